"""QuoKA's Algorithm 1 (`sparsekv.quoka.select`) against its brute-force reference: GQA, budgets around the cache size,
all queries kept, one query, ties, dtypes, invariances, bad input."""
import math
from decimal import ROUND_HALF_UP, Decimal

import pytest
import torch
import torch.nn.functional as F

from sparsekv.quoka.select import (
    GQA_AGGS,
    QUERY_AGGS,
    QUERY_SELECT,
    UnitKeyCache,
    preaggregated_queries,
    query_dissimilarity,
    quoka_decode_select,
    quoka_scores,
    quoka_scores_reference,
    quoka_select,
    quoka_select_reference,
    select_queries,
    unit_keys,
)
from sparsekv.select import resolve_budget, top_budget_indices, top_budget_indices_reference, top_mask

# (S, T, n_q, budget): T > budget, T < budget, T == budget, n_q >= S, a single query, a fraction of the cache,
# an empty cache
CASES = [(16, 50, 4, 12), (16, 9, 4, 12), (16, 12, 4, 12), (16, 50, 16, 12), (16, 50, 40, 12), (1, 50, 4, 12),
         (16, 50, 4, 0.25), (16, 50, 4, 1.0), (7, 33, 3, 1), (16, 0, 4, 12)]


def make_qk(G, S, T, B=2, Hkv=2, D=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, S, D, generator=g, dtype=torch.float64) + 0.4
    q = q * torch.rand(B, Hkv * G, S, 1, generator=g, dtype=torch.float64) * 3  # queries of different norms
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64)
    k = k * torch.rand(B, Hkv, T, 1, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype)


