# %% [markdown]
# # The evaluation protocol
#
# > One method, one item, one row: greedy answers and teacher-forced continuations under any method of the registry, with the KV entries each query actually attended to, budgets matched on that measurement, and scoring cost beside the score.

# %%
#| default_exp protocol

# %% [markdown]
# Every comparison of this package runs its methods through the functions of this page, so that
# methods of different families are compared on the same items at equal *measured* budgets:
#
# - **Items.** `answer` scores one retrieval item (a prompt of `sparsekv.data`, greedy decoding,
#   exact match); `continuation` scores held-out prose windows (the method prefills their first
#   tokens, then reads the rest one token at a time, and its next-token logits are compared with
#   the dense model's: top-1 agreement, KL, negative log-likelihood). Each gives one row per
#   (method, item), the long table `sparsekv.stats.compare` turns into paired intervals.
# - **Measured budgets.** A method's `budget` is nominal: what a query may attend to besides what
#   the family adds (a selection method's chunk attends to its own keys; a page retrieval method
#   rounds to pages; an eviction cache of $B$ entries plus the query's own). Each row carries what
#   the method's queries *did* attend to, per phase (mean and max over queries, heads and layers,
#   from `sparsekv.hf.measure_attended`). `fit_budget` picks, per method, the largest nominal
#   budget whose measured maximum stays within the comparison's budget, so every method of a
#   table is held to the same measured ceiling.
# - **Costs.** `cost_columns` puts the multiply-adds each method spends choosing keys (per cached
#   key, `sparsekv.methods.scoring_cost`) beside its score.

# %%
#| export
from __future__ import annotations

import hashlib
import json
import copy
import math
import numbers
import time
from collections.abc import Mapping
from typing import Callable

import pandas as pd
import torch

from sparsekv import methods
from sparsekv.attention import check_int
from sparsekv.cache import GrowingCache
from sparsekv.data import count_tokens, score_exact
from sparsekv.eval import kl_to_teacher, token_nll, top1_agreement
from sparsekv.hf import AttendedBudget, Method, chunked_prefill, measure_attended
from sparsekv.hf import PHASES, ModelShape, scoring_cost
from sparsekv.stats import compare

# %%
#| hide
from types import SimpleNamespace

import numpy as np
from fastcore.test import test_close, test_eq, test_fail

from sparsekv import presses
from sparsekv.data import make_task
from sparsekv.models import tiny_model

torch.set_num_threads(1)  # small tensors: threads only add overhead


# %% [markdown]
# ## Measured budgets
#
# `measured_budget` reads an `AttendedBudget` into the columns every row carries: for each phase,
# the mean and the max number of KV entries a query attended to (NaN for a phase that did not run).
#
# Some methods leave layers dense by design: page retrieval attends densely in its first layer(s)
# (Quest, OVAL), LessIsMore at and below its selection layer. Their decode queries see every
# earlier token whatever the budget, and a max over all layers would report the whole context. Given
# `n_keys`, the most entries a decode query could attend to (every earlier token and itself at the
# last step), the decode layers whose max reaches it are counted as `dense_layers` and the decode
# columns describe the other layers; `decode_reads` keeps the mean over every layer, what decoding
# actually reads.

# %%
#| export
def _mean_max(rows: list[dict]) -> tuple[float, float]:
    "Mean over the queries of every row (a head of a layer) and the max of their maxes."
    if not rows: return math.nan, math.nan
    return sum(r["mean"] * r["queries"] for r in rows) / sum(r["queries"] for r in rows), max(r["max"] for r in rows)


# %%
test_eq(_mean_max([dict(mean=2.0, queries=1, max=3), dict(mean=5.0, queries=3, max=9)]), ((2 + 15) / 4, 9))
assert all(math.isnan(x) for x in _mean_max([]))

# %% [markdown]
# The check of `measured_budget`: on the tiny model, a dense generation's decode queries attend to every earlier
# token and themselves. With a prompt of $S$ tokens and $n$ new ones, `generate` prefills the prompt (query $i$
# sees $i + 1$ keys) and decodes $n - 1$ steps (step $j$ sees $S + j$ keys), the same in every
# layer and head; every layer is dense, so none is set apart.

