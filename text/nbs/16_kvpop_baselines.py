# %% [markdown]
# # Training-free eviction baselines
#
# > StreamingLLM, TOVA and H2O as `EvictionRule`s with KVpop's budget interface, and the policy that feeds them.

# %%
#| default_exp kvpop.baselines

# %%
#| export
from __future__ import annotations

import torch
from torch import Tensor

from sparsekv.attention import check_int, check_qkv
from sparsekv.cache import EvictingCache, EvictingLayer, EvictionRule, SinkWindowRule, TopScoreRule
from sparsekv.hf import DensePolicy, MaskPolicy, Method, heads_mask, patch

# %%
#| hide
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.models import load_model

# %% [markdown]
# All three baselines are budgeted like KVpop (Eq. 1): per KV head, `sink` first tokens, the
# `window` most recent tokens and `k` long-range slots, $B = s + w + k$.
#
# - **StreamingLLM** (Xiao et al.) keeps only sinks and recent tokens: with the same budget it is
#   `SinkWindowRule(sink, window + k)`.
# - **TOVA** (Oren et al.) evicts, at every step, the cached token with the lowest attention from
#   the current query. The original averages the attention over *all* heads of a layer (every head
#   then keeps the same tokens; kvpress's `TOVAPress` does the same), and so does `TOVA` by default
#   (`heads="all"`); `heads="group"` averages over the query heads of each KV head instead, so
#   heads keep different tokens (a variant, labelled as such in the tables). Here the score of an
#   entry is the attention it received from the latest query, and the `k` best of the tokens that
#   left the window are kept: with `sink=0, window=1` this is exactly TOVA with a cache of `k`.
# - **H2O** (Zhang et al.) keeps heavy hitters, the tokens with the largest *accumulated* attention
#   (summed over all queries since the token entered the cache, per KV head: mean over the group's
#   query heads, `heads="group"`, its default), plus a window of recent tokens.
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

# %%
# the values of the `heads` option (they name result rows): per KV head's group, or over all query heads
test_eq(HEAD_REDUCTIONS, ("group", "all"))


# %%
#| export
class AttentionScoreRule(TopScoreRule):
    "Sinks, a window and the `k` best attention-based scores of older entries; `observe` turns attention into scores."
    observes_attention = True

    def __init__(self, sink: int, window: int, k: int, heads: str = "group"):
        super().__init__(sink, window, k)
        if heads not in HEAD_REDUCTIONS: raise ValueError(f"heads must be one of {HEAD_REDUCTIONS}, got {heads!r}")
        self.heads = heads

    def visible(self, layer, query_positions):
        # a chunk: dense, evict after it
        if query_positions.shape[0] > 1: return EvictionRule.visible(self, layer, query_positions)
        return super().visible(layer, query_positions)

    def observe(self, layer: EvictingLayer, probs: Tensor) -> None:
        "Update `layer.scores` from the attention `probs` [B,Hkv,Sq,N] of this call's queries over the layer's entries."
        raise NotImplementedError(f"{type(self).__name__} must implement observe(layer, probs)")


# %%
# s = 1, w = 1, k = 1 over positions 0..5: a chunk of queries sees every earlier entry (dense, evict after it); one
# query (5) sees the sink, itself and the best-scored older entry (position 1, score 5)
_lay = SimpleNamespace(positions=torch.arange(6).expand(1, 1, 6), scores=torch.tensor([[[0.0, 5, 1, 4, 0, 0]]]))
_asr = AttentionScoreRule(1, 1, 1)
test_eq(_asr.visible(_lay, torch.tensor([4, 5]))[0, 0].int().tolist(), [[1, 1, 1, 1, 1, 0], [1] * 6])
test_eq(_asr.visible(_lay, torch.tensor([5]))[0, 0, 0].int().tolist(), [1, 1, 0, 0, 0, 1])
test_eq((_asr.heads, _asr.observes_attention), ("group", True))
test_fail(lambda: _asr.observe(_lay, None), exc=NotImplementedError, contains="must implement observe")
test_fail(lambda: AttentionScoreRule(1, 1, 1, heads="max"), contains="heads must be one of")


