# %% [markdown]
# # OVAL experiments
#
# > The machinery of the OVAL stages: retrieval arms, quality on captured activations, decoding arms side by side, tables and decode latency.

# %%
#| default_exp oval.experiments

# %% [markdown]
# The OVAL stages [`oval_quality`](../reproduce/30_oval_quality.ipynb),
# [`oval_latency`](../reproduce/31_oval_latency.ipynb) and [`oval_tasks`](../reproduce/32_oval_tasks.ipynb)
# read as documents: parameters, one grid, the tables, the figures.
# The functions they call live here, each with a check. They use the library's page retrieval
# ([the pages notebook](32_oval_pages.ipynb)) and its summaries
# ([the summaries notebook](31_oval_summaries.ipynb)); nothing here changes what those compute.
#
# An *arm* is one way to attend at decode: full attention, or page retrieval with one summary
# (`"quest"`, `"arkvale"`, `"keypca"`, `"oval"` at some $\eta$, `"oracle"`) within one budget.

# %%
#| export
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
from torch import Tensor

from sparsekv import methods
from sparsekv.attention import check_int
from sparsekv.data import make_task, packed_sequences, reasoning_problems, score_exact, token_stream
from sparsekv.eval import attention_fidelity, kl_to_teacher, run_grid, top1_agreement
from sparsekv.hf import AttentionContext, AttentionPolicy, attend_selected, chunked_prefill, dense_attention, patch
from sparsekv.models import model_info
from sparsekv.oval.basis import centre_page, check_eta, output_metric, page_basis, page_risks
from sparsekv.oval.pages import (
    CapturePolicy,
    PackedPages,
    PageRetrievalPolicy,
    aggregate_gqa,
    gather_pages,
    select_pages,
    top_pages,
)
from sparsekv.oval.summaries import build_summaries, score_pages, split_pages
from sparsekv.protocol import cpu_seconds

# %%
#| hide
from fastcore.test import test_close, test_eq, test_fail

# %%
import tempfile

from sparsekv.hf import DensePolicy
from sparsekv.models import tiny_model


# %% [markdown]
# ## Arms
#
# The page-retrieval arms of every OVAL stage, in the order of their tables: Quest, ArkVale, key
# PCA ($\eta = 0$), OVAL at each $\eta$, the oracle.

# %%
#| export
def retrieval_arms(etas: Sequence[float]) -> list[tuple[str, float]]:
    "The (summary, eta) of each page-retrieval arm: Quest, ArkVale, key PCA, OVAL at each of `etas`, the oracle."
    etas = list(etas)
    for e in etas: check_eta(e)
    return [("quest", 0.0), ("arkvale", 0.0), ("keypca", 0.0), *[("oval", e) for e in etas], ("oracle", 0.0)]


# %%
test_eq(retrieval_arms([0.5, 1.0])[3:5], [("oval", 0.5), ("oval", 1.0)])
test_eq([m for m, _ in retrieval_arms([])], ["quest", "arkvale", "keypca", "oracle"])
test_fail(lambda: retrieval_arms([1.5]), contains="eta")


# %%
#| export
def arm_label(method: str, eta: float) -> str:
    "The display name of an arm: 'oval eta=0.5' for OVAL, else the method's name."
    if not isinstance(method, str): raise TypeError(f"method must be a str, got {method!r}")
    return f"oval eta={eta:g}" if method == "oval" else method


# %%
test_eq([arm_label(m, e) for m, e in retrieval_arms([0.25])],
        ["quest", "arkvale", "keypca", "oval eta=0.25", "oracle"])


# %% [markdown]
# Each page-retrieval arm is one of the registry's methods (`sparsekv.methods`); its summary has
# a shorter name there (`key_pca` summarizes by `"keypca"`).

# %%
#| export
def registry_name(summary: str) -> str:
    "The name of the registered page-retrieval method whose summary is `summary` ('keypca' -> 'key_pca')."
    names = {methods.get(n).summary: n for n in methods.names("retrieval")}
    if summary not in names: raise ValueError(f"summary must be one of {sorted(names)}, got {summary!r}")
    return names[summary]


# %%
test_eq([registry_name(m) for m, _ in retrieval_arms([0.5])],
        ["quest", "arkvale", "key_pca", "oval", "oracle_pages"])
test_fail(lambda: registry_name("full"), contains="summary must be one of")


# %% [markdown]
# The stages' figures draw one metric against $\eta$: OVAL's curve starts at key PCA ($\eta = 0$),
# and each baseline is a dashed line.

# %%
#| export
def plot_eta_curve(ax, table: pd.DataFrame, metric: str, baselines: dict[str, str]):
    "Draw `metric` of the key PCA and OVAL rows of `table` against eta on `ax`, each baseline (method: colour) dashed."
    if metric not in table: raise ValueError(f"metric must be a column of table, got {metric!r}")
    spectral = table[table.method.isin(["keypca", "oval"])].sort_values("eta")  # key PCA is OVAL at eta = 0
    ax.plot(spectral.eta, spectral[metric], marker="o", color="C0", label="OVAL (eta = 0: key PCA)")
    for m, c in baselines.items():
        ax.axhline(table[table.method == m][metric].iloc[0], color=c, ls="--", lw=1.2, label=m)
    return ax


# %%
import matplotlib.pyplot as plt

_t = pd.DataFrame({"method": ["quest", "oval", "keypca", "oval"], "eta": [0.0, 1.0, 0.0, 0.5],
                   "m": [0.3, 0.9, 0.5, 0.7]})
_fig, _ax = plt.subplots()
plot_eta_curve(_ax, _t, "m", {"quest": "C1"})
test_eq(list(_ax.lines[0].get_ydata()), [0.5, 0.7, 0.9])
test_eq(list(_ax.lines[1].get_ydata()), [0.3, 0.3])
plt.close(_fig)


# %% [markdown]
# A stage's grid CSV is a resumable cache that may hold rows of other runs; `this_run` keeps the rows of
# this run's cells. `md_table` writes a table into a stage's summary.

# %%
#| export
def this_run(grid: pd.DataFrame, cells: list[dict], params: dict | None = None) -> pd.DataFrame:
    "The rows of `grid` whose keys are one of `cells` (each with the run's `params`), in the grid's order."
    want = pd.DataFrame([{**(params or {}), **c} for c in cells])
    res = grid.merge(want, on=list(want.columns))
    if len(res) != len(want): raise ValueError(f"grid holds {len(res)} rows of the {len(want)} cells of this run")
    return res


# %%
_grid = pd.DataFrame({"model": ["a", "a", "b"], "x": [1, 2, 1], "y": [0.1, 0.2, 0.3]})
test_eq(this_run(_grid, [{"x": 2}, {"x": 1}], {"model": "a"}).y.tolist(), [0.1, 0.2])
test_fail(lambda: this_run(_grid, [{"x": 3}], {"model": "a"}), contains="0 rows of the 1 cells")


# %%
#| export
def md_table(df: pd.DataFrame, floatfmt: str = ".3f") -> str:
    "`df` as a markdown table, numbers as `floatfmt` (a `budget_fraction` column written by '{:g}' first)."
    if "budget_fraction" in df: df = df.assign(budget_fraction=df.budget_fraction.map("{:g}".format))
    return df.to_markdown(index=False, floatfmt=floatfmt)


# %%
test_eq(md_table(pd.DataFrame({"budget_fraction": [0.0625], "x": [1 / 3]})).splitlines()[-1].split(),
        ["|", "0.062", "|", "0.333", "|"])     # tabulate reads numbers in text as numbers
