# %% [markdown]
# # Training-free eviction baselines
#
# > StreamingLLM, TOVA and H2O as `EvictionRule`s with KVpop's budget interface (sinks, window, k long-range slots), and the policy that feeds attention-based rules the current attention.

# %%
#| default_exp kvpop.baselines

# %%
#| export
from __future__ import annotations

import torch
from torch import Tensor

from sparsekv.attention import check_qkv
from sparsekv.cache import EvictingLayer, EvictionRule, SinkWindowRule, TopScoreRule
from sparsekv.hf import DensePolicy, MaskPolicy, heads_mask, patch

# %%
#| hide
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.cache import EvictingCache
from sparsekv.hf import chunked_prefill
from sparsekv.models import load_model

# %% [markdown]
# All three baselines are budgeted like KVpop (Eq. 1): per KV head, `sink` first tokens, the
# `window` most recent tokens and `k` long-range slots, $B = s + w + k$.
#
# - **StreamingLLM** (Xiao et al.) keeps only sinks and recent tokens: with the same budget it is
#   `SinkWindowRule(sink, window + k)`.
# - **TOVA** (Oren et al.) evicts, at every step, the cached token with the lowest attention from
#   the current query. The original averages the attention over *all* heads of a layer (every head
#   then keeps the same tokens; kvpress's `TOVAPress` does the same); `heads="group"` averages over
#   the query heads of each KV head instead, so heads keep different tokens. Here the score of an
#   entry is the attention it received from the latest query, and the `k` best of the tokens that
#   left the window are kept: with `sink=0, window=1` this is exactly TOVA with a cache of `k`.
# - **H2O** (Zhang et al.) keeps heavy hitters, the tokens with the largest *accumulated* attention
#   (summed over all queries since the token entered the cache, mean over the group's query
#   heads), plus a window of recent tokens.
#
# The attention-based rules are `TopScoreRule`s whose scores the policy rewrites after computing
# attention, before the dispatcher evicts (03_hf). A token evicted once is gone for good, so the
# kept set is greedy: at each step the worst eligible entry leaves.
#
# **Prefill.** Within a prefill chunk, queries attend to every kept entry and to the chunk causally
# (dense); eviction happens after the chunk, from the chunk's attention (TOVA: its last query,
# H2O: the sum over its queries). A one-chunk prefill is therefore kvpress's "compress after
# prefill", and chunks of one token are per-token TOVA/H2O.

# %%
#| export
HEAD_REDUCTIONS = ("group", "all")


class AttentionScoreRule(TopScoreRule):
    "Sinks, a window and the `k` best attention-based scores of older entries; `observe` turns attention into scores."

    def __init__(self, sink: int, window: int, k: int, heads: str = "group"):
        super().__init__(sink, window, k)
        if heads not in HEAD_REDUCTIONS: raise ValueError(f"heads must be one of {HEAD_REDUCTIONS}, got {heads!r}")
        self.heads = heads

    def visible(self, layer, query_positions):
        if query_positions.shape[0] > 1: return EvictionRule.visible(self, layer, query_positions)  # a chunk: dense, evict after it
        return super().visible(layer, query_positions)

    def observe(self, layer: EvictingLayer, probs: Tensor) -> None:
        "Update `layer.scores` from the attention `probs` [B,Hkv,Sq,N] of this call's queries over the layer's entries."
        raise NotImplementedError(f"{type(self).__name__} must implement observe(layer, probs)")


class TOVARule(AttentionScoreRule):
    "TOVA: an entry's score is the attention it gets from the latest query."

    def observe(self, layer, probs):
        layer.scores = probs[:, :, -1].float()


class H2ORule(AttentionScoreRule):
    "H2O: an entry's score is the attention it has accumulated over all queries since it was cached."

    def observe(self, layer, probs):
        layer.scores = layer.scores + probs.sum(2).float()


def streaming_llm_rule(sink: int, window: int, k: int) -> SinkWindowRule:
    "StreamingLLM with KVpop's budget s + w + k: sinks and the window + k most recent tokens."
    return SinkWindowRule(sink, window + k)


# %% [markdown]
# ## The attention the rules observe
#
# The policy computes the probabilities of the call's queries over the cached keys (GQA: query head
# $hG+g$ reads KV head $h$) and reduces them over heads: the mean over each KV head's group, or the
# mean over all query heads repeated for every KV head.

