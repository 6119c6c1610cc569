# %% [markdown]
# # KVpop: decode memory and latency with a bounded cache
#
# > Peak memory and per-token decode latency against context length, dense `DynamicCache` against the bounded KVpop cache with MLP and mLSTM scorers (Fig. 4 analogue, §4 "Inference efficiency").

# %% [markdown]
# How each measurement is made is told at the end of the page; the machinery is `DecodeBench`, in
# [the KVpop experiments](../nbs/19b_kvpop_experiments.ipynb).

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
from pathlib import Path

import pandas as pd
import torch
from IPython.display import Markdown

from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.kvpop import experiments as kx
from sparsekv.models import load_model

use_style()
torch.set_num_threads(threads)  # both sides of every ratio get the same threads
model, tok = load_model(model_name, dtype=dtype, device=device)
bench = kx.DecodeBench(model, tok, budgets, chunk, check_context, seed, device)
LAYERS, HKV, D, cuda = bench.n_layers, bench.n_kv_heads, bench.head_dim, torch.device(device).type == "cuda"
print(f"{model_name}: {LAYERS} layers, {HKV} KV heads of dim {D}, {dtype}, {torch.get_num_threads()} thread(s), "
      f"device {device}")

# %% [markdown]
# ## Paper vs ours
#
# The fills checked first (shown further down), then at each context $L$ one decode step of every cache for its
# memory and `repeats` timed steps, the methods interleaved; beside the paper's claims (a GPU, batch 1, contexts up
# to 131k; §4.1 "Inference efficiency", Fig. 4), the growth from $L$ = 4,096 (or the shortest context) to the longest.

# %%
check, check_ratio = bench.fill_check(repeats)       # dense: synthetic fill against a real prefill
steady, steady_ratio = bench.steady(real_steps, repeats)   # KVpop: fast-forwarded against real decode
mem, lat = bench.context_sweep(contexts, repeats)
table, ratios, kv_names = kx.decode_tables(mem, lat, list(bench.kv))
Lmax, L4 = max(contexts), min([L for L in contexts if L >= 4096] or [min(contexts)])
growth = kx.memory_growth(table, L4, Lmax)
paper = kx.decode_claims(growth, ratios, kv_names, L4, Lmax, bench.weights_bytes)
Markdown("\n".join(paper))

# %% [markdown]
# ## Memory and latency against the context length
#
# The speed-up of KVpop over dense per token, each the median over steps of the ratio within a step (CPU time;
# `wall_`: wall clock); a missing ratio: the context is shorter than that cache's fill.

# %%
ratios

# %% [markdown]
# Memory per context and method: the cache's bytes (`cache_nbytes`: every tensor storage it holds, exact) and the
# peak of live tensor memory during one decode step, without and with the weights.

# %%
mem

# %%
write_csv(Path(fig_dir)/"kvpop_decode.csv", table)
write_csv(Path(fig_dir)/"kvpop_decode_ratios.csv", ratios)
write_csv(Path(fig_dir)/"kvpop_decode_steady.csv", steady_ratio.reset_index())
fig = kx.decode_figure(table, cpu_time=not cuda)
fig.suptitle(f"KVpop Fig. 4 analogue: decode memory and latency vs context, {model_name}, batch 1, "
             f"{torch.get_num_threads()} thread(s)")
save_figure(fig, Path(fig_dir)/"kvpop_decode.png", data=table)

# %% [markdown]
# ## The fills, checked
#
# **Dense: synthetic fill against a real prefill.** At `check_context` tokens: a dense cache from a real prefill of
# prose, and one filled with random keys and values, decoded alternately (`repeats` steps each, interleaved).

# %%
check.groupby("fill")[["seconds", "wall_seconds"]].median().assign(synthetic_over_real=check_ratio)

# %% [markdown]
# **KVpop: real decode against the fast-forwarded cache.** For each budget and scorer: fill, decode `real_steps`
# tokens for real and time the last `repeats` of them; then a copy of the cache taken right after the fill is
# fast-forwarded to the same position and timed over `repeats` steps.

# %%
steady_ratio

# %% [markdown]
# ## How it works
#
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
# One decode step feeds the previous step's greedy token. The dense model runs unpatched (the
# `transformers` SDPA path, its standard decode); KVpop with MLP scorers decodes under
# `patch(model, DensePolicy())`, with mLSTM scorers under `KVpopPolicy` (it masks the pending token).
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
# At each $L$: a fresh synthetic dense cache, every KVpop cache fast-forwarded to $L$ (where $L$ is past its fill);
# the memory of one step of each (untimed), then `repeats` timed steps with the methods interleaved in a rotating
# order. Scorers have random weights (`random_scorers`): the cost of scoring and evicting does not depend
# on what the scorer learned. Budgets, labelled $(s, w, k)$: the paper's training settings $s = 4$,
# $w = 256$, $k = 2016$ (its "$B = 2048$" row; App. Table 3), and $(4, 64, 444)$, $s + w + k = 512$
# (75% compression of $S = 2048$, the CPU profile's scale). A dash in the ratio table: the context
# is shorter than that cache's fill.

# %%
mib, big = 2**20, ratios.set_index("L").loc[Lmax]
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
lines += ["", f"Memory growth from L = {L4} to L = {Lmax} (cache / peak without weights / peak with weights): " +
          "; ".join(f"{m} {a:+.1%} / {b:+.1%} / {c:+.1%}" for m, a, b, c in growth) + "."]
kv_growth = [b for m, a, b, c in growth if m != "dense"]
lines += ["", f"Goals at L = {Lmax}: KVpop peak memory (weights excluded) grows at most "
          f"{max(kv_growth, default=float('nan')):.1%} from L = {L4} (goal <= 5%: "
          f"{'met' if kv_growth and max(kv_growth) <= 0.05 else 'missed'}); per-token decode "
          + ", ".join(f"{m} {big[f'dense_over_{m}']:.2f}x" for m in kv_names) + " faster than dense (goal >= 3x: "
          + ("met" if all(big[f"dense_over_{m}"] >= 3 for m in kv_names) else "missed for "
             + ", ".join(m for m in kv_names if big[f"dense_over_{m}"] < 3)) + ")."]
lines += ["", "Paper vs ours (the paper: a GPU, batch 1, contexts up to 131k; §4.1 \"Inference efficiency\", Fig. 4):",
          "", *paper]
write_text(Path(out_dir)/"kvpop_decode.md", "\n".join(lines) + "\n")
print("\n".join(lines))
