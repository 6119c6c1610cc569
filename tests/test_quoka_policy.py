"""Tests of sparsekv.quoka.policy: QuoKA's chunked prefill (Alg. 2) and generation mode, and the baselines under the
same loop."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sparsekv.hf import DensePolicy, chunked_prefill, patch
from sparsekv.models import load_model
from sparsekv.quoka.baselines import (
    LessIsMorePolicy,
    LessIsMoreSelector,
    lessismore_select,
    loki_select,
    mean_score_select,
    sample_attention_select,
    sparq_select,
)
from sparsekv.quoka.policy import BaselinePolicy, QuokaPolicy, last_chunk_logits, selected_attention_reference
from sparsekv.quoka.select import quoka_scores_reference, quoka_select, quoka_select_reference
from sparsekv.select import anchor_mask, anchored_top_indices, anchored_top_indices_reference, resolve_budget

ATOL = dict(atol=1e-5, rtol=0)


def _ids(B, S, seed, vocab=259):
    return torch.randint(3, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _recording(base):
    "A subclass of policy class `base` keeping each call's (q, k, v, ctx, selected earlier keys or None, output)."
    class Rec(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.calls = []

        def attend(self, q, k, v, ctx):
            idx, out = self.select(q, k, v, ctx), super().attend(q, k, v, ctx)
            self.calls.append((q, k, v, ctx, None if idx is None else idx[..., :-q.shape[2]], out))
            return out
    return Rec


def _dense_last(model, ids, chunk):
    return chunked_prefill(model, ids, chunk)[1]


# --- QuoKA prefill ---------------------------------------------------------------------------

def test_full_budget_equals_dense(every_tiny_model):
    ids = _ids(2, 23, 0)
    dense = _dense_last(every_tiny_model, ids, 5)
    for policy in [QuokaPolicy(4, 23), QuokaPolicy(4, 1.0), QuokaPolicy(4, 100, "head", "mean", sinks=2, recent=2)]:
        assert_close(chunked_prefill(every_tiny_model, ids, 5, policy)[1], dense, **ATOL)


@pytest.mark.parametrize("options", [dict(n_q=3, budget=6),
                                     dict(n_q=2, budget=7, query_select="head", query_agg="mean"),
                                     dict(n_q=16, budget=6),
                                     dict(n_q=2, budget=6, query_rank="similar"),
                                     dict(n_q=3, budget=6, gqa_agg="max")])
def test_small_budget_matches_brute_force(every_tiny_model, options):
    """Every call: the selection is the reference Alg. 1 and the output the reference attention over it; the last
    logits differ from dense."""
    ids = _ids(2, 21, 1)
    rec = _recording(QuokaPolicy)(**options)
    _, last = chunked_prefill(every_tiny_model, ids, 5, rec)
    n, checked = options["budget"], 0
    sel = dict(n_q=options["n_q"], query_select=options.get("query_select", "group"),
               query_agg=options.get("query_agg", "max"), query_rank=options.get("query_rank", "dissimilar"),
               gqa_agg=options.get("gqa_agg", "mean"))
    for q, k, v, ctx, idx, out in rec.calls:
        T = ctx.past_len
        assert (idx is None) == (T <= n)
        if idx is None: continue
        assert idx.shape == (2, k.shape[1], n)
        ref = quoka_select_reference(q, k[:, :, :T], budget=n, **sel)
        assert torch.equal(idx, ref)
        assert torch.equal(idx, quoka_select(q, k[:, :, :T], budget=n, **sel))
        assert_close(out, selected_attention_reference(q, k, v, ctx, ref), **ATOL)
        checked += 1
    assert checked == 3 * every_tiny_model.config.num_hidden_layers  # chunks 2-4 (T = 10, 15, 20) select
    assert (last - _dense_last(every_tiny_model, ids, 5)).abs().max() > 1e-4


def test_unit_key_cache_is_per_kv_cache_and_changes_nothing(tiny_llama):
    """The policy's cached unit keys give the same logits as recomputing them; a second prompt (a new KV cache) gets
    fresh unit keys."""
    policy = QuokaPolicy(n_q=3, budget=6)
    for seed in (3, 4):  # the same policy object for two prompts of the same length
        ids = _ids(2, 31, seed)
        cache, last = chunked_prefill(tiny_llama, ids, 5, policy)
        uncached = QuokaPolicy(n_q=3, budget=6, cache_unit_keys=False)
        assert torch.equal(last, chunked_prefill(tiny_llama, ids, 5, uncached)[1])
        for layer in cache.layers:  # the unit keys of all but the last chunk's keys
            unit = F.normalize(layer.keys[:, :, :25], dim=-1, eps=1e-12)
            assert torch.equal(policy.unit_caches[layer].buffer[:, :, :25], unit)
    with pytest.raises(TypeError, match="cache_unit_keys"): QuokaPolicy(cache_unit_keys=1)


def test_random_query_rank_is_seeded(tiny_llama):
    """The 'random' ablation: one seed, one result; another seed, other queries; every query kept (N_Q >= B_CP) draws
    nothing and equals QuoKA; each call keeps what quoka_select keeps from the policy's generator state."""
    ids = _ids(2, 26, 5)
    run = lambda **kw: chunked_prefill(tiny_llama, ids, 5, QuokaPolicy(n_q=2, budget=6, query_rank="random", **kw))[1]
    assert torch.equal(run(seed=1), run(seed=1))
    assert not torch.equal(run(seed=1), run(seed=2))
    assert torch.equal(chunked_prefill(tiny_llama, ids, 5, QuokaPolicy(5, 6, query_rank="random"))[1],
                       chunked_prefill(tiny_llama, ids, 5, QuokaPolicy(5, 6))[1])
    policy = QuokaPolicy(n_q=2, budget=6, query_rank="random", seed=3)
    gen = torch.Generator().manual_seed(3)
    for T in (10, 15):  # replays the policy's draws: the same generator state before each call
        q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, T, 16)
        gen.set_state(policy.generator.get_state())
        assert torch.equal(policy.earlier_indices(q, k), quoka_select_reference(q, k, 2, 6, query_rank="random",
                                                                                generator=gen))


