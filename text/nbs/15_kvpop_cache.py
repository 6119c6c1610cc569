# %% [markdown]
# # KVpop: bounded-cache inference
#
# > A `transformers` cache of `s` sinks, `w` recent tokens and `k` priority slots per KV head (§3, App. C).

# %%
#| default_exp kvpop.cache

# %%
#| export
from __future__ import annotations

import torch
from fastcore.basics import patch_to
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from sparsekv.attention import check_int, flex_attention_lse, gather_kv, is_causal
from sparsekv.cache import EvictingCache, EvictingLayer, TopScoreRule
from sparsekv.hf import DensePolicy, MaskPolicy, dense_attention, measuring
from sparsekv.kvpop.cutoff import LogDecay, check_budget, prefix_kth, topk_cutoff
from sparsekv.kvpop.mask import kvpop_mask
from sparsekv.kvpop.scorers import MLPScorer, MLSTMScorer, mlstm_chunkwise_immediate, mlstm_readout, mlstm_step

# %%
#| hide
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.nn.attention.flex_attention import create_mask
from torch.testing import assert_close

from sparsekv.hf import chunked_prefill, patch
from sparsekv.models import load_model


# %% [markdown]
# ## Static priorities at absolute positions
#
# KVpop ranks the tokens that left the window by the effective score
# $\hat r_{h,t} + \lfloor (q-t)/n \rfloor \log\gamma_h$ (Eq. 5). For a fixed query $q$, ranking by it is
# the same as ranking by the static priority $\hat r_{h,t} - \lfloor t/n \rfloor \log\gamma_h$ (Eq. 20)
# when $n = 1$ (the term $q \log \gamma_h$ is common to all tokens); `static_priority` computes it for
# positions $0..S-1$. At decode the cache scores a chunk of tokens at absolute positions
# $t_0..t_0+C-1$, so we need the same formula at arbitrary positions. A `KVpopScorers` holds, per
# layer, one scorer and one `LogDecay`, and returns the static priority of new entries.

# %%
#| export
class KVpopScorers(nn.Module):
    "Per layer a scorer (raw scores from [k; v]) and a `LogDecay`; `priority` gives static priorities at positions."

    def __init__(self, scorers: list[nn.Module], decays: list[LogDecay], n: int = 1):
        super().__init__()
        if len(scorers) != len(decays) or not scorers:
            raise ValueError(f"need one scorer and one LogDecay per layer, got {len(scorers)} scorers and "
                             f"{len(decays)} decays")
        self.scorers, self.decays = nn.ModuleList(scorers), nn.ModuleList(decays)
        self.n = check_int(n, "n (the decay step)", 1)


# %%
test_fail(lambda: KVpopScorers([MLPScorer(3, 8)], []), contains="one scorer and one LogDecay per layer")


# %%
#| export
@patch_to(KVpopScorers, cls_method=True)
def mlp(cls, num_layers: int, num_kv_heads: int, head_dim: int, n: int = 1, **decay_kwargs) -> "KVpopScorers":
    "MLP scorers (zero score head: neutral ranking) and default decays for every layer."
    return cls([MLPScorer(num_kv_heads, head_dim) for _ in range(num_layers)],
               [LogDecay(num_kv_heads, **decay_kwargs) for _ in range(num_layers)], n)


# %%
sc = KVpopScorers.mlp(2, 3, 8, n=4)
test_eq(([type(m).__name__ for m in sc.scorers], len(sc.decays), sc.n), (["MLPScorer"] * 2, 2, 4))


# %%
#| export
@patch_to(KVpopScorers, cls_method=True)
def mlstm(cls, num_layers: int, num_kv_heads: int, head_dim: int, delay: int, n: int = 1,
          **decay_kwargs) -> "KVpopScorers":
    "mLSTM scorers with readout delay `delay` (= the window w in KVpop) and default decays for every layer."
    return cls([MLSTMScorer(num_kv_heads, head_dim, delay=delay) for _ in range(num_layers)],
               [LogDecay(num_kv_heads, **decay_kwargs) for _ in range(num_layers)], n)


# %%
test_eq([type(m).__name__ for m in KVpopScorers.mlstm(2, 3, 8, delay=4).scorers], ["MLSTMScorer"] * 2)


# %%
#| export
@patch_to(KVpopScorers)
def _layer(self, layer_idx: int) -> int:
    if not 0 <= layer_idx < len(self.scorers):
        raise ValueError(f"layer_idx must lie in [0, {len(self.scorers)}), got {layer_idx}")
    return layer_idx


# %%
test_eq([sc._layer(0), sc._layer(1)], [0, 1])
test_fail(lambda: sc._layer(-1), contains="layer_idx must lie in [0, 2)")


# %%
#| export
@patch_to(KVpopScorers)
def raw(self, layer_idx: int, k: Tensor, v: Tensor) -> Tensor:
    "Raw scores [B,Hkv,S] of layer `layer_idx` from keys/values [B,Hkv,S,d]."
    return self.scorers[self._layer(layer_idx)](k, v).float()


# %%
test_eq(sc.raw(1, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)).detach(), torch.zeros(2, 3, 5))  # zero heads
test_fail(lambda: sc.raw(2, torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)), contains="layer_idx must lie in [0, 2)")


# %% [markdown]
# `decayed` applies the decay to raw scores: $r_t - \lfloor t/n \rfloor \log\gamma_h$, in float32.
# Checked by hand for $n = 4$ (positions 0..4 are steps 0, 0, 0, 0, 1):

# %%
#| export
@patch_to(KVpopScorers)
def decayed(self, layer_idx: int, r: Tensor, positions: Tensor) -> Tensor:
    "Static priorities, float32, of raw scores r at absolute `positions` (same shape, heads in dim 1)."
    log_gamma = self.decays[self._layer(layer_idx)]().to(r.device, torch.float32)  # ranking in float32 (App. F)
    log_gamma = log_gamma.view(1, -1, *([1] * (r.dim() - 2)))
    steps = positions if self.n == 1 else torch.div(positions, self.n, rounding_mode="floor")
    return torch.addcmul(r.float(), steps.float(), log_gamma, value=-1)


# %%
from sparsekv.kvpop.cutoff import static_priority

r = torch.randn(1, 3, 5)
log_g = sc.decays[0]()
assert_close(sc.decayed(0, r, torch.arange(5).expand(1, 3, 5)),
             r - torch.tensor([0.0, 0, 0, 0, 1]) * log_g[:, None])


# %% [markdown]
# `priority` scores keys and values and decays the scores; at positions $0..S-1$ it is `static_priority` of the
# raw scores, for $n = 1$ and for age buckets $n > 1$:

# %%
#| export
@patch_to(KVpopScorers)
def priority(self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    "Static priorities r_t - floor(t/n) log(gamma_h), float32 [B,Hkv,S], at absolute `positions` [B,Hkv,S]."
    return self.decayed(layer_idx, self.raw(layer_idx, k, v), positions)


# %%
torch.manual_seed(0)
sc = KVpopScorers.mlp(2, 3, 8, n=4)
for m in sc.modules():
    if isinstance(m, LogDecay): nn.init.normal_(m.alpha)
for p in sc.scorers.parameters(): nn.init.normal_(p, std=0.5)
k, v = torch.randn(2, 3, 11, 8), torch.randn(2, 3, 11, 8)
pos = torch.arange(11).expand(2, 3, 11)
for layer in range(2):
    assert_close(sc.priority(layer, k, v, pos), static_priority(sc.raw(layer, k, v), sc.decays[layer](), 4))
# a chunk at positions 6..10 gets the same priorities as inside the full sequence
assert_close(sc.priority(1, k[:, :, 6:], v[:, :, 6:], pos[:, :, 6:]), sc.priority(1, k, v, pos)[:, :, 6:])
test_fail(lambda: sc.priority(2, k, v, pos), contains="layer_idx must lie in [0, 2)")


# %% [markdown]
# ## The eviction rule
#
# KVpop's budget per KV head is $B = s + w + k$ (Eq. 1). `TopScoreRule` already implements "sinks,
# window, and the $k$ best-scored entries among those that left the window (ties: the earlier)",
# and 03_hf proves by induction that with scores fixed at insertion, permanently dropping what the
# next query does not see keeps exactly $\operatorname{top}_k E(p)$. With the static priority as the
# score, a token that leaves the window is kept only if it beats the worst kept long-range token
# (then that one is evicted for good), which is Alg. 2's running top-$k$. So the KVpop rule is a
# `TopScoreRule` whose insertion score is the static priority. Memory per head: between steps the
# cache holds $s + (w-1) + k$ entries (the next query fills the window's last slot), during a step
# $s + w + k$, and during a prefill chunk of $C$ tokens at most $C$ more.
#
# With zero score heads (a fresh MLP scorer) a stateless rule's scores are the decay alone,
# $-t\log\gamma_h$; a recurrent rule refuses an eviction that no `KVpopPolicy` masked:

# %%
#| export
class KVpopRule(TopScoreRule):
    "KVpop eviction (Eq. 1): `sink` sinks, a `window` of recent tokens, the `k` best static priorities of older tokens."

    def __init__(self, scorers: KVpopScorers, sink: int, window: int, k: int):
        check_budget(k, sink, window)
        if not isinstance(scorers, KVpopScorers):
            raise TypeError(f"scorers must be a KVpopScorers, got {type(scorers).__name__}")
        delays = {getattr(s, "delay", 0) for s in scorers.scorers}
        if len(delays) != 1 or max(delays) > window:
            raise ValueError(f"the scorers' readout delays must be one value <= window={window}, got {sorted(delays)}")
        recurrent = {isinstance(s, MLSTMScorer) for s in scorers.scorers}
        if len(recurrent) != 1: raise ValueError("the scorers must be all recurrent (MLSTMScorer) or all stateless")
        super().__init__(sink, window, k)
        self.kvpop, self.delay, self.recurrent = scorers, delays.pop(), recurrent.pop()

    @property
    def budget(self) -> int:
        "The budget per KV head, s + w + k (Eq. 1)."
        return self.sink + self.window + self.k

    def scores(self, layer, keys, values, positions):
        "Static priorities of new entries; a delayed scorer also scores the older ones read now (`DelayedReadout`)."
        with torch.no_grad():
            if not self.recurrent: return self.kvpop.priority(layer.layer_idx, keys, values, positions)
            return self._recurrent_scores(layer, keys, values, positions)

    def check_masked(self, layer) -> None:
        "Before an eviction: a recurrent scorer's pending token must have been masked by `KVpopPolicy` at decode."
        if self.recurrent and not getattr(layer, "kvpop_masked", False):
            raise RuntimeError("a KVpop cache with recurrent (mLSTM) scorers decodes only under KVpopPolicy (it masks "
                               "decode queries)")
        layer.kvpop_masked = False


# %%
rule = KVpopRule(KVpopScorers.mlp(1, 2, 4), 2, 3, 4)
test_eq((rule.budget, rule.delay, rule.recurrent), (9, 0, False))
k4, v4, pos4 = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.arange(6).expand(1, 2, 6)
assert_close(rule.scores(SimpleNamespace(layer_idx=0), k4, v4, pos4), -pos4 * rule.kvpop.decays[0]()[:, None])
rec = KVpopRule(KVpopScorers.mlstm(1, 2, 4, delay=3), 2, 3, 4)
test_eq((rec.delay, rec.recurrent), (3, True))
test_fail(lambda: rec.check_masked(SimpleNamespace()), contains="only under KVpopPolicy")
masked = SimpleNamespace(kvpop_masked=True)
rec.check_masked(masked); test_eq(masked.kvpop_masked, False)  # one mask allows one eviction
test_fail(lambda: KVpopRule(KVpopScorers.mlstm(1, 2, 4, delay=3), 2, 2, 4),
          contains="delays must be one value <= window")
mixed = KVpopScorers([MLPScorer(2, 4), MLSTMScorer(2, 4, delay=0)], [LogDecay(2), LogDecay(2)])
test_fail(lambda: KVpopRule(mixed, 2, 3, 4), contains="all recurrent (MLSTMScorer) or all stateless")


# %% [markdown]
# ## What a query sees, without a sort at decode
#
# The reference: per query, sinks, window, the pending entries (not scored yet, see below) and the
# $k$ best eligible entries by a stable sort (ties: the earlier). By hand, 8 entries, $s = 1$,
# $w = 2$, $k = 2$: query 7 sees the sink, the window $\{6, 7\}$ and the two best of $1..5$
# (priorities 5, 1, 5, 2, 0: entries 1 and 3); with $k = 1$ the tie of 5 goes to the earlier
# entry 1; query 4 sees everything up to 4 (only two entries are eligible); with entry 5 pending it
# stays visible and is not ranked.

# %%
#| export
def kvpop_visible_reference(positions: Tensor, scores: Tensor, query_positions: Tensor, sink: int, window: int, k: int,
                            pending_from: int) -> Tensor:
    "Boolean [B,H,Sq,N]: sinks, window, pending (t >= pending_from), the k best eligible by a stable sort, per query."
    t, p = positions[:, :, None, :], query_positions[:, None]
    pending = t >= pending_from
    eligible = (t >= sink) & (p - t >= window) & ~pending
    s = scores[:, :, None, :].expand(eligible.shape).masked_fill(~eligible, float("-inf"))
    best = s.argsort(dim=-1, descending=True, stable=True)[..., :k]
    top = torch.zeros_like(eligible).scatter(-1, best, True) & eligible
    return (t <= p) & ((t < sink) | (p - t < window) | pending) | top


# %%
pos8, sco8 = torch.arange(8)[None, None], torch.tensor([[[0.0, 5, 1, 5, 2, 0, 0, 0]]])
vis = lambda k, pending_from: kvpop_visible_reference(pos8, sco8, torch.tensor([7, 4]), 1, 2, k, pending_from)[0, 0]
test_eq(vis(2, 8).int().tolist(), [[1, 1, 0, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])
test_eq(vis(1, 8)[0].int().tolist(), [1, 1, 0, 0, 0, 0, 1, 1])
test_eq(vis(2, 5)[0].int().tolist(), [1, 1, 0, 1, 0, 1, 1, 1])


# %% [markdown]
# `visible` does not sort each query's eligible entries (the reference's $[B, H, S_q, N]$ sort, $O(S_q N \log N)$:
# seconds for a long prompt read in one call). It ranks the entries once, as training's Alg. 2 ranks tokens: the
# candidates (neither sinks nor pending) by descending priority, ties to the earlier entry, then the others. In
# position order a query $p$'s eligible entries are the candidates among the first $m(p)$ entries (those at
# $t \le p - w$), so its $k$ best are the eligible entries whose rank is at most $\tau_p$, the $k$-th smallest rank
# among those first $m(p)$ (`prefix_kth`, the wavelet matrix of `cutoff_torch`, all queries at once): when fewer
# than $k$ of them are candidates, $\tau_p$ is a non-candidate's rank and every eligible entry is kept. No branch
# reads a count back from the device. (At decode the layer needs no ranking at all: see
# `TopScoreRule.worst_eligible`.) An eligible entry whose priority is $-\infty$ still ranks above the entries that
# are not eligible, so each head keeps $\min(k, |E|)$ of them whatever the priorities; for finite ones this is the
# reference exactly.
#
# `visible` against the reference on random layer states, with many tied priorities (integers),
# with and without pending entries, for single queries, chunks of queries and a whole prompt:

# %%
#| export
@patch_to(KVpopRule)
def pending_from(self, layer) -> int:
    "The first position not scored yet: a recurrent scorer reads tokens `delay` late (`TopScoreRule.eligible_span`)."
    return layer.kvpop_readout.pending_from if self.recurrent else layer.seen


# %%
#| export
@patch_to(KVpopRule)
def cutoffs(self, layer, query_positions) -> tuple[Tensor, Tensor] | None:
    """What `visible` hides by: (rank [B,H,N] of each candidate entry, -1 for sinks and pending entries, and the cutoff
    [B,H,Sq] of each query: an entry out of its window whose rank exceeds the cutoff is hidden); None: N <= k."""
    (B, H, N), k = layer.positions.shape, self.k
    if N <= k: return None  # at most k entries: every eligible one is among the k best
    cand = (layer.positions >= self.sink) & (layer.positions < self.pending_from(layer))  # neither sink nor pending
    # the candidates by priority (an eligible -inf above the rest, so `count` holds), then the others in entry order
    key = torch.where(cand, layer.scores.clamp_min(torch.finfo(layer.scores.dtype).min), float("-inf"))
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=order.device).expand_as(order))
    # [B,H,Sq]: how many entries lie at t <= p - w, the first ones (a layer keeps its entries in position order)
    m = torch.searchsorted(layer.positions.contiguous(), (query_positions - self.window).expand(B, H, -1).contiguous(),
                           right=True)
    tau = prefix_kth(rank.view(B * H, N), m.clamp(min=k).view(B * H, -1), k).view(m.shape)
    return torch.where(cand, rank, -1), torch.where(m >= k, tau, N)  # fewer than k there: every eligible one


