"Tests of sparsekv.hf: policies and patch, chunked prefill, evicting caches, on tiny Llama/Qwen3 models."
import copy

import pytest
import torch
from torch.testing import assert_close
from transformers import DynamicCache

from sparsekv.attention import attention_reference, checks, content_checks
from sparsekv.cache import EvictingCache, EvictionRule, SinkWindowCache, TopScoreRule
from sparsekv.hf import (
    _ACTIVE,
    ATTN_NAME,
    AttentionPolicy,
    DensePolicy,
    MaskPolicy,
    SelectionPolicy,
    active_patch,
    add_chunk_keys,
    attend_selected,
    chunked_prefill,
    dense_attention,
    heads_mask,
    patch,
)

ATOL = dict(atol=1e-5, rtol=0)


def _ids(B, S, seed, vocab=259):
    return torch.randint(3, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, n=5, **kw):
    return model.generate(ids, attention_mask=kw.pop("attention_mask", torch.ones_like(ids)), max_new_tokens=n,
                          do_sample=False, pad_token_id=0, **kw)


def _reference_policy(mask_fn):
    "A policy computing explicit-softmax attention under `mask_fn(k, ctx) & causal` (the project's reference)."
    class _Ref(AttentionPolicy):
        def attend(self, q, k, v, ctx):
            m = heads_mask(mask_fn(k, ctx), q.shape[1]) & heads_mask(ctx.full_mask(), q.shape[1])
            return attention_reference(q, k, v, m, ctx.scale)[0]
    return _Ref()


def _sink_window_mask(s, w):
    def mask(k, ctx):
        t, p = ctx.key_positions[:, :, None], ctx.query_positions[:, None]
        return (t <= p) & ((t < s) | (p - t < w))
    return mask


def _teacher_forced(model, ids, cache, prefill, chunk, policy=None):
    "Logits [B,S,V] of a chunked prefill of `prefill` tokens (all positions), then one decode step per token."
    rows = []
    with torch.no_grad(), patch(model, policy or DensePolicy()):
        for c in range(0, prefill, chunk):
            pos = torch.arange(c, min(c + chunk, prefill), device=ids.device)
            rows.append(model(ids[:, pos], past_key_values=cache, position_ids=pos[None]).logits)
        for t in range(prefill, ids.shape[1]):
            rows.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
    return torch.cat(rows, 1)


# --- attention helpers --------------------------------------------------------------------

