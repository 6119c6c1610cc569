# %% [markdown]
# # QuoKA experiments
#
# > The machinery of the QuoKA stages: greedy answers after a chunked prefill, dense recordings of a prompt's last chunk, the fidelity of a selection on them, needle retention, and the tables built from their grids.

# %%
#| default_exp quoka.experiments

# %% [markdown]
# The three QuoKA stages of the pipeline ([observations](../reproduce/20_quoka_observations.ipynb),
# [latency](../reproduce/21_quoka_latency.ipynb), [accuracy](../reproduce/22_quoka_accuracy.ipynb)) share what
# is here. Each definition is checked on a tiny random model or on random tensors, against an independent
# computation. Methods and policies are built by the registry (`sparsekv.methods.make`).

# %%
#| export
from __future__ import annotations

import copy
import statistics
import time
from functools import lru_cache, partial
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from fastcore.basics import patch_to
from torch.utils._python_dispatch import TorchDispatchMode

from sparsekv.attention import attention_scores, causal_mask, check_int, gather_keys
from sparsekv.data import make_task, score_exact, token_stream
from sparsekv.eval import attention_fidelity, needle_retention, query_quantile, run_grid
from sparsekv.hf import DensePolicy, add_chunk_keys, attend_selected, chunked_prefill, dense_attention, patch
from sparsekv.methods import make
from sparsekv.quoka.baselines import loki_basis, loki_select, mean_score_select, sample_attention_select, sparq_select
from sparsekv.quoka.select import UnitKeyCache, preaggregated_queries, quoka_scores, quoka_select, select_queries
from sparsekv.reproduce import find_pipeline, load_stages, notebook_parameters
from sparsekv.select import resolve_budget, top_budget_indices
from sparsekv.stats import paired_ci

# %%
import tempfile

from fastcore.test import test_close, test_eq, test_fail

from sparsekv.models import load_model


# %% [markdown]
# ## Figures

# %%
#| export
def panel_grid(n: int, width: float, height: float, per_row: int = 3, pad: float = 1.4, **kw):
    """A constrained-layout figure with `n` panels of `width` x `height` inches, at most `per_row` a row (plus `pad`
    inches of width), and the flat list of its axes."""
    check_int(n, "n", 1), check_int(per_row, "per_row", 1)
    rows, cols = -(-n // per_row), min(n, per_row)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols + pad, height * rows), squeeze=False,
                             layout="constrained", **kw)
    for ax in axes.flat[n:]: ax.set_visible(False)
    return fig, list(axes.flat[:n])


# %%
_fig, _axes = panel_grid(5, 2.0, 1.5, sharey=True)
test_eq(len(_axes), 5)
test_eq([a.get_visible() for a in _fig.axes], [True] * 5 + [False])
test_eq(tuple(_fig.get_size_inches()), (2.0 * 3 + 1.4, 1.5 * 2))
plt.close(_fig)
test_fail(lambda: panel_grid(0, 1, 1), contains="n must")


# %% [markdown]
# ## One greedy loop
#
# Every answer of the accuracy stage is the argmax of the prefill's last logits followed by greedy decode steps,
# each one token fed at its position, under the same policy as the prefill (QuoKA's §4.4 selects at generation too).
# `sparsekv.protocol.answer` generates through `Method.generate`, a different number of tokens and a different
# score; this loop is the one the accuracy stage's grids were computed with.

# %%
#| export
def greedy_continue(model, cache, logits: torch.Tensor, start: int, n_new: int, policy=None) -> torch.Tensor:
    """Greedy ids `[B, n_new]` after a prefill: the argmax of its last `logits` `[B, V]`, then `n_new - 1` decode
    steps from position `start` (the prompt's length) under `policy` (None: dense), extending `cache`."""
    check_int(n_new, "n_new", 1), check_int(start, "start")
    out = [logits.argmax(-1)]
    with torch.no_grad(), patch(model, policy or DensePolicy()):
        for i in range(n_new - 1):
            pos = torch.tensor([start + i], device=logits.device)
            out.append(model(input_ids=out[-1][:, None], past_key_values=cache, use_cache=True,
                             position_ids=pos[None]).logits[:, -1].argmax(-1))
    return torch.stack(out, 1)


# %%
# against a loop without a cache: each step reruns the whole sequence densely
tiny, tiny_tok = load_model("tiny-llama")
_ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(0))
_cache, _logits = chunked_prefill(tiny, _ids, 16)
_ref = _ids
with torch.no_grad():
    for _ in range(5): _ref = torch.cat([_ref, tiny(_ref).logits[:, -1:].argmax(-1)], 1)
test_eq(greedy_continue(tiny, _cache, _logits, 40, 5), _ref[:, 40:])
test_fail(lambda: greedy_continue(tiny, _cache, _logits, 40, 0), contains="n_new")


# %% [markdown]
# ## Answers and recordings of task items
#
# **Prefill reuse.** While the cache holds at most $B_{SA}$ keys every selection attends densely, so the dense
# prefix of a prompt (the chunks whose $T \le B_{SA}$, but never the last chunk) is computed once per prompt and
# budget and copied for each method.

