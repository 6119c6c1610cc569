# %% [markdown]
# # Evicting caches
#
# > Caches that keep a bounded set of entries per KV head, chosen by an `EvictionRule`, held by an `EvictingLayer`.

# %%
#| default_exp cache

# %%
#| export
from __future__ import annotations

import functools

import torch
from fastcore.basics import patch_to
from torch import Tensor
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from sparsekv.attention import (
    IntArgumentError,
    check_int,
    content_checks,
    evictable,
    gather_index,
    gather_kv,
    is_causal,
    sink_window_visible,
)

# %%
#| hide
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# An evicting cache keeps, per KV head, a bounded set of entries: keys and values with the
# **sequence position** of each entry, `positions [B,Hkv,N]`. Different heads may keep different
# positions; all heads keep the same *number* `N` of entries (the tensors are rectangular).
#
# (The *dispatcher* is the attention function that `sparsekv.hf.patch` registers: it calls the policy,
# then lets the cache evict.)
#
# **Positions.** Keys are cached after RoPE, so an entry keeps the rotation of its true position
# forever and eviction never re-rotates anything. New tokens must be rotated by their true position
# too, not by the number of cached entries: the model takes the position of the next token from
# `get_seq_length()`, so an evicting layer reports the number of tokens *seen*, not kept.
#
# **Masks.** The model builds the mask of a call once, for layer 0, from
# `get_mask_sizes(query_length)`, which returns a key count $L$ and an offset $o$: key slot $j$
# stands for position $o + j$ and is visible to query position $p$ iff $o + j \le p$. After $T$ tokens
# seen, the cache returns its $N$ kept entries followed by the $S_q$ new ones, so we report
# $L = N + S_q$ and $o = T - N$: the kept entries get stand-in positions $T-N, \dots, T-1$, all before
# the first new query (at $T$), hence all visible, and the new ones get their true positions, hence
# causal. The sizes are right for every layer as long as all layers keep the same number of entries
# (the dispatcher checks this). The stand-in positions would misplace a padding mask, so evicting
# caches refuse padded batches.
#
# **Which entries each query sees.** An `EvictionRule` defines, for each query position $p$ and
# entry $t$, whether $p$ attends to $t$: `visible(layer, query_positions) -> [B,Hkv,Sq,N]`. It must
# be monotone (an entry invisible to $p$ is invisible to every $p' > p$: eviction is permanent).
# Then
#
# - `keep(layer, p)` keeps exactly the entries visible to the next position $p$: a decode query
#   sees every kept entry plus itself, so decoding needs no mask at all;
# - within a prefill chunk, a later query may no longer see an entry the first query saw; the
#   dispatcher applies `visible` as a mask over the chunk, so chunked prefill with an evicting cache
#   computes exactly what a per-token decode would.
#
# **When eviction happens.** `update` appends the new entries (and their scores) and returns
# everything; the dispatcher evicts *after* the policy has computed attention, down to what the next
# position sees. So attention-based rules (H2O, TOVA) can update the entries' scores from the
# current attention (a policy reaches the layer via `ctx.cache_layer`) before the eviction that uses
# them; learned rules (KVpop) score entries at insertion with `scores(layer, keys, values, positions)`.
# Between steps the layer holds what the next query will see, minus that query itself (a full sink-window layer:
# plus the one entry the next token overwrites, see `rings`); during a prefill chunk of $C$ tokens it briefly holds
# up to $C$ more entries.
#
# Since only the dispatcher evicts, an evicting cache works only inside `patch`; `update` refuses
# to run otherwise, rather than silently keeping everything. A forward pass interrupted by an
# exception leaves the cache unevicted: start a new one.
#
# **How many entries stay.** `keep` returns a tensor of $M$ entries per head; $M$ is a shape, which the host must
# know. Reading it from the mask (`vis.sum(-1)`) would make every decode step wait for the device in every layer,
# so a rule says it from what the host knows: `count(layer, p)` is the number of entries visible to the layer's next
# position $p$ (None when it cannot tell; then `keep` reads it, and checks that every head keeps as many). A rule
# that changes which entries a single query sees states its `count` too. Outside the per-step path (and inside it
# under `sparsekv.attention.checks`) `keep` also reads the count and checks the rule's claim.
#
# The base rule is causal attention: it keeps every entry at or before the next position, in order, and refuses a
# layer whose heads would keep different numbers of entries (here head 1 holds a position after the query):

# %%
#| export
class EvictionRule:
    "Which cached entries each query sees, hence which a KV head keeps; the base rule keeps everything (dense)."
    observes_attention = False  # True: scores come from the attention entries receive, not from the entries alone
    ring = False  # True: a decode token overwrites the oldest non-sink entry in place (see `EvictingLayer.rings`)

    def scores(self, layer: "EvictingLayer", keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        "Scores `[B,Hkv,S]` (float32) of new entries at insertion; zeros by default."
        return torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)

    def visible(self, layer: "EvictingLayer", query_positions: Tensor) -> Tensor:
        "Boolean `[B,Hkv,Sq,N]`: the layer's entries each query position attends to (monotone in the position)."
        return is_causal(query_positions[:, None], layer.positions[:, :, None, :])

    def count(self, layer: "EvictingLayer", next_position: int) -> int | None:
        "Entries visible to `next_position`, known on the host (None: unknown, `keep` reads it from the device)."
        return None

    def keep(self, layer: "EvictingLayer", next_position: int) -> Tensor:
        "Increasing indices `[B,Hkv,M]` of the entries visible to `next_position` (the same number in every head)."
        M = self.count(layer, next_position)
        quick = M is not None and getattr(layer, "ordered", True) and not content_checks()
        if quick and (idx := self.next_keep(layer, M)) is not None: return idx
        vis = self.visible(layer, torch.tensor([next_position], device=layer.positions.device))[:, :, 0]
        if M is None or content_checks(): M = visible_count(self, vis, M)  # reads the device
        return torch.argsort((~vis).to(torch.uint8), dim=-1, stable=True)[..., :M]

    def next_keep(self, layer: "EvictingLayer", M: int) -> Tensor | None:
        "`keep` for the layer's next position, whose `count` M is known, without `visible` (None: no shortcut)."
        return None


# %%
#| export
def visible_count(rule: EvictionRule, vis: Tensor, claimed: int | None = None) -> int:
    "The entries `vis` [B,Hkv,N] shows in each head, read from the device: one number, `claimed` if not None."
    counts = vis.sum(-1)
    if (counts != counts.flatten()[0]).any():
        raise ValueError(f"{type(rule).__name__} keeps different numbers of entries per head: {counts.tolist()}")
    n = int(counts.flatten()[0])
    if claimed is not None and n != claimed:
        raise ValueError(f"{type(rule).__name__}.count says {claimed} entries stay visible, its rule shows {n}")
    return n


# %%
_dense = EvictionRule()
_two = SimpleNamespace(positions=torch.tensor([[[0, 1, 2], [0, 1, 9]]]))
test_eq(_dense.scores(_two, torch.randn(1, 2, 3, 4), None, _two.positions), torch.zeros(1, 2, 3))
test_eq(_dense.visible(_two, torch.tensor([1, 2]))[0].tolist(),
        [[[True, True, False], [True, True, True]], [[True, True, False], [True, True, False]]])
test_eq(_dense.keep(SimpleNamespace(positions=torch.tensor([[[0, 3, 5]]])), 6).tolist(), [[[0, 1, 2]]])
test_fail(lambda: _dense.keep(_two, 5), contains="keeps different numbers of entries per head: [[3, 2]]")
test_eq(_dense.count(_two, 5), None)
test_fail(lambda: visible_count(_dense, torch.ones(1, 2, 3, dtype=torch.bool), 2), contains="count says 2 entries")


# %% [markdown]
# With $s = 2$, $w = 3$, query 6 sees positions 0, 1 and 4..6; the next position (7) keeps 0, 1, 5, 6:

