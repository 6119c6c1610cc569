"""OVAL page summaries (`sparsekv.oval.summaries`): each class against its loop, bounds, rank m-1, packed layout,
string API."""

import pytest
import torch
from torch.testing import assert_close

from sparsekv.oval.summaries import (
    METHODS,
    SUMMARIES,
    ArkValeSummary,
    KeyPCASummary,
    OracleSummary,
    OVALSummary,
    PageSummary,
    QuestSummary,
    build_summaries,
    make_summary,
    score_pages,
    score_pages_reference,
    split_pages,
)

F64 = torch.float64


def cache(B=2, Hkv=2, T=45, d=8, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(B, Hkv, T, d, generator=g, dtype=F64) * torch.logspace(0, -1, d, dtype=F64)
    K = K + torch.randn(d, generator=g, dtype=F64)
    V = torch.randn(B, Hkv, T, d, generator=g, dtype=F64)
    A = torch.randn(Hkv, d, d, generator=g, dtype=F64)
    return K.to(dtype), V.to(dtype), (A.mT @ A / d).to(dtype)


def queries(B=2, Hq=4, d=8, seed=1, S=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, Hq, *([] if S is None else [S]), d, generator=g, dtype=F64)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed,page_size,T,Hq", [(0, 8, 45, 4), (1, 5, 20, 2), (2, 4, 4, 6), (3, 1, 7, 2)])
def test_score_matches_loop(method, seed, page_size, T, Hq):
    K, V, G = cache(T=T, seed=seed)
    q = queries(Hq=Hq, seed=seed + 10)
    s = build_summaries(method, K, V, page_size, rank=3, eta=0.75, G=G)
    assert s.n_pages == T // page_size
    assert_close(score_pages(method, s, q), score_pages_reference(method, K, q, s))


@pytest.mark.parametrize("method", ["quest", "arkvale"])
@pytest.mark.parametrize("seed", range(3))
def test_bounds_hold_for_every_key(method, seed):
    K, V, _ = cache(seed=seed, T=48, d=16)
    q = queries(d=16, seed=seed) * 3
    sc = score_pages(method, build_summaries(method, K, V, 8), q)
    logits = torch.einsum("bhgd,bhpmd->bhgpm", q.reshape(2, 2, 2, 16), split_pages(K, 8)).reshape(2, 4, 6, 8) / 4
    assert (sc.unsqueeze(-1) >= logits - 1e-12).all()
    # a single-token page makes both bounds tight
    one = score_pages(method, build_summaries(method, K, V, 1), q)
    assert_close(one, score_pages("oracle", build_summaries("oracle", K, V, 1), q))


@pytest.mark.parametrize("method", ["keypca", "oval"])
@pytest.mark.parametrize("page_size", [4, 8, 16])
def test_full_rank_basis_equals_oracle(method, page_size):
    K, V, G = cache(T=3 * page_size + 1, d=16)
    q = queries(d=16, S=3)
    exact = score_pages("oracle", build_summaries("oracle", K, V, page_size), q)
    full = build_summaries(method, K, V, page_size, rank=page_size - 1, eta=0.5, G=G)
    assert_close(score_pages(method, full, q), exact)
    # a rank above the cap gives the same summary
    assert_close(score_pages(method, build_summaries(method, K, V, page_size, rank=64, eta=0.5, G=G), q), exact)


def test_keypca_ignores_values_and_oval_uses_them():
    K, V, G = cache(T=32, d=8)
    q = queries()
    a = score_pages("keypca", build_summaries("keypca", K, V, 8, rank=2), q)
    assert_close(a, score_pages("keypca", build_summaries("keypca", K, None, 8, rank=2), q))
    assert_close(a, score_pages("keypca", build_summaries("keypca", K, 5 * V.flip(2), 8, rank=2), q))
    assert_close(a, score_pages("oval", build_summaries("oval", K, V, 8, rank=2, eta=0.0, G=G), q))
    b = score_pages("oval", build_summaries("oval", K, V, 8, rank=2, eta=1.0, G=G), q)
    assert not torch.allclose(a, b)


def test_float32_cache_keeps_dtype():
    K, V, G = cache(dtype=torch.float32)
    for m in METHODS:
        s = build_summaries(m, K, V, 8, rank=3, G=G)
        assert all(t.dtype == torch.float32 for t in s.tensors.values())
        q = queries().float()
        assert_close(score_pages(m, s, q).double(), score_pages_reference(m, K, q, s), rtol=1e-4, atol=1e-4)


def test_bad_inputs():
    K, V, G = cache()
    with pytest.raises(ValueError, match="method"): build_summaries("pca", K, V, 8)
    with pytest.raises(ValueError, match="page_size"): build_summaries("quest", K, V, 0)
    with pytest.raises(ValueError, match="V is required"): build_summaries("oval", K, None, 8)
    with pytest.raises(ValueError, match="G must be"): build_summaries("oval", K, V, 8, G=G[0])
    with pytest.raises(ValueError, match="K must be"): build_summaries("quest", K[0], V, 8)
    s = build_summaries("quest", K, V, 8)
    with pytest.raises(ValueError, match="built for"): score_pages("arkvale", s, queries())
    with pytest.raises(ValueError, match="multiple"): score_pages("quest", s, queries(Hq=3))

def test_names_map_to_classes():
    assert METHODS == ("quest", "arkvale", "keypca", "oval", "oracle")
    assert [SUMMARIES[n] for n in METHODS] == [QuestSummary, ArkValeSummary, KeyPCASummary, OVALSummary, OracleSummary]
    for name, cls in SUMMARIES.items():
        assert issubclass(cls, PageSummary) and cls.name == name
    assert [n for n, c in SUMMARIES.items() if c.needs_values] == ["oval"]
    assert [n for n, c in SUMMARIES.items() if c.needs_metric] == ["oval"]
    s = make_summary("oval", rank=3, eta=0.25)
    assert (type(s), s.rank, s.eta, s.G, s.n_pages) == (OVALSummary, 3, 0.25, None, 0)
    assert (make_summary("keypca", rank=4, eta=0.9).rank, make_summary("keypca", eta=0.9).eta) == (4, 0.0)
    with pytest.raises(ValueError, match="method must be one of"): make_summary("pq")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed,page_size,T,Hq", [(0, 8, 45, 4), (1, 4, 4, 6), (2, 1, 7, 2)])
def test_class_equals_string_api(method, seed, page_size, T, Hq):
    "The class path (constructor, summarize, score, reference) gives the string API's tensors and scores exactly."
    K, V, G = cache(T=T, seed=seed)
    q = queries(Hq=Hq, seed=seed + 10)
    by_name = build_summaries(method, K, V, page_size, rank=3, eta=0.75, G=G)
    made = {"keypca": lambda: KeyPCASummary(3), "oval": lambda: OVALSummary(3, 0.75, G)}
    spec = made.get(method, SUMMARIES[method])()
    summ = spec.summarize(K, V, page_size)
    assert spec.tensors is None and (summ.page_size, summ.length, summ.n_pages) == (page_size, T, T // page_size)
    assert list(summ.tensors) == list(by_name.tensors)
    for n, x in by_name.tensors.items(): assert torch.equal(summ.tensors[n], x)
    assert torch.equal(summ.score(q, 0.3), score_pages(method, by_name, q, 0.3))
    assert torch.equal(summ.reference(K, q), score_pages_reference(method, K, q, by_name))
    assert torch.equal(build_summaries(spec, K, V, page_size, rank=8, eta=0.1).tensors[next(iter(summ.tensors))],
                       next(iter(summ.tensors.values())))                   # a PageSummary is used as it is


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed,page_size,T,Hq", [(0, 8, 45, 4), (1, 5, 20, 6), (2, 1, 7, 2)])
def test_packed_layout_matches_score(method, seed, page_size, T, Hq):
    "pack/features/packed_score multiplied out give score; unpack inverts pack; scalars counts the stored numbers."
    K, V, G = cache(T=T, seed=seed)
    q = queries(Hq=Hq, seed=seed + 20)
    summ = build_summaries(method, K, V, page_size, rank=3, eta=0.5, G=G)
    rows, R = summ.pack()
    Bsz, Hkv, P, nr, f = rows.shape
    for n, x in summ.unpack(rows, R).items(): assert torch.equal(x, summ.tensors[n])
    x = summ.features(q.reshape(Bsz * Hkv, -1, 8) * 0.7)
    z = torch.einsum("agf,aprf->agpr", x, rows.reshape(Bsz * Hkv, P, nr, f))
    Rp = None if R is None else R.reshape(Bsz * Hkv, P, *R.shape[3:]).transpose(0, 1)
    assert_close(summ.packed_score(z, Rp).reshape(Bsz, Hq, P), summ.score(q, 0.7))
    assert sum(t[0, 0].numel() for t in summ.tensors.values()) == P * summ.scalars(page_size, 8)


def test_summary_bad_input():
    K, V, G = cache()
    with pytest.raises(ValueError, match="holds no pages"): OVALSummary().score(queries())
    with pytest.raises(ValueError, match="holds no pages"): QuestSummary().reference(K, queries())
    with pytest.raises(ValueError, match="rank must be an int >= 1"): KeyPCASummary(0)
    with pytest.raises(TypeError, match="rank must be an int >= 1"): OVALSummary(rank=2.0)
    with pytest.raises(ValueError, match="eta must be a number in"): OVALSummary(eta=-0.1)
    with pytest.raises(ValueError, match="V must match|must match K"): OVALSummary().summarize(K, V[:, :, :40], 8)
    with pytest.raises(TypeError, match="V must be"): KeyPCASummary().summarize(K, V.long(), 8)
    with pytest.raises(ValueError, match="q's batch"): QuestSummary().summarize(K, V, 8).score(queries(B=3))
    with pytest.raises(NotImplementedError, match="no loop reference"):
        PageSummary().reference_page(None, None, {}, 1.0)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"): split_pages(K, 0)
