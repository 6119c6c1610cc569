"""KVpop scorers: headwise stateless scorers and the mLSTM scorer (parallel vs recurrent, delayed readout, oracles,
init)."""

import pytest
import torch
import torch.nn.functional as F
from mlstm_kernels.torch.parallel.native.fw import mlstm_parallel_fw
from mlstm_kernels.torch.recurrent.native_step import mlstm_recurrent_step__native_fw
from torch.testing import assert_close

from sparsekv.kvpop.scorers import (
    LinearScorer,
    MLPScorer,
    MLSTMScorer,
    count_parameters,
    hedgehog,
    mlp_scorer_reference,
    mlstm_chunkwise,
    mlstm_init_state,
    mlstm_parallel,
    mlstm_readout,
    mlstm_recurrent,
    mlstm_step,
    mlstm_unstabilized_reference,
)


def make_kv(B, H, S, d, seed, dtype=torch.float32, scale=1.0):
    "Random keys/values [B,H,S,d]."
    g = torch.Generator().manual_seed(seed)
    draw = lambda: (scale * torch.randn(B, H, S, d, generator=g)).to(dtype)
    return draw(), draw()


def randomize(module, seed, std=0.3):
    "Give every parameter a random perturbation (so no zero-init makes a check vacuous)."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters(): p.add_(std * torch.randn(p.shape, generator=g).to(p.dtype))
    return module


def make_scorers(H, d, delay=3):
    return {"linear": LinearScorer(H, d), "mlp": MLPScorer(H, d, hidden=2 * d), "mlstm": MLSTMScorer(H, d, delay=delay)}


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlstm"])
@pytest.mark.parametrize("B,H,S,d", [(2, 3, 17, 8), (1, 1, 1, 4), (3, 2, 5, 16)])
def test_shapes_and_neutral_init(kind, B, H, S, d):
    scorer = make_scorers(H, d)[kind]
    k, v = make_kv(B, H, S, d, seed=S)
    r = scorer(k, v)
    assert r.shape == (B, H, S) and r.dtype == torch.float32
    assert (r == r.flatten()[0]).all()  # zero-initialized score head: all scores equal (neutral ranking)
    randomize(scorer, 0)
    if r.numel() > 1: assert scorer(k, v).std() > 0  # and a trained head ranks


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlstm"])
def test_per_kv_head_independent(kind):
    "Scores of KV head h depend only on head h's keys/values and parameters (GQA: one score per KV head)."
    H, d = 4, 8
    scorer = randomize(make_scorers(H, d)[kind], 1)
    k, v = make_kv(2, H, 23, d, seed=2)
    r = scorer(k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, 2] += torch.randn_like(k2[:, 2]); v2[:, 2] += 1.0
    r2 = scorer(k2, v2)
    keep = [0, 1, 3]
    assert_close(r2[:, keep], r[:, keep])
    assert not torch.allclose(r2[:, 2], r[:, 2])


def test_mlp_matches_loop_reference():
    scorer = randomize(MLPScorer(3, 6, hidden=5), 3)
    k, v = make_kv(2, 3, 11, 6, seed=4)
    assert_close(scorer(k, v), mlp_scorer_reference(scorer, k, v))


@pytest.mark.parametrize("S,delay", [(1, 0), (1, 3), (50, 0), (50, 7), (50, 49), (300, 0), (300, 64), (300, 400)])
def test_mlstm_parallel_vs_recurrent_fp32(delay, S):
    H, d = 2, 16
    scorer = randomize(MLSTMScorer(H, d, delay=delay), 5)
    k, v = make_kv(1, H, S, d, seed=S + delay)
    assert_close(scorer(k, v), scorer.recurrent(k, v), rtol=1e-4, atol=1e-4)


