# %% [markdown]
# # Static priorities and the running top-k cutoff
#
# > KVpop's learned per-head decay, the static priority it induces, and the cutoff of Alg. 2: its Fenwick tree, and a wavelet matrix for all queries at once.

# %%
#| default_exp kvpop.cutoff

# %%
#| export
from __future__ import annotations

import functools
import math
import os
import time

import torch
from torch import Tensor, nn

from sparsekv.attention import check_int, require_data

# %%
#| hide
import itertools
import random

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# KVpop keeps, for every query position $q$, the sinks $t < s$, the protected window
# $q - t < w$, and the $k$ best tokens of the *eligible set* (Eq. 4)
#
# $$\mathcal{E}(q) = \{t \mid s \le t \le q - w\}.$$
#
# "Best" is measured by an *effective score* that ages: a token's raw score $r_t$ (the
# teacher's target or the scorer's prediction) is lowered by $\log\gamma_h < 0$ every $n$
# tokens (Eq. 5, 18):
#
# $$r_t(q) = r_t + \Big\lfloor \frac{q - t}{n} \Big\rfloor \log \gamma_h, \qquad \gamma_h \in (0, 1).$$
#
# This notebook turns that query-dependent ranking into a single static one (§3.1, App.
# B.3), and computes the running top-$k$ threshold for all $q$ in $O(S \log S)$ with a
# Fenwick tree (§3.2, App. C.2, Alg. 2), and for all $q$ at once with a wavelet matrix of the
# ranks (the `torch` backend). The mask built from it is in
# `sparsekv.kvpop.mask`.
#
# ## The learned decay (Eq. 21)
#
# Each KV head $h$ learns its decay through an unconstrained parameter $\alpha_h$, squashed
# into a fixed range of log-decays:
#
# $$\log \gamma_h = \log \gamma_{\min} + \sigma(\alpha_h)\,(\log \gamma_{\max} - \log \gamma_{\min}), \qquad 0 < \gamma_{\min} < \gamma_{\max} < 1.$$
#
# $\sigma(\alpha_h) \in (0, 1)$, so $\log\gamma_h$ lies strictly between the two ends and
# can never reach $0$ (no decay) or run off to $-\infty$. The paper's range (App. F,
# Table 3) is $\gamma_{\min} = 0.999$, $\gamma_{\max} = 0.999999$: a token loses between
# $10^{-6}$ and $10^{-3}$ nats of priority per step. $\alpha_h = 0$ starts every head at
# the midpoint of the range in log space.
#
# Check: $\alpha = 0$ gives the log-space midpoint; very negative and very positive
# $\alpha$ approach the two ends from inside; the gradient reaches $\alpha$ and equals
# $\sigma'(\alpha)(\log\gamma_{\max} - \log\gamma_{\min})$.

# %%
#| export
class LogDecay(nn.Module):
    "Per-head log-decay log(gamma_h) = log g_min + sigmoid(alpha_h) (log g_max - log g_min), Eq. (21)."
    def __init__(self, n_heads: int, gamma_min: float = 0.999, gamma_max: float = 0.999999, alpha_init: float = 0.0):
        super().__init__()
        check_int(n_heads, "n_heads", 1)
        if not (0 < gamma_min < gamma_max < 1):
            raise ValueError(f"need 0 < gamma_min < gamma_max < 1, got gamma_min={gamma_min!r}, "
                             f"gamma_max={gamma_max!r}")
        self.log_gamma_min, self.log_gamma_max = math.log(gamma_min), math.log(gamma_max)
        self.alpha = nn.Parameter(torch.full((n_heads,), float(alpha_init)))

    def forward(self) -> Tensor:
        "log(gamma_h) for every head, [H] float32."
        span = self.log_gamma_max - self.log_gamma_min
        return self.log_gamma_min + torch.sigmoid(self.alpha) * span

    def extra_repr(self) -> str:
        return (f"n_heads={self.alpha.numel()}, gamma_min={math.exp(self.log_gamma_min):g}, "
                f"gamma_max={math.exp(self.log_gamma_max):g}")


# %%
decay = LogDecay(3)
mid = (math.log(0.999) + math.log(0.999999)) / 2
assert_close(decay(), torch.full((3,), mid))
with torch.no_grad(): decay.alpha.copy_(torch.tensor([-12., 0., 12.]))
lg = decay()
assert (lg > math.log(0.999)).all() and (lg < math.log(0.999999)).all()
assert_close(lg[0], torch.tensor(math.log(0.999)), rtol=0, atol=1e-8)
assert_close(lg[2], torch.tensor(math.log(0.999999)), rtol=0, atol=1e-8)
decay = LogDecay(2, alpha_init=0.7)
decay().sum().backward()
s = torch.sigmoid(torch.tensor(0.7))
assert_close(decay.alpha.grad, (s * (1 - s) * (math.log(0.999999) - math.log(0.999))).expand(2))
test_fail(lambda: LogDecay(2, gamma_min=0.99, gamma_max=0.9), contains="0 < gamma_min < gamma_max < 1")
test_fail(lambda: LogDecay(0), contains="n_heads must be an int >= 1")


