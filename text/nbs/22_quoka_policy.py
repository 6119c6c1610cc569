# %% [markdown]
# # QuoKA chunked prefill
#
# > Algorithm 2 of QuoKA through `sparsekv.hf`: chunked prefill and generation over the selected keys (§4.4).

# %%
#| default_exp quoka.policy

# %%
#| export
from __future__ import annotations

import contextlib
import inspect
import weakref

import torch
from fastcore.basics import patch_to
from torch import Tensor

from sparsekv.attention import attention_reference, causal_mask, check_int
from sparsekv.cache import GrowingCache, follow_batch_ops
from sparsekv.hf import (
    AttentionContext,
    DensePolicy,
    Method,
    ModelShape,
    ScoringCost,
    SelectionPolicy,
    active_patch,
    add_chunk_keys,
    chunked_prefill,
    heads_mask,
    patch,
    queries_per_call,
)
from sparsekv.quoka.select import (
    UnitKeyCache,
    check_backend,
    check_quoka_options,
    quoka_decode_select,
    quoka_scores,
    quoka_select,
)
from sparsekv.select import all_key_indices, anchored_top_indices, resolve_budget

# %%
#| hide
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close
from transformers.cache_utils import DynamicLayer

from sparsekv.models import load_model
from sparsekv.quoka.baselines import loki_select, mean_score_select, sample_attention_select, sparq_select
from sparsekv.quoka.select import quoka_select_reference


# %% [markdown]
# [`quoka_select`](20_quoka_select.ipynb) chooses, for one chunk and one layer, $B_{SA}$ of the $T$
# cached keys per KV head (Algorithm 1). This notebook runs it inside a model.
#
# ## Algorithm 2, reconstructed
#
# Our copy of the paper names Algorithm 2 but does not print it; §3.4 says: "For each
# incoming block $X_i$, QuoKA subselects the active KV tokens using the procedure in
# Algorithm 1. The resulting subset of keys and values is then passed to the attention
# computation for that chunk." Spelled out for a prompt of $L$ tokens and chunks of
# $B_{CP}$ tokens:
#
# 1. For $i = 1, 2, \dots, \lceil L / B_{CP} \rceil$: run the model on block $X_i$ with the
#    cache of the earlier blocks. In every layer, with the block's post-RoPE queries
#    $Q_i$ `[B,Hq,S,D]` and the $T = (i-1) B_{CP}$ cached keys $K_{<i}$:
#    1. $n = \min(B_{SA}, T)$ (or the fraction of $T$, see below). If $n = T$ the block
#       attends densely (there is nothing to select).
#    2. Otherwise $I = $ `quoka_select`$(Q_i, K_{<i}, N_Q, B_{SA})$, `[B,Hkv,n]` per KV head.
#    3. The block attends to $K_{<i}[I]$ (every query sees all selected keys: they are
#       earlier) and to its own $S$ keys under the causal mask, by gathering these
#       $n + S$ keys and values and calling a dense kernel (SDPA).
#    4. The block's own keys and values are appended to the cache **in full**:
#       selection decides what a block reads, not what is stored, so a later block may
#       select a key that an earlier block skipped.
# 2. Return the cache and the last token's logits.
#
# **Interpretation.** Step 4 (the cache keeps everything) follows from the paper calling
# QuoKA a *selection* method complementary to eviction (§5: "Eviction is complementary to
# our approach and could be integrated with QuoKA"). Step 3 includes all of the block's own
# keys, which Algorithm 1 never scores: they are not in the cache when it runs.
#
# `sparsekv.hf` already has the machinery: a `SelectionPolicy` returns per-KV-head
# indices of the keys to attend to, `add_chunk_keys` appends the block's own keys, and
# `attend_selected` gathers them and applies the causal mask to the own keys.
# `chunked_prefill(model, ids, B_CP, policy)` is the loop of step 1.
#
# ## Generation mode (§4.4)
#
# At generation "the model computes attention for a single query and no query
# subselection is applied": the new token's query scores the $T$ cached keys with the same
# cosine rule and keeps the top $B_{SA}$ (`quoka_decode_select`); the token's own key is
# always attended. `decode=False` keeps generation dense, so prefill alone can be measured.
#
# ## Budgets, sinks and recent keys
#
# `budget` is $B_{SA}$ as an int, or a float fraction of the cache (Table 2 keeps 25%:
# "$B_{SA}$ is set to 25% of full cache length", during prefill and generation), resolved
# per chunk by `resolve_budget(budget, T)`. The paper keeps no fixed sinks or local window; as an
# ablation `sinks` and `recent` keys are always kept, counted against the budget
# (`anchored_top_indices` in [`sparsekv.select`](05_select.ipynb)).

# %% [markdown]
# ## The policy
#
# `QuokaPolicy.earlier_indices(q, k_earlier, kind)` is Algorithm 1 for one call (prefill:
# `quoka_select`; decode: `quoka_decode_select`; with anchors: the same scores,
# `quoka_scores`, and `anchored_top_indices`); `select` wraps it for `SelectionPolicy`:
# None (dense) when there is nothing to select, else the earlier indices plus the
# block's own keys. That wrapper is the same for the baselines' policies (`BaselinePolicy` below, and
# Loki's and LessIsMore's in [the baselines](21_quoka_baselines.ipynb)), so it is written once, in
# `EarlierKeysPolicy`; each policy only says how it picks the earlier keys (`pick_earlier`).
#
# **Unit keys across chunks.** The keys of earlier chunks never change during a chunked
# prefill, so the policy keeps their unit vectors per layer (`UnitKeyCache`, one per cache
# layer of the model's KV cache, forgotten with it) and normalizes only the keys each new
# chunk added; the selection is unchanged (checked below against `quoka_select` on the
# recorded inputs). `cache_unit_keys=False` recomputes them per chunk (no extra memory).