def test_fraction_budget(tiny_llama):
    rec = _recording(QuokaPolicy)(n_q=3, budget=0.25)
    chunked_prefill(tiny_llama, _ids(1, 26, 2), 5, rec)
    for _q, _k, _v, ctx, idx, _out in rec.calls:
        n = resolve_budget(0.25, ctx.past_len)
        assert (idx is None) == (n == ctx.past_len)
        if idx is not None: assert idx.shape[-1] == n


def test_anchors_count_against_the_budget(tiny_llama):
    ids = _ids(1, 26, 3)
    rec = _recording(QuokaPolicy)(n_q=3, budget=6, sinks=2, recent=3)
    chunked_prefill(tiny_llama, ids, 5, rec)
    selecting = [c for c in rec.calls if c[4] is not None]
    assert selecting
    for q, k, v, ctx, idx, out in selecting:
        T = ctx.past_len
        assert idx.shape[-1] == 6
        kept = set(range(2)) | set(range(T - 3, T))
        assert all(kept <= set(row) for row in idx.reshape(-1, 6).tolist())
        scores = quoka_scores_reference(q, k[:, :, :T], 3)
        assert idx.reshape(-1, 6).tolist() == anchored_top_indices_reference(scores, 6, 2, 3)
        assert_close(out, selected_attention_reference(q, k, v, ctx, idx), **ATOL)


def test_anchored_top_indices_reference():
    g = torch.Generator().manual_seed(4)
    for _ in range(30):
        T = int(torch.randint(1, 12, (1,), generator=g))
        n, s, r = (int(torch.randint(0, m + 1, (1,), generator=g)) for m in (T, 4, 4))
        scores = torch.randint(0, 3, (2, 2, T), generator=g).float()
        want = anchored_top_indices_reference(scores, n, s, r)
        assert anchored_top_indices(scores, n, s, r).reshape(4, n).tolist() == want
        assert int(anchor_mask(T, n, s, r).sum()) == min(n, min(s, n) + min(r, T - min(s, n)))


# --- generation ------------------------------------------------------------------------------

def _generate(model, prompt, cache, policy, n=4):
    with torch.no_grad(), patch(model, policy):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, max_new_tokens=n,
                              do_sample=False, pad_token_id=0)


def test_generate_after_quoka_prefill_uses_decode_rule(every_tiny_model):
    prompt = _ids(1, 19, 5)
    rec = _recording(QuokaPolicy)(n_q=3, budget=5)
    cache, _ = chunked_prefill(every_tiny_model, prompt[:, :-1], 6, rec)
    out = _generate(every_tiny_model, prompt, cache, rec)
    assert out.shape == (1, 23)
    decode = [c for c in rec.calls if c[3].kind == "decode"]
    assert len(decode) == 4 * every_tiny_model.config.num_hidden_layers
    for q, k, v, ctx, idx, o in decode:
        assert torch.equal(idx, quoka_select_reference(q, k[:, :, :ctx.past_len], 1, 5))
        assert_close(o, selected_attention_reference(q, k, v, ctx, idx), **ATOL)


