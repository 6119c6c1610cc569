# %% [markdown]
# # KVpop: teacher boundary and retention loss
#
# > The teacher's keep/drop decision, its boundary token and KVpop's boundary-aware pairwise loss (Eq. 5–7, 22–25).

# %%
#| default_exp kvpop.loss

# %%
#| export
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsekv.kvpop.cutoff import check_budget, topk_cutoff

# %%
#| hide
from fastcore.test import test_close, test_eq, test_fail
from torch.testing import assert_close

from sparsekv.kvpop.cutoff import LogDecay, static_priority

# %% [markdown]
# KVpop keeps, for every KV head, $s$ sink tokens, a protected window of the $w$ most recent
# tokens, and $k$ long-range tokens chosen by a learned scorer (budget $B = s + w + k$,
# Eq. (1)). At query position $q$ the tokens competing for the $k$ long-range slots are
#
# $$\mathcal{E}(q) = \{t : s \le t \le q - w\} \qquad \text{(Eq. (4))},$$
#
# and from one query to the next exactly one token enters this set: $t_{\mathrm{new}} = q - w$,
# which has just left the protected window. The scorer is trained at exactly this moment:
# would the teacher keep $t_{\mathrm{new}}$, and does the student rank it on the right side
# of the teacher's cutoff? This notebook builds that supervision from a target score
# $r^{\mathrm{tgt}}_{h,t}$ (the future-attention target of Eq. (3), computed in
# `sparsekv.kvpop.target`) and a predicted score $\hat r_{h,t}$ (the scorer's output).
#
# ## Effective scores and static priorities (Eq. 5, 18–20)
#
# Both the teacher and the student rank the eligible tokens by an *effective score* that
# decays with the token's age $q - t$ (Eq. (5), Eq. (18)):
#
# $$r_{h,t}(q) = r_{h,t} + \Big\lfloor \frac{q - t}{n} \Big\rfloor \log \gamma_h, \qquad \gamma_h \in (0, 1).$$
#
# The loss (Eq. (7)) compares two tokens at the same query $q$: the newly eligible token and
# the teacher's boundary token. For decay step $n = 1$ the floor disappears and the
# difference of effective scores is, step by step,
#
# $$
# \begin{aligned}
# r_{h,t_{\mathrm{new}}}(q) - r_{h,t_{\mathrm{bnd}}}(q)
# &= \big(r_{h,t_{\mathrm{new}}} + (q - t_{\mathrm{new}})\log\gamma_h\big) - \big(r_{h,t_{\mathrm{bnd}}} + (q - t_{\mathrm{bnd}})\log\gamma_h\big) \\
# &= r_{h,t_{\mathrm{new}}} - r_{h,t_{\mathrm{bnd}}} + (t_{\mathrm{bnd}} - t_{\mathrm{new}})\log\gamma_h \\
# &= \big(r_{h,t_{\mathrm{new}}} - t_{\mathrm{new}}\log\gamma_h\big) - \big(r_{h,t_{\mathrm{bnd}}} - t_{\mathrm{bnd}}\log\gamma_h\big)
#  = \bar r_{h,t_{\mathrm{new}}} - \bar r_{h,t_{\mathrm{bnd}}},
# \end{aligned}
# $$
#
# with the static priority $\bar r_{h,t} = r_{h,t} - t\log\gamma_h$ of Eq. (20). Only the
# part $q\log\gamma_h$ that both tokens share cancels. The parts $-t\log\gamma_h$ depend
# on the token's position and do **not** cancel: two tokens of different ages have
# different decay terms. So the difference is of *static priorities*, not of raw
# scores. §3.1 of the paper says that the comparison "reduces to the difference of raw
# scores"; that holds only without decay ($\gamma_h = 1$). Since $t_{\mathrm{bnd}} \in
# \mathcal{E}(q)$ is at most $q - w = t_{\mathrm{new}}$, the extra term $(t_{\mathrm{bnd}} -
# t_{\mathrm{new}})\log\gamma_h = (t_{\mathrm{new}} - t_{\mathrm{bnd}})\,|\log\gamma_h| \ge 0$ is an
# age bonus for the newer token. It is also the only way the loss reaches the learned
# decay: its derivative with respect to $\log\gamma_h$ is $t_{\mathrm{bnd}} - t_{\mathrm{new}}$,
# which is nonzero, so the decay parameter $\alpha_h$ of Eq. (21) receives a gradient.
#
# The functions below therefore take *priorities* `[B, H, S]`, as produced by
# `static_priority(r, log_gamma)` from `sparsekv.kvpop.cutoff`: the same priorities the
# sparse mask ranks by. For $n > 1$ the floor does not split into a token part and a query
# part; there the loss compares the priorities of that module's bucketed approximation, i.e.
# exactly the ranking the student is deployed with.
#
# A check of the identity with explicit effective scores, and that the raw-score difference
# is a different number:

# %%
_g = torch.Generator().manual_seed(0)
_S, _H = 50, 3
_r = torch.randn(2, _H, _S, generator=_g)
_log_gamma = -torch.rand(_H, generator=_g) * 0.2
_prio = static_priority(_r, _log_gamma)
for _q, _t_new, _t_bnd in [(49, 45, 10), (30, 26, 25), (20, 16, 0)]:
    _eff = lambda t: _r[..., t] + (_q - t) * _log_gamma  # Eq. (5) with n = 1, written out
    assert_close(_eff(_t_new) - _eff(_t_bnd), _prio[..., _t_new] - _prio[..., _t_bnd])
    assert ((_eff(_t_new) - _eff(_t_bnd)) - (_r[..., _t_new] - _r[..., _t_bnd])).abs().min() > 0


