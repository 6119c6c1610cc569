"""The paged decode kernel (`sparsekv.oval.kernel`) against its brute-force reference and the eager page attention, on
random caches and edge cases (here under Triton's interpreter, which `conftest.py` turns on without a GPU), and the
retrieval policy with `backend='triton'` against `backend='torch'`."""
import pytest
import torch
from torch.testing import assert_close

from sparsekv import methods
from sparsekv.hf import measure_attended, patch
from sparsekv.oval.kernel import paged_decode, paged_decode_reference
from sparsekv.oval.pages import PAGE_BACKENDS, PageRetrievalPolicy, page_attention
from sparsekv.oval.summaries import METHODS

DTYPES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_reference_on_random_caches(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    draw = lambda *n: int(torch.randint(n[0], n[1] + 1, (1,), generator=g))  # noqa: E731
    B, Hkv, G, m, D = draw(1, 2), draw(1, 3), draw(1, 7), draw(1, 9), draw(1, 40)
    T = draw(m, 12 * m)
    n, splits = draw(0 if T % m else 1, 2 * (T // m)), draw(1, 5)   # pages may repeat; none needs a partial page
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((B, Hkv * G, 1, D), (B, Hkv, T, D), (B, Hkv, T, D)))
    pages = torch.randint(0, T // m, (B, Hkv, n), generator=g)
    scale = [None, 0.3][seed % 2]
    out = paged_decode(q, k, v, pages, m, scale, splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    tol = DTYPES[dtype]
    assert_close(out, paged_decode_reference(q, k, v, pages, m, scale), atol=tol, rtol=tol)
    if n: assert_close(out, page_attention(q, k, v, pages, m, scale), atol=tol, rtol=tol)


def test_kernel_on_strided_and_offset_views():
    "A preallocated cache (a slice of a larger buffer), keys with the head dim not last in memory, strided pages."
    g = torch.Generator().manual_seed(7)
    buf = torch.randn(2, 3, 2, 50, 16, generator=g)
    k, v = buf[0, :, :, 5:38], buf[1, :, :, 5:38].mT.contiguous().mT
    q = torch.randn(3, 16, 1, 4, generator=g).permute(0, 3, 2, 1)      # [3, 4, 1, 16], head dim strided
    pages = torch.randint(0, 33 // 4, (3, 2, 6), generator=g)
    wide = torch.stack([pages, -pages], -1)[..., 0]                    # every other int64 of a buffer
    assert not (k.is_contiguous() or q.is_contiguous() or wide.is_contiguous())
    assert_close(paged_decode(q, k, v, wide, 4, splits=3), paged_decode_reference(q, k, v, pages, 4),
                 atol=1e-5, rtol=1e-5)


def test_kernel_extreme_scores():
    "Scores far apart (the online softmax rescales without overflow) and one page that holds all the mass."
    k = torch.zeros(1, 1, 16, 4)
    k[0, 0, 9, 0] = 80.0                       # token 9 (page 2 of 4) dominates: exp(80 * 2) overflows float32
    v = torch.arange(64.).view(1, 1, 16, 4)
    q = torch.tensor([[[[2.0, 0, 0, 0]]]])
    out = paged_decode(q, k, v, torch.tensor([[[0, 2, 3]]]), 4, scale=1.0, splits=2)
    assert torch.isfinite(out).all()
    assert_close(out[0, 0, 0], v[0, 0, 9])


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.randn(1, 2, 2, 8)), "one decode query"),
    (dict(k=torch.randn(1, 3, 12, 8)), "k and v must be"),
    (dict(pages=torch.zeros(1, 1, 1, dtype=torch.int32)), "pages must be int64"),
    (dict(pages=torch.full((1, 1, 1), 3)), r"complete pages, in \[0, 3\)"),
    (dict(pages=torch.full((1, 1, 1), -1)), r"complete pages, in \[0, 3\)"),
    (dict(page_size=0), "page_size must be"),
    (dict(k=torch.randn(1, 1, 12, 8), v=torch.randn(1, 1, 12, 8), pages=torch.zeros(1, 1, 0, dtype=torch.long)),
     "no key to attend"),
    (dict(splits=0), "splits must be"),
])
def test_kernel_rejects_bad_input(bad, match):
    args = dict(q=torch.randn(1, 2, 1, 8), k=torch.randn(1, 1, 13, 8), v=None,
                pages=torch.zeros(1, 1, 1, dtype=torch.long), page_size=4, splits=None) | bad
    if args["v"] is None: args["v"] = args["k"]
    with pytest.raises(ValueError, match=match): paged_decode(**args)


def test_page_attention_backend_measures_the_same_keys():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 6, 1, 8), (2, 3, 45, 8), (2, 3, 45, 8)))
    pages = torch.randint(0, 45 // 8, (2, 3, 3), generator=g)
    with measure_attended() as eager: want = page_attention(q, k, v, pages, 8)
    with measure_attended() as fused: got = page_attention(q, k, v, pages, 8, backend="triton")
    assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert fused.per_head() == eager.per_head()
    assert fused.per_head()[0]["mean"] == 3 * 8 + 45 % 8
    with pytest.raises(ValueError, match="backend must be one of"): page_attention(q, k, v, pages, 8, backend="cuda")
    with pytest.raises(ValueError, match="without dropout"): page_attention(q, k, v, pages, 8, 0.1, 0.5, "triton")


@pytest.mark.parametrize("method", METHODS)
def test_policy_with_the_kernel_generates_as_eager(tiny_llama, method):
    "Greedy generation with backend='triton' chooses the eager backend's tokens, its logits equal at every step."
    ids = torch.randint(3, 250, (1, 37), generator=torch.Generator().manual_seed(4))
    runs = {}
    for backend in PAGE_BACKENDS:
        pol = PageRetrievalPolicy(method, token_budget=16, page_size=4, sink=4, recent=4, rank=2, backend=backend)
        with torch.no_grad(), patch(tiny_llama, pol):
            runs[backend] = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                                do_sample=False, pad_token_id=0, output_logits=True,
                                                return_dict_in_generate=True)
    assert torch.equal(runs["triton"].sequences, runs["torch"].sequences)
    assert_close(torch.stack(runs["triton"].logits), torch.stack(runs["torch"].logits), atol=1e-4, rtol=1e-4)


def test_registered_retrieval_methods_take_the_backend():
    for name in methods.names("retrieval"):
        m = methods.make(name, budget=64, backend="triton")
        assert m.options()["backend"] == "triton" and m.policy().backend == "triton"
        assert methods.make(name, budget=64).policy().backend == "torch"
    with pytest.raises(ValueError, match="backend must be one of"): methods.make("oval", budget=64, backend="cuda")
