"""Every attention backend against `attention_reference`: GQA, odd lengths, decode-like queries, fully masked rows,
dtypes, gradients."""
import math

import pytest
import torch
import torch.nn.functional as F

import sparsekv.attention as A
from sparsekv.attention import (
    BACKENDS,
    attention_chunked,
    attention_reference,
    attention_scores,
    bias_score_mod,
    block_mask_from_bool,
    causal_block_mask,
    causal_mask,
    check_mask,
    check_qkv,
    flex_attention_lse,
    masked_attention,
    masked_logsumexp,
    merge_attention,
    repeat_kv,
)

LENGTHS = [(1, 1), (33, 33), (130, 130), (1, 130), (7, 33), (33, 7)]  # (Sq, Sk); Sq > Sk has empty rows
MASKS = ["causal", "random", "shared", "padding"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_qkv(G, Sq, Sk, B=2, Hkv=2, D=16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, Sq, D, generator=g)
    k, v = torch.randn(B, Hkv, Sk, D, generator=g), torch.randn(B, Hkv, Sk, D, generator=g)
    return q.to(device), k.to(device), v.to(device)


def make_mask(kind, B, Hq, Sq, Sk, seed=0, device="cpu"):
    "None (causal), or a boolean mask of the given broadcast kind with at least one fully masked row."
    if kind == "causal": return None
    g = torch.Generator().manual_seed(seed + 1)
    shape = {"random": (B, Hq, Sq, Sk), "shared": (Sq, Sk), "padding": (B, 1, 1, Sk)}[kind]
    mask = torch.rand(shape, generator=g) > 0.6
    if kind == "padding": mask[0] = False  # the whole first sequence is padding: all its rows are empty
    else: mask[..., Sq // 2, :] = False
    return mask.to(device)


def reference(q, k, v, mask):
    "attention_reference with mask=None made explicit (causal_mask), which it needs for Sq > Sk (the empty rows)."
    return attention_reference(q, k, v, causal_mask(q.shape[2], k.shape[2], q.device) if mask is None else mask)


def assert_same(got, want, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    assert got[0].dtype == dtype and not got[0].isnan().any() and not got[1].isnan().any()


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("Sq,Sk", LENGTHS)
@pytest.mark.parametrize("kind", MASKS)
def test_backends_match_reference(G, Sq, Sk, kind):
    q, k, v = make_qkv(G, Sq, Sk, seed=G * 1000 + Sq * 10 + Sk)
    mask = make_mask(kind, q.shape[0], q.shape[1], Sq, Sk)
    for dtype in (torch.float32, torch.bfloat16) if kind in ("causal", "random") else (torch.float32,):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        want = reference(qd, kd, vd, mask)
        for backend in BACKENDS:
            assert_same(masked_attention(qd, kd, vd, mask, backend=backend), want, dtype)
        assert_same(attention_chunked(qd, kd, vd, mask, chunk=32), want, dtype)


def test_reference_matches_independent_dense_computation():
    """The reference against softmax of masked float64 scores and torch.logsumexp (rows with a key),
    and 0 / -inf (rows without)."""
    q, k, v = make_qkv(3, 33, 40, seed=7)
    mask = make_mask("random", 2, 6, 33, 40)
    out, lse = attention_reference(q.double(), k.double(), v.double(), mask)
    kr, vr = k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1)
    s = (q.double() @ kr.transpose(-1, -2) / 4.0).masked_fill(~mask, -math.inf)
    seen = mask.any(-1)
    torch.testing.assert_close(out[seen], (torch.softmax(s, -1) @ vr)[seen])
    torch.testing.assert_close(lse[seen], torch.logsumexp(s, -1)[seen])
    assert (out[~seen] == 0).all() and torch.isneginf(lse[~seen]).all() and (~seen).any()
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attention_reference(q, k, v, mask)[0][seen], out_sdpa[seen])


def test_causal_is_aligned_to_last_keys():
    q, k, v = make_qkv(2, 5, 12, seed=3)
    i, j = torch.arange(5)[:, None], torch.arange(12)
    want = attention_reference(q, k, v, j <= i + 7)
    for backend in BACKENDS: assert_same(masked_attention(q, k, v, None, backend=backend), want, torch.float32)
    # one decode step equals the last row of the full causal prefill
    q_all = make_qkv(2, 12, 12, seed=4)[0]
    full, step = attention_reference(q_all, k, v), attention_reference(q_all[:, :, -1:], k, v)
    torch.testing.assert_close(step[0], full[0][:, :, -1:])
    torch.testing.assert_close(step[1], full[1][:, :, -1:])


@pytest.mark.parametrize("chunk", [1, 5, 32, 256])
def test_chunked_never_holds_more_than_chunk_rows(chunk, monkeypatch):
    rows_seen = []
    scores = A.attention_scores
    def recording(q, k, mask=None, scale=None):
        s = scores(q, k, mask, scale)
        rows_seen.append(s.shape[2])
        return s
    monkeypatch.setattr(A, "attention_scores", recording)
    q, k, v = make_qkv(4, 33, 40, seed=5)
    for kind in MASKS:
        mask = make_mask(kind, 2, 8, 33, 40)
        rows_seen.clear()
        got = attention_chunked(q, k, v, mask, chunk=chunk)
        assert max(rows_seen) <= chunk and sum(rows_seen) == 33
        assert_same(got, attention_reference(q, k, v, mask), torch.float32)


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
@pytest.mark.parametrize("kind", ["causal", "random", "padding"])
def test_gradients_match_reference(backend, kind):
    q, k, v = make_qkv(3, 33, 33, seed=11)
    mask = make_mask(kind, 2, 6, 33, 33)

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
        ((out * w).sum() + lse.masked_fill(lse.isneginf(), 0).sum()).backward()
        return [x.grad for x in leaves]

    got = grads(lambda q, k, v: masked_attention(q, k, v, mask, backend=backend))
    want = grads(lambda q, k, v: attention_reference(q, k, v, mask))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_auto_picks_a_differentiable_backend_on_cpu():
    q, k, v = make_qkv(3, 7, 33, seed=2)
    q.requires_grad_()
    out, lse = masked_attention(q, k, v, None)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="no backward on cpu"): masked_attention(q, k, v, None, backend="flex")
    out, lse = masked_attention(q, k, v, None, backend="flex", need_grad=False)
    assert not out.requires_grad
    assert_same((out, lse), attention_reference(q.detach(), k, v), torch.float32)


