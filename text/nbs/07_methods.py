# %% [markdown]
# # Methods
#
# > One object per method, found by name: `methods.make("tova", budget=256)`, then `m.generate` or `m.patch`.

# %%
#| default_exp methods

# %%
#| export
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping

from fastcore.basics import patch_to
from torch import Tensor

from sparsekv.attention import check_int
from sparsekv.cache import EvictingCache, GrowingCache, GrowingLayer, query_count
from sparsekv.hf import (  # noqa: F401
    METHOD_FAMILIES,
    PHASES,
    AttentionContext,
    AttentionPolicy,
    Method,
    ModelShape,
    ScoringCost,
    queries_per_call,
    scoring_cost,
)

# Every method lives with its paper's code; importing them registers them and makes them reachable from here.
from sparsekv.kvpop.baselines import H2O, TOVA, EvictionMethod, StreamingLLM, split_budget  # noqa: F401
from sparsekv.kvpop.dms import DMS  # noqa: F401
from sparsekv.kvpop.student import KVpopMLP, KVpopMLSTM, StreamingLLMPlus, TrainedMethod  # noqa: F401
from sparsekv.oval.summaries import OVAL, ArkVale, KeyPCA, OraclePages, PageRetrieval, Quest  # noqa: F401
from sparsekv.quoka.baselines import LessIsMore, Loki, MeanScores, SampleAttention, SparQ  # noqa: F401
from sparsekv.quoka.policy import BaselineSelection, Quoka, SelectionMethod  # noqa: F401

# %%
#| hide
from types import SimpleNamespace

import torch
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

from sparsekv.hf import DensePolicy, MaskPolicy, chunked_prefill, measure_attended, patch
from sparsekv.kvpop.baselines import TOVARule
from sparsekv.kvpop.cache import KVpopCache, KVpopMaskPolicy, KVpopPolicy, random_scorers
from sparsekv.models import load_model
from sparsekv.oval.pages import PageRetrievalPolicy
from sparsekv.quoka.policy import QuokaPolicy
from sparsekv.quoka.select import quoka_select

torch.set_num_threads(1)  # tiny model: threads only add overhead


# %% [markdown]
# Every method of this package, its papers' baselines included, is one `sparsekv.hf.Method`: a name, a
# budget, the method's own parameters as keyword arguments (the papers' defaults), and two ways to run it:
#
# ```python
# m = methods.make("tova", budget=256)
# out = m.generate(model, input_ids, max_new_tokens=20, do_sample=False)  # token ids
# with m.patch(model) as past_key_values:   # advanced: the cache to pass
#     model(input_ids, past_key_values=past_key_values)
# ```
#
# `budget` is always the number of KV entries each query may attend to, per KV head. Each family maps it
# onto a policy (`patch` routes every attention call to it) and a cache:
#
# | family | setting | policy | cache | `budget` means |
# |---|---|---|---|---|
# | `eviction` | evict while reading: the prompt and the generated tokens go through a bounded cache | dense over what the cache keeps (TOVA, H2O: it also scores the entries; KVpop: masks the mLSTM's unread token) | `EvictingCache(rule)` / `KVpopCache` / `DMSCache` | $B = s + w + k$ kept entries (`split_budget`: $s = 4$, $w = \mathrm{round}(256B/4356)$, the rest $k$); DMS: a training target met on average |
# | `selection` | chunked prefill of `chunk_size` ($B_{CP}$ = 128) tokens with a selection policy; decode likewise | `QuokaPolicy`, `BaselinePolicy(select_fn)`, `LessIsMorePolicy` | `GrowingCache` (the full cache, written in place) | $B_{SA}$ earlier keys per chunk (or a float fraction of the cache), plus the chunk's own keys causally |
# | `retrieval` | dense prefill, sparse decode | `PageRetrievalPolicy(summary)` | `GrowingCache` (the full cache, written in place) | `token_budget`: sink, recent and top-scored pages, the sink and recent regions rounded out to pages |
# | `dense` | exact attention | `DensePolicy` | `GrowingCache` | ignored |
# | composition `'first+then'` (`PrefillDecode`) | one method reads the prompt, another generates (e.g. `quoka+kvpop_mlstm`, `dense+streaming_llm`) | `RoutedPolicy(first, then)` | the first's full cache, handed to the second's evicting cache at the first decode step (`HandoffCache`) when the second evicts | one budget, each part in its own terms |
#
# **Padded batches.** `generate(model, ids, attention_mask=...)` takes `generate`'s left padding. The dense,
# selection and retrieval methods give each row exactly the tokens it gets alone (each row selects over its own
# tokens, see `sparsekv.hf`); the eviction methods refuse padding before any work (their cache keeps entries per
# batch column, not per row), so generate their prompts one at a time or in batches of equal length
# (tests/test_padding.py checks every method).
#
# Each method lives with its paper's code, where adding a baseline is one subclass beside its algorithm: the
# eviction methods with KVpop's (`sparsekv.kvpop.baselines`, `.student`, `.dms`, one `EvictionMethod` subclass
# beside its rule), the selection methods with QuoKA's (`sparsekv.quoka.baselines`, one `SelectionMethod`
# subclass beside its selection function; QuoKA's own in `sparsekv.quoka.policy`), the retrieval methods with OVAL's
# (`sparsekv.oval.summaries`, one `PageRetrieval` subclass beside its page summary). This module imports them all,
# so importing it registers every method; the paper packages never import it. The scoring cost every method states
# (`ModelShape`, `ScoringCost`, `scoring_cost`) is defined with `Method` in `sparsekv.hf`.

