# %% [markdown]
# # End-to-end speed: decode tokens per second and time to first token, every method on SmolLM2
#
# > What a user of `sparsekv.methods` measures: whole-model decode steps and prefills, dense against every method, side by side on this CPU, with the attention module's share of each step.

# %% [markdown]
# Whole-model decode steps and prefills, every method against transformers' default on this CPU
# (`sparsekv.protocol.SpeedBench`); how the caches are filled and the steps timed is told at the end of the page.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
dtype = "float32"
device = "cpu"
contexts = [512, 1024]
budget_fraction = 0.125  # B = budget_fraction * L entries per KV head
method_names = ["dense", "streaming_llm", "tova", "kvpop_mlp", "quoka", "sparq", "quest", "key_pca", "oval"]
long_contexts = []             # contexts timed for long_context_methods only (instead of method_names)
long_context_methods = ["dense", "quest", "oval"]
threads = [1]
repeats = 3
ttft_contexts = [256]
ttft_methods = ["dense", "quoka", "tova"]
ttft_repeats = 1
seed = 0

# %%
import gc
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
from tqdm.auto import tqdm
from IPython.display import Markdown, display
from transformers import DynamicCache
from sparsekv.data import token_stream
from sparsekv.hf import chunked_prefill
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.models import load_model, model_info
from sparsekv.protocol import Decoder, SpeedBench, goal_line, step_ratios

use_style()
model, tok = load_model(model_name, dtype=dtype, device=device)
info = model_info(model)
prose = token_stream(tok)[None].to(device)
cuda = torch.device(device).type == "cuda"
print(info, f"{torch.get_num_threads()} threads by default")
bench = SpeedBench(model, prose, budget_fraction, threads, repeats, seed, device)

# %% [markdown]
# ## Decode

# %%
decode = []
for L in tqdm([*contexts, *long_contexts], desc="contexts"):
    kv = bench.synthetic_kv(L)
    names = long_context_methods if L in long_contexts else method_names
    for name in tqdm(names, desc=f"L={L}", leave=False):
        decode += bench.decode_rows(name, L, kv)
        gc.collect()  # a Decoder and its cache reference each other (the timed update): free them before the next
    del kv
decode = pd.DataFrame(decode)
keys = ["L", "threads", "method"]
own = decode[decode.who != "default"].groupby(keys, sort=False)
default = decode[decode.who == "default"].groupby(keys, sort=False)
summary = pd.DataFrame({
    "position": own.position.first(),
    "ms_per_token": 1e3 * own.wall_seconds.median(),
    **{f"speedup_{how}_{clock}": step_ratios(decode, keys, col, how)
       for how in ("median", "min", "max") for clock, col in (("cpu", "seconds"), ("wall", "wall_seconds"))},
    "attention_share": own.attention_seconds.median() / own.seconds.median(),
    "cache_share": own.cache_seconds.median() / own.seconds.median(),
    "default_cache_share": default.cache_seconds.median() / default.seconds.median(),
    "first_step_s": own.first_step_seconds.first(),
}).reset_index()
on_cpu_clock = (summary.threads == 1) & (not cuda)
for how, name in (("median", "speedup"), ("min", "slowest_step"), ("max", "fastest_step")):
    summary[name] = summary[f"speedup_{how}_cpu"].where(on_cpu_clock, summary[f"speedup_{how}_wall"])
summary["tokens_per_s"] = 1e3 / summary.ms_per_token
write_csv(Path(fig_dir)/"speed_decode.csv", summary)
summary

# %% [markdown]
# A check of the synthetic fill the table rests on: at the smallest context, the default decoding from a real prefill of prose and from
# random keys and values take the same time per step (their ratio is printed, not asserted: the machine is shared),
# and each method's step runs with its policy called once per layer.

# %%
L0 = min(contexts)
real = Decoder(model, chunked_prefill(model, prose[:, :L0], 128)[0], device=device)
synth = Decoder(model, bench.fill(DynamicCache(config=model.config), bench.synthetic_kv(L0)), device=device)
for d in (real, synth): d.step()
steps = [{"fill": name, **d.step()} for _ in range(repeats) for name, d in (("real", real), ("synthetic", synth))]
medians = pd.DataFrame(steps).groupby("fill").seconds.median()
synthetic_over_real = medians["synthetic"] / medians["real"]
print(f"synthetic / real fill, time per step: {synthetic_over_real:.2f}")
del real, synth
_dec, _ = bench.decoder("quoka", L0, bench.synthetic_kv(L0))
_dec.step()
assert _dec.policy.calls == info.num_layers and _dec.policy.attention_seconds > 0 and _dec.cache_seconds > 0
del _dec

# %% [markdown]
# ## Time to first token

# %%
ttft = []
torch.set_num_threads(max(threads))
for L in ttft_contexts:
    for name in ttft_methods:
        for j in range(ttft_repeats):
            ttft += [{"L": L, "method": name, "who": "default", "step": j, **bench.default_ttft(L)},
                     {"L": L, "method": name, "who": name, "step": j, **bench.ttft(name, L)}]
ttft = pd.DataFrame(ttft)
ttft_summary = pd.DataFrame({
    "seconds": ttft[ttft.who != "default"].groupby(["L", "method"], sort=False).wall_seconds.median(),
    "speedup": step_ratios(ttft, ["L", "method"], "wall_seconds")}).reset_index()
write_csv(Path(fig_dir)/"speed_ttft.csv", ttft_summary)
ttft_summary


# %% [markdown]
# ## The goals (no paper figure)
#
# The papers time one layer's attention; the end-to-end speed issue set these targets for the whole model.