# %% [markdown]
# ## From effective scores to a static priority (Eq. 18 → 20)
#
# **Decay step $n = 1$.** The floor disappears and the effective score splits into a part
# that depends on the token only and a part that depends on the query only (Eq. 19):
#
# $$r_t(q) = r_t + (q - t)\log\gamma = \underbrace{(r_t - t\log\gamma)}_{\bar r_t} + q\log\gamma .$$
#
# At a fixed query $q$ every eligible token carries the same $q\log\gamma$, so adding it
# changes no comparison: $r_a(q) > r_b(q) \iff \bar r_a > \bar r_b$. The top-$k$ of
# $\mathcal{E}(q)$ under effective scores is therefore the top-$k$ under the *static
# priority* (Eq. 20)
#
# $$\bar r_t = r_t - t \log\gamma,$$
#
# computed once per token, whatever $q$ is. Since $-\log\gamma > 0$, later tokens get a
# growing bonus: an old token must out-score a newer one by $(t_b - t_a)|\log\gamma|$ to
# stay ahead of it, which is the recency bias the decay is there for.
#
# **Decay step $n > 1$.** Write $q = n\,q' + a$ and $t = n\,t' + b$ with $0 \le a, b < n$
# ($q' = \lfloor q/n \rfloor$, $a = q \bmod n$). Then $q - t = n(q' - t') + (a - b)$ with
# $-n < a - b < n$, so
#
# $$\Big\lfloor \frac{q - t}{n} \Big\rfloor = \Big\lfloor \frac{q}{n} \Big\rfloor - \Big\lfloor \frac{t}{n} \Big\rfloor - [\,q \bmod n < t \bmod n\,],$$
#
# the last term being $1$ exactly when $a - b < 0$. Substituting into Eq. (18):
#
# $$r_t(q) = \underbrace{r_t - \Big\lfloor \frac{t}{n} \Big\rfloor \log\gamma}_{\bar r_t^{(n)}} \;+\; \Big\lfloor \frac{q}{n} \Big\rfloor \log\gamma \;+\; [\,q \bmod n < t \bmod n\,]\,|\log\gamma| .$$
#
# The middle term is shared by all tokens again; the last one is not: it depends on where
# $q$ and $t$ sit inside their buckets of $n$ positions. No single static ranking can
# reproduce the effective ranking at every $q$ (the order of two tokens can flip when $q$
# crosses a bucket offset). **Our approximation** (the "piecewise-constant age buckets" of
# App. B.3) ranks by the *bucketed static priority*
#
# $$\bar r_t^{(n)} = r_t - \Big\lfloor \frac{t}{n} \Big\rfloor \log\gamma,$$
#
# i.e. a token's age is counted in whole buckets of $n$ positions, from bucket to bucket.
# It drops the last term, which is either $0$ or $|\log\gamma|$, so:
#
# 1. at queries with $q \bmod n = n - 1$ (the last position of a bucket) the last term is
#    $0$ for every token and the ranking is exact;
# 2. at any $q$, two tokens whose bucketed priorities differ by more than $|\log\gamma|$
#    are ordered exactly as by the effective score; only near-ties can swap;
# 3. for $n = 1$ it is Eq. (20) exactly.
#
# A static ranking also keeps what the cutoff below relies on: a token, once out of the
# top-$k$, never comes back (with the exact effective score and $n > 1$ it could). The
# decay is computed in float32 (App. F), or float64 when the scores are float64.

# %%
#| export
def check_log_gamma(log_gamma: Tensor | float, H: int) -> Tensor | float:
    "Validate a log-decay: a finite number <= 0, or a tensor of them broadcastable to [H] (one per head)."
    if isinstance(log_gamma, Tensor):
        if not log_gamma.is_floating_point():
            raise TypeError(f"log_gamma must be a floating-point tensor, got {log_gamma.dtype}")
        if log_gamma.dim() > 1 or log_gamma.numel() not in (1, H):
            raise ValueError(f"log_gamma must be a number, a 0-d tensor or a tensor of shape [H]={H}, got shape "
                             f"{tuple(log_gamma.shape)}")
        bad = ~torch.isfinite(log_gamma) | (log_gamma > 0)
        if bad.any():
            raise ValueError("log_gamma must be finite and <= 0 (gamma in (0, 1]), got "
                             f"{log_gamma.detach().cpu().tolist()}")
        return log_gamma.reshape(-1, 1)  # [H or 1, 1]: broadcasts over positions
    if (isinstance(log_gamma, bool) or not isinstance(log_gamma, (int, float)) or not math.isfinite(log_gamma)
            or log_gamma > 0):
        raise ValueError("log_gamma must be a finite number <= 0 (gamma in (0, 1]) or a tensor of them, got "
                         f"{log_gamma!r}")
    return float(log_gamma)


# %%
test_eq(check_log_gamma(-0.5, 3), -0.5)
test_eq(check_log_gamma(torch.tensor([0.0, -0.1, -2.0]), 3).shape, (3, 1))  # one per head, broadcast over positions
test_fail(lambda: check_log_gamma(0.1, 3), contains="log_gamma must be a finite number <= 0")
test_fail(lambda: check_log_gamma(torch.tensor([-0.1, -0.2]), 3), contains="shape [H]=3, got shape (2,)")
test_fail(lambda: check_log_gamma(torch.tensor([-math.inf]), 1), contains="log_gamma must be finite and <= 0")
test_fail(lambda: check_log_gamma(torch.tensor([-1]), 1), exc=TypeError, contains="floating-point tensor")


# %%
#| export
def static_priority(r: Tensor, log_gamma: Tensor | float, n: int = 1) -> Tensor:
    "Static priority r_t - floor(t/n) log(gamma_h) of raw scores r [B,H,S]: Eq. (20) for n=1, n-token age buckets."
    if not isinstance(r, Tensor) or not r.is_floating_point() or r.dim() != 3:
        raise TypeError(f"r must be a 3-D floating-point tensor [B, H, S], got {getattr(r, 'dtype', type(r).__name__)} "
                        f"of shape {tuple(getattr(r, 'shape', ()))}")
    check_int(n, "n (the decay step)", 1)
    log_gamma = check_log_gamma(log_gamma, r.shape[1])
    acc = torch.promote_types(r.dtype, torch.float32)  # the decay in float32 at least (App. F)
    if isinstance(log_gamma, Tensor): log_gamma = log_gamma.to(device=r.device, dtype=acc)
    age = torch.div(torch.arange(r.shape[-1], device=r.device), n, rounding_mode="floor").to(acc)  # floor(t / n)
    return r.to(acc) - age * log_gamma


# %%
# by hand: zero raw scores, log(gamma) = -1/2, age buckets of n = 2 tokens: priorities 0, 0, 1/2, 1/2, 1
test_eq(static_priority(torch.zeros(1, 1, 5), -0.5, n=2).tolist(), [[[0.0, 0.0, 0.5, 0.5, 1.0]]])
test_eq(static_priority(torch.zeros(1, 1, 2, dtype=torch.float16), -0.5).dtype, torch.float32)  # float32 at least


# %% [markdown]
# Check, $n = 1$: at every query $q$, sorting the eligible tokens by effective score and by
# static priority gives the same order. Raw scores are small integers (many ties) and
# $\log\gamma$ a power of two, so all sums are exact in float64 and ties survive: ties are
# broken by position in both orderings (earlier first, as everywhere below).

# %%
#| export
def effective_score(r: Tensor, log_gamma: Tensor | float, q: int, n: int = 1) -> Tensor:
    "Effective scores r_t + floor((q-t)/n) log(gamma_h) at query q (Eq. 5, 18), [B,H,S]: checks `static_priority`."
    check_int(n, "n (the decay step)", 1)
    log_gamma = check_log_gamma(log_gamma, r.shape[1])
    steps = torch.div(q - torch.arange(r.shape[-1], device=r.device), n, rounding_mode="floor").to(r.dtype)
    return r + steps * log_gamma