# %%
#| export
class SinkWindowRule(EvictionRule):
    "StreamingLLM: query `p` sees the first `sink` positions and the `window` most recent ones (itself included)."
    ring = True

    def __init__(self, sink: int, window: int):
        self.sink, self.window = check_int(sink, "sink"), check_int(window, "window", 1)

    def visible(self, layer, query_positions):
        return sink_window_visible(self.sink, self.window)(query_positions[:, None], layer.positions[:, :, None, :])

    def count(self, layer, next_position):
        "min(p, s + w - 1) for the layer's next position p (sinks and window never leave); None for another position."
        if next_position != getattr(layer, "seen", None) or getattr(layer, "looked_ahead", True): return None
        return min(next_position, self.sink + self.window - 1)

    def next_keep(self, layer, M):
        "In position order the first min(s, seen) entries are the sinks and the last M - min(s, seen) the window."
        n, s = layer.positions.shape[-1], min(self.sink, layer.seen)
        ar = torch.arange(M, device=layer.positions.device)
        return (ar + (ar >= s) * (n - M)).expand(*layer.positions.shape[:2], M)


# %%
_sw, _seven = SinkWindowRule(2, 3), SimpleNamespace(positions=torch.arange(7).expand(1, 2, 7))
test_eq(_sw.visible(_seven, torch.tensor([6]))[0, 0, 0].tolist(), [True, True, False, False, True, True, True])
test_eq(_sw.keep(_seven, 7).tolist(), [[[0, 1, 5, 6]] * 2])
test_fail(lambda: SinkWindowRule(2, 0), contains="window")


# %% [markdown]
# ### Sinks, a window and the top-`k` of a score
#
# Many rules keep the sinks, a protected window and the `k` best-scored older entries
# (KVpop Eq. (1), $B = s + w + k$; H2O's heavy hitters; TOVA). With scores fixed at insertion and
# permanent eviction, the kept long-range set at query $p$ is the top-$k$ of the tokens that have
# left the window, $E(p) = \{t : s \le t \le p - w\}$. By induction: if
# $K(p) = \operatorname{top}_k E(p)$, then at $p+1$ one token $x = p+1-w$ joins and
# $K(p+1) = \operatorname{top}_k(K(p) \cup \{x\}) = \operatorname{top}_k(E(p) \cup \{x\}) = \operatorname{top}_k E(p+1)$,
# because any token of $E(p)$ outside $K(p)$ has $k$ better tokens in $K(p)$. Ties go to the earlier
# token. So a query's visible set depends only on its position and the scores, which gives
# `visible` directly; the cache keeps at most $s + w - 1 + k$ entries between steps. The host knows how many
# without looking: at the layer's next position $p$ every head keeps $\min(p, s + w - 1)$ sinks and window
# entries and $\min(k, |E(p)|)$ others (`count`), as long as no eviction looked past the tokens seen.
#
# If a rule changes scores over time (H2O accumulates attention), `visible` uses the current
# scores; a chunk's within-chunk visibility is then an approximation (prefill those rules densely
# or in chunks of 1).
#
# By hand, with $s = 1$, $w = 2$, $k = 2$ and scores 0, 5, 1, 5, 3, 9, 9, 9 at positions 0..7: query 7 sees the sink,
# the window 6, 7 and the best two of $E(7) = \{1..5\}$, position 5 (score 9) and position 1 (score 5, tied with 3:
# the earlier wins); query 5 sees the sink, 4, 5 and the best two of $E(5) = \{1, 2, 3\}$, positions 1 and 3. With
# $k = 0$ it is `SinkWindowRule`; `score_fn` gives the insertion scores:

# %%
#| export
class TopScoreRule(SinkWindowRule):
    "Sinks, a window, and the `k` best-scored entries among those that left the window (ties: the earlier)."
    ring = False

    def __init__(self, sink: int, window: int, k: int, score_fn=None):
        super().__init__(sink, window)
        self.k, self.score_fn = check_int(k, "k"), score_fn

    def scores(self, layer, keys, values, positions):
        "Scores from `score_fn(layer_idx, keys, values, positions)`, or zeros (keep the earliest) without one."
        if self.score_fn is None: return super().scores(layer, keys, values, positions)
        return self.score_fn(layer.layer_idx, keys, values, positions).float()

    def visible(self, layer, query_positions):
        base = super().visible(layer, query_positions)
        if self.k == 0: return base
        eligible = evictable(self.sink, self.window)(query_positions[:, None], layer.positions[:, :, None, :])
        # an eligible -inf score still ranks above every other entry (so `count` holds whatever the scores)
        s = layer.scores.clamp_min(torch.finfo(layer.scores.dtype).min)[:, :, None, :].expand(eligible.shape)
        # entries are in position order: ties -> earlier
        best = s.masked_fill(~eligible, float("-inf")).argsort(dim=-1, descending=True, stable=True)[..., :self.k]
        # KVpop Eq. (1): sinks, window, and the k best of E(p)
        return base | (torch.zeros_like(eligible).scatter(-1, best, True) & eligible)

    def count(self, layer, next_position):
        "The sink-window count plus min(k, |E(p)|), E(p) = {t : s <= t <= p - w} (see above)."
        base = super().count(layer, next_position)
        return None if base is None else base + min(self.k, max(0, next_position - self.window - self.sink + 1))

    def pending_from(self, layer) -> int:
        "The first position whose score is not known yet (never eligible meanwhile): here every entry is scored."
        return layer.seen

    def eligible_span(self, layer, p: int) -> tuple[int, int]:
        """For a query position p >= seen - 1 of the layer: the entries [i0, i1) eligible at p (E(p)), in every head:
        in position order the sinks come before them, the window and the pending entries (positions after
        min(p - w, pending_from - 1)) after."""
        i0 = min(self.sink, layer.seen)
        last = min(p - self.window, self.pending_from(layer) - 1)  # the last eligible position
        return i0, max(i0, layer.positions.shape[-1] - (layer.seen - 1 - last))

    def worst_eligible(self, layer, p: int) -> Tensor | None | bool:
        """For a query position p >= seen - 1: None if at most k entries are eligible, else the index [B,H,1] of the
        worst of k + 1 (lowest score, ties -> the later), or False if more are eligible (after a prefill chunk)."""
        i0, i1 = self.eligible_span(layer, p)
        if i1 - i0 <= self.k: return None
        if i1 - i0 > self.k + 1: return False
        return i1 - 1 - layer.scores[:, :, i0:i1].flip(-1).argmin(-1, keepdim=True)

    def next_keep(self, layer, M):
        "Between decode steps at most one entry leaves: the worst of the k + 1 eligible (no sort)."
        n, worst = layer.positions.shape[-1], self.worst_eligible(layer, layer.seen)
        if worst is False or n - (worst is not None) != M: return None
        ar = torch.arange(M, device=layer.positions.device)
        return ar.expand(*layer.positions.shape[:2], M) if worst is None else ar + (ar >= worst)


# %%
_scored = SimpleNamespace(layer_idx=0, positions=torch.arange(8).expand(1, 1, 8),
                          scores=torch.tensor([[[0.0, 5, 1, 5, 3, 9, 9, 9]]]))
_vis = TopScoreRule(1, 2, 2).visible(_scored, torch.tensor([7, 5]))[0, 0].int().tolist()
test_eq(_vis, [[1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 0, 1, 1, 1, 0, 0]])
_q7 = torch.tensor([7])
test_eq(TopScoreRule(1, 2, 0).visible(_scored, _q7), SinkWindowRule(1, 2).visible(_scored, _q7))
_k8 = torch.randn(1, 1, 8, 4)
test_eq(TopScoreRule(1, 2, 2).scores(_scored, _k8, _k8, _scored.positions), torch.zeros(1, 1, 8))
test_eq(TopScoreRule(1, 2, 2, score_fn=lambda i, k, v, p: p + i).scores(_scored, _k8, _k8, _scored.positions),
        torch.arange(8.0).expand(1, 1, 8))