# %% [markdown]
# ## The registry

# %%
#| export
def names(family: str | None = None) -> list[str]:
    "The registered method names (of `family`, one of `sparsekv.hf.METHOD_FAMILIES`, if given), sorted."
    if family is not None and family not in METHOD_FAMILIES:
        raise ValueError(f"family must be one of {METHOD_FAMILIES} or None, got {family!r}")
    return sorted(n for n, c in Method.registry.items() if family is None or c.family == family)


# %%
# each family lists its own methods (a new baseline joins its family here by being defined, nowhere else)
assert {"arkvale", "key_pca", "oracle_pages", "oval", "quest"} <= set(names("retrieval"))
assert all(Method.registry[n].family == f for f in METHOD_FAMILIES for n in names(f))
assert {"quoka", "tova", "oval"} <= set(names()) and names() == sorted(names())
test_fail(lambda: names("bogus_family"), contains="family must be one of")


# %% [markdown]
# A name is one registered method, or `'prefill+decode'` of two (the composition below):

# %%
#| export
def get(name: str) -> type:
    "The method class registered as `name`; 'first+then' (e.g. 'quoka+kvpop_mlstm') is a `PrefillDecode`."
    if not isinstance(name, str):
        raise TypeError(f"name must be a method name (a str), one of {names()} or 'prefill+decode' of two of them, "
                        f"got {name!r}")
    if name.count("+") > 1:  # 'a+b+c' would read as a+(b+c): b's decode silently replaced by c's
        raise ValueError(f"name {name!r} composes {name.count('+') + 1} methods; a composition is 'prefill+decode' "
                         "of two (one reads the prompt, the other generates)")
    if "+" in name:
        for part in name.split("+"): get(part)
        return PrefillDecode
    if name not in Method.registry:
        raise ValueError(f"name must be one of {names()} or 'prefill+decode' of two of them, got {name!r}")
    return Method.registry[name]


# %%
test_eq((get("quoka"), get("oval"), get("tova")), (Quoka, OVAL, TOVA))
test_fail(lambda: get("snapkv"), contains="name must be one of")
test_fail(lambda: get("quoka+oval+quest"), contains="composes 3 methods")
test_fail(lambda: get("quoka+nope"), contains="'prefill+decode' of two of them")
test_fail(lambda: get(None), exc=TypeError, contains="name must be a method name (a str)")


# %% [markdown]
# `make` builds a method at a budget with its own parameters, refusing those it does not take:

# %%
#| export
def make(name: str, budget: int | None = None, **params) -> Method:
    """Method `name` at `budget` KV entries per query and KV head, with its own `params` (the papers' defaults);
    'first+then': `PrefillDecode(budget, first, then, prefill_params=..., decode_params=...)`."""
    cls = get(name)
    if "+" in name:
        if {"prefill", "decode"} & set(params): raise TypeError(f"{name} names its parts: pass no prefill or decode")
        params = dict(zip(("prefill", "decode"), name.split("+", 1))) | params
    sig = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in sig.values()):
        unknown = sorted(set(params) - set(sig) - {"budget"})
        if unknown: raise TypeError(f"{name} takes no parameter {unknown}; accepted: {sorted(set(sig) - {'budget'})}")
    return cls(**params) if budget is None else cls(budget, **params)