# %%
def at(df: pd.DataFrame, **where) -> pd.Series:
    "The one row of df matching `where` (None if absent)."
    rows = df.loc[(df[list(where)] == pd.Series(where)).all(axis=1)]
    return rows.iloc[0] if len(rows) else None


n1 = min(threads)
goals = ["| goal | target | measured (1 thread) |", "|---|---|---|",
         goal_line("OVAL decode at 8k", at(summary, L=8192, threads=n1, method="oval"), 1.5),
         goal_line("OVAL decode at 32k", at(summary, L=32768, threads=n1, method="oval"), 2.5),
         goal_line("KVpop (MLP) decode at 2k", at(summary, L=2048, threads=n1, method="kvpop_mlp"), 1.0),
         goal_line("dense (GrowingCache) at 1k: no slower", at(summary, L=1024, threads=n1, method="dense"), 1.0),
         goal_line("dense (GrowingCache) at 8k: faster", at(summary, L=8192, threads=n1, method="dense"), 1.0)]
display(Markdown("\n".join(goals)))

# %%
fig, axes = plt.subplots(1, len(threads), figsize=(5.2 * len(threads) + 1.5, 3.8), squeeze=False, sharey=True,
                         layout="constrained")
for ax, n in zip(axes[0], threads):
    for m, g in summary[summary.threads == n].groupby("method", sort=False):
        ax.plot(g.L, g.speedup, marker="o", label=m)
    ax.axhline(1, color="k", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="context $L$ (tokens)", title=f"{n} thread(s)")
axes[0][0].set_ylabel("decode speed-up over transformers' default")
fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside right", fontsize=9)
fig.suptitle(f"End-to-end decode, {model_name}, batch 1, budget {budget_fraction:g} of the context per KV head")
save_figure(fig, Path(fig_dir)/"speed_decode.png", data=summary)
plt.show()

# %%
lines = [f"{model_name} ({info.num_layers} layers, {info.num_kv_heads} KV heads, d = {info.head_dim}, {dtype}), "
         "batch 1, "
         f"on this CPU. Budget B = {budget_fraction:g} L per KV head. Speed-up: transformers' default "
         "(DynamicCache, unpatched) over the method, the median over "
         f"{repeats} alternating steps of the ratio within a step (CPU time of the thread at 1 thread, wall time at "
         f"more; slowest_step and fastest_step: the smallest and largest of those ratios). Synthetic against real "
         f"fill at L = {L0}: {synthetic_over_real:.2f}x per step. Eviction methods run "
         "at position min(L, 2B) (their cache holds B entries at any later position). Attention share: time inside "
         "the method's attention policy (scoring, selection, attention) over the step; cache share: time inside the "
         "cache's update (writes; an evicting cache's scoring and eviction), the method's and the default's.", "",
         summary.drop(columns=summary.filter(like="speedup_").columns).to_markdown(index=False, floatfmt=".3g"), "",
         f"Time to first token ({max(threads)} thread(s), wall): prefill of L prose tokens as `Method.generate` runs "
         "it, then one decode step; speed-up over the default's one-call prefill.", "",
         ttft_summary.to_markdown(index=False, floatfmt=".3g"), "", "**Goals of the end-to-end speed issue**", "",
         *goals, ""]
write_text(Path(out_dir)/"speed.md", "\n".join(lines))
print("\n".join(lines))

# %% [markdown]
# ## How the stage measures
#
# The attention-module benchmarks (`kvpop_decode`, `quoka_latency`, `oval_latency`) time one
# layer's attention. A user runs the whole model: the weights, the cache and every layer. This
# stage times what `methods.make(name, budget)` gives a user, on SmolLM2-135M, batch 1:
#
# - **decode**: one greedy step at context $L$ under the method's own cache and policy
#   (`Method.cache`, `Method.policy`), against transformers' default (`DynamicCache`, the
#   unpatched model) in the same loop; the budget is `budget_fraction` of $L$ KV entries per KV
#   head. The attention share is the time inside the method's attention policy (scoring,
#   selection, gathering and attention of every layer) over the step's time; the cache share
#   the time inside the cache's `update` (the writes, and an evicting cache's scoring and
#   eviction), for the method and for the default.
# - **time to first token**: the prefill of $L$ prose tokens as `Method.generate` runs it
#   (chunked in `chunk_size` for selection methods, the whole prompt for dense), against the same
#   default, then one decode step.
#
# The contexts in `long_contexts` (32k in the cpu profile) are timed for `long_context_methods`
# only (dense and page retrieval, the methods the 32k goal is about), to keep the stage short.
#
# How each cache reaches context $L$ without a long prefill per method (timing depends on the
# shapes, not the values):
#
# - **dense, selection and retrieval methods** keep every token: their cache is filled with the
#   same $L$ random keys and values per layer (`fill`). A retrieval method builds the summaries of
#   all pages at its first decode step, and a selection method normalizes all keys once; that
#   first step is timed apart (`first_step_seconds`) and excluded from the steady-state steps.
# - **eviction methods** keep at most their budget: their cache is filled by a real chunked
#   prefill of $\min(L, 2B)$ prose tokens under their policy, after which a decode step does the
#   same work at any later position (the cache holds $B$ entries either way). Its row at $L$
#   therefore times the step at position $\min(L, 2B)$; the table says so.
#
# **Clock and ratios.** Each step is timed by the CPU time of the calling thread
# (`time.thread_time`, blind to waits on a shared machine) with wall time beside it; the
# default and the method alternate step by step, and every ratio is the median over steps of
# the ratio within a step. A step times the model's forward alone: `Method.generate` patches the
# model once for all its steps, so entering and leaving the patch (a walk over every module)
# is no part of a step. Thread counts are set with
# `torch.set_num_threads`; with 2 threads the CPU time counts only the calling thread's share of
# the work, so at 2 threads the wall clock is the one reported.
