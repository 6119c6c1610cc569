# %% [markdown]
# # Transformers integration
#
# > The one place that touches `transformers`: attention policies, `patch` and chunked prefill.

# %%
#| default_exp hf

# %% [markdown]
# Every method in this project changes *which keys a query attends to* and, for eviction,
# *which keys the cache keeps*. Hugging Face `transformers` (5.2) lets us change both without
# copying any model code:
#
# 1. **Attention functions.** Each attention module (`LlamaAttention`, `Qwen3Attention`, ...)
#    projects, applies RoPE, updates the cache, then calls
#    `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)`
#    with `query` `[B,Hq,Sq,D]` and `key`, `value` `[B,Hkv,Sk,D]`: post-RoPE, the key/value
#    being *everything the cache returned* (earlier tokens and this call's tokens). It expects
#    back `(output [B,Sq,Hq,D], weights)`. `patch(model, policy)` registers one function under
#    the name `"sparsekv"` that hands the call to a **policy** object, and switches the model to it.
# 2. **Caches.** A `Cache` is a list of layers; each layer's `update` stores new keys and returns
#    what attention sees, `get_seq_length` says how many tokens the model has seen (the model
#    derives the positions of new tokens from it) and `get_mask_sizes` says how many keys the
#    next call will return (the model builds its attention mask from it). An evicting layer keeps
#    a bounded set of entries per KV head.
#
# We test everything on the tiny random Llama of `sparsekv.models` (2 layers, 4 query and 2 KV
# heads of dim 16) in float32, where "exact" means equal to the unpatched model up to float
# rounding; `tests/test_hf.py` repeats the checks on tiny Qwen3 and on G = 1.

# %%
#| export
# Over 400 lines on purpose: the attention primitives, the policy classes, the patch that routes transformers'
# attention through them and the chunked prefill share one context object; split, each part would import the others.
from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fastcore.basics import patch_to
from torch import Tensor, nn
from transformers import AttentionInterface, Cache, CompileConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sparsekv.attention import causal_mask, check_int, check_qkv, content_checks, gather_kv, hot_path
from sparsekv.cache import EvictingCache, EvictingLayer, GrowingCache

# %%
#| hide
import dataclasses
import itertools
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close
from transformers import DynamicCache

from sparsekv.attention import attention_reference, checks
from sparsekv.cache import SinkWindowCache, TopScoreRule
from sparsekv.models import load_model

torch.set_num_threads(1)  # the checks use tiny models: threads only add overhead


def _reference(q, k, v, mask, scale=None):
    "The project's brute-force attention (explicit softmax), output only."
    return attention_reference(q, k, v, mask, scale)[0]


# %% [markdown]
# ## Attention helpers
#
# A chunk of $S_q$ queries arrives after $S_k - S_q$ earlier keys, so query $i$ (at sequence
# position $S_k - S_q + i$) may see key $j$ iff
#
# $$M_{ij} = [\, j \le S_k - S_q + i \,],$$
#
# the causal mask *aligned to the last $S_q$ keys* ("bottom-right"). Note that
# `scaled_dot_product_attention(is_causal=True)` aligns to the *first* keys (top-left), which is
# only the same when $S_q = S_k$; so we pass `is_causal` only then, skip the mask for a single
# query (it sees every key) and build $M$ otherwise.
#
# `causal_mask(Sq, Sk)` from `sparsekv.attention` builds $M$. Masks are boolean, True = attend,
# broadcastable to `[B, H, Sq, Sk]` with `H` equal to 1, `Hkv` (one mask per KV head, shared by
# the `G` query heads of its group) or `Hq`.

# %%
#| export
def heads_mask(mask: Tensor, n_heads: int) -> Tensor:
    "A boolean mask with 1, Hkv or Hq heads (dim 1) as 1 or `n_heads` = Hq heads (a KV head's mask repeats per group)."
    if mask.dtype != torch.bool: raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype}")
    if mask.ndim != 4: raise ValueError(f"mask must be 4-D [B,H,Sq,Sk], got shape {tuple(mask.shape)}")
    h = mask.shape[1]
    if h in (1, n_heads): return mask
    if n_heads % h: raise ValueError(f"mask has {h} heads; accepted: 1, the KV heads or {n_heads} query heads")
    return mask.repeat_interleave(n_heads // h, dim=1)


# %%
test_eq(causal_mask(2, 4).tolist(), [[True, True, True, False], [True, True, True, True]])
test_eq(heads_mask(torch.tensor([True, False]).view(1, 2, 1, 1), 4)[0, :, 0, 0].tolist(), [True, True, False, False])


# %% [markdown]
# ### The measured budget
#
# Methods are compared at equal *budget*, and a method's nominal budget is not always what its
# queries attend to: a chunk's own keys come on top of a selection, an eviction rule that evicts
# every 16 tokens lets the queries of the chunk see up to 15 extra keys, and early queries see
# fewer keys than the budget. So the budget is measured where attention is computed. While
# `measure_attended()` is active, every attention call records, per query and query head, the
# number of KV entries its softmax ranges over (the True entries of its mask row, or the causal
# count); `AttendedBudget` keeps per (layer, head) their sum, count and maximum, so a long run
# costs no memory.

# %% [markdown]
# By hand: two query heads, two prefill queries each, then one decode query each:

# %%
#| export
class AttendedBudget:
    """Per (phase, layer, query head): how many KV entries queries attended to (mean, max); per (phase, layer): the
    most entries and bytes its cache held at a call; from `measure_attended`."""
    def __init__(self):
        self._stats: dict = {}  # (phase, layer) -> [sum [Hq], queries, max [Hq]]
        self._stored: dict = {}  # (phase, layer) -> [most entries per KV head, most bytes per sequence]

    def add(self, counts: Tensor, phase: str = "", layer: int = -1):
        "Record `counts` [B,Hq,Sq]: the KV entries each query of each head attended to in one call."
        c = counts.detach().to(torch.float64).transpose(0, 1).reshape(counts.shape[1], -1).cpu()
        s = self._stats.setdefault((phase, layer), [0.0, 0, torch.zeros(c.shape[0], dtype=torch.float64)])
        s[0], s[1], s[2] = s[0] + c.sum(1), s[1] + c.shape[1], torch.maximum(s[2], c.max(1).values)


# %%
_b = AttendedBudget()
_b.add(torch.tensor([[[1, 2], [3, 4]]]), "prefill", 0)
_b.add(torch.tensor([[[5], [6]]]), "decode", 0)
test_eq(_b._stats[("prefill", 0)][:2], [torch.tensor([3.0, 7.0], dtype=torch.float64), 2])


# %%
#| export
@patch_to(AttendedBudget)
def per_head(self) -> list[dict]:
    "One row per (phase, layer, head): mean and max attended KV entries and the number of queries."
    return [{"phase": p, "layer": l, "head": h, "mean": float(s[0][h] / s[1]), "max": int(s[2][h]),
             "queries": s[1]} for (p, l), s in sorted(self._stats.items()) for h in range(len(s[2]))]


# %%
test_eq(_b.per_head(), [{"phase": "decode", "layer": 0, "head": 0, "mean": 5.0, "max": 5, "queries": 1},
                        {"phase": "decode", "layer": 0, "head": 1, "mean": 6.0, "max": 6, "queries": 1},
                        {"phase": "prefill", "layer": 0, "head": 0, "mean": 1.5, "max": 2, "queries": 2},
                        {"phase": "prefill", "layer": 0, "head": 1, "mean": 3.5, "max": 4, "queries": 2}])


# %%
#| export
@patch_to(AttendedBudget)
def _of(self, phase: str | None) -> list:
    stats = [s for (p, _), s in self._stats.items() if phase in (None, p)]
    if not stats: raise ValueError(f"nothing was recorded{f' in phase {phase!r}' if phase else ''}: "
                                   "run attention inside measure_attended()")
    return stats


# %%
test_eq([len(_b._of(None)), len(_b._of("decode"))], [2, 1])


# %%
#| export
@patch_to(AttendedBudget)
def mean(self, phase: str | None = None) -> float:
    "Mean attended KV entries over the recorded queries of every head and layer (of `phase`: prefill or decode)."
    stats = self._of(phase)
    return sum(float(s[0].sum()) for s in stats) / sum(s[1] * len(s[2]) for s in stats)


# %%
test_eq((_b.mean(), _b.mean("prefill")), (3.5, 2.5))
test_fail(lambda: _b.mean("x"), contains="nothing was recorded in phase 'x'")


# %%
#| export
@patch_to(AttendedBudget)
def max(self, phase: str | None = None) -> int:
    "The most KV entries any recorded query of any head attended to (in `phase`: prefill or decode)."
    return int(max(float(s[2].max()) for s in self._of(phase)))


# %%
test_eq((_b.max(), _b.max("prefill")), (6, 4))


# %% [markdown]
# What a cache holds is recorded per layer and call: its entries per KV head and its bytes per sequence.

# %%
#| export
@patch_to(AttendedBudget)
def add_stored(self, keys: Tensor, values: Tensor, phase: str = "", layer: int = -1):
    "Record what one layer's cache holds at a call: `keys`, `values` `[B,Hkv,N,D]` (all entries, the new ones too)."
    nbytes = keys[0].numel() * keys.element_size() + values[0].numel() * values.element_size()
    s = self._stored.setdefault((phase, layer), [0, 0])
    s[0], s[1] = max(s[0], keys.shape[2]), max(s[1], nbytes)


# %%
_b.add_stored(torch.zeros(2, 3, 10, 4), torch.zeros(2, 3, 10, 4), "prefill", 0)   # 3 * 10 * 4 * 4 bytes * 2
_b.add_stored(torch.zeros(2, 3, 8, 4), torch.zeros(2, 3, 8, 4), "prefill", 0)     # fewer: the peak stays
test_eq(_b._stored[("prefill", 0)], [10, 960])


# %% [markdown]
# `stored` sums each layer's peak over the layers (here the prefill peak of layer 0 and the decode one of layer 1):

# %%
#| export
@patch_to(AttendedBudget)
def stored(self, phase: str | None = None) -> dict:
    """The most entries per KV head any layer held at a call (`entries`), and the sum over layers of each
    layer's most bytes per sequence (`bytes`: the KV memory a sequence needs when every layer is at its peak)."""
    rows = [(layer, s) for (p, layer), s in self._stored.items() if phase in (None, p)]
    if not rows: raise ValueError("nothing was stored: run attention inside measure_attended()")
    most = {}
    for layer, s in rows: most[layer] = max(most.get(layer, 0), s[1])
    return {"entries": max(s[0] for _, s in rows), "bytes": sum(most.values())}


# %%
_b.add_stored(torch.zeros(2, 3, 12, 4, dtype=torch.bfloat16), torch.zeros(2, 3, 12, 4, dtype=torch.bfloat16),
              "decode", 0)                                                     # 576 bytes: below layer 0's peak
_b.add_stored(torch.zeros(1, 3, 5, 4), torch.zeros(1, 3, 5, 4), "decode", 1)  # 480 bytes
test_eq(_b.stored(), {"entries": 12, "bytes": 960 + 480})
test_eq(_b.stored("decode"), {"entries": 12, "bytes": 576 + 480})
test_fail(lambda: AttendedBudget().stored(), contains="nothing was stored")

# %% [markdown]
# `measure_attended` makes a budget the active one for the block (blocks nest; the outer one is back after):

# %%
#| export
_METER: contextvars.ContextVar = contextvars.ContextVar("sparsekv_attended_budget", default=None)
_WHERE: contextvars.ContextVar = contextvars.ContextVar("sparsekv_phase_layer", default=("", -1))


@contextlib.contextmanager
def measure_attended():
    "Within the block, every attention call of `sparsekv` records its attended KV entries into the yielded budget."
    budget = AttendedBudget()
    token = _METER.set(budget)
    try: yield budget
    finally: _METER.reset(token)


# %%
test_eq(_METER.get(), None)
with measure_attended() as _outer:
    with measure_attended() as _inner: assert _METER.get() is _inner and _inner is not _outer
    assert _METER.get() is _outer
test_eq(_METER.get(), None)


# %%
#| export
def _meter() -> AttendedBudget | None:
    "The active `measure_attended` budget, or None (always while `torch.compile` traces: compiled steps measure none)."
    return None if torch.compiler.is_compiling() else _METER.get()


def record_attended(counts: Tensor):
    "Add `counts` [B,Hq,Sq] (KV entries attended per query and head) to the active `measure_attended` budget, if any."
    if (budget := _meter()) is not None: budget.add(counts, *_WHERE.get())


def measuring() -> bool:
    "Whether a `measure_attended` budget is active (a policy's fast path that records no counts steps aside)."
    return _meter() is not None


# %%
record_attended(torch.ones(1, 2, 3, dtype=torch.long))                         # no active budget: nothing happens
assert not measuring()
with measure_attended() as _m:
    assert measuring()
    _t = _WHERE.set(("decode", 3))
    record_attended(torch.full((1, 2, 1), 7))
    _WHERE.reset(_t)
test_eq([(r["phase"], r["layer"], r["max"]) for r in _m.per_head()], [("decode", 3, 7), ("decode", 3, 7)])


# %%
#| export
def record_stored(keys: Tensor, values: Tensor, phase: str, layer: int):
    "Add one layer's cached `keys`, `values` at a call to the active `measure_attended` budget, if any."
    if (budget := _meter()) is not None: budget.add_stored(keys, values, phase, layer)


# %%
record_stored(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), "prefill", 0)  # no active budget: nothing happens
with measure_attended() as _m: record_stored(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), "prefill", 0)
test_eq(_m.stored(), {"entries": 2, "bytes": 32})