# %%
m = make("tova", budget=4356)
test_eq((type(m), m.sink, m.window, m.k), (TOVA, 4, 256, 4096))
test_eq(make("quoka", budget=0.25, n_q=4).policy().budget, 0.25)
test_fail(lambda: make("oval", budget=512, eta_typo=0.5), contains="accepted")


# %% [markdown]
# ## Dense

# %%
#| export
class Dense(Method):
    "Exact attention over the full cache, the reference; `budget` is optional, checked when given, unused."
    name = "dense"

    def __init__(self, budget: int | None = None):
        self.budget = None if budget is None else self.check_budget(budget)

    def scoring_cost(self, shape, n_cached: int, phase: str = "prefill", chunk: int | None = None) -> ScoringCost:
        "Zero: dense attention chooses no keys."
        ModelShape.of(shape), check_int(n_cached, "n_cached"), queries_per_call(phase, chunk, 1)
        return ScoringCost()


# %%
test_eq((Dense().budget, Dense(8).budget, make("dense", 8).budget, get("dense")), (None, 8, 8, Dense))
test_eq(Dense().scoring_cost(ModelShape(9, 3, 64, 30), 4096), ScoringCost())
test_fail(lambda: Dense(0), contains="budget must be")


# %% [markdown]
# ## Composition
#
# As kvpress composes presses (a decoding press around a prefill press), a method may wrap others:
# `PrefillDecode` runs one method's policy (and chunking) for the prompt and another's for generation, e.g.
# QuoKA's chunked prefill followed by OVAL's page retrieval, or by KVpop's bounded cache. `make` builds it from
# a name `'first+then'`: `make("quoka+kvpop_mlstm", 128, decode_params={"checkpoint": "smollm2-135m-cr75-mlstm"})`.
#
# **The rule.** The prompt is read by the first method alone: its queries attend to what it selects from the
# full cache (transformers' own, written in place), so the prompt's keys and values are exactly the first
# method's. Generation belongs to the second method:
# - a selection or retrieval method reads the same full cache with its own decode policy;
# - an eviction method gets the prompt handed over (`HandoffCache`): at the first decode step every layer's
#   entries go to the eviction method's empty cache as one prefill of that cache, which scores them and keeps
#   what its rule shows the next token, and from there it evicts as it does alone. This is the eviction method's
#   own state after a prefill of the same keys and values (the next cell checks it token by token), so its
#   scores must come from the entries themselves (StreamingLLM, KVpop); TOVA and H2O score entries by the
#   attention they receive, which a hand-over does not replay, and are refused.
#
# **The budgets.** One `budget` for both parts, each in its own terms: $B_{SA}$ earlier keys per prompt chunk
# for QuoKA, $s + w + k$ kept entries for KVpop (or the decode token budget of a retrieval method). Memory: the
# full prompt is stored while it is read (as QuoKA alone), then an eviction decode holds $s + w + k$ entries per
# KV head whatever the length of the generation (a retrieval decode keeps the full cache).
#
# The policy of a composition routes each call by its kind:

# %%
#| export
class RoutedPolicy(AttentionPolicy):
    "Prefill calls go to `first`, decode calls to `then`."

    def __init__(self, first: AttentionPolicy, then: AttentionPolicy):
        self.first, self.then = first, then

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        return self.first(q, k, v, ctx)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        return self.then(q, k, v, ctx)


# %%
rp = RoutedPolicy(lambda q, k, v, ctx: ("first", q), lambda q, k, v, ctx: ("then", q))
test_eq([rp(i, None, None, SimpleNamespace(kind=kind)) for i, kind in enumerate(("prefill", "decode", "prefill"))],
        [("first", 0), ("then", 1), ("first", 2)])


