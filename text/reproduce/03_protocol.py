# %% [markdown]
# # Methods on equal terms: calibrated tasks, measured budgets, paired intervals
#
# > Eviction, selection and page retrieval methods on the retrieval cells dense SmolLM2-135M solves and on held-out prose, each fitted to the same measured budget per decode query, with paired 95% intervals against dense and against the best other method, and the scoring cost of each.

# %% [markdown]
# The evaluation protocol of `sparsekv.protocol` run end to end; how each step works is told at the end of the page.

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
stem = "protocol"  # output names: {stem}.md, {stem}.png, {stem}_*_grid.csv (the leaderboard stage runs this too)

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display
from sparsekv.data import packed_sequences
from sparsekv.io import save_figure, use_style, write_text
from sparsekv.methods import ModelShape
from sparsekv.models import load_model
from sparsekv.protocol import (AnswerRows, MethodSpecs, ProseRows, composition_lines, cost_front, cost_points,
                               findings, finished_answers, fit_row, long_table, measured_ceilings, pair_lines,
                               plot_protocol_table, probe_inputs, protocol_table, show_table, stored_or_run,
                               task_items, usage_table)

if any(len(pair) != 2 or not set(pair) <= set(method_specs) for pair in pairs):
    raise ValueError(f"pairs must be [method, other] labels of method_specs {list(method_specs)}, got {pairs!r}")
use_style()
model, tok = load_model(model_name, dtype=dtype, device=device)
shape = ModelShape.of(model)
print(f"{model_name}, {dtype}, device {device}, {torch.get_num_threads()} thread(s); {shape}")
specs = MethodSpecs(method_specs, shape, budgets, chunk_size, eviction_chunk)
compressing, all_budgets, reference = specs.compressing, specs.all_budgets, specs.reference

# %% [markdown]
# ## Methods and their fitted budgets (`fit_row`)

# %%
cfg = model.config
probe_model, probe_ids = probe_inputs(model, probe_window)
heads = f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}"
fits = stored_or_run([{"method": label, "budget": b} for label in compressing for b in specs.budgets_of(label)],
                     lambda c: fit_row(specs, c["method"], c["budget"], model, probe_model, probe_ids, probe_steps),
                     Path(out_dir)/f"{stem}_fits_grid.csv", desc="fit budgets",
                     params={"layers": cfg.num_hidden_layers, "heads": heads,
                             "probe_window": probe_window, "probe_steps": probe_steps, "chunk_size": chunk_size,
                             "eviction_chunk": eviction_chunk}, unavailable=specs.unavailable, stage=stem)
specs.nominal = {(r.method, r.budget): int(r.nominal) for r in fits.itertuples() if r.nominal > 0}
not_applicable = [f"{r.method} @ {r.budget}: {r.not_applicable}" for r in fits.itertuples() if r.nominal == 0]
print("\n".join(["not applicable:", *not_applicable]) if not_applicable else "every method fits every ceiling")
fits[["method", "budget", "nominal", "decode_max", "decode_mean", "dense_layers", "wall_s"]]

# %% [markdown]
# ## Items

# %%
items = {label: task_items(label, spec, tok, seeds, depths) for label, spec in cells.items()}
windows = packed_sequences(tok, window, split="validation", n=n_windows, seed=0)
for label, its in items.items():
    print(f"{label}: {len(its)} items of {its[0]['item']['context_tokens']} tokens, e.g. answer "
          f"{its[0]['item']['answer']!r}")
print(f"prose: {len(windows)} windows of {window} tokens, the last {window - prose_prefix} scored")

# %% [markdown]
# ## Continuations and answers
#
# One row per (method, budget, item), resumable: an interrupted run loses at most the batch or item in progress.
# Dense runs once per item (its rows carry budget 0: it has none). Prose comes first: its windows are few and cheap
# per item, so a long run reaches tight intervals there before the answers, which prefill a whole prompt per item
# and method (dense and page retrieval, whose prefill is dense, share one per item).

# %%
runs = specs.runs()
weights = {label: specs.weights_key(label) for label in method_specs}
prose_rows = ProseRows(model, windows, prose_prefix, prose_batch, specs.build, device)
prose = stored_or_run(prose_rows.cells(runs, weights), prose_rows, Path(out_dir)/f"{stem}_prose_grid.csv",
                      desc="prose", params={"model_name": model_name, "dtype": dtype, "device": device,
                                            "chunk_size": chunk_size, "eviction_chunk": eviction_chunk,
                                            "window_tokens": window, "prose_prefix": prose_prefix},
                      unavailable=specs.unavailable, stage=stem)
