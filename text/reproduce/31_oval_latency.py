# %% [markdown]
# # OVAL: decode attention latency and summary construction cost
#
# > Per-token decode attention at long context: full attention against page retrieval scored with Quest, key-PCA and OVAL summaries, and the cost of building a summary per page (Figure 2 analogue, on this CPU).

# %% [markdown]
# One decode step of one layer with SmolLM2-135M head shapes ($H_q = 9$ query heads, $H_{kv} = 3$
# KV heads, $d = 64$) over a cache of $T$ tokens, on random seeded tensors (the time does not
# depend on the values):
#
# - **full**: SDPA of the query over all $T$ keys and values;
# - **retrieval**: score every complete page's summary (`score_pages`), average the per-head page
#   softmaxes over each GQA group (`aggregate_gqa`, avgSM), keep the sink, the recent tokens and
#   the top pages within the token budget (`select_pages`), gather those keys and values, and run
#   SDPA over them.
#
# OVAL and key PCA store the same summary $(\mu, B, R)$ per page and head and are scored by the
# same formula $\log\sum_t \exp\big((R_t \cdot B^\top q + \mu\cdot q)/\sqrt d\big)$, so their
# scoring costs should match (goal: OVAL $\le 1.15\times$ key PCA); they differ only in how $B$
# is built. Each retrieval method is timed on two paths:
#
# - `library`: `score_pages` (one small broadcast matmul per page) and `sparsekv.hf.gather_keys`;
# - `packed`: the basis summaries laid out with all pages' bases of a head side by side ($B$ as
#   $[H_{kv}, d, P r]$, so that $B^\top q$ for every page is one matrix product) and the selected
#   rows gathered with one `index_select`; same scores and same output (checked).
#
# Goal: retrieval $\ge 2\times$ faster than full attention per token at 32k.
#
# Every time is the best of `repeats` runs (`time.perf_counter`) and every ratio comes from the
# same run, on `threads` intra-op threads.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
contexts = [2048, 4096]
token_budget = 512
sink = 64
recent = 64
page_size = 32
rank = 8
eta = 0.5
repeats = 10
construction_pages = 32
threads = 1
seed = 0

# %%
import math
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.nn.functional as F

from sparsekv.hf import gather_keys
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.oval.basis import page_basis
from sparsekv.oval.pages import aggregate_gqa, build_summaries, quest_summary, score_pages, select_pages, split_pages

use_style()
torch.set_num_threads(threads)  # both sides of every ratio get the same threads
HQ, HKV, D = 9, 3, 64           # SmolLM2-135M attention shapes
print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s)")


# %%
def best_seconds(f, repeats: int = repeats) -> float:
    "Best wall time of `repeats` calls of f (after one warm-up call)."
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)

def random_cache(T: int, gen: torch.Generator):
    "Seeded q [1, Hq, 1, d], k, v [1, Hkv, T, d] and a PSD output metric G [Hkv, d, d]."
    q, k, v = torch.randn(1, HQ, 1, D, generator=gen), torch.randn(1, HKV, T, D, generator=gen), torch.randn(1, HKV, T, D, generator=gen)
    W = torch.randn(HKV, D, D, generator=gen) / math.sqrt(D)
    return q, k, v, W @ W.mT


# %% [markdown]
# The packed scorer: the same score as `score_pages` for the basis methods, from the summary
# re-laid out once per page completion (a layout choice, not a different summary). Checked against
# `score_pages` below.

# %%
def pack_basis_summary(summary) -> dict:
    "A basis summary (batch 1) laid out for one-GEMM scoring: B [Hkv, d, P*r], R [Hkv, P, m, r], mu [Hkv, P, d]."
    mu, B, R = (summary.tensors[n][0] for n in ("mu", "B", "R"))
    H, P, d, r = B.shape
    return {"B": B.permute(0, 2, 1, 3).reshape(H, d, P * r).contiguous(), "R": R.contiguous(), "mu": mu.contiguous(), "r": r}

