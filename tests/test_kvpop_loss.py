"""KVpop teacher boundary, query sampler, boundary loss and weights against their brute-force references
(Eq. 5-7, 22-25)."""
import math

import pytest
import torch

from sparsekv.kvpop.cutoff import LogDecay, static_priority, topk_cutoff_reference
from sparsekv.kvpop.loss import (
    balance_weight,
    kept_long_range,
    margin_weight,
    retention_loss,
    retention_loss_reference,
    retention_recall,
    sample_boundary_queries,
    teacher_boundary,
    teacher_boundary_reference,
    teacher_margin,
)
from sparsekv.kvpop.mask import kvpop_mask_reference


def make_priority(B, H, S, kind, seed):
    "Random priorities: continuous, heavily tied (3 values), or with +-inf entries."
    g = torch.Generator().manual_seed(seed)
    if kind == "ties": return torch.randint(0, 3, (B, H, S), generator=g).float()
    p = torch.randn(B, H, S, generator=g)
    if kind == "inf":
        p[torch.rand(B, H, S, generator=g) < 0.1] = math.inf
        p[torch.rand(B, H, S, generator=g) < 0.1] = -math.inf
    return p


# (S, sink, window, k): S up to 300, a single valid query (S = s + w + k + 1), no sinks, k = 1, window 1
SHAPES = [(300, 4, 16, 32), (97, 3, 7, 10), (53, 4, 16, 32), (20, 0, 1, 1), (12, 2, 3, 6), (40, 0, 5, 1),
          (64, 1, 1, 30)]


@pytest.mark.parametrize("S,sink,window,k", SHAPES)
@pytest.mark.parametrize("kind", ["normal", "ties", "inf"])
def test_boundary_matches_reference(S, sink, window, k, kind):
    p = make_priority(2, 3, S, kind, seed=S * 7 + k)
    q = torch.arange(sink + window + k, S)
    got, want = teacher_boundary(p, q, sink, window, k), teacher_boundary_reference(p, q, sink, window, k)
    for a, b, name in zip(got, want, ("t_new", "t_bnd", "y")):
        assert torch.equal(a, b), name
        assert a.dtype == torch.int64 and a.shape == (2, 3, len(q))


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_boundary_against_kept_set(kind):
    """y says whether t_new is in the teacher's kept set (the brute-force mask row); t_bnd is its worst kept token or,
    when that is t_new, its best dropped one."""
    S, sink, window, k = 70, 3, 6, 9
    p = make_priority(2, 2, S, kind, seed=1)
    q = torch.arange(sink + window + k, S)
    t_new, t_bnd, y = teacher_boundary(p, q, sink, window, k)
    rank, cutoff = topk_cutoff_reference(p, k, sink, window)
    t = torch.arange(S)
    eligible = (t >= sink) & (t <= (q - window)[:, None])
    kept = kvpop_mask_reference(p, k, sink, window)[..., q, :] & eligible  # [B, H, n, S]
    assert torch.equal(kept_long_range(p, q, sink, window, k), kept)
    assert torch.equal(kept.sum(-1), torch.full_like(y, k))
    assert torch.equal(y == 1, kept.gather(-1, t_new[..., None])[..., 0])
    kth = torch.where(kept, rank[..., None, :], -1).amax(-1)                       # worst kept rank
    first_dropped = torch.where(eligible & ~kept, rank[..., None, :], S).amin(-1)  # best dropped rank
    at_boundary = rank.gather(-1, t_new) == kth
    want = torch.where(at_boundary, first_dropped, kth)
    assert torch.equal(rank.gather(-1, t_bnd), want)
    assert at_boundary.any() and (y == -1).any() and (y == 1).any()
    assert (t_bnd < t_new).all()  # the boundary token is always older than the new one