test_eq(md_table(pd.DataFrame({"x": [1 / 3]}), ".4f").splitlines()[-1].split(), ["|", "0.3333", "|"])


# %% [markdown]
# ## Retrieval quality on captured activations
#
# The quality stage scores the pages of windows of real activations. A window is prose (from
# `sparsekv.data.packed_sequences`) or reasoning: math word problems, each followed by its answer.

# %%
#| export
def reasoning_window(tok, seq_len: int, seed: int) -> Tensor:
    "`seq_len` token ids of gsm_symbolic problems (seeded by `seed`), each followed by its answer, concatenated."
    check_int(seq_len, "seq_len", 1)
    n, ids = 16, torch.zeros(0, dtype=torch.long)
    while len(ids) < seq_len:
        n *= 2
        text = "".join(f"Question: {p['question']}\nAnswer: {p['answer']}\n\n"
                       for p in reasoning_problems("gsm_symbolic", n, seed=seed))
        ids = token_stream(tok, text)
    return ids[:seq_len]


# %%
model, tok = tiny_model()
_w = reasoning_window(tok, 200, seed=1)
test_eq(_w.shape, (200,))
assert tok.decode(_w).startswith("Question: "), tok.decode(_w)[:40]
test_eq(reasoning_window(tok, 200, seed=1), _w)


# %% [markdown]
# The activations of a window come from one dense forward pass under `CapturePolicy`. A layer never
# reads a later one, so the pass stops after the last layer measured.

# %%
#| export
def layer_activations(model, ids: Tensor, last_layer: int) -> dict:
    "(q, k, v) per layer of one dense forward pass over `ids` [1, S], through layers 0 to `last_layer` only."
    stack = model.model.layers
    check_int(last_layer, "last_layer", 0, len(stack) - 1)
    cap = CapturePolicy()
    model.model.layers = stack[:last_layer + 1]  # a layer's activations do not depend on the layers after it
    try:
        with torch.no_grad(), patch(model, cap): model(ids, logits_to_keep=1, use_cache=False)
    finally:
        model.model.layers = stack
    return cap.qkv


# %%
_ids = torch.randint(10, 200, (1, 96), generator=torch.Generator().manual_seed(0))
_cap = CapturePolicy()
with torch.no_grad(), patch(model, _cap): model(_ids, use_cache=False)
_act = layer_activations(model, _ids, 0)
test_eq(sorted(_act), [0])
for _a, _b in zip(_act[0], _cap.qkv[0]): test_eq(_a, _b)
test_eq(len(model.model.layers), 2)                # the model is whole again
test_fail(lambda: layer_activations(model, _ids, 2), contains="last_layer")


# %%
#| export
def layer_output_metric(model, layer: int) -> Tensor:
    "The output metric G [Hkv, d, d] of a layer, from its `o_proj` (`output_metric`)."
    info = model_info(model)
    check_int(layer, "layer", 0, info.num_layers - 1)
    W = model.model.layers[layer].self_attn.o_proj.weight.detach()
    return output_metric(W, info.num_q_heads, info.num_kv_heads, info.head_dim)


# %% [markdown]
# Check against the definition, $G_h = \sum_g W_{O,hG+g}^\top W_{O,hG+g}$ with $W_{O,j}$ the columns of
# `o_proj` that read query head $j$:

# %%
_W = model.model.layers[1].self_attn.o_proj.weight.detach()
_Hq, _Hkv, _d = 4, 2, 16
_ref = torch.stack([sum(_W[:, j * _d:(j + 1) * _d].T @ _W[:, j * _d:(j + 1) * _d] for j in range(h * 2, h * 2 + 2))
                    for h in range(_Hkv)])
test_close(layer_output_metric(model, 1), _ref, eps=1e-5)


# %% [markdown]
# The page weights of an arm: the last `n_queries` queries score every complete page with the arm's
# summaries, and the per-head page softmaxes are averaged over each GQA group (avgSM).

# %%
#| export
def arm_page_weights(method: str, eta: float, q: Tensor, k: Tensor, v: Tensor, page_size: int, rank: int,
                     n_queries: int, G: Tensor | None = None) -> Tensor:
    "avgSM page weights [1, Hkv, n_queries, P] of the last `n_queries` queries under `method`'s summaries (G: OVAL's)."
    check_int(n_queries, "n_queries", 1, q.shape[2])
    summ = build_summaries(method, k, v, page_size, rank, eta, G if method == "oval" else None)
    return aggregate_gqa(score_pages(method, summ, q[:, :, -n_queries:]), k.shape[1])


