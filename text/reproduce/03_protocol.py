# %% [markdown]
# # Methods on equal terms: calibrated tasks, measured budgets, paired intervals
#
# > Eviction, selection and page retrieval methods on the retrieval cells dense SmolLM2-135M solves and on held-out prose, each fitted to the same measured budget per decode query, with paired 95% intervals against dense and against the best other method, and the scoring cost of each.

# %% [markdown]
# This stage is the evaluation protocol of `sparsekv.protocol` run end to end; the per-paper stages
# take their comparisons from it.
#
# - **Items.** Retrieval cells where dense accuracy was calibrated at $\ge 0.9$ with $\ge 50$ items
#   (`calibration` stage, `cpu-full` profile: `niah_single` and `passkey` phrasing 2 at 4k tokens);
#   here each cell's items are its seeds at each needle depth, the same for every method. Prose:
#   held-out windows of the validation split; each method prefills the first `prose_prefix` tokens,
#   then reads the rest one token at a time (teacher forcing), and its next-token logits are compared
#   with the dense model's (top-1 agreement, KL, NLL).
# - **Budgets.** A budget here is a *measured* ceiling: every method is fitted (`fit_budget`, on a
#   probe window) to the largest nominal budget whose decode queries attend to at most that
#   many KV entries per head, in the layers the method compresses (page retrieval and LessIsMore keep
#   some layers dense by design; the `dense_layers` and `decode_reads` columns show what that costs).
#   Every row records what its queries attended to, and a check below holds each method to the
#   ceiling on the real items. A method's own `budgets` (in `method_specs`) replace the run's for it: a costly
#   method can run at the headline ceiling alone while another is also measured at more.
# - **Prefill.** Selection methods prefill in chunks of `chunk_size` ($B_{CP}$) tokens, each chunk
#   attending to the selected earlier keys and its own; eviction methods prefill in chunks of
#   `eviction_chunk` tokens and evict after each, so a chunk's queries see the kept entries and the
#   chunk (charged in `prefill_max`); page retrieval prefills densely (its papers' setting).
# - **Long runs.** The `cpu-full` answer grid takes about ten hours on two cores: with `answers_hours` set, a run
#   starts no answer cell after that many hours, compares at each budget the items dense and every method at that
#   budget finished, and says so at the top of its summary; the next run (`--force`) continues where it stopped
#   (the grid is committed).
# - **TOVA** is the paper's (and kvpress's): the last query's attention averaged over every query head,
#   one kept set for all KV heads; `tova_group` (`{name: tova, heads: group}`) averages within each KV
#   head's group instead, a variant labelled as such.
# - **kvpress's presses** (`{"press": name}` in `method_specs`, `sparsekv.presses`) prefill densely
#   in one call and compress the prompt's cache once; generation then adds one entry per step, so
#   their fit depends on the number of decode steps: the probe must decode as many steps as the prose
#   scores (`probe_steps = window - prose_prefix`), or the ceiling check below fails. Their scoring
#   cost is not counted.
# - **The leaderboard** is this notebook run as its own stage (`stem: leaderboard`) with every
#   method of every setting, the shipped KVpop scorers, the compositions (`'quoka+kvpop_mlp'`: QuoKA reads
#   the prompt, KVpop's bounded cache takes it over for generation; see the methods page) and the presses,
#   on prose; the table's `setting` column says where each method acts. A method that cannot keep to a
#   ceiling (the shipped KVpop scorers need their sink and window of 68 entries) is listed as not applicable.
# - **Memory and time.** Every row also records the KV entries and bytes each layer's cache held (at its
#   peak, and during decode steps) and the prefill and per-step wall time; the Pareto fronts put quality
#   against each.
# - **Statistics.** `protocol_table` (`sparsekv.stats.compare`): per method and budget, the mean
#   with its standard error, the paired bootstrap 95% interval of the difference from dense and from
#   the best other method; `*` marks an interval that excludes 0, and only those differences are
#   called ahead or behind.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
dtype = "float32"
device = "cpu"
# label -> {"task": make_task name (default: the label), "length": tokens, **its other options}
cells = {"niah_single": {"length": 256}}
depths = [0.0, 1.0]
seeds = [0]
extra_tokens = 3  # decode steps beyond the answer's own tokens
budgets = [64]  # measured ceilings: KV entries per decode query and KV head
# label -> {"name": registry name (default: the label), "match_cost": a label whose scoring cost per key this method's
#           cost knob is matched to (`sparsekv.costs.matched`), "budgets": its ceilings (default: `budgets`),
#           **its parameters}
#       or {"press": a kvpress press of `sparsekv.presses`, **its options}
method_specs = {"dense": {}, "streaming_llm": {}, "tova": {}, "quoka": {}, "quest": {}}
chunk_size = 128  # B_CP of the selection methods
eviction_chunk = 128  # eviction methods prefill in chunks of this many tokens, evicting after each
n_windows = 2
window = 256  # tokens per prose window
prose_prefix = 192  # tokens prefilled before the teacher-forced decode steps
prose_batch = 8  # windows per batch
probe_window = 256  # tokens of the prose window the budgets are fitted on
probe_steps = 40  # its decode steps (more than a page, so the partial page takes every size)
min_claim_items = 16  # below this many items a bootstrap interval covers too little (41_stats): nothing is claimed
target_se = 0.01  # the standard error asked of every headline cell: the findings say how many items it would take
answers_hours = None  # start no answer cell after this many hours (None: all); the tables then use the finished items
pairs = []  # [method, other] labels (e.g. [quoka_heads, quoka], [quoka, sparq_matched]): a paired difference per table
stem = "protocol"  # output names: {stem}.md, {stem}.png, {stem}_*_grid.csv (the leaderboard stage runs this notebook too)