# %%
#| export
BUDGET_COLUMNS = ("prefill_mean", "prefill_max", "decode_mean", "decode_max", "dense_layers", "decode_reads")

def measured_budget(meter: AttendedBudget, n_keys: int | None = None) -> dict:
    """Mean and max KV entries attended per query and head, per phase (`BUDGET_COLUMNS`, NaN where none ran); decode
    layers whose max reaches `n_keys` are `dense_layers`, left out of `decode_mean`/`decode_max` unless all are."""
    rows = meter.per_head()
    out = dict(zip(("prefill_mean", "prefill_max"), _mean_max([r for r in rows if r["phase"] == "prefill"])))
    dec = [r for r in rows if r["phase"] == "decode"]
    dense = set() if n_keys is None else {r["layer"] for r in dec if r["max"] >= check_int(n_keys, "n_keys", 1)}
    sparse = [r for r in dec if r["layer"] not in dense] or dec
    out["decode_mean"], out["decode_max"] = _mean_max(sparse)
    out["dense_layers"] = len(dense) if len(sparse) < len(dec) else 0
    out["decode_reads"] = _mean_max(dec)[0]
    return out


# %%
model, tok = tiny_model("tiny-llama")
S, n_new = 12, 5
ids = torch.randint(3, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(0))
GEN = dict(max_new_tokens=n_new, do_sample=False, pad_token_id=0)
with measure_attended() as meter: methods.make("dense").generate(model, ids, **GEN)
got = measured_budget(meter, n_keys=S + n_new - 1)
prefill, decode = list(range(1, S + 1)), [S + j for j in range(1, n_new)]
test_eq(got, dict(prefill_mean=np.mean(prefill), prefill_max=S, decode_mean=np.mean(decode), decode_max=S + n_new - 1,
                  dense_layers=0, decode_reads=np.mean(decode)))
got

# %% [markdown]
# Quest at a budget of 8 on a 40-token prompt: its first layer decodes densely, the second attends to
# its sink, recent and selected pages; `decode_reads` averages the two layers.

# %%
ids40 = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
SMALL = {"streaming_llm": {}, "quoka": dict(chunk_size=8, n_q=2), "quest": dict(page_size=4, sink=4, recent=4)}
with measure_attended() as meter:
    methods.make("quest", 12, **SMALL["quest"]).generate(model, ids40, max_new_tokens=4, do_sample=False,
                                                         pad_token_id=0)
got = measured_budget(meter, n_keys=43)
per_layer = {l: max(r["max"] for r in meter.per_head() if r["phase"] == "decode" and r["layer"] == l) for l in (0, 1)}
test_eq((got["dense_layers"], got["decode_max"], per_layer[0]), (1, per_layer[1], 43))
assert got["decode_mean"] < got["decode_reads"] < 43
got


# %% [markdown]
# ## Budgets matched on the measurement
#
# A method at nominal budget $b$ attends, per query, to at most some $f(b)$ entries, and $f$ grows
# with $b$ (more slots, more selected keys, more pages). `fit_budget` finds the largest
# $b \le$ `target` with $f(b) \le$ `target` in one phase, measuring $f$ with the caller's probe
# (a function that runs the method and returns its `measured_budget`). Most methods attend to a
# fixed overhead beyond $b$ (a selection method's own query, a page retrieval's partial page), so it
# starts at $b =$ `target`, steps down by the measured excess $f(b) -$ `target`, then bisects between
# the last budget that fits and the first that did not: one probe for an eviction method, two for a
# selection method, a few for page retrieval, where $f$ moves in steps of a page. It never goes below
# the smallest budget the method accepts (a page retrieval method needs its sink and recent tokens),
# and raises when even that budget exceeds the target. It assumes $f$ grows with $b$; every row of a
# comparison carries its own measurement, so a table shows whether the fit held on the real items.

# %% [markdown]
# A measurement is `measure(method)`'s dict of `measured_budget` columns; `fit_budget` reads its `<phase>_max`, a
# count of KV entries. Anything else (the key missing, text, an infinity) is refused naming the key and the method.

