# %% [markdown]
# # QuoKA: query-oriented KV selection
#
# > Algorithm 1 of QuoKA (§3.1–3.4): score the cached keys by the chunk's least typical queries, keep the top B_SA.

# %%
#| default_exp quoka.select

# %%
#| export
from __future__ import annotations

import torch
from torch import Tensor

from sparsekv.attention import check_int, check_qkv, content_checks, require_data, require_finite, shape_count
from sparsekv.quoka.kernel import key_scores
from sparsekv.select import all_key_indices, resolve_budget, top_budget_indices, top_budget_indices_reference

# %%
#| hide
import math

import torch.nn.functional as F
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.attention import checks, hot_path

# %% [markdown]
# Under **chunked prefill** a prompt of length $L$ is processed in blocks $X_1, X_2, \dots$
# of $B_{CP}$ tokens. When block $X_i$ arrives, the cache holds the $T = (i-1) B_{CP}$ keys
# and values of the earlier blocks; each query of the block attends to those $T$ keys and,
# causally, to the keys of its own block. Dense attention costs $O(B_{CP} \cdot T)$ per
# block, hence $O(L^2)$ in total. QuoKA (§3) keeps only $B_{SA}$ of the $T$ earlier keys per
# KV head, chosen from the block's queries, and hands the reduced set to an ordinary dense
# kernel; the cost per block becomes $O(B_{CP} \cdot B_{SA})$ plus the selection.
#
# This notebook builds the selection for one block and one layer (Algorithm 1). The
# chunked-prefill loop around it (Algorithm 2) lives in the transformers integration; it
# calls `quoka_select` with the block's post-RoPE queries and the cached keys and appends
# the block's own keys to the returned indices.
#
# **What our copy of the paper lacks.** The text we have keeps §3.1, §3.3 and §3.4 as
# prose but drops Algorithm 1, Algorithm 2, the theorem announced at the end of §3.1 (a
# candidate statement is given below, before Algorithm 1) and all formulas of §3.2. Everything below is reconstructed from the prose. Where the prose
# does not decide a detail, the choice is marked **Interpretation** and the alternative is
# named; each such choice is a parameter or is argued from a sentence of the paper.
#
# ## Notation
#
# One batch element, one KV head $h$ with its $G$ query heads $hG + g$, $g = 0,\dots,G-1$
# (the package's GQA layout). The block's queries of head $g$ are $q_{g,1}, \dots,
# q_{g,S} \in \mathbb{R}^D$ ($S = B_{CP}$, post-RoPE), the cached keys $k_1, \dots, k_T$.
# Unit vectors carry a hat: $\hat x = x / \lVert x \rVert$. Tensors are `q_chunk [B,Hq,S,D]`
# and `k_cache [B,Hkv,T,D]`.
#
# Budgets and the top-$n$ with its tie rule, shared by every selection method, live in
# [`sparsekv.select`](05_select.ipynb).

# %% [markdown]
# ## Step 1: query subselection (§3.1)
#
# §3.1 observes that queries with a **low cosine similarity to the mean query** attend
# broadly to many keys, while queries near the mean concentrate on a small shared set (the
# paper's Figure 2(a)). The near-mean queries therefore add little beyond what one of them
# already says, and QuoKA keeps only the most dissimilar ones. Per query head, with the
# mean query of the block
#
# $$M_{Q,g} = \frac1S \sum_{i=1}^{S} q_{g,i},$$
#
# each query is ranked by its dissimilarity
#
# $$d_{g,i} = -\cos(M_{Q,g}, q_{g,i}) = -\hat M_{Q,g} \cdot \hat q_{g,i},$$
#
# and the $N_Q$ queries with the largest $d_{g,i}$ are kept ("rank each query $q$ by
# $-\mathrm{CosSim}(M_Q, q)$ and retain the top $N_Q$"). If $N_Q \ge S$ every query is kept.
#
# **Interpretation (which queries a KV group keeps).** The paper ranks "each query" without
# saying whether the ranking is per query head or shared by the heads of a KV group. The
# aggregation of step 3 averages the normalized queries *of a group at the same
# position* (see below), which only makes sense if the heads of a group keep the same
# positions. The default, `query_select="group"`, therefore ranks positions once per KV
# head by the group-averaged dissimilarity
#
# $$\bar d_{h,i} = \frac1G \sum_{g} d_{g,i}$$
#
# and keeps the same $N_Q$ positions $I_h$ for all $G$ heads. The variant
# `query_select="head"` lets each query head keep its own top $N_Q$ positions $I_g$; then
# the $r$-th kept query of each head (in chunk order) is paired with the $r$-th of the
# others in step 3. Both coincide when $G = 1$ or $N_Q \ge S$. Kept positions are listed in
# ascending order; ties in dissimilarity go to the earlier position.
#
# **The premise as a switch (an ablation, not the paper).** Whether the dissimilar queries
# are the ones to keep is an empirical claim about trained models (Figure 2(a)); the
# [observations stage](../reproduce/20_quoka_observations.ipynb) measures it. To test it
# downstream at equal $N_Q$, `query_rank` chooses what the ranking rewards:
# `"dissimilar"` (the paper, default) ranks by $d_{g,i}$; `"similar"` by $-d_{g,i}$ (the
# queries closest to the mean, which the premise says carry the least); `"random"` by
# independent uniform draws (from `generator`), a uniformly random subset of $N_Q$
# positions (in group mode the draws are averaged over the group, which leaves the subset
# uniform because the averages are exchangeable). Keeping *all* queries is `n_q` $\ge S$.
# What the ranking does downstream at equal $N_Q$ is measured by [the quoka_accuracy stage](../reproduce/22_quoka_accuracy.ipynb).

# %% [markdown]
# The paper's choice comes first in each tuple (and is each option's default below):

# %%
#| export
QUERY_SELECT = ("group", "head")
QUERY_AGGS = ("max", "mean")
QUERY_RANKS = ("dissimilar", "similar", "random")
GQA_AGGS = ("mean", "max")
BACKENDS = ("torch", "triton")
EPS = 1e-12  # norms are clamped to at least EPS, as in F.normalize: a zero vector has cosine 0 with everything

# %%
test_eq((QUERY_SELECT[0], QUERY_AGGS[0], QUERY_RANKS[0], GQA_AGGS[0]), ("group", "max", "dissimilar", "mean"))
assert_close(F.normalize(torch.tensor([1e-13, 0.0], dtype=torch.float64), dim=0, eps=EPS),
             torch.tensor([0.1, 0.0], dtype=torch.float64))  # a norm below EPS is clamped to EPS


# %%
#| export
def accumulation_dtype(x: Tensor) -> torch.dtype:
    "float32 for half/bfloat16/float32 inputs, float64 for float64: the dtype scores are computed in."
    return _ACCUMULATION.get(x.dtype) or torch.promote_types(x.dtype, torch.float32)


_ACCUMULATION = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
                 torch.float64: torch.float64}  # the common cases without a call into the dispatcher

# %%
_dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
test_eq([accumulation_dtype(torch.zeros(1, dtype=t)) for t in _dtypes], [torch.float32] * 3 + [torch.float64])
for t in _dtypes + (torch.int64, torch.uint8):  # the table is promote_types' answer
    test_eq(accumulation_dtype(torch.zeros(1, dtype=t)), torch.promote_types(t, torch.float32))


# %% [markdown]
# A 3-4-5 row, a zero row (cosine 0 with everything), bfloat16 in float32, and the `out=` buffer:

# %%
#| export
def unit_vectors(x: Tensor, out: Tensor | None = None) -> Tensor:
    "x / max(|x|, EPS) along the last dim (each query or key), in the accumulation dtype; written into `out` if given."
    x = x.to(accumulation_dtype(x))
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(EPS)  # as F.normalize, one operator fewer
    # a copy, not out=: `out` may be a strided slice of a buffer, which a compiled step cannot write through out=
    return x / norm if out is None else out.copy_(x / norm)


# %%
_x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
test_eq(unit_vectors(_x), torch.tensor([[0.6, 0.8], [0.0, 0.0]]))
test_eq(unit_vectors(_x.bfloat16()).dtype, torch.float32)
_out = torch.empty(2, 2)
unit_vectors(_x, out=_out)
test_eq(_out, unit_vectors(_x))
_r = torch.randn(3, 5, 8, dtype=torch.float64)
test_eq(unit_vectors(_r), F.normalize(_r, dim=-1, eps=EPS))          # F.normalize's values, bit for bit
_buf = torch.zeros(3, 9, 8, dtype=torch.float64)
unit_vectors(_r, out=_buf[:, 2:7])                                  # into a strided slice: only it changes
test_eq((_buf[:, 2:7], _buf[:, :2].abs().sum().item(), _buf[:, 7:].abs().sum().item()), (unit_vectors(_r), 0, 0))


# %% [markdown]
# The products of queries (or their group mean) with the keys of their KV head run as one
# batched matrix product when the batch rows and heads of both merge in a view, as those of a
# cache slice do (a 4-D `@` adds its own expands and reshapes: host work at every step).

