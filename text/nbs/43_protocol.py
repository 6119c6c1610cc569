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

import contextlib
import copy
import hashlib
import inspect
import json
import math
import numbers
import re
import time
from collections.abc import Mapping
from pathlib import Path
from statistics import NormalDist
from typing import Callable

import numpy as np
import pandas as pd
import torch
from fastcore.basics import patch_to
from transformers import DynamicCache

from sparsekv import methods, presses
from sparsekv.attention import check_int
from sparsekv.cache import GrowingCache
from sparsekv.costs import KNOBS, matched
from sparsekv.data import PASSKEY_PHRASINGS, SYNTHETIC_TASKS, count_tokens, make_task, score_exact
from sparsekv.eval import kl_to_teacher, run_grid, token_nll, top1_agreement
from sparsekv.hf import (
    PHASES,
    AttendedBudget,
    Method,
    ModelShape,
    chunked_prefill,
    measure_attended,
    patch,
    scoring_cost,
)
from sparsekv.models import model_info, tiny_model
from sparsekv.stats import compare, compare_cell, paired_ci

# %%
#| hide
import tempfile
from types import SimpleNamespace

from fastcore.test import test_close, test_eq, test_fail

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


# %% [markdown]
# ## A protocol run, step by step
#
# The protocol stage (`reproduce/03_protocol.ipynb`, and the leaderboard, the same notebook run under another name)
# runs the functions above over many methods, items and budgets. The pieces below are its steps, so the stage reads
# as a document: the methods named by label and fitted to each measured ceiling, the grid functions that compute one
# row per (method, budget, item), the long tables `protocol_table` reads, and the text of its findings.
#
# **Methods by label.** A run names its methods by label: `{"name": registry name (default: the label),
# "match_cost": a label whose scoring cost per key this method's cost knob is matched to (`sparsekv.costs.matched`),
# "budgets": its own measured ceilings, **its parameters}`, or `{"press": a kvpress press of `sparsekv.presses`,
# **its options}`. `MethodSpecs` turns a label into the factory, name and parameters that build it, fills in the
# run's prefill chunk sizes (selection methods: $B_{CP}$; eviction methods: the chunk they evict after), and holds
# the nominal budget fitted to each ceiling, so `build(label, ceiling)` gives the method a row runs.

# %%
#| export
class MethodSpecs:
    """The methods of a protocol run by label (`specs`: label -> `{"name", "match_cost", "budgets", **params}` or
    `{"press": name, **options}`), their run-wide `budgets` (measured ceilings) and prefill chunk sizes; `nominal`
    holds the fitted nominal budget of each (label, ceiling)."""

    def __init__(self, specs: Mapping, shape, budgets: list[int], chunk_size: int = 128, eviction_chunk: int = 128):
        if not isinstance(specs, Mapping) or not specs or not all(isinstance(s, Mapping) for s in specs.values()):
            raise TypeError(f"specs must be a non-empty dict of labels to dicts of parameters, got {specs!r}")
        if not isinstance(budgets, (list, tuple)) or not budgets:
            raise ValueError(f"budgets must be a non-empty list of measured ceilings, got {budgets!r}")
        self.specs, self.shape, self.budgets = dict(specs), ModelShape.of(shape), list(budgets)
        self.chunk_size, self.eviction_chunk = chunk_size, eviction_chunk
        self.nominal: dict[tuple[str, int], int] = {}

    def params(self, label: str) -> tuple:
        """The factory (`methods.make`, or `presses.make` for a press), name and parameters of the method `label`:
        the run's chunk sizes filled in, and with `match_cost: other` its cost knob set to cost per key what `other`
        costs."""
        if label not in self.specs: raise ValueError(f"label must be one of {list(self.specs)}, got {label!r}")
        spec = {k: v for k, v in self.specs[label].items() if k != "budgets"}
        if "press" in spec: return presses.make, spec.pop("press"), spec  # a press prefills densely in one call
        name, match = spec.pop("name", label), spec.pop("match_cost", None)
        family = methods.get(name).family
        # (a composition's parts take their own defaults: QuoKA's B_CP = 128)
        if family == "selection" and methods.get(name) is not methods.PrefillDecode:
            spec.setdefault("chunk_size", self.chunk_size)
        if family == "eviction": spec.setdefault("chunk_size", self.eviction_chunk)
        if match is not None:  # the per-key cost does not depend on the budget: match at any
            _, goal_name, goal_params = self.params(match)
            goal = methods.make(goal_name, self.budgets[0], **goal_params)
            spec[KNOBS[name]] = getattr(matched(name, goal, self.shape, self.budgets[0], **spec), KNOBS[name])
        return methods.make, name, spec

    @property
    def compressing(self) -> list[str]:
        "The labels of the methods that compress (every one but dense)."
        return [label for label in self.specs if self.setting(label) != "dense"]

    @property
    def reference(self) -> str:
        "The label of the dense method, the reference of every comparison."
        return next(label for label in self.specs if label not in self.compressing)

    @property
    def all_budgets(self) -> list[int]:
        "Every measured ceiling some compressing method runs at, ascending."
        return sorted({b for label in self.compressing for b in self.budgets_of(label)})

    @property
    def unavailable(self) -> set[str]:
        "The presses of the run when kvpress is not installed (it lives in the peer environment): read, never run."
        return {label for label in self.specs if self.is_press(label) and not presses.available()}


# %% [markdown]
# The check: on SmolLM2's shape, each label's parameters (the chunk sizes filled in by family, a cost-matched
# SparQ's rank against `matched` called directly) and the refusals.

# %%
SPECS = {"dense": {}, "streaming_llm": {}, "quoka": {"budgets": [8, 16]}, "sparq_matched": {"name": "sparq",
         "match_cost": "quoka"}, "quest": dict(pages), "quoka_then_oval": {"name": "prefill_decode"},
         "kvpop": {"name": "kvpop_mlp", "checkpoint": "smollm2-135m-cr75-mlp"}, "knorm": {"press": "knorm"}}
specs = MethodSpecs(SPECS, shape, budgets=[12], chunk_size=8, eviction_chunk=16)
test_eq(specs.params("quoka"), (methods.make, "quoka", {"chunk_size": 8}))
test_eq(specs.params("streaming_llm")[2], {"chunk_size": 16})
test_eq(specs.params("quoka_then_oval")[2], {})                                  # a composition's parts: their own
knob = KNOBS["sparq"]
test_eq(specs.params("sparq_matched")[2], {"chunk_size": 8, knob: getattr(matched(
    "sparq", methods.make("quoka", 12, chunk_size=8), shape, 12, chunk_size=8), knob)})
test_eq(specs.params("knorm"), (presses.make, "knorm", {}))
test_fail(lambda: specs.params("nope"), contains="label must be one of")
test_fail(lambda: MethodSpecs([], shape, [8]), contains="specs must be a non-empty dict")


# %%
#| export
@patch_to(MethodSpecs)
def is_press(self, label: str) -> bool:
    "Whether `label` is a kvpress press (`{\"press\": ...}`)."
    return self.params(label)[0] is presses.make

@patch_to(MethodSpecs)
def setting(self, label: str) -> str:
    "Where the method acts: evict while reading, prefill selection, decode retrieval, post-prefill compression, ..."
    make, name, params = self.params(label)
    if make is presses.make: return "post-prefill compression (kvpress)"
    if methods.get(name) is methods.PrefillDecode:
        m = make(name, self.budgets[0], **params)
        return f"{m.prefill.family} prefill + {m.decode.family} decode"
    return {"dense": "dense", "eviction": "evict while reading", "selection": "prefill selection",
            "retrieval": "decode retrieval"}[methods.get(name).family]


# %% [markdown]
# Where each method acts, read from its family (a composition: its two parts'), and which labels are presses.

# %%
test_eq([specs.setting(label) for label in SPECS],
        ["dense", "evict while reading", "prefill selection", "prefill selection", "decode retrieval",
         "selection prefill + retrieval decode", "evict while reading", "post-prefill compression (kvpress)"])
test_eq([label for label in SPECS if specs.is_press(label)], ["knorm"])


# %%
#| export
@patch_to(MethodSpecs)
def checkpoints(self, label: str) -> list[str]:
    "The trained scorers (`checkpoint`: a shipped name or a path) the method or a composition's parts load."
    params = self.params(label)[2]
    return [p["checkpoint"] for p in (params, params.get("prefill_params") or {}, params.get("decode_params") or {})
            if "checkpoint" in p]

@patch_to(MethodSpecs)
def weights_key(self, label: str) -> dict:
    """`{"scorers": "name@hash, ..."}` for a method that loads trained scorers (by content), else `{}`: a grid
    cell computed with other weights is computed again, not reused."""
    def content(checkpoint: str) -> str:
        shipped = Path(methods.__file__).parent / "checkpoints" / checkpoint / "trained.pt"
        return hashlib.sha256((shipped if shipped.is_file() else Path(checkpoint)).read_bytes()).hexdigest()[:12]
    names = self.checkpoints(label)
    return {"scorers": ", ".join(f"{c}@{content(c)}" for c in names)} if names else {}