# %%
#| export
def measured_max(measurement, phase: str, what: str) -> float:
    """The `<phase>_max` of a `measure` result (KV entries per query, NaN when no query ran); else a TypeError or
    ValueError naming the key and `what` was measured."""
    key = f"{phase}_max"
    if not isinstance(measurement, Mapping) or key not in measurement:
        raise TypeError(f"measure must return a dict holding {key!r} (`measured_budget` columns); for {what} it "
                        f"returned {type(measurement).__name__} {str(measurement)[:80]}")
    x = measurement[key]
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"measure's {key} must be a number of KV entries, got {x!r} for {what}")
    if math.isnan(x): raise ValueError(f"{what} ran no {phase} query in the probe ({key} is NaN)")
    if not 0 <= x < math.inf: raise ValueError(f"measure's {key} must be a finite count >= 0, got {x!r} for {what}")
    return float(x)


# %%
test_eq(measured_max({"decode_max": 12, "prefill_max": 40.0}, "decode", "m"), 12.0)
test_fail(lambda: measured_max({"decode_max": math.inf}, "decode", "m at 3"), contains="got inf for m at 3")
test_fail(lambda: measured_max({"decode_max": True}, "decode", "m"), contains="must be a number")


# %%
#| export
def _builds(make: Callable[..., Method], name: str, budget: int, params: dict) -> bool:
    "Whether `make(name, budget, **params)` builds (a page retrieval method needs at least its sink and recent tokens)."
    try: make(name, budget, **params)
    except ValueError: return False
    return True


# %%
test_eq([_builds(methods.make, "quest", b, SMALL["quest"]) for b in (7, 8)], [False, True])   # sink + recent = 8
test_eq(_builds(methods.make, "streaming_llm", 1, {}), True)


# %% [markdown]
# `fit_budget`'s check against a scan of every nominal budget, for one method of each family on the tiny model
# (small pages and chunks so a 40-token prompt exercises them): the pick is the largest budget
# within the target, its measurement is the one the scan made, and the probes it spent are few.

# %%
#| export
def fit_budget(name: str, target: int, measure: Callable[[Method], dict], phase: str = "decode",
               make: Callable[..., Method] | None = None, **params) -> tuple[Method, dict]:
    """`make(name, b, **params)` (default `methods.make`; e.g. `presses.make`) at the largest nominal `b <= target`
    whose measured max KV entries per query in `phase` is at most `target`, and its measurement; `measure(method)`
    returns `measured_budget` columns."""
    target = check_int(target, "target", 1)
    if phase not in PHASES: raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    make = methods.make if make is None else make
    seen = {}

    def most(b: int) -> float:
        if b not in seen: seen[b] = measure(make(name, b, **params))
        return measured_max(seen[b], phase, f"{name} at budget {b}")

    first = next((b for b in range(1, target + 1) if _builds(make, name, b, params)), None)
    if first is None: make(name, target, **params)  # raises the method's own error
    b, hi = target, target  # hi: the largest budget not known to exceed the target
    while most(b) > target:  # step down by the excess: one step for a fixed overhead (the chunk's, a page's)
        if b == first:
            raise ValueError(f"{name} attends to more than target={target} entries per {phase} query even at its "
                             f"smallest budget {first}")
        hi, b = b - 1, max(first, b - max(1, int(most(b) - target)))
    lo = b
    while lo < hi:  # bisect between the last fit and the first known excess
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if most(mid) <= target else (lo, mid - 1)
    return make(name, lo, **params), seen[lo]


