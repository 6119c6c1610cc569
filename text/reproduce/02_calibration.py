# %% [markdown]
# # Calibration: which tasks the dense model solves
#
# > Dense accuracy per task and context length, with its standard error: the cells where the uncompressed model scores at least 0.9 on at least 50 items are the accuracy cells every method comparison uses.

# %% [markdown]
# Dense accuracy of greedy answers per retrieval task and context length (`sparsekv.protocol.CalibrationCells`,
# `PrefixReuse`, `accuracy_table`); how the items, answers and intervals are made is told at the end of the page.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
dtype = "float32"
device = "cpu"
lengths = [256]
# label -> {"task": make_task name (default: the label), "lengths": its own lengths (default: `lengths`),
#           "seeds": its own seeds (default: `seeds`), "phrasing": one fixed phrasing (default: all, cycled over
#           the items), **its other options}
tasks = {"passkey": {}, "niah_multikey_2": {"task": "niah_multikey", "n_keys": 2}, "induction_copy": {},
         "kv_retrieval": {}}
depths = [0.0, 1.0]
seeds = [0]
extra_tokens = 3  # decode steps beyond the answer's own tokens
usable_accuracy = 0.9
usable_items = 50

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display
from sparsekv.eval import run_grid
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.models import load_model, model_info
from sparsekv.protocol import (CalibrationCells, PrefixReuse, accuracy_table, calibration_answer, common_prefix,
                               prompt_ids)

# %%
use_style()
model, tok = load_model(model_name, dtype=dtype, device=device)
n_params = sum(p.numel() for p in model.parameters())
print(f"{model_name}, {dtype}, device {device}, {torch.get_num_threads()} thread(s); lengths {lengths}, "
      f"{len(seeds)} seed(s) x {len(depths)} depth(s) = {len(seeds) * len(depths)} items per task and length")
cal = CalibrationCells(tasks, tok, lengths, seeds, depths)
cells = cal.all()
for label in tasks:
    example = cal.item(cal.cells(label, cal.lengths_of(label)[0])[0])
    print(f"--- {label}: {example['context_tokens']} tokens, answer {example['answer']!r}, "
          f"needles {example['needles']}")
    print("...", example["prompt"][-150:], "|", example["answer_prefix"])

# %% [markdown]
# ## Greedy answers with shared prefills
#
# The check: for two items of one seed (the first item of the grid, then the same with its needle at half the
# depth), the second item's logits after reusing the first item's cache match those of a fresh prefill, and the
# reuse covered their common prefix.

# %%
check_label = "passkey" if "passkey" in tasks else next(iter(tasks))
check_cell = cal.cells(check_label, cal.lengths_of(check_label)[0])[0]
reuse = PrefixReuse(model, device)
with torch.inference_mode():
    a, b = (prompt_ids(tok, cal.item({**check_cell, "depth": d}), device)[0]
            for d in (check_cell["depth"], check_cell["depth"] / 2))
    reuse.prefill(a)
    shared_logits, reused = reuse.prefill(b)
    fresh_logits = model(input_ids=b[None], logits_to_keep=1).logits[0, -1]
torch.testing.assert_close(shared_logits, fresh_logits, atol=2e-3, rtol=1e-4)
assert reused == common_prefix(a, b) > 0
print(f"reused {reused} of {len(b)} prompt tokens; max |logit difference| "
      f"{(shared_logits - fresh_logits).abs().max().item():.2e}")

# %%
reuse = PrefixReuse(model, device)  # the grid starts from an empty cache
settings = {"model_name": model_name, "dtype": dtype, "device": device, "extra_tokens": extra_tokens}
rows = run_grid(cells, lambda cell: calibration_answer(reuse, tok, cal.item(cell), extra_tokens, device),
                Path(out_dir)/"calibration_grid.csv", desc="calibration", params=settings)
items = rows.drop(columns=list(settings) + ["item"]).rename(columns={"wall_s": "seconds"})
items["phrasing"] = items.phrasing.astype("Int64")
assert len(items) == len(cells) and items.correct.isin([0, 1]).all()
write_csv(Path(fig_dir)/"calibration_items.csv", items)
items.groupby(["task", "length"])[["correct", "seconds"]].mean()

# %% [markdown]
# ## Accuracy per task and length
#
# Per cell: accuracy, its binomial standard error, the 95% Wilson interval and whether the cell is usable.

# %%
table = accuracy_table(items, usable_accuracy, usable_items)
all_lengths = sorted({L for label in tasks for L in cal.lengths_of(label)})
longest = items.length == items.task.map({label: max(cal.lengths_of(label)) for label in tasks})
by_depth_max = items[longest].pivot_table(index="task", columns="depth", values="correct",
                                          aggfunc="mean", sort=False).sort_index(axis=1)
display(table.round(3))
by_depth_max.round(2)


# %% [markdown]
# ## Paper vs ours

