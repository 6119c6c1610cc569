"""The KVpop sparse mask: the definition with loops, budget per row, permanent eviction, FlexAttention and the sparse
LSE."""
import itertools
import math
import random

import pytest
import torch
from torch.testing import assert_close

from sparsekv.attention import attention_reference, masked_attention
from sparsekv.kvpop.cutoff import topk_cutoff
from sparsekv.kvpop.mask import kvpop_attention, kvpop_block_mask, kvpop_mask, kvpop_mask_mod, kvpop_mask_reference


def random_priority(B, H, S, ties, gen):
    if ties: return torch.randint(0, 3, (B, H, S), generator=gen).float()
    return torch.randn(B, H, S, generator=gen)


def configs():
    "(S, k, sink, window) with S in 1..300, including S < s + w + k."
    rnd = random.Random(3)
    fixed = [(1, 1, 0, 1), (2, 1, 1, 1), (4, 9, 2, 3), (12, 1, 0, 1), (300, 30, 4, 64)]
    return fixed + [(S, rnd.randint(1, 20), rnd.randint(0, 4), rnd.randint(1, 16))
                    for S in rnd.sample(range(3, 200), 6)]


def row_budget(S, k, sink, window):
    "min(q + 1, s + w + min(k, |E(q)|))."
    return torch.tensor([min(q + 1, sink + window + min(k, max(0, q - window - sink + 1))) for q in range(S)])


@pytest.mark.parametrize("S,k,sink,window", configs())
@pytest.mark.parametrize("ties", [False, True])
def test_mask_definition_budget_and_permanence(S, k, sink, window, ties):
    gen = torch.Generator().manual_seed(S + 7 * k)
    p = random_priority(1, 2, S, ties, gen)
    rank, cutoff = topk_cutoff(p, k, sink, window)
    mask = kvpop_mask(rank, cutoff, sink, window)
    assert mask.dtype == torch.bool and mask.shape == (1, 2, S, S)
    assert torch.equal(mask, kvpop_mask_reference(p, k, sink, window))
    assert torch.equal(mask.sum(-1), row_budget(S, k, sink, window).expand(1, 2, S))
    if S >= sink + window + k: assert (mask[..., sink + window + k - 1:, :].sum(-1) == sink + window + k).all()
    # eviction is permanent: along a column, from the first query that sees t as eligible, kept is a prefix
    for t in range(sink, S):
        kept = mask[..., t + window:, t]
        assert not (kept[..., 1:] & ~kept[..., :-1]).any()
    assert not mask.triu(1).any()  # causal