# %%
#| export
def head_products(a: Tensor, b: Tensor) -> Tensor:
    "Products [B,H,...,T] of rows a [B,H,...,D] with the rows b [B,H,T,D] of their head b[:, h]."
    B, H, D, T = *a.shape[:2], a.shape[-1], b.shape[2]
    if B == 1 or b.stride(0) == H * b.stride(1):  # the keys' rows and heads merge in a view: one bmm, no key copy
        out = torch.bmm(a.reshape(B * H, -1, D), b.view(B * H, T, D).mT)
    else: out = a.reshape(B, H, -1, D) @ b.mT
    return out.view(*a.shape[:-1], T)


# %%
_a, _b = torch.randn(2, 3, 4, 5, dtype=torch.float64), torch.randn(2, 3, 7, 5, dtype=torch.float64)
assert_close(head_products(_a, _b), _a @ _b.mT)
_wide = torch.randn(2, 3, 12, 5, dtype=torch.float64)[:, :, :7]           # a cache slice: merges, one bmm
assert_close(head_products(_a, _wide), _a @ _wide.mT)
_apart = _b.transpose(0, 1).contiguous().transpose(0, 1)                  # heads outermost: the 4-D product
assert_close(head_products(_a, _apart), _a @ _b.mT)
_a5 = torch.randn(2, 3, 2, 4, 5, dtype=torch.float64)                    # rows [B,H,G,S,D]: the same per head
for keys in (_b, _apart): assert_close(head_products(_a5, keys), _a5 @ _b.mT.unsqueeze(2))


# %% [markdown]
# Check against loops over heads and positions (cosines as Python dot products of unit
# vectors), on a chunk with a query planted far from the others (the negated mean direction):

# %%
#| export
def query_dissimilarity(q_chunk: Tensor) -> Tensor:
    "d = -cos(M_Q, q_i) of every query of the chunk q_chunk [B,Hq,S,D] to its head's mean query M_Q (§3.1): [B,Hq,S]."
    B, Hq, S, D = q_chunk.shape
    q = q_chunk.to(accumulation_dtype(q_chunk))
    m = unit_vectors(q.mean(2, keepdim=True))  # M_Q / |M_Q| per query head
    # q_i . M_Q / |q_i| reads the chunk twice and writes S numbers a head: normalizing every q_i first writes S x D.
    # A product (bmm), not vecdot: FLOP counters (sparsekv.costs) count the G S D multiply-adds of ranking only there
    dots = torch.bmm(q.reshape(B * Hq, S, D), m.view(B * Hq, D, 1)).view(B, Hq, S)
    return dots.div_(torch.linalg.vector_norm(q, dim=-1).clamp_min_(EPS)).neg_()


# %%
def _unit(x): return x / max(x.norm().item(), EPS)

g = torch.Generator().manual_seed(1)
B, Hkv, G, S, D = 2, 2, 3, 11, 8
q = torch.randn(B, Hkv * G, S, D, generator=g, dtype=torch.float64) + 1.5   # a shared offset: a clear mean direction
q[:, :, 4] = -q[:, :, 4]                                                      # position 4 points away from the mean
d = query_dissimilarity(q)
for b in range(B):
    for hq in range(Hkv * G):
        m = _unit(q[b, hq].mean(0))
        for i in range(S): assert abs(d[b, hq, i].item() + float(_unit(q[b, hq, i]) @ m)) < 1e-12


# %%
#| export
def query_ranking(q_chunk: Tensor, query_rank: str = "dissimilar", generator: torch.Generator | None = None) -> Tensor:
    "What select_queries keeps the largest of, [B,Hq,S]: d (§3.1), -d ('similar'), or uniform draws ('random')."
    if query_rank == "random": return torch.rand(q_chunk.shape[:3], generator=generator).to(q_chunk.device)
    d = query_dissimilarity(q_chunk)
    return d if query_rank == "dissimilar" else d.neg_()


# %%
test_eq(query_ranking(q), d)
test_eq(query_ranking(q, "similar"), -d)
test_eq(query_ranking(q, "random", torch.Generator().manual_seed(3)),
        torch.rand(B, Hkv * G, S, generator=torch.Generator().manual_seed(3)))


# %% [markdown]
# One row of positions per KV head in group mode, by the group's mean dissimilarity (a Python sort), every position
# when $N_Q \ge S$:

# %%
#| export
def kept_positions(q_chunk: Tensor, n_q: int, G: int, query_select: str = "group", query_rank: str = "dissimilar",
                   generator: torch.Generator | None = None) -> Tensor:
    """Positions [B,Hkv,g,n] (g = 1 for 'group': shared by the KV head's G query heads; g = G for 'head'),
    n = min(n_q, S), ascending, of the kept queries (ties to the lower position); see `select_queries`."""
    B, Hq, S, _ = q_chunk.shape
    if n_q >= S: return torch.arange(S, device=q_chunk.device).expand(B, Hq // G, 1, S)  # keep every query
    d = query_ranking(q_chunk, query_rank, generator).view(B, Hq // G, G, S)
    if query_select == "group": d = d.mean(2, keepdim=True)  # one ranking per KV head, by the group-mean dissimilarity
    # one stable sort of the S entries breaks ties to the lower position (top_budget_indices takes eight ops)
    return d.sort(dim=-1, descending=True, stable=True).indices[..., :n_q].sort(dim=-1).values


# %%
_pos = kept_positions(q, 4, G)
test_eq(_pos.shape, (B, Hkv, 1, 4))
for b in range(B):
    for h in range(Hkv):
        avg = [sum(d[b, h * G + g_, i].item() for g_ in range(G)) / G for i in range(S)]
        test_eq(_pos[b, h, 0].tolist(), sorted(sorted(range(S), key=lambda i: (-avg[i], i))[:4]))
test_eq(kept_positions(q, 4, G, "head").shape, (B, Hkv, G, 4))
test_eq(kept_positions(q, S, G), torch.arange(S).expand(B, Hkv, 1, S))


# %% [markdown]
# Check against loops over heads and positions (rankings by sorting): the kept positions in both modes, and
# that the planted query is always kept:

# %%
#| export
def select_queries(q_chunk: Tensor, n_q: int, G: int, query_select: str = "group", query_rank: str = "dissimilar",
                   generator: torch.Generator | None = None) -> Tensor:
    """Positions [B,Hq,n], n = min(n_q, S), ascending, of each head's kept queries (§3.1; `query_rank`: the ablation's
    ranking, see `query_ranking`); 'group': the same positions for a KV group."""
    B, Hq = q_chunk.shape[:2]
    pos = kept_positions(q_chunk, n_q, G, query_select, query_rank, generator)
    return pos.expand(-1, -1, G, -1).reshape(B, Hq, -1)  # query head hG+g reads KV head h's positions


# %%
for n_q in (1, 4, S, S + 3):
    pos_head, pos_group = select_queries(q, n_q, G, "head"), select_queries(q, n_q, G, "group")
    n = min(n_q, S)
    for b in range(B):
        for h in range(Hkv):
            avg = [sum(d[b, h * G + g, i].item() for g in range(G)) / G for i in range(S)]
            want_group = sorted(sorted(range(S), key=lambda i: (-avg[i], i))[:n])
            for g_ in range(G):
                hq = h * G + g_
                test_eq(pos_group[b, hq].tolist(), want_group)
                row = d[b, hq].tolist()
                test_eq(pos_head[b, hq].tolist(), sorted(sorted(range(S), key=lambda i: (-row[i], i))[:n]))
                assert 4 in pos_head[b, hq].tolist() and 4 in pos_group[b, hq].tolist()
                if n < S:  # 'similar' ranks by -d: its top S - n are the complement of the top n by d
                    sim = select_queries(q, S - n, G, "head", "similar")[b, hq].tolist()
                    test_eq(sorted(set(range(S)) - set(sim)), pos_head[b, hq].tolist())

# %% [markdown]
# `"similar"` never keeps the planted opposite query, and `"random"` keeps a uniformly random
# subset: over many draws every position is kept with probability $N_Q / S$ (a binomial test at
# four standard errors), a seeded generator repeats its draw, and in group mode the heads of a
# group share their positions.

# %%
assert not any(4 in r for r in select_queries(q, 4, G, "head", "similar").flatten(0, 1).tolist())
gen = torch.Generator().manual_seed(0)
draws = 4000
counts = torch.zeros(S)
for _ in range(draws):
    pos = select_queries(q, 4, G, "group", "random", gen)
    test_eq(pos, pos.view(B, Hkv, G, 4)[:, :, :1].expand(-1, -1, G, -1).reshape(B, Hkv * G, 4))  # shared in a group
    counts += torch.zeros(S).index_add_(0, pos[0, 0], torch.ones(4))
p = 4 / S
assert ((counts / draws - p).abs() < 4 * (p * (1 - p) / draws) ** 0.5).all(), counts / draws
test_eq(select_queries(q, 4, G, "head", "random", torch.Generator().manual_seed(5)),
        select_queries(q, 4, G, "head", "random", torch.Generator().manual_seed(5)))


# %% [markdown]
# ## Step 2: cosine scoring (§3.2)
#
# §3.2's formulas are missing from our copy; its title ("Scoring via Cosine Similarity"),
# the method overview ("compute cosine similarity between queries and keys to estimate
# their relevance"), §3.3 ("if we normalize $K$ and $Q$ prior to computing the score") and
# §5 ("then selects keys via cosine similarity") fix it to
#
# $$c_{g,i,j} = \cos(q_{g,i}, k_j) = \hat q_{g,i} \cdot \hat k_j, \qquad i \in I_g,\; j = 1,\dots,T .$$
#
# Unlike the attention logit $q \cdot k / \sqrt D$ it is blind to the norms, so a query of
# large norm cannot dominate the ranking of keys, and a key's score is bounded in $[-1, 1]$.
# No softmax is taken: the selection only needs a ranking, and the softmax would destroy
# the linearity that step 3 relies on.
#
# ## Step 3: aggregation over queries and over the heads of a group (§3.3)
#
# One KV head serves $G$ query heads and $|I| = \min(N_Q, S)$ kept queries each, but keeps
# one set of keys, so the $G \cdot |I|$ scores of a key must be reduced to one number. §3.3:
#
# * **over queries, the maximum**: "averaging can obscure rare but important query–key
#   interactions, so QuoKA instead takes the maximum" (the heavy tail of Figure 3);
# * **over the query heads of a group, the mean**: "we simply average scores across KV
#   groups ... head-level importance is correlated";
# * and "if we normalize $K$ and $Q$ prior to computing the score, we can achieve the same
#   average by **pre-aggregation**: averaging normalized queries across KV groups due to the
#   linearity of the mean and the outer product $QK^\top$".
#
# **Which order.** Max over queries and mean over heads do not commute. Let $c_{g,i}$ be the
# scores of one key ($i$ indexes the kept queries of head $g$). The two orders are
#
# $$\sigma = \max_i \frac1G \sum_g c_{g,i} \qquad\text{and}\qquad \tau = \frac1G \sum_g \max_i c_{g,i},$$
#
# and in general $\sigma \le \tau$ (each $c_{g,i} \le \max_{i'} c_{g,i'}$, so every average
# inside the max of $\sigma$ is at most $\tau$), with equality only when one query index
# maximizes every head's score. Only $\sigma$ can be computed by pre-aggregation: $\tau$ takes
# a max per head *before* averaging, a non-linear step that needs every head's scores, so
# no average of queries reproduces it. Since §3.3 states that pre-aggregation gives "the same
# average", **QuoKA's order is $\sigma$: the mean over the heads of a group at each query
# position, then the max over the positions.** (The conclusion's $\bar Q K^\top$, a single
# product with an averaged query matrix, says the same.) This is what `quoka_scores`
# exports.
#
# **The pre-aggregation identity.** Fix a KV head $h$ and a kept position $i$ (the same $i$
# for all heads of the group, `query_select="group"`). Define the pre-aggregated query
#
# $$\bar q_{h,i} = \frac1G \sum_{g=0}^{G-1} \hat q_{g,i} .$$
#
# Then, for every key $j$, by linearity of the dot product in its first argument,
#
# $$\frac1G \sum_g c_{g,i,j} = \frac1G \sum_g \hat q_{g,i} \cdot \hat k_j = \Big(\frac1G \sum_g \hat q_{g,i}\Big) \cdot \hat k_j = \bar q_{h,i} \cdot \hat k_j .$$
#
# The identity is exact for each position $i$ (up to floating-point rounding); the max over
# $i$ is then taken of identical numbers, so
#
# $$\sigma_{h,j} = \max_{i \in I_h} \bar q_{h,i} \cdot \hat k_j = \max_{\text{rows}} \big(\bar Q_h \hat K^\top\big)_{:, j}, \qquad \bar Q_h \in \mathbb{R}^{|I_h| \times D} .$$
#
# Two remarks make the conditions precise:
#
# 1. **Normalize first, then average.** The average is over *cosines*. $\cos(q_{g,i}, k) =
#    \hat q_{g,i} \cdot \hat k$ is linear in $\hat q_{g,i}$, not in $q_{g,i}$; averaging the
#    raw queries and then taking one cosine, $\cos(\frac1G \sum_g q_{g,i}, k)$, weights each
#    head by its query norm and renormalizes the sum, which is a different number. This is
#    the "if we normalize ... prior to computing the score" of §3.3. (Equally, a softmax
#    score is not linear in $q$; pre-aggregation would not apply to it.)
# 2. **The pairing.** The identity only uses linearity, so it holds for any pairing of one
#    query per head: with `query_select="head"` row $r$ of $\bar Q_h$ averages the $r$-th kept
#    query of each head, and $\max_r \bar q_{h,r} \cdot \hat k_j$ equals the head-by-head
#    $\max_r \frac1G \sum_g \hat q_{g, i_g(r)} \cdot \hat k_j$ exactly. What changes is the
#    meaning: in "group" mode a row is one token position seen by all heads of the group.
#
# **Cost.** Head by head, the scores take $G \cdot |I| \cdot T \cdot D$ multiply-adds;
# pre-aggregated, $|I| \cdot T \cdot D$ plus $G \cdot |I| \cdot D$ for the averages, a factor
# $G$ less (§3.3: "lowers computation and memory cost by a factor of the number of KV
# groups").
#
# **Unit keys, once per key.** The keys are normalized before the product, $\hat K_h =
# (\hat k_1, \dots, \hat k_T)$, so the scores are one product $\bar Q_h \hat K_h^\top$ and a
# max over rows. Under chunked prefill the keys of earlier chunks never change, so $\hat k_j$
# need not be recomputed for every later chunk: `UnitKeyCache` keeps the unit keys of one
# layer (in the accumulation dtype: float32 for bfloat16 models, which also saves converting
# all $T$ keys per chunk) and normalizes only the keys added since its last call, and
# `quoka_scores(..., k_unit=)` takes them. The selection is the same function of the same
# unit vectors with or without the cache (each key is normalized on its own). The price is
# memory: a float32 copy of the layer's keys (amortized growth, at most twice that). (A zero
# key has norm clamped to $10^{-12}$ and score $0$, as with `F.normalize`.)
#
# **Interpretation (query aggregation as a parameter).** The max over queries is QuoKA's
# choice; `query_agg="mean"` replaces it by the mean, the alternative the paper ablates
# (Appendix I), for the same experiment here. The identity above is unaffected (a mean of
# means is linear too).
#
# **An ablation of the head mean (`gqa_agg="max"`, not the paper's).** §3.3 rests the mean
# over a group's heads on "head-level importance is correlated". Where one head of a group
# attends to a key the others ignore (a retrieval head), the mean divides that head's cosine
# by $G$ and the key can fall out of the budget. `gqa_agg="max"` scores a key by its largest
# head score instead, $\max_g \max_i c_{g,i}$ (with `query_agg="mean"`: $\max_g \frac{1}{|I|}
# \sum_i c_{g,i}$); a max is not linear, so the $G$ heads' unit queries stay separate rows and
# the scoring costs $G$ times the pre-aggregated product. The `protocol` stage's needle items
# motivate it: on SmolLM2 ($G = 3$) the needle items QuoKA misses at $B_{SA} = 256$ lose the
# needle in the last prefill chunk. In a first probe on a few of them, keeping every chunk
# query ($N_Q = B_{CP}$) found the needle only with the head max, at about mean-of-scores'
# cost; at $N_Q = 16$ the head max found it on some and lost others. The [protocol stage](../reproduce/03_protocol.ipynb)
# measures it on every item (`quoka_heads`, with paired intervals), and [the quoka_accuracy
# stage](../reproduce/22_quoka_accuracy.ipynb) QuoKA's accuracy over $B_{SA}$ and $B_{CP}$.

# %% [markdown]
# Each kept query is the chunk's query at its position, per head (`"head"`) or shared by a group (`"group"`):

# %%
#| export
def kept_queries(q_chunk: Tensor, pos: Tensor) -> Tensor:
    "[B,Hkv,G,n,D]: the queries of q_chunk [B,Hq,S,D] at positions pos [B,Hkv,g,n] (`kept_positions`), per KV head."
    B, Hkv, _, n = pos.shape
    _, Hq, S, D = q_chunk.shape
    return q_chunk.view(B, Hkv, Hq // Hkv, S, D).gather(3, pos[..., None].expand(-1, -1, Hq // Hkv, -1, D))


# %%
for mode in QUERY_SELECT:
    _pos = kept_positions(q, 4, G, mode)
    kq = kept_queries(q, _pos)
    test_eq(kq.shape, (B, Hkv, G, 4, D))
    for b in range(B):
        for h in range(Hkv):
            for g_ in range(G):
                for r in range(4): test_eq(kq[b, h, g_, r], q[b, h * G + g_, _pos[b, h, min(g_, _pos.shape[2] - 1), r]])


# %%
#| export
def unit_queries(q_chunk: Tensor, pos: Tensor, G: int) -> Tensor:
    "Q̂ [B,Hkv,G,n,D]: each query head's kept queries (`pos` [B,Hq,n]), normalized, under its KV head."
    B, Hq, n = pos.shape
    return unit_vectors(kept_queries(q_chunk, pos.reshape(B, Hq // G, G, n)))  # only the kept rows are normalized


# %%
_pos = select_queries(q, 4, G, "head")
uq = unit_queries(q, _pos, G)
for b in range(B):
    for hq in range(Hkv * G):
        for r in range(4): assert_close(uq[b, hq // G, hq % G, r], _unit(q[b, hq, _pos[b, hq, r]]), rtol=0, atol=1e-12)


# %% [markdown]
# Row $r$ of $\bar Q_h$ by a Python sum of the group's unit queries, in both modes:

# %%
#| export
def preaggregated_queries(q_chunk: Tensor, pos: Tensor, G: int) -> Tensor:
    "Q̄ [B,Hkv,n,D]: row r the mean over a group's G heads of their r-th kept query (`pos`), each normalized (§3.3)."
    return unit_queries(q_chunk, pos, G).mean(2)  # normalize, then average: the mean of cosines is linear in them


# %%
for mode in QUERY_SELECT:
    _pos = select_queries(q, 4, G, mode)
    qbar = preaggregated_queries(q, _pos, G)
    for b in range(B):
        for h in range(Hkv):
            for r in range(4):
                want = sum(_unit(q[b, h * G + g_, _pos[b, h * G + g_, r]]) for g_ in range(G)) / G
                assert_close(qbar[b, h, r], want, rtol=0, atol=1e-12)


# %%
#| export
def check_quoka_options(n_q: int, query_select: str, query_agg: str, query_rank: str = "dissimilar",
                        gqa_agg: str = "mean"):
    """Raise naming the argument unless N_Q is an int >= 1 and the modes are among QUERY_SELECT, QUERY_AGGS,
    QUERY_RANKS and GQA_AGGS."""
    check_int(n_q, "n_q (N_Q)", 1)
    if gqa_agg not in GQA_AGGS: raise ValueError(f"gqa_agg must be one of {GQA_AGGS}, got {gqa_agg!r}")
    if query_rank not in QUERY_RANKS: raise ValueError(f"query_rank must be one of {QUERY_RANKS}, got {query_rank!r}")
    if query_select not in QUERY_SELECT:
        raise ValueError(f"query_select must be one of {QUERY_SELECT}, got {query_select!r}")
    if query_agg not in QUERY_AGGS: raise ValueError(f"query_agg must be one of {QUERY_AGGS}, got {query_agg!r}")


def check_backend(backend: str) -> str:
    "Validate the key-scoring backend: 'torch' (unit keys, then products) or 'triton' (`sparsekv.quoka.kernel`)."
    if backend not in BACKENDS: raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


# %%
check_quoka_options(16, "group", "max")
for n_q in (0, 2.0, "4"): test_fail(lambda: check_quoka_options(n_q, "group", "max"), contains="n_q")
test_fail(lambda: check_quoka_options(4, "token", "max"), contains="query_select")
test_fail(lambda: check_quoka_options(4, "group", "sum"), contains="query_agg")
test_fail(lambda: check_quoka_options(4, "group", "max", "far"), contains="query_rank")
test_fail(lambda: check_quoka_options(4, "group", "max", gqa_agg="sum"), contains="gqa_agg")
test_eq(check_backend("triton"), "triton")
test_fail(lambda: check_backend("cuda"), contains="backend must be one of ('torch', 'triton')")


# %% [markdown]
# $G$ from the heads; an empty cache (the first chunk) passes; a bad shape or a NaN is refused naming the argument.
# The NaN check reads a value back from the device: in a patched model's step (where the policy calls this for
# every chunk and layer) it runs only under `sparsekv.attention.checks`, the shapes always:

# %%
#| export
def check_chunk(q_chunk: Tensor, k_cache: Tensor) -> int:
    "Check a chunk's queries q_chunk [B,Hq,S,D] and earlier keys k_cache [B,Hkv,T,D] (T = 0 allowed): G = Hq // Hkv."
    if isinstance(k_cache, Tensor) and k_cache.dim() == 4 and k_cache.shape[2] == 0:
        # an empty cache is valid; its other dims are still checked
        k_cache = k_cache.new_zeros(*k_cache.shape[:2], 1, k_cache.shape[3])
    try: G = check_qkv(q_chunk, k_cache)
    except (TypeError, ValueError) as e: raise type(e)(f"q_chunk (as q) / k_cache (as k): {e}") from None
    require_data("q_chunk", q_chunk); require_data("k_cache", k_cache)  # selection reads values
    # every entry (a NaN in a query that is not kept still moves the mean query, hence which queries are kept)
    require_finite("q_chunk", q_chunk); require_finite("k_cache", k_cache)
    return G


# %%
_q, _k = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 5, 8)
test_eq(check_chunk(_q, _k), 3)
test_eq(check_chunk(_q, _k[:, :, :0]), 3)
test_fail(lambda: check_chunk(_q, _k[..., :4]), contains="q_chunk (as q) / k_cache (as k)")
test_fail(lambda: check_chunk(_q, _k.masked_fill(_k > 1, math.nan)), contains="k_cache contains NaN or inf")
with hot_path():
    test_eq(check_chunk(_q, _k.masked_fill(_k > 1, math.nan)), 3)
    test_fail(lambda: check_chunk(_q, _k[..., :4]), contains="q_chunk (as q) / k_cache (as k)")
    with checks(): test_fail(lambda: check_chunk(_q, _k * math.inf), contains="k_cache contains NaN or inf")


# %%
#| export
def unit_keys(k: Tensor) -> Tensor:
    "k̂ = k / max(|k|, EPS) per key, in the accumulation dtype: [..., T, D]."
    return unit_vectors(k)


# %%
_k = torch.randn(1, 2, 9, 4, generator=torch.Generator().manual_seed(0))
for h in range(2):
    for j in range(9): assert_close(unit_keys(_k)[0, h, j], _unit(_k[0, h, j]))
test_eq(unit_keys(_k.bfloat16()).dtype, torch.float32)


# %% [markdown]
# Unit keys given by the caller are checked for what they are, cheaply: their shape, dtype and device, and their
# first, middle and last keys against `unit_keys` of those of `k_cache` (three keys a call, not the cache). Unit keys
# of other keys of the right shape (another layer's, another sequence's) would otherwise be scored silently. The
# comparison of values is a content check (`torch.allclose` returns a Python bool: a read back), so in a patched
# model's step it runs only under `sparsekv.attention.checks`.

# %%
#| export
def check_unit_keys(k_unit: Tensor, k_cache: Tensor) -> Tensor:
    """`k_unit` if it is a tensor like `unit_keys(k_cache)` whose first, middle and last keys are those of `k_cache`
    (unit keys of other keys, e.g. another layer's or a stale cache's, are refused); else a ValueError naming it."""
    dtype = accumulation_dtype(k_cache)
    if (not isinstance(k_unit, Tensor) or k_unit.shape != k_cache.shape or k_unit.dtype != dtype
            or k_unit.device != k_cache.device):
        got = f"{getattr(k_unit, 'dtype', type(k_unit).__name__)} {tuple(getattr(k_unit, 'shape', ()))}"
        raise ValueError(f"k_unit must be the unit keys [B,Hkv,T,D] = {tuple(k_cache.shape)} in {dtype} on "
                         f"{k_cache.device} (`unit_keys(k_cache)`), got {got} on {getattr(k_unit, 'device', None)}")
    T = k_cache.shape[2]
    if not T or not content_checks(): return k_unit  # comparing values reads back: not in the per-step path
    pos = sorted({0, T // 2, T - 1})
    at = torch.tensor(pos, device=k_cache.device)
    if not torch.allclose(k_unit.index_select(2, at), unit_vectors(k_cache.index_select(2, at)), rtol=1e-5,
                          atol=1e-6, equal_nan=True):
        raise ValueError("k_unit must be the unit keys of k_cache (`unit_keys(k_cache)`); its keys at positions "
                         f"{pos} are not those of k_cache (another layer's, or a cache that changed?)")
    return k_unit


# %%
test_eq(check_unit_keys(unit_keys(_k), _k), unit_keys(_k))
test_eq(check_unit_keys(unit_keys(_k[:, :, :0]), _k[:, :, :0]).shape, (1, 2, 0, 4))
test_fail(lambda: check_unit_keys(unit_keys(_k.roll(1, 2)), _k), contains="positions [0, 4, 8] are not those of")
test_fail(lambda: check_unit_keys(unit_keys(_k)[:, :1], _k), contains="k_unit must be the unit keys [B,Hkv,T,D]")
with hot_path():  # shapes only, unless checks() is on
    test_eq(check_unit_keys(unit_keys(_k.roll(1, 2)), _k), unit_keys(_k.roll(1, 2)))
    with checks(): test_fail(lambda: check_unit_keys(unit_keys(_k.roll(1, 2)), _k), contains="are not those of")


# %%
#| export
def check_k_cache(k_cache: Tensor) -> Tensor:
    "`k_cache` if it is a floating-point tensor [B,Hkv,T,D] (a layer's cached keys), else a TypeError naming it."
    if not isinstance(k_cache, Tensor) or k_cache.dim() != 4 or not k_cache.is_floating_point():
        raise TypeError("k_cache must be a floating-point tensor [B,Hkv,T,D], got "
                        f"{getattr(k_cache, 'shape', type(k_cache).__name__)}")
    return k_cache


# %%
test_eq(check_k_cache(_k), _k)
for bad in (_k[0], _k.long(), _k.tolist()): test_fail(lambda: check_k_cache(bad), contains="k_cache must be")


# %% [markdown]
# The unit-key cache: fed the keys of a growing cache chunk by chunk (buffer growth included), it returns exactly
# `unit_keys` of the whole cache, in float32 and bfloat16; a cropped or differently shaped cache starts over; a cache
# that is not [B,Hkv,T,D] is refused; beam search's reordering of rows moves the unit keys with them.

# %%
#| export
class UnitKeyCache:
    "Unit keys of a layer's growing cache: `update(k_cache)` normalizes only the keys added since the last call."

    def __init__(self):
        self.buffer, self.length = None, 0

    @property
    def length(self) -> int:
        "Keys whose unit keys are cached (kept as a shape, `shape_count`: a compiled step serves every length)."
        return self._length.shape[1]

    @length.setter
    def length(self, n: int): self._length = shape_count(n)

    def crop(self, n: int):
        "Forget the unit keys from position n on (the KV cache was cropped or a new sequence starts)."
        self.length = min(self.length, check_int(n, "n"))

    def apply_rows(self, fn):
        "Apply the batch-row map `fn` (beam search's reorder etc., `sparsekv.cache.row_map`) to the cached unit keys."
        if self.buffer is not None: self.buffer = fn(self.buffer)

    def update(self, k_cache: Tensor) -> Tensor:
        "Unit keys [B,Hkv,T,D] of k_cache [B,Hkv,T,D], whose first `length` keys must be those of the previous call."
        B, Hkv, T, D = check_k_cache(k_cache).shape
        dtype = accumulation_dtype(k_cache)
        if self.buffer is not None and (self.buffer.shape[:2] + self.buffer.shape[3:] != (B, Hkv, D)
                                        or self.buffer.dtype != dtype or self.buffer.device != k_cache.device):
            self.buffer, self.length = None, 0  # another shape: start over
        self.length = min(self.length, T)
        if self.buffer is None or self.buffer.shape[2] < T:  # grow by doubling: amortized O(new keys) per call
            size = max(T, 2 * (0 if self.buffer is None else self.buffer.shape[2]))
            grown = k_cache.new_empty(B, Hkv, size, D, dtype=dtype)
            if self.length: grown[:, :, :self.length] = self.buffer[:, :, :self.length]
            self.buffer = grown
        unit_vectors(k_cache[:, :, self.length:T], out=self.buffer[:, :, self.length:T])  # in place: no copy
        self.length = T
        return self.buffer[:, :, :T]


# %%
g = torch.Generator().manual_seed(4)
for dtype in (torch.float32, torch.bfloat16):
    cache = UnitKeyCache()
    k_all = torch.randn(1, 2, 300, 32, generator=g).to(dtype)
    for T in (0, 16, 32, 48, 200, 201, 300):
        unit = cache.update(k_all[:, :, :T])
        test_eq(unit, unit_keys(k_all[:, :, :T]))
        test_eq(unit.dtype, torch.float32)
    cache.crop(20)
    k2 = torch.cat([k_all[:, :, :20], k_all[:, :, 100:120]], 2)                  # the first 20 keys kept, others new
    test_eq(cache.update(k2), unit_keys(k2))                                       # recomputed from position 20 on
    test_eq(cache.update(k_all[:, :, :10])[:, :, :10], unit_keys(k_all[:, :, :10]))  # a shorter cache: cropped to it
    test_eq(cache.update(k_all[:, :1, :10]), unit_keys(k_all[:, :1, :10]))         # another shape: a fresh buffer
test_fail(lambda: UnitKeyCache().update(torch.randn(2, 20, 16)), contains="k_cache")
# beam search reorders the cache's rows (apply_rows with the same map): the unit keys follow
kb = torch.randn(3, 2, 12, 8, generator=g)
cache = UnitKeyCache()
cache.update(kb)
cache.apply_rows(lambda x: x[[2, 0, 0]])
kb = torch.cat([kb[[2, 0, 0]], kb[:, :, :1]], 2)   # the moved rows and one new key each
test_eq(cache.update(kb), unit_keys(kb))


# %% [markdown]
# Check the pre-aggregation identity against the head-by-head computation: all $G \cdot |I|$
# cosines formed one head at a time (explicit unit vectors, no pre-aggregation), averaged over
# heads at each row, then maxed. Exact up to rounding, for both pairings and $G = 1, 3, 4$.
# Then that the other order $\tau$ (max per head, then mean) is a different number, never
# below $\sigma$; and that averaging raw queries before normalizing is different as well.

# %%
#| export
def quoka_scores(q_chunk: Tensor, k_cache: Tensor, n_q: int = 16, query_select: str = "group", query_agg: str = "max",
                 k_unit: Tensor | None = None, query_rank: str = "dissimilar",
                 generator: torch.Generator | None = None, gqa_agg: str = "mean", backend: str = "torch") -> Tensor:
    """QuoKA's score of every cached key, [B,Hkv,T] float32 (float64 for float64 input): max over kept queries of q̄·k̂
    (§3.1–3.3, Alg. 1); `k_unit`: the unit keys if already at hand; `query_rank`, `generator`: see `select_queries`;
    `gqa_agg='max'` (an ablation): the max over the group's heads of each head's score, not pre-aggregated;
    `backend='triton'`: the keys scored where they lie by one fused kernel (`sparsekv.quoka.kernel`, no `k_unit`)."""
    check_quoka_options(n_q, query_select, query_agg, query_rank, gqa_agg)
    check_chunk(q_chunk, k_cache)
    return _quoka_scores(q_chunk, k_cache, n_q, query_select, query_agg, k_unit, query_rank, generator, gqa_agg,
                         check_backend(backend))


def _quoka_scores(q_chunk, k_cache, n_q, query_select, query_agg, k_unit, query_rank, generator, gqa_agg,
                  backend="torch") -> Tensor:
    "`quoka_scores` of arguments already checked (`check_quoka_options`, `check_chunk`, `check_backend`)."
    G = q_chunk.shape[1] // k_cache.shape[1]
    B, Hq, S, D = q_chunk.shape
    rows = unit_vectors(q_chunk.view(B, Hq // G, G, S, D) if n_q >= S else  # every query kept (decode): no gather
                        kept_queries(q_chunk, kept_positions(q_chunk, n_q, G, query_select, query_rank, generator)))
    if backend == "triton":  # one group of pre-aggregated rows, or G groups of each head's rows
        if k_unit is not None: raise ValueError("backend='triton' reads the keys themselves: pass no k_unit")
        return key_scores(rows.mean(2) if gqa_agg == "mean" else rows.flatten(2, 3), k_cache,
                          1 if gqa_agg == "mean" else G, query_agg, EPS)
    k_unit = unit_keys(k_cache) if k_unit is None else check_unit_keys(k_unit, k_cache)
    if gqa_agg == "mean": s = head_products(rows.mean(2), k_unit)  # [B,Hkv,n,T]: the pre-aggregated Q̄ (§3.3)
    else: s = rows @ k_unit.mT.unsqueeze(2)                      # [B,Hkv,G,n,T]: each head
    s = s.amax(-2) if query_agg == "max" else s.mean(-2)                               # over the kept queries
    return s if gqa_agg == "mean" else s.amax(2)                                       # then the largest head


# %%
g = torch.Generator().manual_seed(2)
for G in (1, 3, 4):
    B, Hkv, S, T, D, n_q = 2, 2, 12, 30, 16, 5
    q = (torch.randn(B, Hkv * G, S, D, generator=g, dtype=torch.float64)
         * torch.rand(B, Hkv * G, S, 1, generator=g, dtype=torch.float64) * 3)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) * 2
    for mode in QUERY_SELECT:
        pos = select_queries(q, n_q, G, mode)                                 # [B,Hq,n]
        qk = torch.stack([torch.stack([torch.stack([
            torch.stack([_unit(k[b, hq // G, j]) @ _unit(q[b, hq, pos[b, hq, r]]) for j in range(T)])
            for r in range(n_q)]) for hq in range(Hkv * G)]) for b in range(B)])   # c[b, hq, r, j], head by head
        c = qk.view(B, Hkv, G, n_q, T)
        # mean over heads per row, then max over rows
        sigma = c.mean(2).amax(2)
        assert_close(quoka_scores(q, k, n_q, mode), sigma, rtol=0, atol=1e-12)
        assert_close(quoka_scores(q, k, n_q, mode, "mean"), c.mean(2).mean(2), rtol=0, atol=1e-12)
        tau = c.amax(3).mean(2)                                               # max per head, then mean over heads
        assert_close(quoka_scores(q, k, n_q, mode, gqa_agg="max"), c.amax(3).amax(2), rtol=0, atol=1e-12)
        assert_close(quoka_scores(q, k, n_q, mode, "mean", gqa_agg="max"), c.mean(3).amax(2), rtol=0, atol=1e-12)
        assert (tau >= sigma - 1e-12).all()
        if G > 1: assert (tau - sigma).abs().max() > 1e-3                     # the orders differ
        else: assert_close(tau, sigma)                                        # ... unless there is one head
        qbar_raw = q.gather(2, pos[..., None].expand(-1, -1, -1, D)).view(B, Hkv, G, n_q, D).mean(2)
        raw_first = (F.normalize(qbar_raw, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)).amax(2)
        if G > 1: assert (raw_first - sigma).abs().max() > 1e-3               # average-then-normalize is another score

# %% [markdown]
# ## The theorem of §3.1: a candidate statement (reconstruction)
#
# §3.1 ends "This can be formalized through the following theorem:", and our copy has no
# theorem after it. What the sentence before it claims is that keeping the queries far from
# the mean "preserves the queries most responsible for large key–query dot products while
# normalizing per query". We cannot recover the authors' statement; the following is a
# statement of that claim we can prove, **marked as our reconstruction**. It is about the
# *selection score* (max of cosines), not about attention mass.
#
# **Proposition (reconstruction).** Fix one query head ($G = 1$), its unit queries $\hat q_i$,
# $i = 1..S$, the unit mean direction $\hat M = \hat M_Q$ and the dissimilarities $d_i =
# -\hat M\cdot\hat q_i$. Put $\rho_i = \|\hat q_i - \hat M\| = \sqrt{2(1 + d_i)}$. For any kept set
# $I$ let $\sigma_I(k) = \max_{i\in I}\hat q_i\cdot\hat k$ and $\rho_{\bar I} = \max_{i\notin I}\rho_i$.
# Then for every key $k$
#
# 1. $|\hat q_i\cdot\hat k - \hat M\cdot\hat k| \le \rho_i$: a query's scores are those of the mean
#    direction up to its distance from it;
# 2. $\sigma_I(k) \le \sigma_{\mathrm{all}}(k) \le \max\big(\sigma_I(k),\ \hat M\cdot\hat k + \rho_{\bar I}\big)$:
#    dropping the queries outside $I$ can raise no key's score, and lowers it at most to where
#    the mean direction plus $\rho_{\bar I}$ would put it;
# 3. among all sets of $N_Q$ queries, QuoKA's (the $N_Q$ largest $d_i$) minimizes $\rho_{\bar I}$,
#    so it makes the bound of 2 the tightest.
#
# *Proof.* 1 is Cauchy–Schwarz with $\|\hat k\| = 1$, and $\|\hat q_i - \hat M\|^2 = 2 - 2\hat q_i\cdot\hat M$.
# 2: $\sigma_{\mathrm{all}} = \max(\sigma_I, \max_{i\notin I}\hat q_i\cdot\hat k)$ and by 1 each
# dropped score is at most $\hat M\cdot\hat k + \rho_i \le \hat M\cdot\hat k + \rho_{\bar I}$.
# 3: $\rho_i$ increases with $d_i$, so dropping the $S - N_Q$ smallest $d_i$ leaves the smallest
# possible maximum. $\square$
#
# **What it does and does not say.** The near-mean queries QuoKA drops are redundant for the
# max-cosine score *to within their distance from the mean*: on a chunk whose queries
# cluster tightly around $\hat M$ except for a few outliers, QuoKA's choice loses almost
# nothing of the all-query score. It says nothing about *attention*: that the dissimilar
# queries are the ones that spread their softmax mass over many keys (Figure 2(a)) is an
# empirical premise, measured on SmolLM2 by the
# [observations stage](../reproduce/20_quoka_observations.ipynb) (there the per-head
# correlation is negative in few layers, and at equal $N_Q$ the dissimilar queries recover
# slightly *less* attention mass than random ones). The proposition holds on every model;
# whether the selection it justifies keeps the keys attention needs depends on the premise.
#
# Checked on random chunks with a clear mean direction: 1 for every query and key, 2 for every
# key with QuoKA's kept set from `select_queries`, 3 against every one of the $\binom{8}{3} = 56$
# subsets of a small chunk, and that 1 holds with equality for the key along $\hat q_i - \hat M$.

# %%
from itertools import combinations

g = torch.Generator().manual_seed(11)
Dq = 16
for S, n_q in ((32, 4), (8, 3)):
    q = torch.randn(1, 1, S, Dq, generator=g, dtype=torch.float64) * 0.4 + 1.0   # a shared direction plus spread
    k = torch.randn(1, 1, 200, Dq, generator=g, dtype=torch.float64)
    qh, kh = F.normalize(q[0, 0], dim=-1), F.normalize(k[0, 0], dim=-1)
    Mh = F.normalize(q[0, 0].mean(0), dim=-1)
    rho = (2 * (1 + query_dissimilarity(q)[0, 0])).clamp_min(0).sqrt()
    assert_close(rho, (qh - Mh).norm(dim=-1))
    cos = qh @ kh.T                                                         # [S, T]
    assert ((cos - Mh @ kh.T).abs() <= rho[:, None] + 1e-12).all()          # 1
    kept = select_queries(q, n_q, 1)[0, 0].tolist()
    dropped = [i for i in range(S) if i not in kept]
    sigma_I, sigma_all = cos[kept].amax(0), cos.amax(0)
    assert_close(sigma_I, quoka_scores(q, k, n_q=n_q)[0, 0])
    bound = torch.maximum(sigma_I, Mh @ kh.T + rho[dropped].max())
    assert (sigma_I <= sigma_all + 1e-12).all() and (sigma_all <= bound + 1e-12).all()   # 2
    worst = min(max(rho[i].item() for i in range(S) if i not in I) for I in combinations(range(S), n_q)) \
        if S <= 8 else None
    if worst is not None: assert_close(rho[dropped].max().item(), worst)     # 3: QuoKA's set is optimal
# equality in 1: the key along q_f - M, for the dropped query q_f farthest from the mean
i_far = dropped[int(rho[dropped].argmax())]
k_star = (qh[i_far] - Mh) / rho[i_far]
assert_close(qh[i_far] @ k_star, Mh @ k_star + rho[i_far])


# %% [markdown]
# ## Algorithm 1, reconstructed
#
# For one layer and one chunk, per batch element and KV head $h$ (the paper's Algorithm 1
# is missing from our copy; this is the procedure §3.1–3.4 describe, with the
# interpretations above):
#
# 1. $n \leftarrow$ `resolve_budget`$(B_{SA}, T)$. If $n = T$, return all keys $0, \dots, T-1$.
# 2. For each query head $g$ of the group: $M_{Q,g} \leftarrow$ mean of the chunk's queries;
#    $d_{g,i} \leftarrow -\hat M_{Q,g} \cdot \hat q_{g,i}$.
# 3. Keep $\min(N_Q, S)$ positions: by $\frac1G \sum_g d_{g,i}$ (group) or per head (head).
# 4. $\bar Q_h \leftarrow$ rows $\frac1G \sum_g \hat q_{g,i}$ over the kept positions.
# 5. $\sigma_{h,j} \leftarrow \max_{\text{rows}} (\bar Q_h \hat K_h^\top)_{:,j}$ for all $T$ keys (unit keys cached across chunks).
# 6. Return the $n$ keys of largest $\sigma_{h,j}$, ties to the lower index, ascending.
#
# The chunk's own keys are not scored: every query attends to its block causally anyway,
# so the caller appends them (the integration's `add_chunk_keys`). No causal mask is needed
# on the cached keys, which all precede every query of the chunk.

# %% [markdown]
# The selection is the scores' top $B_{SA}$ (a Python sort of every row), or every key when $T \le B_{SA}$; unit keys
# from a `UnitKeyCache` give the same selection as without them, and unit keys that are not those of `k_cache` are
# refused. (Against the loop reference below, with all options, after it.)

# %%
#| export
def quoka_select(q_chunk: Tensor, k_cache: Tensor, n_q: int = 16, budget: int | float = 1024,
                 query_select: str = "group", query_agg: str = "max", k_unit: Tensor | None = None,
                 query_rank: str = "dissimilar", generator: torch.Generator | None = None,
                 gqa_agg: str = "mean", backend: str = "torch") -> Tensor:
    """Alg. 1: indices [B,Hkv,min(B_SA,T)] (int64, ascending, ties to the lower index) of the cached keys
    k_cache [B,Hkv,T,D] that the chunk q_chunk [B,Hq,S,D] (post-RoPE) attends to; all keys if T <= B_SA.
    `budget`: B_SA as an int, or a float fraction of T; `n_q`: N_Q queries kept per chunk;
    `k_unit`: `unit_keys(k_cache)` if at hand (e.g. from a `UnitKeyCache`); `query_rank`: 'dissimilar' (the paper),
    or the ablations 'similar' and 'random' (drawn from `generator`); `gqa_agg`: 'mean' over the heads of a group
    (the paper, pre-aggregated) or the ablation 'max'; `backend`: 'torch' or 'triton' (see `quoka_scores`)."""
    check_quoka_options(n_q, query_select, query_agg, query_rank, gqa_agg)
    check_chunk(q_chunk, k_cache)
    B, Hkv, T, _ = k_cache.shape
    n = resolve_budget(budget, T)
    if n == T: return all_key_indices(B, Hkv, T, k_cache.device)  # T <= B_SA: nothing to select
    return top_budget_indices(_quoka_scores(q_chunk, k_cache, n_q, query_select, query_agg, k_unit, query_rank,
                                            generator, gqa_agg, check_backend(backend)), n)


# %%
def _qk(G, S, T, B=2, Hkv=2, D=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hkv * G, S, D, generator=g, dtype=dtype) + 0.5,
            torch.randn(B, Hkv, T, D, generator=g, dtype=dtype))

q, k = _qk(3, 8, 20)
test_eq(quoka_select(q, k, 4, 8), top_budget_indices_reference(quoka_scores(q, k, 4), 8))
test_eq(quoka_select(q, k, 4, 20), torch.arange(20).expand(2, 2, 20))
g = torch.Generator().manual_seed(4)
for dtype in (torch.float32, torch.bfloat16):
    cache = UnitKeyCache()
    q = torch.randn(1, 6, 16, 32, generator=g).to(dtype)
    k_all = torch.randn(1, 2, 300, 32, generator=g).to(dtype)
    for T in (16, 32, 48, 200, 201, 300):
        unit = cache.update(k_all[:, :, :T])
        test_eq(quoka_select(q, k_all[:, :, :T], 4, 10, k_unit=unit), quoka_select(q, k_all[:, :, :T], 4, 10))
q, k = _qk(3, 8, 20)
test_fail(lambda: quoka_select(q, k, 4, 8, k_unit=unit_keys(k)[:, :, :5]), contains="k_unit")
test_fail(lambda: quoka_select(q, k, 4, 8, k_unit=unit_keys(k).float()), contains="k_unit")
test_fail(lambda: quoka_select(q, k, 4, 8, k_unit=unit_keys(k).to("meta")), contains="k_unit")
test_fail(lambda: quoka_select(q, k, 4, 8, k_unit=unit_keys(k.flip(2))), contains="k_unit must be the unit keys of k")
test_fail(lambda: quoka_select(q, k, 4, 8, k_unit=unit_keys(k + 1)), contains="positions [0, 10, 19]")
test_fail(lambda: quoka_select(q.to("meta"), k.to("meta"), 4, 8), contains="q_chunk is a meta tensor")


# %% [markdown]
# ## The brute-force reference
#
# `quoka_select_reference` follows the procedure above with explicit loops over batch,
# KV head, query head and kept query, in float64, and without pre-aggregation: every
# head's cosines are formed separately from unit vectors and averaged afterwards.
# Rankings (queries and keys) come from Python's `sorted` on the key (-score, index). It
# shares no code with the fast path except input validation and `resolve_budget`.

# %%
#| export
def _ranked(values: list, n: int) -> list:
    "The n indices of the largest values, ties to the lower index, in ascending order."
    return sorted(sorted(range(len(values)), key=lambda i: (-values[i], i))[:n])


# %%
test_eq(_ranked([1.0, 3.0, 3.0, 0.0, 3.0], 2), [1, 2])   # ties to the lower index
test_eq(_ranked([5.0, 1.0, 4.0], 2), [0, 2])             # ascending, not by value
test_eq(_ranked([1.0, 2.0], 5), [0, 1])


# %% [markdown]
# The loops agree with the pre-aggregated product in float64, for every option (the `random` rankings from equal
# seeds):

# %%
#| export
def quoka_scores_reference(q_chunk: Tensor, k_cache: Tensor, n_q: int = 16, query_select: str = "group",
                           query_agg: str = "max", query_rank: str = "dissimilar",
                           generator: torch.Generator | None = None, gqa_agg: str = "mean") -> Tensor:
    """`quoka_scores` by loops over batch, KV head, query head and kept query in float64 (no pre-aggregation);
    'random' ranks by the same draw, torch.rand([B,Hq,S]) from `generator`."""
    check_quoka_options(n_q, query_select, query_agg, query_rank, gqa_agg)
    G = check_chunk(q_chunk, k_cache)
    q, k = q_chunk.double(), k_cache.double()
    B, Hq, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    n = min(n_q, S)
    unit = lambda x: x / max(x.norm().item(), EPS)
    draw = torch.rand(B, Hq, S, generator=generator).tolist() if query_rank == "random" and n < S else None
    sign = -1.0 if query_rank == "similar" else 1.0
    out = torch.zeros(B, Hkv, T, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            heads = [h * G + g for g in range(G)]
            dis = {}
            for hq in heads:
                m = unit(q[b, hq].mean(0))
                dis[hq] = draw[b][hq] if draw else [-sign * float(unit(q[b, hq, i]) @ m) for i in range(S)]
            if query_select == "group":
                avg = [sum(dis[hq][i] for hq in heads) / G for i in range(S)]
                kept = {hq: _ranked(avg, n) for hq in heads}
            else:
                kept = {hq: _ranked(dis[hq], n) for hq in heads}
            khat = torch.stack([unit(k[b, h, j]) for j in range(T)]) if T else k.new_zeros(0, D)
            # cosines [G, n, T] of all keys with head hq's r-th kept query
            c = torch.stack([torch.stack([khat @ unit(q[b, hq, kept[hq][r]]) for r in range(n)]) for hq in heads])
            # 'mean': the group mean at each row, then over rows; 'max': each head over its rows, then the largest
            rows = c.mean(0, keepdim=True) if gqa_agg == "mean" else c
            out[b, h] = (rows.amax(1) if query_agg == "max" else rows.mean(1)).amax(0)
    return out


# %%
for G in (1, 3):
    q, k = _qk(G, 9, 15, seed=G)
    for mode in QUERY_SELECT:
        for agg in QUERY_AGGS:
            for gqa in GQA_AGGS:
                for rank in QUERY_RANKS:
                    seeded = lambda: torch.Generator().manual_seed(2)
                    assert_close(quoka_scores(q, k, 4, mode, agg, query_rank=rank, generator=seeded(), gqa_agg=gqa),
                                 quoka_scores_reference(q, k, 4, mode, agg, rank, seeded(), gqa), rtol=0, atol=1e-12)


# %% [markdown]
# Check `quoka_select` against the reference: GQA $G = 1, 3, 4$, both query modes (and the
# ablation's `similar` and `random` rankings), a budget below, equal to and above the cache,
# a fractional budget, $N_Q \ge S$ (all queries kept), a single query; float64 (indices must
# agree exactly) and float32 (scores within float32 rounding). The output is int64, ascending
# and duplicate-free.

# %%
#| export
def quoka_select_reference(q_chunk: Tensor, k_cache: Tensor, n_q: int = 16, budget: int | float = 1024,
                           query_select: str = "group", query_agg: str = "max", query_rank: str = "dissimilar",
                           generator: torch.Generator | None = None, gqa_agg: str = "mean") -> Tensor:
    "`quoka_select` from `quoka_scores_reference` and a Python sort of every row."
    n = resolve_budget(budget, k_cache.shape[2])
    check_quoka_options(n_q, query_select, query_agg, query_rank, gqa_agg)
    if n == k_cache.shape[2]: query_rank = "dissimilar"  # quoka_select keeps every key without ranking (or drawing)
    scores = quoka_scores_reference(q_chunk, k_cache, n_q, query_select, query_agg, query_rank, generator, gqa_agg)
    return top_budget_indices_reference(scores, n)


# %%
for G in (1, 3, 4):
    for S, T, n_q, budget in [(16, 40, 4, 10), (16, 40, 16, 10), (16, 40, 30, 0.25), (1, 40, 4, 7), (8, 9, 2, 9),
                              (8, 5, 2, 9)]:
        q, k = _qk(G, S, T, seed=G * 100 + S + T)
        for mode in QUERY_SELECT:
            idx = quoka_select(q, k, n_q, budget, mode)
            test_eq(idx, quoka_select_reference(q, k, n_q, budget, mode))
            for rank in ("similar", "random"):  # the ablations' rankings, the random one from equal seeds
                seeded = lambda: torch.Generator().manual_seed(9)
                test_eq(quoka_select(q, k, n_q, budget, mode, query_rank=rank, generator=seeded()),
                        quoka_select_reference(q, k, n_q, budget, mode, query_rank=rank, generator=seeded()))
            test_eq(idx.shape, (2, 2, resolve_budget(budget, T)))
            test_eq(idx.dtype, torch.long)
            assert (idx[..., 1:] > idx[..., :-1]).all()
            assert_close(quoka_scores(q.float(), k.float(), n_q, mode), quoka_scores_reference(q, k, n_q, mode).float(),
                         rtol=1e-5, atol=1e-5)
            for agg in QUERY_AGGS:  # the head-max ablation, both query aggregations
                test_eq(quoka_select(q, k, n_q, budget, mode, agg, gqa_agg="max"),
                        quoka_select_reference(q, k, n_q, budget, mode, agg, gqa_agg="max"))
test_eq(quoka_select(*_qk(3, 8, 6), 4, 6), torch.arange(6).expand(2, 2, 6))        # T == B_SA: every key
test_eq(quoka_select(*_qk(3, 8, 0), 4, 6).shape, (2, 2, 0))                         # empty cache (first chunk)
test_eq(quoka_select_reference(*_qk(3, 8, 0), 4, 6).shape, (2, 2, 0))

# %% [markdown]
# Ties: one-hot queries and keys make every quantity exact, and many keys repeat, so equal
# scores straddle the budget's cut. The earlier key must win, in both implementations:

# %%
g = torch.Generator().manual_seed(3)
D = 6
for G in (1, 2, 4):
    q = F.one_hot(torch.randint(0, D, (1, 2 * G, 10), generator=g), D).double()
    k = F.one_hot(torch.randint(0, 3, (1, 2, 25), generator=g), D).double()   # only 3 distinct keys among 25
    for mode in QUERY_SELECT:
        for budget in (1, 4, 12):
            test_eq(quoka_select(q, k, 3, budget, mode), quoka_select_reference(q, k, 3, budget, mode))
# all tied: the first B_SA
test_eq(quoka_select(torch.ones(1, 1, 4, 3), torch.ones(1, 1, 9, 3), 2, 5), torch.arange(5).view(1, 1, 5))

# %% [markdown]
# The fused kernel (`backend='triton'`, [the kernel notebook](20b_quoka_kernel.ipynb)) reads the
# raw keys and divides by their norms after the products: the same scores up to float32
# rounding for every option, and a selection whose keys score as the reference's up to that
# rounding (two keys within it of each other at the budget's cut may trade places). It
# computes in float32 and takes no unit keys.

# %%
import os

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel first runs
for G in (1, 3):
    for S, T, n_q in [(16, 40, 4), (1, 40, 4), (8, 70, 2)]:
        q, k = _qk(G, S, T, seed=G + S + T, dtype=torch.float32)
        for mode in QUERY_SELECT:
            for agg in QUERY_AGGS:
                for gqa in GQA_AGGS:
                    want = quoka_scores_reference(q, k, n_q, mode, agg, gqa_agg=gqa)
                    fused = quoka_scores(q, k, n_q, mode, agg, gqa_agg=gqa, backend="triton")
                    assert_close(fused, want.float(), rtol=1e-5, atol=1e-5)
                    idx = quoka_select(q, k, n_q, 10, mode, agg, gqa_agg=gqa, backend="triton")
                    ref = quoka_select_reference(q, k, n_q, 10, mode, agg, gqa_agg=gqa)
                    # the keys kept score as the reference's up to rounding (a near-tie at the cut may swap two)
                    assert_close(want.gather(-1, idx).sort(-1).values, want.gather(-1, ref).sort(-1).values,
                                 rtol=0, atol=1e-5)
                    assert (idx == ref).float().mean() > 0.9
q, k = _qk(3, 8, 20)
test_fail(lambda: quoka_select(q, k, 4, 8, backend="triton"), contains="k must be a float16, bfloat16 or float32")
test_fail(lambda: quoka_select(q.float(), k.float(), 4, 8, k_unit=unit_keys(k.float()), backend="triton"),
          contains="pass no k_unit")
test_fail(lambda: quoka_select(q, k, 4, 8, backend="cuda"), contains="backend must be one of")


# %% [markdown]
# ## Generation mode (§4.4)
#
# At decode "the model computes attention for a single query and no query subselection is
# applied"; the scoring and the group mean are unchanged. With one query the mean query is
# the query itself, so this is Algorithm 1 with $S = N_Q = 1$: the score of key $j$ is
# $\big(\frac1G \sum_g \hat q_g\big) \cdot \hat k_j$. `quoka_decode_select` is that case with
# a check that one query was passed.

# %%
#| export
def quoka_decode_select(q: Tensor, k_cache: Tensor, budget: int | float = 1024, k_unit: Tensor | None = None,
                        gqa_agg: str = "mean", backend: str = "torch") -> Tensor:
    "Generation (§4.4): indices [B,Hkv,min(B_SA,T)] for one query per head q [B,Hq,1,D], no subselection, same scoring."
    if isinstance(q, Tensor) and q.dim() == 4 and q.shape[2] != 1:
        raise ValueError(f"q must hold one query per head [B,Hq,1,D] at decode, got shape {tuple(q.shape)}; use "
                         "quoka_select for a chunk")
    return quoka_select(q, k_cache, 1, budget, k_unit=k_unit, gqa_agg=gqa_agg, backend=backend)


# %%
for G in (1, 3):
    q, k = _qk(G, 1, 50, seed=7)
    qbar = F.normalize(q, dim=-1).view(2, 2, G, 1, 16).mean(2)  # mean of the unit queries of a group
    want = top_budget_indices_reference((qbar @ F.normalize(k, dim=-1).transpose(-1, -2))[:, :, 0], 12)
    test_eq(quoka_decode_select(q, k, 12), want)
    test_eq(quoka_decode_select(q, k, 12), quoka_select_reference(q, k, 16, 12))
    test_eq(quoka_decode_select(q, k, 12, gqa_agg="max"), quoka_select_reference(q, k, 16, 12, gqa_agg="max"))
test_fail(lambda: quoka_decode_select(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 9, 4)), contains="one query per head")

# %% [markdown]
# In a patched model's step, Alg. 1 (with cached unit keys, for a chunk and at decode, in float32 and float64) reads
# nothing back from the device (`sparsekv.syncs.HostSyncs` counts the operators that would):

# %%
from sparsekv.syncs import HostSyncs

for dtype in (torch.float32, torch.float64):
    q, k = _qk(3, 8, 20, dtype=dtype)
    with HostSyncs() as rec, hot_path():
        quoka_select(q, k, 4, 8, k_unit=unit_keys(k)), quoka_decode_select(q[:, :, :1], k, 8, k_unit=unit_keys(k))
    test_eq(rec.total, 0)

# %% [markdown]
# ## Bad input
#
# Mismatched heads, dtypes or head dims, a non-integer $N_Q$, an unknown mode, a bad budget
# and NaN inputs are refused with a message naming the argument:

# %%
q, k = _qk(3, 8, 20)
test_fail(lambda: quoka_select(q[:, :5], k, 4, 8), contains="multiple of the KV heads")
test_fail(lambda: quoka_select(q, k.float(), 4, 8), contains="k_cache")
test_fail(lambda: quoka_select(q, k[..., :8], 4, 8), contains="head dim")
test_fail(lambda: quoka_select(q, k, 0, 8), contains="n_q")
test_fail(lambda: quoka_select(q, k, 4.0, 8), contains="n_q")
test_fail(lambda: quoka_select(q, k, 4, 8, "token"), contains="query_select")
test_fail(lambda: quoka_select(q, k, 4, 8, query_agg="sum"), contains="query_agg")
test_fail(lambda: quoka_select(q, k, 4, 8, gqa_agg="sum"), contains="gqa_agg")
test_fail(lambda: quoka_select(q, k, 4, 8, query_rank="far"), contains="query_rank")
test_fail(lambda: quoka_select(q, k, 4, -1), contains="budget")
test_fail(lambda: quoka_select(q, k.masked_fill(k > 2, math.nan), 4, 8), contains="NaN")

# %% [markdown]
# Every entry of the queries and keys is checked, not the queries that happen to be kept: a NaN or an infinity in a
# query the selection drops still moves the chunk's mean query, hence the ranking and which queries are kept, so the
# indices would silently change. Here a query of a chunk of 8 that is not among the 2 kept holds each non-finite value
# in turn, refused naming `q_chunk` (at decode too); and in any key, naming `k_cache`.

# %%
q, k = _qk(3, 8, 20, dtype=torch.float32)
clean = quoka_select(q, k, 2, 5)
dropped = next(i for i in range(8) if i not in kept_positions(q, 2, 3)[0, 0, 0].tolist())
for bad in (math.nan, math.inf, -math.inf):
    qb = q.clone(); qb[0, 0, dropped, 3] = bad
    test_fail(lambda: quoka_select(qb, k, 2, 5), contains="q_chunk contains NaN or inf")
    kb = k.clone(); kb[1, 1, 7, 0] = bad
    test_fail(lambda: quoka_select(q, kb, 2, 5), contains="k_cache contains NaN or inf")
    test_fail(lambda: quoka_decode_select(qb[:, :, dropped:dropped + 1], k, 5), contains="q_chunk contains NaN or inf")
test_eq(quoka_select(q, k, 2, 5), clean)

# %% [markdown]
# What the checks cost: `quoka_select` at SmolLM2's shape (9 query heads over 3 KV heads of 64 dims), a prefill chunk
# of $B_{CP} = 128$ queries and a decode query over 1,024 and 4,096 cached keys, with the checks and with
# `require_finite` replaced by a no-op, side by side (best of 5 runs, one thread). The checks are two sums over
# `q_chunk` and `k_cache`: measured on a shared 2-core machine, about 4-12% of a prefill chunk's selection and about
# 12% of a decode query's (whose selection is one product over the cache, the same order of work as the sum).

# %%
import time
from unittest import mock


def best_seconds(fn, repeats=20, runs=5):
    fn()
    return min(timeit(fn, repeats) for _ in range(runs))


def timeit(fn, repeats):
    t0 = time.perf_counter()
    for _ in range(repeats): fn()
    return (time.perf_counter() - t0) / repeats


threads = torch.get_num_threads()
torch.set_num_threads(1)
for T in (1024, 4096):
    k = torch.randn(1, 3, T, 64)
    for S in (128, 1):
        q = torch.randn(1, 9, S, 64)
        checked = best_seconds(lambda: quoka_select(q, k, 16, 256))
        with mock.patch(f"{quoka_select.__module__}.require_finite", lambda *a, **kw: None):
            unchecked = best_seconds(lambda: quoka_select(q, k, 16, 256))
        print(f"T={T:5d} {'prefill chunk' if S > 1 else 'decode query '}: checked {checked * 1e3:.3f} ms, unchecked "
              f"{unchecked * 1e3:.3f} ms, ratio {checked / unchecked:.3f}")
torch.set_num_threads(threads)
