"""OVAL page retrieval (`sparsekv.oval.pages`): avgSM/max aggregation, page selection, storage, the packed decode
layout and the decode policy, by name or with a PageSummary."""
import math

import pytest
import torch
from torch.testing import assert_close

from sparsekv.attention import gather_keys
from sparsekv.hf import AttentionContext, attend_selected, patch
from sparsekv.oval.basis import output_metric
from sparsekv.oval.pages import (
    GQA_POLICIES,
    PackedPages,
    PageRetrievalPolicy,
    aggregate_gqa,
    always_kept,
    gather_pages,
    page_attention,
    page_tokens,
    retrieval_quality,
    select_pages,
    select_pages_reference,
    storage_table,
    summary_scalars,
    top_pages,
)
from sparsekv.oval.summaries import (
    METHODS,
    SUMMARIES,
    KeyPCASummary,
    OVALSummary,
    QuestSummary,
    build_summaries,
    score_pages,
    score_pages_reference,
)

F64 = torch.float64


def cache(B=2, Hkv=2, T=45, d=8, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -1, d, dtype=F64)
    K = torch.randn(B, Hkv, T, d, generator=g, dtype=F64) * spectrum + torch.randn(d, generator=g, dtype=F64)
    V = torch.randn(B, Hkv, T, d, generator=g, dtype=F64)
    A = torch.randn(Hkv, d, d, generator=g, dtype=F64)
    return K.to(dtype), V.to(dtype), (A.mT @ A / d).to(dtype)


def queries(B=2, Hq=4, d=8, seed=1, S=None):
    g = torch.Generator().manual_seed(seed)
    shape = (B, Hq, d) if S is None else (B, Hq, S, d)
    return torch.randn(*shape, generator=g, dtype=F64)


@pytest.mark.parametrize("policy", GQA_POLICIES)
def test_aggregate_matches_loop(policy):
    sc = queries(B=2, Hq=6, d=5, S=3)
    agg = aggregate_gqa(sc, 3, policy)
    assert agg.shape == (2, 3, 3, 5)
    for b in range(2):
        for h in range(3):
            for s in range(3):
                pis = [[math.exp(x) for x in sc[b, 2 * h + g, s].tolist()] for g in range(2)]
                pis = [[x / sum(p) for x in p] for p in pis]
                ref = [(a + c) / 2 if policy == "avgSM" else max(a, c) for a, c in zip(*pis)]
                assert_close(agg[b, h, s], torch.tensor(ref, dtype=F64))
    assert_close(aggregate_gqa(sc, 6, policy), sc.softmax(-1))        # one query head per KV head