# %%
#| export
def _check_budget(budget):
    "`budget` if `resolve_budget` accepts it (an int >= 1 or a float fraction in (0, 1])."
    resolve_budget(budget, 0)  # raises on a bad budget
    return budget


# %%
test_eq((_check_budget(7), _check_budget(0.25)), (7, 0.25))
for bad in (0, 1.5, "x"): test_fail(lambda: _check_budget(bad), contains="budget must be an int >= 1")


# %% [markdown]
# The policies differ only in `pick_earlier`. Check the shared part with a policy that
# picks the first $n$ earlier keys: dense while the cache fits (and on the first chunk), dense at
# decode with `decode=False`, otherwise the picked keys followed by the chunk's own keys $T, \dots, T+S-1$.

# %%
#| export
class EarlierKeysPolicy(SelectionPolicy):
    """A chunk (or a decode query) attends to the earlier keys `pick_earlier` chooses per KV head plus all its own keys;
    dense when no earlier key is dropped. Subclasses set `budget` (B_SA) or override `fits`."""

    def __init__(self, decode: bool = True):
        if not isinstance(decode, bool): raise TypeError(f"decode must be a bool, got {decode!r}")
        self.decode_sparse = decode

    def fits(self, T: int) -> bool:
        "Whether the T earlier keys all fit the budget: the chunk then attends densely, `pick_earlier` is not asked."
        return resolve_budget(self.budget, T) == T

    def pick_earlier(self, q: Tensor, k_earlier: Tensor, ctx: AttentionContext) -> Tensor | None:
        "Indices [B,Hkv,n] (ascending) of the earlier keys k_earlier [B,Hkv,T,D] the queries q attend to; None: all."
        raise NotImplementedError(f"{type(self).__name__} must implement pick_earlier(q, k_earlier, ctx)")


# %%
class FirstKeys(EarlierKeysPolicy):
    def __init__(self, budget, decode=True): super().__init__(decode); self.budget = budget
    def pick_earlier(self, q, k_earlier, ctx):
        return all_key_indices(2, 3, resolve_budget(self.budget, k_earlier.shape[2]))

test_eq([FirstKeys(3).fits(T) for T in (0, 3, 4)], [True, True, False])
test_eq([FirstKeys(0.5).fits(T) for T in (0, 1, 2)], [True, True, False])
test_fail(lambda: EarlierKeysPolicy().pick_earlier(None, None, None), contains="must implement pick_earlier")


