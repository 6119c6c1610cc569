"Tests of sparsekv.kvpop.cache: the bounded KVpop cache decodes exactly what the training-time mask computes."
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from sparsekv.hf import DensePolicy, chunked_prefill, patch
from sparsekv.kvpop.cache import KVpopCache, KVpopMaskPolicy, KVpopPolicy, KVpopRule, KVpopScorers, random_scorers
from sparsekv.kvpop.cutoff import static_priority
from sparsekv.kvpop.mask import kvpop_mask_reference

BUDGETS = [(2, 3, 4), (0, 1, 3), (1, 5, 1)]


def ids_of(model, B, S, seed=0):
    return torch.randint(3, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def make_scorers(model, kind, seed, window):
    "Random MLP scorers, mLSTM scorers with readout delay = window (KVpop's choice), or immediate readout ('mlstm0')."
    if kind == "mlp": return random_scorers(model, seed=seed)
    return random_scorers(model, seed=seed, kind="mlstm", delay=window if kind == "mlstm" else 0)


def policy_for(kind):
    "Recurrent scorers need the masking decode policy; a stateless scorer decodes under plain dense attention."
    return DensePolicy() if kind == "mlp" else KVpopPolicy()


@pytest.mark.parametrize("kind", ["mlp", "mlstm", "mlstm0"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_decode_equals_teacher_forced_mask(tiny_llama64_gqa_mha, budget, kind):
    model = tiny_llama64_gqa_mha
    s, w, k = budget
    scorers, ids = make_scorers(model, kind, sum(budget), w), ids_of(model, 2, 20)
    with torch.no_grad(), patch(model, KVpopMaskPolicy(scorers, s, w, k)): want = model(ids).logits
    cache, got, sizes = KVpopCache(scorers, s, w, k), [], set()
    with torch.no_grad(), patch(model, policy_for(kind)):
        for t in range(ids.shape[1]):
            got.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
            sizes |= {l.positions.shape[-1] for l in cache.layers}
    assert_close(torch.cat(got, 1), want)
    # constant once full: the next query fills the window's last slot; a delayed scorer keeps one pending token more
    assert max(sizes) == s + w + k - (kind != "mlstm")
    with torch.no_grad(): dense = model(ids).logits
    assert (dense - want).abs().max() > 1e-3  # the budget binds: the agreement is not the dense one


@pytest.mark.parametrize("kind", ["mlp", "mlstm", "mlstm0"])
def test_batch_operations_move_the_scorer_state(tiny_llama64_gqa_mha, kind):
    """Beam search's `reorder_cache`, then `batch_repeat_interleave` and `batch_select_indices`, move the entries and a
    recurrent scorer's state and queue: decoding on equals a cache fed the moved rows from the start."""
    model = tiny_llama64_gqa_mha
    s, w, k = 1, 3, 3
    scorers, ids = make_scorers(model, kind, 4, w), ids_of(model, 3, 18, seed=6)
    rows = torch.tensor([2, 0, 1])[[1, 2]]  # reorder [2, 0, 1], repeat 2, select [2, 5] (the 2nd and 3rd rows)
    moved, ref, ref3 = (KVpopCache(scorers, s, w, k) for _ in range(3))
    got, want, want3 = [], [], []
    with torch.no_grad(), patch(model, policy_for(kind)):
        for t in range(ids.shape[1]):
            if t == 9: moved.reorder_cache(torch.tensor([2, 0, 1]))
            if t == 12:
                moved.batch_repeat_interleave(2)
                moved.batch_select_indices(torch.tensor([2, 5]))
            order = torch.arange(3) if t < 9 else torch.tensor([2, 0, 1]) if t < 12 else rows
            got.append(model(ids[order, t:t + 1], past_key_values=moved).logits)
            want.append(model(ids[rows, t:t + 1], past_key_values=ref).logits)
            want3.append(model(ids[[2, 0, 1], t:t + 1], past_key_values=ref3).logits)
    assert_close(torch.cat(got[9:12], 1), torch.cat(want3[9:12], 1))
    assert_close(torch.cat(got[12:], 1), torch.cat(want[12:], 1))


class RecordingMask(KVpopMaskPolicy):
    "KVpopMaskPolicy that records each layer's static priorities."
    def mask(self, q, k, v, ctx):
        self.prio = getattr(self, "prio", {})
        self.prio[ctx.layer_idx] = self.scorers.priority(ctx.layer_idx, k, v, ctx.key_positions)
        return super().mask(q, k, v, ctx)


def test_kept_positions_are_the_reference_mask_row(tiny_llama64_gqa_mha):
    """After decoding S tokens each head keeps what the brute-force KVpop mask shows query S (minus itself);
    scores are priorities."""
    model = tiny_llama64_gqa_mha
    s, w, k, S = 1, 2, 3, 15
    scorers, ids = random_scorers(model, seed=5), ids_of(model, 1, S + 1, seed=3)
    cache = KVpopCache(scorers, s, w, k)
    with torch.no_grad(), patch(model, DensePolicy()):
        for t in range(S): model(ids[:, t:t + 1], past_key_values=cache)
    pol = RecordingMask(scorers, s, w, k)
    with torch.no_grad(), patch(model, pol): model(ids)
    for l, layer in enumerate(cache.layers):
        row = kvpop_mask_reference(pol.prio[l], k, s, w)[0, :, S, :S]
        for h in range(row.shape[0]): assert layer.positions[0, h].tolist() == row[h].nonzero()[:, 0].tolist()
        assert_close(layer.scores, pol.prio[l].gather(2, layer.positions))


@pytest.mark.parametrize("kind", ["mlp", "mlstm", "mlstm0"])
def test_chunked_prefill_then_generate(tiny_llama64_gqa_mha, kind):
    model = tiny_llama64_gqa_mha
    s, w, k = 2, 3, 4
    scorers, ids = make_scorers(model, kind, 1, w), ids_of(model, 1, 16, seed=2)
    with torch.no_grad(), patch(model, KVpopMaskPolicy(scorers, s, w, k)): want = model(ids).logits
    cache = KVpopCache(scorers, s, w, k)
    _, last = chunked_prefill(model, ids[:, :11], 4, policy_for(kind), cache)
    assert_close(last, want[:, 10])
    with torch.no_grad(), patch(model, policy_for(kind)): nxt = model(ids[:, 11:14], past_key_values=cache).logits
    assert_close(nxt, want[:, 11:14])  # a second chunk after the prefill
    prompt = ids[:, :6]
    with torch.no_grad(), patch(model, policy_for(kind)):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             past_key_values=KVpopCache(scorers, s, w, k), max_new_tokens=9, do_sample=False)
    seq = prompt
    with torch.no_grad(), patch(model, KVpopMaskPolicy(scorers, s, w, k)):
        for _ in range(9): seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("kind", ["mlstm", "mlstm0"])
@pytest.mark.parametrize("chunk", [1, 2, 5, 16])
def test_recurrent_scores_equal_parallel_priorities(tiny_llama64_gqa_mha, kind, chunk):
    """A recurrent scorer's scores in the cache after prefill chunks of one token, of fewer and more tokens than its
    delay, and of the whole prompt, are its parallel (chunkwise) priorities; the tokens not yet read are pending."""
    model = tiny_llama64_gqa_mha
    s, w, k = 2, 3, 16  # k >= the prompt: nothing is evicted, every layer holds every token
    scorers, ids = make_scorers(model, kind, 4, w), ids_of(model, 2, 16, seed=3)
    cache = KVpopCache(scorers, s, w, k)
    chunked_prefill(model, ids, chunk, KVpopPolicy(), cache)
    for l, layer in enumerate(cache.layers):
        assert layer.positions.shape[-1] == ids.shape[1]
        read = layer.positions < layer.kvpop_readout.pending_from
        assert int(read.sum(-1).min()) == ids.shape[1] - (w if kind == "mlstm" else 0)
        want = scorers.priority(l, layer.keys, layer.values, layer.positions)
        assert_close(layer.scores[read], want[read], rtol=1e-4, atol=1e-5)


def test_priority_is_static_priority_and_mask_is_reference():
    torch.manual_seed(0)
    sc = KVpopScorers.mlp(1, 2, 4, n=3)
    for p in sc.parameters(): nn.init.normal_(p)
    k, v = torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4)
    pos = torch.arange(12).expand(1, 2, 12)
    prio = sc.priority(0, k, v, pos)
    assert_close(prio, static_priority(sc.raw(0, k, v), sc.decays[0](), 3))
    assert_close(sc.priority(0, k[:, :, 5:], v[:, :, 5:], pos[:, :, 5:]), prio[:, :, 5:])
    pol = KVpopMaskPolicy(sc, 1, 2, 3)
    from sparsekv.hf import AttentionContext
    ctx = AttentionContext(layer_idx=0, kind="prefill", query_positions=torch.arange(12), key_positions=pos, mask=None,
                           scale=0.5)
    assert torch.equal(pol.mask(None, k, v, ctx), kvpop_mask_reference(prio, 3, 1, 2))


def test_delayed_scorer_needs_kvpop_policy(tiny_llama64_gqa_mha):
    model = tiny_llama64_gqa_mha
    scorers = make_scorers(model, "mlstm", 0, 3)
    with pytest.raises(RuntimeError, match="only under KVpopPolicy"):
        chunked_prefill(model, ids_of(model, 1, 5), 5, DensePolicy(), KVpopCache(scorers, 1, 3, 2))
    with pytest.raises(ValueError, match="delays must be one value <= window"): KVpopRule(scorers, 1, 2, 2)


def test_bad_arguments():
    sc = KVpopScorers.mlp(2, 2, 4)
    with pytest.raises(ValueError, match="k must be an int >= 1"): KVpopRule(sc, 1, 2, 0)
    with pytest.raises(TypeError, match="scorers must be a KVpopScorers"): KVpopRule([sc], 1, 2, 3)
    with pytest.raises(ValueError, match="one scorer and one LogDecay per layer"):
        KVpopScorers(list(sc.scorers), [sc.decays[0]])
    with pytest.raises(ValueError, match="layer_idx must lie in"):
        sc.priority(2, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, dtype=torch.long))


