# %% [markdown]
# # Selection baselines for chunked prefill
#
# > The KV selection methods QuoKA compares with (§4), each algorithm with its method class: mean of scores, SampleAttention, SparQ, Loki, LessIsMore.

# %%
#| default_exp quoka.baselines

# %%
#| export
from __future__ import annotations

import copy
import math
import weakref

import torch
from torch import Tensor

from sparsekv.attention import check_int, content_checks, shape_count, softmax_scale
from sparsekv.cache import follow_batch_ops
from sparsekv.hf import AttentionContext
from sparsekv.models import model_info
from sparsekv.quoka.policy import BaselinePolicy, BaselineSelection, EarlierKeysPolicy, SelectionMethod
from sparsekv.quoka.select import accumulation_dtype, check_chunk, check_k_cache, head_products
from sparsekv.select import all_key_indices, resolve_budget, top_budget_indices, top_budget_indices_reference, top_mask

# %%
#| hide
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.hf import ModelShape, chunked_prefill, patch
from sparsekv.models import load_model
from sparsekv.quoka.policy import QuokaPolicy


# %% [markdown]
# QuoKA's experiments (§4) compare it with query-dependent selection methods that were
# designed for **generation**, where one new query picks the keys it needs. Under chunked
# prefill a chunk of $S = B_{CP}$ queries must agree on one set of $B_{SA}$ keys per KV head,
# so each method needs a rule to combine its per-query scores; §2.4 and §5 note that "naïvely
# averaging such proxies across multiple queries in a prefill chunk often degrades
# accuracy". This notebook writes each baseline from its paper's description and from the
# QuoKA paper's summary of it, in the same shape as `quoka_select`:
#
# `method_select(q_chunk [B,Hq,S,D], k_cache [B,Hkv,T,D], budget, ...) -> indices [B,Hkv,min(B_SA,T)]`
#
# int64, ascending, ties to the lower index, every key when $T \le B_{SA}$; `budget` is
# $B_{SA}$ or a fraction of $T$ (`resolve_budget`). As for QuoKA, the chunk's own keys are not
# scored (the caller appends them) and the cached keys all precede the chunk, so no causal
# mask is needed. Each method comes with a brute-force reference (explicit loops over batch,
# KV head, query head and query, in float64) that it is checked against.
#
# | method | paper | what it scores a key with | how the chunk's queries are combined |
# |---|---|---|---|
# | mean of scores | (the naive extension, §2.4) | exact attention probability | mean over all queries and heads |
# | SampleAttention | Zhu et al. 2024 | exact attention probability | sum over a uniform sample of queries |
# | SparQ | Ribar et al. 2024 | logit from the query's top-$r$ channels | mean of softmax over queries and heads |
# | Loki | Singhania et al. 2024 | logit in the top-$r$ PCA subspace of the keys | mean of softmax over queries and heads |
# | LessIsMore | Yang et al. 2025b | exact attention probability, at a few layers only | per-head rankings merged across all heads, plus a recent window |
#
# Notation: $p_{g,i,j} = \mathrm{softmax}_j(c\, q_{g,i} \cdot k_j)$ is the attention probability
# of query $i$ of head $g$ on cached key $j$, normalized over the $T$ cached keys, with
# $c = 1/\sqrt D$ unless `scale` is given.
#
# Each section ends with the baseline as a method of the package, registered by its name (see
# [the registry](07_methods.ipynb)): a subclass of `BaselineSelection` (for LessIsMore, of `SelectionMethod`),
# which [the chunked-prefill policy](22_quoka_policy.ipynb) defines with `BaselinePolicy`, the policy that runs a
# selection function per chunk and layer. The class holds the method's parameters, its own policy where it needs
# one (Loki, LessIsMore), and its scoring cost per cached key (`key_cost`), checked by hand beside it.

# %%
#| export
def grouped_products(q: Tensor, k: Tensor) -> Tensor:
    "Dot products [B,Hkv,G,S,T] of each query q [B,Hq,S,D] with each key k [B,Hkv,T,D] of its head (no key copy)."
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    acc, G = accumulation_dtype(q), Hq // Hkv
    # head hG+g is row block g of KV head h
    return head_products(q.to(acc).view(B, Hkv, G, S, D), k.to(acc))