# %%
#| export
class TOVARule(AttentionScoreRule):
    "TOVA: an entry's score is the attention it gets from the latest query."

    def observe(self, layer, probs):
        layer.scores = probs[:, :, -1].float()


# %%
_probs = torch.tensor([[[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]]])  # [B=1, Hkv=1, Sq=2, N=3]
_lay = SimpleNamespace(scores=torch.tensor([[[9.0, 9.0, 9.0]]]))
TOVARule(0, 1, 2).observe(_lay, _probs)
test_eq(_lay.scores, torch.tensor([[[0.2, 0.3, 0.5]]]))  # the latest query's attention replaces the scores


# %%
#| export
class H2ORule(AttentionScoreRule):
    "H2O: an entry's score is the attention it has accumulated over all queries since it was cached."

    def observe(self, layer, probs):
        layer.scores = layer.scores + probs.sum(2).float()


# %%
_lay = SimpleNamespace(scores=torch.tensor([[[1.0, 0.0, 0.0]]]))
H2ORule(0, 1, 2).observe(_lay, _probs)
assert_close(_lay.scores, torch.tensor([[[1.7, 0.8, 0.5]]]))  # accumulated over both queries


# %%
#| export
def streaming_llm_rule(sink: int, window: int, k: int) -> SinkWindowRule:
    "StreamingLLM with KVpop's budget s + w + k: sinks and the window + k most recent tokens."
    return SinkWindowRule(sink, window + k)


# %%
_sl = streaming_llm_rule(2, 3, 4)
test_eq((type(_sl), _sl.sink, _sl.window), (SinkWindowRule, 2, 3 + 4))


# %% [markdown]
# ## The attention the rules observe
#
# The policy computes the probabilities of the call's queries over the cached keys (GQA: query head
# $hG+g$ reads KV head $h$) and reduces them over heads: the mean over each KV head's group, or the
# mean over all query heads repeated for every KV head.