# %%
def probe(m: Method) -> dict:
    with measure_attended() as meter: m.generate(model, ids40, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return measured_budget(meter, n_keys=43)


for name, params in SMALL.items():
    for target in (12, 17):
        calls = []
        m, got = fit_budget(name, target, lambda m: calls.append(m.budget) or probe(m), **params)
        scan = {b: probe(methods.make(name, b, **params))["decode_max"] for b in range(1, target + 1)
                if _builds(methods.make, name, b, params)}
        ok = [b for b, most in scan.items() if most <= target]
        test_eq(m.budget, max(ok))
        test_eq(got["decode_max"], scan[m.budget])
        assert len(calls) <= 5, calls
        print(f"{name:14s} target {target}: nominal {m.budget}, measured decode max {got['decode_max']}, "
              f"probes at {calls}")
# a page-like overhead that moves in steps (f(b) = 4 ceil(b / 4) + 3) takes the step down and the bisection
paged = lambda m: dict(decode_max=4 * math.ceil(m.budget / 4) + 3)  # noqa: E731
for target in range(8, 40):
    m, _ = fit_budget("streaming_llm", target, paged)
    test_eq(m.budget, max(b for b in range(1, target + 1) if paged(SimpleNamespace(budget=b))["decode_max"] <= target))
test_fail(lambda: fit_budget("quest", 7, probe, **SMALL["quest"]), contains="budget=7 must cover")  # sink + recent
test_fail(lambda: fit_budget("quest", 8, probe, **SMALL["quest"]), contains="even at its smallest budget 8")
# a measurement that is not one: no decode_max, not a mapping, not a number, infinite
for bad, exc, msg in [({"prefill_max": 3.0}, TypeError, "holding 'decode_max'"), ("12", TypeError, "returned str"),
                      ({"decode_max": "12"}, TypeError, "decode_max must be a number"),
                      ({"decode_max": math.inf}, ValueError, "decode_max must be a finite count"),
                      ({"decode_max": math.nan}, ValueError, "ran no decode query")]:
    test_fail(lambda: fit_budget("tova", 16, lambda m: bad), exc=exc, contains=msg)
    test_fail(lambda: fit_budget("tova", 16, lambda m: bad), contains="tova at budget 16")

# %% [markdown]
# Any factory with `methods.make`'s signature fits too: a kvpress press (in the peer environment, see the
# README) keeps $b$ prompt entries and decode adds one per step, so 4 new tokens read at most $b + 3$.

# %%
#| peers
m, got = fit_budget("knorm", 17, probe, make=presses.make)
test_eq((m.budget, got["decode_max"]), (14, 17))


# %% [markdown]
# ## One retrieval item
#
# Items are keyed in results grids by `item_hash`, a hash of their text. `answer` feeds the prompt,
# a space and the answer prefix to `Method.generate` and decodes greedily
# as many tokens as the answer has plus `extra_tokens`; the item is correct when the completion
# contains the whole answer (`score_exact`). The row carries the measured budget and the seconds.
#
# Dense decoding and page retrieval prefill the prompt with dense attention into transformers' own
# cache (`prefills_densely`); only their decode steps differ. Prefilling a 4k prompt is most of an
# item's time, so `dense_prefill` does it once per item and `answer(..., prefilled=...)` decodes each
# such method from a copy of that cache: the first new token is the prefill's argmax, as in
# `generate`, and the row's prefill budget is the shared prefill's. Its `seconds` still count the
# prefill, so they are what the method costs alone.

# %%
#| export
def item_hash(item: dict) -> str:
    "A short hash of an item's prompt, answer prefix and answer: its key in a results grid (new text, new key)."
    return hashlib.sha256(json.dumps([item["prompt"], item["answer_prefix"], item["answer"]]).encode()).hexdigest()[:16]


# %%
test_eq(item_hash(dict(prompt="p", answer_prefix="a", answer="x", seed=3)),
        hashlib.sha256(b'["p", "a", "x"]').hexdigest()[:16])             # by hand; other fields do not count
assert item_hash(dict(prompt="p", answer_prefix="a", answer="y")) != item_hash(dict(prompt="p", answer_prefix="a",
                                                                                     answer="x"))


# %%
#| export
def prompt_ids(tok, item: dict, device=None) -> torch.Tensor:
    "Token ids `[1, L]` of an item's prompt, a space and its answer prefix."
    return tok(item["prompt"] + " " + item["answer_prefix"], return_tensors="pt").input_ids.to(device)


# %%
item = make_task("passkey", tok, 200, seed=0, depth=0.5)
item_ids = prompt_ids(tok, item)
test_eq((item_ids.ndim, item_ids.shape[0], item_ids.dtype), (2, 1, torch.long))
assert tok.decode(item_ids[0], skip_special_tokens=True).endswith(item["prompt"][-20:] + " " + item["answer_prefix"])


# %%
#| export
def prefills_densely(method: Method) -> bool:
    "Whether `method` prefills with dense attention into transformers' own cache (dense, page retrieval)."
    return method.family in ("dense", "retrieval") and method.chunk_size is None


# %%
pages = dict(page_size=4, sink=4, recent=4)  # pages of 4 so a 24-entry budget retrieves some
four = (methods.make("dense"), methods.make("quest", 24, **pages), methods.make("quoka", 24), methods.make("tova", 24))
test_eq([prefills_densely(m) for m in four], [True, True, False, False])


# %%
#| export
@torch.no_grad()
def dense_prefill(model, ids: torch.Tensor) -> dict:
    "The dense prefill of prompt `ids` `[1, L]` to share among `prefills_densely` methods: cache, last logits, budget."
    start = time.perf_counter()
    with measure_attended() as meter, methods.make("dense").patch(model):
        cache = GrowingCache(config=model.config)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return {"ids": ids, "cache": cache, "logits": logits, "budget": measured_budget(meter),
            "seconds": time.perf_counter() - start}


# %%
shared = dense_prefill(model, item_ids)
L = item_ids.shape[1]
with torch.no_grad(): torch.testing.assert_close(shared["logits"], model(item_ids).logits[:, -1])
test_eq((shared["cache"].get_seq_length(), shared["budget"]["prefill_max"]), (L, L))   # the last query sees all L
assert math.isnan(shared["budget"]["decode_max"]) and shared["seconds"] > 0


# %%
#| export
def _generate_after(method: Method, model, ids: torch.Tensor, n_new: int, prefilled: dict, **kwargs) -> torch.Tensor:
    "`method.generate(model, ids, max_new_tokens=n_new, **kwargs)` continued from a copy of `prefilled`'s cache."
    if not prefills_densely(method):
        raise ValueError(f"prefilled: {method.name} does not prefill densely; answer it without a shared prefill")
    if not torch.equal(prefilled["ids"], ids): raise ValueError("prefilled: it is the prefill of another prompt")
    out = torch.cat([ids, prefilled["logits"].argmax(-1, keepdim=True)], 1)  # the prefill's token, as generate
    eos = model.generation_config.eos_token_id
    if n_new == 1 or int(out[0, -1]) in (eos if isinstance(eos, list) else [eos]): return out
    with torch.no_grad(), method.patch(model):
        return model.generate(out, past_key_values=copy.deepcopy(prefilled["cache"]), max_new_tokens=n_new - 1,
                              **kwargs)


# %%
greedy = dict(do_sample=False, pad_token_id=0)
test_eq(_generate_after(methods.make("dense"), model, item_ids, 4, shared, **greedy),
        methods.make("dense").generate(model, item_ids, max_new_tokens=4, **greedy))
test_eq(shared["cache"].get_seq_length(), L)                                   # it decoded from a copy
test_fail(lambda: _generate_after(methods.make("dense"), model, item_ids[:, 1:], 4, shared), contains="another prompt")
test_fail(lambda: _generate_after(methods.make("quoka", 24), model, item_ids, 4, shared), contains="prefilled: quoka")


# %% [markdown]
# The check of `answer`: on the tiny model and a passkey item, every method that prefills densely answers the same
# from the shared prefill as from its own, with the same measured budget; a method that prefills in
# chunks is refused one.

# %%
#| export
def answer(method: Method, model, tok, item: dict, extra_tokens: int = 3, prefilled: dict | None = None) -> dict:
    """One greedy answer to a retrieval item under `method`: correct (0/1), the completion, measured budget, seconds;
    `prefilled`: the item's `dense_prefill`, for a method that `prefills_densely`."""
    ids = prompt_ids(tok, item, model.device)
    n_new = count_tokens(tok, " " + item["answer"]) + check_int(extra_tokens, "extra_tokens")
    start, gen = time.perf_counter(), dict(do_sample=False, pad_token_id=tok.eos_token_id)
    with measure_attended() as meter:
        if prefilled is None: out = method.generate(model, ids, max_new_tokens=n_new, **gen)
        else: out = _generate_after(method, model, ids, n_new, prefilled, **gen)
    budget = measured_budget(meter, n_keys=out.shape[1] - 1)
    if prefilled is not None: budget |= {k: v for k, v in prefilled["budget"].items() if k.startswith("prefill")}
    seconds = time.perf_counter() - start + (0 if prefilled is None else prefilled["seconds"])
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return {"correct": int(score_exact(text, item["answer"]) == 1.0), "completion": text.replace("\n", "\\n"),
            **budget, "seconds": seconds}


# %%
for m in [methods.make("dense")] + [methods.make(n, 24, **pages) for n in methods.names("retrieval")]:
    assert prefills_densely(m), m
    own, got = answer(m, model, tok, item), answer(m, model, tok, item, prefilled=shared)
    test_eq({k: got[k] for k in ("completion", *BUDGET_COLUMNS)}, {k: own[k] for k in ("completion", *BUDGET_COLUMNS)})
    print(f"{m.name:8s} {got['completion']!r}, decode mean / max {got['decode_mean']:.1f} / {got['decode_max']}")
test_fail(lambda: answer(methods.make("quoka", 24), model, tok, item, prefilled=shared), contains="prefilled: quoka")


# %% [markdown]
# ## Prose windows
#
# `continuation` runs the method over windows of $S$ tokens as a reader would: it prefills the first
# `prefix` tokens (in chunks of the method's `chunk_size`, else at once), then feeds the remaining
# tokens one at a time, each a decode step under the method. The next-token logits of those
# $S - $ `prefix` steps are compared with the dense model's logits at the same positions (one dense
# forward over the windows, or `dense_logits` when given): top-1 agreement, KL(dense ‖ method) and
# the method's negative log-likelihood of the true next token, each averaged over the steps.
#
# Decoding one token reads every weight of the model, so on a CPU a decode step costs about the same
# for one window as for several: `continuation` takes a batch of windows `[B, S]` (equal lengths, no
# padding) and returns one row per window. The measured budget is the batch's (every row of a batch
# gets the same), and `seconds` is the batch's time divided among its rows.

# %%
#| export
def _check_windows(ids, prefix: int) -> int:
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise ValueError(f"ids must be a [B, S] tensor of token ids, got {getattr(ids, 'shape', type(ids).__name__)}")
    prefix = check_int(prefix, "prefix", 1)
    if prefix >= ids.shape[1]:
        raise ValueError(f"prefix must be below the windows' {ids.shape[1]} tokens, got {prefix}")
    return prefix


# %%
wins = torch.randint(3, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
win = wins[:1]
test_eq(_check_windows(wins, 47), 47)
test_fail(lambda: _check_windows(wins, 48), contains="prefix must be below")
test_fail(lambda: _check_windows(wins[0], 8), contains="ids must be a [B, S]")
test_fail(lambda: _check_windows(wins, 0), contains="prefix must be")


# %%
#| export
@torch.no_grad()
def window_logits(method: Method, model, ids: torch.Tensor, prefix: int, times: dict | None = None) -> torch.Tensor:
    """Next-token logits `[B, S - prefix, V]` after tokens `prefix - 1 .. S - 2` of windows `ids` `[B, S]`, `method`
    on; `times` (a dict) gets the wall seconds of the batch's prefill (`prefill_s`) and per decode step (`step_s`)."""
    prefix = _check_windows(ids, prefix)
    with method.patch(model) as cache:
        start = time.perf_counter()
        cache = GrowingCache(config=model.config) if cache is None else cache
        if method.chunk_size: last = chunked_prefill(model, ids[:, :prefix], method.chunk_size, cache=cache)[1]
        else: last = model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]
        steps, decoding = [last], time.perf_counter()
        for t in range(prefix, ids.shape[1] - 1):  # teacher forcing: the true token, one decode step each
            # its position is t, whatever the cache holds (a press cut the prompt's cache: its length is not t)
            pos = torch.full((ids.shape[0], 1), t, device=ids.device)
            steps.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                               position_ids=pos).logits[:, -1])
        end = time.perf_counter()
    if times is not None:
        times |= {"prefill_s": decoding - start, "step_s": (end - decoding) / max(1, len(steps) - 1)}
    return torch.stack(steps, 1)