def packed_scores(packed: dict, q: torch.Tensor) -> torch.Tensor:
    "Page scores [1, Hq, P] of q [1, Hq, d] from a packed basis summary (same values as score_pages)."
    B, R, mu, r = packed["B"], packed["R"], packed["mu"], packed["r"]
    H, d = B.shape[:2]
    qg = q.reshape(H, -1, d)
    c = 1 / math.sqrt(d)
    code = torch.bmm(qg, B).view(H, qg.shape[1], -1, r)                      # B_p^T q for every page p
    logits = torch.einsum("hpmr,hgpr->hgpm", R, code)
    return ((logits * c).logsumexp(-1) + torch.bmm(qg, mu.mT) * c).reshape(1, -1, R.shape[1])


# %% [markdown]
# The gather: `sparsekv.hf.gather_keys` (`torch.gather` with an index expanded over the head
# dimension) is slow on CPU; the packed path instead gathers whole rows with one `index_select` on
# the flattened cache. Both give the same tensors (checked below).

# %%
def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    "The rows idx [B, H, n] of x [B, H, T, d] by one index_select over the flattened cache: [B, H, n, d]."
    B, H, T, d = x.shape
    offset = (torch.arange(B * H, device=x.device) * T).view(B, H, 1)
    return x.reshape(B * H * T, d).index_select(0, (idx + offset).flatten()).view(B, H, -1, d)

def decode_step(scores_fn, gather_fn, q, k, v, T: int) -> torch.Tensor:
    "One retrieval decode step: page scores -> avgSM weights -> top pages within the budget -> gather -> SDPA."
    w = aggregate_gqa(scores_fn(q[:, :, 0]), HKV)
    idx = select_pages(w, token_budget, page_size, sink, recent, T)
    return F.scaled_dot_product_attention(q, gather_fn(k, idx), gather_fn(v, idx), enable_gqa=True)

def full_step(q, k, v) -> torch.Tensor:
    "One dense decode step over all T keys."
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


# %%
gen = torch.Generator().manual_seed(seed)
rows = []
for T in contexts:
    q, k, v, G = random_cache(T, gen)
    summ = {m: build_summaries(m, k, v, page_size, rank, eta, G) for m in ("quest", "keypca", "oval")}
    packed = {m: pack_basis_summary(summ[m]) for m in ("keypca", "oval")}
    for m in packed:  # the packed layout gives the library's scores
        torch.testing.assert_close(packed_scores(packed[m], q[:, :, 0]), score_pages(m, summ[m], q[:, :, 0]), rtol=1e-4, atol=1e-4)
    idx = select_pages(aggregate_gqa(score_pages("quest", summ["quest"], q[:, :, 0]), HKV), token_budget, page_size, sink, recent, T)
    assert torch.equal(gather_rows(k, idx), gather_keys(k, idx))
    library = {m: (lambda x, m=m: score_pages(m, summ[m], x)) for m in summ}
    fast = {"quest": library["quest"], **{m: (lambda x, m=m: packed_scores(packed[m], x)) for m in packed}}
    rows.append({"T": T, "method": "full", "path": "dense", "score_s": 0.0, "step_s": best_seconds(lambda: full_step(q, k, v))})
    for path, scorers, gather_fn in (("library", library, gather_keys), ("packed", fast, gather_rows)):
        for m, fn in scorers.items():
            torch.testing.assert_close(decode_step(fn, gather_fn, q, k, v, T), decode_step(library[m], gather_keys, q, k, v, T))
            rows.append({"T": T, "method": m, "path": path, "score_s": best_seconds(lambda: fn(q[:, :, 0])),
                         "step_s": best_seconds(lambda: decode_step(fn, gather_fn, q, k, v, T))})
lat = pd.DataFrame(rows)
lat["pages"] = lat["T"] // page_size
lat["threads"] = torch.get_num_threads()
lat


# %%
def ratios(lat: pd.DataFrame) -> pd.DataFrame:
    "Per context and path: OVAL vs key-PCA scoring and step ratios, and full vs retrieval speed-ups (all from one run)."
    out = []
    for T, g in lat.groupby("T"):
        full = g[g.method == "full"].step_s.iloc[0]
        for path in ("library", "packed"):
            t = g[g.path == path].set_index("method")
            out.append({"T": T, "path": path, "oval_vs_keypca_score": t.score_s["oval"] / t.score_s["keypca"],
                        "oval_vs_keypca_step": t.step_s["oval"] / t.step_s["keypca"],
                        "full_over_oval": full / t.step_s["oval"], "full_over_keypca": full / t.step_s["keypca"],
                        "full_over_quest": full / t.step_s["quest"]})
    return pd.DataFrame(out)