# %%
_q, _k, _v = _act[0]
_pw = arm_page_weights("quest", 0.0, _q, _k, _v, 8, 2, 4)
test_eq(_pw.shape, (1, 2, 4, 96 // 8))
test_close(_pw.sum(-1), torch.ones(1, 2, 4), eps=1e-5)   # a mean of softmaxes over the pages
test_fail(lambda: arm_page_weights("quest", 0.0, _q, _k, _v, 8, 2, 0), contains="n_queries")


# %% [markdown]
# Each arm keeps the sink, the recent tokens and its top pages within the budget; exact attention
# over the kept keys gives the **mass recall** and the **relative output error**
# (`sparsekv.eval.attention_fidelity`), averaged over query heads and queries. The arms run as the
# rows of one batch.

# %%
#| export
def arms_fidelity(q: Tensor, k: Tensor, v: Tensor, weights: list[Tensor], budget: int, page_size: int, sink: int,
                  recent: int, n_queries: int) -> list[tuple[float, float]]:
    "(mean mass recall, mean relative output error) of each arm's pages (`weights`: its page weights), batched."
    if not weights: raise ValueError("weights must hold the page weights of at least one arm")
    idx = torch.cat([select_pages(w, budget, page_size, sink, recent, k.shape[2]) for w in weights])
    A = len(weights)                                 # the same number of kept tokens for every arm
    qa = q[:, :, -n_queries:].expand(A, -1, -1, -1)
    mass, err = attention_fidelity(qa, k.expand(A, -1, -1, -1), v.expand(A, -1, -1, -1), idx)
    return [(mass[i].nanmean().item(), err[i].nanmean().item()) for i in range(A)]


# %%
_ws = [arm_page_weights(m, e, _q, _k, _v, 8, 2, 4) for m, e in retrieval_arms([1.0])]
_fid = arms_fidelity(_q, _k, _v, _ws, 32, 8, 8, 8, 4)
for _w, _f in zip(_ws, _fid): test_close(arms_fidelity(_q, _k, _v, [_w], 32, 8, 8, 8, 4)[0], _f, eps=1e-5)
assert max(m for m, _ in _fid) <= _fid[-1][0] + 1e-6   # the oracle keeps the pages of largest mass
test_close(arms_fidelity(_q, _k, _v, _ws[:1], 96, 8, 8, 8, 4)[0], (1.0, 0.0), eps=1e-5)  # everything kept


# %% [markdown]
# **Choosing $\eta$ (the Table 3 analogue).** For each test pool, budget and metric, $\eta$ is chosen
# on the calibration pool and frozen; the gap is to the best $\eta$ on the test pool itself. Key PCA
# and Quest on the test pool are kept for reference.

# %%
#| export
def choose_eta(res: pd.DataFrame, etas: Sequence[float], budgets: Sequence[int], test_pools: Sequence[str],
               calib_pool: str = "calib") -> pd.DataFrame:
    """Per test pool, budget and metric (mass_recall higher, output_error lower is better): eta chosen on `calib_pool`,
    its test value, the test-best eta and value, their gap, key PCA and Quest on the test pool."""
    out = []
    by = res.groupby(["pool", "budget", "method", "eta"])[["mass_recall", "output_error"]].mean()
    for pool in test_pools:
        for b in budgets:
            for metric_name, better in (("mass_recall", max), ("output_error", min)):
                cal = {e: by.loc[(calib_pool, b, "oval", e), metric_name] for e in etas}
                test = {e: by.loc[(pool, b, "oval", e), metric_name] for e in etas}
                e_cal, e_best = better(cal, key=cal.get), better(test, key=test.get)
                out.append({"test_pool": pool, "budget": b, "metric": metric_name, "eta_calibrated": e_cal,
                            "test_at_calibrated": test[e_cal], "eta_best_test": e_best, "test_best": test[e_best],
                            "gap": abs(test[e_cal] - test[e_best]),
                            "keypca_test": by.loc[(pool, b, "keypca", 0.0), metric_name],
                            "quest_test": by.loc[(pool, b, "quest", 0.0), metric_name]})
    return pd.DataFrame(out)


# %%
_res = pd.DataFrame([{"pool": p, "budget": 64, "method": m, "eta": e, "mass_recall": r, "output_error": 1 - r}
                     for p, rs in (("calib", (0.9, 0.8)), ("heldout", (0.6, 0.7)))
                     for (m, e), r in zip((("oval", 0.5), ("oval", 1.0)), rs)]
                    + [{"pool": "heldout", "budget": 64, "method": m, "eta": 0.0, "mass_recall": 0.5,
                        "output_error": 0.5} for m in ("keypca", "quest")])
_t3 = choose_eta(_res, [0.5, 1.0], [64], ["heldout"]).set_index("metric")
test_eq(_t3.loc["mass_recall", ["eta_calibrated", "eta_best_test"]].tolist(), [0.5, 1.0])
test_close(_t3.loc["mass_recall", "gap"], 0.1)
test_eq(_t3.loc["output_error", "eta_calibrated"], 0.5)    # lowest calibration error


# %% [markdown]
# The best OVAL $\eta$ per source and budget against the baselines, from the mean table of a stage
# (one row per source, budget, method and $\eta$).

# %%
#| export
def best_eta_summary(table4: pd.DataFrame) -> pd.DataFrame:
    "Per source and budget: best OVAL recall and error (over eta) beside key PCA's, Quest's and ArkVale's."
    rows = []
    for (src, b), t in table4.groupby(["source", "budget"], sort=False):
        t = t.set_index("arm")
        ov = t[t.method == "oval"]
        rows.append({"source": src, "budget": str(b), "best OVAL recall": ov.mass_recall.max(),
                     "key PCA recall": t.mass_recall["keypca"], "Quest recall": t.mass_recall["quest"],
                     "ArkVale recall": t.mass_recall["arkvale"], "best OVAL error": ov.output_error.min(),
                     "key PCA error": t.output_error["keypca"], "Quest error": t.output_error["quest"]})
    return pd.DataFrame(rows)


# %%
_t4 = pd.DataFrame([{"source": "prose", "budget": 64, "method": m, "eta": e, "arm": arm_label(m, e),
                     "mass_recall": r, "output_error": 1 - r}
                    for (m, e), r in zip(retrieval_arms([0.5, 1.0]), (0.4, 0.5, 0.6, 0.7, 0.65, 0.9))])
_s = best_eta_summary(_t4).iloc[0]
test_eq((_s["budget"], _s["best OVAL recall"], _s["key PCA recall"], _s["Quest recall"]), ("64", 0.7, 0.6, 0.4))
test_close(_s["best OVAL error"], 0.3)


# %% [markdown]
# ## Where the theory says OVAL should win
#
# The leading-order output-risk gain of OVAL at $\eta = 1$ over key PCA is $\rho = 1 + (1 - a)/\tau$
# ([the basis notebook](30_oval_basis.ipynb), §16): $a$ is the key–output alignment (the share of the
# best attainable output sensitivity that key PCA's basis captures), $\tau$ the output sensitivity
# beyond rank $r$ relative to the top $r$. `theory_rows` measures them on the complete pages of one
# window's layer, per KV head: $\rho$ as the ratio of the mean trace-form risks over pages, with the
# layer's $G$ and with $G = I$, and $G$'s condition number and effective rank
# $(\operatorname{tr}G)^2/\operatorname{tr}(G^2)$ as a share of $d$.

# %%
#| export
def theory_rows(k: Tensor, v: Tensor, G: Tensor, rank: int, page_size: int) -> list[dict]:
    """Per KV head of one window's keys and values [1, Hkv, T, d]: alignment a, tail tau and gain rho of OVAL (eta = 1)
    over key PCA with the metric G [Hkv, d, d] and with G = I, and G's condition number and effective rank share."""
    K, V, G = split_pages(k, page_size)[0].double(), split_pages(v, page_size)[0].double(), G.double()
    Gp = G[:, None]                                                 # one metric per KV head, shared by its pages
    _, X = centre_page(K)
    _, Y = centre_page(V)
    out = []
    for name, Gm in (("model", Gp), ("identity", None)):
        B0, B1 = (page_basis(K, V, Gm, rank=rank, eta=e)[1] for e in (0.0, 1.0))
        r0, r1 = page_risks(K, V, B0, Gm)[1], page_risks(K, V, B1, Gm)[1]
        YtX = Y.mT @ X
        M = YtX.mT @ (YtX if Gm is None else Gm @ YtX)              # M_out per page
        lam = torch.linalg.eigvalsh(M)
        top, total = lam[..., -B0.shape[-1]:].sum(-1), lam.sum(-1)
        a = (B0.mT @ M @ B0).diagonal(dim1=-2, dim2=-1).sum(-1) / top
        out.append({f"rho_{name}": (r0.mean(-1) / r1.mean(-1)).tolist(), f"alignment_{name}": a.mean(-1).tolist(),
                    f"tail_{name}": ((total - top) / top).mean(-1).tolist()})
    eig = torch.linalg.eigvalsh(G)
    spectrum = {"G_condition": (eig[:, -1] / eig[:, 0]).tolist(),
                "G_effective_rank": ((eig.sum(-1) ** 2 / (eig ** 2).sum(-1)) / G.shape[-1]).tolist()}
    return [{"kv_head": h, **{key: vals[h] for part in (*out, spectrum) for key, vals in part.items()}}
            for h in range(G.shape[0])]


# %% [markdown]
# Checks: with $G = I$ the two columns agree and the condition number is 1; OVAL's basis never has a
# larger output risk than key PCA's ($\rho \ge 1$), and the alignment is a share.

# %%
_rows = pd.DataFrame(theory_rows(_k, _v, torch.eye(16).expand(2, 16, 16), 2, 8))
test_close(_rows.rho_model.values, _rows.rho_identity.values, eps=1e-9)
test_close(_rows.alignment_model.values, _rows.alignment_identity.values, eps=1e-9)
test_close(_rows.G_condition.values, [1.0, 1.0])
_rows = pd.DataFrame(theory_rows(_k, _v, layer_output_metric(model, 0), 2, 8))
test_eq(_rows.kv_head.tolist(), [0, 1])
assert (_rows.rho_model >= 1 - 1e-9).all() and _rows.alignment_model.between(0, 1 + 1e-9).all()


# %% [markdown]
# ## Decoding the arms side by side
#
# The task stage prefills each prompt densely once and decodes every arm from a copy of that cache.
# `ArmsPolicy` is an attention policy over a batch whose row $b$ belongs to arm $b$: each attention call
# is split by rows, and row $b$ goes to `policies[b]` (its own page-retrieval policy with its own
# summaries, or dense attention).

# %%
#| export
class ArmsPolicy(AttentionPolicy):
    "Row b of every attention call goes to policies[b]: the arms of one prompt decoded side by side."
    def __init__(self, policies: list):
        if not policies or not all(isinstance(p, AttentionPolicy) for p in policies):
            raise TypeError("policies must be a non-empty list of AttentionPolicy")
        self.policies = list(policies)

    def __call__(self, q, k, v, ctx):
        if q.shape[0] != len(self.policies):
            raise ValueError(f"the batch has {q.shape[0]} rows, expected one per policy ({len(self.policies)})")
        def row(b):
            m = ctx.mask if ctx.mask is None or ctx.mask.shape[0] == 1 else ctx.mask[b:b + 1]
            return dataclasses.replace(ctx, key_positions=ctx.key_positions[b:b + 1], mask=m, cache=None)
        return torch.cat([p(q[b:b + 1], k[b:b + 1], v[b:b + 1], row(b)) for b, p in enumerate(self.policies)])


# %%
test_fail(lambda: ArmsPolicy([]), contains="policies")
test_fail(lambda: ArmsPolicy(["dense"]), contains="policies")


# %% [markdown]
# The prompt's last token is held back from the prefill, so that every answer token comes from a
# decode step.

# %%
#| export
def held_back_prefill(model, ids: Tensor, chunk_size: int) -> tuple:
    "The dense cache of the prompt `ids` [1, S] without its last token (`chunked_prefill`), and that token [1]."
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be one prompt [1, S] of S >= 2 tokens, got {getattr(ids, 'shape', ids)!r}")
    cache, _ = chunked_prefill(model, ids[:, :-1].to(model.device), chunk_size)
    return cache, ids[:, -1].to(model.device)


# %%
_ids = torch.randint(10, 200, (1, 100), generator=torch.Generator().manual_seed(1))
_cache, _first = held_back_prefill(model, _ids, 64)
test_eq((_cache.get_seq_length(), _first.tolist()), (99, [int(_ids[0, -1])]))
test_fail(lambda: held_back_prefill(model, _ids[0], 64), contains="ids must be")


# %% [markdown]
# `decode_arms` is the stages' one greedy loop. (`sparsekv.protocol.answer` decodes one method at a
# time through `generate`; this loop decodes the arms as one batch and can force the input tokens.)
# It copies the cache, repeats it once per arm and decodes greedily. With `teacher` tokens, the input
# after step $i$ is `teacher[i]` for every arm (teacher forcing), and the logits come back too.

# %%
#| export
def decode_arms(model, cache, first: Tensor, policies: list, n_new: int, teacher: Tensor | None = None) -> tuple:
    """Greedy tokens [A, n_new] of each of the A arms (`policies`) from a copy of `cache`, starting at token `first`
    [1]; with `teacher` [n_new] tokens, teacher forcing, and the logits [A, n_new, V] (else None)."""
    check_int(n_new, "n_new", 1)
    if teacher is not None and len(teacher) < n_new: raise ValueError(f"teacher must hold n_new={n_new} tokens")
    A, device = len(policies), first.device
    c = copy.deepcopy(cache)
    c.batch_repeat_interleave(A)
    x, toks, logits = first.view(1, 1).expand(A, 1), [], []
    with torch.no_grad(), patch(model, ArmsPolicy(policies)):
        for i in range(n_new):
            pos = torch.tensor([c.get_seq_length()], device=device)
            out = model(input_ids=x, past_key_values=c, use_cache=True, position_ids=pos.expand(A, 1),
                        logits_to_keep=1)
            step = out.logits[:, -1].float()
            toks.append(step.argmax(-1))
            if teacher is not None: logits.append(step)
            x = (toks[-1] if teacher is None else teacher[i].expand(A)).view(A, 1)
    return torch.stack(toks, 1), (torch.stack(logits, 1) if teacher is not None else None)


# %% [markdown]
# The policy of an arm: dense attention (the registry's `dense`), or page retrieval within `budget`
# tokens per KV head. The retrieval arms take the decode-time settings of OVAL's App. D (first
# layers dense, speculative retrieval from the query `spec_steps` steps back, corrected below
# `tau`), which the registry's page-retrieval methods do not take, so they are built as
# `PageRetrievalPolicy` of the method's summary.

# %%
#| export
def arm_policy(method: str, eta: float, budget: int, page_size: int = 32, sink: int = 32, recent: int = 32,
               rank: int = 8, dense_layers: int = 1, spec_steps: int = 0, tau: float = 0.9) -> AttentionPolicy:
    "The policy of one arm: dense for 'full', else page retrieval by summary `method` within `budget` tokens."
    if method == "full": return methods.make("dense").policy()
    registry_name(method)  # refuses a name that is no page-retrieval method's summary
    return PageRetrievalPolicy(method, budget, page_size, sink, recent, rank, eta, dense_layers=dense_layers,
                               spec_steps=spec_steps, tau=tau)


# %%
_p = arm_policy("oval", 0.5, 64, page_size=8, sink=8, recent=8, spec_steps=2, tau=0.8)
test_eq((_p.method, _p.budget, _p.page_size, _p.spec_steps, _p.tau, _p.spec.eta), ("oval", 64, 8, 2, 0.8, 0.5))
assert isinstance(arm_policy("full", 0.0, 64), DensePolicy)
test_fail(lambda: arm_policy("key_pca", 0.0, 64), contains="summary must be one of")

# %% [markdown]
# Checks on the tiny model: the arms batched give the greedy tokens of each arm decoded alone; a
# retrieval arm whose budget covers the whole cache is full attention; under teacher forcing on full
# attention's greedy tokens, each arm predicts its own free-running tokens up to and including its
# first divergence from full attention (so the teacher-forced first divergence is the free-running
# one); the shared prefill cache is never modified.

# %%
_kw = dict(page_size=8, sink=8, recent=8, spec_steps=2, tau=0.8)
_pols = lambda: [arm_policy("full", 0.0, 0), arm_policy("quest", 0.0, 32, **_kw),
                 arm_policy("oval", 0.5, 32, **_kw), arm_policy("oval", 0.5, 200, **_kw)]
_tok, _none = decode_arms(model, _cache, _first, _pols(), 6)
assert _none is None
for _a, _pol in enumerate(_pols()):
    test_eq(decode_arms(model, _cache, _first, [_pol], 6)[0][0], _tok[_a])
test_eq(_tok[3], _tok[0])                                   # budget 200 > cache: dense
_tf, _lg = decode_arms(model, _cache, _first, _pols(), 6, teacher=_tok[0])
test_eq(_lg.shape[:2], (4, 6))
for _a in range(len(_tok)):
    _d = next((i for i in range(6) if _tok[_a, i] != _tok[0, i]), 5)
    test_eq(_tf[_a, :_d + 1], _tok[_a, :_d + 1])
test_eq(_cache.get_seq_length(), 99)


# %% [markdown]
# ### Task items and generation
#
# An answer is cut at the first end-of-text token.

# %%
#| export
def end_of_text_ids(tok) -> set[int]:
    "The ids of the tokenizer's end-of-text tokens: its eos and the chat ends it knows."
    vocab = tok.get_vocab()
    return {vocab[t] for t in (tok.eos_token, "<|im_end|>", "<|eot_id|>", "<|endoftext|>") if t in vocab}


# %%
_eot = end_of_text_ids(tok)
assert tok.eos_token_id in _eot
assert set(tok.convert_ids_to_tokens(list(_eot))) <= {tok.eos_token, "<|im_end|>", "<|eot_id|>", "<|endoftext|>"}


# %%
#| export
def cut_at(tokens: list, stop) -> list:
    "`tokens` up to (without) the first one in `stop`."
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stop), tokens)