@pytest.mark.parametrize("seed", range(20))
def test_select_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    m = int(torch.randint(1, 9, (1,), generator=g))
    T = int(torch.randint(1, 120, (1,), generator=g))
    budget = int(torch.randint(1, 130, (1,), generator=g))
    sink, recent = (int(x) for x in torch.randint(0, 40, (2,), generator=g))
    w = torch.rand(2, 3, T // m, generator=g, dtype=F64).round(decimals=1)         # with ties
    idx = select_pages(w, budget, m, sink, recent, T)
    assert idx.tolist() == select_pages_reference(w, budget, m, sink, recent, T)
    sink_end, recent_start = always_kept(T, m, sink, recent)
    assert idx.shape[-1] <= max(budget, sink_end + T - recent_start)
    assert (idx.diff(dim=-1) > 0).all()                                                  # sorted, no repeats


def test_select_keeps_the_heaviest_pages():
    w = torch.zeros(1, 1, 10, dtype=F64)
    w[0, 0, 3], w[0, 0, 6] = 2.0, 1.0
    idx = select_pages(w, 4 * 4 + 2, 4, 4, 4, 42)     # sink page 0, recent page 9 + 2 partial, 2 pages: 3 and 6
    assert idx[0, 0].tolist() == [0, 1, 2, 3, *range(12, 16), *range(24, 28), *range(36, 42)]


@pytest.mark.parametrize("bad", [
    lambda w: select_pages(w, 10, 4, 0, 0, 44),
    lambda w: select_pages(w, 0, 4, 0, 0, 40),
    lambda w: select_pages(w, 10, 4, -1, 0, 40),
    lambda w: select_pages(w.long(), 10, 4, 0, 0, 40),
    lambda w: select_pages(w * math.nan, 10, 4, 0, 0, 40),
])
def test_select_rejects_bad_input(bad):
    with pytest.raises((ValueError, TypeError)):
        bad(torch.rand(1, 2, 10, dtype=F64))


def test_bad_inputs():
    with pytest.raises(ValueError, match="policy"): aggregate_gqa(queries(), 2, "mean")
    with pytest.raises(ValueError, match="num_kv_heads must be an int >= 1"): aggregate_gqa(queries(), 0)


def test_storage():
    K, V, G = cache(T=64, d=16)
    for m in METHODS:
        s = build_summaries(m, K, V, 8, rank=5, G=G)
        assert sum(t[0, 0].numel() for t in s.tensors.values()) == s.n_pages * summary_scalars(m, 8, 16, rank=5)
    tab = storage_table(32, 64, 8, torch.bfloat16).set_index("method")
    assert (tab["bytes"] == 2 * tab["scalars"]).all()
    assert tab.loc["oracle", "vs_keys"] == 1.0
    assert summary_scalars("oval", 2, 64, rank=8) == 64 + 64 + 2          # rank capped at m - 1


def test_oracle_selection_maximizes_mass():
    g = torch.Generator().manual_seed(0)
    K, V = torch.randn(1, 3, 200, 8, generator=g, dtype=F64) * 2, torch.randn(1, 3, 200, 8, generator=g, dtype=F64)
    q = torch.randn(1, 3, 3, 8, generator=g, dtype=F64)
    best, _ = retrieval_quality("oracle", q, K, V, 8, 48, 8, 8)
    for m in METHODS:
        mass, err = retrieval_quality(m, q, K, V, 8, 48, 8, 8, rank=3)
        assert (mass <= best + 1e-9).all()
        assert torch.isfinite(err).all()
    # a budget covering the cache is exact
    mass, err = retrieval_quality("quest", q, K, V, 8, 200, 8, 8)
    assert_close(mass, torch.ones_like(mass))
    assert_close(err, torch.zeros_like(err))


def _ctx(T, attn, layer=1):
    return AttentionContext(layer_idx=layer, kind="decode", query_positions=torch.tensor([T - 1]),
                            key_positions=torch.arange(T).expand(1, 2, T), mask=None, scale=0.25, module=attn)


@pytest.mark.parametrize("method,policy", [("quest", "avgSM"), ("keypca", "max"), ("oval", "avgSM"), ("oracle", "max")])
def test_decode_policy_matches_reference(tiny_llama, method, policy):
    attn = tiny_llama.model.layers[1].self_attn
    g = torch.Generator().manual_seed(2)
    pol = PageRetrievalPolicy(method, token_budget=20, page_size=4, sink=2, recent=5, rank=2, eta=0.75, policy=policy)
    k, v = torch.randn(1, 2, 60, 16, generator=g), torch.randn(1, 2, 60, 16, generator=g)
    G = output_metric(attn.o_proj.weight.detach(), 4, 2, 16) if method == "oval" else None
    for T in (21, 24, 25, 33, 60, 28, 30):                                  # 28 after 60: a new sequence
        if T == 28: k, v = torch.randn(1, 2, 60, 16, generator=g), torch.randn(1, 2, 60, 16, generator=g)
        q = torch.randn(1, 4, 1, 16, generator=g)
        out = pol(q, k[:, :, :T], v[:, :, :T], _ctx(T, attn))
        fresh = build_summaries(method, k[:, :, :T], v[:, :, :T], 4, rank=2, eta=0.75, G=G)
        for n, x in fresh.tensors.items(): assert_close(pol.summaries[1].tensors[n], x)
        idx = select_pages(aggregate_gqa(score_pages(method, fresh, q[:, :, 0], scale=0.25), 2, policy), 20, 4, 2, 5, T)
        keep = torch.zeros(1, 4, 1, T, dtype=torch.bool)
        for h in range(4): keep[0, h, 0, idx[0, h // 2]] = True
        kr, vr = k[:, :, :T].repeat_interleave(2, 1), v[:, :, :T].repeat_interleave(2, 1)
        assert_close(out, torch.where(keep, q @ kr.mT * 0.25, -math.inf).softmax(-1) @ vr)
    # prefill, dense layers and a cache within the budget go dense
    assert pol.select(q, k[:, :, :20], v[:, :, :20], _ctx(20, attn)) is None
    assert pol.select(q, k, v, _ctx(60, attn, layer=0)) is None


def test_decode_policy_generation(tiny_llama):
    ids = torch.randint(3, 250, (1, 37), generator=torch.Generator().manual_seed(4))
    gen = lambda: tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                      pad_token_id=0)
    with torch.no_grad():
        plain = gen()
        for m in METHODS:
            # keeps everything
            with patch(tiny_llama, PageRetrievalPolicy(m, token_budget=8, page_size=4, sink=0, recent=64, rank=2)):
                assert torch.equal(gen(), plain)
            with patch(tiny_llama, PageRetrievalPolicy(m, token_budget=16, page_size=4, sink=4, recent=4, rank=2)):
                assert gen().shape == plain.shape
    with pytest.raises(ValueError, match="method"): PageRetrievalPolicy("pq", 16)
    with pytest.raises(ValueError, match="policy"): PageRetrievalPolicy("quest", 16, policy="min")


class _Rebuilding(PageRetrievalPolicy):
    "The stateless reference: summaries rebuilt from the cache at every decode call."
    def summary(self, k, v, ctx):
        self.summaries.pop(ctx.layer_idx, None)
        return super().summary(k, v, ctx)


@pytest.mark.parametrize("method", ["oval", "quest"])
def test_beam_search_moves_page_summaries(tiny_llama, method):
    "With 3 beams the summaries follow the cache's reordered rows: the same as rebuilding them at every step."
    ids = torch.randint(3, 250, (1, 13), generator=torch.Generator().manual_seed(5))
    def beams(policy):
        with torch.no_grad(), patch(tiny_llama, policy):
            out = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, num_beams=3,
                                      do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                                      output_scores=True)
        return out.sequences, torch.stack(out.scores)
    kw = dict(token_budget=12, page_size=4, sink=4, recent=4, rank=2)
    (seq, scores), (ref_seq, ref_scores) = beams(PageRetrievalPolicy(method, **kw)), beams(_Rebuilding(method, **kw))
    assert torch.equal(seq, ref_seq)
    assert_close(scores, ref_scores, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method,tau", [("keypca", 0.0), ("oracle", 0.1), ("oval", -0.1)])
def test_speculative_selection_matches_reference(tiny_llama, method, tau):
    attn = tiny_llama.model.layers[1].self_attn
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    qs = [torch.randn(1, 4, 1, 16, generator=g) for _ in range(8)]
    G = output_metric(attn.o_proj.weight.detach(), 4, 2, 16) if method == "oval" else None
    pol = PageRetrievalPolicy(method, 16, 4, 4, 4, rank=2, spec_steps=3, tau=tau)
    n_fix = 0
    for j, q in enumerate(qs):
        T = 30 + j
        idx = pol.select(q, k[:, :, :T], v[:, :, :T], _ctx(T, attn))
        summ = build_summaries(method, k[:, :, :T], v[:, :, :T], 4, rank=2, G=G)
        w_now = aggregate_gqa(score_pages(method, summ, q[:, :, 0], 0.25), 2)
        if j >= 3:
            past = qs[j - 3][:, :, 0]
            w = aggregate_gqa(score_pages(method, summ, past, 0.25), 2)
            for h in range(2):
                pairs = [(past[0, 2 * h + i], q[0, 2 * h + i, 0]) for i in range(2)]
                cos = [float(torch.dot(a, b) / a.norm() / b.norm()) for a, b in pairs]
                if sum(cos) / 2 < tau: w[0, h], n_fix = w_now[0, h], n_fix + 1
        else: w = w_now
        assert torch.equal(idx, select_pages(w, 16, 4, 4, 4, T))
    assert (pol.corrected, pol.speculated) == (n_fix, 10)
    with pytest.raises(ValueError, match="tau"): PageRetrievalPolicy(method, 16, tau=math.nan)
    with pytest.raises(ValueError, match="spec_steps"): PageRetrievalPolicy(method, 16, spec_steps=-1)


def _packed(method, K, V, G, page_size, chunks, rank=3, eta=0.75):
    "PackedPages of K, V appended chunk by chunk (page boundaries in `chunks`), as pages complete during decode."
    pk = PackedPages(method, page_size)
    for a, b in zip(chunks[:-1], chunks[1:]):
        pages = slice(a * page_size, b * page_size)
        pk.append(build_summaries(method, K[:, :, pages], V[:, :, pages], page_size, rank, eta, G))
    return pk


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed,page_size,T,Hq,chunks", [
    (0, 8, 45, 2, [0, 5]),              # G = 1, partial last page, all pages at once
    (1, 8, 45, 6, [0, 1, 1, 4, 5]),     # G = 3, appended in uneven chunks (one empty)
    (2, 5, 5, 6, [0, 1]),               # a single page
    (3, 1, 7, 2, [0, 3, 7]),            # pages of one token (rank capped at 0)
    (4, 4, 64, 4, [0, 1, 2, 3, 16]),    # many appends: the buffers grow
])
def test_packed_scores_match_score_pages(method, seed, page_size, T, Hq, chunks):
    K, V, G = cache(T=T, seed=seed)
    whole = build_summaries(method, K, V, page_size, rank=3, eta=0.75, G=G)
    pk = _packed(method, K, V, G, page_size, chunks)
    assert pk.n_pages == whole.n_pages
    for n, x in whole.tensors.items(): assert_close(pk.tensors[n], x)
    for q in (queries(Hq=Hq, seed=seed + 10), queries(Hq=Hq, seed=seed + 20, S=3)):
        assert_close(pk.scores(q), score_pages(method, whole, q))
        assert_close(pk.scores(q, 0.7), score_pages(method, whole, q, 0.7))
    assert_close(pk.scores(q[:, :, 0]), score_pages_reference(method, K, q[:, :, 0], whole))
    assert_close(score_pages(method, pk.summary(), q), score_pages(method, whole, q))