# %%
#| export
def dense_prefix_tokens(budget: int, length: int, chunk_size: int) -> int:
    """Tokens of a `length`-token prompt that every selection at B_SA = `budget` prefills densely in chunks of
    `chunk_size` (whole chunks, never the last)."""
    check_int(budget, "budget", 1), check_int(length, "length", 1), check_int(chunk_size, "chunk_size", 1)
    return min((budget // chunk_size + 1) * chunk_size, (length - 1) // chunk_size * chunk_size)


# %%
# by brute force: the chunk starts T with every earlier chunk start <= budget, and a later chunk left
def _dense_ref(budget, length, c):
    starts = list(range(0, length, c))
    return max([s + c for s in starts[:-1] if s <= budget] + [0])
for _b, _L, _c in [(256, 1024, 128), (100, 1024, 128), (1024, 1000, 128), (5, 20, 8), (16, 17, 8), (8, 8, 8)]:
    test_eq(dense_prefix_tokens(_b, _L, _c), _dense_ref(_b, _L, _c))


# %%
#| export
class LastChunksRecorder(DensePolicy):
    "Dense attention keeping each layer's queries of the positions >= `start` and the keys and values of its last call"
    def __init__(self, start: int):
        self.start, self.q, self.kv = start, {}, {}

    def attend(self, q, k, v, ctx):
        first = ctx.query_positions[0].item()
        if first + q.shape[2] > self.start:
            keep = q[:, :, max(0, self.start - first):]
            self.q[ctx.layer_idx] = torch.cat([self.q[ctx.layer_idx], keep], 2) if ctx.layer_idx in self.q else keep
            self.kv[ctx.layer_idx] = (k, v, ctx.scale)
        return super().attend(q, k, v, ctx)


# %%
_rec = LastChunksRecorder(40 - 20)
chunked_prefill(tiny, _ids, 16, _rec)
_k, _v, _s = _rec.kv[1]
test_eq(tuple(_rec.q[1].shape[2:]), (20, 16))
test_eq(_k.shape[2], 40)
# the recorded queries of the last positions reproduce the model's attention output there
_o = torch.nn.functional.scaled_dot_product_attention(_rec.q[1], _k.repeat_interleave(2, 1), _v.repeat_interleave(2, 1),
                                                      attn_mask=causal_mask(20, 40)[None, None], scale=_s)
test_eq(_o.shape, (1, 4, 20, 16))


# %%
#| export
class TaskProbe:
    """`make_task` items for one model: greedy answers after a chunked prefill (B_CP = `chunk_size`) under each
    method's policy, and dense recordings of the last `probe` queries with all keys and values. Policies come from
    the registry with `n_q` (QuoKA, SampleAttention) and `lessismore_layers`; `new_tokens`: answer length per task."""

    def __init__(self, model, tok, chunk_size: int = 128, n_q: int = 16, lessismore_layers=(2, 15), probe: int = 128,
                 new_tokens: dict | None = None, device="cpu"):
        self.model, self.tok, self.device = model, tok, device
        self.chunk_size, self.n_q = check_int(chunk_size, "chunk_size", 1), check_int(n_q, "n_q", 1)
        self.probe = check_int(probe, "probe", 1)
        self.lessismore_layers, self.new_tokens = list(lessismore_layers), dict(new_tokens or {})
        self.n_layers = model.config.num_hidden_layers
        # caches of this probe (sizes as the stage had them: a dense recording holds every layer's keys and values)
        self.sample = lru_cache(maxsize=4)(self._sample)
        self.dense_prefix = lru_cache(maxsize=2)(self._dense_prefix)
        self.dense_record = lru_cache(maxsize=1)(self._dense_record)

    def _sample(self, task: str, length: int, seed: int, depth: float | None) -> tuple[dict, torch.Tensor]:
        "The task item and its token ids [1, L] (prompt, a space, the answer prefix)."
        item = make_task(task, self.tok, length, seed, depth=depth)
        ids = self.tok(item["prompt"] + " " + item["answer_prefix"], return_tensors="pt").input_ids
        return item, ids.to(self.device)

    def _dense_prefix(self, key: tuple, n_tokens: int):
        "Cache after a dense chunked prefill of the first `n_tokens` tokens of the sample `key`."
        return chunked_prefill(self.model, self.sample(*key)[1][:, :n_tokens], self.chunk_size)[0]

    def policy(self, method: str, budget: int):
        "The attention policy of `method` at B_SA = `budget`, from the registry (None: dense)."
        if method == "dense": return None
        params = {"quoka": {"n_q": self.n_q}, "sample_attention": {"n_q": self.n_q},
                  "lessismore": {"selection_layers": tuple(self.lessismore_layers)}}.get(method, {})
        return make(method, budget, chunk_size=self.chunk_size, **params).policy()

    def prefill(self, key: tuple, ids: torch.Tensor, policy, budget: int):
        "chunked_prefill of `ids` under `policy`, from a copy of the shared dense prefix (`dense_prefix_tokens`)."
        if policy is None: return chunked_prefill(self.model, ids, self.chunk_size)
        n_dense = dense_prefix_tokens(budget, ids.shape[1], self.chunk_size)
        if n_dense < self.chunk_size: return chunked_prefill(self.model, ids, self.chunk_size, policy)
        cache = copy.deepcopy(self.dense_prefix(key, n_dense))
        return chunked_prefill(self.model, ids[:, n_dense:], self.chunk_size, policy, cache=cache)

    def answer(self, key: tuple, method: str, budget: int) -> str:
        """Greedy completion (the task's `new_tokens`) of the sample `key` after a chunked prefill under `method`,
        generation under it too."""
        ids, policy = self.sample(*key)[1], self.policy(method, budget)
        cache, logits = self.prefill(key, ids, policy, budget)
        out = greedy_continue(self.model, cache, logits, ids.shape[1], self.new_tokens[key[0]], policy)
        return self.tok.decode(out[0], skip_special_tokens=True)

    def _dense_record(self, key: tuple) -> tuple[str, dict, dict]:
        """Dense greedy answer of the sample `key` and, from the same prefill, each layer's last `probe` queries and all
        keys and values."""
        ids = self.sample(*key)[1]
        rec = LastChunksRecorder(ids.shape[1] - self.probe)
        cache, logits = chunked_prefill(self.model, ids, self.chunk_size, rec)
        out = greedy_continue(self.model, cache, logits, ids.shape[1], self.new_tokens[key[0]])
        return self.tok.decode(out[0], skip_special_tokens=True), rec.q, rec.kv


# %%
probe = TaskProbe(tiny, tiny_tok, chunk_size=16, n_q=4, lessismore_layers=[0], probe=32,
                  new_tokens={"niah_single": 3, "niah_multikey": 3})
_key = ("niah_single", 400, 0, 0.5)
_item, _ids = probe.sample(*_key)
# continuing from the copied dense prefix gives the same last logits as a full chunked prefill under the policy
for _m in ("quoka", "lessismore", "mean_scores", "loki"):
    torch.testing.assert_close(probe.prefill(_key, _ids, probe.policy(_m, 24), 24)[1],
                               chunked_prefill(tiny, _ids, 16, probe.policy(_m, 24))[1], atol=1e-4, rtol=0)
# the dense answer of a recording is the dense answer of `answer`, and it records the last `probe` queries
test_eq(probe.dense_record(_key)[0], probe.answer(_key, "dense", 0))  # dense: budget 0 in the grids
test_eq(probe.dense_record(_key)[1][1].shape[2], 32)
test_eq(type(probe.policy("quoka", 24)).__name__, "QuokaPolicy")
assert probe.policy("dense", 24) is None


# %%
#| export
@patch_to(TaskProbe)
def answer_cell(self, cell: dict) -> dict:
    """Exact-match score and completion of one grid cell (task, length, depth, seed, method, budget); the dense
    answer of a task other than `niah_single` comes with its recording (`dense_record`)."""
    key = (cell["task"], cell["length"], cell["seed"], cell.get("depth"))
    if cell["method"] == "dense" and not cell["task"] == "niah_single": text = self.dense_record(key)[0]
    else: text = self.answer(key, cell["method"], cell["budget"])
    return {"score": score_exact(text, self.sample(*key)[0]["answer"]), "completion": text.replace("\n", "\\n")}


# %%
_c = probe.answer_cell({"task": "niah_single", "length": 400, "depth": 0.5, "seed": 0, "method": "quoka", "budget": 24})
test_eq(_c["completion"], probe.answer(_key, "quoka", 24).replace("\n", "\\n"))
test_eq(_c["score"], score_exact(probe.answer(_key, "quoka", 24), _item["answer"]))


# %%
#| export
def answer_cells(task: str, length: int, depth, seed: int, budgets: list, names: list) -> list[dict]:
    "Grid cells of one sample: dense once (budget 0), every other method of `names` at every budget (depth None: none)."
    base = {"task": task, "length": length, **({} if depth is None else {"depth": depth}), "seed": seed}
    return [{**base, "method": m, "budget": 0 if m == "dense" else b} for m in names
            for b in ([0] if m == "dense" else budgets)]


# %%
test_eq(answer_cells("t", 64, None, 0, [8, 16], ["dense", "quoka"]),
        [{"task": "t", "length": 64, "seed": 0, "method": m, "budget": b} for m, b in
         (("dense", 0), ("quoka", 8), ("quoka", 16))])
test_eq(answer_cells("t", 64, 0.5, 0, [8], ["quoka"])[0]["depth"], 0.5)


# %%
#| export
def grid_rows(cells: list[dict], fn, path, desc: str, settings: dict) -> pd.DataFrame:
    """The rows of `cells` (in order) of the resumable grid at `path` (`run_grid` of `fn`), keyed by the cells and
    `settings`; the settings' columns dropped, the cells' columns as the cells hold them."""
    rows = run_grid(cells, fn, Path(path), desc=desc, params=settings).drop(columns=list(settings))
    return rows.merge(pd.DataFrame(cells), on=list(cells[0]))


# %%
with tempfile.TemporaryDirectory() as _d:
    _cells = [{"method": "b", "budget": 8}, {"method": "a", "budget": 4}]
    _g = grid_rows(_cells, lambda c: {"x": c["budget"] * 2}, Path(_d)/"g.csv", "test", {"model": "m"})
    test_eq(_g[["method", "budget", "x"]].values.tolist(), [["b", 8, 16], ["a", 4, 8]])
    assert "model" not in _g and "wall_s" in _g
    test_eq(grid_rows(_cells[1:], lambda c: 1 / 0, Path(_d)/"g.csv", "test", {"model": "m"}).x.tolist(), [8])  # reused

# %% [markdown]
# ## The fidelity of a selection on a recording
#
# On a dense recording, each method's selection for the last chunk is scored one layer at a time, free of
# compounding: the share of the dense attention mass on the kept keys (earlier selection plus the chunk's own,
# causally) and the relative error of the attention output (`attention_fidelity`). Besides the registered
# methods, `fidelity_selection` knows the diagnostic variants of QuoKA: dot product instead of cosine
# (`quoka_dot`), keys centred by their mean (`quoka_centered`), mean instead of max over queries
# (`quoka_meanagg`), 4 sinks and 64 recent keys inside the budget (`quoka_anchors`), QuoKA's kept queries scored by
# their mean softmax probability (`quoka_softmax`), and `quoka_nqN`: QuoKA with $N_Q = N$.

# %%
#| export
VARIANTS = ("quoka_dot", "quoka_centered", "quoka_meanagg", "quoka_anchors", "quoka_softmax")

def fidelity_selection(method: str, budget: int, layer: int, q, k_earlier, scale: float, n_q: int = 16,
                       selector=None) -> torch.Tensor:
    """Indices `[B,Hkv,n]` of the earlier keys k_earlier that `method` keeps for the chunk q at `layer` (all keys where
    it attends densely); `selector`: LessIsMore's, shared by the layers of one pass."""
    T = k_earlier.shape[2]
    all_keys = torch.arange(T, device=q.device).expand(k_earlier.shape[0], k_earlier.shape[1], T)
    n = resolve_budget(budget, T)
    if method == "dense" or n == T: return all_keys
    if method == "lessismore":
        if selector is None: raise ValueError("selector: lessismore needs the LessIsMoreSelector of this pass")
        idx = selector.select(layer, q, k_earlier)
        return all_keys if idx is None else idx
    if method == "quoka_centered": return quoka_select(q, k_earlier - k_earlier.mean(2, keepdim=True), n_q, budget)
    if method == "quoka_dot":
        return top_budget_indices(quoka_scores(q, k_earlier, n_q) * k_earlier.float().norm(dim=-1), n)
    if method == "quoka_softmax":  # QuoKA's kept queries, scored by their mean softmax probability, not the max cosine
        pos = select_queries(q, n_q, q.shape[1] // k_earlier.shape[1])
        kept = q.gather(2, pos[..., None].expand(-1, -1, -1, q.shape[-1]))
        return mean_score_select(kept, k_earlier, budget, scale=scale)
    quoka = {"quoka": {}, "quoka_meanagg": {"query_agg": "mean"}, "quoka_anchors": {"sinks": 4, "recent": 64}}
    if method in quoka or method.startswith("quoka_nq"):
        n_q = int(method[len("quoka_nq"):]) if method.startswith("quoka_nq") else n_q
        return make("quoka", budget, n_q=n_q, **quoka.get(method, {})).policy().earlier_indices(q, k_earlier)
    extra = {"n_q": n_q} if method == "sample_attention" else {}
    return make(method, budget, **extra).policy().earlier_indices(q, k_earlier, scale)


# %%
# each method's keys are its selection function's (the registry's defaults are the papers')
_q, _k = torch.randn(1, 6, 16, 8, generator=torch.Generator().manual_seed(1)), torch.randn(1, 2, 50, 8)
_same = lambda a, b: test_eq(a.sort(-1).values, b.sort(-1).values)
_same(fidelity_selection("quoka", 10, 0, _q, _k, 0.3, 4), quoka_select(_q, _k, 4, 10))
_same(fidelity_selection("quoka_nq2", 10, 0, _q, _k, 0.3, 4), quoka_select(_q, _k, 2, 10))
_same(fidelity_selection("quoka_meanagg", 10, 0, _q, _k, 0.3, 4), quoka_select(_q, _k, 4, 10, query_agg="mean"))
_same(fidelity_selection("mean_scores", 10, 0, _q, _k, 0.3, 4), mean_score_select(_q, _k, 10, scale=0.3))
_same(fidelity_selection("sample_attention", 10, 0, _q, _k, 0.3, 4),
      sample_attention_select(_q, _k, 10, n_q=4, scale=0.3))
_same(fidelity_selection("sparq", 10, 0, _q, _k, 0.3, 4), sparq_select(_q, _k, 10, scale=0.3))
_same(fidelity_selection("loki", 10, 0, _q, _k, 0.3, 4), loki_select(_q, _k, 10, scale=0.3))
_anch = fidelity_selection("quoka_anchors", 70, 0, _q, torch.randn(1, 2, 200, 8), 0.3, 4)
assert set(range(4)) | set(range(136, 200)) <= set(_anch[0, 0].tolist())  # the sinks and the recent keys are kept
test_eq(fidelity_selection("quoka", 50, 0, _q, _k, 0.3, 4), torch.arange(50).expand(1, 2, 50))  # all fit: all keys
test_fail(lambda: fidelity_selection("lessismore", 10, 0, _q, _k, 0.3), contains="selector")


# %%
#| export
@patch_to(TaskProbe)
def last_chunk_fidelity(self, key: tuple, method: str, budget: int, c: int):
    """Per layer of the dense recording of sample `key`, with the last `c` recorded queries as the chunk: the layer,
    the kept keys `[1, Hkv, S]` (`method`'s selection among the earlier ones, and the chunk's own), and the per-query
    mass recall and relative output error `[1, Hq, c]` of exact attention over them."""
    _, qs, kvs = self.dense_record(key)
    selector = (make("lessismore", budget, selection_layers=tuple(self.lessismore_layers)).policy().selector
                if method == "lessismore" else None)
    for layer in range(self.n_layers):
        k, v, scale = kvs[layer]
        q = qs[layer][:, :, -c:]
        S = k.shape[2]
        T = S - c
        idx = fidelity_selection(method, budget, layer, q, k[:, :, :T], scale, self.n_q, selector)
        keep = torch.ones(1, k.shape[1], S, dtype=torch.bool, device=k.device)
        keep[..., :T] = torch.zeros(1, k.shape[1], T, dtype=torch.bool, device=k.device).scatter(2, idx, True)
        mass, err = attention_fidelity(q, k, v, keep[:, :, None], causal_mask(c, S).to(k.device)[None, None],
                                       scale=scale)
        yield layer, keep, mass, err


# %%
#| export
@patch_to(TaskProbe)
def fidelity_cell(self, cell: dict) -> dict:
    """Mean mass recall and relative output error at every layer (`mass_recall@layer` etc.) of one cell (task,
    length, seed, depth, method, budget, chunk)."""
    key = (cell["task"], cell["length"], cell["seed"], cell.get("depth"))
    return {f"{m}@{layer}": x.nanmean().item()
            for layer, _, mass, err in self.last_chunk_fidelity(key, cell["method"], cell["budget"], cell["chunk"])
            for m, x in (("mass_recall", mass), ("output_error", err))}


# %%
# dense keeps every key: recall 1, no error; a budget below the cache loses mass, by the selection itself
_cell = {"task": "niah_single", "length": 400, "seed": 0, "depth": 0.5, "chunk": 16}
_d = probe.fidelity_cell({**_cell, "method": "dense", "budget": 8})
test_eq(sorted(_d), ["mass_recall@0", "mass_recall@1", "output_error@0", "output_error@1"])
assert all(abs(_d[f"mass_recall@{l}"] - 1) < 1e-6 and _d[f"output_error@{l}"] < 1e-5 for l in (0, 1))
_layer, _keep, _mass, _ = next(probe.last_chunk_fidelity(_key, "quoka", 8, 16))
_q1, (_k1, _v1, _s1) = probe.dense_record(_key)[1][0][:, :, -16:], probe.dense_record(_key)[2][0]
_bias = torch.where(causal_mask(16, _k1.shape[2]), 0, -torch.inf)
_p = torch.softmax(_s1 * _q1 @ _k1.repeat_interleave(2, 1).mT + _bias, -1)
torch.testing.assert_close(_mass, (_p * _keep.repeat_interleave(2, 1)[:, :, None]).sum(-1))
test_eq(_keep[0, :, :_k1.shape[2] - 16].sum(-1).tolist(), [8, 8])


# %%
#| export
@patch_to(TaskProbe)
def key_stats_cell(self, cell: dict) -> dict:
    """At one layer of a recording: mean cosine of the keys with their mean key, and the mean share of |k|^2 in the two
    largest channels."""
    k = self.dense_record((cell["task"], cell["length"], cell["seed"], None))[2][cell["layer"]][0].float()
    mean_cos = F.cosine_similarity(k, k.mean(2, keepdim=True), dim=-1).mean().item()
    top2 = (k.square().topk(2, dim=-1).values.sum(-1) / k.square().sum(-1).clamp_min(1e-12)).mean().item()
    return {"mean_cos_to_mean_key": mean_cos, "top2_channel_share": top2}


# %%
_s = probe.key_stats_cell({"task": "niah_multikey", "length": 600, "seed": 0, "layer": 1})
_k = probe.dense_record(("niah_multikey", 600, 0, None))[2][1][0][0].double()  # [Hkv, S, D]
_kk = [sorted((x * x).tolist(), reverse=True) for h in _k for x in h]
test_eq(round(_s["top2_channel_share"], 5), round(float(np.mean([(r[0] + r[1]) / sum(r) for r in _kk])), 5))
_m = _k.mean(1, keepdim=True)
test_eq(round(_s["mean_cos_to_mean_key"], 5),
        round(float(((_k * _m).sum(-1) / _k.norm(dim=-1) / _m.norm(dim=-1)).mean()), 5))


# %% [markdown]
# ## Needle retention
#
# The needle's tokens are those whose characters overlap the needle sentence in the prompt (the tokenizer's
# offsets). A method's selection keeps a share of them per KV head (`needle_retention`); the dense attention mass
# the last query puts on them weighs the heads that read the needle.

# %%
#| export
@patch_to(TaskProbe)
def needle_positions(self, item: dict) -> torch.Tensor:
    "Token positions, in the sample's ids, of the tokens overlapping the item's (one) needle sentence."
    text = item["prompt"] + " " + item["answer_prefix"]  # as `sample` tokenizes it
    start = item["prompt"].index(item["needles"][0])
    end = start + len(item["needles"][0])
    offsets = self.tok(text, return_offsets_mapping=True)["offset_mapping"]
    return torch.tensor([i for i, (a, b) in enumerate(offsets) if a < end and b > start])


# %%
_pos = probe.needle_positions(_item)
assert _item["answer"] in tiny_tok.decode(_ids[0, _pos]) and (_pos.diff() == 1).all()  # the needle, in one piece
assert _item["answer"] not in tiny_tok.decode(_ids[0, :_pos[0]]) + tiny_tok.decode(_ids[0, _pos[-1] + 1:])


# %%
#| export
@patch_to(TaskProbe)
def dense_needle_mass(self, key: tuple, needle: torch.Tensor) -> list[torch.Tensor]:
    "Per layer: the dense attention mass the last recorded query puts on the needle, `[Hkv]` (mean over each group)."
    _, qs, kvs = self.dense_record(key)
    out = []
    for layer in range(self.n_layers):
        k, _, scale = kvs[layer]
        p = attention_scores(qs[layer][:, :, -1:], k, scale=scale).softmax(-1)[0, :, 0]  # [Hq, S]: sees every key
        out.append(p[:, needle].sum(-1).view(k.shape[1], -1).mean(-1))
    return out


# %%
_, _qs, _kvs = probe.dense_record(_key)
_k, _, _scale = _kvs[1]
_G = _qs[1].shape[1] // _k.shape[1]
_ref = [torch.softmax(_scale * _k[0, h // _G] @ _qs[1][0, h, -1], -1)[_pos].sum() for h in range(_qs[1].shape[1])]
torch.testing.assert_close(probe.dense_needle_mass(_key, _pos)[1], torch.stack(_ref).view(-1, _G).mean(-1))


# %%
#| export
@patch_to(TaskProbe)
def retention_cell(self, cell: dict) -> dict:
    """Per layer of one needle item: each KV head's needle retention (`needle@layer.head`) and the mean and 5th
    percentile of the per-query mass recall (`mass@layer`, `p05@layer`) of `method`'s last-chunk selection; the
    same for its selection for the last query alone (`q1needle@...`, `q1mass@...`); and the dense attention mass
    the last query puts on the needle, per KV head (`onneedle@layer.head`)."""
    key = ("niah_single", cell["length"], cell["seed"], cell["depth"])
    needle = self.needle_positions(self.sample(*key)[0])
    out = {f"onneedle@{layer}.{h}": m for layer, on in enumerate(self.dense_needle_mass(key, needle))
           for h, m in enumerate(on.tolist())}
    for c, pre in ((self.chunk_size, ""), (1, "q1")):
        for layer, keep, mass, _ in self.last_chunk_fidelity(key, cell["method"], cell["budget"], c):
            out |= {f"{pre}needle@{layer}.{h}": r for h, r in enumerate(needle_retention(keep, needle)[0].tolist())}
            out |= {f"{pre}mass@{layer}": mass.nanmean().item()}
            if c > 1: out[f"p05@{layer}"] = query_quantile(mass, 0.05).item()
    return out


# %%
# a budget of the whole cache keeps the whole needle in every head; QuoKA's decode scoring is Alg. 1 with one query
_r = probe.retention_cell({"length": 400, "seed": 0, "depth": 0.5, "method": "quoka", "budget": 10_000})
assert all(v == 1 for c, v in _r.items() if "needle@" in c and not c.startswith("on"))
test_eq(len([c for c in _r if c.startswith("onneedle@")]), 2 * 2)
_q, _k = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 300, 64)
test_eq(make("quoka", 100, n_q=16).policy().earlier_indices(_q, _k, "decode").sort(-1).values,
        fidelity_selection("quoka", 100, 0, _q, _k, 0.125).sort(-1).values)


# %% [markdown]
# ## Grids into tables
#
# The fidelity grid holds one row per selection with a `metric@layer` column per layer (a grid is rewritten after
# every row, so one row per layer would cost 30 rewrites); `by_layer` turns it into one row per layer. The retention
# grid's `metric@layer.head` columns are read by `long_metric`.

# %%
#| export
def by_layer(wide: pd.DataFrame) -> pd.DataFrame:
    "The fidelity grid's rows (a `metric@layer` column per layer) as one row per layer: keys, layer, metrics, wall_s."
    per = [c for c in wide.columns if "@" in c]
    long = wide.melt(id_vars=[c for c in wide.columns if c not in per], value_vars=per)
    long[["metric", "layer"]] = long.pop("variable").str.split("@", expand=True)
    long["layer"] = long.layer.astype(int)
    keys = [c for c in long.columns if c not in ("metric", "value")]
    out = long.pivot(index=keys, columns="metric", values="value").reset_index()
    return out.rename_axis(columns=None)[[*(c for c in keys if c != "wall_s"), "mass_recall", "output_error", "wall_s"]]


# %%
_wide = pd.DataFrame([{"task": "t", "method": "m", "mass_recall@1": 0.5, "output_error@1": 0.2, "mass_recall@0": 0.9,
                       "output_error@0": 0.1, "wall_s": 3.0}])
test_eq(by_layer(_wide).sort_values("layer").to_dict("records"), [
    {"task": "t", "method": "m", "layer": 0, "mass_recall": 0.9, "output_error": 0.1, "wall_s": 3.0},
    {"task": "t", "method": "m", "layer": 1, "mass_recall": 0.5, "output_error": 0.2, "wall_s": 3.0}])


# %%
#| export
def long_metric(retention: pd.DataFrame, prefix: str, where: list[str]) -> pd.DataFrame:
    "The retention grid's `prefix@...` columns as rows: method, seed, depth, the `where` parts (layer, head), value."
    cols = [c for c in retention if c.startswith(prefix + "@")]
    out = retention.melt(id_vars=["method", "seed", "depth"], value_vars=cols, var_name="at")
    out[where] = out.pop("at").str[len(prefix) + 1:].str.split(".", expand=True).astype(int)
    return out


# %%
# a toy retention grid: two methods, one item, two layers of two heads
_ret = pd.DataFrame([{"method": m, "seed": 0, "depth": 0.5,
                      **{f"needle@{l}.{h}": r for l in (0, 1) for h, r in enumerate(rs[2 * l:2 * l + 2])},
                      **{f"q1needle@{l}.{h}": 1.0 for l in (0, 1) for h in (0, 1)},
                      **{f"onneedle@{l}.{h}": w for l in (0, 1) for h, w in enumerate([0.1, 0.3])},
                      **{f"mass@{l}": 0.8 for l in (0, 1)}, **{f"q1mass@{l}": 0.9 for l in (0, 1)},
                      **{f"p05@{l}": 0.5 for l in (0, 1)}}
                     for m, rs in (("a", [1.0, 0.0, 0.5, 1.0]), ("b", [1.0, 1.0, 1.0, 1.0]))])
_lm = long_metric(_ret, "needle", ["layer", "head"])
test_eq(len(_lm), 8)
test_eq(_lm[(_lm.method == "a") & (_lm.layer == 1) & (_lm["head"] == 0)].value.item(), 0.5)


# %%
#| export
def kept_and_mass(retention: pd.DataFrame, pre: str) -> pd.DataFrame:
    """Per method, item, layer and head: the needle retention of selection `pre` (`value`) and the last query's dense
    needle mass (`value_w`)."""
    at = ["method", "seed", "depth", "layer", "head"]
    return long_metric(retention, pre + "needle", at[3:]).merge(long_metric(retention, "onneedle", at[3:]), on=at,
                                                                suffixes=("", "_w"))


# %%
#| export
def weighted_retention(kept: pd.DataFrame, by: list[str]) -> pd.Series:
    "Per group of `by`: the needle retention weighted by the last query's dense needle mass in each head."
    g = kept.assign(product=kept.value * kept.value_w).groupby(by)
    return g["product"].sum() / g.value_w.sum()


# %%
_kept = kept_and_mass(_ret, "")
test_eq(_kept[_kept.method == "a"].value_w.tolist(), [0.1, 0.3, 0.1, 0.3])
# method a: heads weighted 0.1, 0.3, 0.1, 0.3 keep 1, 0, 0.5, 1
test_eq(round(weighted_retention(_kept, ["method"])["a"], 12), round((0.1 + 0 + 0.05 + 0.3) / 0.8, 12))


# %%
#| export
def retention_summary(retention: pd.DataFrame, pre: str) -> pd.DataFrame:
    """Per method, for the selection `pre` ('': the chunk's, 'q1': the last query's): needle retention (mean, and
    weighted by the dense attention the last query puts on the needle in each head), shares of heads keeping all
    of the needle and none, and the mean mass recall."""
    kept = kept_and_mass(retention, pre)
    weighted = weighted_retention(kept, ["method"])
    return pd.concat([kept.groupby("method").value.agg(needle_retention="mean", whole_needle=lambda r: (r == 1).mean(),
                                                       needle_lost=lambda r: (r == 0).mean()),
                      weighted.rename("needle_weighted"),
                      long_metric(retention, pre + "mass", ["layer"]).groupby("method").value.mean()
                      .rename("mass_recall")],
                     axis=1).add_prefix(f"{pre}_" if pre else "")


# %%
#| export
def retention_table(retention: pd.DataFrame, methods: list[str]) -> pd.DataFrame:
    """`retention_summary` of the chunk's and the last query's selections and the mean 5th percentile of the mass
    recall, a row per method of `methods`."""
    return pd.concat([retention_summary(retention, ""),
                      long_metric(retention, "p05", ["layer"]).groupby("method").value.mean().rename("mass_p05"),
                      retention_summary(retention, "q1")], axis=1).loc[methods]


# %%
_t = retention_table(_ret, ["b", "a"])
test_eq(list(_t.index), ["b", "a"])
test_eq(_t.loc["a", ["needle_retention", "whole_needle", "needle_lost", "mass_recall", "mass_p05"]].tolist(),
        [0.625, 0.5, 0.25, 0.8, 0.5])
test_eq(_t.loc["a", ["q1_needle_retention", "q1_mass_recall"]].tolist(), [1.0, 0.9])


# %% [markdown]
# ## Retention on the items answered and missed
#
# Per item the weighted needle retention pools the item's layers and heads; the items a method answered and those
# it missed are different items, so their means are compared by a two-sample bootstrap (each group resampled apart).

# %%
#| export
def two_sample_ci(a, b, level: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    "`(mean(a) - mean(b), lo, hi)`: the difference of two groups' means and its bootstrap percentile interval."
    a, b, rng = np.asarray(a, float), np.asarray(b, float), np.random.default_rng(seed)
    if not len(a) or not len(b):
        raise ValueError(f"a and b must each hold at least one value, got {len(a)} and {len(b)}")
    draws = a[rng.integers(0, len(a), (n_boot, len(a)))].mean(1) - b[rng.integers(0, len(b), (n_boot, len(b)))].mean(1)
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return a.mean() - b.mean(), lo, hi


# %%
#| export
def percentile_reference(values: list, q: float) -> float:
    "The `q` quantile of `values` by linear interpolation between the sorted values (numpy's default)."
    v, h = sorted(values), q * (len(values) - 1)
    return v[int(h)] + (h - int(h)) * (v[min(int(h) + 1, len(v) - 1)] - v[int(h)])


# %%
test_eq(percentile_reference([3, 1, 2, 4], 0.5), 2.5)
_a, _b = np.random.default_rng(1).normal(size=(2, 9))
_r = np.random.default_rng(0)  # the same draws as two_sample_ci's, summed one resample at a time
_ia, _ib = _r.integers(0, 9, (300, 9)), _r.integers(0, 9, (300, 9))
_loop = [sum(_a[i] for i in _ia[k]) / 9 - sum(_b[i] for i in _ib[k]) / 9 for k in range(300)]
assert np.allclose(two_sample_ci(_a, _b, n_boot=300),
                   (_a.mean() - _b.mean(), percentile_reference(_loop, 0.025), percentile_reference(_loop, 0.975)))
test_eq(two_sample_ci([1.0, 1.0], [0.0, 0.0]), (1.0, 1.0, 1.0))  # no spread, no interval
test_fail(lambda: two_sample_ci([], [1.0]), contains="a and b")


# %%
#| export
def answered_items(path, hashes: dict, budget: int, methods: list[str]) -> pd.DataFrame:
    """The protocol's answers at B_SA = `budget` of `methods` on the items `hashes` (item hash -> (seed, depth)), from
    its grid at `path`: method, seed, depth, correct; empty where the grid is absent."""
    path = Path(path)
    if not path.exists(): return pd.DataFrame(columns=["method", "seed", "depth", "correct"])
    a = pd.read_csv(path)
    a = a[a.item.isin(hashes) & (a.budget == budget) & a.method.isin(methods)]
    return a.assign(seed=[hashes[h][0] for h in a.item], depth=[hashes[h][1] for h in a.item])[
        ["method", "seed", "depth", "correct"]]


# %%
#| export
def retention_by_answer(retention: pd.DataFrame, answers: pd.DataFrame, min_items: int = 16) -> pd.DataFrame:
    """Per method and selection (last chunk, last query): the items answered and missed (needle before the last
    chunk), each group's mean weighted retention per item and the difference with its interval (none under
    `min_items` items a group)."""
    per_item = pd.concat({pre or "chunk": weighted_retention(kept_and_mass(retention, pre), ["method", "seed", "depth"])
                          for pre in ("", "q1")}, axis=1).reset_index()
    joined = per_item.merge(answers, on=["method", "seed", "depth"])
    joined = joined[joined.depth < 1.0]
    rows = []
    for (m, sel), g in joined.melt(id_vars=["method", "seed", "depth", "correct"], value_vars=["chunk", "q1"],
                                   var_name="selection").groupby(["method", "selection"], sort=False):
        hit, miss = g.value[g.correct == 1], g.value[g.correct == 0]
        d, lo, hi = two_sample_ci(hit, miss) if min(len(hit), len(miss)) >= min_items else (np.nan,) * 3
        rows.append({"method": m, "selection": sel, "answered": len(hit), "missed": len(miss),
                     "retention_answered": hit.mean(), "retention_missed": miss.mean(), "diff": d, "lo": lo, "hi": hi})
    return pd.DataFrame(rows)


# %%
_grid = pd.DataFrame({"item": ["h1", "h2", "h3"], "budget": [8, 8, 16], "method": ["a", "b", "a"],
                      "correct": [1, 0, 1]})
with tempfile.TemporaryDirectory() as _d:
    _grid.to_csv(Path(_d)/"g.csv", index=False)
    _ans = answered_items(Path(_d)/"g.csv", {"h1": (0, 0.5), "h2": (0, 0.5), "h3": (1, 0.0)}, 8, ["a", "b"])
    test_eq(len(answered_items(Path(_d)/"none.csv", {}, 8, ["a"])), 0)
test_eq(_ans.values.tolist(), [["a", 0, 0.5, 1], ["b", 0, 0.5, 0]])
_split = retention_by_answer(_ret, _ans)
test_eq(_split[["method", "selection", "answered", "missed"]].values.tolist(),
        [["a", "chunk", 1, 0], ["b", "chunk", 0, 1], ["a", "q1", 1, 0], ["b", "q1", 0, 1]])
test_eq(round(_split.retention_answered[0], 12), round((0.1 + 0 + 0.05 + 0.3) / 0.8, 12))
assert _split["diff"].isna().all()  # fewer than 16 items a group: no interval


# %% [markdown]
# ## Accuracy and ablation tables

# %%
#| export
def accuracy_table(r: pd.DataFrame, budgets: list[int], methods: list[str]) -> pd.DataFrame:
    """Mean score per (length, budget, task) x method of the answer grid `r`, with the mean over tasks; dense (budget
    0) repeated at every budget of `budgets`."""
    rows = []
    for b in budgets:
        sub = pd.concat([r[r.method == "dense"].assign(budget=b), r[(r.method != "dense") & (r.budget == b)]])
        per_task = sub.groupby(["length", "budget", "task", "method"]).score.mean().unstack("method")
        rows.append(per_task)
        rows.append(per_task.groupby(["length", "budget"]).mean().assign(task="mean").set_index("task", append=True))
    return pd.concat(rows).sort_index()[list(methods)]


# %%
_acc = pd.DataFrame([{"length": 64, "task": t, "method": m, "budget": b, "score": s}
                     for t, m, b, s in [("x", "dense", 0, 1.0), ("x", "quoka", 8, 0.5), ("y", "dense", 0, 0.0),
                                        ("y", "quoka", 8, 1.0), ("x", "quoka", 16, 1.0), ("y", "quoka", 16, 1.0)]])
_tab = accuracy_table(_acc, [8, 16], ["dense", "quoka"])
test_eq(_tab.loc[(64, 8, "mean")].tolist(), [0.5, 0.75])
test_eq(_tab.loc[(64, 16, "x")].tolist(), [1.0, 1.0])


# %%
#| export
def ablation_frame(fid: pd.DataFrame, kind: str, budget: int, chunk_size: int) -> pd.DataFrame:
    """Mean fidelity of QuoKA along one swept parameter `kind` (B_SA, N_Q or B_CP) of the per-layer fidelity rows
    `fid`, the others at their defaults (B_SA = `budget`, B_CP = `chunk_size`): length, value, metrics, param."""
    if kind == "B_SA": sub, x = fid[(fid.method == "quoka") & (fid.chunk == chunk_size)], "budget"
    elif kind == "N_Q":
        sub = fid[fid.method.str.startswith("quoka_nq") & (fid.budget == budget) & (fid.chunk == chunk_size)].copy()
        sub["n_q"], x = sub.method.str[len("quoka_nq"):].astype(int), "n_q"
    elif kind == "B_CP": sub, x = fid[(fid.method == "quoka") & (fid.budget == budget)], "chunk"
    else: raise ValueError(f"kind must be 'B_SA', 'N_Q' or 'B_CP', got {kind!r}")
    return (sub.groupby(["length", x])[["mass_recall", "output_error"]].mean().reset_index()
            .rename(columns={x: "value"}).assign(param=kind))


# %%
_fid = pd.DataFrame([{"length": 64, "method": m, "budget": b, "chunk": c, "layer": l, "mass_recall": r,
                      "output_error": 1 - r}
                     for m, b, c, r in [("quoka", 8, 16, 0.5), ("quoka", 16, 16, 0.7), ("quoka_nq2", 16, 16, 0.6),
                                        ("quoka", 16, 8, 0.9)] for l, r in ((0, r), (1, r + 0.1))])
test_eq(ablation_frame(_fid, "B_SA", 16, 16).value.tolist(), [8, 16])
test_close(ablation_frame(_fid, "N_Q", 16, 16)[["value", "mass_recall"]].values, [[2, 0.65]])
test_eq(ablation_frame(_fid, "B_CP", 16, 16).value.tolist(), [8, 16])
test_fail(lambda: ablation_frame(_fid, "N", 16, 16), contains="kind")


# %% [markdown]
# ## The ablations on the protocol's items
#
# The `protocol` stage answers calibrated retrieval items with QuoKA at several settings: every label of its
# `method_specs` whose method is `quoka`. Each label's settings are read back from the method the registry builds
# (so a default changed in `sparsekv.methods` shows), and its answers from the protocol's grid.

# %%
#| export
def protocol_params(profile: str) -> dict:
    "The `protocol` stage's parameters in `profile` (its notebook's defaults under the profile's); {} if none."
    stage = next((s for s in load_stages(find_pipeline(), profile) if s.name == "protocol"), None)
    return {} if stage is None else {**notebook_parameters(stage.notebook), **stage.params}


# %%
#| export
def protocol_quoka_settings(params: dict) -> pd.DataFrame:
    "The protocol's QuoKA labels (of `params`), each with its B_CP, N_Q, query ranking and head aggregation."
    rows = []
    for label, spec in params.get("method_specs", {}).items():
        spec = {k: v for k, v in spec.items() if k != "budgets"}
        if spec.pop("name", label) != "quoka": continue
        m = make("quoka", budget=1, **{"chunk_size": params["chunk_size"], **spec})
        rows.append({"method": label, "B_CP": m.chunk_size, "N_Q": m.n_q, "queries": m.query_rank, "heads": m.gqa_agg})
    return pd.DataFrame(rows, columns=["method", "B_CP", "N_Q", "queries", "heads"])


# %%
_set = protocol_quoka_settings({"chunk_size": 64, "method_specs": {
    "quoka": {"budgets": [8]}, "quoka_nq4": {"name": "quoka", "n_q": 4}, "dense": {}, "sparq": {"name": "sparq"}}})
test_eq(_set.values.tolist(), [["quoka", 64, 16, "dissimilar", "mean"], ["quoka_nq4", 64, 4, "dissimilar", "mean"]])
test_eq(len(protocol_quoka_settings({})), 0)
_pp = protocol_params("cpu")  # the pipeline's protocol stage: its notebook's parameters under the profile's
assert "method_specs" in _pp and "chunk_size" in _pp


# %%
#| export
def protocol_answers(path, labels) -> pd.DataFrame:
    """The protocol's answers of dense and of `labels` from its grid at `path` (method, budget, cell, item, correct);
    empty where the grid is absent."""
    path = Path(path)
    if not path.exists(): return pd.DataFrame(columns=["method", "budget", "cell", "item", "correct"])
    a = pd.read_csv(path)
    return a[a.method.isin(["dense", *labels])][["method", "budget", "cell", "item", "correct"]]


# %%
#| export
def paired_vs(answers: pd.DataFrame, x: pd.Series, method: str, budget=None, min_items: int = 16) -> tuple:
    """`x` (correct per item) minus `method`'s answers (at `budget`) on the same items: (diff, lo, hi); nan under
    `min_items` items."""
    other = answers[(answers.method == method) & ((answers.budget == budget) if budget is not None else True)]
    y = other.set_index("item").correct.reindex(x.index).dropna()
    return paired_ci(x[y.index], y) if len(y) >= min_items else (np.nan,) * 3


# %%
#| export
def protocol_ablation(settings: pd.DataFrame, answers: pd.DataFrame, lengths: dict,
                      min_items: int = 16) -> pd.DataFrame:
    """Per QuoKA label of `settings`, budget and cell (of length `lengths[cell]`): items, accuracy, minus dense and
    minus the default QuoKA at that budget (paired intervals, none under `min_items` items)."""
    rows = []
    for (m, b, cell), g in answers[answers.method != "dense"].groupby(["method", "budget", "cell"]):
        x, base = g.set_index("item").correct, answers[answers.cell == cell]
        vs_quoka = (np.nan,) * 3 if m == "quoka" else paired_vs(base, x, "quoka", b, min_items)
        rows.append({"method": m, "B_SA": b, "cell": cell, "B_SA/L": b / lengths[cell], "n": len(x),
                     "accuracy": x.mean(),
                     **dict(zip(["dense_diff", "dense_lo", "dense_hi"], paired_vs(base, x, "dense", None, min_items))),
                     **dict(zip(["quoka_diff", "quoka_lo", "quoka_hi"], vs_quoka))})
    cols = ["method", "B_SA", "cell", "B_SA/L", "n", "accuracy", *(f"{who}_{part}" for who in ("dense", "quoka")
                                                                   for part in ("diff", "lo", "hi"))]
    return settings.merge(pd.DataFrame(rows, columns=cols), on="method")


# %%
# a loop: each label's accuracy minus the default's, item by item, is the table's mean difference
_rng = np.random.default_rng(0)
_answers = pd.DataFrame([{"method": m, "budget": 0 if m == "dense" else 8, "cell": "c", "item": f"i{i}",
                          "correct": int(_rng.random() < p)}
                         for m, p in (("dense", 0.9), ("quoka", 0.6), ("quoka_nq4", 0.4)) for i in range(20)])
with tempfile.TemporaryDirectory() as _d:
    _answers.to_csv(Path(_d)/"g.csv", index=False)
    test_eq(len(protocol_answers(Path(_d)/"g.csv", ["quoka"])), 40)
    test_eq(len(protocol_answers(Path(_d)/"none.csv", ["quoka"])), 0)
_abl = protocol_ablation(_set, _answers, {"c": 64})
_c = lambda m: _answers[_answers.method == m].set_index("item").correct
test_eq(_abl.n.tolist(), [20, 20])
assert np.isclose(_abl.quoka_diff[1], (_c("quoka_nq4") - _c("quoka")).mean())
assert np.isclose(_abl.dense_diff[0], (_c("quoka") - _c("dense")).mean()) and np.isnan(_abl.quoka_diff[0])
assert np.isnan(paired_vs(_answers, _c("quoka"), "dense", min_items=21)[0])


# %%
#| export
def ci_text(diff: float, lo: float, hi: float) -> str:
    "A difference and its interval as 'diff [lo, hi]', signed, three decimals."
    return f"{diff:+.3f} [{lo:+.3f}, {hi:+.3f}]"


# %%
#| export
def with_intervals(df: pd.DataFrame) -> pd.DataFrame:
    "`df` with each (diff, lo, hi) triple shown as one 'diff [lo, hi]' column (* where 0 is outside; blank: none)."
    out = df.drop(columns=[c for c in df if c.endswith(("_diff", "_lo", "_hi"))])
    for who in ("dense", "quoka"):
        d, lo, hi = df[f"{who}_diff"], df[f"{who}_lo"], df[f"{who}_hi"]
        out[f"vs {who}"] = [("" if np.isnan(x) else ci_text(x, l, h) + ("*" if l > 0 or h < 0 else ""))
                            for x, l, h in zip(d, lo, hi)]
    return out.round({"accuracy": 3, "B_SA/L": 3})


# %%
test_eq(ci_text(0.1, -0.05, 0.25), "+0.100 [-0.050, +0.250]")
_w = with_intervals(pd.DataFrame({"accuracy": [0.51234], "B_SA/L": [0.1], "dense_diff": [-0.2], "dense_lo": [-0.3],
                                  "dense_hi": [-0.1], **{f"quoka_{p}": [np.nan] for p in ("diff", "lo", "hi")}}))
test_eq(_w.to_dict("records"),
        [{"accuracy": 0.512, "B_SA/L": 0.1, "vs dense": "-0.200 [-0.300, -0.100]*", "vs quoka": ""}])

# %%
#| export
SETTINGS = ["B_CP", "N_Q", "queries", "heads"]

def varied_alone(settings: pd.DataFrame, ablation: pd.DataFrame, col: str) -> pd.DataFrame:
    "The rows of `ablation` (`protocol_ablation`) of the QuoKA labels that differ from the default in `col` alone."
    base = settings.set_index("method").loc["quoka", SETTINGS]
    alone = [r.method for _, r in settings.iterrows() if list(base.index[r[SETTINGS].values != base.values]) == [col]]
    return ablation[ablation.method.isin(alone)]


# %%
test_eq(varied_alone(_set, _abl, "N_Q").method.tolist(), ["quoka_nq4"])
test_eq(len(varied_alone(_set, _abl, "B_CP")), 0)


# %%
#| export
def protocol_claim_rows(settings: pd.DataFrame, ablation: pd.DataFrame, why: str, min_items: int = 16) -> list[str]:
    """Paper-vs-ours rows for QuoKA §4.5's claims on the protocol's accuracy (`protocol_ablation` of `settings`;
    `why`: why ours differ); none where the protocol has no default QuoKA."""
    if "quoka" not in set(ablation.method): return []
    q = ablation[ablation.method == "quoka"].dropna(subset=["dense_diff"])
    worst = q.loc[q.groupby("B_SA").dense_diff.idxmin()]
    within = worst[worst.dense_diff >= -0.03]
    small = (f"fewer than {min_items} items a cell: not compared" if not len(q) else
             f"within 3% of dense in every cell from B_SA/L = {within['B_SA/L'].min():.1%}" if len(within) else
             "more than 3% behind dense at every measured B_SA; worst cell: " + "; ".join(
                 f"{r['B_SA/L']:.1%} ({r.cell}) {ci_text(r.dense_diff, r.dense_lo, r.dense_hi)}"
                 for _, r in worst.iterrows()))
    per_change = lambda col: "; ".join(f"{col} = {r[col]} at B_SA {r.B_SA}, {r.cell}: {r.accuracy:.3f}, vs the default "
                                       f"{ci_text(r.quoka_diff, r.quoka_lo, r.quoka_hi)}"
                                       for _, r in varied_alone(settings, ablation, col).dropna(subset=["quoka_diff"])
                                       .iterrows())
    base = settings.set_index("method").loc["quoka"]
    return [f"| small loss under sparsity, on the protocol's accuracy | §4.5 (as above) | {small} | {why} |",
            f"| N_Q = B_CP/16 costs little (Table 12), on accuracy | §4.5 (as above) | default N_Q = {base.N_Q}, "
            f"B_CP = {base.B_CP}; {per_change('N_Q') or 'no other N_Q measured'} | as above |",
            f"| stable under B_CP (Table 11), on accuracy | §4.5 (as above) | default B_CP = {base.B_CP}; "
            f"{per_change('B_CP') or 'no other B_CP measured'} (N_Q = {base.N_Q} throughout) | as above |"]


# %%
_rows = protocol_claim_rows(_set, _abl, "why")
test_eq(len(_rows), 3)
assert "N_Q = 4 at B_SA 8, c: " in _rows[1] and "no other B_CP measured" in _rows[2]
test_eq(protocol_claim_rows(_set, _abl[_abl.method != "quoka"], "why"), [])


# %% [markdown]
# ## Observations: the queries and keys of a chunk
#
# The observations stage captures the post-RoPE queries, keys and values of the last chunk of a dense chunked
# prefill, and asks of each query how many keys hold most of its attention (QuoKA Fig. 2(a)) and of each key how
# its attention over the chunk's queries is spread (Fig. 3).

# %%
#| export
class LayerCapture(DensePolicy):
    "Dense attention that keeps, per layer in `layers`, the post-RoPE q, k, v and the scale of its latest call."

    def __init__(self, layers):
        self.layers, self.qkv = set(layers), {}

    def attend(self, q, k, v, ctx):
        if ctx.layer_idx in self.layers:
            self.qkv[ctx.layer_idx] = (q.detach().clone(), k.detach().clone(), v.detach().clone(), ctx.scale)
        return super().attend(q, k, v, ctx)


# %%
#| export
def last_chunk(model, ids: torch.Tensor, layers, chunk_size: int) -> dict:
    "Per layer in `layers`: (q, k, v, scale) of the last chunk of a dense chunked prefill of `ids` (q: that chunk's)."
    capture = LayerCapture(layers)
    chunked_prefill(model, ids, chunk_size, capture)
    return capture.qkv


# %%
_ids40 = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(0))  # the ids _rec recorded
_qkv = last_chunk(tiny, _ids40, [1], 16)
test_eq(list(_qkv), [1])
test_eq(_qkv[1][0].shape[2], 40 - 32)  # the last chunk's 8 queries
test_eq(_qkv[1][1].shape[2], 40)       # over all keys
test_eq(_qkv[1][1][:, :, :20], _rec.kv[1][0][:, :, :20])  # the keys LastChunksRecorder recorded


# %%
#| export
def keys_for_mass(p: torch.Tensor, mass: float) -> torch.Tensor:
    "Per row of probabilities `p`, the smallest number of entries (largest first) summing to at least `mass`."
    cum = p.sort(dim=-1, descending=True).values.cumsum(-1)
    return (cum < mass).sum(-1) + 1


# %%
test_eq(keys_for_mass(torch.tensor([[0.5, 0.05, 0.4, 0.05], [1.0, 0, 0, 0]]), 0.9).tolist(), [2, 1])


# %%
#| export
def chunk_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention probabilities `[Hq,S,Sk]` (float64) of the chunk's S queries q `[1,Hq,S,D]` (the last S
    positions) over all keys k `[1,Hkv,Sk,D]`."""
    S, Sk = q.shape[2], k.shape[2]
    logits = scale * q[0].double() @ k[0].double().repeat_interleave(q.shape[1] // k.shape[1], 0).transpose(-1, -2)
    seen = torch.arange(Sk)[None] <= torch.arange(Sk - S, Sk)[:, None]
    return logits.masked_fill(~seen, float("-inf")).softmax(-1)


# %%
# the probabilities times v are the model's attention output on the chunk
_q, _k, _v, _s = _qkv[1]
_p = chunk_probs(_q, _k, _s)
torch.testing.assert_close(_p.sum(-1), torch.ones(_p.shape[:2], dtype=torch.float64))
assert (_p[:, 0, _k.shape[2] - 8 + 1:] == 0).all()  # the chunk's first query sees none of the later chunk keys
_o = torch.nn.functional.scaled_dot_product_attention(_q, _k.repeat_interleave(2, 1), _v.repeat_interleave(2, 1),
                                                      attn_mask=causal_mask(8, 40)[None, None], scale=_s)
torch.testing.assert_close((_p @ _v[0].double().repeat_interleave(2, 0)).float(), _o[0], atol=1e-5, rtol=1e-4)


# %%
#| export
def spearman(x: pd.Series, y: pd.Series) -> float:
    "Spearman rank correlation (Pearson correlation of the average ranks)."
    return x.rank().corr(y.rank())


# %%
assert abs(spearman(pd.Series([1, 2, 3, 4]), pd.Series([10, 9, 2, 1])) + 1) < 1e-12
test_close(spearman(pd.Series([1, 2, 3, 4, 5]), pd.Series([1, 3, 2, 5, 4])), 1 - 6 * 4 / (5 * 24))  # 1 - 6Σd²/(n(n²-1))


# %%
#| export
def query_similarity(q: torch.Tensor) -> torch.Tensor:
    "Cosine `[Hq,S]` (float64) of each query of the chunk q `[1,Hq,S,D]` with its head's mean query M_Q."
    return F.cosine_similarity(q[0].double(), q[0].double().mean(1, keepdim=True), dim=-1)


# %%
_qq = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])  # mean (2/3, 2/3): the direction (1, 1)
test_close(query_similarity(_qq)[0].tolist(), [2 ** -0.5, 2 ** -0.5, 1.0])


# %%
#| export
def head_premise(q: torch.Tensor, k: torch.Tensor, scale: float, mass: float = 0.9) -> np.ndarray:
    "Per query head, the Spearman correlation of cos(M_Q, q_i) with the keys holding `mass` of q_i's attention: [Hq]."
    n90 = keys_for_mass(chunk_probs(q, k, scale), mass).double()
    cos = query_similarity(q)
    return np.array([spearman(pd.Series(cos[h].numpy()), pd.Series(n90[h].numpy())) for h in range(q.shape[1])])


# %%
# the per-head statistic by hand for each head
_n = keys_for_mass(chunk_probs(_q, _k, _s), 0.9)
_ref = [spearman(pd.Series(query_similarity(_q)[h].numpy()), pd.Series(_n[h].double().numpy()))
        for h in range(_q.shape[1])]
np.testing.assert_allclose(head_premise(_q, _k, _s), _ref, rtol=0, atol=1e-12)


# %%
#| export
def window_ids(tok, w: int, length: int, offset: int = 0) -> torch.Tensor:
    "Prose window `w` (consecutive windows of `length` tokens from `offset` in `token_stream`) as [1, length] ids."
    start = offset + w * length
    return token_stream(tok)[start:start + length][None]


# %%
test_eq(window_ids(tiny_tok, 2, 30, 5)[0], token_stream(tiny_tok)[65:95])


# %%
#| export
def chunk_fidelity(q, k, v, scale: float, idx: torch.Tensor) -> tuple[float, float]:
    "Mean mass recall and relative output error of the chunk q over its earlier keys `idx` [1,Hkv,n] and its own keys."
    S, Sk = q.shape[2], k.shape[2]
    keep = torch.ones(1, k.shape[1], 1, Sk, dtype=torch.bool)
    keep[..., :Sk - S] = torch.zeros(1, k.shape[1], Sk - S, dtype=torch.bool).scatter(2, idx, True)[:, :, None]
    m, e = attention_fidelity(q, k, v, keep, causal_mask(S, Sk)[None, None], scale=scale)
    return m.nanmean().item(), e.nanmean().item()


# %%
#| export
RANKINGS = ("all", "dissimilar", "similar", "random")

def ranking_select(q, k_earlier, budget: int, ranking: str, n_q: int = 16, generator=None) -> torch.Tensor:
    """QuoKA's earlier keys for the chunk q with its `n_q` queries chosen by `ranking` ('all': every query; 'random':
    drawn by `generator`)."""
    if ranking == "all": return quoka_select(q, k_earlier, q.shape[2], budget)
    return quoka_select(q, k_earlier, n_q, budget, query_rank=ranking, generator=generator)


# %%
# a full budget keeps every key under every ranking: exact attention
for _r in RANKINGS:
    _m, _e = chunk_fidelity(_q, _k, _v, _s, ranking_select(_q, _k[:, :, :-8], 32, _r, 4, torch.Generator()))
    assert abs(_m - 1) < 1e-6 and _e < 1e-5, (_r, _m, _e)
# a smaller one: the recall is the dense probability mass on the kept keys plus the chunk's own
_idx = ranking_select(_q, _k[:, :, :-8], 10, "dissimilar", 4)
_keep = torch.zeros(2, 40, dtype=torch.bool)
_keep[:, 32:] = True
_keep[:, :32] = torch.zeros(2, 32, dtype=torch.bool).scatter(1, _idx[0], True)
test_close(chunk_fidelity(_q, _k, _v, _s, _idx)[0],
           (_p * _keep.repeat_interleave(2, 0)[:, None]).sum(-1).mean().item(), eps=1e-6)


# %% [markdown]
# ## Latency: one chunk's attention, timed
#
# The latency stage times what a policy computes for one chunk of chunked prefill on random tensors: a method's
# selection of earlier keys, then the gather and SDPA over the kept keys and the chunk's own
# (`sparse_chunk_attention`), against SDPA over every key (`dense_chunk_attention`). With one intra-op thread the
# clock is the thread's CPU time, blind to waits for a core on a shared machine.

# %%
#| export
def clock() -> float:
    "Seconds on this thread's CPU clock with one intra-op thread (blind to waits on a shared machine), else wall time."
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


# %%
#| export
def sparse_chunk_attention(select, q, k, v):
    """One chunk as a selection policy computes it (select earlier keys, add the chunk's own, gather + SDPA): the
    output, the selection's seconds and the total seconds."""
    T, S = k.shape[2] - q.shape[2], q.shape[2]
    t0 = clock()
    idx = select(q, k[:, :, :T])
    t1 = clock()
    out = attend_selected(q, k, v, add_chunk_keys(idx, k.shape[2], S))
    return out, t1 - t0, clock() - t0


# %%
#| export
def dense_chunk_attention(q, k, v):
    "One chunk of dense chunked prefill (SDPA over all T + S keys): the output, 0 and the total seconds."
    t0 = clock()
    out = dense_attention(q, k, v)
    return out, 0.0, clock() - t0


# %%
#| export
def chunk_tensors(Hq: int, Hkv: int, D: int, T: int, S: int, dtype: torch.dtype, seed: int):
    "Random q [1,Hq,S,D] and k, v [1,Hkv,T+S,D] (the chunk's own keys last), seeded."
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, S, D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, T + S, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


# %%
# a selection of every key reproduces dense attention, so the sparse path computes what the dense one does
_q, _k, _v = chunk_tensors(6, 2, 16, 200, 32, torch.float64, 0)
test_eq([_q.shape, _k.shape], [(1, 6, 32, 16), (1, 2, 232, 16)])
_out, _sel_s, _tot_s = sparse_chunk_attention(lambda q, k: quoka_select(q, k, n_q=4, budget=10_000), _q, _k, _v)
torch.testing.assert_close(_out, dense_chunk_attention(_q, _k, _v)[0])
assert 0 <= _sel_s <= _tot_s
test_eq(chunk_tensors(6, 2, 16, 200, 32, torch.float64, 0)[1], _k)  # seeded


# %%
#| export
def best_split(f, repeats: int) -> tuple[float, float]:
    "(selection, total) seconds of the fastest of `repeats` calls of `f` after a warm-up: both parts from one call."
    check_int(repeats, "repeats", 1)
    f()
    return min((f()[1:] for _ in range(repeats)), key=lambda st: st[1])


# %%
_times = iter([(None, 0.5, 3.0), (None, 0.1, 2.0), (None, 0.9, 1.0), (None, 0.2, 4.0)])
test_eq(best_split(lambda: next(_times), 3), (0.9, 1.0))  # the warm-up's (0.5, 3.0) is not counted
test_fail(lambda: best_split(lambda: (None, 0, 0), 0), contains="repeats")


# %%
#| export
def cached_quoka_select(k_cache: torch.Tensor, chunk_size: int, n_q: int, budget: int):
    """QuokaPolicy's selection for the chunk after k_cache, `(q, k) -> [B,Hkv,B_SA]`: a `UnitKeyCache` holds all but
    the last `chunk_size` keys' unit keys; each call adds those and selects (from the same state every call)."""
    T = k_cache.shape[2]
    units = UnitKeyCache()
    units.update(k_cache[:, :, :T - chunk_size])

    def select(q, k):
        units.crop(T - chunk_size)  # the state before this chunk, for every repeat
        return quoka_select(q, k, n_q=n_q, budget=budget, k_unit=units.update(k))
    return select


# %%
# the cached path selects exactly what quoka_select selects, on every repeat
_q, _k, _ = chunk_tensors(6, 2, 16, 4 * 16, 16, torch.float32, 0)
_sel = cached_quoka_select(_k[:, :, :64], 16, 4, 20)
for _ in range(2): test_eq(_sel(_q, _k[:, :, :64]), quoka_select(_q, _k[:, :, :64], n_q=4, budget=20))


# %%
#| export
def floor_select(q, k_cache, n_q: int, budget: int):
    """QuoKA's floor as a selection `(q, k) -> [B,Hkv,B_SA]`: one product of the pre-aggregated unit queries
    (computed here, outside the timing) with the cached unit keys, its max over queries, the top-B_SA."""
    G = q.shape[1] // k_cache.shape[1]
    qbar = preaggregated_queries(q, select_queries(q, n_q, G), G)
    k_unit = UnitKeyCache().update(k_cache).contiguous()
    return lambda q, k: top_budget_indices((qbar @ k_unit.mT).amax(2), budget)


# %%
# the floor is QuoKA's selection without its checks and query choice: the same keys
test_eq(floor_select(_q, _k[:, :, :64], 4, 20)(_q, None).sort(-1).values,
        quoka_select(_q, _k[:, :, :64], n_q=4, budget=20).sort(-1).values)


# %%
#| export
def selection_over_floor(select, floor, q, k, v, pairs: int) -> float:
    """Median over `pairs` of select's time over floor's, both timed as a chunk's selection, back to back in
    alternating order."""
    check_int(pairs, "pairs", 1)
    sparse_chunk_attention(select, q, k, v), sparse_chunk_attention(floor, q, k, v)  # warm-up
    ratios = []
    for j in range(pairs):
        order = (select, floor) if j % 2 else (floor, select)
        t = dict(zip(order, (sparse_chunk_attention(f, q, k, v)[1] for f in order)))
        ratios.append(t[select] / t[floor])
    return statistics.median(ratios)


# %%
# a selection that sleeps 0.3 s against one that does not, on the wall clock (two intra-op threads): the median of
# three pairs is well above 1 even on a busy machine
_threads = torch.get_num_threads()
torch.set_num_threads(2)
_slow = lambda q, k: time.sleep(0.3) or quoka_select(q, k, n_q=4, budget=20)
_fast = lambda q, k: quoka_select(q, k, n_q=4, budget=20)
assert selection_over_floor(_slow, _fast, _q, _k, _k, 3) > 1.5
torch.set_num_threads(_threads)


# %%
#| export
def gather_seconds(idx, k, v, S: int, repeats: int) -> float:
    """Best of `repeats` times (after a warm-up) of the policy's gather: the chunk's own keys appended to idx, keys and
    values gathered."""
    check_int(repeats, "repeats", 1)
    def f():
        t0 = clock()
        full = add_chunk_keys(idx, k.shape[2], S)
        gather_keys(k, full), gather_keys(v, full)
        return clock() - t0
    f()
    return min(f() for _ in range(repeats))


# %%
assert 0 <= gather_seconds(_sel(_q, _k[:, :, :64]), _k, _k, 16, 2) < 1


# %%
#| export
def selectors(k_cache: torch.Tensor, chunk_size: int, n_q: int, budget: int) -> dict:
    """Each method's selection of earlier keys, `(q_chunk, k_cache) -> [B,Hkv,B_SA]`: QuoKA with its unit-key cache
    and without (`quoka_nocache`) and the baselines (Loki's basis precomputed here, outside the timing)."""
    basis = loki_basis(k_cache)
    return {"quoka": cached_quoka_select(k_cache, chunk_size, n_q, budget),
            "quoka_nocache": partial(quoka_select, n_q=n_q, budget=budget),
            "mean_scores": partial(mean_score_select, budget=budget),
            "sample_attention": partial(sample_attention_select, budget=budget, n_q=n_q),
            "loki": partial(loki_select, budget=budget, basis=basis),
            "sparq": partial(sparq_select, budget=budget)}


# %%
_sels = selectors(_k[:, :, :64], 16, 4, 20)
test_eq(_sels["loki"](_q, _k[:, :, :64]), loki_select(_q, _k[:, :, :64], 20))  # the cache's basis is its own
test_eq(_sels["quoka"](_q, _k[:, :, :64]), _sels["quoka_nocache"](_q, _k[:, :, :64]))
test_eq(_sels["sample_attention"](_q, _k[:, :, :64]), sample_attention_select(_q, _k[:, :, :64], 20, n_q=4))


# %%
#| export
class OpCount(TorchDispatchMode):
    "Count the ATen operations run inside the `with` block (`n`)."
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


# %%
#| export
def op_count(f) -> int:
    "ATen operations of one call of f, after a warm-up call (a unit-key buffer has grown)."
    f()
    with OpCount() as c: f()
    return c.n


# %%
_x = torch.ones(3)
test_eq(op_count(lambda: (_x + 1).mul(2).sum()), 3)


# %%
#| export
def time_chunk(model_name: str, Hq: int, Hkv: int, D: int, T: int, dtype_name: str, n_threads: int, methods: list,
               chunk_size: int = 128, budget: int = 1024, n_q: int = 16, repeats: int = 3, floor_pairs: int = 21,
               seed: int = 0) -> list[dict]:
    """Rows (one per method of `methods`: 'dense' or a key of `selectors`) of the best total time of one chunk of T
    cached keys with these head shapes, and the selection time within it; QuoKA's row adds its gather, its floor and
    its selection over the floor (the function `selection_over_floor`). Sets torch's intra-op threads to
    `n_threads`."""
    torch.set_num_threads(n_threads)
    q, k, v = chunk_tensors(Hq, Hkv, D, T, chunk_size, getattr(torch, dtype_name), seed)
    sel = selectors(k[:, :, :T], chunk_size, n_q, budget)
    base = {"model": model_name, "heads": f"{Hq}/{Hkv}x{D}", "T": T, "dtype": dtype_name, "threads": n_threads}
    rows = []
    for m in methods:
        f = (partial(dense_chunk_attention, q, k, v) if m == "dense"
             else partial(sparse_chunk_attention, sel[m], q, k, v))
        selection_s, total_s = best_split(f, repeats)
        rows.append({**base, "method": m, "seconds": total_s, "selection_seconds": selection_s})
    idx, quoka_row = sel["quoka"](q, k[:, :, :T]), rows[methods.index("quoka")]
    quoka_row["gather_seconds"] = gather_seconds(idx, k, v, chunk_size, repeats)
    # timed where QuoKA's selection is timed, inside a chunk (after the last chunk's attention left the caches cold)
    floor = floor_select(q, k[:, :, :T], n_q, budget)
    quoka_row["floor_seconds"] = best_split(partial(sparse_chunk_attention, floor, q, k, v), repeats)[0]
    quoka_row["selection_over_floor"] = selection_over_floor(sel["quoka"], floor, q, k, v, floor_pairs)
    return rows


# %%
_rows = time_chunk("tiny", 6, 2, 16, 64, "float32", _threads, ["dense", "quoka", "sparq"], 16, 20, 4, 2, 3)
test_eq([r["method"] for r in _rows], ["dense", "quoka", "sparq"])
test_eq(_rows[0]["selection_seconds"], 0.0)
assert all(0 <= r["selection_seconds"] <= r["seconds"] for r in _rows)
assert {"gather_seconds", "floor_seconds", "selection_over_floor"} <= set(_rows[1])
torch.set_num_threads(_threads)