# %%
#| export
def attention_probs(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    "Softmax probabilities [B,Hq,Sq,N] of queries q [B,Hq,Sq,D] over keys k [B,Hkv,N,D]; `mask` boolean (True = attend) or None."
    G = q.shape[1] // k.shape[1]
    logits = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)).float() * scale
    if mask is not None: logits = logits.masked_fill(~heads_mask(mask, q.shape[1]), float("-inf"))
    return torch.softmax(logits, -1)


def reduce_heads(probs: Tensor, n_kv_heads: int, heads: str = "group") -> Tensor:
    "Per-KV-head attention [B,Hkv,Sq,N] from [B,Hq,Sq,N]: mean over each group ('group') or over all query heads ('all')."
    if heads not in HEAD_REDUCTIONS: raise ValueError(f"heads must be one of {HEAD_REDUCTIONS}, got {heads!r}")
    B, Hq, Sq, N = probs.shape
    if heads == "all": return probs.mean(1, keepdim=True).expand(B, n_kv_heads, Sq, N)
    return probs.view(B, n_kv_heads, Hq // n_kv_heads, Sq, N).mean(2)


class AttentionScorePolicy(DensePolicy):
    "Exact attention that also hands its probabilities to an `AttentionScoreRule`'s cache layer (before eviction)."

    def attend(self, q, k, v, ctx):
        layer = ctx.cache_layer
        if isinstance(layer, EvictingLayer) and isinstance(layer.rule, AttentionScoreRule):
            check_qkv(q, k, v)
            probs = attention_probs(q, k, ctx.full_mask(), ctx.scale)
            layer.rule.observe(layer, reduce_heads(probs, k.shape[1], layer.rule.heads))
        return super().attend(q, k, v, ctx)


# %%
p = torch.softmax(torch.randn(2, 6, 3, 5), -1)
assert_close(reduce_heads(p, 2)[:, 1], p[:, 3:6].mean(1))
assert_close(reduce_heads(p, 3, "all")[:, 2], p.mean(1))
q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8)
m = torch.rand(1, 2, 2, 5) > 0.3
m[..., 0] = True
ref = torch.stack([torch.softmax((q[0, h] @ k[0, h // 2].T * 0.3).masked_fill(~m[0, h // 2], -torch.inf), -1) for h in range(4)])[None]
assert_close(attention_probs(q, k, m, 0.3), ref)
test_fail(lambda: reduce_heads(p, 2, "max"), contains="heads must be one of")

# %% [markdown]
# ## Baselines by name
#
# `eviction_baseline(name, sink, window, k)` gives the rule and the policy to decode with, for
# `EvictingCache(rule)` inside `patch(model, policy)`.

# %%
#| export
EVICTION_BASELINES = ("streaming_llm", "tova", "h2o")


def eviction_baseline(name: str, sink: int, window: int, k: int, heads: str = "group") -> tuple[EvictionRule, DensePolicy]:
    "(rule, policy) of the baseline `name` with budget s + w + k per KV head."
    if name == "streaming_llm": return streaming_llm_rule(sink, window, k), DensePolicy()
    if name == "tova": return TOVARule(sink, window, k, heads), AttentionScorePolicy()
    if name == "h2o": return H2ORule(sink, window, k, heads), AttentionScorePolicy()
    raise ValueError(f"name must be one of {EVICTION_BASELINES}, got {name!r}")


# %% [markdown]
# ## Check against a brute-force simulation
#
# The reference recomputes every step from scratch: a full forward of the sequence so far in which
# query row $q$ of each layer and KV head sees exactly the set that head kept at step $q$ (explicit
# masks), the attention of the last row recomputed, scores updated in Python dictionaries, and the
# kept set chosen by sorting (ties: earlier). The cache decoding token by token must give the same
# logits and keep the same positions.

# %%
#| export
class RowsPolicy(MaskPolicy):
    "Row r of layer l, KV head h sees the positions `rows[l][h][r]`; records the last row's probabilities per layer and query head."
    def __init__(self, rows): self.rows, self.probs = rows, {}

    def mask(self, q, k, v, ctx):
        S, rows = k.shape[2], self.rows[ctx.layer_idx]
        m = torch.tensor([[[t in rows[h][r] for t in range(S)] for r in range(S)] for h in range(len(rows))])[None]
        G = q.shape[1] // k.shape[1]
        logits = torch.einsum("jd,jsd->js", q[0, :, -1], k[0].repeat_interleave(G, 0)) * ctx.scale  # explicit, not attention_probs
        self.probs[ctx.layer_idx] = [torch.softmax(logits[j].masked_fill(~m[0, j // G, -1], -torch.inf), -1)
                                     for j in range(q.shape[1])]
        return m


def eviction_reference(model, ids, kind: str, sink: int, window: int, k: int, heads: str = "group"):
    "Brute-force StreamingLLM/TOVA/H2O on a batch of one: per-step logits `[1,S,V]` and the kept positions per layer and KV head."
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    Hq, S = model.config.num_attention_heads, ids.shape[1]
    G = Hq // H
    rows = [[[] for _ in range(H)] for _ in range(L)]
    kept = [[set() for _ in range(H)] for _ in range(L)]
    score = [[{} for _ in range(H)] for _ in range(L)]
    logits = []
    for p in range(S):
        for l in range(L):
            for h in range(H): rows[l][h].append(kept[l][h] | {p})
        pol = RowsPolicy(rows)
        with torch.no_grad(), patch(model, pol): logits.append(model(ids[:, :p + 1]).logits[:, -1])
        for l in range(L):
            for h in range(H):
                group = range(h * G, (h + 1) * G) if heads == "group" else range(Hq)
                for t in rows[l][h][p]:
                    a = sum(pol.probs[l][j][t].item() for j in group) / len(group)
                    score[l][h][t] = a + (score[l][h].get(t, 0.0) if kind == "h2o" else 0.0)
                if kind == "streaming_llm":
                    kept[l][h] = {t for t in rows[l][h][p] if t < sink or p + 1 - t < window + k}
                    continue
                fixed = {t for t in rows[l][h][p] if t < sink or p + 1 - t < window}
                best = sorted((t for t in rows[l][h][p] if t not in fixed), key=lambda t: (-score[l][h][t], t))[:k]
                kept[l][h] = fixed | set(best)
                score[l][h] = {t: score[l][h][t] for t in kept[l][h]}
    return torch.stack(logits, 1), kept


# %%
def _decode(model, ids, rule, policy):
    "Logits of decoding `ids` token by token with an `EvictingCache(rule)`, and the cache."
    cache, out = EvictingCache(rule), []
    with torch.no_grad(), patch(model, policy):
        for t in range(ids.shape[1]): out.append(model(ids[:, t:t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1), cache


# %%
model, _ = load_model("tiny-llama", dtype=torch.float64)
ids = torch.randint(3, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
for kind, heads in (("tova", "group"), ("h2o", "group"), ("tova", "all")):
    rule, pol = eviction_baseline(kind, 1, 2, 3, heads)
    got, cache = _decode(model, ids, rule, pol)
    want, kept = eviction_reference(model, ids, kind, 1, 2, 3, heads)
    assert_close(got, want)
    for l, layer in enumerate(cache.layers):
        test_eq(layer.positions.shape[-1], 1 + 1 + 3)  # s + (w - 1) + k between steps
        for h in range(layer.positions.shape[1]): test_eq(layer.positions[0, h].tolist(), sorted(kept[l][h]))

# %% [markdown]
# The two KV heads of a layer keep different tokens with `heads="group"` and the same with `"all"`:

# %%
rule, pol = eviction_baseline("tova", 1, 2, 3, "group")
pos = _decode(model, ids, rule, pol)[1].layers[1].positions
assert not torch.equal(pos[0, 0], pos[0, 1])
rule, pol = eviction_baseline("tova", 1, 2, 3, "all")
pos = _decode(model, ids, rule, pol)[1].layers[1].positions
test_eq(pos[0, 0], pos[0, 1])

# %% [markdown]
# With a budget larger than the sequence nothing is evicted and every baseline equals the dense model;
# `generate` works with each of them.

# %%
with torch.no_grad(): dense = model(ids).logits
for name in EVICTION_BASELINES:
    assert_close(_decode(model, ids, *eviction_baseline(name, 2, 4, 20))[0], dense)
    rule, pol = eviction_baseline(name, 1, 2, 3)
    with torch.no_grad(), patch(model, pol):
        out = model.generate(ids[:, :6], attention_mask=torch.ones_like(ids[:, :6]), past_key_values=EvictingCache(rule),
                             max_new_tokens=8, do_sample=False)
    test_eq(out.shape, (1, 14))