@patch_to(KVpopRule)
def visible(self, layer, query_positions):
    "Sinks, window, pending (unread) and the k best eligible entries (ranked once, ties to the earlier; a cutoff each)."
    t, p = layer.positions[:, :, None, :], query_positions[:, None]
    cut = self.cutoffs(layer, query_positions)
    if cut is None: return is_causal(p, t)
    rank, tau = cut
    # hidden: the eligible entries (E(p), Eq. 4: out of the window, candidates) beyond the cutoff; a long prompt's
    # [B,H,Sq,N] mask is the cost here, so each comparison over it runs once (sinks and pending rank -1: never hidden)
    return is_causal(p, t) & ~((t <= p - self.window) & (rank[:, :, None, :] > tau[..., None]))


# %%
gen = torch.Generator().manual_seed(0)
for trial in range(300):
    s_, w_, k_ = (int(x) for x in torch.randint(1, 6, (3,), generator=gen))
    seen = int(torch.randint(s_ + w_, s_ + w_ + 3 * k_, (1,), generator=gen))
    pos = torch.stack([torch.randperm(seen, generator=gen)[:s_ + w_ + k_].sort().values for _ in range(2)])[None]
    sco = torch.randint(0, 3, pos.shape, generator=gen).float()  # many ties
    recurrent = trial % 2 == 1
    rule = KVpopRule(KVpopScorers.mlstm(1, 1, 2, w_) if recurrent else KVpopScorers.mlp(1, 1, 2), s_, w_, k_)
    pend = seen - int(torch.randint(0, w_ + 1, (1,), generator=gen)) if recurrent else seen
    layer = SimpleNamespace(positions=pos, scores=sco, seen=seen, kvpop_readout=SimpleNamespace(pending_from=pend))
    for qp in (torch.tensor([seen]), torch.arange(seen - 3, seen + 1)):
        test_eq(rule.visible(layer, qp), kvpop_visible_reference(pos, sco, qp, s_, w_, k_, pend))
# a whole prompt at once, every query; and -inf priorities, which rank above the entries that are not eligible: the
# reference with them raised to the lowest float
pos, sco = torch.arange(40).expand(1, 2, 40), torch.randint(0, 4, (1, 2, 40), generator=gen).float()
sco[0, 0, 3:33] = float("-inf")  # head 0: fewer finite eligible entries than k for most queries
rule, layer = KVpopRule(KVpopScorers.mlp(1, 1, 2), 3, 4, 6), SimpleNamespace(positions=pos, scores=sco, seen=40)
test_eq(rule.visible(layer, torch.arange(40)),
        kvpop_visible_reference(pos, sco.clamp_min(torch.finfo(sco.dtype).min), torch.arange(40), 3, 4, 6, 40))


# %% [markdown]
# A long prompt read at once makes that `[B,H,Sq,N]` mask the cost (32k tokens: a billion entries per head), and
# dense attention under it reads every key. FlexAttention takes the same rule as a `mask_mod` that reads the ranks
# `[B,H,N]` and cutoffs `[B,H,Sq]` where it needs them, and skips the blocks the rule hides.

