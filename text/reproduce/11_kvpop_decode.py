# %% [markdown]
# # KVpop: decode memory and latency with a bounded cache
#
# > Peak memory and per-token decode latency against context length, dense `DynamicCache` against the bounded KVpop cache with MLP and mLSTM scorers (Fig. 4 analogue, §4 "Inference efficiency").

# %% [markdown]
# KVpop keeps per KV head $B = s + w + k$ entries (Eq. 1), so once the cache is full decoding should
# cost the same memory and time at any context length, while a dense cache grows linearly. We decode
# with SmolLM2-135M (batch 1) and measure, at context lengths $L$:
#
# - **memory**: the cache's bytes (`cache_nbytes`: every tensor storage it holds, exact), and the peak
#   of live tensor memory during one decode step (the cache, freed when a layer is replaced, plus
#   everything the step allocates; counted by a dispatch-mode tracker), with and without the weights;
# - **latency**: per-token decode time, CPU time of the calling thread (wall clock beside it: the
#   machine is shared), `repeats` steps per $L$ with the methods interleaved, ratios dense/KVpop as
#   the median over steps of the ratio within a step.
#
# How each cache reaches context $L$ without decoding $L$ tokens:
#
# - **dense**: a `DynamicCache` filled with $L$ random keys and values per layer. Dense attention and
#   the cache's concatenation do the same work whatever the values; at `check_context` a real prefill
#   of prose followed by decode checks that the timing matches.
# - **KVpop**: a real chunked prefill of $s + 2w + k$ prose tokens fills the cache (long-range slots
#   full, window full, mLSTM state running), then `fast_forward` moves every non-sink entry, the
#   token counter and the mLSTM's unread position by $L - $ seen: the cache then holds exactly the
#   entries a full cache at $L$ holds (sinks, $k$ long-range entries, the window ending at $L - 1$)
#   and the next token decodes at position $L$ (its RoPE too). Within a head all non-sink
#   priorities shift by the same constant, so the ranking is unchanged. Before that, `real_steps`
#   tokens are really decoded past the fill, and their last `repeats` steps are timed against the
#   fast-forwarded cache at the same $L$.
#
# Scorers have random weights (`random_scorers`): the cost of scoring and evicting does not depend
# on what the scorer learned. Budgets, labelled $(s, w, k)$: the paper's training settings $s = 4$,
# $w = 256$, $k = 2016$ (its "$B = 2048$" row; App. Table 3), and $(4, 64, 444)$, $s + w + k = 512$
# (75% compression of $S = 2048$, the CPU profile's scale). A dash in the ratio table: the context
# is shorter than that cache's fill.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
device = "cpu"
dtype = "float32"
contexts = [512, 1024]
budgets = [[4, 16, 44]]  # [s, w, k] per budget; the first one is plotted
repeats = 3
real_steps = 8
check_context = 256
chunk = 128
threads = 1
seed = 0

# %%
import copy
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from sparsekv.data import prose_tokens
from sparsekv.hf import DensePolicy, chunked_prefill, patch
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.kvpop.cache import KVpopCache, KVpopPolicy, cache_nbytes, cache_storages, random_scorers
from sparsekv.kvpop.target import peak_memory
from sparsekv.models import load_model

# %%
use_style()
torch.set_num_threads(threads)  # both sides of every ratio get the same threads
model, tok = load_model(model_name, dtype=dtype, device=device)
cfg = model.config
HKV, LAYERS = cfg.num_key_value_heads, cfg.num_hidden_layers
D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
n_prose = max(check_context, max(s + 2 * w + k for s, w, k in budgets)) + 1
prose = torch.as_tensor(prose_tokens(tok)[0][:n_prose], dtype=torch.long, device=device)[None]
cuda = torch.device(device).type == "cuda"
print(f"{model_name}: {LAYERS} layers, {HKV} KV heads of dim {D}, {dtype}, {torch.get_num_threads()} thread(s), "
      f"device {device}")


# %% [markdown]
# One decode step feeds the previous step's greedy token. The dense model runs unpatched (the
# `transformers` SDPA path, its standard decode); KVpop with MLP scorers decodes under
# `patch(model, DensePolicy())`, with mLSTM scorers under `KVpopPolicy` (it masks the pending token).

# %%
def seconds(fn) -> dict:
    "CPU time of this thread and wall time of fn() (synchronized on CUDA)."
    if cuda: torch.cuda.synchronize(device)
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    if cuda: torch.cuda.synchronize(device)
    return {"seconds": time.thread_time() - c0, "wall_seconds": time.perf_counter() - w0}


