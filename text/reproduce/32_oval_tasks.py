# %% [markdown]
# # OVAL: end tasks with decode-time page retrieval
#
# > Needle and RULER-style accuracy and generation agreement with full attention when every decoded token attends to retrieved pages (full, Quest, ArkVale, key PCA, OVAL per eta, oracle): Table 1/2 and Table 4 analogues on SmolLM2.

# %% [markdown]
# The answers a model gives when it *decodes* with page retrieval (OVAL §4, App. D; stage `oval_quality`
# measures the retrieval itself). The protocol is described under the first table.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
dtype = "float32"
device = "cpu"
contexts = [1024]
needle_depths = [0.5]
ruler_tasks = ["niah_multikey"]
n_samples = 1            # seeds per (task, context, depth)
max_new_tokens = {"niah_single": 10, "niah_multikey": 10, "variable_tracking": 24, "common_words": 32}
gen_contexts = [1024]
n_gen = 1                # prose prompts per generation context
gen_tokens = 16
check_tokens = 6         # greedy tokens of the batching check
budget_fractions = [0.125]
etas = [0.25, 0.5, 0.75, 1.0]
page_size = 32
rank = 8
sink = 32
recent = 32
dense_layers = 1
spec_steps = 2
tau = 0.8
chunk_size = 1024
threads = 1
seed = 0

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

from sparsekv.data import packed_sequences
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.models import load_model, model_info
from sparsekv.oval.experiments import (arm_label, arm_policy, arm_table, arms_grids, decode_arms, eta_goal,
                                       held_back_prefill, md_table, plot_eta_curve, retrieval_arms)

if threads: torch.set_num_threads(threads)
use_style()
torch.manual_seed(seed)
model, tok = load_model(model_name, dtype=dtype, device=device)
print(model_info(model), f"; {torch.get_num_threads()} threads on {device}")

# %%
ARMS = [("full", 0.0, 1.0)] + [(m, e, f) for f in budget_fractions for m, e in retrieval_arms(etas)]
retrieval = dict(page_size=page_size, rank=rank, sink=sink, recent=recent, dense_layers=dense_layers,
                 spec_steps=spec_steps, tau=tau)
ITEMS = [("niah_single", c, d, s) for c in contexts for d in needle_depths for s in range(n_samples)] + \
        [(t, c, None, s) for c in contexts for t in ruler_tasks for s in range(n_samples)]
tasks_res, gen_res = arms_grids(model, tok, ARMS, ITEMS, [(c, s) for c in gen_contexts for s in range(n_gen)],
                                retrieval, max_new_tokens, gen_tokens, n_gen, chunk_size, seed=seed, out_dir=out_dir,
                                params={"model": model_name, "dtype": dtype, "device": device})
write_csv(Path(fig_dir)/"oval_tasks_items.csv", tasks_res)
write_csv(Path(fig_dir)/"oval_tasks_generation.csv", gen_res)

# %% [markdown]
# ## Table 1/2 analogue: accuracy and agreement with full attention per arm and budget

# %%
table = arm_table(tasks_res, gen_res, ruler_tasks, ARMS)
table

# %% [markdown]
# Columns: the needle test (single-key needle, mean over depths), each RULER-style task and their mean,
# the share of answers token-identical to full attention's (`same_as_full`), and generation agreement
# with full attention.
#
# **Protocol.** Each prompt is prefilled densely, once (`chunked_prefill`), and the full cache stays
# resident; the prompt's last token is held back, so that every answer token comes from a decode step.
# Every arm then decodes greedily from a copy of that cache. At each decode step and layer past the
# first (layer 0 stays dense, App. D.3), each KV head attends to the sink page, the recent page and
# the top pages of its method's summaries that fit the token budget (`PageRetrievalPolicy`: page size
# 32, rank 8, avgSM GQA aggregation, speculative retrieval from the query `spec_steps` steps back with
# correction below `tau`, as App. D's FreeKV setup). The arms of one prompt run side by side as the rows
# of one batch (`ArmsPolicy`), so one prefill serves them all.
#
# Methods: full attention, Quest, ArkVale, key PCA ($\eta=0$), OVAL at each $\eta$ (with
# $G = \sum_g W_{O,g}^\top W_{O,g}$ from each layer's `o_proj`) and the oracle (exact page log-mass).
# **Budget**: the paper keeps $\mathcal B = 2048$ tokens of up to 16k (ratio 1/8); here the budget is
# the fraction `budget_fractions` of the context, sink and recent one page each.
#
# **Tasks** (`sparsekv.data.make_task`, scored by `score_exact`): the single-key needle at several
# depths, and RULER-style multi-key needle, variable tracking and common words. The prompt is the task's
# prompt, a newline and its answer prefix, completed as raw text (no chat template); the answer is cut
# at the first end-of-text token. **Generation agreement** (the long-generation analogue of
# LongGenBench, Table 2): a window of held-out prose is prefilled, full attention continues it greedily
# for `gen_tokens` tokens, and every arm decodes under teacher forcing on that continuation: top-1
# agreement with full attention's next token, the first position where they differ (where a
# free-running greedy generation would first diverge), and the mean KL(full || arm).
#
# Checks: scores lie in $[0, 1]$; full attention agrees with itself at every position of the
# teacher-forced continuation (its row is the teacher); on a short prompt, the arms batched give the
# greedy tokens of each arm decoded alone (the library notebook checks the rest of the loop on a tiny
# model: a budget over the cache is full attention, the teacher-forced first divergence is the
# free-running one).

