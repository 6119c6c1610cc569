"Tests of sparsekv.eval: metrics against brute-force references on random inputs, and the resumable grid runner."
import math
import time
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import sparsekv.eval as ev
from sparsekv.eval import (
    attention_fidelity,
    attention_fidelity_reference,
    attention_mass_recall,
    avg_at_k,
    kl_to_teacher,
    needle_retention,
    needle_retention_reference,
    needle_summary,
    oracle_topk,
    pass_at_k,
    pass_at_k_estimate,
    pass_at_k_reference,
    per_head_mean,
    perplexity,
    perplexity_reference,
    query_quantile,
    query_quantile_reference,
    relative_output_error,
    retention_recall,
    retention_recall_reference,
    run_grid,
    token_accuracy,
    token_kl,
    token_kl_reference,
    token_nll,
    top1_agreement,
    top1_agreement_reference,
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --- logits metrics -------------------------------------------------------------------

@pytest.mark.parametrize("seed,shape", [(0, (2, 6, 9)), (1, (1, 1, 2)), (2, (4, 17)), (3, (2, 3, 5, 8))])
def test_top1_agreement_matches_loop(seed, shape):
    t = torch.randn(*shape, generator=gen(seed))
    s = t + torch.randn(*shape, generator=gen(seed + 100))
    mask = torch.rand(shape[:-1], generator=gen(seed + 200)) > 0.4
    mask.view(-1)[0] = True
    assert top1_agreement(s, t).item() == pytest.approx(top1_agreement_reference(s, t))
    assert top1_agreement(s, t, mask).item() == pytest.approx(top1_agreement_reference(s, t, mask))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("top_k", [None, 1, 4, 13])
@pytest.mark.parametrize("renorm", [True, False])
def test_token_kl_matches_reference(seed, top_k, renorm):
    t = 3 * torch.randn(2, 5, 13, generator=gen(seed))
    s = t + 2 * torch.randn(2, 5, 13, generator=gen(seed + 50))
    got = token_kl(s, t, top_k=top_k, renormalize_student=renorm)
    assert_close(got, token_kl_reference(s, t, top_k, renorm).float(), rtol=1e-5, atol=1e-5)
    assert (got >= -1e-6).all()


def test_token_kl_blocks_of_rows(monkeypatch):
    "Splitting the rows into blocks (as for long sequences) changes nothing."
    t = torch.randn(3, 11, 7, generator=gen(0))
    s = torch.randn(3, 11, 7, generator=gen(1))
    full, topk = token_kl(s, t), token_kl(s, t, top_k=3)
    monkeypatch.setattr(ev, "_ROWS", 4)
    assert_close(token_kl(s, t), full)
    assert_close(token_kl(s, t, top_k=3), topk)


def test_kl_gradient_is_student_minus_teacher_probabilities():
    "d KL(p_T || p_S) / d z_S = p_S - p_T; on the top-k set the same with both renormalized on T."
    t = torch.randn(4, 10, dtype=torch.float64, generator=gen(3))
    s = torch.randn(4, 10, dtype=torch.float64, generator=gen(4)).requires_grad_()
    token_kl(s, t).sum().backward()
    assert_close(s.grad, F.softmax(s.detach(), -1) - F.softmax(t, -1))
    s.grad = None
    token_kl(s, t, top_k=3).sum().backward()
    idx = t.topk(3, -1).indices
    diff = F.softmax(s.detach().gather(-1, idx), -1) - F.softmax(t.gather(-1, idx), -1)
    want = torch.zeros_like(t).scatter(-1, idx, diff)
    assert_close(s.grad, want)


def test_kl_to_teacher_mask_and_dtypes():
    t = torch.randn(2, 7, 9, generator=gen(5))
    s = torch.randn(2, 7, 9, generator=gen(6))
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 2:5] = True
    assert kl_to_teacher(s, t, mask).item() == pytest.approx(token_kl_reference(s, t)[mask].mean().item(), rel=1e-5)
    assert kl_to_teacher(s.double(), t.double()).dtype == torch.float64
    assert kl_to_teacher(s.half(), t.half()).dtype == torch.float32
    assert kl_to_teacher(t, t).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("call,msg", [
    (lambda s, t: token_kl(s, t[..., :8]), "same shape"),
    (lambda s, t: token_kl(s, t, top_k=0), "top_k must be an int in [1, 9]"),
    (lambda s, t: token_kl(s, t, top_k=2.0), "top_k must be an int"),
    (lambda s, t: kl_to_teacher(s, t, torch.ones(2, 7)), "mask must be a boolean tensor"),
    (lambda s, t: top1_agreement(s[0, 0], t[0, 0]), "at least 2 dims"),
])
def test_logit_metrics_reject_bad_input(call, msg):
    t, s = torch.randn(2, 7, 9), torch.randn(2, 7, 9)
    with pytest.raises((ValueError, TypeError)) as e:
        call(s, t)
    assert msg in str(e.value)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shift", [True, False])
def test_perplexity_and_accuracy_match_loops(seed, shift):
    z = 2 * torch.randn(3, 8, 11, generator=gen(seed))
    y = torch.randint(0, 11, (3, 8), generator=gen(seed + 1))
    y[torch.rand(3, 8, generator=gen(seed + 2)) < 0.25] = -100
    y[0, -1] = 4
    want = math.log(perplexity_reference(z, y, shift=shift))
    assert math.log(perplexity(z, y, shift=shift).item()) == pytest.approx(want, rel=1e-5)
    zz, yy = (z[:, :-1], y[:, 1:]) if shift else (z, y)
    pairs = [(p, l) for p, l in zip(zz.argmax(-1).flatten().tolist(), yy.flatten().tolist()) if l != -100]
    assert token_accuracy(z, y, shift=shift).item() == pytest.approx(sum(p == l for p, l in pairs) / len(pairs))


