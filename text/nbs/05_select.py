# %% [markdown]
# # Budgets and top-budget selection
#
# > What every selection method shares: budgets, a deterministic top-n of scores, and the anchors a budget keeps.

# %%
#| default_exp select

# %%
#| export
from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

from sparsekv.attention import check_int, content_checks

# %%
#| hide
from fastcore.test import test_eq, test_fail


# %% [markdown]
# ## Budgets
#
# $B_{SA}$ is either a fixed number of keys (Table 1 uses $B_{SA} = 1024$) or a fraction of
# the cache (Table 2 keeps 25% of it, "$B_{SA}$ growing with the KV cache"). If the cache
# is no larger than the budget, every key is kept (there is nothing to select). A fraction
# $f$ keeps $\mathrm{round}(f\,T)$ keys, halves rounded up, at least one. The product is
# taken exactly on the decimal the user wrote (`Fraction(repr(f))`): in binary floating
# point $0.29 \cdot 100 = 28.999999999999996$ and $0.7 \cdot 175 = 122.49999999999999$,
# which would round the wrong way.

# %%
#| export
def resolve_budget(budget: int | float, T: int) -> int:
    """Keys kept out of `T` cached keys: min(B_SA, T) for an int `budget`, round(budget*T) (halves up, at least 1, at
    most T) for a float fraction in (0, 1]."""
    check_int(T, "T")
    accepted = "an int >= 1 (B_SA, a number of keys) or a float in (0, 1] (a fraction of the cache)"
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be {accepted}, got {budget!r}")
    if isinstance(budget, int):
        if budget < 1: raise ValueError(f"budget must be {accepted}, got {budget!r}")
        return min(budget, T)
    if not 0.0 < budget <= 1.0: raise ValueError(f"budget must be {accepted}, got {budget!r}")
    return min(T, max(1, math.floor(Fraction(repr(budget)) * T + Fraction(1, 2))))  # exact decimal product, halves up


# %%
for T in (0, 1, 7, 100, 1000):
    for b in (1, 7, 64, 1024):
        test_eq(resolve_budget(b, T), min(b, T))
    test_eq(resolve_budget(1.0, T), T)
    test_eq(resolve_budget(0.25, T), 0 if T == 0 else max(1, round(T / 4 + 1e-9)))   # exact quarter, halves up
test_eq(resolve_budget(0.29, 100), 29)     # 0.29 * 100 = 28.999999999999996 in float64
test_eq(resolve_budget(0.7, 175), 123)     # 0.7 * 175 = 122.49999999999999 in float64; 122.5 rounds up
test_eq(resolve_budget(0.1, 30), 3)        # 0.1 * 30 = 3.0000000000000004
test_eq(resolve_budget(0.01, 10), 1)       # at least one key
test_fail(lambda: resolve_budget(0, 10), contains="budget must be")
test_fail(lambda: resolve_budget(1.5, 10), contains="budget must be")
test_fail(lambda: resolve_budget(True, 10), contains="budget must be")
test_fail(lambda: resolve_budget("25%", 10), contains="budget must be")
test_fail(lambda: resolve_budget(4, -1), contains="T must be")


# %% [markdown]
# ## Top-$n$ with a deterministic tie rule
#
# Both the query subselection (keep $N_Q$ of $S$ queries) and the key selection (keep
# $B_{SA}$ of $T$ keys) take the $n$ largest of a row of scores. `torch.topk` does not
# promise which of several equal scores it returns, and equal scores are not rare here
# (identical tokens give identical keys, hence identical cosines). **Tie rule of this
# package: among equal scores the lower index wins**, and the chosen indices are returned
# **sorted ascending** (the order of the cache, which keeps the later gather contiguous in
# runs and makes results comparable).
#
# The rule is implemented without a sort: with $v$ the $n$-th largest score of a row, every
# entry $> v$ is kept, and of the entries $= v$ the first $n - \#\{> v\}$ in index order (a
# cumulative count). NaN scores have no order; they are refused.
#
# **Without reading anything back.** `top_mask` is the definition; turning its mask into indices
# takes a `nonzero`, whose output size the host must read from the device, and telling whether ties
# are at the cut at all takes a test of the data: a decode step would wait on the host for either, in
# every layer. `top_budget_indices` needs neither: it ranks *keys that are distinct by construction*.
# A float of at most 32 bits maps to a 32-bit integer of the same order (its IEEE bits, with the
# magnitude bits of a negative number flipped; `-0.0` first becomes `0.0`, which it equals as a score);
# shifted up by 32 bits, with $T - 1 - j$ below it for the index $j$, it gives one 64-bit key per
# entry ordered by (score, lower index first). Keys are distinct, so `topk` of them has no tie to break:
# its $n$ indices are exactly the reference's, found by one `topk` of fixed size $n$ and a sort of $n$.
# float64 and integer scores (no room for the index beside them) take one stable descending sort
# instead, which keeps equal scores in index order. NaN scores have no order: a direct call refuses
# them; in the per-step path that check reads a value, so it runs there only under
# `sparsekv.attention.checks`.

