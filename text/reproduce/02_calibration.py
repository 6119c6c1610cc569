# %% [markdown]
# # Calibration: which tasks the dense model solves
#
# > Dense accuracy per task and context length, with its standard error: the cells where the uncompressed model scores at least 0.9 on at least 50 items are the accuracy cells every method comparison uses.

# %% [markdown]
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
# (cropped, then extended by the rest of its prompt): an item at depth $d$ prefills about $(1 - d)L$ tokens
# instead of $L$. A check below shows the reused prefill gives the logits of a fresh one.
#
# **Statistics.** Per cell: the accuracy $\hat p$ over its $n$ items, the binomial standard error
# $\sqrt{\hat p(1-\hat p)/n}$ and the 95% Wilson score interval, the set of $p$ with
# $|\hat p - p| \le z\sqrt{p(1-p)/n}$, $z = 1.96$, which (unlike $\hat p \pm z\,\mathrm{SE}$) stays inside $[0, 1]$
# and does not collapse to a point at $\hat p = 1$. Items of one seed are not independent (shared haystack and
# value), so read the intervals as a lower bound on the uncertainty. A cell is *usable* as an accuracy cell when
# $\hat p \ge 0.9$ with $n \ge 50$.

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
import inspect
import re
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

from sparsekv.data import PASSKEY_PHRASINGS, SYNTHETIC_TASKS, count_tokens, make_task, score_exact
from sparsekv.eval import run_grid
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.models import load_model, model_info
from sparsekv.protocol import item_hash, prompt_ids

# %%
use_style()
model, tok = load_model(model_name, dtype=dtype, device=device)
n_params = sum(p.numel() for p in model.parameters())
print(f"{model_name}, {dtype}, device {device}, {torch.get_num_threads()} thread(s); lengths {lengths}, "
      f"{len(seeds)} seed(s) x {len(depths)} depth(s) = {len(seeds) * len(depths)} items per task and length")

# %% [markdown]
# ## Items

# %%
PHRASINGS = {"passkey": len(PASSKEY_PHRASINGS)}  # tasks asked in several phrasings, and how many


def task_name(label: str) -> str:
    "The `make_task` name of the task labelled `label`."
    name = tasks[label].get("task", label)
    if name not in SYNTHETIC_TASKS: raise ValueError(f"tasks[{label!r}]: task must be one of {tuple(SYNTHETIC_TASKS)}")
    if "depth" not in inspect.signature(SYNTHETIC_TASKS[name]).parameters:
        raise ValueError(f"tasks[{label!r}]: {name} has no needle depth; calibrated tasks need one")
    return name


@lru_cache(maxsize=None)
def _item(label: str, length: int, seed: int, depth: float, phrasing: int | None) -> dict:
    options = {k: v for k, v in tasks[label].items() if k not in ("task", "lengths", "seeds")}
    if phrasing is not None: options["phrasing"] = phrasing
    return make_task(task_name(label), tok, length, seed, depth=depth, **options)


def task_item(cell: dict) -> dict:
    "The `make_task` item of one cell (made once)."
    return _item(cell["task"], cell["length"], cell["seed"], cell["depth"], cell["phrasing"])


def task_lengths(label: str) -> list[int]:
    "The context lengths the task labelled `label` is measured at."
    return tasks[label].get("lengths", lengths)


def cells_of(label: str, length: int) -> list[dict]:
    "The items of one (task, length): each seed at each depth (deepest first), phrasings cycled over the items."
    n_phr = None if "phrasing" in tasks[label] else PHRASINGS.get(task_name(label))
    cells = [{"task": label, "length": length, "seed": s, "depth": d,
              "phrasing": None if n_phr is None else (i * len(depths) + j) % n_phr}
             for i, s in enumerate(tasks[label].get("seeds", seeds))
             for j, d in sorted(enumerate(depths), key=lambda jd: -jd[1])]
    # a hash of each item's text in its row's key: a changed task generator or option never reuses old rows
    return [{**c, "item": item_hash(task_item(c))} for c in cells]