class Decoder:
    "A cache, the policy it decodes under (None: unpatched dense model) and the last token."

    def __init__(self, cache, policy, token: int):
        self.cache, self.policy, self.token = cache, policy, torch.tensor([[token]], device=device)

    def step(self):
        with torch.no_grad():
            if self.policy is None: logits = model(self.token, past_key_values=self.cache, use_cache=True).logits
            else:
                with patch(model, self.policy):
                    logits = model(self.token, past_key_values=self.cache, use_cache=True).logits
        self.token = logits[:, -1:].argmax(-1)


def dense_synthetic(L: int, gen: torch.Generator) -> DynamicCache:
    "A dense cache holding L random keys and values in every layer."
    cache = DynamicCache(config=cfg)
    for layer in range(LAYERS):
        kv = [torch.randn(1, HKV, L, D, generator=gen, device=device, dtype=model.dtype) for _ in range(2)]
        cache.update(*kv, layer)
    return cache


def kvpop_filled(kind: str, s: int, w: int, k: int) -> Decoder:
    "A KVpop cache after a real chunked prefill of s + 2w + k prose tokens (full), ready to decode."
    scorers = random_scorers(model, seed=seed, kind=kind, delay=w if kind == "mlstm" else 0)
    policy = DensePolicy() if kind == "mlp" else KVpopPolicy()
    cache = KVpopCache(scorers, s, w, k)
    _, last = chunked_prefill(model, prose[:, :s + 2 * w + k], chunk, policy, cache)
    return Decoder(cache, policy, int(last.argmax(-1)))


def fast_forward(cache: KVpopCache, L: int) -> None:
    """Move every non-sink entry, the token count and the mLSTM's first unread position forward so the next token is at
    position L."""
    for layer in cache.layers:
        d = L - layer.seen
        if d < 0: raise ValueError(f"L={L} is before the cache's next position {layer.seen}")
        layer.positions.add_((layer.positions >= cache.rule.sink) * d)  # in place: the buffers
        layer.seen = L
        if getattr(layer, "kvpop_readout", None) is not None: layer.kvpop_readout.pending_from += d


def step_peak_bytes(dec: Decoder) -> int:
    """Peak bytes of live tensor storage during one decode step: the cache's storages (until freed) plus what the step
    allocates."""
    return peak_memory(dec.step, device=device, held=cache_storages(dec.cache))[1]


# %% [markdown]
# ## Dense: synthetic fill against a real prefill
#
# At `check_context` tokens: a dense cache from a real prefill of prose, and one filled with random
# keys and values, decoded alternately (`repeats` steps each, interleaved).

# %%
gen = torch.Generator(device).manual_seed(seed)
real_dense = Decoder(chunked_prefill(model, prose[:, :check_context], chunk)[0], None, 0)
synth_dense = Decoder(dense_synthetic(check_context, gen), None, 0)
for d in (real_dense, synth_dense): d.step()  # warm-up
check = pd.DataFrame([{"fill": name, "step": j, **seconds(d.step)} for j in range(repeats)
                      for name, d in (("real", real_dense), ("synthetic", synth_dense))[::(-1) ** j]])
check_ratio = check.pivot(index="step", columns="fill", values="seconds").eval("synthetic / real").median()
del real_dense, synth_dense
check.groupby("fill")[["seconds", "wall_seconds"]].median().assign(synthetic_over_real=check_ratio)

# %% [markdown]
# ## KVpop: real decode against the fast-forwarded cache
#
# For each budget and scorer: fill, decode `real_steps` tokens for real and time the last `repeats`
# of them; then a copy of the cache taken right after the fill is fast-forwarded to the same position
# and timed over `repeats` steps.

# %%
kv, steady = {}, []
for s, w, k in budgets:
    for kind in ("mlp", "mlstm"):
        name = f"kvpop-{kind} ({s},{w},{k})"
        dec = kvpop_filled(kind, s, w, k)
        ff = copy.deepcopy(dec)  # the same filled cache, fast-forwarded below
        for j in tqdm(range(real_steps), desc=f"{name} real decode", leave=False):
            t = seconds(dec.step)
            if j >= real_steps - repeats:
                steady.append({"method": name, "how": "real", "L": dec.cache.get_seq_length(), **t})
        fast_forward(ff.cache, dec.cache.get_seq_length() - repeats)
        steady += [{"method": name, "how": "fast-forward", "L": ff.cache.get_seq_length() + 1, **seconds(ff.step)}
                   for _ in range(repeats)]
        kv[name] = dict(dec=ff, fill=s + 2 * w + k, budget=s + w + k)
