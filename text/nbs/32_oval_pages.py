# %% [markdown]
# # OVAL page retrieval
#
# > Page retrieval from page summaries: GQA aggregation, budgeted selection, cost, quality and the decode policy.

# %%
#| default_exp oval.pages

# %% [markdown]
# A page retriever keeps the full KV cache and, for every decode query, attends exactly to a
# few *pages* of $m$ consecutive tokens (OVAL §1, D.8), chosen from a compact summary stored
# beside each completed page. The summaries the OVAL paper compares (§2, §4) — Quest, ArkVale,
# key PCA, OVAL and the oracle — are the `PageSummary` classes of
# [`sparsekv.oval.summaries`](31_oval_summaries.ipynb), found by name in `SUMMARIES`; their
# scores come in the log domain, `[B, Hq, P]` or `[B, Hq, S, P]`. This notebook turns those
# scores into retrieval: one page selection per KV head (GQA aggregation), the pages that fit a
# token budget, what the summaries cost to store, how well they retrieve, and the decode-time
# policy that plugs it all into `sparsekv.hf`. Every function that takes a `method` takes its
# name (`"quest"`, `"arkvale"`, `"keypca"`, `"oval"`, `"oracle"`) or a `PageSummary`. The registered methods that
# run this policy (`PageRetrieval` and its subclasses `Quest`, `ArkVale`, `KeyPCA`, `OVAL`, `OraclePages`) are
# written beside their summaries in [the summaries](31_oval_summaries.ipynb); each builds its
# `PageRetrievalPolicy` here.

# %%
#| export
from __future__ import annotations

import copy
import math
import weakref

import pandas as pd
import torch
from fastcore.basics import patch_to
from torch import Tensor

from sparsekv.attention import check_int, content_checks, gather_kv, shape_count
from sparsekv.cache import follow_batch_ops
from sparsekv.eval import attention_fidelity
from sparsekv.hf import (
    DensePolicy,
    SelectionPolicy,
    _meter,
    attend_selected,
    attended_counts,
    dense_attention,
    record_attended,
)
from sparsekv.oval.basis import output_metric
from sparsekv.oval.kernel import paged_decode

# the string API of the summaries, importable from here too
from sparsekv.oval.summaries import (  # noqa: F401
    METHODS,
    PageSummary,
    _check_cache,
    _group_queries,
    build_summaries,
    make_summary,
    score_pages,
    score_pages_reference,
    split_pages,
)
from sparsekv.select import top_budget_indices

# %%
#| hide
import os

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.attention import gather_keys

# %%
from sparsekv.hf import AttentionContext, measure_attended
from sparsekv.oval.summaries import OVALSummary


# %% [markdown]
# The checks below use a random GQA cache (2 KV heads, 3 query heads each, $d = 16$) whose
# keys have channels of different scales and a shared offset, as in `sparsekv.oval.summaries`.