# %% [markdown]
# The hand-over checked against its definition, on a tiny random Llama in float64 with random KVpop
# scorers (MLP, and mLSTM with delayed readout): the prompt's queries attend densely, every later query
# attends to what KVpop's teacher-forced mask (`KVpopMaskPolicy`, Eq. 26 on the whole sequence) shows it.
# One full-sequence forward under that mask gives the reference logits; `dense+kvpop` prefilling the
# prompt in one call and decoding the rest one token at a time must give the same logits at every decode
# position, with at most $s + w + k$ (+ 1 pending for the mLSTM) entries per head after the hand-over.

# %%
#| export
class HandoffCache(GrowingCache):
    """A `GrowingCache` while the prompt is read; at the first decode step (the model asks the mask sizes of one
    query after some tokens) each layer's entries are handed to the layers of the evicting cache `then`."""

    def __init__(self, then: EvictingCache, config=None):
        if not isinstance(then, EvictingCache): raise TypeError(f"then must be an EvictingCache, got {type(then)}")
        super().__init__(config=config)
        self.then, self.handed_over = then, False

    def hand_over(self) -> None:
        "Give every growing layer's entries to `then`'s layer of the same index (`EvictingLayer.absorb`)."
        for i, layer in enumerate(self.layers):
            if isinstance(layer, GrowingLayer) and layer.get_seq_length():
                self.layers[i] = self.then.layer(i)
                self.layers[i].absorb(layer.keys, layer.values)
        self.handed_over = True

    @property
    def is_compileable(self) -> bool:
        "Whether both the growing layers and `then`'s are (`OptInCompile`): the steps after the hand-over are then's."
        return super().is_compileable and self.then.is_compileable

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        # transformers asks before the layers run: the sizes are then the evicting layers'
        if not self.handed_over and query_count(query_length) == 1 and self.get_seq_length(): self.hand_over()
        return super().get_mask_sizes(query_length, layer_idx)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.handed_over and key_states.shape[2] == 1 and self.get_seq_length(layer_idx):
            raise RuntimeError("HandoffCache hands the prompt over when the model asks for a decode step's mask "
                               "sizes (get_mask_sizes); this model decoded without asking")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


# %%
class PromptDenseThenKVpop(MaskPolicy):
    "Reference: queries before `P` causal (dense), later ones KVpop's teacher-forced mask on the whole sequence."
    def __init__(self, P, *kvpop): self.P, self.kvpop = P, KVpopMaskPolicy(*kvpop)

    def mask(self, q, k, v, ctx):
        return self.kvpop.mask(q, k, v, ctx) | (ctx.query_positions < self.P)[:, None]


m64, _ = load_model("tiny-llama", dtype=torch.float64)
S, P, s, w, kk = 30, 17, 2, 3, 4
seq = torch.randint(3, m64.config.vocab_size, (2, S), generator=torch.Generator().manual_seed(3))
for kind in ("mlp", "mlstm"):
    sc = random_scorers(m64, seed=1, kind=kind, delay=w if kind == "mlstm" else 0)
    with torch.no_grad(), patch(m64, PromptDenseThenKVpop(P, sc, s, w, kk)): want = m64(seq).logits[:, P - 1:-1]
    with torch.no_grad(): dense = m64(seq).logits[:, P - 1:-1]
    cache = HandoffCache(KVpopCache(sc, s, w, kk), config=m64.config)
    with torch.no_grad(), patch(m64, RoutedPolicy(DensePolicy(), KVpopPolicy())):
        got = [m64(seq[:, :P], past_key_values=cache).logits[:, -1:]]
        assert not cache.handed_over
        for t in range(P, S - 1):
            got.append(m64(seq[:, t:t + 1], past_key_values=cache).logits)
            test_eq(max(l.positions.shape[-1] for l in cache.layers) <= s + w + kk + (kind == "mlstm"), True)
    assert_close(torch.cat(got, 1), want)
    assert (want - dense)[:, 1:].abs().max() > 1e-3  # the budget binds: not the dense logits
print("hand-over: the composed decode equals the prompt-dense, KVpop-after mask (MLP and mLSTM)")


# %% [markdown]
# The method: its parts made at the one budget, checked to fit together (an eviction method cannot read a prompt
# for another; only one that scores entries by themselves can take a prompt over), and the routed policy.