def test_perplexity_over_batches_from_token_nll():
    "Summing token_nll over batches and dividing by the count gives the perplexity of all the tokens."
    z = torch.randn(4, 6, 5, generator=gen(7))
    y = torch.randint(0, 5, (4, 6), generator=gen(8))
    y[1, 2:] = -100
    parts = [token_nll(z[i:i + 2], y[i:i + 2]) for i in (0, 2)]
    total = sum(n.sum() for n, _ in parts) / sum(v.sum() for _, v in parts)
    assert_close(total.exp(), perplexity(z, y))
    with pytest.raises(ValueError, match="labels must be in"):  # with another ignore_index, -100 is an invalid label
        perplexity(z, y, ignore_index=-1)


def test_perplexity_rejects_bad_labels():
    z, y = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    with pytest.raises(ValueError, match="at least 2 positions"):
        perplexity(z[:, :1], y[:, :1])
    with pytest.raises(ValueError, match="no position to score"):
        token_accuracy(z, torch.full_like(y, -100))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 7\)"):
        perplexity(z, y - 1 - y.max())


# --- attention fidelity ---------------------------------------------------------------

def rand_qkv(seed, B, Hkv, G, Sq, Sk, D, Dv):
    g = gen(seed)
    return (torch.randn(B, Hkv * G, Sq, D, generator=g), torch.randn(B, Hkv, Sk, D, generator=g),
            torch.randn(B, Hkv, Sk, Dv, generator=g))


def causal(B, Hq, Sq, Sk):
    return (torch.arange(Sk) <= torch.arange(Sq)[:, None] + (Sk - Sq)).expand(B, Hq, Sq, Sk)


SHAPES = [  # B, Hkv, G, Sq, Sk, D, Dv
    (1, 1, 1, 1, 1, 4, 4),
    (2, 2, 1, 7, 7, 8, 8),
    (1, 3, 3, 5, 13, 6, 5),
    (2, 1, 4, 1, 11, 4, 4),   # decode: one query
    (1, 2, 3, 9, 9, 4, 3),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(2))
def test_attention_fidelity_matches_explicit_softmax(shape, seed):
    B, Hkv, G, Sq, Sk, D, Dv = shape
    q, k, v = rand_qkv(seed, *shape)
    keep = torch.rand(B, Hkv * G, Sq, Sk, generator=gen(seed + 9)) > 0.5
    mass_ref, err_ref = attention_fidelity_reference(q, k, v, keep, causal(B, Hkv * G, Sq, Sk))
    mass, err = attention_fidelity(q, k, v, keep, chunk=3)
    assert_close(mass, mass_ref.float(), atol=1e-6, rtol=1e-5)
    assert_close(err, err_ref.float(), atol=1e-5, rtol=1e-4, equal_nan=True)
    assert_close(attention_mass_recall(q, k, keep, chunk=2), mass)