# %% [markdown]
# Causally, query $i$ of 2 after 2 earlier keys sees $3 + i$ keys; under a mask, its True entries:

# %%
#| export
def attended_counts(mask: Tensor | None, B: int, Hq: int, sq: int, sk: int) -> Tensor:
    "KV entries each query attends to, `[B,Hq,Sq]`, under boolean `mask` ([Sq,Sk] or 1, Hkv or Hq heads) or causally."
    if mask is None: return torch.arange(sk - sq + 1, sk + 1).expand(B, Hq, sq)
    mask = mask[None, None] if mask.ndim == 2 else heads_mask(mask, Hq)
    return mask.expand(B, Hq, sq, sk).sum(-1)


# %%
test_eq(attended_counts(None, 1, 2, 2, 4), torch.tensor([[[3, 4], [3, 4]]]))
test_eq(attended_counts(torch.tensor([[True, False, True]]), 2, 1, 1, 3), torch.tensor([[[2]], [[2]]]))
_hm = torch.tensor([True, False]).view(1, 2, 1, 1).expand(1, 2, 1, 5)                 # per KV head, 2 query heads each
test_eq(attended_counts(_hm, 1, 4, 1, 5), torch.tensor([[[5], [5], [0], [0]]]))


# %% [markdown]
# `dense_attention` is exact softmax attention with that convention, through SDPA (with its
# native GQA); it is what the unpatched model computes. It reports its attended counts to an
# active `measure_attended()`. A decode query (one per head, every key visible) goes in as the $G$
# queries of its KV head's group, `[B, Hkv, G, D]`, with no mask: SDPA then reads each KV head once
# instead of repeating it for the $G$ query heads that share it, about twice as fast on a CPU at 8k
# keys and more at 32k.

# %%
#| export
def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                    scale: float | None = None, dropout: float = 0.0) -> Tensor:
    "Softmax attention `[B,Hq,Sq,D]` of q over k, v (GQA); `mask` boolean (True = attend), None: causal, last keys."
    G = check_qkv(q, k, v)
    sq, sk = q.shape[2], k.shape[2]
    is_causal = False
    # a decode query: its group of G heads as G queries of one KV head, which a mask per KV head serves as it is
    grouped = sq == 1 and G > 1 and (mask is None or mask.ndim == 4 and mask.shape[1] in (1, k.shape[1]))
    if mask is not None: mask = heads_mask(mask, k.shape[1] if grouped else q.shape[1])
    elif sk < sq: raise ValueError(f"a causal call needs at least as many keys as queries, got Sk={sk} < Sq={sq}")
    elif sq == sk: is_causal = sq > 1
    elif sq > 1: mask = causal_mask(sq, sk, q.device)
    if _meter() is not None: record_attended(attended_counts(mask, q.shape[0], q.shape[1], sq, sk))
    if grouped:
        B, Hkv, D = k.shape[0], k.shape[1], v.shape[-1]
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, G, q.shape[-1]), k, v, attn_mask=mask,
                                             dropout_p=dropout, scale=scale)
        return out.reshape(B, Hkv * G, 1, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                          scale=scale, enable_gqa=G > 1)


# %%
torch.manual_seed(0)
for (sq, sk), hkv in itertools.product([(1, 1), (1, 7), (5, 5), (3, 8)], (1, 2, 4)):  # groups of 4, 2 and 1
    q, k, v = torch.randn(2, 4, sq, 16), torch.randn(2, hkv, sk, 16), torch.randn(2, hkv, sk, 16)
    assert_close(dense_attention(q, k, v), _reference(q, k, v, causal_mask(sq, sk)[None, None]))