# %%
#| export
class PrefillDecode(Method):
    """Method `prefill` (a name or a Method) for the prompt, `decode` for generation; names are made at `budget` with
    `prefill_params`, `decode_params`. An eviction `decode` gets the prompt handed over (`HandoffCache`)."""
    name, family = "prefill_decode", "selection"
    handover = (StreamingLLM, KVpopMLP)  # eviction methods whose scores come from the entries alone

    def __init__(self, budget: int | float, prefill: str | Method = "quoka", decode: str | Method = "oval",
                 prefill_params: dict | None = None, decode_params: dict | None = None):
        for part, params in (("prefill_params", prefill_params), ("decode_params", decode_params)):
            if params is not None and not isinstance(params, Mapping):
                raise TypeError(f"{part} must be a dict of the part's parameter names to values (or None), got "
                                f"{type(params).__name__} {params!r}")
        self.prefill, self.decode = (m if isinstance(m, Method) else make(m, budget, **(p or {}))
                                     for m, p in ((prefill, prefill_params), (decode, decode_params)))
        if self.prefill.family == "eviction":
            raise ValueError(f"prefill must not be an eviction method (its cache bounds the prompt's reading too): "
                             f"{self.prefill.name!r}")
        if self.decode.family == "eviction" and not isinstance(self.decode, self.handover):
            raise ValueError(f"decode: {self.decode.name!r} cannot take a prompt over; the eviction methods that "
                             "can, scoring entries by themselves: streaming_llm, kvpop_mlp, kvpop_mlstm")
        self.budget, self.chunk_size = budget, self.prefill.chunk_size

    def policy(self) -> RoutedPolicy:
        return RoutedPolicy(self.prefill.policy(), self.decode.policy())

    @contextlib.contextmanager
    def patch(self, model):
        "`Method.patch`, after each part's `check_model(model)` (if it has one)."
        for part in (self.prefill, self.decode):
            if hasattr(part, "check_model"): part.check_model(model)
        with super().patch(model) as cache: yield cache


# %%
pd_ = make("quoka+oval", 16, prefill_params=dict(chunk_size=8, n_q=2))
test_eq((type(pd_.prefill), type(pd_.decode), pd_.budget, pd_.chunk_size, pd_.decode.budget), (Quoka, OVAL, 16, 8, 16))
rp = pd_.policy()
test_eq((type(rp), type(rp.first), type(rp.then)), (RoutedPolicy, QuokaPolicy, PageRetrievalPolicy))
test_fail(lambda: make("quoka+tova", 16), contains="cannot take a prompt over")
test_fail(lambda: make("tova+oval", 16), contains="prefill must not be an eviction method")
test_fail(lambda: PrefillDecode(16, prefill_params="n_q=2"), exc=TypeError, contains="prefill_params must be a dict")


# %% [markdown]
# Its cache: the prefill method's full cache, handed over at the first decode step when the decode method evicts.

# %%
#| export
@patch_to(PrefillDecode)
def cache(self, model):
    "The prefill method's full cache; handed over to the decode method's at the first decode step if it evicts."
    if self.decode.family != "eviction": return super(PrefillDecode, self).cache(model)
    return HandoffCache(self.decode.cache(model), config=model.config)


# %%
test_eq(type(make("quoka+oval", 16).cache(m64)), GrowingCache)
hc = make("dense+kvpop_mlp", 16, decode_params=dict(sink=2, window=4)).cache(m64)
test_eq((type(hc), type(hc.then), hc.handed_over), (HandoffCache, KVpopCache, False))


# %% [markdown]
# Its scoring cost is the part's of the phase: at SmolLM2-135M's shape, QuoKA's $N_Q D$ = 1,024 per key at
# prefill and OVAL's 78 at decode (the figures of the last section).

# %%
#| export
# patch_to leaves the module's name `scoring_cost` bound to sparsekv.hf's function, which the body calls
@patch_to(PrefillDecode)
def scoring_cost(self, shape, n_cached: int, phase: str = "prefill", chunk: int | None = None) -> ScoringCost:  # noqa: F811
    "The prefill method's cost at prefill, the decode method's at decode."
    queries_per_call(phase, chunk, self.chunk_size)
    return scoring_cost(self.prefill if phase == "prefill" else self.decode, shape, n_cached, phase, chunk)


