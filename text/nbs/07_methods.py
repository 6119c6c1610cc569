# %% [markdown]
# # Methods
#
# > One object per method, found by name: `methods.make("tova", budget=256)`, then `m.generate` or `m.patch`.

# %%
#| default_exp methods

# %%
#| export
from __future__ import annotations

import inspect

from torch import Tensor

from sparsekv.attention import check_int
from sparsekv.hf import AttentionContext, AttentionPolicy, Method
# The eviction methods live with KVpop: importing them registers them and makes them reachable from this module.
from sparsekv.kvpop.baselines import H2O, TOVA, EvictionMethod, StreamingLLM, split_budget  # noqa: F401
from sparsekv.kvpop.dms import DMS  # noqa: F401
from sparsekv.kvpop.student import KVpopMLP, KVpopMLSTM, StreamingLLMPlus, TrainedMethod  # noqa: F401
from sparsekv.oval.pages import PageRetrievalPolicy
from sparsekv.quoka.baselines import (MEAN_SCORES, LessIsMoreSelector, loki_select, mean_score_select,
                                      sample_attention_select, sparq_select)
from sparsekv.quoka.policy import BaselinePolicy, LessIsMorePolicy, QuokaPolicy
from sparsekv.select import resolve_budget

# %%
#| hide
import torch
from fastcore.test import test_eq, test_fail

from sparsekv.cache import EvictingCache
from sparsekv.hf import chunked_prefill, patch
from sparsekv.kvpop.baselines import TOVARule
from sparsekv.models import load_model

torch.set_num_threads(1)  # tiny model: threads only add overhead


# %% [markdown]
# Every method of this package, its papers' baselines included, is one `sparsekv.hf.Method`: a name, a
# budget, the method's own parameters as keyword arguments (the papers' defaults), and two ways to run it:
#
# ```python
# m = methods.make("tova", budget=256)
# out = m.generate(model, input_ids, max_new_tokens=20, do_sample=False)  # token ids
# with m.patch(model) as past_key_values:   # advanced: the cache to pass (None: transformers' own)
#     model(input_ids, past_key_values=past_key_values)
# ```
#
# `budget` is always the number of KV entries each query may attend to, per KV head. Each family maps it
# onto a policy (`patch` routes every attention call to it) and a cache:
#
# | family | setting | policy | cache | `budget` means |
# |---|---|---|---|---|
# | `eviction` | evict while reading: the prompt and the generated tokens go through a bounded cache | dense over what the cache keeps (TOVA, H2O: it also scores the entries; KVpop: masks the mLSTM's unread token) | `EvictingCache(rule)` / `KVpopCache` / `DMSCache` | $B = s + w + k$ kept entries (`split_budget`: $s = 4$, $w = \mathrm{round}(256B/4356)$, the rest $k$); DMS: a training target met on average |
# | `selection` | chunked prefill of `chunk_size` ($B_{CP}$ = 128) tokens with a selection policy; decode likewise | `QuokaPolicy`, `BaselinePolicy(select_fn)`, `LessIsMorePolicy` | transformers' own (the full cache) | $B_{SA}$ earlier keys per chunk (or a float fraction of the cache), plus the chunk's own keys causally |
# | `retrieval` | dense prefill, sparse decode | `PageRetrievalPolicy(summary)` | transformers' own (the full cache) | `token_budget`: sink, recent and top-scored pages, the sink and recent regions rounded out to pages |
# | `dense` | exact attention | `DensePolicy` | transformers' own | ignored |
#
# **Padded batches.** `generate(model, ids, attention_mask=...)` takes `generate`'s left padding. The dense,
# selection and retrieval methods give each row exactly the tokens it gets alone (each row selects over its own
# tokens, see `sparsekv.hf`); the eviction methods refuse padding before any work (their cache keeps entries per
# batch column, not per row), so generate their prompts one at a time or in batches of equal length
# (tests/test_padding.py checks every method).
#
# The eviction methods live with the paper that compares against them (`sparsekv.kvpop.baselines`,
# `.student`, `.dms`), where adding a baseline is one `EvictionMethod` subclass beside its rule. The
# selection and retrieval methods below wrap the policies of `sparsekv.quoka` and `sparsekv.oval`. This module
# imports them all, so importing it registers every method; the paper packages never import it.

