"Tests of sparsekv.kvpop.cache: the bounded KVpop cache decodes exactly what the training-time mask computes."
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from sparsekv.hf import DensePolicy, chunked_prefill, patch
from sparsekv.kvpop.cache import KVpopCache, KVpopMaskPolicy, KVpopPolicy, KVpopRule, KVpopScorers, random_scorers
from sparsekv.kvpop.cutoff import static_priority
from sparsekv.kvpop.mask import kvpop_mask_reference
from sparsekv.models import load_model

BUDGETS = [(2, 3, 4), (0, 1, 3), (1, 5, 1)]


@pytest.fixture(scope="module", params=[{}, dict(num_kv_heads=4)], ids=["gqa", "mha"])
def model(request):
    return load_model("tiny-llama", dtype=torch.float64, **request.param)[0]


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
def test_decode_equals_teacher_forced_mask(model, budget, kind):
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


class RecordingMask(KVpopMaskPolicy):
    "KVpopMaskPolicy that records each layer's static priorities."
    def mask(self, q, k, v, ctx):
        self.prio = getattr(self, "prio", {})
        self.prio[ctx.layer_idx] = self.scorers.priority(ctx.layer_idx, k, v, ctx.key_positions)
        return super().mask(q, k, v, ctx)


def test_kept_positions_are_the_reference_mask_row(model):
    "After decoding S tokens each head keeps what the brute-force KVpop mask shows query S (minus itself); scores are priorities."
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
def test_chunked_prefill_then_generate(model, kind):
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
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=KVpopCache(scorers, s, w, k),
                             max_new_tokens=9, do_sample=False)
    seq = prompt
    with torch.no_grad(), patch(model, KVpopMaskPolicy(scorers, s, w, k)):
        for _ in range(9): seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


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
    ctx = AttentionContext(layer_idx=0, kind="prefill", query_positions=torch.arange(12), key_positions=pos, mask=None, scale=0.5)
    assert torch.equal(pol.mask(None, k, v, ctx), kvpop_mask_reference(prio, 3, 1, 2))


def test_delayed_scorer_needs_kvpop_policy(model):
    scorers = make_scorers(model, "mlstm", 0, 3)
    with pytest.raises(RuntimeError, match="only under KVpopPolicy"):
        chunked_prefill(model, ids_of(model, 1, 5), 5, DensePolicy(), KVpopCache(scorers, 1, 3, 2))
    with pytest.raises(ValueError, match="delays must be one value <= window"): KVpopRule(scorers, 1, 2, 2)


def test_bad_arguments():
    sc = KVpopScorers.mlp(2, 2, 4)
    with pytest.raises(ValueError, match="k must be an int >= 1"): KVpopRule(sc, 1, 2, 0)
    with pytest.raises(TypeError, match="scorers must be a KVpopScorers"): KVpopRule([sc], 1, 2, 3)
    with pytest.raises(ValueError, match="one scorer and one LogDecay per layer"): KVpopScorers(list(sc.scorers), [sc.decays[0]])
    with pytest.raises(ValueError, match="layer_idx must lie in"): sc.priority(2, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4),
                                                                                 torch.zeros(1, 2, 3, dtype=torch.long))
