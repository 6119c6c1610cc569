"Tests of sparsekv.kvpop.target: every method against the dense reference and the loop reference, on random inputs."
import math

import pytest
import torch
from torch.testing import assert_close

from sparsekv.attention import attention_scores, causal_mask, masked_logsumexp
from sparsekv.kvpop.target import (
    AGGS,
    aggregate_target,
    bench_target,
    causal_lse,
    future_attention_target,
    future_attention_target_reference,
    future_count,
    peak_memory,
)

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(G, S, Hkv=2, B=2, D=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, S, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    lse = causal_lse(q, k) + 2 * torch.rand(B, Hkv * G, S, generator=gen)  # a normalizer other than the dense one
    return q.to(dtype), k.to(dtype), lse


# (G, S, window): GQA G = 1, 3, 4; S from 1 to 300, below, at and above the window
CASES = [(1, 1, 1), (3, 1, 4), (4, 2, 1), (3, 5, 8), (1, 64, 64), (4, 65, 64), (3, 129, 16), (1, 300, 1),
         (3, 300, 37), (4, 200, 300)]


@pytest.mark.parametrize("G,S,window", CASES)
@pytest.mark.parametrize("method", ["chunked", "flex"])
def test_methods_equal_dense(G, S, window, method):
    q, k, given = _inputs(G, S, seed=S + G)
    options = (("max", True), ("mean", False), ("max", False), ("mean", True))
    for lse in (None, given):
        for agg, normalize in options[:2 if lse is None else 4]:
            want = future_attention_target(q, k, window, lse, agg, normalize=normalize, method="dense")
            got = future_attention_target(q, k, window, lse, agg, normalize=normalize, method=method, block=32)
            assert got.shape == (q.shape[0], k.shape[1], S) and got.dtype == torch.float32
            assert_close(got, want, **TOL)


@pytest.mark.parametrize("G,S,window", [(1, 1, 1), (3, 9, 2), (4, 12, 5), (3, 6, 6), (1, 17, 16)])
def test_dense_equals_loop_reference(G, S, window):
    q, k, given = _inputs(G, S, Hkv=1, B=1, D=8, seed=G * S)
    for lse, eps in ((None, 1e-6), (given, 0.01)):
        for agg in AGGS:
            for normalize in (True, False):
                want = future_attention_target_reference(q, k, window, lse, agg, eps, normalize)
                for method in ("dense", "chunked", "flex"):
                    got = future_attention_target(q, k, window, lse, agg, eps, normalize, method=method, block=3)
                    assert_close(got.double(), want, **TOL)


def test_chunked_block_does_not_change_the_result():
    q, k, lse = _inputs(3, 61, seed=1)
    for given in (None, lse):
        want = future_attention_target(q, k, 10, given, method="chunked", block=61)
        for block in (1, 2, 7, 32, 50, 51, 1000):  # S - window = 51 keys have a future query
            got = future_attention_target(q, k, 10, given, method="chunked", block=block)
            assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["dense", "chunked", "flex"])
def test_tokens_without_future_query_get_log_eps(method):
    S, window = 40, 9
    q, k, lse = _inputs(3, S, seed=2)
    for eps in (1e-6, 1e-3):
        for agg in AGGS:
            r = future_attention_target(q, k, window, lse, agg, eps, method=method)
            none = torch.arange(S) > S - 1 - window  # t + w > S - 1: no query d >= t + w
            assert (r[..., none] == math.log(eps)).all()
            assert (r[..., ~none] > math.log(eps)).all()
    short = future_attention_target(q[:, :, :9], k[:, :, :9], window, method=method)  # S <= window
    assert (short == math.log(1e-6)).all()


def test_mass_sums_to_the_off_diagonal_mass():
    # w = 1, no normalization: sum_t m_bar_t counts every probability with d > t, i.e. sum_d (1 - p_{d->d})
    q, k, _ = _inputs(1, 30, Hkv=1, B=1, seed=3, dtype=torch.float64)
    p = torch.softmax(attention_scores(q, k), -1)
    for method in ("dense", "chunked", "flex"):
        r = future_attention_target(q, k, 1, eps=1e-300, normalize=False, method=method)
        assert_close(r.exp().sum(), (1 - p[0, 0].diagonal()).sum())


def test_dense_lse_is_the_default():
    q, k, _ = _inputs(3, 50, seed=4)
    lse = masked_logsumexp(attention_scores(q, k, causal_mask(50, 50)))
    for method in ("dense", "chunked", "flex"):
        assert_close(future_attention_target(q, k, 7, None, method=method),
                     future_attention_target(q, k, 7, lse, method=method))