# %%
times = {}
with measure_attended() as meter: dense_steps = window_logits(methods.make("dense"), model, wins, 32, times)
with torch.no_grad(): torch.testing.assert_close(dense_steps, model(input_ids=wins).logits[:, 31:-1])
test_eq(sorted(times), ["prefill_s", "step_s"])


# %%
#| export
def memory_columns(meter: AttendedBudget) -> dict:
    """The most KV entries per KV head a layer held (`kv_peak`; `kv_decode` at decode steps) and the KV bytes per
    sequence with every layer at its most (`kv_bytes_peak`, `kv_bytes_decode`), from `measure_attended`."""
    got = {"peak": meter.stored(), "decode": meter.stored("decode")}
    return {f"kv_{p}": g["entries"] for p, g in got.items()} | {f"kv_bytes_{p}": g["bytes"] for p, g in got.items()}


# %%
kv_bytes = model.config.num_hidden_layers * 2 * model.config.num_key_value_heads * model.config.head_dim * 4
test_eq(memory_columns(meter), {"kv_peak": 47, "kv_decode": 47, "kv_bytes_peak": 47 * kv_bytes,
                                "kv_bytes_decode": 47 * kv_bytes})   # dense: every one of the 47 tokens fed, kept


# %% [markdown]
# The checks of `continuation`: dense attention agrees with itself at every step (KL 0) and its NLL is the plain
# cross-entropy of the window's last tokens; a budget covering the whole window does the same for a
# method of each family; a small budget does not; and a batch of two windows gives each window's
# row alone.

