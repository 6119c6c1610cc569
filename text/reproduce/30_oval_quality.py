# %% [markdown]
# # OVAL: page retrieval quality on real activations
#
# > Attention-mass recall and attention-output error of page retrieval with Quest, ArkVale, key-PCA, OVAL (per eta) and oracle summaries, on real activations over long prose; eta sensitivity (Table 4 analogue) and eta chosen on calibration windows, scored on held-out ones (Table 3 analogue).

# %% [markdown]
# End-task accuracy mixes retrieval quality with how hard the task is. This stage measures the
# retrieval itself, on the queries, keys and values a real model produces over windows of text. The
# protocol is described under the first table.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
dtype = "float32"
seq_len = 1024
n_calib = 1
n_heldout = 1
layers = [2, 10, 18, 26]   # None: every layer
budget_fractions = [0.125]
etas = [0.25, 0.5, 0.75, 1.0]
page_size = 32
rank = 8
sink = 32
recent = 32
n_queries = 32
n_reasoning = 1
seed = 0

# %%
from functools import lru_cache
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

from sparsekv.data import packed_sequences
from sparsekv.eval import run_grid
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.models import MODEL_LABELS, load_model, model_info
from sparsekv.oval.experiments import (arm_label, arm_page_weights, arms_fidelity, best_eta_summary, choose_eta,
                                       layer_activations, layer_output_metric, md_table, plot_eta_curve,
                                       reasoning_window, retrieval_arms, theory_rows, this_run)

use_style()
torch.manual_seed(seed)
model, tok = load_model(model_name, dtype=dtype)
info = model_info(model)
model_label = MODEL_LABELS.get(model_name, model_name)  # the model's name in titles and tables
layers = list(range(info.num_layers)) if layers is None else list(layers)
windows = {"calib": packed_sequences(tok, seq_len, "train", n=n_calib, seed=seed),
           "heldout": packed_sequences(tok, seq_len, "validation", n=n_heldout, seed=seed),
           "reasoning": torch.stack([reasoning_window(tok, seq_len, seed + 1 + i) for i in range(n_reasoning)])
           if n_reasoning else torch.zeros(0, seq_len, dtype=torch.long)}
budgets = [int(f * seq_len) for f in budget_fractions]
print(info, f"; budgets {budgets} of {seq_len} tokens; {torch.get_num_threads()} threads")

# %%
ARMS = retrieval_arms(etas)
activations = lru_cache(maxsize=1)(lambda pool, i: layer_activations(model, windows[pool][i:i + 1], max(layers)))
metric = lru_cache(maxsize=None)(lambda layer: layer_output_metric(model, layer))
page_weights = lru_cache(maxsize=len(ARMS))(lambda pool, i, layer, m, e: arm_page_weights(
    m, e, *activations(pool, i)[layer], page_size, rank, n_queries, metric(layer) if m == "oval" else None))
layer_results = lru_cache(maxsize=len(budget_fractions))(lambda pool, i, layer, b: dict(zip(ARMS, arms_fidelity(
    *activations(pool, i)[layer], [page_weights(pool, i, layer, m, e) for m, e in ARMS], b, page_size, sink, recent,
    n_queries))))
cells = [{"seq_len": seq_len, "n_queries": n_queries, "pool": pool, "window": i, "layer": layer, "method": m, "eta": e,
          "budget": b} for pool in windows for i in range(len(windows[pool])) for layer in layers for b in budgets
         for m, e in ARMS]
# the run's settings are key columns of every row; the pools' sizes are not (window i is the same whatever their number)
settings = {"model_name": model_name, "dtype": dtype, "seed": seed, "page_size": page_size, "rank": rank, "sink": sink,
            "recent": recent}
grid = run_grid(cells, lambda c: dict(zip(("mass_recall", "output_error"), layer_results(
    c["pool"], c["window"], c["layer"], c["budget"])[(c["method"], c["eta"])])),
    Path(out_dir)/"oval_quality_grid.csv", desc="oval quality", params=settings).drop(columns=list(settings))
res = this_run(grid, cells)  # this run's cells only (the grid CSV, resumable and uncommitted, may hold others)
res.insert(res.columns.get_loc("pool") + 1, "source",
           res.pool.map(lambda p: "reasoning" if p == "reasoning" else "prose"))
write_csv(Path(fig_dir)/"oval_quality_cells.csv", res)

# %% [markdown]
# **Table 4 analogue**: mean over all windows and layers per source (prose: calibration and held-out
# windows together; reasoning), budget, method and $\eta$.