# %% [markdown]
# ## The registry

# %%
#| export
def names(family: str | None = None) -> list[str]:
    "The registered method names (of `family`, one of `sparsekv.hf.METHOD_FAMILIES`, if given), sorted."
    return sorted(n for n, c in Method.registry.items() if family is None or c.family == family)


def get(name: str) -> type:
    "The method class registered as `name`."
    if name not in Method.registry: raise ValueError(f"name must be one of {names()}, got {name!r}")
    return Method.registry[name]


def make(name: str, budget: int | None = None, **params) -> Method:
    "Method `name` at `budget` KV entries per query and KV head, with its own `params` (the papers' defaults)."
    cls = get(name)
    sig = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in sig.values()):
        unknown = sorted(set(params) - set(sig) - {"budget"})
        if unknown: raise TypeError(f"{name} takes no parameter {unknown}; accepted: {sorted(set(sig) - {'budget'})}")
    return cls(**params) if budget is None else cls(budget, **params)


# %% [markdown]
# ## Dense

# %%
#| export
class Dense(Method):
    "Exact attention and transformers' own cache, the reference; `budget` is optional, checked when given, unused."
    name = "dense"

    def __init__(self, budget: int | None = None):
        self.budget = None if budget is None else self.check_budget(budget)


# %% [markdown]
# ## Prefill selection (QuoKA and its baselines)
#
# A chunk of $B_{CP}$ queries attends to $B_{SA}$ = `budget` earlier keys per KV head and to its own keys
# (so at most `budget + chunk_size` keys); a chunk whose earlier keys fit the budget is dense. The budget
# may also be a float fraction of the cache (Table 2's 25%), as `resolve_budget` reads it. Each method
# builds its policy once at construction, so a bad parameter fails there.

# %%
#| export
class SelectionMethod(Method):
    """Chunked prefill in chunks of `chunk_size` (B_CP), each attending to `budget` (B_SA) earlier keys per KV head plus
    its own; decode likewise unless `decode=False`."""
    family = "selection"

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


class Quoka(SelectionMethod):
    "QuoKA (Alg. 2): the B_SA earlier keys of largest cosine with the N_Q = `n_q` most dissimilar queries."
    name = "quoka"

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, n_q: int = 16,
                 query_select: str = "group", query_agg: str = "max", sinks: int = 0, recent: int = 0):
        super().__init__(budget, chunk_size, decode)
        self.n_q, self.query_select, self.query_agg = n_q, query_select, query_agg
        self.sinks, self.recent = sinks, recent
        self.policy()

    def policy(self) -> QuokaPolicy:
        return QuokaPolicy(self.n_q, self.budget, self.query_select, self.query_agg, self.sinks, self.recent,
                           self.decode)


class BaselineSelection(SelectionMethod):
    "A baseline of `sparsekv.quoka.baselines`: `select_fn(q_chunk, k_cache, budget, **options())` in `BaselinePolicy`."
    select_fn = None

    def options(self) -> dict:
        "The keyword arguments of `select_fn` besides the budget."
        return {}

    def policy(self) -> BaselinePolicy:
        return BaselinePolicy(type(self).select_fn, self.budget, self.decode, **self.options())


class MeanScores(BaselineSelection):
    "Mean of scores: the keys of largest attention probability (or logit, `scores`) over the chunk's queries and heads."
    name, select_fn = "mean_scores", staticmethod(mean_score_select)

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, scores: str = "softmax"):
        super().__init__(budget, chunk_size, decode)
        if scores not in MEAN_SCORES: raise ValueError(f"scores must be one of {MEAN_SCORES}, got {scores!r}")
        self.scores = scores

    def options(self): return dict(scores=self.scores)