# %%
#| export
def attention_probs(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    "Softmax probabilities [B,Hq,Sq,N] of q [B,Hq,Sq,D] over k [B,Hkv,N,D]; `mask` boolean (True = attend) or None."
    (B, Hq, Sq, D), (H, N) = q.shape, k.shape[1:3]
    # a KV head's G query heads as G * Sq queries of it: one bmm over the KV heads, no copy of the keys per query head
    logits = torch.bmm(q.reshape(B * H, Hq // H * Sq, D), k.reshape(B * H, N, D).mT).view(B, Hq, Sq, N).float() * scale
    if mask is not None: logits = logits.masked_fill(~heads_mask(mask, Hq), float("-inf"))
    return torch.softmax(logits, -1)


# %%
q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8)
m = torch.rand(1, 2, 2, 5) > 0.3
m[..., 0] = True
ref = torch.stack([torch.softmax((q[0, h] @ k[0, h // 2].T * 0.3).masked_fill(~m[0, h // 2], -torch.inf), -1)
                   for h in range(4)])[None]
assert_close(attention_probs(q, k, m, 0.3), ref)
assert_close(attention_probs(q[:, :, -1:], k, None, 0.3), torch.softmax(ref.new_tensor(
    [[(q[0, h, -1] @ k[0, h // 2].T * 0.3).tolist()] for h in range(4)]), -1)[None])
q2, k2 = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 8, 5).mT  # two batch rows, keys not contiguous
test_eq(k2.is_contiguous(), False)
assert_close(attention_probs(q2, k2, None, 0.3), torch.stack([torch.stack(
    [torch.softmax(q2[b, h] @ k2[b, h // 2].T * 0.3, -1) for h in range(4)]) for b in range(2)]))


# %%
#| export
def reduce_heads(probs: Tensor, n_kv_heads: int, heads: str = "group") -> Tensor:
    "Per-KV-head attention [B,Hkv,Sq,N] from [B,Hq,Sq,N]: mean per group ('group') or over all heads ('all')."
    if heads not in HEAD_REDUCTIONS: raise ValueError(f"heads must be one of {HEAD_REDUCTIONS}, got {heads!r}")
    B, Hq, Sq, N = probs.shape
    if heads == "all": return probs.mean(1, keepdim=True).expand(B, n_kv_heads, Sq, N)
    return probs.view(B, n_kv_heads, Hq // n_kv_heads, Sq, N).mean(2)


# %%
p = torch.softmax(torch.randn(2, 6, 3, 5), -1)
assert_close(reduce_heads(p, 2)[:, 1], p[:, 3:6].mean(1))
assert_close(reduce_heads(p, 3, "all")[:, 2], p.mean(1))
test_fail(lambda: reduce_heads(p, 2, "max"), contains="heads must be one of")


# %%
#| export
class AttentionScorePolicy(DensePolicy):
    "Exact attention that also hands its probabilities to an `AttentionScoreRule`'s cache layer (before eviction)."

    def attend(self, q, k, v, ctx):
        layer = ctx.cache_layer
        if isinstance(layer, EvictingLayer) and isinstance(layer.rule, AttentionScoreRule):
            check_qkv(q, k, v)
            # a decode query without a mask sees every kept entry (see `EvictionRule.keep`)
            mask = None if q.shape[2] == 1 and ctx.mask is None else ctx.full_mask()
            probs = attention_probs(q, k, mask, ctx.scale)
            layer.rule.observe(layer, reduce_heads(probs, k.shape[1], layer.rule.heads))
        return super().attend(q, k, v, ctx)


# %%
from sparsekv.hf import dense_attention

_q, _k, _v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
_causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
_layer = EvictingLayer(TOVARule(0, 1, 2), 0)
_ctx = SimpleNamespace(cache_layer=_layer, mask=None, scale=0.5, dropout=0.0, full_mask=lambda: _causal)
assert_close(AttentionScorePolicy().attend(_q, _k, _v, _ctx), dense_attention(_q, _k, _v, None, 0.5, 0.0))
assert_close(_layer.scores, reduce_heads(attention_probs(_q, _k, _causal, 0.5), 2)[:, :, -1])  # what TOVA observes


# %% [markdown]
# ## The baselines as methods
#
# A user gives one number, the budget $B$ of KV entries per KV head; `split_budget` turns it into
# KVpop's split (Eq. 1), $B = s + w + k$: by default the paper's $s = 4$ sinks and its window scaled
# with the budget, $w = \mathrm{round}(256\,B / 4356)$ (App. F: $w = 256$ next to $s + k = 4 + 4096$),
# at least 1; the rest are the $k$ long-range slots. `EvictionMethod` is the family of methods that
# evict while reading (`sparsekv.hf.Method`): its `cache(model)` is an `EvictingCache` of its `rule()`,
# used under its `policy()`, so the cache never keeps more than $B$ entries per KV head between
# steps. Each baseline is one subclass with a `name`, which registers it for `sparsekv.methods`:
# adding an eviction baseline means adding its rule and one such class here.
#
# The split, by hand: $B = 4356$ gives KVpop's $(4, 256, 4096)$; small budgets keep a window of one and
# as many sinks as fit.

# %%
#| export
def split_budget(budget: int, sink: int | None = None, window: int | None = None) -> tuple[int, int, int]:
    "(sink, window, k), s + w + k = `budget`; default s = 4, w = round(256 B / 4356) >= 1 (KVpop: w = 256 at B = 4356)."
    B = Method.check_budget(budget)
    if window is None: window = min(B, max(1, round(256 * B / 4356)))
    if sink is None: sink = min(4, B - window)
    check_int(window, "window", 1), check_int(sink, "sink", 0)
    if sink + window > B: raise ValueError(f"budget={B} must cover sink + window = {sink} + {window}")
    return sink, window, B - sink - window


# %%
test_eq(split_budget(4356), (4, 256, 4096))
test_eq([split_budget(b) for b in (1, 3, 5, 40)], [(0, 1, 0), (2, 1, 0), (4, 1, 0), (4, 2, 34)])
test_eq(split_budget(10, sink=1, window=2), (1, 2, 7))
test_fail(lambda: split_budget(4, sink=2, window=3), contains="budget=4 must cover")


# %%
#| export
class EvictionMethod(Method):
    "Evict while reading: an `EvictingCache` of `rule()` under `policy()` keeps sink + window + k entries per KV head."
    family = "eviction"

    def __init__(self, budget: int, sink: int | None = None, window: int | None = None, chunk_size: int | None = None):
        super().__init__(budget)
        self.sink, self.window, self.k = split_budget(self.budget, sink, window)
        if chunk_size is not None: check_int(chunk_size, "chunk_size", 1)  # None: the whole prompt in one call
        self.chunk_size = chunk_size

    def rule(self) -> EvictionRule:
        "The eviction rule of one run."
        raise NotImplementedError(f"{type(self).__name__} must implement rule()")

    def cache(self, model) -> EvictingCache:
        return EvictingCache(self.rule())


# %%
_em = EvictionMethod(20, 2, 4, chunk_size=8)
test_eq((_em.sink, _em.window, _em.k, _em.chunk_size, _em.family), (2, 4, 14, 8, "eviction"))
test_fail(lambda: _em.rule(), exc=NotImplementedError, contains="EvictionMethod must implement rule()")
test_fail(lambda: EvictionMethod(20, chunk_size=0), contains="chunk_size must be an int >= 1")


# %%
#| export
class StreamingLLM(EvictionMethod):
    "StreamingLLM (Xiao et al.): the sinks and the window + k most recent tokens."
    name = "streaming_llm"

    def rule(self) -> SinkWindowRule:
        return streaming_llm_rule(self.sink, self.window, self.k)


# %%
test_eq(type(StreamingLLM(20, 2, 4).rule()).__name__, "SinkWindowRule")
test_eq(StreamingLLM(20, 2, 4).rule().window, 4 + 14)
test_eq(type(StreamingLLM(20, 2, 4).cache(None).rule), SinkWindowRule)


# %%
#| export
class TOVA(EvictionMethod):
    """TOVA (Oren et al.): the k older entries most attended by the latest query; `heads` 'all' (the paper's and
    kvpress's: attention averaged over every query head, one kept set) or 'group' (per KV head's group)."""
    name = "tova"
    rule_class = TOVARule
    default_heads = "all"

    def __init__(self, budget: int, sink: int | None = None, window: int | None = None, heads: str | None = None,
                 chunk_size: int | None = None):
        super().__init__(budget, sink, window, chunk_size)
        heads = self.default_heads if heads is None else heads
        if heads not in HEAD_REDUCTIONS: raise ValueError(f"heads must be one of {HEAD_REDUCTIONS}, got {heads!r}")
        self.heads = heads

    def rule(self) -> AttentionScoreRule:
        return self.rule_class(self.sink, self.window, self.k, self.heads)

    def policy(self) -> AttentionScorePolicy:
        return AttentionScorePolicy()


# %%
test_fail(lambda: TOVA(0), contains="budget must be")
test_fail(lambda: TOVA(8, heads="max"), contains="heads must be one of")
test_eq(TOVA(8, heads="group").rule().heads, "group")
test_eq((type(TOVA(8).policy()), (TOVA(8).rule().sink, TOVA(8).rule().k)), (AttentionScorePolicy, split_budget(8)[::2]))


# %% [markdown]
# The registry builds the rules of each name, with TOVA's heads averaged as in its paper and H2O's per group:

# %%
#| export
class H2O(TOVA):
    "H2O (Zhang et al.): the k older entries with the most attention accumulated since they were cached."
    name = "h2o"
    rule_class = H2ORule
    default_heads = "group"  # each KV head keeps its own heavy hitters, as H2O scores every head separately


# %%
test_eq([type(Method.registry[n](8).rule()).__name__ for n in ("tova", "h2o")], ["TOVARule", "H2ORule"])
test_eq([Method.registry[n](8).rule().heads for n in ("tova", "h2o")], ["all", "group"])  # TOVA: the paper's


def _baseline(name, sink, window, k, heads="group"):
    "(rule, policy) of baseline `name` at sink + window + k."
    m = Method.registry[name](sink + window + k, sink, window, **({} if name == "streaming_llm" else {"heads": heads}))
    return m.rule(), m.policy()


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
    "Row r of layer l, KV head h sees positions `rows[l][h][r]`; records the last row's probabilities per query head."
    def __init__(self, rows): self.rows, self.probs = rows, {}

    def mask(self, q, k, v, ctx):
        S, rows = k.shape[2], self.rows[ctx.layer_idx]
        m = torch.tensor([[[t in rows[h][r] for t in range(S)] for r in range(S)] for h in range(len(rows))])[None]
        G = q.shape[1] // k.shape[1]
        # explicit, not attention_probs
        logits = torch.einsum("jd,jsd->js", q[0, :, -1], k[0].repeat_interleave(G, 0)) * ctx.scale
        self.probs[ctx.layer_idx] = [torch.softmax(logits[j].masked_fill(~m[0, j // G, -1], -torch.inf), -1)
                                     for j in range(q.shape[1])]
        return m


# %%
# one layer, one KV head, two query heads: rows 0, 1, 2 see {0}, {0, 1}, {0, 2}
_rp = RowsPolicy([[[{0}, {0, 1}, {0, 2}]]])
_q, _k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
test_eq(_rp.mask(_q, _k, None, SimpleNamespace(layer_idx=0, scale=0.5))[0, 0].int().tolist(),
        [[1, 0, 0], [1, 1, 0], [1, 0, 1]])
for j in range(2):
    _w = torch.softmax(_k[0, 0, [0, 2]] @ _q[0, j, -1] * 0.5, -1)
    assert_close(_rp.probs[0][j], torch.tensor([_w[0], 0.0, _w[1]]))


# %%
#| export
def eviction_reference(model, ids, kind: str, sink: int, window: int, k: int, heads: str = "group"):
    "Brute-force StreamingLLM/TOVA/H2O on one sequence: step logits `[1,S,V]`, kept positions per layer and KV head."
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


model, _ = load_model("tiny-llama", dtype=torch.float64)
ids = torch.randint(3, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
for kind, heads in (("tova", "group"), ("h2o", "group"), ("tova", "all")):
    rule, pol = _baseline(kind, 1, 2, 3, heads)
    got, cache = _decode(model, ids, rule, pol)
    want, kept = eviction_reference(model, ids, kind, 1, 2, 3, heads)
    assert_close(got, want)
    for l, layer in enumerate(cache.layers):
        test_eq(layer.positions.shape[-1], 1 + 1 + 3)  # s + (w - 1) + k between steps
        for h in range(layer.positions.shape[1]): test_eq(layer.positions[0, h].tolist(), sorted(kept[l][h]))

# %% [markdown]
# The two KV heads of a layer keep different tokens with `heads="group"` and the same with `"all"`:

# %%
rule, pol = _baseline("tova", 1, 2, 3, "group")
pos = _decode(model, ids, rule, pol)[1].layers[1].positions
assert not torch.equal(pos[0, 0], pos[0, 1])
rule, pol = _baseline("tova", 1, 2, 3, "all")
pos = _decode(model, ids, rule, pol)[1].layers[1].positions
test_eq(pos[0, 0], pos[0, 1])

# %% [markdown]
# With a budget larger than the sequence nothing is evicted and every baseline equals the dense model;
# `generate` works with each of them.

# %%
with torch.no_grad(): dense = model(ids).logits
for name in ("streaming_llm", "tova", "h2o"):
    assert_close(_decode(model, ids, *_baseline(name, 2, 4, 20))[0], dense)
    rule, pol = _baseline(name, 1, 2, 3)
    with torch.no_grad(), patch(model, pol):
        out = model.generate(ids[:, :6], attention_mask=torch.ones_like(ids[:, :6]),
                             past_key_values=EvictingCache(rule),
                             max_new_tokens=8, do_sample=False)
    test_eq(out.shape, (1, 14))