# %%
import hashlib
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

import sparsekv
from sparsekv import methods, presses
from sparsekv.costs import KNOBS, matched
from sparsekv.data import make_task, packed_sequences
from sparsekv.eval import run_grid
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.methods import ModelShape
from sparsekv.models import load_model, tiny_model
from sparsekv.protocol import (BUDGET_COLUMNS, answer, continuation, cost_columns, dense_prefill, fit_budget,
                               item_hash, prefills_densely, prompt_ids, protocol_table)
from sparsekv.stats import compare_cell, paired_ci

# %%
_unknown = [x for pair in pairs for x in pair if x not in method_specs]
if _unknown or any(len(pair) != 2 for pair in pairs):
    raise ValueError(f"pairs must be [method, other] labels of method_specs {list(method_specs)}, got {pairs!r}")
use_style()
model, tok = load_model(model_name, dtype=dtype, device=device)
shape = ModelShape.of(model)
print(f"{model_name}, {dtype}, device {device}, {torch.get_num_threads()} thread(s); {shape}")


# %% [markdown]
# ## Methods and their fitted budgets

# %%
def method_params(label: str) -> tuple:
    """The factory (`methods.make`, or `presses.make` for a kvpress press), name and parameters of the method labelled
    `label`: the protocol's chunk sizes filled in, and with `match_cost: other` its cost knob (rank, sampled queries)
    set to cost per key what method `other` costs."""
    spec = {k: v for k, v in method_specs[label].items() if k != "budgets"}
    if "press" in spec: return presses.make, spec.pop("press"), spec  # a press prefills densely in one call
    name, match = spec.pop("name", label), spec.pop("match_cost", None)
    family = methods.get(name).family
    # (a composition's parts take their own defaults: QuoKA's B_CP = 128)
    if family == "selection" and methods.get(name) is not methods.PrefillDecode: spec.setdefault("chunk_size", chunk_size)
    if family == "eviction": spec.setdefault("chunk_size", eviction_chunk)
    if match is not None:  # the per-key cost does not depend on the budget: match at any
        _, goal_name, goal_params = method_params(match)
        goal = methods.make(goal_name, budgets[0], **goal_params)
        spec[KNOBS[name]] = getattr(matched(name, goal, shape, budgets[0], **spec), KNOBS[name])
    return methods.make, name, spec


def setting(label: str) -> str:
    "Where the method acts: evict while reading, prefill selection, decode retrieval, post-prefill compression, ..."
    make, name, params = method_params(label)
    if make is presses.make: return "post-prefill compression (kvpress)"
    if methods.get(name) is methods.PrefillDecode:
        m = make(name, budgets[0], **params)
        return f"{m.prefill.family} prefill + {m.decode.family} decode"
    return {"dense": "dense", "eviction": "evict while reading", "selection": "prefill selection",
            "retrieval": "decode retrieval"}[methods.get(name).family]


def checkpoints_of(params: dict) -> list[str]:
    "The trained scorers (`checkpoint`: a shipped name or a path) a method or a composition's parts load."
    return [p["checkpoint"] for p in (params, params.get("prefill_params") or {}, params.get("decode_params") or {})
            if "checkpoint" in p]


def trained_for_the_model(params: dict) -> bool:
    return bool(checkpoints_of(params))


def weights_key(label: str) -> dict:
    """`{"scorers": "name@hash, ..."}` for a method that loads trained scorers (by content), else `{}`: a grid cell
    computed with other weights (scorers retrained and shipped again) is computed again, not reused."""
    def content(checkpoint: str) -> str:
        shipped = Path(sparsekv.__file__).parent / "checkpoints" / checkpoint / "trained.pt"
        return hashlib.sha256((shipped if shipped.is_file() else Path(checkpoint)).read_bytes()).hexdigest()[:12]
    names = checkpoints_of(method_params(label)[2])
    return {"scorers": ", ".join(f"{c}@{content(c)}" for c in names)} if names else {}


# What a method attends to is set by its structure (slots, chunks, pages, sinks), not by the weights: the budgets are
# fitted on a random model with the real one's layers and heads, a hundred times cheaper, and the rows below check
# the fit on the real model and items.
cfg = model.config
# (width: 16 per query head, the tiny model's head dim; transformers wants the width a multiple of the heads)
probe_model = tiny_model("tiny-llama", num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                         num_kv_heads=cfg.num_key_value_heads, hidden_size=16 * cfg.num_attention_heads)[0]
probe_ids = torch.randint(3, probe_model.config.vocab_size, (1, probe_window),
                          generator=torch.Generator().manual_seed(0))


def probe(m, on=probe_model) -> dict:
    "The measured budget of `m` on the probe window (`on` the probe model, or the model for trained scorers)."
    return continuation(m, on, probe_ids, probe_window - probe_steps)[0]