# %%
def _order(scores, tokens):
    "Tokens sorted by descending score, ties by position (earlier first)."
    return sorted(tokens, key=lambda t: (-scores[t], t))

torch.manual_seed(0)
B, H, S, s, w = 2, 3, 40, 2, 3
r = torch.randint(0, 4, (B, H, S)).double()
log_gamma = -torch.tensor([0.0, 0.25, 2.0], dtype=torch.float64)      # no decay, mild, strong
pri = static_priority(r, log_gamma)
assert_close(pri, r - torch.arange(S) * log_gamma[:, None])            # Eq. (20) written out
for q in range(s + w, S):
    eff = effective_score(r, log_gamma, q)
    assert_close(eff, pri + q * log_gamma[:, None])                     # Eq. (19): static part + shared part
    for b, h in itertools.product(range(B), range(H)):
        E = range(s, q - w + 1)
        test_eq(_order(eff[b, h].tolist(), E), _order(pri[b, h].tolist(), E))

# %% [markdown]
# Check, $n > 1$: the floor identity on a grid; the effective score equals the bucketed
# priority plus the shared and the bucket-offset terms; rankings agree exactly at the last
# position of every bucket; and every pair ordered differently by the two rankings has
# bucketed priorities within $|\log\gamma|$. The last lines measure how often the
# approximation changes anything at all: the fraction of discordant pairs and of top-$k$
# sets that differ, over all $q$.