@pytest.mark.parametrize("G", [1, 3, 4])
def test_mask_mod_equals_dense(G):
    gen = torch.Generator().manual_seed(G)
    B, Hkv, S, k, sink, window = 2, 2, 45, 4, 3, 5
    rank, cutoff = topk_cutoff(random_priority(B, Hkv, S, True, gen), k, sink, window)
    dense = kvpop_mask(rank, cutoff, sink, window, groups=G)
    assert dense.shape == (B, Hkv * G, S, S)
    b, h, q, kv = torch.meshgrid(torch.arange(B), torch.arange(Hkv * G), torch.arange(S), torch.arange(S),
                                 indexing="ij")
    assert torch.equal(kvpop_mask_mod(rank, cutoff, sink, window, G)(b, h, q, kv), dense)
    per_kv = kvpop_mask(rank, cutoff, sink, window)
    for hq in range(Hkv * G): assert torch.equal(dense[:, hq], per_kv[:, hq // G])
    bm = kvpop_block_mask(rank, cutoff, sink, window, G)
    assert bm.shape[-2:] == (S, S)


def lse_loops(q, k, mask, G):
    "Eq. (9) by loops in float64."
    B, Hq, S, D = q.shape
    out = torch.empty(B, Hq, S, dtype=torch.float64)
    for b, h, d in itertools.product(range(B), range(Hq), range(S)):
        x = [float(q[b, h, d].double() @ k[b, h // G, t].double()) / math.sqrt(D) for t in range(S) if mask[b, h, d, t]]
        m = max(x)
        out[b, h, d] = m + math.log(sum(math.exp(v - m) for v in x))
    return out


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("S", [1, 7, 50])
def test_sparse_attention_and_lse(G, S):
    gen = torch.Generator().manual_seed(10 * G + S)
    B, Hkv, D, k, sink, window = 1, 2, 8, 4, 2, 3
    q, kk, v = (torch.randn(B, h, S, D, generator=gen) for h in (Hkv * G, Hkv, Hkv))
    rank, cutoff = topk_cutoff(random_priority(B, Hkv, S, True, gen), k, sink, window)
    mask = kvpop_mask(rank, cutoff, sink, window, G)
    want_out, want_lse = attention_reference(q, kk, v, mask)
    assert_close(want_lse.double(), lse_loops(q, kk, mask, G), rtol=1e-5, atol=1e-5)
    for backend in ("auto", "sdpa", "reference", "flex"):
        out, lse = kvpop_attention(q, kk, v, rank, cutoff, sink, window, backend=backend)
        assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    out, lse = masked_attention(q, kk, v, mask)
    assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_gradients_through_dense_path():
    gen = torch.Generator().manual_seed(0)
    B, Hkv, G, S, D = 1, 1, 3, 30, 8
    leaves = [torch.randn(B, h, S, D, generator=gen).requires_grad_() for h in (Hkv * G, Hkv, Hkv)]
    rank, cutoff = topk_cutoff(torch.randn(B, Hkv, S, generator=gen), 3, 1, 4)
    out, lse = kvpop_attention(*leaves, rank, cutoff, 1, 4)
    (out.square().sum() + lse.sum()).backward()
    got = [x.grad.clone() for x in leaves]
    for x in leaves: x.grad = None
    out, lse = attention_reference(*leaves, kvpop_mask(rank, cutoff, 1, 4, G))
    (out.square().sum() + lse.sum()).backward()
    for g, x in zip(got, leaves): assert_close(g, x.grad, rtol=1e-4, atol=1e-5)


def test_validation():
    rank, cutoff = topk_cutoff(torch.randn(1, 2, 10), 2, 1, 2)
    q, k = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    with pytest.raises(TypeError, match="int64"): kvpop_mask(rank.float(), cutoff, 1, 2)
    with pytest.raises(ValueError, match="one shape"): kvpop_mask(rank, cutoff[..., :5], 1, 2)
    with pytest.raises(ValueError, match="sink must be"): kvpop_mask(rank, cutoff, -1, 2)
    with pytest.raises(ValueError, match="window must be"): kvpop_mask_mod(rank, cutoff, 1, 0)
    with pytest.raises(ValueError, match="groups must be"): kvpop_block_mask(rank, cutoff, 1, 2, groups=0)
    with pytest.raises(ValueError, match="must be \\[B, Hkv, S\\]"):
        kvpop_attention(q, k, k, rank[:, :1], cutoff[:, :1], 1, 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        kvpop_attention(q, k, k, rank, cutoff, 1, 2, backend="x")


def test_ranks_for_another_sink_or_window_refused():
    "Ranks and cutoffs built for another sink or window, or negative ranks, are refused rather than masking wrongly."
    p = torch.randn(2, 2, 40, generator=torch.Generator().manual_seed(3))
    rank, cutoff = topk_cutoff(p, 4, 2, 3)
    assert torch.equal(kvpop_mask(rank, cutoff, 2, 3), kvpop_mask_reference(p, 4, 2, 3))
    with pytest.raises(ValueError, match="negative"):
        kvpop_mask(rank.index_fill(2, torch.tensor([7]), -2), cutoff, 2, 3)
    for s in (0, 1, 3, 5):
        with pytest.raises(ValueError, match="another sink"): kvpop_mask(rank, cutoff, s, 3)
        with pytest.raises(ValueError, match="another sink"): kvpop_mask_mod(rank, cutoff, s, 3)
    for w in (1, 2, 4, 5, 8):
        with pytest.raises(ValueError, match="window"): kvpop_mask(rank, cutoff, 2, w)
    with pytest.raises(ValueError, match="window=3"): kvpop_mask_mod(*topk_cutoff(p, 1, 2, 1), 2, 3)
    with pytest.raises(ValueError, match="cutoff must be in"): kvpop_mask(rank, cutoff.clamp(max=5), 2, 3)