cells = [c for label in tasks for L in task_lengths(label) for c in cells_of(label, L)]
for label in tasks:
    example = task_item(cells_of(label, task_lengths(label)[0])[0])
    print(f"--- {label}: {example['context_tokens']} tokens, answer {example['answer']!r}, "
          f"needles {example['needles']}")
    print("...", example["prompt"][-150:], "|", example["answer_prefix"])


# %% [markdown]
# ## Greedy answers with shared prefills

# %%
def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    "Length of the longest common prefix of two 1-D token tensors."
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class PrefixReuse:
    "Dense prefills that reuse the KV cache of the previous prompt up to the longest common prefix."

    def __init__(self):
        self.ids, self.cache = torch.zeros(0, dtype=torch.long, device=device), None

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        "Logits of the last position of `ids` [L] and the number of prompt tokens whose keys and values were reused."
        n = min(common_prefix(self.ids, ids), len(ids) - 1)  # at least one token to compute the logits from
        if n: self.cache.crop(n - self.cache.get_seq_length())  # drops the rest of the previous prompt and its answer
        out = model(input_ids=ids[None, n:], past_key_values=self.cache if n else None, use_cache=True,
                    logits_to_keep=1)
        self.ids, self.cache = ids, out.past_key_values
        return out.logits[0, -1], n


reuse = PrefixReuse()


@torch.inference_mode()
def greedy(ids: torch.Tensor, n_new: int) -> tuple[str, int]:
    "Greedy completion of `n_new` tokens (or up to EOS) after `ids` [L], and the prompt tokens reused."
    logits, reused = reuse.prefill(ids)
    out = [int(logits.argmax())]
    while len(out) < n_new and out[-1] != tok.eos_token_id:
        step = torch.tensor([[out[-1]]], device=device)
        out.append(int(model(input_ids=step, past_key_values=reuse.cache, use_cache=True).logits[0, -1].argmax()))
    return tok.decode(out, skip_special_tokens=True), reused


# %% [markdown]
# The check: for two items of one seed (the first item of the grid, then the same with its needle at half the
# depth), the second item's logits after reusing the first item's cache match those of a fresh prefill, and the
# reuse covered their common prefix.

# %%
check_label = "passkey" if "passkey" in tasks else next(iter(tasks))
check_cell = cells_of(check_label, task_lengths(check_label)[0])[0]
with torch.inference_mode():
    a, b = (prompt_ids(tok, task_item({**check_cell, "depth": d}), device)[0]
            for d in (check_cell["depth"], check_cell["depth"] / 2))
    reuse.prefill(a)
    shared_logits, reused = reuse.prefill(b)
    fresh_logits = model(input_ids=b[None], logits_to_keep=1).logits[0, -1]
torch.testing.assert_close(shared_logits, fresh_logits, atol=2e-3, rtol=1e-4)
assert reused == common_prefix(a, b) > 0
print(f"reused {reused} of {len(b)} prompt tokens; max |logit difference| "
      f"{(shared_logits - fresh_logits).abs().max().item():.2e}")
reuse = PrefixReuse()  # start the grid from an empty cache


# %%
def other_numbers(item: dict) -> list[str]:
    "The numbers of the prompt other than the answer (the distractors of the multi-needle and key-value tasks)."
    return sorted(set(re.findall(r"\d+", item["prompt"])) - {item["answer"]})


def answer_cell(cell: dict) -> dict:
    "Greedy answer of one item: correct (0/1), the completion, distractor use and words found."
    item = task_item(cell)
    n_new = count_tokens(tok, " " + item["answer"]) + extra_tokens
    text, reused = greedy(prompt_ids(tok, item, device)[0], n_new)
    correct = int(score_exact(text, item["answer"]) == 1.0)
    distractor = int(not correct and any(score_exact(text, x) == 1.0 for x in other_numbers(item)))
    return {"correct": correct, "distractor": distractor, "words_found": score_exact(text, item["answer"].split()),
            "reused_tokens": reused, "context_tokens": item["context_tokens"], "completion": text.replace("\n", "\\n")}