def check_indices(idx, B, Hkv, n, T):
    assert idx.shape == (B, Hkv, n) and idx.dtype == torch.long
    assert (idx[..., 1:] > idx[..., :-1]).all(), "ascending and without repeats"
    if idx.numel(): assert idx.min() >= 0 and idx.max() < T


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("mode", QUERY_SELECT)
@pytest.mark.parametrize("S,T,n_q,budget", CASES)
def test_select_matches_reference(G, mode, S, T, n_q, budget):
    q, k = make_qk(G, S, T, seed=1000 * G + 10 * S + T)
    for agg in QUERY_AGGS:
        for gqa in GQA_AGGS:
            idx = quoka_select(q, k, n_q, budget, mode, agg, gqa_agg=gqa)
            want = quoka_select_reference(q, k, n_q, budget, mode, agg, gqa_agg=gqa)
            torch.testing.assert_close(idx, want, rtol=0, atol=0)
            check_indices(idx, 2, 2, resolve_budget(budget, T), T)


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("mode", QUERY_SELECT)
def test_scores_match_head_by_head_reference(G, mode):
    """Pre-aggregated scores equal the head-by-head float64 loops, in float64 and (to rounding) from float32 and
    bfloat16 inputs."""
    q, k = make_qk(G, 24, 70, seed=G)
    for agg in QUERY_AGGS:
        for gqa in GQA_AGGS:  # the head max: each head's queries apart, against the same loops
            torch.testing.assert_close(quoka_scores(q, k, 6, mode, agg, gqa_agg=gqa),
                                       quoka_scores_reference(q, k, 6, mode, agg, gqa_agg=gqa), rtol=0, atol=1e-12)
        want = quoka_scores_reference(q, k, 6, mode, agg)
        torch.testing.assert_close(quoka_scores(q, k, 6, mode, agg), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(quoka_scores(q.float(), k.float(), 6, mode, agg).double(),
                                   quoka_scores_reference(q.float(), k.float(), 6, mode, agg), rtol=0, atol=2e-6)
        qb, kb = q.bfloat16(), k.bfloat16()  # same rounded inputs on both sides: only the accumulation differs
        assert quoka_scores(qb, kb, 6, mode, agg).dtype == torch.float32
        torch.testing.assert_close(quoka_scores(qb, kb, 6, mode, agg).double(),
                                   quoka_scores_reference(qb, kb, 6, mode, agg), rtol=0, atol=2e-6)


def test_preaggregation_is_not_mean_of_per_head_max():
    """The exported order (mean over heads per query, then max) is sigma <= tau (max per head, then mean), and differs
    for G > 1."""
    q, k = make_qk(4, 20, 60, seed=3)
    pos = select_queries(q, 5, 4)
    qs = F.normalize(q.gather(2, pos[..., None].expand(-1, -1, -1, 16)), dim=-1)
    c = (qs.view(2, 2, 4, 5, 16) @ F.normalize(k, dim=-1)[:, :, None].transpose(-1, -2))  # [B,Hkv,G,n,T] per head
    sigma, tau = c.mean(2).amax(2), c.amax(3).mean(2)
    torch.testing.assert_close(quoka_scores(q, k, 5), sigma)
    assert (tau >= sigma - 1e-12).all() and (tau - sigma).max() > 1e-2
    torch.testing.assert_close(preaggregated_queries(q, pos, 4), qs.view(2, 2, 4, 5, 16).mean(2))


@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("mode", QUERY_SELECT)
def test_ties_go_to_the_lower_index(G, mode):
    "One-hot queries and keys: every score is exact and many are equal; both implementations break ties the same way."
    g = torch.Generator().manual_seed(G)
    D = 5
    for _ in range(4):
        q = F.one_hot(torch.randint(0, D, (2, 2 * G, 9), generator=g), D).double()
        k = F.one_hot(torch.randint(0, 2, (2, 2, 30), generator=g), D).double()  # two distinct keys among 30
        for budget in (1, 7, 15, 29):
            want = quoka_select_reference(q, k, 3, budget, mode)
            torch.testing.assert_close(quoka_select(q, k, 3, budget, mode), want, rtol=0, atol=0)
    same = quoka_select(torch.ones(1, G, 4, 3), torch.ones(1, 1, 20, 3), 2, 6)
    torch.testing.assert_close(same, torch.arange(6).view(1, 1, 6))


def test_all_queries_kept_and_group_equals_head_mode():
    "With n_q >= S both modes keep every query; with G = 1 they coincide for any n_q."
    q, k = make_qk(3, 10, 40, seed=5)
    torch.testing.assert_close(quoka_scores(q, k, 10, "group"), quoka_scores(q, k, 10, "head"))
    torch.testing.assert_close(quoka_scores(q, k, 99, "group"), quoka_scores(q, k, 10, "group"))
    q1, k1 = make_qk(1, 10, 40, seed=6)
    torch.testing.assert_close(quoka_scores(q1, k1, 3, "group"), quoka_scores(q1, k1, 3, "head"))


def test_kept_queries_are_the_most_dissimilar():
    q, _ = make_qk(3, 30, 1, seed=7)
    d = query_dissimilarity(q)
    for mode in QUERY_SELECT:
        pos = select_queries(q, 8, 3, mode)
        ranked = d.view(2, 2, 3, 30).mean(2).repeat_interleave(3, 1) if mode == "group" else d
        kept = torch.zeros_like(ranked, dtype=torch.bool).scatter(2, pos, True)
        assert (ranked.masked_fill(~kept, math.inf).amin(-1) >= ranked.masked_fill(kept, -math.inf).amax(-1)).all()
        if mode == "group":  # the heads of a group keep the same positions
            assert (pos.view(2, 2, 3, 8) == pos.view(2, 2, 3, 8)[:, :, :1]).all()


def test_invariant_to_vector_norms():
    "Cosine scoring: rescaling each key, or each query when all are kept, by a positive factor changes nothing."
    q, k = make_qk(3, 16, 60, seed=8)
    g = torch.Generator().manual_seed(0)
    qs = q * (torch.rand(*q.shape[:3], 1, generator=g, dtype=torch.float64) * 10 + 0.1)
    ks = k * (torch.rand(*k.shape[:3], 1, generator=g, dtype=torch.float64) * 10 + 0.1)
    # one factor per head: M_Q scales along
    qh = q * (torch.rand(*q.shape[:2], 1, 1, generator=g, dtype=torch.float64) * 10 + 0.1)
    for mode in QUERY_SELECT:
        want = quoka_select(q, k, 4, 15, mode)
        torch.testing.assert_close(quoka_select(q, ks, 4, 15, mode), want, rtol=0, atol=0)
        torch.testing.assert_close(quoka_select(qh, ks, 4, 15, mode), want, rtol=0, atol=0)
        torch.testing.assert_close(quoka_select(qs, ks, 16, 15, mode), quoka_select(q, k, 16, 15, mode), rtol=0, atol=0)
    # per-query norms do move the mean query M_Q, hence the subselection: the two are not invariant together
    assert not torch.equal(query_dissimilarity(qs), query_dissimilarity(q))


def test_permuting_the_cache_permutes_the_selection():
    q, k = make_qk(3, 16, 60, seed=9)
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(1))
    got = quoka_select(q, k[:, :, perm], 4, 15)
    want = quoka_select(q, k, 4, 15)
    assert torch.equal(perm[got].sort(-1).values, want)