# %%
qo = make("quoka+oval", 1024)
test_eq([qo.scoring_cost(ModelShape(9, 3, 64, 30), 4096, p).per_key for p in PHASES], [1024, 78])
test_fail(lambda: qo.scoring_cost(ModelShape(9, 3, 64, 30), 64, "decode", chunk=4), contains="chunk must be")
assert scoring_cost(qo, ModelShape(9, 3, 64, 30), 4096) == qo.scoring_cost(ModelShape(9, 3, 64, 30), 4096)


# %% [markdown]
# Through the registry: `make("dense+streaming_llm", ...)` generates what dense prefill followed by
# StreamingLLM's mask gives token by token; `quoka+kvpop_mlstm` runs end to end and its decode queries
# attend to exactly the budget; TOVA cannot take a prompt over, an eviction method cannot read one for another.

# %%
class PromptDenseThenWindow(MaskPolicy):
    "Reference: queries before `P` causal, later ones StreamingLLM's sinks and recent tokens."
    def __init__(self, P, sink, recent): self.P, self.sink, self.recent = P, sink, recent

    def mask(self, q, k, v, ctx):
        t, p = ctx.key_positions[:, :, None, :], ctx.query_positions[None, None, :, None]
        return (t < self.sink) | (p - t < self.recent) | (p < self.P)


sl = make("dense+streaming_llm", 12)
test_eq((type(sl), type(sl.prefill).__name__, sl.decode.name, sl.chunk_size), (PrefillDecode, "Dense", "streaming_llm",
                                                                                None))
with torch.no_grad(), patch(m64, PromptDenseThenWindow(P, sl.decode.sink, sl.decode.window + sl.decode.k)):
    want = m64(seq).logits[:, P - 1:-1]
with torch.no_grad(), sl.patch(m64) as cache:
    got = [m64(seq[:, :P], past_key_values=cache).logits[:, -1:]]
    got += [m64(seq[:, t:t + 1], past_key_values=cache).logits for t in range(P, S - 1)]
assert_close(torch.cat(got, 1), want)

qk = make("quoka+kvpop_mlstm", 16, prefill_params=dict(chunk_size=8, n_q=2), decode_params=dict(sink=2, window=4))
test_eq((qk.prefill.budget, qk.chunk_size, (qk.decode.sink, qk.decode.window, qk.decode.k)), (16, 8, (2, 4, 10)))
with measure_attended() as meter: out = qk.generate(m64, seq, max_new_tokens=6, do_sample=False, pad_token_id=0)
test_eq((out.shape, meter.max("decode")), ((2, S + 6), 16))
test_fail(lambda: make("quoka+tova", 16), contains="cannot take a prompt over")
test_fail(lambda: make("tova+oval", 16), contains="prefill must not be an eviction method")
test_fail(lambda: make("quoka+nope", 16), contains="'prefill+decode' of two of them")
test_fail(lambda: make("quoka+oval", 16, decode="quest"), contains="pass no prefill or decode")

# %% [markdown]
# ## Checks
#
# Every method of the issue is registered, in its family; a name, a parameter or a budget outside what a
# method accepts is refused with the accepted values.

# %%
test_eq(set(names()) >= {"dense", "streaming_llm", "tova", "h2o", "streaming_llm_plus", "dms", "kvpop_mlp",
                         "kvpop_mlstm", "quoka", "mean_scores", "sample_attention", "sparq", "loki", "lessismore",
                         "quest", "arkvale", "key_pca", "oval", "oracle_pages"}, True)
assert {"arkvale", "key_pca", "oracle_pages", "oval", "quest"} <= set(names("retrieval"))
assert {"dms", "h2o", "kvpop_mlp", "kvpop_mlstm", "streaming_llm", "streaming_llm_plus", "tova"} <= set(
    names("eviction"))
test_eq(sorted(sum((names(f) for f in METHOD_FAMILIES), [])), names())  # every method in exactly one family
test_fail(lambda: make("snapkv", budget=8), contains="name must be one of")
test_fail(lambda: make("oval", budget=512, eta_typo=0.5), contains="accepted")
test_fail(lambda: make("tova"), contains="budget")
for n in ("tova", "quoka", "oval"):
    for bad in (0, -1, True, "8"): test_fail(lambda: make(n, budget=bad), contains="budget must be")