def test_boundary_edge_cases():
    p = make_priority(1, 2, 30, "normal", seed=0)
    sink, window, k = 2, 4, 5
    # the first valid query is s + w + k; before it |E(q)| <= k and there is no first dropped token
    with pytest.raises(ValueError, match="Eq. 25"): teacher_boundary(p, [sink + window + k - 1], sink, window, k)
    with pytest.raises(ValueError, match="S - 1"): teacher_boundary(p, [30], sink, window, k)
    # k > |E(q)| everywhere
    with pytest.raises(ValueError, match="Eq. 25"): teacher_boundary(p[..., :10], [10], sink, window, k)
    with pytest.raises(ValueError, match="1-D integer"): teacher_boundary(p, torch.tensor([20.0]), sink, window, k)
    with pytest.raises(ValueError, match="1-D integer"): teacher_boundary(p, [[20]], sink, window, k)
    with pytest.raises(TypeError, match="floating-point"): teacher_boundary(p.long(), [20], sink, window, k)
    with pytest.raises(ValueError, match="NaN"): teacher_boundary(p.clone().fill_(math.nan), [20], sink, window, k)
    with pytest.raises(ValueError, match="window"): teacher_boundary(p, [20], sink, 0, k)
    with pytest.raises(ValueError, match="k must"): teacher_boundary(p, [20], sink, window, 0)
    empty = teacher_boundary(p, torch.tensor([], dtype=torch.long), sink, window, k)
    assert all(x.shape == (1, 2, 0) for x in empty)
    # a list works like a tensor, repeated positions give repeated answers
    a = teacher_boundary(p, [20, 20, 29], sink, window, k)
    b = teacher_boundary(p, torch.tensor([20, 20, 29]), sink, window, k)
    for x, z in zip(a, b): assert torch.equal(x, z) and torch.equal(x[..., 0], x[..., 1])


def test_sampler_determinism_and_range():
    S, sink, window, k = 500, 4, 16, 32
    draw = lambda seed, **kw: sample_boundary_queries(S, 256, sink, window, k,
                                                      generator=torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))
    for late_frac in (0.0, 0.5, 1.0):
        q = draw(0, late_frac=late_frac)
        assert q.dtype == torch.int64 and q.shape == (256,)
        assert q.min() >= sink + window + k and q.max() <= S - 1
        assert torch.equal(q, q.sort().values)
    assert torch.equal(sample_boundary_queries(53, 4, 4, 16, 32), torch.full((4,), 52))  # one valid position


def test_sampler_distribution():
    "Uniform part: mass 1/2 below the midpoint of [lo, S-1]; late part: density rising linearly, mass 1/4 below it."
    S, lo = 1000, 4 + 16 + 32
    mid = lo + (S - lo) / 2
    g = torch.Generator().manual_seed(0)
    unif = sample_boundary_queries(S, 20000, 4, 16, 32, late_frac=0.0, generator=g)
    late = sample_boundary_queries(S, 20000, 4, 16, 32, late_frac=1.0, generator=g)
    mixed = sample_boundary_queries(S, 20000, 4, 16, 32, late_frac=0.5, generator=g)
    assert abs((unif < mid).double().mean() - 0.5) < 0.02
    assert abs((late < mid).double().mean() - 0.25) < 0.02
    assert abs((mixed < mid).double().mean() - 0.375) < 0.02
    assert set(unif.unique().tolist()) == set(range(lo, S))  # every valid position is reachable


def test_sampler_bad_input():
    with pytest.raises(ValueError, match="Eq. 25"): sample_boundary_queries(52, 4, 4, 16, 32)
    with pytest.raises(ValueError, match="n must"): sample_boundary_queries(100, 0, 4, 16, 32)
    with pytest.raises(ValueError, match="late_frac"): sample_boundary_queries(100, 4, 4, 16, 32, late_frac=1.5)
    with pytest.raises(ValueError, match="sink"): sample_boundary_queries(100, 4, -1, 16, 32)


OPTIONS = [dict(margin=False), dict(), dict(tau=0.3, omega_min=0.5, tau_omega=0.2), dict(margin=False, balance=True),
           dict(balance=True, c_min=0.7, c_max=1.3)]


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_loss_matches_reference(opts, kind):
    "The loss on static priorities equals the loop-by-loop loss on Eq. (5) effective scores (n = 1)."
    B, H, S, sink, window, k = 2, 3, 80, 3, 5, 12
    g = torch.Generator().manual_seed(len(str(opts)))
    r_hat, r_tgt = make_priority(B, H, S, "normal", seed=9), make_priority(B, H, S, kind, seed=10)
    log_gamma = -torch.rand(H, generator=g) * 0.05
    q = sample_boundary_queries(S, 24, sink, window, k, generator=g)
    got = retention_loss(static_priority(r_hat, log_gamma), static_priority(r_tgt, log_gamma), q, sink, window, k,
                         **opts)
    want = retention_loss_reference(r_hat, r_tgt, log_gamma, q, sink, window, k, **opts)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    per = retention_loss(static_priority(r_hat, log_gamma), static_priority(r_tgt, log_gamma), q, sink, window, k,
                         reduction="none", **opts)
    assert per.shape == (B, H, len(q)) and torch.allclose(per.mean(), got)