# %% [markdown]
# `generate` moves batch rows with three cache-layer operations: beam search reorders them
# (`reorder_cache`), and `batch_repeat_interleave` / `batch_select_indices` repeat or pick them.
# `row_map` gives the map each one applies to a tensor whose first dimension is the batch; state a
# policy keeps *beside* a cache layer follows the layer's rows when it is hooked with
# `follow_batch_ops` (otherwise beam search would silently score one beam's keys with another's
# summaries).

# %%
#| export
BATCH_OPS = ("reorder_cache", "batch_repeat_interleave", "batch_select_indices")


def row_map(op: str, arg):
    "The map [B, ...] -> [B', ...] that the cache batch operation `op`(arg) applies to the batch rows of a tensor."
    if op == "reorder_cache": return lambda x: x.index_select(0, arg.to(x.device))
    if op == "batch_repeat_interleave": return lambda x: x.repeat_interleave(arg, dim=0)
    if op == "batch_select_indices": return lambda x: x[arg.to(x.device) if isinstance(arg, Tensor) else arg]
    raise ValueError(f"op must be one of {BATCH_OPS}, got {op!r}")


# %%
_rows = torch.tensor([10, 11, 12])
test_eq(row_map("reorder_cache", torch.tensor([2, 0, 0]))(_rows).tolist(), [12, 10, 10])
test_eq(row_map("batch_repeat_interleave", 2)(_rows).tolist(), [10, 10, 11, 11, 12, 12])
test_eq(row_map("batch_select_indices", torch.tensor([1, 2]))(_rows).tolist(), [11, 12])
test_eq(row_map("batch_select_indices", [0, 2])(_rows).tolist(), [10, 12])
test_fail(lambda: row_map("crop", 1), contains="op must be one of")


# %% [markdown]
# A hooked `DynamicLayer` still moves its own rows, then calls each hook with the same map:

# %%
#| export
def hooked_layer_class(cls: type) -> type:
    "The subclass of cache layer class `cls` whose batch operations then call every `row_hooks` entry with the row map."
    class Hooked(cls):
        def _moved(self, op: str, arg) -> None:
            for hook in list(self.row_hooks.values()): hook(row_map(op, arg))

        def reorder_cache(self, beam_idx):
            super().reorder_cache(beam_idx)
            self._moved("reorder_cache", beam_idx)

        def batch_repeat_interleave(self, repeats):
            super().batch_repeat_interleave(repeats)
            self._moved("batch_repeat_interleave", repeats)

        def batch_select_indices(self, indices):
            super().batch_select_indices(indices)
            self._moved("batch_select_indices", indices)

    Hooked.__name__ = Hooked.__qualname__ = f"Hooked{cls.__name__}"
    return Hooked


# %%
_hooked = hooked_layer_class(DynamicLayer)()
_hooked.row_hooks, _seen_ops = {0: lambda fn: _seen_ops.append(fn(_rows).tolist())}, []
_hooked.update(torch.arange(3.0).view(3, 1, 1, 1), torch.zeros(3, 1, 1, 1))
_hooked.reorder_cache(torch.tensor([2, 0, 0]))
_hooked.batch_repeat_interleave(2)
test_eq(_hooked.keys.flatten().tolist(), [2, 2, 0, 0, 0, 0])
test_eq(_seen_ops, [[12, 10, 10], [10, 10, 11, 11, 12, 12]])
test_eq((type(_hooked).__name__, isinstance(_hooked, DynamicLayer)), ("HookedDynamicLayer", True))

# %% [markdown]
# Check: a `DynamicLayer` hooked to a side tensor keeps it in step with its keys under all three;
# registering again for the same owner replaces the hook (no double move), and a deep copy of the
# layer moves its own rows, not the original's.

# %%
#| export
_HOOKED = {}  # layer class -> its hooked subclass


def follow_batch_ops(layer, owner: int, apply_rows) -> None:
    """After each batch operation (BATCH_OPS) of the cache `layer`, call `apply_rows(row_map(op, arg))`; one hook per
    `owner` (an int id: a copied layer keeps its hooks, and re-registering replaces them)."""
    if not hasattr(layer, "row_hooks"):
        cls = type(layer)
        if cls not in _HOOKED: _HOOKED[cls] = hooked_layer_class(cls)
        layer.__class__, layer.row_hooks = _HOOKED[cls], {}  # the same layout: the class can be swapped
    layer.row_hooks[owner] = apply_rows


# %%
import copy

_lay, _side = DynamicLayer(), {}
_k = torch.randn(3, 2, 4, 8)
_lay.update(_k, _k)
_side["x"] = _k.clone()
for _ in range(2): follow_batch_ops(_lay, 0, lambda fn: _side.update(x=fn(_side["x"])))
_lay.reorder_cache(torch.tensor([2, 0, 0]))
_lay.batch_repeat_interleave(2)
_lay.batch_select_indices(torch.tensor([1, 4]))
test_eq(_side["x"], _lay.keys)
test_eq(_lay.keys, _k[[2, 0]])
assert isinstance(_lay, DynamicLayer)
_copy = copy.deepcopy(_lay)
_copy.reorder_cache(torch.tensor([1, 1]))
test_eq(_copy.keys, _k[[0, 0]])
test_eq(_lay.keys, _k[[2, 0]])


# %% [markdown]
# ## The layer contract of `transformers`
#
# A cache layer answers four calls of the model and of `generate`: `update(keys, values)` (the model
# passes nothing else: positions are the layer's own business), `get_seq_length()` (tokens seen: the
# model derives default positions from it), `get_mask_sizes(query_length)` (the key count and offset
# of the causal mask of the next call of `query_length` tokens) and `crop(tokens_to_remove)`, which
# since transformers 5.3 takes the number of tokens to drop as a negative int (0 drops nothing) and
# refuses a positive one, as an absolute length was before. Two helpers read those arguments for every
# layer here. The peer environment (kvpress's transformers 5.2, see the README) still passes
# `get_mask_sizes` the tensor of the new tokens' cache positions, so `query_count` reads its length.

# %%
#| export
def query_count(query_length: int | Tensor) -> int:
    "New tokens of a call from `get_mask_sizes`' argument: an int, or (transformers 5.2) their cache positions [Sq]."
    if isinstance(query_length, Tensor): return query_length.shape[0]
    return check_int(query_length, "query_length", 0)


# %%
test_eq((query_count(3), query_count(torch.arange(5, 9))), (3, 4))
test_fail(lambda: query_count(1.5), contains="query_length")


# %%
#| export
def tokens_to_lose(tokens_to_remove: int, seen: int) -> int:
    "How many of `seen` tokens `crop(tokens_to_remove)` drops: `-tokens_to_remove`, at most `seen`."
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
        raise IntArgumentError(f"tokens_to_remove must be an int <= 0 (minus the number of last tokens to drop, as "
                               f"transformers crops), got {tokens_to_remove!r}")
    return min(-tokens_to_remove, seen)


# %%
test_eq([tokens_to_lose(n, 4) for n in (0, -1, -4, -9)], [0, 1, 4, 4])
test_fail(lambda: tokens_to_lose(2, 4), contains="tokens_to_remove must be an int <= 0")


# %% [markdown]
# The layer stores keys, values, positions and scores; `update` appends, `evict` gathers the kept
# entries (all four tensors), `crop` undoes the last tokens as long as none of them was
# evicted, and the batch operations `generate` uses (beam search, `batch_select_indices`) carry
# positions and scores along. The class holds the state and the sizes the model asks for; the
# methods that change the entries follow, each with its check.
#
# A fresh layer has seen nothing; `lazy_initialization` gives empty entries of the states' batch and heads, and
# `reset` empties a layer that holds some:

# %%
#| export
class EvictingLayer(DynamicLayer):
    "A cache layer keeping per KV head the entries its `EvictionRule` still shows, with their positions and scores."
    is_compileable = True  # its decode step compiles as one graph (see `OptInCompile`)

    def __init__(self, rule: EvictionRule, layer_idx: int):
        super().__init__()
        self.rule, self.layer_idx = rule, layer_idx
        self.positions = self.scores = None
        # looked_ahead: an eviction for a position past the next one (the rule's `count` no longer holds)
        self.seen, self.armed, self.looked_ahead = 0, False, False
        self.ordered = True  # entries in position order (False once a ring write took the oldest one's place)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.positions = torch.zeros(key_states.shape[:2] + (0,), dtype=torch.long, device=self.device)
        self.scores = torch.zeros(key_states.shape[:2] + (0,), dtype=torch.float32, device=self.device)
        self.is_initialized = True


# %%
_fresh = EvictingLayer(SinkWindowRule(2, 3), 0)
test_eq((_fresh.armed, _fresh.looked_ahead), (False, False))
_fresh.lazy_initialization(torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))
test_eq((_fresh.keys.shape, _fresh.positions.shape, _fresh.scores.dtype), ((2, 3, 0, 4), (2, 3, 0), torch.float32))


# %%
#| export
@patch_to(EvictingLayer)
def arm(self) -> None:
    "Allow the next `update` (called by `patch`'s hook: the dispatcher will evict after attention)."
    self.armed = True


# %%
_fresh.arm()
test_eq(_fresh.armed, True)


# %%
#| export
@patch_to(EvictingLayer)
def get_seq_length(self) -> int:
    "Number of tokens seen (the next token's position), not the number kept."
    return self.seen


# %%
test_eq(_fresh.get_seq_length(), 0)


# %%
#| export
@patch_to(EvictingLayer)
def get_max_length(self) -> int:
    "-1: no maximum (the budget bounds what is kept, not the tokens seen)."
    return -1


# %%
test_eq(_fresh.get_max_length(), -1)


# %%
#| export
@patch_to(EvictingLayer)
def _apply(self, fn) -> None:
    "Apply `fn` to keys, values, positions and scores."
    if self.is_initialized:
        self.keys, self.values, self.positions, self.scores = map(
            fn, (self.keys, self.values, self.positions, self.scores))


# %%
_fresh._apply(lambda x: torch.cat([x, x.new_zeros(*x.shape[:2], 4, *x.shape[3:])], dim=2))
_fresh.seen = 4
test_eq((_fresh.keys.shape[2], _fresh.scores.shape[2]), (4, 4))


# %%
#| export
@patch_to(EvictingLayer)
def reset(self) -> None:
    self._apply(lambda x: x[:, :, :0])
    self.seen, self.looked_ahead, self.ordered = 0, False, True


# %%
_fresh.reset()
test_eq((_fresh.seen, _fresh.keys.shape[2], _fresh.positions.shape[2]), (0, 0, 0))


# %% [markdown]
# **A ring for the sink-window rule.** When a sink-window layer holds $s + w$ entries (the sinks and the $w$ latest
# positions), the next token's query no longer sees exactly one of them, the oldest non-sink entry, and sees
# everything else. So at decode the new entry can take that entry's place in the buffers, in place: no append, no
# compaction, the same shapes every step (what a captured decode needs), and nothing to evict after attention
# (`evict` leaves the one stale entry for the next token to overwrite). The entries are then no longer in position
# order (`ordered`), which `visible` does not need; a prefill chunk after ring writes drops the stale entry first
# (its peak stays $s + w - 1 + C$) and its eviction puts the entries back in position order.
# `rings(q)` says, on the host, whether a call of `q` tokens writes in place:

# %%
#| export
@patch_to(EvictingLayer)
def rings(self, q: int) -> bool:
    "Whether a call of `q` new tokens overwrites the oldest non-sink entry in place (a full sink-window layer)."
    r = self.rule
    return (q == 1 and r.ring and self.is_initialized and not self.looked_ahead
            and self.positions.shape[-1] == r.sink + r.window)


# %%
#| export
@patch_to(EvictingLayer)
def overwrite_oldest(self, keys: Tensor, values: Tensor, positions: Tensor, scores: Tensor) -> None:
    "Write one new entry per head in place of the oldest entry after the sinks (found on the device, no read)."
    slot = self.positions[:, :, self.rule.sink:].argmin(-1, keepdim=True) + self.rule.sink  # [B,H,1]
    wide = {}  # the index of entries of each width: keys and values of one head dim share theirs
    for x, new in zip((self.keys, self.values, self.positions, self.scores), (keys, values, positions, scores)):
        if x.ndim == 4 and x.shape[-1] not in wide: wide[x.shape[-1]] = gather_index(slot, x.shape[-1])
        x.scatter_(2, slot if x.ndim == 3 else wide[x.shape[-1]], new.to(x.dtype))
    self.ordered = False


# %%
_ring = EvictingLayer(SinkWindowRule(1, 2), 0)
_ring.lazy_initialization(torch.randn(1, 2, 1, 2), torch.randn(1, 2, 1, 2))
_ring.seen, _ring.positions = 3, torch.tensor([[[0, 1, 2], [0, 1, 2]]])
_ring.keys = _ring.values = torch.zeros(1, 2, 3, 2)
_ring.scores = torch.zeros(1, 2, 3)
test_eq((_ring.rings(1), _ring.rings(2)), (True, False))
_ring.overwrite_oldest(torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2), torch.full((1, 2, 1), 3), torch.zeros(1, 2, 1))
test_eq((_ring.positions[0, 0].tolist(), _ring.keys[0, 0, :, 0].tolist(), _ring.ordered), ([0, 3, 2], [0, 1, 0], False))
_ring.positions = torch.tensor([[[0, 2, 3], [0, 3, 2]]])  # heads may hold their slots in different orders
_ring.overwrite_oldest(torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2), torch.full((1, 2, 1), 4), torch.zeros(1, 2, 1))
test_eq(_ring.positions[0].tolist(), [[0, 4, 3], [0, 3, 4]])
_ring.values = torch.zeros(1, 2, 3, 3)  # values wider than the keys: each gets its own index
_ring.overwrite_oldest(torch.ones(1, 2, 1, 2), torch.full((1, 2, 1, 3), 2.0), torch.full((1, 2, 1), 5),
                       torch.zeros(1, 2, 1))
test_eq((_ring.positions[0].tolist(), _ring.values[0, :, :, 2].tolist()),
        ([[0, 4, 5], [0, 5, 4]], [[0, 0, 2], [0, 2, 0]]))
test_eq((EvictingLayer(TopScoreRule(1, 2, 1), 0).rings(1), EvictingLayer(SinkWindowRule(1, 2), 0).rings(1)),
        (False, False))


# %% [markdown]
# A first call of 4 tokens gets the plain causal mask (4 keys, offset 0); after 9 tokens seen with 4 kept, a call of
# 2 tokens gets 4 + 2 keys at offset 9 - 4 = 5:

# %%
#| export
@patch_to(EvictingLayer)
def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
    """(kept entries + `query_length` new tokens, offset) so that the model's causal mask shows every kept entry (a
    ring write replaces an entry: the kept entries alone; a chunk drops the ring's stale entry first)."""
    n, q = self.positions.shape[-1] if self.is_initialized else 0, query_count(query_length)
    if self.rings(q): return n, self.seen - n + 1
    n -= self.rings(1)  # see `update`
    return n + q, self.seen - n