# %%
#| export
@patch_to(EarlierKeysPolicy)
def select(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor | None:
    """Picked earlier keys, then the chunk's own [B,Hkv,n+Sq] (a padded batch: chosen keys [B,Hkv,Sk], see
    `select_rows`); None (dense): none dropped or decode=False at decode."""
    if ctx.kind == "decode" and not self.decode_sparse: return None
    real = ctx.real_keys()
    if real is not None: return self.select_rows(q, k, ctx, real)
    T = ctx.past_len
    if self.fits(T): return None
    idx = self.pick_earlier(q, k[:, :, :T], ctx)
    if idx is None or idx.shape[-1] == T: return None
    return add_chunk_keys(idx, k.shape[2], q.shape[2])


# %%
def first_keys_select(budget, kind, T, decode=True):
    S = 1 if kind == "decode" else 4  # a chunk of 4 queries, or one decode query, after T earlier keys
    q, k = torch.randn(2, 6, S, 8), torch.randn(2, 3, T + S, 8)
    ctx = SimpleNamespace(kind=kind, past_len=T, real_keys=lambda: None)  # an unpadded batch
    return FirstKeys(budget, decode).select(q, k, None, ctx)

for budget, kind, T in [(10, "prefill", 10), (12, "prefill", 10), (3, "prefill", 0), (1.0, "decode", 10)]:
    test_eq(first_keys_select(budget, kind, T), None)  # nothing to drop: dense
test_eq(first_keys_select(3, "decode", 10, decode=False), None)
test_eq(first_keys_select(3, "prefill", 10), torch.tensor([0, 1, 2, 10, 11, 12, 13]).expand(2, 3, -1))
test_eq(first_keys_select(0.5, "decode", 10), torch.tensor([0, 1, 2, 3, 4, 10]).expand(2, 3, -1))
test_fail(lambda: FirstKeys(3, decode=1), contains="decode must be a bool")


# %% [markdown]
# In a padded batch (the model's mask hides padding keys, see *Padded batches* below) each row picks from its own
# real keys, and the policy returns the chosen keys as a boolean `[B,Hkv,Sk]`.
# By hand: 5 earlier keys and a chunk of 2; row 1's first two keys are padding, so its real earlier keys are 2, 3, 4.
# Keeping 2 keys, row 0 keeps keys 0, 1 and row 1 its first two real ones, 2, 3; keeping 3, row 1's three fit.

# %%
#| export
@patch_to(EarlierKeysPolicy)
def select_rows(self, q: Tensor, k: Tensor, ctx: AttentionContext, real: Tensor) -> Tensor | None:
    """A padded batch: each row picks as if alone, from its real earlier keys for its real queries (`real` [B,Sk]);
    the chosen keys [B,Hkv,Sk] (its own keys included), or None when no row drops a key."""
    T, B, Hkv = ctx.past_len, k.shape[0], k.shape[1]
    chosen, dropped = real[:, None].expand(B, Hkv, -1).clone(), False
    for b in range(B):
        keys, queries = real[b, :T].nonzero()[:, 0], real[b, T:].nonzero()[:, 0]
        if not len(queries) or self.fits(len(keys)): continue
        row = ctx.row_context(b, len(keys) + len(queries), len(queries))
        idx = self.pick_earlier(q[b:b + 1, :, queries], k[b:b + 1, :, keys], row)
        if idx is None or idx.shape[-1] == len(keys): continue
        chosen[b, :, :T] = False
        chosen[b, :, :T].scatter_(1, keys[idx[0]], True)
        dropped = True
    return chosen if dropped else None


# %%
real = torch.ones(2, 7, dtype=torch.bool)
real[1, :2] = False
ctx = SimpleNamespace(kind="prefill", past_len=5, real_keys=lambda: real, row_context=lambda b, n, s: None)
q, k = torch.randn(2, 6, 2, 8), torch.randn(2, 3, 7, 8)
test_eq(FirstKeys(2).select(q, k, None, ctx),
        torch.tensor([[1, 1, 0, 0, 0, 1, 1], [0, 0, 1, 1, 0, 1, 1]], dtype=torch.bool)[:, None].expand(2, 3, 7))
test_eq(FirstKeys(3).select(q, k, None, ctx),
        torch.tensor([[1, 1, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)[:, None].expand(2, 3, 7))
test_eq(FirstKeys(5).select(q, k, None, ctx), None)   # every row fits


# %%
#| export
class QuokaPolicy(EarlierKeysPolicy):
    """QuoKA (Alg. 2): each prefill chunk attends to the `budget` (B_SA) earlier keys Alg. 1 selects per KV head plus
    its own keys; decode likewise (§4.4) unless `decode=False`. `query_rank`: 'dissimilar' (the paper) or the
    ablations 'similar' and 'random' (a generator seeded with `seed`), see `select_queries`; `gqa_agg`: 'mean' over a
    group's heads (the paper) or the ablation 'max', see `quoka_scores`; `backend='triton'`: the keys scored in place
    by the fused kernel (no unit keys cached), see `quoka_scores`."""

    def __init__(self, n_q: int = 16, budget: int | float = 1024, query_select: str = "group", query_agg: str = "max",
                 sinks: int = 0, recent: int = 0, decode: bool = True, cache_unit_keys: bool = True,
                 query_rank: str = "dissimilar", seed: int = 0, gqa_agg: str = "mean", backend: str = "torch"):
        check_quoka_options(n_q, query_select, query_agg, query_rank, gqa_agg)
        self.query_rank, self.seed, self.gqa_agg = query_rank, check_int(seed, "seed"), gqa_agg
        self.backend = check_backend(backend)
        self.generator = torch.Generator().manual_seed(seed) if query_rank == "random" else None
        super().__init__(decode)
        if not isinstance(cache_unit_keys, bool):
            raise TypeError(f"cache_unit_keys must be a bool, got {cache_unit_keys!r}")
        # cache layer -> UnitKeyCache
        self.cache_unit_keys, self.unit_caches = cache_unit_keys, weakref.WeakKeyDictionary()
        self.n_q, self.budget, self.query_select, self.query_agg = n_q, _check_budget(budget), query_select, query_agg
        self.sinks, self.recent = check_int(sinks, "sinks"), check_int(recent, "recent")

    def pick_earlier(self, q: Tensor, k_earlier: Tensor, ctx: AttentionContext) -> Tensor:
        "Alg. 1 (prefill) or §4.4 (decode) over the earlier keys, with this layer's cached unit keys."
        return self.earlier_indices(q, k_earlier, ctx.kind, self.unit_keys(k_earlier, ctx))

    def __repr__(self):
        return (f"QuokaPolicy(n_q={self.n_q}, budget={self.budget}, query_select={self.query_select!r}, "
                f"query_agg={self.query_agg!r}, query_rank={self.query_rank!r}, gqa_agg={self.gqa_agg!r}, "
                f"sinks={self.sinks}, recent={self.recent}, decode={self.decode_sparse}"
                + (f", backend={self.backend!r})" if self.backend != "torch" else ")"))


# %%
test_eq(repr(QuokaPolicy(n_q=4, budget=0.25, sinks=2)),
        "QuokaPolicy(n_q=4, budget=0.25, query_select='group', query_agg='max', query_rank='dissimilar', "
        "gqa_agg='mean', sinks=2, recent=0, decode=True)")
test_eq(QuokaPolicy(query_rank="random", seed=3).generator.initial_seed(), 3)
test_eq(QuokaPolicy().generator, None)
test_fail(lambda: QuokaPolicy(budget=0), contains="budget must be")
test_fail(lambda: QuokaPolicy(cache_unit_keys=1), contains="cache_unit_keys must be a bool")


# %% [markdown]
# `earlier_indices` is Algorithm 1 for one call, or with anchors the same scores and `anchored_top_indices`. On
# random inputs it keeps what the loop-based `quoka_select_reference` keeps; with 2 sinks and 2 recent keys in a
# budget of 6 over 20 keys, keys 0, 1, 18 and 19 are always among the 6:

# %%
#| export
@patch_to(QuokaPolicy)
def earlier_indices(self, q: Tensor, k_earlier: Tensor, kind: str = "prefill",
                    k_unit: Tensor | None = None) -> Tensor:
    """Indices [B,Hkv,n] (ascending) of the earlier keys k_earlier [B,Hkv,T,D] that the queries q [B,Hq,S,D] attend
    to (Alg. 1; §4.4 for `kind='decode'`); `k_unit`: their unit keys if at hand."""
    if kind not in ("prefill", "decode"): raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
    if not (self.sinks or self.recent):
        if kind == "decode": return quoka_decode_select(q, k_earlier, self.budget, k_unit, self.gqa_agg, self.backend)
        return quoka_select(q, k_earlier, self.n_q, self.budget, self.query_select, self.query_agg, k_unit,
                            self.query_rank, self.generator, self.gqa_agg, self.backend)
    if kind == "decode" and q.shape[2] != 1:
        raise ValueError(f"q must hold one query per head [B,Hq,1,D] at decode, got {tuple(q.shape)}")
    B, Hkv, T, _ = k_earlier.shape
    n = resolve_budget(self.budget, T)
    n_q = 1 if kind == "decode" else self.n_q
    # validates shapes even when n == T
    s = quoka_scores(q, k_earlier, n_q, self.query_select, self.query_agg, k_unit, self.query_rank, self.generator,
                     self.gqa_agg, self.backend)
    if n == T: return all_key_indices(B, Hkv, T, k_earlier.device)
    return anchored_top_indices(s, n, self.sinks, self.recent)


# %%
g = torch.Generator().manual_seed(0)
q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
test_eq(QuokaPolicy(n_q=3, budget=5).earlier_indices(q, k), quoka_select_reference(q, k, 3, 5))
test_eq(QuokaPolicy(budget=5).earlier_indices(q[:, :, :1], k, "decode"), quoka_select_reference(q[:, :, :1], k, 1, 5))
anchored = QuokaPolicy(n_q=3, budget=6, sinks=2, recent=2).earlier_indices(q, k)
test_eq(anchored.shape, (2, 2, 6))
test_eq(anchored[..., :2], torch.tensor([0, 1]).expand(2, 2, 2))       # the sinks
test_eq(anchored[..., -2:], torch.tensor([18, 19]).expand(2, 2, 2))    # the recent keys
test_eq(QuokaPolicy(n_q=3, budget=20, sinks=1).earlier_indices(q, k), all_key_indices(2, 2, 20))
test_fail(lambda: QuokaPolicy(sinks=1).earlier_indices(q, k, "decode"), contains="one query per head")
test_fail(lambda: QuokaPolicy().earlier_indices(q, k, "verify"), contains="kind must be")


# %% [markdown]
# The unit keys of a cache layer are kept across calls (and follow its batch operations); without a cache layer,
# or with `cache_unit_keys=False`, there are none:

# %%
#| export
@patch_to(QuokaPolicy)
def unit_keys(self, k_earlier: Tensor, ctx: AttentionContext) -> Tensor | None:
    "Unit keys of k_earlier from this layer's `UnitKeyCache` (None: no cache, `cache_unit_keys=False` or the kernel)."
    layer = ctx.cache_layer
    if not self.cache_unit_keys or layer is None or self.backend == "triton": return None
    if layer not in self.unit_caches:
        self.unit_caches[layer] = UnitKeyCache()
        # beam search moves the layer's rows: move the unit keys with them
        follow_batch_ops(layer, id(self), self.unit_caches[layer].apply_rows)
    return self.unit_caches[layer].update(k_earlier)


# %%
layer = DynamicLayer()
layer.update(k, k)
pol = QuokaPolicy(budget=5)
assert_close(pol.unit_keys(k, SimpleNamespace(cache_layer=layer)), k / k.norm(dim=-1, keepdim=True))
test_eq(len(pol.unit_caches), 1)
test_eq(pol.unit_keys(k, SimpleNamespace(cache_layer=None)), None)
test_eq(QuokaPolicy(cache_unit_keys=False).unit_keys(k, SimpleNamespace(cache_layer=layer)), None)

# %% [markdown]
# The attribute is `decode_sparse` because `decode` is the `AttentionPolicy` method for
# generation calls. Beam search is supported: the cached unit keys follow the cache layer's
# batch operations (`follow_batch_ops`), so `generate(num_beams=3)` equals the same policy with
# `cache_unit_keys=False` (tests/test_quoka_policy.py).
#
# ## Checks on a tiny model
#
# A tiny random Llama (2 layers, 4 query / 2 KV heads, $G = 2$, fp32). First: with a
# budget at least the prompt length every chunk is dense, so QuoKA's chunked prefill
# equals dense chunked prefill.

# %%
model, _ = load_model("tiny-llama")
ids = torch.randint(3, 259, (2, 40), generator=torch.Generator().manual_seed(1))
_, dense_last = chunked_prefill(model, ids, 8)
_, quoka_last = chunked_prefill(model, ids, 8, QuokaPolicy(n_q=4, budget=40))
assert_close(quoka_last, dense_last, atol=1e-5, rtol=0)
_, quoka_last = chunked_prefill(model, ids, 8, QuokaPolicy(n_q=4, budget=1.0))  # the whole cache as a fraction
assert_close(quoka_last, dense_last, atol=1e-5, rtol=0)


# %% [markdown]
# With a small budget, record each call's inputs and output, and recompute the output by
# brute force: the selection from the loop-based `quoka_select_reference`, an explicit
# boolean mask over all keys (the selected earlier keys for every query, the block's own
# keys causally) and `attention_reference`.

# %%
#| export
def selected_attention_reference(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, earlier: Tensor) -> Tensor:
    "Attention over earlier keys `earlier` [B,Hkv,n] and the chunk's own (causal) by a mask and `attention_reference`."
    B, Hkv, Sk, _ = k.shape
    Sq, T = q.shape[2], ctx.past_len
    m = torch.zeros(B, Hkv, Sq, Sk, dtype=torch.bool)
    m[..., :T] = torch.zeros(B, Hkv, T, dtype=torch.bool).scatter(2, earlier, True)[:, :, None]
    m[..., T:] = causal_mask(Sq, Sq)
    return attention_reference(q, k, v, heads_mask(m, q.shape[1]), ctx.scale)[0]


# %%
class Recording(QuokaPolicy):
    "QuokaPolicy that keeps every call's q, k, v, context, selected earlier keys (None: dense) and output."
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def attend(self, q, k, v, ctx):
        idx, out = self.select(q, k, v, ctx), super().attend(q, k, v, ctx)
        self.calls.append((q, k, v, ctx, None if idx is None else idx[..., :-q.shape[2]], out))
        return out




rec = Recording(n_q=3, budget=5)
_, sparse_last = chunked_prefill(model, ids, 8, rec)
test_eq([c[4] is None for c in rec.calls], [c[3].past_len <= 5 for c in rec.calls])  # dense while the cache fits
for q, k, v, ctx, idx, out in rec.calls:
    if idx is None: continue
    ref_idx = quoka_select_reference(q, k[:, :, :ctx.past_len], 3, 5)
    test_eq(idx, ref_idx)
    test_eq(idx, quoka_select(q, k[:, :, :ctx.past_len], 3, 5))
    assert_close(out, selected_attention_reference(q, k, v, ctx, ref_idx), atol=1e-5, rtol=0)
assert (sparse_last - dense_last).abs().max() > 1e-3  # the selection changed the result
test_eq(len(rec.unit_caches), model.config.num_hidden_layers)  # one unit-key cache per layer of the live KV cache
# the same result without it
test_eq(chunked_prefill(model, ids, 8, QuokaPolicy(n_q=3, budget=5, cache_unit_keys=False))[1], sparse_last)
# the ablation's 'similar' ranking passes through unchanged: each call keeps what the reference keeps with it
rec = Recording(n_q=3, budget=5, query_rank="similar")
chunked_prefill(model, ids, 8, rec)
for q, k, _v, ctx, idx, _out in rec.calls:
    if idx is not None: test_eq(idx, quoka_select_reference(q, k[:, :, :ctx.past_len], 3, 5, query_rank="similar"))
len(rec.calls)

# %% [markdown]
# Generation: after a QuoKA prefill, each generated token's query selects with the decode
# rule (one query, no subselection); with `decode=False` generation is dense and matches
# a plain dense decode from the same cache.

# %%
rec = Recording(n_q=3, budget=5)
prompt = ids[:1, :20]
with torch.no_grad():
    cache, _ = chunked_prefill(model, prompt[:, :-1], 8, rec)
    with patch(model, rec):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, max_new_tokens=4,
                             do_sample=False, pad_token_id=0)
decode_calls = [c for c in rec.calls if c[3].kind == "decode"]
test_eq(len(decode_calls), 4 * model.config.num_hidden_layers)
for q, k, v, ctx, idx, o in decode_calls:
    test_eq(idx, quoka_select_reference(q, k[:, :, :ctx.past_len], 1, 5))  # one query: max = mean, nothing subselected
    assert_close(o, selected_attention_reference(q, k, v, ctx, idx), atol=1e-5, rtol=0)
out.shape


# %% [markdown]
# ## The baselines under the same loop
#
# Every selection function of [the baselines](21_quoka_baselines.ipynb) has the
# signature `select_fn(q_chunk, k_cache, budget, **options) -> [B,Hkv,n]`;
# `BaselinePolicy` runs one per chunk exactly as `QuokaPolicy` runs `quoka_select`
# (dense when the cache fits, the chunk's own keys appended, the same single query at
# decode). The model's softmax scale is passed to functions that take `scale`.
# Two baselines need more than one call's inputs; their policies are written with their algorithms in
# [the baselines](21_quoka_baselines.ipynb): Loki keeps each layer's key moments across calls (`LokiPolicy`,
# a `BaselinePolicy`), and LessIsMore selects at a few layers and reuses the pick in the following ones
# (`LessIsMorePolicy`, an `EarlierKeysPolicy`).

# %%
#| export
class BaselinePolicy(EarlierKeysPolicy):
    "Run baseline `select_fn(q_chunk, k_cache, budget, **options)` per chunk and layer, as QuokaPolicy runs Alg. 1."

    def __init__(self, select_fn, budget: int | float = 1024, decode: bool = True, **options):
        if not callable(select_fn):
            raise TypeError(f"select_fn must be a selection function, got {type(select_fn).__name__}")
        super().__init__(decode)
        params = inspect.signature(select_fn).parameters
        if "budget" not in params:
            raise TypeError(f"select_fn must take a `budget` argument, {getattr(select_fn, '__name__', select_fn)} "
                            "does not")
        self.select_fn, self.budget, self.options = select_fn, _check_budget(budget), options
        self.pass_scale = "scale" in params and "scale" not in options

    def earlier_indices(self, q: Tensor, k_earlier: Tensor, scale: float | None = None) -> Tensor:
        "Indices [B,Hkv,n] of the earlier keys k_earlier [B,Hkv,T,D] that `select_fn` picks for the queries q."
        extra = {"scale": scale} if self.pass_scale else {}
        return self.select_fn(q, k_earlier, budget=self.budget, **self.options, **extra)

    def pick_earlier(self, q: Tensor, k_earlier: Tensor, ctx: AttentionContext) -> Tensor:
        "The keys `select_fn` picks, with the model's softmax scale."
        return self.earlier_indices(q, k_earlier, ctx.scale)

    def __repr__(self):
        name = getattr(self.select_fn, "__name__", repr(self.select_fn))
        return f"BaselinePolicy({name}, budget={self.budget}, decode={self.decode_sparse}, **{self.options})"


# %%
q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
mean_policy = BaselinePolicy(mean_score_select, 5)
test_eq(mean_policy.earlier_indices(q, k, 0.3), mean_score_select(q, k, budget=5, scale=0.3))
test_eq(repr(mean_policy), "BaselinePolicy(mean_score_select, budget=5, decode=True, **{})")
test_eq((mean_policy.pass_scale, BaselinePolicy(sparq_select, 5, r=4, scale=0.3).pass_scale), (True, False))
test_eq(BaselinePolicy(sparq_select, 5, r=4).earlier_indices(q, k, 0.3), sparq_select(q, k, 5, r=4, scale=0.3))
test_fail(lambda: BaselinePolicy("mean"), contains="select_fn must be a selection function")
test_fail(lambda: BaselinePolicy(lambda q, k: None), contains="must take a `budget` argument")

# %% [markdown]
# Each baseline at full budget reproduces dense chunked prefill; at a small budget its
# per-chunk selection is the function called directly:

# %%
baselines = {"mean": (mean_score_select, {}), "sample": (sample_attention_select, dict(n_q=3)),
             "sparq": (sparq_select, dict(r=4)), "loki": (loki_select, dict(r=4))}
for name, (fn, opts) in baselines.items():
    assert_close(chunked_prefill(model, ids, 8, BaselinePolicy(fn, 40, **opts))[1], dense_last, atol=1e-5, rtol=0)

    class Rec(BaselinePolicy):
        def select(self, q, k, v, ctx):
            idx = super().select(q, k, v, ctx)
            if idx is not None: test_eq(idx[..., :5], fn(q, k[:, :, :ctx.past_len], 5, scale=ctx.scale, **opts))
            return idx
    sparse = chunked_prefill(model, ids, 8, Rec(fn, 5, **opts))[1]
    assert (sparse - dense_last).abs().max() > 1e-4, name

# %% [markdown]
# ## Padded batches
#
# In a left-padded batch (`chunked_prefill(..., attention_mask=...)`, `generate` with padding) the
# model's mask hides each row's padding keys. The policies then select **row by row**, as if the row ran
# alone (`EarlierKeysPolicy.select_rows`): the row's real queries of the chunk score only its real earlier
# keys, its budget is resolved on their number (a row whose real keys fit attends densely while another
# selects), and its sinks and recent keys are its own first and last real keys. Rows may thus keep
# different numbers of keys; the policy returns the chosen keys as a boolean `[B,Hkv,Sk]` and
# `attend_chosen` masks the fillers. Unit keys are not cached row by row (they are recomputed, which changes no
# selection).
#
# Check: three prompts of 40, 29 and 21 tokens left-padded to 40, in chunks of 8 (padding 0, 11 and 19:
# `chunked_prefill` prefills rows with different remainders separately, so their chunks start at their
# first token). Each row's last logits equal those of the row alone, under QuoKA (with and without
# anchors, an int and a fraction budget) and the baselines under `BaselinePolicy` (LessIsMore's policy, which keeps
# one selector per row, is checked the same way in [the baselines](21_quoka_baselines.ipynb)):

# %%
lens = [40, 29, 21]
batch, am = torch.zeros(3, 40, dtype=torch.long), torch.zeros(3, 40, dtype=torch.long)
for b, n in enumerate(lens): batch[b, 40 - n:], am[b, 40 - n:] = ids[b % 2, :n], 1
policies = {"quoka": lambda: QuokaPolicy(n_q=3, budget=5),
            "quoka anchors": lambda: QuokaPolicy(n_q=3, budget=6, sinks=2, recent=2),
            "quoka fraction": lambda: QuokaPolicy(n_q=3, budget=0.3)}
for name, (fn, opts) in baselines.items(): policies[name] = lambda fn=fn, opts=opts: BaselinePolicy(fn, 5, **opts)
for name, make in policies.items():
    last = chunked_prefill(model, batch, 8, make(), attention_mask=am)[1]
    for b, n in enumerate(lens):
        alone = chunked_prefill(model, batch[b:b + 1, 40 - n:], 8, make())[1]
        assert_close(last[b], alone[0], atol=1e-4, rtol=0, msg=f"{name}, row {b}")
        assert (alone[0] - chunked_prefill(model, batch[b:b + 1, 40 - n:], 8)[1][0]).abs().max() > 1e-4  # it selects


# %% [markdown]
# ## A pretrained model: SmolLM2-135M
#
# Chunked prefill of about 2k tokens of prose with $B_{CP} = 128$, $N_Q = 16$ and
# $B_{SA} \in \{256, 512\}$ (the CPU profile's scale of the paper's setting). To compare more
# than one token, the prompt's last chunk is run with logits at every position
# (`last_chunk_logits`): the 128 next-token distributions of the last chunk, each read
# from a cache built under the policy, against those of dense chunked prefill: KL(dense ‖
# sparse) and top-1 agreement (`sparsekv.eval`).

# %%
#| export
def last_chunk_logits(model, input_ids: Tensor, chunk_size: int, policy=None) -> Tensor:
    "Logits [B,c,V] at each position of the last chunk (c tokens) of `chunked_prefill(model, input_ids, ...)`."
    check_int(chunk_size, "chunk_size", 1)
    if (not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.dtype != torch.long
            or input_ids.shape[1] == 0):
        raise ValueError("input_ids must be a non-empty int64 tensor [B,S]")
    S = input_ids.shape[1]
    start = (S - 1) // chunk_size * chunk_size  # where chunked_prefill's last chunk starts
    cache = (chunked_prefill(model, input_ids[:, :start], chunk_size, policy)[0] if start
             else GrowingCache(config=model.config))
    pos = torch.arange(start, S, device=input_ids.device)
    with torch.no_grad(), patch(model, policy or DensePolicy()):
        state = active_patch(model)
        state.kind, state.chunk_index = "prefill", start // chunk_size  # a one-token last chunk is still prefill
        return model(input_ids=input_ids[:, start:], past_key_values=cache, use_cache=True,
                     position_ids=pos.expand(input_ids.shape[0], -1)).logits


# %%
ll = last_chunk_logits(model, ids, 8, QuokaPolicy(n_q=3, budget=5))
assert_close(ll[:, -1], sparse_last, atol=1e-5, rtol=0)  # the last position is chunked_prefill's
with torch.no_grad(): full = model(ids).logits
assert_close(last_chunk_logits(model, ids, 8), full[:, 32:], atol=1e-5, rtol=0)  # dense: the full forward's

# %%
#| slow
from sparsekv.data import prose_text
from sparsekv.eval import attention_mass_recall, kl_to_teacher, top1_agreement
from sparsekv.hf import AttentionPolicy


# %%
#| slow
class LastChunkRecorder(AttentionPolicy):
    "Dense attention that keeps each layer's q, k and scale for the chunk whose earlier keys number `past`."
    def __init__(self, past):
        self.past, self.seen = past, {}

    def attend(self, q, k, v, ctx):
        if ctx.past_len == self.past: self.seen[ctx.layer_idx] = (q, k, ctx.scale)
        return super().attend(q, k, v, ctx)


smol, tok = load_model("smollm2-135m")
prose = tok(prose_text()[:12000], return_tensors="pt").input_ids[:, :2048]
recorder = LastChunkRecorder(2048 - 128)
dense = last_chunk_logits(smol, prose, 128, recorder)
rows = {}
for name, policy in [("quoka 256", QuokaPolicy(16, 256)), ("quoka 512", QuokaPolicy(16, 512)),
                     ("mean-of-scores 512", BaselinePolicy(mean_score_select, 512))]:
    sparse = last_chunk_logits(smol, prose, 128, policy)
    rows[name] = dict(kl=kl_to_teacher(sparse, dense).item(), top1=top1_agreement(sparse, dense).item())
rows


# %% [markdown]
# The same comparison one layer at a time, free of compounding: on the last chunk's dense
# queries and keys, the share of each query's dense attention mass that falls on the
# selected earlier keys plus the chunk's own keys (`attention_mass_recall`), averaged over
# heads and queries, then over the 30 layers (and the worst layer).

# %%
#| slow
def selection_mass_recall(policy, q, k, scale):
    "Mean attention-mass recall of `policy`'s selection for the last chunk (queries q over keys k, own keys causal)."
    T, S = k.shape[2] - q.shape[2], q.shape[2]
    extra = dict(scale=scale) if isinstance(policy, BaselinePolicy) else {}
    idx = policy.earlier_indices(q, k[:, :, :T], **extra)
    keep = torch.ones(1, k.shape[1], 1, k.shape[2], dtype=torch.bool)
    keep[..., :T] = torch.zeros(1, k.shape[1], T, dtype=torch.bool).scatter(2, idx, True)[:, :, None]
    return attention_mass_recall(q, k, keep, causal_mask(S, T + S)[None, None], scale=scale).mean().item()


recall = {}
for name, policy in [("quoka 256", QuokaPolicy(16, 256)), ("quoka 512", QuokaPolicy(16, 512)),
                     ("quoka 256, 4 sinks + 64 recent", QuokaPolicy(16, 256, sinks=4, recent=64)),
                     ("mean-of-scores 256", BaselinePolicy(mean_score_select, 256)),
                     ("mean-of-scores 512", BaselinePolicy(mean_score_select, 512))]:
    per_layer = [selection_mass_recall(policy, *recorder.seen[l]) for l in sorted(recorder.seen)]
    recall[name] = dict(mean=sum(per_layer) / len(per_layer), worst=min(per_layer))
recall


# %% [markdown]
# What these comparisons come to, with every baseline, over budgets and on RULER-style prompts, is measured by the
# [quoka_accuracy stage](../reproduce/22_quoka_accuracy.ipynb).

# %% [markdown]
# ## The methods
#
# A chunk of $B_{CP}$ queries attends to $B_{SA}$ = `budget` earlier keys per KV head and to its own keys
# (so at most `budget + chunk_size` keys); a chunk whose earlier keys fit the budget is dense. The budget
# may also be a float fraction of the cache (Table 2's 25%), as `resolve_budget` reads it. Each method
# builds its policy once at construction, so a bad parameter fails there. The registry (`sparsekv.methods`) finds
# them by name: `methods.make("quoka", 256)` is `Quoka(256)`.
#
# This notebook defines what every selection method shares (`SelectionMethod`: the chunking, the budget, the
# scoring cost from a `key_cost` formula), QuoKA's method (`Quoka`) and `BaselineSelection`, a method that runs a
# selection function under `BaselinePolicy`. The baselines' classes (`MeanScores`, `SampleAttention`, `SparQ`,
# `Loki`, `LessIsMore`) follow their algorithms in [the baselines](21_quoka_baselines.ipynb), each beside its
# selection function, its policy where it has its own, and the check of its `key_cost`.

# %%
#| export
class SelectionMethod(Method):
    """Chunked prefill in chunks of `chunk_size` (B_CP), each attending to `budget` (B_SA) earlier keys per KV head plus
    its own; decode likewise unless `decode=False`."""
    family, small_params = "selection", {"chunk_size": 8}

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True):
        super().__init__(budget)
        check_int(chunk_size, "chunk_size", 1)
        if not isinstance(decode, bool): raise TypeError(f"decode must be a bool, got {decode!r}")
        self.chunk_size, self.decode = chunk_size, decode

    @classmethod
    def check_budget(cls, budget) -> int | float:
        "`budget` if `resolve_budget` accepts it: an int >= 1 (B_SA keys) or a float fraction of the cache in (0, 1]."
        resolve_budget(budget, 0)
        return budget

    def check_model(self, model) -> None:
        "Raise naming the parameter if one does not fit `model` (its layers, its head dim); none here."

    @contextlib.contextmanager
    def patch(self, model):
        "`Method.patch`, after `check_model(model)`: what only the model can tell is checked before any work."
        self.check_model(model)
        with super().patch(model) as cache: yield cache

    def key_cost(self, shape: ModelShape, S: int) -> tuple[int, int]:
        "Multiply-adds per KV head choosing keys for S queries per head: (per cached key, per call besides the keys)."
        raise NotImplementedError(f"{type(self).__name__} must implement key_cost(shape, S)")

    def scoring_layers(self, shape: ModelShape) -> int:
        "Layers that score keys: all."
        return shape.layers


# %%
shape = ModelShape(9, 3, 64, 30)  # SmolLM2-135M: G = 3 query heads per KV head, D = 64, 30 layers
sm = SelectionMethod(256, chunk_size=64)
test_eq((sm.family, sm.chunk_size, sm.decode, sm.budget), ("selection", 64, True, 256))
test_eq(SelectionMethod(0.25).budget, 0.25)  # a fraction of the cache
test_fail(lambda: SelectionMethod(0), contains="budget must be")
test_fail(lambda: SelectionMethod(8, decode=1), contains="decode must be a bool")
test_fail(lambda: sm.key_cost(shape, 64), contains="must implement key_cost")


# %%
#| export
@patch_to(SelectionMethod)
def scoring_cost(self, shape, n_cached: int, phase: str = "prefill", chunk: int | None = None) -> ScoringCost:
    "Multiply-adds choosing among `n_cached` earlier keys for a prefill chunk or a decode step (see ScoringCost)."
    shape, S = ModelShape.of(shape), queries_per_call(phase, chunk, self.chunk_size)
    check_int(n_cached, "n_cached")
    if phase == "decode" and not self.decode: return ScoringCost()
    per_key, fixed = self.key_cost(shape, S)
    step = per_key * n_cached + fixed if resolve_budget(self.budget, n_cached) < n_cached else 0
    return ScoringCost(per_key, step, step * shape.Hkv * self.scoring_layers(shape))


# %%
class _Flat(SelectionMethod):
    def key_cost(self, shape, S): return 10, 7  # 10 per key, 7 per call

test_eq(_Flat(256).scoring_cost(shape, 1000), ScoringCost(10, 10 * 1000 + 7, (10 * 1000 + 7) * 3 * 30))
test_eq(_Flat(256).scoring_cost(shape, 200), ScoringCost(10, 0, 0))  # the keys fit the budget: a dense call
test_eq(_Flat(256, decode=False).scoring_cost(shape, 1000, "decode"), ScoringCost())


# %%
#| export
class Quoka(SelectionMethod):
    """QuoKA (Alg. 2): the B_SA earlier keys of largest cosine with the N_Q = `n_q` most dissimilar queries
    (`query_rank`: the ablations 'similar', 'random' with `seed`; `gqa_agg='max'`: the ablation of the head mean)."""
    name, cost_knob, small_params = "quoka", "n_q", {"chunk_size": 8, "n_q": 2}

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, n_q: int = 16,
                 query_select: str = "group", query_agg: str = "max", sinks: int = 0, recent: int = 0,
                 query_rank: str = "dissimilar", seed: int = 0, gqa_agg: str = "mean", *, backend: str = "torch"):
        super().__init__(budget, chunk_size, decode)
        self.n_q, self.query_select, self.query_agg, self.gqa_agg = n_q, query_select, query_agg, gqa_agg
        self.sinks, self.recent, self.query_rank, self.seed, self.backend = sinks, recent, query_rank, seed, backend
        self.policy()

    def policy(self) -> QuokaPolicy:
        return QuokaPolicy(self.n_q, self.budget, self.query_select, self.query_agg, self.sinks, self.recent,
                           self.decode, query_rank=self.query_rank, seed=self.seed, gqa_agg=self.gqa_agg,
                           backend=self.backend)

    def key_cost(self, shape, S):
        """min(N_Q, S) pre-aggregated unit queries (§3.3) times each unit key: min(N_Q, S) D (G times that with
        `gqa_agg='max'`, each head's queries apart); ranking the queries (N_Q < S, not 'random'): each of the G S
        queries dotted with its head's mean, G S D per call."""
        ranks = self.n_q < S and self.query_rank != "random"
        heads = shape.G if self.gqa_agg == "max" else 1
        return heads * min(self.n_q, S) * shape.D, shape.G * S * shape.D if ranks else 0


