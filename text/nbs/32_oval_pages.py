# %% [markdown]
# # OVAL page retrieval
#
# > Page summaries (Quest, ArkVale, key PCA, OVAL, oracle), their scores, GQA aggregation, page selection within a token budget, and storage cost.

# %%
#| default_exp oval.pages

# %% [markdown]
# A page retriever keeps the full KV cache and, for every decode query, attends exactly to a
# few *pages* of $m$ consecutive tokens (OVAL §1, D.8). Which pages is decided from a
# compact *summary* stored beside each completed page. This notebook builds the summaries
# the OVAL paper compares (§2, §4):
#
# | method | summary per page and KV head | page score for a query $q$ (log domain) |
# |---|---|---|
# | Quest | per-channel min $\ell$ and max $u$ of the keys | $s\sum_c \max(q_c \ell_c,\ q_c u_c)$ |
# | ArkVale | centre $c$ and radius $\rho$ of a ball holding the keys | $s\,(q\cdot c + \lVert q\rVert \rho)$ |
# | key PCA (LOCKS) | $\mu$, $B$, $R$ from `page_basis(..., eta=0)` | $\log\sum_t \exp(s\,(R_t\cdot B^\top q + \mu\cdot q))$ |
# | OVAL | $\mu$, $B$, $R$ from `page_basis(..., eta)`, $\eta\in(0,1]$ | same as key PCA |
# | oracle | the keys themselves | $\log\sum_t \exp(s\, k_t\cdot q)$, the exact page LSE |
#
# with $s = 1/\sqrt d$. Only complete pages get a summary; the tokens of a trailing
# partial page are always attended ("recent"). Keys are post-RoPE, laid out `[B, Hkv, T, d]`.
#
# **Our reading of ArkVale.** The OVAL paper only says ArkVale "summarizes pages with
# compact geometric representations" [13]; the issue asks for a centre/radius summary. We
# use the bounding ball around the page mean, $c=\mu$, $\rho=\max_t\lVert k_t-\mu\rVert$,
# stored as $d+1$ scalars. By Cauchy–Schwarz, $q\cdot k_t = q\cdot c + q\cdot(k_t-c) \le
# q\cdot c + \lVert q\rVert\rho$, so like Quest's it is an upper bound on every key's logit
# in the page (Quest's holds because $q_c k_c \le \max(q_c\ell_c, q_c u_c)$ channel by
# channel). The ArkVale paper itself also considers a bounding cuboid; that variant is Quest's box.

# %%
#| export
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from sparsekv.eval import attention_fidelity
from sparsekv.hf import DensePolicy, SelectionPolicy, attend_selected, dense_attention
from sparsekv.oval.basis import output_metric, page_basis, page_lse_exact, page_score

# %%
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

# %% [markdown]
# ## Pages and summaries
#
# `split_pages` views the complete pages of a cache `[B, H, T, d]` as `[B, H, P, m, d]`,
# $P=\lfloor T/m\rfloor$. A summary records the method, the page size, the cache length it
# was built from and its tensors, each `[B, Hkv, P, ...]`.

# %%
#| export
METHODS = ("quest", "arkvale", "keypca", "oval", "oracle")

def _check_method(method) -> str:
    if method not in METHODS: raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method