def test_float32_and_bfloat16_inputs():
    q, k = make_qk(3, 16, 80, seed=10)
    want = quoka_scores_reference(q, k, 4)
    for dtype in (torch.float32, torch.bfloat16):
        idx = quoka_select(q.to(dtype), k.to(dtype), 4, 20)
        check_indices(idx, 2, 2, 20, 80)
        # the chosen keys are (up to rounding of the inputs) the best: their worst score is near the 20th best
        worst = want.gather(2, idx).amin(-1)
        assert (worst >= want.topk(20, -1).values[..., -1] - (0.05 if dtype == torch.bfloat16 else 1e-5)).all()


@pytest.mark.parametrize("G", [1, 3])
def test_decode_mode(G):
    q, k = make_qk(G, 1, 64, seed=11)
    qbar = F.normalize(q, dim=-1).view(2, 2, G, 16).mean(2)  # mean of the group's unit queries
    scores = (F.normalize(k, dim=-1) @ qbar[..., None])[..., 0]
    for budget in (5, 0.25, 64, 100):
        want = top_budget_indices_reference(scores, resolve_budget(budget, 64))
        torch.testing.assert_close(quoka_decode_select(q, k, budget), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one query per head"):
        quoka_decode_select(torch.randn(2, 2, 3, 16), k)


@pytest.mark.parametrize("seed", range(5))
def test_top_budget_indices_matches_sort(seed):
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 40, (1,), generator=g))
    for scores in (torch.randn(3, 2, T, generator=g), torch.randint(0, 4, (3, 2, T), generator=g).float()):
        scores[0, 0, ::2] = -math.inf
        for n in range(T + 1):
            torch.testing.assert_close(top_budget_indices(scores, n), top_budget_indices_reference(scores, n),
                                       rtol=0, atol=0)
            assert (top_mask(scores, n).sum(-1) == n).all()


def test_resolve_budget():
    "Fractions round the decimal product half up (computed independently with `decimal`), at least 1, at most T."
    for T in range(0, 300, 7):
        for frac in (0.01, 0.1, 0.25, 0.29, 0.5, 0.7, 0.999, 1.0):
            exact = (Decimal(repr(frac)) * T).quantize(Decimal(1), rounding=ROUND_HALF_UP)
            assert resolve_budget(frac, T) == min(T, max(1, int(exact)))
        assert resolve_budget(1024, T) == min(1024, T)
    for bad in (0, -3, 0.0, 1.01, float("nan"), "1024", None, True):
        with pytest.raises((ValueError, TypeError), match="budget must be"):
            resolve_budget(bad, 10)


def test_bad_input():
    q, k = make_qk(3, 8, 20)
    with pytest.raises(ValueError, match="multiple of the KV heads"): quoka_select(q[:, :5], k, 4, 8)
    with pytest.raises(TypeError, match="share one dtype"): quoka_select(q, k.float(), 4, 8)
    with pytest.raises(ValueError, match="batch size"): quoka_select(q[:1], k, 4, 8)
    with pytest.raises(ValueError, match="4-D"): quoka_select(q[0], k, 4, 8)
    with pytest.raises(TypeError, match="floating-point"): quoka_select(q.long(), k.long(), 4, 8)
    with pytest.raises(ValueError, match="n_q"): quoka_select(q, k, 0, 8)
    with pytest.raises(ValueError, match="n_q"): quoka_select(q, k, True, 8)
    with pytest.raises(ValueError, match="query_select"): quoka_select(q, k, 4, 8, "all")
    with pytest.raises(ValueError, match="query_agg"): quoka_select(q, k, 4, 8, query_agg="min")
    with pytest.raises(ValueError, match="budget"): quoka_select(q, k, 4, 0)
    with pytest.raises(ValueError, match="NaN"): quoka_select(q, k.masked_fill(k > 1, math.nan), 4, 8)
    with pytest.raises(ValueError, match="NaN"): quoka_select(q.masked_fill(q > 1, math.inf), k, 4, 8)