def test_packed_float32_and_bad_input():
    K, V, G = cache(dtype=torch.float32)
    for m in METHODS:
        whole = build_summaries(m, K, V, 8, rank=3, G=G)
        pk = PackedPages(m, 8).append(whole)
        q = queries().float()
        assert pk.scores(q).dtype == torch.float32
        assert_close(pk.scores(q), score_pages(m, whole, q), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no pages"): PackedPages("quest", 8).scores(q)
    with pytest.raises(ValueError, match="scale"): pk.scores(q, 0.0)
    with pytest.raises(ValueError, match="multiple"): pk.scores(queries(Hq=3).float())
    with pytest.raises(ValueError, match="this store holds"): pk.append(build_summaries("oracle", K, V, 4))
    with pytest.raises(ValueError, match="this store holds"):
        pk.append(build_summaries("oracle", K[:, :1], V[:, :1], 8))
    with pytest.raises(TypeError, match="PageSummary"): pk.append(K)
    with pytest.raises(ValueError, match="method"): PackedPages("pq", 8)


@pytest.mark.parametrize("seed", range(12))
def test_top_pages_gather_and_attention_match_references(seed):
    g = torch.Generator().manual_seed(seed)
    m = int(torch.randint(1, 9, (1,), generator=g))
    T = int(torch.randint(1, 120, (1,), generator=g))
    budget = int(torch.randint(1, 150, (1,), generator=g))                 # some budgets >= T: every page and the tail
    sink, recent = (int(x) for x in torch.randint(0, 40, (2,), generator=g))
    Hkv, G = 2, int(torch.randint(1, 4, (1,), generator=g))                # G = 1, 2 or 3
    w = torch.rand(2, Hkv, T // m, generator=g, dtype=F64).round(decimals=1)
    pages = top_pages(w, budget, m, sink, recent, T)
    assert page_tokens(pages, m, T).tolist() == select_pages_reference(w, budget, m, sink, recent, T)
    if budget >= T: assert pages.tolist() == [[list(range(T // m))] * Hkv] * 2
    k = torch.randn(2, Hkv, T + 5, 8, generator=g, dtype=F64)[:, :, :T]     # a strided slice, as a growing cache
    v = torch.randn(2, Hkv, T, 8, generator=g, dtype=F64)
    tok = page_tokens(pages, m, T)
    assert torch.equal(gather_pages(k, pages, m), gather_keys(k, tok))
    q = torch.randn(2, Hkv * G, 1, 8, generator=g, dtype=F64)
    assert_close(page_attention(q, k, v, pages, m, 0.3), attend_selected(q, k, v, tok, scale=0.3))
    with pytest.raises(ValueError, match="pages must be"): gather_pages(k, pages.int(), m)
    with pytest.raises(ValueError, match="one decode query"): page_attention(q.expand(-1, -1, 2, -1), k, v, pages, m)


def test_policy_summarizes_pages_incrementally(tiny_llama):
    """During decode each completed page is summarized once: appended to the layer's PackedPages, earlier pages
    untouched."""
    attn = tiny_llama.model.layers[1].self_attn
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(1, 2, 80, 16, generator=g), torch.randn(1, 2, 80, 16, generator=g)
    pol = PageRetrievalPolicy("oval", token_budget=16, page_size=4, sink=4, recent=4, rank=2)
    pol(torch.randn(1, 4, 1, 16, generator=g), k[:, :, :30], v[:, :, :30], _ctx(30, attn))
    first = pol.summaries[1].tensors["R"][:, :, :7].clone()
    for T in range(31, 81):
        pol(torch.randn(1, 4, 1, 16, generator=g), k[:, :, :T], v[:, :, :T], _ctx(T, attn))
        assert pol.built == T // 4 == pol.summaries[1].n_pages
    assert torch.equal(pol.summaries[1].tensors["R"][:, :, :7], first)


@pytest.mark.parametrize("method", METHODS)
def test_policy_before_the_first_page_completes(tiny_llama, method):
    """A cache over the budget but shorter than a page: no summary yet, every token is in the partial page, attention
    is dense."""
    attn = tiny_llama.model.layers[1].self_attn
    g = torch.Generator().manual_seed(8)
    pol = PageRetrievalPolicy(method, token_budget=8, page_size=32, sink=0, recent=0, rank=2)
    for T in (20, 21):
        k, v = torch.randn(1, 2, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g)
        q = torch.randn(1, 4, 1, 16, generator=g)
        out = pol(q, k, v, _ctx(T, attn))
        assert pol.summaries[1].n_pages == 0
        assert_close(out, torch.softmax(q @ k.repeat_interleave(2, 1).mT * 0.25, -1) @ v.repeat_interleave(2, 1))
    if method == "oval":
        ctx = _ctx(40, None)
        with pytest.raises(ValueError, match="ctx.module"):
            pol(q, torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), ctx)


@pytest.mark.parametrize("name,summary", [("quest", QuestSummary()), ("keypca", KeyPCASummary(rank=2)),
                                          ("oval", OVALSummary(rank=2, eta=0.75))])
def test_policy_with_a_summary_instance_equals_the_name(tiny_llama, name, summary):
    "PageRetrievalPolicy(a PageSummary) gives the outputs and summaries of (name, rank=2, eta=0.75) bit for bit."
    attn = tiny_llama.model.layers[1].self_attn
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(1, 2, 50, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g)
    by_name = PageRetrievalPolicy(name, 16, 4, 4, 4, rank=2, eta=0.75, spec_steps=1, tau=0.5)
    # the instance's rank and eta apply
    by_class = PageRetrievalPolicy(summary, 16, 4, 4, 4, rank=5, eta=0.1, spec_steps=1, tau=0.5)
    for T in (30, 31, 36, 50):
        q = torch.randn(1, 4, 1, 16, generator=g)
        kt, vt = k[:, :, :T], v[:, :, :T]
        assert torch.equal(by_class(q, kt, vt, _ctx(T, attn)), by_name(q, kt, vt, _ctx(T, attn)))
        for n, x in by_name.summaries[1].tensors.items(): assert torch.equal(by_class.summaries[1].tensors[n], x)
    assert (by_class.method, by_class.built, by_class.corrected) == (name, by_name.built, by_name.corrected)
    assert summary.tensors is None                                           # the given summary is not modified


def test_policy_keeps_a_given_metric(tiny_llama):
    "An OVALSummary given its own G summarizes with it; one without G takes the layer's o_proj metric."
    attn = tiny_llama.model.layers[1].self_attn
    g = torch.Generator().manual_seed(10)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    G = torch.eye(16).expand(2, 16, 16) * 2
    for given, want in ((G, G), (None, output_metric(attn.o_proj.weight.detach(), 4, 2, 16))):
        pol = PageRetrievalPolicy(OVALSummary(rank=2, G=given), 16, 4, 4, 4)
        pol(q, k, v, _ctx(40, attn))
        for n, x in build_summaries("oval", k, v, 4, rank=2, G=want).tensors.items():
            assert torch.equal(pol.summaries[1].tensors[n], x)
        assert (pol.metric(_ctx(40, attn)) is None) == (given is not None)


def test_packed_pages_of_a_summary_instance():
    K, V, G = cache(T=45)
    q = queries()
    for name, cls in SUMMARIES.items():
        whole = build_summaries(name, K, V, 8, rank=3, G=G)
        pk = PackedPages(cls.from_options(rank=3, G=G), 8).append(whole)
        assert torch.equal(pk.scores(q), PackedPages(name, 8).append(whole).scores(q))
        view = pk.summary()
        assert type(view) is cls and view.n_pages == whole.n_pages and torch.equal(view.score(q), whole.score(q))
    with pytest.raises(TypeError, match="holding pages"): PackedPages("quest", 8).append(QuestSummary())
    with pytest.raises(ValueError, match="this store holds 'oval'"):
        PackedPages(OVALSummary(), 8).append(build_summaries("keypca", K, V, 8))


@pytest.mark.parametrize("eta", [2.0, -0.1, math.nan, True])
def test_policy_refuses_bad_eta_at_construction(eta):
    "eta outside [0, 1] is refused when the policy is built, not in the middle of generate."
    with pytest.raises(ValueError, match="eta must be"): PageRetrievalPolicy("oval", 16, eta=eta)


@pytest.mark.parametrize("method", METHODS)
def test_padded_rows_retrieve_as_alone(method):
    "A padded decode call: each row keeps the pages it keeps alone (page grid and sink from its first real token)."
    g = torch.Generator().manual_seed(4)
    T, pads, Hkv = 41, [0, 5, 30], 2
    q, k, v = torch.randn(3, 4, 1, 16, generator=g), torch.randn(3, Hkv, T, 16, generator=g), torch.randn(3, Hkv, T, 16)
    summary = OVALSummary(rank=2, eta=0.5, G=torch.eye(16).expand(Hkv, 16, 16)) if method == "oval" else method
    opts = dict(token_budget=12, page_size=4, sink=4, recent=4, rank=2)
    real = torch.arange(T) >= torch.tensor(pads)[:, None]
    ctx = AttentionContext(layer_idx=1, kind="decode", query_positions=torch.tensor([T - 1]),
                           key_positions=torch.arange(T).expand(3, Hkv, T), mask=real[:, None, None], scale=0.25)
    pol = PageRetrievalPolicy(summary, **opts)
    chosen = pol.select(q, k, v, ctx)
    for b, p in enumerate(pads):
        n = T - p
        alone = PageRetrievalPolicy(summary, **opts).select(q[b:b + 1], k[b:b + 1, :, p:], v[b:b + 1, :, p:],
                                                            ctx.row_context(b, n, 1))
        want = torch.arange(n).expand(1, Hkv, n) if alone is None else alone  # a row that fits keeps everything
        for h in range(Hkv): assert chosen[b, h].nonzero()[:, 0].tolist() == (want[0, h] + p).tolist()
    assert chosen[1, :, 5:9].all() and not chosen[1, :, :5].any()  # row 1's sink page: its first 4 real tokens
    out = pol(q, k, v, ctx)  # attention over exactly the chosen keys
    keep = chosen.repeat_interleave(2, 1)[:, :, None]
    probs = torch.where(keep, q @ k.repeat_interleave(2, 1).mT * 0.25, -math.inf).softmax(-1)
    assert_close(out, probs @ v.repeat_interleave(2, 1))