# %%
for q, t, n in itertools.product(range(30), range(30), (1, 2, 3, 7)):
    test_eq((q - t) // n, q // n - t // n - int(q % n < t % n))

def _ranking_error(r, log_gamma, n, s, w, k):
    "(share of discordant eligible pairs, share of (q, head) whose top-k set differs), exact vs bucketed rankings."
    pri = static_priority(r, log_gamma, n)
    pairs = bad_pairs = sets = bad_sets = 0
    for q in range(s + w, r.shape[-1]):
        eff = effective_score(r, log_gamma, q, n)
        E = list(range(s, q - w + 1))
        for b, h in itertools.product(range(r.shape[0]), range(r.shape[1])):
            e, p = eff[b, h].tolist(), pri[b, h].tolist()
            exact, approx = _order(e, E), _order(p, E)
            if q % n == n - 1: test_eq(exact, approx)                  # property 1: exact at bucket ends
            pos = {t: i for i, t in enumerate(approx)}
            for i, a in enumerate(exact):                              # exact ranks a before every later c
                for c in exact[i + 1:]:
                    pairs += 1
                    if pos[a] > pos[c]:
                        bad_pairs += 1
                        assert abs(p[a] - p[c]) <= abs(log_gamma[h].item())   # property 2: only near-ties swap
            sets += 1
            bad_sets += set(exact[:k]) != set(approx[:k])
    return bad_pairs / pairs, bad_sets / sets

torch.manual_seed(1)
r = torch.randn(1, 2, 48, dtype=torch.float64)
for n in (2, 4, 8):
    for lg in (1e-3, 0.05, 0.5):
        log_gamma = torch.tensor([-lg, -lg / 4], dtype=torch.float64)
        pri = static_priority(r, log_gamma, n)
        for q in range(48):
            assert_close(effective_score(r, log_gamma, q, n),
                         pri + (q // n) * log_gamma[:, None] - (q % n < torch.arange(48) % n) * log_gamma[:, None])
        pair_err, set_err = _ranking_error(r, log_gamma, n, s=2, w=3, k=5)
        print(f"n={n} |log gamma|={lg}: discordant pairs {pair_err:.3%}, top-5 sets differing {set_err:.2%}")
test_fail(lambda: static_priority(r, torch.tensor([0.1, -0.1]), 2), contains="<= 0")
test_fail(lambda: static_priority(r, -0.1, 0), contains="n (the decay step)")
test_fail(lambda: static_priority(r.long(), -0.1), contains="floating-point")


# %% [markdown]
# With the paper's step $n = 1$ there is no approximation. For $n > 1$ the error grows
# with $|\log\gamma|$ relative to the spread of the scores (unit-variance scores here); the cell above prints it
# at the paper's largest decay, $|\log\gamma| \approx 10^{-3}$, and at larger ones.
#
# ## Ranks
#
# The cutoff works with integer ranks rather than scores. Among the tokens that can ever
# be eligible, $t \ge s$, sort by descending static priority; $\mathrm{rank}(t)$ is the
# position in that order: $0$ is the best, $S - s - 1$ the worst. **Ties**: the earlier
# token ranks better (a total order, so "the top-$k$" is always a set of exactly $k$
# tokens). **Sinks** ($t < s$) never compete; they get rank $S$, larger than every real
# rank, so that the rank tensor has the full length $[B, H, S]$ and a sink can never pass a
# rank test by accident. The reference counts, for each token, the tokens that beat it;
# that is $O(S^2)$ and independent of any sort routine.

# %%
#| export
def check_priority(priority: Tensor) -> Tensor:
    "Validate priorities: a real [B,H,S] tensor with S >= 1 and no NaN."
    if not isinstance(priority, Tensor) or priority.dim() != 3 or priority.dtype == torch.bool or priority.is_complex():
        raise TypeError("priority must be a 3-D real tensor [B, H, S], got "
                        f"{getattr(priority, 'dtype', type(priority).__name__)} "
                        f"of shape {tuple(getattr(priority, 'shape', ()))}")
    if priority.shape[-1] < 1:
        raise ValueError(f"priority needs at least one position, got shape {tuple(priority.shape)}")
    require_data("priority", priority)  # ranking reads values
    if priority.is_floating_point() and torch.isnan(priority.amax()):  # max propagates NaN: one reduction
        raise ValueError("priority contains NaN: rankings need ordered values (+-inf are allowed)")
    return priority


# %%
_pr = torch.tensor([[[1.0, math.inf, -math.inf]]])
assert check_priority(_pr) is _pr and check_priority(torch.tensor([[[3, 1]]])) is not None  # integers are fine
test_fail(lambda: check_priority(torch.zeros(1, 1, 0)), contains="needs at least one position")
test_fail(lambda: check_priority(torch.tensor([[[True]]])), exc=TypeError, contains="3-D real tensor")
test_fail(lambda: check_priority(torch.tensor([[[0.0, math.nan]]])), contains="priority contains NaN")


# %%
#| export
def check_budget(k: int, sink: int, window: int) -> tuple[int, int, int]:
    "Validate the budget: k >= 1 long-range tokens, sink >= 0 sinks, window >= 1 protected recent tokens (Eq. 1)."
    return check_int(k, "k", 1), check_int(sink, "sink", 0), check_int(window, "window", 1)


# %%
test_eq(check_budget(3, 0, 1), (3, 0, 1))
test_fail(lambda: check_budget(0, 0, 1), contains="k must be an int >= 1")
test_fail(lambda: check_budget(1, 0, 0), contains="window must be an int >= 1")


# %%
#| export
def priority_rank(priority: Tensor, sink: int) -> Tensor:
    "rank[t], int64 [B,H,S]: position of t >= sink by descending priority (0 = best, ties: earlier first); sinks get S."
    priority = check_priority(priority)
    sink = check_int(sink, "sink", 0)
    S = priority.shape[-1]
    rank = torch.full(priority.shape, S, dtype=torch.int64, device=priority.device)
    n = max(S - sink, 0)
    if n == 0: return rank
    # stable: ties keep time order
    order = torch.sort(priority[..., sink:], dim=-1, descending=True, stable=True).indices
    rank[..., sink:] = torch.empty_like(order).scatter_(
        -1, order, torch.arange(n, device=order.device).expand_as(order))
    return rank


# %%
p = torch.tensor([[[5., -math.inf, math.inf, 5., 0.]]])
test_eq(priority_rank(p, 1)[0, 0].tolist(), [5, 3, 0, 1, 2])  # the sink gets S; the tie 5, 5 goes to the earlier
test_eq(priority_rank(p, 5)[0, 0].tolist(), [5] * 5)             # all sinks


# %%
#| export
def rank_reference(priority: Tensor, sink: int) -> Tensor:
    "`priority_rank` by counting per eligible token the tokens that beat it (higher priority, or equal and earlier)."
    priority = check_priority(priority)
    S = priority.shape[-1]
    rank = torch.full(priority.shape, S, dtype=torch.int64, device=priority.device)
    t = torch.arange(S, device=priority.device)
    for a in range(sink, S):
        rivals = t >= sink
        beats = (priority > priority[..., a:a + 1]) | ((priority == priority[..., a:a + 1]) & (t < a))
        rank[..., a] = (beats & rivals).sum(-1)
    return rank


# %%
torch.manual_seed(2)
for S, sink in ((1, 0), (1, 3), (5, 5), (9, 2), (64, 4)):
    for p in (torch.randn(2, 3, S), torch.randint(0, 3, (2, 3, S)), torch.randint(0, 2, (2, 3, S)).float()):
        rank = priority_rank(p, sink)
        test_eq(rank, rank_reference(p, sink))
        test_eq(rank[..., :sink], torch.full_like(rank[..., :sink], S))
        test_eq(rank[..., sink:].sort(-1).values, torch.arange(max(S - sink, 0)).expand(2, 3, -1))  # a permutation
test_fail(lambda: priority_rank(torch.tensor([[[1., math.nan]]]), 0), contains="NaN")
test_fail(lambda: priority_rank(torch.zeros(2, 3), 0), contains="3-D real tensor")


# %% [markdown]
# ## The running top-$k$ cutoff
#
# With ranks fixed, the top-$k$ of $\mathcal{E}(q)$ is the set of the $k$ eligible tokens
# with the smallest ranks. Let $\tau_q$ be the $k$-th smallest rank in $\mathcal{E}(q)$;
# then the kept long-range tokens are exactly those with $\mathrm{rank}(t) \le \tau_q$
# (Eq. 26), and one integer per query describes the whole top-$k$. When fewer than $k$
# tokens are eligible, all of them are kept: we set $\tau_q = S$, above every rank.
#
# As $q$ grows by one, $\mathcal{E}(q)$ gains exactly one token, $t_\text{new} = q - w$
# (if $t_\text{new} \ge s$), and loses none. So $\tau_q$ is the $k$-th smallest element of
# a set that only grows, and never increases: inserting an element either leaves the $k$
# smallest alone or pushes the old $k$-th out.
#
# The brute force recomputes $\tau_q$ for every $q$ by sorting the ranks of
# $\mathcal{E}(q)$: $O(S^2 \log S)$ time.

# %%
#| export
def eligible_count(S: int, sink: int, window: int, device=None) -> Tensor:
    "|E(q)| = max(0, q - window - sink + 1) for q = 0..S-1, int64 [S] (Eq. 4)."
    return (torch.arange(S, device=device) - window - sink + 1).clamp(0, max(S - sink, 0))


# %%
# S = 8, one sink, a window of 2: token q - 2 becomes eligible at q = 3
test_eq(eligible_count(8, 1, 2).tolist(), [0, 0, 0, 1, 2, 3, 4, 5])
test_eq(eligible_count(4, 9, 1).tolist(), [0] * 4)  # more sinks than tokens


# %%
#| export
def cutoff_reference(rank: Tensor, k: int, sink: int, window: int) -> Tensor:
    "Brute-force cutoff: per q, sort the ranks in E(q) = {sink <= t <= q - window}, take the k-th (S if |E(q)| < k)."
    B, H, S = rank.shape
    cutoff = torch.full((B, H, S), S, dtype=torch.int64, device=rank.device)
    for q in range(S):
        eligible = rank[..., sink:max(sink, q - window + 1)]
        if eligible.shape[-1] >= k: cutoff[..., q] = eligible.sort(-1).values[..., k - 1]
    return cutoff


# %%
# ranks of positions 0..4 with one sink: 5 (the sink), 2, 0, 3, 1; window 1, k = 2. E(q) = {1, ..., q - 1}: fewer
# than 2 tokens up to q = 2 (cutoff S = 5), then the 2nd smallest of {2, 0} and of {2, 0, 3}: 2
_rk = torch.tensor([[[5, 2, 0, 3, 1]]])
test_eq(cutoff_reference(_rk, 2, 1, 1).tolist(), [[[5, 5, 5, 2, 2]]])
test_eq(cutoff_reference(_rk, 1, 1, 1).tolist(), [[[5, 5, 2, 0, 0]]])


# %%
#| export
def topk_cutoff_reference(priority: Tensor, k: int, sink: int, window: int) -> tuple[Tensor, Tensor]:
    "(rank, cutoff) by brute force: ranks by counting (`rank_reference`), cutoffs by sorting (`cutoff_reference`)."
    k, sink, window = check_budget(k, sink, window)
    rank = rank_reference(priority, sink)
    return rank, cutoff_reference(rank, k, sink, window)


# %%
# priorities whose ranks (one sink) are the ones above: 5 > 3 > 1 > 0 at positions 2, 4, 1, 3
test_eq(topk_cutoff_reference(torch.tensor([[[9.0, 1, 5, 0, 3]]]), 2, 1, 1), (_rk, torch.tensor([[[5, 5, 5, 2, 2]]])))
test_fail(lambda: topk_cutoff_reference(torch.zeros(1, 1, 3), 0, 1, 1), contains="k must be an int >= 1")


# %% [markdown]
# ## A Fenwick tree over ranks (Alg. 2)
#
# A Fenwick (binary indexed) tree keeps counts $c_0, \dots, c_{n-1}$ (here: $c_r = 1$ if
# the token of rank $r$ is eligible) in an array $T[1..n]$ where node $i$ stores the sum
# of the $\mathrm{lowbit}(i)$ counts ending at position $i$ (1-indexed), $\mathrm{lowbit}(i)
# = i \,\&\, (-i)$ being the lowest set bit:
#
# $$T[i] = \sum_{r = i - \mathrm{lowbit}(i)}^{i - 1} c_r .$$
#
# - **insert** rank $r$: the nodes covering position $r + 1$ are $i = r + 1$, then
#   $i \mathrel{+}= \mathrm{lowbit}(i)$ while $i \le n$: $O(\log n)$ of them.
# - **$k$-th smallest** by *binary lifting*: find the largest $p$ with
#   $c_0 + \dots + c_{p-1} < k$; the answer is rank $p$. Start at $p = 0$ with $k$ still
#   to find, and try steps $2^l$ from the largest power of two $\le n$ down to $1$. At
#   each step $p$ is a multiple of $2^{l+1}$, so $\mathrm{lowbit}(p + 2^l) = 2^l$ and node
#   $T[p + 2^l]$ holds exactly the counts of ranks $p, \dots, p + 2^l - 1$. If that is less
#   than what is still to find, all those ranks lie below the answer: move $p$ past them
#   and subtract. $O(\log n)$ steps, each one array read.
#
# Alg. 2 scans $q = 0, \dots, S-1$: insert $\mathrm{rank}(q - w)$ when $q - w \ge s$, then
# read $\tau_q$ by binary lifting (or $S$ while fewer than $k$ are inserted). $O(S \log S)$
# time and $O(S)$ memory per head. The `python` backend is this loop, written to be read.
#
# Check the tree against plain counting after every insertion, in a random order.

# %%
#| export
class Fenwick:
    "Fenwick tree of counts over ranks 0..n-1: insert a rank, find the k-th smallest inserted rank."
    def __init__(self, n: int):
        self.n, self.tree, self.size = n, [0] * (n + 1), 0  # tree[i] counts ranks i - lowbit(i) .. i - 1

    def insert(self, r: int):
        "Add one token of rank r (0 <= r < n)."
        i = r + 1
        while i <= self.n:
            self.tree[i] += 1
            i += i & -i  # next node whose range covers position r + 1
        self.size += 1

    def count_below(self, r: int) -> int:
        "Number of inserted ranks < r."
        total, i = 0, r
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def kth(self, k: int) -> int:
        "The k-th smallest inserted rank (k >= 1), by binary lifting; n if fewer than k are inserted."
        if k > self.size: return self.n
        p, rest = 0, k
        step = 1 << (self.n.bit_length() - 1)  # largest power of two <= n
        while step:
            if p + step <= self.n and self.tree[p + step] < rest:  # ranks p .. p+step-1 all lie below the answer
                p += step
                rest -= self.tree[p]
            step >>= 1
        return p


# %%
random.seed(0)
for n in (1, 2, 7, 16, 33):
    tree, inserted = Fenwick(n), []
    for r in random.sample(range(n), n):
        tree.insert(r)
        inserted.append(r)
        for x in range(n + 1): test_eq(tree.count_below(x), sum(y < x for y in inserted))
        ordered = sorted(inserted)
        for j in range(1, n + 2): test_eq(tree.kth(j), ordered[j - 1] if j <= len(ordered) else n)


# %%
#| export
def cutoff_python(rank: Tensor, k: int, sink: int, window: int) -> Tensor:
    "Cutoffs [B,H,S] by Alg. 2: one Fenwick tree per (batch, head), scanning q left to right."
    B, H, S = rank.shape
    n = max(S - sink, 0)
    cutoff = torch.full((B, H, S), S, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            ranks, tree = rank[b, h].tolist(), Fenwick(n)
            for q in range(S):
                if q - window >= sink: tree.insert(ranks[q - window])  # t_new = q - w becomes eligible
                if tree.size >= k: cutoff[b, h, q] = tree.kth(k)
    return cutoff.to(rank.device)


# %%
test_eq(cutoff_python(_rk, 2, 1, 1).tolist(), [[[5, 5, 5, 2, 2]]])  # the hand-computed case above
test_eq(cutoff_python(_rk, 1, 1, 1).tolist(), [[[5, 5, 2, 0, 0]]])


# %% [markdown]
# ## All queries at once (the `torch` backend)
#
# The scan above is sequential in $q$: $S$ steps of $O(\log S)$ tiny operations each.
# Vectorized over heads in PyTorch, each of them would be a separate operator call of a few
# microseconds, some $2 S \log_2 S \approx 460\,000$ calls at $S = 16384$: seconds of
# pure overhead.
# The question each query asks, though, does not need the tree to be built in time order:
# number the eligible tokens by entry time $u = t - s$ ($n = S - s$ of them); then
# $\mathcal{E}(q)$ is the prefix $u < m_q$ ($m_q = |\mathcal{E}(q)|$) and
#
# $$\tau_q = \text{the } k\text{-th smallest of } r_0, \dots, r_{m_q - 1}, \qquad r_u = \mathrm{rank}(s + u),$$
#
# a $k$-th smallest query on a prefix of one fixed sequence, which all queries can answer
# together, reading the ranks' bits from the top ($L = \lceil \log_2 n \rceil$ bits):
#
# - **One bit at a time.** Of the tokens still in play (at first the prefix), let $z$ have a
#   0 in the current bit. If $z \ge k$, the answer has a 0 there and only those $z$ tokens
#   stay in play; else it has a 1, the $z$ smaller ones are counted ($k \leftarrow k - z$)
#   and the others stay. After $L$ bits the bits chosen spell $\tau_q$.
# - **Counting $z$ in $O(1)$: a wavelet matrix.** Before reading bit $l$, reorder the
#   sequence stably by that bit (zeros first, each side in its previous order), once for all
#   queries. If the tokens in play occupy positions $[a, b)$ of the order at bit $l$, with
#   $Z_l(i)$ the zeros among its first $i$ positions (a prefix sum) and $N_l = Z_l(n)$, then
#   $z = Z_l(b) - Z_l(a)$, and in the next order the zeros of $[a, b)$ occupy
#   $[Z_l(a), Z_l(b))$ and its ones $[N_l + a - Z_l(a), N_l + b - Z_l(b))$: a stable
#   partition moves each side's members together, keeping their order, so the tokens in play
#   stay one contiguous range at every bit. The prefix starts as $[0, m_q)$.
#
# Per bit: one prefix sum and one stable partition of the $n$ ranks (shared by all queries)
# and two lookups per query, vectorized over all (batch, head) pairs: $O(S \log S)$ work
# in $\lceil \log_2 S \rceil$ rounds of a few large tensor operations, $O(S)$ memory per
# head. (An earlier version counted Fenwick nodes with one sort of $n$ keys per bit:
# $O(S \log^2 S)$, two to three times slower on this CPU at $S$ = 2,048 to 16,384.) Queries
# before $q = s + w + k - 1$ have fewer than $k$ eligible tokens ($\tau_q = S$) and are
# skipped. It returns Alg. 2's $\tau_q$ exactly: both give the $k$-th smallest rank of
# $\mathcal{E}(q)$, checked below against the brute force.

# %%
#| export
def prefix_kth(r: Tensor, m: Tensor, k: int) -> Tensor:
    """The k-th smallest of r[i, :m[i, j]] for every i, j, int64 [R, Q], by a wavelet matrix: r [R, n] holds a
    permutation of 0..n-1 in each row; m [R, Q] (or [Q], shared by the rows) prefix lengths in [k, n]."""
    R, n = r.shape
    a, b = torch.zeros(R, m.shape[-1], dtype=torch.int64, device=r.device), m.expand(R, -1)  # in play: [a, b) of r
    rest, tau = torch.full_like(a, k), torch.zeros_like(a)
    u = torch.arange(n, device=r.device)
    zeros = torch.zeros(R, n + 1, dtype=torch.int64, device=r.device)  # Z(i): zeros among the first i
    for level in range(max(n - 1, 1).bit_length() - 1, -1, -1):
        bit = (r >> level) & 1
        torch.cumsum(1 - bit, -1, out=zeros[:, 1:])
        N, za, zb = zeros[:, -1:], zeros.gather(-1, a), zeros.gather(-1, b)
        one = rest > zb - za  # fewer than `rest` zeros in play: this bit of tau is 1
        tau |= one.long() << level
        rest = torch.where(one, rest - (zb - za), rest)
        a, b = torch.where(one, N + a - za, za), torch.where(one, N + b - zb, zb)
        if level:  # the next bit's order: a stable partition, zeros first
            r = torch.empty_like(r).scatter_(-1, torch.where(bit == 0, zeros[:, :-1], N + u - zeros[:, :-1]), r)
    return tau


def cutoff_torch(rank: Tensor, k: int, sink: int, window: int) -> Tensor:
    "Cutoffs [B,H,S]: the k-th smallest rank of each prefix E(q), for all queries at once by a wavelet matrix of ranks."
    B, H, S = rank.shape
    n = max(S - sink, 0)
    cutoff = torch.full((B * H, S), S, dtype=torch.int64, device=rank.device)
    first = sink + window + k - 1  # the first query with |E(q)| >= k; before it, cutoff = S
    if n == 0 or first >= S: return cutoff.reshape(B, H, S)
    m = eligible_count(S, sink, window, rank.device)[first:]  # E(q) = the first m[q] eligible tokens in time order
    cutoff[:, first:] = prefix_kth(rank[..., sink:].reshape(B * H, n), m, k)
    return cutoff.reshape(B, H, S)


# %%
# the k-th smallest of every prefix, by brute force: random permutations, every prefix length from k, every k
torch.manual_seed(5)
for n in (1, 2, 7, 33):
    r = torch.stack([torch.randperm(n) for _ in range(3)])
    for k in range(1, n + 1):
        m = torch.arange(k, n + 1)
        want = torch.stack([torch.stack([row[:j].sort().values[k - 1] for j in m]) for row in r])
        test_eq(prefix_kth(r, m, k), want)
        shuffled = torch.stack([m[torch.randperm(len(m))] for _ in range(3)])  # lengths of each row's own, any order
        test_eq(prefix_kth(r, shuffled, k), torch.stack([torch.stack([row[:j].sort().values[k - 1] for j in lens])
                                                           for row, lens in zip(r, shuffled)]))

# %%
# the step it rests on, by brute force: after a stable partition by one bit, the zeros and the ones of every
# range [a, b) sit at [Z(a), Z(b)) and [N + a - Z(a), N + b - Z(b)), in their old order
torch.manual_seed(6)
r = torch.randperm(37)
bit = (r >> 3) & 1
order = torch.cat([r[bit == 0], r[bit == 1]])
Z = torch.cat([torch.zeros(1, dtype=torch.int64), (1 - bit).cumsum(0)])
N = int(Z[-1])
for a in range(38):
    for b in range(a, 38):
        test_eq(order[Z[a]:Z[b]], r[a:b][bit[a:b] == 0])
        test_eq(order[N + a - Z[a]:N + b - Z[b]], r[a:b][bit[a:b] == 1])


# %% [markdown]
# Check both backends against the brute force: sizes from $1$ to $300$, budgets larger and
# smaller than the sequence, no sinks, a window of one, and priorities with many ties.

# %%
def _configs():
    "(S, k, sink, window) covering S < s + w + k, n a power of two or not, and no eligible token at all."
    yield from ((1, 1, 0, 1), (1, 3, 2, 4), (2, 1, 0, 1), (7, 2, 1, 2), (16, 3, 0, 1), (17, 4, 1, 1),
                (33, 5, 4, 8), (64, 64, 0, 1), (100, 7, 3, 20), (300, 16, 4, 32), (300, 1000, 2, 5))

torch.manual_seed(3)
for S, k, sink, window in _configs():
    for p in (torch.randn(2, 3, S), torch.randint(0, 4, (2, 3, S)).float()):
        rank, want = topk_cutoff_reference(p, k, sink, window)
        test_eq(cutoff_torch(rank, k, sink, window), want)
        if S <= 100: test_eq(cutoff_python(rank, k, sink, window), want)
        assert (want[..., 1:] <= want[..., :-1]).all()                  # tau_q never increases


# %% [markdown]
# ## A Triton kernel (the `triton` backend)
#
# The GPU version of Alg. 2 as the paper runs it: one program per (batch, head), its
# Fenwick array in a scratch buffer of $n + 1$ int32 counters in global memory, the scan
# over $q$ and the binary lifting as scalar loops inside the kernel (int32 only, one
# warp, one configuration). Barriers around each insertion keep the threads of the
# program in step: the descent at $q$ reads the tree after the insertion at $q$ and before
# the insertion at $q + 1$. Triton is imported on first use; on a CPU it runs
# only under the interpreter, for which `TRITON_INTERPRET=1` must be set before Triton is
# imported.

# %%
#| export
@functools.cache
def _fenwick_cutoff_kernel():
    "Build the Triton kernel of Alg. 2 (imported lazily: Triton is optional)."
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(rank_ptr, cutoff_ptr, tree_ptr, S, n, sink, window, k, top):
        head = tl.program_id(0).to(tl.int64)
        rank_ptr += head * S
        cutoff_ptr += head * S
        tree_ptr += head * (n + 1)
        size = 0
        for q in range(0, S):
            tl.debug_barrier()  # the previous descent has read the tree before it changes
            t = q - window
            if t >= sink:  # t_new = q - w becomes eligible: insert its rank
                i = tl.load(rank_ptr + t) + 1
                while i <= n:
                    tl.store(tree_ptr + i, tl.load(tree_ptr + i) + 1)
                    i += i & -i
                size += 1
            tl.debug_barrier()  # the insertion is visible before the descent reads the tree
            tau = S
            if size >= k:  # binary lifting for the k-th smallest inserted rank
                p = 0
                rest = k
                step = top
                while step > 0:
                    if p + step <= n:
                        node = tl.load(tree_ptr + p + step)
                        if node < rest:
                            p += step
                            rest -= node
                    step = step // 2
                tau = p
            tl.store(cutoff_ptr + q, tau)

    return kernel


# %%
if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
_kernel = _fenwick_cutoff_kernel()
assert _fenwick_cutoff_kernel() is _kernel  # built once
# by hand, one head of S = n = 3 ranks 2, 0, 1, no sink, w = 1, k = 1: nothing eligible at q = 0 (S), then the
# smallest of {2} and of {2, 0}
_dev = "cuda" if torch.cuda.is_available() else "cpu"
_ranks = torch.tensor([[2, 0, 1]], dtype=torch.int32, device=_dev)
_out = torch.empty(1, 3, dtype=torch.int32, device=_dev)
_kernel[(1,)](_ranks, _out, torch.zeros(1, 4, dtype=torch.int32, device=_dev), 3, 3, 0, 1, 1, 2, num_warps=1)
test_eq(_out.tolist(), [[3, 2, 0]])


# %%
#| export
def triton_interpreted() -> bool:
    "Whether Triton kernels run in the interpreter (TRITON_INTERPRET=1, read when a kernel is built)."
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def require_triton_device(x: Tensor) -> None:
    "Raise ValueError unless a Triton kernel can run on `x`'s device: CUDA, or any device under the interpreter."
    if not x.is_cuda and not triton_interpreted():
        raise ValueError(f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported "
                         f"to run on {x.device.type}; use backend='torch' there")


# %%
_was = os.environ.get("TRITON_INTERPRET")
for _v, _want in (("1", True), ("on", True), ("TRUE", True), ("0", False), ("", False)):
    os.environ["TRITON_INTERPRET"] = _v
    test_eq(triton_interpreted(), _want)
    if _want: require_triton_device(torch.zeros(1))  # the interpreter runs on the CPU
    else: test_fail(lambda: require_triton_device(torch.zeros(1)), contains="needs CUDA tensors, or TRITON_INTERPRET=1")
if _was is None: del os.environ["TRITON_INTERPRET"]
else: os.environ["TRITON_INTERPRET"] = _was


# %% [markdown]
# The kernel on this machine's CPU, in the interpreter (slow: small sizes only). The cell
# sets `TRITON_INTERPRET=1` when there is no GPU; in a fresh process that must happen
# before anything imports Triton (the test suite's `conftest.py` does it first thing).

# %%
#| export
def cutoff_triton(rank: Tensor, k: int, sink: int, window: int) -> Tensor:
    "Cutoffs [B,H,S] by the Triton kernel of Alg. 2 (a program per (batch, head)) on CUDA, or with TRITON_INTERPRET=1."
    require_triton_device(rank)
    B, H, S = rank.shape
    if S >= 2**31: raise ValueError(f"backend='triton' counts in int32: S must be < 2**31, got {S}")
    n = max(S - sink, 0)
    ranks = rank.to(torch.int32).reshape(B * H, S).contiguous()
    cutoff = torch.empty_like(ranks)
    tree = torch.zeros(B * H, n + 1, dtype=torch.int32, device=rank.device)
    top = 1 << (n.bit_length() - 1) if n else 0
    _fenwick_cutoff_kernel()[(B * H,)](ranks, cutoff, tree, S, n, min(sink, S), min(window, S), min(k, S + 1), top,
                                       num_warps=1)
    return cutoff.to(torch.int64).reshape(B, H, S)


# %%
if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")
torch.manual_seed(4)
for S, k, sink, window in ((1, 1, 0, 1), (2, 1, 0, 1), (7, 2, 1, 2), (17, 4, 1, 1), (24, 3, 2, 3), (24, 40, 0, 1)):
    p = torch.randint(0, 4, (1, 2, S)).float()
    rank, want = topk_cutoff_reference(p, k, sink, window)
    test_eq(cutoff_triton(rank, k, sink, window), want)

# %% [markdown]
# ## One entry point: `topk_cutoff`
#
# `topk_cutoff(priority, k, sink, window, backend)` validates its arguments, ranks the
# tokens once (a stable sort) and returns `(rank, cutoff)`, both int64 $[B, H, S]$:
#
# | `backend` | what runs | where |
# |---|---|---|
# | `"torch"` | all queries at once: a wavelet matrix of the ranks (prefix sum + stable partition per bit) | any device |
# | `"triton"` | one program per (batch, head): Fenwick tree and binary lifting in the kernel | CUDA; CPU under `TRITON_INTERPRET=1` |
# | `"python"` | Alg. 2 with the `Fenwick` class | CPU loops, for reading and testing |
#
# Conventions: `rank[t] = S` for sinks; `cutoff[q] = S` while $|\mathcal{E}(q)| < k$.
# Token $t$ is kept as a long-range token at query $q$ iff
# $s \le t \le q - w$ and `rank[t] <= cutoff[q]` (Eq. 26).

# %%
#| export
CUTOFF_BACKENDS = ("torch", "triton", "python")

# %%
# the `backend` values of `topk_cutoff`, its default first
test_eq(CUTOFF_BACKENDS, ("torch", "triton", "python"))


# %%
#| export
def topk_cutoff(priority: Tensor, k: int, sink: int, window: int, backend: str = "torch") -> tuple[Tensor, Tensor]:
    """(rank, cutoff), int64 [B,H,S]: rank of each token t >= sink by descending priority (ties: earlier first;
    sinks: S), and cutoff[q] = the k-th smallest rank in E(q) = {sink <= t <= q - window}, or S when |E(q)| < k
    (Alg. 2)."""
    if backend not in CUTOFF_BACKENDS: raise ValueError(f"backend must be one of {CUTOFF_BACKENDS}, got {backend!r}")
    k, sink, window = check_budget(k, sink, window)
    rank = priority_rank(priority, sink)  # validates priority
    cutoff = {"torch": cutoff_torch, "triton": cutoff_triton, "python": cutoff_python}[backend](rank, k, sink, window)
    return rank, cutoff


# %%
torch.manual_seed(5)
p = torch.randint(0, 5, (2, 4, 50)).float()
want = topk_cutoff_reference(p, 6, 2, 5)
for backend in CUTOFF_BACKENDS:
    got = topk_cutoff(p, 6, 2, 5, backend=backend)
    test_eq(got[0], want[0])
    test_eq(got[1], want[1])
    test_eq(got[1].dtype, torch.int64)
test_fail(lambda: topk_cutoff(p, 0, 2, 5), contains="k must be an int >= 1")
test_fail(lambda: topk_cutoff(p, 3, -1, 5), contains="sink must be an int >= 0")
test_fail(lambda: topk_cutoff(p, 3, 2, 0), contains="window must be an int >= 1")
test_fail(lambda: topk_cutoff(p, 3.0, 2, 5), contains="k must be an int")
test_fail(lambda: topk_cutoff(p, 3, 2, 5, backend="cuda"), contains="backend must be one of")
test_fail(lambda: topk_cutoff(p.masked_fill(p == 0, math.nan), 3, 2, 5), contains="NaN")
test_fail(lambda: topk_cutoff(p.to("meta"), 3, 2, 5), contains="priority is a meta tensor")  # a shape, no values


# %% [markdown]
# ## Benchmark
#
# `bench_cutoff(S)` times the `torch` backend (ranking included) against the per-query
# brute force (`cutoff_reference`, given the ranks for free), checks they agree, and
# reports the ratio. Memory: the `torch` backend holds $O(S)$ int64 values per head (the
# keys and their sorted copy over $n$ tokens; $p$, the remaining count, $m_q$ and the node
# count per query; the ranks and the output), reported as `torch_bytes_per_head`; on CUDA
# the measured peak is reported too. The brute force is also $O(S)$ per head (one sorted
# prefix at a time) but $O(S^2 \log S)$ in time. The paper-scale defaults are $s = 4$,
# $w = 256$, $k = 2016$ (App. F).

# %%
#| export
def _timed(fn, repeats: int):
    "(best wall time over `repeats` runs, last result)."
    best, out = math.inf, None
    for _ in range(repeats):
        if torch.cuda.is_available(): torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if torch.cuda.is_available(): torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, out


# %%
_calls = []
_best, _out = _timed(lambda: _calls.append(1) or len(_calls), 3)
test_eq((_out, len(_calls)), (3, 3))  # the last result of three runs
assert 0 <= _best < 1


# %%
#| export
def bench_cutoff(S: int, BH: int = 8, k: int = 2016, sink: int = 4, window: int = 256, repeats: int = 3,
                 device=None, seed: int = 0) -> dict:
    "Time `topk_cutoff(backend='torch')` against the per-query brute force on B x H = 1 x BH heads of length S."
    k, sink, window = check_budget(k, sink, window)
    gen = torch.Generator().manual_seed(seed)
    priority = torch.randn(1, BH, S, generator=gen).to(device or "cpu")
    if priority.is_cuda: torch.cuda.reset_peak_memory_stats()
    torch_s, (rank, cutoff) = _timed(lambda: topk_cutoff(priority, k, sink, window, backend="torch"), repeats)
    peak = torch.cuda.max_memory_allocated() if priority.is_cuda else None
    brute_s, want = _timed(lambda: cutoff_reference(rank, k, sink, window), 1)
    if not torch.equal(cutoff, want): raise AssertionError("the torch backend disagrees with the brute force")
    return {"S": S, "BH": BH, "k": k, "sink": sink, "window": window, "device": str(priority.device),
            "torch_s": torch_s, "brute_s": brute_s, "ratio": brute_s / torch_s,
            # at most: keys + sorted keys; p, rest, node, m, rank, cutoff
            "torch_bytes_per_head": 8 * (2 * (S - sink) + 6 * S),
            "cuda_peak_bytes": peak}


# %%
r = bench_cutoff(300, BH=2, k=16, window=8, repeats=1)
test_eq(r["S"], 300)
assert r["ratio"] > 0

# %% [markdown]
# At the paper's sizes (flagged `slow`: the brute force takes minutes on 2 CPU cores):

# %%
#| slow
import pandas as pd

# %%
#| slow
results = pd.DataFrame([bench_cutoff(S) for S in (4096, 16384)])
results[["S", "BH", "k", "torch_s", "brute_s", "ratio", "torch_bytes_per_head"]]
