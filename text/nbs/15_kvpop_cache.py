# %% [markdown]
# # KVpop: bounded-cache inference
#
# > A `transformers` cache holding per KV head exactly `s` sinks, a ring of `w` recent tokens and `k` long-range slots; tokens leaving the window are kept by their learned static priority (§3, §4 "Inference efficiency", App. C).

# %%
#| default_exp kvpop.cache

# %%
#| export
from __future__ import annotations

import torch
from torch import Tensor, nn

from sparsekv.hf import DensePolicy, EvictingCache, EvictingLayer, MaskPolicy, SinkWindowRule, TopScoreRule, dense_attention
from sparsekv.kvpop.cutoff import LogDecay, check_budget, topk_cutoff
from sparsekv.kvpop.mask import kvpop_mask
from sparsekv.kvpop.scorers import MLPScorer, MLSTMScorer

# %%
#| hide
from fastcore.test import test_eq, test_fail
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
    "Per layer one scorer (raw scores from [k; v]) and one `LogDecay`; `priority` gives static priorities at absolute positions."

    def __init__(self, scorers: list[nn.Module], decays: list[LogDecay], n: int = 1):
        super().__init__()
        if len(scorers) != len(decays) or not scorers:
            raise ValueError(f"need one scorer and one LogDecay per layer, got {len(scorers)} scorers and {len(decays)} decays")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1: raise ValueError(f"n (the decay step) must be an int >= 1, got {n!r}")
        self.scorers, self.decays, self.n = nn.ModuleList(scorers), nn.ModuleList(decays), n

    @classmethod
    def mlp(cls, num_layers: int, num_kv_heads: int, head_dim: int, n: int = 1, **decay_kwargs) -> "KVpopScorers":
        "MLP scorers (zero score head: neutral ranking) and default decays for every layer."
        return cls([MLPScorer(num_kv_heads, head_dim) for _ in range(num_layers)],
                   [LogDecay(num_kv_heads, **decay_kwargs) for _ in range(num_layers)], n)

    @classmethod
    def mlstm(cls, num_layers: int, num_kv_heads: int, head_dim: int, delay: int, n: int = 1, **decay_kwargs) -> "KVpopScorers":
        "mLSTM scorers with readout delay `delay` (= the window w in KVpop) and default decays for every layer."
        return cls([MLSTMScorer(num_kv_heads, head_dim, delay=delay) for _ in range(num_layers)],
                   [LogDecay(num_kv_heads, **decay_kwargs) for _ in range(num_layers)], n)

    def raw(self, layer_idx: int, k: Tensor, v: Tensor) -> Tensor:
        "Raw scores [B,Hkv,S] of layer `layer_idx` from keys/values [B,Hkv,S,d]."
        return self.scorers[self._layer(layer_idx)](k, v).float()

    def priority(self, layer_idx: int, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
        "Static priorities r_t - floor(t/n) log(gamma_h), float32 [B,Hkv,S], of entries at absolute `positions` [B,Hkv,S]."
        return self.decayed(layer_idx, self.raw(layer_idx, k, v), positions)

    def decayed(self, layer_idx: int, r: Tensor, positions: Tensor) -> Tensor:
        "Static priorities, float32, of raw scores r at absolute `positions` (same shape, heads in dim 1)."
        log_gamma = self.decays[self._layer(layer_idx)]().to(r.device, torch.float32)  # ranking in float32 (App. F)
        log_gamma = log_gamma.view(1, -1, *([1] * (r.dim() - 2)))
        return r.float() - torch.div(positions, self.n, rounding_mode="floor").float() * log_gamma

    def _layer(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < len(self.scorers): raise ValueError(f"layer_idx must lie in [0, {len(self.scorers)}), got {layer_idx}")
        return layer_idx


# %% [markdown]
# At positions $0..S-1$ `priority` is `static_priority` of the raw scores, for $n = 1$ and for age
# buckets $n > 1$:

# %%
from sparsekv.kvpop.cutoff import static_priority

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

# %%
#| export
class KVpopRule(TopScoreRule):
    "KVpop eviction (Eq. 1): `sink` sinks, a `window` of recent tokens, the `k` best static priorities of older tokens."

    def __init__(self, scorers: KVpopScorers, sink: int, window: int, k: int):
        check_budget(k, sink, window)
        if not isinstance(scorers, KVpopScorers): raise TypeError(f"scorers must be a KVpopScorers, got {type(scorers).__name__}")
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
        "Static priorities of the new entries; a delayed scorer also scores the older entries read out now (see `DelayedReadout`)."
        with torch.no_grad():
            if not self.recurrent: return self.kvpop.priority(layer.layer_idx, keys, values, positions)
            return self._recurrent_scores(layer, keys, values, positions)

    def visible(self, layer, query_positions):
        if not self.recurrent: return super().visible(layer, query_positions)
        t, p = layer.positions[:, :, None, :], query_positions[:, None]
        pending = t >= layer.kvpop_readout.pending_from  # scored later: never eligible yet (delay <= window), kept meanwhile
        base = SinkWindowRule.visible(self, layer, query_positions) | ((t <= p) & pending)
        eligible = (t >= self.sink) & (p - t >= self.window) & ~pending
        s = layer.scores[:, :, None, :].expand(eligible.shape).masked_fill(~eligible, float("-inf"))
        best = s.argsort(dim=-1, descending=True, stable=True)[..., :self.k]  # ties -> earlier (entries in position order)
        return base | (torch.zeros_like(eligible).scatter(-1, best, True) & eligible)

    def _recurrent_scores(self, layer, keys, values, positions):
        "Step the layer's mLSTM over the new tokens, read out tokens u = t - delay and give them their static priorities."
        scorer = self.kvpop.scorers[layer.layer_idx]
        if int(positions[0, 0, 0]) == 0 or getattr(layer, "kvpop_readout", None) is None:  # a new sequence
            layer.kvpop_readout = DelayedReadout(scorer.init_state(keys.shape[0], keys.device),
                                                 scorer.query_feature(keys[:, :, :0], values[:, :, :0]))
        ro = layer.kvpop_readout
        ro.queue = torch.cat([ro.queue, scorer.query_feature(keys, values)], dim=2)  # read features of unread tokens
        raw = []
        for j in range(keys.shape[2]):
            ro.state = scorer.step(ro.state, keys[:, :, j], values[:, :, j])
            if int(positions[0, 0, j]) >= self.delay:  # token u = t - delay reads the state after t (Eq. 41)
                raw.append(scorer.readout(ro.state, ro.queue[:, :, 0]))
                ro.queue = ro.queue[:, :, 1:]
        t_end = int(positions[0, 0, -1]) + 1
        read = torch.arange(ro.pending_from, ro.pending_from + len(raw), device=keys.device)
        new = torch.zeros(positions.shape, dtype=torch.float32, device=keys.device)  # pending: never ranked before it is read
        if raw:
            prio = self.kvpop.decayed(layer.layer_idx, torch.stack(raw, -1), read.expand(*positions.shape[:2], -1))
            old = layer.positions[..., None] == read  # [B,H,N,R]: cached entries read now
            layer.scores = torch.where(old.any(-1), (old * prio[:, :, None]).sum(-1), layer.scores)
            fresh = positions[..., None] == read
            new = torch.where(fresh.any(-1), (fresh * prio[:, :, None]).sum(-1), new)
        ro.pending_from = max(t_end - self.delay, 0)
        return new

    def keep(self, layer, next_position):
        if self.recurrent and not getattr(layer, "kvpop_masked", False):
            raise RuntimeError("a KVpop cache with recurrent (mLSTM) scorers decodes only under KVpopPolicy (it masks decode queries)")
        layer.kvpop_masked = False
        return super().keep(layer, next_position)


class DelayedReadout:
    "Per-layer state of a recurrent scorer in the cache: the mLSTM state, read features of unread tokens, first unread position."

    def __init__(self, state, queue: Tensor):
        self.state, self.queue, self.pending_from = state, queue, 0


class KVpopPolicy(DensePolicy):
    "Exact attention over what a `KVpopRule` shows each query, decode included (needed by recurrent scorers)."

    def decode(self, q, k, v, ctx):
        layer = ctx.cache_layer
        if not isinstance(layer, EvictingLayer) or not isinstance(layer.rule, KVpopRule): return super().decode(q, k, v, ctx)
        layer.kvpop_masked = True
        return dense_attention(q, k, v, layer.rule.visible(layer, ctx.query_positions), ctx.scale, ctx.dropout)

    def prefill(self, q, k, v, ctx):
        if isinstance(ctx.cache_layer, EvictingLayer): ctx.cache_layer.kvpop_masked = True  # the dispatcher masks chunks itself
        return super().prefill(q, k, v, ctx)


class KVpopCache(EvictingCache):
    "A bounded KVpop cache (use inside `sparsekv.hf.patch`): per KV head s sinks, w recent and k long-range entries."

    def __init__(self, scorers: KVpopScorers, sink: int, window: int, k: int):
        super().__init__(KVpopRule(scorers, sink, window, k))


# %% [markdown]
# ## The training-time mask as a policy
#
# The reference is the training-time computation: a full forward in which every layer scores its own
# keys and values, ranks them with `topk_cutoff` on the static priorities and attends under
# `kvpop_mask` (Eq. 26). `KVpopMaskPolicy` does exactly that with no cache (teacher forcing).

# %%
#| export
class KVpopMaskPolicy(MaskPolicy):
    "Teacher-forced KVpop: each layer masks its attention with `kvpop_mask` from its scorers' priorities on the whole sequence."

    def __init__(self, scorers: KVpopScorers, sink: int, window: int, k: int):
        self.k, self.sink, self.window = check_budget(k, sink, window)
        self.scorers = scorers

    def mask(self, q, k, v, ctx):
        if ctx.past_len: raise ValueError("KVpopMaskPolicy masks a whole sequence: call it without a cache")
        with torch.no_grad():
            prio = self.scorers.priority(ctx.layer_idx, k, v, ctx.key_positions)
            rank, cutoff = topk_cutoff(prio, self.k, self.sink, self.window)
        return kvpop_mask(rank, cutoff, self.sink, self.window)


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
cache = KVpopCache(ms, s, w, kk)
_, last = chunked_prefill(model, ids[:, :13], 5, KVpopPolicy(), cache)
assert_close(last, want[:, 12])
with torch.no_grad(), patch(model, KVpopPolicy()):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=KVpopCache(ms, s, w, kk),
                         max_new_tokens=10, do_sample=False)
seq = prompt
with torch.no_grad(), patch(model, KVpopMaskPolicy(ms, s, w, kk)):
    for _ in range(10): seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
test_eq(out, seq)
test_fail(lambda: KVpopRule(ms, s, w - 1, kk), contains="delays must be one value <= window")
test_fail(lambda: chunked_prefill(model, ids[:, :4], 4, DensePolicy(), KVpopCache(ms, s, w, kk)), contains="only under KVpopPolicy")

# %%
test_fail(lambda: KVpopCache(scorers, 0, 3, 0), contains="k must be an int >= 1")
test_fail(lambda: KVpopRule(scorers, 1, 0, 4), contains="window must be an int >= 1")
test_fail(lambda: KVpopRule(object(), 1, 2, 4), contains="scorers must be a KVpopScorers")