# %%
def fmt_cell(r) -> str:
    "One cell as `task @ L: accuracy (n, 95% interval)`."
    return f"{r.task} @ {r.length}: {r.accuracy:.2f} (n = {r.n}, 95% CI {r.ci_lo:.2f}-{r.ci_hi:.2f})"


best = table.sort_values("accuracy").iloc[-1]
paper_vs_ours = [
    "| claim | paper | ours | why they differ |", "|---|---|---|---|",
    "| the dense model retrieves a single needle at every length and depth | QuoKA §4.1, Fig. 4: full attention on "
    "Llama3.2-3B-Instruct up to 30K tokens (no number in the text) | best cell: " + fmt_cell(best)
    + f"; usable cells: {int(table.usable.sum())} of {len(table)} | a {n_params / 1e6:.0f}M model with a "
    f"{(model_info(model).max_positions or 0) // 1024}k training context, "
    f"lengths {all_lengths} |",
    "| dense RULER scores are the ceiling of every method | QuoKA Table 1 and OVAL Tables 1-2 report full attention "
    "beside each method (their numbers are not in our copies' text) | the accuracies above, with their intervals | "
    "our tasks are RULER-style retrieval only; cells below the threshold are not used for accuracy |"]
display(Markdown("\n".join(paper_vs_ours)))

# %% [markdown]
# ## The heatmap
#
# Left: dense accuracy per task and length, the number of items in each cell, and a frame around the usable cells.
# Right: at each task's longest length, accuracy per needle depth (0 = the start of the haystack, 1 = its end).

# %%
fig, axes = plt.subplots(1, 2, figsize=(3.6 + 1.0 * max(2, len(all_lengths)) + 0.5 * max(5, len(depths)),
                                         0.45 * len(tasks) + 2.4),
                         layout="constrained", sharey=True,
                         gridspec_kw={"width_ratios": [max(2, len(all_lengths)), 0.5 * max(5, len(depths))]})
acc = table.pivot(index="task", columns="length", values="accuracy").loc[list(tasks)]
n_items = table.pivot(index="task", columns="length", values="n").loc[list(tasks)]
usable = table.pivot(index="task", columns="length", values="usable").loc[list(tasks)]
depth_acc = by_depth_max.loc[list(tasks)]
for ax, m in zip(axes, (acc, depth_acc)):
    im = ax.imshow(m.to_numpy(dtype=float), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(len(m.index)), m.index)
    ax.grid(False)
for (r, c), v in np.ndenumerate(acc.to_numpy(dtype=float)):
    if np.isnan(v): continue  # a length this task is not measured at
    axes[0].text(c, r, f"{v:.2f}\nn = {int(n_items.iat[r, c])}", ha="center", va="center", fontsize=8,
                 color="black" if v > 0.5 else "white")
    if usable.iat[r, c]:
        axes[0].add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
for (r, c), v in np.ndenumerate(depth_acc.to_numpy(dtype=float)):
    axes[1].text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="black" if v > 0.5 else "white")
axes[0].set_xticks(range(len(acc.columns)), [str(L) for L in acc.columns])
axes[0].set(xlabel="context length (tokens)", title="per length")
axes[1].set_xticks(range(len(depth_acc.columns)), [f"{d:.0%}" for d in depth_acc.columns], fontsize=7)
axes[1].set(xlabel="needle depth", title=f"per depth at each task's longest length, {len(seeds)} item(s) per cell")
fig.colorbar(im, ax=axes, label="dense accuracy", shrink=0.9)
fig.suptitle(f"Accuracy of dense {model_name}, greedy answers; red frame: usable cell (accuracy >= "
             f"{usable_accuracy}, n >= {usable_items})", fontsize=10)
for ax in axes: ax.title.set_fontsize(9)
save_figure(fig, Path(fig_dir)/"calibration.png", data=table)
plt.show()


# %% [markdown]
# ## What the model can and cannot do
#
# Computed from the items above: the usable cells, then per task the weakest depth, the wrong answers that name
# a distractor's number (multi-needle and key-value tasks), the share of the words copied in wrong induction
# answers, and per phrasing for the passkey.