# %%
test_eq(cut_at([5, 6, 2, 7, 2], {2}), [5, 6])
test_eq(cut_at([5, 6], {2}), [5, 6])


# %% [markdown]
# One task item under every arm: the prompt is the item's prompt, a newline and its answer prefix, as
# raw text. The first policy is the reference (full attention): `same_as_full` compares with its answer.

# %%
#| export
def task_arms(model, tok, item: dict, policies: list, n_new: int, chunk_size: int, stop) -> list[dict]:
    """Per arm (`policies`, the first full attention): the exact-match score of its greedy answer to `item`, whether
    the answer is token-identical to the first arm's, the prompt's length and the answer (repr)."""
    ids = tok(item["prompt"] + "\n" + item["answer_prefix"], return_tensors="pt").input_ids
    cache, first = held_back_prefill(model, ids, chunk_size)
    toks, _ = decode_arms(model, cache, first, policies, n_new)
    preds = [cut_at(t, stop) for t in toks.tolist()]
    return [{"score": score_exact(tok.decode(p), item["answer"]), "same_as_full": p == preds[0],
             "prompt_tokens": ids.shape[1], "prediction": repr(tok.decode(p))} for p in preds]


# %%
_item = {"prompt": "The code is 1234. Noise noise noise noise.", "answer_prefix": "The code is", "answer": "1234"}
_out = task_arms(model, tok, _item, _pols(), 4, 64, end_of_text_ids(tok))
test_eq(len(_out), 4)
assert _out[0]["same_as_full"] and _out[3]["same_as_full"]   # the dense-sized arm answers as full attention
test_eq(_out[0]["prompt_tokens"], len(tok(_item["prompt"] + "\n" + _item["answer_prefix"]).input_ids))
_full = decode_arms(model, *held_back_prefill(model, tok(_item["prompt"] + "\n" + _item["answer_prefix"],
                                                        return_tensors="pt").input_ids, 64), _pols()[:1], 4)[0][0]