# %%
def _random_cache(B=2, Hkv=2, T=4 * 8 + 5, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(B, Hkv, T, d, generator=g, dtype=dtype) * torch.logspace(0, -1, d, dtype=dtype)
    K = K + torch.randn(d, generator=g, dtype=dtype)
    V = torch.randn(B, Hkv, T, d, generator=g, dtype=dtype)
    A = torch.randn(Hkv, d, d, generator=g, dtype=dtype)
    return K, V, A.mT @ A / d


# %% [markdown]
# ## GQA aggregation
#
# All query heads of a KV head share one page selection (the KV head's cache is read once).
# `avgSM` (D.3) turns each query head's page scores into a distribution over pages,
# $\pi_{hg}=\mathrm{softmax}_p(\text{score}_{hg})$, and averages it over the group:
# $\bar\pi_h = \frac1G\sum_g \pi_{hg}$. The `max` variant takes $\max_g \pi_{hg}$ instead
# (a page any query head wants strongly is kept). Both return probabilities
# `[B, Hkv, (S,) P]`. With log-mass scores (oracle, basis methods) $\pi_{hg}$ is the
# estimated share of head $hg$'s attention on each page; for the upper-bound scores it is
# only a ranking device.

# %%
#| export
GQA_POLICIES = ("avgSM", "max")

def aggregate_gqa(page_scores: Tensor, num_kv_heads: int, policy: str = "avgSM") -> Tensor:
    "Per-KV-head page weights [B, Hkv, (S,) P] of log scores [B, Hq, (S,) P]: page softmax, group mean ('avgSM')/max."
    if policy not in GQA_POLICIES: raise ValueError(f"policy must be one of {GQA_POLICIES}, got {policy!r}")
    if not isinstance(page_scores, Tensor) or not page_scores.is_floating_point():
        raise TypeError("page_scores must be a floating-point tensor")
    if page_scores.dim() not in (3, 4):
        raise ValueError(f"page_scores must be [B, Hq, P] or [B, Hq, S, P], got {tuple(page_scores.shape)}")
    Hkv = check_int(num_kv_heads, "num_kv_heads", 1)
    B, Hq = page_scores.shape[:2]
    if Hq % Hkv: raise ValueError(f"the query heads ({Hq}) must be a multiple of num_kv_heads ({Hkv})")
    pi = page_scores.softmax(-1).reshape(B, Hkv, Hq // Hkv, *page_scores.shape[2:])
    return pi.mean(2) if policy == "avgSM" else pi.amax(2)


# %%
sc = torch.randn(2, 6, 5, 4, dtype=torch.float64)
for pol in GQA_POLICIES:
    agg = aggregate_gqa(sc, 2, pol)
    test_eq(agg.shape, (2, 2, 5, 4))
    for b in range(2):
        for h in range(2):
            probs = [torch.exp(sc[b, h * 3 + g] - sc[b, h * 3 + g].logsumexp(-1, keepdim=True)) for g in range(3)]
            ref = sum(probs) / 3 if pol == "avgSM" else torch.stack(probs).max(0).values
            assert_close(agg[b, h], ref)
test_fail(lambda: aggregate_gqa(sc, 4), contains="multiple of num_kv_heads")


# %% [markdown]
# ## Selecting pages within a token budget
#
# `select_pages` returns the token indices each KV head attends to. The budget
# `token_budget` counts every attended token, split as in the paper's harness
# (`budget = selectable + sink + recent`, D.4–D.5):
#
# 1. **sink**: the first `sink` tokens, rounded up to whole pages;
# 2. **recent**: the last `recent` tokens and the trailing partial page, rounded down to the
#    start of a page (so the recent region is whole pages plus the partial page);
# 3. **selected pages**: the remaining budget, $\lfloor(\text{budget}-|\text{sink}\cup\text{recent}|)/m\rfloor$
#    pages (at least 0), taken by decreasing weight among the pages outside sink and recent
#    (ties: lower page first).
#
# When the cache fits in the budget every token is kept. All KV heads keep the same number
# of tokens $n$, so the result is one tensor `[B, Hkv, (S,) n]`, sorted by position.
# `top_pages` returns the kept complete pages (sink, selected and recent pages, sorted) and
# `page_tokens` turns them into token indices, appending the trailing partial page; the
# packed decode path below gathers whole pages from the first.
#
# The always-kept regions, by hand: with pages of 8, a sink of 4 tokens is page 0, and the last 8 of 100 tokens
# reach back into page 11 (88–95), so the recent region starts at 88; without `recent` it is the partial page alone.

# %%
#| export
def always_kept(T: int, page_size: int, sink: int, recent: int) -> tuple[int, int]:
    "The always-kept regions [0, sink_end) and [recent_start, T), rounded out to page boundaries."
    m = page_size
    sink_end = min(T, -(-sink // m) * m)
    recent_start = max(sink_end, min((T // m) * m, ((T - recent) // m) * m if recent else T))
    return sink_end, recent_start


# %%
test_eq(always_kept(100, 8, 4, 8), (8, 88))
test_eq(always_kept(100, 8, 0, 0), (0, 96))
test_eq(always_kept(37, 8, 1, 1), (8, 32))
test_eq(always_kept(16, 8, 20, 0), (16, 16))   # a sink longer than the cache: all of it


# %% [markdown]
# On the same 100 tokens with a budget of 40: sink page 0 and recent page 11 hold 8 + 12 tokens (the partial page
# included), which leaves $\lfloor 20 / 8 \rfloor = 2$ pages, the two of largest weight among pages 1–10:

# %%
#| export
def top_pages(page_scores: Tensor, token_budget: int, page_size: int, sink: int, recent: int, T: int) -> Tensor:
    "Sorted complete pages [B, Hkv, (S,) n_p] a KV head keeps: sinks, the top pages within token_budget, recent pages."
    if not isinstance(page_scores, Tensor) or not page_scores.is_floating_point():
        raise TypeError("page_scores must be a floating-point tensor")
    m = check_int(page_size, "page_size", 1)
    T = check_int(T, "T", 1)
    sink, recent = check_int(sink, "sink", 0), check_int(recent, "recent", 0)
    budget = check_int(token_budget, "token_budget", 1)
    P = T // m
    if page_scores.dim() < 3 or page_scores.shape[-1] != P:
        raise ValueError(f"page_scores must be [B, Hkv, (S,) P] with P = T // page_size = {P}, got "
                         f"{tuple(page_scores.shape)}")
    if content_checks() and page_scores.isnan().any(): raise ValueError("page_scores must not contain NaN")
    lead, dev = page_scores.shape[:-1], page_scores.device
    if T <= budget: return torch.arange(P, device=dev).expand(*lead, P)
    sink_end, recent_start = always_kept(T, m, sink, recent)
    first, last = sink_end // m, recent_start // m                           # selectable pages [first, last)
    k = max(0, min(last - first, (budget - sink_end - (T - recent_start)) // m))
    top = top_budget_indices(page_scores[..., first:last], k) + first
    return torch.cat([torch.arange(first, device=dev).expand(*lead, -1), top,
                      torch.arange(last, P, device=dev).expand(*lead, -1)], -1)


# %%
_w = torch.tensor([[[5.0, 1, 9, 2, 8, 3, 0, 4, 6, 7, 9, 9]]])
test_eq(top_pages(_w, 40, 8, 4, 8, 100), torch.tensor([[[0, 2, 10, 11]]]))   # 9 at pages 2 and 10 (page 11 is recent)
test_eq(top_pages(_w, 100, 8, 4, 8, 100), torch.arange(12).view(1, 1, 12))   # the cache fits: every page
test_fail(lambda: top_pages(_w, 40, 8, 4, 8, 90), contains="P = T // page_size")
test_fail(lambda: top_pages(_w.fill_(math.nan), 40, 8, 4, 8, 100), contains="NaN")


# %% [markdown]
# Pages 0 and 2 of 4 tokens and a partial page of 13 tokens, by hand:

# %%
#| export
def page_tokens(pages: Tensor, page_size: int, T: int) -> Tensor:
    "Token indices [..., n_p * m + T % m] of complete pages [..., n_p], then the partial page [T - T % m, T)."
    m = check_int(page_size, "page_size", 1)
    tail = torch.arange(T // m * m, check_int(T, "T", 1), device=pages.device)
    return torch.cat([torch.add(torch.arange(m, device=pages.device), pages.unsqueeze(-1), alpha=m).flatten(-2),
                      tail.expand(*pages.shape[:-1], -1)], -1)


# %%
test_eq(page_tokens(torch.tensor([[0, 2]]), 4, 13), torch.tensor([[0, 1, 2, 3, 8, 9, 10, 11, 12]]))
test_eq(page_tokens(torch.tensor([[1]]), 4, 8), torch.tensor([[4, 5, 6, 7]]))   # no partial page


# %% [markdown]
# The loop reference adds whole pages by decreasing weight until the next would exceed the budget; on the example
# above it keeps pages 0, 9, 10, 11 and the partial page (weights rising with the page):

# %%
#| export
def select_pages_reference(page_scores: Tensor, token_budget: int, page_size: int, sink: int, recent: int,
                           T: int) -> list:
    "Loop reference of select_pages for [B, Hkv, P] scores: a nested list of sorted kept positions."
    m, P = page_size, T // page_size
    out = []
    for row_b in page_scores.tolist():
        out.append([])
        for w in row_b:
            if T <= token_budget: out[-1].append(list(range(T))); continue
            sink_pages = {p for p in range(P) if p * m < sink}
            recent_pages = {p for p in range(P) if (p + 1) * m > T - recent}
            kept = {t for t in range(T) if t >= P * m or (t // m) in sink_pages | recent_pages}
            for p in sorted(set(range(P)) - sink_pages - recent_pages, key=lambda p: (-w[p], p)):
                if len(kept) + m > token_budget: break
                kept |= set(range(p * m, (p + 1) * m))
            out[-1].append(sorted(kept))
    return out


# %%
test_eq(select_pages_reference(torch.arange(12.0).view(1, 1, 12), 40, 8, 4, 8, 100),
        [[list(range(8)) + list(range(72, 100))]])
test_eq(select_pages_reference(torch.zeros(1, 1, 4), 40, 8, 0, 0, 37), [[list(range(37))]])   # the cache fits


# %% [markdown]
# `select_pages` against the loop reference, on budgets around the cache, sink and recent regions that overlap,
# ties and several query rows:

# %%
#| export
def select_pages(page_scores: Tensor, token_budget: int, page_size: int, sink: int, recent: int, T: int) -> Tensor:
    "Token indices [B, Hkv, (S,) n] per KV head: sink and recent pages and the top pages that fit in token_budget."
    return page_tokens(top_pages(page_scores, token_budget, page_size, sink, recent, T), page_size, T)


# %%
g = torch.Generator().manual_seed(3)
for T, budget, sink, recent in [(100, 40, 4, 8), (100, 40, 0, 0), (96, 64, 10, 20), (100, 100, 4, 8), (100, 20, 8, 20),
                                (37, 24, 1, 1), (64, 33, 0, 32)]:
    w = torch.rand(2, 3, T // 8, generator=g, dtype=torch.float64)
    w[0, 0, :] = 0.5                                                          # ties: lower page first
    idx = select_pages(w, budget, 8, sink, recent, T)
    test_eq(idx.tolist(), select_pages_reference(w, budget, 8, sink, recent, T))
    sink_end, recent_start = always_kept(T, 8, sink, recent)
    assert idx.shape[-1] <= max(budget, sink_end + T - recent_start)
# several query rows select independently
w = torch.rand(2, 3, 4, 12, generator=g, dtype=torch.float64)
test_eq(select_pages(w, 40, 8, 4, 8, 100)[:, :, 2], select_pages(w[:, :, 2], 40, 8, 4, 8, 100))
test_fail(lambda: select_pages(w, 40, 8, 4, 8, 90), contains="P = T // page_size")


# %% [markdown]
# ## Storage per page
#
# Summaries are additional state beside the (resident) cache, built once per completed page
# and KV head. Scalars per page, with $r_{\text{eff}}=\min(r, m-1, d)$:
# Quest $2d$; ArkVale $d+1$; key PCA and OVAL $d + d\,r_{\text{eff}} + m\,r_{\text{eff}}$
# ($\mu$, $B$, $R$; the same for both: OVAL uses the values only while building the basis);
# the oracle reads the page's $m d$ keys, stored nowhere extra. Each `PageSummary` counts its own
# (`scalars`); `summary_scalars` asks the method's, checked against the tensors each summary holds.

# %%
#| export
def summary_scalars(method: str | PageSummary, page_size: int, head_dim: int, rank: int = 8) -> int:
    "Scalars stored per page and KV head by a method's summary (oracle: the m*d keys it reads)."
    spec = make_summary(method, check_int(rank, "rank", 1))
    return spec.scalars(check_int(page_size, "page_size", 1), check_int(head_dim, "head_dim", 1))


# %%
K, V, G = _random_cache(T=64, d=16)
for mt in METHODS:
    summ = build_summaries(mt, K, V, 8, rank=3, G=G)
    stored = sum(x[0, 0].numel() for x in summ.tensors.values()) // summ.n_pages  # per page and KV head
    test_eq(stored, summary_scalars(mt, 8, 16, rank=3))
test_eq(summary_scalars("oval", 4, 64, rank=8), 64 + 64 * 3 + 4 * 3)   # rank cap m - 1
test_eq(summary_scalars(OVALSummary(rank=3), 8, 16), summary_scalars("oval", 8, 16, rank=3))
test_fail(lambda: summary_scalars("pq", 8, 16), contains="method must be one of")


# %% [markdown]
# The table of every method, in bytes of bfloat16 and relative to the page's $m d$ keys:

# %%
#| export
def storage_table(page_size: int = 32, head_dim: int = 64, rank: int = 8,
                  dtype: torch.dtype = torch.bfloat16) -> pd.DataFrame:
    "Per-page, per-KV-head summary storage of every method: scalars, bytes in dtype, and the ratio to the page's keys."
    itemsize = torch.empty((), dtype=dtype).element_size()
    keys = page_size * head_dim
    rows = [{"method": mt, "scalars": summary_scalars(mt, page_size, head_dim, rank)} for mt in METHODS]
    for r in rows: r.update(bytes=r["scalars"] * itemsize, vs_keys=r["scalars"] / keys)
    return pd.DataFrame(rows)


# %%
tab = storage_table()
test_eq(list(tab.method), list(METHODS))
test_eq(list(tab.bytes), [2 * summary_scalars(mt, 32, 64) for mt in METHODS])
test_eq(tab.set_index("method").loc["oracle", "vs_keys"], 1.0)   # the oracle reads the page's keys
tab


# %% [markdown]
# ## Retrieval quality on random data
#
# End to end: summaries, scores, `avgSM`, selection, then exact attention over the kept
# tokens (`sparsekv.eval.attention_fidelity`): attention-mass recall and relative output
# error against full attention. Keys here have a few outlier pages (a shared direction
# with a larger weight) so that retrieval has something to find. With one query head per KV
# head the oracle's pages maximize the kept mass for every query (the budget is whole
# pages), so no method may beat it; on such data every method should beat random pages.

# %%
#| export
def retrieval_quality(method: str | PageSummary, q: Tensor, K: Tensor, V: Tensor, page_size: int, token_budget: int,
                      sink: int, recent: int, rank: int = 8, eta: float = 0.5, G: Tensor | None = None,
                      policy: str = "avgSM") -> tuple[Tensor, Tensor]:
    "Mass recall and relative output error [B, Hq, S] of page retrieval for q [B, Hq, S, d], K, V [B, Hkv, T, d]."
    summ = make_summary(method, rank, eta, G).summarize(K, V, page_size)
    w = aggregate_gqa(summ.score(q), K.shape[1], policy)
    idx = select_pages(w, token_budget, page_size, sink, recent, K.shape[2])
    return attention_fidelity(q, K, V, idx)


# %%
def _structured(B=1, H=2, T=512, d=32, S=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(B, H, T, d, generator=g)
    u = torch.randn(d, generator=g)
    hot = torch.rand(B, H, T // 16, generator=g) < 0.15                      # a few pages lean towards u
    K = K + 2.5 * hot.repeat_interleave(16, -1)[..., None] * u
    V = torch.randn(B, H, T, d, generator=g)
    q = torch.randn(B, H, S, d, generator=g) + 1.5 * u
    return q, K, V

q, K, V = _structured()
res = {mt: retrieval_quality(mt, q, K, V, 16, 128, 16, 16, rank=4) for mt in METHODS}
rand_idx = select_pages(torch.rand(1, 2, 4, 32, generator=torch.Generator().manual_seed(9)), 128, 16, 16, 16, 512)
rand_mass, _ = attention_fidelity(q, K, V, rand_idx)
for mt, (mass, _err) in res.items():
    assert (mass <= res["oracle"][0] + 1e-6).all(), mt
    assert mass.mean() > rand_mass.mean(), mt
pd.DataFrame({mt: {"mass recall": m.mean().item(), "output error": e.mean().item()} for mt, (m, e) in res.items()}).T


# %% [markdown]
# ## SmolLM2 activations
#
# The real test: post-RoPE queries, keys and values of SmolLM2-135M on long prose. A
# `DensePolicy` subclass records them per layer while the model runs densely; then for the
# last 16 queries of a 2048-token window, each method retrieves pages of 32 tokens at rank 8
# under a budget of 256 tokens (sink 32 + recent 32 + 6 selected pages, an 8x reduction,
# the paper's 2048 of 16k) and we average mass recall and output error over layers 1–29
# (layer 0 stays dense, D.3), heads and queries. $G$ comes from each layer's `o_proj`.

# %%
#| export
class CapturePolicy(DensePolicy):
    "Dense attention that records (q, k, v) of each call by layer index, detached on the CPU."
    def __init__(self): self.qkv = {}

    def attend(self, q, k, v, ctx):
        self.qkv[ctx.layer_idx] = (q.detach().cpu(), k.detach().cpu(), v.detach().cpu())
        return super().attend(q, k, v, ctx)


# %%
_g = torch.Generator().manual_seed(0)
_q, _k, _v = (torch.randn(1, 2, n, 8, generator=_g) for n in (3, 5, 5))
_ctx = AttentionContext(layer_idx=4, kind="prefill", query_positions=torch.arange(2, 5),
                        key_positions=torch.arange(5).expand(1, 2, 5), mask=None, scale=0.3)
cap = CapturePolicy()
test_eq(cap.attend(_q, _k, _v, _ctx), DensePolicy().attend(_q, _k, _v, _ctx))   # attends densely
test_eq(list(cap.qkv), [4])
for got, x in zip(cap.qkv[4], (_q, _k, _v)): test_eq(got, x)

# %%
#| slow
from sparsekv.data import prose_text
from sparsekv.hf import patch
from sparsekv.models import load_model, model_info

# %%
#| slow
model, tok = load_model("smollm2-135m")
info = model_info(model)
text = prose_text()
arms = ([("quest", 0.0), ("arkvale", 0.0), ("oracle", 0.0), ("keypca", 0.0)]
        + [("oval", e) for e in (0.25, 0.5, 0.75, 1.0)])
rows, S = [], 16
for start in (200_000, 1_200_000):                                           # two windows of prose
    ids = tok(text[start:start + 12_000], return_tensors="pt").input_ids[:, :2048]
    cap = CapturePolicy()
    with torch.no_grad(), patch(model, cap): model(ids)
    for layer in range(1, info.num_layers):
        q, k, v = cap.qkv[layer]
        Gl = output_metric(model.model.layers[layer].self_attn.o_proj.weight.detach(), info.num_q_heads,
                           info.num_kv_heads, info.head_dim)
        for mt, eta in arms:
            mass, err = retrieval_quality(mt, q[:, :, -S:], k, v, 32, 256, 32, 32, rank=8, eta=eta, G=Gl)
            rows.append({"window": start, "layer": layer, "method": mt, "eta": eta,
                         "mass_recall": mass.mean().item(), "output_error": err.mean().item()})
smol = pd.DataFrame(rows).groupby(["method", "eta"])[["mass_recall", "output_error"]].mean()
smol


# %% [markdown]
# ## A packed layout for decode
#
# `score_pages` broadcasts each query against every page's summary tensors: for the basis
# methods that is $P$ separate small products $B_p^\top q$ and broadcast copies of the
# queries, and `gather_keys` then gathers the kept keys element by element. Clear for
# analysis, but too slow per decode step: page retrieval through these two did not beat full
# attention at 32k tokens on the CPU (`reproduce/31_oval_latency` reports the scoring speed-up
# of the packed layout over `score_pages`). At decode a page's summary never changes once
# built, so `PackedPages` lays it out once, when the page completes, as rows of one matrix per
# KV head, chosen so that **one GEMM scores every page for every query head of the group**.
# Each summary's score is a function of inner products of a query feature $\phi(sq)$ with the
# page's rows $W_p$ ($s = 1/\sqrt d > 0$ folded into the query), and each `PageSummary` defines
# that layout (see [`sparsekv.oval.summaries`](31_oval_summaries.ipynb)): `pack` gives
# $W_p$, `features` gives $\phi$, `packed_score` turns the products into the
# page score. Quest: one row $[u;\ \ell]$ of $2d$ against $[sq^+;\ sq^-]$; ArkVale: one row
# $[c;\ \rho]$ of $d+1$ against $[sq;\ \lVert sq\rVert]$; key PCA and OVAL: the $r+1$ rows
# $[B_p^\top;\ \mu_p^\top]$, giving the code $c_p = sB_p^\top q$ and the mean term at once, then
# $\log\sum_t \exp((R_p c_p)_t)$ batched over the pages; the oracle: its $m$ keys, then a log-sum-exp.
#
# Stacking the rows of all $P$ pages of a KV head, $W = [W_1; \dots; W_P]$, the products of all
# pages with the $G$ query heads of the group are the single product $\phi(Q)\,W^\top$,
# `[G, f] x [f, P rows]`. These are the same sums as `score_pages`'s, regrouped, so the scores
# agree to rounding. `append` writes the rows of newly completed pages into buffers whose
# capacity doubles when full: earlier pages are never rebuilt, and the copies on growth cost
# $O(1)$ amortized per page.
# The packed store keeps its rows in float32 (or float64), the dtype the scores are computed in.
#
# The pages that `top_pages` keeps are blocks of $m$ consecutive rows of the cache, so
# `gather_pages` copies whole `[m, d]` blocks, all KV heads in one indexing operation (on the
# cache's `[B, H, P, m, d]` view), and appends the trailing partial page; `page_attention` runs SDPA
# of the decode query over them. The kept keys come in the order of `page_tokens`, and since
# a decode query is the last position and sees every kept key, the output is exact attention
# over the selected tokens.

# %%
#| export
def _reserve(buf: Tensor | None, used: int, need: int, dim: int, like: Tensor) -> Tensor:
    "A buffer with room for `need` entries along dim (capacity doubling), holding buf's first `used` entries."
    if buf is not None and buf.shape[dim] >= need: return buf
    shape = list(like.shape)
    shape[dim] = max(need, 2 * (0 if buf is None else buf.shape[dim]))
    new = like.new_empty(shape)
    if used: new.narrow(dim, 0, used).copy_(buf.narrow(dim, 0, used))
    return new


# %%
_b = _reserve(None, 0, 3, 1, torch.zeros(2, 1))
test_eq(_b.shape, (2, 3))                                    # the first: exactly what is needed
_b[:, :3] = torch.arange(6.0).view(2, 3)
assert _reserve(_b, 3, 3, 1, torch.zeros(2, 1)) is _b        # room enough: the same buffer
_b2 = _reserve(_b, 3, 4, 1, torch.zeros(2, 1))
test_eq(_b2.shape, (2, 6))                                   # full: capacity doubles
test_eq(_b2[:, :3], _b[:, :3])                               # holding the used entries
test_eq(_reserve(_b, 3, 10, 1, torch.zeros(2, 1)).shape, (2, 10))


# %% [markdown]
# The store holds the page's rows of `PageSummary.pack` and the summary it was built from (its kind, page size
# and tensors as views); `append` and `scores`, the two halves of the layout above, follow.

# %%
#| export
class PackedPages:
    "A growing cache's page summaries packed for decode: rows appended per page, scored by one GEMM per KV head."
    def __init__(self, method: str | PageSummary, page_size: int):
        # the first append's replaces spec
        self.spec, self.page_size = make_summary(method), check_int(page_size, "page_size", 1)
        # (batch, KV heads, rows per page, features, per-page factor shape), fixed by the first append
        self.n_pages, self.layout = 0, None
        self.W = self.R = None              # W [B*Hkv, capacity * rows, f]; R [capacity, B*Hkv, ...] (basis methods' R)

    @property
    def heads(self) -> tuple[int, int] | None:
        "(batch, KV heads) of the pages held; None before the first append."
        return None if self.layout is None else self.layout[:2]

    @property
    def rows(self) -> int:
        "Rows of the packed matrix per page."
        return self.layout[2]

    @property
    def tensors(self) -> dict:
        "The summary tensors in PageSummary's layout [B, Hkv, P, ...] (views of the packed buffers)."
        (Bsz, Hkv), P = self.heads, self.n_pages
        W = self.W[:, :P * self.rows].view(Bsz, Hkv, P, self.rows, -1)
        R = None if self.R is None else self.R[:P].view(P, Bsz, Hkv, *self.R.shape[2:]).movedim(0, 2)
        return self.spec.unpack(W, R)

    def summary(self) -> PageSummary:
        "The packed pages as a PageSummary of the store's kind holding views, for score_pages and the references."
        return self.spec.with_tensors(self.page_size, self.n_pages * self.page_size, self.tensors)


# %%
test_eq((PackedPages("keypca", 8).heads, PackedPages("keypca", 8).n_pages), (None, 0))
test_eq(PackedPages(OVALSummary(rank=3), 8).spec.name, "oval")
test_fail(lambda: PackedPages("keypca", 0), contains="page_size")
test_fail(lambda: PackedPages("pq", 8), contains="method must be one of")


# %% [markdown]
# Check: on a GQA cache with a trailing partial page, pages appended in uneven chunks (as they
# complete during decode) give the same tensors as summaries built at once, in every method; a summary of
# another kind, rank or head count is refused.

# %%
#| export
@patch_to(PackedPages)
def append(self, summary: PageSummary) -> PackedPages:
    "Append the pages of `summary` (those completed since the last append, same batch and KV heads); returns self."
    if not isinstance(summary, PageSummary) or summary.tensors is None:
        raise TypeError("summary must be a PageSummary holding pages (see summarize), "
                        f"got {type(summary).__name__}")
    if type(summary) is not type(self.spec) or summary.page_size != self.page_size:
        raise ValueError(f"summary is {summary.name!r} with page_size {summary.page_size}, "
                         f"this store holds {self.spec.name!r} with {self.page_size}")
    rows, R = summary.pack()
    Bsz, Hkv, n, nr, f = rows.shape
    layout = (Bsz, Hkv, nr, f, None if R is None else tuple(R.shape[3:]))
    if self.layout is None: self.layout, self.spec = layout, summary.with_tensors()
    elif layout != self.layout:
        raise ValueError(f"summary packs as (batch, KV heads, rows per page, features, factor per page) {layout}; "
                         f"this store holds {self.layout} (another batch, head count or rank)")
    wd = torch.promote_types(rows.dtype, torch.float32)
    P, BH = self.n_pages, Bsz * Hkv
    rows = rows.to(wd).reshape(BH, n * nr, f)
    self.W = _reserve(self.W, P * nr, (P + n) * nr, 1, rows)
    self.W[:, P * nr:(P + n) * nr] = rows
    if R is not None:
        R = R.to(wd).reshape(BH, n, *R.shape[3:]).transpose(0, 1)
        self.R = _reserve(self.R, P, P + n, 0, R)
        self.R[P:P + n] = R
    self.n_pages = P + n
    return self


# %%
K, V, G = _random_cache(T=4 * 8 + 5)
q = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
stores, wholes = {}, {}
for method in METHODS:
    whole = wholes[method] = build_summaries(method, K, V, 8, rank=3, eta=0.5, G=G)
    packed = stores[method] = PackedPages(method, 8)
    for a, b in ((0, 1), (1, 1), (1, 3), (3, 4)):                         # chunks of 1, 0, 2 and 1 pages
        packed.append(build_summaries(method, K[:, :, a * 8:b * 8], V[:, :, a * 8:b * 8], 8, rank=3, eta=0.5, G=G))
    test_eq(packed.n_pages, 4)
    for n, x in whole.tensors.items(): assert_close(packed.tensors[n], x)
test_fail(lambda: packed.append(build_summaries("quest", K, V, 8)), contains="this store holds")
rank3 = PackedPages("keypca", 8).append(build_summaries("keypca", K, V, 8, rank=3))
test_fail(lambda: rank3.append(build_summaries("keypca", K, V, 8, rank=2)), contains="head count or rank")


# %% [markdown]
# The packed scores equal `score_pages`'s and the loop reference's, for one query and for several, in every method:

# %%
#| export
@patch_to(PackedPages)
def scores(self, q: Tensor, scale: float | None = None) -> Tensor:
    """Log-domain page scores [B, Hq, P] (or [B, Hq, S, P] for q [B, Hq, S, d]), equal to score_pages's up to
    rounding; scale > 0, default 1/sqrt(d)."""
    if self.heads is None: raise ValueError("no pages appended yet")
    Bsz, Hkv = self.heads
    qg, single = _group_queries(q, Hkv)                                  # [B, Hkv, G, S, 1, d]
    _, _, G, S, _, d = qg.shape
    if qg.shape[0] != Bsz: raise ValueError(f"q's batch ({qg.shape[0]}) must match the store's ({Bsz})")
    s = 1 / math.sqrt(d) if scale is None else float(scale)
    if not s > 0: raise ValueError(f"scale must be > 0, got {scale!r}")
    P, nr, BH = self.n_pages, self.rows, Bsz * Hkv
    x = self.spec.features(qg.reshape(BH, G * S, d).to(self.W.dtype) * s)
    # the one GEMM: all pages, all queries of the group
    z = torch.bmm(x, self.W[:, :P * nr].mT).view(BH, G * S, P, nr)
    out = self.spec.packed_score(z, None if self.R is None else self.R[:P]).reshape(Bsz, Hkv * G, S, P)
    return out[:, :, 0] if single else out


# %%
for method, packed in stores.items():
    whole = wholes[method]
    assert_close(packed.scores(q), score_pages(method, whole, q))
    assert_close(packed.scores(q), score_pages_reference(method, K, q, whole))
    assert_close(packed.scores(torch.stack([q, -q], 2), 0.3), score_pages(method, whole, torch.stack([q, -q], 2), 0.3))
test_fail(lambda: packed.scores(q, scale=-1.0), contains="scale must be > 0")
test_fail(lambda: PackedPages("quest", 8).scores(q), contains="no pages appended yet")


# %% [markdown]
# Check: the gathered pages are `gather_keys` at `page_tokens` (also on a strided slice of a
# longer cache, as a growing cache is):

# %%
#| export
def gather_pages(x: Tensor, pages: Tensor, page_size: int) -> Tensor:
    "Pages `pages` [B, H, n_p] of x [B, H, T, d] as [m, d] blocks, then the partial page: [B, H, n_p*m + T % m, d]."
    _check_cache(x, "x")
    m = check_int(page_size, "page_size", 1)
    B, H, T, d = x.shape
    P = T // m
    if pages.dtype != torch.long or pages.dim() != 3 or pages.shape[:2] != (B, H):
        raise ValueError(f"pages must be int64 [B, H, n_p] = [{B}, {H}, n_p], got {pages.dtype} {tuple(pages.shape)}")
    body = x[:, :, :P * m].unflatten(2, (P, m))                               # [B, H, P, m, d] view of the cache
    blocks = body.gather(2, pages[..., None, None].expand(-1, -1, -1, m, d))  # one copy of the chosen blocks
    return torch.cat([blocks.flatten(2, 3), x[:, :, P * m:]], dim=2)


# %%
K, V, G = _random_cache(T=100)
w = aggregate_gqa(score_pages("oval", build_summaries("oval", K, V, 8, rank=3, G=G), q), 2)
for T in (100, 96, 37):
    k, v = K[:, :, :T], V[:, :, :T]
    ids = top_pages(w[..., :T // 8], 40, 8, 4, 8, T)
    test_eq(page_tokens(ids, 8, T), select_pages(w[..., :T // 8], 40, 8, 4, 8, T))
    test_eq(gather_pages(k, ids, 8), gather_keys(k, page_tokens(ids, 8, T)))
test_eq(gather_pages(K[:, :, :0], ids[..., :0], 8).shape, (*K.shape[:2], 0, K.shape[-1]))   # no pages, no partial page
test_fail(lambda: gather_pages(K, ids.int(), 8), contains="pages must be int64")

# %% [markdown]
# `page_attention` equals exact attention over those tokens, `attend_selected` (a masked softmax over the gathered
# keys):

# %%
#| export
PAGE_BACKENDS = ("torch", "triton")


def page_attention(q: Tensor, k: Tensor, v: Tensor, pages: Tensor, page_size: int, scale: float | None = None,
                   dropout: float = 0.0, backend: str = "torch") -> Tensor:
    """Decode attention [B, Hq, 1, d] of q over complete pages `pages` [B, Hkv, n_p] of k, v and the partial page;
    `backend`: 'torch' (gather, then dense attention) or 'triton' (`paged_decode`: the pages read in place)."""
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be one decode query [B, Hq, 1, d], got {getattr(q, 'shape', type(q).__name__)}")
    if backend not in PAGE_BACKENDS: raise ValueError(f"backend must be one of {PAGE_BACKENDS}, got {backend!r}")
    if backend == "triton":
        if dropout: raise ValueError(f"backend='triton' attends without dropout, got dropout={dropout!r}")
        if _meter() is not None:  # the keys it reads: every chosen page and the partial page
            record_attended(attended_counts(None, q.shape[0], q.shape[1], 1,
                                            pages.shape[2] * page_size + k.shape[2] % page_size))
        return paged_decode(q, k, v, pages, page_size, scale)
    tokens = page_tokens(pages, page_size, k.shape[2])  # gathered per token: fewer operators than gather_pages twice
    return dense_attention(q, *gather_kv(k, v, tokens), None, scale, dropout)  # measured


# %%
for T in (100, 96, 37):
    k, v = K[:, :, :T], V[:, :, :T]
    ids = top_pages(w[..., :T // 8], 40, 8, 4, 8, T)
    qq = q.unsqueeze(2)
    assert_close(page_attention(qq, k, v, ids, 8, 0.2), attend_selected(qq, k, v, page_tokens(ids, 8, T), scale=0.2))
test_fail(lambda: page_attention(q, k, v, ids, 8), contains="one decode query")

# %% [markdown]
# With `backend="triton"` the chosen pages are read where they lie by the kernel of
# [the paged decode notebook](31b_oval_kernel.ipynb) (here under Triton's interpreter): the
# same attention, and under `measure_attended` the same count of attended keys.

# %%
if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is built
for T in (100, 96, 37):
    k, v = K[:, :, :T], V[:, :, :T]
    ids, qq = top_pages(w[..., :T // 8], 40, 8, 4, 8, T), q.unsqueeze(2)
    with measure_attended() as eager: want = page_attention(qq, k, v, ids, 8, 0.2)
    with measure_attended() as fused: got = page_attention(qq, k, v, ids, 8, 0.2, backend="triton")
    assert_close(got, want, atol=1e-5, rtol=1e-5)
    test_eq(fused.per_head(), eager.per_head())
test_fail(lambda: page_attention(qq, k, v, ids, 8, backend="cuda"), contains="backend must be one of")
test_fail(lambda: page_attention(qq, k, v, ids, 8, dropout=0.1, backend="triton"), contains="without dropout")


# %% [markdown]
# ## Decode-time retrieval
#
# `PageRetrievalPolicy` plugs the pipeline into `sparsekv.hf` as a `SelectionPolicy`
# (D.3, D.8): the full cache stays resident; prefill is dense; at each decode step of a
# layer past the first `dense_layers` (layer 0 stays dense in the paper), the policy
# summarizes pages that completed since its last call (a page's summary never changes once
# built, so earlier summaries are kept and only new pages are appended to the layer's
# `PackedPages`; `built` counts the pages summarized), scores every page with the current
# query by the packed GEMM, aggregates over the group, and attends exactly to the sink,
# recent and selected pages' original keys (`page_attention`). The summary is named
# (`"oval"` with `rank` and `eta`, as in `build_summaries`) or given as a `PageSummary`
# (`OVALSummary(rank=8, eta=0.5)`; `rank` and `eta` are then unused). A summary that takes the
# output metric (OVAL) and was given none gets each layer's $G$ from that layer's `o_proj`. A
# cache that did not grow or whose first key changed (a new sequence) rebuilds the layer's summaries.
#
# Speculative retrieval with correction (the paper's FreeKV setup, D.3: 2 steps, `corr_group avg`,
# $\tau=0.8$ or $0.9$): with `spec_steps = n > 0` the pages are ranked with the layer's decode
# query from $n$ steps ago (in FreeKV this lets the recall overlap the previous steps); for
# each KV head, when the cosine between the current and that past query, averaged over the
# group's query heads, is below $\tau$, the head is re-scored with the current query. Here the
# summaries are the current ones (FreeKV's would be $n$ steps older), and there is no overlap
# to gain on the CPU: this reproduces the selection, not the latency. The counters
# `corrected / speculated` give the correction rate.
#
# The class holds the settings and `attend`; its steps follow one by one, each checked on the attention module of
# layer 1 of a tiny random model (4 query heads over 2 KV heads of 16 dims).

# %%
#| export
class PageRetrievalPolicy(SelectionPolicy):
    "Page retrieval: dense prefill; decode over sink, recent and top pages within token_budget per KV head (`method`)."
    def __init__(self, method: str | PageSummary, token_budget: int, page_size: int = 32, sink: int = 32,
                 recent: int = 32, rank: int = 8, eta: float = 0.5, policy: str = "avgSM", dense_layers: int = 1,
                 spec_steps: int = 0, tau: float = 0.9, backend: str = "torch"):
        self.spec = make_summary(method, check_int(rank, "rank", 1), eta)   # unbuilt; pages are summarized per layer
        if policy not in GQA_POLICIES: raise ValueError(f"policy must be one of {GQA_POLICIES}, got {policy!r}")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau):
            raise ValueError(f"tau must be a finite number, got {tau!r}")
        self.method, self.budget = self.spec.name, check_int(token_budget, "token_budget", 1)
        self.page_size = check_int(page_size, "page_size", 1)
        self.sink, self.recent = check_int(sink, "sink", 0), check_int(recent, "recent", 0)
        self.policy, self.dense_layers = policy, check_int(dense_layers, "dense_layers", 0)
        self.spec_steps, self.tau = check_int(spec_steps, "spec_steps", 0), float(tau)
        if backend not in PAGE_BACKENDS: raise ValueError(f"backend must be one of {PAGE_BACKENDS}, got {backend!r}")
        self.backend = backend  # of page_attention
        self.summaries, self.metrics, self.history, self.seen = {}, {}, {}, {}
        # cache layers whose batch operations (beam search) move this policy's per-row state
        self.followed = weakref.WeakSet()
        # KV-head decisions re-scored / made speculatively
        self.corrected, self.speculated = 0, 0
        # pages summarized (all heads of a page at once), summed over layers
        self.built = 0
        # a padded batch: layer -> one policy per row, each retrieving as if its row ran alone
        self.rows = {}

    def attend(self, q, k, v, ctx):
        "Decode: page_attention over kept pages (attend_selected under a mask or for several queries); else dense."
        self.follow(ctx)
        if self.padding(ctx) is not None: return super().attend(q, k, v, ctx)  # the chosen keys of select_rows
        pages = self.page_ids(q, k, v, ctx)
        if pages is None: return dense_attention(q, k, v, ctx.mask, ctx.scale, ctx.dropout)
        if ctx.mask is None and q.shape[2] == 1:
            return page_attention(q, k, v, pages, self.page_size, ctx.scale, ctx.dropout, self.backend)
        return attend_selected(q, k, v, page_tokens(pages, self.page_size, k.shape[2]), ctx.mask, ctx.scale,
                               ctx.dropout)


# %%
from sparsekv.hf import patch
from sparsekv.models import load_model as _load

tiny = _load("tiny-llama")[0]
attn = tiny.model.layers[1].self_attn
ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
def _dctx(T, B=1, layer=1, kind="decode", mask=None, module=attn):
    "The context of a decode call at layer 1 of `tiny` over T keys."
    return AttentionContext(layer_idx=layer, kind=kind, query_positions=torch.tensor([T - 1]),
                            key_positions=torch.arange(T).expand(B, 2, T), mask=mask, scale=0.25, module=module)

pol = PageRetrievalPolicy("oval", 16)
test_eq((pol.method, pol.budget, pol.page_size, pol.sink, pol.recent), ("oval", 16, 32, 32, 32))
test_eq((pol.policy, pol.dense_layers, pol.spec_steps, pol.tau, pol.built), ("avgSM", 1, 0, 0.9, 0))
test_fail(lambda: PageRetrievalPolicy("oval", 16, policy="sum"), contains="policy must be one of")
test_fail(lambda: PageRetrievalPolicy("oval", 16, tau=math.nan), contains="tau must be a finite number")
test_fail(lambda: PageRetrievalPolicy("oval", 0), contains="token_budget")


# %% [markdown]
# OVAL's metric comes from the layer's `o_proj` once per layer; a summary without a metric (Quest) needs none:

# %%
#| export
@patch_to(PageRetrievalPolicy)
def metric(self, ctx) -> Tensor | None:
    "The layer's output metric G [Hkv, d, d] from o_proj if the summary takes one and has none (OVAL), else None."
    if not self.spec.needs_metric or self.spec.G is not None: return None
    if ctx.module is None:
        raise ValueError(f"{type(self.spec).__name__} needs the attention module (ctx.module, with o_proj) "
                         "for its output metric G")
    if ctx.layer_idx not in self.metrics:
        m = ctx.module
        W = m.o_proj.weight.detach()
        self.metrics[ctx.layer_idx] = output_metric(W, m.config.num_attention_heads,
                                                    m.config.num_key_value_heads, m.head_dim)
    return self.metrics[ctx.layer_idx]


# %%
pol = PageRetrievalPolicy("oval", 16, 4, 4, 4, rank=2)
assert_close(pol.metric(_dctx(30)), output_metric(attn.o_proj.weight.detach(), 4, 2, 16))
assert pol.metric(_dctx(31)) is pol.metrics[1]
test_eq(PageRetrievalPolicy("quest", 16).metric(_dctx(30)), None)
test_fail(lambda: pol.metric(_dctx(30, layer=2, module=None)), contains="needs the attention module")


# %% [markdown]
# `track` keeps the last `spec_steps + 1` decode queries of a layer and hands back the oldest once there are
# that many; a cache that did not grow starts over:

# %%
#| export
@patch_to(PageRetrievalPolicy)
def follow(self, ctx) -> None:
    """Follow the batch operations (beam search: `apply_rows`) of the call's cache layer, from the first call that
    sees it (the prefill: a compiled decode step could not hook a layer, see `follow_batch_ops`)."""
    layer = ctx.cache_layer
    if layer is not None and layer not in self.followed:
        self.followed.add(layer)
        follow_batch_ops(layer, id(self), lambda fn, i=ctx.layer_idx: self.apply_rows(i, fn))


@patch_to(PageRetrievalPolicy)
def track(self, q: Tensor, k: Tensor, ctx) -> Tensor | None:
    "Record decode query [B, Hq, d]; return the one of spec_steps calls ago (or None); a new sequence resets."
    i, T = ctx.layer_idx, k.shape[2]
    layer = ctx.cache_layer
    self.follow(ctx)
    first, last_T, last_layer = self.seen.get(i, (None, shape_count(0), None))  # last_T: a shape (compiled once)
    # a new sequence: a cache that did not grow, or another cache object (known on the host); without a cache layer
    # to follow, a different first key (read back)
    if layer is None: new = first is None or not torch.equal(first, k[:, :, :1])
    else: new = last_layer is None or last_layer() is not layer
    if new or last_T.shape[1] >= T:
        self.summaries.pop(i, None)
        self.history[i] = []
    self.seen[i] = (k[:, :, :1].clone() if layer is None else None, shape_count(T),
                    None if layer is None else weakref.ref(layer))
    hist = self.history[i]
    hist.append(q[:, :, -1])
    del hist[: -self.spec_steps - 1]
    return hist[0] if self.spec_steps and len(hist) == self.spec_steps + 1 else None


# %%
_g = torch.Generator().manual_seed(7)
_k, _qs = torch.randn(2, 2, 40, 16, generator=_g), [torch.randn(2, 4, 1, 16, generator=_g) for _ in range(4)]
pol = PageRetrievalPolicy("quest", 16, 4, 4, 4, spec_steps=2)
got = [pol.track(_qs[j], _k[:, :, :30 + j], _dctx(30 + j, B=2)) for j in range(4)]
test_eq(got[:2], [None, None])
test_eq(got[2], _qs[0][:, :, -1])
test_eq(got[3], _qs[1][:, :, -1])
test_eq(pol.track(_qs[0], _k[:, :, :20], _dctx(20, B=2)), None)           # a cache that did not grow: a new sequence
test_eq(len(pol.history[1]), 1)
test_eq(PageRetrievalPolicy("quest", 16).track(_qs[0], _k, _dctx(40, B=2)), None)   # no speculation


# %% [markdown]
# Beam search is supported: the policy hooks each cache layer it decodes with
# (`follow_batch_ops`); when `generate` reorders, repeats or selects the cache's batch rows, the
# kept decode queries and first keys follow the rows (`apply_rows`) and the layer's summaries are rebuilt from
# the moved cache at the next step, so `num_beams=3` equals rebuilding them at every step
# (tests/test_oval_pages.py). Here rows 1, 1 of the two:

# %%
#| export
@patch_to(PageRetrievalPolicy)
def apply_rows(self, i: int, fn) -> None:
    "Layer i's cache moved its batch rows by `fn` (beam search): move the queries kept, rebuild the summaries."
    self.summaries.pop(i, None)
    if i in self.history: self.history[i] = [fn(h) for h in self.history[i]]
    if i in self.seen and self.seen[i][0] is not None: self.seen[i] = (fn(self.seen[i][0]), *self.seen[i][1:])
    if i in self.rows:  # the row policies move with their rows; a repeated row gets its own copy
        old, moved = self.rows[i], []
        for j in fn(torch.arange(len(old))).tolist():
            moved.append(copy.deepcopy(old[j]) if old[j] in moved else old[j])
        self.rows[i] = moved


# %%
pol = PageRetrievalPolicy("quest", 16, 4, 4, 4, spec_steps=1)
for j in range(2): pol.track(_qs[j], _k[:, :, :30 + j], _dctx(30 + j, B=2))
pol.summaries[1], pol.rows[1] = PackedPages("quest", 4), [PageRetrievalPolicy("quest", 16) for _ in range(2)]
row1 = pol.rows[1][1]
pol.apply_rows(1, lambda x: x[[1, 1]])
test_eq(pol.history[1], [_qs[0][[1, 1], :, -1], _qs[1][[1, 1], :, -1]])
test_eq(pol.seen[1][0], _k[[1, 1], :, :1])
assert 1 not in pol.summaries
assert pol.rows[1][0] is row1 and pol.rows[1][1] is not row1 and pol.rows[1][1].budget == 16


# %% [markdown]
# The packed summaries of a layer grow with its cache, page by page, and equal those built from scratch:

# %%
#| export
@patch_to(PageRetrievalPolicy)
def summary(self, k: Tensor, v: Tensor, ctx) -> PackedPages:
    "The layer's packed summaries of all complete pages of k, v [B, Hkv, T, d]; only new pages are built."
    i, m, P = ctx.layer_idx, self.page_size, k.shape[2] // self.page_size
    packed = self.summaries.get(i) or self.summaries.setdefault(i, PackedPages(self.spec, m))
    done = packed.n_pages
    if P > done or packed.heads is None:
        G = self.metric(ctx)
        spec = self.spec if G is None else self.spec.with_metric(G.to(k.device))
        packed.append(spec.summarize(k[:, :, done * m:P * m], v[:, :, done * m:P * m], m))
        self.built += P - done
    return packed


# %%
_v = torch.randn(2, 2, 40, 16, generator=_g)
pol = PageRetrievalPolicy("oval", 16, 4, 4, 4, rank=2, eta=0.5)
for T in (30, 37, 40):
    packed = pol.summary(_k[:, :, :T], _v[:, :, :T], _dctx(T, B=2))
    fresh = build_summaries("oval", _k[:, :, :T], _v[:, :, :T], 4, rank=2, eta=0.5, G=pol.metrics[1])
    for n, x in fresh.tensors.items(): assert_close(packed.tensors[n], x)
test_eq((packed.n_pages, pol.built), (10, 10))                           # each page summarized once


# %%
#| export
@patch_to(PageRetrievalPolicy)
def weights(self, summ: PackedPages, q: Tensor, Hkv: int, scale: float) -> Tensor:
    "Aggregated page weights [B, Hkv, P] for queries q [B, Hq, d]."
    return aggregate_gqa(summ.scores(q, scale), Hkv, self.policy)


# %%
_q0 = _qs[0][:, :, 0]
assert_close(pol.weights(packed, _q0, 2, 0.25), aggregate_gqa(score_pages("oval", fresh, _q0, 0.25), 2))
test_eq(PageRetrievalPolicy("oval", 16, policy="max").weights(packed, _q0, 2, 0.25),
        aggregate_gqa(packed.scores(_q0, 0.25), 2, "max"))


# %% [markdown]
# **Padded batches.** In a left-padded batch the model's mask hides each row's padding. Pages, sink and
# budget then belong to the row, not to the batch's columns: the policy keeps one policy per row and layer
# (`row_policy`, no shared state but the output metrics), and each retrieves over its row's real keys as
# if the row ran alone (`select_rows`): the row's first page (its sink) starts at its first real token,
# its page grid follows from there, and its budget counts its real tokens. The rows' choices are a boolean
# `[B, Hkv, T]`, attended by `attend_chosen`; the row policies follow beam search with their rows.
# `padding` tells such a call from the others, by the real keys of the mask:

# %%
#| export
@patch_to(PageRetrievalPolicy)
def padding(self, ctx) -> Tensor | None:
    "The real keys [B, T] of a padded batch's decode call in a retrieval layer; None otherwise."
    if ctx.kind != "decode" or ctx.layer_idx < self.dense_layers: return None
    return ctx.real_keys()


# %%
_mask = torch.ones(2, 1, 1, 30, dtype=torch.bool)
_mask[1, ..., :5] = False                                                 # row 1: 5 padding tokens
test_eq(pol.padding(_dctx(30, B=2, mask=_mask)), _mask[:, 0, 0])
test_eq(pol.padding(_dctx(30, B=2)), None)                                # nothing padded
test_eq(pol.padding(_dctx(30, B=2, mask=_mask, kind="prefill")), None)
test_eq(pol.padding(_dctx(30, B=2, mask=_mask, layer=0)), None)           # a dense layer


# %% [markdown]
# `page_ids` runs the steps above for a decode query. Checked with a small budget: each decode step's output
# equals dense attention restricted to the tokens `select_pages` picks from summaries built from scratch, and the
# incrementally extended summaries equal those built from scratch.

# %%
#| export
@patch_to(PageRetrievalPolicy)
def page_ids(self, q, k, v, ctx):
    "The complete pages [B, Hkv, n_p] a decode query keeps (see top_pages); None when select would return None."
    if ctx.kind != "decode" or ctx.layer_idx < self.dense_layers: return None
    past = self.track(q, k, ctx)
    T, Hkv = k.shape[2], k.shape[1]
    if T <= self.budget: return None
    summ, now = self.summary(k, v, ctx), q[:, :, -1]
    if past is None: w = self.weights(summ, now, Hkv, ctx.scale)
    else:
        # speculative: score with the query from spec_steps ago;
        # re-score a KV head whose group-average cosine fell below tau
        cos = torch.nn.functional.cosine_similarity(past.float(), now.float(), dim=-1)
        fix = cos.reshape(cos.shape[0], Hkv, -1).mean(-1) < self.tau
        w = self.weights(summ, past, Hkv, ctx.scale)
        if fix.any(): w = torch.where(fix[..., None], self.weights(summ, now, Hkv, ctx.scale), w)
        self.corrected, self.speculated = self.corrected + int(fix.sum()), self.speculated + fix.numel()
    return top_pages(w, self.budget, self.page_size, self.sink, self.recent, T)


# %%
g = torch.Generator().manual_seed(1)
pol = PageRetrievalPolicy("oval", token_budget=16, page_size=4, sink=4, recent=4, rank=2, eta=0.5)
kk, vv = torch.randn(1, 2, 50, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g)
for T in (30, 31, 34, 41, 50):
    qq = torch.randn(1, 4, 1, 16, generator=g)
    ctx = AttentionContext(layer_idx=1, kind="decode", query_positions=torch.tensor([T - 1]),
                           key_positions=torch.arange(T).expand(1, 2, T), mask=None, scale=0.25, module=attn)
    out = pol(qq, kk[:, :, :T], vv[:, :, :T], ctx)
    Gl = output_metric(attn.o_proj.weight.detach(), 4, 2, 16)
    fresh = build_summaries("oval", kk[:, :, :T], vv[:, :, :T], 4, rank=2, eta=0.5, G=Gl)
    for n, x in fresh.tensors.items(): assert_close(pol.summaries[1].tensors[n], x)
    idx = select_pages(aggregate_gqa(score_pages("oval", fresh, qq[:, :, 0]), 2), 16, 4, 4, 4, T)
    keep = torch.zeros(1, 4, 1, T, dtype=torch.bool)
    for h in range(4): keep[0, h, 0, idx[0, h // 2]] = True
    probs = torch.where(keep, qq @ kk[:, :, :T].repeat_interleave(2, 1).mT * 0.25, -math.inf).softmax(-1)
    ref = probs @ vv[:, :, :T].repeat_interleave(2, 1)
    assert_close(out, ref)


# %% [markdown]
# `select` returns the tokens of those pages. Speculation: with $\tau$ below every cosine no head is corrected and
# the pages are those of the query 2 steps back; with $\tau$ above every cosine every head is re-scored and the
# selection is the plain one.

# %%
#| export
@patch_to(PageRetrievalPolicy)
def select(self, q, k, v, ctx):
    """Token indices [B, Hkv, n] for a decode query (a padded batch: chosen keys [B, Hkv, T], see `select_rows`);
    None (dense) at prefill, in dense layers, when the cache fits."""
    real = self.padding(ctx)
    if real is not None: return self.select_rows(q, k, v, ctx, real)
    pages = self.page_ids(q, k, v, ctx)
    return None if pages is None else page_tokens(pages, self.page_size, k.shape[2])


# %%
def _steps(pol, qs, T0=30):
    outs = []
    for j, qq in enumerate(qs):
        T = T0 + j
        ctx = AttentionContext(layer_idx=1, kind="decode", query_positions=torch.tensor([T - 1]),
                               key_positions=torch.arange(T).expand(1, 2, T), mask=None, scale=0.25, module=attn)
        outs.append(pol.select(qq, kk[:, :, :T], vv[:, :, :T], ctx))
    return outs

qs = [torch.randn(1, 4, 1, 16, generator=g) for _ in range(5)]
plain = _steps(PageRetrievalPolicy("quest", 16, 4, 4, 4), qs)
never = PageRetrievalPolicy("quest", 16, 4, 4, 4, spec_steps=2, tau=-2)
always = PageRetrievalPolicy("quest", 16, 4, 4, 4, spec_steps=2, tau=2)
for j, (a, b, c) in enumerate(zip(plain, _steps(never, qs), _steps(always, qs))):
    test_eq(c, a)
    T = 30 + j
    summ = build_summaries("quest", kk[:, :, :T], None, 4)
    w = aggregate_gqa(score_pages("quest", summ, qs[j - 2 if j >= 2 else j][:, :, 0], 0.25), 2)
    test_eq(b, select_pages(w, 16, 4, 4, 4, T))
test_eq((never.corrected, never.speculated, always.corrected, always.speculated), (0, 6, 6, 6))


# %% [markdown]
# A row's policy has this one's settings and output metrics, and no state of its own yet:

# %%
#| export
@patch_to(PageRetrievalPolicy)
def row_policy(self) -> PageRetrievalPolicy:
    "A policy with this one's settings and no state (the output metrics are shared), for one row of a batch."
    row = copy.copy(self)
    row.summaries, row.history, row.seen, row.rows, row.followed = {}, {}, {}, {}, weakref.WeakSet()
    row.corrected = row.speculated = row.built = 0
    return row


# %%
row = never.row_policy()
test_eq((row.budget, row.spec_steps, row.tau, row.speculated, row.summaries, row.history), (16, 2, -2.0, 0, {}, {}))
test_eq(never.speculated, 6)                                               # the policy keeps its own
row = pol.row_policy()
assert row.metrics is pol.metrics and row.summaries is not pol.summaries and row.built == 0 < pol.built


# %% [markdown]
# Padded batches, with every summary: a prompt of 40 tokens and one of 27 left-padded to 40 (13 padding
# tokens, so its pages are not those of the batch's columns) generate, row by row, the tokens each
# generates alone; at decode the padded row's sink page is its first 4 real tokens, and no padding is kept.

# %%
#| export
@patch_to(PageRetrievalPolicy)
def select_rows(self, q, k, v, ctx, real: Tensor) -> Tensor | None:
    """A padded batch: each row retrieves as if alone, over its real keys (`real` [B, T]: its pages, sink and budget
    start at its first real token); the chosen keys [B, Hkv, T], or None when every row keeps all its keys."""
    B, Hkv = k.shape[:2]
    if len(self.rows.get(ctx.layer_idx, ())) != B: self.rows[ctx.layer_idx] = [self.row_policy() for _ in range(B)]
    self.follow(ctx)  # beam search moves the row policies with their rows
    chosen, dropped = real[:, None].expand(B, Hkv, -1).clone(), False
    for b, row in enumerate(self.rows[ctx.layer_idx]):
        keys = real[b].nonzero()[:, 0]
        before = row.built, row.corrected, row.speculated
        pages = row.page_ids(q[b:b + 1], k[b:b + 1, :, keys], v[b:b + 1, :, keys],
                             ctx.row_context(b, len(keys), q.shape[2]))
        # the counters count every row's work
        self.built += row.built - before[0]
        self.corrected += row.corrected - before[1]
        self.speculated += row.speculated - before[2]
        if pages is None: continue
        chosen[b] = False
        chosen[b].scatter_(1, keys[page_tokens(pages, self.page_size, len(keys))[0]], True)
        dropped = True
    return chosen if dropped else None


# %%
class _Chosen(PageRetrievalPolicy):
    "Keeps the last decode call's choice of layer 1."
    def select(self, q, k, v, ctx):
        out = super().select(q, k, v, ctx)
        if ctx.layer_idx == 1: self.last = out
        return out

ids2 = torch.randint(3, 250, (1, 27), generator=torch.Generator().manual_seed(5))
padded, pmask = torch.zeros(2, 40, dtype=torch.long), torch.zeros(2, 40, dtype=torch.long)
padded[0], pmask[0], padded[1, 13:], pmask[1, 13:] = ids[0], 1, ids2[0], 1
opts, gen = dict(token_budget=12, page_size=4, sink=4, recent=4, rank=2), dict(max_new_tokens=5, do_sample=False,
                                                                                pad_token_id=0)
with torch.no_grad():
    for mt in METHODS:
        pol = _Chosen(mt, **opts)
        with patch(tiny, pol): out = tiny.generate(padded, attention_mask=pmask, **gen)
        for b, row in enumerate((ids, ids2)):
            with patch(tiny, PageRetrievalPolicy(mt, **opts)):
                test_eq(out[b, 40 - row.shape[1]:], tiny.generate(row, attention_mask=torch.ones_like(row), **gen)[0])
        test_eq((pol.last[1, :, 13:17].all().item(), pol.last[1, :, :13].any().item()), (True, False))
        assert (pol.last.sum(-1) < pmask.sum(-1)[:, None] + 4).all()  # both rows select (4 tokens decoded so far)

# %% [markdown]
# The kernel in the policy: generation with `backend="triton"` (under the interpreter here)
# chooses the same tokens as the eager backend, its logits equal at every step.

# %%
with torch.no_grad():
    for mt in METHODS:
        runs = {}
        for backend in PAGE_BACKENDS:
            with patch(tiny, PageRetrievalPolicy(mt, **opts, backend=backend)):
                runs[backend] = tiny.generate(ids, attention_mask=torch.ones_like(ids), output_logits=True,
                                              return_dict_in_generate=True, **gen)
        test_eq(runs["triton"].sequences, runs["torch"].sequences)
        assert_close(torch.stack(runs["triton"].logits), torch.stack(runs["torch"].logits), atol=1e-4, rtol=1e-4)
test_fail(lambda: PageRetrievalPolicy("oval", 16, backend="cuda"), contains="backend must be one of")


# %% [markdown]
# Generation on the tiny model: when sink and recent cover the sequence (the retrieval path
# runs but keeps every token), generation equals dense generation, and the summaries follow the cache in every
# retrieval layer (layer 0 stays dense).

# %%
def _greedy(n=6):
    return tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
with torch.no_grad():
    plain = _greedy()
    pol = PageRetrievalPolicy("oval", token_budget=8, page_size=4, sink=0, recent=64, rank=2)
    with patch(tiny, pol): test_eq(_greedy(), plain)
test_eq(sorted(pol.summaries), [1])                                          # layer 0 stayed dense
test_eq(pol.summaries[1].n_pages, 45 // 4)                                   # summaries followed the cache

# %% [markdown]
# A `PageSummary` in place of the name: `OVALSummary(rank=2, eta=0.5)` gives the outputs of
# `"oval"` with `rank=2, eta=0.5` bit for bit (each layer's $G$ from its `o_proj`); one given
# its own $G$ (here the identity) summarizes with that $G$.

# %%
eye = torch.eye(16).expand(2, 16, 16)
by_name = PageRetrievalPolicy("oval", 16, 4, 4, 4, rank=2, eta=0.5)
by_class = PageRetrievalPolicy(OVALSummary(rank=2, eta=0.5), 16, 4, 4, 4)
fixed = PageRetrievalPolicy(OVALSummary(rank=2, eta=0.5, G=eye), 16, 4, 4, 4)
for T in (30, 41):
    qq = torch.randn(1, 4, 1, 16, generator=g)
    ctx = AttentionContext(layer_idx=1, kind="decode", query_positions=torch.tensor([T - 1]),
                           key_positions=torch.arange(T).expand(1, 2, T), mask=None, scale=0.25, module=attn)
    assert torch.equal(by_class(qq, kk[:, :, :T], vv[:, :, :T], ctx), by_name(qq, kk[:, :, :T], vv[:, :, :T], ctx))
    fixed(qq, kk[:, :, :T], vv[:, :, :T], ctx)
    for n, x in build_summaries("oval", kk[:, :, :T], vv[:, :, :T], 4, rank=2, eta=0.5, G=eye).tensors.items():
        assert_close(fixed.summaries[1].tensors[n], x)
test_eq((by_class.method, fixed.metric(ctx), len(by_class.metrics)), ("oval", None, 1))