# %%
q, k = torch.randn(2, 6, 3, 4, dtype=torch.float64), torch.randn(2, 2, 5, 4, dtype=torch.float64)
gp = grouped_products(q, k)
test_eq(gp.shape, (2, 2, 3, 3, 5))
for h in range(6): assert_close(gp[:, h // 3, h % 3], q[:, h] @ k[:, h // 3].transpose(-1, -2))   # hG+g reads h
# keys whose rows and heads do not merge in a view (heads outermost in memory): the same products
k_heads_first = k.transpose(0, 1).contiguous().transpose(0, 1)
assert_close(grouped_products(q, k_heads_first), gp)


# %% [markdown]
# The references below share one loop: a per-query score of the cached keys, averaged (or summed) over the
# chunk's queries, or some of them, and the heads of a group. With the logits as the per-query score it is the
# mean of the products above:

# %%
#| export
def _reference_scores(q_chunk: Tensor, k_cache: Tensor, per_query, positions=None, reduce: str = "mean") -> Tensor:
    "Mean (or sum) over a KV head's G query heads and the chunk of per_query(q [D], K [T,D], b, h) -> [T]; loops."
    G = check_chunk(q_chunk, k_cache)
    q, k = q_chunk.double(), k_cache.double()
    B, _, S, _ = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    positions = list(range(S)) if positions is None else list(positions)
    out = torch.zeros(B, Hkv, T, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            for g in range(G):
                for i in positions: out[b, h] += per_query(q[b, h * G + g, i], k[b, h], b, h)
            if reduce == "mean": out[b, h] /= G * len(positions)
    return out


# %%
logit = lambda x, K, b, h: K @ x
assert_close(_reference_scores(q, k, logit), gp.mean((2, 3)))
assert_close(_reference_scores(q, k, logit, [0, 2], reduce="sum"), gp[:, :, :, [0, 2]].sum((2, 3)))

# %% [markdown]
# ## The naive extension: mean of scores over the chunk
#
# The direct way to use a single-query rule for a chunk: score each key by the attention it
# gets, averaged over all $S$ queries of the chunk and the $G$ heads of its group,
#
# $$\mu_{h,j} = \frac{1}{G S} \sum_{g} \sum_{i=1}^{S} p_{g,i,j},$$
#
# and keep the top $B_{SA}$. **Decision: probabilities, not raw logits.** The mean of
# probabilities is the average attention mass the chunk actually puts on key $j$ (over the
# cached keys), the quantity a selection wants to preserve, and each query contributes a
# distribution summing to one, so no single query dominates through its norm. The mean of raw
# logits, `scores="logits"`, is kept as an option: by linearity it equals scoring with the
# mean query, $\frac1{GS} \sum_{g,i} q_{g,i} \cdot k_j = \bar q \cdot k_j$, which is exactly the
# direction QuoKA argues carries the least information (§3.1). This baseline computes all
# $G S T$ logits: it is the accuracy reference for "averaging", not a fast method.

# %%
#| export
MEAN_SCORES = ("softmax", "logits")

def mean_score_select(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, scores: str = "softmax",
                      scale: float | None = None) -> Tensor:
    "Keys [B,Hkv,min(B_SA,T)] of largest attention probability (or logit) averaged over the chunk and a group's heads."
    if scores not in MEAN_SCORES: raise ValueError(f"scores must be one of {MEAN_SCORES}, got {scores!r}")
    check_chunk(q_chunk, k_cache)
    B, Hkv, T, D = k_cache.shape
    c, n = softmax_scale(scale, D), resolve_budget(budget, T)
    if n == T: return all_key_indices(B, Hkv, T, k_cache.device)
    s = c * grouped_products(q_chunk, k_cache)
    if scores == "softmax": s = s.softmax(-1)
    return top_budget_indices(s.mean((2, 3)), n)


# %%
def _qk(G, S, T, B=2, Hkv=2, D=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hkv * G, S, D, generator=g, dtype=dtype) + 0.3,
            torch.randn(B, Hkv, T, D, generator=g, dtype=dtype))

q, k = _qk(3, 12, 40)
qbar = q.view(2, 2, 3 * 12, 16).mean(2, keepdim=True)      # the mean query of each group
test_eq(mean_score_select(q, k, 10, "logits"), top_budget_indices_reference((qbar @ k.transpose(-1, -2))[:, :, 0], 10))
test_fail(lambda: mean_score_select(q, k, 10, "probs"), contains="scores must be")


# %% [markdown]
# Check: the selection against its reference, over head groups, chunk and cache lengths and budgets (also a
# fraction of $T$, and a cache no longer than the budget).

# %%
#| export
def mean_score_select_reference(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, scores: str = "softmax",
                                scale: float | None = None) -> Tensor:
    "`mean_score_select` by loops over batch, KV head, query head and query in float64."
    c = softmax_scale(scale, q_chunk.shape[-1])
    def per_query(q, K, b, h):
        logits = c * (K @ q)
        return torch.softmax(logits, 0) if scores == "softmax" else logits
    return top_budget_indices_reference(_reference_scores(q_chunk, k_cache, per_query),
                                        resolve_budget(budget, k_cache.shape[2]))


# %%
CASES = [(12, 40, 10), (12, 40, 0.25), (1, 40, 7), (8, 9, 9), (8, 5, 9), (8, 0, 4)]   # (S, T, budget)

def _check_indices(idx, B, Hkv, n):
    test_eq(idx.shape, (B, Hkv, n))
    test_eq(idx.dtype, torch.long)
    assert (idx[..., 1:] > idx[..., :-1]).all()

for G in (1, 3, 4):
    for S, T, budget in CASES:
        q, k = _qk(G, S, T, seed=G * 100 + S + T)
        for scores in MEAN_SCORES:
            idx = mean_score_select(q, k, budget, scores)
            test_eq(idx, mean_score_select_reference(q, k, budget, scores))
            _check_indices(idx, 2, 2, resolve_budget(budget, T))


# %% [markdown]
# **The method.** `MeanScores` (`"mean_scores"`) runs `mean_score_select` under `BaselinePolicy`, with its option
# `scores`. Its `key_cost` is the scoring's multiply-adds per cached key and KV head: every query of every head of
# the group times the key, $G S D$. By hand at SmolLM2-135M's shape ($G = 3$, $D = 64$) for a chunk of $S = 128$:

# %%
#| export
class MeanScores(BaselineSelection):
    "Mean of scores: the keys of largest attention probability (or logit, `scores`) over the chunk's queries and heads."
    name, select_fn = "mean_scores", staticmethod(mean_score_select)

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, scores: str = "softmax"):
        super().__init__(budget, chunk_size, decode)
        if scores not in MEAN_SCORES: raise ValueError(f"scores must be one of {MEAN_SCORES}, got {scores!r}")
        self.scores = scores

    def options(self): return dict(scores=self.scores)

    def key_cost(self, shape, S):
        "Every query of every head of the group times each key: G S D."
        return shape.G * S * shape.D, 0


# %%
shape = ModelShape(9, 3, 64, 30)  # SmolLM2-135M: G = 3 query heads per KV head, D = 64, 30 layers
test_eq(MeanScores(256).key_cost(shape, 128), (3 * 128 * 64, 0))
test_eq(MeanScores(256, scores="logits").options(), {"scores": "logits"})
test_fail(lambda: MeanScores(256, scores="max"), contains="scores must be one of")


# %% [markdown]
# ## SampleAttention (Zhu et al. 2024)
#
# Q. Zhu, J. Duan, C. Chen, S. Liu, X. Li, G. Feng, X. Lv, H. Cao, X. Chuanfu, X. Zhang et al.,
# *SampleAttention: Near-lossless acceleration of long context LLM inference with adaptive
# structured sparse attention*, arXiv:2406.15486 (2024).
#
# SampleAttention targets prefill. Its query-guided key selection computes the attention
# scores of a **sample of query rows** only, sums them column-wise (per key), and keeps the
# keys that cover a target share of the accumulated attention; it adds a local window. QuoKA
# describes it as "uniformly samples queries to compute $S$" and runs it with 16 sampled
# queries per chunk (§4). Here, per KV head,
#
# $$\alpha_{h,j} = \sum_{g} \sum_{i \in R} p_{g,i,j}, \qquad R \subset \{1,\dots,S\},\ |R| = \min(N_Q, S) \text{ drawn uniformly without replacement},$$
#
# and the top $B_{SA}$ keys are kept. **Interpretations:** (1) the adaptive budget (the
# cumulative-attention threshold) is replaced by the fixed $B_{SA}$, so all methods are
# compared at equal budgets as in QuoKA's tables; (2) one sample $R$ is shared by all heads
# (rows of the attention matrix are token positions); (3) no local window among the cached
# keys, since the chunk's own keys are always attended. The sample is seeded: an int `seed`
# draws the same positions for every chunk of the same length; a `torch.Generator` advances
# from chunk to chunk.
#
# Check: the sample is reproducible from an int seed, advances with a generator, and is uniform (each of 10
# positions is drawn with frequency $4/10$ when 4 are sampled, within a few standard deviations over 4000 draws).

# %%
#| export
def sample_query_positions(S: int, n_q: int, seed: int | torch.Generator = 0) -> Tensor:
    "min(n_q, S) chunk positions drawn uniformly without replacement (all S if n_q >= S), ascending, int64 on the CPU."
    check_int(n_q, "n_q", 1)
    if not isinstance(seed, torch.Generator) and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int or a CPU torch.Generator, got {type(seed).__name__}")
    if n_q >= S: return torch.arange(S)  # (no generator built: a decode step draws nothing)
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    return torch.randperm(S, generator=gen)[:n_q].sort().values


# %%
test_eq(sample_query_positions(10, 4, 3), sample_query_positions(10, 4, 3))
gen = torch.Generator().manual_seed(0)
draws = torch.stack([sample_query_positions(10, 4, gen) for _ in range(4000)])
assert len({tuple(d) for d in draws[:20].tolist()}) > 1                       # the generator advances
freq = torch.nn.functional.one_hot(draws, 10).sum((0, 1)).double() / 4000
assert (freq - 0.4).abs().max() < 4 * math.sqrt(0.4 * 0.6 / 4000)
test_eq(sample_query_positions(5, 9), torch.arange(5))
test_fail(lambda: sample_query_positions(10, 4, "0"), contains="seed must be")


# %% [markdown]
# With $N_Q \ge S$ every query is in the sample and SampleAttention is the mean of scores (a sum is a multiple
# of the mean):

# %%
#| export
def sample_attention_select(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, n_q: int = 16,
                            seed: int | torch.Generator = 0, scale: float | None = None) -> Tensor:
    """SampleAttention (Zhu et al. 2024): keys [B,Hkv,min(B_SA,T)] of largest attention probability summed over n_q
    uniformly sampled queries and the heads of a group."""
    check_chunk(q_chunk, k_cache)
    B, Hkv, T, D = k_cache.shape
    c, n = softmax_scale(scale, D), resolve_budget(budget, T)
    # drawn even when every key is kept, so a Generator advances per chunk
    pos = sample_query_positions(q_chunk.shape[2], n_q, seed)
    if n == T: return all_key_indices(B, Hkv, T, k_cache.device)
    sampled = q_chunk if len(pos) == q_chunk.shape[2] else q_chunk[:, :, pos.to(q_chunk.device)]  # all: as they are
    p = (c * grouped_products(sampled, k_cache)).softmax(-1)
    return top_budget_indices(p.sum((2, 3)), n)


# %%
q, k = _qk(3, 12, 40, seed=3)
test_eq(sample_attention_select(q, k, 10, n_q=12), mean_score_select(q, k, 10))
test_eq(sample_attention_select(q, k, 0.25, n_q=16), mean_score_select(q, k, 0.25))


# %% [markdown]
# Check: against the reference, on the cases above.

# %%
#| export
def sample_attention_select_reference(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, n_q: int = 16,
                                      seed: int | torch.Generator = 0, scale: float | None = None) -> Tensor:
    "`sample_attention_select` by loops in float64 over the same sampled positions."
    c = softmax_scale(scale, q_chunk.shape[-1])
    pos = sample_query_positions(q_chunk.shape[2], n_q, seed).tolist()
    scores = _reference_scores(q_chunk, k_cache, lambda q, K, b, h: torch.softmax(c * (K @ q), 0), pos, reduce="sum")
    return top_budget_indices_reference(scores, resolve_budget(budget, k_cache.shape[2]))


# %%
for G in (1, 3, 4):
    for S, T, budget in CASES:
        q, k = _qk(G, S, T, seed=G * 100 + S + T + 1)
        for n_q in (4, 16):
            idx = sample_attention_select(q, k, budget, n_q, seed=5)
            test_eq(idx, sample_attention_select_reference(q, k, budget, n_q, seed=5))
            _check_indices(idx, 2, 2, resolve_budget(budget, T))
        test_eq(sample_attention_select(q, k, budget, n_q=S), mean_score_select(q, k, budget))


# %% [markdown]
# **The method.** `SampleAttention` (`"sample_attention"`) runs `sample_attention_select` with `n_q` sampled
# queries drawn from `seed`; `n_q` is its cost knob (`cost_knob`, read by `sparsekv.costs.matched`). Per cached key
# it scores $G \min(N_Q, S) D$: the 16 sampled queries of a chunk of 128, all the queries of a chunk of 8.

# %%
#| export
class SampleAttention(BaselineSelection):
    "SampleAttention: the attention of `n_q` uniformly sampled queries (from `seed`)."
    name, select_fn = "sample_attention", staticmethod(sample_attention_select)
    cost_knob, small_params = "n_q", {"chunk_size": 8, "n_q": 2}

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, n_q: int = 16, seed: int = 0):
        super().__init__(budget, chunk_size, decode)
        self.n_q, self.seed = check_int(n_q, "n_q", 1), check_int(seed, "seed")

    def options(self): return dict(n_q=self.n_q, seed=self.seed)

    def key_cost(self, shape, S):
        "min(n_q, S) sampled queries of every head of the group times each key: G min(n_q, S) D."
        return shape.G * min(self.n_q, S) * shape.D, 0