test_eq(_out[0]["prediction"], repr(tok.decode(cut_at(_full.tolist(), end_of_text_ids(tok)))))


# %% [markdown]
# Generation agreement: full attention continues a prose window greedily for `n_new` tokens, and every
# arm decodes under teacher forcing on that continuation: top-1 agreement with full attention's next
# token, the first position where they differ, and the mean KL(full || arm).

# %%
#| export
def generation_arms(model, ids: Tensor, policies: list, n_new: int, chunk_size: int) -> list[dict]:
    """Per arm (`policies`, the first full attention), teacher-forced on full attention's greedy continuation of `ids`
    [1, S]: top-1 agreement and KL with the first arm, and the first position its greedy token differs."""
    cache, first = held_back_prefill(model, ids, chunk_size)
    teacher = decode_arms(model, cache, first, [methods.make("dense").policy()], n_new)[0][0]
    toks, logits = decode_arms(model, cache, first, policies, n_new, teacher=teacher)
    out = []
    for a in range(len(policies)):
        miss = (toks[a] != teacher).nonzero()
        out.append({"agreement": top1_agreement(logits[a], logits[0]).item(),
                    "kl": kl_to_teacher(logits[a], logits[0]).item(),
                    "first_divergence": int(miss[0, 0]) if len(miss) else n_new})
    return out


# %%
_gen = generation_arms(model, _ids, _pols(), 6, 64)
test_eq((_gen[0]["agreement"], _gen[0]["first_divergence"]), (1.0, 6))
test_close(_gen[0]["kl"], 0.0, eps=1e-6)
test_eq(_gen[3]["first_divergence"], 6)                     # budget over the cache: full attention
_d = next((i for i in range(6) if _tf[1, i] != _tok[0, i]), 6)
test_eq(_gen[1]["first_divergence"], _d)


# %% [markdown]
# The stage's two grids: every task item and every generation prompt under every arm, one row per
# (item, arm), resumable. The arms of one item share one prefill and decode as one batch (the item's
# rows are computed together, then read back one at a time). Every setting that changes a result is a
# key of every row, so a resumed grid never reuses rows of other settings.

# %%
#| export
def arms_grids(model, tok, arms: list, items: list, gen_items: list, retrieval: dict, max_new_tokens: dict,
               gen_tokens: int, n_gen: int, chunk_size: int, params: dict, seed: int, out_dir) -> tuple:
    """This run's rows of `out_dir`'s oval_tasks grids: each task item of `items` ((task, context, depth or None,
    sample)) and each prose prompt of `gen_items` ((context, sample < n_gen)) under each arm of `arms` ((method, eta,
    budget fraction)) with the page-retrieval settings `retrieval`; `params`: the run's other keys (model, ...)."""
    stop, common = end_of_text_ids(tok), {**params, "seed": seed, "chunk_size": chunk_size, **retrieval}
    arm_of = lambda cell: (cell["method"], cell["eta"], cell["budget_fraction"])
    policies = lambda context: [arm_policy(m, e, int(f * context), **retrieval) for m, e, f in arms]

    @functools.lru_cache(maxsize=1)
    def item_arms(task, context, depth, sample):
        item = make_task(task, tok, context, seed=seed * 1000 + sample, **({} if depth is None else {"depth": depth}))
        return dict(zip(arms, task_arms(model, tok, item, policies(context), max_new_tokens[task], chunk_size, stop)))

    @functools.lru_cache(maxsize=1)
    def generation(context, sample):
        ids = packed_sequences(tok, context, "validation", n=n_gen, seed=seed)[sample:sample + 1]
        return dict(zip(arms, generation_arms(model, ids, policies(context), gen_tokens, chunk_size)))

    task_cells = [{"task": t, "context": c, "depth": d, "sample": s, "max_new_tokens": max_new_tokens[t],
                   "method": m, "eta": e, "budget_fraction": f} for t, c, d, s in items for m, e, f in arms]
    gen_cells = [{"context": c, "sample": s, "gen_tokens": gen_tokens, "method": m, "eta": e, "budget_fraction": f}
                 for c, s in gen_items for m, e, f in arms]
    tasks = run_grid(task_cells, lambda c: item_arms(c["task"], c["context"], c["depth"], c["sample"])[arm_of(c)],
                     Path(out_dir)/"oval_tasks_grid.csv", desc="oval tasks", params=common)
    gen = run_grid(gen_cells, lambda c: generation(c["context"], c["sample"])[arm_of(c)],
                   Path(out_dir)/"oval_tasks_generation_grid.csv", desc="oval generation", params=common)
    tasks, gen = this_run(tasks, task_cells, common), this_run(gen, gen_cells, common)
    tasks.insert(1, "family", tasks.task.map(lambda t: "needle" if t == "niah_single" else "ruler"))
    return tasks, gen


