"""Tests of sparsekv.kvpop.dms: Gumbel-sigmoid, the delayed-eviction mask, the student protocol, the bounded cache,
eviction ratios, kvpress."""
import pytest
import torch
from torch.testing import assert_close
from transformers import DynamicCache

from sparsekv.distill import DistillStudent
from sparsekv.hf import patch
from sparsekv.kvpop.dms import (
    DMSStudent,
    dms_attention,
    dms_mask_bias,
    dms_mask_bias_reference,
    dms_visible,
    eviction_ratios,
    gumbel_sigmoid,
    gumbel_sigmoid_mean,
    ratio_loss,
    ratio_schedule,
    target_for_budget,
)
from sparsekv.models import load_model


def random_student(model, window=4, seed=0, **kw):
    "A student with random decision MLPs and gates centred at 0 (about half the tokens marked), in eval mode."
    torch.manual_seed(seed)
    st = DMSStudent.for_model(model, window=window, target=0.5, ramp_steps=10, init_logit=0.0, **kw).eval()
    for p in st.decisions.scorers.parameters(): p.data.add_(torch.randn_like(p))
    return st


def ids_of(S, B=2, seed=0):
    return torch.randint(3, 259, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tau", [0.02, 0.2, 1.0, 3.0])
def test_gumbel_sigmoid_mean(tau):
    """Hard gates have mean sigmoid(l) at any tau; soft gates the quadrature mean, which differs from sigmoid(l) for
    large tau."""
    g = torch.Generator().manual_seed(int(tau * 100))
    ell = torch.linspace(-4, 4, 9)
    n = 100_000
    hard = gumbel_sigmoid(ell.expand(n, -1), tau, hard=True, generator=g).mean(0)
    soft = gumbel_sigmoid(ell.expand(n, -1), tau, generator=g).mean(0).double()
    tol = 5 * (0.25 / n) ** 0.5
    assert (hard - torch.sigmoid(ell)).abs().max() < tol
    assert (soft - gumbel_sigmoid_mean(ell, tau)).abs().max() < tol
    if tau >= 1: assert (soft - torch.sigmoid(ell.double())).abs().max() > 5 * tol  # the relaxation's bias is visible


@pytest.mark.parametrize("window", [1, 2, 5, 20])
def test_mask_bias_matches_loop(window):
    g = torch.Generator().manual_seed(window)
    alpha = torch.rand(2, 2, 11, generator=g, dtype=torch.float64)
    alpha[0, 0, ::3] = 1.0
    alpha[1, 1, 1::2] = 0.0
    assert_close(dms_mask_bias(alpha, window), dms_mask_bias_reference(alpha, window))
    hard = alpha > 0.5
    pos = torch.arange(11).expand(2, 2, 11)
    visible = torch.isfinite(dms_mask_bias(hard.double(), window))
    assert torch.equal(dms_visible(hard, window, pos, torch.arange(11)), visible)


def explicit_dms_attention(q, k, v, log_keep, window):
    "Softmax over expanded KV heads with the DMS bias, float64."
    G = q.shape[1] // k.shape[1]
    kq, vq = (x.double().repeat_interleave(G, 1) for x in (k, v))
    bias = dms_mask_bias(None, window, log_keep.double()).repeat_interleave(G, 1)
    return torch.softmax(q.double() @ kq.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias, -1) @ vq


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_dms_attention_forward(backend):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 150, 16, generator=g) for h in (4, 2, 2))  # more than one 128-block
    lk = torch.log1p(-torch.rand(1, 2, 150, generator=g))
    lk[0, 0, 3::5] = float("-inf")
    with torch.no_grad(): out = dms_attention(q, k, v, lk, 7, backend=backend)
    assert_close(out.double(), explicit_dms_attention(q, k, v, lk, 7), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_dms_attention_flex_gradients_cuda():
    "On CUDA the flex route (bias in a score_mod) gives the SDPA route's output and gradients, log(1 - alpha) included."
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 700, 64, device="cuda", generator=g, requires_grad=True) for h in (8, 2, 2))
    lk = torch.nn.functional.logsigmoid(torch.randn(2, 2, 700, device="cuda", generator=g)).requires_grad_()
    outs, grads = [], []
    for backend in ("sdpa", "flex"):
        out = dms_attention(q, k, v, lk, 64, backend=backend)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v, lk)))
    assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)
    for a, b in zip(grads[1], grads[0]): assert_close(a, b, atol=5e-3, rtol=5e-3)
    assert grads[1][3].abs().max() > 0