@pytest.mark.parametrize("seed", range(3))
def test_top_budget_indices_fast_path_and_ties_at_the_cut(seed):
    """Long rows without ties (topk fast path) and the same rows with a tie planted at the cut (mask path) both match
    the sort."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, 500, generator=g, dtype=torch.float64)
    for n in (1, 37, 250, 499, 500):
        torch.testing.assert_close(top_budget_indices(scores, n), top_budget_indices_reference(scores, n),
                                   rtol=0, atol=0)
        tied = scores.clone()
        if n < 500:
            kth = tied[0, 0].topk(n).values[-1]
            tied[0, 0, tied[0, 0].argsort()[0]] = kth  # a second entry equal to the n-th score, at another position
            torch.testing.assert_close(top_budget_indices(tied, n), top_budget_indices_reference(tied, n),
                                       rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_unit_key_cache_gives_the_same_selection(dtype):
    """Growing the cache chunk by chunk: the cached unit keys equal unit_keys of the whole cache and the selection is
    unchanged; it matches the reference in float64."""
    q_all, k_all = make_qk(3, 16 * 12, 16 * 12, seed=dtype.itemsize)
    q_all, k_all = q_all.to(dtype), k_all.to(dtype)
    cache = UnitKeyCache()
    for c in range(1, 12):
        q, k = q_all[:, :, 16 * c:16 * (c + 1)], k_all[:, :, :16 * c]
        unit = cache.update(k)
        assert torch.equal(unit, unit_keys(k))
        assert unit.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        idx = quoka_select(q, k, 4, 20, k_unit=unit)
        assert torch.equal(idx, quoka_select(q, k, 4, 20))
        if dtype == torch.float64 and c in (2, 11): assert torch.equal(idx, quoka_select_reference(q, k, 4, 20))
    assert cache.buffer.shape[2] < 2 * 16 * 11 + 1  # grown by doubling, not per call


def test_meta_tensors_are_refused_by_name():
    "Meta tensors (shapes, no values) failed deep inside on Tensor.item(); refused up front, naming the argument."
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match="q_chunk is a meta tensor .* needs a tensor with data"):
        quoka_select(q.to("meta"), k.to("meta"), 4, 8)
    with pytest.raises(ValueError, match="q_chunk is a meta tensor"): quoka_scores(q.to("meta"), k.to("meta"), 4)
    with pytest.raises(ValueError, match=r"k_unit must be the unit keys .* on cpu .* on meta"):
        quoka_select(q, k, 4, 8, k_unit=unit_keys(k).to("meta"))


@pytest.mark.parametrize("mode", QUERY_SELECT)
def test_head_max_ablation(mode):
    """gqa_agg='max' is the largest of the per-head scores (explicit unit vectors), at least the head mean, equal to it
    with one head per group; at decode too; an unknown value is refused by name."""
    for G in (1, 3):
        q, k = make_qk(G, 10, 40, seed=7 + G)
        pos = select_queries(q, 4, G, mode)
        qhat = F.normalize(q.gather(2, pos[..., None].expand(-1, -1, -1, q.shape[-1])), dim=-1)
        c = torch.einsum("bhnd,bhtd->bhnt", qhat, F.normalize(k, dim=-1).repeat_interleave(G, 1))  # [B,Hq,n,T]
        per_head = c.view(2, 2, G, 4, 40).amax(3)                                                   # [B,Hkv,G,T]
        got = quoka_scores(q, k, 4, mode, gqa_agg="max")
        torch.testing.assert_close(got, per_head.amax(2), rtol=0, atol=1e-12)
        assert (got >= quoka_scores(q, k, 4, mode) - 1e-12).all()
        if G == 1: torch.testing.assert_close(got, quoka_scores(q, k, 4, mode), rtol=0, atol=1e-12)
        q1 = q[:, :, :1]
        assert torch.equal(quoka_decode_select(q1, k, 9, gqa_agg="max"),
                           quoka_select_reference(q1, k, 1, 9, gqa_agg="max"))
    with pytest.raises(ValueError, match="gqa_agg"): quoka_select(q, k, 4, 8, gqa_agg="min")