def _check_int(x, name: str, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo: raise ValueError(f"{name} must be an int >= {lo}, got {x!r}")
    return x

def _check_cache(x, name: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point(): raise TypeError(f"{name} must be a floating-point torch.Tensor")
    if x.dim() != 4: raise ValueError(f"{name} must be [B, Hkv, T, d], got shape {tuple(x.shape)}")
    return x

def split_pages(x: Tensor, page_size: int) -> Tensor:
    "The complete pages of a cache x [B, H, T, d] as [B, H, P, m, d], P = T // m (a trailing partial page is left out)."
    _check_cache(x, "x")
    m = _check_int(page_size, "page_size", 1)
    B, H, T, d = x.shape
    P = T // m
    return x[:, :, : P * m].reshape(B, H, P, m, d)

@dataclass
class PageSummary:
    "Summaries of the complete pages of one cache: method, page size m, cache length T, tensors each [B, Hkv, P, ...]."
    method: str
    page_size: int
    length: int
    tensors: dict

    @property
    def n_pages(self) -> int:
        "Number of summarized (complete) pages P."
        return self.length // self.page_size


# %% [markdown]
# The builders. Quest keeps the per-channel extrema; ArkVale the mean and the largest
# distance to it; the basis methods call `page_basis` batched over `[B, Hkv, P]` pages, with
# the output metric $G$ `[Hkv, d, d]` (from `output_metric`) broadcast over batch and pages;
# the oracle keeps the keys.

# %%
#| export
def quest_summary(K: Tensor, page_size: int) -> dict:
    "Quest (§2): per-channel key min and max of each complete page, each [B, Hkv, P, d]."
    pages = split_pages(K, page_size)
    return {"kmin": pages.amin(-2), "kmax": pages.amax(-2)}

def arkvale_summary(K: Tensor, page_size: int) -> dict:
    "ArkVale as a bounding ball (our reading): centre = page mean [B, Hkv, P, d], radius = max_t ||k_t - centre|| [B, Hkv, P]."
    pages = split_pages(K, page_size)
    centre = pages.mean(-2)
    return {"centre": centre, "radius": (pages - centre.unsqueeze(-2)).norm(dim=-1).amax(-1)}

def basis_summary(K: Tensor, V: Tensor, page_size: int, rank: int = 8, eta: float = 0.5, G: Tensor | None = None) -> dict:
    "OVAL / key-PCA summary (§3.3): page_basis per page, mu [B, Hkv, P, d], B [B, Hkv, P, d, r], R [B, Hkv, P, m, r]."
    _check_cache(V, "V")
    if V.shape[:3] != K.shape[:3]: raise ValueError(f"V {tuple(V.shape)} must match K {tuple(K.shape)} in batch, heads and length")
    if G is not None:
        if not isinstance(G, Tensor) or G.dim() != 3 or G.shape[0] != K.shape[1]:
            raise ValueError(f"G must be [Hkv={K.shape[1]}, dv, dv] (see output_metric), got {getattr(G, 'shape', type(G).__name__)}")
        G = G[:, None]                                                     # broadcast over pages
    mu, B, R = page_basis(split_pages(K, page_size), split_pages(V, page_size), G, rank=rank, eta=eta)
    return {"mu": mu, "B": B, "R": R}

def build_summaries(method: str, K: Tensor, V: Tensor | None, page_size: int, rank: int = 8, eta: float = 0.5,
                    G: Tensor | None = None) -> PageSummary:
    "Summaries of the complete pages of K (and V for OVAL) [B, Hkv, T, d]: 'quest', 'arkvale', 'keypca' (eta = 0), 'oval' (eta, G), 'oracle'."
    _check_method(method)
    _check_cache(K, "K")
    m = _check_int(page_size, "page_size", 1)
    if method == "quest": t = quest_summary(K, m)
    elif method == "arkvale": t = arkvale_summary(K, m)
    elif method == "oracle": t = {"K": split_pages(K, m)}
    else:
        if V is None and method == "oval": raise ValueError("V is required for method 'oval'")
        # key PCA never looks at the values (eta = 0), so V may be omitted
        t = basis_summary(K, K if V is None else V, m, rank, 0.0 if method == "keypca" else eta, None if method == "keypca" else G)
    return PageSummary(method, m, K.shape[2], t)


# %% [markdown]
# ## Scores
#
# Queries arrive as `[B, Hq, d]` (one decode step) or `[B, Hq, S, d]` (several queries
# scored against the same pages). Query head $h G + g$ reads the summaries of KV head $h$,
# so we view the queries as `[B, Hkv, G, S, 1, d]` against summaries `[B, Hkv, 1, 1, P, ...]`
# and broadcast. Scores are in the log domain (they are logits or log-masses) and come back
# as `[B, Hq, P]` or `[B, Hq, S, P]`.

# %%
#| export
def _group_queries(q: Tensor, Hkv: int) -> tuple[Tensor, bool]:
    "q [B, Hq, d] or [B, Hq, S, d] -> [B, Hkv, G, S, 1, d] and whether S was added."
    if not isinstance(q, Tensor) or not q.is_floating_point(): raise TypeError("q must be a floating-point torch.Tensor")
    if q.dim() not in (3, 4): raise ValueError(f"q must be [B, Hq, d] or [B, Hq, S, d], got shape {tuple(q.shape)}")
    single = q.dim() == 3
    if single: q = q.unsqueeze(2)
    B, Hq, S, d = q.shape
    if Hq % Hkv: raise ValueError(f"the query heads ({Hq}) must be a multiple of the summary's KV heads ({Hkv})")
    return q.reshape(B, Hkv, Hq // Hkv, S, 1, d), single

def _pages(x: Tensor) -> Tensor:
    "[B, Hkv, P, *] -> [B, Hkv, 1, 1, P, *] to broadcast against grouped queries."
    return x.unsqueeze(2).unsqueeze(3)

def quest_score(q: Tensor, kmin: Tensor, kmax: Tensor, scale: float) -> Tensor:
    "Quest upper bound scale * sum_c max(q_c kmin_c, q_c kmax_c): q [..., d], kmin/kmax [..., d] broadcast -> [...]."
    return torch.maximum(q * kmin, q * kmax).sum(-1) * scale

def arkvale_score(q: Tensor, centre: Tensor, radius: Tensor, scale: float) -> Tensor:
    "Bounding-ball upper bound scale * (q . c + ||q|| rho): q [..., d], centre [..., d], radius [...] broadcast -> [...]."
    return ((q * centre).sum(-1) + q.norm(dim=-1) * radius) * scale

def score_pages(method: str, summary: PageSummary, q: Tensor, scale: float | None = None) -> Tensor:
    "Log-domain page scores [B, Hq, P] (or [B, Hq, S, P] for q [B, Hq, S, d]) of the summary's pages; scale defaults to 1/sqrt(d)."
    _check_method(method)
    if not isinstance(summary, PageSummary): raise TypeError(f"summary must be a PageSummary, got {type(summary).__name__}")
    if summary.method != method: raise ValueError(f"summary was built for {summary.method!r}, not {method!r}")
    t = summary.tensors
    first = next(iter(t.values()))
    Bsz, Hkv, P = first.shape[:3]
    qg, single = _group_queries(q, Hkv)
    d = qg.shape[-1]
    if qg.shape[0] != Bsz: raise ValueError(f"q's batch ({qg.shape[0]}) must match the summary's ({Bsz})")
    s = 1 / math.sqrt(d) if scale is None else float(scale)
    wd = torch.promote_types(q.dtype, torch.float32)
    qg = qg.to(wd)
    if method == "quest": out = quest_score(qg, _pages(t["kmin"]).to(wd), _pages(t["kmax"]).to(wd), s)
    elif method == "arkvale": out = arkvale_score(qg, _pages(t["centre"]).to(wd), _pages(t["radius"]).to(wd), s)
    elif method == "oracle": out = page_lse_exact(qg, _pages(t["K"]), scale=s)
    else: out = page_score(qg, _pages(t["mu"]), _pages(t["B"]), _pages(t["R"]), scale=s)
    out = out.reshape(Bsz, -1, out.shape[-2], P)                            # [B, Hq, S, P]
    return out[:, :, 0] if single else out


# %% [markdown]
# Brute-force references: an explicit loop over batch, query head and page that computes
# each definition from the original keys of the page (for the bounds) or from the summary
# tensors (for the basis score).

# %%
#| export
def score_pages_reference(method: str, K: Tensor, q: Tensor, summary: PageSummary) -> Tensor:
    "Loop reference of score_pages for q [B, Hq, d]: Quest/ArkVale/oracle from the keys K [B, Hkv, T, d], basis methods from the summary's tensors."
    Bsz, Hq, d = q.shape
    Hkv, m, P = K.shape[1], summary.page_size, summary.n_pages
    s = 1 / math.sqrt(d)
    out = torch.empty(Bsz, Hq, P, dtype=torch.float64)
    for b in range(Bsz):
        for h in range(Hq):
            x = q[b, h].double()
            kv = h // (Hq // Hkv)
            for p in range(P):
                Kp = K[b, kv, p * m:(p + 1) * m].double()
                if method == "quest":
                    lo, hi = Kp.min(0).values, Kp.max(0).values
                    out[b, h, p] = s * sum(max(x[c] * lo[c], x[c] * hi[c]) for c in range(d))
                elif method == "arkvale":
                    c = Kp.mean(0)
                    out[b, h, p] = s * (x @ c + x.norm() * max((Kp[t] - c).norm() for t in range(m)))
                elif method == "oracle":
                    out[b, h, p] = math.log(sum(math.exp(s * float(Kp[t] @ x)) for t in range(m)))
                else:
                    mu, Bb, R = (summary.tensors[n][b, kv, p].double() for n in ("mu", "B", "R"))
                    out[b, h, p] = math.log(sum(math.exp(s * float(R[t] @ (Bb.T @ x) + mu @ x)) for t in range(m)))
    return out


# %% [markdown]
# Check every method against its loop on a random GQA cache (2 KV heads, 3 query heads each),
# with a trailing partial page that must be ignored:

# %%
def _random_cache(B=2, Hkv=2, T=4 * 8 + 5, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(B, Hkv, T, d, generator=g, dtype=dtype) * torch.logspace(0, -1, d, dtype=dtype) + torch.randn(d, generator=g, dtype=dtype)
    V = torch.randn(B, Hkv, T, d, generator=g, dtype=dtype)
    A = torch.randn(Hkv, d, d, generator=g, dtype=dtype)
    return K, V, A.mT @ A / d

K, V, G = _random_cache()
q = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
for method in METHODS:
    summ = build_summaries(method, K, V, page_size=8, rank=3, eta=0.5, G=G)
    test_eq(summ.n_pages, 4)
    sc = score_pages(method, summ, q)
    test_eq(sc.shape, (2, 6, 4))
    assert_close(sc, score_pages_reference(method, K, q, summ))
    # several queries at once give the same scores as one at a time
    assert_close(score_pages(method, summ, torch.stack([q, 2 * q], 2)), torch.stack([sc, score_pages(method, summ, 2 * q)], 2))

# %% [markdown]
# Quest's and ArkVale's scores are upper bounds on the logit $s\,k_t\cdot q$ of every key in
# the page, hence also on $\max_t$; and since $\log\sum_t e^{z_t} \le \max_t z_t + \log m$,
# the oracle's log-mass is bounded by them plus $\log m$. At rank $m-1$ the basis methods
# represent every centred key exactly ($X$ has rank $\le m-1$), so their score equals the
# oracle's exact page LSE:

# %%
logits = torch.einsum("bhgd,bhpmd->bhgpm", q.reshape(2, 2, 3, 16), split_pages(K, 8)).reshape(2, 6, 4, 8) / 4
oracle = score_pages("oracle", build_summaries("oracle", K, V, 8), q)
for method in ("quest", "arkvale"):
    sc = score_pages(method, build_summaries(method, K, V, 8), q)
    assert (sc.unsqueeze(-1) >= logits - 1e-12).all(), method
    assert (sc + math.log(8) >= oracle - 1e-12).all(), method
for method in ("keypca", "oval"):
    assert_close(score_pages(method, build_summaries(method, K, V, 8, rank=7, G=G), q), oracle)
    # at a low rank the score is only an approximation
    assert not torch.allclose(score_pages(method, build_summaries(method, K, V, 8, rank=1, G=G), q), oracle)

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
    "Per-KV-head page weights [B, Hkv, (S,) P] from [B, Hq, (S,) P] log scores: softmax over pages, then mean ('avgSM') or max over the group."
    if policy not in GQA_POLICIES: raise ValueError(f"policy must be one of {GQA_POLICIES}, got {policy!r}")
    if not isinstance(page_scores, Tensor) or not page_scores.is_floating_point(): raise TypeError("page_scores must be a floating-point tensor")
    if page_scores.dim() not in (3, 4): raise ValueError(f"page_scores must be [B, Hq, P] or [B, Hq, S, P], got {tuple(page_scores.shape)}")
    Hkv = _check_int(num_kv_heads, "num_kv_heads", 1)
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

# %%
#| export
def always_kept(T: int, page_size: int, sink: int, recent: int) -> tuple[int, int]:
    "The always-kept regions [0, sink_end) and [recent_start, T), rounded out to page boundaries."
    m = page_size
    sink_end = min(T, -(-sink // m) * m)
    recent_start = max(sink_end, min((T // m) * m, ((T - recent) // m) * m if recent else T))
    return sink_end, recent_start

def top_pages(page_scores: Tensor, token_budget: int, page_size: int, sink: int, recent: int, T: int) -> Tensor:
    "Complete pages [B, Hkv, (S,) n_p] each KV head keeps, sorted: sink pages, the top-weighted pages within token_budget, recent pages."
    if not isinstance(page_scores, Tensor) or not page_scores.is_floating_point(): raise TypeError("page_scores must be a floating-point tensor")
    m = _check_int(page_size, "page_size", 1)
    T = _check_int(T, "T", 1)
    sink, recent = _check_int(sink, "sink", 0), _check_int(recent, "recent", 0)
    budget = _check_int(token_budget, "token_budget", 1)
    P = T // m
    if page_scores.dim() < 3 or page_scores.shape[-1] != P:
        raise ValueError(f"page_scores must be [B, Hkv, (S,) P] with P = T // page_size = {P}, got {tuple(page_scores.shape)}")
    if page_scores.isnan().any(): raise ValueError("page_scores must not contain NaN")
    lead, dev = page_scores.shape[:-1], page_scores.device
    if T <= budget: return torch.arange(P, device=dev).expand(*lead, P)
    sink_end, recent_start = always_kept(T, m, sink, recent)
    first, last = sink_end // m, recent_start // m                           # selectable pages [first, last)
    k = max(0, min(last - first, (budget - sink_end - (T - recent_start)) // m))
    top = torch.sort(page_scores[..., first:last], dim=-1, descending=True, stable=True).indices[..., :k] + first
    return torch.cat([torch.arange(first, device=dev).expand(*lead, -1), torch.sort(top, dim=-1).values,
                      torch.arange(last, P, device=dev).expand(*lead, -1)], -1)

def page_tokens(pages: Tensor, page_size: int, T: int) -> Tensor:
    "Token indices [..., n_p * m + T % m] of complete pages [..., n_p], followed by the trailing partial page [T - T % m, T)."
    m = _check_int(page_size, "page_size", 1)
    tail = torch.arange(T // m * m, _check_int(T, "T", 1), device=pages.device)
    return torch.cat([(pages.unsqueeze(-1) * m + torch.arange(m, device=pages.device)).flatten(-2), tail.expand(*pages.shape[:-1], -1)], -1)

def select_pages(page_scores: Tensor, token_budget: int, page_size: int, sink: int, recent: int, T: int) -> Tensor:
    "Token indices [B, Hkv, (S,) n] per KV head: sink and recent pages plus the top-weighted pages that fit in token_budget."
    return page_tokens(top_pages(page_scores, token_budget, page_size, sink, recent, T), page_size, T)

def select_pages_reference(page_scores: Tensor, token_budget: int, page_size: int, sink: int, recent: int, T: int) -> list:
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
g = torch.Generator().manual_seed(3)
for T, budget, sink, recent in [(100, 40, 4, 8), (100, 40, 0, 0), (96, 64, 10, 20), (100, 100, 4, 8), (100, 20, 8, 20), (37, 24, 1, 1), (64, 33, 0, 32)]:
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
# the oracle reads the page's $m d$ keys, stored nowhere extra.

# %%
#| export
def summary_scalars(method: str, page_size: int, head_dim: int, rank: int = 8) -> int:
    "Scalars stored per page and KV head by a method's summary (oracle: the m*d keys it reads)."
    _check_method(method)
    m, d = _check_int(page_size, "page_size", 1), _check_int(head_dim, "head_dim", 1)
    r = min(_check_int(rank, "rank", 1), m - 1, d)
    return {"quest": 2 * d, "arkvale": d + 1, "keypca": d + d * r + m * r, "oval": d + d * r + m * r, "oracle": m * d}[method]

def storage_table(page_size: int = 32, head_dim: int = 64, rank: int = 8, dtype: torch.dtype = torch.bfloat16) -> pd.DataFrame:
    "Per-page, per-KV-head summary storage of every method: scalars, bytes in dtype, and the ratio to the page's keys."
    itemsize = torch.empty((), dtype=dtype).element_size()
    keys = page_size * head_dim
    rows = [{"method": mt, "scalars": summary_scalars(mt, page_size, head_dim, rank)} for mt in METHODS]
    for r in rows: r.update(bytes=r["scalars"] * itemsize, vs_keys=r["scalars"] / keys)
    return pd.DataFrame(rows)


# %%
tab = storage_table()
tab

# %%
K, V, G = _random_cache(T=64, d=16)
for mt in METHODS:
    summ = build_summaries(mt, K, V, 8, rank=3, G=G)
    stored = sum(x[0, 0].numel() for x in summ.tensors.values()) // summ.n_pages  # per page and KV head
    test_eq(stored, summary_scalars(mt, 8, 16, rank=3))
test_eq(summary_scalars("oval", 4, 64, rank=8), 64 + 64 * 3 + 4 * 3)   # rank cap m - 1


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
def retrieval_quality(method: str, q: Tensor, K: Tensor, V: Tensor, page_size: int, token_budget: int, sink: int, recent: int,
                      rank: int = 8, eta: float = 0.5, G: Tensor | None = None, policy: str = "avgSM") -> tuple[Tensor, Tensor]:
    "Mass recall and relative output error [B, Hq, S] of page retrieval for the last S queries q [B, Hq, S, d] over the cache K, V [B, Hkv, T, d]."
    summ = build_summaries(method, K, V, page_size, rank, eta, G)
    w = aggregate_gqa(score_pages(method, summ, q), K.shape[1], policy)
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
for mt, (mass, err) in res.items():
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
#| slow
from sparsekv.models import load_model, model_info
from sparsekv.data import prose_text
from sparsekv.hf import patch

# %%
#| slow
model, tok = load_model("smollm2-135m")
info = model_info(model)
text = prose_text()
arms = [("quest", 0.0), ("arkvale", 0.0), ("oracle", 0.0), ("keypca", 0.0)] + [("oval", e) for e in (0.25, 0.5, 0.75, 1.0)]
rows, S = [], 16
for start in (200_000, 1_200_000):                                           # two windows of prose
    ids = tok(text[start:start + 12_000], return_tensors="pt").input_ids[:, :2048]
    cap = CapturePolicy()
    with torch.no_grad(), patch(model, cap): model(ids)
    for layer in range(1, info.num_layers):
        q, k, v = cap.qkv[layer]
        Gl = output_metric(model.model.layers[layer].self_attn.o_proj.weight.detach(), info.num_q_heads, info.num_kv_heads, info.head_dim)
        for mt, eta in arms:
            mass, err = retrieval_quality(mt, q[:, :, -S:], k, v, 32, 256, 32, 32, rank=8, eta=eta, G=Gl)
            rows.append({"window": start, "layer": layer, "method": mt, "eta": eta, "mass_recall": mass.mean().item(), "output_error": err.mean().item()})
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
# Each method's score is a function of inner products of a query feature $\phi(q)$ with the
# page's rows $W_p$ (with $s = 1/\sqrt d > 0$ folded into the query):
#
# - **Quest**: since $\ell_c \le u_c$, $\max(q_c\ell_c, q_c u_c) = q_c^+ u_c + q_c^- \ell_c$
#   with $q^+ = \max(q, 0)$, $q^- = \min(q, 0)$, so the score is $\phi(q)\cdot W_p$ with
#   $\phi(q) = [s q^+;\ s q^-]$ and one row $W_p = [u;\ \ell]$ of $2d$ scalars;
# - **ArkVale**: $s(q\cdot c + \lVert q\rVert\rho) = [sq;\ \lVert sq\rVert]\cdot[c;\ \rho]$, one row of $d+1$;
# - **key PCA / OVAL**: $W_p = [B_p^\top;\ \mu_p^\top]$, $r+1$ rows of $d$: $W_p(sq)$ gives the
#   page's code $c_p = s B_p^\top q$ and its mean term $s\mu_p\cdot q$ at once. The remaining
#   $R_p c_p$ ($m \times r$ times $r$) is one small product per page, batched over all pages:
#
# $$\text{score}_p(q) = \log\sum_{t=1}^m \exp\big((R_p c_p)_t\big) + s\,\mu_p\cdot q,\qquad c_p = s B_p^\top q ;$$
#
# - **oracle**: $W_p = K_p$, $m$ rows; the score is the log-sum-exp of $W_p(sq)$.
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
# `gather_pages` copies whole `[m, d]` blocks with one `index_select` per KV head (on the
# cache's `[P, m, d]` view) and appends the trailing partial page; `page_attention` runs SDPA
# of the decode query over them. The kept keys come in the order of `page_tokens`, and since
# a decode query is the last position and sees every kept key, the output is exact attention
# over the selected tokens.

# %%
#| export
def _rows_per_page(method: str, page_size: int, rank: int) -> int:
    "Rows of the packed matrix per page: 1 (Quest, ArkVale), rank + 1 (basis: B^T and mu), m (oracle)."
    if method in ("quest", "arkvale"): return 1
    return page_size if method == "oracle" else rank + 1

def packed_rows(summary: PageSummary) -> tuple[Tensor, Tensor | None]:
    "A summary's pages as packed rows [B, Hkv, P, rows, f] (see the text) and, for the basis methods, R [B, Hkv, P, m, r]."
    t = summary.tensors
    if summary.method == "quest": return torch.cat([t["kmax"], t["kmin"]], -1).unsqueeze(-2), None
    if summary.method == "arkvale": return torch.cat([t["centre"], t["radius"].unsqueeze(-1)], -1).unsqueeze(-2), None
    if summary.method == "oracle": return t["K"], None
    return torch.cat([t["B"].mT, t["mu"].unsqueeze(-2)], -2), t["R"]

def _reserve(buf: Tensor | None, used: int, need: int, dim: int, like: Tensor) -> Tensor:
    "A buffer with room for `need` entries along dim (capacity doubling), holding buf's first `used` entries."
    if buf is not None and buf.shape[dim] >= need: return buf
    shape = list(like.shape)
    shape[dim] = max(need, 2 * (0 if buf is None else buf.shape[dim]))
    new = like.new_empty(shape)
    if used: new.narrow(dim, 0, used).copy_(buf.narrow(dim, 0, used))
    return new


class PackedPages:
    "A growing cache's page summaries packed for decode: rows appended once per completed page, every page scored by one GEMM per KV head."
    def __init__(self, method: str, page_size: int):
        self.method, self.page_size = _check_method(method), _check_int(page_size, "page_size", 1)
        self.n_pages, self.heads, self.rank = 0, None, None
        self.W = self.R = None              # W [B*Hkv, capacity * rows, f]; R [capacity, B*Hkv, m, r] (basis methods)

    @property
    def rows(self) -> int:
        "Rows of the packed matrix per page."
        return _rows_per_page(self.method, self.page_size, self.rank)

    def append(self, summary: PageSummary) -> "PackedPages":
        "Append the pages of `summary` (the pages completed since the last append, same batch and KV heads); returns self."
        if not isinstance(summary, PageSummary): raise TypeError(f"summary must be a PageSummary, got {type(summary).__name__}")
        if summary.method != self.method or summary.page_size != self.page_size:
            raise ValueError(f"summary is {summary.method!r} with page_size {summary.page_size}, this store holds {self.method!r} with {self.page_size}")
        rows, R = packed_rows(summary)
        Bsz, Hkv, n, nr, f = rows.shape
        if self.heads is None: self.heads, self.rank = (Bsz, Hkv), None if R is None else R.shape[-1]
        elif self.heads != (Bsz, Hkv) or (R is not None and R.shape[-1] != self.rank):
            raise ValueError(f"summary has batch, KV heads {(Bsz, Hkv)} and rank {None if R is None else R.shape[-1]}; this store holds {self.heads}, rank {self.rank}")
        wd = torch.promote_types(rows.dtype, torch.float32)
        P, BH = self.n_pages, Bsz * Hkv
        rows = rows.to(wd).reshape(BH, n * nr, f)
        self.W = _reserve(self.W, P * nr, (P + n) * nr, 1, rows)
        self.W[:, P * nr:(P + n) * nr] = rows
        if R is not None:
            R = R.to(wd).reshape(BH, n, *R.shape[-2:]).transpose(0, 1)
            self.R = _reserve(self.R, P, P + n, 0, R)
            self.R[P:P + n] = R
        self.n_pages = P + n
        return self

    def scores(self, q: Tensor, scale: float | None = None) -> Tensor:
        "Log-domain page scores [B, Hq, P] (or [B, Hq, S, P] for q [B, Hq, S, d]), equal to score_pages's up to rounding; scale > 0, default 1/sqrt(d)."
        if self.heads is None: raise ValueError("no pages appended yet")
        Bsz, Hkv = self.heads
        qg, single = _group_queries(q, Hkv)                                  # [B, Hkv, G, S, 1, d]
        _, _, G, S, _, d = qg.shape
        if qg.shape[0] != Bsz: raise ValueError(f"q's batch ({qg.shape[0]}) must match the store's ({Bsz})")
        s = 1 / math.sqrt(d) if scale is None else float(scale)
        if not s > 0: raise ValueError(f"scale must be > 0, got {scale!r}")
        P, nr, BH, m = self.n_pages, self.rows, Bsz * Hkv, self.page_size
        x = qg.reshape(BH, G * S, d).to(self.W.dtype) * s
        if self.method == "quest": x = torch.cat([x.clamp(min=0), x.clamp(max=0)], -1)
        elif self.method == "arkvale": x = torch.cat([x, x.norm(dim=-1, keepdim=True)], -1)
        z = torch.bmm(x, self.W[:, :P * nr].mT).view(BH, G * S, P, nr)     # the one GEMM: every page, every query of the group
        if self.method in ("quest", "arkvale"): out = z[..., 0]
        elif self.method == "oracle": out = z.logsumexp(-1)
        else:
            r = self.rank
            code = z[..., :r].permute(2, 0, 1, 3).reshape(P * BH, G * S, r)   # c_p per page, [P*BH, GS, r]
            logits = torch.bmm(code, self.R[:P].view(P * BH, m, r).mT)        # (R_p c_p)_t  [P*BH, GS, m]
            out = logits.view(P, BH, G * S, m).logsumexp(-1).permute(1, 2, 0) + z[..., r]
        out = out.reshape(Bsz, Hkv * G, S, P)
        return out[:, :, 0] if single else out

    @property
    def tensors(self) -> dict:
        "The summary tensors in PageSummary's layout [B, Hkv, P, ...] (views of the packed buffers)."
        Bsz, Hkv = self.heads
        P, W = self.n_pages, self.W[:, :self.n_pages * self.rows].view(Bsz, Hkv, self.n_pages, self.rows, -1)
        if self.method == "quest": return {"kmin": W[..., 0, W.shape[-1] // 2:], "kmax": W[..., 0, :W.shape[-1] // 2]}
        if self.method == "arkvale": return {"centre": W[..., 0, :-1], "radius": W[..., 0, -1]}
        if self.method == "oracle": return {"K": W}
        return {"mu": W[..., -1, :], "B": W[..., :-1, :].mT, "R": self.R[:P].view(P, Bsz, Hkv, *self.R.shape[-2:]).permute(1, 2, 0, 3, 4)}

    def summary(self) -> PageSummary:
        "The packed pages as a PageSummary (views), for score_pages and the references."
        return PageSummary(self.method, self.page_size, self.n_pages * self.page_size, self.tensors)


# %% [markdown]
# Check: on a GQA cache with a trailing partial page, pages appended in uneven chunks (as they
# complete during decode) give the same tensors as summaries built at once, and the packed scores
# equal `score_pages`'s and the loop reference's, for one query and for several, in every method.

# %%
K, V, G = _random_cache(T=4 * 8 + 5)
q = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
for method in METHODS:
    whole = build_summaries(method, K, V, 8, rank=3, eta=0.5, G=G)
    packed = PackedPages(method, 8)
    for a, b in ((0, 1), (1, 1), (1, 3), (3, 4)):                         # chunks of 1, 0, 2 and 1 pages
        packed.append(build_summaries(method, K[:, :, a * 8:b * 8], V[:, :, a * 8:b * 8], 8, rank=3, eta=0.5, G=G))
    test_eq(packed.n_pages, 4)
    for n, x in whole.tensors.items(): assert_close(packed.tensors[n], x)
    assert_close(packed.scores(q), score_pages(method, whole, q))
    assert_close(packed.scores(q), score_pages_reference(method, K, q, whole))
    assert_close(packed.scores(torch.stack([q, -q], 2), 0.3), score_pages(method, whole, torch.stack([q, -q], 2), 0.3))
test_fail(lambda: packed.scores(q, scale=-1.0), contains="scale must be > 0")
test_fail(lambda: packed.append(build_summaries("quest", K, V, 8)), contains="this store holds")


# %%
#| export
def gather_pages(x: Tensor, pages: Tensor, page_size: int) -> Tensor:
    "The complete pages `pages` [B, H, n_p] of x [B, H, T, d] as whole [m, d] blocks, then the trailing partial page: [B, H, n_p*m + T % m, d]."
    _check_cache(x, "x")
    m = _check_int(page_size, "page_size", 1)
    B, H, T, d = x.shape
    P = T // m
    if pages.dtype != torch.long or pages.dim() != 3 or pages.shape[:2] != (B, H):
        raise ValueError(f"pages must be int64 [B, H, n_p] = [{B}, {H}, n_p], got {pages.dtype} {tuple(pages.shape)}")
    n = pages.shape[-1]
    out = x.new_empty(B, H, n * m + T - P * m, d)
    body = x[:, :, :P * m].unflatten(2, (P, m))                               # [B, H, P, m, d] view of the cache
    for b in range(B):
        for h in range(H): torch.index_select(body[b, h], 0, pages[b, h], out=out[b, h, :n * m].view(n, m, d))
    out[:, :, n * m:] = x[:, :, P * m:]
    return out

def page_attention(q: Tensor, k: Tensor, v: Tensor, pages: Tensor, page_size: int, scale: float | None = None, dropout: float = 0.0) -> Tensor:
    "Decode attention [B, Hq, 1, d] of q over the complete pages `pages` [B, Hkv, n_p] of k, v plus the trailing partial page."
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[2] != 1: raise ValueError(f"q must be one decode query [B, Hq, 1, d], got {getattr(q, 'shape', type(q).__name__)}")
    ks, vs = gather_pages(k, pages, page_size), gather_pages(v, pages, page_size)
    return torch.nn.functional.scaled_dot_product_attention(q, ks, vs, dropout_p=dropout, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# %% [markdown]
# Check: the gathered pages are `gather_keys` at `page_tokens` (also on a strided slice of a
# longer cache, as a growing cache is), and `page_attention` equals exact attention over those
# tokens, `attend_selected` (a masked softmax over the gathered keys).

# %%
from sparsekv.attention import gather_keys

# %%
K, V, G = _random_cache(T=100)
w = aggregate_gqa(score_pages("oval", build_summaries("oval", K, V, 8, rank=3, G=G), q), 2)
for T in (100, 96, 37):
    k, v = K[:, :, :T], V[:, :, :T]
    ids = top_pages(w[..., :T // 8], 40, 8, 4, 8, T)
    test_eq(page_tokens(ids, 8, T), select_pages(w[..., :T // 8], 40, 8, 4, 8, T))
    test_eq(gather_pages(k, ids, 8), gather_keys(k, page_tokens(ids, 8, T)))
    qq = q.unsqueeze(2)
    assert_close(page_attention(qq, k, v, ids, 8, 0.2), attend_selected(qq, k, v, page_tokens(ids, 8, T), scale=0.2))


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
# recent and selected pages' original keys (`page_attention`). $G$ for OVAL comes from the
# layer's `o_proj`. A cache that did not grow or whose first key changed (a new sequence)
# rebuilds the layer's summaries.
#
# Speculative retrieval with correction (the paper's FreeKV setup, D.3: 2 steps, `corr_group avg`,
# $\tau=0.8$ or $0.9$): with `spec_steps = n > 0` the pages are ranked with the layer's decode
# query from $n$ steps ago (in FreeKV this lets the recall overlap the previous steps); for
# each KV head, when the cosine between the current and that past query, averaged over the
# group's query heads, is below $\tau$, the head is re-scored with the current query. Here the
# summaries are the current ones (FreeKV's would be $n$ steps older), and there is no overlap
# to gain on the CPU: this reproduces the selection, not the latency. The counters
# `corrected / speculated` give the correction rate.

# %%
#| export
class PageRetrievalPolicy(SelectionPolicy):
    "Decode-time page retrieval: dense prefill; at decode, sink + recent + top pages within token_budget per KV head, from `method`'s summaries."
    def __init__(self, method: str, token_budget: int, page_size: int = 32, sink: int = 32, recent: int = 32, rank: int = 8,
                 eta: float = 0.5, policy: str = "avgSM", dense_layers: int = 1, spec_steps: int = 0, tau: float = 0.9):
        _check_method(method)
        if policy not in GQA_POLICIES: raise ValueError(f"policy must be one of {GQA_POLICIES}, got {policy!r}")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau): raise ValueError(f"tau must be a finite number, got {tau!r}")
        self.method, self.budget, self.page_size = method, _check_int(token_budget, "token_budget", 1), _check_int(page_size, "page_size", 1)
        self.sink, self.recent, self.rank = _check_int(sink, "sink", 0), _check_int(recent, "recent", 0), _check_int(rank, "rank", 1)
        self.eta, self.policy, self.dense_layers = eta, policy, _check_int(dense_layers, "dense_layers", 0)
        self.spec_steps, self.tau = _check_int(spec_steps, "spec_steps", 0), float(tau)
        self.summaries, self.metrics, self.history, self.seen = {}, {}, {}, {}
        self.corrected, self.speculated = 0, 0                               # KV-head decisions re-scored / made speculatively
        self.built = 0                                                       # pages summarized (all heads of a page at once), summed over layers

    def metric(self, ctx) -> Tensor | None:
        "The layer's output metric G [Hkv, d, d] from its o_proj (OVAL only)."
        if self.method != "oval": return None
        if ctx.module is None: raise ValueError("OVAL needs the attention module (ctx.module, with o_proj) for its output metric G")
        if ctx.layer_idx not in self.metrics:
            m = ctx.module
            W = m.o_proj.weight.detach()
            self.metrics[ctx.layer_idx] = output_metric(W, m.config.num_attention_heads, m.config.num_key_value_heads, m.head_dim)
        return self.metrics[ctx.layer_idx]

    def track(self, q: Tensor, k: Tensor, ctx) -> Tensor | None:
        "Record this decode query [B, Hq, d]; return the layer's query from spec_steps calls ago (None if none). A new sequence resets the layer."
        i, T = ctx.layer_idx, k.shape[2]
        first, last_T = self.seen.get(i, (None, 0))
        if first is None or last_T >= T or not torch.equal(first, k[:, :, :1]):  # the cache restarted
            self.summaries.pop(i, None)
            self.history[i] = []
        self.seen[i] = (k[:, :, :1].clone(), T)
        hist = self.history[i]
        hist.append(q[:, :, -1])
        del hist[: -self.spec_steps - 1]
        return hist[0] if self.spec_steps and len(hist) == self.spec_steps + 1 else None

    def summary(self, k: Tensor, v: Tensor, ctx) -> PackedPages:
        "The layer's packed summaries of every complete page of k, v [B, Hkv, T, d]: only the pages completed since the last call are built and appended."
        i, m, P = ctx.layer_idx, self.page_size, k.shape[2] // self.page_size
        packed = self.summaries.get(i) or self.summaries.setdefault(i, PackedPages(self.method, m))
        done = packed.n_pages
        if P > done or packed.heads is None:
            packed.append(build_summaries(self.method, k[:, :, done * m:P * m], v[:, :, done * m:P * m], m, self.rank, self.eta,
                                          None if self.method != "oval" else self.metric(ctx).to(k.device)))
            self.built += P - done
        return packed

    def weights(self, summ: PackedPages, q: Tensor, Hkv: int, scale: float) -> Tensor:
        "Aggregated page weights [B, Hkv, P] for queries q [B, Hq, d]."
        return aggregate_gqa(summ.scores(q, scale), Hkv, self.policy)

    def select(self, q, k, v, ctx):
        "Token indices [B, Hkv, n] for a decode query; None (dense) at prefill, in the dense layers and when the cache fits the budget."
        pages = self.page_ids(q, k, v, ctx)
        return None if pages is None else page_tokens(pages, self.page_size, k.shape[2])

    def attend(self, q, k, v, ctx):
        "Decode: page_attention over the kept pages (attend_selected under a mask or with several queries); otherwise dense."
        pages = self.page_ids(q, k, v, ctx)
        if pages is None: return dense_attention(q, k, v, ctx.mask, ctx.scale, ctx.dropout)
        if ctx.mask is None and q.shape[2] == 1: return page_attention(q, k, v, pages, self.page_size, ctx.scale, ctx.dropout)
        return attend_selected(q, k, v, page_tokens(pages, self.page_size, k.shape[2]), ctx.mask, ctx.scale, ctx.dropout)

    def page_ids(self, q, k, v, ctx):
        "The complete pages [B, Hkv, n_p] a decode query keeps (see top_pages); None when select would return None."
        if ctx.kind != "decode" or ctx.layer_idx < self.dense_layers: return None
        past = self.track(q, k, ctx)
        T, Hkv = k.shape[2], k.shape[1]
        if T <= self.budget: return None
        summ, now = self.summary(k, v, ctx), q[:, :, -1]
        if past is None: w = self.weights(summ, now, Hkv, ctx.scale)
        else:
            # speculative: score with the query from spec_steps ago; re-score a KV head whose group-average cosine fell below tau
            cos = torch.nn.functional.cosine_similarity(past.float(), now.float(), dim=-1)
            fix = cos.reshape(cos.shape[0], Hkv, -1).mean(-1) < self.tau
            w = self.weights(summ, past, Hkv, ctx.scale)
            if fix.any(): w = torch.where(fix[..., None], self.weights(summ, now, Hkv, ctx.scale), w)
            self.corrected, self.speculated = self.corrected + int(fix.sum()), self.speculated + fix.numel()
        return top_pages(w, self.budget, self.page_size, self.sink, self.recent, T)


# %% [markdown]
# Checks on a tiny random model: when sink and recent cover the sequence (the retrieval path
# runs but keeps every token), generation equals dense generation; with a small budget,
# each decode step's output equals dense attention restricted to the tokens `select_pages`
# picks from summaries built from scratch, and the incrementally extended summaries equal
# those built from scratch.

# %%
from sparsekv.models import load_model as _load
from sparsekv.hf import AttentionContext, patch

# %%
tiny = _load("tiny-llama")[0]
ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
def _greedy(n=6): return tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
with torch.no_grad():
    plain = _greedy()
    pol = PageRetrievalPolicy("oval", token_budget=8, page_size=4, sink=0, recent=64, rank=2)
    with patch(tiny, pol): test_eq(_greedy(), plain)
test_eq(sorted(pol.summaries), [1])                                          # layer 0 stayed dense
test_eq(pol.summaries[1].n_pages, 45 // 4)                                   # summaries followed the cache

# %%
attn = tiny.model.layers[1].self_attn
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
    ref = torch.where(keep, qq @ kk[:, :, :T].repeat_interleave(2, 1).mT * 0.25, -math.inf).softmax(-1) @ vv[:, :, :T].repeat_interleave(2, 1)
    assert_close(out, ref)


# %% [markdown]
# Speculation: with $\tau$ below every cosine no head is corrected and the pages are those of
# the query 2 steps back; with $\tau$ above every cosine every head is re-scored and the
# selection is the plain one.

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
never, always = PageRetrievalPolicy("quest", 16, 4, 4, 4, spec_steps=2, tau=-2), PageRetrievalPolicy("quest", 16, 4, 4, 4, spec_steps=2, tau=2)
for j, (a, b, c) in enumerate(zip(plain, _steps(never, qs), _steps(always, qs))):
    test_eq(c, a)
    T = 30 + j
    w = aggregate_gqa(score_pages("quest", build_summaries("quest", kk[:, :, :T], None, 4), qs[j - 2 if j >= 2 else j][:, :, 0], 0.25), 2)
    test_eq(b, select_pages(w, 16, 4, 4, 4, T))
test_eq((never.corrected, never.speculated, always.corrected, always.speculated), (0, 6, 6, 6))