def test_schedule_and_ratio_loss():
    assert [ratio_schedule(s, 10, 0.88) for s in (0, 5, 10, 20)] == pytest.approx([0.0, 0.44, 0.88, 0.88])
    assert ratio_loss(torch.tensor([0.2, 0.4]), 0.5).item() == pytest.approx(0.2)
    assert ratio_loss(torch.tensor([0.7, 0.4]), 0.5).item() == 0.0
    with pytest.raises(ValueError, match="target"): ratio_loss(torch.tensor([0.2]), -0.1)
    with pytest.raises(ValueError, match="step"): ratio_schedule(-1, 10, 0.5)
    rho = target_for_budget(300, 20, 1000)  # expected cache w + (1 - rho)(S - w) equals the budget
    assert 20 + (1 - rho) * 980 == pytest.approx(300)


def test_student_protocol(tiny_llama):
    """method_loss: the ratio loss of the gates captured in training vs the schedule, with gradient to the gates;
    cleared after."""
    st = DMSStudent.for_model(tiny_llama, window=4, target=0.75, ramp_steps=4)
    assert isinstance(st, DistillStudent) and sum(p.numel() for p in st.parameters()) > 0
    ids = ids_of(24)
    st.train()
    with patch(tiny_llama, st.policy()): tiny_llama(ids)
    assert len(st._captured) == tiny_llama.config.num_hidden_layers
    mean = torch.stack(st._captured).mean().item()
    loss, m = st.method_loss(2)
    assert m["eviction_target"] == pytest.approx(0.375) and m["eviction_rate"] == pytest.approx(mean)
    assert loss.item() == pytest.approx(0.375 - mean, abs=1e-6) and mean < 0.05  # gates start closed
    assert m["eviction_rate_inference"] == 0.0  # noise-free logits all at -5
    loss.backward()
    assert st.decisions.bias.grad is not None and (st.decisions.bias.grad < 0).all()  # pushes every head's gates up
    assert st.method_loss(3)[0].item() == 0.0  # capture cleared
    cache = DynamicCache(config=tiny_llama.config)
    with pytest.raises(ValueError, match="without a cache"), patch(tiny_llama, st.policy()):
        tiny_llama(ids[:, :5], past_key_values=cache)
        tiny_llama(ids[:, 5:7], past_key_values=cache)
    st.method_loss(0)  # clears the capture
    st.eval()
    with torch.no_grad(), patch(tiny_llama, st.policy()):
        a, b = tiny_llama(ids).logits, tiny_llama(ids).logits
    assert torch.equal(a, b) and not st._captured  # evaluation: deterministic, nothing captured


@pytest.mark.parametrize("hard", [False, True])
def test_kl_gradient_reaches_decisions(tiny_llama, hard):
    "Through the soft (or straight-through) mask, the output's gradient reaches the decision MLP."
    torch.manual_seed(1)
    st = DMSStudent.for_model(tiny_llama, window=3, target=0.5, ramp_steps=10, hard=hard, init_logit=0.0).train()
    with patch(tiny_llama, st.policy()): out = tiny_llama(ids_of(16)).logits
    out.square().mean().backward()
    assert st.decisions.scorers[0].out.weight.grad.abs().max() > 0
    assert torch.isfinite(st.decisions.bias.grad).all()


def decode(model, st, ids, prefill=0, chunk=1):
    cache, rows = st.inference_cache(), []
    with torch.no_grad(), patch(model, st.policy()):
        for a in range(0, prefill, chunk):
            pos = torch.arange(a, min(a + chunk, prefill))
            rows.append(model(ids[:, pos], past_key_values=cache, position_ids=pos.expand(ids.shape[0], -1)).logits)
        for t in range(prefill, ids.shape[1]): rows.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
    return torch.cat(rows, 1), cache


@pytest.mark.parametrize("name,overrides,window,sink", [("tiny-llama", {}, 4, 0), ("tiny-qwen3", {}, 3, 0),
                                                         ("tiny-llama", {"num_kv_heads": 4}, 5, 2)])