@patch_to(MethodSpecs)
def budgets_of(self, label: str) -> list[int]:
    "The measured ceilings the method `label` runs at: its own `budgets`, else the run's."
    own = self.specs[label].get("budgets", self.budgets)
    if not own or not all(isinstance(b, int) and b > 0 for b in own):
        raise ValueError(f"method_specs[{label!r}]['budgets'] must be a list of positive ints, got {own!r}")
    return list(own)


# %% [markdown]
# The weights key hashes the shipped scorers' bytes; the ceilings are each method's own or the run's; the reference,
# the compressing labels and the presses kvpress is missing for follow from them.

# %%
shipped = Path(methods.__file__).parent / "checkpoints/smollm2-135m-cr75-mlp/trained.pt"
test_eq(specs.weights_key("kvpop"),
        {"scorers": f"smollm2-135m-cr75-mlp@{hashlib.sha256(shipped.read_bytes()).hexdigest()[:12]}"})
test_eq(specs.weights_key("quoka"), {})
test_eq((specs.reference, specs.compressing, specs.all_budgets), ("dense", list(SPECS)[1:], [8, 12, 16]))
test_eq(specs.unavailable, set() if presses.available() else {"knorm"})
test_fail(lambda: MethodSpecs({"dense": {}, "tova": {"budgets": [0]}}, shape, [8]).budgets_of("tova"),
          contains="must be a list of positive ints")


# %%
#| export
@patch_to(MethodSpecs)
def runs(self) -> list[tuple[str, int]]:
    "(label, ceiling) of every row kind: the reference once (ceiling 0), then each fitted method at each ceiling."
    return [(self.reference, 0)] + [(label, b) for b in self.all_budgets for label in self.compressing
                                    if (label, b) in self.nominal]

@patch_to(MethodSpecs)
def build(self, label: str, budget: int | None = None) -> Method:
    "The method `label` at its fitted nominal budget for the measured ceiling `budget` (dense: none)."
    make, name, params = self.params(label)
    if label not in self.compressing: return make(name, **params)
    if (label, budget) not in self.nominal:
        raise ValueError(f"budget: {label} has no fitted nominal budget for the ceiling {budget!r} (fitted: "
                         f"{sorted(b for lab, b in self.nominal if lab == label)})")
    return make(name, self.nominal[label, budget], **params)

@patch_to(MethodSpecs)
def costs(self, n_cached: int) -> dict:
    "(label, ceiling) -> `cost_columns` of every run at `n_cached` cached keys (NaN for presses: not counted)."
    uncounted = {"prefill_cost": math.nan, "decode_cost": math.nan}  # each press scores in its own way
    return {(label, b): uncounted if self.is_press(label) else cost_columns(self.build(label, b or None),
                                                                             self.shape, n_cached)
            for label, b in self.runs()}


# %% [markdown]
# The runs, builds and costs once budgets are fitted (`nominal`), and the refusal of a ceiling never fitted.

# %%
specs.nominal = {("quoka", 8): 6, ("quest", 12): 12}
test_eq(specs.runs(), [("dense", 0), ("quoka", 8), ("quest", 12)])
test_eq((specs.build("quoka", 8).budget, specs.build("dense").name), (6, "dense"))
test_eq(specs.costs(4096)[("quoka", 8)], cost_columns(methods.make("quoka", 6, chunk_size=8), shape, 4096))
test_fail(lambda: specs.build("quoka", 12), contains="no fitted nominal budget for the ceiling 12")


# %% [markdown]
# **Fitting on a probe.** What a method attends to is set by its structure (slots, chunks, pages, sinks), not by the
# weights, so the budgets are fitted on a random model with the real one's layers and heads (`probe_inputs`, a
# hundred times cheaper), on a window of random tokens whose last `probe_steps` are decoded; a method with trained
# scorers has the model's shapes and is fitted on the model itself. `fit_row` is one cell of the fits grid.

# %%
#| export
def probe_inputs(model, window: int, seed: int = 0) -> tuple:
    "A random tiny model with `model`'s layers and heads, and a window `[1, window]` of random token ids for it."
    cfg = model.config
    # (width: 16 per query head, the tiny model's head dim; transformers wants the width a multiple of the heads)
    probe_model = tiny_model("tiny-llama", num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                             num_kv_heads=cfg.num_key_value_heads, hidden_size=16 * cfg.num_attention_heads)[0]
    ids = torch.randint(3, probe_model.config.vocab_size, (1, check_int(window, "window", 2)),
                        generator=torch.Generator().manual_seed(seed))
    return probe_model, ids


# %%
probe_model, probe_ids = probe_inputs(model, 40)
pc, mc = probe_model.config, model.config
test_eq((pc.num_hidden_layers, pc.num_attention_heads, pc.num_key_value_heads, probe_ids.shape),
        (mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, (1, 40)))
test_eq(probe_ids, probe_inputs(model, 40)[1])
test_fail(lambda: probe_inputs(model, 1), contains="window must be")


# %%
#| export
def fit_row(specs: MethodSpecs, label: str, budget: int, model, probe_model, probe_ids: torch.Tensor,
            probe_steps: int) -> dict:
    """The fits grid's row of (`label`, measured ceiling `budget`): the fitted `nominal` budget and its measurement
    (`BUDGET_COLUMNS`) on the probe, or nominal 0 and the reason when no budget keeps to the ceiling."""
    make, name, params = specs.params(label)
    on = model if specs.checkpoints(label) else probe_model  # trained scorers have the model's shapes
    prefix = probe_ids.shape[1] - check_int(probe_steps, "probe_steps", 1)
    try: m, got = fit_budget(name, budget, lambda m: continuation(m, on, probe_ids, prefix)[0], make=make, **params)
    except ValueError as e: return {"nominal": 0, "not_applicable": str(e)}
    return {"nominal": m.budget, **{k: got[k] for k in BUDGET_COLUMNS}}


# %% [markdown]
# The check: the fitted Quest keeps within the ceiling on the probe and the next nominal budget does not; below its
# sink and recent tokens it is not applicable.

# %%
tiny_specs = MethodSpecs({"dense": {}, "quest": dict(pages)}, model, budgets=[16])
row = fit_row(tiny_specs, "quest", 16, model, probe_model, probe_ids, 8)
over = continuation(methods.make("quest", row["nominal"] + 1, **pages), probe_model, probe_ids, 32)[0]
assert row["decode_max"] <= 16 < over["decode_max"], (row, over["decode_max"])
test_eq(fit_row(tiny_specs, "quest", 7, model, probe_model, probe_ids, 8)["nominal"], 0)
row


# %% [markdown]
# **Grids that resume.** Every step stores its rows with `sparsekv.eval.run_grid`. `stored_or_run` runs a grid,
# except that the cells of `unavailable` methods (kvpress's presses outside the peer environment) are only read
# from the rows a run there stored.

# %%
#| export
def stored_or_run(cells: list[dict], fn: Callable[[dict], Mapping], path, desc: str, params: dict,
                  time_limit: float | None = None, unavailable=(), stage: str = "protocol") -> pd.DataFrame:
    """`run_grid` over `cells`, except that those of `unavailable` methods are only read: every stored row, in cell
    order (`stage` names the stage to rerun in the peer environment)."""
    if here := [c for c in cells if c["method"] not in unavailable]: run_grid(here, fn, path, desc, params, time_limit)
    rows = run_grid(cells, fn, path, desc, params, time_limit=0)
    if missing := sorted({c["method"] for c in cells} & set(unavailable) - set(rows.method)):
        print(f"not run here (kvpress is in the peer environment: `make peers`, then this stage with "
              f".venv-peers/bin/python -m sparsekv.reproduce --only {stage}): {', '.join(missing)}")
    return rows


# %%
with tempfile.TemporaryDirectory() as d:
    grid, calls = Path(d) / "g.csv", []
    fn = lambda c: calls.append(c["method"]) or {"x": len(c["method"])}  # noqa: E731
    cells_ab = [{"method": "a"}, {"method": "bb"}]
    test_eq(stored_or_run(cells_ab, fn, grid, "t", {"p": 1}, unavailable={"bb"}).method.tolist(), ["a"])
    test_eq(stored_or_run(cells_ab, fn, grid, "t", {"p": 1}).x.tolist(), [1, 2])         # computed where available
    test_eq(stored_or_run(cells_ab, fn, grid, "t", {"p": 1}, unavailable={"bb"}).x.tolist(), [1, 2])   # then read
    test_eq(calls, ["a", "bb"])


# %% [markdown]
# **Items and prose rows.** An accuracy cell's items are its seeds at each needle depth (`task_items`).
# `ProseRows` is the grid function of the prose windows: the windows run in batches of `batch` (a decode step reads
# the weights once for the batch), every method within a batch, so the dense logits of a batch are computed once;
# its `cells` go batch by batch in that order.

# %%
#| export
def task_items(label: str, spec: Mapping, tok, seeds: list[int], depths: list[float]) -> list[dict]:
    """The items of the accuracy cell `label`, each seed at each depth; `spec` holds `"length"` (tokens), optionally
    `"task"` (a make_task name, default: the label) and the task's options."""
    spec = dict(spec)
    if "length" not in spec: raise ValueError(f"cells[{label!r}] must give its length in tokens, got {spec!r}")
    name, length = spec.pop("task", label), spec.pop("length")
    return [{"cell": label, "seed": s, "depth": d, "item": make_task(name, tok, length, s, depth=d, **spec)}
            for s in seeds for d in depths]


