# %% [markdown]
# # The fixed-budget sparse mask
#
# > KVpop's attention mask (Eq. 26) of sinks, window and running top-k, dense and as a FlexAttention mask_mod.

# %%
#| default_exp kvpop.mask

# %%
#| export
from __future__ import annotations

import itertools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from sparsekv.attention import (
    BACKENDS,
    check_int,
    check_qkv,
    evictable,
    flex_attention_lse,
    masked_attention,
    repeat_kv,
    sink_window_visible,
)
from sparsekv.kvpop.cutoff import check_budget, check_priority

# %%
#| hide
import math

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.attention import attention_reference
from sparsekv.kvpop.cutoff import effective_score, static_priority, topk_cutoff


# %% [markdown]
# At query $q$, KVpop attends to three sets of keys (App. C.1): the $s$ sinks $t < s$, the
# $w$ most recent tokens $q - t < w$, and the $k$ best tokens of the eligible set
# $\mathcal{E}(q) = \{t \mid s \le t \le q - w\}$ (Eq. 4). With the static ranks and the
# cutoffs $\tau_q$ of `sparsekv.kvpop.cutoff` (the $k$-th smallest rank in
# $\mathcal{E}(q)$, or $S$ when fewer than $k$ are eligible), the third set is
# $\{t \in \mathcal{E}(q) : \mathrm{rank}(t) \le \tau_q\}$, and the mask is (Eq. 26, with
# causality written out)
#
# $$M_{q,t} = [t \le q] \land \Big([t < s] \lor [q - t < w] \lor \big([s \le t \le q - w] \land [\mathrm{rank}(t) \le \tau_q]\big)\Big).$$
#
# ## How many keys a row keeps
#
# For $t \le q$ the three conditions cover everything: a token that is neither a sink
# ($t \ge s$) nor in the window ($t \le q - w$) is eligible. So the causal row $[0, q]$ is
# the union of sinks, window and $\mathcal{E}(q)$, and $\mathcal{E}(q)$ is disjoint from the
# other two. Of the eligible tokens exactly $\min(k, |\mathcal{E}(q)|)$ are kept (ranks are
# distinct, so exactly the $k$ smallest pass $\mathrm{rank} \le \tau_q$). With
# $|\mathcal{E}(q)| = \max(0, q - w - s + 1)$:
#
# - if $\mathcal{E}(q)$ is empty ($q < s + w$), the row keeps all of $[0, q]$: $q + 1 \le s + w$ keys;
# - otherwise sinks and window are disjoint (the window starts after $q - w \ge s$) and the row keeps $s + w + \min(k, |\mathcal{E}(q)|) \le q + 1$ keys.
#
# Both cases read
#
# $$\sum_t M_{q,t} = \min\big(q + 1,\; s + w + \min(k, |\mathcal{E}(q)|)\big),$$
#
# which is the budget $B = s + w + k$ (Eq. 1) as soon as $|\mathcal{E}(q)| \ge k$, i.e.
# from $q = s + w + k - 1$ on.
#
# ## Eviction is permanent
#
# $\tau_q$ never increases: it is the $k$-th smallest element of a set that gains one
# element per step and loses none. A token $t$ evicted at $q$ (eligible, with
# $\mathrm{rank}(t) > \tau_q$) stays eligible at every $q' > q$ and has
# $\mathrm{rank}(t) > \tau_q \ge \tau_{q'}$: it stays evicted. So the mask is what a
# bounded KV cache can actually serve during decoding: once dropped, a key is gone. (This
# holds because the ranking is static; App. B.3 and `sparsekv.kvpop.cutoff`.)