def test_auto_dtypes_and_no_gradient():
    q, k, lse = _inputs(3, 40, seed=5)
    want = future_attention_target(q, k, 5, lse, method="chunked")
    assert_close(future_attention_target(q, k, 5, lse), want)  # auto = chunked on CPU
    r = future_attention_target(q.requires_grad_(), k.requires_grad_(), 5, lse, method="flex")
    assert not r.requires_grad
    assert future_attention_target(q.bfloat16(), k.bfloat16(), 5, method="chunked").dtype == torch.float32
    r64 = future_attention_target(q.double(), k.double(), 5, lse.double(), method="chunked")
    assert r64.dtype == torch.float64
    assert_close(r64.float(), want, **TOL)


def test_aggregate_and_count():
    x = torch.log(torch.rand(2, 6, 11, dtype=torch.float64))
    x[0, :3, 4] = -math.inf
    assert_close(aggregate_target(x, 3, "max", 1e-4), torch.log(1e-4 + x.exp().view(2, 2, 3, 11).amax(2)))
    assert_close(aggregate_target(x, 3, "mean", 1e-4), torch.log(1e-4 + x.exp().view(2, 2, 3, 11).mean(2)))
    assert (aggregate_target(x, 3, "mean", 1e-4)[0, 0, 4] == math.log(1e-4)).item()
    S, w = 12, 5
    assert future_count(S, w).tolist() == [max(1, S - (t + w)) for t in range(S)]
    assert future_count(S, w, normalize=False).tolist() == [1] * S


@pytest.mark.parametrize("kwargs,message", [
    (dict(window=0), "window must be an int >= 1"), (dict(window=True), "window must be an int >= 1"),
    (dict(agg="median"), "agg must be one of"), (dict(eps=-1.0), "eps must be"), (dict(eps=math.inf), "eps must be"),
    (dict(method="sdpa"), "method must be one of"), (dict(block=0), "block must be"),
    (dict(normalize="yes"), "normalize must be a bool"), (dict(lse=torch.zeros(1, 6)), "lse must have shape"),
    (dict(lse=torch.full((1, 6, 10), math.nan)), "lse must be finite"),
])
def test_bad_arguments(kwargs, message):
    q, k = torch.randn(1, 6, 10, 8), torch.randn(1, 2, 10, 8)
    args = dict(window=3) | kwargs
    with pytest.raises((ValueError, TypeError), match=message): future_attention_target(q, k, **args)


def test_bad_layouts():
    q, k = torch.randn(1, 6, 10, 8), torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="same length S"): future_attention_target(q, k[:, :, :8], 3)
    with pytest.raises(ValueError, match="multiple of the KV heads"): future_attention_target(q[:, :5], k, 3)
    with pytest.raises(TypeError, match="floating-point"):
        future_attention_target(q, k, 3, lse=torch.zeros(1, 6, 10, dtype=torch.long))


def test_peak_memory_counts_new_storage_only():
    x = torch.randn(256, 256)
    _, peak = peak_memory(lambda: (x.exp(), x[:3], x.mul_(1.0)))
    assert peak == x.nbytes  # exp allocates; the view and the in-place result do not


def test_chunked_needs_a_fraction_of_dense_memory():
    r = bench_target(S=1024, Hkv=1, G=2, D=16, window=16, block=64)
    assert r["chunked_peak_ratio"] <= 1 / 8
    assert r["chunked_max_abs_diff"] < 1e-4


@pytest.mark.gpu
def test_flex_compiled_on_cuda_equals_dense():
    for G, S, w in [(1, 1, 1), (3, 200, 16), (4, 513, 64), (3, 1000, 1)]:
        q, k, lse = _inputs(G, S, D=64, seed=S)
        q, k, lse = q.cuda(), k.cuda(), lse.cuda()
        for given in (None, lse):
            for agg in AGGS:
                want = future_attention_target(q, k, w, given, agg, method="dense")
                assert_close(future_attention_target(q, k, w, given, agg), want, rtol=1e-4, atol=1e-4)  # auto = flex
                assert_close(future_attention_target(q, k, w, given, agg, method="chunked"), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["dense", "chunked"])
def test_non_finite_input_refused(method):
    "A NaN in q or an inf in k would give NaN targets: refused, naming the tensor (check_finite=False skips it)."
    q, k = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8)
    bad_q, bad_k = q.index_fill(2, torch.tensor([3]), math.nan), k.index_fill(2, torch.tensor([0]), math.inf)
    with pytest.raises(ValueError, match="q contains NaN or inf"): future_attention_target(bad_q, k, 2, method=method)
    with pytest.raises(ValueError, match="k contains NaN or inf"): future_attention_target(q, bad_k, 2, method=method)
    assert future_attention_target(q, bad_k, 2, method=method, check_finite=False).isnan().any()