# %%
#| export
def continuation(method: Method, model, ids: torch.Tensor, prefix: int, dense_logits: torch.Tensor | None = None
                 ) -> list[dict]:
    """Per window of `ids` `[B, S]`: agreement, KL and NLL of `method`'s next-token logits vs dense, measured budget,
    KV memory (`memory_columns`), seconds per window, the batch's prefill seconds and milliseconds per decode step."""
    start, times = time.perf_counter(), {}
    with measure_attended() as meter: got = window_logits(method, model, ids, prefix, times)
    seconds = (time.perf_counter() - start) / ids.shape[0]
    if dense_logits is None:
        with torch.no_grad(): dense_logits = model(input_ids=ids).logits[:, prefix - 1:-1]
    if dense_logits.shape != got.shape:
        raise ValueError(f"dense_logits must be [B, S - prefix, V] = {tuple(got.shape)}, got "
                         f"{tuple(dense_logits.shape)}")
    budget = measured_budget(meter, n_keys=ids.shape[1] - 1)
    cost = {**memory_columns(meter), "seconds": seconds, "prefill_s": times["prefill_s"],
            "decode_ms": 1e3 * times["step_s"]}
    return [{"agreement": float(top1_agreement(g, d)), "kl": float(kl_to_teacher(g, d)),
             "nll": float(token_nll(g, y, shift=False)[0].mean()), **budget, **cost}
            for g, d, y in zip(got, dense_logits, ids[:, prefix:])]