@pytest.mark.parametrize("G", [1, 3, 4])
def test_keep_indices_per_kv_head_equal_hand_built_mask(G):
    B, Hkv, Sq, Sk, n = 2, 2, 6, 10, 4
    q, k, v = rand_qkv(G, B, Hkv, G, Sq, Sk, 5, 5)
    idx = torch.randint(0, Sk, (B, Hkv, n), generator=gen(G))
    hand = torch.zeros(B, Hkv * G, Sq, Sk, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv * G):
            hand[b, h, :, idx[b, h // G]] = True
    want = attention_fidelity_reference(q, k, v, hand, causal(B, Hkv * G, Sq, Sk))
    for got in (attention_fidelity(q, k, v, idx), attention_fidelity(q, k, v, idx.int())):
        assert_close(got[0], want[0].float())
        assert_close(got[1], want[1].float(), equal_nan=True)
    per_query = idx[:, :, None].expand(B, Hkv, Sq, n)
    assert_close(attention_mass_recall(q, k, per_query), attention_mass_recall(q, k, idx))
    per_qhead = idx.repeat_interleave(G, dim=1)
    assert_close(attention_mass_recall(q, k, per_qhead), attention_mass_recall(q, k, idx))


def test_mass_recall_grows_with_the_kept_set():
    q, k, _ = rand_qkv(11, 1, 2, 2, 6, 12, 4, 4)
    order = torch.randperm(12, generator=gen(1))
    masses = [attention_mass_recall(q, k, order[:n].expand(1, 2, n)) for n in range(1, 13)]
    for a, b in zip(masses, masses[1:]):
        assert (b >= a - 1e-6).all()
    assert_close(masses[-1], torch.ones_like(masses[-1]))


def test_custom_mask_and_fully_masked_rows():
    B, Hkv, G, Sq, Sk = 2, 1, 3, 4, 6
    q, k, v = rand_qkv(12, B, Hkv, G, Sq, Sk, 4, 4)
    mask = torch.rand(B, Hkv * G, Sq, Sk, generator=gen(2)) > 0.4
    mask[1, 2, 3] = False
    keep = torch.rand(B, 1, 1, Sk, generator=gen(3)) > 0.5
    mass, err = attention_fidelity(q, k, v, keep, mask=mask)
    ref = attention_fidelity_reference(q, k, v, keep.expand(B, Hkv * G, Sq, Sk), mask)
    assert mass[1, 2, 3].isnan() and err[1, 2, 3].isnan()
    assert_close(mass, ref[0].float(), equal_nan=True)
    assert_close(err, ref[1].float(), equal_nan=True)
    heads = per_head_mean(mass)
    assert torch.isfinite(heads).all() and heads.shape == (Hkv * G,)


def test_float64_stays_float64():
    q, k, v = (x.double() for x in rand_qkv(13, 1, 1, 2, 3, 5, 4, 4))
    keep = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    keep[..., 0] = False
    mass, err = attention_fidelity(q, k, v, keep)
    assert mass.dtype == err.dtype == torch.float64
    ref = attention_fidelity_reference(q, k, v, keep.expand(1, 2, 3, 5), causal(1, 2, 3, 5))
    assert_close(mass, ref[0], rtol=1e-12, atol=1e-12)


def test_against_attention_reference():
    "The output error equals the one computed from sparsekv.attention's outputs, and the mass from its LSEs."
    from sparsekv import attention
    B, Hkv, G, Sq, Sk = 2, 2, 3, 5, 11
    q, k, v = rand_qkv(14, B, Hkv, G, Sq, Sk, 8, 8)
    keep = torch.rand(B, Hkv * G, Sq, Sk, generator=gen(4)) > 0.6
    for i in range(Sq): keep[:, :, i, i + Sk - Sq] = True  # every query keeps at least its diagonal key
    allowed = causal(B, Hkv * G, Sq, Sk)
    o_dense, lse_dense = attention.attention_reference(q, k, v)
    o_kept, lse_kept = attention.attention_reference(q, k, v, mask=allowed & keep)
    mass, err = attention_fidelity(q, k, v, keep)
    assert_close(mass, (lse_kept - lse_dense).exp(), atol=1e-6, rtol=1e-5)
    assert_close(err, relative_output_error(o_kept, o_dense), atol=1e-5, rtol=1e-4)


def test_relative_output_error_definition():
    a, b = torch.randn(3, 4, 5, 6, generator=gen(15)), torch.randn(3, 4, 5, 6, generator=gen(16))
    b[2, 1, 0] = 0
    got = relative_output_error(a, b)
    for idx in np.ndindex(3, 4, 5):
        n = b[idx].norm()
        if n == 0:
            assert got[idx].isnan()
        else:
            assert got[idx].item() == pytest.approx(((a[idx] - b[idx]).norm() / n).item(), rel=1e-5)
    assert relative_output_error(b, b)[~got.isnan()].abs().max() == 0
    valid = ~got.isnan()
    assert_close(per_head_mean(got), torch.stack([got[:, h][valid[:, h]].mean() for h in range(4)]))


@pytest.mark.parametrize("make,msg", [
    (lambda q, k, v, keep: attention_fidelity(q, k, v[:, :, :5], keep), "must match k"),
    (lambda q, k, v, keep: attention_mass_recall(q[:, :5], k, keep), "multiple of the KV heads"),
    (lambda q, k, v, keep: attention_mass_recall(q[..., :3], k, keep), "batch and head dim"),
    (lambda q, k, v, keep: attention_mass_recall(q, k, keep[..., :4]), "not broadcastable"),
    (lambda q, k, v, keep: attention_mass_recall(q, k, keep, mask=keep.float()), "mask must be a boolean"),
    (lambda q, k, v, keep: attention_mass_recall(q, k, torch.full((1, 2, 3), 7)), r"keep indices must be in [0, 7)"),
    (lambda q, k, v, keep: attention_mass_recall(q, k, torch.zeros(1, 5, 3, dtype=torch.long)),
     "keep indices must have shape"),
    (lambda q, k, v, keep: attention_mass_recall(q, k, keep, scale="x"), "scale must be a number"),
    (lambda q, k, v, keep: attention_mass_recall(q[0], k[0], keep), "at least 4 dims"),
])
def test_attention_metrics_reject_bad_input(make, msg):
    q, k, v = rand_qkv(0, 1, 2, 3, 4, 7, 4, 4)
    with pytest.raises((ValueError, TypeError)) as e:
        make(q, k, v, torch.ones(1, 6, 4, 7, dtype=torch.bool))
    assert msg in str(e.value)


# --- retention recall -----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_retention_recall_matches_sets_with_ties(seed):
    S, n = 15, 6
    scores = torch.randint(0, 3, (4, 3, S), generator=gen(seed)).float()
    scores[0, :, :2] = -math.inf  # ineligible positions
    kept = torch.stack([torch.stack([torch.randperm(S, generator=gen(100 * seed + 3 * r + h))[:n] for h in range(3)])
                        for r in range(4)])
    for k in (1, 6, S - 2):
        ref = retention_recall_reference([set(x) for x in kept.reshape(-1, n).tolist()],
                                         scores.reshape(-1, S).tolist(), k)
        assert_close(retention_recall(kept, scores, k).flatten(), torch.tensor(ref))


def test_oracle_topk_is_permutation_invariant_up_to_ties():
    "Reordering positions and mapping back gives the same oracle set, and ties go to the lower position."
    s = torch.tensor([[2.0, 5.0, 5.0, 1.0, 5.0, 3.0]])
    assert oracle_topk(s, 2).tolist() == [[1, 2]]
    assert oracle_topk(s, 4).tolist() == [[1, 2, 4, 5]]
    s = torch.randn(3, 20, generator=gen(1))
    perm = torch.randperm(20, generator=gen(2))
    assert_close(perm[oracle_topk(s[:, perm], 7)].sort(-1).values, oracle_topk(s, 7).sort(-1).values)


def test_retention_recall_rejects_bad_input():
    s = torch.randn(2, 8)
    with pytest.raises(ValueError, match="exceeds the number of eligible"):
        retention_recall(torch.zeros(2, 3, dtype=torch.long), torch.where(torch.arange(8) < 6, -math.inf, s), 3)
    with pytest.raises(ValueError, match="NaN"):
        retention_recall(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 8), math.nan), 1)
    with pytest.raises(ValueError, match="kept mask must have the shape"):
        retention_recall(torch.zeros(2, 7, dtype=torch.bool), s, 1)
    with pytest.raises(TypeError, match="kept must be"):
        retention_recall(torch.zeros(2, 3), s, 1)
    with pytest.raises(TypeError, match="k must be an int"):
        retention_recall(torch.zeros(2, 3, dtype=torch.long), s, 1.5)