# %%
_arms = [("full", 0.0, 1.0), ("quest", 0.0, 0.5), ("oval", 0.5, 0.5)]
_items = [("niah_single", 400, 0.5, 0), ("niah_multikey", 600, None, 0)]
with tempfile.TemporaryDirectory() as _dir:
    _kw = dict(retrieval=dict(page_size=8, sink=8, recent=8), max_new_tokens={"niah_single": 3, "niah_multikey": 3},
               gen_tokens=4, n_gen=1, chunk_size=64, params={"model": "tiny"}, seed=0, out_dir=_dir)
    _tr, _gr = arms_grids(model, tok, _arms, _items, [(96, 0)], **_kw)
    test_eq((len(_tr), len(_gr)), (6, 3))
    test_eq(_tr.family.tolist(), ["needle"] * 3 + ["ruler"] * 3)
    test_eq(_tr.method.tolist(), ["full", "quest", "oval"] * 2)
    test_eq(_gr.agreement.iloc[0], 1.0)                      # full attention is the teacher
    _item = make_task("niah_single", tok, 400, seed=0, depth=0.5)   # one row equals its item computed alone
    _alone = task_arms(model, tok, _item, [arm_policy(m, e, int(f * 400), page_size=8, sink=8, recent=8)
                                           for m, e, f in _arms], 3, 64, end_of_text_ids(tok))
    test_eq(_tr.prediction.tolist()[:3], [a["prediction"] for a in _alone])
    _rows = len(pd.read_csv(Path(_dir)/"oval_tasks_grid.csv"))
    _tr2, _ = arms_grids(model, tok, _arms, _items[:1], [(96, 0)], **_kw)   # resumed: no new rows
    test_eq((len(pd.read_csv(Path(_dir)/"oval_tasks_grid.csv")), _tr2.prediction.tolist()),
            (_rows, _tr.prediction.tolist()[:3]))


# %% [markdown]
# ### The task tables
#
# `arm_table` is the Table 1/2 analogue: per arm, needle accuracy (mean over the single-key needle
# items), each RULER-style task's accuracy and their mean, the share of answers identical to full
# attention's, and the generation metrics.

# %%
#| export
def arm_table(tasks_res: pd.DataFrame, gen_res: pd.DataFrame, ruler_tasks: Sequence[str], arms: list) -> pd.DataFrame:
    """Per arm of `arms` ((method, eta, budget_fraction), in that order): needle accuracy, each RULER task's accuracy,
    their mean, same_as_full, generation agreement, first divergence and KL."""
    keys = ["budget_fraction", "method", "eta"]
    per_task = tasks_res.pivot_table(index=keys, columns="task", values="score", aggfunc="mean")
    t = pd.DataFrame(index=per_task.index)
    t["needle"] = per_task["niah_single"]
    for name in ruler_tasks: t[name] = per_task[name]
    t["ruler"] = per_task[list(ruler_tasks)].mean(1)
    t["same_as_full"] = tasks_res.groupby(keys).same_as_full.mean()
    g = gen_res.groupby(keys)[["agreement", "first_divergence", "kl"]].mean()
    t = t.join(g.rename(columns={"agreement": "gen_agreement", "first_divergence": "gen_first_divergence",
                                 "kl": "gen_kl"}))
    t = t.reset_index()
    t.insert(1, "arm", [arm_label(m, e) for m, e in zip(t.method, t.eta)])
    t["order"] = [arms.index((m, e, f)) for m, e, f in zip(t.method, t.eta, t.budget_fraction)]
    return t.sort_values("order").drop(columns="order").reset_index(drop=True)


# %%
_arms = [("full", 0.0, 1.0), ("quest", 0.0, 0.5), ("oval", 1.0, 0.5)]
_tr = pd.DataFrame([{"task": t, "budget_fraction": f, "method": m, "eta": e, "score": s,
                     "same_as_full": m != "quest"}
                    for t, ss in (("niah_single", (1, 0, 1)), ("niah_multikey", (1, 1, 0)))
                    for (m, e, f), s in zip(_arms, ss)])
_gr = pd.DataFrame([{"budget_fraction": f, "method": m, "eta": e, "agreement": 1.0, "first_divergence": 3,
                     "kl": 0.1} for m, e, f in _arms])
_at = arm_table(_tr, _gr, ["niah_multikey"], _arms)
test_eq(_at.arm.tolist(), ["full", "quest", "oval eta=1"])
test_eq(_at.needle.tolist(), [1.0, 0.0, 1.0])
test_eq(_at.ruler.tolist(), [1.0, 1.0, 0.0])
test_eq(_at.same_as_full.tolist(), [1.0, 0.0, 1.0])


# %% [markdown]
# `eta_goal` is the Table 4 analogue's goal check: for each budget and metric, the best OVAL $\eta$
# (ties to the smallest $\eta$) against key PCA, Quest, ArkVale and full attention.

# %%
#| export
def eta_goal(table: pd.DataFrame, budget_fractions: Sequence[float],
             metrics: list[tuple[str, Callable]]) -> pd.DataFrame:
    """Per budget fraction and (metric, max or min) of `metrics`: the best OVAL eta and value in `table` (an
    `arm_table`), key PCA's, Quest's, ArkVale's and full attention's, and whether the best OVAL is at least key PCA
    and Quest."""
    goal = []
    for f in budget_fractions:
        t = table[table.budget_fraction == f].set_index("arm")
        ov = t[t.method == "oval"]
        for metric_name, better in metrics:
            if better not in (max, min): raise ValueError(f"metrics: {metric_name} must come with max or min")
            best = better(ov[metric_name])
            sign = 1 if better is max else -1
            goal.append({"budget_fraction": f, "metric": metric_name,
                         "best_eta": ov[metric_name].idxmax() if better is max else ov[metric_name].idxmin(),
                         "best_oval": best, "keypca": t.loc["keypca", metric_name],
                         "quest": t.loc["quest", metric_name],
                         "arkvale": t.loc["arkvale", metric_name],
                         "full": table[(table.method == "full")][metric_name].iloc[0],
                         ">= keypca": sign * (best - t.loc["keypca", metric_name]) >= 0,
                         ">= quest": sign * (best - t.loc["quest", metric_name]) >= 0})
    return pd.DataFrame(goal)


# %%
_tab = pd.DataFrame([{"budget_fraction": f, "method": m, "eta": e, "arm": arm_label(m, e), "needle": n,
                      "gen_kl": k}
                     for m, e, f, n, k in (("full", 0.0, 1.0, 1.0, 0.0), ("quest", 0.0, 0.5, 0.5, 0.3),
                                           ("arkvale", 0.0, 0.5, 0.4, 0.4), ("keypca", 0.0, 0.5, 0.6, 0.2),
                                           ("oval", 0.5, 0.5, 0.7, 0.25), ("oval", 1.0, 0.5, 0.7, 0.1))])
_g = eta_goal(_tab, [0.5], [("needle", max), ("gen_kl", min)]).set_index("metric")
test_eq(_g.loc["needle", ["best_eta", "best_oval", "keypca", "full", ">= keypca"]].tolist(),
        ["oval eta=0.5", 0.7, 0.6, 1.0, True])
test_eq(_g.loc["gen_kl", ["best_eta", ">= keypca", ">= quest"]].tolist(), ["oval eta=1", True, True])
test_fail(lambda: eta_goal(_tab, [0.5], [("needle", sum)]), contains="max or min")