def _beams(model, prompt, policy, n=6):
    "Beam search (3 beams) under `policy`: the sequences and each step's scores."
    with torch.no_grad(), patch(model, policy):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, num_beams=3,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    return out.sequences, torch.stack(out.scores)


def test_beam_search_moves_cached_unit_keys(tiny_llama):
    "With 3 beams the cached unit keys follow the cache's reordered rows: the same as recomputing them every call."
    prompt = _ids(1, 17, 8)
    seq, scores = _beams(tiny_llama, prompt, QuokaPolicy(n_q=3, budget=5))
    ref_seq, ref_scores = _beams(tiny_llama, prompt, QuokaPolicy(n_q=3, budget=5, cache_unit_keys=False))
    assert torch.equal(seq, ref_seq)
    assert_close(scores, ref_scores, atol=1e-6, rtol=0)


def test_decode_off_is_dense(tiny_llama):
    prompt = _ids(1, 19, 6)
    cache, _ = chunked_prefill(tiny_llama, prompt[:, :-1], 6, QuokaPolicy(3, 5))
    rec = _recording(QuokaPolicy)(n_q=3, budget=5, decode=False)
    off = _generate(tiny_llama, prompt, copy.deepcopy(cache), rec)
    assert all(c[4] is None for c in rec.calls)
    assert torch.equal(off, _generate(tiny_llama, prompt, copy.deepcopy(cache), DensePolicy()))
    assert len(rec.calls) == 4 * tiny_llama.config.num_hidden_layers


# --- baselines under the same loop -----------------------------------------------------------

BASELINES = {"mean": (mean_score_select, {}), "mean-logits": (mean_score_select, dict(scores="logits")),
             "sample": (sample_attention_select, dict(n_q=3)), "sparq": (sparq_select, dict(r=4)),
             "loki": (loki_select, dict(r=4))}


@pytest.mark.parametrize("name", list(BASELINES))
def test_baseline_policies(tiny_llama, name):
    fn, opts = BASELINES[name]
    ids = _ids(2, 21, 7)
    dense = _dense_last(tiny_llama, ids, 5)
    assert_close(chunked_prefill(tiny_llama, ids, 5, BaselinePolicy(fn, 21, **opts))[1], dense, **ATOL)
    rec = _recording(BaselinePolicy)(fn, 6, **opts)
    _, last = chunked_prefill(tiny_llama, ids, 5, rec)
    selecting = [c for c in rec.calls if c[4] is not None]
    assert len(selecting) == 3 * tiny_llama.config.num_hidden_layers
    for q, k, v, ctx, idx, out in selecting:
        assert torch.equal(idx, fn(q, k[:, :, :ctx.past_len], 6, scale=ctx.scale, **opts))
        assert_close(out, selected_attention_reference(q, k, v, ctx, idx), **ATOL)
    assert (last - dense).abs().max() > 1e-4
    prompt = ids[:1, :12]
    cache, _ = chunked_prefill(tiny_llama, prompt[:, :-1], 5, rec)
    assert _generate(tiny_llama, prompt, cache, rec, 2).shape == (1, 14)


def test_lessismore_policy():
    model = load_model("tiny-llama", num_layers=3)[0]
    ids = _ids(1, 21, 8)
    dense = _dense_last(model, ids, 5)
    assert_close(chunked_prefill(model, ids, 5, LessIsMorePolicy(LessIsMoreSelector(21, (1,))))[1], dense, **ATOL)
    rec = _recording(LessIsMorePolicy)(LessIsMoreSelector(8, (1,), recent_ratio=0.25))
    _, last = chunked_prefill(model, ids, 5, rec)
    by_chunk = {}
    for c in rec.calls: by_chunk.setdefault(c[3].chunk_index, {})[c[3].layer_idx] = c
    for layers in by_chunk.values():
        assert layers[0][4] is None and layers[1][4] is None  # below and at the selection layer: dense
        q, k = layers[1][0], layers[1][1]
        T = layers[2][3].past_len
        # layer 2 reuses layer 1's pick
        if T <= 8: assert layers[2][4] is None
        else: assert torch.equal(layers[2][4], lessismore_select(q, k[:, :, :T], 8, 0.25))
    assert (last - dense).abs().max() > 1e-4


# --- last_chunk_logits and input checks ------------------------------------------------------

