# %% [markdown]
# # OVAL page summaries
#
# > The page summaries OVAL compares (Quest, ArkVale, key PCA, OVAL, the oracle) as `PageSummary` classes, each with its retrieval method.

# %%
#| default_exp oval.summaries

# %%
#| export
from __future__ import annotations

import copy
import math

import torch
from fastcore.basics import patch_to
from torch import Tensor

from sparsekv.attention import check_int, require_finite
from sparsekv.hf import Method, ModelShape, ScoringCost, SelectionPolicy, queries_per_call
from sparsekv.oval.basis import check_eta, page_basis, page_lse_exact, page_score

# %%
#| hide
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# A page retriever keeps the full KV cache and, for every decode query, attends exactly to a
# few *pages* of $m$ consecutive tokens (OVAL §1, D.8). Which pages is decided from a
# compact *summary* stored beside each completed page. This notebook builds the summaries
# the OVAL paper compares (§2, §4), one class each, and after each summary the retrieval method
# that uses it (a `PageRetrieval` subclass, found by the registry by its name); the retrieval
# itself (GQA aggregation, page selection within a token budget, the decode-time policy) is in
# [`sparsekv.oval.pages`](32_oval_pages.ipynb).
#
# | method | class | summary per page and KV head | page score for a query $q$ (log domain) | retrieval method (registry name) |
# |---|---|---|---|---|
# | Quest | `QuestSummary` | per-channel min $\ell$ and max $u$ of the keys | $s\sum_c \max(q_c \ell_c,\ q_c u_c)$ | `Quest` (`"quest"`) |
# | ArkVale | `ArkValeSummary` | centre $c$ and radius $\rho$ of a ball holding the keys | $s\,(q\cdot c + \lVert q\rVert \rho)$ | `ArkVale` (`"arkvale"`) |
# | key PCA (LOCKS) | `KeyPCASummary` | $\mu$, $B$, $R$ from `page_basis(..., eta=0)` | $\log\sum_t \exp(s\,(R_t\cdot B^\top q + \mu\cdot q))$ | `KeyPCA` (`"key_pca"`) |
# | OVAL | `OVALSummary` | $\mu$, $B$, $R$ from `page_basis(..., eta)`, $\eta\in(0,1]$ | same as key PCA | `OVAL` (`"oval"`) |
# | oracle | `OracleSummary` | the keys themselves | $\log\sum_t \exp(s\, k_t\cdot q)$, the exact page LSE | `OraclePages` (`"oracle_pages"`) |
#
# with $s = 1/\sqrt d$. Only complete pages get a summary; the tokens of a trailing
# partial page are always attended ("recent"). Keys are post-RoPE, laid out `[B, Hkv, T, d]`.
# The names in the first column are the keys of `SUMMARIES`, which is how the string API
# (`build_summaries("oval", ...)`, `PageRetrievalPolicy("oval", ...)`) finds the classes.

# %% [markdown]
# ## Pages
#
# `split_pages` views the complete pages of a cache `[B, H, T, d]` as `[B, H, P, m, d]`,
# $P=\lfloor T/m\rfloor$.