# %%
test_eq(SampleAttention(256).key_cost(shape, 128), (3 * 16 * 64, 0))
test_eq(SampleAttention(256).key_cost(shape, 8), (3 * 8 * 64, 0))
test_fail(lambda: SampleAttention(256, n_q=0), contains="n_q")


# %% [markdown]
# ## SparQ (Ribar et al. 2024)
#
# L. Ribar, I. Chelombiev, L. Hudlass-Galley, C. Blake, C. Luschi, D. Orr, *SparQ Attention:
# Bandwidth-efficient LLM inference*, ICML 2024, pp. 42558–42583.
#
# SparQ approximates a query's attention from the $r$ channels where the query is largest in
# magnitude, which reads only $r$ of the $D$ columns of $K$. For one query $q$:
#
# 1. $i_1 \leftarrow$ the $r$ channels of largest $|q_c|$;
# 2. $\hat s \leftarrow \mathrm{softmax}\Big(q_{[i_1]} \cdot K_{[:, i_1]}^\top \big/ \sqrt{D \cdot \lVert q_{[i_1]} \rVert_1 / \lVert q \rVert_1}\Big)$;
#    the temperature is corrected for the share of $q$'s $L_1$ mass that the kept channels carry;
# 3. the keys of largest $\hat s$ are attended exactly (SparQ also mixes in the mean value
#    vector with the weight the unselected keys had; that changes the output, not the
#    selection, and is not part of a selection baseline).
#
# For a chunk, QuoKA's baseline is step 1–2 per query and "mean over queries": the
# approximate probabilities $\hat s_{g,i,j}$ are averaged over the chunk's queries and the
# heads of a group, and the top $B_{SA}$ kept. $r$ defaults to $D/2$ (QuoKA runs SparQ at 64 of
# 128 dimensions). Ties among channel magnitudes go to the lower channel. Dropping the
# unselected channels is written as zeroing them, which gives the same products; it does not
# save the reads a kernel would (a latency benchmark must gather the channels instead).
# With `scale` given, $1/\sqrt D$ above is replaced by `scale`.

# %%
#| export
def _check_rank(r: int | None, D: int, name: str = "r") -> int:
    "r, or D // 2 when None; an int in [1, D]."
    return max(1, D // 2) if r is None else check_int(r, name, 1, D)


# %%
test_eq((_check_rank(None, 16), _check_rank(None, 1), _check_rank(16, 16), _check_rank(1, 16)), (8, 1, 16, 1))
test_fail(lambda: _check_rank(17, 16), contains="r must be")
test_fail(lambda: _check_rank(0, 16, "rank"), contains="rank must be")


# %% [markdown]
# With $r = D$ nothing is dropped (the temperature correction is 1) and SparQ is the mean of scores:

# %%
#| export
def sparq_select(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, r: int | None = None,
                 scale: float | None = None) -> Tensor:
    """SparQ (Ribar et al. 2024): keys [B,Hkv,min(B_SA,T)] of largest approximate attention from each query's top-r
    channels, averaged over queries and heads."""
    check_chunk(q_chunk, k_cache)
    B, Hkv, T, D = k_cache.shape
    c, n, r = softmax_scale(scale, D), resolve_budget(budget, T), _check_rank(r, D)
    if n == T: return all_key_indices(B, Hkv, T, k_cache.device)
    q = q_chunk.to(accumulation_dtype(q_chunk))
    mag = q.abs()
    keep = top_mask(mag, r)  # i_1 per query: its r largest channels
    total = mag.sum(-1)
    # ||q[i1]||_1 / ||q||_1
    share = torch.where(total > 0, (mag * keep).sum(-1) / total.clamp_min(torch.finfo(q.dtype).tiny), 1.0)
    temp = (c / share.sqrt()).view(B, Hkv, -1, q.shape[2], 1)  # per-query softmax scale
    p = (temp * grouped_products(q * keep, k_cache)).softmax(-1)
    return top_budget_indices(p.mean((2, 3)), n)


# %%
q, k = _qk(3, 12, 40, seed=4)
test_eq(sparq_select(q, k, 10, r=16), mean_score_select(q, k, 10))
test_fail(lambda: sparq_select(q, k, 10, r=0), contains="r must be")


# %% [markdown]
# Check: against the reference (heavy-tailed queries, where channel selection matters, and
# queries with tied magnitudes); with $r = D$ nothing is dropped and SparQ is the mean of
# scores; $r = 1$ is accepted, $r > D$ refused.

# %%
#| export
def sparq_select_reference(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, r: int | None = None,
                           scale: float | None = None) -> Tensor:
    "`sparq_select` by loops in float64: per query its top-r channels by a Python sort, scores from those columns."
    D = q_chunk.shape[-1]
    c, r = softmax_scale(scale, D), _check_rank(r, D)
    def per_query(q, K, b, h):
        mag = q.abs().tolist()
        ch = sorted(range(D), key=lambda i: (-mag[i], i))[:r]
        share = sum(mag[i] for i in ch) / sum(mag) if sum(mag) > 0 else 1.0
        return torch.softmax(K[:, ch] @ q[ch] * (c / math.sqrt(share)), 0)
    return top_budget_indices_reference(_reference_scores(q_chunk, k_cache, per_query),
                                        resolve_budget(budget, k_cache.shape[2]))


# %%
for G in (1, 3, 4):
    for S, T, budget in CASES:
        q, k = _qk(G, S, T, seed=G * 100 + S + T + 2)
        q = q * torch.rand(q.shape, generator=torch.Generator().manual_seed(G)).pow(3) * 4   # heavy-tailed channels
        for r in (1, 5, None):
            idx = sparq_select(q, k, budget, r)
            test_eq(idx, sparq_select_reference(q, k, budget, r))
            _check_indices(idx, 2, 2, resolve_budget(budget, T))
        test_eq(sparq_select(q, k, budget, r=16), mean_score_select(q, k, budget))
q, k = _qk(3, 8, 30, seed=9)
q = q.sign()                                                                      # every magnitude tied
test_eq(sparq_select(q, k, 10, 6), sparq_select_reference(q, k, 10, 6))
test_fail(lambda: sparq_select(q, k, 10, r=17), contains="r must be")


# %% [markdown]
# **The method.** `SparQ` (`"sparq"`) runs `sparq_select` with `r` channels, its cost knob; `check_model` refuses
# an `r` larger than the model's head dim before any work. Per cached key, every query's $r$ channels times the same
# channels of the key: $G S r$, with $r = D/2 = 32$ by default.

# %%
#| export
class SparQ(BaselineSelection):
    "SparQ: attention approximated from each query's top-`r` channels (None: D/2, QuoKA's 64 of 128 in §4)."
    name, select_fn, cost_knob = "sparq", staticmethod(sparq_select), "r"

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, r: int | None = None):
        super().__init__(budget, chunk_size, decode)
        self.r = None if r is None else check_int(r, "r (channels kept)", 1)

    def options(self): return dict(r=self.r)

    def check_model(self, model):
        "r at most the model's head dim."
        _check_rank(self.r, model_info(model).head_dim, "r (channels kept, at most the head dim)")

    def key_cost(self, shape, S):
        "Every query's top-r channels times the same channels of each key: G S r."
        return shape.G * S * _check_rank(self.r, shape.D), 0