# %%
#| export
def check_rank_cutoff(rank: Tensor, cutoff: Tensor) -> tuple[int, int, int]:
    "Validate rank and cutoff: int64 [B,H,S] tensors of one shape on one device; return (B, H, S)."
    for name, x in (("rank", rank), ("cutoff", cutoff)):
        if not isinstance(x, Tensor) or x.dtype != torch.int64 or x.dim() != 3:
            raise TypeError(f"{name} must be an int64 tensor [B, H, S] (from topk_cutoff), got "
                            f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    if rank.shape != cutoff.shape:
        raise ValueError(f"rank and cutoff must have one shape, got {tuple(rank.shape)} and {tuple(cutoff.shape)}")
    if rank.device != cutoff.device:
        raise ValueError(f"rank and cutoff must be on one device, got {rank.device} and {cutoff.device}")
    return tuple(rank.shape)


# %%
test_eq(check_rank_cutoff(torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, 5, dtype=torch.long)), (2, 3, 5))
test_fail(lambda: check_rank_cutoff(torch.zeros(2, 3, 5, dtype=torch.int32), torch.zeros(2, 3, 5, dtype=torch.long)),
          contains="rank must be an int64 tensor")
test_fail(lambda: check_rank_cutoff(torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, 4, dtype=torch.long)),
          contains="must have one shape")


# %%
#| export
def _check_mask_args(rank: Tensor, cutoff: Tensor, sink: int, window: int, groups: int) -> tuple[int, int, int]:
    check_int(sink, "sink", 0)
    check_int(window, "window", 1)
    check_int(groups, "groups", 1)
    return check_rank_cutoff(rank, cutoff)


# %%
z = torch.zeros(1, 2, 4, dtype=torch.long)
test_eq(_check_mask_args(z, z, 0, 1, 1), (1, 2, 4))
test_fail(lambda: _check_mask_args(z, z, -1, 1, 1), contains="sink must be")
test_fail(lambda: _check_mask_args(z, z, 0, 0, 1), contains="window must be an int >= 1")
test_fail(lambda: _check_mask_args(z, z, 0, 1, 0), contains="groups must be an int >= 1")


# %% [markdown]
# `check_ranks` by hand for $S = 4$, one sink, a window of one: rank $S$ at the sink and in $[0, S)$ after it,
# cutoff $S$ for the first two queries (no eligible key yet):

# %%
#| export
def check_ranks(rank: Tensor, cutoff: Tensor, sink: int, window: int) -> None:
    """Necessary conditions, O(S) per head, for rank and cutoff to come from `topk_cutoff(., k, sink, window)`: rank S
    at the sinks and in [0, S) after them; cutoff in [0, S], and S while E(q) is empty (q < sink + window)."""
    S, s = rank.shape[-1], min(sink, rank.shape[-1])
    if (rank[..., :s] != S).any() or ((rank[..., s:] < 0) | (rank[..., s:] >= S)).any():
        raise ValueError(f"rank must be S={S} at the sinks and in [0, S) after them, as topk_cutoff gives for "
                         f"sink={sink}: ranks built for another sink, or negative, are refused")
    if ((cutoff < 0) | (cutoff > S)).any() or (cutoff[..., :sink + window] != S).any():
        raise ValueError(f"cutoff must be in [0, S={S}], and S for the first sink + window = {sink + window} queries "
                         f"(no eligible key), as topk_cutoff gives for sink={sink}, window={window}")


# %%
rank4, cut4 = torch.tensor([[[4, 0, 1, 2]]]), torch.tensor([[[4, 4, 0, 1]]])
check_ranks(rank4, cut4, 1, 1)
test_fail(lambda: check_ranks(torch.tensor([[[0, 0, 1, 2]]]), cut4, 1, 1), contains="rank must be S=4 at the sinks")
test_fail(lambda: check_ranks(rank4, torch.tensor([[[4, 0, 0, 1]]]), 1, 1), contains="S for the first sink + window")
test_fail(lambda: check_ranks(rank4, torch.tensor([[[4, 4, 0, 5]]]), 1, 1), contains="cutoff must be in [0, S=4]")


# %% [markdown]
# The kept-count check by hand for $S = 5$, no sink, a window of one and $k = 2$: $|\mathcal{E}(q)| = q$, so the
# rows $q \ge 2$ are full and keep 2 eligible keys, the rows before keep all they have:

# %%
#| export
def _check_kept(n: Tensor, full: Tensor, sink: int, window: int) -> None:
    "Rows with a cutoff < S keep one number k of eligible keys per head, and exactly those rows have |E(q)| >= k."
    size = (torch.arange(n.shape[-1], device=n.device) - sink - window + 1).clamp(min=0)   # |E(q)|
    k = n.masked_fill(~full, 0).amax(-1, keepdim=True)
    if ((n != k) & full).any() or (full != (size >= k) & full.any(-1, keepdim=True)).any():
        raise ValueError(f"rank and cutoff do not keep the same k eligible keys at every full row: built for another "
                         f"sink or window than sink={sink}, window={window}?")


# %%
full5 = torch.tensor([[[False, False, True, True, True]]])
_check_kept(torch.tensor([[[0, 1, 2, 2, 2]]]), full5, 0, 1)
test_fail(lambda: _check_kept(torch.tensor([[[0, 1, 2, 3, 2]]]), full5, 0, 1), contains="the same k eligible keys")
test_fail(lambda: _check_kept(torch.tensor([[[0, 1, 2, 2, 2]]]), ~torch.tensor([[[1, 0, 0, 0, 0]]]).bool(), 0, 1),
          contains="the same k eligible keys")  # row 1 has one eligible key, not k = 2: it cannot be full


# %% [markdown]
# The mask by its definition, with loops, by hand for $S = 4$, $k = 1$, no sink, a window of one and priorities
# $(3, 1, 2, 0)$: token 0 wins the one slot at every query.

# %%
#| export
def kvpop_mask_reference(priority: Tensor, k: int, sink: int, window: int) -> Tensor:
    "The KVpop mask [B,H,S,S] by definition, with loops: per q, the top k of E(q) by priority (ties: earlier first)."
    priority = check_priority(priority)
    k, sink, window = check_budget(k, sink, window)
    B, H, S = priority.shape
    rows = []
    for b, h in itertools.product(range(B), range(H)):
        p = priority[b, h].tolist()
        for q in range(S):
            top = set(sorted(range(sink, q - window + 1), key=lambda t: (-p[t], t))[:k])
            rows.append([t <= q and (t < sink or q - t < window or t in top) for t in range(S)])
    return torch.tensor(rows, dtype=torch.bool, device=priority.device).reshape(B, H, S, S)


# %%
test_eq(kvpop_mask_reference(torch.tensor([[[3.0, 1, 2, 0]]]), 1, 0, 1)[0, 0].int().tolist(),
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]])


# %% [markdown]
# The dense mask, from the rank and cutoff of `topk_cutoff`:
#
# Check the dense mask built from `topk_cutoff` against the loops, then the row counts and
# the permanence of eviction, on sizes from $1$ to $300$ (including sequences shorter than
# the budget), with and without ties in the priorities.

# %%
#| export
def kvpop_mask(rank: Tensor, cutoff: Tensor, sink: int, window: int, groups: int = 1) -> Tensor:
    """Dense KVpop mask (Eq. 26), bool [B, H*groups, S, S], True = attend: causal and (sink, or in the window,
    or eligible with rank[t] <= cutoff[q]). Query head h*groups+g uses KV head h."""
    _check_mask_args(rank, cutoff, sink, window, groups)
    check_ranks(rank, cutoff, sink, window)
    S = rank.shape[-1]
    q = torch.arange(S, device=rank.device)[:, None]
    t = torch.arange(S, device=rank.device)
    top = rank[..., None, :] <= cutoff[..., :, None]  # [B, H, S, S]: rank(t) <= tau_q
    # causal and (sink or window), or in E(q) (Eq. 4) with rank(t) <= tau_q
    kept = evictable(sink, window)(q, t) & top
    _check_kept(kept.sum(-1), cutoff < S, sink, window)
    return repeat_kv(sink_window_visible(sink, window)(q, t) | kept, groups)


# %%
def _row_counts(S, k, sink, window):
    "min(q + 1, s + w + min(k, |E(q)|)) for q = 0..S-1, with |E(q)| counted directly."
    return torch.tensor([min(q + 1, sink + window + min(k, len(range(sink, q - window + 1)))) for q in range(S)])