# %%
#| export
def _check_top(scores: Tensor, n: int):
    "Refuse an `n` outside [0, T] and NaN scores (they have no order)."
    T = scores.shape[-1]
    check_int(n, "n", 0, T)
    if scores.is_floating_point() and content_checks() and scores.isnan().any():  # a read: see `checks`
        raise ValueError("scores contain NaN (check the inputs for NaN or inf)")


# %%
_check_top(torch.tensor([1.0, 2.0]), 2)  # n = T is allowed
test_fail(lambda: _check_top(torch.tensor([1.0, math.nan]), 1), contains="NaN")
test_fail(lambda: _check_top(torch.zeros(4), 5), contains="n must be")


# %%
#| export
def top_mask(scores: Tensor, n: int) -> Tensor:
    "Boolean mask of the `n` largest entries of each row (last dim), exactly n per row; ties: the lower index wins."
    _check_top(scores, n)
    if n == 0: return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    # the n-th largest score of each row, whichever tied entry topk returned
    kth = scores.topk(n, dim=-1).values[..., -1:]
    above, tied = scores > kth, scores == kth
    room = n - above.sum(-1, keepdim=True)  # slots left for the entries tied with the n-th score
    return above | (tied & (tied.cumsum(-1) <= room))


# %%
test_eq(top_mask(torch.tensor([[1.0, 3, 3, 2], [2, 1, 2, 2]]), 2).int().tolist(),
        [[0, 1, 1, 0], [1, 0, 1, 0]])  # ties at the cut: the lower index wins
test_eq(top_mask(torch.zeros(2, 3), 0).any().item(), False)


# %%
#| export
def top_budget_indices_reference(scores: Tensor, n: int) -> Tensor:
    "`top_budget_indices` by sorting each row in Python on the key (-score, index), keeping the first n, ascending."
    rows = scores.reshape(math.prod(scores.shape[:-1]), scores.shape[-1]).tolist()
    picked = [sorted(sorted(range(len(r)), key=lambda j: (-r[j], j))[:n]) for r in rows]
    return torch.tensor(picked, dtype=torch.long).reshape(*scores.shape[:-1], n)


# %%
test_eq(top_budget_indices_reference(torch.tensor([[2.0, 1, 2, 2], [5, 4, 3, 6]]), 2).tolist(), [[0, 2], [0, 3]])


# %% [markdown]
# Check against the sort on random rows, on rows made of a few repeated values (many ties,
# some at the cut), with $\pm\infty$, and $n \in \{0, 1, T\}$:

# %%
#| export
def _order_keys(scores: Tensor) -> Tensor:
    "Distinct int64 keys [..., T] ordered as (score, lower index first), for scores of at most 32 bits."
    T = scores.shape[-1]
    bits = scores.float().view(torch.int32).long()  # a float's bits: sign, then magnitude (ordered as an integer)
    bits = torch.where(bits < 0, -(1 << 31) - bits, bits)  # a negative float -> -(its magnitude); -0.0 -> 0, as 0.0
    return torch.add(torch.arange(T - 1, -1, -1, device=scores.device), bits, alpha=1 << 32)  # then the index, reversed