def random_layer_states(recurrent: bool, seed: int, n: int):
    """n random KVpop layer states (2 rows, 3 heads, tied priorities, recurrent ones with pending entries):
    (rule, layer, first pending position, s, w, k) each."""
    from types import SimpleNamespace
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        s, w, k = (int(x) for x in torch.randint(1, 7, (3,), generator=gen))
        seen = int(torch.randint(s + w, s + w + 4 * k, (1,), generator=gen))
        m = min(seen, s + w + k + int(torch.randint(0, 3, (1,), generator=gen)))
        pos = torch.stack([torch.randperm(seen, generator=gen)[:m].sort().values for _ in range(6)]).view(2, 3, m)
        sco = torch.randint(0, 3, pos.shape, generator=gen).float()
        rule = KVpopRule(KVpopScorers.mlstm(1, 1, 2, w) if recurrent else KVpopScorers.mlp(1, 1, 2), s, w, k)
        pend = seen - int(torch.randint(0, w + 1, (1,), generator=gen)) if recurrent else seen
        layer = SimpleNamespace(positions=pos, scores=sco, seen=seen, kvpop_readout=SimpleNamespace(pending_from=pend))
        yield rule, layer, pend, s, w, k


@pytest.mark.parametrize("recurrent", [False, True])
def test_visible_equals_stable_sort_reference(recurrent):
    """KVpopRule.visible (no sort when at most k + 1 entries are eligible) equals the stable-sort reference on random
    states with ties."""
    from sparsekv.kvpop.cache import kvpop_visible_reference
    for rule, layer, pend, s, w, k in random_layer_states(recurrent, 7 + recurrent, 200):
        seen, pos, sco = layer.seen, layer.positions, layer.scores
        for qp in (torch.tensor([seen]), torch.tensor([seen - 1]), torch.arange(max(seen - 5, 0), seen + 1)):
            assert torch.equal(rule.visible(layer, qp), kvpop_visible_reference(pos, sco, qp, s, w, k, pend))