settings = {"model_name": model_name, "dtype": dtype, "device": device, "extra_tokens": extra_tokens}
rows = run_grid(cells, answer_cell, Path(out_dir)/"calibration_grid.csv", desc="calibration", params=settings)
items = rows.drop(columns=list(settings) + ["item"]).rename(columns={"wall_s": "seconds"})
items["phrasing"] = items.phrasing.astype("Int64")
assert len(items) == len(cells) and items.correct.isin([0, 1]).all()
write_csv(Path(fig_dir)/"calibration_items.csv", items)
items.groupby(["task", "length"])[["correct", "seconds"]].mean()


# %% [markdown]
# ## Accuracy per task and length
#
# The Wilson interval is checked against its definition: on a fine grid of $p$, the points that satisfy
# $|\hat p - p| \le z\sqrt{p(1-p)/n}$ span the interval.

# %%
def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    "The Wilson score interval of a binomial proportion with k successes in n trials."
    z = NormalDist().inv_cdf((1 + level) / 2)
    p, z2 = k / n, z * z / n
    centre, half = (p + z2 / 2) / (1 + z2), z / (1 + z2) * np.sqrt(p * (1 - p) / n + z2 / (4 * n))
    return max(0.0, centre - half), min(1.0, centre + half)


grid_p = np.linspace(0, 1, 200_001)
for k, n in [(0, 5), (3, 10), (47, 50), (50, 50), (120, 400)]:
    z = NormalDist().inv_cdf(0.975)
    inside = grid_p[np.abs(k / n - grid_p) <= z * np.sqrt(grid_p * (1 - grid_p) / n)]
    np.testing.assert_allclose(wilson(k, n), (inside.min(), inside.max()), atol=1e-5)


def accuracy_table(items: pd.DataFrame) -> pd.DataFrame:
    "Accuracy per (task, length): n, accuracy, binomial standard error, 95% Wilson interval, usable."
    t = items.groupby(["task", "length"], sort=False).correct.agg(n="size", k="sum").reset_index()
    t["accuracy"] = t.k / t.n
    t["se"] = np.sqrt(t.accuracy * (1 - t.accuracy) / t.n)
    t["ci_lo"], t["ci_hi"] = zip(*(wilson(k, n) for k, n in zip(t.k, t.n)))
    t["usable"] = (t.accuracy >= usable_accuracy) & (t.n >= usable_items)
    return t.drop(columns="k")


table = accuracy_table(items)
all_lengths = sorted({L for label in tasks for L in task_lengths(label)})
longest = items.length == items.task.map({label: max(task_lengths(label)) for label in tasks})
by_depth_max = items[longest].pivot_table(index="task", columns="depth", values="correct",
                                          aggfunc="mean", sort=False).sort_index(axis=1)
display(table.round(3))
by_depth_max.round(2)

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
fig.suptitle("Calibration, no paper figure (the dense rows behind QuoKA Fig. 4 / Table 1, OVAL Tables 1-2):\n"
             f"accuracy of dense {model_name}, greedy answers; red frame: usable cell (accuracy >= "
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
def fmt_cell(r) -> str:
    "One cell as `task @ L: accuracy (n, 95% interval)`."
    return f"{r.task} @ {r.length}: {r.accuracy:.2f} (n = {r.n}, 95% CI {r.ci_lo:.2f}-{r.ci_hi:.2f})"


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
            if wrong.distractor.any() or task_name(label) in ("niah_multikey", "kv_retrieval"):
                line += f"; {int(wrong.distractor.sum())} of {len(wrong)} wrong answers name a distractor's number"
            if task_name(label) == "induction_copy":
                line += f"; wrong answers copy {wrong.words_found.mean():.0%} of the words on average"
        if task_name(label) in PHRASINGS and "phrasing" not in tasks[label]:
            per = sub.groupby("phrasing").correct.mean()
            line += "; per phrasing " + ", ".join(f"{int(p)}: {v:.2f}" for p, v in per.items())
        out.append(line + ".")
    reused = items.reused_tokens.sum() / items.context_tokens.sum()
    out.append(f"- Time: {items.seconds.mean():.1f} s per item on average ({items.seconds.sum() / 60:.1f} min in "
               f"all); the shared prefills reused {reused:.0%} of the prompt tokens.")
    return out


notes = findings()
display(Markdown("\n".join(notes)))

# %% [markdown]
# ## Paper vs ours

# %%
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