# %%
mean_by = res.groupby(["source", "budget", "method", "eta"])[["mass_recall", "output_error"]].mean()
table4 = mean_by.reset_index()
table4.insert(2, "arm", [arm_label(m, e) for m, e in zip(table4.method, table4.eta)])
table4

# %% [markdown]
# **Protocol.** The activations are captured with `CapturePolicy` during one dense forward pass of
# `model_name` (SmolLM2-135M, or Qwen2.5-Coder-0.5B in the `qwen-full` profile) over each window:
#
# - for each layer and window, the last `n_queries` queries (the decode positions of the window's
#   final page) score every complete page with a method's summary (`sparsekv.oval.summaries`), the
#   per-head page softmaxes are averaged over each GQA group (avgSM), and the sink, the recent tokens
#   and the top pages that fit the token budget are kept, per KV head (`sparsekv.oval.pages`);
# - **mass recall** $\sum_{j \in \text{kept}} p_j$ of the dense attention $p$, and **relative output
#   error** $\lVert o_{\text{kept}} - o\rVert / \lVert o \rVert$ of exact attention over the kept keys
#   (`sparsekv.eval.attention_fidelity`), averaged over query heads and queries.
#
# Methods: Quest (per-channel min/max bound), ArkVale (bounding ball), key PCA ($\eta = 0$), OVAL at
# each $\eta$ with $G$ from the layer's `o_proj`, and the oracle (exact page log-mass); page size 32,
# rank 8. **Budget**: the paper keeps $\mathcal B = 2048$ tokens of up to 16k-token reasoning traces
# (ratio 1/8; LongBench v2 is 2048 of 64k, 1/32). We keep the fraction `budget_fractions` of the
# window; sink and recent are one page each. (The quick smoke test keeps 1/4 of 512-token windows, so
# that some pages remain selectable.)
#
# The grid runs through `run_grid` (one CSV row per window, layer, method, $\eta$ and budget), so an
# interrupted run resumes. Calibration windows come from the training part of the prose stream,
# held-out windows from its validation part (disjoint text). A third pool, `reasoning`, holds windows
# of math word problems (`reasoning_problems("gsm_symbolic")`, each followed by its answer,
# concatenated up to the window length): a different domain, on which the prose-calibrated $\eta$ is
# also scored.
#
# Sanity checks on the measurements: the oracle keeps the pages of largest true mass, so no method
# beats its mean recall; every recall lies in $[0, 1]$.

# %%
assert res.mass_recall.between(0, 1 + 1e-6).all()
sources = list(dict.fromkeys(res.source))
for src in sources:
    for b in budgets:
        assert mean_by.loc[(src, b)].mass_recall.max() <= mean_by.loc[(src, b, "oracle", 0.0), "mass_recall"] + 1e-6

# %% [markdown]
# **Table 3 analogue**: for each budget and metric, $\eta$ is chosen on the calibration windows,
# frozen, and scored on the held-out windows; the gap is to the best $\eta$ on the held-out windows
# themselves. Key PCA ($\eta = 0$) and Quest on the same held-out windows for reference. The same
# frozen $\eta$ is also scored on the reasoning windows (a domain shift).

# %%
table3 = choose_eta(res, etas, budgets, [p for p in ("heldout", "reasoning") if len(windows[p])])
write_csv(Path(fig_dir)/"oval_quality_table3.csv", table3)
table3

# %% [markdown]
# **Figure** (Table 4 analogue, as curves): one row per source and budget, mass recall (higher is
# better) and relative output error (lower is better) against $\eta$; the curve starts at key PCA
# ($\eta = 0$, the paper's "page local key PCA") and the baselines are horizontal lines.

# %%
rows = [(src, b) for src in sources for b in budgets]
fig, axes = plt.subplots(len(rows), 2, figsize=(9, 2.9 * len(rows)), squeeze=False, sharex=True, layout="constrained")
for i, (src, b) in enumerate(rows):
    t = table4[(table4.source == src) & (table4.budget == b)]
    for j, (metric_name, name) in enumerate((("mass_recall", "mass recall"), ("output_error", "rel. output error"))):
        plot_eta_curve(axes[i, j], t, metric_name, {"quest": "C1", "arkvale": "C2", "oracle": "k"})
        axes[i, j].set(ylabel=name, title=f"{src}, budget {b} of {seq_len}",
                       xlabel="eta" if i == len(rows) - 1 else None)
fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=9)
fig.suptitle(f"OVAL Table 4 analogue: page retrieval quality vs eta on {model_label} activations", fontsize=11)
save_figure(fig, Path(fig_dir)/"oval_quality.png", data=table4)  # writes table4 to oval_quality.csv