# %%
its = task_items("pk", {"task": "passkey", "length": 200}, tok, [0, 1], [0.0, 0.5])
test_eq([(x["seed"], x["depth"]) for x in its], [(0, 0.0), (0, 0.5), (1, 0.0), (1, 0.5)])
test_eq(its[1]["item"], item)                                   # the passkey item of the checks above
test_fail(lambda: task_items("pk", {"task": "passkey"}, tok, [0], [0.0]), contains="must give its length")


# %%
#| export
class ProseRows:
    """The prose grid's function: `continuation` rows of the `windows` `[N, S]` under each method, `batch` windows at
    a time after `prefix` tokens, the dense logits of a batch computed once; `build(label, ceiling)` makes a method."""

    def __init__(self, model, windows: torch.Tensor, prefix: int, batch: int, build: Callable, device=None):
        self.model, self.windows, self.prefix, self.build = model, windows, _check_windows(windows, prefix), build
        self.batch, self.device = check_int(batch, "batch", 1), device
        self.done, self.dense = {}, {}

    def batch_of(self, w: int) -> range:
        "The windows of the batch holding window `w`."
        start = w - w % self.batch
        return range(start, min(start + self.batch, len(self.windows)))

    def cells(self, runs: list[tuple[str, int]], weights: Mapping) -> list[dict]:
        "The grid's cells, batch by batch, every run within a batch; `weights`: each label's `weights_key`."
        return [{"method": label, "budget": b, **weights[label], "window": w}
                for start in range(0, len(self.windows), self.batch) for label, b in runs for w in self.batch_of(start)]

    def __call__(self, cell: dict) -> dict:
        ws = self.batch_of(cell["window"])
        key = (cell["method"], cell["budget"], ws.start)
        if key not in self.done:
            ids = self.windows[list(ws)].to(self.device)
            if ws.start not in self.dense:
                self.dense.clear()  # one batch of dense logits at a time
                with torch.no_grad(): self.dense[ws.start] = self.model(input_ids=ids).logits[:, self.prefix - 1:-1]
            m = self.build(cell["method"], cell["budget"] or None)
            rows = continuation(m, self.model, ids, self.prefix, self.dense[ws.start])
            self.done[key] = {w: {"nominal": m.budget or 0, **r} for w, r in zip(ws, rows)}
        return self.done[key].pop(cell["window"])


# %% [markdown]
# The check: three windows in batches of two; the cells' order, and a row of the second batch equals
# `continuation` of that window alone.

# %%
tiny_specs.nominal = {("quest", 16): 12}
prose_rows = ProseRows(model, wins.repeat(2, 1)[:3], 32, 2, tiny_specs.build)
test_eq([(c["method"], c["window"]) for c in prose_rows.cells(tiny_specs.runs(), {"dense": {}, "quest": {}})],
        [("dense", 0), ("dense", 1), ("quest", 0), ("quest", 1), ("dense", 2), ("quest", 2)])
got = prose_rows({"method": "quest", "budget": 16, "window": 2})
alone = continuation(methods.make("quest", 12, **pages), model, wins[:1], 32)[0]
test_close([got[k] for k in ("agreement", "kl", "nll")], [alone[k] for k in ("agreement", "kl", "nll")], eps=1e-4)
test_eq((got["nominal"], got["decode_max"]), (12, alone["decode_max"]))
test_fail(lambda: ProseRows(model, wins, 32, 0, tiny_specs.build), contains="batch must be")


# %% [markdown]
# **Answer rows.** `AnswerRows` is the grid function of the retrieval items: `answer` under each method, the methods
# that prefill densely sharing one `dense_prefill` per item. Its `cells` go item by item, every method on each, seed
# by seed through every cell: a run stopped early still pairs every method on the items it finished.

# %%
#| export
class AnswerRows:
    """The answers grid's function: `answer` rows of the `items` (label -> `task_items`) under each method, one shared
    dense prefill per item for the methods that prefill densely; `build(label, ceiling)` makes a method."""

    def __init__(self, model, tok, items: Mapping, build: Callable, extra_tokens: int = 3, device=None):
        self.model, self.tok, self.build, self.device = model, tok, build, device
        self.extra_tokens = check_int(extra_tokens, "extra_tokens")
        self.items = [x for its in items.values() for x in its]
        self.by_hash, self.shared = {item_hash(x["item"]): x["item"] for x in self.items}, {}

    def cells(self, runs: list[tuple[str, int]], weights: Mapping) -> list[dict]:
        "The grid's cells: seed by seed (stable: cells, depths), every run on each item."
        by_seed = sorted(self.items, key=lambda x: x["seed"])
        return [{"method": label, "budget": b, **weights[label], "cell": x["cell"], "seed": x["seed"],
                 "depth": x["depth"], "item": item_hash(x["item"])} for x in by_seed for label, b in runs]

    def __call__(self, cell: dict) -> dict:
        m, item = self.build(cell["method"], cell["budget"] or None), self.by_hash[cell["item"]]
        if prefills_densely(m) and cell["item"] not in self.shared:
            self.shared.clear()
            self.shared[cell["item"]] = dense_prefill(self.model, prompt_ids(self.tok, item, self.device))
        prefilled = self.shared[cell["item"]] if prefills_densely(m) else None
        return {"nominal": m.budget or 0, **answer(m, self.model, self.tok, item, self.extra_tokens, prefilled)}


# %%
answer_rows = AnswerRows(model, tok, {"pk": its[:2]}, tiny_specs.build)
test_eq([(c["method"], c["depth"]) for c in answer_rows.cells(tiny_specs.runs(), {"dense": {}, "quest": {}})],
        [("dense", 0.0), ("quest", 0.0), ("dense", 0.5), ("quest", 0.5)])
got = answer_rows({"method": "quest", "budget": 16, "item": item_hash(item)})
test_eq({k: got[k] for k in ("nominal", "completion", "correct")},
        {"nominal": 12, **{k: v for k, v in answer(methods.make("quest", 12, **pages), model, tok, item).items()
                           if k in ("completion", "correct")}})
test_eq(list(answer_rows.shared), [item_hash(item)])             # quest's prefill is dense: shared


# %% [markdown]
# **A partial run.** With a time limit, the answers grid stops with cells pending; `finished_answers` keeps, at each
# ceiling, the items dense and every method at that ceiling finished (dense's rows where any ceiling kept the item).

# %%
#| export
def finished_answers(answers: pd.DataFrame, runs: list[tuple[str, int]], budgets: list[int]) -> tuple:
    """The rows of `answers` on items finished by dense and every run at their ceiling (None if none), and a note
    of how many items each ceiling kept."""
    n_runs = pd.Series([b for _, b in runs]).value_counts()
    n_done = answers.groupby(["budget", "item"]).size()
    done = {(b, i) for (b, i), n in n_done.items() if n == n_runs[b]}
    finished = {b: {i for b2, i in done if b2 == b and (0, i) in done} for b in budgets}
    kept = [(b, i) in done and (0, i) in done if b else any(i in f for f in finished.values())
            for b, i in zip(answers.budget, answers["item"])]
    return answers[kept] if any(kept) else None, ", ".join(f"{len(f)} at {b}" for b, f in finished.items())


# %%
part = pd.DataFrame({"method": ["dense", "a", "b", "dense", "a", "dense"], "budget": [0, 8, 8, 0, 8, 0],
                     "item": ["x", "x", "x", "y", "y", "z"]})
kept, note = finished_answers(part, [("dense", 0), ("a", 8), ("b", 8)], [8])
test_eq((kept.item.tolist(), note), (["x", "x", "x"], "1 at 8"))     # y lacks b, z every compressing method
test_eq(finished_answers(part[part.item == "z"], [("dense", 0), ("a", 8)], [8])[0], None)


# %% [markdown]
# ## The protocol's tables
#
# `long_table` turns a grid's rows into the long table `compare` reads: dense without a budget, one item id from the
# item's key columns, and each row's scoring costs (`MethodSpecs.costs`). `measured_ceilings` gives, per method and
# ceiling, what its decode queries attended to on the real items, and `show_table` a `protocol_table` as text.

# %%
#| export
def long_table(rows: pd.DataFrame, item_cols: list[str], reference: str, costs: Mapping) -> pd.DataFrame:
    """A grid's rows as `compare` reads them: the `reference` without a budget, one `item` id joining `item_cols`,
    each row's `prefill_cost` and `decode_cost` from `costs` ((label, ceiling) -> `cost_columns`)."""
    out = rows.assign(budget=rows.budget.astype(int).astype(object).where(rows.method != reference),
                      item=rows[item_cols].astype(str).agg("/".join, axis=1))
    for col in ("prefill_cost", "decode_cost"):
        out[col] = [costs[label, int(b) if b == b and b is not None else 0][col]
                    for label, b in zip(out.method, out.budget)]
    return out


# %%
grid_rows = pd.DataFrame({"method": ["dense", "a"], "budget": [0, 8], "cell": ["c", "c"], "seed": [0, 0]})
lt = long_table(grid_rows, ["cell", "seed"], "dense", {("dense", 0): {"prefill_cost": 0, "decode_cost": 0},
                                                      ("a", 8): {"prefill_cost": 5, "decode_cost": 7}})
test_eq((lt.budget.isna().tolist(), lt.item.tolist(), lt.decode_cost.tolist()), ([True, False], ["c/0", "c/0"], [0, 7]))