def fit_cell(cell: dict) -> dict:
    """The fitted nominal budget of one (method, budget) and its measurement on the probe; nominal 0 and the reason
    when the method cannot keep to that ceiling (e.g. shipped KVpop scorers need their sink and window)."""
    make, name, params = method_params(cell["method"])
    # trained scorers have the model's shapes: fitted on the model itself
    on = model if trained_for_the_model(params) else probe_model
    try: m, got = fit_budget(name, cell["budget"], lambda m: probe(m, on), make=make, **params)
    except ValueError as e: return {"nominal": 0, "not_applicable": str(e)}
    return {"nominal": m.budget, **{k: got[k] for k in BUDGET_COLUMNS}}


def budgets_of(label: str) -> list[int]:
    "The measured ceilings the method labelled `label` runs at: its own `budgets`, else the run's."
    own = method_specs[label].get("budgets", budgets)
    if not own or not all(isinstance(b, int) and b > 0 for b in own):
        raise ValueError(f"method_specs[{label!r}]['budgets'] must be a list of positive ints, got {own!r}")
    return list(own)


compressing = [label for label in method_specs if setting(label) != "dense"]
all_budgets = sorted({b for label in compressing for b in budgets_of(label)})
# kvpress's presses run only in the peer environment (kvpress caps transformers below 5.3, see the README): elsewhere
# their rows are read from the grids where a run there stored them, and never computed
unavailable = {label for label in method_specs if method_params(label)[0] is presses.make and not presses.available()}


def stored_or_run(cells: list[dict], fn, path, desc: str, params: dict, time_limit=None) -> pd.DataFrame:
    "`run_grid` over `cells`, except that those of `unavailable` methods are only read: every stored row, in cell order."
    if here := [c for c in cells if c["method"] not in unavailable]: run_grid(here, fn, path, desc, params, time_limit)
    rows = run_grid(cells, fn, path, desc, params, time_limit=0)
    if missing := sorted({c["method"] for c in cells} & unavailable - set(rows.method)):
        print(f"not run here (kvpress is in the peer environment: `make peers`, then this stage with "
              f".venv-peers/bin/python -m sparsekv.reproduce --only {stem}): {', '.join(missing)}")
    return rows


fits = stored_or_run([{"method": label, "budget": b} for label in compressing for b in budgets_of(label)], fit_cell,
                Path(out_dir)/f"{stem}_fits_grid.csv", desc="fit budgets",
                params={"layers": cfg.num_hidden_layers,
                        "heads": f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}",
                        "probe_window": probe_window,
                        "probe_steps": probe_steps, "chunk_size": chunk_size, "eviction_chunk": eviction_chunk})
nominal = {(r.method, r.budget): int(r.nominal) for r in fits.itertuples() if r.nominal > 0}
not_applicable = [f"{r.method} @ {r.budget}: {r.not_applicable}" for r in fits.itertuples() if r.nominal == 0]
print("\n".join(["not applicable:", *not_applicable]) if not_applicable else "every method fits every ceiling")


def build(label: str, budget: int | None):
    "The method labelled `label` at its fitted nominal budget for the measured ceiling `budget` (dense: none)."
    make, name, params = method_params(label)
    if label not in compressing: return make(name, **params)
    return make(name, nominal[label, budget], **params)


fits[["method", "budget", "nominal", "decode_max", "decode_mean", "dense_layers", "wall_s"]]


# %% [markdown]
# ## Items

# %%
def task_items(label: str) -> list[dict]:
    "The items of one accuracy cell: each seed at each depth."
    spec = dict(cells[label])
    name, length = spec.pop("task", label), spec.pop("length")
    return [{"cell": label, "seed": s, "depth": d, "item": make_task(name, tok, length, s, depth=d, **spec)}
            for s in seeds for d in depths]


items = {label: task_items(label) for label in cells}
windows = packed_sequences(tok, window, split="validation", n=n_windows, seed=0)
for label, its in items.items():
    print(f"{label}: {len(its)} items of {its[0]['item']['context_tokens']} tokens, e.g. answer "
          f"{its[0]['item']['answer']!r}")
print(f"prose: {len(windows)} windows of {window} tokens, the last {window - prose_prefix} scored")

# %% [markdown]
# ## Continuations and answers
#
# One row per (method, budget, item), resumable (`run_grid`): an interrupted run loses at most the
# batch or item in progress. Dense runs once per item (its rows carry budget 0: it has none). Prose
# comes first: its windows are few and cheap per item, so a long run reaches tight intervals there
# before the answers, which prefill a whole prompt per item and method (dense and page retrieval, whose
# prefill is dense, share one per item: `sparsekv.protocol.dense_prefill`).

# %%
reference = next(label for label in method_specs if label not in compressing)
runs = [(reference, 0)] + [(label, b) for b in all_budgets for label in compressing if (label, b) in nominal]
# Prose windows run in batches of `prose_batch` (a decode step reads the weights once for the batch); the
# cells go batch by batch, every method within a batch, so the dense logits of a batch are computed once.
batch_of = lambda w: range(w - w % prose_batch, min(w - w % prose_batch + prose_batch, len(windows)))  # noqa: E731
done_rows, dense_batch = {}, {}


def prose_row(cell: dict) -> dict:
    ws = batch_of(cell["window"])
    key = (cell["method"], cell["budget"], ws.start)
    if key not in done_rows:
        ids = windows[list(ws)].to(device)
        if ws.start not in dense_batch:
            dense_batch.clear()  # one batch of dense logits at a time
            with torch.no_grad(): dense_batch[ws.start] = model(input_ids=ids).logits[:, prose_prefix - 1:-1]
        m = build(cell["method"], cell["budget"] or None)
        rows = continuation(m, model, ids, prose_prefix, dense_batch[ws.start])
        done_rows[key] = {w: {"nominal": m.budget or 0, **r} for w, r in zip(ws, rows)}
    return done_rows[key].pop(cell["window"])