m = torch.rand(2, 2, 3, 8) > 0.4  # one mask per KV head, some rows fully masked
m[0, 1, 2] = False
q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
assert_close(dense_attention(q, k, v, m), _reference(q, k, v, heads_mask(m, 4)))
test_eq(dense_attention(q, k, v, m)[0, 2:4, 2].abs().max().item(), 0.0)  # fully masked row -> 0, never NaN
test_fail(lambda: dense_attention(q, k, v, m.float()), contains="boolean")
for h in (1, 2, 4):  # a decode query's mask: one for all heads, per KV head (grouped queries), per query head
    m1 = torch.rand(2, h, 1, 8) > 0.4
    m1[1, 0, 0] = False  # a fully masked row
    q1 = torch.randn(2, 4, 1, 16)
    assert_close(dense_attention(q1, k, v, m1), _reference(q1, k, v, heads_mask(m1, 4)))
    test_eq(dense_attention(q1, k, v, m1)[1, :4 // h].abs().max().item(), 0.0)
test_fail(lambda: dense_attention(torch.randn(2, 3, 3, 16), k, v), contains="must be a multiple of the KV heads")


# %% [markdown]
# The measured budget against brute force: the number of nonzero weights of the explicit softmax
# (float64, so no weight underflows), per query and head, for causal calls, per-KV-head masks and a
# fully masked row; outside `measure_attended()` nothing is recorded.

# %%
def _nonzero_weights(q, k, mask):
    "Brute force: per [B,Hq,Sq], how many keys get a nonzero softmax weight."
    logits = (q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2))
    return logits.masked_fill(~heads_mask(mask, q.shape[1]), float("-inf")).softmax(-1).nan_to_num().gt(0).sum(-1)

for sq, sk in [(1, 7), (5, 5), (3, 8)]:
    q, k, v = torch.randn(2, 4, sq, 16), torch.randn(2, 2, sk, 16), torch.randn(2, 2, sk, 16)
    with measure_attended() as meter: dense_attention(q, k, v)
    want = _nonzero_weights(q, k, causal_mask(sq, sk)[None, None])
    test_eq([r["max"] for r in meter.per_head()], want.amax((0, 2)).tolist())
    assert_close(torch.tensor([r["mean"] for r in meter.per_head()], dtype=torch.float64), want.double().mean((0, 2)))
q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
with measure_attended() as meter:
    dense_attention(q, k, v, m)
    dense_attention(q, k, v, m)
want = _nonzero_weights(q, k, m)
assert_close(torch.tensor([r["mean"] for r in meter.per_head()], dtype=torch.float64), want.double().mean((0, 2)))
test_eq((meter.max(), meter.per_head()[0]["queries"]), (int(want.max()), 2 * 2 * 3))
dense_attention(q, k, v, m)  # outside the block: not recorded
test_eq(meter.per_head()[0]["queries"], 12)
test_fail(lambda: AttendedBudget().mean(), contains="nothing was recorded")
test_fail(lambda: meter.max("decode"), contains="nothing was recorded in phase 'decode'")


# %% [markdown]
# ### Attention over a selected subset of keys
#
# Selection methods (QuoKA per prefill chunk, OVAL per decode step) choose, per KV head $h$, a
# set $I_h$ of key indices. Attending over the gathered keys $K_{I_h}$ equals attending over all
# keys with the selection as an extra mask, because softmax over a subset is softmax over the
# full row with the other logits at $-\infty$:
#
# $$\operatorname{softmax}\big(q K_{I}^\top/\sqrt d\big) V_{I}
#   = \operatorname{softmax}\big(q K^\top/\sqrt d + \log \mathbf 1_{I}\big) V .$$
#
# Gathering is what makes it fast: the cost is $O(|I|)$ per query instead of $O(S_k)$. The causal
# mask still applies to the gathered keys (a chunk's own keys are visible only to later queries of
# the chunk), so we gather the mask's columns along with the keys. Indices must be distinct
# (a repeated key would be counted twice). Their range and distinctness are content checks, read back from the
# device: in a patched model's step they run only under `sparsekv.attention.checks` (their shape and dtype always).

# %%
#| export
def _check_indices(idx: Tensor, k: Tensor):
    "Validate per-KV-head key indices `idx` [B,Hkv,n] against keys k [B,Hkv,Sk,D]."
    if idx.dtype != torch.long: raise TypeError(f"idx must be int64, got {idx.dtype}")
    if idx.ndim != 3 or idx.shape[:2] != k.shape[:2]:
        raise ValueError(f"idx must be [B,Hkv,n] = [{k.shape[0]},{k.shape[1]},n], got {tuple(idx.shape)}")
    if not content_checks() or not idx.numel(): return  # the per-step path reads no value back
    if idx.min() < 0 or idx.max() >= k.shape[2]: raise ValueError(f"idx must lie in [0, {k.shape[2]})")
    s = idx.sort(-1).values
    if (s[..., 1:] == s[..., :-1]).any(): raise ValueError("idx must not repeat a key within a head")


# %%
_kk = torch.zeros(1, 2, 5, 4)
_check_indices(torch.tensor([[[0, 4], [3, 1]]]), _kk)
test_fail(lambda: _check_indices(torch.tensor([[[0, 4], [3, 1]]]).int(), _kk), contains="idx must be int64")
test_fail(lambda: _check_indices(torch.tensor([[[0, 4]]]), _kk), contains="idx must be [B,Hkv,n] = [1,2,n]")
test_fail(lambda: _check_indices(torch.tensor([[[0, 5], [3, 1]]]), _kk), contains="idx must lie in [0, 5)")
test_fail(lambda: _check_indices(torch.tensor([[[0, 0], [3, 1]]]), _kk), contains="must not repeat")
with hot_path():  # in the per-step path: shapes and dtypes only, unless checks() is on
    _check_indices(torch.tensor([[[0, 0], [3, 9]]]), _kk)
    test_fail(lambda: _check_indices(torch.tensor([[[0, 4]]]), _kk), contains="idx must be [B,Hkv,n] = [1,2,n]")
    with checks(): test_fail(lambda: _check_indices(torch.tensor([[[0, 5], [3, 1]]]), _kk), contains="must lie in")


# %% [markdown]
# A chunk's own keys are the last `q_len` of the `k_len` keys, appended to each head's earlier ones:

# %%
#| export
def add_chunk_keys(idx: Tensor, k_len: int, q_len: int) -> Tensor:
    "Append to `idx` `[B,Hkv,n]` (earlier keys) the indices of the chunk's own keys, the last `q_len` of `k_len`."
    own = torch.arange(k_len - q_len, k_len, device=idx.device).expand(*idx.shape[:2], q_len)
    return torch.cat([idx, own], dim=-1)


# %%
test_eq(add_chunk_keys(torch.tensor([[[0, 2], [1, 3]]]), 7, 2), torch.tensor([[[0, 2, 5, 6], [1, 3, 5, 6]]]))
test_eq(add_chunk_keys(torch.zeros(1, 1, 0, dtype=torch.long), 3, 3), torch.tensor([[[0, 1, 2]]]))


# %% [markdown]
# Check against the explicit softmax under the selection mask, with and without an explicit mask; selecting every key
# is dense:

# %%
#| export
def attend_selected(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, mask: Tensor | None = None,
                    scale: float | None = None, dropout: float = 0.0) -> Tensor:
    "Attention `[B,Hq,Sq,D]` over only keys `idx` `[B,Hkv,n]` per KV head (gather, SDPA); `mask` per KV head or None."
    check_qkv(q, k, v)
    _check_indices(idx, k)
    sq, sk = q.shape[2], k.shape[2]
    if mask is None and sq == 1: sel = None  # one query, the last position: it sees every cached key
    elif mask is None: sel = idx[:, :, None, :] <= torch.arange(sk - sq, sk, device=idx.device)[:, None]
    else:
        if mask.dtype != torch.bool or mask.ndim != 4 or mask.shape[1] not in (1, k.shape[1]):
            raise ValueError(f"mask must be boolean [B,1 or Hkv,Sq,Sk], got {mask.dtype} {tuple(mask.shape)}")
        sel = mask.expand(idx.shape[0], k.shape[1], sq, sk).gather(3, idx[:, :, None, :].expand(-1, -1, sq, -1))
    return dense_attention(q, *gather_kv(k, v, idx), sel, scale, dropout)


# %%
torch.manual_seed(1)
# G = 3, chunk of 4 after 7 keys
q, k, v = torch.randn(2, 6, 4, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
earlier = torch.stack([torch.randperm(7)[:3] for _ in range(4)]).view(2, 2, 3)  # 3 earlier keys per KV head
idx = add_chunk_keys(earlier, 11, 4)
sel = torch.zeros(2, 2, 1, 11, dtype=torch.bool).scatter(3, idx[:, :, None], True)
assert_close(attend_selected(q, k, v, idx), _reference(q, k, v, heads_mask(sel & causal_mask(4, 11), 6)))
pad = torch.rand(2, 1, 4, 11) > 0.3  # an explicit (e.g. padding) mask is gathered with the keys
assert_close(attend_selected(q, k, v, idx, pad), _reference(q, k, v, heads_mask(sel & pad, 6)))
full = torch.arange(11).expand(2, 2, 11)
assert_close(attend_selected(q, k, v, full), dense_attention(q, k, v))  # selecting everything is dense
q1 = q[:, :, -1:]  # one decode query at the last position: every selected key is visible, no mask is built
assert_close(attend_selected(q1, k, v, earlier), _reference(q1, k, v, heads_mask(sel, 6) & (torch.arange(11) < 7)))
test_fail(lambda: attend_selected(q, k, v, torch.zeros(2, 2, 2, dtype=torch.long)), contains="must not repeat")
test_fail(lambda: attend_selected(q, k, v, idx + 11), contains="must lie in")


# %% [markdown]
# Rows of a padded batch may choose different numbers of keys (each row selects as if it ran alone, see
# below). `attend_chosen` takes the choice as a boolean `[B,Hkv,Sk]`: `chosen_indices` gathers the largest
# count per head, rows that chose fewer are filled up with unchosen keys, and the fillers are masked out, so
# each row attends to exactly its chosen keys:

# %%
#| export
def chosen_indices(chosen: Tensor) -> Tensor:
    "Indices [B,Hkv,n], ascending, of the chosen keys of `chosen` [B,Hkv,Sk] (bool), n the largest count, and fillers."
    n = int(chosen.sum(-1).max()) if chosen.numel() else 0
    # stable: the chosen keys first in index order, then the lowest unchosen ones fill rows that chose fewer
    return (~chosen).to(torch.uint8).argsort(dim=-1, stable=True)[..., :n].sort(-1).values


# %%
chosen = torch.rand(2, 2, 11, generator=torch.Generator().manual_seed(2)) > 0.5
chosen[1, 0] = False
chosen[1, 0, [2, 9]] = True  # one head chooses two keys only
idx = chosen_indices(chosen)
test_eq(idx.shape[-1], chosen.sum(-1).max().item())
test_eq({2, 9} <= set(idx[1, 0].tolist()), True)  # the two, then the lowest unchosen keys as fillers
test_eq(chosen.gather(2, idx).sum(-1), chosen.sum(-1))  # every chosen key is gathered


# %%
#| export
def attend_chosen(q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, mask: Tensor | None = None,
                  scale: float | None = None, dropout: float = 0.0) -> Tensor:
    "`attend_selected` over the keys `chosen` [B,Hkv,Sk] (bool; counts may differ per row) under `mask` (None: causal)."
    if chosen.dtype != torch.bool or chosen.shape != k.shape[:3]:
        raise ValueError(f"chosen must be boolean [B,Hkv,Sk] = {tuple(k.shape[:3])}, got {chosen.dtype} "
                         f"{tuple(chosen.shape)}")
    base = causal_mask(q.shape[2], k.shape[2], k.device)[None, None] if mask is None else mask
    return attend_selected(q, k, v, chosen_indices(chosen), base & chosen[:, :, None], scale, dropout)


# %%
assert_close(attend_chosen(q, k, v, chosen, pad), _reference(q, k, v, heads_mask(chosen[:, :, None] & pad, 6)))
causal_chosen = heads_mask(chosen[:, :, None] & causal_mask(4, 11), 6)
assert_close(attend_chosen(q, k, v, chosen), _reference(q, k, v, causal_chosen))
test_fail(lambda: attend_chosen(q, k, v, chosen.long()), contains="chosen must be boolean")


# %% [markdown]
# ## Policies
#
# A policy receives, for every attention call of every layer, the post-RoPE `q`, the cache's
# keys and values after the update, and an `AttentionContext`: the layer index, the step kind
# (`"prefill"` for a prompt chunk, `"decode"` for one new token after a cache), the cache
# positions of the queries and of the keys (per KV head: an evicting cache keeps different
# positions in different heads), the mask transformers built (None = causal), the softmax scale,
# the module (for `o_proj`, `num_key_value_groups`, ...), the prefill chunk index and the cache.
# It returns the attention output `[B,Hq,Sq,D]`.
#
# `AttentionPolicy` is dense by default; a method overrides `attend` (one rule), or only
# `prefill` or `decode`:
#
# - `MaskPolicy`: override `mask(q, k, v, ctx)` to return a boolean mask (KVpop during training);
# - `SelectionPolicy`: override `select(q, k, v, ctx)` to return key indices per KV head (QuoKA
#   per chunk, OVAL's pages at decode), a boolean `[B,Hkv,Sk]` of the chosen keys (rows may choose
#   different numbers), or None for dense.
#
# **Padded batches.** With left padding (as `generate` pads decoder-only prompts) the model's mask hides
# each row's padding keys from every query; `ctx.real_keys()` gives the keys that some query may see (None
# when nothing is hidden). A selection method must then choose for each row what it would choose with the row alone:
# score only its real keys, count its budget on them, anchor sinks at its first real token.
# `ctx.row_context(b, ...)` is the context of row `b` as if it ran unpadded.

# %% [markdown]
# A chunk of 2 queries after 3 keys, then a padded batch whose row 1 hides its first key:

# %%
#| export
@dataclass
class AttentionContext:
    "What a policy knows about one attention call besides q, k, v."
    layer_idx: int
    kind: str                    # "prefill" (a prompt chunk) or "decode" (one token after a cache)
    query_positions: Tensor      # [Sq] sequence positions of the queries
    key_positions: Tensor        # [B,Hkv,Sk] sequence positions of the keys, per KV head
    mask: Tensor | None          # boolean (True = attend), broadcastable to [B,Hkv,Sq,Sk]; None = causal
    scale: float
    module: nn.Module | None = None
    # prefill chunk within this `chunked_prefill` call (0 for a one-shot prefill, None at decode)
    chunk_index: int | None = None
    cache: Cache | None = None
    dropout: float = 0.0
    # the batch row this context describes on its own (a padded batch, row by row); None: the whole batch
    row: int | None = None
    # the mask is known on the host to hide keys by causality alone (no padding, no sliding window)
    causal_only: bool = False

    @property
    def past_len(self) -> int:
        "Number of keys before this call's own keys."
        return self.key_positions.shape[-1] - self.query_positions.shape[0]

    @property
    def cache_layer(self):
        "This layer's cache layer, or None without a cache."
        if self.cache is None or self.layer_idx >= len(self.cache.layers): return None
        return self.cache.layers[self.layer_idx]


# %%
_ctx = AttentionContext(layer_idx=0, kind="prefill", query_positions=torch.arange(3, 5),
                        key_positions=torch.arange(5).expand(2, 2, 5), mask=None, scale=0.25)
test_eq((_ctx.chunk_index, _ctx.cache, _ctx.row, _ctx.causal_only), (None, None, None, False))
test_eq((_ctx.past_len, _ctx.cache_layer), (3, None))


# %%
#| export
@patch_to(AttentionContext)
def full_mask(self) -> Tensor:
    "The mask as a tensor (the causal mask when `mask` is None), broadcastable to [B,Hkv,Sq,Sk]."
    if self.mask is not None: return self.mask
    return causal_mask(self.query_positions.shape[0], self.key_positions.shape[-1],
                       self.key_positions.device)[None, None]


# %%
test_eq(_ctx.full_mask(), causal_mask(2, 5)[None, None])
_pm = torch.ones(2, 1, 2, 5, dtype=torch.bool)
_pm[1, ..., 0] = False
_pctx = AttentionContext(0, "prefill", torch.arange(3, 5), torch.arange(5).expand(2, 2, 5), _pm, 0.25)
test_eq(_pctx.full_mask(), _pm)


# %%
#| export
@patch_to(AttentionContext)
def real_keys(self) -> Tensor | None:
    """Boolean [B,Sk]: the keys some query may see (not padding); None when every key is seen (nothing padded;
    known without reading the mask when `causal_only`)."""
    if self.mask is None or self.causal_only or isinstance(self.cache_layer, EvictingLayer): return None
    real = self.mask.any(-2).any(1).expand(self.key_positions.shape[0], -1)
    return None if bool(real.all()) else real


# %%
test_eq(_ctx.real_keys(), None)
test_eq(_pctx.real_keys(), torch.tensor([[True] * 5, [False] + [True] * 4]))
_causal = AttentionContext(0, "prefill", torch.arange(3, 5), torch.arange(5).expand(2, 2, 5),
                           causal_mask(2, 5)[None, None], 0.25)
test_eq(_causal.real_keys(), None)                       # read from the mask: every key is seen
test_eq(dataclasses.replace(_causal, causal_only=True).real_keys(), None)  # known on the host: nothing read


# %% [markdown]
# Row 1 alone has 4 real keys, numbered from 0, of which its 2 queries are the last:

# %%
#| export
@patch_to(AttentionContext)
def row_context(self, b: int, n_keys: int, n_queries: int) -> AttentionContext:
    """The context of row `b` alone, as if run unpadded: its `n_keys` real keys numbered from 0, the last
    `n_queries` of them this call's queries; causal (no mask), no cache."""
    pos = torch.arange(n_keys, device=self.key_positions.device)
    return AttentionContext(layer_idx=self.layer_idx, kind=self.kind, query_positions=pos[n_keys - n_queries:],
                            key_positions=pos.expand(1, self.key_positions.shape[1], n_keys), mask=None,
                            scale=self.scale, module=self.module, chunk_index=self.chunk_index,
                            dropout=self.dropout, row=b)


# %%
_r = _pctx.row_context(1, 4, 2)
test_eq((_r.row, _r.kind, _r.mask, _r.scale, _r.query_positions.tolist()), (1, "prefill", None, 0.25, [2, 3]))
test_eq(_r.key_positions, torch.arange(4).expand(1, 2, 4))


# %% [markdown]
# The base policy routes prefill and decode to `attend`, exact attention under the context's mask; a policy may
# override one of the two (here decode, as a marker):

# %%
#| export
class AttentionPolicy:
    "Base class of attention policies: the output `[B,Hq,Sq,D]` of each attention call; dense unless overridden."
    # True: the policy masks an evicting cache's prefill chunks itself (`ctx.mask` is then None; see `_context`)
    masks_chunks = False

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        return self.decode(q, k, v, ctx) if ctx.kind == "decode" else self.prefill(q, k, v, ctx)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        "Attention for a prefill chunk (defaults to `attend`)."
        return self.attend(q, k, v, ctx)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        "Attention for one decoded token (defaults to `attend`)."
        return self.attend(q, k, v, ctx)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        "Exact attention under the context's mask."
        return dense_attention(q, k, v, ctx.mask, ctx.scale, ctx.dropout)


# %%
class _DecodeMarker(AttentionPolicy):
    def decode(self, q, k, v, ctx): return torch.zeros_like(q)

_q, _k, _v = torch.randn(2, 4, 2, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
test_eq(AttentionPolicy()(_q, _k, _v, _ctx), dense_attention(_q, _k, _v, None, 0.25))
test_eq(_DecodeMarker()(_q, _k, _v, _ctx), dense_attention(_q, _k, _v, None, 0.25))        # a prefill call
_dctx = AttentionContext(0, "decode", torch.tensor([4]), torch.arange(5).expand(2, 2, 5), None, 0.25)
test_eq(_DecodeMarker()(_q[:, :, :1], _k, _v, _dctx), torch.zeros(2, 4, 1, 8))


# %%
#| export
class DensePolicy(AttentionPolicy):
    "Exact causal attention: what the unpatched model computes."


# %%
assert_close(DensePolicy()(_q, _k, _v, _pctx), _reference(_q, _k, _v, heads_mask(_pm, 4), 0.25))


# %% [markdown]
# A mask policy attends under its mask and the context's (here: every other key, and row 1's padding):

# %%
#| export
class MaskPolicy(AttentionPolicy):
    "Attention under an extra boolean mask `mask(q, k, v, ctx)` (1, Hkv or Hq heads) and the context's mask."

    def mask(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        "Boolean mask broadcastable to [B,H,Sq,Sk] (True = attend)."
        raise NotImplementedError(f"{type(self).__name__} must implement mask(q, k, v, ctx)")

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        hq = q.shape[1]
        m = heads_mask(self.mask(q, k, v, ctx), hq) & heads_mask(ctx.full_mask(), hq)
        return dense_attention(q, k, v, m, ctx.scale, ctx.dropout)


# %%
class _EveryOther(MaskPolicy):
    def mask(self, q, k, v, ctx): return (torch.arange(k.shape[2]) % 2 == 0)[None, None, None]

_want = _reference(_q, _k, _v, heads_mask(_pm & (torch.arange(5) % 2 == 0), 4), 0.25)
assert_close(_EveryOther()(_q, _k, _v, _pctx), _want)
test_fail(lambda: MaskPolicy()(_q, _k, _v, _pctx), contains="must implement mask")


# %% [markdown]
# A selection policy attends over the indices it returns (`attend_selected`), a boolean choice (`attend_chosen`), or
# densely for None:

# %%
#| export
class SelectionPolicy(AttentionPolicy):
    "Attention over the keys `select(q, k, v, ctx)` picks per KV head (`[B,Hkv,n]`), or dense when it returns None."

    def select(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor | None:
        "Indices `[B,Hkv,n]` of the keys to attend to (include the chunk's own keys, see `add_chunk_keys`)."
        raise NotImplementedError(f"{type(self).__name__} must implement select(q, k, v, ctx)")

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        idx = self.select(q, k, v, ctx)
        if idx is None: return super().attend(q, k, v, ctx)
        if idx.dtype == torch.bool: return attend_chosen(q, k, v, idx, ctx.mask, ctx.scale, ctx.dropout)
        return attend_selected(q, k, v, idx, ctx.mask, ctx.scale, ctx.dropout)


# %%
class _Fixed(SelectionPolicy):
    def __init__(self, out): self.out = out
    def select(self, q, k, v, ctx): return self.out

_idx = torch.tensor([0, 2, 4]).expand(2, 2, 3)
assert_close(_Fixed(_idx)(_q, _k, _v, _ctx), attend_selected(_q, _k, _v, _idx, None, 0.25))
_ch = torch.rand(2, 2, 5, generator=torch.Generator().manual_seed(0)) > 0.5
assert_close(_Fixed(_ch)(_q, _k, _v, _ctx), attend_chosen(_q, _k, _v, _ch, None, 0.25))
test_eq(_Fixed(None)(_q, _k, _v, _ctx), dense_attention(_q, _k, _v, None, 0.25))
test_fail(lambda: SelectionPolicy()(_q, _k, _v, _ctx), contains="must implement select")

# %% [markdown]
# ## `patch`: routing a model's attention to a policy
#
# `transformers` looks attention functions up by name, per call, in `ALL_ATTENTION_FUNCTIONS`,
# and mask builders in `ALL_MASK_ATTENTION_FUNCTIONS`. We register one function, `"sparsekv"`,
# once, with the SDPA mask builder (so the model builds boolean masks, and none at all when plain
# causal attention suffices). The function finds the policy through the calling module in a
# registry that `patch` fills, so differently patched models (a teacher and a student) coexist.
#
# Two things the attention function is not given are the cache and the query positions.
# A forward pre-hook on each attention module records them just before the call: the cache from
# its keyword arguments (`past_key_values`) and, since the model passes no positions to the cache
# any more, the number of tokens the layer has seen before the call (`get_seq_length` of that
# layer: an evicting layer counts tokens seen, not kept). The queries are the tokens that follow.
#
# `patch` sets the attention implementation with `model.set_attn_implementation`, which
# propagates to sub-models, and restores every config's previous value on exit, even when the
# block raises.
#
# Inside the block, `generate` with a cache that already holds every token of `input_ids` (a cache
# reused for a new prompt, or one that `chunked_prefill` filled with the whole prompt) has no token
# left to feed, and `transformers` fails on an empty index deep inside. `patch` wraps the model's
# `prepare_inputs_for_generation` for the block to say what to do instead.

# %%
#| export
ATTN_NAME = "sparsekv"


class _Patch:
    "State of one `patch` context: the policy and what the hooks recorded."
    def __init__(self, policy: AttentionPolicy):
        self.policy, self.kind, self.chunk_index, self.calls = policy, None, None, {}
        # causal_only: the model is called without padding (chunked_prefill's unpadded loop); steps: open hot paths
        self.causal_only, self.steps = False, []
        # the positions of the last plain-cache call: every layer of a step has the same, built once a step
        self.positions = (None, None)


_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> stack of _Patch

# %%
_st = _Patch(_DecodeMarker())
test_eq((type(_st.policy), _st.kind, _st.chunk_index, _st.calls), (_DecodeMarker, None, None, {}))
test_eq((_st.causal_only, _st.steps, _st.positions), (False, [], (None, None)))
test_eq(len(_ACTIVE), 0)                                                   # nothing patched yet


# %% [markdown]
# The attention modules of the tiny test model (two layers), and its configs:

# %%
#| export
def attention_modules(model: nn.Module) -> list[nn.Module]:
    "The self-attention modules of `model` (those with a `layer_idx` and an `o_proj`)."
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not mods:
        raise ValueError(f"found no attention module (with `layer_idx` and `o_proj`) in {type(model).__name__}")
    return mods


# %%
model, _ = load_model("tiny-llama")
test_eq([m.layer_idx for m in attention_modules(model)], list(range(model.config.num_hidden_layers)))
test_fail(lambda: attention_modules(nn.Linear(2, 2)), contains="found no attention module")


# %%
#| export
def _configs(model: PreTrainedModel) -> list:
    "Every config of `model`: its own, its sub-configs and those of its sub-models."
    seen, todo = {}, [model.config] + [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen: continue
        seen[id(c)] = c
        todo += [getattr(c, key, None) for key in getattr(c, "sub_configs", {})]
    return list(seen.values())


# %%
_cfgs = _configs(model)
assert any(c is model.config for c in _cfgs) and len({id(c) for c in _cfgs}) == len(_cfgs)


# %% [markdown]
# Without padding, `transformers` masks a full-attention layer by causality alone; a layer with a sliding window
# (or attention in chunks) hides old keys too. Which one a layer is, the model's config says:

# %%
#| export
def _plain_causal(module) -> bool:
    "Whether an attention module's layer is masked by causality alone when nothing is padded (no window, no chunks)."
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    if types is not None: return types[module.layer_idx] == "full_attention"
    return getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None


# %%
assert _plain_causal(attention_modules(model)[0])  # the tiny Llama: no layer types, no window
_lt = SimpleNamespace(layer_idx=1, config=SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))
assert not _plain_causal(_lt) and _plain_causal(SimpleNamespace(layer_idx=0, config=_lt.config))
assert not _plain_causal(SimpleNamespace(layer_idx=0, config=SimpleNamespace(sliding_window=4096)))  # Mistral's way


# %% [markdown]
# The context of a call: a prefill of 3 tokens without a cache, then a decode query after 5 tokens the layer saw;
# a mask that is not boolean is refused.

# %%
#| export
def _plain_positions(state: _Patch, seen: int, B: int, hkv: int, sk: int, sq: int, device) -> tuple[Tensor, Tensor]:
    """Query positions [Sq] and key positions [B,Hkv,Sk] of a plain cache's call: its keys sit at consecutive
    positions ending with the queries' (one arange serves both); the same for every layer of a step, so built once."""
    key = (seen, B, hkv, sk, sq, device)
    if torch.compiler.is_compiling() or state.positions[0] != key:  # traced: lengths are symbols, nothing to keep
        pos = torch.arange(seen + sq - sk, seen + sq, device=device)
        state.positions = (key, (pos[sk - sq:], pos.expand(B, hkv, sk)))
    return state.positions[1]


# %%
_stp = _Patch(DensePolicy())
_qp, _kp = _plain_positions(_stp, 5, 2, 3, 6, 1, "cpu")
test_eq((_qp, _kp), (torch.tensor([5]), torch.arange(6).expand(2, 3, 6)))
assert _plain_positions(_stp, 5, 2, 3, 6, 1, "cpu")[1] is _kp              # the next layer of the step: kept
test_eq(_plain_positions(_stp, 6, 2, 3, 7, 1, "cpu")[0], torch.tensor([6]))  # the next step: built anew
test_eq(_plain_positions(_stp, 0, 1, 3, 4, 4, "cpu")[1], torch.arange(4).expand(1, 3, 4))  # a prefill


# %%
#| export
def _context(module, query, key, attention_mask, state: _Patch, scaling, dropout) -> AttentionContext:
    "Build the policy's context for one call of `module`."
    cache, seen = state.calls.pop(module, (None, None))
    B, hkv, sk = key.shape[:3]
    sq, idx = query.shape[2], module.layer_idx
    if seen is None: seen = sk - sq  # no cache: the keys are this call's own
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise TypeError(f"{ATTN_NAME} attention needs a boolean mask, got {attention_mask.dtype}")
        if attention_mask.shape[-1] != sk:
            raise ValueError(f"the model's mask covers {attention_mask.shape[-1]} keys but layer {idx} returned {sk}: "
                             "all layers of a cache must hold the same number of entries")
    layer = cache.layers[idx] if cache is not None and idx < len(cache.layers) else None
    evicting = isinstance(layer, EvictingLayer)
    if not evicting and sk > seen + sq:  # slots not written yet would be read as keys at the wrong positions
        raise ValueError(f"layer {idx}'s cache returned {sk} key slots for {seen + sq} tokens: a preallocated cache "
                         "(transformers' StaticCache, cache_implementation='static') is not supported under "
                         "sparsekv.hf.patch; use a dynamic cache or the method's own (Method.generate, with "
                         "compile=True for a compiled decode)")
    if evicting: query_positions = torch.arange(seen, seen + sq, device=key.device)
    else: query_positions, key_positions = _plain_positions(state, seen, B, hkv, sk, sq, key.device)
    # one query after earlier tokens decodes, even when an evicting cache keeps only itself (no device sync)
    kind = state.kind or ("decode" if sq == 1 and (sk > 1 or evicting and layer.seen > 1) else "prefill")
    mask = attention_mask
    # known on the host: no padding, and this layer's mask is causal (`AttentionContext.real_keys` reads nothing)
    causal_only = state.causal_only and mask is not None and _plain_causal(module)
    if evicting:
        if mask is not None and not causal_only and not (mask == causal_mask(sq, sk, key.device)).all():
            raise ValueError("evicting caches support unpadded batches of full-attention layers only: the model's "
                             "mask hides keys (padding?); generate each prompt alone or batch prompts of equal length")
        key_positions = layer.positions
        # a decode query sees every kept entry by construction (see `EvictionRule.keep`); a chunk's mask, unless the
        # policy builds its own (FlexAttention needs none as a tensor)
        own = getattr(state.policy, "masks_chunks", False)
        mask = layer.rule.visible(layer, query_positions) if sq > 1 and not own else None
    chunk_index = state.chunk_index if state.chunk_index is not None else (0 if kind == "prefill" else None)
    return AttentionContext(layer_idx=idx, kind=kind, query_positions=query_positions, key_positions=key_positions,
                            mask=mask, scale=scaling if scaling is not None else key.shape[-1] ** -0.5, module=module,
                            chunk_index=chunk_index, cache=cache, dropout=dropout, causal_only=causal_only)


# %%
_a0 = attention_modules(model)[0]
_hd = model.config.hidden_size // model.config.num_attention_heads
_st = _Patch(DensePolicy())
_c = _context(_a0, torch.randn(2, 4, 3, _hd), torch.randn(2, 2, 3, _hd), None, _st, None, 0.0)
test_eq((_c.kind, _c.chunk_index, _c.query_positions.tolist(), _c.scale), ("prefill", 0, [0, 1, 2], _hd ** -0.5))
test_eq(_c.key_positions, torch.arange(3).expand(2, 2, 3))
_st.calls[_a0] = (None, 5)
_c = _context(_a0, torch.randn(2, 4, 1, _hd), torch.randn(2, 2, 6, _hd), None, _st, 0.5, 0.0)
test_eq((_c.kind, _c.chunk_index, _c.query_positions.tolist(), _c.scale), ("decode", None, [5], 0.5))
test_fail(lambda: _context(_a0, torch.randn(1, 4, 2, _hd), torch.randn(1, 2, 2, _hd), torch.ones(1, 1, 2, 2), _st,
                           None, 0.0), contains="needs a boolean mask")


# %% [markdown]
# The attention function `transformers` calls refuses to run outside `patch`, and is registered under `ATTN_NAME`:

# %%
#| export
def _sparsekv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    "The attention function `ATTN_NAME`: builds the context, calls the policy, returns `([B,Sq,Hq,D], None)`."
    stack = _ACTIVE.get(module)
    if not stack:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} is set but this model is not inside "
                           "sparsekv.hf.patch(model, policy)")
    state = stack[-1]
    ctx = _context(module, query, key, attention_mask, state, scaling, dropout)
    # measure_attended records per phase and layer
    token = _WHERE.set((ctx.kind, ctx.layer_idx)) if _meter() is not None else None
    try: out = state.policy(query, key, value, ctx)
    finally:
        if token is not None: _WHERE.reset(token)
    record_stored(key, value, ctx.kind, ctx.layer_idx)  # before an eviction: the most this call held
    if out.shape != query.shape[:3] + value.shape[-1:]:
        raise ValueError(f"{type(state.policy).__name__} returned shape {tuple(out.shape)}, expected [B,Hq,Sq,D] = "
                         f"{tuple(query.shape[:3] + value.shape[-1:])}")
    if isinstance(ctx.cache_layer, EvictingLayer): ctx.cache_layer.evict()  # after attention: rules may use its scores
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, _sparsekv_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)

# %%
assert AttentionInterface._global_mapping[ATTN_NAME] is _sparsekv_attention
test_fail(lambda: _sparsekv_attention(_a0, torch.randn(1, 4, 2, _hd), torch.randn(1, 2, 2, _hd),
                                      torch.randn(1, 2, 2, _hd), None), contains="not inside sparsekv.hf.patch")


# %%
#| export
def _checked_prepare(prepare):
    "Wrap `prepare_inputs_for_generation`: refuse, clearly, a cache that already holds every token of `input_ids`."
    def wrapped(input_ids, *args, **kwargs):
        # generate feeds input_ids[:, -n:] with n = len(input_ids) - tokens cached: with n <= 0 it would feed all of
        # them (-0) or the wrong tail
        cache, n = kwargs.get("past_key_values"), kwargs.get("next_sequence_length")
        if cache is not None and n is not None and n <= 0:
            raise ValueError(
                f"past_key_values already holds {cache.get_seq_length()} tokens and input_ids {input_ids.shape[1]}: "
                "generate has no new token to feed. To generate after chunked_prefill, prefill all but the last "
                "prompt token (chunked_prefill(model, ids[:, :-1], ...)) and pass the whole prompt, or call "
                "Method.generate(model, ids), which does both; for a new prompt, pass a fresh cache (each "
                "Method.patch block yields one)")
        return prepare(input_ids, *args, **kwargs)
    return wrapped


# %%
_w = _checked_prepare(lambda input_ids, *a, **kw: "fed")
test_eq(_w(torch.ones(1, 3), past_key_values=DynamicCache(), next_sequence_length=1), "fed")
test_eq(_w(torch.ones(1, 3)), "fed")
test_fail(lambda: _w(torch.ones(1, 3), past_key_values=DynamicCache(), next_sequence_length=0),
          contains="generate has no new token to feed")


# %% [markdown]
# The hook records the cache and the tokens the layer saw: none without a cache, 0 for an empty one:

# %%
#| export
def _record_call(state: _Patch):
    "Forward pre-hook recording an attention module's cache and the tokens its layer saw before the call."
    def hook(module, args, kwargs):
        cache, idx = kwargs.get("past_key_values"), module.layer_idx
        # (a cache may also hold evicting layers among others: `sparsekv.methods.HandoffCache`)
        layer = cache.layer(idx) if isinstance(cache, EvictingCache) else (
            cache.layers[idx] if isinstance(cache, Cache) and idx < len(cache.layers) else None)
        seen = None if not isinstance(cache, Cache) else layer.get_seq_length() if layer is not None else 0
        state.calls[module] = (cache, seen)
        if isinstance(layer, EvictingLayer): layer.arm()
        _open_step(state)
    return hook


def _open_step(state: _Patch) -> None:
    "Enter the per-step path (no content checks, see `checks`) until the forward hook of the call closes it."
    if torch.compiler.is_compiling(): return  # a compiled step runs no content check: nothing to open (`hot_path`)
    step = hot_path()
    step.__enter__()
    state.steps.append(step)


def _end_call(state: _Patch):
    "Forward hook (called also when the call raises) closing the per-step path its pre-hook opened."
    def hook(module, args, output):
        if state.steps and not torch.compiler.is_compiling(): state.steps.pop().__exit__(None, None, None)
    return hook


# %%
_st = _Patch(DensePolicy())
_record_call(_st)(_a0, (), {"past_key_values": None})
test_eq(_st.calls[_a0], (None, None))
_dc = DynamicCache()
_record_call(_st)(_a0, (), {"past_key_values": _dc})
test_eq(_st.calls[_a0], (_dc, 0))
test_eq(len(_st.steps), 2)
assert not content_checks()  # inside the layer's call: the per-step path
_end_call(_st)(_a0, (), None); _end_call(_st)(_a0, (), None); _end_call(_st)(_a0, (), None)  # one more: no-op
assert content_checks() and not _st.steps


# %% [markdown]
# A dense policy must reproduce the unpatched model, and leaving the block must give the model
# back as it was, also after an exception:

# %%
#| export
@contextlib.contextmanager
def patch(model: PreTrainedModel, policy: AttentionPolicy):
    "Route every attention call of `model` to `policy` inside the block; restore the attention implementation on exit."
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(policy, AttentionPolicy):
        raise TypeError(f"policy must be an AttentionPolicy, got {type(policy).__name__}")
    modules, state = attention_modules(model), _Patch(policy)
    saved = [(c, c._attn_implementation_internal) for c in _configs(model)]
    hooks, own_prepare = [], model.__dict__.get("prepare_inputs_for_generation")
    try:
        model.prepare_inputs_for_generation = _checked_prepare(model.prepare_inputs_for_generation)
        # the model's call (a decode step, a prefill chunk) and each attention call in it: the per-step path
        hooks.append(model.register_forward_pre_hook(lambda module, args: _open_step(state)))
        hooks.append(model.register_forward_hook(_end_call(state), always_call=True))
        for m in modules:
            _ACTIVE.setdefault(m, []).append(state)
            hooks.append(m.register_forward_pre_hook(_record_call(state), with_kwargs=True))
            hooks.append(m.register_forward_hook(_end_call(state), always_call=True))
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            raise ValueError(f"{type(model).__name__} does not support a custom attention function "
                             "(AttentionInterface)")
        yield model
    finally:
        while state.steps: state.steps.pop().__exit__(None, None, None)  # a call cut short (KeyboardInterrupt)
        if own_prepare is None: model.__dict__.pop("prepare_inputs_for_generation", None)
        else: model.prepare_inputs_for_generation = own_prepare
        for h in hooks: h.remove()
        for m in modules:
            stack = _ACTIVE.get(m, [])
            if state in stack: stack.remove(state)
            if not stack: _ACTIVE.pop(m, None)
        for c, impl in saved: c._attn_implementation_internal = impl


# %%
ids = torch.randint(3, 259, (2, 13), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ref = model(ids).logits
    impl = model.config._attn_implementation
    with patch(model, DensePolicy()):
        test_eq(model.config._attn_implementation, ATTN_NAME)
        assert_close(model(ids).logits, ref, atol=1e-5, rtol=0)
    test_eq(model.config._attn_implementation, impl)
    assert_close(model(ids).logits, ref, atol=0, rtol=0)

    def _boom():
        with patch(model, DensePolicy()): raise RuntimeError("stop")
    test_fail(_boom, contains="stop")
    test_eq(model.config._attn_implementation, impl)
    test_eq(len(_ACTIVE), 0)
    test_eq(sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()), 0)


# %% [markdown]
# Each call of the patched model (the cache's work before the layers included) and each of its attention calls is the
# per-step path: the policy runs without content checks (`sparsekv.attention.checks` turns them on), and they are
# back after the call, also when it raises:

# %%
class _Checks(DensePolicy):
    "Record whether content checks run inside each attention call; fail on request."
    def __init__(self, fail=False): self.seen, self.fail = [], fail
    def attend(self, q, k, v, ctx):
        self.seen.append(content_checks())
        if self.fail: raise RuntimeError("stop")
        return super().attend(q, k, v, ctx)


with torch.no_grad():
    with patch(model, _pc := _Checks()):
        model(ids)
        with checks(): model(ids)
        assert content_checks()
    test_eq(_pc.seen, [False] * 2 + [True] * 2)
    with patch(model, _Checks(fail=True)): test_fail(lambda: model(ids), contains="stop")
    assert content_checks()
    with patch(model, DensePolicy()), patch(model, _pc := _Checks()): model(ids)  # nested: hooks of both patches
    test_eq(_pc.seen, [False] * 2)
    assert content_checks()


# %%
#| export
def active_patch(model: nn.Module) -> _Patch | None:
    "The innermost `patch` state of `model`, or None when it is not patched."
    stack = _ACTIVE.get(attention_modules(model)[0])
    return stack[-1] if stack else None


# %%
test_eq(active_patch(model), None)
_p1, _p2 = DensePolicy(), DensePolicy()
with patch(model, _p1):
    assert active_patch(model).policy is _p1
    with patch(model, _p2): assert active_patch(model).policy is _p2   # the innermost
    assert active_patch(model).policy is _p1
test_eq(active_patch(model), None)


# %% [markdown]
# The context carries what methods need. A recording policy shows it for a prefill of 5
# tokens followed by one decode step with a `DynamicCache`:

# %%
class _Recorder(AttentionPolicy):
    def __init__(self): self.seen = []
    def attend(self, q, k, v, ctx):
        self.seen.append((ctx.layer_idx, ctx.kind, ctx.chunk_index, ctx.query_positions.tolist(),
                          ctx.key_positions.shape, ctx.past_len))
        return super().attend(q, k, v, ctx)

rec = _Recorder()
with torch.no_grad(), patch(model, rec):
    out = model(ids[:, :5], use_cache=True)
    model(ids[:, 5:6], past_key_values=out.past_key_values)
test_eq(rec.seen, [(0, "prefill", 0, [0, 1, 2, 3, 4], (2, 2, 5), 0), (1, "prefill", 0, [0, 1, 2, 3, 4], (2, 2, 5), 0),
                   (0, "decode", None, [5], (2, 2, 6), 5), (1, "decode", None, [5], (2, 2, 6), 5)])


# %% [markdown]
# ## Chunked prefill
#
# QuoKA processes a prompt in chunks of $B_{CP}$ tokens: chunk $c$ has queries at positions
# $cB_{CP}, \dots, (c+1)B_{CP}-1$ and attends to the cache of earlier chunks plus its own keys.
# Each call passes the cache and the chunk's true positions as `position_ids` (RoPE); the cache
# knows where the chunk starts (the tokens it has seen). Only the last position's logits are computed (`logits_to_keep=1`): a prompt of
# 8k tokens would otherwise materialize `[8k, vocab]` logits per chunk.
#
# To continue with `generate`, prefill all but the last prompt token and pass the cache: generate
# feeds the unprocessed tail of `input_ids` (here, the last token) and continues from the cache. A
# cache that holds the whole prompt leaves generate nothing to feed (inside `patch` that is a clear
# error). **The one-call way is `Method.generate(model, ids, ...)`** (below, and `sparsekv.methods`):
# it prefills all but the last token in chunks under the method's policy, then generates.
#
# **Padded batches.** `attention_mask` `[B,S]` (1 = token, 0 = padding, padding on the left as
# `generate` uses for decoder-only models) makes each padded row compute what it computes alone. As in
# `transformers`, each row's positions are the running count of its tokens minus one
# (`attention_mask.cumsum(-1) - 1`), and each chunk passes the mask of everything seen so far, so the
# model hides the padding keys. One more thing decides what a chunked method computes: where its chunks
# start. Alone, a row's chunks start at its first token; in the batch, chunk boundaries fall every
# `chunk_size` columns. So rows whose padding leaves the same remainder modulo `chunk_size` are
# prefilled together, from the first column that is not padding in all of them (the columns before are
# padding, kept as zeros), and the caches are joined row by row into one. Only an empty cache can take a
# padded prompt; evicting caches take unpadded batches only.

# %% [markdown]
# Checks: an empty batch (no row, or no token) and ids outside the vocabulary are refused by name.

# %%
#| export
def check_input_ids(model: PreTrainedModel, input_ids: Tensor) -> Tensor:
    "`input_ids` if it is a non-empty int64 tensor [B,S] (B, S >= 1) of token ids of `model`'s vocabulary."
    if (not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.dtype != torch.long
            or 0 in input_ids.shape):
        got = (f"{input_ids.dtype} of shape {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"input_ids must be a non-empty int64 tensor [B,S] (at least one row and one token), "
                         f"got {got}")
    emb = model.get_input_embeddings()
    V = emb.num_embeddings if emb is not None else model.config.vocab_size
    lo, hi = input_ids.aminmax()
    if bool((lo < 0) | (hi >= V)):  # one read per prompt, before any chunk is queued
        raise ValueError(f"input_ids must be token ids in [0, {V}) (the model's vocabulary), got ids from {int(lo)} "
                         f"to {int(hi)}")
    return input_ids


# %%
test_eq(check_input_ids(model, ids), ids)
test_fail(lambda: check_input_ids(model, torch.zeros(0, 5, dtype=torch.long)), contains="shape (0, 5)")
test_fail(lambda: check_input_ids(model, torch.zeros(1, 0, dtype=torch.long)), contains="at least one row and one")
test_fail(lambda: check_input_ids(model, torch.tensor([[1, 10**6]])), contains="the model's vocabulary")


# %% [markdown]
# A left-padded mask gives each row's padding, and a mask padded on the right is refused:

# %%
#| export
def left_padding(attention_mask: Tensor | None, input_ids: Tensor) -> Tensor | None:
    "Padding tokens per row [B] of a left-padded 0/1 `attention_mask` [B,S], or None when nothing is padded."
    if attention_mask is None: return None
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a tensor [B,S] = {tuple(input_ids.shape)} like input_ids, got "
                         f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else attention_mask!r}")
    if attention_mask.is_floating_point() or not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold integers or booleans, 0 (padding) and 1 (token)")
    m = attention_mask.bool()
    pads = (~m).sum(-1)
    if not torch.equal(m, torch.arange(m.shape[1], device=m.device) >= pads[:, None]):
        raise ValueError("attention_mask must pad on the left (0s before the tokens of each row), as generate pads "
                         "decoder-only prompts")
    return pads if bool(pads.any()) else None


# %%
_m = torch.tensor([[0, 0, 1], [1, 1, 1]])
test_eq(left_padding(_m, torch.ones_like(_m)).tolist(), [2, 0])
test_fail(lambda: left_padding(_m.flip(1), torch.ones_like(_m)), contains="pad on the left")


# %% [markdown]
# With no policy, the patch context above patches densely, or keeps an active patch and gives its phase back on exit:

# %%
#| export
@contextlib.contextmanager
def _patched(model: PreTrainedModel, policy: AttentionPolicy | None):
    "Patch with `policy`; with None keep an active patch or patch densely. Yields the patch state."
    if policy is None and active_patch(model) is not None:
        state = active_patch(model)
        saved = state.kind, state.chunk_index, state.causal_only
        try: yield state
        finally: state.kind, state.chunk_index, state.causal_only = saved
    else:
        with patch(model, policy or DensePolicy()): yield active_patch(model)


# %%
with _patched(model, None) as _s: assert isinstance(_s.policy, DensePolicy) and active_patch(model) is _s
test_eq(active_patch(model), None)
with patch(model, _p1):
    with _patched(model, None) as _s:
        assert _s.policy is _p1
        _s.kind = "prefill"
    test_eq(active_patch(model).kind, None)


# %% [markdown]
# The chunk loop gives the last logits of the whole prompt, for any chunk size:

# %%
#| export
def _prefill_chunks(model: PreTrainedModel, input_ids: Tensor, chunk_size: int, policy: AttentionPolicy | None,
                    cache: Cache, attention_mask: Tensor | None = None) -> Tensor:
    "The chunk loop of `chunked_prefill` (one grid of chunks for all rows): fills `cache`, returns last logits [B,V]."
    B, S = input_ids.shape
    start = cache.get_seq_length()
    if attention_mask is not None:  # positions as transformers computes them: tokens before, minus one
        mask = attention_mask.long()
        row_pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad(), _patched(model, policy) as state:
        state.kind, state.causal_only = "prefill", attention_mask is None  # unpadded: masks by causality alone
        for c, a in enumerate(range(0, S, chunk_size)):
            state.chunk_index, e = c, min(a + chunk_size, S)
            pos = torch.arange(start + a, start + e, device=input_ids.device)
            rows = (dict(position_ids=pos.expand(B, -1)) if attention_mask is None
                    else dict(position_ids=row_pos[:, a:e], attention_mask=mask[:, :e]))
            out = model(input_ids=input_ids[:, a:e], past_key_values=cache, use_cache=True, logits_to_keep=1, **rows)
    return out.logits[:, -1]


# %%
with torch.no_grad(): full = model(ids).logits[:, -1]
for _cs in (3, 13):
    _cache = GrowingCache(config=model.config)
    assert_close(_prefill_chunks(model, ids, _cs, None, _cache), full, atol=1e-5, rtol=0)
    test_eq(_cache.get_seq_length(), 13)


# %% [markdown]
# Unpadded, the loop knows that each chunk's mask hides keys by causality alone: its contexts say so
# (`causal_only`), and what `real_keys` would read from the mask agrees; with an attention mask it does not know:

# %%
class _Masks(DensePolicy):
    "Record (causal_only, whether the mask shows every key to some query) per call."
    def __init__(self): self.seen = []
    def attend(self, q, k, v, ctx):
        self.seen.append((ctx.causal_only, None if ctx.mask is None else bool(ctx.mask.any(-2).any(1).all())))
        return super().attend(q, k, v, ctx)


_prefill_chunks(model, ids, 4, _pm := _Masks(), GrowingCache(config=model.config))
# 13 tokens, chunks of 4, 4, 4, 1: the first and the one-token chunk have no mask (transformers' is_causal)
test_eq(_pm.seen, [(False, None)] * 2 + [(True, True)] * 4 + [(False, None)] * 2)
_prefill_chunks(model, ids, 4, _pm := _Masks(), GrowingCache(config=model.config), torch.ones_like(ids))
test_eq({c for c, _ in _pm.seen}, {False})


# %% [markdown]
# Rows prefilled apart are joined into one cache, each from its first column, zeros before it:

# %%
#| export
def _join_rows(cache: Cache, parts: list, B: int, S: int) -> None:
    "Fill empty `cache` with `parts` (rows, first column, cache of those rows from that column), zeros elsewhere."
    for i in range(len(parts[0][2].layers)):
        k0, v0 = parts[0][2].layers[i].keys, parts[0][2].layers[i].values
        K, V = k0.new_zeros(B, k0.shape[1], S, k0.shape[3]), v0.new_zeros(B, v0.shape[1], S, v0.shape[3])
        for rows, cut, part in parts: K[rows, :, cut:], V[rows, :, cut:] = part.layers[i].keys, part.layers[i].values
        cache.update(K, V, i)


# %%
_parts = []
for _r, _cut in ((0, 0), (1, 6)):
    _part = GrowingCache(config=model.config)
    _prefill_chunks(model, ids[_r:_r + 1, _cut:], 4, None, _part)
    _parts.append((torch.tensor([_r]), _cut, _part))
_joined = GrowingCache(config=model.config)
_join_rows(_joined, _parts, 2, 13)
for _i, _layer in enumerate(_joined.layers):
    test_eq(_layer.keys[0], _parts[0][2].layers[_i].keys[0])
    test_eq(_layer.values[1, :, 6:], _parts[1][2].layers[_i].values[0])
    test_eq(_layer.keys[1, :, :6].abs().sum().item(), 0.0)


# %% [markdown]
# `chunked_prefill` gives the logits of the whole prompt at every chunk size, and each chunk's queries their positions:

# %%
#| export
def chunked_prefill(model: PreTrainedModel, input_ids: Tensor, chunk_size: int, policy: AttentionPolicy | None = None,
                    cache: Cache | None = None, attention_mask: Tensor | None = None) -> tuple[Cache, Tensor]:
    """Prefill `input_ids` `[B,S]` in chunks of `chunk_size` (B_CP) under `policy`: the cache and last logits `[B,V]`;
    `attention_mask` [B,S]: left padding, each row computes what it computes alone (a row of padding only: 0 logits)."""
    check_int(chunk_size, "chunk_size", 1)  # refuses a bool (True would run as 1)
    check_input_ids(model, input_ids)
    pads = left_padding(attention_mask, input_ids)
    cache = GrowingCache(config=model.config) if cache is None else cache
    if pads is None: return cache, _prefill_chunks(model, input_ids, chunk_size, policy, cache)
    B, S = input_ids.shape
    if isinstance(cache, EvictingCache):
        raise ValueError("attention_mask: evicting caches take unpadded batches only; prefill each prompt alone or "
                         "batch prompts of equal length")
    if cache.get_seq_length():
        raise ValueError(f"attention_mask: a padded prompt needs an empty cache, this one holds "
                         f"{cache.get_seq_length()} tokens; pass a fresh cache (or none)")
    if bool((pads == S).all()): raise ValueError("attention_mask must mark at least one token (1)")
    # rows whose padding leaves the same remainder share the chunk boundaries of their runs alone
    groups = [(pads % chunk_size == r).nonzero()[:, 0] for r in (pads % chunk_size).unique().tolist()]
    cuts = [int(pads[rows].min()) for rows in groups]  # columns of padding in every row of the group
    if len(groups) == 1 and cuts[0] == 0:
        return cache, _prefill_chunks(model, input_ids, chunk_size, policy, cache, attention_mask)
    parts, last = [], None
    for rows, cut in zip(groups, cuts):
        if cut == S: continue  # rows of padding only: nothing to compute
        part = GrowingCache(config=model.config)
        logits = _prefill_chunks(model, input_ids[rows, cut:], chunk_size, policy, part, attention_mask[rows, cut:])
        if last is None: last = logits.new_zeros(B, logits.shape[-1])
        last[rows] = logits
        parts.append((rows, cut, part))
    _join_rows(cache, parts, B, S)
    return cache, last


# %%
for cs in [1, 4, 5, 13, 64]:  # 1, non-divisors of 13, the whole prompt, more than the prompt
    cache, last = chunked_prefill(model, ids, cs)
    assert_close(last, full, atol=1e-5, rtol=0)
    test_eq(cache.get_seq_length(), ids.shape[1])
test_fail(lambda: chunked_prefill(model, ids, 0), contains="chunk_size must be")
test_fail(lambda: chunked_prefill(model, ids, True), contains="chunk_size must be")

rec = _Recorder()
chunked_prefill(model, ids[:1, :7], 3, rec)
test_eq([(r[1], r[2], r[3]) for r in rec.seen if r[0] == 0],
        [("prefill", 0, [0, 1, 2]), ("prefill", 1, [3, 4, 5]), ("prefill", 2, [6])])

# %% [markdown]
# Prefill, then `generate` from the cache, gives the same tokens as `generate` alone:

# %%
gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
prompt = ids[:1]
with torch.no_grad():
    plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), **gen)
    cache, _ = chunked_prefill(model, prompt[:, :-1], 4)
    with patch(model, DensePolicy()):
        cont = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, **gen)