# %% [markdown]
# ## The teacher's decision (Eq. 6)
#
# The teacher ranks $\mathcal{E}(q)$ by the target priority $\bar r^{\mathrm{tgt}}_{h,t}$
# (the target score of Eq. (3) with the same decay $\gamma_h$ as the student, detached) and
# keeps the top $k$; ties go to the earlier token, as in `topk_cutoff`. Call the kept set
# $\mathcal{K}(q)$. The label of the newly eligible token is
#
# $$y_{q,h} = +1 \text{ if } t_{\mathrm{new}} \in \mathcal{K}(q), \text{ else } -1 \qquad \text{(Eq. (6))},$$
#
# and the boundary token $t_{\mathrm{bnd}}$ is the last retained one: the $k$-th best
# token of $\mathcal{E}(q)$. The student is asked to put $t_{\mathrm{new}}$ on the same side
# of $t_{\mathrm{bnd}}$ as the teacher does.
#
# **When the new token *is* the boundary.** If $t_{\mathrm{new}}$ is itself the $k$-th best
# token, Eq. (6) would compare it with itself: the difference in Eq. (7) is identically zero,
# the loss is the constant $\log 2$ and its gradient vanishes, so the example teaches
# nothing. In that case we compare against the *first dropped* token, the $(k{+}1)$-th
# best of $\mathcal{E}(q)$, with $y = +1$: the new token must outrank the best token that
# did not make it. This token exists exactly when $|\mathcal{E}(q)| = q - w - s + 1 \ge k + 1$,
# i.e. $q \ge s + w + k$, which is the sampling condition of Eq. (25). Positions with
# $q < s + w + k$ are never sampled (the budget is not saturated there: every eligible token
# is kept) and `teacher_boundary` rejects them.
#
# **From ranks and cutoffs.** `topk_cutoff` gives, per head, the rank of every token under
# the priority (0 = best) and the cutoff $c_q$ = the $k$-th smallest rank in
# $\mathcal{E}(q)$; the teacher keeps $t \in \mathcal{E}(q)$ iff $\mathrm{rank}(t) \le c_q$.
# With $\mathrm{tok}(\cdot)$ the inverse of the rank permutation:
#
# - $y = +1$ iff $\mathrm{rank}(t_{\mathrm{new}}) \le c_q$;
# - the $k$-th best token is $\mathrm{tok}(c_q)$;
# - if $\mathrm{tok}(c_q) = t_{\mathrm{new}}$, the first dropped token is $\mathrm{tok}(c_{q-1})$.
#   Proof: $\mathcal{E}(q-1) = \mathcal{E}(q) \setminus \{t_{\mathrm{new}}\}$. Sort
#   $\mathcal{E}(q)$ as $a_1, \dots, a_{k-1}, t_{\mathrm{new}}, a_{k+1}, \dots$; removing
#   $t_{\mathrm{new}}$ leaves $a_1, \dots, a_{k-1}, a_{k+1}, \dots$, whose $k$-th element is
#   $a_{k+1}$, the first dropped token at $q$. And $c_{q-1}$ is defined (not the
#   "fewer than $k$" sentinel) because $|\mathcal{E}(q-1)| = q - w - s \ge k$.
#
# So the boundary at all sampled positions costs one `topk_cutoff` pass over the target
# priorities (one sort and the cutoffs of App. C.2 for all positions at once, as
# App. B.6 says) and a few gathers; no second top-$k$ for the first dropped token.

# %%
#| export
def _check_priority(x: Tensor, name: str) -> None:
    "Validate a priority argument `name`: a floating-point [B, H, S] tensor without NaN."
    if not isinstance(x, Tensor): raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3: raise ValueError(f"{name} must have shape [B, H, S], got {tuple(x.shape)}")
    if not x.is_floating_point(): raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.isnan().any(): raise ValueError(f"{name} contains NaN")


# %%
_check_priority(torch.zeros(1, 2, 3), "p")
test_fail(lambda: _check_priority([0.0], "p"), exc=TypeError, contains="p must be a torch.Tensor, got list")
test_fail(lambda: _check_priority(torch.zeros(2, 3), "p"), contains="p must have shape [B, H, S], got (2, 3)")
test_fail(lambda: _check_priority(torch.zeros(1, 2, 3, dtype=torch.long), "p"), exc=TypeError,
          contains="floating-point")
test_fail(lambda: _check_priority(torch.tensor([[[0.0, math.nan]]]), "p"), contains="p contains NaN")


# %%
#| export
def boundary_queries(q: Tensor | Sequence[int], S: int, sink: int, window: int, k: int, device=None) -> Tensor:
    "Validate query positions `q` for the boundary loss: a 1-D int64 tensor with `sink + window + k <= q < S` (Eq. 25)."
    check_budget(k, sink, window)
    q = torch.as_tensor(q, device=device)
    if q.dim() != 1 or q.is_floating_point() or q.dtype == torch.bool:
        raise ValueError(f"q must be a 1-D integer tensor of query positions, got dtype {q.dtype} and shape "
                         f"{tuple(q.shape)}")
    q = q.long()
    lo = sink + window + k
    if q.numel() and (q.min() < lo or q.max() >= S):
        raise ValueError(f"q must lie in [sink + window + k, S - 1] = [{lo}, {S - 1}] (Eq. 25), "
                         f"got values in [{q.min().item()}, {q.max().item()}]")
    return q


# %%
test_eq(boundary_queries([3, 5], 6, 0, 1, 2), torch.tensor([3, 5]))  # s + w + k = 3 <= q < S = 6
test_eq(boundary_queries(torch.tensor([4], dtype=torch.int32), 6, 0, 1, 2).dtype, torch.int64)
test_fail(lambda: boundary_queries([2, 5], 6, 0, 1, 2), contains="q must lie in [sink + window + k, S - 1] = [3, 5]")
test_fail(lambda: boundary_queries([3.0], 6, 0, 1, 2), contains="q must be a 1-D integer tensor")


# %%
#| export
def _token_of_rank(rank: Tensor, sink: int) -> Tensor:
    "Inverse of the rank permutation over tokens `t >= sink`: `tok[..., rank[t]] = t`."
    S = rank.shape[-1]
    tokens = torch.arange(sink, S, device=rank.device).expand(*rank.shape[:-1], -1)
    return torch.empty_like(tokens).scatter_(-1, rank[..., sink:], tokens)