# %%
test_eq(SparQ(256).key_cost(shape, 128), (3 * 128 * 32, 0))  # r = D/2 by default
test_eq(SparQ(256, r=8).key_cost(shape, 128), (3 * 128 * 8, 0))
test_fail(lambda: SparQ(256, r=64).check_model(load_model("tiny-llama")[0]), contains="at most the head dim")


# %% [markdown]
# ## Loki (Singhania et al. 2024)
#
# P. Singhania, S. Singh, S. He, S. Feizi, A. Bhatele, *Loki: Low-rank keys for efficient
# sparse attention*, NeurIPS 2024, pp. 16692–16723.
#
# Loki observes that keys live close to a low-dimensional subspace. Offline, it computes
# per layer and head the principal directions of keys from a calibration set (an orthonormal
# $P \in \mathbb{R}^{D \times D}$, columns by decreasing variance); at inference it scores
# keys with the first $r$ coordinates of the rotated query and keys,
#
# $$\tilde s_{i,j} = (q_i P_{:, :r}) \cdot (k_j P_{:, :r}),$$
#
# keeps the top keys and attends to them exactly (exact because $P$ is orthogonal). QuoKA
# describes it as "down-projects keys and queries before computing $S$", at 64 of 128
# dimensions. For a chunk, as for SparQ: mean over queries and heads of
# $\mathrm{softmax}_j(c\,\tilde s_{g,i,j})$.
#
# **Interpretations.** (1) The basis comes from a calibration set when `basis` is given
# (`loki_basis` of calibration keys, `[Hkv,D,D]`), otherwise from the cache itself, per batch
# element and KV head, as of each call: `loki_select` computes it from the keys it is given, and
# the selection policy keeps it up to date from the new keys alone (`KeyMoments` below); either
# way a $D \times D$ eigenproblem per head and call. Decode keeps it current too, rather than freezing
# the prompt's basis: a basis that has not seen the newest keys represents them worst, and they are
# the keys decode attends to most, so a frozen basis would weaken the baseline the longer it
# generates. The eigenproblem per layer and step is therefore Loki's main decode cost here.
# (2) The basis is that of the **uncentered** second moment $K^\top K$ by default: the top-$r$ eigenvectors of $K^\top K$ minimize the mean
# squared error $\lVert k - P_r P_r^\top k \rVert^2$ of the raw keys, which is what enters the
# dot products; `center=True` uses the covariance (classical PCA) instead. (3) Keys are
# post-RoPE (what the attention function receives); Loki studies both pre- and post-rotary
# PCA.
#
# Check: `loki_basis` is orthonormal and ordered, and its top-$r$ subspace is the best rank-$r$
# fit of the keys (its error equals the sum of the discarded eigenvalues, below that of a
# random subspace). Keys are drawn with a decaying spectrum so the leading subspace is well separated.

# %%
#| export
def loki_basis(keys: Tensor, center: bool = False) -> Tensor:
    "Principal directions [Hkv,D,D] of keys [B,Hkv,S,D] pooled over batch and positions, by decreasing eigenvalue."
    if not isinstance(keys, Tensor) or keys.dim() != 4 or not keys.is_floating_point():
        raise TypeError("keys must be a floating-point tensor [B,Hkv,S,D], got "
                        f"{getattr(keys, 'shape', type(keys).__name__)}")
    B, Hkv, S, D = keys.shape
    x = keys.to(accumulation_dtype(keys)).transpose(0, 1).reshape(Hkv, B * S, D)
    if content_checks() and not x.isfinite().all(): raise ValueError("keys contain NaN or inf: no principal directions")
    if center: x = x - x.mean(1, keepdim=True)
    return torch.linalg.eigh(x.transpose(-1, -2) @ x).eigenvectors.flip(-1)  # eigh sorts ascending


# %%
def _keys_lowrank(B, Hkv, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -1.5, D, dtype=torch.float64)
    return torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) * scale + 0.2

k = _keys_lowrank(3, 2, 50, 16, 0)
P = loki_basis(k)
test_eq(P.shape, (2, 16, 16))
assert_close(P.transpose(-1, -2) @ P, torch.eye(16, dtype=torch.float64).expand(2, 16, 16))
x = k.transpose(0, 1).reshape(2, 150, 16)
ev = torch.linalg.eigvalsh(x.transpose(-1, -2) @ x).flip(-1)
var = ((x @ P) ** 2).sum(1)  # energy along each column
assert_close(var, ev)        # columns in decreasing eigenvalue order
for rr in (2, 8):
    err = ((x - x @ P[..., :rr] @ P[..., :rr].transpose(-1, -2)) ** 2).sum((1, 2))
    assert_close(err, ev[:, rr:].sum(-1))
    Q = torch.linalg.qr(torch.randn(2, 16, rr, dtype=torch.float64)).Q
    assert (((x - x @ Q @ Q.transpose(-1, -2)) ** 2).sum((1, 2)) > err).all()


# %% [markdown]
# A basis given to the selection is one per KV head (a calibration basis) or one per batch row and KV head,
# with at least $r$ columns:

# %%
#| export
def _check_basis(basis: Tensor, B: int, Hkv: int, D: int, r: int):
    "Validate a Loki basis: [Hkv,D,R] or [B (or 1),Hkv,D,R] with R >= r."
    if not isinstance(basis, Tensor) or not basis.is_floating_point() or basis.dim() not in (3, 4) \
            or basis.shape[-3:-1] != (Hkv, D) or basis.shape[-1] < r \
            or (basis.dim() == 4 and basis.shape[0] not in (1, B)):
        raise ValueError(f"basis must be a floating-point [Hkv={Hkv}, D={D}, R] or [B={B}, Hkv, D, R] with R >= r={r}, "
                         f"got {getattr(basis, 'shape', type(basis).__name__)}")


# %%
for ok in (torch.zeros(2, 16, 4), torch.zeros(3, 2, 16, 5), torch.zeros(1, 2, 16, 4)): _check_basis(ok, 3, 2, 16, 4)
for bad in (torch.zeros(2, 16, 3), torch.zeros(2, 2, 16, 4), torch.zeros(2, 8, 4), torch.zeros(2, 16, 4).long()):
    test_fail(lambda: _check_basis(bad, 3, 2, 16, 4), contains="basis must be a floating-point [Hkv=2, D=16, R]")


# %% [markdown]
# The projection the selection uses: the given basis with a batch axis, or each row's own `loki_basis`:

# %%
#| export
def _loki_projection(k_cache: Tensor, r: int, basis: Tensor | None, center: bool) -> Tensor:
    "The first r basis columns, [B or 1, Hkv, D, r]: from `basis` [Hkv,D,R] / [B,Hkv,D,R], or the cache's own PCA."
    if basis is None:
        return torch.stack([loki_basis(k_cache[b:b + 1], center) for b in range(k_cache.shape[0])])[..., :r]
    basis = basis if basis.dim() == 4 else basis[None]
    return basis[..., :r].to(accumulation_dtype(k_cache))


# %%
Pk = _loki_projection(k, 4, None, False)
test_eq(Pk.shape, (3, 2, 16, 4))
for b in range(3): assert_close(Pk[b], loki_basis(k[b:b + 1])[..., :4])
assert_close(_loki_projection(k, 3, None, True)[2], loki_basis(k[2:3], center=True)[..., :3])
test_eq(_loki_projection(k, 4, P, False), P[None, ..., :4])                   # a calibration basis [Hkv, D, R]
test_eq(_loki_projection(k, 4, Pk, False), Pk)