# %%
#| export
@patch_to(KVpopRule)
def block_mask(self, layer, query_positions: Tensor, groups: int = 1) -> BlockMask:
    """FlexAttention BlockMask of `visible` for B x (H*groups) query heads (query head h reads KV head h // groups);
    built compiled on a GPU (no `[Sq, N]` tensor), by a vmap elsewhere."""
    pos, (B, H, N), w = layer.positions, layer.positions.shape, self.window
    qpos, cut = query_positions, self.cutoffs(layer, query_positions)

    def causal(b, h, q_idx, kv_idx): return pos[b, h // groups, kv_idx] <= qpos[q_idx]

    def kvpop(b, h, q_idx, kv_idx):
        hk = h // groups
        hidden = (pos[b, hk, kv_idx] <= qpos[q_idx] - w) & (cut[0][b, hk, kv_idx] > cut[1][b, hk, q_idx])
        return causal(b, h, q_idx, kv_idx) & ~hidden
    return create_block_mask(causal if cut is None else kvpop, B, H * groups, qpos.shape[0], N, device=pos.device,
                             _compile=pos.is_cuda)


# %%
for trial in range(40):
    s_, w_, k_ = (int(x) for x in torch.randint(1, 6, (3,), generator=gen))
    seen = int(torch.randint(s_ + w_, s_ + w_ + 3 * k_, (1,), generator=gen))
    pos = torch.stack([torch.randperm(seen, generator=gen)[:s_ + w_ + k_].sort().values for _ in range(2)])[None]
    sco = torch.randint(0, 3, pos.shape, generator=gen).float()
    rule = KVpopRule(KVpopScorers.mlp(1, 1, 2), s_, w_, k_)
    layer = SimpleNamespace(positions=pos, scores=sco, seen=seen)
    qp, G = torch.arange(seen - 4, seen + 1), 1 + trial % 3
    bm = rule.block_mask(layer, qp, G)
    test_eq(create_mask(bm.mask_mod, 1, 2 * G, 5, pos.shape[-1]), rule.visible(layer, qp).repeat_interleave(G, 1))


# %% [markdown]
# `keep` (the indices that survive an eviction) is `EvictionRule.keep` with the rule's `count`: at the layer's
# next position every head holds the sinks first, then the entries eligible now, then the window and pending
# entries (`TopScoreRule.eligible_span`, with KVpop's `pending_from`), and keeps all but the eligible ones beyond
# the $k$ best, a number the host knows.
#
# Against the reference on decode states and after chunks (sinks, survivors, the window, tied integer priorities):
# the count is the reference's, and `keep` (which outside the per-step path also reads the count and checks the
# claim) returns the reference's entries; for another position than the next the count is unknown (read):

# %%
#| export
@patch_to(KVpopRule)
def count(self, layer, next_position):
    "Entries visible to the layer's next position: all but the eligible beyond the k best; None for another."
    if next_position != getattr(layer, "seen", None) or getattr(layer, "looked_ahead", True): return None
    i0, i1 = self.eligible_span(layer, next_position)
    return layer.positions.shape[-1] - max(0, i1 - i0 - self.k)


# %%
#| export
@patch_to(KVpopRule)
def keep(self, layer, next_position):
    "Indices of the entries visible to `next_position` (`count` of them per head), after the recurrent scorer's check."
    self.check_masked(layer)
    return super(KVpopRule, self).keep(layer, next_position)


# %%
gen = torch.Generator().manual_seed(1)
for _ in range(100):
    s_, w_, k_ = (int(x) for x in torch.randint(1, 6, (3,), generator=gen))
    seen = s_ + w_ + k_ + int(torch.randint(0, 10, (1,), generator=gen))
    extra = int(torch.randint(0, 3, (1,), generator=gen)) * k_  # > 0: after a chunk, more than k + 1 eligible
    heads = [torch.cat([torch.arange(s_), s_ + torch.randperm(seen - w_ - s_, generator=gen)[:k_ + extra].sort().values,
                        torch.arange(seen - w_, seen)]) for _ in range(3)]
    pos = torch.stack(heads)[None]
    sco = torch.randint(0, 3, pos.shape, generator=gen).float()
    layer = SimpleNamespace(positions=pos, scores=sco, seen=seen, looked_ahead=False)
    rule = KVpopRule(KVpopScorers.mlp(1, 3, 2), s_, w_, k_)
    for p in (seen, seen - 1):
        want = kvpop_visible_reference(pos, sco, torch.tensor([p]), s_, w_, k_, seen)[:, :, 0]
        n_want = int(want.sum(-1).flatten()[0])
        test_eq(rule.count(layer, p), n_want if p == seen else None)
        test_eq(rule.keep(layer, p), torch.argsort((~want).to(torch.uint8), dim=-1, stable=True)[..., :n_want])


# %% [markdown]
# ## Delayed-readout (mLSTM) scorers in the rule
#
# A recurrent (mLSTM) scorer with readout delay $\delta$ scores token $u$ only once it has read the
# state after token $u + \delta$ (Eq. 41). Until then the token is *pending*: kept, never ranked. The
# layer keeps the scorer's state, the read features of the pending tokens and the first unread
# position in a `DelayedReadout`; `KVpopRule.scores` steps it over each new chunk and gives the
# tokens read out now their static priorities (in place, for entries already cached).

# %%
#| export
class DelayedReadout:
    "Per-layer state of a recurrent scorer in the cache: mLSTM state, features of unread tokens, first unread position."

    def __init__(self, state, queue: Tensor):
        self.state, self.queue, self.pending_from = state, queue, 0


# %%
st0 = MLSTMScorer(2, 4, delay=1).init_state(1)
ro = DelayedReadout(st0, torch.zeros(1, 2, 0, 4))
test_eq((ro.state is st0, ro.queue.shape, ro.pending_from), (True, (1, 2, 0, 4), 0))  # nothing read yet


# %% [markdown]
# Fed token by token, in prefill chunks or both (into a plain `EvictingLayer` that evicts nothing),
# the tokens read so far get the priorities of the scorer's parallel delayed readout over the
# whole sequence, and the last $\delta$ tokens are still pending (score 0):

# %%
#| export
@patch_to(KVpopRule)
def _recurrent_scores(self, layer, keys, values, positions):
    """Run the layer's mLSTM over new tokens (a step at decode, the chunkwise form over a prefill chunk), read out
    tokens u = t - delay, give them their static priorities."""
    scorer, start, S = self.kvpop.scorers[layer.layer_idx], layer.seen, keys.shape[2]
    if start == 0 or getattr(layer, "kvpop_readout", None) is None:  # a new sequence
        layer.kvpop_readout = DelayedReadout(scorer.init_state(keys.shape[0], keys.device),
                                             scorer.query_feature(keys[:, :, :0], values[:, :, :0]))
    ro = layer.kvpop_readout
    q, kf, vf, log_i, log_f = scorer.features(keys, values)  # once for the chunk
    queue = torch.cat([ro.queue, q], dim=2)  # read features of unread tokens, oldest first
    # steps t = start + j >= delay read token u = t - delay from the state after t (Eq. 41): the last R steps
    first = min(S, max(self.delay - start, 0))
    R = S - first
    if S == 1:  # decode: one step (the chunkwise form would pad it to a whole chunk)
        ro.state = mlstm_step(ro.state, kf[:, :, 0], vf[:, :, 0], log_i[:, :, 0], log_f[:, :, 0])
        raw = scorer.score_head(mlstm_readout(ro.state, queue[:, :, :R], scorer.normalizer, scorer.eps))
    else:  # every state of the chunk at once, continuing the layer's state; steps before `first` read nothing
        q_read = torch.cat([torch.zeros_like(q[:, :, :first]), queue[:, :, :R]], dim=2)
        h, ro.state = mlstm_chunkwise_immediate(q_read, kf, vf, log_i, log_f, scorer.normalizer, scorer.eps,
                                                scorer.chunk_size, ro.state)
        raw = scorer.score_head(h[:, :, first:])
    ro.queue = queue[:, :, R:]
    read = torch.arange(ro.pending_from, ro.pending_from + R, device=keys.device)
    if not R: new = torch.zeros(positions.shape, dtype=torch.float32, device=keys.device)  # pending: never ranked
    else:  # before it is read; the scores of cached entries change in place (buffers)
        prio = self.kvpop.decayed(layer.layer_idx, raw, read.expand(*positions.shape[:2], -1))
        if R == 1:  # a decode step reads one token: an entry is it or not
            layer.scores.copy_(torch.where(layer.positions == read, prio, layer.scores))
            new = torch.where(positions == read, prio, 0.0)
        else:
            old = layer.positions[..., None] == read  # [B,H,N,R]: cached entries read now
            layer.scores.copy_(torch.where(old.any(-1), (old * prio[:, :, None]).sum(-1), layer.scores))
            fresh = positions[..., None] == read
            new = torch.where(fresh.any(-1), (fresh * prio[:, :, None]).sum(-1), 0.0)
    ro.pending_from = max(start + S - self.delay, 0)
    return new


# %%
torch.manual_seed(3)
ms1 = KVpopScorers.mlstm(1, 2, 4, delay=3).double()
for p in ms1.parameters(): p.data.add_(torch.randn_like(p), alpha=0.5)
rule, S1 = KVpopRule(ms1, 1, 3, 4), 14
k1, v1 = torch.randn(1, 2, S1, 4, dtype=torch.float64), torch.randn(1, 2, S1, 4, dtype=torch.float64)
want = ms1.priority(0, k1, v1, torch.arange(S1).expand(1, 2, S1))
for chunks in ([1] * S1, [5, 1, 1, 7], [2, 12]):
    lay = EvictingLayer(rule, 0)
    for c in chunks: lay.arm(); lay.update(k1[:, :, lay.seen:lay.seen + c], v1[:, :, lay.seen:lay.seen + c])
    test_eq(lay.kvpop_readout.pending_from, S1 - 3)
    assert_close(lay.scores[..., :S1 - 3], want[..., :S1 - 3])
    test_eq(lay.scores[..., S1 - 3:], torch.zeros(1, 2, 3))


# %% [markdown]
# ## A layer of preallocated buffers
#
# A `KVpopLayer` stores the entries in buffers of $s + w + k + 1$ slots per head allocated
# once (a budget larger than the sequence gets buffers that grow by doubling with what the sequence holds, up to
# $s + w + k + 1$: a budget of $10^{12}$ must not preallocate terabytes): the new token is written after the kept ones, and the evicted entry is removed by one
# in-place compaction that keeps position order; a prefill chunk larger than the free slots grows
# the buffers, and the next eviction gives the extra slots back. A `KVpopLayer` does not even
# compare positions: every head holds the sinks first and, last, every position after
# $\min(p - w, u_0 - 1)$ ($u_0$ the first unread token of a delayed scorer; these are the window
# and the pending tokens, never evicted), so the eligible entries of query $p$ are the same slice of
# every head (`worst_eligible`), and `KVpopPolicy` masks a decode query with it too.
#
# The capacity by hand: a budget of $2 + 3 + 4$ gets 10 slots at once (or what a larger chunk
# needs); a budget of $10^{12}$ starts at 256 slots and doubles.

# %%
#| export
class KVpopLayer(EvictingLayer):
    """An `EvictingLayer` whose keys, values, positions and scores are views of preallocated buffers of s + w + k + 1
    entries per head (more only while a prefill chunk is in): decode writes the new token in place and removes the
    evicted entry by one in-place compaction, so the cache's memory stays constant once full."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._seat(0, self._capacity(key_states.shape[2]))

    def _capacity(self, need: int, have: int = 0) -> int:
        "Slots for `need` entries: s + w + k + 1 once the sequence can fill them; until then at least twice `have`."
        full = self.rule.budget + 1
        return max(need, min(full, max(2 * have, need, 256)))

    def _seat(self, n: int, capacity: int) -> None:
        "Move the first `n` entries into fresh buffers of `capacity` entries and point the views at them."
        old = (self.keys, self.values, self.positions, self.scores)
        self._buffers = tuple(x.new_empty(x.shape[:2] + (capacity,) + x.shape[3:]) for x in old)
        for b, x in zip(self._buffers, old): b[:, :, :n] = x[:, :, :n]
        self._view(n)

    def _view(self, n: int) -> None:
        self.keys, self.values, self.positions, self.scores = (b[:, :, :n] for b in self._buffers)

    def absorb(self, keys: Tensor, values: Tensor) -> None:
        self.kvpop_masked = True  # no query attends during a hand-over: there is nothing to mask
        super().absorb(keys, values)

    def _apply(self, fn) -> None:
        "Apply `fn` to keys, values, positions and scores, then move them into buffers again."
        super()._apply(fn)
        if self.is_initialized:
            n = self.positions.shape[-1]
            self._seat(n, self._capacity(n, self._buffers[0].shape[2] // 2))


# %%
mlp_rule = KVpopRule(KVpopScorers.mlp(1, 2, 4), 2, 3, 4)
lay = KVpopLayer(mlp_rule, 0)
test_eq([lay._capacity(1), lay._capacity(9), lay._capacity(300, 10)], [10, 10, 300])
big = KVpopLayer(KVpopRule(KVpopScorers.mlp(1, 2, 4), 2, 3, 10**12), 0)
test_eq([big._capacity(5), big._capacity(257, 256), big._capacity(600, 512)], [256, 512, 1024])
lay.lazy_initialization(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
test_eq([tuple(b.shape) for b in lay._buffers], [(1, 2, 10, 4), (1, 2, 10, 4), (1, 2, 10), (1, 2, 10)])
test_eq(lay.keys.shape, (1, 2, 0, 4))


# %% [markdown]
# `update` holds what `EvictingLayer.update` (which concatenates) holds, in views of the buffers;
# a chunk that overflows the free slots grows them:

# %%
#| export
@patch_to(KVpopLayer)
def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
    "Write new entries with positions and scores after the kept ones; return all entries' keys and values."
    pos, sc = self.scored_entries(key_states, value_states)
    s, n = key_states.shape[2], self.positions.shape[-1]
    if n + s > self._buffers[0].shape[2]: self._seat(n, self._capacity(n + s, self._buffers[0].shape[2]))
    for b, x in zip(self._buffers, (key_states, value_states, pos, sc)): b[:, :, n:n + s] = x
    self._view(n + s)
    self.seen += s
    return self.keys, self.values


# %%
fast_l, plain_l = KVpopLayer(mlp_rule, 0), EvictingLayer(mlp_rule, 0)
kx, vx = torch.randn(1, 2, 13, 4), torch.randn(1, 2, 13, 4)
for a, b in ((0, 6), (6, 13)):
    for l in (fast_l, plain_l): l.arm(); l.update(kx[:, :, a:b], vx[:, :, a:b])
    for name in ("keys", "values", "positions", "scores"): test_eq(getattr(fast_l, name), getattr(plain_l, name))
test_eq(fast_l._buffers[0].shape[2], 13)
test_eq(fast_l.keys.untyped_storage().data_ptr(), fast_l._buffers[0].untyped_storage().data_ptr())


# %% [markdown]
# A batch operation of `generate` (beam search: `reorder_cache`, ...) maps the rows of the entries
# and of a recurrent scorer's state and queue alike:

# %%
#| export
@patch_to(KVpopLayer)
def apply_rows(self, fn) -> None:
    "Apply the batch-row map `fn` to the entries and to a recurrent scorer's state and queue (`DelayedReadout`)."
    super(KVpopLayer, self).apply_rows(fn)
    ro = getattr(self, "kvpop_readout", None)
    if ro is not None: ro.state, ro.queue = type(ro.state)(*map(fn, ro.state)), fn(ro.queue)


# %%
lay = KVpopLayer(KVpopRule(ms1, 1, 3, 4), 0)
lay.arm(); lay.update(torch.cat([k1, k1.flip(2)])[:, :, :6], torch.cat([v1, v1.flip(2)])[:, :, :6])
ro = lay.kvpop_readout
before = [x.clone() for x in (lay.keys, lay.scores, ro.state.C, ro.state.m, ro.queue)]
lay.apply_rows(lambda x: x.flip(0))  # swap the two rows
for a, b in zip((lay.keys, lay.scores, ro.state.C, ro.state.m, ro.queue), before): test_eq(a, b.flip(0))
assert not torch.equal(before[2][0], before[2][1])  # the rows differ: the swap is visible

# %% [markdown]
# With $s = 2$, $w = 3$, $k = 4$ and nothing evicted, the last query of 9 tokens has 4 eligible
# entries (None), of 10 tokens 5 (the worst is the one entry `visible` hides), of 11 tokens 6 (False): the rule's
# `TopScoreRule.worst_eligible`, whose eligible span is KVpop's (pending entries are not eligible yet):

# %%
torch.manual_seed(4)
rand_rule = KVpopRule(KVpopScorers.mlp(1, 2, 4), 2, 3, 4)
for p in rand_rule.kvpop.scorers.parameters(): nn.init.normal_(p, std=0.5)
kx, vx = torch.randn(1, 2, 11, 4), torch.randn(1, 2, 11, 4)
for n, want in ((9, None), (10, "index"), (11, False)):
    lay = KVpopLayer(rand_rule, 0); lay.arm(); lay.update(kx[:, :, :n], vx[:, :, :n])
    worst = rand_rule.worst_eligible(lay, n - 1)
    if want != "index": test_eq(worst, want); continue
    hidden = ~rand_rule.visible(lay, torch.tensor([n - 1]))[:, :, 0]
    test_eq(hidden, torch.zeros_like(hidden).scatter(-1, worst, True))


# %% [markdown]
# Evicting after every token or chunk keeps what the plain `EvictingLayer` (which gathers) keeps,
# in the same buffers once full; after a chunk larger than the free slots the extra slots go back:

# %%
#| export
@patch_to(KVpopLayer)
def evict(self, next_position: int | None = None) -> None:
    "Keep the entries the rule shows to `next_position` (default: the next token), compacted in position order."
    if not self.is_initialized: return
    p = self.seen if next_position is None else next_position
    self.looked_ahead = self.looked_ahead or p > self.seen  # then `KVpopRule.count` no longer holds
    worst = self.rule.worst_eligible(self, p) if p == self.seen else False
    if worst is None: return self.rule.check_masked(self)
    if worst is False: idx = self.rule.keep(self, p)
    else:
        self.rule.check_masked(self)
        ar = torch.arange(self.positions.shape[-1] - 1, device=self.device)
        idx = ar + (ar >= worst)
    m, cap = idx.shape[-1], self._buffers[0].shape[2]
    if m == self.positions.shape[-1]: return
    kept = (*gather_kv(*self._buffers[:2], idx), *(b.gather(2, idx) for b in self._buffers[2:]))
    # the kept entries to the front of each buffer (gathered first: no overlap); the views are the new entries
    self.keys, self.values, self.positions, self.scores = (
        b.narrow(2, 0, m).copy_(x) for b, x in zip(self._buffers, kept))
    if cap > self.rule.budget + 1 >= m: self._seat(m, self.rule.budget + 1)  # give back what a prefill chunk needed


# %%
kx, vx = torch.randn(1, 2, 22, 4), torch.randn(1, 2, 22, 4)
for chunks in ([1] * 22, [7, 1, 1, 12, 1]):
    fast_l, plain_l = KVpopLayer(rand_rule, 0), EvictingLayer(rand_rule, 0)
    for c in chunks:
        for l in (fast_l, plain_l):
            l.arm(); l.update(kx[:, :, l.seen:l.seen + c], vx[:, :, l.seen:l.seen + c]); l.evict()
        for name in ("keys", "values", "positions", "scores"): test_eq(getattr(fast_l, name), getattr(plain_l, name))
        test_eq(fast_l.positions.shape[-1], min(fast_l.seen, rand_rule.budget - 1))
    test_eq(fast_l._buffers[0].shape[2], rand_rule.budget + 1)

# %% [markdown]
# Beam search is supported: the batch operations `generate` uses (`reorder_cache`,
# `batch_repeat_interleave`, `batch_select_indices`) move a recurrent scorer's state and queue
# with the entries (`apply_rows`), so decoding on equals a cache fed the moved rows from the
# start (tests/test_kvpop_cache.py).
#
# `KVpopPolicy` runs exact attention over what the rule shows each query. It masks prefill chunks
# itself (`masks_chunks`), with `visible` or, on a GPU, FlexAttention's `block_mask`; at decode the
# layer may hold one eligible entry more than the query sees (the worst of $k + 1$), which the
# policy masks with the index from `worst_eligible` (or with
# the full `visible` mask after a prefill chunk). It also marks the layer as masked: with recurrent
# scorers `keep` refuses to evict after a decode step that no `KVpopPolicy` masked.
#
# A decode query over a layer holding 4, 5 or 6 eligible entries (no mask, the worst hidden, the
# `visible` mask) equals softmax attention written out over what `visible` shows:

# %%
#| export
PREFILL_BACKENDS = ("auto", "mask", "flex")


class KVpopPolicy(DensePolicy):
    """Exact attention over what a `KVpopRule` shows each query, decode included (needed by recurrent scorers);
    a prompt chunk under the rule's mask (`backend='mask'`) or FlexAttention's block mask ('flex'; 'auto': on CUDA)."""
    masks_chunks = True  # the dispatcher leaves a chunk's mask to `prefill`

    def __init__(self, backend: str = "auto"):
        if backend not in PREFILL_BACKENDS:
            raise ValueError(f"backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
        self.backend = backend

    def decode(self, q, k, v, ctx):
        layer = ctx.cache_layer
        if not isinstance(layer, EvictingLayer) or not isinstance(layer.rule, KVpopRule):
            return super().decode(q, k, v, ctx)
        layer.kvpop_masked = True
        worst = layer.rule.worst_eligible(layer, layer.seen - 1) if isinstance(layer, KVpopLayer) else False
        if worst is False: mask = layer.rule.visible(layer, ctx.query_positions)
        elif worst is None: mask = None
        else: mask = ~torch.zeros_like(layer.positions, dtype=torch.bool).scatter(-1, worst, True)[:, :, None]
        return dense_attention(q, k, v, mask, ctx.scale, ctx.dropout)

    def prefill(self, q, k, v, ctx):
        layer = ctx.cache_layer
        if not isinstance(layer, EvictingLayer): return super().prefill(q, k, v, ctx)
        layer.kvpop_masked = True
        if q.shape[2] == 1: return super().prefill(q, k, v, ctx)  # one query sees every kept entry
        flex = self.backend == "flex" or (self.backend == "auto" and q.is_cuda)
        # FlexAttention has no dropout and records no attended counts: the mask then
        if flex and isinstance(layer.rule, KVpopRule) and not ctx.dropout and not measuring():
            G = q.shape[1] // k.shape[1]
            return flex_attention_lse(q, k, v, layer.rule.block_mask(layer, ctx.query_positions, G), scale=ctx.scale,
                                      enable_gqa=G > 1)[0]
        return dense_attention(q, k, v, layer.rule.visible(layer, ctx.query_positions), ctx.scale, ctx.dropout)


# %%
for n in (9, 10, 11):
    lay = KVpopLayer(rand_rule, 0); lay.arm(); lay.update(kx[:, :, :n], vx[:, :, :n])
    qn, qp = torch.randn(1, 2, 1, 4), torch.tensor([n - 1])
    got = KVpopPolicy().decode(qn, lay.keys, lay.values, SimpleNamespace(cache_layer=lay, query_positions=qp,
                                                                          scale=0.5, dropout=0.0))
    att = (0.5 * qn @ lay.keys.transpose(-1, -2)).masked_fill(~rand_rule.visible(lay, qp), float("-inf"))
    assert_close(got, att.softmax(-1) @ lay.values)
    assert lay.kvpop_masked


# %% [markdown]
# `KVpopCache` puts it together: an `EvictingCache` with one `KVpopRule` whose layers are
# `KVpopLayer`s. Pass it as `past_key_values` inside `patch(model, KVpopPolicy())`.

# %%
#| export
class KVpopCache(EvictingCache):
    "A bounded KVpop cache (inside `sparsekv.hf.patch`): per KV head s sinks, w recent, k long-range entries."

    def __init__(self, scorers: KVpopScorers, sink: int, window: int, k: int):
        super().__init__(KVpopRule(scorers, sink, window, k))

    def layer(self, layer_idx: int) -> KVpopLayer:
        "The layer `layer_idx`, created (with all before it) on first use."
        while len(self.layers) <= layer_idx: self.layers.append(KVpopLayer(self.rule, len(self.layers)))
        return self.layers[layer_idx]


# %%
c3 = KVpopCache(KVpopScorers.mlp(3, 2, 4), 2, 3, 4)
test_eq(c3.layer(1).layer_idx, 1)
test_eq([type(l).__name__ for l in c3.layers], ["KVpopLayer"] * 2)  # layers 0 and 1, created on first use
test_eq(c3.rule.budget, 9)


# %% [markdown]
# ## The training-time mask as a policy
#
# The reference is the training-time computation: a full forward in which every layer scores its own
# keys and values, ranks them with `topk_cutoff` on the static priorities and attends under
# `kvpop_mask` (Eq. 26). `KVpopMaskPolicy` does exactly that with no cache (teacher forcing).
#
# Its mask is the KVpop mask by definition (`kvpop_mask_reference`, loops over queries) of the
# scorers' priorities:

# %%
#| export
class KVpopMaskPolicy(MaskPolicy):
    "Teacher-forced KVpop: each layer masks attention by `kvpop_mask` of its scorers' priorities on the sequence."

    def __init__(self, scorers: KVpopScorers, sink: int, window: int, k: int):
        self.k, self.sink, self.window = check_budget(k, sink, window)
        self.scorers = scorers

    def mask(self, q, k, v, ctx):
        if ctx.past_len: raise ValueError("KVpopMaskPolicy masks a whole sequence: call it without a cache")
        with torch.no_grad():
            prio = self.scorers.priority(ctx.layer_idx, k, v, ctx.key_positions)
            rank, cutoff = topk_cutoff(prio, self.k, self.sink, self.window)
        return kvpop_mask(rank, cutoff, self.sink, self.window)


# %%
from sparsekv.kvpop.mask import kvpop_mask_reference

kx, vx, pos16 = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, 8), torch.arange(16).expand(2, 3, 16)
ctx16 = SimpleNamespace(past_len=0, layer_idx=1, key_positions=pos16)
pol = KVpopMaskPolicy(sc, 2, 3, 4)
test_eq(pol.mask(None, kx, vx, ctx16), kvpop_mask_reference(sc.priority(1, kx, vx, pos16), 4, 2, 3))
test_fail(lambda: pol.mask(None, kx, vx, SimpleNamespace(past_len=3)), contains="without a cache")


# %% [markdown]
# ## Decoding with the cache equals the training-time mask
#
# A tiny random Llama (in float64, so rankings cannot flip on rounding) with random MLP scorers and
# decays (non-zero score heads: non-trivial rankings). We teacher-force a sequence under
# `KVpopMaskPolicy` and decode the same sequence token by token with a `KVpopCache`: the logits at
# every position agree, and the cache never holds more than $s + w + k$ entries per head.

# %%
#| export
def random_scorers(model, seed: int = 0, std: float = 0.5, kind: str = "mlp", delay: int = 0) -> KVpopScorers:
    "MLP or mLSTM (`kind`) scorers and decays with random (non-zero) parameters for `model`'s layers, in its dtype."
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        args = cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim
        if kind == "mlp": sc = KVpopScorers.mlp(*args, gamma_min=0.9, gamma_max=0.999)
        elif kind == "mlstm": sc = KVpopScorers.mlstm(*args, delay, gamma_min=0.9, gamma_max=0.999)
        else: raise ValueError(f"kind must be 'mlp' or 'mlstm', got {kind!r}")
        for p in sc.parameters(): p.data.add_(torch.randn_like(p), alpha=std)  # around the scorer's own initialization
    return sc.to(model.dtype)


# %%
model, _ = load_model("tiny-llama", dtype=torch.float64)
scorers = random_scorers(model)
S, s, w, kk = 24, 2, 3, 4
ids = torch.randint(3, model.config.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))
with torch.no_grad(), patch(model, KVpopMaskPolicy(scorers, s, w, kk)): want = model(ids).logits
cache, got, sizes = KVpopCache(scorers, s, w, kk), [], []
with torch.no_grad(), patch(model, DensePolicy()):
    for t in range(S):
        got.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        sizes.append({l.positions.shape[-1] for l in cache.layers})
assert_close(torch.cat(got, 1), want)
test_eq(max(max(x) for x in sizes), s + w + kk - 1)
test_eq(sizes[-1], {s + w + kk - 1})

# %% [markdown]
# The dense model differs from the KVpop one here (the budget does bind), so the agreement is not vacuous:

# %%
with torch.no_grad(): dense = model(ids).logits
assert (dense - want).abs().max() > 1e-3

# %% [markdown]
# Chunked prefill followed by decode gives the same logits, and `generate` works with the cache:
# its greedy tokens are those of the teacher-forced mask recomputed token by token.

# %%
cache = KVpopCache(scorers, s, w, kk)
_, last = chunked_prefill(model, ids[:, :13], 5, cache=cache)
assert_close(last, want[:, 12])
with torch.no_grad(), patch(model, DensePolicy()): nxt = model(ids[:, 13:14], past_key_values=cache).logits
assert_close(nxt[:, 0], want[:, 13])

# %% [markdown]
# `KVpopPolicy` gives the same chunks and a whole prompt read at once the same logits with the rule's mask and with
# FlexAttention's block mask (eager here; compiled on a GPU, where it is the default):

# %%
for backend in PREFILL_BACKENDS:
    _, last = chunked_prefill(model, ids[:, :13], 5, KVpopPolicy(backend), KVpopCache(scorers, s, w, kk))
    assert_close(last, want[:, 12])
    with torch.no_grad(), patch(model, KVpopPolicy(backend)):
        assert_close(model(ids, past_key_values=KVpopCache(scorers, s, w, kk)).logits, want)
test_fail(lambda: KVpopPolicy("sdpa"), contains="backend must be one of ('auto', 'mask', 'flex'), got 'sdpa'")

# %%
prompt = ids[:1, :8]
with torch.no_grad(), patch(model, DensePolicy()):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=KVpopCache(scorers, s, w, kk),
                         max_new_tokens=10, do_sample=False)
seq = prompt
with torch.no_grad(), patch(model, KVpopMaskPolicy(scorers, s, w, kk)):
    for _ in range(10): seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
test_eq(out, seq)

# %% [markdown]
# ## Delayed-readout (mLSTM) scorers
#
# With readout delay $d \le w$ (KVpop uses $d = w$, Eq. 41), token $u$'s raw score reads the mLSTM
# state after token $u + d$: the cache keeps, per layer, the recurrent state (`MLSTMScorer.step`) and
# the read features $\tilde q_u$ of the tokens not read yet, and when token $t$ arrives it steps the
# state and reads out $u = t - d$ (`readout`). Token $u$ becomes eligible at query $u + w \ge u + d$,
# so its score is always known before it is ranked. But the eviction after step $t - 1$ decides
# about the entries visible to $t$, and with $d = w$ token $t - w$ is eligible at $t$ while its score
# arrives only with token $t$. So the rule keeps *pending* tokens (not read yet) through that eviction
# (they are never ranked while pending); once token $t$ has scored them, `visible` decides, and
# `KVpopPolicy` applies `visible` as the mask of decode queries too (the dispatcher masks only
# prefill chunks), so the pending token is hidden if it lost. The cache holds $s + w + k$ entries
# per head between steps, one more than with a stateless scorer (the pending token), and one more
# during a step. Without `KVpopPolicy` the first eviction raises rather than decoding wrongly.
# The same path serves the immediate-readout ablation ($d = 0$): the state must carry over between
# chunks, so any mLSTM scorer is stepped recurrently. Cropping or reordering such a cache is not
# supported (the mLSTM state is not cropped).
#
# The same comparison with the teacher-forced mask, whose priorities come from the *parallel*
# (chunkwise) delayed readout on the whole sequence:

# %%
ms = random_scorers(model, seed=2, kind="mlstm", delay=w)
with torch.no_grad(), patch(model, KVpopMaskPolicy(ms, s, w, kk)): want = model(ids).logits
cache, got, sizes = KVpopCache(ms, s, w, kk), [], []
with torch.no_grad(), patch(model, KVpopPolicy()):
    for t in range(S):
        got.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        sizes.append({l.positions.shape[-1] for l in cache.layers})
assert_close(torch.cat(got, 1), want)
test_eq(max(max(x) for x in sizes), s + w + kk)  # s + w + k + 1 during a step, s + w + k between
assert (dense - want).abs().max() > 1e-3

# %% [markdown]
# Chunked prefill (chunks read out their tokens in order, prune once) and `generate`:

# %%
for backend in PREFILL_BACKENDS:
    _, last = chunked_prefill(model, ids[:, :13], 5, KVpopPolicy(backend), KVpopCache(ms, s, w, kk))
    assert_close(last, want[:, 12])
with torch.no_grad(), patch(model, KVpopPolicy()):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=KVpopCache(ms, s, w, kk),
                         max_new_tokens=10, do_sample=False)
seq = prompt
with torch.no_grad(), patch(model, KVpopMaskPolicy(ms, s, w, kk)):
    for _ in range(10): seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
test_eq(out, seq)
test_fail(lambda: KVpopRule(ms, s, w - 1, kk), contains="delays must be one value <= window")
test_fail(lambda: chunked_prefill(model, ids[:, :4], 4, DensePolicy(), KVpopCache(ms, s, w, kk)),
          contains="only under KVpopPolicy")

# %%
test_fail(lambda: KVpopCache(scorers, 0, 3, 0), contains="k must be an int >= 1")
test_fail(lambda: KVpopRule(scorers, 1, 0, 4), contains="window must be an int >= 1")
test_fail(lambda: KVpopRule(object(), 1, 2, 4), contains="scorers must be a KVpopScorers")


# %% [markdown]
# ## Constant memory
#
# `cache_storages` lists the distinct tensor storages a cache's layers hold, however they nest
# (views of one tensor share its storage; a `DelayedReadout` is looked into):

# %%
#| export
def cache_storages(cache) -> list:
    "The distinct tensor storages a `transformers` cache's layers hold (keys, values, positions, scores, scorer state)."
    storages = {}
    def visit(x):
        if isinstance(x, Tensor): storages[x.untyped_storage().data_ptr()] = x.untyped_storage()
        elif isinstance(x, (tuple, list)): [visit(y) for y in x]
        elif isinstance(x, dict): [visit(y) for y in x.values()]
        elif isinstance(x, DelayedReadout): visit(vars(x))
    for layer in cache.layers: visit(vars(layer))
    return list(storages.values())


# %%
t6, t2 = torch.zeros(6), torch.zeros(2, dtype=torch.float64)
fake = SimpleNamespace(layers=[SimpleNamespace(a=t6, b=[t6[1:], (t2,)], c={"x": t2[:1]}, d=3),
                               SimpleNamespace(e=t6[2:], r=DelayedReadout((torch.zeros(3),), torch.zeros(1)))])
test_eq(sorted(st.nbytes() for st in cache_storages(fake)), [4, 12, 16, 24])


# %% [markdown]
# Decoding with `KVpopLayer`s gives the same logits, kept positions and priorities as the plain
# `EvictingLayer` (which concatenates and gathers), for MLP and mLSTM scorers. Once the cache is full
# the buffers are never reallocated (their storage stays put), and `cache_nbytes`, the bytes of every
# tensor storage the cache holds, is constant:

# %%
#| export
def cache_nbytes(cache) -> int:
    "Bytes of the distinct tensor storages a cache's layers hold (`cache_storages`)."
    return sum(st.nbytes() for st in cache_storages(cache))


# %%
for sc, pol in ((scorers, DensePolicy()), (ms, KVpopPolicy())):
    fast_cache, plain = KVpopCache(sc, s, w, kk), EvictingCache(KVpopRule(sc, s, w, kk))
    ptrs, sizes = [], []
    with torch.no_grad(), patch(model, pol):
        for t in range(S):
            a = model(ids[:, t:t + 1], past_key_values=fast_cache).logits
            assert_close(a, model(ids[:, t:t + 1], past_key_values=plain).logits)
            for lf, lp in zip(fast_cache.layers, plain.layers):
                test_eq(lf.positions, lp.positions); test_eq(lf.scores, lp.scores); test_eq(lf.keys, lp.keys)
            ptrs.append([l._buffers[0].data_ptr() for l in fast_cache.layers]); sizes.append(cache_nbytes(fast_cache))
    test_eq(len({str(x) for x in ptrs}), 1)  # allocated once, at the first token
    test_eq(len(set(sizes[s + w + kk + 1:])), 1)

# %% [markdown]
# `cache_nbytes` of a dense `DynamicCache` is $2 \cdot L \cdot S \cdot H_{kv} \cdot d$ elements ($L$ layers, $S$
# tokens), and a KVpop cache holds $s + w + k + 1$ slots of keys, values (model dtype), positions
# (int64) and priorities (float32) per head and layer, plus, with mLSTM scorers, the state
# ($C$, $n$, $m$) and the read features of the unread tokens:

# %%
cfg = model.config
hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
with torch.no_grad(): dyn = model(ids, use_cache=True).past_key_values
test_eq(cache_nbytes(dyn), 2 * cfg.num_hidden_layers * 2 * S * cfg.num_key_value_heads * hd * 8)
slot = 2 * hd * 8 + 8 + 4  # keys and values in float64, an int64 position and a float32 priority
readout_bytes = sum(cache_nbytes(SimpleNamespace(layers=[l.kvpop_readout])) for l in fast_cache.layers)
test_eq(cache_nbytes(fast_cache) - readout_bytes,
        cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (s + w + kk + 1) * slot)