# %%
#| export
def _check_cache(x, name: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor")
    if x.dim() != 4: raise ValueError(f"{name} must be [B, Hkv, T, d], got shape {tuple(x.shape)}")
    return x


# %%
test_eq(_check_cache(torch.zeros(1, 2, 3, 4), "K").shape, (1, 2, 3, 4))
test_fail(lambda: _check_cache(torch.zeros(2, 3, 4), "K"), contains="K must be [B, Hkv, T, d], got shape (2, 3, 4)")
test_fail(lambda: _check_cache(torch.zeros(1, 2, 3, 4, dtype=torch.long), "V"), contains="V must be a floating-point")


# %% [markdown]
# The pages of a cache of 21 tokens in pages of 5: four pages, the last token left out.

# %%
#| export
def split_pages(x: Tensor, page_size: int) -> Tensor:
    "The complete pages of a cache x [B, H, T, d] as [B, H, P, m, d], P = T // m (a trailing partial page is left out)."
    _check_cache(x, "x")
    m = check_int(page_size, "page_size", 1)
    B, H, T, d = x.shape
    P = T // m
    return x[:, :, : P * m].reshape(B, H, P, m, d)


# %%
x = torch.randn(2, 3, 21, 4, dtype=torch.float64)
pages = split_pages(x, 5)
test_eq(pages.shape, (2, 3, 4, 5, 4))
for p in range(4):
    for t in range(5): assert torch.equal(pages[:, :, p, t], x[:, :, 5 * p + t])
test_fail(lambda: split_pages(x, 0), contains="page_size must be an int >= 1")
test_fail(lambda: split_pages(x[0], 5), contains="[B, Hkv, T, d]")


# %% [markdown]
# ## Queries against pages
#
# Queries arrive as `[B, Hq, d]` (one decode step) or `[B, Hq, S, d]` (several queries
# scored against the same pages). Query head $h G + g$ reads the summaries of KV head $h$,
# so we view the queries as `[B, Hkv, G, S, 1, d]` against summaries `[B, Hkv, 1, 1, P, ...]`
# and broadcast. Scores are in the log domain (they are logits or log-masses) and come back
# as `[B, Hq, P]` or `[B, Hq, S, P]`.

# %%
#| export
def _group_queries(q: Tensor, Hkv: int) -> tuple[Tensor, bool]:
    "q [B, Hq, d] or [B, Hq, S, d] -> [B, Hkv, G, S, 1, d] and whether S was added."
    if not isinstance(q, Tensor) or not q.is_floating_point():
        raise TypeError("q must be a floating-point torch.Tensor")
    if q.dim() not in (3, 4): raise ValueError(f"q must be [B, Hq, d] or [B, Hq, S, d], got shape {tuple(q.shape)}")
    require_finite("q", q)  # every query: one NaN would make a whole row of page scores NaN
    single = q.dim() == 3
    if single: q = q.unsqueeze(2)
    B, Hq, S, d = q.shape
    if Hq % Hkv: raise ValueError(f"the query heads ({Hq}) must be a multiple of the summary's KV heads ({Hkv})")
    return q.reshape(B, Hkv, Hq // Hkv, S, 1, d), single


# %%
q = torch.randn(2, 6, 5, 8)
qg, single = _group_queries(q, 2)
test_eq((qg.shape, single), ((2, 2, 3, 5, 1, 8), False))
for h in range(6): assert torch.equal(qg[:, h // 3, h % 3, :, 0], q[:, h])
test_eq(_group_queries(q[:, :, 0], 3)[0].shape, (2, 3, 2, 1, 1, 8))
test_fail(lambda: _group_queries(q, 4), contains="multiple of the summary's KV heads")


# %% [markdown]
# The summaries `[B, Hkv, P, ...]` get two axes of size 1 for the query groups and the queries:

# %%
#| export
def _pages(x: Tensor) -> Tensor:
    "[B, Hkv, P, *] -> [B, Hkv, 1, 1, P, *] to broadcast against grouped queries."
    return x.unsqueeze(2).unsqueeze(3)


# %%
x = torch.randn(2, 3, 4, 5)
test_eq(_pages(x).shape, (2, 3, 1, 1, 4, 5))
assert torch.equal(_pages(x)[:, :, 0, 0], x)


# %% [markdown]
# ## The interface
#
# A `PageSummary` is a summary method with its parameters (rank, $\eta$, $G$: constructor
# arguments of the classes that take them). `summarize(K, V, page_size)` returns a copy that
# holds the tensors `[B, Hkv, P, ...]` of the complete pages of a cache, and `score(q, scale)`
# scores them in the log domain. Each class fills in:
#
# - `build`: its tensors from the pages; `needs_values` / `needs_metric` say whether it reads
#   $V$ and takes the output metric $G$ (`output_metric`);
# - `score_grouped`: the score of grouped queries against the broadcast tensors (`score` does
#   the grouping, the working dtype, at least float32, and the default scale $1/\sqrt d$);
# - `reference_page`: the score of one page for one query by explicit sums in float64, from
#   the page's keys (the bounds) or its tensors (the basis score); `reference` loops it over
#   batch, query heads and pages — the brute-force check of `score`;
# - the packed layout of the one-GEMM decode path (`PackedPages` in `sparsekv.oval.pages`):
#   `pack` lays each page out as rows of features (plus a per-page second
#   factor, the basis methods' $R$), `features` maps the scaled query $sq$ to the vector those
#   rows multiply, `packed_score` turns the products into page scores, and `unpack` inverts `pack`;
# - `scalars`: what it stores per page and KV head.
#
# The class holds the parameters and the default packed layout. Check: `with_tensors` returns a copy (the summary
# it is called on stays unbuilt), $P = \lfloor T/m\rfloor$, an unbuilt summary has no tensors to give; the default
# packed layout is one row per page that the query multiplies as it is.

# %%
#| export
class PageSummary:
    "A page summary method (§2, §4) and its parameters; `summarize` returns a copy holding a cache's page summaries."
    name = None                                 # its key in SUMMARIES
    needs_values, needs_metric = False, False   # reads V; takes the output metric G
    G = None
    page_size, length, tensors = None, 0, None  # set by summarize: m, T and the tensors [B, Hkv, P, ...]

    @classmethod
    def from_options(cls, rank: int = 8, eta: float = 0.5, G: Tensor | None = None) -> PageSummary:
        "The summary from build_summaries's shared options, taking those the class uses (here none)."
        return cls()

    def with_tensors(self, page_size: int | None = None, length: int = 0, tensors: dict | None = None) -> PageSummary:
        "A copy with the same parameters holding `tensors` of the pages of a cache of `length` tokens (none: unbuilt)."
        out = copy.copy(self)
        out.page_size, out.length, out.tensors = page_size, length, tensors
        return out

    @property
    def n_pages(self) -> int:
        "Number of summarized (complete) pages P (0 before summarize)."
        return 0 if self.page_size is None else self.length // self.page_size

    def _built(self) -> dict:
        if self.tensors is None: raise ValueError(f"this {type(self).__name__} holds no pages: summarize a cache first")
        return self.tensors

    @staticmethod
    def features(x: Tensor) -> Tensor:
        "The query feature [..., f] that the packed rows multiply, of scaled queries x = s q [..., d]."
        return x

    @staticmethod
    def packed_score(z: Tensor, R: Tensor | None) -> Tensor:
        "Page scores [BH, GS, P] from the packed products z [BH, GS, P, rows] and R [P, BH, ...] (or None)."
        return z[..., 0]


# %%
unbuilt = PageSummary.from_options(rank=3, eta=0.25)
test_eq((type(unbuilt), unbuilt.n_pages, unbuilt.tensors), (PageSummary, 0, None))
held = unbuilt.with_tensors(8, 37, {"x": torch.zeros(1)})
test_eq((held.page_size, held.length, held.n_pages, unbuilt.tensors), (8, 37, 4, None))
test_fail(lambda: unbuilt._built(), contains="this PageSummary holds no pages: summarize a cache first")
z = torch.randn(2, 3, 4, 5)
test_eq(PageSummary.features(z), z)
test_eq(PageSummary.packed_score(z, None), z[..., 0])


# %% [markdown]
# What each class fills in:

# %%
#| export
@patch_to(PageSummary)
def build(self, K: Tensor, V: Tensor | None, m: int) -> dict:
    "The tensors [B, Hkv, P, ...] of the complete pages of size m of K (and V) [B, Hkv, T, d]."
    raise NotImplementedError

@patch_to(PageSummary)
def score_grouped(self, q: Tensor, t: dict, s: float) -> Tensor:
    "Scores [B, Hkv, G, S, P] of grouped queries q [B, Hkv, G, S, 1, d] against tensors t [B, Hkv, 1, 1, P, ...]."
    raise NotImplementedError

@patch_to(PageSummary)
def reference_page(self, x: Tensor, Kp: Tensor, tp: dict, s: float) -> Tensor | float:
    "Score of one page for one query x [d] from its keys Kp [m, d] or its tensors tp, by explicit sums."
    raise NotImplementedError(f"{type(self).__name__} has no loop reference")

@patch_to(PageSummary)
def pack(self) -> tuple[Tensor, Tensor | None]:
    "The pages as packed rows [B, Hkv, P, rows, f] and a per-page second factor (the basis methods' R) or None."
    raise NotImplementedError

@patch_to(PageSummary, cls_method=True)
def unpack(cls, W: Tensor, R: Tensor | None) -> dict:
    "The tensors (views) of packed rows W [B, Hkv, P, rows, f] and R [B, Hkv, P, ...]: pack's inverse."
    raise NotImplementedError

@patch_to(PageSummary)
def scalars(self, page_size: int, head_dim: int) -> int:
    "Scalars stored per page and KV head."
    raise NotImplementedError


# %%
for call in (lambda: unbuilt.build(None, None, 8), lambda: unbuilt.score_grouped(None, {}, 1.0), unbuilt.pack,
             lambda: PageSummary.unpack(None, None), lambda: unbuilt.scalars(8, 16)):
    try: call()
    except NotImplementedError: continue
    raise AssertionError("PageSummary leaves it to the classes")
test_fail(lambda: unbuilt.reference_page(None, None, {}, 1.0), contains="PageSummary has no loop reference")


# %% [markdown]
# `summarize` checks the cache and the page size and returns a copy holding what `build` returns. The checks
# of this and the next two methods use a summary of our own that keeps each page's mean key $\bar k$ and scores
# $s\,q\cdot\bar k$ (the mean logit of the page): on the cache $K_{0,0} = [[0, 1], [2, 3], \dots, [8, 9]]$ of 5 tokens,
# pages of 2 have the means $[1, 2]$ and $[5, 6]$ and the last token is left out.

# %%
#| export
@patch_to(PageSummary)
def summarize(self, K: Tensor, V: Tensor | None = None, page_size: int = 32) -> PageSummary:
    "A copy holding the summaries [B, Hkv, P, ...] of the complete pages of K (and V) [B, Hkv, T, d]."
    _check_cache(K, "K")
    require_finite("K", K), require_finite("V", V)
    m = check_int(page_size, "page_size", 1)
    return self.with_tensors(m, K.shape[2], self.build(K, V, m))


# %%
class MeanKeySummary(PageSummary):
    "For the checks: the page's mean key; the score is s q . mean_t k_t."
    def build(self, K, V, m): return {"mean": split_pages(K, m).mean(-2)}
    def score_grouped(self, q, t, s): return (q * t["mean"]).sum(-1) * s
    def reference_page(self, x, Kp, tp, s): return s * float(x @ Kp.mean(0))

Kt = torch.arange(20, dtype=torch.float64).view(2, 1, 5, 2)          # B = 2, one KV head, T = 5, d = 2
mk = MeanKeySummary().summarize(Kt, None, 2)
test_eq((mk.page_size, mk.length, mk.n_pages), (2, 5, 2))
test_eq(mk.tensors["mean"][0, 0], torch.tensor([[1.0, 2.0], [5.0, 6.0]], dtype=torch.float64))
test_eq(MeanKeySummary().tensors, None)
test_fail(lambda: MeanKeySummary().summarize(Kt, None, 0), contains="page_size")
test_fail(lambda: MeanKeySummary().summarize(Kt[0], None, 2), contains="K must be [B, Hkv, T, d]")


# %% [markdown]
# `score` groups the query heads onto the KV heads, works in at least float32 and scales by $1/\sqrt d$ unless
# told otherwise. By hand, with two query heads on the one KV head and $q = [1, 1]$ at scale 1: batch row 0
# scores $1 + 2 = 3$ and $5 + 6 = 11$; row 1 (keys $10, \dots, 19$) scores $23$ and $31$.

# %%
#| export
@patch_to(PageSummary)
def score(self, q: Tensor, scale: float | None = None) -> Tensor:
    "Log-domain page scores [B, Hq, P] (or [B, Hq, S, P] for q [B, Hq, S, d]); scale defaults to 1/sqrt(d)."
    t = self._built()
    Bsz, Hkv, P = next(iter(t.values())).shape[:3]
    qg, single = _group_queries(q, Hkv)
    if qg.shape[0] != Bsz: raise ValueError(f"q's batch ({qg.shape[0]}) must match the summary's ({Bsz})")
    s = 1 / math.sqrt(qg.shape[-1]) if scale is None else float(scale)
    qg = qg.to(torch.promote_types(q.dtype, torch.float32))
    out = self.score_grouped(qg, {n: _pages(x) for n, x in t.items()}, s)
    out = out.reshape(Bsz, -1, out.shape[-2], P)                            # [B, Hq, S, P]
    return out[:, :, 0] if single else out


# %%
ones = torch.ones(2, 2, 2, dtype=torch.float64)
test_eq(mk.score(ones, 1.0), torch.tensor([[[3.0, 11], [3, 11]], [[23, 31], [23, 31]]], dtype=torch.float64))
assert_close(mk.score(ones), mk.score(ones, 1.0) / math.sqrt(2))
test_eq(mk.score(torch.stack([ones, -ones, ones], 2), 1.0)[:, :, 1], -mk.score(ones, 1.0))   # [B, Hq, S, P]
test_fail(lambda: mk.score(ones[:1]), contains="q's batch (1) must match the summary's (2)")
test_fail(lambda: MeanKeySummary().score(ones), contains="holds no pages")


# %% [markdown]
# `reference` loops `reference_page` over batch, query heads and pages in float64, each page read from the keys:

# %%
#| export
@patch_to(PageSummary)
def reference(self, K: Tensor, q: Tensor) -> Tensor:
    "Loop reference of score for q [B, Hq, d] (scale 1/sqrt(d)) over the pages of K [B, Hkv, T, d], float64."
    t = self._built()
    Bsz, Hq, d = q.shape
    Hkv, m, P = K.shape[1], self.page_size, self.n_pages
    out = torch.empty(Bsz, Hq, P, dtype=torch.float64)
    for b in range(Bsz):
        for h in range(Hq):
            x, kv = q[b, h].double(), h // (Hq // Hkv)
            for p in range(P):
                tp = {n: y[b, kv, p] for n, y in t.items()}
                out[b, h, p] = self.reference_page(x, K[b, kv, p * m:(p + 1) * m].double(), tp, 1 / math.sqrt(d))
    return out


# %%
q2 = torch.randn(2, 4, 2, dtype=torch.float64)
test_eq(mk.reference(Kt, ones), mk.score(ones))
assert_close(mk.reference(Kt, q2), mk.score(q2))
Kt2 = torch.randn(2, 2, 7, 2, dtype=torch.float64)                    # two KV heads: query heads 0, 1 read head 0
mk2 = MeanKeySummary().summarize(Kt2, None, 3)
assert_close(mk2.reference(Kt2, q2), mk2.score(q2))


# %% [markdown]
# Each class below is checked against its loop reference on a random GQA cache (2 KV heads, 3
# query heads each, $d = 16$) of 4 pages of 8 tokens and a trailing partial page that must be
# ignored, and by the checks every class shares (`_check_summary`): several queries at once
# give the scores of one at a time; the packed layout, multiplied out with `einsum`, gives the
# same scores, and `unpack` returns the tensors; the tensors hold `scalars` numbers per page.
# An unbuilt summary has no pages to score.

# %%
def _random_cache(B=2, Hkv=2, T=4 * 8 + 5, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(B, Hkv, T, d, generator=g, dtype=dtype) * torch.logspace(0, -1, d, dtype=dtype)
    K = K + torch.randn(d, generator=g, dtype=dtype)
    V = torch.randn(B, Hkv, T, d, generator=g, dtype=dtype)
    A = torch.randn(Hkv, d, d, generator=g, dtype=dtype)
    return K, V, A.mT @ A / d

def _check_summary(summ, K, q):
    "The checks every summary shares: batched queries, the packed layout, unpack, the storage count."
    sc = summ.score(q)
    assert_close(summ.score(torch.stack([q, 2 * q], 2)), torch.stack([sc, summ.score(2 * q)], 2))
    rows, R = summ.pack()
    Bsz, Hkv, P, nr, f = rows.shape
    for n, y in summ.unpack(rows, R).items(): assert torch.equal(y, summ.tensors[n]), n
    x = summ.features(q.reshape(Bsz * Hkv, -1, q.shape[-1]) / math.sqrt(q.shape[-1]))     # [B*Hkv, G, f]
    z = torch.einsum("agf,aprf->agpr", x, rows.reshape(Bsz * Hkv, P, nr, f))
    Rp = None if R is None else R.reshape(Bsz * Hkv, P, *R.shape[3:]).transpose(0, 1)
    assert_close(summ.packed_score(z, Rp).reshape(sc.shape), sc)
    test_eq(sum(y[0, 0].numel() for y in summ.tensors.values()), P * summ.scalars(summ.page_size, K.shape[-1]))

K, V, G = _random_cache()
q = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
logits = torch.einsum("bhgd,bhpmd->bhgpm", q.reshape(2, 2, 3, 16), split_pages(K, 8)).reshape(2, 6, 4, 8) / 4  # s k.q
lse = logits.logsumexp(-1)                                                     # the exact page log-mass


# %% [markdown]
# ## Retrieval methods
#
# Each summary below is followed by its method, the class the registry finds by name (see
# [the registry](07_methods.ipynb)): a subclass of `PageRetrieval`, which names its summary (`summary`, a key of
# `SUMMARIES`) and states what scoring one page costs (`page_cost`). The prompt is prefilled densely into the full
# cache (`GrowingCache`); each decode query attends to the pages `PageRetrievalPolicy`
# ([page retrieval](32_oval_pages.ipynb)) picks from the summaries: the sink and recent regions (rounded out to
# whole pages) and the best-scored pages, within `budget` = `token_budget` tokens per KV head. By default the
# sink and recent regions take the policy's 32 tokens each, at most a quarter of the budget each.
#
# The policy is built on this notebook's summaries (its module imports this one), so `PageRetrieval.policy` imports
# it when called. Check with a retrieval method of our own that uses Quest's summary (below) and its page cost: the
# default sink and recent regions, a budget that cannot hold them, and the scoring cost of a decode step, by hand at
# SmolLM2-135M's shape.

# %%
#| export
class PageRetrieval(Method):
    "Dense prefill; decode queries attend to the sink, recent and top pages of `summary`, `budget` tokens per KV head."
    family, summary, small_params = "retrieval", None, {"page_size": 4, "sink": 4, "recent": 4, "rank": 2}

    def __init__(self, budget: int, page_size: int = 32, sink: int | None = None, recent: int | None = None,
                 rank: int = 8, *, backend: str = "torch"):
        super().__init__(budget)
        self.page_size, self.rank, self.backend = page_size, rank, backend
        self.sink = min(32, self.budget // 4) if sink is None else sink
        self.recent = min(32, self.budget // 4) if recent is None else recent
        self.policy()
        if self.sink + self.recent > self.budget:
            raise ValueError(f"budget={self.budget} must cover sink + recent = {self.sink} + {self.recent}")

    def options(self) -> dict:
        "Keyword arguments of `PageRetrievalPolicy` besides the summary and the budget."
        return dict(page_size=self.page_size, sink=self.sink, recent=self.recent, rank=self.rank, backend=self.backend)

    def policy(self) -> SelectionPolicy:
        "A fresh `PageRetrievalPolicy` of `summary` with this method's budget and options."
        # imported here: the policy that runs page retrieval is built on these summaries (its module imports this one)
        from sparsekv.oval.pages import PageRetrievalPolicy
        return PageRetrievalPolicy(self.summary, token_budget=self.budget, **self.options())

    def page_cost(self, shape: ModelShape) -> int:
        "Multiply-adds scoring one page for the G decode queries of one KV head."
        raise NotImplementedError(f"{type(self).__name__} must implement page_cost(shape)")

    def scoring_cost(self, shape, n_cached: int, phase: str = "prefill", chunk: int | None = None) -> ScoringCost:
        "Multiply-adds scoring the complete pages of `n_cached` keys at a decode step; zero at prefill (it is dense)."
        shape, _ = ModelShape.of(shape), queries_per_call(phase, chunk, 1)
        check_int(n_cached, "n_cached")
        if phase == "prefill": return ScoringCost()
        page = self.page_cost(shape)
        step = page * (n_cached // self.page_size) if n_cached > self.budget else 0
        return ScoringCost(page / self.page_size, step, step * shape.Hkv * max(0, shape.layers - self.dense_layers))

    @property
    def dense_layers(self) -> int:
        "The first layers, dense at decode too (the policy's default)."
        return self.policy().dense_layers


# %%
class _MinMax(PageRetrieval):  # Quest's summary and page cost, unregistered
    summary = "quest"
    def page_cost(self, shape): return 2 * shape.G * shape.D  # noqa: E301

shape = ModelShape(9, 3, 64, 30)  # SmolLM2-135M: G = 3, D = 64, 30 layers
mm = _MinMax(256)
test_eq((mm.family, mm.sink, mm.recent, _MinMax(64).sink, _MinMax(64).recent), ("retrieval", 32, 32, 16, 16))
test_fail(lambda: _MinMax(16, sink=10, recent=10), contains="must cover sink + recent")
test_eq(mm.scoring_cost(shape, 4096, "prefill"), ScoringCost())  # the prefill is dense
# a decode step scores the 4096 / 32 complete pages, 2 G D each, in every layer past the dense ones
test_eq(mm.scoring_cost(shape, 4096, "decode"),
        ScoringCost(384 / 32, 384 * 128, 384 * 128 * 3 * (30 - mm.dense_layers)))
test_eq(mm.scoring_cost(shape, 200, "decode").per_step, 0)  # the cache fits the budget: dense
test_fail(lambda: PageRetrieval.page_cost(mm, shape), contains="must implement page_cost")  # a subclass states it
test_eq(type(mm.policy()).__name__, "PageRetrievalPolicy")




# %% [markdown]
# ## Quest
#
# Quest (§2) keeps the per-channel extrema of the page's keys. Its score is an upper bound on
# the logit $s\,k_t\cdot q$ of every key in the page, channel by channel
# ($q_c k_c \le \max(q_c\ell_c, q_c u_c)$). Packed: since $\ell_c \le u_c$,
# $\max(q_c\ell_c, q_c u_c) = q_c^+ u_c + q_c^- \ell_c$ with $q^+ = \max(q, 0)$,
# $q^- = \min(q, 0)$, so the score is $\phi(q)\cdot W_p$ with $\phi(q) = [s q^+;\ s q^-]$ and
# one row $W_p = [u;\ \ell]$ of $2d$ scalars.
#
# Check: the loop reference; the bound on every key's logit, hence
# $\log\sum_t e^{z_t} \le \max_t z_t + \log m$ bounds the exact page log-mass by the score plus $\log m$.

# %%
#| export
class QuestSummary(PageSummary):
    "Quest (§2): per-channel key min and max of each page, kmin and kmax [B, Hkv, P, d]; the score bounds each logit."
    name = "quest"

    def build(self, K, V, m):
        pages = split_pages(K, m)
        return {"kmin": pages.amin(-2), "kmax": pages.amax(-2)}

    def score_grouped(self, q, t, s):
        return torch.maximum(q * t["kmin"].to(q.dtype), q * t["kmax"].to(q.dtype)).sum(-1) * s

    def reference_page(self, x, Kp, tp, s):
        lo, hi = Kp.min(0).values, Kp.max(0).values
        return s * sum(max(x[c] * lo[c], x[c] * hi[c]) for c in range(len(x)))

    def pack(self):
        return torch.cat([self.tensors["kmax"], self.tensors["kmin"]], -1).unsqueeze(-2), None

    @classmethod
    def unpack(cls, W, R):
        d = W.shape[-1] // 2
        return {"kmin": W[..., 0, d:], "kmax": W[..., 0, :d]}

    @staticmethod
    def features(x):
        return torch.cat([x.clamp(min=0), x.clamp(max=0)], -1)            # q+ u + q- l = max(q u, q l) as l <= u

    def scalars(self, page_size, head_dim): return 2 * head_dim


# %%
quest = QuestSummary().summarize(K, V, 8)
test_eq((quest.n_pages, quest.page_size, quest.length), (4, 8, 37))
sc = quest.score(q)
test_eq(sc.shape, (2, 6, 4))
assert_close(sc, quest.reference(K, q))
assert (sc.unsqueeze(-1) >= logits - 1e-12).all()
assert (sc + math.log(8) >= lse - 1e-12).all()
_check_summary(quest, K, q)
test_fail(lambda: QuestSummary().score(q), contains="holds no pages")


# %% [markdown]
#

# %% [markdown]
# **The method.** `Quest` (`"quest"`) retrieves with this summary. Scoring a page for the $G$ decode queries of a KV
# head multiplies each query's $[q^+;\ q^-]$ by the page's row $[u;\ \ell]$: $2 G D$ multiply-adds (`page_cost`).

# %%
#| export
class Quest(PageRetrieval):
    "Quest: pages scored by their keys' channel-wise min/max bound."
    name, summary = "quest", "quest"

    def page_cost(self, shape):
        "[q+, q-] times [k_max, k_min] per query head: 2 G D."
        return 2 * shape.G * shape.D


# %%
test_eq(Quest(256).page_cost(shape), 2 * 3 * 64)


# ## ArkVale
#
# **Our reading of ArkVale.** The OVAL paper only says ArkVale "summarizes pages with
# compact geometric representations" [13]; the issue asks for a centre/radius summary. We
# use the bounding ball around the page mean, $c=\mu$, $\rho=\max_t\lVert k_t-\mu\rVert$,
# stored as $d+1$ scalars. By Cauchy–Schwarz, $q\cdot k_t = q\cdot c + q\cdot(k_t-c) \le
# q\cdot c + \lVert q\rVert\rho$, so like Quest's it is an upper bound on every key's logit
# in the page. The ArkVale paper itself also considers a bounding cuboid; that variant is
# Quest's box. Packed: $s(q\cdot c + \lVert q\rVert\rho) = [sq;\ \lVert sq\rVert]\cdot[c;\ \rho]$,
# one row of $d+1$.

# %%
#| export
class ArkValeSummary(PageSummary):
    "ArkVale as a bounding ball (our reading): centre = page mean [B, Hkv, P, d], radius = max_t ||k_t - centre||."
    name = "arkvale"

    def build(self, K, V, m):
        pages = split_pages(K, m)
        centre = pages.mean(-2)
        return {"centre": centre, "radius": (pages - centre.unsqueeze(-2)).norm(dim=-1).amax(-1)}

    def score_grouped(self, q, t, s):
        return ((q * t["centre"].to(q.dtype)).sum(-1) + q.norm(dim=-1) * t["radius"].to(q.dtype)) * s

    def reference_page(self, x, Kp, tp, s):
        c = Kp.mean(0)
        return s * (x @ c + x.norm() * max((Kp[t] - c).norm() for t in range(Kp.shape[0])))

    def pack(self):
        return torch.cat([self.tensors["centre"], self.tensors["radius"].unsqueeze(-1)], -1).unsqueeze(-2), None

    @classmethod
    def unpack(cls, W, R): return {"centre": W[..., 0, :-1], "radius": W[..., 0, -1]}

    @staticmethod
    def features(x): return torch.cat([x, x.norm(dim=-1, keepdim=True)], -1)

    def scalars(self, page_size, head_dim): return head_dim + 1


# %%
ark = ArkValeSummary().summarize(K, V, 8)
sc = ark.score(q)
test_eq(sc.shape, (2, 6, 4))
assert_close(sc, ark.reference(K, q))
assert (sc.unsqueeze(-1) >= logits - 1e-12).all()
assert (sc + math.log(8) >= lse - 1e-12).all()
_check_summary(ark, K, q)


# %% [markdown]
#

# %% [markdown]
# **The method.** `ArkVale` (`"arkvale"`) retrieves with the bounding ball: each query's $[q;\ \lVert q\rVert]$ times
# the page's $[c;\ \rho]$, $G (D + 1)$ multiply-adds per page.

# %%
#| export
class ArkVale(PageRetrieval):
    "ArkVale: pages scored by a bounding sphere of their keys."
    name, summary = "arkvale", "arkvale"

    def page_cost(self, shape):
        "[q, |q|] times [centre, radius] per query head: G (D + 1)."
        return shape.G * (shape.D + 1)


# %%
test_eq(ArkVale(256).page_cost(shape), 3 * (64 + 1))


# ## Key PCA
#
# Key PCA (LOCKS, §2) is the page basis of [`sparsekv.oval.basis`](30_oval_basis.ipynb) at
# $\eta = 0$: $\mu$, the top-$r$ principal directions $B$ of the centred keys and their
# coordinates $R = XB$, computed by `page_basis` batched over `[B, Hkv, P]` pages. It never
# looks at the values, so `V` may be omitted. Packed: $W_p = [B_p^\top;\ \mu_p^\top]$, $r+1$
# rows of $d$: $W_p(sq)$ gives the page's code $c_p = s B_p^\top q$ and its mean term
# $s\mu_p\cdot q$ at once. The remaining $R_p c_p$ ($m \times r$ times $r$) is one small product
# per page, batched over all pages (the second factor of `pack`):
#
# $$\text{score}_p(q) = \log\sum_{t=1}^m \exp\big((R_p c_p)_t\big) + s\,\mu_p\cdot q,\qquad c_p = s B_p^\top q .$$
#
# The class below holds the score and the packed layout; `build` follows it. Check: the packed score against the
# log-sum-exp of the page logits written out with `einsum`, and the storage count by hand
# ($d + dr + mr$ with $r \le m - 1$: $16 + 48 + 24 = 88$ at $m = 8$, $d = 16$, $r = 3$).

# %%
#| export
class KeyPCASummary(PageSummary):
    "Key PCA (LOCKS, §2): page_basis at eta = 0, no G: mu [B, Hkv, P, d], B [B, Hkv, P, d, r], R [B, Hkv, P, m, r]."
    name, eta = "keypca", 0.0

    def __init__(self, rank: int = 8): self.rank = check_int(rank, "rank", 1)

    @classmethod
    def from_options(cls, rank=8, eta=0.5, G=None): return cls(rank)

    def score_grouped(self, q, t, s): return page_score(q, t["mu"], t["B"], t["R"], scale=s)

    def reference_page(self, x, Kp, tp, s):
        mu, B, R = (tp[n].double() for n in ("mu", "B", "R"))
        return math.log(sum(math.exp(s * float(R[t] @ (B.T @ x) + mu @ x)) for t in range(R.shape[0])))

    # R is packed transposed, [r, m] per page: the batched product below then reads it row-major (~1.5x faster on CPU)
    def pack(self): return torch.cat([self.tensors["B"].mT, self.tensors["mu"].unsqueeze(-2)], -2), self.tensors["R"].mT

    @classmethod
    def unpack(cls, W, R): return {"mu": W[..., -1, :], "B": W[..., :-1, :].mT, "R": R.mT}

    @staticmethod
    def packed_score(z, R):
        (P, BH, r, m), GS = R.shape, z.shape[1]
        code = z[..., :r].permute(2, 0, 1, 3).reshape(P * BH, GS, r)             # c_p per page, [P*BH, GS, r]
        logits = torch.bmm(code, R.reshape(P * BH, r, m)).view(P, BH, GS, m)     # (R_p c_p)_t
        # logsumexp by hand, in place: finite logits need none of torch's guards for infinite maxima (~1.1x faster)
        mx = logits.amax(-1, keepdim=True)
        lse = logits.sub_(mx).exp_().sum(-1).log_().add_(mx.squeeze(-1))
        return lse.permute(1, 2, 0) + z[..., r]

    def scalars(self, page_size, head_dim):
        r = min(self.rank, page_size - 1, head_dim)
        return head_dim + head_dim * r + page_size * r


# %%
zp, Rp = torch.randn(4, 3, 5, 3 + 1, dtype=torch.float64), torch.randn(5, 4, 3, 8, dtype=torch.float64)
assert_close(KeyPCASummary.packed_score(zp.clone(), Rp),
             torch.einsum("agpj,pajt->agpt", zp[..., :3], Rp).logsumexp(-1) + zp[..., 3])
test_eq((KeyPCASummary(rank=3).scalars(8, 16), KeyPCASummary(rank=20).scalars(8, 16)), (88, 16 + 16 * 7 + 8 * 7))
test_eq(type(KeyPCASummary.from_options(rank=3, eta=0.5, G=G)).__name__, "KeyPCASummary")


# %% [markdown]
# `build` runs `page_basis` batched over the pages, with the output metric of the KV head broadcast over them
# (OVAL's; key PCA has none). Check: the loop reference (from the summary's tensors); at rank $m-1$ the basis
# represents every centred key exactly ($X$ has rank $\le m-1$), so the score is the exact page log-mass,
# and at a low rank it is only an approximation; the values do not matter.

# %%
#| export
@patch_to(KeyPCASummary)
def build(self, K, V, m):  # noqa: F811
    if V is None and self.needs_values: raise ValueError(f"V is required for method {self.name!r}")
    V = _check_cache(K if V is None else V, "V")                    # key PCA never looks at the values (eta = 0)
    if V.shape[:3] != K.shape[:3]:
        raise ValueError(f"V {tuple(V.shape)} must match K {tuple(K.shape)} in batch, heads and length")
    G = self.G
    if G is not None:
        if not isinstance(G, Tensor) or G.dim() != 3 or G.shape[0] != K.shape[1]:
            got = getattr(G, "shape", type(G).__name__)
            raise ValueError(f"G must be [Hkv={K.shape[1]}, dv, dv] (see output_metric), got {got}")
        G = G[:, None]                                                 # broadcast over pages
    mu, B, R = page_basis(split_pages(K, m), split_pages(V, m), G, rank=self.rank, eta=self.eta)
    return {"mu": mu, "B": B, "R": R}


# %%
pca = KeyPCASummary(rank=3).summarize(K, V, 8)
sc = pca.score(q)
test_eq(sc.shape, (2, 6, 4))
assert_close(sc, pca.reference(K, q))
_check_summary(pca, K, q)
assert_close(KeyPCASummary(rank=7).summarize(K, V, 8).score(q), lse)
assert not torch.allclose(KeyPCASummary(rank=1).summarize(K, V, 8).score(q), lse)
for V2 in (None, 5 * V.flip(2)): assert_close(KeyPCASummary(rank=3).summarize(K, V2, 8).score(q), sc)
test_fail(lambda: KeyPCASummary(rank=0), contains="rank must be an int >= 1")


# %% [markdown]
#

# %% [markdown]
# **The method.** `KeyPCA` (`"key_pca"`) retrieves with the key-PCA summary; its rank is its cost knob. Per query
# head, the product with the packed rows $[B;\ \mu]$ costs $D (r + 1)$, then the page's $m$ codes $R c$ cost $m r$,
# with $r = \min(\mathrm{rank}, m - 1, D)$.

# %%
#| export
class KeyPCA(PageRetrieval):
    "Key PCA: pages scored in the rank-`rank` principal basis of their keys (OVAL's eta = 0 endpoint)."
    name, summary, cost_knob = "key_pca", "keypca", "rank"

    def page_cost(self, shape):
        "Per query head q times [B, mu], D (r + 1), then the page's m codes R c, m r; r = min(rank, m - 1, D)."
        r = min(self.rank, self.page_size - 1, shape.D)
        return shape.G * (shape.D * (r + 1) + self.page_size * r)


# %%
test_eq(KeyPCA(256).page_cost(shape), 3 * (64 * 9 + 32 * 8))  # r = 8
test_eq(KeyPCA(256, page_size=4).page_cost(shape), 3 * (64 * 4 + 4 * 3))  # r = m - 1 = 3


# ## OVAL
#
# OVAL (§3.3) is the same summary with the output-aware basis: `page_basis(..., eta)` with the
# layer's output metric $G$ `[Hkv, d, d]` (from `output_metric`; `None` is the identity),
# broadcast over batch and pages. It reads the values while building the basis only; the
# stored tensors, the score and the packed layout are key PCA's.
#
# Check: the loop reference; $\eta = 0$ is key PCA (whatever $G$); rank $m-1$ is exact at any
# $\eta$, a low rank is not; $\eta = 1$ gives another basis than key PCA.

# %%
#| export
class OVALSummary(KeyPCASummary):
    "OVAL (§3.3): page_basis with eta in [0, 1] and the output metric G [Hkv, d, d] (None: identity); else key PCA."
    name, needs_values, needs_metric = "oval", True, True

    def __init__(self, rank: int = 8, eta: float = 0.5, G: Tensor | None = None):
        super().__init__(rank)
        check_eta(eta)
        self.eta, self.G = eta, G

    @classmethod
    def from_options(cls, rank=8, eta=0.5, G=None): return cls(rank, eta, G)

    def with_metric(self, G: Tensor) -> OVALSummary:
        "A copy that uses the output metric G [Hkv, d, d]."
        out = copy.copy(self)
        out.G = G
        return out


# %%
oval = OVALSummary(rank=3, eta=0.5, G=G).summarize(K, V, 8)
sc = oval.score(q)
test_eq(sc.shape, (2, 6, 4))
assert_close(sc, oval.reference(K, q))
_check_summary(oval, K, q)
assert_close(OVALSummary(rank=3, eta=0.0, G=G).summarize(K, V, 8).score(q), pca.score(q))
assert_close(OVALSummary(rank=7, G=G).summarize(K, V, 8).score(q), lse)
assert not torch.allclose(OVALSummary(rank=1, G=G).summarize(K, V, 8).score(q), lse)
assert not torch.allclose(OVALSummary(rank=3, eta=1.0, G=G).summarize(K, V, 8).score(q), pca.score(q))
assert_close(OVALSummary(rank=3).with_metric(G).summarize(K, V, 8).score(q), sc)
test_fail(lambda: OVALSummary().summarize(K, None, 8), contains="V is required")
test_fail(lambda: OVALSummary(G=G[0]).summarize(K, V, 8), contains="G must be [Hkv=2")
for bad in (math.nan, math.inf, -math.inf):  # a key of a page, a value, a query: each refused, named
    test_fail(lambda: QuestSummary().summarize(K.index_fill(2, torch.tensor([3]), bad), None, 8),
              contains="K contains NaN or inf")
    test_fail(lambda: OVALSummary().summarize(K, V.index_fill(2, torch.tensor([5]), bad), 8),
              contains="V contains NaN or inf")
    test_fail(lambda: oval.score(q.index_fill(1, torch.tensor([2]), bad)), contains="q contains NaN or inf")
test_fail(lambda: OVALSummary(eta=1.5), contains="eta must be a number in [0, 1]")


# %% [markdown]
#

# %% [markdown]
# **The method.** `OVAL` (`"oval"`) passes $\eta$ on to the policy (`options`), which gives each layer its output
# metric $G$ from that layer's `o_proj`. Its summary has key PCA's format, so its page cost is key PCA's.

# %%
#| export
class OVAL(PageRetrieval):
    "OVAL (§3.3): output-aware page bases mixing key fidelity and output sensitivity by `eta`."
    name, summary, cost_knob = "oval", "oval", "rank"

    def __init__(self, budget: int, page_size: int = 32, sink: int | None = None, recent: int | None = None,
                 rank: int = 8, eta: float = 0.5, *, backend: str = "torch"):
        self.eta = eta
        super().__init__(budget, page_size, sink, recent, rank, backend=backend)

    def options(self): return dict(super().options(), eta=self.eta)

    page_cost = KeyPCA.page_cost  # the same summary format as key PCA (§3.3)


# %%
test_eq((OVAL(256).page_cost(shape), OVAL(256, eta=0.25).options()["eta"]), (KeyPCA(256).page_cost(shape), 0.25))
test_eq((OVAL(256).options()["backend"], OVAL(256, backend="triton").policy().backend), ("torch", "triton"))


# ## Oracle
#
# The oracle reads the page's keys themselves; its score is the exact page log-mass, the
# quantity the other summaries estimate. It stores nothing extra (it reads the resident
# cache): $m d$ scalars per page. Packed: $W_p = K_p$, $m$ rows; the score is the
# log-sum-exp of $W_p(sq)$.

# %%
#| export
class OracleSummary(PageSummary):
    "The oracle: the page's keys K [B, Hkv, P, m, d]; the score is the exact page log-mass logsumexp_t(s k_t . q)."
    name = "oracle"

    def build(self, K, V, m): return {"K": split_pages(K, m)}

    def score_grouped(self, q, t, s): return page_lse_exact(q, t["K"], scale=s)

    def reference_page(self, x, Kp, tp, s):
        return math.log(sum(math.exp(s * float(Kp[t] @ x)) for t in range(Kp.shape[0])))

    def pack(self): return self.tensors["K"], None

    @classmethod
    def unpack(cls, W, R): return {"K": W}

    @staticmethod
    def packed_score(z, R): return z.logsumexp(-1)

    def scalars(self, page_size, head_dim): return page_size * head_dim


# %%
orc = OracleSummary().summarize(K, V, 8)
assert_close(orc.score(q), orc.reference(K, q))
assert_close(orc.score(q), lse)
_check_summary(orc, K, q)


# %% [markdown]
#

# %% [markdown]
# **The method.** `OraclePages` (`"oracle_pages"`) ranks the pages by their exact attention mass: an upper bound for
# the others, not a method one can deploy. Every key of the page times each query head: $G m D$ per page.

# %%
#| export
class OraclePages(PageRetrieval):
    "The oracle: pages ranked by their exact attention mass (an upper bound, not a method one can deploy)."
    name, summary = "oracle_pages", "oracle"

    def page_cost(self, shape):
        "Every key of the page times each query head: G m D."
        return shape.G * self.page_size * shape.D


# %%
test_eq(OraclePages(256).page_cost(shape), 3 * 32 * 64)


# ## Methods by name
#
# `SUMMARIES` maps each method's name to its class. `make_summary` turns a name and the
# options every method shares (rank, $\eta$, $G$) into an unbuilt summary: each class takes
# the options it uses (key PCA: rank; OVAL: rank, $\eta$, $G$; the others none). A
# `PageSummary` passed instead of a name is used as it is, so every function that takes a
# `method` takes either.

# %%
#| export
SUMMARIES = {"quest": QuestSummary, "arkvale": ArkValeSummary, "keypca": KeyPCASummary, "oval": OVALSummary,
             "oracle": OracleSummary}
METHODS = tuple(SUMMARIES)

# %%
test_eq(METHODS, ("quest", "arkvale", "keypca", "oval", "oracle"))
for name, cls in SUMMARIES.items(): test_eq(cls.name, name)


# %% [markdown]
# A method given by name or as a `PageSummary` comes down to its name:

# %%
#| export
def _check_method(method) -> str:
    "The name of a method given by name or as a PageSummary."
    if isinstance(method, PageSummary): return method.name
    if method not in METHODS: raise ValueError(f"method must be one of {METHODS} or a PageSummary, got {method!r}")
    return method


# %%
test_eq((_check_method("oval"), _check_method(QuestSummary())), ("oval", "quest"))
test_fail(lambda: _check_method("pca"), contains="method must be one of ('quest', 'arkvale'")


# %%
#| export
def make_summary(method: str | PageSummary, rank: int = 8, eta: float = 0.5, G: Tensor | None = None) -> PageSummary:
    "The unbuilt summary of a method: SUMMARIES[method] with the options it takes, or a given PageSummary as it is."
    if isinstance(method, PageSummary): return method.with_tensors()
    return SUMMARIES[_check_method(method)].from_options(rank=rank, eta=eta, G=G)


# %%
test_eq(METHODS, ("quest", "arkvale", "keypca", "oval", "oracle"))
for name, cls in SUMMARIES.items():
    s = make_summary(name, rank=3, eta=0.25, G=G)
    test_eq((type(s), s.name, s.n_pages), (cls, name, 0))
    test_eq(type(make_summary(s)), cls)
test_eq((make_summary("keypca", rank=3, eta=0.25, G=G).eta, make_summary("keypca", G=G).G), (0.0, None))
test_eq((make_summary("oval", rank=3, eta=0.25).rank, make_summary("oval", eta=0.25).eta), (3, 0.25))
assert make_summary(oval).tensors is None and oval.tensors is not None        # the given summary is left as it is
test_fail(lambda: make_summary("pca"), contains="method must be one of")


# %% [markdown]
# The string API: `build_summaries` builds the summaries of a method given by name (or as a
# `PageSummary`) with the shared options, and `score_pages` / `score_pages_reference` score
# them after checking that they are the named method's.

# %%
#| export
def build_summaries(method: str | PageSummary, K: Tensor, V: Tensor | None, page_size: int, rank: int = 8,
                    eta: float = 0.5, G: Tensor | None = None) -> PageSummary:
    "Summaries of the complete pages of K (and V for OVAL) [B, Hkv, T, d] by a method's name (or PageSummary)."
    return make_summary(method, rank, eta, G).summarize(K, V, page_size)


# %%
summs = {method: build_summaries(method, K, V, page_size=8, rank=3, eta=0.5, G=G) for method in METHODS}
for method, summ in summs.items():
    test_eq(summ.n_pages, 4)
    for n, x in make_summary(method, 3, 0.5, G).summarize(K, V, 8).tensors.items():
        assert torch.equal(summ.tensors[n], x)
test_fail(lambda: build_summaries("quest", K, V, 0), contains="page_size")


# %% [markdown]
# The scoring functions check that a summary is the named method's:

# %%
#| export
def _check_summary_of(method, summary) -> PageSummary:
    name = _check_method(method)
    if not isinstance(summary, PageSummary):
        raise TypeError(f"summary must be a PageSummary, got {type(summary).__name__}")
    if summary.name != name: raise ValueError(f"summary was built for {summary.name!r}, not {name!r}")
    return summary


# %%
assert _check_summary_of("quest", quest) is quest and _check_summary_of(oval, oval) is oval
test_fail(lambda: _check_summary_of("arkvale", quest), contains="built for 'quest'")
test_fail(lambda: _check_summary_of("quest", K), contains="must be a PageSummary")


# %% [markdown]
# Check every method by name, on the cache above: one query at a time and several at once.

# %%
#| export
def score_pages(method: str | PageSummary, summary: PageSummary, q: Tensor, scale: float | None = None) -> Tensor:
    "Log-domain page scores [B, Hq, P] (or [B, Hq, S, P]) of the summary's pages; scale defaults to 1/sqrt(d)."
    return _check_summary_of(method, summary).score(q, scale)


# %%
for method, summ in summs.items():
    sc = score_pages(method, summ, q)
    test_eq(sc.shape, (2, 6, 4))
    # several queries at once give the same scores as one at a time
    both = torch.stack([sc, score_pages(method, summ, 2 * q)], 2)
    assert_close(score_pages(method, summ, torch.stack([q, 2 * q], 2)), both)
test_fail(lambda: score_pages("arkvale", quest, q), contains="built for 'quest'")
test_fail(lambda: score_pages("quest", K, q), contains="must be a PageSummary")


# %% [markdown]
# Check every method by name against its loop:

# %%
#| export
def score_pages_reference(method: str | PageSummary, K: Tensor, q: Tensor, summary: PageSummary) -> Tensor:
    "Loop reference of score_pages for q [B, Hq, d]: bounds and oracle from the keys K, basis methods from the tensors."
    return _check_summary_of(method, summary).reference(K, q)


# %%
for method, summ in summs.items(): assert_close(score_pages(method, summ, q), score_pages_reference(method, K, q, summ))