# %% [markdown]
# ## Decode latency
#
# The latency stage times one decode step of one layer on random tensors, each method called as
# `sparsekv.hf.patch` calls it. A call is timed by `sparsekv.protocol.cpu_seconds`: the CPU time of the
# calling thread (`time.thread_time`), which leaves out the time it waits to be scheduled on a shared
# machine, with the wall time beside it.

# %%
import time

_s = cpu_seconds(lambda: time.sleep(0.05))
assert _s["wall_seconds"] >= 0.05 and _s["seconds"] < 0.04, _s   # sleeping takes no CPU time


# %% [markdown]
# A stand-in attention module gives a policy what it reads from a real layer: `o_proj.weight` (for
# OVAL's $G$), the head counts and the head dimension.

# %%
#| export
def stand_in_attention(num_heads: int, num_kv_heads: int, head_dim: int,
                       generator: torch.Generator) -> SimpleNamespace:
    "An attention module's stand-in: a random `o_proj.weight`, the head counts in `config`, and `head_dim`."
    for x, name in ((num_heads, "num_heads"), (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim")):
        check_int(x, name, 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    n = num_heads * head_dim
    return SimpleNamespace(o_proj=SimpleNamespace(weight=torch.randn(n, n, generator=generator) / math.sqrt(n)),
                           config=SimpleNamespace(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads),
                           head_dim=head_dim)


# %%
_m = stand_in_attention(4, 2, 8, torch.Generator().manual_seed(0))
test_eq(_m.o_proj.weight.shape, (32, 32))
test_eq(_m.o_proj.weight, torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) / math.sqrt(32))
test_fail(lambda: stand_in_attention(3, 2, 8, torch.Generator()), contains="multiple")


# %%
#| export
def decode_context(t: int, module, layer_idx: int = 1) -> AttentionContext:
    "The context `sparsekv.hf` builds for a decode query at position t - 1 of layer `layer_idx` (no padding mask)."
    check_int(t, "t", 1)
    Hkv, D = module.config.num_key_value_heads, module.head_dim
    return AttentionContext(layer_idx=layer_idx, kind="decode", query_positions=torch.tensor([t - 1]),
                            key_positions=torch.arange(t).expand(1, Hkv, t), mask=None, scale=D ** -0.5,
                            module=module)


# %%
_ctx = decode_context(10, _m)
test_eq((_ctx.kind, _ctx.query_positions.tolist(), _ctx.key_positions.shape), ("decode", [9], (1, 2, 10)))
test_close(_ctx.scale, 8 ** -0.5)


# %% [markdown]
# The policies of the latency stage come from the registry: `make("dense")` and the page-retrieval
# method of each summary, with OVAL's $\eta$.

# %%
#| export
def decode_policies(names: Sequence[str], token_budget: int, page_size: int, sink: int, recent: int, rank: int,
                    eta: float) -> dict:
    "Fresh policies (`methods.make`) of each name: 'full' (dense) or a page summary ('quest', 'keypca', 'oval', ...)."
    out = {}
    for n in names:
        if n == "full": out[n] = methods.make("dense").policy()
        else:
            out[n] = methods.make(registry_name(n), token_budget, page_size=page_size, sink=sink, recent=recent,
                                  rank=rank, **({"eta": eta} if n == "oval" else {})).policy()
    return out


# %%
_pp = decode_policies(["full", "quest", "oval"], 64, 8, 8, 8, 2, 0.25)
assert isinstance(_pp["full"], DensePolicy)
test_eq([(p.method, p.budget, p.page_size, p.sink, p.recent) for p in (_pp["quest"], _pp["oval"])],
        [("quest", 64, 8, 8, 8), ("oval", 64, 8, 8, 8)])
test_eq((_pp["oval"].spec.rank, _pp["oval"].spec.eta), (2, 0.25))


# %% [markdown]
# `decode_latency` runs the timed decode steps. For each context $T$, a cache of random keys and
# values grows by one token per step (a slice of a longer buffer), so each policy runs its real
# bookkeeping; the summaries of the pages present at the first step are built then, outside the
# timed steps. The first step of each retrieval policy is checked against the analysis path from
# scratch (`build_summaries`, `score_pages`, `select_pages`, `attend_selected`). Every timed step
# calls the methods back to back in a rotating order.
#
# Then the step's parts are timed alone, each kind in a loop of its own with the methods rotated
# within it: the packed scoring (`PackedPages.scores`) beside the broadcast `score_pages` of the same
# summaries, attention over each method's kept pages gathered beforehand (`attend`), choosing the
# pages from their scores (`choose`) and gathering them (`gather`). Interleaved with other kinds, a
# call finds the CPU's caches as the one before left them.

# %%
#| export
def decode_latency(contexts: Sequence[int], module, names: Sequence[str], token_budget: int, page_size: int,
                   sink: int, recent: int, rank: int, eta: float, repeats: int,
                   generator: torch.Generator) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict]:
    """Timed decode steps of each method in `names` ('full' first, then page summaries) per context of `contexts`, and
    the steps' parts: (steps, parts, checks of the first step, kept tokens of the last method per context)."""
    check_int(repeats, "repeats", 1)
    if list(names[:1]) != ["full"] or len(names) < 2:
        raise ValueError(f"names must be 'full' then page summaries, got {names!r}")
    HQ, HKV, D = module.config.num_attention_heads, module.config.num_key_value_heads, module.head_dim
    G, names, sparse = output_metric(module.o_proj.weight, HQ, HKV, D), list(names), list(names[1:])
    steps, scoring, checks, n_kept = [], [], [], {}
    for T in contexts:
        kb = torch.randn(1, HKV, T + repeats + 1, D, generator=generator)
        vb = torch.randn(1, HKV, T + repeats + 1, D, generator=generator)
        qs = torch.randn(repeats + 1, 1, HQ, 1, D, generator=generator)
        pols = decode_policies(names, token_budget, page_size, sink, recent, rank, eta)
        k, v, ctx = kb[:, :, :T], vb[:, :, :T], decode_context(T, module)
        for m, pol in pols.items():                                           # first step: builds the summaries
            out = pol(qs[0], k, v, ctx)
            if m == "full": continue
            ref = build_summaries(m, k, v, page_size, rank, eta, G)
            idx = select_pages(aggregate_gqa(score_pages(m, ref, qs[0, :, :, 0], ctx.scale), HKV), token_budget,
                               page_size, sink, recent, T)
            torch.testing.assert_close(out, attend_selected(qs[0], k, v, idx, scale=ctx.scale), rtol=1e-4, atol=1e-5)
            checks.append({"T": T, "method": m, "pages built": pol.built,
                           "same selection": torch.equal(pol.select(qs[0], k, v, ctx), idx)})
        for j in range(1, repeats + 1):                                       # timed steps, the cache grows by one
            t = T + j
            k, v, ctx = kb[:, :, :t], vb[:, :, :t], decode_context(t, module)
            for m in names[j % len(names):] + names[:j % len(names)]:
                steps.append({"T": T, "step": j, "method": m, **cpu_seconds(lambda: pols[m](qs[j], k, v, ctx))})
        packed = {m: pols[m].summaries[1] for m in sparse}
        views = {m: p.summary() for m, p in packed.items()}
        scorings = [(m, "packed", lambda q, m=m: packed[m].scores(q)) for m in sparse]
        calls = [("keypca", "score_pages", lambda q: score_pages("keypca", views["keypca"], q))]
        t = T + repeats  # the cache the stores summarize after the timed steps
        page_scores = {m: packed[m].scores(qs[0, :, :, 0]) for m in sparse}
        kept = {m: top_pages(aggregate_gqa(page_scores[m], HKV), token_budget, page_size, sink, recent, t)
                for m in sparse}
        kv_kept = {m: (gather_pages(kb[:, :, :t], p, page_size), gather_pages(vb[:, :, :t], p, page_size))
                   for m, p in kept.items()}
        calls += [(m, "attend", lambda q, m=m: dense_attention(q[:, :, None], *kv_kept[m], None, D ** -0.5))
                  for m in sparse]
        parts = [(m, "choose", lambda q, m=m: top_pages(aggregate_gqa(page_scores[m], HKV), token_budget, page_size,
                                                        sink, recent, t)) for m in sparse]
        parts += [(m, "gather", lambda q, m=m: (gather_pages(kb[:, :, :t], kept[m], page_size),
                                                gather_pages(vb[:, :, :t], kept[m], page_size))) for m in sparse]
        n_kept[T] = kv_kept[sparse[-1]][0].shape[2]
        for group in (scorings, calls, parts):
            for j in range(repeats):
                for m, path, f in group[j % len(group):] + group[:j % len(group)]:
                    scoring.append({"T": T, "step": j, "method": m, "path": path,
                                    **cpu_seconds(lambda: f(qs[j, :, :, 0]))})
    return pd.DataFrame(steps), pd.DataFrame(scoring), pd.DataFrame(checks), n_kept


# %%
_steps, _parts, _checks, _kept = decode_latency([256], _m, ["full", "quest", "keypca", "oval"], 64, 8, 8, 8, 2, 0.5,
                                                2, torch.Generator().manual_seed(0))
test_eq(len(_steps), 2 * 4)
test_eq(sorted(_parts.path.unique()), ["attend", "choose", "gather", "packed", "score_pages"])
test_eq(_checks["pages built"].tolist(), [256 // 8] * 3)
assert list(_kept) == [256] and 64 - 8 <= _kept[256] <= 64   # within the budget, less at most a page
test_fail(lambda: decode_latency([256], _m, ["quest"], 64, 8, 8, 8, 2, 0.5, 2, torch.Generator()), contains="names")


# %% [markdown]
# The latency table: median times per context and method of the whole step and of each part timed alone.

# %%
#| export
def latency_table(steps: pd.DataFrame, parts: pd.DataFrame, page_size: int) -> pd.DataFrame:
    "Per context T and method: median step time (thread CPU and wall), median packed scoring, attend, choose, gather."
    lat = steps.groupby(["T", "method"], sort=False)[["seconds", "wall_seconds"]].median()
    lat = lat.set_axis(["step_s", "step_wall_s"], axis=1).reset_index()
    packed = parts[parts.path == "packed"].groupby(["T", "method"]).seconds.median()
    lat = lat.merge(packed.rename("score_s").reset_index(), how="left")
    for path in ("attend", "choose", "gather"):
        lat = lat.merge(parts[parts.path == path].groupby(["T", "method"]).seconds.median().rename(f"{path}_s")
                        .reset_index(), how="left")
    lat["pages"] = lat["T"] // page_size
    return lat


# %%
_lat = latency_table(_steps, _parts, 8).set_index("method")
test_eq(sorted(_lat.index), ["full", "keypca", "oval", "quest"])
test_eq(_lat.step_s["full"], _steps[_steps.method == "full"].seconds.median())
assert _lat.score_s.drop("full").notna().all() and pd.isna(_lat.score_s["full"])


# %% [markdown]
# Only times taken side by side are compared: a ratio is the median over steps of the ratio within a step.

# %%
#| export
def paired_ratio(df: pd.DataFrame, num: str, den: str, col: str = "method", clock: str = "seconds") -> pd.Series:
    "Per T: the median over steps of time(num) / time(den), both taken in the same step, on `clock`."
    if clock not in df: raise ValueError(f"clock must be a column of df, got {clock!r}")
    w = df.pivot_table(index=["T", "step"], columns=col, values=clock)
    return (w[num] / w[den]).groupby("T").median()


# %%
_df = pd.DataFrame({"T": [8] * 6, "step": [0, 0, 1, 1, 2, 2], "method": ["a", "b"] * 3, "seconds": [2, 1, 9, 3, 4, 1]})
test_eq(paired_ratio(_df, "a", "b").to_dict(), {8: 3.0})      # median of 2, 3, 4


# %% [markdown]
# **The FLOP limit.** Counted in multiply-adds over the $H_q$ query heads, with $P = \lfloor T/m\rfloor$
# pages and $n$ kept tokens, full attention costs $H_q \cdot 2Td$ and page retrieval $H_q\,(2nd + c)$,
# with the scoring cost per query head $c$: Quest $2dP$, key PCA and OVAL $(r+1)dP + rmP$.

# %%
#| export
def limit_macs(method: str, T: int, n: int, num_heads: int, head_dim: int, page_size: int,
               rank: int) -> tuple[int, int]:
    "Multiply-adds (full attention, page retrieval by `method`) of one decode step of one layer over T tokens, n kept."
    P = T // page_size
    score = 2 * head_dim * P if method == "quest" else (rank + 1) * head_dim * P + rank * page_size * P
    return num_heads * 2 * T * head_dim, num_heads * (2 * n * head_dim + score)


# %%
test_eq(limit_macs("quest", 64, 16, 2, 4, 8, 2), (2 * 2 * 64 * 4, 2 * (2 * 16 * 4 + 2 * 4 * 8)))
test_eq(limit_macs("oval", 64, 16, 2, 4, 8, 2), (1024, 2 * (2 * 16 * 4 + 3 * 4 * 8 + 2 * 8 * 8)))


# %% [markdown]
# During decode a page completes every $m$ steps and is summarized at once for all KV heads
# (`build_summaries` of that page, appended to the layer's `PackedPages`). `summary_build_latency`
# times it per page, the methods rotated.

# %%
#| export
def summary_build_latency(names: Sequence[str], n_pages: int, page_size: int, rank: int, eta: float, G: Tensor,
                          generator: torch.Generator) -> pd.DataFrame:
    "Thread CPU and wall time of summarizing each of `n_pages` random pages for all KV heads, per summary of `names`."
    check_int(n_pages, "n_pages", 1)
    HKV, D = G.shape[0], G.shape[-1]
    Kc = torch.randn(1, HKV, n_pages * page_size, D, generator=generator)
    Vc = torch.randn(1, HKV, n_pages * page_size, D, generator=generator)
    names, rows = list(names), []
    for p in range(n_pages):
        sl = slice(p * page_size, (p + 1) * page_size)
        for m in names[p % len(names):] + names[:p % len(names)]:
            store = PackedPages(m, page_size)
            rows.append({"method": m, "page": p, **cpu_seconds(lambda: store.append(
                build_summaries(m, Kc[:, :, sl], Vc[:, :, sl], page_size, rank, eta, G if m == "oval" else None)))})
    return pd.DataFrame(rows)


# %%
_b = summary_build_latency(["quest", "keypca", "oval"], 4, 8, 2, 0.5, torch.eye(8).expand(2, 8, 8),
                           torch.Generator().manual_seed(0))
test_eq(len(_b), 12)
test_eq(_b.method.tolist()[:6], ["quest", "keypca", "oval", "keypca", "oval", "quest"])
