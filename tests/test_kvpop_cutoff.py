"Static priorities, ranks and the running top-k cutoff against brute-force references."
import itertools
import math
import os
import random

import pytest
import torch

from sparsekv.kvpop.cutoff import (
    CUTOFF_BACKENDS,
    Fenwick,
    LogDecay,
    bench_cutoff,
    cutoff_python,
    cutoff_torch,
    cutoff_triton,
    effective_score,
    eligible_count,
    priority_rank,
    rank_reference,
    static_priority,
    topk_cutoff,
    topk_cutoff_reference,
)


def random_priority(B, H, S, ties, gen):
    "Standard normal priorities, or integers in 0..3 (many ties) when `ties`."
    if ties: return torch.randint(0, 4, (B, H, S), generator=gen).float()
    return torch.randn(B, H, S, generator=gen)


def order(scores, tokens):
    return sorted(tokens, key=lambda t: (-scores[t], t))


def test_log_decay_range_and_gradient():
    decay = LogDecay(4, gamma_min=0.9, gamma_max=0.99)
    with torch.no_grad(): decay.alpha.copy_(torch.tensor([-10.0, -1.0, 1.0, 10.0]))
    lg = decay()
    assert lg.shape == (4,)
    assert (lg > math.log(0.9)).all() and (lg < math.log(0.99)).all()
    assert (lg[1:] > lg[:-1]).all()  # monotone in alpha
    want = math.log(0.9) + torch.sigmoid(decay.alpha.detach()) * (math.log(0.99) - math.log(0.9))
    torch.testing.assert_close(lg.detach(), want)
    static_priority(torch.randn(1, 4, 9), lg).sum().backward()
    assert decay.alpha.grad is not None and (decay.alpha.grad != 0).all()
    for bad in ((0.0, 0.5), (0.5, 0.5), (0.5, 1.0), (0.9, 0.1)):
        with pytest.raises(ValueError, match="gamma_min"): LogDecay(2, *bad)


@pytest.mark.parametrize("seed", range(3))
def test_static_priority_ranks_like_effective_score_for_n1(seed):
    gen = torch.Generator().manual_seed(seed)
    B, H, S, s, w = 2, 2, 30, 1, 2
    r = torch.randint(-2, 3, (B, H, S), generator=gen).double()  # exact arithmetic: ties survive
    log_gamma = -torch.tensor([0.5, 0.125], dtype=torch.float64)
    pri = static_priority(r, log_gamma)
    for q in range(s + w, S):
        eff = effective_score(r, log_gamma, q)
        for b, h in itertools.product(range(B), range(H)):
            E = range(s, q - w + 1)
            assert order(eff[b, h].tolist(), E) == order(pri[b, h].tolist(), E)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_bucketed_priority_error_bound(n):
    gen = torch.Generator().manual_seed(n)
    B, H, S, s, w = 1, 2, 36, 2, 1
    r = torch.randn(B, H, S, generator=gen, dtype=torch.float64)
    log_gamma = torch.tensor([-0.3, -0.02], dtype=torch.float64)
    pri = static_priority(r, log_gamma, n)
    for q in range(s + w, S):
        eff = effective_score(r, log_gamma, q, n)
        for h in range(H):
            E = list(range(s, q - w + 1))
            exact, approx = order(eff[0, h].tolist(), E), order(pri[0, h].tolist(), E)
            if q % n == n - 1: assert exact == approx
            where = {t: i for i, t in enumerate(approx)}
            for a, c in itertools.combinations(exact, 2):  # a before c in the exact ranking
                if where[a] > where[c]: assert abs(pri[0, h, a] - pri[0, h, c]) <= -log_gamma[h]


def test_static_priority_validation():
    r = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="<= 0"): static_priority(r, 0.1)
    with pytest.raises(ValueError, match="<= 0"): static_priority(r, torch.tensor([-0.1, math.nan]))
    with pytest.raises(ValueError, match=r"shape \[H\]"): static_priority(r, torch.tensor([-0.1, -0.2, -0.3]))
    with pytest.raises(ValueError, match="decay step"): static_priority(r, -0.1, n=0)
    with pytest.raises(TypeError, match="floating-point"): static_priority(r.long(), -0.1)
    assert static_priority(r.half(), -0.5).dtype == torch.float32  # decay in float32 at least


@pytest.mark.parametrize("ties", [False, True])
def test_priority_rank(ties):
    gen = torch.Generator().manual_seed(7)
    for S, sink in ((1, 0), (1, 1), (4, 6), (37, 3), (128, 0)):
        p = random_priority(2, 2, S, ties, gen)
        p[0, 0, ::5] = math.inf
        p[1, 1, ::3] = -math.inf
        assert torch.equal(priority_rank(p, sink), rank_reference(p, sink))
    with pytest.raises(ValueError, match="NaN"): priority_rank(torch.tensor([[[0.0, math.nan]]]), 0)


def test_fenwick_against_counting():
    rnd = random.Random(0)
    for n in (1, 5, 8, 31):
        tree, seen = Fenwick(n), []
        for r in rnd.sample(range(n), n):
            tree.insert(r)
            seen.append(r)
            for j in range(1, n + 2): assert tree.kth(j) == (sorted(seen)[j - 1] if j <= len(seen) else n)


