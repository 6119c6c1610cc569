"""The selection baselines (`sparsekv.quoka.baselines`) against their brute-force references, identities between them,
LessIsMore's layer reuse, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

from sparsekv.quoka.baselines import (
    MEAN_SCORES,
    LessIsMoreSelector,
    lessismore_select,
    lessismore_select_reference,
    lessismore_split,
    loki_basis,
    loki_select,
    loki_select_reference,
    mean_score_select,
    mean_score_select_reference,
    sample_attention_select,
    sample_attention_select_reference,
    sample_query_positions,
    sparq_select,
    sparq_select_reference,
)
from sparsekv.select import resolve_budget

# (S, T, budget): T > budget, T < budget, T == budget, a single query, a fraction, an empty cache
CASES = [(12, 45, 10), (12, 7, 10), (12, 10, 10), (1, 45, 6), (12, 45, 0.3), (12, 0, 10)]


def make_qk(G, S, T, B=2, Hkv=2, D=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hkv * G, S, D, generator=g, dtype=torch.float64) + 0.3) * 1.5
    spectrum = torch.logspace(0, -1.5, D, dtype=torch.float64)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) * spectrum + 0.2
    return q.to(dtype), k.to(dtype)


def check_indices(idx, B, Hkv, n, T):
    assert idx.shape == (B, Hkv, n) and idx.dtype == torch.long
    assert (idx[..., 1:] > idx[..., :-1]).all(), "ascending and without repeats"
    if idx.numel(): assert idx.min() >= 0 and idx.max() < T


def same(a, b): torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("S,T,budget", CASES)
def test_mean_score_matches_reference(G, S, T, budget):
    q, k = make_qk(G, S, T, seed=G * 100 + S + T)
    for scores in MEAN_SCORES:
        idx = mean_score_select(q, k, budget, scores)
        same(idx, mean_score_select_reference(q, k, budget, scores))
        check_indices(idx, 2, 2, resolve_budget(budget, T), T)
    same(mean_score_select(q, k, budget, scale=0.05), mean_score_select_reference(q, k, budget, scale=0.05))


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("S,T,budget", CASES)
def test_sample_attention_matches_reference(G, S, T, budget):
    q, k = make_qk(G, S, T, seed=G * 100 + S + T + 1)
    for n_q in (1, 5, 16):
        for seed in (0, 7):
            idx = sample_attention_select(q, k, budget, n_q, seed)
            same(idx, sample_attention_select_reference(q, k, budget, n_q, seed))
            check_indices(idx, 2, 2, resolve_budget(budget, T), T)
    same(sample_attention_select(q, k, budget, n_q=S), mean_score_select(q, k, budget))  # every query sampled


def test_sampling_is_uniform_and_seeded():
    torch.testing.assert_close(sample_query_positions(20, 5, 3), sample_query_positions(20, 5, 3))
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_query_positions(12, 3, gen) for _ in range(6000)])
    assert (draws[:, 1:] > draws[:, :-1]).all()
    freq = F.one_hot(draws, 12).sum((0, 1)).double() / 6000
    assert (freq - 0.25).abs().max() < 4 * math.sqrt(0.25 * 0.75 / 6000)
    # a Generator advances from chunk to chunk, also when the cache fits the budget
    q, k = make_qk(1, 12, 4)
    gen_a, gen_b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    sample_attention_select(q, k, 10, 3, gen_a)
    sample_query_positions(12, 3, gen_b)
    torch.testing.assert_close(sample_query_positions(12, 3, gen_a), sample_query_positions(12, 3, gen_b))


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("S,T,budget", CASES)
def test_sparq_matches_reference(G, S, T, budget):
    q, k = make_qk(G, S, T, seed=G * 100 + S + T + 2)
    # heavy-tailed channels
    q = q * torch.rand(q.shape, generator=torch.Generator().manual_seed(G), dtype=torch.float64).pow(3) * 4
    for r in (1, 4, None):
        idx = sparq_select(q, k, budget, r)
        same(idx, sparq_select_reference(q, k, budget, r))
        check_indices(idx, 2, 2, resolve_budget(budget, T), T)
    same(sparq_select(q, k, budget, r=16), mean_score_select(q, k, budget))  # no channel dropped


def test_sparq_tied_magnitudes_and_zero_query():
    q, k = make_qk(3, 8, 30, seed=9)
    q = q.sign()
    q[0, 0, 0] = 0.0  # an all-zero query: uniform approximate attention, no division by zero
    for r in (3, 8):
        same(sparq_select(q, k, 10, r), sparq_select_reference(q, k, 10, r))


def test_sparq_uses_only_the_top_channels():
    "Changing the keys in channels no query selects does not change the selection."
    q, k = make_qk(2, 6, 40, seed=10)
    q[..., 8:] *= 1e-3  # every query's largest channels are among the first 8
    k2 = k.clone()
    k2[..., 8:] = torch.randn(k[..., 8:].shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 100
    same(sparq_select(q, k2, 12, r=8), sparq_select(q, k, 12, r=8))
    assert not torch.equal(mean_score_select(q, k2, 12), mean_score_select(q, k, 12))


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("S,T,budget", CASES)
def test_loki_matches_reference(G, S, T, budget):
    q, k = make_qk(G, S, T, seed=G * 100 + S + T + 3)
    for r in (3, None):
        for center in (False, True):
            if center and T <= 16: continue  # the covariance of <= D keys is singular: its top-r subspace is not unique
            idx = loki_select(q, k, budget, r, center=center)
            same(idx, loki_select_reference(q, k, budget, r, center=center))
            check_indices(idx, 2, 2, resolve_budget(budget, T), T)
    calib = loki_basis(make_qk(1, 1, 80, B=3, seed=99)[1])
    same(loki_select(q, k, budget, 5, basis=calib), loki_select_reference(q, k, budget, 5, basis=calib))
    per_batch = torch.stack([calib, calib.flip(-1)])
    same(loki_select(q, k, budget, 5, basis=per_batch), loki_select_reference(q, k, budget, 5, basis=per_batch))
    same(loki_select(q, k, budget, r=16), mean_score_select(q, k, budget))  # the full rotation is exact


def test_loki_basis_is_the_best_subspace():
    k = make_qk(1, 1, 60, B=2, seed=4)[1]
    x = k.transpose(0, 1).reshape(2, 120, 16)
    for center in (False, True):
        P = loki_basis(k, center)
        torch.testing.assert_close(P.transpose(-1, -2) @ P, torch.eye(16, dtype=torch.float64).expand(2, 16, 16))
        xc = x - x.mean(1, keepdim=True) if center else x
        ev = torch.linalg.eigvalsh(xc.transpose(-1, -2) @ xc).flip(-1)
        for r in (1, 4, 12):
            err = ((xc - xc @ P[..., :r] @ P[..., :r].transpose(-1, -2)) ** 2).sum((1, 2))
            torch.testing.assert_close(err, ev[:, r:].sum(-1))  # Eckart–Young: the discarded energy


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("S,T,budget", CASES)
def test_lessismore_matches_reference(G, S, T, budget):
    q, k = make_qk(G, S, T, seed=G * 100 + S + T + 4)
    n = resolve_budget(budget, T)
    for ratio in (0.0, 0.25, 0.6, 1.0):
        idx = lessismore_select(q, k, budget, ratio)
        same(idx, lessismore_select_reference(q, k, budget, ratio))
        check_indices(idx, 2, 2, n, T)
        assert (idx == idx[:, :1]).all(), "one key set for every KV head"
        n_rec = lessismore_split(n, ratio)[1]
        for b in range(2): assert set(range(T - n_rec, T)) <= set(idx[b, 0].tolist())


def test_lessismore_merges_heads_rank_by_rank():
    "Two query heads that want disjoint keys: the merge alternates their rankings."
    D, T = 8, 40
    k = torch.zeros(1, 1, T, D, dtype=torch.float64)
    k[0, 0, :20, 0] = torch.linspace(3, 1, 20, dtype=torch.float64)  # head 0 (query e_0) prefers keys 0, 1, 2, ...
    k[0, 0, 20:, 1] = torch.linspace(3, 1, 20, dtype=torch.float64)  # head 1 (query e_1) prefers keys 20, 21, ...
    q = torch.zeros(1, 2, 1, D, dtype=torch.float64)
    q[0, 0, 0, 0] = q[0, 1, 0, 1] = 10.0
    idx = lessismore_select(q, k, 6, recent_ratio=0.0)
    same(idx, torch.tensor([[[0, 1, 2, 20, 21, 22]]]))
    same(idx, lessismore_select_reference(q, k, 6, 0.0))


def test_lessismore_ties_and_single_head():
    q, k = make_qk(3, 6, 30, seed=11)
    k[:, :, 10:20] = k[:, :, :1]  # ten copies of key 0
    same(lessismore_select(q, k, 12), lessismore_select_reference(q, k, 12))
    q1, k1 = make_qk(1, 9, 40, Hkv=1, seed=12)
    same(lessismore_select(q1, k1, 10, 0.0), mean_score_select(q1, k1, 10))


def test_lessismore_selector_reuses_the_last_pick():
    q, k = make_qk(3, 8, 40)
    sel = LessIsMoreSelector(10, selection_layers=(1, 4), recent_ratio=0.5)
    out = [sel.select(layer, q, k) for layer in range(7)]
    assert [o is None for o in out] == [True, True, False, False, True, False, False]
    want = lessismore_select(q, k, 10, 0.5)
    for layer in (2, 3, 5, 6): same(out[layer], want)
    q2, k2 = make_qk(3, 8, 48, seed=1)  # the next chunk
    with pytest.raises(RuntimeError, match="stored pick"): sel.select(5, q2, k2)  # layers 1 and 4 of this chunk skipped
    assert sel.select(1, q2, k2) is None
    same(sel.select(2, q2, k2), lessismore_select(q2, k2, 10, 0.5))
    with pytest.raises(RuntimeError, match="from layer 1"): sel.select(5, q2, k2)  # layer 4 skipped
    sel.reset()
    with pytest.raises(RuntimeError, match="missing"): sel.select(2, q2, k2)
    for bad in ((), (3, 1), (1, 1), (-1,), (1.0,)):
        with pytest.raises(ValueError, match="selection_layers"): LessIsMoreSelector(10, bad)
    with pytest.raises(ValueError, match="recent_ratio"): LessIsMoreSelector(10, recent_ratio=-0.1)


def test_float32_inputs_agree_with_float64():
    "From float32 inputs each method picks (almost) the keys it picks in float64: only near-ties may flip."
    q, k = make_qk(3, 12, 60, seed=13)
    for select in (mean_score_select, sparq_select, loki_select, lessismore_select,
                   lambda q, k, b: sample_attention_select(q, k, b, 4)):
        idx32, idx64 = select(q.float(), k.float(), 15), select(q, k, 15)
        check_indices(idx32, 2, 2, 15, 60)
        common = (idx32[..., :, None] == idx64[..., None, :]).any(-1).sum(-1)  # keys chosen by both, per head
        assert (common >= 14).all()


ALL = [mean_score_select, sample_attention_select, sparq_select, loki_select, lessismore_select]


@pytest.mark.parametrize("select", ALL, ids=lambda f: f.__name__)
def test_bad_input(select):
    q, k = make_qk(3, 8, 20)
    with pytest.raises(ValueError, match="multiple of the KV heads"): select(q[:, :5], k, 8)
    with pytest.raises(TypeError, match="share one dtype"): select(q, k.float(), 8)
    with pytest.raises(ValueError, match="head dim"): select(q, k[..., :8], 8)
    with pytest.raises(ValueError, match="budget"): select(q, k, 0)
    with pytest.raises(ValueError, match="budget"): select(q, k, 2.0)
    with pytest.raises(ValueError, match="scale"): select(q, k, 8, scale=math.inf)
    with pytest.raises(ValueError, match="NaN"): select(q, k.masked_fill(k > 1, math.nan), 8)


def test_bad_options():
    q, k = make_qk(3, 8, 20)
    with pytest.raises(ValueError, match="scores must be"): mean_score_select(q, k, 8, "probs")
    with pytest.raises(ValueError, match="n_q"): sample_attention_select(q, k, 8, n_q=0)
    with pytest.raises(TypeError, match="seed"): sample_attention_select(q, k, 8, seed=1.5)
    with pytest.raises(ValueError, match="r must be"): sparq_select(q, k, 8, r=0)
    with pytest.raises(ValueError, match="r must be"): loki_select(q, k, 8, r=17)
    with pytest.raises(ValueError, match="basis must be"):
        loki_select(q, k, 8, 4, basis=torch.eye(16, dtype=torch.float64)[None])
    with pytest.raises(ValueError, match="recent_ratio"): lessismore_select(q, k, 8, recent_ratio=2)
    with pytest.raises(TypeError, match="keys must be"): loki_basis(k[0])