# %%
assert tasks_res.score.between(0, 1).all()
full_gen = gen_res[gen_res.method == "full"]
assert (full_gen.agreement == 1).all() and (full_gen.first_divergence == gen_tokens).all()
_cache, _first = held_back_prefill(model, packed_sequences(tok, 300, "validation", n=1, seed=seed + 1), chunk_size)
_pols = lambda: [arm_policy(m, e, 150, **retrieval) for m, e in (("full", 0.0), ("quest", 0.0), ("oval", 0.5))]
_tok = decode_arms(model, _cache, _first, _pols(), check_tokens)[0]
for a, pol in enumerate(_pols()):
    assert torch.equal(decode_arms(model, _cache, _first, [pol], check_tokens)[0][0], _tok[a]), f"arm {a}"

# %% [markdown]
# Needle accuracy by depth and context (the needle-in-a-haystack grid, mean over samples).

# %%
needle = tasks_res[tasks_res.family == "needle"].copy()
needle["arm"] = [arm_label(m, e) for m, e in zip(needle.method, needle.eta)]
needle_grid = needle.pivot_table(index=["budget_fraction", "arm"], columns=["context", "depth"], values="score",
                                 aggfunc="mean", sort=False)
needle_grid.columns = [f"{c} @ depth {d:g}" for c, d in needle_grid.columns]
needle_grid

# %% [markdown]
# ## Table 4 analogue (sensitivity to $\eta$)
#
# OVAL at each $\eta$ ($\eta = 0$ is key PCA) per budget, on each metric; the best $\eta$ per budget and
# metric against key PCA and Quest. (Stage `oval_quality` does the Table 3 analogue, $\eta$ chosen on
# calibration windows, on activation-level metrics.)

# %%
METRICS = [("needle", max), ("ruler", max), ("same_as_full", max), ("gen_agreement", max), ("gen_kl", min)]
spectral = table[table.method.isin(["keypca", "oval"])]
table4 = spectral.pivot_table(index="eta", columns="budget_fraction", values=[m for m, _ in METRICS], sort=False)
goal = eta_goal(table, budget_fractions, METRICS)
write_csv(Path(fig_dir)/"oval_tasks_goal.csv", goal)
table4

# %%
goal

# %% [markdown]
# **Paper vs ours.** The paper reports task accuracy of 7-14B models at up to 64k tokens; ours is a
# 135M model at 1-4k tokens, so only the direction of each claim is comparable.

# %%
per_budget = lambda metric_name, fmt: "; ".join(f"budget {r.budget_fraction:g}: {fmt(r)}"
                                                for r in goal[goal.metric == metric_name].itertuples())
paper_vs_ours = pd.DataFrame([
    {"claim": "OVAL (best eta) is the best compressed method",
     "paper": "Table 1 / §4.1: best in all nine settings; e.g. Llama 8B average avg@k 55.69 vs FreeKV 51.83, "
              "Quest 47.81, ArkVale 49.64",
     "ours": "needle accuracy, best OVAL / key PCA / Quest / ArkVale: "
             + per_budget("needle", lambda r: f"{r.best_oval:.3f} / {r.keypca:.3f} / {r.quest:.3f} / {r.arkvale:.3f}"),
     "why they differ": "135M model, single-key needle at 1-4k tokens with few items, not long reasoning"},
    {"claim": "OVAL can match or exceed full attention",
     "paper": "Table 2 / §4.2: LongBench v2 Overall 29.82 (OVAL) vs 29.22 (FullKV) on Llama 3.1 8B",
     "ours": "needle accuracy, best OVAL vs full: "
             + per_budget("needle", lambda r: f"{r.best_oval:.3f} vs {r.full:.3f}"),
     "why they differ": "the needle task is easy for the dense model, so a sparse arm can at most tie it"},
    {"claim": "long generation is model dependent",
     "paper": "Table 2 / §4.2: LongGenBench CR 74.71 (OVAL) vs 78.03 (FreeKV) on Llama 8B, 78.54 vs 76.93 on Qwen 7B",
     "ours": "generation KL(full || arm), best OVAL / key PCA / Quest: "
             + per_budget("gen_kl", lambda r: f"{r.best_oval:.3f} / {r.keypca:.3f} / {r.quest:.3f}"),
     "why they differ": f"KL over {gen_tokens} teacher-forced tokens of prose, not a judged 16k-token completion"},
    {"claim": "no universally optimal eta",
     "paper": "Table 4 / §4.4: the best eta differs across tasks and models",
     "ours": "best eta per metric: " + "; ".join(f"{r.metric} @ {r.budget_fraction:g}: {r.best_eta}"
                                               for r in goal.itertuples()),
     "why they differ": "ties are resolved to the smallest eta; few items"},
])
paper_vs_ours