steady = pd.DataFrame(steady)
steady_ratio = steady.groupby(["method", "how"]).seconds.median().unstack()
steady_ratio["fast_forward_over_real"] = steady_ratio["fast-forward"] / steady_ratio["real"]
steady_ratio

# %% [markdown]
# ## Memory and latency against the context length
#
# At each $L$: a fresh synthetic dense cache, every KVpop cache fast-forwarded to $L$ (where $L$ is
# past its fill); the memory of one step of each (untimed), then `repeats` timed steps with the
# methods interleaved in a rotating order.

# %%
mem, lat = [], []
for L in tqdm(contexts, desc="contexts"):
    decs = {"dense": Decoder(dense_synthetic(L, gen), None, 0)}
    for name, e in kv.items():
        if L >= e["dec"].cache.get_seq_length():
            fast_forward(e["dec"].cache, L)
            decs[name] = e["dec"]
    for name, d in decs.items():
        cache_bytes = cache_nbytes(d.cache)
        mem.append({"L": L, "method": name, "cache_bytes": cache_bytes, "step_peak_bytes": step_peak_bytes(d),
                    "weights_bytes": weights_bytes})
    names = list(decs)
    for j in range(repeats):
        for name in names[j % len(names):] + names[:j % len(names)]:
            lat.append({"L": L, "method": name, "step": j, **seconds(decs[name].step)})
    del decs
mem, lat = pd.DataFrame(mem), pd.DataFrame(lat)
mem["peak_with_weights_bytes"] = mem.step_peak_bytes + mem.weights_bytes
mem

# %%
per = lat.groupby(["L", "method"], sort=False)[["seconds", "wall_seconds"]].median().reset_index()
wide = lat.pivot_table(index=["L", "step"], columns="method", values="seconds")
wide_wall = lat.pivot_table(index=["L", "step"], columns="method", values="wall_seconds")
kv_names = [m for m in kv if m in wide.columns]  # in budget order
ratios = pd.DataFrame({f"dense_over_{m}": (wide["dense"] / wide[m]).groupby("L").median() for m in kv_names})
ratios_wall = pd.DataFrame({f"wall_dense_over_{m}": (wide_wall["dense"] / wide_wall[m]).groupby("L").median()
                            for m in kv_names})
ratios = ratios.join(ratios_wall).reset_index()
ratios["L"] = ratios["L"].astype(int)
table = per.merge(mem, on=["L", "method"])
table["threads"] = torch.get_num_threads()
ratios

# %%
write_csv(Path(fig_dir)/"kvpop_decode.csv", table)
write_csv(Path(fig_dir)/"kvpop_decode_ratios.csv", ratios)
write_csv(Path(fig_dir)/"kvpop_decode_steady.csv", steady_ratio.reset_index())
mib = 2**20
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
for m, g in table.groupby("method", sort=False):
    a1.plot(g.L, g.peak_with_weights_bytes / mib, marker="o", label=m)
    a1.plot(g.L, g.cache_bytes / mib, marker=".", ls=":", color=a1.lines[-1].get_color())
    a2.plot(g.L, 1e3 * g.seconds, marker="o", label=m)
a1.set(xscale="log", yscale="log", xlabel="context $L$ (tokens)", ylabel="MiB",
       title="peak during a decode step (solid, weights included)\nand the cache alone (dotted)")
a2.set(xscale="log", yscale="log", xlabel="context $L$ (tokens)",
       ylabel="ms per token (CPU time)" if not cuda else "ms per token", title="decode latency per token")
fig.legend(*a2.get_legend_handles_labels(), loc="outside right", title="method $(s, w, k)$", fontsize=9)
fig.suptitle(f"KVpop Fig. 4 analogue: decode memory and latency vs context, {model_name}, batch 1, "
             f"{torch.get_num_threads()} thread(s)")
save_figure(fig, Path(fig_dir)/"kvpop_decode.png", data=table)