# %%
# ranks 2, 0, 3, 1 of tokens 1..4 (token 0 a sink, rank S = 5): the tokens of ranks 0..3 are 2, 4, 1, 3
test_eq(_token_of_rank(torch.tensor([[[5, 2, 0, 3, 1]]]), 1).tolist(), [[[2, 4, 1, 3]]])


# %%
#| export
def _cutoffs(priority: Tensor, k: int, sink: int, window: int, cutoff: tuple[Tensor, Tensor] | None):
    "`topk_cutoff(priority.detach(), k, sink, window)`, or `cutoff` (those already computed) after a shape check."
    if cutoff is None: return topk_cutoff(priority.detach(), k, sink, window)
    if len(cutoff) != 2 or any(c.shape != priority.shape for c in cutoff):
        raise ValueError("cutoff (target_cutoff) must be topk_cutoff's (rank, cutoff) of the priority, each "
                         f"{tuple(priority.shape)}")
    return cutoff


# %%
_p6 = torch.tensor([[[5.0, 1, 4, 3, 0, 2]]])
test_eq(_cutoffs(_p6, 2, 0, 1, None), topk_cutoff(_p6, 2, 0, 1))
_given = topk_cutoff(_p6, 2, 0, 1)
assert _cutoffs(_p6, 2, 0, 1, _given) is _given  # computed once, used as given
test_fail(lambda: _cutoffs(_p6, 2, 0, 1, (_given[0], _given[1][..., :3])), contains="topk_cutoff's (rank, cutoff)")