test_eq(cont, plain)

# %% [markdown]
# A cache holding the whole prompt, or reused for a new prompt, is refused with what to do, and so is a
# preallocated cache that returns unwritten slots as keys; so are token ids outside the vocabulary:

# %%
full_cache, _ = chunked_prefill(model, prompt, 4)
ones = torch.ones_like(prompt)
with patch(model, DensePolicy()):
    test_fail(lambda: model.generate(prompt, attention_mask=ones, past_key_values=full_cache, **gen),
              contains="prefill all but the last prompt token")
    test_fail(lambda: model.generate(prompt[:, :5], attention_mask=ones[:, :5], past_key_values=full_cache, **gen),
              contains="pass a fresh cache")
    # transformers' StaticCache returns every preallocated slot as a key: refused, not attended at wrong positions
    test_fail(lambda: model.generate(prompt, attention_mask=ones, cache_implementation="static", **gen),
              contains="preallocated cache (transformers' StaticCache")
for bad_id in (-1, 259):
    bad = ids.clone()
    bad[1, 3] = bad_id
    test_fail(lambda: chunked_prefill(model, bad, 4), contains="input_ids must be token ids in [0, 259)")

# %% [markdown]
# Padded rows: three prompts of 13, 9 and 6 tokens, left-padded to 13. Each row's last logits and cached
# keys equal those of its run alone, whether all rows share the chunk grid (chunks of 1), two groups are
# prefilled (chunks of 4: padding 0, 4 and 7) or three (chunks of 5):