test_fail(lambda: make("tova", budget=0.5), contains="budget must be")       # eviction: a count of entries
test_eq(make("quoka", budget=0.25).policy().budget, 0.25)                     # selection: also a fraction of the cache
test_fail(lambda: make("oval", budget=16, sink=16, recent=8), contains="must cover sink + recent")
test_fail(lambda: make("quoka", budget=8, n_q=0), contains="n_q")

# %% [markdown]
# Every parameter is checked when the method is made, naming it and what it accepts, and what only the model knows
# (its layers, its head dim) when it is patched, before any work. A name must be a string and a family one of
# `METHOD_FAMILIES`. A composition has two parts: `'quoka+oval+quest'` would otherwise read as QuoKA then
# `'oval+quest'`, whose decode is Quest's alone (OVAL silently dropped).

# %%
for call, exc, msg in [(lambda: make(None, 48), TypeError, "name must be a method name (a str)"),
                       (lambda: make(123, 48), TypeError, "got 123"),
                       (lambda: names("bogus_family"), ValueError, "family must be one of"),
                       (lambda: make("quoka+oval+quest", 48), ValueError, "composes 3 methods"),
                       (lambda: make("quoka+oval", 48, prefill_params="n_q=2"), TypeError,
                        "prefill_params must be a dict"),
                       (lambda: make("quoka+oval", 48, decode_params=[("eta", 1)]), TypeError, "decode_params"),
                       (lambda: make("sparq", 48, r=0), ValueError, "r (channels kept) must be an int >= 1"),
                       (lambda: make("loki", 48, r=-1), ValueError, "r (principal directions) must be an int >= 1"),
                       (lambda: make("loki", 48, center=1), TypeError, "center must be a bool"),
                       (lambda: make("sample_attention", 48, seed="x"), TypeError, "seed must be an int"),
                       (lambda: make("sample_attention", 48, n_q=0), ValueError, "n_q must be an int >= 1"),
                       (lambda: make("lessismore", 48, selection_layers=5), TypeError, "selection_layers must be"),
                       (lambda: make("kvpop_mlp", 48, n_boundaries=0), ValueError, "n_boundaries must be an int"),
                       (lambda: make("kvpop_mlp", 48, gamma_min=2.0), ValueError, "gamma_min"),
                       (lambda: make("kvpop_mlstm", 48, tau=-1), ValueError, "tau must be a finite number in (0"),
                       (lambda: make("kvpop_mlp", 48, margin="yes"), TypeError, "margin must be a bool"),
                       (lambda: make("dms", 48, tau=0), ValueError, "tau must be a number > 0"),
                       (lambda: make("dms", 48, hidden=0), ValueError, "hidden must be an int >= 1")]:
    test_fail(call, exc=exc, contains=msg)
assert "oval" in names("retrieval")  # a known family still lists its methods after the refusals above
x16 = torch.randint(3, 259, (1, 20), generator=torch.Generator().manual_seed(1))
for m, msg in [(make("lessismore", 12, selection_layers=(99,), chunk_size=8), "layer indices in [0, 2) of this model"),
               (make("sparq", 12, r=17, chunk_size=8), "r (channels kept, at most the head dim) must be an int in"),
               (make("loki", 12, r=99, chunk_size=8), "at most the head dim"),
               (make("quoka+lessismore", 12, decode_params=dict(selection_layers=(5,))), "selection_layers")]:
    test_fail(lambda: m.generate(m64, x16, max_new_tokens=2, do_sample=False, pad_token_id=0), exc=ValueError,
              contains=msg)

# %% [markdown]
# Each family builds what the table says: TOVA the rule of its split, QuoKA and OVAL the policies with the
# budget in their own terms.

# %%
m = make("tova", budget=4356)
test_eq((m.sink, m.window, m.k), (4, 256, 4096))
r = m.cache(None).rule
test_eq((type(r), r.sink, r.window, r.k), (TOVARule, 4, 256, 4096))
test_eq(make("quoka", budget=1024).policy().budget, 1024)
p = make("oval", budget=2048, eta=0.25).policy()
test_eq((p.method, p.budget, p.page_size, p.sink, p.recent), ("oval", 2048, 32, 32, 32))
test_eq((make("key_pca", budget=64).policy().method, make("key_pca", budget=64).sink), ("keypca", 16))