def test_eligible_count():
    for S, sink, window in ((1, 0, 1), (10, 2, 3), (10, 12, 1), (50, 4, 7)):
        want = [len(range(sink, q - window + 1)) for q in range(S)]
        assert eligible_count(S, sink, window).tolist() == want


def configs():
    "Random (S, k, sink, window) with S in 1..300, budgets smaller and larger than S."
    rnd = random.Random(11)
    fixed = [(1, 1, 0, 1), (2, 1, 0, 1), (3, 5, 0, 1), (16, 1, 0, 1), (17, 3, 0, 1), (300, 1, 4, 256), (300, 40, 4, 32)]
    return fixed + [(S, rnd.randint(1, 40), rnd.randint(0, 6), rnd.randint(1, 30))
                    for S in rnd.sample(range(1, 301), 12)]


@pytest.mark.parametrize("S,k,sink,window", configs())
@pytest.mark.parametrize("ties", [False, True])
def test_cutoff_backends_equal_brute_force(S, k, sink, window, ties):
    gen = torch.Generator().manual_seed(S * 1000 + k)
    p = random_priority(2, 3, S, ties, gen)
    rank, want = topk_cutoff_reference(p, k, sink, window)
    got_rank, got = topk_cutoff(p, k, sink, window)
    assert torch.equal(got_rank, rank) and torch.equal(got, want)
    assert got.dtype == torch.int64 and got.shape == (2, 3, S)
    if S <= 120: assert torch.equal(cutoff_python(rank, k, sink, window), want)
    # the definition, checked directly: exactly min(k, |E(q)|) eligible tokens pass rank <= cutoff
    E = eligible_count(S, sink, window)
    t = torch.arange(S)
    eligible = (t >= sink) & (t[None] <= t[:, None] - window)  # [q, t]
    kept = (eligible & (rank[..., None, :] <= want[..., :, None])).sum(-1)
    assert torch.equal(kept, E.clamp(max=k).expand_as(kept))
    assert (want[..., 1:] <= want[..., :-1]).all()


@pytest.mark.parametrize("S,k,sink,window", [(1, 1, 0, 1), (5, 2, 0, 1), (16, 3, 1, 2), (23, 4, 2, 3), (20, 30, 0, 1)])
def test_triton_equals_torch_in_interpreter(S, k, sink, window):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(S)
    p = random_priority(1, 2, S, True, gen)
    rank = priority_rank(p, sink)
    assert torch.equal(cutoff_triton(rank, k, sink, window), cutoff_torch(rank, k, sink, window))


def test_topk_cutoff_validation():
    p = torch.randn(1, 2, 10)
    with pytest.raises(ValueError, match="k must be an int >= 1"): topk_cutoff(p, 0, 1, 1)
    with pytest.raises(ValueError, match="k must be an int"): topk_cutoff(p, True, 1, 1)
    with pytest.raises(ValueError, match="sink must be an int >= 0"): topk_cutoff(p, 1, -2, 1)
    with pytest.raises(ValueError, match="window must be an int >= 1"): topk_cutoff(p, 1, 1, 0)
    with pytest.raises(ValueError, match="backend must be one of"): topk_cutoff(p, 1, 1, 1, backend="numpy")
    with pytest.raises(ValueError, match="NaN"): topk_cutoff(p.index_fill(-1, torch.tensor([3]), math.nan), 1, 1, 1)
    with pytest.raises(TypeError, match="3-D real tensor"): topk_cutoff(p[0], 1, 1, 1)
    with pytest.raises(TypeError, match="3-D real tensor"): topk_cutoff(p > 0, 1, 1, 1)
    with pytest.raises(ValueError, match="at least one position"): topk_cutoff(p[..., :0], 1, 1, 1)
    assert set(CUTOFF_BACKENDS) == {"torch", "triton", "python"}


def test_integer_priorities():
    p = torch.randint(0, 3, (1, 2, 25))
    rank, cutoff = topk_cutoff(p, 3, 1, 2)
    want = topk_cutoff_reference(p.double(), 3, 1, 2)
    assert torch.equal(rank, want[0]) and torch.equal(cutoff, want[1])


def test_bench_cutoff_small():
    r = bench_cutoff(200, BH=2, k=8, sink=2, window=16, repeats=1)
    assert r["S"] == 200 and r["torch_s"] > 0 and r["brute_s"] > 0 and r["ratio"] == r["brute_s"] / r["torch_s"]


@pytest.mark.slow
def test_bench_cutoff_paper_size():
    r = bench_cutoff(4096)
    print(r)
    assert r["ratio"] > 1


def test_meta_priority_is_refused_by_name():
    "A meta tensor (a shape, no values) failed deep inside on Tensor.item(); refused up front, naming the argument."
    for fn in (lambda p: topk_cutoff(p, 3, 1, 2), lambda p: priority_rank(p, 1)):
        with pytest.raises(ValueError, match="priority is a meta tensor .* needs a tensor with data"):
            fn(torch.empty(1, 2, 16, device="meta"))
