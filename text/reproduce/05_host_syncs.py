# %% [markdown]
# # Host work per step, every method: synchronizations, operators and the time of a step
#
# > How many times each method's decode step and prefill chunk make the host wait for the device, at which lines, how many operators a decode step dispatches, and what a decode step costs against transformers' own on a model whose step is mostly host work: what keeps a step from running at the speed of memory on an accelerator.

# %% [markdown]
# No paper figure. Each registered method runs on `model_name` (random weights suffice: the count
# depends on the code path, not on the values) with its default parameters at `budget`, and
# `sparsekv.syncs.step_syncs` counts the operators that read a device value on the host
# (`sparsekv.syncs.SYNC_OPS`, boolean-mask indexing) in the prefill of a `prompt_len`-token prompt
# and in the decode step after it, with the line of the library (or of transformers) that issued each.
# Counted on the CPU, these are exactly the points where a GPU stream would stall; dense attention
# through transformers reads none. `graph_breaks`: where TorchDynamo would split the steady decode step
# (the third after the prefill) for `torch.compile` (`sparsekv.syncs.step_graph_breaks`; 0: one graph,
# `fullgraph=True` compiles it).

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "tiny-llama"
device = "cpu"
prompt_len = 300
budget = 64
method_params = {"lessismore": {"selection_layers": [0]}}  # the tiny models have two layers
# the host-work model: tiny-llama with these config overrides (SmolLM2's attention, a narrow residual stream)
narrow = {"num_layers": 4, "hidden_size": 72, "intermediate_size": 144, "num_heads": 9, "num_kv_heads": 3,
          "head_dim": 64, "vocab_size": 1024}
narrow_len = 256         # prompt tokens before the timed decode steps
narrow_budget = 0.125    # budget per KV head, a fraction of narrow_len
repeats = 3              # timed decode steps per method, alternating with transformers' own
untimed = ["dms"]         # attends through its trained student (a model of its own): operators counted, not timed
compile_methods = ["dense", "tova", "quoka", "oval"]  # timed compiled too (None: transformers' own step)
compile_backend = "eager"  # torch.compile's backend: "inductor" generates code; "eager" only traces (a smoke test)
compile_steps = 5        # compiled decode steps timed per method, after the one that compiles
seed = 0

# %%
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from sparsekv import methods
from sparsekv.io import write_csv, write_text
from sparsekv.models import load_model, model_info
from sparsekv.protocol import SpeedBench
from sparsekv.stats import paired_ci
from sparsekv.syncs import decode_seconds, step_graph_breaks, step_syncs

model, tok = load_model(model_name, device=device)
n_layers = model.config.num_hidden_layers
ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)