# %%
#| export
def measured_ceilings(tables: list, reference: str) -> pd.DataFrame:
    """Per method and ceiling of the long `tables` (None skipped; not the `reference`): the nominal budget, the most
    and the mean entries a decode query attended to in the compressed layers, dense layers, mean entries read."""
    measured = pd.concat([t for t in tables if t is not None]).query("method != @reference")
    return measured.groupby(["method", "budget"], sort=False).agg(
        nominal=("nominal", "first"), decode_max=("decode_max", "max"), decode_mean=("decode_mean", "mean"),
        dense_layers=("dense_layers", "max"), decode_reads=("decode_reads", "mean")).reset_index()


# %%
meas = pd.DataFrame({"method": ["dense", "a", "a", "a"], "budget": [None, 8, 8, 8], "nominal": [0, 6, 6, 6],
                     "decode_max": [40, 7, 8, 6], "decode_mean": [20.0, 5.0, 6.0, 4.0], "dense_layers": [0, 1, 1, 1],
                     "decode_reads": [20.0, 9.0, 9.0, 12.0]})
test_eq(measured_ceilings([meas[:2], None, meas[2:]], "dense").iloc[0].tolist(), ["a", 8, 6, 8, 5.0, 1, 10.0])


# %%
#| export
def show_table(table: pd.DataFrame, reference: str, setting: Callable[[str], str], digits: int = 3) -> pd.DataFrame:
    """A `protocol_table` as text: setting, mean ± se, the paired differences (`*`: the 95% interval excludes 0),
    measured budgets and scoring costs."""
    recs = table.to_dict("records")
    out = pd.DataFrame({"method": table.method, "setting": table.method.map(setting),
                        "budget": table.budget.where(table.method != reference, "-")})
    for key, head in (("mean", "mean ± se"), ("ref", "vs dense"), ("base", "vs the best other")):
        out[head] = [compare_cell(r, key, digits) for r in recs]
    out["decode mean / max"] = [f"{a:.0f} / {b:.0f}" for a, b in zip(table.decode_mean, table.decode_max)]
    out["dense layers"] = table.dense_layers.astype(int)
    out["prefill max"] = table.prefill_max.round(0).astype(int)
    out["scoring MACs per key (prefill, decode)"] = [f"{p:,.0f}, {d:,.0f}" if p == p else "not counted" for p, d in
                                                     zip(table.prefill_cost, table.decode_cost)]
    return out


# %%
shown = show_table(table.assign(dense_layers=0), "dense", {"dense": "dense", "a": "x", "b": "y"}.get)
test_eq((shown.budget.tolist(), shown.setting.tolist()), (["-", 8, 8], ["dense", "x", "y"]))
test_eq(shown["mean ± se"][1], f"{table['mean'][1]:.3f} ± {table.se[1]:.3f}")
test_eq(shown["scoring MACs per key (prefill, decode)"].tolist(), ["0, 0", "0, 0", "0, 64"])
shown


# %% [markdown]
# ## Fronts: quality against cost
#
# A point is on a Pareto front when no other point has at least its quality at no more cost, better in one of the
# two; a point without a measurement is on no front. `usage_table` puts each method's memory and time on the prose
# (`memory_columns`, the batch's prefill seconds and decode milliseconds) beside its agreement, with its fronts;
# `cost_points` and `cost_front` do the same for the scoring cost of an accuracy table, ceiling by ceiling.

# %%
#| export
def pareto_front(cost, quality) -> np.ndarray:
    "Boolean per point: no other point has quality >= its own at cost <= its own, one of them strictly."
    c, q = np.asarray(cost, float), np.asarray(quality, float)
    dominated = (c[None] <= c[:, None]) & (q[None] >= q[:, None]) & ((c[None] < c[:, None]) | (q[None] > q[:, None]))
    return ~dominated.any(1) & np.isfinite(c) & np.isfinite(q)  # a point without a measurement is on no front


# %%
_c, _q = np.random.default_rng(0).integers(0, 5, (2, 40))  # ties included
test_eq(pareto_front(_c, _q).tolist(), [not any(_c[j] <= _c[i] and _q[j] >= _q[i] and (_c[j] < _c[i] or _q[j] > _q[i])
                                                for j in range(40)) for i in range(40)])
test_eq(pareto_front([1, np.nan, 3], [1, 5, 2]).tolist(), [True, False, True])


# %%
#| export
def usage_table(txt: pd.DataFrame, agreement: pd.DataFrame, reference: str, setting: Callable[[str], str],
                axes: Mapping) -> pd.DataFrame:
    """Per method and ceiling of the prose rows `txt`: KV entries and MiB per sequence (peak, while decoding), median
    prefill s and decode ms, the agreement's mean and se, and `front_<col>` for each cost column of `axes`."""
    by_row = ["method", "budget"]
    usage = txt.assign(budget=txt.budget.fillna("-")).groupby(by_row, sort=False).agg(
        kv_peak=("kv_peak", "max"), kv_decode=("kv_decode", "max"), kv_mib_peak=("kv_bytes_peak", "max"),
        kv_mib_decode=("kv_bytes_decode", "max"), prefill_s=("prefill_s", "median"), decode_ms=("decode_ms", "median"))
    usage[["kv_mib_peak", "kv_mib_decode"]] /= 2 ** 20
    agree = agreement.assign(budget=agreement.budget.where(agreement.method != reference, "-"))
    agree = agree.drop_duplicates(by_row).set_index(by_row)[["mean", "se"]]  # (dense repeats once per budget)
    usage = usage.join(agree).reset_index()
    usage.insert(2, "setting", usage.method.map(setting))
    for col in axes: usage[f"front_{col}"] = pareto_front(usage[col], usage["mean"])
    return usage


# %%
txt_rows = pd.DataFrame({"method": ["dense", "a", "b"], "budget": [None, 8, 8], "kv_peak": [40, 8, 12],
                         "kv_decode": [40, 8, 12], "kv_bytes_peak": [4 * 2 ** 20, 2 ** 20, 2 ** 19],
                         "kv_bytes_decode": [4 * 2 ** 20, 2 ** 20, 2 ** 19], "prefill_s": [1.0, 2.0, 3.0],
                         "decode_ms": [5.0, 4.0, 3.0]})
agreement = pd.DataFrame({"method": ["dense", "a", "b"], "budget": [8, 8, 8], "mean": [1.0, 0.9, 0.95],
                          "se": [0.0, 0.01, 0.01]})
use = usage_table(txt_rows, agreement, "dense", str.upper, {"kv_mib_peak": "MiB", "prefill_s": "s"})
test_eq((use.budget.tolist(), use.setting.tolist(), use.kv_mib_peak.tolist()), (["-", 8, 8], ["DENSE", "A", "B"],
                                                                               [4.0, 1.0, 0.5]))
test_eq((use.front_kv_mib_peak.tolist(), use.front_prefill_s.tolist()), ([True, False, True], [True, False, False]))


# %%
#| export
def cost_points(t: pd.DataFrame, reference: str, setting: Callable[[str], str]) -> pd.DataFrame:
    "The compressing rows of one accuracy `protocol_table` whose scoring costs are counted, with each row's setting."
    t = t[(t.method != reference) & t.prefill_cost.notna() & t.decode_cost.notna()]
    return t.assign(setting=t.method.map(setting))[["method", "budget", "setting", "mean", "se", "prefill_cost",
                                                    "decode_cost"]]


# %%
pts = cost_points(table, "dense", str.upper)
test_eq((pts.method.tolist(), pts.setting.tolist(), list(pts.columns[-2:])), (["a", "b"], ["A", "B"],
                                                                              ["prefill_cost", "decode_cost"]))


# %%
#| export
def cost_front(pts: pd.DataFrame, col: str) -> pd.DataFrame:
    "The rows of `pts` on the accuracy front by the cost in column `col`, ceiling by ceiling, cheapest first."
    per_budget = [at[pareto_front(at[col], at["mean"])] for _, at in pts.groupby("budget")]
    return pd.concat([pts.iloc[:0], *per_budget]).sort_values(["budget", col])


# %%
test_eq(cost_front(pts, "decode_cost").method.tolist(), ["a", "b"])   # b: more accurate at a higher cost
test_eq(cost_front(pts.assign(decode_cost=[64.0, 0.0]), "decode_cost").method.tolist(), ["b"])


# %% [markdown]
# ## The findings as text
#
# Each line of the protocol's summary is computed from its grids here, so no measured number is written by hand.
# `pair_lines`: the paired difference of each `[method, other]` pair on every table's items both finished;
# `composition_lines`: each composition against its parts; `findings`: per table, who is behind dense, who leads,
# and the largest standard error with the items that would bring it to a target. A standard error falls as
# $1/\sqrt{n}$, so it takes $n\,(\mathrm{se}/\mathrm{target})^2$ items (`items_for_se`).

# %%
#| export
def items_for_se(se: float, n: int, target: float) -> int:
    "Items that bring a standard error `se` measured on `n` items down to `target` (se falls as 1/sqrt(n))."
    if not target > 0: raise ValueError(f"target must be a standard error > 0, got {target!r}")
    return math.ceil(n * (se / target) ** 2)