rat = ratios(lat)
rat

# %% [markdown]
# Summary construction: when a page completes, its summary is built once per KV head. Time per
# (page, head), from a batch of `construction_pages` pages on the 3 KV heads: OVAL's `page_basis`
# (eta = `eta`, with $G$), key PCA (`eta = 0`, no $G$), Quest (min/max) for comparison.
# (`page_basis` runs its eigensolvers on one thread.)

# %%
K1, V1, G1 = (x for x in random_cache(construction_pages * page_size, gen)[1:])
Kp, Vp = split_pages(K1, page_size), split_pages(V1, page_size)
n = HKV * construction_pages
build = pd.DataFrame([
    {"summary": "oval page_basis", "us_per_page_head": 1e6 * best_seconds(lambda: page_basis(Kp, Vp, G1[:, None], rank, eta)) / n},
    {"summary": "keypca page_basis", "us_per_page_head": 1e6 * best_seconds(lambda: page_basis(Kp, Vp, None, rank, 0.0)) / n},
    {"summary": "quest min/max", "us_per_page_head": 1e6 * best_seconds(lambda: quest_summary(K1, page_size)) / n},
])
build["threads"] = torch.get_num_threads()
build

# %%
write_csv(Path(fig_dir)/"oval_latency.csv", lat)
write_csv(Path(fig_dir)/"oval_latency_ratios.csv", rat)
write_csv(Path(fig_dir)/"oval_summary_build.csv", build)
fig, ax = plt.subplots()
for (m, path), g in lat.groupby(["method", "path"], sort=False):
    ax.plot(g["T"], 1e3 * g.step_s, marker="o", ls="-" if path != "library" else ":", label=f"{m} ({path})")
ax.set(xscale="log", yscale="log", xlabel="context $T$ (tokens)", ylabel="decode attention per token (ms)",
       title=f"One layer, {HQ}q/{HKV}kv heads, budget {token_budget}, {torch.get_num_threads()} thread(s)")
ax.legend(fontsize=8)
save_figure(fig, Path(fig_dir)/"oval_latency.png", data=lat)

# %%
big = rat[rat["T"] == rat["T"].max()].set_index("path")
lines = [f"Decode attention of one layer ({HQ} query / {HKV} KV heads, d = {D}), random tensors, page {page_size}, rank {rank}, "
         f"budget {token_budget} (sink {sink}, recent {recent}), best of {repeats}, {torch.get_num_threads()} thread(s). "
         "Paths: `library` = `score_pages` + `gather_keys`; `packed` = one-GEMM basis scoring + `index_select` gather.", "",
         "| T | method | path | scoring (ms) | whole step (ms) |", "|---|---|---|---|---|"]
lines += [f"| {r.T} | {r.method} | {r.path} | {1e3 * r.score_s:.3f} | {1e3 * r.step_s:.3f} |" for r in lat.itertuples()]
lines += ["", "| T | path | OVAL/keyPCA scoring | OVAL/keyPCA step | full/OVAL step | full/keyPCA step | full/Quest step |",
          "|---|---|---|---|---|---|---|"]
lines += [f"| {r.T} | {r.path} | {r.oval_vs_keypca_score:.2f}x | {r.oval_vs_keypca_step:.2f}x | {r.full_over_oval:.2f}x | "
          f"{r.full_over_keypca:.2f}x | {r.full_over_quest:.2f}x |" for r in rat.itertuples()]
lines += ["", f"Goals at T = {int(rat['T'].max())}: OVAL scoring {big.oval_vs_keypca_score['library']:.2f}x (library) / "
          f"{big.oval_vs_keypca_score['packed']:.2f}x (packed) key PCA (goal <= 1.15x); retrieval with OVAL "
          f"{big.full_over_oval['library']:.2f}x (library) / {big.full_over_oval['packed']:.2f}x (packed) faster than full (goal >= 2x).",
          "", "Summary construction per (page, KV head): " + ", ".join(f"{r.summary} {r.us_per_page_head:.1f} us" for r in build.itertuples()) + "."]
write_text(Path(out_dir)/"oval_latency.md", "\n".join(lines) + "\n")
print("\n".join(lines))