# %% [markdown]
# **Figure** (Tables 1/2 and 4 analogue, as curves against $\eta$; one row per budget): needle
# accuracy; the share of task answers token-identical to full attention's (needle and RULER-style items
# together: it separates the methods where the small model's accuracy does not); and the mean
# KL(full || arm) of the teacher-forced continuation. RULER-style accuracy and top-1 agreement stay in
# the tables; the line below the figure prints each metric's spread over the sparse arms, which says
# whether a panel could tell the methods apart.

# %%
panels = [("needle", "needle accuracy"), ("same_as_full", "answers identical to full"),
          ("gen_kl", "generation KL(full || arm)")]
fig, axes = plt.subplots(len(budget_fractions), len(panels), figsize=(12, 3.3 * len(budget_fractions) + 0.8),
                         squeeze=False, sharex=True, layout="constrained")
for i, f in enumerate(budget_fractions):
    t = pd.concat([table[table.budget_fraction == f], table[table.method == "full"]])
    for j, (metric_name, name) in enumerate(panels):
        plot_eta_curve(axes[i, j], t, metric_name, {"quest": "C1", "arkvale": "C2", "oracle": "k", "full": "C4"})
        axes[i, j].set(ylabel=name, title=f"budget {f:g} of the context",
                       xlabel="eta" if i == len(budget_fractions) - 1 else None)
fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=5, fontsize=9)
fig.suptitle(f"OVAL Tables 1/2 and 4 analogue: decode-time page retrieval on {model_name}", fontsize=11)
save_figure(fig, Path(fig_dir)/"oval_tasks.png", data=table)  # writes the table to oval_tasks.csv
spread = table[~table.method.isin(["full", "oracle"])][[m for m, _ in METRICS]].agg(lambda x: x.max() - x.min())
print("Spread (max - min) over the sparse arms: " + ", ".join(f"{m} {v:.3f}" for m, v in spread.items()))

# %%
n_items = tasks_res.groupby("task")[["context", "depth", "sample"]].apply(lambda d: len(d.drop_duplicates())).to_dict()
t4 = table4.copy()
t4.columns = [f"{m} @ {f:g}" for m, f in t4.columns]
lines = [f"{model_name}, decode-time page retrieval after one dense prefill per prompt; page {page_size}, rank {rank}, "
         f"sink {sink}, recent {recent}, layer 0 dense ({dense_layers} dense layers), speculative retrieval "
         f"{spec_steps} steps with correction at tau={tau}; budgets {budget_fractions} of the context (the paper keeps "
         "2048 of up to 16k tokens, 1/8).", "",
         f"Task items (contexts {contexts}, needle depths {needle_depths}, {n_samples} sample(s) each): {n_items}. "
         f"Generation: {n_gen} held-out prose prompt(s) per context {gen_contexts}, {gen_tokens} greedy tokens of full "
         "attention, teacher-forced.", "",
         "Accuracy per arm (Table 1/2 analogue; `same_as_full`: fraction of answers token-identical to full "
         "attention's):", "", md_table(table.drop(columns=["method", "eta"])), "",
         "Needle accuracy by context and depth:", "", md_table(needle_grid.reset_index()), "",
         "Sensitivity to eta (Table 4 analogue; eta = 0 is key PCA):", "",
         t4.reset_index().to_markdown(index=False, floatfmt=".3f"), "",
         "Goal check, best OVAL eta per budget and metric against key PCA and Quest (gen_kl: lower is better):", "",
         md_table(goal), "",
         f"OVAL at its best eta is at least key PCA in {int(goal['>= keypca'].sum())} of {len(goal)} (budget, metric) "
         f"pairs and at least Quest in {int(goal['>= quest'].sum())} of {len(goal)}. The best eta is picked on the "
         "same items it is scored on (the paper's eta*), which favours OVAL over the single-setting baselines; stage "
         "oval_quality chooses eta on disjoint calibration windows (Table 3).",
         "", "Spread (max - min) of each metric over the sparse arms (the figure shows needle, same_as_full and "
         "gen_kl): " + ", ".join(f"{m} {v:.3f}" for m, v in spread.items()) + ".",
         "", "Paper vs ours:", "", paper_vs_ours.to_markdown(index=False)]
write_text(Path(out_dir)/"oval_tasks.md", "\n".join(lines) + "\n")
print("\n".join(lines))