# --- more than the mean: low quantiles, needle retention, output error ----------------

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("q", [0.0, 0.05, 0.25, 0.5, 0.9, 1.0])
def test_query_quantile_matches_loop_and_numpy(seed, q):
    x = torch.randint(0, 6, (2, 3, 13), generator=gen(seed)).float() / 5  # few distinct values: ties
    x[torch.rand(2, 3, 13, generator=gen(seed + 1)) < 0.2] = math.nan
    x[1, 2] = math.nan  # a head-batch row with no finite entry
    assert query_quantile(x, q).item() == pytest.approx(query_quantile_reference(x.flatten().tolist(), q), abs=1e-6)
    assert query_quantile(x, q).item() == pytest.approx(float(np.nanquantile(x.numpy(), q)), abs=1e-6)
    want = [query_quantile_reference(x[:, h].flatten().tolist(), q) for h in range(3)]
    assert_close(query_quantile(x, q, head_dim=1), torch.tensor(want))
    assert_close(query_quantile(x, q, head_dim=-2), query_quantile(x, q, head_dim=1))


def test_query_quantile_edge_cases():
    assert query_quantile(torch.tensor([0.3])).item() == pytest.approx(0.3)  # a single query
    assert query_quantile(torch.full((4,), 0.7), 0.05).item() == pytest.approx(0.7)  # all tied
    assert query_quantile(torch.full((2, 3), math.nan)).isnan()
    x = torch.tensor([[1.0, 2.0, 3.0], [math.nan, math.nan, math.nan]])
    got = query_quantile(x, 0.5, head_dim=0)
    assert got[0].item() == 2.0 and got[1].isnan()
    x = torch.randn(3, 50, generator=gen(3), dtype=torch.float64)
    assert query_quantile(x, 0.0) == x.min() and query_quantile(x, 1.0) == x.max()
    assert query_quantile(x).dtype == torch.float64
    assert query_quantile_reference([math.nan, 2.0], 0.3) == 2.0


@pytest.mark.parametrize("call,exc,msg", [
    (lambda x: query_quantile(x, 1.01), ValueError, "q must be a number in [0, 1]"),
    (lambda x: query_quantile(x, -0.1), ValueError, "q must be a number in [0, 1]"),
    (lambda x: query_quantile(x, True), TypeError, "q must be a number"),
    (lambda x: query_quantile(x, None), TypeError, "q must be a number"),
    (lambda x: query_quantile(x, 0.05, head_dim=2), ValueError, "head_dim must be an int in [-2, 1]"),
    (lambda x: query_quantile(x, 0.05, head_dim=1.0), TypeError, "head_dim must be an int"),
    (lambda x: query_quantile(x.long()), TypeError, "x must be a floating-point tensor"),
    (lambda x: query_quantile(x[:0]), ValueError, "x must not be empty"),
])
def test_query_quantile_rejects_bad_input(call, exc, msg):
    with pytest.raises(exc) as e:
        call(torch.rand(3, 4))
    assert msg in str(e.value)