answer_rows = AnswerRows(model, tok, items, specs.build, extra_tokens, device)
answer_cells = answer_rows.cells(runs, weights)  # (`cells: {}` runs prose alone)
answers = stored_or_run(answer_cells, answer_rows, Path(out_dir)/f"{stem}_answers_grid.csv", desc="answers",
                        params={"model_name": model_name, "dtype": dtype, "device": device,
                                "extra_tokens": extra_tokens, "chunk_size": chunk_size,
                                "eviction_chunk": eviction_chunk},
                        time_limit=None if answers_hours is None else 3600 * answers_hours,
                        unavailable=specs.unavailable, stage=stem) if answer_cells else None
pending = 0 if answers is None else answers.attrs["pending"]
if pending:  # a partial run: at each budget, compare on the items dense and every method at it finished
    answers, finished_note = finished_answers(answers, runs, all_budgets)
    print(f"partial: {pending} of {len(answer_cells)} answer cells pending; compared per budget on the items dense "
          f"and every method at it finished ({finished_note}); run the stage again (--force) to continue")
context = max((x["item"]["context_tokens"] for its in items.values() for x in its), default=window)
acc = None if answers is None else long_table(answers, ["cell", "seed", "depth"], reference, specs.costs(context))
txt = long_table(prose, ["window"], reference, specs.costs(window))
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
ceiling = measured_ceilings([acc, txt], reference)
over = ceiling[ceiling.decode_max > ceiling.budget]
assert over.empty, f"methods above their measured ceiling:\n{over}"
ceiling.round(1)

# %% [markdown]
# ## Accuracy and prose fidelity

# %%
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
    display(show_table(t, reference, specs.setting))

# %% [markdown]
# ## Paper vs ours: the paired comparisons
#
# For each of `pairs`, `[method, other]`: an ablation against its base (QuoKA with the head max in place of §3.3's
# head mean, against QuoKA) or a claim of a paper (QuoKA against each baseline cost-matched to it, OVAL against key
# PCA, key PCA against Quest), the method minus the other on the items and windows of every table both finished,
# with its 95% interval (`*`: excludes 0, on at least `min_claim_items`).

# %%
sources = {f"accuracy, {label}": (acc[acc.cell == label], "correct") for label in cells if acc is not None}
sources |= {"prose agreement": (txt, "agreement"), "prose KL": (txt, "kl")}
paired = pair_lines(pairs, sources, lambda label, b: label == reference or (label, b) in specs.nominal, all_budgets,
                    min_claim_items)
display(Markdown("\n".join(paired or ["no pair in this run"])))

# %% [markdown]
# ## The figure
#
# Per table, each method's mean with a 95% error bar (±1.96 standard errors), one marker per measured
# budget; dense as a dashed line.

# %%
wide = len(compressing) > 12  # many methods: one table per row, wide enough for every label
fig, axes = plt.subplots(len(tables) if wide else 1, 1 if wide else len(tables), layout="constrained",
                         figsize=(2 + 0.32 * len(compressing), 3.4 * len(tables)) if wide else (3.6 * len(tables), 3.8))
for ax, (name, t) in zip(np.atleast_1d(axes), tables.items()):
    plot_protocol_table(t, ax, reference)
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
# one of the two (`pareto_front`).

# %%
axes_of = {"kv_mib_peak": "KV MiB per sequence, peak", "kv_mib_decode": "KV MiB per sequence, while decoding",
           "prefill_s": f"prefill seconds (batch of {prose_batch})",
           "decode_ms": f"ms per decode step (batch of {prose_batch})"}
usage = usage_table(txt, tables["prose agreement"], reference, specs.setting, axes_of)
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
phases = {"prefill_cost": "scoring MACs per key and prefill chunk",
          "decode_cost": "scoring MACs per key and decode step"}