# %% [markdown]
# With $r = D$ the projection is a rotation, which leaves the products as they are: Loki is the mean of scores.

# %%
#| export
def loki_select(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, r: int | None = None,
                basis: Tensor | None = None, center: bool = False, scale: float | None = None) -> Tensor:
    """Loki (Singhania et al. 2024): keys [B,Hkv,min(B_SA,T)] of largest attention approximated in the top-r principal
    subspace of the keys, averaged over queries and heads."""
    check_chunk(q_chunk, k_cache)
    B, Hkv, T, D = k_cache.shape
    c, n, r = softmax_scale(scale, D), resolve_budget(budget, T), _check_rank(r, D)
    if basis is not None: _check_basis(basis, B, Hkv, D, r)
    if n == T: return all_key_indices(B, Hkv, T, k_cache.device)
    P = _loki_projection(k_cache, r, basis, center).to(k_cache.device)
    acc = accumulation_dtype(q_chunk)
    G, S = q_chunk.shape[1] // Hkv, q_chunk.shape[2]
    qp = q_chunk.to(acc).reshape(B, Hkv, G * S, D) @ P  # [B,Hkv,G*S,r] down-projected queries
    kp = k_cache.to(acc) @ P  # [B,Hkv,T,r] down-projected keys
    p = (c * (qp @ kp.transpose(-1, -2))).softmax(-1)
    return top_budget_indices(p.mean(2), n)


# %%
q, k = _qk(3, 12, 40, seed=5)
test_eq(loki_select(q, k, 10, r=16), mean_score_select(q, k, 10))
test_eq(loki_select(q, k, 10, r=16, basis=P), mean_score_select(q, k, 10))
test_fail(lambda: loki_select(q, k, 10, 4, basis=P[..., :3]), contains="basis must be")


# %% [markdown]
# Check: `loki_select` against the reference with the basis from the cache
# (uncentered and centered) and from a calibration set; with $r = D$ it is the mean of scores.

# %%
#| export
def loki_select_reference(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, r: int | None = None,
                          basis: Tensor | None = None, center: bool = False, scale: float | None = None) -> Tensor:
    "`loki_select` by loops in float64, subspace from an SVD of each head's keys (or `basis`), scores q^T P_r P_r^T k."
    B, Hkv, T, D = k_cache.shape
    c, r = softmax_scale(scale, D), _check_rank(r, D)
    proj = {}
    for b in range(B):
        for h in range(Hkv):
            if basis is None:
                x = k_cache[b, h].double()
                if center: x = x - x.mean(0)
                Pr = torch.linalg.svd(x, full_matrices=True).Vh[:r].T  # right singular vectors = eigenvectors of x^T x
            else:
                Pr = (basis[h] if basis.dim() == 3 else basis[b if basis.shape[0] > 1 else 0, h])[:, :r].double()
            proj[b, h] = Pr @ Pr.T  # projector onto the top-r subspace: basis signs and order within it do not matter
    per_query = lambda q, K, b, h: torch.softmax(c * (K @ (proj[b, h] @ q)), 0)
    return top_budget_indices_reference(_reference_scores(q_chunk, k_cache, per_query), resolve_budget(budget, T))


# %%
for G in (1, 3, 4):
    for S, T, budget in CASES:
        q, _ = _qk(G, S, T, seed=G * 100 + S + T + 3)
        k = _keys_lowrank(2, 2, T, 16, G + T)
        for r in (4, None):
            for center in (False, True):
                # the covariance of <= D keys is singular: its top-r subspace is not unique
                if center and T <= 16: continue
                idx = loki_select(q, k, budget, r, center=center)
                test_eq(idx, loki_select_reference(q, k, budget, r, center=center))
                _check_indices(idx, 2, 2, resolve_budget(budget, T))
        calib = loki_basis(_keys_lowrank(4, 2, 64, 16, 99))
        test_eq(loki_select(q, k, budget, 4, basis=calib), loki_select_reference(q, k, budget, 4, basis=calib))
        test_eq(loki_select(q, k, budget, r=16), mean_score_select(q, k, budget))
q, k = _qk(3, 8, 30, seed=13)
test_fail(lambda: loki_select(q, k, 10, 4, basis=calib[..., :3]), contains="basis must be")
test_fail(lambda: loki_select(q, k, 10, 4, basis=calib[:1]), contains="basis must be")


# %% [markdown]
# Recomputing the cache's basis at every call costs a pass over all $T$ cached keys per head
# ($T D^2$ multiply-adds for $K^\top K$) at every chunk and decode step, more than the scoring
# itself at decode. The moments $K^\top K = \sum_t k_t k_t^\top$ (and $\sum_t k_t$ for the
# centred variant, whose covariance is $K^\top K - \frac{1}{T}(\sum_t k_t)(\sum_t k_t)^\top$) only
# grow with the cache, so `KeyMoments` adds the new keys' outer products and solves the $D \times D$
# eigenproblem per head: $D^2$ per new key and $O(D^3)$ per call, whatever $T$. The selection
# policy keeps one per cache layer (`LokiPolicy`, below).
#
# Check: keys arriving in three parts give the basis `loki_basis` finds for each row's whole
# cache (as a projector onto the top-$r$ subspace: eigenvector signs are arbitrary), centred and
# not; the selection with it equals `loki_select` without a basis; a shorter cache restarts.

# %%
#| export
class KeyMoments:
    "Loki's cache basis kept up to date: `update(k_cache)` adds the moments of the keys added since the last call."

    def __init__(self):
        self.xx = self.x = None  # [B,Hkv,D,D] sum of k k^T, [B,Hkv,D] sum of k
        self.length = 0

    @property
    def length(self) -> int:
        "Keys added so far (kept as a shape, `shape_count`: a compiled step serves every length)."
        return self._length.shape[1]

    @length.setter
    def length(self, n: int): self._length = shape_count(n)

    def apply_rows(self, fn):
        "Apply the batch-row map `fn` (beam search's reorder etc., `sparsekv.cache.row_map`) to the moments."
        if self.xx is not None: self.xx, self.x = fn(self.xx), fn(self.x)

    def update(self, k_cache: Tensor) -> "KeyMoments":
        "Add the keys of k_cache [B,Hkv,T,D] after the first `length` (the previous call's); a shorter cache restarts."
        B, Hkv, T, D = check_k_cache(k_cache).shape
        dtype = accumulation_dtype(k_cache)
        if self.xx is None or self.xx.shape != (B, Hkv, D, D) or self.xx.dtype != dtype or self.length > T:
            self.xx, self.x = k_cache.new_zeros(B, Hkv, D, D, dtype=dtype), k_cache.new_zeros(B, Hkv, D, dtype=dtype)
            self.length = 0
        new = k_cache[:, :, self.length:].to(dtype)
        if content_checks() and not new.isfinite().all():
            raise ValueError("keys contain NaN or inf: no principal directions")
        self.xx += new.transpose(-1, -2) @ new
        self.x += new.sum(2)
        self.length = T
        return self

    def basis(self, center: bool = False) -> Tensor:
        "Principal directions [B,Hkv,D,D] of each row's keys so far, by decreasing eigenvalue (`loki_basis` per row)."
        if not self.length: raise ValueError("no keys yet: call update(k_cache) first")
        m = self.xx - self.x[..., :, None] * self.x[..., None, :] / self.length if center else self.xx
        return torch.linalg.eigh(m).eigenvectors.flip(-1)


# %%
k = _keys_lowrank(2, 2, 60, 16, 5)
for center in (False, True):
    mom = KeyMoments()
    for T in (20, 21, 60): mom.update(k[:, :, :T])
    got = mom.basis(center)
    for b in range(2):
        want = loki_basis(k[b:b + 1], center)
        for rr in (4, 8):
            assert_close(got[b, ..., :rr] @ got[b, ..., :rr].transpose(-1, -2),
                         want[..., :rr] @ want[..., :rr].transpose(-1, -2))
    q, _ = _qk(3, 1, 60, seed=21)
    test_eq(loki_select(q, k, 10, 4, basis=got, center=center), loki_select(q, k, 10, 4, center=center))