# %%
test_eq((items_for_se(0.05, 100, 0.01), items_for_se(0.005, 40, 0.01)), (2500, 10))
_hits = np.r_[np.ones(28), np.zeros(27)]  # an accuracy of about 1/2 on 55 items: about 0.25 / 0.01**2 items
assert abs(items_for_se(_hits.std(ddof=1) / np.sqrt(55), 55, 0.01) / 2500 - 1) < 0.02
test_fail(lambda: items_for_se(0.05, 100, 0), contains="target must be")


# %%
#| export
def largest_se(t: pd.DataFrame, target_se: float) -> str:
    "The table's largest standard error, its method, and the items a standard error of `target_se` would take."
    r = t.loc[t.se.idxmax()]
    if not r.se > 0: return "largest standard error 0.000"
    return (f"largest standard error {r.se:.3f} ({r.method} @ {r.budget}; {target_se} would take about "
            f"{items_for_se(r.se, int(r.n), target_se):,} items)")


# %%
test_eq(largest_se(table, 0.01), f"largest standard error {table.se.max():.3f} (a @ {table.budget[1]}; 0.01 would "
        f"take about {math.ceil(12 * (table.se.max() / 0.01) ** 2):,} items)")


# %%
#| export
def findings(tables: Mapping, reference: str, min_items: int, target_se: float) -> list[str]:
    """One bullet per `protocol_table` of `tables` (name -> table): who is behind `reference` (intervals excluding 0),
    who leads every other method, the largest standard error; no claim on fewer than `min_items` items."""
    out = []
    for name, t in tables.items():
        better = "higher" if t.attrs["higher_is_better"] else "lower"
        rows = t[t.method != reference]
        behind = rows[rows.ref_sig & ((rows.diff_ref < 0) == t.attrs["higher_is_better"])]
        lead = rows[rows.base_sig & ((rows.diff_base > 0) == t.attrs["higher_is_better"])]
        if t.n.iloc[0] < min_items:
            out.append(f"- **{name}**: n = {int(t.n.iloc[0])} < {min_items} items, no difference claimed; "
                       f"{largest_se(t, target_se)}.")
            continue
        out.append(f"- **{name}** ({better} is better, n = {int(t.n.iloc[0])}): behind dense: "
                   + (", ".join(f"{r.method} @ {r.budget} ({r.diff_ref:+.3f})" for r in behind.itertuples()) or "none")
                   + "; ahead of every other method: "
                   + (", ".join(f"{r.method} @ {r.budget} ({r.diff_base:+.3f} vs {r.baseline})"
                                for r in lead.itertuples()) or "none")
                   + f"; {largest_se(t, target_se)}.")
    return out


# %%
few = findings({"acc": table}, "dense", 16, 0.01)
test_eq(few, [f"- **acc**: n = 12 < 16 items, no difference claimed; {largest_se(table, 0.01)}."])
many = findings({"acc": protocol_table(rows, "correct", min_items=12)}, "dense", 12, 0.01)[0]
behind = protocol_table(rows, "correct", min_items=12).query("method != 'dense' and ref_sig").method.tolist()
assert many.startswith("- **acc** (higher is better, n = 12): behind dense: ") and all(f"{m} @ 8" in many
                                                                                         for m in behind), many
many


# %%
#| export
def pair_lines(pairs: list, sources: Mapping, runs_at: Callable[[str, int], bool], budgets: list[int],
               min_items: int) -> list[str]:
    """One bullet per `[method, other]` pair and ceiling both ran at (`runs_at`): the method minus the other on the
    items of each source (name -> (rows, metric)) both finished, with its paired 95% interval (`*`: excludes 0, on at
    least `min_items`)."""
    out = []
    for this, other in pairs:
        for b in (b for b in budgets if runs_at(this, b) and runs_at(other, b)):
            parts = []
            for name, (rows, metric) in sources.items():
                pair = rows[(rows.method == this) & (rows.budget == b)][["item", metric]].merge(
                    rows[(rows.method == other) & (rows.budget == b)][["item", metric]], on="item",
                    suffixes=("", "_other"))
                if len(pair) < 2: continue
                d, lo, hi = paired_ci(pair[metric].to_numpy(), pair[f"{metric}_other"].to_numpy())
                claim = len(pair) >= min_items and (lo > 0 or hi < 0)  # as the tables: no claim on few items
                parts.append(f"{name} {d:+.3f} [{lo:+.3f}, {hi:+.3f}]{'*' if claim else ''} (n = {len(pair)})")
            out.append(f"- **{this} vs {other} @ {b}**: " + ("; ".join(parts) or "no item finished by both") + ".")
    return out


# %%
d, lo, hi = paired_ci(rows[rows.method == "a"].correct.to_numpy(), rows[rows.method == "b"].correct.to_numpy())
got = pair_lines([["a", "b"], ["a", "c"]], {"acc": (rows, "correct")}, lambda m, b: m in "ab", [8], 16)
test_eq(got, [f"- **a vs b @ 8**: acc {d:+.3f} [{lo:+.3f}, {hi:+.3f}] (n = 12)."])


# %%
#| export
def composition_lines(specs: MethodSpecs, txt: pd.DataFrame, usage: pd.DataFrame, axes: Mapping) -> list[str]:
    """One bullet per composition of `specs` and ceiling: its prose agreement (`txt`) against each part run alone
    (paired 95% interval), the memory of each (`usage`), and the fronts of `axes` it is on."""
    def memory(u) -> str:  # prose rows from before memory was measured have none
        if not np.isfinite(u.kv_mib_peak): return "memory not recorded"
        return f"{u.kv_mib_peak:.2f} MiB peak / {u.kv_mib_decode:.2f} MiB decoding"

    def same_method(label: str, part, b) -> bool:  # the same class and trained checkpoint
        if (label, b) not in specs.nominal or specs.is_press(label): return False
        m = specs.build(label, b)
        return type(m) is type(part) and getattr(m, "checkpoint", None) == getattr(part, "checkpoint", None)

    out, rows = [], txt.assign(budget=txt.budget.fillna("-"))
    for label in specs.compressing:
        make, name, params = specs.params(label)
        if make is presses.make or methods.get(name) is not methods.PrefillDecode: continue
        for b in (b for b in specs.all_budgets if (label, b) in specs.nominal):
            m, me = specs.build(label, b), usage[(usage.method == label) & (usage.budget == b)].iloc[0]
            a = rows[(rows.method == label) & (rows.budget == b)].sort_values("window")
            parts = []
            for role in ("prefill", "decode"):
                other = next((x for x in specs.compressing if x != label and same_method(x, getattr(m, role), b)),
                             None)
                if other is None: continue
                o = rows[(rows.method == other) & (rows.budget == b)].sort_values("window")
                d, lo, hi = paired_ci(a.agreement.to_numpy(), o.agreement.to_numpy())
                ou = usage[(usage.method == other) & (usage.budget == b)].iloc[0]
                parts.append(f"vs {other} ({role}) {d:+.3f} [{lo:+.3f}, {hi:+.3f}]{'*' if lo > 0 or hi < 0 else ''} "
                             f"at {memory(ou)}")
            fronts = [axes[c] for c in axes if me[f"front_{c}"]]
            out.append(f"- **{label} @ {b}** ({memory(me)}): " + ("; ".join(parts) or "no part in the table")
                       + "; on the front of: " + (", ".join(fronts) or "none") + ".")
    return out


# %% [markdown]
# The check: QuoKA then OVAL beside QuoKA alone; its prefill part is found, its decode part (OVAL) is not in the run.

# %%
comp = MethodSpecs({"dense": {}, "quoka": {}, "quoka_then_oval": {"name": "prefill_decode"}}, shape, [8])
comp.nominal = {("quoka", 8): 8, ("quoka_then_oval", 8): 8}
ag = {"quoka": [1, 1, 0, 1], "quoka_then_oval": [1, 0, 0, 1]}
comp_txt = pd.DataFrame([{"method": m, "budget": 8, "window": w, "agreement": float(x)}
                         for m, xs in ag.items() for w, x in enumerate(xs)])
comp_use = pd.DataFrame({"method": list(ag), "budget": [8, 8], "kv_mib_peak": [2.0, np.nan],
                         "kv_mib_decode": [1.0, np.nan], "front_prefill_s": [True, False]})
d, lo, hi = paired_ci(np.array(ag["quoka_then_oval"], float), np.array(ag["quoka"], float))
test_eq(composition_lines(comp, comp_txt, comp_use, {"prefill_s": "prefill seconds"}),
        [f"- **quoka_then_oval @ 8** (memory not recorded): vs quoka (prefill) {d:+.3f} [{lo:+.3f}, {hi:+.3f}] at "
         "2.00 MiB peak / 1.00 MiB decoding; on the front of: none."])


# %% [markdown]
# ## The protocol's figure
#
# `plot_protocol_table` draws one `protocol_table`: the methods along x, each one's mean with a 95% error bar
# (±1.96 standard errors) per measured ceiling, and the reference as a dashed line.