# %%
_x = torch.tensor([-math.inf, -2.5, -1e-30, -0.0, 0.0, 1e-30, 1.0, 3e38, math.inf])
# descending: the values' order; -0.0 (index 3) and 0.0 (index 4) tie, so the lower index comes first
test_eq(_order_keys(_x).argsort(descending=True).tolist(), [8, 7, 6, 5, 3, 4, 2, 1, 0])
test_eq(_order_keys(torch.tensor([1.0, 1.0, 1.0])).argsort(descending=True).tolist(), [0, 1, 2])
for dtype in (torch.float16, torch.bfloat16):  # widened to float32 exactly: the same order
    _r = torch.randn(50).to(dtype)
    test_eq(_order_keys(_r).argsort(descending=True), _order_keys(_r.float()).argsort(descending=True))


# %%
#| export
def top_budget_indices(scores: Tensor, n: int) -> Tensor:
    "Indices [..., n], ascending, of the `n` largest scores of each row (last dim); ties: the lower index wins."
    _check_top(scores, n)  # NaN only outside the per-step path (see `sparsekv.attention.checks`)
    if scores.dtype in (torch.float16, torch.bfloat16, torch.float32):
        idx = _order_keys(scores).topk(n, dim=-1, sorted=False).indices  # distinct keys: no tie to break
    else: idx = scores.sort(dim=-1, descending=True, stable=True).indices[..., :n]  # float64, integers
    return idx.sort(-1).values