class SampleAttention(BaselineSelection):
    "SampleAttention: the attention of `n_q` uniformly sampled queries (from `seed`)."
    name, select_fn = "sample_attention", staticmethod(sample_attention_select)

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, n_q: int = 16, seed: int = 0):
        super().__init__(budget, chunk_size, decode)
        self.n_q, self.seed = n_q, seed

    def options(self): return dict(n_q=self.n_q, seed=self.seed)


class SparQ(BaselineSelection):
    "SparQ: attention approximated from each query's top-`r` channels (None: D/8 as in the paper's default)."
    name, select_fn = "sparq", staticmethod(sparq_select)

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, r: int | None = None):
        super().__init__(budget, chunk_size, decode)
        self.r = r

    def options(self): return dict(r=self.r)


class Loki(BaselineSelection):
    "Loki: attention approximated in the top-`r` principal subspace of the keys (`center`: of the centred keys)."
    name, select_fn = "loki", staticmethod(loki_select)

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, r: int | None = None,
                 center: bool = False):
        super().__init__(budget, chunk_size, decode)
        self.r, self.center = r, center

    def options(self): return dict(r=self.r, center=self.center)


class LessIsMore(SelectionMethod):
    "LessIsMore: one key set for all heads, picked at `selection_layers` and reused by the layers after them."
    name = "lessismore"

    def __init__(self, budget: int | float, chunk_size: int = 128, decode: bool = True, selection_layers=(2,),
                 recent_ratio: float = 0.25):
        super().__init__(budget, chunk_size, decode)
        self.selection_layers, self.recent_ratio = tuple(selection_layers), recent_ratio
        self.policy()

    def policy(self) -> LessIsMorePolicy:
        return LessIsMorePolicy(LessIsMoreSelector(self.budget, self.selection_layers, self.recent_ratio), self.decode)


# %% [markdown]
# ## Decode retrieval (OVAL and its baselines)
#
# The prompt is prefilled densely into transformers' own cache; each decode query attends to the pages
# `PageRetrievalPolicy` picks from the summaries: the sink and recent regions (rounded out to whole pages)
# and the best-scored pages, within `budget` = `token_budget` tokens per KV head. By default the
# sink and recent regions take the policy's 32 tokens each, at most a quarter of the budget each.