def _evictions_permanent(mask, sink, window):
    "True if every eligible key, once dropped at some query, is dropped at all later queries."
    S = mask.shape[-1]
    for t in range(sink, S):
        kept = mask[..., t + window:, t]  # the queries at which t is eligible
        dropped = torch.cumsum(~kept, -1) > 0  # dropped at this query or at an earlier one
        if (kept & dropped).any(): return False
    return True

torch.manual_seed(0)
for S, k, sink, window in ((1, 1, 0, 1), (2, 1, 1, 1), (5, 3, 2, 4), (9, 2, 0, 1), (30, 4, 2, 3), (64, 8, 4, 16),
                           (120, 200, 1, 2), (300, 24, 4, 32)):
    for p in (torch.randn(1, 2, S), torch.randint(0, 3, (1, 2, S)).float()):
        rank, cutoff = topk_cutoff(p, k, sink, window)
        mask = kvpop_mask(rank, cutoff, sink, window)
        test_eq(mask, kvpop_mask_reference(p, k, sink, window))
        test_eq(mask.sum(-1), _row_counts(S, k, sink, window).expand(1, 2, S))
        assert _evictions_permanent(mask, sink, window)

# %% [markdown]
# The permanence check can fail: a mask whose top-$k$ is recomputed at every $q$ from the
# exact effective scores with a decay step $n > 1$ (Eq. 18) is not a running top-$k$. Take
# $n = 2$, $\log\gamma = -1$, $k = 1$, and two tokens one position apart with raw scores
# $r_0 = 1$, $r_1 = 0.5$: their effective scores differ by
# $0.5 - (\lfloor q/2 \rfloor - \lfloor (q-1)/2 \rfloor) = 0.5 - [q \text{ even}]$, so the
# slot alternates between them and token $0$ is dropped at $q = 2$ and back at $q = 3$.
# The static (bucketed) ranking keeps token $0$ throughout.

# %%
r = torch.tensor([[[1.0, 0.5, -5.0, -5.0, -5.0, -5.0]]])
S, k, sink, window, n = 6, 1, 0, 1, 2
rows = []
for q in range(S):
    eff = effective_score(r, -1.0, q, n)[0, 0].tolist()
    top = set(sorted(range(sink, q - window + 1), key=lambda t: (-eff[t], t))[:k])
    rows.append([t <= q and (q - t < window or t in top) for t in range(S)])
exact_n2 = torch.tensor(rows)[None, None]
assert not _evictions_permanent(exact_n2, sink, window)
test_eq(exact_n2[0, 0, 2:4, 0].tolist(), [False, True])
rank, cutoff = topk_cutoff(static_priority(r, -1.0, n), k, sink, window)
assert _evictions_permanent(kvpop_mask(rank, cutoff, sink, window), sink, window)


# %% [markdown]
# ## FlexAttention: the mask evaluated on the fly (App. C.3)
#
# FlexAttention asks a `mask_mod(b, h, q_idx, kv_idx)` whether query `q_idx` of head `h`
# may see key `kv_idx`; the kernel evaluates it per block of scores and never stores an
# $S \times S$ mask. Ours reads the captured `rank` and `cutoff` ($O(S)$ per head) and
# tests Eq. (26). With grouped-query attention FlexAttention passes the *query* head $h$;
# its KV head is $\lfloor h / G \rfloor$. `kvpop_block_mask` builds the `BlockMask` (which
# blocks can be skipped entirely) from the same `mask_mod`.
#
# Check: the `mask_mod`, evaluated on the full grid of indices (broadcast tensors), equals
# the dense mask for $G = 1, 3, 4$.

# %%
#| export
def kvpop_mask_mod(rank: Tensor, cutoff: Tensor, sink: int, window: int, groups: int = 1):
    "FlexAttention mask_mod of `kvpop_mask` over captured rank/cutoff [B,Hkv,S]; query head h reads KV head h // G."
    _check_mask_args(rank, cutoff, sink, window, groups)
    check_ranks(rank, cutoff, sink, window)
    fixed, eligible = sink_window_visible(sink, window), evictable(sink, window)  # the predicates of `kvpop_mask`

    def mask_mod(b, h, q_idx, kv_idx):
        kv_head = h // groups
        top = rank[b, kv_head, kv_idx] <= cutoff[b, kv_head, q_idx]
        return fixed(q_idx, kv_idx) | (eligible(q_idx, kv_idx) & top)

    return mask_mod