weights = {label: weights_key(label) for label in method_specs}
prose_cells = [{"method": label, "budget": b, **weights[label], "window": w}
               for start in range(0, len(windows), prose_batch) for label, b in runs for w in batch_of(start)]
prose = stored_or_run(prose_cells, prose_row, Path(out_dir)/f"{stem}_prose_grid.csv", desc="prose",
                 params={"model_name": model_name, "dtype": dtype, "device": device, "chunk_size": chunk_size,
                         "eviction_chunk": eviction_chunk, "window_tokens": window, "prose_prefix": prose_prefix})


by_hash = {item_hash(x["item"]): x["item"] for its in items.values() for x in its}


shared = {}  # the current item's dense prefill, shared by the methods that prefill densely (dense, page retrieval)


def answer_row(cell: dict) -> dict:
    m, item = build(cell["method"], cell["budget"] or None), by_hash[cell["item"]]
    if prefills_densely(m) and cell["item"] not in shared:
        shared.clear()
        shared[cell["item"]] = dense_prefill(model, prompt_ids(tok, item, device))
    prefilled = shared[cell["item"]] if prefills_densely(m) else None
    return {"nominal": m.budget or 0, **answer(m, model, tok, item, extra_tokens, prefilled)}


# item by item, every method on each, seed by seed through every cell: a run stopped early still pairs every method
# on the items it finished, with every cell at every depth; the methods that prefill densely share one prefill per item
# (`cells: {}` runs prose alone)
by_seed = sorted((x for its in items.values() for x in its), key=lambda x: x["seed"])  # stable: cells, depths
answer_cells = [{"method": label, "budget": b, **weights[label], "cell": x["cell"], "seed": x["seed"],
                 "depth": x["depth"], "item": item_hash(x["item"])} for x in by_seed for label, b in runs]
answers = stored_or_run(answer_cells, answer_row, Path(out_dir)/f"{stem}_answers_grid.csv", desc="answers",
                   params={"model_name": model_name, "dtype": dtype, "device": device, "extra_tokens": extra_tokens,
                           "chunk_size": chunk_size, "eviction_chunk": eviction_chunk},
                   time_limit=None if answers_hours is None else 3600 * answers_hours) if answer_cells else None
pending = 0 if answers is None else answers.attrs["pending"]
if pending:  # a partial run: at each budget, compare on the items dense and every method at it finished
    n_runs = pd.Series([b for _, b in runs]).value_counts()
    n_done = answers.groupby(["budget", "item"]).size()
    done = {(b, i) for (b, i), n in n_done.items() if n == n_runs[b]}
    finished = {b: {i for b2, i in done if b2 == b and (0, i) in done} for b in all_budgets}
    kept = [(b, i) in done and (0, i) in done if b else any(i in f for f in finished.values())
            for b, i in zip(answers.budget, answers["item"])]
    answers = answers[kept] if any(kept) else None
    finished_note = ", ".join(f"{len(f)} at {b}" for b, f in finished.items())
    print(f"partial: {pending} of {len(answer_cells)} answer cells pending; compared per budget on the items dense "
          f"and every method at it finished ({finished_note}); run the stage again (--force) to continue")


# %%
def long_table(rows: pd.DataFrame, item_cols: list[str], n_cached: int) -> pd.DataFrame:
    "The grid's rows as `compare` reads them: dense without a budget, one item id, each method's scoring costs."
    out = rows.assign(budget=rows.budget.astype(int).astype(object).where(rows.method != reference),
                      item=rows[item_cols].astype(str).agg("/".join, axis=1))
    # kvpress's presses each score in their own way, not counted here
    uncounted = {"prefill_cost": float("nan"), "decode_cost": float("nan")}
    costs = {(label, b): uncounted if method_params(label)[0] is presses.make
             else cost_columns(build(label, b or None), shape, n_cached) for label, b in runs}
    for col in ("prefill_cost", "decode_cost"):
        out[col] = [costs[label, int(b) if b == b and b is not None else 0][col]
                    for label, b in zip(out.method, out.budget)]
    return out


context = max((x["item"]["context_tokens"] for its in items.values() for x in its), default=window)
acc = None if answers is None else long_table(answers, ["cell", "seed", "depth"], context)
txt = long_table(prose, ["window"], window)
if acc is not None:
    display(acc.groupby(["method", "budget"], dropna=False, sort=False)[
        ["correct", "decode_mean", "decode_max", "seconds"]].mean())

# %% [markdown]
# ## Equal measured budgets
#
# The fit was made on the probe window; on the real items every method's decode queries must stay
# within the ceiling in the layers it compresses. The table gives, per method and budget, the most
# entries any decode query attended to (max over items, layers and heads) and the mean.

# %%
measured = pd.concat([t.assign(on=on) for t, on in ((acc, "answers"), (txt, "prose")) if t is not None]
                     ).query("method != @reference")
ceiling = measured.groupby(["method", "budget"], sort=False).agg(
    nominal=("nominal", "first"), decode_max=("decode_max", "max"), decode_mean=("decode_mean", "mean"),
    dense_layers=("dense_layers", "max"), decode_reads=("decode_reads", "mean")).reset_index()