def test_loss_bad_input():
    p = make_priority(1, 2, 40, "normal", seed=0)
    with pytest.raises(ValueError, match="same shape"): retention_loss(p, p[:, :1], [30], 2, 4, 5)
    with pytest.raises(TypeError, match="pred_priority"): retention_loss(p.long(), p, [30], 2, 4, 5)
    with pytest.raises(ValueError, match="tau must"): retention_loss(p, p, [30], 2, 4, 5, tau=0.0)
    with pytest.raises(ValueError, match="reduction"): retention_loss(p, p, [30], 2, 4, 5, reduction="sum")
    with pytest.raises(ValueError, match="omega_min"): retention_loss(p, p, [30], 2, 4, 5, omega_min=2.0)
    with pytest.raises(ValueError, match="c_min"):
        retention_loss(p, p, [30], 2, 4, 5, balance=True, c_min=2.0, c_max=1.0)


def test_margin_weights():
    S, sink, window, k = 90, 2, 5, 10
    p = make_priority(2, 3, S, "ties", seed=4)  # ties give exact zero margins
    q = torch.arange(sink + window + k, S)
    t_new, t_bnd, y = teacher_boundary(p, q, sink, window, k)
    m = teacher_margin(p, t_new, t_bnd, y)
    assert (m >= 0).all() and (m == 0).any() and (m > 0).any()  # Eq. (22): >= 0 by construction
    w = margin_weight(m, omega_min=0.2, tau_omega=0.5)
    assert torch.allclose(w[m == 0], torch.tensor(0.6))  # a tie gets (1 + omega_min) / 2
    assert (w >= 0.6).all() and (w < 1).all()
    assert (w[m > 0] > 0.6).all()


def test_balance_weights():
    g = torch.Generator().manual_seed(0)
    y = torch.where(torch.rand(3, 4, 50, generator=g) < torch.tensor([0.1, 0.3, 0.5, 0.9])[:, None], 1, -1)
    w = balance_weight(y, c_min=1e-4, c_max=1e4)  # unclipped: each head's labels weigh the same
    for h in range(4):
        torch.testing.assert_close(w[:, h][y[:, h] > 0].sum(), w[:, h][y[:, h] < 0].sum())
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))
    w = balance_weight(y, c_min=0.2, c_max=2.0)  # clipped, then mean-normalized
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))
    rho = (y > 0).float().mean(dim=(0, 2))
    for h in range(4):
        raw = lambda lab: min(max(1 / (2 * rho[h].item()) if lab > 0 else 1 / (2 * (1 - rho[h].item())), 0.2), 2.0)
        pos, neg = w[:, h][y[:, h] > 0][0], w[:, h][y[:, h] < 0][0]
        torch.testing.assert_close(pos / neg, torch.tensor(raw(1) / raw(-1)))
    one_label = torch.ones(1, 2, 8, dtype=torch.long)  # rho = 1: the absent label's 1/0 must not leak
    one_label[0, 1] = -1
    w = balance_weight(one_label)
    assert torch.isfinite(w).all() and torch.allclose(w, torch.ones_like(w, dtype=torch.float))