acc_points = {name: cost_points(t, reference, specs.setting) for name, t in tables.items()
              if name.startswith("accuracy, ")}
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
# the composition is on (`composition_lines`). What to expect from the rule (methods page): every scored token of
# the prose is a decode step, so a composition's quality there is mostly its decode method's, on better prompt keys
# and values than the decode method would have made alone. QuoKA then KVpop holds the prompt while reading it
# (QuoKA's peak) and KVpop's bounded cache while decoding, so it can win on decode memory (against QuoKA) and
# on quality at equal decode memory (against KVpop alone, which also evicted while reading the prompt); but a
# dense prefill followed by KVpop (`dense+kvpop_mlp`) holds the same memory with exact prompt keys and values,
# so QuoKA's prefill can only pay off in prefill time, which it saves on long prompts (the `quoka_latency`
# stage), not on a few hundred tokens. QuoKA then OVAL keeps the whole cache like QuoKA alone, so it can only win
# on quality or time at that memory: its decode reads whole 32-token pages (sink and recent regions rounded out to
# pages) where QuoKA's own decode picks single tokens for each query at the same budget, and at a few hundred
# cached tokens page scoring saves nothing measurable (the scoring costs of the two are in the tables above);
# retrieval's gain is reading contiguous pages of a long cache (the `oval_latency` and `speed` stages).

# %%
verdicts = composition_lines(specs, txt, usage, axes_of)
display(Markdown("\n".join(verdicts)))

# %% [markdown]
# ## Findings
#
# Read from the tables above: per table, the methods whose paired interval against dense excludes 0
# (behind or ahead), the method ahead of all others when one is, and the largest standard error. With
# fewer than `min_claim_items` items the percentile bootstrap is too narrow (its coverage is measured in
# `41_stats`, well below 95% on few items), so `compare` marks no difference and none is
# claimed; the intervals are still printed. Beside the largest standard error stands the number of items
# that would bring it to `target_se` (the evaluation issue asks 0.01 of agreement and accuracy): a standard
# error falls as $1/\sqrt{n}$, so $n\,(\mathrm{se}/\mathrm{target})^2$ items. For an accuracy near 1/2
# that is about $0.25/\mathrm{target}^2$ = 2,500 items at a target of 0.01, whatever the method.

# %%
answer_s = 0 if acc is None else acc.seconds.sum()
notes = findings(tables, reference, min_claim_items, target_se) + [
    f"- Time: fits {fits.wall_s.sum():.0f} s, answers {answer_s:.0f} s, prose {prose.seconds.sum():.0f} s."]
display(Markdown("\n".join(notes)))

# %%
finished_items = {} if acc is None else acc.groupby("cell")["item"].nunique().to_dict()
lines = [f"Dense {model_name} ({dtype}, device {device}, {torch.get_num_threads()} thread(s)). Accuracy cells: "
         + ("; ".join(f"{label} ({finished_items.get(label, 0) if pending else len(items[label])}"
                      f"{f' of {len(items[label])}' if pending else ''} items of "
                      f"{items[label][0]['item']['context_tokens']} tokens)" for label in cells)
            or "none (prose alone)")
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
    lines += [f"**{name}**", "", show_table(t, reference, specs.setting).to_markdown(index=False), ""]
usage_md = usage.drop(columns=[c for c in usage if c.startswith("front_")]).round(3)
lines += ["**Memory and time** (KV entries per KV head and MiB per sequence, peak and while decoding; prefill s and "
          f"ms per decode step of a batch of {prose_batch}; prose agreement; nan: prose rows computed before memory "
          "and time were recorded, reused from the committed grid):", "", usage_md.to_markdown(index=False),
          "", "**Compositions**", "", *(verdicts or ["- none in this run"]), ""]
for name, pts in acc_points.items():
    front = {c: ", ".join(f"{r.method} @{r.budget}" for r in cost_front(pts, c).itertuples()) for c in phases}
    lines += [f"**{name} against scoring cost** (`{stem}_cost.png`): on the front by prefill cost (cheapest first): "
              f"{front['prefill_cost']}; by decode cost: {front['decode_cost']}.", ""]
if paired: lines += ["**Paired comparisons** (method minus other, paired, 95% interval):", "", *paired, ""]
lines += ["**Findings**", "", *notes, ""]
write_text(Path(out_dir)/f"{stem}.md", "\n".join(lines))
print("\n".join(lines))

# %% [markdown]
# ## How the protocol runs
#
# The per-paper stages take their comparisons from this one.
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
# - **Long runs.** The `cpu-full` answer grid takes many hours on two cores: with `answers_hours` set, a run
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