@pytest.mark.parametrize("Sq,Sk", [(7, 33), (33, 33), (1, 130)])
def test_merge_of_key_blocks_equals_full_attention(Sq, Sk):
    q, k, v = make_qkv(3, Sq, Sk, seed=Sq + Sk)
    mask = make_mask("random", 2, 6, Sq, Sk)
    want = attention_reference(q, k, v, mask)
    for split in sorted({1, Sk // 3, Sk - 1} - {0}):
        a = attention_reference(q, k[:, :, :split], v[:, :, :split], mask[..., :split])
        b = attention_reference(q, k[:, :, split:], v[:, :, split:], mask[..., split:])
        got = merge_attention(*a, *b)
        assert_same(got, want, torch.float32)
        # the merge weight of block A is the reference's attention mass on A
        p = torch.exp(attention_scores(q, k, mask) - want[1][..., None])
        seen = ~torch.isneginf(want[1])
        torch.testing.assert_close(torch.exp(a[1] - want[1])[seen], p[..., :split].sum(-1)[seen])


def test_masked_logsumexp_is_stable_and_finite():
    s = torch.tensor([[1000.0, 999.0, -math.inf], [-1000.0, -1001.0, -1002.0], [-math.inf] * 3], requires_grad=True)
    lse = masked_logsumexp(s)
    want = [1000 + math.log(1 + math.exp(-1)), -1000 + math.log(1 + math.exp(-1) + math.exp(-2)), -math.inf]
    torch.testing.assert_close(lse, torch.tensor(want))
    lse[:2].sum().backward()
    assert torch.isfinite(s.grad).all() and (s.grad[2] == 0).all()


def test_flex_score_mod_and_broadcast_block_mask():
    q, k, v = make_qkv(4, 33, 130, seed=9)
    bias = torch.randn(2, 8, 33, 130)
    out, lse = flex_attention_lse(q, k, v, causal_block_mask(33, 130), score_mod=bias_score_mod(bias))
    s = attention_scores(q, k) + bias
    torch.testing.assert_close(lse, masked_logsumexp(s), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ repeat_kv(v, 4), rtol=1e-5, atol=1e-5)
    pad = make_mask("padding", 2, 8, 33, 130)
    got = flex_attention_lse(q, k, v, block_mask_from_bool(pad, (2, 8, 33, 130)))
    assert_same(got, attention_reference(q, k, v, pad), torch.float32)


def test_bad_inputs_are_refused_with_clear_errors():
    q, k, v = make_qkv(3, 7, 9)
    with pytest.raises(ValueError, match="multiple of the KV heads"): check_qkv(q[:, :5], k, v)
    with pytest.raises(TypeError, match="share one dtype"): masked_attention(q, k.half(), v.half(), None)
    with pytest.raises(TypeError, match="floating-point"): check_qkv(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="4-D"): attention_reference(q[0], k, v)
    with pytest.raises(ValueError, match="batch size"): attention_reference(q[:1], k, v)
    with pytest.raises(ValueError, match="head dim"): attention_reference(q[..., :8], k, v)
    with pytest.raises(ValueError, match="k and v must agree"): attention_reference(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="at least one position"): attention_reference(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(TypeError, match="torch.bool"): masked_attention(q, k, v, torch.ones(7, 9))
    with pytest.raises(ValueError, match="does not broadcast"):
        masked_attention(q, k, v, torch.ones(7, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="at most 4 dims"):
        check_mask(torch.ones(1, 1, 1, 7, 9, dtype=torch.bool), (2, 6, 7, 9), "cpu")
    with pytest.raises(ValueError, match="backend must be one of"): masked_attention(q, k, v, None, backend="flash")
    with pytest.raises(ValueError, match="scale must be"): masked_attention(q, k, v, None, scale=float("nan"))
    with pytest.raises(ValueError, match="chunk must be"): attention_chunked(q, k, v, chunk=0)


@pytest.mark.parametrize("Sq,Sk", LENGTHS)
def test_causal_mask_matches_loops(Sq, Sk):
    want = torch.tensor([[j <= i + Sk - Sq for j in range(Sk)] for i in range(Sq)])
    assert torch.equal(causal_mask(Sq, Sk), want)
    shifted = torch.tensor([[j <= i + 3 for j in range(Sk)] for i in range(Sq)])
    assert torch.equal(causal_mask(Sq, Sk, offset=3), shifted)


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("Sq,Sk", LENGTHS)
def test_compiled_flex_on_cuda(G, Sq, Sk):
    q, k, v = make_qkv(G, Sq, Sk, D=64, seed=G + Sq + Sk, device="cuda")
    for kind in MASKS:
        mask = make_mask(kind, 2, 2 * G, Sq, Sk, device="cuda")
        for dtype in (torch.float32, torch.bfloat16):
            qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
            want = reference(qd, kd, vd, mask)
            assert_same(masked_attention(qd, kd, vd, mask), want, dtype)  # auto = compiled flex on CUDA
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        masked_attention(*leaves, mask, backend="flex")[0].square().sum().backward()
        reference(*ref_leaves, mask)[0].square().sum().backward()
        for g, w in zip(leaves, ref_leaves):
            assert torch.isfinite(g.grad).all()
            torch.testing.assert_close(g.grad, w.grad, rtol=1e-4, atol=1e-4)


# --- non-finite input and more queries than keys ---------------------------------

@pytest.mark.parametrize("name, value", [("q", math.nan), ("k", math.inf), ("v", -math.inf)])
def test_attention_reference_refuses_non_finite(name, value):
    "One NaN or inf would make NaN rows: refused, naming the tensor; check_finite=False skips the check."
    args = dict(q=torch.randn(1, 4, 5, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8))
    args[name] = args[name].index_fill(2, torch.tensor([1]), value)
    with pytest.raises(ValueError, match=f"{name} contains NaN or inf"): attention_reference(**args)
    with pytest.raises(ValueError, match=f"{name} contains NaN or inf"): attention_chunked(**args, chunk=2)
    assert attention_reference(**args, check_finite=False)[0].isnan().any()


def test_attention_reference_more_queries_than_keys():
    "mask=None aligns the queries to the last keys: more queries than keys is refused; a mask may allow it."
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"more queries \(Sq=6\) than keys \(Sk=3\)"): attention_reference(q, k, v)
    out, lse = attention_reference(q, k, v, torch.ones(6, 3, dtype=torch.bool))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def _gather_loops(x, idx):
    "The entries idx [B,H,n] of x [B,H,S,D] by loops: the reference `gather_keys` and `gather_kv` are checked against."
    return torch.stack([torch.stack([x[b, h, idx[b, h]] for h in range(x.shape[1])]) for b in range(x.shape[0])])


# layouts of [B,H,S,D] a cache hands to attention: whole, a capacity buffer's prefix, batch rows or heads of a larger
# tensor, heads and sequence transposed, lone heads and entries, expanded over batch and heads (stride 0)
LAYOUTS = {
    "contiguous": lambda b: b[:, :, :9].contiguous(),
    "buffer prefix": lambda b: b[:, :, :9],
    "last batch row": lambda b: b[1:, :, :9],
    "two of three heads": lambda b: b[:, :2, :9],
    "middle head": lambda b: b[:, 1:2, :9],
    "sequence-major": lambda b: b.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :9],  # memory [B,S,H,D]
    "one entry": lambda b: b[:, :, :1],
    "expanded": lambda b: b[:1, :1, :9].expand(2, 3, 9, -1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_keys_and_kv_equal_loops(layout, dtype):
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(2, 3, 16, 8, generator=g).to(dtype)
    k, v = LAYOUTS[layout](buf), LAYOUTS[layout](torch.randn(2, 3, 16, 8, generator=g).to(dtype))
    idx = torch.randint(0, k.shape[2], (*k.shape[:2], 6), generator=g)
    assert torch.equal(A.gather_keys(k, idx), _gather_loops(k, idx))
    assert A.gather_keys(k, idx)._base is None  # a tensor of its own, as gather's: compiled steps see one kind
    for vv in (v, torch.randn(*v.shape[:3], 5, generator=g).to(dtype)):  # a value head as wide, narrower
        gk, gv = A.gather_kv(k, vv, idx)
        assert torch.equal(gk, _gather_loops(k, idx)) and torch.equal(gv, _gather_loops(vv, idx))


def test_row_table_only_where_rows_are_whole():
    buf = torch.randn(2, 3, 16, 8)
    table, step = A.row_table(buf[:, :, :9])
    assert step == 16 and table.shape == (5 * 16 + 9, 8) and table.data_ptr() == buf.data_ptr()  # a view, no copy
    assert A.row_table(buf.transpose(2, 3)) is None  # entries are not rows of memory
    assert A.row_table(buf[:, :2]) is None  # the batch's step is not a whole number of these heads
    assert A.row_table(buf.clone().requires_grad_()) is None  # differentiated: gather's backward
    with torch.no_grad(): assert A.row_table(buf.clone().requires_grad_()) is not None