# %%
(dense_row,) = continuation(methods.make("dense"), model, win, prefix=32)
with torch.no_grad(): logits = model(input_ids=win).logits[:, 31:-1]
test_eq(dense_row["agreement"], 1.0)
test_close(dense_row["kl"], 0.0, eps=1e-5)
test_close(dense_row["nll"], torch.nn.functional.cross_entropy(logits[0], win[0, 32:]).item(), eps=1e-4)
test_eq(dense_row["decode_max"], 47)  # the last step's query sees all 48 - 1 earlier tokens and itself
for name, params in SMALL.items():
    (whole,) = continuation(methods.make(name, 48, **params), model, win, prefix=32, dense_logits=logits)
    test_close(whole["kl"], 0.0, eps=1e-4)
    (small,) = continuation(methods.make(name, 8, **params), model, win, prefix=32, dense_logits=logits)
    assert small["kl"] > 1e-3 and small["decode_max"] < whole["decode_max"], (name, small)
    pair = continuation(methods.make(name, 8, **params), model, wins, prefix=32)
    for row, alone in zip(pair, [small, continuation(methods.make(name, 8, **params), model, wins[1:], prefix=32)[0]]):
        for key in ("agreement", "kl", "nll"): test_close(row[key], alone[key], eps=1e-4)
    print(f"{name:14s} budget 48: KL {whole['kl']:.1e}, agreement {whole['agreement']:.3f}; budget 8: "
          f"KL {small['kl']:.3f}, agreement {small['agreement']:.3f}, decode max {small['decode_max']}")
per_entry = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # float32 key + value per KV head
layers = model.config.num_hidden_layers
test_eq({k: dense_row[k] for k in ("kv_peak", "kv_decode", "kv_bytes_peak")}, {"kv_peak": 47, "kv_decode": 47,
                                                                            "kv_bytes_peak": layers * 47 * per_entry})