# %%
#| export
def plot_protocol_table(t: pd.DataFrame, ax, reference: str) -> None:
    "One protocol table on `ax`: methods along x, a marker and error bar per ceiling, the reference as a dashed line."
    rows = t[t.method != reference]
    labels, bs = list(dict.fromkeys(rows.method)), sorted(rows.budget.unique())
    for j, b in enumerate(bs):
        r = rows[rows.budget == b].set_index("method").reindex(labels)  # NaN where a method does not apply
        x = np.arange(len(labels)) + (j - (len(bs) - 1) / 2) * 0.8 / len(bs)
        ax.errorbar(x, r["mean"], yerr=1.96 * r.se, fmt="o", capsize=3, label=f"budget {b}")
    ax.axhline(float(t.loc[t.method == reference, "mean"].iloc[0]), color="k", ls="--", lw=1, label=reference)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set(ylabel=t.attrs["metric"])
    ax.legend(fontsize=7)


# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots()
plot_protocol_table(table, ax, "dense")
test_eq([x.get_text() for x in ax.get_xticklabels()], ["a", "b"])
test_eq((len(ax.containers), ax.lines[-1].get_ydata()[0]), (1, 1.0))  # one ceiling; dense's mean, dashed
plt.close(fig)


# %% [markdown]
# ## Calibration: dense answers with shared prefixes
#
# The calibration stage (`reproduce/02_calibration.ipynb`) asks the dense model every item of every retrieval task
# at each context length, to find the cells it solves. Items of one seed share their haystack, so they share the
# prompt up to their needle. `CalibrationCells` names the items (each seed at each needle depth, deepest first, a
# task's phrasings cycled over them); `PrefixReuse` prefills each prompt reusing the previous prompt's KV cache up to
# their longest common prefix (`common_prefix`), so an item at depth $d$ prefills about $(1 - d)L$ tokens instead of
# $L$; its `greedy` is the stage's one answer loop, and `calibration_answer` scores its completion.

# %%
#| export
class CalibrationCells:
    """The items of a calibration run: each task of `tasks` at `lengths`, each seed of `seeds` at each needle depth of
    `depths`; `tasks` maps a label to its spec: `"task"` (a make_task name, default: the label), `"lengths"`,
    `"seeds"`, `"phrasing"` and the task's options."""

    PHRASINGS = {"passkey": len(PASSKEY_PHRASINGS)}  # tasks asked in several phrasings, and how many

    def __init__(self, tasks: Mapping, tok, lengths: list[int], seeds: list[int], depths: list[float]):
        if not isinstance(tasks, Mapping) or not tasks:
            raise TypeError(f"tasks must be a non-empty dict of labels to dicts of options, got {tasks!r}")
        self.tasks, self.tok, self.lengths, self.seeds, self.depths = dict(tasks), tok, lengths, seeds, depths
        self._items = {}

    def task_name(self, label: str) -> str:
        "The `make_task` name of the task labelled `label` (one with a needle depth)."
        name = self.tasks[label].get("task", label)
        if name not in SYNTHETIC_TASKS:
            raise ValueError(f"tasks[{label!r}]: task must be one of {tuple(SYNTHETIC_TASKS)}")
        if "depth" not in inspect.signature(SYNTHETIC_TASKS[name]).parameters:
            raise ValueError(f"tasks[{label!r}]: {name} has no needle depth; calibrated tasks need one")
        return name

    def lengths_of(self, label: str) -> list[int]:
        "The context lengths the task labelled `label` is measured at."
        return self.tasks[label].get("lengths", self.lengths)

    def item(self, cell: dict) -> dict:
        "The `make_task` item of one cell (made once)."
        key = (cell["task"], cell["length"], cell["seed"], cell["depth"], cell["phrasing"])
        if key not in self._items:
            options = {k: v for k, v in self.tasks[cell["task"]].items() if k not in ("task", "lengths", "seeds")}
            if cell["phrasing"] is not None: options["phrasing"] = cell["phrasing"]
            self._items[key] = make_task(self.task_name(cell["task"]), self.tok, cell["length"], cell["seed"],
                                         depth=cell["depth"], **options)
        return self._items[key]

    def cells(self, label: str, length: int) -> list[dict]:
        "The items of one (task, length): each seed at each depth (deepest first), phrasings cycled, keyed by hash."
        n_phr = None if "phrasing" in self.tasks[label] else self.PHRASINGS.get(self.task_name(label))
        cells = [{"task": label, "length": length, "seed": s, "depth": d,
                  "phrasing": None if n_phr is None else (i * len(self.depths) + j) % n_phr}
                 for i, s in enumerate(self.tasks[label].get("seeds", self.seeds))
                 for j, d in sorted(enumerate(self.depths), key=lambda jd: -jd[1])]
        # a hash of each item's text in its row's key: a changed task generator or option never reuses old rows
        return [{**c, "item": item_hash(self.item(c))} for c in cells]

    def all(self) -> list[dict]:
        "Every cell: task by task, length by length."
        return [c for label in self.tasks for L in self.lengths_of(label) for c in self.cells(label, L)]


# %% [markdown]
# The check: two seeds at three depths of the passkey cycle the phrasings item by item (deepest first), each cell's
# item is `make_task`'s, and a task without a needle depth is refused.

# %%
cal = CalibrationCells({"passkey": {}, "kv": {"task": "kv_retrieval", "lengths": [600]}}, tok, [300], [0, 1],
                       [0.0, 0.5, 1.0])
got = cal.cells("passkey", 300)
n_phr = len(PASSKEY_PHRASINGS)
test_eq([(c["seed"], c["depth"], c["phrasing"]) for c in got],
        [(s, d, (i * 3 + j) % n_phr) for i, s in enumerate([0, 1]) for j, d in ((2, 1.0), (1, 0.5), (0, 0.0))])
test_eq(cal.item(got[1]), make_task("passkey", tok, 300, 0, depth=0.5, phrasing=got[1]["phrasing"]))
test_eq(got[1]["item"], item_hash(cal.item(got[1])))
test_eq([(c["task"], c["length"], c["phrasing"]) for c in cal.all()][-1], ("kv", 600, None))
test_fail(lambda: CalibrationCells({"vt": {"task": "variable_tracking"}}, tok, [300], [0], [0.0]).cells("vt", 300),
          contains="has no needle depth")


# %%
#| export
def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    "Length of the longest common prefix of two 1-D token tensors."
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


# %%
pairs_ab = [([1, 2, 3], [1, 2, 4]), ([1, 2], [1, 2, 3]), ([5], [1]), ([], [1])]
test_eq([common_prefix(torch.tensor(a, dtype=torch.long), torch.tensor(b)) for a, b in pairs_ab], [2, 2, 0, 0])


# %%
#| export
class PrefixReuse:
    """Dense prefills of `model` that reuse the KV cache of the previous prompt up to their longest common prefix, and
    the greedy answer loop that decodes from them."""

    def __init__(self, model, device=None):
        self.model, self.device = model, device
        self.ids, self.cache = torch.zeros(0, dtype=torch.long, device=device), None

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        "Logits of the last position of `ids` [L] and the number of prompt tokens whose keys and values were reused."
        if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or not len(ids):
            raise ValueError(f"ids must be a non-empty 1-D tensor of token ids, got {getattr(ids, 'shape', ids)!r}")
        n = min(common_prefix(self.ids, ids), len(ids) - 1)  # at least one token to compute the logits from
        if n: self.cache.crop(n - self.cache.get_seq_length())  # drops the rest of the previous prompt and its answer
        out = self.model(input_ids=ids[None, n:], past_key_values=self.cache if n else None, use_cache=True,
                         logits_to_keep=1)
        self.ids, self.cache = ids, out.past_key_values
        return out.logits[0, -1], n

    @torch.inference_mode()
    def greedy(self, tok, ids: torch.Tensor, n_new: int) -> tuple[str, int]:
        "Greedy completion of `n_new` tokens (or up to EOS) after `ids` [L], as text, and the prompt tokens reused."
        n_new = check_int(n_new, "n_new", 1)
        logits, reused = self.prefill(ids)
        out = [int(logits.argmax())]
        while len(out) < n_new and out[-1] != tok.eos_token_id:
            step = torch.tensor([[out[-1]]], device=self.device)
            out.append(int(self.model(input_ids=step, past_key_values=self.cache, use_cache=True).logits[0, -1]
                           .argmax()))
        return tok.decode(out, skip_special_tokens=True), reused


# %% [markdown]
# The checks: for two passkey items of one seed, the second item's logits after reusing the first item's cache match
# those of a fresh prefill, and the reuse covered their common prefix; a greedy answer after a reuse is the one
# `generate` gives from scratch.

# %%
reuse = PrefixReuse(model)
with torch.inference_mode():
    a, b = (prompt_ids(tok, make_task("passkey", tok, 600, 0, depth=d))[0] for d in (1.0, 0.5))
    reuse.prefill(a)
    shared_logits, reused = reuse.prefill(b)
    fresh_logits = model(input_ids=b[None], logits_to_keep=1).logits[0, -1]
torch.testing.assert_close(shared_logits, fresh_logits, atol=2e-3, rtol=1e-4)
assert reused == common_prefix(a, b) > 0
text, n = reuse.greedy(tok, a, 5)
want = model.generate(a[None], max_new_tokens=5, do_sample=False, pad_token_id=0)[0, len(a):]
test_eq((text, n), (tok.decode(want, skip_special_tokens=True), common_prefix(a, b)))
test_fail(lambda: reuse.prefill(a[None]), contains="ids must be a non-empty 1-D tensor")
print(f"reused {reused} of {len(b)} prompt tokens; max |logit difference| "
      f"{(shared_logits - fresh_logits).abs().max().item():.2e}")