over = ceiling[ceiling.decode_max > ceiling.budget]
assert over.empty, f"methods above their measured ceiling:\n{over}"
ceiling.round(1)


# %% [markdown]
# ## Accuracy and prose fidelity

# %%
def show(table: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    "A protocol table as text: mean ± se, the paired differences (`*`: the 95% interval excludes 0), budgets, costs."
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


kw = dict(reference=reference, baselines=list(dict.fromkeys(label for label, _ in runs[1:])),  # those that ran
          min_items=min_claim_items)
# a partial run compares a cell once two of its items are finished (an interval needs two)
tables = {f"accuracy, {label}": protocol_table(acc[acc.cell == label], "correct", **kw) for label in cells
          if acc is not None and acc[acc.cell == label]["item"].nunique() >= 2}
tables |= {"prose agreement": protocol_table(txt, "agreement", **kw),
           "prose KL": protocol_table(txt, "kl", higher_is_better=False, **kw),
           "prose NLL": protocol_table(txt, "nll", higher_is_better=False, **kw)}
for name, t in tables.items():
    display(Markdown(f"**{name}**, n = {int(t.n.iloc[0])} items"))
    display(show(t))


# %% [markdown]
# ## The figure
#
# Per table, each method's mean with a 95% error bar (±1.96 standard errors), one marker per measured
# budget; dense as a dashed line.

# %%
def plot_table(t: pd.DataFrame, ax) -> None:
    "One protocol table: methods along x, a marker and error bar per budget, the reference as a dashed line."
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


wide = len(compressing) > 12  # many methods: one table per row, wide enough for every label
fig, axes = plt.subplots(len(tables) if wide else 1, 1 if wide else len(tables), layout="constrained",
                         figsize=(2 + 0.32 * len(compressing), 3.4 * len(tables)) if wide else (3.6 * len(tables), 3.8))
for ax, (name, t) in zip(np.atleast_1d(axes), tables.items()):
    plot_table(t, ax)
    ax.set_title(f"{name} (n = {int(t.n.iloc[0])})", fontsize=9)
fig.suptitle(f"Methods on equal terms, {model_name}: each method fitted to the same measured budget per decode query; "
             "error bars: 95% (±1.96 se)", fontsize=10)
save_figure(fig, Path(fig_dir)/f"{stem}.png",
            data=pd.concat([t.assign(table=name) for name, t in tables.items()], ignore_index=True))
plt.show()


# %% [markdown]
# ## Memory, time and the Pareto fronts
#
# What each method stores and how fast it runs, from the same prose runs (`sparsekv.protocol.memory_columns`):
# the most KV entries per KV head any layer held, at its peak and during decode steps, and the KV memory per
# sequence with every layer at its most (MiB); the batch's prefill seconds and milliseconds per decode step
# (`prose_batch` windows at once, median over batches; wall time on this machine, so compare within one run).
# A method is on a Pareto front when no other method has at least its agreement at no more cost, better on
# one of the two.

# %%
def pareto_front(cost, quality) -> np.ndarray:
    "Boolean per point: no other point has quality >= its own at cost <= its own, one of them strictly."
    c, q = np.asarray(cost, float), np.asarray(quality, float)
    dominated = (c[None] <= c[:, None]) & (q[None] >= q[:, None]) & ((c[None] < c[:, None]) | (q[None] > q[:, None]))
    return ~dominated.any(1) & np.isfinite(c) & np.isfinite(q)  # a point without a measurement is on no front


_c, _q = np.random.default_rng(0).integers(0, 5, (2, 40))  # ties included
test_front = [not any(_c[j] <= _c[i] and _q[j] >= _q[i] and (_c[j] < _c[i] or _q[j] > _q[i]) for j in range(40))
              for i in range(40)]
assert pareto_front(_c, _q).tolist() == test_front

MiB = 2 ** 20
by_row = ["method", "budget"]
usage = txt.assign(budget=txt.budget.fillna("-")).groupby(by_row, sort=False).agg(
    kv_peak=("kv_peak", "max"), kv_decode=("kv_decode", "max"), kv_mib_peak=("kv_bytes_peak", "max"),
    kv_mib_decode=("kv_bytes_decode", "max"), prefill_s=("prefill_s", "median"), decode_ms=("decode_ms", "median"))
usage[["kv_mib_peak", "kv_mib_decode"]] /= MiB
agree = tables["prose agreement"]  # (dense repeats once per budget)
agree = agree.assign(budget=agree.budget.where(agree.method != reference, "-")).drop_duplicates(by_row)
agree = agree.set_index(by_row)[["mean", "se"]]
usage = usage.join(agree).reset_index()
usage.insert(2, "setting", usage.method.map(setting))
axes_of = {"kv_mib_peak": "KV MiB per sequence, peak", "kv_mib_decode": "KV MiB per sequence, while decoding",
           "prefill_s": f"prefill seconds (batch of {prose_batch})",
           "decode_ms": f"ms per decode step (batch of {prose_batch})"}
for col in axes_of: usage[f"front_{col}"] = pareto_front(usage[col], usage["mean"])
usage.round(3)

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 11), layout="constrained")
axes = axes.flatten()
colors = dict(zip(dict.fromkeys(usage.setting), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
for ax, (col, title) in zip(axes, axes_of.items()):
    for st, rows in usage.groupby("setting", sort=False):
        ax.errorbar(rows[col], rows["mean"], yerr=1.96 * rows.se, fmt="o", ms=4, capsize=2, color=colors[st],
                    label=st)
    front = usage[usage[f"front_{col}"]].sort_values(col)
    ax.step(front[col], front["mean"], where="post", color="k", lw=0.8, ls=":", label="Pareto front")
    for r in usage.itertuples():
        ax.annotate(f"{r.method}" + (f" @{r.budget}" if len(all_budgets) > 1 and r.budget != "-" else ""),
                    (getattr(r, col), r.mean), fontsize=5.5, xytext=(3, 2), textcoords="offset points")
    ax.set(xlabel=title, ylabel="prose agreement with dense")
axes[0].legend(fontsize=6)
fig.suptitle(f"Quality against memory and time, {model_name} ({len(windows)} windows of {window} tokens; "
             "error bars 95%; times: wall time on this machine)", fontsize=10)
save_figure(fig, Path(fig_dir)/f"{stem}_pareto.png", data=usage)
plt.show()


# %% [markdown]
# ## Accuracy against scoring cost
#
# What each compressing method spends choosing the entries it keeps, against the accuracy it gets at the same
# measured budget: scoring multiply-adds per cached key and KV head (`sparsekv.costs`), per prefill chunk and per
# decode step, on a symmetric-log axis (0: a method that does not score in that phase). Dense is the dashed line:
# it scores nothing but reads every entry, so it is no point on a front. At each budget, a method is on the front
# when no other method at that budget has at least its accuracy at no more cost. A cost-matched baseline
# (`match_cost`) sits at its goal's prefill cost by construction, so the prefill panel is where QuoKA's claim
# against them is read. kvpress's presses are left out (their scoring is not counted).

# %%
def cost_points(t: pd.DataFrame) -> pd.DataFrame:
    "The compressing rows of one accuracy table whose scoring costs are counted, with each row's setting."
    t = t[(t.method != reference) & t.prefill_cost.notna() & t.decode_cost.notna()]
    return t.assign(setting=t.method.map(setting))[[*by_row, "setting", "mean", "se", "prefill_cost", "decode_cost"]]


def cost_front(pts: pd.DataFrame, col: str) -> pd.DataFrame:
    "The rows of `pts` on the accuracy front by the cost in column `col`, budget by budget, cheapest first."
    per_budget = [at[pareto_front(at[col], at["mean"])] for _, at in pts.groupby("budget")]
    return pd.concat([pts.iloc[:0], *per_budget]).sort_values(["budget", col])


phases = {"prefill_cost": "scoring MACs per key and prefill chunk",
          "decode_cost": "scoring MACs per key and decode step"}
acc_points = {name: cost_points(t) for name, t in tables.items() if name.startswith("accuracy, ")}
if acc_points:
    fig, axes = plt.subplots(len(acc_points), 2, figsize=(13, 4.8 * len(acc_points)), layout="constrained",
                             squeeze=False)
    for row, (name, pts) in zip(axes, acc_points.items()):
        for ax, (col, title) in zip(row, phases.items()):
            for st, r in pts.groupby("setting", sort=False):
                ax.errorbar(r[col], r["mean"], yerr=1.96 * r.se, fmt="o", ms=4, capsize=2, color=colors.get(st),
                            label=st)
            for b, front in cost_front(pts, col).groupby("budget"):
                ax.step(front[col], front["mean"], where="post", color="k", lw=0.8, ls=":",
                        label="front" + (f" @{b}" if len(all_budgets) > 1 else ""))
            ax.axhline(float(tables[name].loc[tables[name].method == reference, "mean"].iloc[0]), color="k", ls="--",
                       lw=1, label=reference)
            for r in pts.itertuples():
                ax.annotate(r.method + (f" @{r.budget}" if len(all_budgets) > 1 else ""),
                            (getattr(r, col), r.mean), fontsize=5.5, xytext=(3, 2), textcoords="offset points")
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xlim(left=-0.5)  # costs are >= 0: no negative decades
            ax.set(xlabel=title, ylabel="accuracy", title=name)
        row[0].legend(fontsize=6)
    fig.suptitle(f"Accuracy against scoring cost, {model_name}, at equal measured budgets (error bars 95%; dotted: "
                 "the front at each budget; dashed: dense)", fontsize=10)
    save_figure(fig, Path(fig_dir)/f"{stem}_cost.png",
                data=pd.concat([pts.assign(table=name) for name, pts in acc_points.items()], ignore_index=True))
    plt.show()


# %% [markdown]
# **Compositions against their parts.** For each composition with both parts in the table: the paired
# difference in agreement from each part (95% interval over the same windows), their memory, and the fronts
# the composition is on. What to expect from the rule (methods page): every scored token of the prose is a
# decode step, so a composition's quality there is mostly its decode method's, on better prompt keys and
# values than the decode method would have made alone. QuoKA then KVpop holds the prompt while reading it
# (QuoKA's peak) and KVpop's bounded cache while decoding, so it can win on decode memory (against QuoKA) and
# on quality at equal decode memory (against KVpop alone, which also evicted while reading the prompt); but a
# dense prefill followed by KVpop (`dense+kvpop_mlp`) holds the same memory with exact prompt keys and values,
# so QuoKA's prefill can only pay off in prefill time, which it saves on long prompts (the `quoka_latency`
# stage), not on a few hundred tokens. QuoKA
# then OVAL keeps the whole cache like QuoKA alone, so it can only win on quality or time at that memory: its
# decode reads whole 32-token pages (sink and recent regions rounded out to pages) where QuoKA's own decode
# picks single tokens for each query at the same budget, and at a few hundred cached tokens page scoring saves
# nothing measurable (OVAL's 78 multiply-adds per cached key at decode against QuoKA's 64); retrieval's gain
# is reading contiguous pages of a long cache (the `oval_latency` and `speed` stages).

# %%
def same_method(label: str, part, b) -> bool:
    "Whether the row `label` runs the method `part` (the same class and trained checkpoint)."
    if (label, b) not in nominal or method_params(label)[0] is presses.make: return False
    m = build(label, b)
    return type(m) is type(part) and getattr(m, "checkpoint", None) == getattr(part, "checkpoint", None)


def memory(u) -> str:
    "A usage row's KV MiB per sequence, peak and while decoding (prose rows from before these were measured have none)."
    if not np.isfinite(u.kv_mib_peak): return "memory not recorded"
    return f"{u.kv_mib_peak:.2f} MiB peak / {u.kv_mib_decode:.2f} MiB decoding"


def composition_verdicts() -> list[str]:
    "One bullet per composition and budget: agreement against each part, memory, the fronts it is on."
    out, rows = [], txt.assign(budget=txt.budget.fillna("-"))
    for label in compressing:
        make, name, params = method_params(label)
        if make is presses.make or methods.get(name) is not methods.PrefillDecode: continue
        for b in (b for b in all_budgets if (label, b) in nominal):
            m, me = build(label, b), usage[(usage.method == label) & (usage.budget == b)].iloc[0]
            a = rows[(rows.method == label) & (rows.budget == b)].sort_values("window")
            parts = []
            for role in ("prefill", "decode"):
                other = next((x for x in compressing if x != label and same_method(x, getattr(m, role), b)), None)
                if other is None: continue
                o = rows[(rows.method == other) & (rows.budget == b)].sort_values("window")
                d, lo, hi = paired_ci(a.agreement.to_numpy(), o.agreement.to_numpy())
                ou = usage[(usage.method == other) & (usage.budget == b)].iloc[0]
                parts.append(f"vs {other} ({role}) {d:+.3f} [{lo:+.3f}, {hi:+.3f}]{'*' if lo > 0 or hi < 0 else ''} "
                             f"at {memory(ou)}")
            fronts = [axes_of[c] for c in axes_of if me[f"front_{c}"]]
            out.append(f"- **{label} @ {b}** ({memory(me)}): "
                       + ("; ".join(parts) or "no part in the table") + "; on the front of: "
                       + (", ".join(fronts) or "none") + ".")
    return out


verdicts = composition_verdicts()
display(Markdown("\n".join(verdicts)))


# %% [markdown]
# **Paired comparisons.** For each of `pairs`, `[method, other]`: an ablation against its base (QuoKA with
# the head max in place of §3.3's head mean, against QuoKA) or a claim of a paper (QuoKA against each baseline
# cost-matched to it, OVAL against key PCA, key PCA against Quest), the method minus the other on the items and
# windows of every table both finished, with its 95% interval (`*`: excludes 0, on at least `min_claim_items`).

# %%
def pair_lines() -> list[str]:
    "One bullet per pair and budget: the method minus the other on each table's items, with the interval."
    sources = {f"accuracy, {label}": (acc[acc.cell == label], "correct") for label in cells if acc is not None}
    sources |= {"prose agreement": (txt, "agreement"), "prose KL": (txt, "kl")}
    out = []
    runs_at = lambda label, b: label == reference or (label, b) in nominal  # noqa: E731
    for this, other in pairs:
        for b in (b for b in all_budgets if runs_at(this, b) and runs_at(other, b)):
            parts = []
            for name, (rows, metric) in sources.items():
                pair = rows[(rows.method == this) & (rows.budget == b)][["item", metric]].merge(
                    rows[(rows.method == other) & (rows.budget == b)][["item", metric]], on="item", suffixes=("", "_other"))
                if len(pair) < 2: continue
                d, lo, hi = paired_ci(pair[metric].to_numpy(), pair[f"{metric}_other"].to_numpy())
                claim = len(pair) >= min_claim_items and (lo > 0 or hi < 0)  # as the tables: no claim on few items
                parts.append(f"{name} {d:+.3f} [{lo:+.3f}, {hi:+.3f}]{'*' if claim else ''} (n = {len(pair)})")
            out.append(f"- **{this} vs {other} @ {b}**: " + ("; ".join(parts) or "no item finished by both") + ".")
    return out


paired = pair_lines()
display(Markdown("\n".join(paired or ["no pair in this run"])))


# %% [markdown]
# ## Findings
#
# Read from the tables above: per table, the methods whose paired interval against dense excludes 0
# (behind or ahead), the method ahead of all others when one is, and the largest standard error. With
# fewer than `min_claim_items` items the percentile bootstrap is too narrow (its measured coverage in
# `41_stats`: 0.45 at 2 items, 0.88 at 8, 0.92 from 16), so `compare` marks no difference and none is
# claimed; the intervals are still printed. Beside the largest standard error stands the number of items
# that would bring it to `target_se` (the evaluation issue asks 0.01 of agreement and accuracy): a standard
# error falls as $1/\sqrt{n}$, so $n\,(\mathrm{se}/\mathrm{target})^2$ items. For an accuracy near 1/2
# that is about $0.25/\mathrm{target}^2$ = 2,500 items at a target of 0.01, whatever the method.

# %%
def items_for_se(se: float, n: int, target: float) -> int:
    "Items that bring a standard error `se` measured on `n` items down to `target` (se falls as 1/sqrt(n))."
    return math.ceil(n * (se / target) ** 2)


assert items_for_se(0.05, 100, 0.01) == 2500 and items_for_se(0.005, 40, 0.01) == 10
_hits = np.r_[np.ones(28), np.zeros(27)]  # an accuracy of about 1/2 on 55 items: about 0.25 / 0.01**2 items
assert abs(items_for_se(_hits.std(ddof=1) / np.sqrt(55), 55, 0.01) / 2500 - 1) < 0.02


def largest_se(t) -> str:
    "The table's largest standard error, its method, and the items a standard error of `target_se` would take."
    r = t.loc[t.se.idxmax()]
    if not r.se > 0: return "largest standard error 0.000"
    return (f"largest standard error {r.se:.3f} ({r.method} @ {r.budget}; {target_se} would take about "
            f"{items_for_se(r.se, int(r.n), target_se):,} items)")


def findings() -> list[str]:
    "One bullet per table: who is behind dense (intervals excluding 0), who leads, the largest standard error."
    out = []
    for name, t in tables.items():
        better = "higher" if t.attrs["higher_is_better"] else "lower"
        rows = t[t.method != reference]
        behind = rows[rows.ref_sig & ((rows.diff_ref < 0) == t.attrs["higher_is_better"])]
        lead = rows[rows.base_sig & ((rows.diff_base > 0) == t.attrs["higher_is_better"])]
        if t.n.iloc[0] < min_claim_items:
            out.append(f"- **{name}**: n = {int(t.n.iloc[0])} < {min_claim_items} items, no difference claimed; "
                       f"{largest_se(t)}.")
            continue
        line = (f"- **{name}** ({better} is better, n = {int(t.n.iloc[0])}): behind dense: "
                + (", ".join(f"{r.method} @ {r.budget} ({r.diff_ref:+.3f})" for r in behind.itertuples()) or "none")
                + "; ahead of every other method: "
                + (", ".join(f"{r.method} @ {r.budget} ({r.diff_base:+.3f} vs {r.baseline})"
                             for r in lead.itertuples()) or "none")
                + f"; {largest_se(t)}.")
        out.append(line)
    answer_s = 0 if acc is None else acc.seconds.sum()
    out.append(f"- Time: fits {fits.wall_s.sum():.0f} s, answers {answer_s:.0f} s, prose "
               f"{prose.seconds.sum():.0f} s.")
    return out


notes = findings()
display(Markdown("\n".join(notes)))

# %%
finished_items = {} if acc is None else acc.groupby("cell")["item"].nunique().to_dict()
lines = [f"Dense {model_name} ({dtype}, device {device}, {torch.get_num_threads()} thread(s)). Accuracy cells: "
         + ("; ".join(f"{label} ({finished_items.get(label, 0) if pending else len(items[label])}"
                      f"{f' of {len(items[label])}' if pending else ''} items of "
                      f"{items[label][0]['item']['context_tokens']} tokens)" for label in cells) or "none (prose alone)")
         + f"; prose: {len(windows)} held-out windows of {window} tokens, the last {window - prose_prefix} scored. "
         f"Selection prefill chunks of {chunk_size}, eviction prefill chunks of {eviction_chunk}.", "",
         "**Measured budgets** (fitted nominal budget; decode mean / max over the real items in the compressed "
         "layers; dense layers; mean entries read per decode query over every layer):", "",
         ceiling.round(1).to_markdown(index=False), ""]
if pending: lines[1:1] = ["", f"**Partial run**: {pending} of {len(answer_cells)} answer cells are not computed yet "
                          f"(`answers_hours = {answers_hours}`); at each budget the accuracy tables compare the items "
                          f"dense and every method at that budget finished ({finished_note}). The next run of this "
                          "stage (`--force`) continues the grid."]
if not_applicable: lines += ["**Not applicable** (no nominal budget keeps to the ceiling):", "",
                             *(f"- {x}" for x in not_applicable), ""]
for name, t in tables.items():
    lines += [f"**{name}**", "", show(t).to_markdown(index=False), ""]
usage_md = usage.drop(columns=[c for c in usage if c.startswith("front_")]).round(3)
lines += ["**Memory and time** (KV entries per KV head and MiB per sequence, peak and while decoding; prefill s and "
          f"ms per decode step of a batch of {prose_batch}; prose agreement; nan: prose rows computed before memory and "
          "time were recorded, reused from the committed grid):", "", usage_md.to_markdown(index=False),
          "", "**Compositions**", "", *(verdicts or ["- none in this run"]), ""]
for name, pts in acc_points.items():
    front = {c: ", ".join(f"{r.method} @{r.budget}" for r in cost_front(pts, c).itertuples()) for c in phases}
    lines += [f"**{name} against scoring cost** (`{stem}_cost.png`): on the front by prefill cost (cheapest first): "
              f"{front['prefill_cost']}; by decode cost: {front['decode_cost']}.", ""]
if paired: lines += ["**Paired comparisons** (method minus other, paired, 95% interval):", "", *paired, ""]
lines += ["**Findings**", "", *notes, ""]
write_text(Path(out_dir)/f"{stem}.md", "\n".join(lines))
print("\n".join(lines))