def test_cache_matches_teacher_forced(name, overrides, window, sink):
    """Decoding with DMSCache (token by token, and chunked prefill + decode) equals one forward under DMSPolicy in eval
    mode."""
    model = load_model(name, **overrides)[0]
    st = random_student(model, window=window, sink=sink)
    ids = ids_of(28, seed=3)
    with torch.no_grad(), patch(model, st.policy()): ref = model(ids).logits
    got, cache = decode(model, st, ids)
    assert_close(got, ref, atol=1e-5, rtol=0)
    assert_close(decode(model, st, ids, prefill=11, chunk=4)[0], ref, atol=1e-5, rtol=0)
    # memory: every head keeps exactly its entries visible to the next token; the tensors hold the largest count
    counts = cache.live_counts()
    for layer, c in zip(cache.layers, counts):
        assert layer.keys.shape[2] == counts.max()
        evict = layer.scores > 0
        live = (layer.positions[..., None] == torch.arange(28)).any(-2)  # [B,H,28] kept positions, padding included
        assert (c == (dms_visible(evict, window, layer.positions, torch.tensor([28]), sink)[:, :, 0]).sum(-1)).all()
        assert live.sum(-1).max() <= 28
    assert counts.max() < 28 and counts.min() < counts.max()


def test_generate(tiny_llama):
    st = random_student(tiny_llama, window=3, seed=2)
    prompt = ids_of(7, B=1, seed=4)
    with torch.no_grad(), patch(tiny_llama, st.policy()):
        out = tiny_llama.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=st.inference_cache(),
                                  max_new_tokens=8, do_sample=False, pad_token_id=0)
        seq = prompt
        for _ in range(8): seq = torch.cat([seq, tiny_llama(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


def test_eviction_ratios_hand_built(tiny_llama):
    "Heads with constant gates give ratio 1 (all long-range tokens evicted) or 0; a mixed head the counted fraction."
    st = DMSStudent.for_model(tiny_llama, window=5, target=0.5, ramp_steps=1, sink=2)
    with torch.no_grad():
        st.decisions.bias.copy_(torch.tensor([[4.0, -4.0], [-4.0, -4.0]]) / st.decisions.bias_scale)
        # layer 1, head 1 through its MLP instead of its bias: zero input weights, hidden bias 1,
        # output 8 -> logit 8 - 4 > 0
        sc = st.decisions.scorers[1]
        sc.hidden.weight[1].zero_()
        sc.hidden.bias[1].fill_(1.0)
        sc.out.weight[1, 0, 0] = 8.0 / torch.nn.functional.silu(torch.tensor(1.0))
    r = eviction_ratios(st, tiny_llama, ids_of(20))
    assert r.shape == (2, 2, 2)
    assert_close(r, torch.tensor([[[1.0, 0.0], [0.0, 1.0]]] * 2))
    with pytest.raises(ValueError, match="needs more than"): eviction_ratios(st, tiny_llama, ids_of(7))


@pytest.mark.peers
def test_against_kvpress(kvpress):
    """kvpress DMSPress (threshold on a scorer, window of recent tokens) evicts the same positions as DMSCache,
    given the same decisions."""
    model = load_model("tiny-llama")[0]  # its own instance: kvpress leaves state on the attention modules
    window = 4
    st = random_student(model, window=window, seed=5)

    class Decisions(kvpress.ScorerPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return -st.decisions(module.layer_idx, keys, values)  # kept iff score >= 0 iff logit <= 0

    # kvpress's window protects `sliding_window_size` tokens besides the query:
    # ours (w keys, the query included) is w - 1
    press = kvpress.DMSPress(Decisions(), threshold=0.0, sliding_window_size=window - 1, decoding=True)
    ids = ids_of(26, B=1, seed=6)
    theirs = DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
        model(ids[:, :12], past_key_values=theirs)
        for t in range(12, 26): model(ids[:, t:t + 1], past_key_values=theirs)
    masked = [set() for _ in range(2)]
    mods = [m for m in model.modules() if hasattr(m, "masked_key_indices")]
    b, h, s = mods[0].masked_key_indices  # layer 0: its keys do not depend on how earlier tokens attended
    for hh, ss in zip(h.tolist(), s.tolist()): masked[hh].add(ss)
    for m in mods: m.masked_key_indices = None
    # ours: the same tokens, all decoded one by one
    # (kvpress prefills densely; layer-0 decisions are the same either way)
    _, cache = decode(model, st, ids)
    layer = cache.layers[0]
    vis = dms_visible(layer.scores > 0, window, layer.positions, torch.tensor([26]))
    live = [set(layer.positions[0, hh][vis[0, hh, 0]].tolist()) for hh in range(2)]
    for hh in range(2):
        assert masked[hh] and masked[hh] == set(range(26)) - live[hh]