def test_gradients_reach_only_scorer_and_alpha():
    B, H, S, sink, window, k = 2, 3, 70, 2, 6, 10
    g = torch.Generator().manual_seed(2)
    scorer = torch.nn.Linear(5, 1)
    x = torch.randn(B, H, S, 5, generator=g)
    decay = LogDecay(H, gamma_min=0.9, gamma_max=0.999)
    r_tgt = torch.randn(B, H, S, generator=g, requires_grad=True)  # a target that (wrongly) asks for gradients
    log_gamma = decay()
    pred = static_priority(scorer(x)[..., 0], log_gamma)
    tgt = static_priority(r_tgt, log_gamma)  # built from the live decay: the loss must not differentiate through it
    q = sample_boundary_queries(S, 16, sink, window, k, generator=g)
    loss = retention_loss(pred, tgt, q, sink, window, k, balance=True)
    grads = torch.autograd.grad(loss, [scorer.weight, scorer.bias, decay.alpha, r_tgt], allow_unused=True)
    assert grads[0].abs().min() > 0 and grads[2].abs().min() > 0  # scorer weights and every head's alpha
    torch.testing.assert_close(grads[1], torch.zeros(1), atol=1e-7, rtol=0)  # a shared bias cancels in the difference
    assert grads[3] is None
    # the alpha gradient through the student is the reference's
    ref = retention_loss_reference(scorer(x)[..., 0], r_tgt, decay(), q, sink, window, k, balance=True)
    want = torch.autograd.grad(ref, decay.alpha)[0]
    torch.testing.assert_close(grads[2], want, rtol=1e-4, atol=1e-7)


def test_loss_dtype_and_no_decay():
    "bf16 scores give a float32 loss; without decay the comparison is of raw scores."
    B, H, S, sink, window, k = 1, 2, 50, 2, 4, 8
    r_hat, r_tgt = make_priority(B, H, S, "normal", 5), make_priority(B, H, S, "normal", 6)
    q = torch.arange(sink + window + k, S)
    loss = retention_loss(static_priority(r_hat.bfloat16(), 0.0), static_priority(r_tgt, 0.0), q, sink, window, k)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(retention_loss(r_hat, r_tgt, q, sink, window, k),
                               retention_loss_reference(r_hat, r_tgt, torch.zeros(H), q, sink, window, k).float())


def test_recall_bounds():
    S, sink, window, k = 60, 2, 5, 7
    p = make_priority(2, 2, S, "normal", seed=0)
    q = torch.arange(sink + window + k, S)
    assert torch.equal(retention_recall(p, p, q, sink, window, k), torch.ones(2, 2, len(q)))
    rec = retention_recall(make_priority(2, 2, S, "normal", seed=1), p, q, sink, window, k)
    assert ((rec >= 0) & (rec <= 1)).all() and (rec < 1).any()
    # recall = |kept_pred & kept_tgt| / k, counted directly
    a, b = kept_long_range(-p, q, sink, window, k), kept_long_range(p, q, sink, window, k)
    assert torch.equal(retention_recall(-p, p, q, sink, window, k), (a & b).sum(-1) / k)


def test_toy_linear_scorer_learns_teacher_ranking():
    "A linear student trained on the boundary loss reproduces a hidden linear teacher's top-k (recall -> 1)."
    B, H, S, D, sink, window, k = 4, 3, 150, 6, 3, 6, 20
    g = torch.Generator().manual_seed(123)
    x = torch.randn(B, H, S, D, generator=g)
    u = torch.randn(H, D, generator=g) / math.sqrt(D)
    log_gamma = torch.tensor([-0.01, -0.02, -0.04])
    tgt = static_priority(torch.einsum("bhsd,hd->bhs", x, u), log_gamma)
    v, b = torch.zeros(H, D, requires_grad=True), torch.zeros(H, 1, requires_grad=True)
    steps = 200
    opt = torch.optim.Adam([v, b], lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    student = lambda: static_priority(torch.einsum("bhsd,hd->bhs", x, v) + b, log_gamma)
    q_all = torch.arange(sink + window + k, S)
    before = retention_recall(student().detach(), tgt, q_all, sink, window, k).mean()
    for _ in range(steps):
        q = sample_boundary_queries(S, 32, sink, window, k, generator=g)
        loss = retention_loss(student(), tgt, q, sink, window, k, tau=0.1)
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    after = retention_recall(student().detach(), tgt, q_all, sink, window, k).mean(dim=(0, 2))  # per head
    assert before < 0.85 and (after > 0.95).all(), (before, after)
    assert torch.cosine_similarity(v.detach(), u).min() > 0.99