# %%
def findings() -> list[str]:
    "Bullet points about what the dense model can and cannot do, from the items of this run."
    good = table[table.usable]
    solved = table[table.accuracy >= usable_accuracy]
    out = [f"- Usable accuracy cells (accuracy >= {usable_accuracy}, n >= {usable_items}): "
           + ("; ".join(fmt_cell(r) for r in good.itertuples()) if len(good) else "none in this run") + "."]
    if len(solved) > len(good):
        out.append(f"- Solved (>= {usable_accuracy}) but with fewer than {usable_items} items, so not usable yet: "
                   + "; ".join(fmt_cell(r) for r in solved[~solved.usable].itertuples()) + ".")
    failed = table[table.accuracy < usable_accuracy]
    if len(failed):
        out.append(f"- Below {usable_accuracy}: " + "; ".join(fmt_cell(r) for r in failed.itertuples()) + ".")
    for label in tasks:
        sub = items[items.task == label]
        wrong = sub[sub.correct == 0]
        line = f"- `{label}`: {int(sub.correct.sum())}/{len(sub)} correct over all lengths"
        if len(wrong):
            worst = sub.groupby("depth").correct.mean()
            line += (f"; weakest depth {worst.idxmin():.0%} ({worst.min():.2f}), best {worst.idxmax():.0%} "
                     f"({worst.max():.2f})")
            if wrong.distractor.any() or cal.task_name(label) in ("niah_multikey", "kv_retrieval"):
                line += f"; {int(wrong.distractor.sum())} of {len(wrong)} wrong answers name a distractor's number"
            if cal.task_name(label) == "induction_copy":
                line += f"; wrong answers copy {wrong.words_found.mean():.0%} of the words on average"
        if cal.task_name(label) in cal.PHRASINGS and "phrasing" not in tasks[label]:
            per = sub.groupby("phrasing").correct.mean()
            line += "; per phrasing " + ", ".join(f"{int(p)}: {v:.2f}" for p, v in per.items())
        out.append(line + ".")
    reused = items.reused_tokens.sum() / items.context_tokens.sum()
    out.append(f"- Time: {items.seconds.mean():.1f} s per item on average ({items.seconds.sum() / 60:.1f} min in "
               f"all); the shared prefills reused {reused:.0%} of the prompt tokens.")
    return out


notes = findings()
display(Markdown("\n".join(notes)))

# %%
fmt_table = table.assign(ci=[f"{lo:.3f}-{hi:.3f}" for lo, hi in zip(table.ci_lo, table.ci_hi)]).drop(
    columns=["ci_lo", "ci_hi"]).round(3)
lines = [
    f"Dense {model_name} ({dtype}, device {device}, {torch.get_num_threads()} thread(s)), greedy answers after the "
    f"prompt and answer prefix; {len(seeds)} seed(s) x {len(depths)} depth(s) per task and length.", "",
    fmt_table.to_markdown(index=False), "",
    "Accuracy per needle depth at each task's longest length:", "", by_depth_max.round(2).to_markdown(), "",
    "**Findings**", "", *notes, "",
    "**Paper vs ours**", "", *paper_vs_ours, ""]
write_text(Path(out_dir)/"calibration.md", "\n".join(lines))
print("\n".join(lines))

# %% [markdown]
# ## How the calibration runs
#
# A compression method can only lose accuracy the dense model has: on a task the dense model fails, every method
# ties at the floor and the comparison shows nothing. This stage measures, for the default model and without any
# compression, the accuracy of greedy answers on the retrieval tasks of `sparsekv.data` at each context length:
#
# - `passkey`: one number of 5 to 7 digits, asked in one of the phrasings of `PASSKEY_PHRASINGS`;
# - `niah_multikey` with few keys: several needles *"The special magic number for KEY is: N."*, asked for one;
# - `induction_copy`: repeat the words that followed a unique marker ("repeat the earlier line");
# - `kv_retrieval`: the value of one key in a block of key-value pairs.
#
# **Items.** Every (task, length) cell has the same items: each seed at each needle depth, and for a task with
# phrasings the phrasing cycles over the items, so each phrasing is asked about equally often and at every depth.
# Items of one seed share their haystack and values (see `make_task`), so they differ only in where the answer is
# (and its phrasing). The results are kept per item in a resumable grid (`run_grid`), keyed by a hash of the item's
# text, so an interrupted run resumes and a changed task generator never reuses old rows.
#
# **Answers.** The prompt, a space and the task's answer prefix are prefilled densely, then the model decodes
# greedily as many tokens as the answer has plus `extra_tokens`; an item is correct when `score_exact` finds the
# whole answer in the completion.
#
# **Shared prefills.** Items of one seed share the prompt up to their needle, so the items run from the deepest
# needle to the shallowest and each reuses the previous item's KV cache up to their longest common prefix
# (cropped, then extended by the rest of its prompt, `PrefixReuse`): an item at depth $d$ prefills about
# $(1 - d)L$ tokens instead of $L$. A check above shows the reused prefill gives the logits of a fresh one.
#
# **Statistics.** Per cell: the accuracy $\hat p$ over its $n$ items, the binomial standard error
# $\sqrt{\hat p(1-\hat p)/n}$ and the 95% Wilson score interval, the set of $p$ with
# $|\hat p - p| \le z\sqrt{p(1-p)/n}$, $z = 1.96$, which (unlike $\hat p \pm z\,\mathrm{SE}$) stays inside $[0, 1]$
# and does not collapse to a point at $\hat p = 1$. Items of one seed are not independent (shared haystack and
# value), so read the intervals as a lower bound on the uncertainty. A cell is *usable* as an accuracy cell when
# $\hat p \ge 0.9$ with $n \ge 50$.
