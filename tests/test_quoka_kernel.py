"""The fused key-scoring kernel (`sparsekv.quoka.kernel`) against its brute-force reference and QuoKA's loop reference,
on random caches and edge cases (here under Triton's interpreter, which `conftest.py` turns on without a GPU), and the
QuoKA policy with `backend='triton'` against `backend='torch'` in a patched model."""
import pytest
import torch
from torch.testing import assert_close

from sparsekv import methods
from sparsekv.hf import chunked_prefill, patch
from sparsekv.quoka.kernel import key_scores, key_scores_reference
from sparsekv.quoka.policy import QuokaPolicy
from sparsekv.quoka.select import (
    BACKENDS,
    GQA_AGGS,
    QUERY_AGGS,
    QUERY_SELECT,
    quoka_scores,
    quoka_scores_reference,
    quoka_select,
    quoka_select_reference,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # one tolerance: the reference reads the same rounded keys


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_reference_on_random_caches(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    B, Hkv, groups, n, T, D = draw(1, 2), draw(1, 3), draw(1, 4), draw(1, 9), draw(0, 150), draw(1, 40)
    rows = torch.randn(B, Hkv, groups * n, D, generator=g)
    k = (torch.randn(B, Hkv, T, D, generator=g) * torch.rand(B, Hkv, T, 1, generator=g) * 4).to(dtype)
    if T: k[-1, -1, T // 2] = 0.0  # a zero key scores 0
    for agg in QUERY_AGGS:
        got = key_scores(rows, k, groups, agg, block_t=[16, 32, 64, 128][seed])
        assert got.shape == (B, Hkv, T) and got.dtype == torch.float32
        assert_close(got, key_scores_reference(rows, k, groups, agg).float(), atol=1e-5, rtol=1e-5)
        if T: assert got[-1, -1, T // 2] == 0


def test_kernel_on_strided_and_offset_views():
    "A preallocated cache (a slice of a larger buffer), keys with the head dim not last in memory, strided rows."
    g = torch.Generator().manual_seed(7)
    buf = torch.randn(2, 3, 90, 24, generator=g)
    k = buf.mT.contiguous().mT[:, :, 11:80]
    rows = torch.randn(2, 3, 24, 10, generator=g).mT[:, :, ::2]       # 5 rows, every other one of a buffer
    assert not (k.is_contiguous() or rows.is_contiguous())
    assert_close(key_scores(rows, k, 1, "max"), key_scores_reference(rows, k).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(k=torch.randn(1, 2, 9, 8).double()), "k must be a float16, bfloat16 or float32 cache"),
    (dict(k=torch.randn(2, 9, 8)), "k must be a float16, bfloat16 or float32 cache"),
    (dict(rows=torch.randn(1, 1, 4, 8)), r"rows must be float \[B, Hkv, R, D\] = \[1, 2, R, 8\]"),
    (dict(rows=torch.randn(1, 2, 4, 6)), "rows must be float"),
    (dict(rows=torch.ones(1, 2, 4, 8, dtype=torch.long)), "rows must be float"),
    (dict(groups=3), "multiple of groups=3"),
    (dict(groups=0), "groups must be"),
    (dict(query_agg="sum"), "query_agg must be one of"),
    (dict(block_t=8), "block_t must be"),
])
def test_kernel_rejects_bad_input(bad, match):
    args = dict(rows=torch.randn(1, 2, 4, 8), k=torch.randn(1, 2, 9, 8), groups=2, query_agg="max") | bad
    with pytest.raises(ValueError, match=match): key_scores(**args)


@pytest.mark.parametrize("gqa_agg", GQA_AGGS)
@pytest.mark.parametrize("query_agg", QUERY_AGGS)
@pytest.mark.parametrize("query_select", QUERY_SELECT)
def test_quoka_scores_with_the_kernel(query_select, query_agg, gqa_agg):
    "QuoKA's scores by the kernel against its loop reference (float64, no pre-aggregation), prefill chunk and decode."
    g = torch.Generator().manual_seed(11)
    for G, S, n_q, T in ((1, 12, 4, 50), (3, 12, 5, 77), (4, 1, 16, 40)):
        q = torch.randn(2, 2 * G, S, 16, generator=g) + 0.3
        k = torch.randn(2, 2, T, 16, generator=g)
        want = quoka_scores_reference(q, k, n_q, query_select, query_agg, gqa_agg=gqa_agg)
        got = quoka_scores(q, k, n_q, query_select, query_agg, gqa_agg=gqa_agg, backend="triton")
        assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
        idx = quoka_select(q, k, n_q, 9, query_select, query_agg, gqa_agg=gqa_agg, backend="triton")
        ref = quoka_select_reference(q, k, n_q, 9, query_select, query_agg, gqa_agg=gqa_agg)
        # kept keys score as the reference's up to rounding (keys within it of each other at the cut may trade places)
        assert_close(want.gather(-1, idx).sort(-1).values, want.gather(-1, ref).sort(-1).values, atol=1e-5, rtol=0)


def test_policy_with_the_kernel_generates_as_eager(tiny_llama):
    "Chunked prefill, then greedy decode, with backend='triton': the eager backend's logits and tokens."
    ids = torch.randint(3, 250, (1, 45), generator=torch.Generator().manual_seed(5))
    runs = {}
    for backend in BACKENDS:
        pol = QuokaPolicy(n_q=2, budget=12, backend=backend)
        with torch.no_grad():
            cache, last = chunked_prefill(tiny_llama, ids[:, :-1], 8, pol)   # chunks 3-6 select 12 of 16-40 keys
            with patch(tiny_llama, pol):
                out = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                          max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                                          return_dict_in_generate=True)
        runs[backend] = last, out
    (last_t, out_t), (last_e, out_e) = runs["triton"], runs["torch"]
    assert_close(last_t, last_e, atol=1e-4, rtol=1e-4)
    assert torch.equal(out_t.sequences, out_e.sequences)
    assert_close(torch.stack(out_t.logits), torch.stack(out_e.logits), atol=1e-4, rtol=1e-4)


def test_quoka_method_takes_the_backend():
    m = methods.make("quoka", budget=64, backend="triton")
    assert m.policy().backend == "triton" and "backend='triton'" in repr(m.policy())
    assert methods.make("quoka", budget=64).policy().backend == "torch"
    assert not QuokaPolicy(backend="triton").unit_caches  # no unit keys kept by the kernel's policy
    with pytest.raises(ValueError, match="backend must be one of"): methods.make("quoka", budget=64, backend="cuda")