def test_mlstm_parallel_vs_recurrent_bf16():
    H, d, S = 2, 16, 120
    scorer = randomize(MLSTMScorer(H, d, delay=16), 6).to(torch.bfloat16)
    k, v = make_kv(1, H, S, d, seed=7, dtype=torch.bfloat16)
    r_par, r_rec = scorer(k, v), scorer.recurrent(k, v)
    assert r_par.dtype == torch.float32
    assert_close(r_par, r_rec, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("normalizer", ["ratio", "mlstm"])
@pytest.mark.parametrize("delay", [0, 3, 30])
def test_stabilized_equals_unstabilized_float64(normalizer, delay):
    g = torch.Generator().manual_seed(delay)
    B, H, S, dk, dv = 2, 2, 25, 6, 4
    q = hedgehog(torch.randn(B, H, S, dk // 2, generator=g, dtype=torch.float64))
    kf = hedgehog(torch.randn(B, H, S, dk // 2, generator=g, dtype=torch.float64))
    vf = torch.randn(B, H, S, dv, generator=g, dtype=torch.float64)
    log_i = 2 * torch.randn(B, H, S, generator=g, dtype=torch.float64)
    log_f = F.logsigmoid(torch.randn(B, H, S, generator=g, dtype=torch.float64) + 1)
    ref = mlstm_unstabilized_reference(q, kf, vf, log_i, log_f, delay, normalizer)
    assert_close(mlstm_parallel(q, kf, vf, log_i, log_f, delay, normalizer, eps=0.0), ref)
    assert_close(mlstm_recurrent(q, kf, vf, log_i, log_f, delay, normalizer, eps=0.0), ref)


def test_against_mlstm_kernels_parallel_and_step():
    "Immediate readout with the xLSTM normalizer equals mlstm_kernels' native parallel forward and recurrent step."
    g = torch.Generator().manual_seed(8)
    B, H, S, dk, dv = 2, 3, 96, 16, 8
    q = hedgehog(torch.randn(B, H, S, dk // 2, generator=g))
    kf = hedgehog(torch.randn(B, H, S, dk // 2, generator=g))
    vf = torch.randn(B, H, S, dv, generator=g)
    i_pre, f_pre = 40 * torch.randn(B, H, S, generator=g), 4 * torch.randn(B, H, S, generator=g)
    h_ours = mlstm_parallel(q, kf, vf, i_pre, F.logsigmoid(f_pre), 0, "mlstm")
    assert_close(h_ours, mlstm_parallel_fw(q, kf, vf, i_pre, f_pre)[0])
    ours = mlstm_init_state(B, H, dk, dv)
    theirs = (ours.C, ours.n, ours.m[..., None])
    for t in range(S):
        ours = mlstm_step(ours, kf[:, :, t], vf[:, :, t], i_pre[..., t], F.logsigmoid(f_pre[..., t]))
        h_t, theirs = mlstm_recurrent_step__native_fw(*theirs, q[:, :, t], kf[:, :, t], vf[:, :, t],
                                                      i_pre[..., t, None], f_pre[..., t, None])
        assert_close(mlstm_readout(ours, q[:, :, t], "mlstm"), h_t)
    assert_close(ours.C, theirs[0]); assert_close(ours.n, theirs[1]); assert_close(ours.m, theirs[2][..., 0])


def random_mlstm_inputs(B, H, S, dk, dv, seed, i_scale=20.0):
    "Hedgehog query/key features, values and log-gates (float32, large input-gate pre-activations)."
    g = torch.Generator().manual_seed(seed)
    q = hedgehog(torch.randn(B, H, S, dk // 2, generator=g))
    kf = hedgehog(torch.randn(B, H, S, dk // 2, generator=g))
    vf = torch.randn(B, H, S, dv, generator=g)
    log_i = i_scale * torch.randn(B, H, S, generator=g)
    log_f = F.logsigmoid(2 * torch.randn(B, H, S, generator=g) + 2)
    return q, kf, vf, log_i, log_f


@pytest.mark.parametrize("S,chunk_size,delay", [(64, 16, 0), (64, 16, 5), (70, 16, 33), (70, 128, 10), (33, 1, 4),
                                                (50, 7, 80), (1, 4, 0), (1, 4, 2)])
@pytest.mark.parametrize("normalizer", ["ratio", "mlstm"])
def test_chunkwise_equals_quadratic_values_and_grads(S, chunk_size, delay, normalizer):
    inputs = [t.requires_grad_(True) for t in random_mlstm_inputs(2, 2, S, 8, 4, seed=S + chunk_size + delay)]
    h_quad = mlstm_parallel(*inputs, delay, normalizer)
    grads_quad = torch.autograd.grad(h_quad.sin().sum(), inputs)
    h_chunk = mlstm_chunkwise(*inputs, delay, normalizer, chunk_size=chunk_size)
    grads_chunk = torch.autograd.grad(h_chunk.sin().sum(), inputs)
    assert_close(h_chunk, h_quad, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads_chunk, grads_quad):
        assert torch.isfinite(a).all()
        assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_delayed_readout_reads_state_u_plus_w():
    "Score of token u with delay w = readout of token u's query feature from the state after token min(u+w, S-1)."
    H, d, S, w = 2, 8, 30, 6
    scorer = randomize(MLSTMScorer(H, d, delay=w), 9)
    k, v = make_kv(2, H, S, d, seed=10)
    r = scorer(k, v)
    q = scorer.query_feature(k, v)
    state, states = scorer.init_state(2), []
    for t in range(S):
        state = scorer.step(state, k[:, :, t], v[:, :, t])
        states.append(state)
    for u in (0, 5, S - w - 1, S - w, S - 1):
        assert_close(r[:, :, u], scorer.readout(states[min(u + w, S - 1)], q[:, :, u]))
    # delay 0 vs w: the same parameters give different scores, and the prefix of a longer sequence changes only
    # the delayed scores of tokens whose state index moves
    immediate = MLSTMScorer(H, d, delay=0); immediate.load_state_dict(scorer.state_dict())
    r0 = immediate(k, v)
    assert not torch.allclose(r0, r)
    assert_close(r0[:, :, -1], r[:, :, -1])  # the last token reads the last state in both
    assert_close(immediate(k[:, :, :S - w], v[:, :, :S - w])[:, :, :S - w - 1], r0[:, :, :S - w - 1])  # causal
    assert_close(scorer(k[:, :, :S - 1], v[:, :, :S - 1])[:, :, :S - 1 - w], r[:, :, :S - 1 - w])


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlstm"])
def test_gradients_reach_scorer_params_only(kind):
    H, d = 3, 8
    scorer = randomize(make_scorers(H, d)[kind], 11)
    k, v = make_kv(2, H, 40, d, seed=12)
    k.requires_grad_(True); v.requires_grad_(True)
    r = scorer(k, v)
    r.square().sum().backward()
    assert k.grad is None and v.grad is None
    for name, p in scorer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_zero_init_gradient_trains_score_head_first():
    "At step 0 (score head zero) only the score head gets gradient: the ranking starts neutral."
    scorer = MLSTMScorer(2, 8, delay=4)
    k, v = make_kv(1, 2, 30, 8, seed=13)
    (scorer(k, v) * torch.randn(1, 2, 30)).sum().backward()
    assert scorer.score.weight.grad.abs().sum() > 0
    assert scorer.q_proj.weight.grad.abs().sum() == 0


def test_mlstm_stable_with_large_inputs():
    "Large inputs: both forms stay finite and match the float64 computation to float32 precision at the output's scale."
    scorer = randomize(MLSTMScorer(2, 16, delay=8, soft_cap=None), 14, std=3.0)
    k, v = make_kv(1, 2, 200, 16, seed=15, scale=30.0)
    r_par, r_rec = scorer(k, v), scorer.recurrent(k, v)
    assert torch.isfinite(r_par).all() and torch.isfinite(r_rec).all()
    with torch.no_grad():
        scorer.double()  # computed in float64, the scores rounded to float32 at the end
        ref = scorer(k.double(), v.double())
        assert_close(scorer.recurrent(k.double(), v.double()), ref, rtol=1e-6, atol=1e-6)
    # scores reach ~1e4 here, so one near 0 carries the absolute error of the large ones (~1e-5 of them)
    tol = 1e-5 * float(ref.abs().max())
    assert_close(r_par, ref, rtol=1e-4, atol=tol)
    assert_close(r_rec, ref, rtol=1e-4, atol=tol)


def test_soft_cap_bounds_gate_preactivations():
    scorer = randomize(MLSTMScorer(2, 8, delay=2, soft_cap=5.0), 16, std=5.0)
    k, v = make_kv(1, 2, 10, 8, seed=17, scale=20.0)
    _, _, _, log_i, log_f = scorer.features(k, v)
    assert log_i.abs().max() <= 5.0 and (log_f >= F.logsigmoid(torch.tensor(-5.0)) - 1e-6).all()


@pytest.mark.parametrize("H,d", [(3, 64), (8, 128)])
def test_parameter_counts(H, d):
    "Per-layer counts for SmolLM2-135M (3 KV heads, d=64) and Qwen3-4B (8, d=128) shapes, from the formula."
    assert count_parameters(MLSTMScorer(H, d, delay=256)) == H * (3 * d * (2 * d) // 2 + 2 * (2 * d + 1) + d // 2 + 1)
    assert count_parameters(MLPScorer(H, d, hidden=d)) == H * ((2 * d + 1) * d + d + 1)
    assert count_parameters(LinearScorer(H, d)) == H * (2 * d + 1)


def test_bad_inputs():
    scorer = MLSTMScorer(2, 8, delay=1)
    k, v = make_kv(1, 2, 5, 8, seed=0)
    with pytest.raises(ValueError, match="num_kv_heads"): scorer(k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="head_dim"): scorer(k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="same shape"): scorer(k, v[:, :, :3])
    with pytest.raises(TypeError, match="floating-point"): scorer(k.long(), v)
    with pytest.raises(ValueError, match="delay"): MLSTMScorer(2, 8, delay=-1)
    with pytest.raises(ValueError, match="head_dim must be even"): MLSTMScorer(2, 7, delay=1)
    with pytest.raises(ValueError, match="normalizer"): MLSTMScorer(2, 8, delay=1, normalizer="max")
    with pytest.raises(ValueError, match="soft_cap"): MLSTMScorer(2, 8, delay=1, soft_cap=0.0)
    with pytest.raises(ValueError, match="hidden"): MLPScorer(2, 8, hidden=0)


def test_single_token_layout_when_batch_equals_heads():
    "step/readout on [B,Hkv,d] tokens must not confuse the batch with the head axis (B == Hkv here)."
    scorer = randomize(MLSTMScorer(3, 8, delay=2), 18)
    k, v = make_kv(3, 3, 12, 8, seed=19)
    assert_close(scorer(k, v), scorer.recurrent(k, v), rtol=1e-4, atol=1e-4)
    q = scorer.query_feature(k[:, :, 4], v[:, :, 4])
    assert q.shape == (3, 3, 8)
    assert_close(q, scorer.query_feature(k, v)[:, :, 4])