# %%
#| export
def other_numbers(item: dict) -> list[str]:
    "The numbers of the prompt other than the answer (the distractors of the multi-needle and key-value tasks)."
    return sorted(set(re.findall(r"\d+", item["prompt"])) - {item["answer"]})


# %%
kv_item = make_task("kv_retrieval", tok, 600, 0, depth=0.5)
test_eq(other_numbers({"prompt": "a 12 b 7 c 12 d 30", "answer": "7"}), ["12", "30"])
assert kv_item["answer"] not in other_numbers(kv_item) and other_numbers(kv_item)


# %%
#| export
def calibration_answer(reuse: PrefixReuse, tok, item: dict, extra_tokens: int = 3, device=None) -> dict:
    """The greedy answer of dense `reuse.model` to one item: correct (0/1), whether a wrong answer names a distractor,
    the answer's words found, the prompt tokens reused, the item's context tokens and the completion."""
    n_new = count_tokens(tok, " " + item["answer"]) + check_int(extra_tokens, "extra_tokens")
    text, reused = reuse.greedy(tok, prompt_ids(tok, item, device)[0], n_new)
    correct = int(score_exact(text, item["answer"]) == 1.0)
    distractor = int(not correct and any(score_exact(text, x) == 1.0 for x in other_numbers(item)))
    return {"correct": correct, "distractor": distractor, "words_found": score_exact(text, item["answer"].split()),
            "reused_tokens": reused, "context_tokens": item["context_tokens"], "completion": text.replace("\n", "\\n")}


# %%
row = calibration_answer(PrefixReuse(model), tok, item, extra_tokens=2)
n_new = count_tokens(tok, " " + item["answer"]) + 2
new_ids = model.generate(item_ids, max_new_tokens=n_new, do_sample=False, pad_token_id=0)[0, item_ids.shape[1]:]
want = tok.decode(new_ids, skip_special_tokens=True)
test_eq(row, {"correct": int(score_exact(want, item["answer"]) == 1.0), "distractor": 0,
              "words_found": score_exact(want, item["answer"].split()), "reused_tokens": 0,
              "context_tokens": item["context_tokens"], "completion": want.replace("\n", "\\n")})


# %% [markdown]
# **Accuracy per cell.** Per (task, length): the accuracy $\hat p$ over its $n$ items, the binomial standard error
# $\sqrt{\hat p(1-\hat p)/n}$ and the 95% Wilson score interval, the set of $p$ with
# $|\hat p - p| \le z\sqrt{p(1-p)/n}$, $z = 1.96$, which (unlike $\hat p \pm z\,\mathrm{SE}$) stays inside $[0, 1]$
# and does not collapse to a point at $\hat p = 1$. The check of `wilson` scans a fine grid of $p$: the points that
# satisfy the inequality span the interval.

# %%
#| export
def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    "The Wilson score interval of a binomial proportion with k successes in n trials."
    n = check_int(n, "n", 1)
    if not 0 <= k <= n: raise ValueError(f"k must be a count of successes in [0, n={n}], got {k!r}")
    z = NormalDist().inv_cdf((1 + level) / 2)
    p, z2 = k / n, z * z / n
    centre, half = (p + z2 / 2) / (1 + z2), z / (1 + z2) * np.sqrt(p * (1 - p) / n + z2 / (4 * n))
    return max(0.0, centre - half), min(1.0, centre + half)


# %%
grid_p = np.linspace(0, 1, 200_001)
for k, n in [(0, 5), (3, 10), (47, 50), (50, 50), (120, 400)]:
    z = NormalDist().inv_cdf(0.975)
    inside = grid_p[np.abs(k / n - grid_p) <= z * np.sqrt(grid_p * (1 - grid_p) / n)]
    np.testing.assert_allclose(wilson(k, n), (inside.min(), inside.max()), atol=1e-5)
test_fail(lambda: wilson(6, 5), contains="k must be a count")


# %%
#| export
def accuracy_table(items: pd.DataFrame, usable_accuracy: float = 0.9, usable_items: int = 50) -> pd.DataFrame:
    """Accuracy per (task, length) of the item rows: n, accuracy, binomial standard error, 95% Wilson interval, and
    whether the cell is usable (accuracy >= `usable_accuracy` on >= `usable_items` items)."""
    t = items.groupby(["task", "length"], sort=False).correct.agg(n="size", k="sum").reset_index()
    t["accuracy"] = t.k / t.n
    t["se"] = np.sqrt(t.accuracy * (1 - t.accuracy) / t.n)
    t["ci_lo"], t["ci_hi"] = zip(*(wilson(k, n) for k, n in zip(t.k, t.n)))
    t["usable"] = (t.accuracy >= usable_accuracy) & (t.n >= usable_items)
    return t.drop(columns="k")


# %%
answers_toy = pd.DataFrame({"task": ["a"] * 60 + ["b"] * 4, "length": [8] * 64,
                            "correct": [1] * 57 + [0] * 3 + [1, 1, 1, 1]})
acc_t = accuracy_table(answers_toy)
test_eq((acc_t.n.tolist(), acc_t.accuracy.tolist(), acc_t.usable.tolist()), ([60, 4], [0.95, 1.0], [True, False]))
test_close(acc_t.se[0], (0.95 * 0.05 / 60) ** 0.5)
test_eq((acc_t.ci_lo[0], acc_t.ci_hi[0]), wilson(57, 60))


# %% [markdown]
# ## End-to-end speed
#
# The speed stage (`reproduce/04_speed.ipynb`) times what `methods.make(name, budget)` gives a user: whole-model
# decode steps and prefills, against transformers' default (`DynamicCache`, the unpatched model) in the same loop.
# Its clock is `cpu_seconds` (the calling thread's CPU time, blind to waits on a shared machine, with the wall time
# beside it); `timed` and `Decoder` add up the time spent inside a method's attention policy and inside its cache's
# `update`; `SpeedBench` fills each method's cache to a context and alternates its steps with the default's.

# %%
#| export
def cpu_seconds(fn: Callable[[], object], device=None) -> dict:
    "CPU time of this thread and wall time of `fn()` (synchronized on CUDA, where the wall time is the one to read)."
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda: torch.cuda.synchronize(device)
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    if cuda: torch.cuda.synchronize(device)
    return {"seconds": time.thread_time() - c0, "wall_seconds": time.perf_counter() - w0}


# %%
slept = cpu_seconds(lambda: time.sleep(0.05))
assert slept["wall_seconds"] >= 0.05 > slept["seconds"], slept       # a wait costs no CPU time
busy = cpu_seconds(lambda: sum(i * i for i in range(200_000)))
assert busy["seconds"] > 0 and busy["wall_seconds"] > 0


# %%
#| export
def timed(policy):
    """`policy`, its class swapped for a subclass (isinstance checks still hold) that counts its attention calls in
    `policy.calls` and adds their CPU time to `policy.attention_seconds`."""
    class Timed(type(policy)):
        def __call__(self, q, k, v, ctx):
            t = time.thread_time()
            out = super().__call__(q, k, v, ctx)
            self.attention_seconds += time.thread_time() - t
            self.calls += 1
            return out

    policy.__class__, policy.attention_seconds, policy.calls = Timed, 0.0, 0
    return policy


# %%
pol = timed(methods.make("dense").policy())
with torch.no_grad(), patch(model, pol): patched = model(wins[:1]).logits
with torch.no_grad(): torch.testing.assert_close(patched, model(wins[:1]).logits)     # it still attends
test_eq((pol.calls, type(pol).__mro__[1].__name__), (model.config.num_hidden_layers, "DensePolicy"))
assert pol.attention_seconds > 0


# %%
#| export
class Decoder:
    """A cache of `model`, the policy it decodes under (None: transformers' default, unpatched) and the next token;
    the CPU time inside the cache's `update` (every layer's write, and an evicting cache's scoring and eviction) adds
    up in `cache_seconds`."""

    def __init__(self, model, cache, policy=None, token: int = 0, device=None):
        self.model, self.cache, self.policy, self.device = model, cache, policy, device
        self.token = torch.tensor([[token]], device=device)
        self.cache_seconds, update = 0.0, cache.update

        def timed_update(*args, **kwargs):
            t = time.thread_time()
            out = update(*args, **kwargs)
            self.cache_seconds += time.thread_time() - t
            return out
        cache.update = timed_update  # an instance attribute: each attention layer calls cache.update

    def forward(self):
        "One decode step of the model: the next token, greedy."
        self.token = self.model(self.token, past_key_values=self.cache, use_cache=True).logits[:, -1:].argmax(-1)

    def step(self) -> dict:
        """One decode step; the times of the forward alone (`generate` patches the model once for all its steps, so
        entering the patch is not part of a step)."""
        with (torch.no_grad(), patch(self.model, self.policy) if self.policy is not None
              else contextlib.nullcontext()):
            return cpu_seconds(self.forward, self.device)

    def attention_seconds(self) -> float:
        "The CPU seconds inside the policy's attention so far (NaN for transformers' default)."
        return getattr(self.policy, "attention_seconds", float("nan"))


# %% [markdown]
# The check: a step of the default from a prefill of 32 tokens gives the token a full forward over the 33 gives,
# and its cache grows by one; the time of its cache writes is counted.