@pytest.mark.parametrize("recurrent", [False, True])
def test_block_mask_is_visible(recurrent):
    "The FlexAttention mask_mod of KVpopRule.block_mask, materialized, is `visible` repeated over each KV head's group."
    from torch.nn.attention.flex_attention import create_mask
    for trial, (rule, layer, *_) in enumerate(random_layer_states(recurrent, 11 + recurrent, 40)):
        n = layer.positions.shape[-1]
        layer.scores[0, 1, : n // 2] = float("-inf")  # eligible -inf priorities rank above the rest
        G = 1 + trial % 3
        for qp in (torch.tensor([layer.seen]), torch.arange(max(layer.seen - 5, 0), layer.seen + 1)):
            got = create_mask(rule.block_mask(layer, qp, G).mask_mod, 2, 3 * G, len(qp), n)
            assert torch.equal(got, rule.visible(layer, qp).repeat_interleave(G, 1))


@pytest.mark.parametrize("kind", ["mlp", "mlstm", "mlstm0"])
def test_flex_prefill_equals_the_mask(tiny_llama64_gqa_mha, kind):
    "KVpopPolicy's FlexAttention prefill gives the teacher-forced mask's logits, in chunks and for a whole prompt."
    model = tiny_llama64_gqa_mha
    s, w, k = 2, 3, 4
    scorers, ids = make_scorers(model, kind, 3, w), ids_of(model, 2, 20, seed=4)
    with torch.no_grad(), patch(model, KVpopMaskPolicy(scorers, s, w, k)): want = model(ids).logits
    _, last = chunked_prefill(model, ids[:, :17], 6, KVpopPolicy("flex"), KVpopCache(scorers, s, w, k))
    assert_close(last, want[:, 16])
    with torch.no_grad(), patch(model, KVpopPolicy("flex")):
        assert_close(model(ids, past_key_values=KVpopCache(scorers, s, w, k)).logits, want)
    with pytest.raises(ValueError, match="backend must be one of"): KVpopPolicy("triton")


@pytest.mark.parametrize("kind", ["mlp", "mlstm", "mlstm0"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_buffered_layers_equal_plain_layers(tiny_llama64_gqa_mha, kind, budget):
    """KVpopCache (KVpopLayer buffers, sort-free eviction) decodes like EvictingCache(KVpopRule) (concatenate, sort,
    gather), chunks included."""
    from sparsekv.cache import EvictingCache
    from sparsekv.kvpop.cache import cache_nbytes
    model = tiny_llama64_gqa_mha
    s, w, k = budget
    scorers, ids = make_scorers(model, kind, 3, w), ids_of(model, 2, 30, seed=4)
    fast, plain = KVpopCache(scorers, s, w, k), EvictingCache(KVpopRule(scorers, s, w, k))
    pol, sizes, caps = policy_for(kind), [], set()
    with torch.no_grad(), patch(model, pol):
        for a, b in [(0, 5), (5, 6), (6, 13)] + [(t, t + 1) for t in range(13, 30)]:  # chunks, then decode
            got = model(ids[:, a:b], past_key_values=fast).logits
            assert_close(got, model(ids[:, a:b], past_key_values=plain).logits)
            for lf, lp in zip(fast.layers, plain.layers):
                assert torch.equal(lf.positions, lp.positions) and torch.equal(lf.scores, lp.scores)
                assert torch.equal(lf.keys, lp.keys) and torch.equal(lf.values, lp.values)
            if a >= 13:  # decode: buffers of s + w + k + 1 slots, never reallocated
                caps |= {(l._buffers[0].shape[2], l._buffers[0].data_ptr()) for l in fast.layers}
                sizes.append(cache_nbytes(fast))
    assert {c for c, _ in caps} == {s + w + k + 1} and len(caps) == len(fast.layers)
    assert len(set(sizes[w:])) == 1


def test_prefill_chunk_grows_then_gives_back(tiny_llama64_gqa_mha):
    "A chunk larger than the free slots grows the buffers; the eviction after it returns to s + w + k + 1 slots."
    from sparsekv.kvpop.cache import cache_nbytes
    model = tiny_llama64_gqa_mha
    s, w, k = 1, 2, 2
    scorers, ids = random_scorers(model, seed=1), ids_of(model, 1, 40, seed=6)
    cache = KVpopCache(scorers, s, w, k)
    chunked_prefill(model, ids[:, :4], 4, DensePolicy(), cache)
    small = cache_nbytes(cache)
    with torch.no_grad(), patch(model, DensePolicy()):
        model(ids[:, 4:30], past_key_values=cache)
        assert {l._buffers[0].shape[2] for l in cache.layers} == {s + w + k + 1}
        assert cache_nbytes(cache) == small
        with torch.no_grad(), patch(model, KVpopMaskPolicy(scorers, s, w, k)): want = model(ids[:, :31]).logits[:, -1]
        assert_close(model(ids[:, 30:31], past_key_values=cache).logits[:, -1], want)