test_eq(mom.update(k[:, :, :10]).length, 10)
assert_close(mom.xx, k[:, :, :10].transpose(-1, -2) @ k[:, :, :10])
test_fail(lambda: KeyMoments().basis(), contains="no keys yet")


# %% [markdown]
# Loki without a calibration basis uses the cache's own: `LokiPolicy`, a `BaselinePolicy`, keeps each layer's key
# moments (`KeyMoments`) and adds only the new keys at each chunk and decode step, rather than a pass over
# the whole cache per call (a padded batch's rows, which see only their own keys, fall back to the
# full pass). It picks what `BaselinePolicy(loki_select)` picks.
#
# Check on the tiny random Llama in float64: chunked prefill and ten decode steps under either policy give the same
# logits.

# %%
#| export
class LokiPolicy(BaselinePolicy):
    "Loki (`loki_select`) with the cache's basis from per-layer `KeyMoments`, updated by the new keys only."

    def __init__(self, budget: int | float = 1024, decode: bool = True, r: int | None = None, center: bool = False):
        super().__init__(loki_select, budget, decode, r=r, center=center)
        self.moments = weakref.WeakKeyDictionary()  # cache layer -> KeyMoments

    def pick_earlier(self, q: Tensor, k_earlier: Tensor, ctx: AttentionContext) -> Tensor:
        layer = ctx.cache_layer
        if layer is None or ctx.row is not None: return super().pick_earlier(q, k_earlier, ctx)
        if layer not in self.moments:
            self.moments[layer] = KeyMoments()
            follow_batch_ops(layer, id(self), self.moments[layer].apply_rows)  # beam search moves the rows
        basis = self.moments[layer].update(k_earlier).basis(self.options["center"])
        return loki_select(q, k_earlier, self.budget, self.options["r"], basis=basis, scale=ctx.scale)