# %%
def _eval_mask_mod(mask_mod, B, Hq, S):
    "A mask_mod evaluated on every (b, h, q, kv), [B, Hq, S, S]."
    b, h, q, kv = (torch.arange(n).reshape([-1 if i == j else 1 for j in range(4)])
                   for i, n in enumerate((B, Hq, S, S)))
    return mask_mod(b, h, q, kv).expand(B, Hq, S, S)

torch.manual_seed(1)
for G, (S, k, sink, window) in itertools.product((1, 3, 4), ((1, 1, 0, 1), (13, 2, 1, 3), (77, 6, 2, 9))):
    p = torch.randint(0, 4, (2, 2, S)).float()
    rank, cutoff = topk_cutoff(p, k, sink, window)
    dense = kvpop_mask(rank, cutoff, sink, window, groups=G)
    test_eq(dense.shape, (2, 2 * G, S, S))
    test_eq(_eval_mask_mod(kvpop_mask_mod(rank, cutoff, sink, window, G), 2, 2 * G, S), dense)
    # query head h <- KV head h // G
    for h in range(2 * G): test_eq(dense[:, h], kvpop_mask(rank, cutoff, sink, window)[:, h // G])


# %%
#| export
def kvpop_block_mask(rank: Tensor, cutoff: Tensor, sink: int, window: int, groups: int = 1) -> BlockMask:
    "FlexAttention BlockMask of the KVpop mask for B x (Hkv*groups) query heads over S x S positions."
    B, H, S = _check_mask_args(rank, cutoff, sink, window, groups)
    return create_block_mask(kvpop_mask_mod(rank, cutoff, sink, window, groups), B, H * groups, S, S,
                             device=rank.device)


# %%
bm = kvpop_block_mask(rank, cutoff, sink, window, 3)  # the last ranks of the grid above: S = 77, 2 KV heads
test_eq(bm.shape, (2, 6, 77, 77))
test_eq(_eval_mask_mod(bm.mask_mod, 2, 6, 77), kvpop_mask(rank, cutoff, sink, window, groups=3))


# %% [markdown]
# ## Sparse attention and its log-sum-exp (Eq. 9)
#
# `kvpop_attention` runs attention under the KVpop mask and returns `(out, lse)` like the
# core backends of `sparsekv.attention`: on CUDA through FlexAttention with the on-the-fly
# block mask, elsewhere (and whenever gradients are needed on CPU) through
# `masked_attention` with the dense mask. The LSE it returns is the *sparse* normalizer
#
# $$\widetilde{\mathrm{LSE}}_d = \log \sum_{t'=0}^{d} M_{d,t'} \exp \ell(d, t'),$$
#
# which KVpop's target reuses in place of the dense one (Eq. 9, `sparsekv.kvpop.target`).
#
# Check, for $G = 1, 3, 4$: the dense-mask path and the FlexAttention path equal the
# reference attention under the same mask, and the LSE equals Eq. (9) summed with loops
# over the kept keys in float64.

# %%
#| export
def kvpop_attention(q: Tensor, k: Tensor, v: Tensor, rank: Tensor, cutoff: Tensor, sink: int, window: int,
                    scale: float | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Attention under the KVpop mask: (out [B,Hq,S,Dv], sparse lse [B,Hq,S], Eq. 9). q [B,Hq,S,D], k/v [B,Hkv,S,D],
    rank/cutoff [B,Hkv,S]. backend 'auto': FlexAttention with the on-the-fly mask on CUDA, the dense mask elsewhere."""
    if backend not in BACKENDS: raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    G = check_qkv(q, k, v)
    B, Hkv, S = _check_mask_args(rank, cutoff, sink, window, 1)
    if q.shape[2] != S or k.shape[2] != S or (B, Hkv) != tuple(k.shape[:2]):
        raise ValueError(f"rank/cutoff {tuple(rank.shape)} must be [B, Hkv, S] of k {tuple(k.shape)}, with q "
                         f"{tuple(q.shape)} over the same S")
    if rank.device != q.device:
        raise ValueError(f"rank and cutoff must be on {q.device} (with q, k, v), got {rank.device}")
    if backend == "flex" or (backend == "auto" and q.is_cuda):
        return flex_attention_lse(q, k, v, kvpop_block_mask(rank, cutoff, sink, window, G), scale=scale,
                                  enable_gqa=G > 1)
    return masked_attention(q, k, v, kvpop_mask(rank, cutoff, sink, window, G), scale=scale, backend=backend)


# %%
def _sparse_lse_loops(q, k, mask, G):
    "Eq. (9) with explicit loops: log of the sum over kept keys of exp(<q_d, k_t> / sqrt(D)), float64."
    B, Hq, S, D = q.shape
    lse = torch.empty(B, Hq, S, dtype=torch.float64)
    for b, h, d in itertools.product(range(B), range(Hq), range(S)):
        logits = [float(q[b, h, d].double() @ k[b, h // G, t].double()) / math.sqrt(D)
                  for t in range(S) if mask[b, h, d, t]]
        m = max(logits)
        lse[b, h, d] = m + math.log(sum(math.exp(x - m) for x in logits))
    return lse

torch.manual_seed(2)
B, Hkv, S, D, k, sink, window = 1, 2, 40, 8, 5, 2, 4
for G in (1, 3, 4):
    q, kk, v = torch.randn(B, Hkv * G, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    rank, cutoff = topk_cutoff(torch.randint(0, 5, (B, Hkv, S)).float(), k, sink, window)
    mask = kvpop_mask(rank, cutoff, sink, window, G)
    want_out, want_lse = attention_reference(q, kk, v, mask)
    assert_close(want_lse.double(), _sparse_lse_loops(q, kk, mask, G), rtol=1e-5, atol=1e-5)
    for backend in ("auto", "sdpa", "flex"):
        out, lse = kvpop_attention(q, kk, v, rank, cutoff, sink, window, backend=backend)
        assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
test_fail(lambda: kvpop_attention(q, kk, v, rank[..., :-1], cutoff[..., :-1], sink, window),
          contains="must be [B, Hkv, S]")
test_fail(lambda: kvpop_mask(rank.int(), cutoff, sink, window), contains="int64 tensor")
test_fail(lambda: kvpop_mask(rank, cutoff, sink, 0), contains="window must be an int >= 1")
test_fail(lambda: kvpop_mask(rank, cutoff, sink, window, groups=0), contains="groups must be an int >= 1")

# %% [markdown]
# Ranks and cutoffs built for another sink or window, or negative ranks, are refused (`check_ranks` in $O(S)$, and
# the dense mask checks that its full rows keep one number $k$ of eligible keys).

# %%
p = torch.randn(2, 2, 30)
rank, cutoff = topk_cutoff(p, 4, 2, 3)
test_eq(kvpop_mask(rank, cutoff, 2, 3), kvpop_mask_reference(p, 4, 2, 3))
test_fail(lambda: kvpop_mask(rank.index_fill(2, torch.tensor([5]), -1), cutoff, 2, 3), contains="negative")
for s, w in ((1, 3), (3, 3)):   # another sink
    test_fail(lambda: kvpop_mask(rank, cutoff, s, w), contains="another sink")
for s, w in ((2, 1), (2, 6), (2, 5)):   # another window
    test_fail(lambda: kvpop_mask(rank, cutoff, s, w), contains="window")
# the mask_mod checks in O(S) only: another sink, or a window larger than the ranks were built for (small k)
test_fail(lambda: kvpop_mask_mod(rank, cutoff, 1, 3), contains="another sink")
test_fail(lambda: kvpop_mask_mod(*topk_cutoff(p, 1, 2, 1), 2, 3), contains="window=3")