@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 9), (7, 7), (5, 13)])
def test_dense_attention_matches_reference(G, sq, sk):
    g = torch.Generator().manual_seed(G * 100 + sq * 10 + sk)
    q = torch.randn(2, 2 * G, sq, 8, generator=g)
    k, v = torch.randn(2, 2, sk, 8, generator=g), torch.randn(2, 2, sk, 8, generator=g)
    assert_close(dense_attention(q, k, v), attention_reference(q, k, v)[0])
    for heads in {1, 2, 2 * G}:
        m = torch.rand(2, heads, sq, sk, generator=g) > 0.5
        m[0, 0, 0] = False  # a fully masked row gives 0
        assert_close(dense_attention(q, k, v, m, scale=0.3), attention_reference(q, k, v, heads_mask(m, 2 * G), 0.3)[0])


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("sq", [1, 4])
def test_attend_selected_is_masked_attention(G, sq):
    g = torch.Generator().manual_seed(G + sq)
    B, H, sk = 2, 2, 11
    q = torch.randn(B, H * G, sq, 8, generator=g)
    k, v = torch.randn(B, H, sk, 8, generator=g), torch.randn(B, H, sk, 8, generator=g)
    earlier = torch.stack([torch.randperm(sk - sq, generator=g)[:3] for _ in range(B * H)]).view(B, H, 3)
    idx = add_chunk_keys(earlier, sk, sq)
    sel = torch.zeros(B, H, 1, sk, dtype=torch.bool).scatter(3, idx[:, :, None], True)
    causal = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    assert_close(attend_selected(q, k, v, idx), attention_reference(q, k, v, heads_mask(sel & causal, H * G))[0])
    pad = torch.rand(B, 1, sq, sk, generator=g) > 0.3
    assert_close(attend_selected(q, k, v, idx, pad), attention_reference(q, k, v, heads_mask(sel & pad, H * G))[0])
    with pytest.raises(ValueError, match="must not repeat"):
        attend_selected(q, k, v, torch.zeros(B, H, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="must lie in"): attend_selected(q, k, v, idx + sk)
    with pytest.raises(TypeError, match="int64"): attend_selected(q, k, v, idx.int())
    with pytest.raises(ValueError, match="per KV head|Hkv"):
        attend_selected(q, k, v, idx, torch.ones(B, 3, sq, sk, dtype=torch.bool))


# --- patch ---------------------------------------------------------------------------------

def test_dense_patch_reproduces_and_restores(tiny_model):
    ids = _ids(2, 13, 0)
    impl = tiny_model.config._attn_implementation
    with torch.no_grad():
        ref = tiny_model(ids).logits
        with patch(tiny_model, DensePolicy()) as m:
            assert m is tiny_model and tiny_model.config._attn_implementation == ATTN_NAME
            assert_close(tiny_model(ids).logits, ref, **ATOL)
        assert tiny_model.config._attn_implementation == impl
        assert torch.equal(tiny_model(ids).logits, ref)
    assert len(_ACTIVE) == 0 and all(not m._forward_pre_hooks for m in tiny_model.modules())


def test_patch_nesting_and_exceptions(tiny_model):
    ids = _ids(1, 9, 1)
    impl = tiny_model.config._attn_implementation

    class Zero(AttentionPolicy):
        def attend(self, q, k, v, ctx): return torch.zeros_like(q)

    with torch.no_grad():
        ref = tiny_model(ids).logits
        with patch(tiny_model, DensePolicy()):
            with patch(tiny_model, Zero()):
                zero = tiny_model(ids).logits
                assert (zero - ref).abs().max() > 1e-3
            assert_close(tiny_model(ids).logits, ref, **ATOL)  # the outer policy is back
        with pytest.raises(RuntimeError, match="boom"):
            with patch(tiny_model, DensePolicy()): raise RuntimeError("boom")
    assert tiny_model.config._attn_implementation == impl and active_patch(tiny_model) is None
    assert content_checks()  # every step each patch's hooks opened is closed, in whichever order they ran
    with pytest.raises(TypeError, match="AttentionPolicy"):
        with patch(tiny_model, lambda q, k, v, ctx: q): pass
    with pytest.raises(TypeError, match="PreTrainedModel"):
        with patch(torch.nn.Linear(2, 2), DensePolicy()): pass


def test_policy_output_shape_is_checked(tiny_model):
    class Bad(AttentionPolicy):
        def attend(self, q, k, v, ctx): return q[:, :, :1]
    with torch.no_grad(), patch(tiny_model, Bad()), pytest.raises(ValueError, match="returned shape"):
        tiny_model(_ids(1, 5, 2))


def test_context(tiny_model):
    seen = []

    class Rec(AttentionPolicy):
        def attend(self, q, k, v, ctx):
            seen.append((ctx.layer_idx, ctx.kind, ctx.chunk_index, ctx.query_positions.tolist(),
                         tuple(ctx.key_positions.shape), ctx.key_positions[0, 0].tolist(), ctx.past_len,
                         ctx.module.layer_idx, ctx.cache_layer is not None))
            return super().attend(q, k, v, ctx)

    H = tiny_model.config.num_key_value_heads
    ids = _ids(1, 6, 3)
    cache, _ = chunked_prefill(tiny_model, ids[:, :5], 3, Rec())
    with torch.no_grad(), patch(tiny_model, Rec()): tiny_model(ids[:, 5:], past_key_values=cache)
    layer0 = [s for s in seen if s[0] == 0]
    assert layer0 == [(0, "prefill", 0, [0, 1, 2], (1, H, 3), [0, 1, 2], 0, 0, True),
                      (0, "prefill", 1, [3, 4], (1, H, 5), [0, 1, 2, 3, 4], 3, 0, True),
                      (0, "decode", None, [5], (1, H, 6), list(range(6)), 5, 0, True)]
    assert len(seen) == 3 * tiny_model.config.num_hidden_layers


# --- chunked prefill and generate ----------------------------------------------------------

def test_chunked_prefill_equals_full_forward(tiny_model):
    ids = _ids(2, 16, 4)
    with torch.no_grad(): full = tiny_model(ids).logits[:, -1]
    for chunk in [1, 3, 7, 16, 20]:
        cache, last = chunked_prefill(tiny_model, ids, chunk)
        assert_close(last, full, **ATOL)
        assert cache.get_seq_length() == 16
    cache, _ = chunked_prefill(tiny_model, ids[:, :9], 4)  # continuing a cache
    _, last = chunked_prefill(tiny_model, ids[:, 9:], 4, cache=cache)
    assert_close(last, full, **ATOL)
    with pytest.raises(ValueError, match="chunk_size"): chunked_prefill(tiny_model, ids, 0)
    with pytest.raises(ValueError, match="input_ids"): chunked_prefill(tiny_model, ids.float(), 4)


def test_generate_with_dense_policy(tiny_model):
    ids = _ids(1, 10, 5)
    with torch.no_grad():
        plain = _greedy(tiny_model, ids)
        with patch(tiny_model, DensePolicy()): assert torch.equal(_greedy(tiny_model, ids), plain)
        cache, _ = chunked_prefill(tiny_model, ids[:, :-1], 4)
        with patch(tiny_model, DensePolicy()):
            assert torch.equal(_greedy(tiny_model, ids, past_key_values=cache), plain)
        # a left-padded batch: the model's padding mask reaches the policy
        batch = torch.stack([ids[0], torch.cat([torch.zeros(3, dtype=torch.long), ids[0, 3:]])])
        am = torch.ones_like(batch)
        am[1, :3] = 0
        plain = _greedy(tiny_model, batch, attention_mask=am)
        with patch(tiny_model, DensePolicy()): assert torch.equal(_greedy(tiny_model, batch, attention_mask=am), plain)
        # transformers' StaticCache returns unwritten slots as keys: refused (they would be read at wrong positions)
        with patch(tiny_model, DensePolicy()), pytest.raises(ValueError, match="key slots for 10 tokens"):
            _greedy(tiny_model, ids, cache_implementation="static")


def test_mask_and_selection_policies_match_reference(tiny_model):
    "Each KV head keeps its own random half of the earlier keys plus the chunk; three routes agree."
    def earlier(ctx):
        g = torch.Generator().manual_seed(ctx.layer_idx * 1000 + ctx.past_len)
        B, H, _ = ctx.key_positions.shape
        halves = [torch.randperm(ctx.past_len, generator=g)[:ctx.past_len // 2] for _ in range(B * H)]
        return torch.stack(halves).view(B, H, -1)

    def subset(k, ctx):
        m = torch.zeros(ctx.key_positions.shape, dtype=torch.bool).scatter(2, earlier(ctx), True)
        m[:, :, ctx.past_len:] = True
        return m[:, :, None]

    class Mask(MaskPolicy):
        def mask(self, q, k, v, ctx): return subset(k, ctx)

    class Select(SelectionPolicy):
        def select(self, q, k, v, ctx): return add_chunk_keys(earlier(ctx), k.shape[2], q.shape[2])

    ids = _ids(2, 14, 6)
    last = {n: chunked_prefill(tiny_model, ids, 4, p)[1] for n, p in
            [("mask", Mask()), ("select", Select()), ("ref", _reference_policy(subset))]}
    assert_close(last["mask"], last["ref"], **ATOL)
    assert_close(last["select"], last["ref"], **ATOL)
    with torch.no_grad(): dense = tiny_model(ids).logits[:, -1]
    assert (last["ref"] - dense).abs().max() > 1e-4


# --- evicting caches -----------------------------------------------------------------------

def _key_score(layer_idx, keys, values, positions):
    "A fixed random projection of each key: scores that differ per head."
    return keys @ torch.randn(keys.shape[-1], generator=torch.Generator().manual_seed(11 + layer_idx))


def _top_score_mask(s, w, k):
    "Brute force: per query p, sinks + window + top-k of E(p) = {s <= t <= p-w} by score (ties: earlier)."
    def mask(keys, ctx):
        B, H, S = keys.shape[:3]
        sc = _key_score(ctx.layer_idx, keys, None, None)
        m = torch.zeros(B, H, S, S, dtype=torch.bool)
        for b in range(B):
            for h in range(H):
                for p in range(S):
                    m[b, h, p, :min(s, p + 1)] = True
                    m[b, h, p, max(0, p - w + 1):p + 1] = True
                    top = sorted(range(s, p - w + 1), key=lambda t: (-sc[b, h, t].item(), t))[:k]
                    for t in top: m[b, h, p, t] = True
        return m
    return mask


def test_evicting_cache_equals_dynamic_when_budget_exceeds_sequence(tiny_model):
    ids = _ids(2, 20, 7)
    dyn = _teacher_forced(tiny_model, ids, DynamicCache(), 9, 4)
    caches = [SinkWindowCache(2, 64), EvictingCache(TopScoreRule(2, 3, 64, _key_score)), EvictingCache(EvictionRule())]
    for cache in caches:
        assert_close(_teacher_forced(tiny_model, ids, cache, 9, 4), dyn, **ATOL)
        assert cache.get_seq_length() == 20 and cache.layers[1].positions.shape[-1] == 20
    prompt = ids[:1, :8]
    with torch.no_grad():
        plain = _greedy(tiny_model, prompt)
        with patch(tiny_model, DensePolicy()):
            assert torch.equal(_greedy(tiny_model, prompt, past_key_values=SinkWindowCache(2, 64)), plain)


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_sink_window_cache_matches_masked_reference(tiny_model, chunk):
    ids = _ids(2, 30, 8)
    with torch.no_grad(), patch(tiny_model, _reference_policy(_sink_window_mask(3, 5))): ref = tiny_model(ids).logits
    cache = SinkWindowCache(3, 5)
    assert_close(_teacher_forced(tiny_model, ids, cache, 15, chunk), ref, **ATOL)
    # the sinks and the window, whose oldest entry (25) the next token would overwrite in place (a ring)
    assert sorted(cache.layers[0].positions[1, 0].tolist()) == [0, 1, 2, 25, 26, 27, 28, 29]
    with torch.no_grad(): dense = tiny_model(ids).logits
    assert (ref - dense)[:, 8:].abs().max() > 1e-4


def test_top_score_cache_keeps_per_head_positions(tiny_model):
    ids = _ids(2, 26, 9)
    with torch.no_grad(), patch(tiny_model, _reference_policy(_top_score_mask(2, 3, 4))): ref = tiny_model(ids).logits
    cache = EvictingCache(TopScoreRule(2, 3, 4, _key_score))
    assert_close(_teacher_forced(tiny_model, ids, cache, 11, 4), ref, **ATOL)
    kept = cache.layers[1].positions
    assert kept.shape[-1] == 2 + 2 + 4
    assert (kept[:, :, :2] == torch.tensor([0, 1])).all() and (kept[:, :, -2:] == torch.tensor([24, 25])).all()
    assert any(not torch.equal(kept[b, 0], kept[b, h]) for b in range(2) for h in range(1, kept.shape[1]))


def test_sink_window_generate_matches_reference(tiny_model):
    prompt = _ids(1, 9, 10)
    with torch.no_grad():
        with patch(tiny_model, DensePolicy()):
            out = _greedy(tiny_model, prompt, n=8, past_key_values=SinkWindowCache(2, 4))
        seq = prompt
        with patch(tiny_model, _reference_policy(_sink_window_mask(2, 4))):
            for _ in range(8): seq = torch.cat([seq, tiny_model(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


def test_beam_search_with_evicting_cache(tiny_model):
    prompt = _ids(1, 7, 12)
    with torch.no_grad():
        plain = _greedy(tiny_model, prompt, num_beams=3)
        with patch(tiny_model, DensePolicy()):
            beams = _greedy(tiny_model, prompt, num_beams=3, past_key_values=SinkWindowCache(1, 64))
        assert torch.equal(beams, plain)
        with patch(tiny_model, DensePolicy()):
            _greedy(tiny_model, prompt, num_beams=3, past_key_values=SinkWindowCache(1, 3))


def test_evicting_cache_errors(tiny_model):
    ids = _ids(2, 8, 13)
    with pytest.raises(RuntimeError, match="only inside sparsekv.hf.patch"):
        with torch.no_grad(): tiny_model(ids, past_key_values=SinkWindowCache(1, 3))
    am = torch.ones_like(ids)
    am[1, :2] = 0
    with pytest.raises(ValueError, match="unpadded"):
        with torch.no_grad(), patch(tiny_model, DensePolicy()):
            _greedy(tiny_model, ids, attention_mask=am, past_key_values=SinkWindowCache(1, 3))

    class Ragged(EvictionRule):  # keeps a different number of entries in head 0
        def visible(self, layer, query_positions):
            vis = super().visible(layer, query_positions).clone()
            vis[:, 0, :, 0] = False
            return vis
    with pytest.raises(ValueError, match="different numbers of entries"):
        chunked_prefill(tiny_model, ids, 4, cache=EvictingCache(Ragged()))
    bad = TopScoreRule(1, 2, 2, lambda i, k, v, p: torch.full(k.shape[:3], float("nan")))
    # the scores' values are a content check: inside a patched model's step only under checks()
    with pytest.raises(ValueError, match="finite scores"), checks():
        chunked_prefill(tiny_model, ids, 4, cache=EvictingCache(bad))
    chunked_prefill(tiny_model, ids, 4, cache=EvictingCache(bad))  # without: no read back, no error
    with pytest.raises(ValueError, match="window"): SinkWindowCache(1, 0)
    with pytest.raises(ValueError, match="sink"): SinkWindowCache(-1, 2)
    with pytest.raises(ValueError, match="k must be"): TopScoreRule(1, 2, -1)
    with pytest.raises(TypeError, match="EvictionRule"): EvictingCache("sink")


def test_crop(tiny_model):
    ids = _ids(1, 10, 14)
    cache, _ = chunked_prefill(tiny_model, ids, 3, cache=SinkWindowCache(2, 4))
    with pytest.raises(ValueError, match="already evicted"): cache.crop(-2)
    # transformers' convention: minus the number of tokens to drop; an absolute length is refused
    with pytest.raises(ValueError, match="tokens_to_remove must be an int <= 0"): cache.crop(8)
    cache, _ = chunked_prefill(tiny_model, ids, 3, cache=SinkWindowCache(2, 64))
    cache.crop(-3)
    assert cache.get_seq_length() == 7 and cache.layers[0].positions[0, 0].tolist() == list(range(7))
    _, last = chunked_prefill(tiny_model, ids[:, 7:], 2, cache=cache)
    with torch.no_grad(): assert_close(last, tiny_model(ids).logits[:, -1], **ATOL)


@pytest.mark.gpu
def test_on_cuda(tiny_model):
    "The same identities with the model, caches and policies on a CUDA device."
    m = copy.deepcopy(tiny_model).cuda()
    ids = _ids(2, 24, 15).cuda()
    tol = dict(atol=1e-4, rtol=0)
    with torch.no_grad():
        ref = m(ids).logits
        with patch(m, DensePolicy()): assert_close(m(ids).logits, ref, **tol)
        assert_close(chunked_prefill(m, ids, 5)[1], ref[:, -1], **tol)
        with patch(m, _reference_policy(_sink_window_mask(3, 5))): ref_sw = m(ids).logits
    assert_close(_teacher_forced(m, ids, SinkWindowCache(3, 5), 12, 4), ref_sw, **tol)


def test_chunked_prefill_refuses_a_bool_chunk_size(tiny_model):
    "chunk_size=True would run as 1: refused like any non-int."
    for bad in (True, False, 2.0):
        with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
            chunked_prefill(tiny_model, _ids(1, 6, 1), bad)


def test_follow_batch_ops_moves_side_state_once_and_per_copy():
    "A hooked layer moves its side state with its rows; one hook per owner; a deep copy moves only its own rows."
    from transformers.cache_utils import DynamicLayer

    from sparsekv.cache import follow_batch_ops
    layer, side, k = DynamicLayer(), {}, torch.randn(3, 2, 4, 8)
    layer.update(k, k)
    side["x"] = k.clone()
    for _ in range(2): follow_batch_ops(layer, 7, lambda fn: side.update(x=fn(side["x"])))
    layer.reorder_cache(torch.tensor([1, 2, 0]))
    layer.batch_repeat_interleave(3)
    layer.batch_select_indices(torch.tensor([0, 8]))
    assert torch.equal(layer.keys, k[[1, 0]]) and torch.equal(side["x"], layer.keys)
    twin = copy.deepcopy(layer)
    twin.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(twin.keys, k[[0, 0]]) and torch.equal(layer.keys, k[[1, 0]])


def test_content_checks_run_in_a_step_only_under_checks(tiny_llama):
    """A NaN key in a patched model's step: not looked for by default (no value is read back), refused by name under
    `checks()`; the same call outside a step (quoka_select called directly) refuses it either way."""
    from sparsekv import methods
    from sparsekv.quoka.select import quoka_select
    model = copy.deepcopy(tiny_llama)
    with torch.no_grad(): model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    ids, quoka = _ids(1, 40, 3), methods.make("quoka", 8, **methods.get("quoka").small_params)
    with torch.no_grad(), quoka.patch(model) as cache:
        chunked_prefill(model, ids, quoka.chunk_size, cache=cache)  # runs: the check is off in the step
    with pytest.raises(ValueError, match="k_cache contains NaN or inf"), checks():
        with torch.no_grad(), quoka.patch(model) as cache: chunked_prefill(model, ids, quoka.chunk_size, cache=cache)
    k = torch.randn(1, 2, 20, 16)
    with pytest.raises(ValueError, match="k_cache contains NaN or inf"):
        quoka_select(torch.randn(1, 4, 4, 16), k.index_fill(2, torch.tensor([3]), float("nan")), 4, 8)


def test_token_ids_outside_the_vocabulary_are_refused(tiny_llama):
    "Ids < 0 or >= the vocabulary: a clear error naming input_ids, not an IndexError deep in the embedding."
    from sparsekv.hf import Method
    V = tiny_llama.get_input_embeddings().num_embeddings
    for bad in (-1, V, V + 7):
        ids = _ids(2, 8, 0)
        ids[1, 2] = bad
        with pytest.raises(ValueError, match=rf"input_ids must be token ids in \[0, {V}\)"):
            chunked_prefill(tiny_llama, ids, 4)
        with pytest.raises(ValueError, match="the model's vocabulary"):
            Method(8).generate(tiny_llama, ids, max_new_tokens=2)


def test_a_cache_with_no_new_token_to_feed_is_refused_clearly(tiny_llama):
    "generate with a cache holding the whole prompt (chunked_prefill of all of it) or reused for a new prompt."
    from sparsekv.hf import Method
    ids, other = _ids(1, 10, 1), _ids(1, 6, 2)
    full, _ = chunked_prefill(tiny_llama, ids, 4)
    with torch.no_grad(), patch(tiny_llama, DensePolicy()):
        with pytest.raises(ValueError, match=r"holds 10 tokens .* prefill all but the last prompt token"):
            _greedy(tiny_llama, ids, past_key_values=full)
        used = SinkWindowCache(2, 64)
        _greedy(tiny_llama, ids, past_key_values=used)
        with pytest.raises(ValueError, match="for a new prompt, pass a fresh cache"):
            _greedy(tiny_llama, other, past_key_values=used)
        # the documented route: all but the last token, then the whole prompt
        cache, _ = chunked_prefill(tiny_llama, ids[:, :-1], 4)
        assert torch.equal(_greedy(tiny_llama, ids, past_key_values=cache), _greedy(tiny_llama, ids))
    assert "prepare_inputs_for_generation" not in tiny_llama.__dict__  # the check leaves with the patch
    with pytest.raises(ValueError, match="past_key_values: Method.generate makes a fresh cache"):
        Method(8).generate(tiny_llama, ids, past_key_values=full)


def test_padded_chunked_prefill_equals_rows_alone(tiny_model):
    "Left-padded rows: last logits and cached keys of each row as alone, for every grouping of chunk boundaries."
    lens, S = (17, 11, 6, 17), 17
    ids, mask = torch.zeros(4, S, dtype=torch.long), torch.zeros(4, S, dtype=torch.long)
    for b, n in enumerate(lens): ids[b, S - n:], mask[b, S - n:] = _ids(1, n, 10 + b)[0], 1
    for cs in (1, 3, 4, 6, 32):
        cache, last = chunked_prefill(tiny_model, ids, cs, attention_mask=mask)
        assert cache.get_seq_length() == S
        for b, n in enumerate(lens):
            alone, want = chunked_prefill(tiny_model, ids[b:b + 1, S - n:], cs)
            assert_close(last[b], want[0], atol=1e-4, rtol=0)
            for layer, one in zip(cache.layers, alone.layers):
                assert_close(layer.keys[b, :, S - n:], one.keys[0], atol=1e-5, rtol=0)
                assert_close(layer.values[b, :, S - n:], one.values[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="evicting caches take unpadded batches only"):
        chunked_prefill(tiny_model, ids, 4, cache=SinkWindowCache(2, 4), attention_mask=mask)