# %%
g = torch.Generator().manual_seed(0)
for shape in [(3, 17), (2, 4, 9), (1, 1, 1)]:
    rand = torch.randn(shape, generator=g)
    few = torch.randint(0, 3, shape, generator=g).double()       # values in {0, 1, 2}: ties everywhere
    inf = rand.clone()
    inf[..., ::3] = -math.inf
    inf[..., 0] = math.inf
    for s in (rand, few, few.float(), inf):
        for n in sorted({0, 1, shape[-1] // 2, shape[-1]}):
            got = top_budget_indices(s, n)
            test_eq(got, top_budget_indices_reference(s, n))
            test_eq(top_mask(s, n).sum(-1), torch.full(shape[:-1], n))
test_eq(top_budget_indices(torch.zeros(2, 6), 3), torch.tensor([[0, 1, 2], [0, 1, 2]]))   # all tied: the first n
test_fail(lambda: top_mask(torch.tensor([1.0, math.nan]), 1), contains="NaN")
for n in (1, 2, 3):  # a NaN anywhere in a row is refused, whichever entries the top n would be
    test_fail(lambda: top_budget_indices(torch.tensor([[3.0, 2.0, 1.0], [1.0, math.nan, 2.0]]), n), contains="NaN")
test_fail(lambda: top_budget_indices(torch.zeros(4), 5), contains="n must be")
test_fail(lambda: top_mask(torch.zeros(4), 5), contains="n must be")

# %% [markdown]
# The same check on many rows of every dtype, with many ties (a few repeated values, signed zeros) and
# infinities, against the reference's Python sort; and the selection reads nothing back from the device (no
# operator of `sparsekv.syncs.SYNC_OPS`), in the per-step path as well as in a direct call but for the NaN check:

# %%
from sparsekv.attention import hot_path
from sparsekv.syncs import HostSyncs

g = torch.Generator().manual_seed(1)
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64):
    for T in (1, 2, 7, 64, 300):
        few = torch.randint(-2, 3, (4, 3, T), generator=g)
        signed = few * 0.0 if dtype.is_floating_point else few  # -0.0 and 0.0 tie
        for s in (few.to(dtype), signed.to(dtype), torch.randn(4, 3, T, generator=g).to(dtype)):
            if dtype.is_floating_point and T > 2: s[..., 1], s[..., -2] = math.inf, -math.inf
            for n in sorted({0, 1, T // 3, T - 1, T} - {-1}):
                test_eq(top_budget_indices(s, n), top_budget_indices_reference(s, n))
                with HostSyncs() as rec, hot_path(): top_budget_indices(s, n)
                test_eq(rec.total, 0)
with HostSyncs() as rec: top_budget_indices(torch.randn(3, 50), 5)
test_eq([op for op, _ in rec.counts], ["aten._local_scalar_dense"])  # a direct call: only the NaN check reads


# %%
#| export
def all_key_indices(B: int, Hkv: int, T: int, device=None) -> Tensor:
    "Indices [B,Hkv,T] of every cached key: the selection when the cache fits the budget."
    return torch.arange(T, device=device).expand(B, Hkv, T).contiguous()


# %%
test_eq(all_key_indices(1, 2, 3), torch.tensor([[[0, 1, 2], [0, 1, 2]]]))
assert all_key_indices(2, 3, 4).is_contiguous()


# %% [markdown]
# ## Budgets, sinks and recent keys
#
# `budget` is $B_{SA}$ as an int, or a float fraction of the cache (Table 2 keeps 25%:
# "$B_{SA}$ is set to 25% of full cache length", during prefill and generation), resolved
# per chunk by `resolve_budget(budget, T)`.
#
# The paper keeps no fixed sinks or local window. As an ablation, `sinks` (the first
# keys) and `recent` (the last earlier keys, just before the block) are always kept.
# **Our choice: they count against the budget**, so a setting with anchors attends to
# exactly as many keys as one without, and compares at equal cost. The anchors take their
# slots first (sinks before recent keys when the budget is smaller than both), the
# remaining $n - |A|$ slots go to the best-scored other keys. We implement it by giving
# the anchors an infinite score before the top-$n$.

# %%
#| export
def anchor_mask(T: int, n: int, sinks: int = 0, recent: int = 0, device=None) -> Tensor:
    "Boolean [T]: the anchors a budget of n keys keeps, the first min(sinks, n) and last min(recent, n - those) keys."
    check_int(sinks, "sinks"), check_int(recent, "recent"), check_int(n, "n", 0, T)
    s = min(sinks, n)
    r = min(recent, n - s, T - s)
    m = torch.zeros(T, dtype=torch.bool, device=device)
    m[:s] = True
    m[T - r:] = True  # r = 0: the empty slice m[T:]
    return m


# %%
test_eq(anchor_mask(10, 4, 3, 3).nonzero().flatten().tolist(), [0, 1, 2, 9])  # sinks take their slots first
test_eq(anchor_mask(10, 4, 0, 2).nonzero().flatten().tolist(), [8, 9])
test_eq(anchor_mask(5, 3, 0, 5).nonzero().flatten().tolist(), [2, 3, 4])
test_fail(lambda: anchor_mask(10, 4, -1, 0), contains="sinks")
test_fail(lambda: anchor_mask(10, 11), contains="n must be")


# %%
#| export
def anchored_top_indices_reference(scores: Tensor, n: int, sinks: int = 0, recent: int = 0) -> list:
    "`anchored_top_indices` by Python lists: anchors by explicit loops, then the others sorted on (-score, index)."
    T = scores.shape[-1]
    rows = scores.reshape(-1, T).tolist()
    s = min(sinks, n)
    anchors = set(range(s)) | set(range(T - min(recent, n - s, T - s), T))
    out = []
    for r in rows:
        rest = sorted((j for j in range(T) if j not in anchors), key=lambda j: (-r[j], j))
        out.append(sorted(anchors | set(rest[:n - len(anchors)])))
    return out


# %%
# anchors 0 (sink) and 5 (recent), then the best other key: 1 and 3 tie at 5, the lower index wins
test_eq(anchored_top_indices_reference(torch.tensor([[0.0, 5, 1, 5, 2, 0]]), 3, 1, 1), [[0, 1, 5]])


# %% [markdown]
# Check the anchors against the list version, on random scores with ties, for budgets
# smaller and larger than the anchors:

# %%
#| export
def anchored_top_indices(scores: Tensor, n: int, sinks: int = 0, recent: int = 0) -> Tensor:
    "Indices [..., n], ascending, of the anchors (`anchor_mask`) and best other keys of [..., T]; ties: lower first."
    a = anchor_mask(scores.shape[-1], n, sinks, recent, scores.device)
    # scores are finite: anchors win every slot they need
    return top_budget_indices(scores.masked_fill(a, float("inf")), n)


# %%
g = torch.Generator().manual_seed(0)
for T, n, s, r in [(10, 4, 0, 0), (10, 4, 2, 1), (10, 4, 3, 3), (10, 2, 3, 3), (10, 10, 2, 2), (5, 3, 0, 5),
                   (6, 0, 1, 1)]:
    sc = torch.randint(0, 3, (2, 3, T), generator=g).float()  # many ties
    test_eq(anchored_top_indices(sc, n, s, r).reshape(6, n).tolist(), anchored_top_indices_reference(sc, n, s, r))