# %% [markdown]
# On the tiny model, `generate` is exactly the lower-level route written out by hand: QuoKA's chunked
# prefill of all but the last token then `model.generate` from its cache, OVAL's patched `model.generate`, and
# TOVA's evicting cache under its policy; the composed method prefills like QuoKA and decodes like OVAL.

# %%
model, _ = load_model("tiny-llama")
ids = torch.randint(3, 259, (2, 40), generator=torch.Generator().manual_seed(0))
gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
ones = torch.ones_like(ids)
with torch.no_grad():
    cache, _ = chunked_prefill(model, ids[:, :-1], 8, QuokaPolicy(n_q=2, budget=8))
    with patch(model, QuokaPolicy(n_q=2, budget=8)):
        want = model.generate(ids, attention_mask=ones, past_key_values=cache, **gen)
test_eq(make("quoka", budget=8, chunk_size=8, n_q=2).generate(model, ids, **gen), want)
oval = dict(page_size=4, sink=4, recent=4, rank=2, eta=0.5)
with torch.no_grad(), patch(model, PageRetrievalPolicy("oval", token_budget=16, **oval)):
    want = model.generate(ids, attention_mask=ones, **gen)
test_eq(make("oval", budget=16, **oval).generate(model, ids, **gen), want)
with torch.no_grad(), patch(model, TOVA(12).policy()):
    want = model.generate(ids, attention_mask=ones, past_key_values=EvictingCache(TOVARule(4, 1, 7, "all")), **gen)
test_eq(make("tova", budget=12).generate(model, ids, **gen), want)
both = PrefillDecode(16, prefill=make("quoka", budget=8, chunk_size=8, n_q=2), decode=make("oval", budget=16, **oval))
with torch.no_grad():
    cache, _ = chunked_prefill(model, ids[:, :-1], 8, QuokaPolicy(n_q=2, budget=8))
    with patch(model, PageRetrievalPolicy("oval", token_budget=16, **oval)):
        want = model.generate(ids, attention_mask=ones, past_key_values=cache, **gen)
test_eq(both.generate(model, ids, **gen), want)
with torch.no_grad(): dense = model.generate(ids, attention_mask=ones, **gen)
assert not torch.equal(want, dense)  # the budgets really change the tokens

# %% [markdown]
# At SmolLM2-135M's shape (9 query heads over 3 KV heads of 64 dimensions, 30 layers) and the paper defaults
# ($B_{CP}$ = 128, $N_Q$ = 16, $r = D/2$) the scoring costs per cached key are the figures: QuoKA
# $N_Q D$ = 1,024, SparQ and Loki $G B_{CP} r$ = 12,288, mean of scores $G B_{CP} D$ = 24,576. OVAL scores at
# decode only, $G(D(r+1) + m r)/m$ = 78 per key; eviction and dense attention choose nothing. QuoKA adds
# $G B_{CP} D$ = 24,576 per chunk (ranking the chunk's queries), what 24 cached keys cost; its figures are
# what its code multiplies ([the costs page](42_costs.ipynb) counts every method).

# %%
smol = ModelShape(9, 3, 64, 30)
test_eq([make(n, budget=1024).scoring_cost(smol, 4096).per_key for n in ("quoka", "sparq", "loki", "mean_scores")],
        [1024, 12288, 12288, 24576])
test_eq([make("oval", budget=1024).scoring_cost(smol, 4096, p).per_key for p in PHASES], [0, 78])
test_eq(scoring_cost(make("tova", budget=1024), smol, 4096), ScoringCost())
c = make("quoka", budget=1024).scoring_cost(smol, 4096)
q, k = torch.randn(1, 9, 128, 64), torch.randn(1, 3, 4096, 64)
with FlopCounterMode(display=False) as fc: quoka_select(q, k, 16, 1024)
step = 1024 * 4096 + 3 * 128 * 64  # N_Q D per key, and G B_CP D per chunk ranking the queries
test_eq((fc.get_total_flops() // 2, c.per_step, c.total), (3 * step, step, 3 * 30 * step))
test_eq(make("quoka", budget=4096).scoring_cost(smol, 4096).per_step, 0)  # the chunk's earlier keys fit: dense
test_fail(lambda: make("quoka", budget=8).scoring_cost(smol, 64, "generate"), contains="phase must be")
test_fail(lambda: make("oval", budget=64).scoring_cost(smol, 64, "decode", chunk=4), contains="chunk must be")