# %%
_sizes = EvictingLayer(SinkWindowRule(2, 3), 0)
test_eq((_sizes.get_mask_sizes(4), _sizes.get_mask_sizes(torch.arange(4))), ((4, 0), (4, 0)))
_sizes.lazy_initialization(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
_sizes.positions, _sizes.seen = torch.tensor([[[0, 1, 7, 8]]]), 9
test_eq(_sizes.get_mask_sizes(2), (6, 5))


# %% [markdown]
# An armed layer that has seen 3 tokens gives the next 2 entries positions 3, 4 in every head and the rule's scores,
# then disarms; a rule whose scores have the wrong shape is refused:

# %%
#| export
@patch_to(EvictingLayer)
def scored_entries(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
    "Positions [B,H,s] and rule scores of the entries an armed `update` gets (checks the call, disarms the layer)."
    if not self.armed:
        raise RuntimeError("an EvictingCache works only inside sparsekv.hf.patch(model, policy), which evicts "
                           "after attention")
    self.armed = False
    if not self.is_initialized: self.lazy_initialization(key_states, value_states)
    s = key_states.shape[2]
    pos = torch.arange(self.seen, self.seen + s, device=self.device).expand(*key_states.shape[:2], s)
    sc = self.rule.scores(self, key_states, value_states, pos)
    # the values only outside the per-step path (a read; see sparsekv.attention.checks)
    if sc.shape != pos.shape or (content_checks() and not torch.isfinite(sc).all()):
        raise ValueError(f"{type(self.rule).__name__}.scores must return finite scores of shape "
                         f"{tuple(pos.shape)}, got {tuple(sc.shape)}")
    return pos, sc


# %%
_lay = EvictingLayer(TopScoreRule(1, 2, 1, score_fn=lambda i, k, v, p: 2.0 * p), 0)
_lay.seen = 3
_lay.arm()
_pos, _sc = _lay.scored_entries(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
test_eq((_pos.tolist(), _sc.tolist(), _lay.armed), ([[[3, 4]] * 2], [[[6.0, 8.0]] * 2], False))
test_fail(lambda: _lay.scored_entries(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)),
          contains="only inside sparsekv.hf.patch")
_lay.rule.score_fn = lambda i, k, v, p: p[..., :1].float()
_lay.arm()
test_fail(lambda: _lay.scored_entries(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)),
          contains="must return finite scores of shape (1, 2, 2), got (1, 2, 1)")


# %% [markdown]
# Two armed updates append: 3 then 2 entries at positions 0..4, with the rule's scores, and the returned keys are all
# five:

# %%
#| export
@patch_to(EvictingLayer)
def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
    "Append the new entries (positions: the next ones seen) with their scores; return all entries' keys and values."
    pos, sc = self.scored_entries(key_states, value_states)
    s = key_states.shape[2]
    if self.rings(s): self.overwrite_oldest(key_states, value_states, pos, sc)
    else:
        if self.rings(1): self.compact(self.seen)  # a chunk after ring writes: the stale entry goes first
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.positions = torch.cat([self.positions, pos], dim=-1)
        self.scores = torch.cat([self.scores, sc.to(self.scores.dtype)], dim=-1)
    self.seen += s
    return self.keys, self.values


# %%
_lay = EvictingLayer(TopScoreRule(1, 2, 1, score_fn=lambda i, k, v, p: -p), 0)
_k5 = torch.randn(1, 2, 5, 4)
for _part in (_k5[:, :, :3], _k5[:, :, 3:]):
    _lay.arm()
    _keys, _values = _lay.update(_part, 2 * _part)
test_eq((_keys, _values), (_k5, 2 * _k5))
test_eq((_lay.positions[0, 1].tolist(), _lay.scores[0, 1].tolist(), _lay.seen),
        ([0, 1, 2, 3, 4], [0, -1, -2, -3, -4], 5))


# %% [markdown]
# A layer on its own (arming by hand what `patch` does before each call): after 7 tokens, a
# sink+window rule with $s=2$, $w=3$ shows query 6 the sinks and positions 4..6, and keeps for
# the next query (7) the sinks and positions 5, 6; `get_mask_sizes` then announces those 4
# entries plus the new token, at stand-in offset 3:

# %%
#| export
@patch_to(EvictingLayer)
def evict(self, next_position: int | None = None) -> None:
    "Keep only the entries the rule shows to `next_position` (default: the next token; a full ring keeps one more)."
    if not self.is_initialized: return
    p = self.seen if next_position is None else next_position
    self.looked_ahead = self.looked_ahead or p > self.seen
    if p == self.seen and self.rings(1): return  # the one entry p no longer sees is the next token's slot
    self.compact(p)


@patch_to(EvictingLayer)
def compact(self, p: int) -> None:
    "Keep exactly the entries the rule shows to position `p`, in position order."
    idx = self.rule.keep(self, p)
    if not self.ordered:  # after ring writes: back in position order
        idx, self.ordered = idx.gather(-1, self.positions.gather(-1, idx).argsort(-1)), True
    elif idx.shape[-1] == self.positions.shape[-1]: return
    self.keys, self.values = gather_kv(self.keys, self.values, idx)
    self.positions, self.scores = self.positions.gather(2, idx), self.scores.gather(2, idx)


# %%
lay = EvictingLayer(SinkWindowRule(2, 3), 0)
lay.arm()
k7 = torch.randn(1, 2, 7, 16)
lay.update(k7, k7)
test_eq(lay.rule.visible(lay, torch.tensor([6]))[0, 0, 0].tolist(), [True, True, False, False, True, True, True])
lay.evict()
test_eq(lay.positions[0].tolist(), [[0, 1, 5, 6]] * 2)
assert_close(lay.keys, k7[:, :, [0, 1, 5, 6]])
test_eq((lay.get_seq_length(), lay.get_mask_sizes(1)), (7, (5, 3)))
test_fail(lambda: lay.update(k7, k7), contains="only inside sparsekv.hf.patch")

# %% [markdown]
# The counts the rules state agree with the device's, after prefill chunks of every size and decode steps, for
# sink-window and top-score rules (random scores with ties, and -inf scores, which only the per-step path lets
# through): each `keep` below reads the count and checks the claim (outside the per-step path). Inside it, eviction
# reads nothing back, and a step needs no `visible` mask and no sort: `next_keep` knows the kept entries' places in
# position order (sink-window), or evicts the worst of the $k + 1$ eligible entries when one leaves (top-score; a
# prefill chunk that evicts more takes the sort). It keeps what `visible` keeps, checked at every step below. An
# eviction past the next position makes the count unknown (then read):

# %%
from sparsekv.attention import gather_keys, hot_path
from sparsekv.syncs import HostSyncs

_g = torch.Generator().manual_seed(0)
for _rule in (SinkWindowRule(2, 3), SinkWindowRule(0, 1), TopScoreRule(1, 2, 3), TopScoreRule(0, 4, 2),
              TopScoreRule(2, 1, 5, score_fn=lambda i, k, v, p: k[..., 0].round()),
              TopScoreRule(1, 2, 2, score_fn=lambda i, k, v, p: torch.where(k[..., 0] > 0, float("-inf"), 0.0))):
    _shortcuts = 0
    for _chunks in ([1] * 12, [5, 1, 1, 4, 1, 1, 1], [12], [3, 3, 3, 1, 1, 1]):
        _l, _seen_counts = EvictingLayer(_rule, 0), []
        for _c in _chunks:
            _l.arm()
            with hot_path():  # as in a step: -inf scores are not refused there
                _l.update(torch.randn(2, 3, _c, 4, generator=_g), torch.randn(2, 3, _c, 4, generator=_g))
            _seen_counts.append(_rule.count(_l, _l.seen))
            _quick = _rule.next_keep(_l, _seen_counts[-1]) if _l.ordered else None  # (a ring is out of order)
            if _quick is not None:  # the step's shortcut: what visible keeps
                test_eq(_quick, _rule.keep(_l, _l.seen))
                _shortcuts += 1
            _l.evict()  # keep() checks the claimed count against the device's
        assert None not in _seen_counts
        _l.arm()
        with HostSyncs() as _rec, hot_path():  # a decode step's update and eviction
            _l.update(torch.randn(2, 3, 1, 4, generator=_g), torch.randn(2, 3, 1, 4, generator=_g))
            _l.evict()
        test_eq(_rec.total, 0)
    assert _shortcuts >= (4 if _rule.ring else 12), (_rule, _shortcuts)  # a ring writes in place once full
_l.evict(_l.seen + 3)
assert _l.looked_ahead and _rule.count(_l, _l.seen) is None

# %% [markdown]
# Decoding token by token, a sink-window layer holds after each step the sinks and the latest $w$ positions (the
# oldest of them stale, overwritten by the next token), in the same buffers from its first ring write on; its mask
# sizes cover the entries alone; a prefill chunk after it evicts back to position order:

# %%
_r, _ks = EvictingLayer(SinkWindowRule(2, 3), 0), torch.randn(1, 2, 13, 4)
for _t in range(10):
    _r.arm()
    _r.update(_ks[:, :, _t:_t + 1], -_ks[:, :, _t:_t + 1])
    _r.evict()
    test_eq(sorted(_r.positions[0, 1].tolist()), sorted({*range(min(2, _t + 1)), *range(2, _t + 1)[-3:]}))
    test_eq((_r.keys, _r.values), (gather_keys(_ks, _r.positions), -gather_keys(_ks, _r.positions)))
    if _t == 4: _buffer = _r.keys.data_ptr()
    if _t > 4: test_eq(_r.keys.data_ptr(), _buffer)
test_eq((_r.ordered, _r.get_mask_sizes(1), _r.get_mask_sizes(2)), (False, (5, 6), (6, 6)))
_r.arm()
test_eq(_r.update(_ks[:, :, 10:13], -_ks[:, :, 10:13])[0].shape[2], 2 + 2 + 3)  # stale entry dropped: s + w - 1 + 3
_r.evict()
test_eq((_r.positions[0].tolist(), _r.ordered), ([[0, 1, 11, 12]] * 2, True))
test_eq(_r.keys, gather_keys(_ks, _r.positions))


# %% [markdown]
# Absorbing the 7 entries above keeps what the prefill and eviction kept; a layer that has seen tokens, or whose rule
# scores by attention, refuses:

# %%
#| export
@patch_to(EvictingLayer)
def absorb(self, keys: Tensor, values: Tensor) -> None:
    """Take over a prompt's entries `[B,Hkv,S,D]` (positions 0..S-1) cached elsewhere, as one prefill of this empty
    layer, and keep what the rule shows the next token."""
    if self.seen: raise ValueError(f"absorb fills an empty layer; this one has seen {self.seen} tokens")
    if self.rule.observes_attention:
        raise ValueError(f"{type(self.rule).__name__} scores entries by the attention they receive: handing a "
                         "prompt over replays no attention")
    self.arm()
    self.update(keys, values)
    self.evict()


# %%
_abs = EvictingLayer(SinkWindowRule(2, 3), 0)
_abs.absorb(k7, k7)
test_eq((_abs.positions, _abs.keys, _abs.seen, _abs.armed), (lay.positions, lay.keys, 7, False))
test_fail(lambda: _abs.absorb(k7, k7), contains="this one has seen 7 tokens")
_attn_rule = SinkWindowRule(2, 3)
_attn_rule.observes_attention = True
test_fail(lambda: EvictingLayer(_attn_rule, 0).absorb(k7, k7), contains="replays no attention")


# %% [markdown]
# Before any eviction, cropping 3 of 5 tokens keeps positions 0, 1 (and `seen` follows); after an eviction, cropping
# a token fails (the layer above kept 0, 1, 5, 6 of 7: positions 2..4 are gone):

# %%
#| export
@patch_to(EvictingLayer)
def crop(self, tokens_to_remove: int) -> None:
    "Forget the last `-tokens_to_remove` tokens seen (transformers' crop); fails if one of them was evicted."
    max_length = self.seen - tokens_to_lose(tokens_to_remove, self.seen)
    if self.seen == max_length: return
    if self.is_initialized and ((self.positions < max_length).sum(-1) != max_length).any():
        raise ValueError(f"cannot crop to {max_length} tokens: some of them were already evicted")
    self._apply(lambda x: x[:, :, :max_length])
    self.seen = max_length


# %%
_crop = EvictingLayer(SinkWindowRule(1, 2), 0)
_crop.arm()
_crop.update(_k5, _k5)
_crop.crop(-3)
test_eq((_crop.positions[0, 0].tolist(), _crop.keys, _crop.seen), ([0, 1], _k5[:, :, :2], 2))
_crop.crop(0)
test_eq(_crop.seen, 2)
test_fail(lambda: _crop.crop(1), contains="tokens_to_remove must be an int <= 0")
test_fail(lambda: lay.crop(-1), contains="cannot crop to 6 tokens: some of them were already evicted")
test_eq((lay.positions[0, 0].tolist(), lay.seen), ([0, 1, 5, 6], 7))


# %% [markdown]
# The batch operations move positions and scores with the keys: two rows with different scores, reordered, repeated
# and selected, keep each row's entries together:

# %%
#| export
@patch_to(EvictingLayer)
def apply_rows(self, fn) -> None:
    "Apply the batch-row map `fn` (see `row_map`) to all per-row state (here: keys, values, positions, scores)."
    self._apply(fn)


# %%
_rows2 = EvictingLayer(TopScoreRule(1, 1, 1, score_fn=lambda i, k, v, p: k[..., 0]), 0)
_rows2.arm()
_k2 = torch.randn(2, 1, 4, 3)
_rows2.update(_k2, _k2)
_rows2.evict()
_before = [(_rows2.keys[b], _rows2.positions[b], _rows2.scores[b]) for b in range(2)]
_rows2.apply_rows(lambda x: x * 1)
test_eq([(_rows2.keys[b], _rows2.positions[b], _rows2.scores[b]) for b in range(2)], _before)


# %%
#| export
@patch_to(EvictingLayer)
def reorder_cache(self, beam_idx: Tensor) -> None:
    self.apply_rows(row_map("reorder_cache", beam_idx))


# %%
_rows2.reorder_cache(torch.tensor([1, 0]))
test_eq(_rows2.positions[0], _before[1][1])


# %%
#| export
@patch_to(EvictingLayer)
def batch_repeat_interleave(self, repeats: int) -> None:
    self.apply_rows(row_map("batch_repeat_interleave", repeats))


# %%
_rows2.batch_repeat_interleave(2)
test_eq(_rows2.keys.shape[0], 4)


# %%
#| export
@patch_to(EvictingLayer)
def batch_select_indices(self, indices: Tensor) -> None:
    self.apply_rows(row_map("batch_select_indices", indices))


# %%
_rows2.batch_select_indices(torch.tensor([0, 3]))
for b, src in ((0, 1), (1, 0)):
    test_eq((_rows2.keys[b], _rows2.positions[b], _rows2.scores[b]), _before[src])
assert_close(_rows2.scores, _rows2.keys[..., 0])


# %% [markdown]
# Layers appear as they are used, all sharing the rule; an update reaches its layer (which refuses it outside `patch`):

# %% [markdown]
# **Compiled decoding, when asked.** `transformers`' `generate` compiles the decode steps of a cache whose
# `is_compileable` is true (on a GPU on its own, elsewhere when its `compile_config` says so). Our caches change
# shape every step (a growing buffer's filled view, a budget of entries chosen anew), so their steps compile with
# dynamic shapes, as one graph for every length (`sparsekv.syncs`), and only when asked: `OptInCompile` makes a
# cache compileable when its `compiled_decode` is set (`Method.generate(compile=...)` sets it) and every layer's
# step compiles (the layer classes' `is_compileable`; `layers_compile` is False for a cache whose own step reads a
# device value).

# %%
#| export
class OptInCompile:
    "Mixin of our caches: `is_compileable` (transformers compiles the decode steps) only when `compiled_decode`."
    compiled_decode = False  # set to compile the decode steps (see `Method.generate`)
    layers_compile = True  # False where the cache's own step reads a device value on the host

    @property
    def is_compileable(self) -> bool:
        return self.compiled_decode and self.layers_compile and all(
            getattr(lay, "is_compileable", False) for lay in self.layers)


# %%
#| export
class EvictingCache(OptInCompile, Cache):
    "A `transformers` cache of `EvictingLayer`s (made as layers are used) sharing one `EvictionRule`; use in `patch`."

    def __init__(self, rule: EvictionRule):
        if not isinstance(rule, EvictionRule):
            raise TypeError(f"rule must be an EvictionRule, got {type(rule).__name__}")
        super().__init__(layers=[])
        self.rule = rule

    def layer(self, layer_idx: int) -> EvictingLayer:
        "The layer `layer_idx`, created (with all before it) on first use."
        while len(self.layers) <= layer_idx: self.layers.append(EvictingLayer(self.rule, len(self.layers)))
        return self.layers[layer_idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layer(layer_idx).update(key_states, value_states)


# %%
_cache = EvictingCache(TopScoreRule(1, 2, 1))
test_eq([(lay.layer_idx, lay.rule is _cache.rule) for lay in [_cache.layer(2)] + _cache.layers],
        [(2, True), (0, True), (1, True), (2, True)])
_cache.layer(1).arm()
test_eq(_cache.update(k7, 2 * k7, 1), (k7, 2 * k7))
test_eq([lay.seen for lay in _cache.layers], [0, 7, 0])
test_fail(lambda: _cache.update(k7, k7, 0), contains="only inside sparsekv.hf.patch")
test_fail(lambda: EvictingCache("sink-window"), contains="rule must be an EvictionRule, got str")
test_eq(_cache.is_compileable, False)  # not unless asked
_cache.compiled_decode = True
test_eq(_cache.is_compileable, True)
_cache.layers.append(DynamicLayer())  # a layer of transformers' own: its steps are not declared compileable
test_eq(_cache.is_compileable, False)


# %%
#| export
class SinkWindowCache(EvictingCache):
    "StreamingLLM cache: each query sees `sink` first tokens and the `window` most recent (itself included)."

    def __init__(self, sink: int, window: int):
        super().__init__(SinkWindowRule(sink, window))


# %%
_swc = SinkWindowCache(2, 3)
test_eq((type(_swc.rule), _swc.rule.sink, _swc.rule.window, _swc.layer(0).rule is _swc.rule),
        (SinkWindowRule, 2, 3, True))


# %% [markdown]
# ## A cache that grows in place
#
# transformers' `DynamicLayer` appends with `torch.cat`, so every decode step copies the whole cache
# of every layer: at 8k tokens on SmolLM2-135M (30 layers, 3 KV heads of 64) that is 2 × 30 copies
# of 6 MB per step, about as long as the rest of the step on two cores. `GrowingLayer` keeps keys
# and values in buffers with room to spare, writes each step's entries in place, and returns views
# of the filled part; when a buffer is full its capacity doubles (one copy per doubling, so the
# copying averages out to at most one extra write per entry). Everything else is `DynamicLayer`'s
# contract: `get_seq_length`, `get_mask_sizes`, `crop`, and the batch operations `generate` uses
# for beam search and repeated rows.
#
# A returned view stays valid while the cache only grows. After `crop` the next `update` overwrites
# the cropped slots, so a view taken before the crop would see the new entries; nothing in
# `sparsekv` keeps one (policies copy what they store), and transformers' assisted decoding only
# reads the cache after cropping it.
#
# An assigned tensor is the buffer, full: the layer holds its entries and has no room to spare; `reset` forgets them,
# keeping the buffer:

# %%
#| export
class GrowingLayer(DynamicLayer):
    "A `DynamicLayer` that writes new entries in place into buffers whose capacity doubles when full; returns views."
    is_compileable = True  # its decode step compiles as one graph (see `OptInCompile`)

    def __init__(self, min_capacity: int = 256):
        self.min_capacity = check_int(min_capacity, "min_capacity", 1)
        self._k = self._v = self._filled = None
        super().__init__()

    # the entries filled: the length of the filled view of the key buffer. A shape is traced by torch.compile as a
    # symbol; an int attribute would be a constant, compiled again for at every step
    @property
    def _n(self) -> int: return 0 if self._filled is None else self._filled.shape[-2]

    @_n.setter
    def _n(self, n: int): self._filled = None if self._k is None else self._k[:, :, :n]

    # keys/values are the filled part of the buffers; transformers assigns them (offload, the batch operations of the
    # base class): an assigned tensor becomes the buffer, full to its length
    @property
    def keys(self) -> Tensor | None: return self._filled

    @keys.setter
    def keys(self, x: Tensor | None): self._k = self._filled = x

    @property
    def values(self) -> Tensor | None: return None if self._v is None else self._v[:, :, :self._n]

    @values.setter
    def values(self, x: Tensor | None): self._v = x

    @property
    def capacity(self) -> int:
        "Entries the buffers hold before they must grow."
        return 0 if self._k is None else self._k.shape[-2]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self._n

    def reset(self) -> None:
        self._n = 0


# %%
_g, _x = GrowingLayer(min_capacity=4), torch.randn(1, 2, 3, 4)
test_eq((_g.keys, _g.values, _g.capacity, _g.get_seq_length()), (None, None, 0, 0))
_g.keys, _g.values = _x, 2 * _x
test_eq((_g.keys, _g.values, _g.capacity, _g.get_seq_length()), (_x, 2 * _x, 3, 3))
_g.reset()
test_eq((_g.keys.shape[2], _g.capacity), (0, 3))
test_fail(lambda: GrowingLayer(0), contains="min_capacity")


# %% [markdown]
# Growing the full buffer of 3 entries above: at least `min_capacity`, at least twice the old capacity, at least
# what is needed; the filled entries are copied:

# %%
#| export
@patch_to(GrowingLayer)
def _buffers(self, need: int, key_states: Tensor, value_states: Tensor) -> None:
    "Fresh buffers of at least `need` entries (twice the old capacity) for the new states' rows, the filled copied."
    cap = max(need, 2 * self.capacity, self.min_capacity)
    k, v = (x.new_empty(*x.shape[:2], cap, x.shape[3]) for x in (key_states, value_states))
    n = self._n
    if n: k[:, :, :n], v[:, :, :n] = self.keys, self.values
    self._k, self._v = k, v
    self._n = n  # the filled view, now of the new buffer


# %%
_g.keys, _g.values = _x, 2 * _x
_g._buffers(4, _x, _x)
test_eq((_g.capacity, _g.keys, _g.values), (6, _x, 2 * _x))
_g._buffers(20, _x, _x)
test_eq((_g.capacity, _g.keys), (20, _x))
_g8 = GrowingLayer(min_capacity=8)
_g8._buffers(2, _x, _x)
test_eq((_g8.capacity, _g8.keys.shape), (8, (1, 2, 0, 4)))  # nothing filled yet


# %% [markdown]
# A prefill of 5 fills 5 exactly; the next step doubles the buffer to 10, and steps then write in place (the returned
# keys are views of the same buffer) until it is full:

# %%
#| export
@patch_to(GrowingLayer)
def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:  # noqa: F811
    "Write the new entries after the filled ones (growing the buffers when full); views of all filled entries."
    if not self.is_initialized: self.lazy_initialization(key_states, value_states)
    n, m = self._n, key_states.shape[-2]
    if n + m > self.capacity or self._k.shape[:2] != key_states.shape[:2]:
        self._buffers(n + m, key_states, value_states)
    self._k[:, :, n:n + m] = key_states
    self._v[:, :, n:n + m] = value_states
    self._n = n + m
    return self.keys, self.values


# %%
_g = GrowingLayer(min_capacity=4)
_k6 = torch.randn(1, 2, 6, 4)
test_eq((_g.update(_k6[:, :, :5], _k6[:, :, :5])[0], _g.capacity), (_k6[:, :, :5], 5))
_first = _g.update(_k6[:, :, 5:], _k6[:, :, 5:])[0]
test_eq((_first, _g.capacity, _g.get_seq_length()), (_k6, 10, 6))
test_eq(_g.update(_k6[:, :, :1], _k6[:, :, :1])[0].data_ptr(), _first.data_ptr())


# %%
#| export
@patch_to(GrowingLayer)
def crop(self, tokens_to_remove: int) -> None:  # noqa: F811
    "Forget the last `tokens_to_remove` entries (an int <= 0, as transformers takes it); the buffers stay."
    self._n -= tokens_to_lose(tokens_to_remove, self._n)


# %%
_g.crop(-3)
test_eq((_g.keys, _g.capacity), (_k6[:, :, :4], 10))
_g.crop(-9)
test_eq(_g.get_seq_length(), 0)
test_fail(lambda: _g.crop(2), contains="tokens_to_remove must be an int <= 0")


# %% [markdown]
# Checks against `DynamicLayer` on random entries: a prefill of 5 and decode steps past two doublings
# give the same keys and values and the same lengths and mask sizes; the buffers grew twice, not at
# each step; `crop` and the three batch operations give what they give on `DynamicLayer`, and
# further updates after each still match.

# %%
#| export
@patch_to(GrowingLayer)
def _rows(self, fn) -> None:
    "Apply the batch-row map `fn` (`row_map`) to the filled entries, into buffers of the same capacity."
    if not self._n: return
    keys, values, cap = fn(self.keys), fn(self.values), self.capacity
    self._k = self._v = None
    self._n = 0
    self.update(keys, values)
    if self.capacity < cap: self._buffers(cap, keys, values)


# %%
_g2, _kk = GrowingLayer(min_capacity=8), torch.randn(2, 3, 5, 4)
_g2.update(_kk, 2 * _kk)
_g2._rows(lambda x: x.flip(0))
test_eq((_g2.keys, _g2.values, _g2.capacity), (_kk.flip(0), 2 * _kk.flip(0), 8))


# %%
#| export
@patch_to(GrowingLayer)
def reorder_cache(self, beam_idx: Tensor) -> None:  # noqa: F811
    self._rows(row_map("reorder_cache", beam_idx))


# %%
_g2.reorder_cache(torch.tensor([1, 0]))
test_eq(_g2.keys, _kk)


# %%
#| export
@patch_to(GrowingLayer)
def batch_repeat_interleave(self, repeats: int) -> None:  # noqa: F811
    self._rows(row_map("batch_repeat_interleave", repeats))


# %%
_g2.batch_repeat_interleave(2)
test_eq(_g2.values, 2 * _kk.repeat_interleave(2, 0))


# %%
#| export
@patch_to(GrowingLayer)
def batch_select_indices(self, indices: Tensor) -> None:  # noqa: F811
    self._rows(row_map("batch_select_indices", indices))


# %%
def feed(layers, n: int, H=3, D=4) -> None:
    "Update both layers with the same `n` random entries per row; they must return the same keys and values."
    k = torch.randn(layers[0].keys.shape[0] if layers[0].is_initialized else 2, H, n, D)
    (k0, v0), (k1, v1) = (lay.update(k, 2 * k) for lay in layers)
    test_eq(k1, k0)
    test_eq(v1, v0)


ref, grow = DynamicLayer(), GrowingLayer(min_capacity=4)
feed((ref, grow), 5)
caps = [grow.capacity]
for _ in range(12):
    feed((ref, grow), 1)
    caps.append(grow.capacity)
test_eq(sorted(set(caps)), [5, 10, 20])  # the first write fills 5 exactly; then it doubles when full
test_eq((grow.get_seq_length(), grow.get_mask_sizes(1)), (ref.get_seq_length(), ref.get_mask_sizes(1)))
for op, arg in (("crop", -8), ("crop", -2), ("crop", 0), ("reorder_cache", torch.tensor([1, 0])),
                ("batch_repeat_interleave", 2), ("batch_select_indices", torch.tensor([0, 3]))):
    for lay in (ref, grow): getattr(lay, op)(arg)
    test_eq(grow.keys, ref.keys)
    test_eq(grow.values, ref.values)
    test_eq(grow.get_seq_length(), ref.get_seq_length())
    feed((ref, grow), 3)
grow.reset()
test_eq((grow.get_seq_length(), grow.keys.shape[2]), (0, 0))


# %% [markdown]
# And in `generate`, on a tiny model: greedy decoding (with its logits), beam search (which reorders
# the rows at every step) and several return sequences give the same tokens as with `DynamicCache`.

# %%
#| export
class GrowingCache(OptInCompile, DynamicCache):
    "`DynamicCache` whose full-attention layers are `GrowingLayer`s (sliding-window layers stay transformers' own)."

    def __init__(self, config=None, min_capacity: int = 256):
        super().__init__(config=config)
        check_int(min_capacity, "min_capacity", 1)
        if config is None: self.layer_class_to_replicate = functools.partial(GrowingLayer, min_capacity)
        else: self.layers = [GrowingLayer(min_capacity) if type(lay) is DynamicLayer else lay for lay in self.layers]


# %%
from transformers import DynamicCache

from sparsekv.models import tiny_model

model, _ = tiny_model("tiny-llama")
prompt = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
for kw in (dict(num_beams=1), dict(num_beams=3), dict(num_beams=3, num_return_sequences=2)):
    out = [model.generate(prompt, past_key_values=cache(config=model.config), max_new_tokens=12, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kw)
           for cache in (DynamicCache, GrowingCache)]
    test_eq(out[1].sequences, out[0].sequences)
    assert_close(torch.stack(out[1].logits), torch.stack(out[0].logits))
print("generate: same tokens and logits with GrowingCache as with DynamicCache")

# %% [markdown]
# What it saves, measured side by side (`make test-all` runs it): one decode step's cache updates
# and attention over 30 layers of 3 KV heads and 9 query heads of 64 (SmolLM2-135M's shapes) at
# 2k, 8k and 32k cached tokens, alternating, median of 15: transformers' path (`DynamicLayer`,
# SDPA with its GQA), `GrowingLayer` with the same attention, and `GrowingLayer` with
# `sparsekv.hf.dense_attention`, which hands SDPA a decode query's group of heads as the queries
# of one KV head. The model's weights (the rest of a step) are left out: this is the part the cache
# and the attention call change.

# %%
#| slow
import statistics
import time

import torch.nn.functional as F

from sparsekv.hf import dense_attention


def step_ms(layers: list, attend, q: Tensor, kv: Tensor) -> float:
    "Milliseconds of one decode step: every layer appends `kv` and attends `q` over its whole cache."
    start = time.perf_counter()
    for lay in layers: attend(q, *lay.update(kv, kv))
    return 1e3 * (time.perf_counter() - start)


sdpa_gqa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
variants = {"DynamicLayer, SDPA": (DynamicLayer, sdpa_gqa), "GrowingLayer, SDPA": (GrowingLayer, sdpa_gqa),
            "GrowingLayer, dense_attention": (GrowingLayer, dense_attention)}
print(f"{torch.get_num_threads()} thread(s); ms per step (speed-up over transformers' path)")
for T in (2048, 8192, 32768):
    prefill, q, kv = torch.randn(1, 3, T, 64), torch.randn(1, 9, 1, 64), torch.randn(1, 3, 1, 64)
    runs = {name: ([cls() for _ in range(30)], attend) for name, (cls, attend) in variants.items()}
    for layers, _ in runs.values():
        for lay in layers: lay.update(prefill, prefill)
    ms = {name: [] for name in runs}
    for _ in range(15):
        for name, (layers, attend) in runs.items(): ms[name].append(step_ms(layers, attend, q, kv))
    med = {name: statistics.median(m) for name, m in ms.items()}
    base = med["DynamicLayer, SDPA"]
    print(f"{T:6d} cached: " + ", ".join(f"{name} {m:6.1f} ({base / m:.2f}x)" for name, m in med.items()))