# %%
# N_Q D per key; ranking the G S queries of a chunk of S = 128 against their mean: G S D per call
test_eq(Quoka(256).key_cost(shape, 128), (16 * 64, 3 * 128 * 64))
test_eq(Quoka(256, gqa_agg="max").key_cost(shape, 128), (3 * 16 * 64, 3 * 128 * 64))  # each head's queries apart
test_eq(Quoka(256, query_rank="random").key_cost(shape, 128), (16 * 64, 0))  # a random choice ranks nothing
test_eq(Quoka(256).key_cost(shape, 8), (8 * 64, 0))  # fewer queries than N_Q: all kept, none ranked
assert isinstance(Quoka(256).policy(), QuokaPolicy)


# %%
#| export
class BaselineSelection(SelectionMethod):
    "A baseline of `sparsekv.quoka.baselines`: `select_fn(q_chunk, k_cache, budget, **options())` in `BaselinePolicy`."
    select_fn = None

    def options(self) -> dict:
        "The keyword arguments of `select_fn` besides the budget."
        return {}

    def policy(self) -> BaselinePolicy:
        return BaselinePolicy(type(self).select_fn, self.budget, self.decode, **self.options())


# %%
test_eq(BaselineSelection(64).options(), {})
test_fail(lambda: BaselineSelection(64).policy(), contains="select_fn must be a selection")  # a subclass sets it