# %%
lens = [13, 9, 6]
batch, am = torch.zeros(3, 13, dtype=torch.long), torch.zeros(3, 13, dtype=torch.long)
for b, n in enumerate(lens): batch[b, 13 - n:], am[b, 13 - n:] = ids[b % 2, :n], 1
for cs in (1, 4, 5):
    pcache, plast = chunked_prefill(model, batch, cs, attention_mask=am)
    for b, n in enumerate(lens):
        alone, alone_last = chunked_prefill(model, batch[b:b + 1, 13 - n:], cs)
        assert_close(plast[b], alone_last[0], atol=1e-4, rtol=0)
        for layer, one in zip(pcache.layers, alone.layers): assert_close(layer.keys[b, :, 13 - n:], one.keys[0])
with torch.no_grad(): unmasked = model(batch).logits[:, -1]
assert (unmasked[2] - plast[2]).abs().max() > 1e-2  # without the mask the padding would change the row
assert_close(chunked_prefill(model, batch, 4, attention_mask=torch.ones_like(am))[1], unmasked, atol=1e-5, rtol=0)
test_fail(lambda: chunked_prefill(model, batch, 4, attention_mask=am.flip(-1)), contains="pad on the left")
test_fail(lambda: chunked_prefill(model, batch, 4, attention_mask=am * 2), contains="0 (padding) and 1 (token)")
test_fail(lambda: chunked_prefill(model, batch, 4, attention_mask=am[:, 1:]), contains="like input_ids")
test_fail(lambda: chunked_prefill(model, batch, 4, cache=pcache, attention_mask=am), contains="needs an empty cache")
test_fail(lambda: chunked_prefill(model, batch, 4, attention_mask=am * 0), contains="at least one token")