# %%
model64, _ = load_model("tiny-llama", dtype="float64")
ids70 = torch.randint(3, 200, (2, 70), generator=torch.Generator().manual_seed(4))
for center in (False, True):
    runs = []
    for policy in (BaselinePolicy(loki_select, 12, r=4, center=center), LokiPolicy(12, r=4, center=center)):
        cache, last = chunked_prefill(model64, ids70[:, :60], 16, policy)
        with torch.no_grad(), patch(model64, policy):  # decode steps under the same policy
            steps = [model64(ids70[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(60, 70)]
        runs.append(torch.cat([last[:, None], *steps], 1))
    assert_close(runs[1], runs[0], rtol=1e-9, atol=1e-9)
print("LokiPolicy: the same logits as BaselinePolicy(loki_select), chunked prefill and decode")


# %% [markdown]
# **The method.** `Loki` (`"loki"`) runs under `LokiPolicy`, with `r` principal directions (its cost knob, at most
# the head dim) and `center`. Per cached key, the projected queries times the projected key, $G S r$; projecting
# the chunk's queries, $G S D r$, is paid once per call.

# %%
#| export
class Loki(BaselineSelection):
    "Loki: attention in the top-`r` (None: D/2) principal subspace of the keys (`center`: of the centred keys)."
    name, select_fn, cost_knob = "loki", staticmethod(loki_select), "r"

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, r: int | None = None,
                 center: bool = False):
        super().__init__(budget, chunk_size, decode)
        self.r = None if r is None else check_int(r, "r (principal directions)", 1)
        if not isinstance(center, bool): raise TypeError(f"center must be a bool, got {center!r}")
        self.center = center

    def check_model(self, model):
        "r at most the model's head dim."
        _check_rank(self.r, model_info(model).head_dim, "r (principal directions, at most the head dim)")

    def options(self): return dict(r=self.r, center=self.center)

    def policy(self) -> LokiPolicy:
        return LokiPolicy(self.budget, self.decode, **self.options())

    def key_cost(self, shape, S):
        "Projected queries times each projected key, G S r; projecting the queries, G S D r, once per call."
        r = _check_rank(self.r, shape.D)
        return shape.G * S * r, shape.G * S * shape.D * r


# %%
test_eq(Loki(256).key_cost(shape, 128), (3 * 128 * 32, 3 * 128 * 64 * 32))
test_fail(lambda: Loki(256, center=1), contains="center must be a bool")
assert isinstance(Loki(256).policy(), LokiPolicy)


# %% [markdown]
# ## LessIsMore (Yang et al. 2025b)
#
# L. Yang, Z. Zhang, A. Jain, S. Cao, B. Yuan, Y. Chen, Z. Jia, R. Netravali, *Less is more:
# training-free sparse attention with global locality for efficient reasoning*,
# arXiv:2508.07101 (2025). It builds on TidalDecode (Yang et al. 2024b, arXiv:2410.05076).
#
# TidalDecode observed that the keys a query needs are largely the same across layers: a few
# **selection layers** attend densely and pick the keys, and the sparse layers after them
# reuse the pick until the next selection layer (the first layers, before the first
# selection layer, attend densely). LessIsMore adds two rules to the selection: the pick is
# **one set of keys for all heads** (each head's top keys, merged across heads), and a fixed
# share $\rho$ of the budget is a **window of the most recent keys**. QuoKA describes it as
# "computes $S$ only at specified layers". With $n = \min(B_{SA}, T)$:
#
# 1. $n_{\mathrm{mid}} = \lfloor n (1 - \rho) \rfloor$, $n_{\mathrm{rec}} = n - n_{\mathrm{mid}}$: the last $n_{\mathrm{rec}}$ cached keys are kept;
# 2. for each query head $g$ (of **all** $H_q$ heads), rank the other keys by its score
#    $\frac1S \sum_i p_{g,i,j}$ and keep its top $n_{\mathrm{mid}}$, in rank order;
# 3. merge the heads' lists rank by rank (rank 0 of head 0, 1, ..., then rank 1 of each head,
#    ...), drop repeats, keep the first $n_{\mathrm{mid}}$ keys: the union of the heads'
#    top sets, truncated by rank ("flatten and union the selected indices for all heads,
#    keeping the first $k$", LessIsMore's Figure 1). Head 0 alone lists $n_{\mathrm{mid}}$
#    distinct keys, so the merge always fills $n_{\mathrm{mid}}$;
# 4. the same $n$ keys are used by every KV head.
#
# **Interpretations.** (1) For a chunk, a head's per-query probabilities (over all $T$ cached
# keys, the attention the selection layer actually computes) are averaged over the chunk's
# queries, the naive extension, since LessIsMore scores one decoding query. (2) $\rho = 0.25$
# by default (LessIsMore's default recent ratio) and no sink tokens (its code has an option
# for them, off by default). (3) Selection layers default to `(2,)`; the reference code also
# re-selects at one "correction" layer in the middle of the network (layer 9 in its Qwen3
# script), e.g. `selection_layers=(2, 9)`.
#
# `lessismore_select` is the per-layer rule; `LessIsMoreSelector` keeps the selection of the
# last selection layer so the integration can reuse it in the following layers.

# %%
#| export
def lessismore_split(n: int, recent_ratio: float) -> tuple[int, int]:
    "(n_mid, n_recent): n_mid = floor(n * (1 - recent_ratio)) keys chosen by score, the other n_recent the most recent."
    if isinstance(recent_ratio, bool) or not isinstance(recent_ratio, (int, float)) or not 0 <= recent_ratio <= 1:
        raise ValueError(f"recent_ratio must be a number in [0, 1], got {recent_ratio!r}")
    n_mid = int(n * (1 - recent_ratio))
    return n_mid, n - n_mid


# %%
test_eq([lessismore_split(10, r) for r in (0.0, 0.25, 0.5, 1.0)], [(10, 0), (7, 3), (5, 5), (0, 10)])   # 7.5 -> 7
test_eq(lessismore_split(0, 0.25), (0, 0))
for bad in (1.5, -0.1, True, "0.25"): test_fail(lambda: lessismore_split(10, bad), contains="recent_ratio")


# %% [markdown]
# The merge of step 3: each head's top keys in rank order, rank 0 of every head first, repeats dropped. By hand,
# with two heads over four keys: head 0 ranks keys $0, 1, 2$ first, head 1 ranks $3, 2, 1$; rank by rank the
# merge lists $0, 3, 1, 2, 2, 1$, whose first three distinct keys are $0, 3, 1$.

# %%
#| export
def _merge_ranked(p: Tensor, n_mid: int) -> Tensor:
    "The first n_mid distinct keys [B, n_mid] of the heads' rankings of p [B,Hq,t] merged rank by rank."
    B, t_mid = p.shape[0], p.shape[-1]
    # stable: equal scores keep the lower index first
    ranked = p.sort(dim=-1, descending=True, stable=True).indices[..., :n_mid]
    merged = ranked.transpose(1, 2).reshape(B, -1)  # rank-major: rank 0 of every head, then rank 1, ...
    order = torch.arange(merged.shape[1], device=merged.device).expand(B, -1)
    first = torch.full((B, t_mid), merged.shape[1], dtype=torch.long, device=merged.device)
    first = first.scatter_reduce(1, merged, order, "amin")  # where each key first appears in the merged list
    return first.argsort(dim=-1, stable=True)[:, :n_mid]  # the first n_mid distinct keys of the merge


# %%
pr = torch.tensor([[[0.5, 0.3, 0.2, 0.0], [0.0, 0.1, 0.2, 0.7]]])
test_eq(_merge_ranked(pr, 3), torch.tensor([[0, 3, 1]]))
test_eq(_merge_ranked(pr, 4), torch.tensor([[0, 3, 1, 2]]))
test_eq(_merge_ranked(torch.zeros(1, 2, 4), 2), torch.tensor([[0, 1]]))     # ties: lower index first
test_eq(_merge_ranked(pr, 0).shape, (1, 0))


# %% [markdown]
# With one head and no recent window, the merge is that head's ranking: LessIsMore is the mean of scores.

# %%
#| export
def lessismore_select(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024, recent_ratio: float = 0.25,
                      scale: float | None = None) -> Tensor:
    "LessIsMore (Yang et al. 2025b): one key set for all heads, their top keys merged rank by rank, plus recent keys."
    check_chunk(q_chunk, k_cache)
    B, Hkv, T, D = k_cache.shape
    c, n = softmax_scale(scale, D), resolve_budget(budget, T)
    n_mid, n_rec = lessismore_split(n, recent_ratio)
    if n == T: return all_key_indices(B, Hkv, T, k_cache.device)
    t_mid = T - n_rec  # keys before the recent window compete for the n_mid slots
    # [B,Hkv,G,T]: each head's mean probability over the chunk
    p = (c * grouped_products(q_chunk, k_cache)).softmax(-1).mean(3)
    p = p.reshape(B, -1, T)[..., :t_mid]  # [B,Hq,t_mid], heads in the package order h*G+g
    if content_checks() and p.isnan().any(): raise ValueError("scores contain NaN (check the inputs for NaN or inf)")
    mid = _merge_ranked(p, n_mid)
    recent = torch.arange(t_mid, T, device=k_cache.device).expand(B, n_rec)
    idx = torch.cat([mid, recent], -1).sort(-1).values
    return idx[:, None].expand(B, Hkv, n).contiguous()


# %%
q, k = _qk(1, 9, 40, B=2, Hkv=1, seed=12)
test_eq(lessismore_select(q, k, 10, 0.0), mean_score_select(q, k, 10))
test_eq(lessismore_select(q, k, 10, 1.0), torch.arange(30, 40).expand(2, 1, 10))     # all recent
test_fail(lambda: lessismore_select(q, k, 10, 1.5), contains="recent_ratio")


# %% [markdown]
# Check against the reference, with scores that make the heads disagree (so the merge order
# matters) and with repeated keys (ties); with one head and no window it is the mean of
# scores; the recent window is always kept, and all KV heads share one set.

# %%
#| export
def lessismore_select_reference(q_chunk: Tensor, k_cache: Tensor, budget: int | float = 1024,
                                recent_ratio: float = 0.25, scale: float | None = None) -> Tensor:
    "`lessismore_select` by loops in float64: Python rankings per head, a rank-by-rank merge by dict, recent window."
    G = check_chunk(q_chunk, k_cache)
    q, k = q_chunk.double(), k_cache.double()
    B, Hq, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    c, n = softmax_scale(scale, D), resolve_budget(budget, T)
    n_mid, n_rec = lessismore_split(n, recent_ratio)
    t_mid = T - n_rec
    out = []
    for b in range(B):
        rankings = []
        for hq in range(Hq):
            score = sum(torch.softmax(c * (k[b, hq // G] @ q[b, hq, i]), 0) for i in range(S)) / S
            row = score[:t_mid].tolist()
            rankings.append(sorted(range(t_mid), key=lambda j: (-row[j], j))[:n_mid])
        merged = list(dict.fromkeys(rankings[hq][r] for r in range(n_mid) for hq in range(Hq)))[:n_mid]
        out.append(sorted(merged + list(range(t_mid, T))))
    return torch.tensor(out, dtype=torch.long).view(B, 1, n).expand(B, Hkv, n).contiguous()


# %%
for G in (1, 3, 4):
    for S, T, budget in CASES:
        q, k = _qk(G, S, T, seed=G * 100 + S + T + 4)
        for ratio in (0.0, 0.25, 0.5, 1.0):
            idx = lessismore_select(q, k, budget, ratio)
            test_eq(idx, lessismore_select_reference(q, k, budget, ratio))
            n = resolve_budget(budget, T)
            _check_indices(idx, 2, 2, n)
            test_eq(idx[:, 0:1].expand_as(idx), idx)                                       # one set for all KV heads
            n_rec = lessismore_split(n, ratio)[1]
            assert set(range(T - n_rec, T)) <= set(idx[0, 0].tolist())                     # the recent window
q, k = _qk(3, 6, 30, seed=11)
k[:, :, 10:20] = k[:, :, :1]                                                                # ten copies of key 0: ties
test_eq(lessismore_select(q, k, 12), lessismore_select_reference(q, k, 12))


# %% [markdown]
# ### Reusing the selection across layers
#
# `LessIsMoreSelector.select(layer_idx, q_chunk, k_cache)` is called by every layer of a
# forward pass (a chunk, or a decode step), in layer order. It returns `None` where the
# layer attends densely (the integration's `SelectionPolicy` treats `None` as dense): layers
# below the first selection layer, and the selection layers themselves, which store their
# pick. The layers after a selection layer get the stored indices. A stored pick belongs to
# one forward pass: if its cache length or batch shape does not match, or the selection
# layer just below was skipped, the call fails instead of reusing a stale pick.

# %%
#| export
class LessIsMoreSelector:
    """LessIsMore across the layers of a forward pass: dense below the first selection layer and at selection layers
    (which pick the keys); later layers reuse the last pick."""

    def __init__(self, budget: int | float = 1024, selection_layers=(2,), recent_ratio: float = 0.25,
                 scale: float | None = None):
        resolve_budget(budget, 0)  # validates the budget
        if not isinstance(selection_layers, (list, tuple, range)):
            raise TypeError(f"selection_layers must be a list or tuple of layer indices, got {selection_layers!r}")
        layers = tuple(selection_layers)
        if (not layers or any(isinstance(l, bool) or not isinstance(l, int) or l < 0 for l in layers)
                or list(layers) != sorted(set(layers))):
            raise ValueError("selection_layers must be a non-empty increasing sequence of layer indices >= 0, got "
                             f"{selection_layers!r}")
        lessismore_split(0, recent_ratio)  # validates the ratio
        self.budget, self.selection_layers, self.recent_ratio, self.scale = budget, layers, recent_ratio, scale
        self.reset()

    def reset(self):
        "Forget the stored selection."
        self.selection, self.selected_at = None, None

    def select(self, layer_idx: int, q_chunk: Tensor, k_cache: Tensor) -> Tensor | None:
        "Key indices [B,Hkv,n] for layer `layer_idx`, or None where the layer attends densely."
        if layer_idx < self.selection_layers[0]: return None
        if layer_idx in self.selection_layers:
            self.selection = lessismore_select(q_chunk, k_cache, self.budget, self.recent_ratio, self.scale)
            self.selected_at, self.shape = layer_idx, tuple(k_cache.shape[:3])
            return None
        check_chunk(q_chunk, k_cache)
        below = max(l for l in self.selection_layers if l < layer_idx)
        if self.selection is None or self.selected_at != below or self.shape != tuple(k_cache.shape[:3]):
            stored = "missing" if self.selection is None else f"from layer {self.selected_at} for keys {self.shape}"
            raise RuntimeError(f"layer {layer_idx} reuses the pick of selection layer {below} of this forward pass, "
                               f"but the stored pick is {stored}; "
                               f"call select for every layer in order (keys now {tuple(k_cache.shape[:3])})")
        return self.selection


# %%
q, k = _qk(3, 8, 40)
sel = LessIsMoreSelector(10, selection_layers=(2, 5))
got = [sel.select(layer, q, k) for layer in range(8)]
# dense: 0, 1 and the selection layers
test_eq([x is None for x in got], [True, True, True, False, False, True, False, False])
want = lessismore_select(q, k, 10)
for layer in (3, 4, 6, 7): test_eq(got[layer], want)
q2, k2 = _qk(3, 8, 48, seed=1)                                    # the next chunk: 8 more keys
test_fail(lambda: sel.select(3, q2, k2), contains="stored pick")  # layer 2 of this chunk was skipped
test_eq(sel.select(2, q2, k2), None)
test_eq(sel.select(3, q2, k2), lessismore_select(q2, k2, 10))
sel.reset()
test_fail(lambda: sel.select(3, q2, k2), contains="missing")
test_fail(lambda: LessIsMoreSelector(10, selection_layers=(5, 2)), contains="selection_layers")
test_fail(lambda: LessIsMoreSelector(0), contains="budget")


# %% [markdown]
# ### LessIsMore in the chunked prefill
#
# `LessIsMorePolicy` is an `EarlierKeysPolicy` (see [the policy](22_quoka_policy.ipynb)) that asks one
# `LessIsMoreSelector` for every layer of every chunk, in order. LessIsMore keeps no budget of its own per call: its
# selector decides, and a layer that reuses a pick covering all earlier keys attends densely. In a padded batch
# each row has a selector of its own (`row_selector`), so its pick is the row's.

# %%
#| export
class LessIsMorePolicy(EarlierKeysPolicy):
    "LessIsMore (Yang et al. 2025b) in chunked prefill: a `LessIsMoreSelector` picks at selection layers, others reuse."

    def __init__(self, selector: LessIsMoreSelector, decode: bool = True):
        if not isinstance(selector, LessIsMoreSelector):
            raise TypeError(f"selector must be a LessIsMoreSelector, got {type(selector).__name__}")
        super().__init__(decode)
        self.selector, self.row_selectors = selector, {}

    def fits(self, T: int) -> bool:
        "Only the first chunk (T = 0) is dense without asking: the selector is not consulted there."
        return T == 0

    def pick_earlier(self, q: Tensor, k_earlier: Tensor, ctx: AttentionContext) -> Tensor | None:
        "The selector's pick for this layer (called for every layer: it checks the order); None: dense."
        return self.row_selector(ctx.row).select(ctx.layer_idx, q, k_earlier)

    def row_selector(self, row: int | None) -> LessIsMoreSelector:
        "The selector of the whole batch (row None) or, in a padded batch, of row `row` (its pick is the row's own)."
        if row is None: return self.selector
        if row not in self.row_selectors:
            self.row_selectors[row] = copy.copy(self.selector)
            self.row_selectors[row].reset()
        return self.row_selectors[row]


# %%
_lim = LessIsMorePolicy(LessIsMoreSelector(budget=6, selection_layers=(0,)))
test_eq((_lim.fits(0), _lim.fits(5)), (True, False))
assert _lim.row_selector(None) is _lim.selector
row1 = _lim.row_selector(1)
assert isinstance(row1, LessIsMoreSelector) and row1 is not _lim.selector and _lim.row_selector(1) is row1
test_fail(lambda: LessIsMorePolicy(QuokaPolicy()), contains="selector must be a LessIsMoreSelector")

# %% [markdown]
# On the tiny random Llama of [the policy's checks](22_quoka_policy.ipynb) (2 layers, chunks of 8): at full budget
# the policy reproduces dense chunked prefill; in a batch of three prompts of 40, 29 and 21 tokens left-padded to
# 40, each row's last logits equal those of the row alone, and each row selects.

# %%
model, _ = load_model("tiny-llama")
ids = torch.randint(3, 259, (2, 40), generator=torch.Generator().manual_seed(1))
_, dense_last = chunked_prefill(model, ids, 8)
lim = LessIsMorePolicy(LessIsMoreSelector(budget=40, selection_layers=(0,)))
assert_close(chunked_prefill(model, ids, 8, lim)[1], dense_last, atol=1e-5, rtol=0)
lens = [40, 29, 21]
batch, am = torch.zeros(3, 40, dtype=torch.long), torch.zeros(3, 40, dtype=torch.long)
for b, n in enumerate(lens): batch[b, 40 - n:], am[b, 40 - n:] = ids[b % 2, :n], 1
def make(): return LessIsMorePolicy(LessIsMoreSelector(budget=6, selection_layers=(0,)))
last = chunked_prefill(model, batch, 8, make(), attention_mask=am)[1]
for b, n in enumerate(lens):
    alone = chunked_prefill(model, batch[b:b + 1, 40 - n:], 8, make())[1]
    assert_close(last[b], alone[0], atol=1e-4, rtol=0, msg=f"lessismore, row {b}")
    assert (alone[0] - chunked_prefill(model, batch[b:b + 1, 40 - n:], 8)[1][0]).abs().max() > 1e-4  # it selects


# %% [markdown]
# **The method.** `LessIsMore` (`"lessismore"`) is a `SelectionMethod` with its own policy. Only its selection
# layers score keys (`scoring_layers`: one layer, 2, by default), every query of every head times each key, $G S D$;
# the layers after them reuse the pick. `check_model` refuses a selection layer the model does not have (it would
# never select): the default layer 2 on the two-layer tiny model.

# %%
#| export
class LessIsMore(SelectionMethod):
    "LessIsMore: one key set for all heads, picked at `selection_layers` and reused by the layers after them."
    # at layer 0, so that layer 1 of the two-layer test models reuses its pick (at or below it attention is dense)
    name, small_params = "lessismore", {"chunk_size": 8, "selection_layers": (0,)}

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, selection_layers=(2,),
                 recent_ratio: float = 0.25):
        super().__init__(budget, chunk_size, decode)
        LessIsMoreSelector(self.budget, selection_layers, recent_ratio)  # checks both, naming them
        self.selection_layers, self.recent_ratio = tuple(selection_layers), recent_ratio

    def policy(self) -> LessIsMorePolicy:
        return LessIsMorePolicy(LessIsMoreSelector(self.budget, self.selection_layers, self.recent_ratio), self.decode)

    def key_cost(self, shape, S):
        "At a selection layer, every query of every head times each key: G S D."
        return shape.G * S * shape.D, 0

    def scoring_layers(self, shape):
        "Only the selection layers score."
        return sum(layer < shape.layers for layer in self.selection_layers)

    def check_model(self, model):
        "Every selection layer is a layer of the model (one beyond it would never select: dense attention)."
        L = model_info(model).num_layers
        if self.selection_layers[-1] >= L:
            raise ValueError(f"selection_layers must be layer indices in [0, {L}) of this model ({L} layers), got "
                             f"{self.selection_layers}")


# %%
test_eq((LessIsMore(256).key_cost(shape, 128), LessIsMore(256).scoring_layers(shape)), ((3 * 128 * 64, 0), 1))
test_fail(lambda: LessIsMore(256).check_model(load_model("tiny-llama")[0]), contains="selection_layers must be")

# %% [markdown]
# ## Bad input
#
# All baselines validate like `quoka_select`: shapes, dtypes and heads through `check_chunk`,
# the budget through `resolve_budget`, the scale through `softmax_scale`, NaN scores in the
# selection:

# %%
q, k = _qk(3, 8, 20)
for select in (mean_score_select, sample_attention_select, sparq_select, loki_select, lessismore_select):
    test_fail(lambda: select(q[:, :5], k, 8), contains="multiple of the KV heads")
    test_fail(lambda: select(q, k.float(), 8), contains="k_cache")
    test_fail(lambda: select(q, k, 0), contains="budget")
    test_fail(lambda: select(q, k, 8, scale="big"), contains="scale")
    test_fail(lambda: select(q, k.masked_fill(k > 2, math.nan), 8), contains="NaN")