# %%
cache0 = DynamicCache(config=model.config)
with torch.no_grad(): model(wins[:1, :32], past_key_values=cache0, use_cache=True)
dec = Decoder(model, cache0, token=int(wins[0, 32]))
took = dec.step()
with torch.no_grad(): want = model(wins[:1, :33]).logits[0, -1].argmax()
test_eq((int(dec.token), cache0.get_seq_length()), (int(want), 33))
assert dec.cache_seconds > 0 and took["seconds"] > 0 and math.isnan(dec.attention_seconds())


# %%
#| export
class SpeedBench:
    """Decode steps and prefills of `model` under each method at a budget of `budget_fraction` of the context per KV
    head, alternated with transformers' default, at each thread count of `threads`, on the token stream `prose`."""

    def __init__(self, model, prose: torch.Tensor, budget_fraction: float = 0.125, threads=(1,), repeats: int = 3,
                 seed: int = 0, device=None):
        if not 0 < budget_fraction <= 1: raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction!r}")
        self.model, self.prose, self.budget_fraction, self.threads = model, prose, budget_fraction, list(threads)
        self.repeats, self.seed, self.device = check_int(repeats, "repeats", 1), seed, device
        self.info = model_info(model)

    def make(self, name: str, L: int) -> Method:
        "Method `name` at a budget of budget_fraction * L entries per KV head (dense: no budget)."
        return methods.make(name) if name == "dense" else methods.make(name, max(1, round(self.budget_fraction * L)))

    def synthetic_kv(self, L: int) -> list:
        "L random keys and values per layer, [1, Hkv, L, D] each (the same for every method at this L)."
        g = torch.Generator().manual_seed(self.seed + L)
        shape = (1, self.info.num_kv_heads, L, self.info.head_dim)
        return [tuple(torch.randn(shape, generator=g, dtype=self.model.dtype).to(self.device) for _ in "kv")
                for _ in range(self.info.num_layers)]

    @staticmethod
    def fill(cache, kv: list):
        "`cache` holding the keys and values `kv` in every layer, written as a prefill writes them."
        for layer, (k, v) in enumerate(kv): cache.update(k, v, layer)
        return cache

    def decoder(self, name: str, L: int, kv: list) -> tuple[Decoder, int]:
        """A decoder of method `name` at budget_fraction of L, and the position its steps run at: the `kv` of L tokens
        for a method that keeps every token, a real chunked prefill of min(L, 2B) prose tokens for an eviction one."""
        m = self.make(name, L)
        B, policy = m.budget, timed(m.policy())
        if m.family != "eviction": return Decoder(self.model, self.fill(m.cache(self.model), kv), policy,
                                                  device=self.device), L
        n = min(L, 2 * B)  # a bounded cache: steady after 2B tokens
        cache, last = chunked_prefill(self.model, self.prose[:, :n], m.chunk_size or n, policy, m.cache(self.model))
        return Decoder(self.model, cache, policy, int(last.argmax(-1)), self.device), n


# %% [markdown]
# The checks on the tiny model, at a context of 64 and a budget of a quarter: the budgets, the synthetic keys and
# values (their shapes, the same for every method at one context), a selection method decoding from them with its
# policy called once per layer, and an eviction method from a real prefill of $2B$ tokens.

# %%
stream = torch.randint(3, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(3))
bench = SpeedBench(model, stream, budget_fraction=0.25, repeats=2)
test_eq((bench.make("dense", 64).budget, bench.make("tova", 64).budget, bench.make("tova", 2).budget), (None, 16, 1))
kv = bench.synthetic_kv(64)
test_eq((len(kv), kv[0][0].shape), (model.config.num_hidden_layers, (1, model.config.num_key_value_heads, 64,
                                                                      model.config.head_dim)))
test_eq(kv[1][1], bench.synthetic_kv(64)[1][1])
q_dec, at = bench.decoder("quoka", 64, kv)
q_dec.step()
test_eq((at, q_dec.policy.calls, q_dec.cache.get_seq_length()), (64, model.config.num_hidden_layers, 65))
assert q_dec.policy.attention_seconds > 0 and q_dec.cache_seconds > 0
test_eq(bench.decoder("tova", 64, kv)[1], 32)                       # min(L, 2B) prose tokens
test_fail(lambda: SpeedBench(model, wins, budget_fraction=0), contains="budget_fraction must be in")


# %%
#| export
@patch_to(SpeedBench)
def decode_rows(self, name: str, L: int, kv: list) -> list[dict]:
    """Steady-state decode steps of `name` at L alternating with the default's at each thread count (who goes
    first alternates too), and its first step (which builds page summaries, unit keys) timed apart."""
    torch.set_num_threads(max(self.threads))
    base = Decoder(self.model, self.fill(DynamicCache(config=self.model.config), kv), device=self.device)
    dec, at = self.decoder(name, L, kv)
    first = dec.step()["wall_seconds"]  # summaries, unit keys: built once
    base.step()
    rows = []
    for n in self.threads:
        torch.set_num_threads(n)
        for j in range(self.repeats):
            for who, d in [("default", base), (name, dec)][::(-1) ** j]:  # alternate who goes first
                a0, c0 = d.attention_seconds(), d.cache_seconds
                t = d.step()
                rows.append({"L": L, "threads": n, "method": name, "who": who, "step": j, "position": at, **t,
                             "attention_seconds": d.attention_seconds() - a0, "cache_seconds": d.cache_seconds - c0,
                             "first_step_seconds": first})
    return rows


# %% [markdown]
# The rows of the alternating steps: who goes first alternates, every step at the method's position.

# %%
steps = bench.decode_rows("quoka", 64, kv)
test_eq([(r["who"], r["step"]) for r in steps], [("default", 0), ("quoka", 0), ("quoka", 1), ("default", 1)])
test_eq({r["position"] for r in steps}, {64})


# %%
#| export
@patch_to(SpeedBench)
def ttft(self, name: str, L: int) -> dict:
    """Times of `name`'s prefill of L prose tokens (in its chunks, else in one call) and its first decode step
    (which builds a retrieval method's page summaries)."""
    m = self.make(name, L)

    def run():
        policy = m.policy()
        cache, last = chunked_prefill(self.model, self.prose[:, :L], m.chunk_size or L, policy, m.cache(self.model))
        with torch.no_grad(), patch(self.model, policy):
            self.model(last.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
    return cpu_seconds(run, self.device)

@patch_to(SpeedBench)
def default_ttft(self, L: int) -> dict:
    "transformers' default: one forward over the prompt into a DynamicCache, then one decode step."
    def run():
        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            last = self.model(self.prose[:, :L], past_key_values=cache, use_cache=True,
                              logits_to_keep=1).logits[:, -1]
            self.model(last.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
    return cpu_seconds(run, self.device)


# %% [markdown]
# Both times to first token are measured (positive) on the tiny model.

# %%
assert bench.ttft("quoka", 64)["seconds"] > 0 and bench.default_ttft(64)["seconds"] > 0


# %% [markdown]
# **Ratios and goals.** Every ratio is the median (or min, or max) over steps of the ratio within a step: default
# over method (`step_ratios`). A goal is met when the median reaches its target; a median below it whose fastest
# step reaches it is a tie, no difference the steps show (`goal_line`).

# %%
#| export
def step_ratios(df: pd.DataFrame, keys: list, col: str, how: str = "median") -> pd.Series:
    "Per keys: the `how` (median, min, max) over steps of default / method of `col` within a step."
    wide = df.pivot_table(index=keys + ["step"], columns="who", values=col)
    return (wide["default"] / wide.drop(columns="default").max(axis=1)).groupby(keys).agg(how)


# %%
toy_steps = pd.DataFrame({"L": [8] * 6, "method": ["m"] * 6, "who": ["default", "m"] * 3, "step": [0, 0, 1, 1, 2, 2],
                          "seconds": [2.0, 1.0, 3.0, 1.0, 1.0, 1.0]})
test_eq([step_ratios(toy_steps, ["L", "method"], "seconds", how).iloc[0] for how in ("median", "min", "max")],
        [2.0, 1.0, 3.0])


# %%
#| export
def goal_line(what: str, row, target: float) -> str:
    """A Markdown table row of a speed goal for the `step_ratios` summary `row` (None: not measured): met, tied (a
    median below target whose fastest step reaches it) or not met."""
    if row is None: return f"| {what} | >= {target:g}x | not measured in this profile |"
    if row.speedup >= target: verdict = "met"
    elif row.fastest_step >= target:
        verdict = f"tied: the steps' ratios span {row.slowest_step:.2f}-{row.fastest_step:.2f}x"
    else: verdict = "not met"
    return f"| {what} | >= {target:g}x | {row.speedup:.2f}x ({verdict}) |"


# %%
r = SimpleNamespace(speedup=1.2, slowest_step=0.9, fastest_step=1.6)
test_eq([goal_line("g", r, t) for t in (1.0, 1.5, 2.0)],
        ["| g | >= 1x | 1.20x (met) |", "| g | >= 1.5x | 1.20x (tied: the steps' ratios span 0.90-1.60x) |",
         "| g | >= 2x | 1.20x (not met) |"])
test_eq(goal_line("g", None, 2.5), "| g | >= 2.5x | not measured in this profile |")