# %% [markdown]
# **Where the theory says OVAL should win, measured on the model** (`30_oval_basis` §16): for every
# layer and KV head, over the complete pages of the held-out windows, the alignment $a$, the tail
# $\tau$ and the predicted gain $\rho = 1 + (1 - a)/\tau$ of OVAL at $\eta = 1$ over key PCA, with the
# layer's $G$ and with $G = I$ (how much of it $G$'s anisotropy contributes), and $G$'s spectrum
# (`theory_rows`). Beside them, the measured output-error ratio key PCA / OVAL($\eta = 1$) of the
# retrieval above (held-out prose, per layer).

# %%
theory = pd.DataFrame([{"pool": "heldout", "window": i, "layer": layer, **row}
                       for i in range(len(windows["heldout"])) for layer in layers
                       for row in theory_rows(*activations("heldout", i)[layer][1:], metric(layer), rank, page_size)])
assert (theory.rho_model >= 1 - 1e-9).all() and theory.alignment_model.between(0, 1 + 1e-9).all()
by_layer = theory.groupby("layer")[["alignment_model", "tail_model", "rho_model", "rho_identity", "G_condition",
                                    "G_effective_rank"]].mean()
err = res[res.pool == "heldout"].groupby(["layer", "method", "eta"]).output_error.mean()
by_layer["measured_error_ratio"] = [err[(l, "keypca", 0.0)] / err[(l, "oval", 1.0)] if 1.0 in etas else float("nan")
                                    for l in by_layer.index]
rank_corr = by_layer.rho_model.rank().corr(by_layer.measured_error_ratio.rank())
print(f"per layer, Spearman(predicted rho, measured key PCA / OVAL(eta=1) output-error ratio) = {rank_corr:.2f}")
by_layer.round(3)

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), layout="constrained")
axes[0].plot(by_layer.index, by_layer.rho_model, marker="o", label="with the layer's G")
axes[0].plot(by_layer.index, by_layer.rho_identity, marker="s", label="with G = I")
axes[0].axhline(1, color="k", lw=0.8)
axes[0].set(xlabel="layer", ylabel="predicted gain rho", title="predicted gain, OVAL(eta=1) / key PCA")
axes[0].legend(fontsize=8)
axes[1].scatter(theory.alignment_model, theory.tail_model, s=12, c=theory.layer, cmap="viridis")
axes[1].set(xlabel="key-output alignment a", ylabel="tail tau", title="per KV head (colour: layer)")
axes[2].scatter(by_layer.rho_model, by_layer.measured_error_ratio, s=14)
axes[2].axhline(1, color="k", lw=0.8)
axes[2].set(xlabel="predicted gain rho", ylabel="measured error ratio", title=f"per layer (Spearman {rank_corr:.2f})")
fig.suptitle(f"Where OVAL should beat key PCA on {model_label}", fontsize=11)
save_figure(fig, Path(fig_dir)/"oval_theory.png", data=theory)

# %% [markdown]
# **Reading it.** $\rho$ is a gain in *reconstructing a page's output from its summary*, the error the
# theory's linearization bounds. Page retrieval never uses the summary that way: it only ranks the pages
# with it and then attends exactly over the keys of the kept ones, so its output error comes from the
# pages it drops, i.e. from how well the summary ranks pages by mass, which is key fidelity ($\eta = 0$'s
# objective). A large $\rho$ therefore need not show in the measured ratio; what the table can show is
# whether $G$'s anisotropy (the `rho_model` vs `rho_identity` gap, the condition number) is anywhere near
# the controlled setting of `30_oval_basis` §16.
#
# **Paper vs ours.** The paper's numbers are end-task accuracies (avg@$k$ of 8B-14B reasoning
# models at 16k tokens); ours are retrieval metrics on a small model's activations, so only the
# direction of each claim is comparable.

# %%
summary = best_eta_summary(table4)
per_budget = lambda src, fmt: "; ".join(f"B={r['budget']}: {fmt(r)}" for r in summary.to_dict("records")
                                        if r["source"] == src)