# %% [markdown]
# A mask policy and a selection policy that keep the same keys give the same output as the
# brute-force reference. Here each KV head keeps its own random half of the earlier keys, plus
# the chunk's own keys (causally); the reference applies the equivalent mask with an explicit
# softmax. We run a prefill in chunks of 4, so every call has earlier keys:

# %%
def _random_earlier(ctx):
    "Deterministic random indices [B,Hkv,past//2] of earlier keys, different per KV head."
    g = torch.Generator().manual_seed(ctx.layer_idx * 1000 + ctx.past_len)
    B, H, _ = ctx.key_positions.shape
    picks = [torch.randperm(ctx.past_len, generator=g)[:ctx.past_len // 2] for _ in range(B * H)]
    return torch.stack(picks).view(B, H, -1)

def _random_mask(ctx):
    "The same subset as a mask [B,Hkv,1,Sk], the chunk's own keys included."
    B, H, sk = ctx.key_positions.shape
    m = torch.zeros(B, H, sk, dtype=torch.bool).scatter(2, _random_earlier(ctx), True)
    m[:, :, ctx.past_len:] = True
    return m[:, :, None]

class _RandomMask(MaskPolicy):
    def mask(self, q, k, v, ctx): return _random_mask(ctx)

class _RandomSelect(SelectionPolicy):
    def select(self, q, k, v, ctx): return add_chunk_keys(_random_earlier(ctx), k.shape[2], q.shape[2])

class _ExplicitMask(AttentionPolicy):
    def attend(self, q, k, v, ctx):
        return _reference(q, k, v, heads_mask(_random_mask(ctx) & ctx.full_mask(), q.shape[1]), ctx.scale)

lasts = {name: chunked_prefill(model, ids, 4, pol)[1]
         for name, pol in [("mask", _RandomMask()), ("select", _RandomSelect()), ("ref", _ExplicitMask())]}
assert_close(lasts["mask"], lasts["ref"], atol=1e-5, rtol=0)
assert_close(lasts["select"], lasts["ref"], atol=1e-5, rtol=0)
assert (lasts["ref"] - ref[:, -1]).abs().max() > 1e-2  # the subset really changes the output

# %% [markdown]
# In the model, the measured budget is per layer and query head, and the same subset measures the
# same whether a policy masks it or selects it; dense causal attention over $S$ tokens in one
# forward attends to $(S + 1) / 2$ entries per query on average, $S$ at most.

# %%
with torch.no_grad():
    with measure_attended() as by_mask: chunked_prefill(model, ids, 4, _RandomMask())
    with measure_attended() as by_select: chunked_prefill(model, ids, 4, _RandomSelect())
    with measure_attended() as dense: chunked_prefill(model, ids, ids.shape[1], DensePolicy())
test_eq(by_mask.per_head(), by_select.per_head())
test_eq(len(by_mask.per_head()), model.config.num_hidden_layers * model.config.num_attention_heads)
assert by_mask.mean() < dense.mean()
test_eq((dense.mean("prefill"), dense.max("prefill")), ((ids.shape[1] + 1) / 2, ids.shape[1]))

# %% [markdown]
# ## Evicting caches in a model
#
# With a budget larger than the sequence, the evicting cache is a `DynamicCache`:

# %%
with torch.no_grad():
    c_dyn, l_dyn = chunked_prefill(model, ids, 4)
    c_sw, l_sw = chunked_prefill(model, ids, 4, cache=SinkWindowCache(2, 64))
    assert_close(l_sw, l_dyn, atol=1e-5, rtol=0)
    test_eq(c_sw.get_seq_length(), c_dyn.get_seq_length())
    assert_close(c_sw.layers[1].keys, c_dyn.layers[1].keys, atol=1e-5, rtol=0)
    with patch(model, DensePolicy()):
        test_eq(model.generate(prompt, past_key_values=SinkWindowCache(2, 64), **gen), plain)
test_fail(lambda: chunked_prefill(model, ids, 4, cache=SinkWindowCache(2, 0)), contains="window must be")


# %% [markdown]
# When it does evict, the cache must compute exactly what the full sequence computes under the
# equivalent mask. The reference runs the whole sequence in one forward pass, no cache, with an
# explicit-softmax policy whose mask is the rule's definition written out: query $p$ sees $t$ iff
# $t \le p$ and ($t < s$ or $p - t < w$). We compare the logits of every position, from a chunked
# prefill (chunks of 3, so eviction happens inside chunks) followed by teacher-forced decoding:

# %%
class _ExplicitSinkWindow(AttentionPolicy):
    "Reference: the full sequence with the sink+window mask, explicit softmax."
    def __init__(self, sink, window): self.sink, self.window = sink, window
    def attend(self, q, k, v, ctx):
        t, p = ctx.key_positions[:, :, None], ctx.query_positions[:, None]
        m = (t <= p) & ((t < self.sink) | (p - t < self.window))
        return _reference(q, k, v, heads_mask(m, q.shape[1]), ctx.scale)


def _teacher_forced(model, ids, cache, prefill, chunk):
    "Logits [B,S,V] from a chunked prefill of `prefill` tokens, then one decode step per remaining token."
    rows = []
    with torch.no_grad(), patch(model, DensePolicy()):
        for c in range(0, prefill, chunk):
            pos = torch.arange(c, min(c + chunk, prefill))
            rows.append(model(ids[:, pos], past_key_values=cache, position_ids=pos[None]).logits)
        for t in range(prefill, ids.shape[1]):
            rows.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
    return torch.cat(rows, 1)


long = torch.randint(3, 259, (2, 40), generator=torch.Generator().manual_seed(3))
with torch.no_grad(), patch(model, _ExplicitSinkWindow(3, 6)): ref_sw = model(long).logits
cache = SinkWindowCache(3, 6)
assert_close(_teacher_forced(model, long, cache, 17, 3), ref_sw, atol=1e-5, rtol=0)
test_eq(cache.get_seq_length(), 40)
# between steps the sinks and the window, whose oldest entry (34) the next token overwrites in place (a ring)
test_eq(sorted(cache.layers[0].positions[0, 0].tolist()), [0, 1, 2] + list(range(34, 40)))
with torch.no_grad(): dense = model(long).logits
assert (ref_sw - dense)[:, 10:].abs().max() > 1e-2  # eviction really changes the result

# %% [markdown]
# A scored rule keeps different positions in different heads. With scores fixed at insertion
# (here a fixed random projection of each key), the reference mask is the top-$k$ of $E(p)$
# recomputed for every query by brute force, from the keys of the reference pass itself:

# %%
_proj = torch.randn(16, generator=torch.Generator().manual_seed(7))
def _key_score(layer_idx, keys, values, positions): return keys @ _proj


class _ExplicitTopScore(AttentionPolicy):
    "Reference: per query p, sinks + window + top-k of E(p) by score, recomputed by sorting; explicit softmax."
    def __init__(self, s, w, k): self.s, self.w, self.k = s, w, k
    def attend(self, q, k, v, ctx):
        B, H, S = k.shape[:3]
        sc = _key_score(ctx.layer_idx, k, v, None)
        m = torch.zeros(B, H, S, S, dtype=torch.bool)
        for b in range(B):
            for h in range(H):
                for p in range(S):
                    m[b, h, p, :min(self.s, p + 1)] = True
                    m[b, h, p, max(0, p - self.w + 1):p + 1] = True
                    elig = list(range(self.s, p - self.w + 1))
                    for t in sorted(elig, key=lambda t: (-sc[b, h, t].item(), t))[:self.k]: m[b, h, p, t] = True
        return _reference(q, k, v, heads_mask(m, q.shape[1]), ctx.scale)


with torch.no_grad(), patch(model, _ExplicitTopScore(2, 4, 5)): ref_top = model(long).logits
cache = EvictingCache(TopScoreRule(2, 4, 5, _key_score))
assert_close(_teacher_forced(model, long, cache, 17, 5), ref_top, atol=1e-5, rtol=0)
kept = cache.layers[1].positions[0]
test_eq(kept.shape[-1], 2 + 3 + 5)
assert not (kept[0] == kept[1]).all()  # the two KV heads keep different positions

# %% [markdown]
# `generate` with a sink+window cache produces the greedy tokens of the masked reference: we
# recompute the reference's argmax token by token, feeding back its own choices.

# %%
with torch.no_grad():
    with patch(model, DensePolicy()):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=SinkWindowCache(2, 5),
                             **gen)
    seq = prompt
    with patch(model, _ExplicitSinkWindow(2, 5)):
        for _ in range(gen["max_new_tokens"]): seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
test_eq(out, seq)


# %% [markdown]
# Attention-based rules write the entries' scores from the policy, which runs *before* the
# eviction of the same step. A TOVA-like policy stores, at each decode step, the current query's
# attention (averaged over the query heads of each KV head) as the scores; with `TopScoreRule(1, 2, 3)`
# the entries kept after the step are the sink, the new token and the 3 best-scored others:

# %%
class _LastQueryScores(AttentionPolicy):
    "TOVA-like: at decode, the current query's attention (mean over the group) becomes the entries' scores."
    def __init__(self): self.written = {}
    def decode(self, q, k, v, ctx):
        B, H, N, _ = k.shape
        # [B,Hq,1,N]
        probs = torch.softmax((q @ k.repeat_interleave(q.shape[1] // H, 1).transpose(-1, -2)) * ctx.scale, -1)
        ctx.cache_layer.scores = probs.view(B, H, -1, N).mean(2).float()
        self.written[ctx.layer_idx] = (ctx.cache_layer.scores.clone(), ctx.key_positions.clone())
        return super().decode(q, k, v, ctx)


pol, cache = _LastQueryScores(), EvictingCache(TopScoreRule(1, 2, 3))
chunked_prefill(model, ids[:1, :9], 4, cache=cache)
with torch.no_grad(), patch(model, pol): model(ids[:1, 9:10], past_key_values=cache)
for layer_idx, (sc, pos) in pol.written.items():
    for h in range(pos.shape[1]):
        old = [(-sc[0, h, j].item(), pos[0, h, j].item()) for j in range(pos.shape[-1]) if 1 <= pos[0, h, j] <= 10 - 2]
        expect = sorted([0, 9] + [t for _, t in sorted(old)[:3]])  # next position 10: sink 0, window {9}, top 3
        test_eq(cache.layers[layer_idx].positions[0, h].tolist(), expect)

# %% [markdown]
# Outside `patch` an evicting cache refuses to run, and `crop` refuses to resurrect evicted tokens:

# %%
test_fail(lambda: model(prompt, past_key_values=SinkWindowCache(2, 4)), contains="only inside sparsekv.hf.patch")
cache = SinkWindowCache(2, 4)
chunked_prefill(model, ids[:1, :10], 3, cache=cache)
test_fail(lambda: cache.crop(-2), contains="already evicted")
cache = SinkWindowCache(2, 64)
chunked_prefill(model, ids[:1, :10], 3, cache=cache)
cache.crop(-3)
test_eq(cache.get_seq_length(), 7)
test_eq(cache.layers[0].positions[0, 1].tolist(), list(range(7)))

# %% [markdown]
# ### The memory a cache holds
#
# `measure_attended` also records, per phase and layer, the keys and values the layer's cache hands to
# attention at each call: everything it holds at that moment, the new entries included, before an eviction
# rule runs. Its most entries per KV head and the bytes they take per sequence are the cache's peak
# (`AttendedBudget.stored`). Checked against what the caches hold, counted by hand: a full cache holds every
# token (prompt of 10 in chunks of 3, then 2 decode steps), an evicting one $s + w$ entries at a decode
# call (the $s + w - 1$ it kept and the new token) and at most $s + w - 1 + 3$ while a chunk of 3 is in.

# %%
L, Hkv, D = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
per_entry = 2 * Hkv * D * next(model.parameters()).element_size()  # a key and a value per KV head
for cache, prefill_most, decode_most in ((None, 10, 12), (SinkWindowCache(2, 4), 2 + 4 - 1 + 3, 2 + 4)):
    with measure_attended() as meter, torch.no_grad():
        cache, _ = chunked_prefill(model, ids[:2, :10], 3, cache=cache)
        with patch(model, DensePolicy()):
            for t in (10, 11): model(ids[:2, t:t + 1], past_key_values=cache)
    test_eq(meter.stored("prefill"), {"entries": prefill_most, "bytes": L * prefill_most * per_entry})
    test_eq(meter.stored("decode"), {"entries": decode_most, "bytes": L * decode_most * per_entry})
    test_eq(meter.stored(), meter.stored("prefill" if prefill_most > decode_most else "decode"))
test_fail(lambda: AttendedBudget().stored(), contains="nothing was stored")

# %% [markdown]
# ## Methods: one object per method
#
# A user picks a method by name and a budget; everything above is how the method runs. `Method` is
# that object: `policy()` is the attention policy of one run, `cache(model)` the cache to pass as
# `past_key_values` (None: `transformers`' own), `patch(model)` patches the model with a fresh policy
# and yields that cache, and `generate` prefills (in chunks of `chunk_size` tokens where the method
# needs it: all but the last prompt token, through `chunked_prefill`) and decodes, in one call. It takes
# `generate`'s left-padded `attention_mask`: each row gets what it gets alone, except with an evicting
# cache, which takes unpadded batches only and refuses padding before any work. Each paper package
# defines its methods as subclasses with a `name`; `__init_subclass__` registers them in
# `Method.registry`, and `sparsekv.methods` imports the packages so that every method is there. The base is the dense method's behaviour: exact attention, no cache.
#
# **Budget.** `budget` is the number of KV entries each query may attend to, per KV head (an int
# >= 1); each family says how it maps onto its own parameters, and a method whose budget is a
# learned target met only on average says so with `exact_budget = False`.

# %% [markdown]
# A method class joins the registry under its own `name` (one it inherits does not count), once its family is
# checked; a second class cannot take the name, while the same class defined again (a notebook cell run twice) may:

# %%
#| export
METHOD_FAMILIES = ("dense", "eviction", "selection", "retrieval")


def _register(cls: type, registry: dict):
    "Add method class `cls` to `registry` under its own `name`, if it sets one; its family must be in METHOD_FAMILIES."
    name = cls.__dict__.get("name")
    if cls.family not in METHOD_FAMILIES:
        raise ValueError(f"{cls.__name__}.family must be one of {METHOD_FAMILIES}, got {cls.family!r}")
    if name is None: return
    prev = registry.get(name)
    # re-running a notebook cell redefines the same class
    if prev is not None and prev.__qualname__ != cls.__qualname__:
        raise ValueError(f"method name {name!r} is already taken by {prev.__module__}.{prev.__qualname__}")
    registry[name] = cls


# %%
_reg = {}
class _A: name, family = "a", "dense"
class _B(_A): pass
_register(_A, _reg)
_register(_B, _reg)                                                            # inherits the name: not registered
test_eq(_reg, {"a": _A})
class _A: name, family = "a", "dense"                                          # the same class, defined again
_register(_A, _reg)
test_eq(_reg, {"a": _A})
test_fail(lambda: _register(type("C", (), {"name": "a", "family": "dense"}), _reg), contains="already taken")
test_fail(lambda: _register(type("D", (), {"name": "d", "family": "x"}), _reg), contains="family must be one of")


# %% [markdown]
# Check: a subclass with a name registers itself (and a second class cannot take the name); a bad budget and a bad
# family are refused; `patch` yields a fresh `GrowingCache` under the method's policy.

# %%
#| export
class Method:
    "One KV method behind one interface (`patch`, `generate`); a subclass with a `name` joins `Method.registry`."
    name: str | None = None
    family: str = "dense"       # one of METHOD_FAMILIES
    exact_budget: bool = True   # False: `budget` is a learned target, met on average (DMS)
    chunk_size: int | None = None  # prefill in chunks of this many tokens (B_CP); None: the whole prompt in one call
    cost_knob: str | None = None   # the parameter that sets the scoring cost per cached key (`sparsekv.costs.matched`)
    small_params: dict = {}        # parameters that make a 20-token prompt on the two-layer test models exercise it
    registry: dict[str, type] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _register(cls, Method.registry)

    def __init__(self, budget: int):
        self.budget = self.check_budget(budget)

    @classmethod
    def check_budget(cls, budget) -> int:
        "`budget` if it is an int >= 1 (KV entries each query may attend to, per KV head)."
        return check_int(budget, "budget", 1)


# %%
class _ChunkedDense(Method):
    name, chunk_size = "_chunked_dense", 4

test_fail(lambda: type("Other", (Method,), {"name": "_chunked_dense"}), contains="already taken")
test_fail(lambda: type("Other", (Method,), {"family": "pruning"}), contains="family must be one of")
for bad in (0, -3, True, 2.5, "8"): test_fail(lambda: Method(bad), contains="budget must be")


# %%
#| export
@patch_to(Method)
def policy(self) -> AttentionPolicy:
    "A fresh attention policy for one run (dense here)."
    return DensePolicy()


# %%
test_eq(type(Method(8).policy()), DensePolicy)


# %%
#| export
@patch_to(Method)
def cache(self, model: PreTrainedModel) -> Cache | None:
    "The cache to pass as `past_key_values` for one run (here `GrowingCache`: no copy of the cache per step)."
    return GrowingCache(config=model.config)


# %%
test_eq(type(Method(8).cache(model)), GrowingCache)


# %%
#| export
@patch_to(Method)
@contextlib.contextmanager
def patch(self, model: PreTrainedModel):  # noqa: F811  the method Method.patch; the module keeps the function
    "Patch `model` with a fresh `policy()` inside the block and yield the cache to pass (`cache(model)`)."
    with patch(model, self.policy()): yield self.cache(model)


# %%
with Method(8).patch(model) as c:
    assert isinstance(c, GrowingCache) and c.get_seq_length() == 0, c
    test_eq(model.config._attn_implementation, ATTN_NAME)
test_eq(model.config._attn_implementation, impl)


# %%
#| export
@patch_to(Method)
def __repr__(self):
    args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
    return f"{type(self).__name__}({args})"


# %%
test_eq(repr(Method(8)), "Method(budget=8)")


# %% [markdown]
# `generate` gives exactly what the unpatched model generates, in one call or in chunks:

# %%
#| export
def decode_compile_config(backend: str = "inductor") -> CompileConfig:
    """The `compile_config` with which `generate` compiles our caches' decode steps: as one graph (`fullgraph`),
    once for every length (`dynamic`), by `backend`, on any device (transformers' own flag; on a GPU too: the
    shapes change every step, so no CUDA-graph capture)."""
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"compile must be True or a torch.compile backend's name, got {backend!r}")
    config = CompileConfig(fullgraph=True, dynamic=True, backend=backend, mode=None)
    config._compile_all_devices = True
    return config


@patch_to(Method)
def generate(self, model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor | None = None,
             compile: bool | str = False, **kwargs) -> Tensor:
    """Prefill (in chunks of `chunk_size` if set), decode by `model.generate(**kwargs)` under the method: token ids;
    `attention_mask`: left padding, as generate takes it; `compile`: compile the decode steps (True: by inductor, or
    a `torch.compile` backend's name; see `decode_compile_config`)."""
    check_input_ids(model, input_ids)
    if "past_key_values" in kwargs:
        raise ValueError("past_key_values: Method.generate makes a fresh cache for each call; to continue a cache "
                         "of your own, call model.generate inside `with method.patch(model):`")
    if compile is not False and "compile_config" in kwargs:
        raise ValueError("compile and compile_config: pass one (compile=True builds `decode_compile_config()`)")
    if compile is not False:
        kwargs["compile_config"] = decode_compile_config("inductor" if compile is True else compile)
    S, pads = input_ids.shape[1], left_padding(attention_mask, input_ids)
    if pads is not None and bool((pads == S).any()):
        raise ValueError("attention_mask must mark at least one token (1) in every row")
    if attention_mask is None: attention_mask = torch.ones_like(input_ids)
    with torch.no_grad(), self.patch(model) as cache:
        # (`sparsekv.methods.HandoffCache` hands the prompt to the evicting cache `then` later)
        if pads is not None and any(isinstance(c, EvictingCache) for c in (cache, getattr(cache, "then", None))):
            raise ValueError(f"attention_mask: {self.name or type(self).__name__} evicts from a cache that takes "
                             "unpadded batches only (padding would shift its rows); generate each prompt alone "
                             "or batch prompts of equal length")
        active_patch(model).causal_only = pads is None  # known here once: no mask needs reading in any step
        if "compile_config" in kwargs:
            for c in (cache, getattr(cache, "then", None)):
                if c is not None: c.compiled_decode = True
            if not getattr(cache, "is_compileable", False):
                raise ValueError(f"compile: the decode step of {self.name or type(self).__name__} does not compile "
                                 f"as one graph (its {type(cache).__name__} is not compileable); generate without "
                                 "compiling")
        # a prefill with some token (rows of one token have none before the last)
        if self.chunk_size and S > 1 and (pads is None or bool((pads < S - 1).any())):
            # generate feeds the last token
            cache = chunked_prefill(model, input_ids[:, :-1], self.chunk_size, cache=cache,
                                    attention_mask=None if pads is None else attention_mask[:, :-1])[0]
            # generate repeats each row of input_ids for beams or return sequences, not a cache passed to it
            cfg = kwargs.get("generation_config") or model.generation_config
            expand = max(kwargs.get("num_beams", cfg.num_beams) or 1,
                         kwargs.get("num_return_sequences", cfg.num_return_sequences) or 1)
            if expand > 1: cache.batch_repeat_interleave(expand)
        return model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, **kwargs)


# %% [markdown]
# Generation under the method gives the unpatched model's tokens, in one prefill or in chunks. With `compile=` the
# decode steps run compiled: that they give the eager tokens for every registered method is checked in
# `tests/test_host_syncs.py` (TorchDynamo cannot trace this notebook's own definitions when nbdev-test runs it in a
# worker process); here, that a bad `compile` is refused:

# %%
with torch.no_grad(): plain = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
test_eq(Method(8).generate(model, ids, **gen), plain)
test_eq(Method.registry["_chunked_dense"](8).generate(model, ids, **gen), plain)
test_fail(lambda: Method(8).generate(model, ids, compile="", **gen), contains="compile must be True or")
test_fail(lambda: Method(8).generate(model, ids, compile=True, compile_config=decode_compile_config(), **gen),
          contains="pass one")

# %% [markdown]
# A padded batch gives each row the tokens it gets alone, in one call or in chunks; a cache of one's own, an
# all-padding row and token ids outside the vocabulary are refused:

# %%
padded, pam = torch.zeros_like(ids), torch.zeros_like(ids)
padded[0], pam[0] = ids[0], 1
padded[1, 6:], pam[1, 6:] = ids[1, :7], 1
for m in (Method(8), Method.registry["_chunked_dense"](8)):
    out = m.generate(model, padded, attention_mask=pam, **gen)
    test_eq(out[0], plain[0])
    test_eq(out[1, 6:], m.generate(model, ids[1:, :7], **gen)[0])
test_fail(lambda: Method(8).generate(model, ids, past_key_values=DynamicCache()), contains="past_key_values")
test_fail(lambda: Method(8).generate(model, ids, attention_mask=pam * 0), contains="at least one token")
test_fail(lambda: Method(8).generate(model, ids + 256, **gen), contains="model's vocabulary")
del Method.registry["_chunked_dense"]


# %% [markdown]
# ## Scoring cost
#
# A selection or retrieval method does work to *choose* keys before attention reads them: QuoKA's cosines of
# its $N_Q$ kept queries with every cached key, SparQ's products over $r$ channels, OVAL's page scores. Each such
# method (its class sits with its paper's policies) states that work as **multiply-adds of matrix products**
# (matmul, bmm, einsum; elementwise work is left out), per KV head and layer, with
# `scoring_cost(shape, n_cached, phase, chunk)`:
#
# - `per_key`: for one cached key, whenever the method scores (it does not depend on `n_cached`);
# - `per_step`: for one call over `n_cached` keys, a prefill chunk of `chunk` queries per head
#   ($B_{CP}$ = `chunk_size` by default) or one decode step; 0 when the keys fit the budget (the call is dense);
# - `total`: `per_step` over every KV head of every layer that scores (batch 1).
#
# `n_cached` counts the keys the method ranks: a chunk's earlier keys (selection), the whole cache at a decode step
# (retrieval). The formulas are derived, and checked against the multiply-adds the code performs, on
# [the costs page](42_costs.ipynb). A method that scores no cached keys costs zero: dense attention, and the eviction
# methods (TOVA and H2O reuse the attention weights, KVpop and DMS score each key once, when it arrives).
#
# The shape is read from a config as transformers spells it; the tiny test model has 4 query heads over 2 KV
# heads of 16 dimensions ($64 / 4$) in 2 layers.

# %%
#| export
@dataclass(frozen=True)
class ModelShape:
    "The shape scoring costs depend on: `Hq` query heads, `Hkv` KV heads, head dim `D`, `layers`."
    Hq: int
    Hkv: int
    D: int
    layers: int

    def __post_init__(self):
        for n in ("Hq", "Hkv", "D", "layers"): check_int(getattr(self, n), n, 1)
        if self.Hq % self.Hkv: raise ValueError(f"Hq={self.Hq} must be a multiple of Hkv={self.Hkv}")

    @property
    def G(self) -> int:
        "Query heads per KV head."
        return self.Hq // self.Hkv

    @classmethod
    def of(cls, x) -> ModelShape:
        "`x` as a ModelShape (any object with `Hq, Hkv, D, layers`), or the shape of a transformers config or model."
        if isinstance(x, cls): return x
        # duck-typed: a notebook that re-runs the class cell makes a second ModelShape class with the same fields
        if all(hasattr(x, n) for n in ("Hq", "Hkv", "D", "layers")): return cls(x.Hq, x.Hkv, x.D, x.layers)
        c = getattr(x, "config", x)
        try: Hq, Hkv, L = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads, c.num_hidden_layers
        except AttributeError:
            raise TypeError(f"shape must be a ModelShape, a transformers config or a model, got {type(x).__name__}") \
                from None
        return cls(Hq, Hkv, getattr(c, "head_dim", None) or c.hidden_size // Hq, L)


# %%
test_eq(ModelShape.of(load_model("tiny-llama")[0]), ModelShape(Hq=4, Hkv=2, D=16, layers=2))
test_eq(ModelShape(9, 3, 64, 30).G, 3)
test_fail(lambda: ModelShape(9, 2, 64, 30), contains="multiple of Hkv")
test_fail(lambda: ModelShape.of("smollm2"), contains="shape must be a ModelShape")


# %%
#| export
@dataclass(frozen=True)
class ScoringCost:
    """Multiply-adds spent choosing keys: `per_key` per cached key and KV head, `per_step` per KV head for one call of
    one layer, `total` over the model's KV heads and scoring layers."""
    per_key: float = 0
    per_step: int = 0
    total: int = 0


# %%
test_eq(ScoringCost(), ScoringCost(0, 0, 0))
test_fail(lambda: setattr(ScoringCost(), "total", 1), exc=AttributeError)   # frozen

# %%
#| export
PHASES = ("prefill", "decode")


def queries_per_call(phase: str, chunk: int | None, chunk_size: int) -> int:
    "Queries per head of one scoring call: `chunk` (default `chunk_size`, B_CP) at prefill, 1 at decode."
    if phase not in PHASES: raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if phase == "decode":
        if chunk not in (None, 1): raise ValueError(f"chunk must be None or 1 at decode (one query), got {chunk!r}")
        return 1
    return chunk_size if chunk is None else check_int(chunk, "chunk", 1)


# %%
test_eq([queries_per_call("prefill", None, 128), queries_per_call("prefill", 7, 128),
         queries_per_call("decode", None, 128)], [128, 7, 1])
test_fail(lambda: queries_per_call("training", None, 128), contains="phase must be one of")
test_fail(lambda: queries_per_call("decode", 4, 128), contains="chunk must be None or 1 at decode")


# %% [markdown]
# A method that states no cost (dense attention, the eviction methods) chooses no keys: zero, with its arguments
# checked all the same.

# %%
#| export
def scoring_cost(method: Method, shape, n_cached: int, phase: str = "prefill", chunk: int | None = None) -> ScoringCost:
    "`method.scoring_cost(shape, n_cached, phase, chunk)`; zero for a method that scores no cached keys (eviction)."
    if not isinstance(method, Method): raise TypeError(f"method must be a Method, got {type(method).__name__}")
    if hasattr(method, "scoring_cost"): return method.scoring_cost(shape, n_cached, phase, chunk)
    ModelShape.of(shape), check_int(n_cached, "n_cached"), queries_per_call(phase, chunk, 1)
    return ScoringCost()


# %%
test_eq(scoring_cost(Method(8), ModelShape(9, 3, 64, 30), 4096, "decode"), ScoringCost())
test_fail(lambda: scoring_cost("quoka", ModelShape(9, 3, 64, 30), 4096), contains="method must be a Method")
test_fail(lambda: scoring_cost(Method(8), ModelShape(9, 3, 64, 30), -1), contains="n_cached")