# %%
Lmax = max(contexts)
L4 = min([L for L in contexts if L >= 4096] or [min(contexts)])
big = ratios.set_index("L").loc[Lmax]
lines = [f"{model_name} ({LAYERS} layers, {HKV} KV heads, d = {D}, {dtype}), batch 1, {torch.get_num_threads()} "
         f"thread(s) on {device}. Dense: `DynamicCache` filled with random keys/values (timing against a real prefill "
         f"at L = {check_context}: synthetic/real {check_ratio:.2f}x). KVpop: random scorers, real prefill of "
         "s + 2w + k tokens, then fast-forwarded (timing against real decode at the same position: "
         + ", ".join(f"{m} {r:.2f}x" for m, r in steady_ratio.fast_forward_over_real.items())
         + f"). Times: median over {repeats} interleaved steps, CPU time of the thread (wall clock in brackets).", "",
         "| L | method | ms per token | cache (MiB) | peak during a step, weights excluded / included (MiB) |",
         "|---|---|---|---|---|"]
lines += [f"| {r.L} | {r.method} | {1e3 * r.seconds:.1f} ({1e3 * r.wall_seconds:.1f}) | {r.cache_bytes / mib:.2f} | "
          f"{r.step_peak_bytes / mib:.1f} / {r.peak_with_weights_bytes / mib:.1f} |" for r in table.itertuples()]
lines += ["", "| L | " + " | ".join(f"dense / {m}" for m in kv_names) + " |", "|---|" + "---|" * len(kv_names)]
lines += [f"| {r['L']} | " + " | ".join("-" if pd.isna(r[f"dense_over_{m}"]) else
                                          f"{r[f'dense_over_{m}']:.2f}x ({r[f'wall_dense_over_{m}']:.2f}x)"
                                          for m in kv_names) + " |" for r in ratios.to_dict("records")]
growth = []
for m, g in table.groupby("method", sort=False):
    g = g.set_index("L")
    if L4 in g.index and Lmax in g.index and L4 < Lmax:
        growth.append((m, *(g.loc[Lmax, c] / g.loc[L4, c] - 1
                            for c in ("cache_bytes", "step_peak_bytes", "peak_with_weights_bytes"))))
lines += ["", f"Memory growth from L = {L4} to L = {Lmax} (cache / peak without weights / peak with weights): " +
          "; ".join(f"{m} {a:+.1%} / {b:+.1%} / {c:+.1%}" for m, a, b, c in growth) + "."]
kv_growth = [b for m, a, b, c in growth if m != "dense"]
lines += ["", f"Goals at L = {Lmax}: KVpop peak memory (weights excluded) grows at most "
          f"{max(kv_growth, default=float('nan')):.1%} from L = {L4} (goal <= 5%: "
          f"{'met' if kv_growth and max(kv_growth) <= 0.05 else 'missed'}); per-token decode "
          + ", ".join(f"{m} {big[f'dense_over_{m}']:.2f}x" for m in kv_names) + " faster than dense (goal >= 3x: "
          + ("met" if all(big[f"dense_over_{m}"] >= 3 for m in kv_names) else "missed for "
             + ", ".join(m for m in kv_names if big[f"dense_over_{m}"] < 3)) + ")."]
with_w = {m: c for m, a, b, c in growth}  # growth of the peak with weights (what the paper's peak VRAM counts)
kv_with = max((c for m, c in with_w.items() if m != "dense"), default=float("nan"))
lines += ["", "Paper vs ours (the paper: a GPU, batch 1, contexts up to 131k; §4.1 \"Inference efficiency\", Fig. 4):",
          "",
          "| claim | paper | ours | why they differ |", "|---|---|---|---|",
          "| dense peak memory grows with the context | +100%: \"from 18GB at 16k tokens to 36GB at 131k\" (8x "
          f"context) | {with_w.get('dense', float('nan')):+.1%} from L = {L4} to {Lmax} ({Lmax / L4:.0f}x context), "
          f"weights included | the weights ({weights_bytes / 2**30:.2f} GiB here) dominate the peak until the dense "
          "cache outgrows them |",
          f"| KVpop peak memory stays nearly flat | \"both DMS and KVpop only grow by 19% to 19GB\" | {kv_with:+.1%} "
          "(largest over the KVpop caches) | ours counts live tensor storage exactly (no allocator, nothing else on "
          "the device) |",
          "| per-token decode faster than dense at long context | no number in the text (Fig. 4 plots it; §1: "
          "\"faster long-generation decoding\") | " + ", ".join(f"{m} {big[f'dense_over_{m}']:.2f}x" for m in kv_names)
          + f" at L = {Lmax} | CPU and a 135M model: the scorer's fixed cost per step outweighs the attention saved "
          "until the dense cache is long |"]
write_text(Path(out_dir)/"kvpop_decode.md", "\n".join(lines) + "\n")
print("\n".join(lines))