def test_last_chunk_logits(tiny_llama):
    ids = _ids(2, 17, 9)
    with torch.no_grad(): full = tiny_llama(ids).logits
    assert_close(last_chunk_logits(tiny_llama, ids, 5), full[:, 15:], **ATOL)
    assert_close(last_chunk_logits(tiny_llama, ids, 32), full, **ATOL)
    assert_close(last_chunk_logits(tiny_llama, ids[:, :16], 5), full[:, 15:16], **ATOL)  # a one-token last chunk
    policy = QuokaPolicy(3, 6)
    assert_close(last_chunk_logits(tiny_llama, ids, 5, policy)[:, -1], chunked_prefill(tiny_llama, ids, 5, policy)[1],
                 **ATOL)
    with pytest.raises(ValueError, match="chunk_size"): last_chunk_logits(tiny_llama, ids, 0)
    with pytest.raises(ValueError, match="input_ids"): last_chunk_logits(tiny_llama, ids.float(), 5)


def test_bad_arguments():
    for kw, match in [(dict(n_q=0), "n_q"), (dict(budget=0), "budget"), (dict(budget=1.5), "budget"),
                      (dict(query_select="x"), "query_select"), (dict(query_agg="x"), "query_agg"),
                      (dict(sinks=-1), "sinks"), (dict(recent=1.0), "recent"),
                      (dict(query_rank="far"), "query_rank"), (dict(seed=-1), "seed")]:
        with pytest.raises(ValueError, match=match): QuokaPolicy(**kw)
    with pytest.raises(TypeError, match="budget"): QuokaPolicy(budget="all")
    with pytest.raises(TypeError, match="decode"): QuokaPolicy(decode=1)
    with pytest.raises(ValueError, match="kind"):
        QuokaPolicy().earlier_indices(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4), "x")
    with pytest.raises(ValueError, match="one query"):
        QuokaPolicy(budget=2, sinks=1).earlier_indices(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4), "decode")
    with pytest.raises(ValueError, match="one query"):
        QuokaPolicy(budget=2).earlier_indices(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4), "decode")
    with pytest.raises(TypeError, match="select_fn"): BaselinePolicy(None)
    with pytest.raises(TypeError, match="budget"): BaselinePolicy(lambda q, k: None)
    with pytest.raises(TypeError, match="decode"): BaselinePolicy(mean_score_select, decode="yes")
    with pytest.raises(TypeError, match="selector"): LessIsMorePolicy(mean_score_select)


def _padded_context(B, Hkv, T, S, pads, kind="prefill"):
    "A context of S queries after T earlier keys where row b starts with pads[b] padding keys (the model's mask)."
    from sparsekv.attention import causal_mask
    from sparsekv.hf import AttentionContext
    real = torch.arange(T + S) >= torch.tensor(pads)[:, None]
    mask = causal_mask(S, T + S)[None, None] & real[:, None, None]
    return AttentionContext(layer_idx=0, kind=kind, query_positions=torch.arange(T, T + S),
                            key_positions=torch.arange(T + S).expand(B, Hkv, -1), mask=mask, scale=0.25), real


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_padded_rows_select_as_alone_with_anchors_at_their_first_token(kind):
    "Each padded row chooses its selection alone, shifted past its padding: sinks are its first real keys."
    g = torch.Generator().manual_seed(0)
    T, S, pads = 20, 4 if kind == "prefill" else 1, [0, 7, 16]
    q, k = torch.randn(3, 4, S, 16, generator=g), torch.randn(3, 2, T + S, 16, generator=g)
    ctx, real = _padded_context(3, 2, T, S, pads, kind)
    for pol in (QuokaPolicy(n_q=2, budget=6, sinks=2, recent=1), QuokaPolicy(n_q=2, budget=0.4),
                BaselinePolicy(mean_score_select, 6)):
        chosen = pol.select(q, k, None, ctx)
        assert chosen.dtype == torch.bool and torch.equal(chosen[:, :, T:], real[:, None, T:].expand(-1, 2, -1))
        for b, p in enumerate(pads):
            n = T - p
            want = pol.pick_earlier(q[b:b + 1], k[b:b + 1, :, p:T], ctx.row_context(b, n + S, S))
            if pol.fits(n): want = torch.arange(n).expand(1, 2, n)  # a row whose real keys fit attends to all
            for h in range(2): assert chosen[b, h, :T].nonzero()[:, 0].tolist() == (want[0, h] + p).tolist()
            assert not chosen[b, :, :p].any()  # no padding key
        if getattr(pol, "sinks", 0): assert chosen[1, :, 7:9].all()  # row 1's sinks: its first real tokens