# %%
#| export
def teacher_boundary(target_priority: Tensor, q: Tensor | Sequence[int], sink: int, window: int, k: int,
                     cutoff: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. (6): new eligible token `q - window`, teacher's boundary token, label `y` (+1 keep, -1 drop), int64
    [B,H,|q|]; `cutoff`: `topk_cutoff(target_priority.detach(), k, sink, window)` if already at hand."""
    _check_priority(target_priority, "target_priority")
    B, H, S = target_priority.shape
    q = boundary_queries(q, S, sink, window, k, device=target_priority.device)
    rank, cutoff = _cutoffs(target_priority, k, sink, window, cutoff)
    tok = _token_of_rank(rank, sink)
    t_new = (q - window).expand(B, H, -1).contiguous()
    c_q, c_prev = cutoff[..., q], cutoff[..., q - 1]
    y = torch.where(rank.gather(-1, t_new) <= c_q, 1, -1)
    kth = tok.gather(-1, c_q)
    first_dropped = tok.gather(-1, c_prev)  # only used where t_new is the k-th kept token: see above
    t_bnd = torch.where(kth == t_new, first_dropped, kth)
    return t_new, t_bnd, y


# %%
# by hand, priorities 5, 1, 4, 3, 0, 2, no sink, w = 1, k = 2: the teacher keeps tokens 0 and 2 at every q.
# q = 3: the new token 2 is kept (y = +1) as the k-th, so the boundary is the first dropped, 1; q = 4, 5: the new
# tokens 3, 4 are dropped (y = -1) and the boundary is the k-th kept, 2
test_eq(teacher_boundary(_p6, [3, 4, 5], 0, 1, 2),
        (torch.tensor([[[2, 3, 4]]]), torch.tensor([[[1, 2, 2]]]), torch.tensor([[[1, -1, -1]]])))


# %% [markdown]
# Ranks count from 0 over the tokens $t \ge s$ only (sinks never compete), so `tok` has
# $S - s$ entries and `tok[..., r]` is the token of rank `r`. The brute-force reference sorts
# $\mathcal{E}(q)$ explicitly for every batch row, head and query:
#
# Check on random priorities, on priorities with many ties (few distinct values), and at the
# extremes: a single valid query ($S = s + w + k + 1$), no sinks, $k = 1$. The fast version
# must equal the reference everywhere:

# %%
#| export
def teacher_boundary_reference(target_priority: Tensor, q: Tensor | Sequence[int], sink: int, window: int, k: int
                               ) -> tuple[Tensor, Tensor, Tensor]:
    "Eq. (6) by sorting E(q) for every (batch, head, query) in Python: the reference for `teacher_boundary`."
    _check_priority(target_priority, "target_priority")
    B, H, S = target_priority.shape
    q = boundary_queries(q, S, sink, window, k).tolist()
    p = target_priority.detach().double().cpu().tolist()
    t_new, t_bnd, y = (torch.zeros(B, H, len(q), dtype=torch.long) for _ in range(3))
    for b in range(B):
        for h in range(H):
            for j, qj in enumerate(q):
                new = qj - window
                ranked = sorted(range(sink, new + 1), key=lambda t: (-p[b][h][t], t))  # ties: earlier first
                kept = ranked[:k]
                t_new[b, h, j] = new
                y[b, h, j] = 1 if new in kept else -1
                t_bnd[b, h, j] = ranked[k] if kept[-1] == new else kept[-1]
    dev = target_priority.device
    return t_new.to(dev), t_bnd.to(dev), y.to(dev)


# %%
def _random_priority(B, H, S, ties, seed):
    g = torch.Generator().manual_seed(seed)
    if ties: return torch.randint(0, 3, (B, H, S), generator=g).float()
    return torch.randn(B, H, S, generator=g)

for S, sink, window, k, ties in [(40, 2, 5, 8, False), (40, 2, 5, 8, True), (15, 0, 3, 1, True),
                                 (12, 4, 3, 4, False), (12, 1, 1, 9, True), (130, 4, 16, 32, False)]:
    p = _random_priority(2, 3, S, ties, seed=S + k)
    q = torch.arange(sink + window + k, S)
    for a, b in zip(teacher_boundary(p, q, sink, window, k), teacher_boundary_reference(p, q, sink, window, k)):
        test_eq(a, b)

# %% [markdown]
# And against the definition through ranks and cutoffs, which is how the mask
# (`sparsekv.kvpop.mask`, Eq. (26)) will see the teacher: the label says whether $t_{\mathrm{new}}$
# has rank $\le c_q$; the boundary token has rank exactly $c_q$, except when that is
# $t_{\mathrm{new}}$, and then it is the best-ranked token of $\mathcal{E}(q)$ outside the kept set:

# %%
p = _random_priority(2, 3, 90, ties=True, seed=3)
sink, window, k = 3, 7, 10
q = torch.arange(sink + window + k, 90)
t_new, t_bnd, y = teacher_boundary(p, q, sink, window, k)
rank, cutoff = topk_cutoff(p, k, sink, window)
c_q = cutoff[..., q]
test_eq(y == 1, rank.gather(-1, t_new) <= c_q)
swapped = rank.gather(-1, t_new) == c_q
test_eq(rank.gather(-1, t_bnd)[~swapped], c_q[~swapped])
eligible = (torch.arange(90) >= sink) & (torch.arange(90)[None] <= (q - window)[:, None])     # [n, S]
dropped_rank = torch.where(eligible & (rank[..., None, :] > c_q[..., None]), rank[..., None, :], 90)
test_eq(rank.gather(-1, t_bnd)[swapped], dropped_rank.min(-1).values[swapped])
assert swapped.any() and (y == -1).any() and (y == 1).any()
test_fail(lambda: teacher_boundary(p, [sink + window + k - 1], sink, window, k), contains="Eq. 25")
test_fail(lambda: teacher_boundary(p, [90], sink, window, k), contains="S - 1")
test_fail(lambda: teacher_boundary(p.long(), q, sink, window, k), contains="floating-point")


# %% [markdown]
# ## Sampling query positions (Eq. 25, App. B.6)
#
# The loss is evaluated at a few positions per sequence, all after the long-range budget is
# saturated, $q \ge s + w + k$. The paper's sampler "mixes uniform samples with samples
# biased toward later positions" without giving the distribution; ours draws a fraction
# `late_frac` of the positions with density rising linearly toward the end of the sequence
# and the rest uniformly. With $u \sim U[0,1)$, $\sqrt{u}$ has density $2x$ on $[0, 1)$ (its
# CDF is $P(\sqrt{u} \le x) = x^2$), so the late-biased positions are
# $q = q_{\min} + \lfloor \sqrt{u}\,(S - q_{\min}) \rfloor$. Positions are drawn with
# replacement and returned sorted; the same `generator` state gives the same positions.

# %%
#| export
def sample_boundary_queries(S: int, n: int, sink: int, window: int, k: int, late_frac: float = 0.5,
                            generator: torch.Generator | None = None, device=None) -> Tensor:
    "Eq. (25): `n` sorted query positions in `[sink + window + k, S - 1]`, a `late_frac` of them biased to the end."
    check_budget(k, sink, window)
    if not isinstance(n, int) or n < 1: raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not 0.0 <= late_frac <= 1.0: raise ValueError(f"late_frac must lie in [0, 1], got {late_frac!r}")
    lo = sink + window + k
    if S <= lo: raise ValueError(f"S={S} leaves no query position with q >= sink + window + k = {lo} (Eq. 25)")
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    n_late = round(n * late_frac)
    u[:n_late] = u[:n_late].sqrt()  # density 2x on [0, 1): linearly more mass near the end
    q = lo + (u * (S - lo)).long().clamp_max(S - 1 - lo)
    return q.sort().values.to(device)


# %%
_a = sample_boundary_queries(300, 64, 4, 16, 32, generator=torch.Generator().manual_seed(7))
_b = sample_boundary_queries(300, 64, 4, 16, 32, generator=torch.Generator().manual_seed(7))
test_eq(_a, _b)
assert _a.min() >= 4 + 16 + 32 and _a.max() <= 299
_late = sample_boundary_queries(300, 4000, 4, 16, 32, late_frac=1.0, generator=torch.Generator().manual_seed(1))
_unif = sample_boundary_queries(300, 4000, 4, 16, 32, late_frac=0.0, generator=torch.Generator().manual_seed(1))
# uniform on [52, 299]: mean 175.5; density rising linearly from 52: mean 52 + 2/3 * 248 = 217.3
assert abs(_unif.double().mean() - 175.5) < 5 and abs(_late.double().mean() - (52 + 2 / 3 * 248)) < 5
test_eq(sample_boundary_queries(53, 5, 4, 16, 32), torch.full((5,), 52))
test_fail(lambda: sample_boundary_queries(52, 5, 4, 16, 32), contains="Eq. 25")


# %% [markdown]
# ## The boundary-aware loss (Eq. 7)
#
# With the student's priorities $\hat{\bar r}$ (static priorities of the scorer's output under
# the shared decay), the loss at one sampled $(q, h)$ is the pairwise logistic loss
#
# $$\ell_{q,h} = \omega_{q,h}\, \mathrm{softplus}\Big(-y_{q,h}\, \frac{\hat{\bar r}_{h,t_{\mathrm{new}}} - \hat{\bar r}_{h,t_{\mathrm{bnd}}}}{\tau}\Big),$$
#
# averaged over batch rows, heads and sampled positions ($\mathbb{E}_{q,h}$ of Eq. (7)). It is
# $\log(1 + e^{-z})$ of the signed margin $z = y\,\Delta\hat{\bar r} / \tau$: small when the
# student puts the new token on the teacher's side of the boundary, linear in the violation
# otherwise. The temperature $\tau$ defaults to the paper's $1.0$ (Table 3).
#
# ### Margin weighting (Eq. 22–23)
#
# The teacher margin is the teacher's own signed priority gap (Eq. (22); by the derivation
# above, effective-score and static-priority differences are equal),
#
# $$\Delta^{\mathrm{tgt}}_{q,h} = y_{q,h}\big(\bar r^{\mathrm{tgt}}_{h,t_{\mathrm{new}}} - \bar r^{\mathrm{tgt}}_{h,t_{\mathrm{bnd}}}\big) \ge 0 .$$
#
# It is $\ge 0$ by construction: for $y = +1$ the new token is kept and ranks at least as well
# as the $k$-th kept token (or the first dropped one); for $y = -1$ it is dropped and ranks
# below the $k$-th kept. It is $0$ exactly at ties. The weight is (Eq. (23))
#
# $$\omega^{\mathrm{margin}}_{q,h} = \omega_{\min} + (1 - \omega_{\min})\,\sigma\big(\Delta^{\mathrm{tgt}}_{q,h} / \tau_\omega\big).$$
#
# *Interpretation.* Because $\Delta^{\mathrm{tgt}} \ge 0$, $\sigma(\Delta^{\mathrm{tgt}}/\tau_\omega) \in
# [\tfrac12, 1)$, so this weight lies in $[\tfrac{1 + \omega_{\min}}{2}, 1)$: an exact tie gets
# $(1 + \omega_{\min})/2$, not the "minimum example weight" $\omega_{\min}$ the paper names.
# We implement Eq. (23) as printed. The paper gives neither $\omega_{\min}$ nor $\tau_\omega$;
# the defaults $\omega_{\min} = 0.1$, $\tau_\omega = 1$ are ours ($\tau_\omega = 1$ is one nat
# of log-mass, the natural unit of the target). The paper trains with margin weighting on
# (Table 3), so `margin=True` is the default.

# %%
#| export
def teacher_margin(target_priority: Tensor, t_new: Tensor, t_bnd: Tensor, y: Tensor) -> Tensor:
    "Eq. (22): the teacher's signed priority gap `y * (p[t_new] - p[t_bnd])`, >= 0, detached."
    p = target_priority.detach().float()
    return y * (p.gather(-1, t_new) - p.gather(-1, t_bnd))


# %%
# the case above: y (p[t_new] - p[t_bnd]) = 1 (4 - 1), -1 (3 - 4), -1 (0 - 4)
_tb = teacher_boundary(_p6, [3, 4, 5], 0, 1, 2)
test_eq(teacher_margin(_p6, *_tb).tolist(), [[[3.0, 1.0, 4.0]]])


# %%
#| export
def margin_weight(target_margin: Tensor, omega_min: float = 0.1, tau_omega: float = 1.0) -> Tensor:
    "Eq. (23): `omega_min + (1 - omega_min) * sigmoid(margin / tau_omega)`; near-ties get less weight."
    if not 0.0 <= omega_min <= 1.0: raise ValueError(f"omega_min must lie in [0, 1], got {omega_min!r}")
    if not tau_omega > 0: raise ValueError(f"tau_omega must be > 0, got {tau_omega!r}")
    return omega_min + (1 - omega_min) * torch.sigmoid(target_margin / tau_omega)


# %%
test_close(margin_weight(torch.tensor([0.0])).item(), 0.1 + 0.9 * 0.5, eps=1e-7)  # a tie: halfway
test_close(margin_weight(torch.tensor([50.0]), omega_min=0.2).item(), 1.0, eps=1e-7)  # a clear decision: full weight
test_close(margin_weight(torch.tensor([2.0]), tau_omega=2.0).item(), 0.1 + 0.9 / (1 + math.exp(-1.0)), eps=1e-7)
test_fail(lambda: margin_weight(torch.tensor([0.0]), omega_min=1.5), contains="omega_min must lie in [0, 1]")
test_fail(lambda: margin_weight(torch.tensor([0.0]), tau_omega=0), contains="tau_omega must be > 0")


# %% [markdown]
# ### Keep/drop balancing (Eq. 24)
#
# Let $\rho_h$ be the fraction of sampled decisions of head $h$ with $y = +1$. Each decision
# is weighted by the inverse frequency of its label, clipped (Eq. (24)):
#
# $$\omega^{\mathrm{bal}}_{q,h} = \mathrm{clip}\Big(\frac{1}{2\rho_h}, c_{\min}, c_{\max}\Big) \text{ if } y = +1, \qquad \mathrm{clip}\Big(\frac{1}{2(1-\rho_h)}, c_{\min}, c_{\max}\Big) \text{ if } y = -1,$$
#
# then divided by its mean over the valid examples. Without clipping, the $\rho_h N$ keep
# decisions of a head (out of $N$) carry total weight $\rho_h N \cdot \frac{1}{2\rho_h} = N/2$
# and the drop decisions $(1-\rho_h) N \cdot \frac{1}{2(1-\rho_h)} = N/2$: the two labels
# weigh the same, and the mean weight of every head is already exactly $1$. The
# mean-normalization therefore only matters once clipping binds; it restores the loss
# scale.
#
# *Interpretations.* (i) $\rho_h$ pools the decisions of head $h$ over the batch rows and the
# sampled positions (a head's parameters are shared by the whole batch). (ii) "Normalize by
# their mean over valid examples": one mean over all examples of the call (all heads), so
# the balancing weights average to $1$. (iii) Every example passed in is valid:
# `teacher_boundary` rejects positions that break Eq. (25), so there is no validity mask.
# (iv) The paper gives no $c_{\min}, c_{\max}$; we default to $0.2$ and $5$ (a fivefold
# range either way). Both $\frac{1}{2\rho}$ and $\frac{1}{2(1-\rho)}$ are at least $\tfrac12$
# (as $0 \le \rho \le 1$), so a $c_{\min} \le \tfrac12$ never binds. (v) The final weight is $\omega^{\mathrm{margin}} \cdot \omega^{\mathrm{bal}}$ (App.
# B.5); the margin weight is not re-normalized.

# %%
#| export
def balance_weight(y: Tensor, c_min: float = 0.2, c_max: float = 5.0) -> Tensor:
    "Eq. (24): headwise inverse label-frequency weights for `y` `[B, H, n]`, clipped to `[c_min, c_max]`, mean 1."
    if not 0 < c_min <= c_max: raise ValueError(f"need 0 < c_min <= c_max, got c_min={c_min!r}, c_max={c_max!r}")
    keep = y > 0
    rho = keep.float().mean(dim=(0, 2), keepdim=True)  # per head, over batch rows and sampled positions
    # a label absent from a head gives 1/0 = inf, clipped to c_max, and is never selected
    w = torch.where(keep, (1 / (2 * rho)).clamp(c_min, c_max), (1 / (2 * (1 - rho))).clamp(c_min, c_max))
    return w / w.mean()


# %%
_y = torch.where(torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(0))
                 < torch.tensor([0.2, 0.5, 0.7])[:, None], 1, -1)
_w = balance_weight(_y, c_min=1e-3, c_max=1e3)  # no clipping
for h in range(3):
    assert_close(_w[:, h][_y[:, h] > 0].sum(), _w[:, h][_y[:, h] < 0].sum())  # keep and drop weigh the same
    assert_close(_w[:, h].mean(), torch.tensor(1.0))                            # every head averages 1
_w = balance_weight(torch.tensor([[[1] + [-1] * 19]]), c_min=0.2, c_max=5.0)  # rho = 1/20: 1/(2 rho) = 10 clips to 5
assert_close(_w[0, 0, 0] / _w[0, 0, 1], torch.tensor(5.0 / (20 / 38)))
assert_close(_w.mean(), torch.tensor(1.0))


# %% [markdown]
# ### Putting it together
#
# `retention_loss` takes the student's priorities (with gradient, through the scorer output
# and the decay parameter $\alpha$) and the target priorities (detached: the teacher is a
# fixed function of the target; its decisions are integer indices and its margin enters only
# the weights, which are detached too). `reduction="none"` returns the per-example terms
# `[B, H, n]` for logging.

# %%
#| export
def retention_loss(pred_priority: Tensor, target_priority: Tensor, q: Tensor | Sequence[int], sink: int, window: int,
                   k: int, tau: float = 1.0, margin: bool = True, omega_min: float = 0.1, tau_omega: float = 1.0,
                   balance: bool = False, c_min: float = 0.2, c_max: float = 5.0, reduction: str = "mean",
                   target_cutoff: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Eq. (7): weighted pairwise logistic loss between the new eligible token and the teacher's boundary token at `q`;
    `target_cutoff`: the teacher's `topk_cutoff` if already at hand."""
    _check_priority(pred_priority, "pred_priority")
    if pred_priority.shape != target_priority.shape:
        raise ValueError(f"pred_priority {tuple(pred_priority.shape)} and target_priority "
                         f"{tuple(target_priority.shape)} must have the same shape")
    if not tau > 0: raise ValueError(f"tau must be > 0, got {tau!r}")
    if reduction not in ("mean", "none"): raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    t_new, t_bnd, y = teacher_boundary(target_priority, q, sink, window, k, target_cutoff)
    pred = pred_priority.float()  # ranking and decay in float32 (App. F)
    z = y * (pred.gather(-1, t_new) - pred.gather(-1, t_bnd)) / tau
    w = 1.0
    if margin: w = w * margin_weight(teacher_margin(target_priority, t_new, t_bnd, y), omega_min, tau_omega)
    if balance: w = w * balance_weight(y, c_min, c_max)
    loss = w * F.softplus(-z)
    return loss.mean() if reduction == "mean" else loss


# %%
# the student equal to the teacher in the case above: signed gaps 3, 1, 4, each term softplus(-gap / tau)
_gaps = torch.tensor([3.0, 1.0, 4.0])
assert_close(retention_loss(_p6, _p6, [3, 4, 5], 0, 1, 2, margin=False), F.softplus(-_gaps).mean())
assert_close(retention_loss(_p6, _p6, [3, 4, 5], 0, 1, 2, tau=2.0, margin=False, reduction="none"),
             F.softplus(-_gaps / 2)[None, None])
assert_close(retention_loss(_p6, _p6, [3, 4, 5], 0, 1, 2, reduction="none"),
             (margin_weight(_gaps) * F.softplus(-_gaps))[None, None])
test_fail(lambda: retention_loss(_p6, _p6[..., :5], [3], 0, 1, 2), contains="must have the same shape")
test_fail(lambda: retention_loss(_p6, _p6, [3], 0, 1, 2, tau=0), contains="tau must be > 0")
test_fail(lambda: retention_loss(_p6, _p6, [3], 0, 1, 2, reduction="sum"), contains="reduction must be")


# %% [markdown]
# The reference recomputes everything from the definitions with explicit loops: effective
# scores of Eq. (5) at each $q$ (with the floor, from raw scores and $\log\gamma$, not from
# priorities), the teacher by sorting those effective scores, the weights by counting. For
# $n = 1$ it must agree with `retention_loss` on static priorities; that checks both the
# derivation above and the code.

# %%
#| export
def retention_loss_reference(pred_score: Tensor, target_score: Tensor, log_gamma: Tensor, q: Sequence[int], sink: int,
                             window: int, k: int, n: int = 1, tau: float = 1.0, margin: bool = True,
                             omega_min: float = 0.1, tau_omega: float = 1.0, balance: bool = False,
                             c_min: float = 0.2, c_max: float = 5.0) -> Tensor:
    "Eq. (5)-(7), (22)-(24) by loops over raw scores `[B, H, S]` and `log_gamma` `[H]`: checks `retention_loss`."
    B, H, S = pred_score.shape
    q = boundary_queries(q, S, sink, window, k).tolist()
    lg_t = log_gamma.detach()
    terms, ys, margins = [], [], []
    for b in range(B):
        for h in range(H):
            for qj in q:
                eff_t = lambda t: target_score[b, h, t].detach() + ((qj - t) // n) * lg_t[h]    # Eq. (5)
                eff_p = lambda t: pred_score[b, h, t] + ((qj - t) // n) * log_gamma[h]
                ranked = sorted(range(sink, qj - window + 1), key=lambda t: (-eff_t(t).item(), t))
                new = qj - window
                y = 1 if new in ranked[:k] else -1
                bnd = ranked[k] if ranked[k - 1] == new else ranked[k - 1]
                terms.append(F.softplus(-y * (eff_p(new) - eff_p(bnd)) / tau))
                ys.append(y)
                margins.append(y * (eff_t(new) - eff_t(bnd)).item())
    w = [1.0] * len(terms)
    if margin: w = [omega_min + (1 - omega_min) / (1 + math.exp(-m / tau_omega)) for m in margins]
    if balance:
        per_head = len(q)
        wb = []
        for i, y in enumerate(ys):
            h = (i // per_head) % H
            same_head = [ys[j] for j in range(len(ys)) if (j // per_head) % H == h]
            rho = sum(v > 0 for v in same_head) / len(same_head)
            wb.append(min(max(1 / (2 * rho) if y > 0 else 1 / (2 * (1 - rho)), c_min), c_max))
        mean_b = sum(wb) / len(wb)
        w = [a * c / mean_b for a, c in zip(w, wb)]
    return sum(wi * t for wi, t in zip(w, terms)) / len(terms)


# %%
_g = torch.Generator().manual_seed(5)
B, H, S, sink, window, k = 2, 3, 60, 2, 6, 12
r_hat, r_tgt = torch.randn(B, H, S, generator=_g), torch.randn(B, H, S, generator=_g)
log_gamma = -torch.rand(H, generator=_g) * 0.1
q = sample_boundary_queries(S, 16, sink, window, k, generator=_g)
for opts in [dict(margin=False), dict(), dict(balance=True), dict(balance=True, c_max=1.2, tau=0.5, omega_min=0.3)]:
    got = retention_loss(static_priority(r_hat, log_gamma), static_priority(r_tgt, log_gamma), q, sink, window, k,
                         **opts)
    assert_close(got, retention_loss_reference(r_hat, r_tgt, log_gamma, q, sink, window, k, **opts).float())

# %% [markdown]
# ## Where the gradient goes
#
# The student's priority is $\hat{\bar r}_{h,t} = \hat r_{h,t} - t \log\gamma_h(\alpha_h)$, with
# $\log\gamma_h$ from the decay parameter $\alpha_h$ (Eq. (21)). The gradient of the loss must
# reach the scorer output $\hat r$ and $\alpha$, and nothing of the target: below the target
# scores ask for a gradient, and the target priority is built from the *same* live
# $\log\gamma$, so any leak through either path would show.

# %%
_g = torch.Generator().manual_seed(11)
decay = LogDecay(H, gamma_min=0.9, gamma_max=0.999)  # Eq. (21); alpha = decay.alpha
r_hat = torch.randn(B, H, S, generator=_g, requires_grad=True)
r_tgt = torch.randn(B, H, S, generator=_g, requires_grad=True)
log_gamma = decay()
loss = retention_loss(static_priority(r_hat, log_gamma), static_priority(r_tgt, log_gamma), q, sink, window, k,
                      balance=True)
loss.backward()
assert r_tgt.grad is None
assert decay.alpha.grad.abs().min() > 0
# only the compared tokens get a gradient: t_new and t_bnd at the sampled positions
t_new, t_bnd, y = teacher_boundary(static_priority(r_tgt, log_gamma), q, sink, window, k)
touched = torch.zeros(B, H, S, dtype=torch.bool).scatter_(-1, t_new, True).scatter_(-1, t_bnd, True)
test_eq(r_hat.grad != 0, touched)
# and the gradients are those of the loop-by-loop reference
grads = r_hat.grad.clone(), decay.alpha.grad.clone()
r_hat.grad, decay.alpha.grad = None, None
retention_loss_reference(r_hat, r_tgt, decay(), q, sink, window, k, balance=True).backward()
assert_close(r_hat.grad, grads[0]); assert_close(decay.alpha.grad, grads[1])
assert r_tgt.grad is None


# %% [markdown]
# ## Retention recall, and a toy problem
#
# The paper measures agreement with the teacher by *retention recall* (§4, Fig. 7): the
# fraction of the teacher's $k$ kept long-range tokens that the student also keeps, under the
# same budget. With both kept sets given by ranks and cutoffs, it is a count over the
# eligible tokens. (This materializes a boolean `[B, H, n, S]`, fine for the few sampled
# positions it is meant for.)

# %%
#| export
def kept_long_range(priority: Tensor, q: Tensor | Sequence[int], sink: int, window: int, k: int,
                    cutoff: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Eq. (26), long-range part: `[B, H, len(q), S]`, True where token `t` is among the top-k of E(q) under `priority`;
    `cutoff`: `topk_cutoff(priority.detach(), k, sink, window)` if already at hand."""
    _check_priority(priority, "priority")
    S = priority.shape[-1]
    q = boundary_queries(q, S, sink, window, k, device=priority.device)
    rank, cutoff = _cutoffs(priority, k, sink, window, cutoff)
    t = torch.arange(S, device=priority.device)
    eligible = (t >= sink) & (t <= (q - window)[:, None])
    return eligible & (rank[..., None, :] <= cutoff[..., q, None])


# %%
# the case above: at q = 3 and 4 the teacher keeps tokens 0 and 2
test_eq(kept_long_range(_p6, [3, 4], 0, 1, 2).int().tolist(), [[[[1, 0, 1, 0, 0, 0], [1, 0, 1, 0, 0, 0]]]])
# the student ranking by -p keeps the lowest: tokens 1 and 2 at q = 3 (E = {0, 1, 2}), 1 and 3 at q = 4
test_eq(kept_long_range(-_p6, [3, 4], 0, 1, 2).int().tolist(), [[[[0, 1, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0]]]])


# %%
#| export
def retention_recall(pred_priority: Tensor, target_priority: Tensor, q: Tensor | Sequence[int], sink: int, window: int,
                     k: int, target_cutoff: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`|student kept ∩ teacher kept| / k` at positions `q`, per row, head and position `[B, H, len(q)]` (§4, Fig. 7);
    `target_cutoff`: the teacher's `topk_cutoff` if already at hand."""
    both = (kept_long_range(pred_priority, q, sink, window, k)
            & kept_long_range(target_priority, q, sink, window, k, target_cutoff))
    return both.sum(-1) / k


# %%
q = torch.arange(20, 90)
test_eq(kept_long_range(p, q, 3, 7, 10).sum(-1), torch.full((2, 3, 70), 10))
test_eq(retention_recall(p, p, q, 3, 7, 10), torch.ones(2, 3, 70))
test_eq(retention_recall(-p, p, q, 3, 7, 10) < 1, torch.ones(2, 3, 70, dtype=torch.bool))
# the teacher's cutoffs computed once serve the loss and the recall: the same results as computing them in each
cut = topk_cutoff(p, 10, 3, 7)
test_eq(retention_recall(-p, p, q, 3, 7, 10, target_cutoff=cut), retention_recall(-p, p, q, 3, 7, 10))
test_eq(retention_loss(-p, p, q, 3, 7, 10, target_cutoff=cut), retention_loss(-p, p, q, 3, 7, 10))
test_fail(lambda: retention_recall(-p, p, q, 3, 7, 10, target_cutoff=(cut[0], cut[1][:1])), contains="topk_cutoff's")


# %% [markdown]
# **Toy problem.** Each token has a random feature vector $x_t \in \mathbb{R}^D$; the hidden
# teacher score of head $h$ is linear, $r^{\mathrm{tgt}}_{h,t} = u_h^\top x_t$, and the student is
# a linear scorer $\hat r_{h,t} = v_h^\top x_t + b_h$ that starts from zero. Both rank with the
# same fixed decay $\gamma$. Because the priority $\hat r - t\log\gamma$ adds a fixed age term
# to the score, reproducing the teacher's *ranking* needs the exact scale $v_h = u_h$, not
# only its direction; the loss must pin the scale down through comparisons of tokens of
# different ages (the bias $b_h$ shifts all priorities of a head alike and is irrelevant).
#
# This makes the temperature matter. The logistic loss keeps rewarding larger margins, and
# with decay the student can enlarge the score part of its margins by inflating the scale of
# $v_h$, at the price of a few boundary errors. With $\tau$ comparable to the spread of the
# target scores (here $\approx 1$, so the paper's $\tau = 1$), the scale settles visibly above
# 1 and retention recall stalls around $0.9$; with $\tau$ small against the spread
# ($\tau = 0.1$ below) the loss approaches a count of boundary errors and the scale comes out
# close to 1. For real targets (log future-attention masses spanning several nats) the same
# ratio is what to watch. Training with Adam on `retention_loss` at freshly sampled
# positions drives the retention recall, measured at every valid position, close to $1$:

# %%
def toy_teacher_problem(B=4, H=2, S=160, D=8, seed=0):
    "Random token features `[B, H, S, D]`, hidden linear teacher vectors `[H, D]` and their scores `[B, H, S]`."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, S, D, generator=g)
    u = torch.randn(H, D, generator=g) / math.sqrt(D)
    return x, u, torch.einsum("bhsd,hd->bhs", x, u)

def train_toy_scorer(x, r_tgt, log_gamma, sink=2, window=8, k=24, steps=200, n_q=32, lr=0.05, tau=0.1, seed=0):
    "Fit a linear scorer `(v, b)` to the teacher's boundary decisions: Adam on `retention_loss`, cosine learning rate."
    B, H, S, D = x.shape
    g = torch.Generator().manual_seed(seed)
    v, b = torch.zeros(H, D, requires_grad=True), torch.zeros(H, 1, requires_grad=True)
    opt = torch.optim.Adam([v, b], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    tgt = static_priority(r_tgt, log_gamma)
    for _ in range(steps):
        q = sample_boundary_queries(S, n_q, sink, window, k, generator=g)
        pred = static_priority(torch.einsum("bhsd,hd->bhs", x, v) + b, log_gamma)
        loss = retention_loss(pred, tgt, q, sink, window, k, tau=tau)
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    return v.detach(), b.detach()

def toy_recall(x, r_tgt, v, b, log_gamma, sink=2, window=8, k=24):
    "Mean retention recall of the linear scorer `(v, b)` at every position with q >= sink + window + k."
    pred = static_priority(torch.einsum("bhsd,hd->bhs", x, v) + b, log_gamma)
    q = torch.arange(sink + window + k, x.shape[2])
    return retention_recall(pred, static_priority(r_tgt, log_gamma), q, sink, window, k).mean().item()


# %%
#| hide
torch.set_num_threads(1)  # tensors this small only pay for intra-op thread synchronization (very costly on a busy CPU)

# %%
x, u, r_tgt = toy_teacher_problem()
log_gamma = torch.full((2,), math.log(0.975))
start = toy_recall(x, r_tgt, torch.zeros_like(u), torch.zeros(2, 1), log_gamma)  # untrained: recency only
results = {}
for tau in (0.1, 1.0):
    v, b = train_toy_scorer(x, r_tgt, log_gamma, tau=tau)
    results[tau] = toy_recall(x, r_tgt, v, b, log_gamma), v.norm(dim=1) / u.norm(dim=1)
    print(f"tau={tau}: retention recall {start:.3f} -> {results[tau][0]:.3f}, "
          f"|v|/|u| per head {results[tau][1].tolist()}")
assert start < 0.8 and results[0.1][0] > 0.97 and (results[0.1][1] - 1).abs().max() < 0.1
assert results[1.0][0] < results[0.1][0] and results[1.0][1].min() > 1.1  # tau ~ target spread: inflated scale