@pytest.mark.parametrize("G", [1, 3])
def test_low_quantile_mass_of_an_index_selection(G):
    "The 5th-percentile mass of a top-n selection per KV head equals the quantile of the brute-force masses."
    from sparsekv.select import top_budget_indices
    B, Hkv, Sq, Sk = 2, 2, 6, 14
    q, k, v = rand_qkv(20 + G, B, Hkv, G, Sq, Sk, 4, 4)
    idx = top_budget_indices(torch.randn(B, Hkv, Sk, generator=gen(G)), 5)
    hand = torch.zeros(B, Hkv * G, Sq, Sk, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv * G):
            hand[b, h, :, idx[b, h // G]] = True
    mass_ref = attention_fidelity_reference(q, k, v, hand, causal(B, Hkv * G, Sq, Sk))[0]
    mass = attention_mass_recall(q, k, idx)
    assert query_quantile(mass).item() == pytest.approx(query_quantile_reference(mass_ref.flatten().tolist(), 0.05),
                                                        abs=1e-6)
    assert_close(query_quantile(mass, 0.05, head_dim=1),
                 torch.tensor([query_quantile_reference(mass_ref[:, h].flatten().tolist(), 0.05)
                               for h in range(Hkv * G)]).float())
    # a selection with more entries than the sequence (every key, three times) keeps all the mass
    every = torch.arange(Sk).repeat(3).expand(B, Hkv, 3 * Sk)
    assert query_quantile(attention_mass_recall(q, k, every)).item() == pytest.approx(1.0)


def needle_rows(keep, needle, G, per_query):
    "Python sets per (batch, query head, query) of the kept and of the needle positions."
    B, Hkv = keep.shape[:2]
    Sq = keep.shape[2] if per_query else 1
    kept, need = [], []
    for b in range(B):
        for h in range(Hkv * G):
            for i in range(Sq):
                row = keep[b, h // G, i] if per_query else keep[b, h // G]
                kept.append({j for j, x in enumerate(row.tolist()) if x} if keep.dtype == torch.bool
                            else set(row.tolist()))
                nb = needle if needle.dim() == 1 else needle[b]
                need.append({j for j, x in enumerate(nb.tolist()) if x} if needle.dtype == torch.bool
                            else set(nb.tolist()))
    return kept, need


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("per_query", [True, False])
@pytest.mark.parametrize("keep_form,needle_form", [("idx", "pos"), ("mask", "pos"), ("idx", "mask"),
                                                   ("mask", "mask"), ("idx", "shared")])
def test_needle_retention_matches_sets(seed, G, per_query, keep_form, needle_form):
    B, Hkv, Sq, S, n = 2, 2, 3, 12, 5
    shape = (B, Hkv, Sq, n) if per_query else (B, Hkv, n)
    idx = torch.randint(0, S, shape, generator=gen(seed))  # repeats likely
    keep = idx if keep_form == "idx" else torch.zeros(*shape[:-1], S, dtype=torch.bool).scatter(-1, idx, True)
    pos = torch.stack([torch.randperm(S, generator=gen(seed + 10 + b))[:3] for b in range(B)])
    if needle_form == "mask":
        needle = torch.zeros(B, S, dtype=torch.bool)
        for b in range(B): needle[b, torch.randperm(S, generator=gen(seed + 20 + b))[:1 + 2 * b]] = True
    else:
        needle = pos if needle_form == "pos" else pos[0]
    got = needle_retention(keep, needle, query_heads=Hkv * G)
    assert got.shape == ((B, Hkv * G, Sq) if per_query else (B, Hkv * G))
    assert_close(got.flatten(), torch.tensor(needle_retention_reference(*needle_rows(keep, needle, G, per_query))))
    assert_close(needle_retention(keep, needle), got[:, ::G])  # without query_heads: one value per selection head


def test_needle_retention_edge_cases():
    one = torch.zeros(1, 1, 1, dtype=torch.long)
    assert needle_retention(one, [0]).item() == 1.0                                     # a single token, kept
    assert needle_retention(one[..., :0], [0]).item() == 0.0                            # nothing kept
    assert needle_retention(torch.tensor([[[True]]]), torch.tensor([True])).item() == 1.0
    keep = torch.tensor([[[0, 1, 2, 3], [3, 4, 5, 6]]])
    assert needle_retention(keep, [5, 6]).tolist() == [[0.0, 1.0]]                      # evicted -> 0, kept -> 1
    assert needle_retention(keep, [2, 3, 4, 5]).tolist() == [[0.5, 0.75]]
    assert needle_retention(keep, [3, 3, 4]).tolist() == [[0.5, 1.0]]                   # a repeat counts once
    every = torch.arange(8).repeat(4).expand(2, 3, 32)                                  # more entries than tokens
    assert (needle_retention(every, torch.tensor([[1, 7], [0, 4]])) == 1).all()
    # ties: equal scores keep the lowest positions, so a needle at the front is kept and one at the back is not
    from sparsekv.select import top_budget_indices
    tied = top_budget_indices(torch.zeros(1, 2, 10), 4)
    assert needle_retention(tied, [1, 2]).tolist() == [[1.0, 1.0]]
    assert needle_retention(tied, [8, 9]).tolist() == [[0.0, 0.0]]
    # GQA group of 1: query_heads = H changes nothing
    assert_close(needle_retention(keep, [4], query_heads=2), needle_retention(keep, [4]))


def test_needle_summary_against_loops():
    rho = needle_retention(torch.randint(0, 9, (3, 2, 4, 3), generator=gen(5)), [2, 6], query_heads=6)
    vals = rho.flatten().tolist()
    s = needle_summary(rho)
    assert s["needle_retention"] == pytest.approx(sum(vals) / len(vals))
    assert s["needle_whole"] == pytest.approx(sum(x == 1.0 for x in vals) / len(vals))
    assert 0 < s["needle_whole"] < 1
    assert needle_summary(torch.ones(2, 3)) == {"needle_retention": 1.0, "needle_whole": 1.0}
    assert needle_summary(torch.zeros(2, 3)) == {"needle_retention": 0.0, "needle_whole": 0.0}


@pytest.mark.parametrize("call,exc,msg", [
    (lambda k, n: needle_retention(k.float(), n), TypeError, "keep must be a boolean mask"),
    (lambda k, n: needle_retention(k[0], n), ValueError, "keep must be [B, H, S] or [B, H, Sq, S]"),
    (lambda k, n: needle_retention(k - 5, n), ValueError, "keep indices must be >= 0"),
    (lambda k, n: needle_retention(k, [1.5]), TypeError, "needle must be integer positions"),
    (lambda k, n: needle_retention(k, [True, False]), TypeError, "needle must be integer positions"),
    (lambda k, n: needle_retention(k, n[None].expand(3, 2)), ValueError, "with B=2, got shape (3, 2)"),
    (lambda k, n: needle_retention(k, []), ValueError, "at least one position"),
    (lambda k, n: needle_retention(k, torch.zeros(2, 8, dtype=torch.bool)), ValueError, "at least one position"),
    (lambda k, n: needle_retention(k, [-1]), ValueError, "needle positions must be >= 0"),
    (lambda k, n: needle_retention(k, torch.arange(4) < 2), ValueError, "keep positions must be in [0, 4)"),
    (lambda k, n: needle_retention(torch.ones(2, 3, 8, dtype=torch.bool), [8]), ValueError,
     "needle positions must be in [0, 8)"),
    (lambda k, n: needle_retention(torch.ones(2, 3, 8, dtype=torch.bool), torch.arange(9) < 1), ValueError,
     "must cover the same S positions"),
    (lambda k, n: needle_retention(k, n, query_heads=4), ValueError, "must be a multiple of keep's heads (3)"),
    (lambda k, n: needle_retention(k, n, query_heads=0), ValueError, "query_heads must be an int >= 1"),
    (lambda k, n: needle_summary(torch.tensor([0.5, math.nan])), ValueError, "retention must hold fractions"),
    (lambda k, n: needle_summary(torch.tensor([1, 0])), TypeError, "retention must be a floating-point tensor"),
])
def test_needle_retention_rejects_bad_input(call, exc, msg):
    keep = torch.tensor([[[0, 5, 7]] * 3] * 2)
    with pytest.raises(exc) as e:
        call(keep, torch.tensor([1, 5]))
    assert msg in str(e.value)


@pytest.mark.parametrize("G", [1, 3])
def test_relative_output_error_per_query_and_head_edge_cases(G):
    "Output error of an index selection per (batch, query head, query): loops, a single token, every key kept."
    B, Hkv, Sq, Sk = 2, 2, 4, 9
    q, k, v = rand_qkv(30 + G, B, Hkv, G, Sq, Sk, 4, 3)
    idx = torch.randint(0, Sk, (B, Hkv, Sq, 3), generator=gen(G))
    keep = torch.zeros(B, Hkv, Sq, Sk, dtype=torch.bool).scatter(-1, idx, True).repeat_interleave(G, 1)
    err = attention_fidelity(q, k, v, idx)[1]
    assert err.shape == (B, Hkv * G, Sq)
    assert_close(err, attention_fidelity_reference(q, k, v, keep, causal(B, Hkv * G, Sq, Sk))[1].float(),
                 equal_nan=True, atol=1e-5, rtol=1e-4)
    every = torch.arange(Sk).repeat(2).expand(B, Hkv, 2 * Sk)  # more entries than keys: all kept, no error
    assert_close(attention_fidelity(q, k, v, every)[1], torch.zeros(B, Hkv * G, Sq), atol=1e-6, rtol=0)
    q1, k1, v1 = rand_qkv(40 + G, 1, 1, G, 1, 1, 4, 4)  # a single token: its own key is all of attention
    assert_close(attention_fidelity(q1, k1, v1, torch.zeros(1, 1, 1, dtype=torch.long))[1], torch.zeros(1, G, 1))


# --- pass@k ---------------------------------------------------------------------------

def test_pass_at_k_equals_subset_enumeration():
    for n in range(1, 10):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = pass_at_k_reference([True] * c + [False] * (n - c), k)
                assert pass_at_k_estimate(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_over_problems_and_avg_at_k():
    rng = np.random.default_rng(1)
    correct = rng.random((20, 7)) < rng.random((20, 1))
    for k in (1, 3, 7):
        assert pass_at_k(correct, k) == pytest.approx(np.mean([pass_at_k_reference(r, k) for r in correct]))
    assert avg_at_k(correct) == pytest.approx(correct.sum() / correct.size)
    assert pass_at_k(torch.from_numpy(correct), 2) == pytest.approx(pass_at_k(correct.astype(int), 2))
    ks = [pass_at_k(correct, k) for k in range(1, 8)]
    assert all(a <= b + 1e-12 for a, b in zip(ks, ks[1:]))  # pass@k grows with k


def test_pass_at_k_rejects_bad_input():
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 3\]"):
        pass_at_k([[True, False, True]], 4)
    with pytest.raises(ValueError, match="2-D"):
        avg_at_k([True, False])
    with pytest.raises(TypeError, match="booleans"):
        avg_at_k([[2, 0]])
    with pytest.raises(TypeError, match="n must be an int"):
        pass_at_k_estimate(4.0, 1, 1)


# --- grid runner ----------------------------------------------------------------------

def metrics_of(cell):
    return {"acc": cell["budget"] / 1000, "kl": torch.tensor(cell["budget"] / 7, dtype=torch.float64), "n": np.int64(3)}


def grid_cells():
    return [{"method": m, "budget": b, "task": t}
            for m in ("dense", "streaming", "kvpop") for b in (256, 512) for t in ("niah", "vt")]


def test_grid_resumes_after_interruption(tmp_path):
    path = tmp_path / "runs" / "grid.csv"
    cells, calls = grid_cells(), []

    def failing(cell):
        calls.append(cell)
        if len(calls) == 3: raise RuntimeError("killed at the third cell")
        return metrics_of(cell)

    with pytest.raises(RuntimeError, match="third cell"):
        run_grid(cells, failing, path, desc="test grid")
    partial = pd.read_csv(path)
    assert partial[["method", "budget", "task"]].to_dict("records") == cells[:2]

    calls.clear()
    df = run_grid(cells, lambda c: (calls.append(c), metrics_of(c))[1], path, desc="test grid")
    assert calls == cells[2:]
    assert df[["method", "budget", "task"]].to_dict("records") == cells
    assert list(df.columns) == ["method", "budget", "task", "acc", "kl", "n", "wall_s"]
    assert df["kl"].tolist() == [c["budget"] / 7 for c in cells]  # floats round-trip exactly
    assert (df["wall_s"] >= 0).all()
    assert sorted(p.name for p in path.parent.iterdir()) == ["grid.csv"]  # no temporary file left

    calls.clear()
    run_grid(list(reversed(cells)), lambda c: (calls.append(c), metrics_of(c))[1], path)
    assert calls == []


@pytest.mark.parametrize("limit,done", [(0, 0), (2.5, 3), (100, 12)])
def test_grid_time_limit_stops_between_cells(tmp_path, monkeypatch, limit, done):
    "Each cell takes one second of a fake clock: no cell starts once `limit` seconds have passed; a rerun resumes."
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def one_second(cell):
        now[0] += 1
        return metrics_of(cell)

    cells, calls = grid_cells(), []
    run_grid(cells[:1], metrics_of, tmp_path / "g.csv")                      # one cell in the file already
    part = run_grid(cells, counting(calls, one_second), tmp_path / "g.csv", time_limit=limit)
    want = cells[1:][:done] if done < 12 else cells[1:]
    assert calls == want and part.attrs["pending"] == len(cells) - 1 - len(want)
    assert part[["method", "budget", "task"]].to_dict("records") == cells[:1 + len(want)]
    rest = run_grid(cells, counting(calls), tmp_path / "g.csv")
    assert calls == cells[1:] and rest.attrs["pending"] == 0 and len(rest) == len(cells)


def test_grid_time_limit_before_any_cell_gives_an_empty_frame(tmp_path):
    got = run_grid(grid_cells(), metrics_of, tmp_path / "g.csv", time_limit=0)
    assert got.empty and list(got.columns) == ["method", "budget", "task"] and got.attrs["pending"] == 12
    assert not (tmp_path / "g.csv").exists()


@pytest.mark.parametrize("limit", [-1, True, "60", float("nan")])
def test_grid_time_limit_rejects_bad_values(tmp_path, limit):
    with pytest.raises(ValueError, match="time_limit must be a number of seconds"):
        run_grid(grid_cells(), metrics_of, tmp_path / "g.csv", time_limit=limit)


def test_grid_matches_mixed_types_and_keeps_foreign_rows(tmp_path):
    path = tmp_path / "g.csv"
    cells = [{"method": "oval", "eta": 0.1, "rank": 8, "quant": None, "flag": True, "note": 'a, "quoted" note'},
             {"method": "oval", "eta": np.float64(1 / 3), "rank": np.int64(4), "quant": "bf16", "flag": False,
              "note": ""},
             {"method": "quest", "eta": 0.5}]
    run_grid(cells, lambda c: {"mass": 0.5}, path)
    calls = []
    run_grid(cells, lambda c: (calls.append(c), {"mass": 0.5})[1], path)
    assert calls == []
    # a cell that differs only in a key the others lack is a new cell; rows of other grids are kept
    more = [{"method": "quest", "eta": 0.5, "rank": 2}]
    run_grid(more, lambda c: (calls.append(c), {"mass": 0.25})[1], path)
    assert calls == more
    df = pd.read_csv(path)
    assert len(df) == 4
    assert df.loc[0, "note"] == 'a, "quoted" note' and df.loc[1, "eta"] == 1 / 3
    run_grid(cells + more, lambda c: pytest.fail("nothing to compute"), path)


def test_grid_new_metric_columns_are_added(tmp_path):
    path = tmp_path / "g.csv"
    run_grid([{"x": 1}], lambda c: {"a": 1.0}, path)
    df = run_grid([{"x": 1}, {"x": 2}], lambda c: {"a": 2.0, "b": 3.0}, path)
    assert list(df.columns) == ["x", "a", "wall_s", "b"]
    assert df["b"].isna().tolist() == [True, False]


def test_grid_shows_progress(tmp_path, capsys):
    run_grid([{"x": i} for i in range(3)], lambda c: {"y": c["x"]}, tmp_path / "g.csv", desc="my grid")
    err = capsys.readouterr().err
    assert "my grid" in err and "3/3" in err


@pytest.mark.parametrize("cells,fn,msg", [
    ([], metrics_of, "cells is empty"),
    ([{"budget": 1}, {"budget": 1}], metrics_of, "same cell twice"),
    ([{"budget": 1}], lambda c: {"budget": 2}, "repeat a cell key"),
    ([{"budget": 1}], lambda c: {"wall_s": 2}, "repeat a cell key"),
    ([{"budget": 1}], lambda c: [1.0], "must return a dict"),
    ([{"budget": [1, 2]}], metrics_of, "must be a str, int, float, bool, None"),
    ([{"budget": 1}], lambda c: {"m": torch.ones(2)}, "must be a scalar"),
    ([("budget", 1)], metrics_of, "each cell must be a dict"),
    ([{"wall_s": 1}], metrics_of, "cell keys must be strings"),
])
def test_grid_rejects_bad_input(tmp_path, cells, fn, msg):
    with pytest.raises((ValueError, TypeError)) as e:
        run_grid(cells, fn, tmp_path / "g.csv")
    assert msg in str(e.value)


# --- grid runner: every setting is a key, damaged files are recomputed ----------------

def counting(calls, fn=metrics_of):
    return lambda c: (calls.append(dict(c)), fn(c))[1]


def test_grid_params_are_part_of_the_key(tmp_path):
    "Changing a run-level setting (window 4 -> 8) recomputes every cell; each call returns only its own rows."
    path, cells, calls = tmp_path / "g.csv", grid_cells()[:4], []
    a = run_grid(cells, counting(calls), path, params={"model": "tiny", "window": 4, "lr": 1e-3})
    b = run_grid(cells, counting(calls), path, params={"model": "tiny", "window": 8, "lr": 1e-3})
    assert calls == cells + cells
    assert len(a) == len(b) == 4 and set(a.window) == {4} and set(b.window) == {8}
    assert list(a.columns[:3]) == ["model", "window", "lr"]
    calls.clear()
    again = run_grid(cells, counting(calls), path, params={"model": "tiny", "window": 4, "lr": 1e-3})
    assert calls == [] and again.equals(a)
    run_grid(cells, counting(calls), path, params={"model": "tiny", "window": 4, "lr": 2e-3})
    assert calls == cells
    with pytest.raises(ValueError, match=r"both set \['budget'\]"):
        run_grid(cells, metrics_of, path, params={"budget": 1})
    with pytest.raises(ValueError, match="params keys"): run_grid(cells, metrics_of, path, params={"row_check": 1})
    with pytest.raises(TypeError, match="must be a str, int"):
        run_grid(cells, metrics_of, path, params={"budgets": [1, 2]})


def test_grid_row_of_other_keys_is_not_reused(tmp_path):
    "A row written for cell {x: 1, y: 2} does not answer cell {x: 1} (it was made with another setting y)."
    path, calls = tmp_path / "g.csv", []
    run_grid([{"x": 1, "y": 2}], lambda c: {"m": 2.0}, path)
    with pytest.warns(UserWarning, match="made for other key columns"):
        df = run_grid([{"x": 1}], counting(calls, lambda c: {"m": 1.0}), path)
    assert calls == [{"x": 1}] and df.m.tolist() == [1.0] and list(df.columns) == ["x", "m", "wall_s"]


def _damage(path, how):
    lines = path.read_text().splitlines()
    if how == "cut short": lines[2] = lines[2].rsplit(",", 3)[0]
    elif how == "cut in the last field": lines[2] = lines[2][:-3]
    elif how == "extra field": lines[2] += ",surplus"
    elif how == "key 1 -> 1.0": lines[2] = lines[2].replace(",256,", ",256.0,", 1)
    elif how == "metric edited": lines[2] = lines[2].replace(",0.256,", ",0.9,", 1)
    elif how == "empty wall_s":
        fields = lines[2].split(",")
        fields[-2] = ""
        lines[2] = ",".join(fields)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("how", ["cut short", "cut in the last field", "extra field", "key 1 -> 1.0", "metric edited",
                                 "empty wall_s"])
def test_grid_damaged_row_is_recomputed(tmp_path, how):
    "A damaged row counts as not done: its cell (only) is computed again, and every cell comes back once, complete."
    path, cells, calls = tmp_path / "g.csv", grid_cells(), []
    run_grid(cells, metrics_of, path)
    _damage(path, how)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        df = run_grid(cells, counting(calls), path)
    # a rewritten key names no cell of the grid
    if how != "key 1 -> 1.0": assert "damaged results" in str(seen[0].message)
    assert calls == [cells[1]]
    assert df[["method", "budget", "task"]].to_dict("records") == cells
    assert not df.isna().any().any() and df["acc"].tolist() == [c["budget"] / 1000 for c in cells]
    calls.clear()
    df2 = run_grid(cells, counting(calls), path)
    assert calls == [] and df2.equals(df)


def test_grid_lost_header_or_unreadable_file_names_the_path(tmp_path):
    path, cells = tmp_path / "g.csv", grid_cells()[:3]
    run_grid(cells, metrics_of, path)
    path.write_text("\n".join(path.read_text().splitlines()[1:]) + "\n")
    with pytest.raises(ValueError, match=f"{path} has no valid header line"): run_grid(cells, metrics_of, path)
    path.write_bytes(b"\xff\xfe\x00garbage\x00\x81")
    with pytest.raises(ValueError, match=f"cannot read the grid results file {path}"): run_grid(cells, metrics_of, path)
    path.write_text("")  # an empty file holds no results
    assert len(run_grid(cells, metrics_of, path)) == 3


def test_grid_file_without_row_check_is_recomputed_once(tmp_path):
    "Rows of an older file (no row_check column) are kept but computed again, once."
    path, cells, calls = tmp_path / "g.csv", grid_cells()[:2], []
    pd.DataFrame([{**c, "acc": 0.0, "wall_s": 0.1} for c in cells]).to_csv(path, index=False)
    with pytest.warns(UserWarning, match="row_check"):
        df = run_grid(cells, counting(calls), path)
    assert calls == cells and df.acc.tolist() == [c["budget"] / 1000 for c in cells] and len(pd.read_csv(path)) == 4
    calls.clear()
    run_grid(cells, counting(calls), path)
    assert calls == []


def test_kl_refuses_nan_and_inf_logits():
    "NaN or +inf logits would give a NaN KL: refused, naming the tensor; -inf (a masked token) stays allowed."
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    with pytest.raises(ValueError, match="student_logits contains NaN"):
        kl_to_teacher(s.index_fill(-1, torch.tensor([2]), math.nan), t)
    with pytest.raises(ValueError, match="teacher_logits contains NaN or \\+inf"):
        kl_to_teacher(s, t.index_fill(-1, torch.tensor([0]), math.inf))
    assert torch.isfinite(kl_to_teacher(s, t.index_fill(-1, torch.tensor([0]), -math.inf)))