held = table3[(table3.test_pool == "heldout") & (table3.metric == "output_error")]
paper_vs_ours = pd.DataFrame([
    {"claim": "nonzero eta beats key PCA (eta = 0)",
     "paper": "Table 4 / §4.4: no universally optimal eta; long reasoning generally benefits from nonzero eta "
              "(e.g. Llama 8B AIME24 avg@k 42.08 at eta=0, 53.33 at eta=0.5)",
     "ours": "prose, output error, best OVAL vs key PCA: "
             + per_budget("prose", lambda r: f"{r['best OVAL error']:.4f} vs {r['key PCA error']:.4f}")
             + "; mass recall: "
             + per_budget("prose", lambda r: f"{r['best OVAL recall']:.4f} vs {r['key PCA recall']:.4f}"),
     "why they differ": "OVAL trades key fidelity (mass recall) for output sensitivity; retrieval metrics of "
                        f"{model_label} averaged over layers, not accuracy"},
    {"claim": "OVAL retrieves better than Quest and ArkVale",
     "paper": "Table 1: Llama 8B average avg@k, eta* 55.69 vs Quest 47.81, ArkVale 49.64",
     "ours": "prose mass recall, best OVAL / Quest / ArkVale: "
             + per_budget("prose", lambda r: f"{r['best OVAL recall']:.4f} / {r['Quest recall']:.4f} / "
                                             f"{r['ArkVale recall']:.4f}"),
     "why they differ": "recall of the dense attention mass, not task accuracy"},
    {"claim": "the output-aware basis matters where G weights directions unequally (§3.1-3.2, App. A.3)",
     "paper": "argued from the theory (a direction with large key energy and no output effect, App. A.3); no "
              "measurement of G's spectrum or of the key-output alignment on the evaluated models",
     "ours": f"G's condition number {by_layer.G_condition.min():.1f} to {by_layer.G_condition.max():.1f} per layer "
             f"(effective rank {by_layer.G_effective_rank.min():.0%} to {by_layer.G_effective_rank.max():.0%} of d); "
             f"predicted rho {by_layer.rho_model.min():.2f} to {by_layer.rho_model.max():.2f} with G, "
             f"{by_layer.rho_identity.min():.2f} to {by_layer.rho_identity.max():.2f} with G = I; measured "
             f"output-error ratio key PCA / OVAL(eta=1) {by_layer.measured_error_ratio.min():.2f} to "
             f"{by_layer.measured_error_ratio.max():.2f} (Spearman with rho over layers {rank_corr:.2f})",
     "why they differ": "rho is a within-page reconstruction gain; retrieval attends exactly over the kept pages and "
                        "loses only what it drops, which the ranking (key fidelity) decides"},
    {"claim": "eta calibrated on a disjoint pool transfers",
     "paper": "Table 3 / §4.3: gap (sweep best - frozen) 2.05 avg@k points on Llama 8B, 3.50 on Qwen 7B",
     "ours": "held-out prose, output error: " + "; ".join(
         f"B={r.budget}: eta {r.eta_calibrated:g} frozen, gap {r.gap:.4f}" for r in held.itertuples()),
     "why they differ": f"{n_calib} calibration and {n_heldout} held-out window(s) of prose vs 40 calibration "
                        "problems; gap in relative-error units, not accuracy points"},
])
paper_vs_ours

# %%
lines = [f"{model_label} activations over windows of {seq_len} tokens ({n_calib} calibration + {n_heldout} held-out "
         f"prose, {n_reasoning} gsm_symbolic reasoning), {len(layers)} layers, last {n_queries} queries per window; "
         f"page {page_size}, rank {rank}, sink {sink}, recent {recent}, budgets {budgets} (fractions "
         f"{budget_fractions} of the window; the paper keeps 2048 of up to 16k tokens, 1/8).", "",
         "Mean per source, method and eta (Table 4 analogue):", "",
         md_table(table4.drop(columns=["method", "eta"]), ".4f"), "",
         "Best OVAL eta against the baselines:", "", md_table(summary, ".4f"), "",
         "eta chosen on the prose calibration windows, scored on held-out prose and on reasoning windows (Table 3 "
         "analogue):", "", md_table(table3, ".4f"),
         "", "Where the theory says OVAL should win (30_oval_basis §16), mean per layer over KV heads and held-out "
         "pages: alignment a, tail tau, predicted leading-order gain rho = 1 + (1 - a)/tau with the layer's G and with "
         "G = I, G's condition number and effective rank share, and the measured output-error ratio key PCA / "
         f"OVAL(eta=1) (Spearman over layers {rank_corr:.2f}; the controlled setting of §16 spans rho 1.15 to "
         "5.7):", "",
         md_table(by_layer.reset_index(), ".4f"),
         "", "Paper vs ours (the paper's numbers are end-task accuracies, ours retrieval metrics):", "",
         paper_vs_ours.to_markdown(index=False)]
write_text(Path(out_dir)/"oval_quality.md", "\n".join(lines) + "\n")
print("\n".join(lines))