(evict,) = continuation(methods.make("streaming_llm", 8, sink=2, window=2), model, win, prefix=32)
test_eq((evict["kv_decode"], evict["kv_bytes_decode"]), (8, layers * 8 * per_entry))  # 7 kept + the new token
test_eq(evict["kv_peak"], 32)  # the prompt in one call, before its eviction
assert dense_row["prefill_s"] > 0 and dense_row["decode_ms"] > 0
test_fail(lambda: continuation(methods.make("dense"), model, win, prefix=48), contains="prefix must be below")
test_fail(lambda: continuation(methods.make("dense"), model, win[0], prefix=8), contains="ids must be a [B, S]")


# %% [markdown]
# ## Scoring cost beside the score
#
# `cost_columns` gives a method's scoring multiply-adds per cached key and KV head at prefill and at a
# decode step, for `n_cached` cached keys (zero for eviction and dense, see [the costs page](42_costs.ipynb)).

# %%
#| export
def cost_columns(method: Method, shape, n_cached: int) -> dict:
    "Scoring multiply-adds per cached key and KV head, at prefill and at decode: `prefill_cost`, `decode_cost`."
    shape = ModelShape.of(shape)
    return {f"{p}_cost": scoring_cost(method, shape, n_cached, p).per_key for p in PHASES}


# %%
shape = ModelShape(Hq=9, Hkv=3, D=64, layers=30)  # SmolLM2-135M
# QuoKA: N_Q = 16 aggregated queries of D dims per key at prefill (16 x 64 = 1,024), one at decode
test_eq(cost_columns(methods.make("quoka", 512), shape, 4096), dict(prefill_cost=16 * 64, decode_cost=64))
test_eq(cost_columns(methods.make("tova", 512), shape, 4096), dict(prefill_cost=0, decode_cost=0))


# %% [markdown]
# ## The comparison table
#
# `protocol_table` runs `compare` on a long table of rows (`method`, `budget`: the measured ceiling the
# methods were fitted to, `item`, the metric, the `BUDGET_COLUMNS` and the cost columns) and adds, per
# method and budget, what the methods measured: the mean over items of each phase's mean, the max of
# each phase's max, and the scoring cost. A reader checks in the same table that the budgets were
# equal and what each method paid to choose its keys.

# %%
#| export
def protocol_table(results: pd.DataFrame, metric: str, **compare_kwargs) -> pd.DataFrame:
    "`compare(results, metric)` with each method's measured budget (mean of means, max of maxes) and scoring costs."
    cmp = compare(results, metric, **compare_kwargs)
    method, budget = compare_kwargs.get("method", "method"), compare_kwargs.get("budget", "budget")
    costs = [c for c in ("prefill_cost", "decode_cost") if c in results]
    agg = {c: ("max" if c.endswith("_max") else "mean") for c in (*BUDGET_COLUMNS, *costs) if c in results}
    per = results.groupby([method, budget], dropna=False).agg(agg).reset_index()
    ref = cmp.attrs["reference"]
    out = cmp.merge(per[per[method] != ref], on=[method, budget], how="left")
    # the reference's rows may carry no budget: its measurement is the same at every budget
    ref_meas = per[per[method] == ref].drop(columns=[method, budget]).mean()
    for c in agg: out.loc[out[method] == ref, c] = ref_meas[c]
    out.attrs.update(cmp.attrs)
    return out


# %%
rows = pd.DataFrame([dict(method=m, budget=b, item=i, correct=int(m == "dense" or i % (2 + (m == "b")) > 0),
                          prefill_mean=10.0, prefill_max=20, decode_mean=float(b or 30), decode_max=b or 30,
                          prefill_cost=0.0, decode_cost=64.0 * (m == "b"))
                     for m, b in (("dense", None), ("a", 8), ("b", 8)) for i in range(12)])
table = protocol_table(rows, "correct")
test_eq(list(table.method), ["dense", "a", "b"])
test_eq(table.decode_max.tolist(), [30, 8, 8])
test_eq(table.decode_cost.tolist(), [0.0, 0.0, 64.0])
test_close(table["mean"].tolist(), [1.0, 0.5, 8 / 12])
table[["method", "budget", "mean", "se", "diff_ref", "ref_lo", "ref_hi", "decode_mean", "decode_max", "decode_cost"]]