# %%
rows, sites = [], []
for name in methods.names():
    m = methods.make(name) if name == "dense" else methods.make(name, budget, **method_params.get(name, {}))
    chunk = getattr(m, "chunk_size", None)
    for phase in ("prefill", "decode"):
        rec = step_syncs(m, model, ids, phase)
        calls = -(-(prompt_len - 1) // chunk) if phase == "prefill" and chunk else 1
        breaks = len(step_graph_breaks(m, model, ids)) if phase == "decode" else None
        rows.append(dict(method=name, family=m.family, phase=phase, calls=calls, syncs=rec.total,
                         per_call_per_layer=rec.total / calls / n_layers, graph_breaks=breaks))
        sites += [dict(method=name, phase=phase, line=where, op=op, n=n) for (op, where), n in rec.counts.items()]
syncs, sites = pd.DataFrame(rows), pd.DataFrame(sites, columns=["method", "phase", "line", "op", "n"])
syncs

# %%
# Dense attention is the control: transformers' own step reads nothing back.
assert syncs[syncs.method == "dense"].syncs.eq(0).all()
assert set(syncs.method) == set(methods.names())

# %%
decode = syncs[syncs.phase == "decode"]
free = sorted(decode[decode.syncs == 0].method)
top = (sites.groupby(["line", "op"]).agg(methods=("method", "nunique"), reads=("n", "sum"))
       .sort_values(["methods", "reads"], ascending=False).reset_index())
reading = decode[decode.syncs > 0]
lo, hi = reading.syncs.min(), reading.syncs.max()
rest = (f"; {', '.join(sorted(reading.method))} read{'s' if len(reading) == 1 else ''} "
        f"{lo if lo == hi else f'{lo} to {hi}'} value(s) per decode step ({reading.per_call_per_layer.max():.1f} "
        f"per layer at most)" if len(reading) else "")
one_graph = sorted(decode[decode.graph_breaks == 0].method)
summary = (f"{model_name}, {n_layers} layers, prompt {prompt_len} tokens, budget {budget}: {len(free)} of "
           f"{len(decode)} methods decode without reading a device value on the host ({', '.join(free)}){rest}. "
           f"The steady decode step (the third) of {len(one_graph)} of {len(decode)} methods traces as one graph for "
           f"torch.compile (fullgraph); split: "
           + (", ".join(f"{r.method} ({r.graph_breaks:.0f} breaks)" for r in decode[decode.graph_breaks > 0]
                        .itertuples()) or "none") + ".")
write_csv(Path(fig_dir)/"host_syncs.csv", syncs)
write_csv(Path(fig_dir)/"host_syncs_lines.csv", sites)
print(summary)
top

# %% [markdown]
# ## Host work of a decode step
#
# A model whose step is mostly per-layer host work, as a small model's is on an accelerator:
# SmolLM2's attention (9 query and 3 KV heads of dimension 64) on a residual stream of width 72 with
# random weights, so the weights' arithmetic is small beside the operators each layer dispatches. Per
# method at a budget of `narrow_budget` of a `narrow_len`-token context, one thread: the operators a
# steady decode step dispatches per layer (`step_syncs(...).ops`, the fourth step after the prefill: the
# first ones may grow a buffer sized to the prompt, which happens once per doubling) against transformers'
# own unpatched step, and the wall time of a decode step (`SpeedBench.decode_rows`: a cache filled as a
# prefill fills it, steps alternating with transformers' default on the same context). `step_vs_default`
# is the geometric mean over the `repeats` pairs of the method's step time over the default's, with its
# paired 95% bootstrap interval (`step_lo`, `step_hi`: `sparsekv.stats.paired_ci` of the log times);
# a goal is met where the interval lies below it, missed where it lies above, open where it holds it.
# The interval covers the steps of this run; the same table run again on this machine has moved a
# method's ratio by up to 15%, more than the interval's width.

# %%
torch.set_num_threads(1)
hw_model, _ = load_model("tiny-llama", device=device, **narrow)
hw_layers = hw_model.config.num_hidden_layers
hw_ids = torch.randint(3, hw_model.config.vocab_size, (1, narrow_len + 4),
                       generator=torch.Generator().manual_seed(seed)).to(device)
bench = SpeedBench(hw_model, hw_ids, narrow_budget, [1], repeats, seed, device)
kv = bench.synthetic_kv(narrow_len)
default_ops = step_syncs(None, hw_model, hw_ids, steps=4).ops / hw_layers
work = []
timed_names = [n for n in methods.names() if n not in untimed]
for name in methods.names():
    m = bench.make(name, narrow_len)
    ops = step_syncs(m, hw_model, hw_ids, steps=4).ops / hw_layers
    row = dict(method=name, family=m.family, ops_per_layer=ops, ops_vs_default=ops / default_ops)
    if name in timed_names:
        steps = pd.DataFrame(bench.decode_rows(name, narrow_len, kv)).pivot_table(index="step", columns="who",
                                                                                  values="wall_seconds")
        mean, lo, hi = paired_ci(np.log(steps[name]), np.log(steps["default"]), seed=seed)
        row |= dict(step_ms=1e3 * steps[name].median(), default_ms=1e3 * steps["default"].median(),
                    step_vs_default=math.exp(mean), step_lo=math.exp(lo), step_hi=math.exp(hi))
    work.append(row)
work = pd.DataFrame(work)
print(model_info(hw_model), f"; transformers' own step: {default_ops:.0f} operators per layer")
work

# %%
# the control: sparsekv's dense path dispatches about what transformers' own does
assert work.set_index("method").ops_vs_default["dense"] < 1.5
assert len(work) == len(methods.names()) and (work.set_index("method").step_ms[timed_names] > 0).all()
timed_work = work.set_index("method").loc[timed_names]
assert ((timed_work.step_lo <= timed_work.step_vs_default) & (timed_work.step_vs_default <= timed_work.step_hi)).all()

# %% [markdown]
# ### Compiled
#
# The steps of transformers' own decode and of `compile_methods`, eager and compiled
# (`sparsekv.syncs.decode_seconds`: `torch.compile` of the whole step with `fullgraph=True` and dynamic
# shapes, by `compile_backend`, after two eager steps), one run after the other on the same context of
# `narrow_len` + 1 tokens (past the doubling of buffers sized to `narrow_len`, so the timed steps stay
# within one capacity): the median step, the compilation time, and the largest difference of the logits from eager. Steps
# that compiled again (`recompiled`, their positions: where a buffer doubled or a page completed, rare
# by design) are left out of the median; a step not compilable as one graph (`error`) would end its
# run early and show here. Every method but DMS compiles once for lengths between two growths
# (`tests/test_host_syncs.py`).

# %%
compiled = []
c_ids = torch.randint(3, hw_model.config.vocab_size, (1, narrow_len + 4 + compile_steps),
                      generator=torch.Generator().manual_seed(seed)).to(device)  # prefill: narrow_len + 1 tokens
for name in [None, *compile_methods]:
    m = None if name is None else bench.make(name, narrow_len)
    eager = decode_seconds(m, hw_model, c_ids, compile_steps + 1)
    comp = decode_seconds(m, hw_model, c_ids, compile_steps + 1,
                          backend=compile_backend)
    compiled.append(dict(method=name or "transformers", backend=compile_backend,
                         eager_ms=1e3 * pd.Series(eager["step_seconds"]).median(),
                         compiled_ms=1e3 * pd.Series(comp["step_seconds"]).median(),
                         compile_s=comp["compile_seconds"], compiled_steps=len(comp["step_seconds"]),
                         recompiled=" ".join(map(str, comp["recompiled"])), error=comp["error"],
                         max_logit_diff=(comp["logits"] - eager["logits"][:len(comp["logits"])]).abs().max().item()
                         ))
compiled = pd.DataFrame(compiled)
compiled["speedup"] = compiled.eager_ms / compiled.compiled_ms
compiled["vs_transformers_eager"] = compiled.compiled_ms / compiled.eager_ms[0]
compiled

# %%
assert (compiled.max_logit_diff < 1e-3).all(), compiled   # the compiled steps compute what the eager ones do

# %%
family = work.groupby("family")[["ops_vs_default", "step_lo", "step_hi"]].max()
slowest = work.dropna(subset=["step_vs_default"]).sort_values("step_vs_default").groupby("family").last()


def verdict(lo: float, hi: float, target: float) -> str:
    "A goal of at most `target` for ratios whose intervals' largest ends are lo and hi."
    return "met" if hi <= target else "not met" if lo > target else "open: an interval holds it"


goal = (f"Host work on {model_info(hw_model)}, context {narrow_len}, budget {narrow_budget:g} of it, 1 thread, "
        f"{repeats} alternating pairs of steps: transformers' own decode step dispatches {default_ops:.0f} operators "
        f"per layer and takes {work.default_ms.median():.1f} ms. The most per family, operators; time against it "
        "(the slowest method, its geometric mean and 95% interval): "
        + "; ".join(f"{f} {r.ops_vs_default:.2f}x; {slowest.method[f]} {slowest.step_vs_default[f]:.2f}x "
                    f"[{slowest.step_lo[f]:.2f}, {slowest.step_hi[f]:.2f}]" for f, r in family.iterrows())
        + f" (not timed: {', '.join(untimed) or 'none'}). Goals (accelerator speed): every family's step <= 1.25x "
        f"({verdict(family.step_lo.max(), family.step_hi.max(), 1.25)}; "
        + ", ".join(f"{f} {verdict(r.step_lo, r.step_hi, 1.25)}" for f, r in family.iterrows())
        + "), operators <= 1.5x "
        f"({'met' if (family.ops_vs_default <= 1.5).all() else 'not met'}).")
write_csv(Path(fig_dir)/"host_work.csv", work)
write_csv(Path(fig_dir)/"host_work_compiled.csv", compiled)
best = compiled.set_index("method")
goal += (f" Compiled ({compile_backend}, fullgraph, {compile_steps} steps after the compiling one): "
         + "; ".join(f"{n} {r.eager_ms:.1f} -> {r.compiled_ms:.1f} ms ({r.speedup:.2f}x, compiled in "
                     f"{r.compile_s:.0f} s)" for n, r in best.iterrows()) + ".")
write_text(Path(out_dir)/"host_syncs.md", "\n\n".join([
    summary, syncs.to_markdown(index=False, floatfmt=".2f"),
    "The lines that read back, with how many methods pass through each and the reads over all of them:",
    top.to_markdown(index=False), "## Host work of a decode step", goal,
    work.to_markdown(index=False, floatfmt=".2f"), "Compiled and eager decode steps:",
    compiled.to_markdown(index=False, floatfmt=".3g")]) + "\n")
print(goal)