# %%
#| export
class PageRetrieval(Method):
    "Dense prefill; decode queries attend to the sink, recent and top pages of `summary`, `budget` tokens per KV head."
    family, summary = "retrieval", None

    def __init__(self, budget: int, page_size: int = 32, sink: int | None = None, recent: int | None = None,
                 rank: int = 8):
        super().__init__(budget)
        self.page_size, self.rank = page_size, rank
        self.sink = min(32, self.budget // 4) if sink is None else sink
        self.recent = min(32, self.budget // 4) if recent is None else recent
        self.policy()
        if self.sink + self.recent > self.budget:
            raise ValueError(f"budget={self.budget} must cover sink + recent = {self.sink} + {self.recent}")

    def options(self) -> dict:
        "Keyword arguments of `PageRetrievalPolicy` besides the summary and the budget."
        return dict(page_size=self.page_size, sink=self.sink, recent=self.recent, rank=self.rank)

    def policy(self) -> PageRetrievalPolicy:
        return PageRetrievalPolicy(self.summary, token_budget=self.budget, **self.options())


class Quest(PageRetrieval):
    "Quest: pages scored by their keys' channel-wise min/max bound."
    name, summary = "quest", "quest"


class ArkVale(PageRetrieval):
    "ArkVale: pages scored by a bounding sphere of their keys."
    name, summary = "arkvale", "arkvale"


class KeyPCA(PageRetrieval):
    "Key PCA: pages scored in the rank-`rank` principal basis of their keys (OVAL's eta = 0 endpoint)."
    name, summary = "key_pca", "keypca"


class OVAL(PageRetrieval):
    "OVAL (§3.3): output-aware page bases mixing key fidelity and output sensitivity by `eta`."
    name, summary = "oval", "oval"

    def __init__(self, budget: int, page_size: int = 32, sink: int | None = None, recent: int | None = None,
                 rank: int = 8, eta: float = 0.5):
        self.eta = eta
        super().__init__(budget, page_size, sink, recent, rank)

    def options(self): return dict(super().options(), eta=self.eta)


class OraclePages(PageRetrieval):
    "The oracle: pages ranked by their exact attention mass (an upper bound, not a method one can deploy)."
    name, summary = "oracle_pages", "oracle"


# %% [markdown]
# ## Composition
#
# As kvpress composes presses (a decoding press around a prefill press), a method may wrap others:
# `PrefillDecode` runs one method's policy (and chunking) for the prompt and another's for generation, e.g.
# QuoKA's chunked prefill followed by OVAL's page retrieval. Both keep transformers' own cache, so neither may
# be an eviction method (a bounded cache belongs to one method).

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


class PrefillDecode(Method):
    "Method `prefill` (a name or a Method) for the prompt, `decode` for generation; names are made at `budget`."
    name, family = "prefill_decode", "selection"

    def __init__(self, budget: int | float, prefill: str | Method = "quoka", decode: str | Method = "oval"):
        self.prefill, self.decode = (m if isinstance(m, Method) else make(m, budget) for m in (prefill, decode))
        for role, m in (("prefill", self.prefill), ("decode", self.decode)):
            if m.family == "eviction":
                raise ValueError(f"{role} must not be an eviction method (its cache bounds both phases): {m.name!r}")
        self.budget, self.chunk_size = budget, self.prefill.chunk_size

    def policy(self) -> RoutedPolicy:
        return RoutedPolicy(self.prefill.policy(), self.decode.policy())


# %% [markdown]
# ## Checks
#
# Every method of the issue is registered, in its family; a name, a parameter or a budget outside what a
# method accepts is refused with the accepted values.

# %%
test_eq(set(names()) >= {"dense", "streaming_llm", "tova", "h2o", "streaming_llm_plus", "dms", "kvpop_mlp",
                         "kvpop_mlstm", "quoka", "mean_scores", "sample_attention", "sparq", "loki", "lessismore",
                         "quest", "arkvale", "key_pca", "oval", "oracle_pages"}, True)
test_eq(names("retrieval"), ["arkvale", "key_pca", "oracle_pages", "oval", "quest"])
test_eq(names("eviction"), ["dms", "h2o", "kvpop_mlp", "kvpop_mlstm", "streaming_llm", "streaming_llm_plus", "tova"])
test_fail(lambda: make("snapkv", budget=8), contains="name must be one of")
test_fail(lambda: make("oval", budget=512, eta_typo=0.5), contains="accepted")
test_fail(lambda: make("tova"), contains="budget")
for n in ("tova", "quoka", "oval"):
    for bad in (0, -1, True, "8"): test_fail(lambda: make(n, budget=bad), contains="budget must be")
test_fail(lambda: make("tova", budget=0.5), contains="budget must be")       # eviction: a count of entries
test_eq(make("quoka", budget=0.25).policy().budget, 0.25)                     # selection: also a fraction of the cache
test_fail(lambda: make("oval", budget=16, sink=16, recent=8), contains="must cover sink + recent")
test_fail(lambda: make("quoka", budget=8, n_q=0), contains="n_q")
test_fail(lambda: PrefillDecode(8, decode="tova"), contains="must not be an eviction method")

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
    want = model.generate(ids, attention_mask=ones, past_key_values=EvictingCache(TOVARule(4, 1, 7)), **gen)
test_eq(make("tova", budget=12).generate(model, ids, **gen), want)
both = PrefillDecode(16, prefill=make("quoka", budget=8, chunk_size=8, n_q=2), decode=make("oval", budget=16, **oval))
with torch.no_grad():
    cache, _ = chunked_prefill(model, ids[:, :-1], 8, QuokaPolicy(n_q=2, budget=8))
    with patch(model, PageRetrievalPolicy("oval", token_budget=16, **oval)):
        want = model.generate(ids, attention_mask=ones, past_key_values=cache, **gen)
test_eq(both.generate(model, ids, **gen), want)
with torch.no_grad(): dense = model.generate(ids, attention_mask=ones, **gen)
assert not torch.equal(want, dense)  # the budgets really change the tokens
