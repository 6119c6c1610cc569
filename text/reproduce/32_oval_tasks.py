# %% [markdown]
# # OVAL: end tasks with decode-time page retrieval
#
# > Needle and RULER-style accuracy and generation agreement with full attention when every decoded token attends to retrieved pages (full, Quest, ArkVale, key PCA, OVAL per eta, oracle): Table 1/2 and Table 4 analogues on SmolLM2.

# %% [markdown]
# Stage `oval_quality` measures the retrieval itself on captured activations; this stage measures
# what the paper's Tables 1, 2 and 4 measure: the answers a model produces when it *decodes* with
# page retrieval (OVAL §4, App. D). The protocol:
#
# - each prompt is prefilled **densely, once** (`chunked_prefill`): the full cache stays resident;
#   the prompt's last token is held back so that every answer token is produced by a decode step;
# - every method then decodes greedily from a copy of that cache. At each decode step and layer
#   past the first (layer 0 stays dense, App. D.3), each KV head attends exactly to the sink page,
#   the recent page and the top pages of its method's summaries that fit the token budget
#   (`PageRetrievalPolicy`: page size 32, rank 8, avgSM GQA aggregation, speculative retrieval
#   from the query `spec_steps` steps back with correction below `tau`, as App. D's FreeKV setup);
# - the arms of one prompt run side by side as the rows of one batch (`ArmsPolicy` below hands
#   row $b$ of every attention call to arm $b$'s policy), so one prefill serves all of them.
#
# Methods: full attention, Quest, ArkVale, key PCA ($\eta=0$), OVAL at each $\eta$ (with
# $G = \sum_g W_{O,g}^\top W_{O,g}$ from each layer's `o_proj`) and the oracle (exact page
# log-mass). **Budget**: the paper keeps $\mathcal B = 2048$ tokens of up to 16k (ratio 1/8); here
# the budget is the fraction `budget_fractions` of the context (1/8 and 1/16 in the cpu profile;
# 1/2 of 256 tokens in the quick smoke test, so that some pages remain selectable), sink and recent
# one page each.
#
# **Tasks** (`sparsekv.data.make_task`, scored by `score_exact`): single-key needle at several
# depths (the needle test), and RULER-style multi-key needle, variable tracking and common words.
# The prompt is the task's prompt, a newline and its answer prefix, completed as raw text (no chat
# template); the answer is cut at the first end-of-text token. **Generation agreement** (the
# long-generation analogue of LongGenBench, Table 2): a window of held-out prose is prefilled,
# full attention continues it greedily for `gen_tokens` tokens, and every arm decodes under
# teacher forcing on that continuation: top-1 agreement with full attention's next token, the
# first position where they differ (= where a free-running greedy generation would first
# diverge), and the mean KL(full || arm).

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
check_tokens = 6         # greedy tokens of the batching checks below
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
import copy
import dataclasses
from functools import lru_cache
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

from sparsekv.data import make_task, packed_sequences, score_exact
from sparsekv.eval import kl_to_teacher, run_grid, top1_agreement
from sparsekv.hf import AttentionPolicy, DensePolicy, chunked_prefill, patch
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.models import load_model, model_info
from sparsekv.oval.pages import PageRetrievalPolicy

# %%
if threads: torch.set_num_threads(threads)
use_style()
torch.manual_seed(seed)
model, tok = load_model(model_name, dtype=dtype, device=device)
info = model_info(model)
EOS = {tok.get_vocab()[t] for t in (tok.eos_token, "<|im_end|>", "<|eot_id|>", "<|endoftext|>") if t in tok.get_vocab()}  # end-of-text tokens
print(info, f"; contexts {contexts}, budgets {budget_fractions} of the context; {torch.get_num_threads()} threads on {device}")


# %% [markdown]
# ## One prefill, every arm side by side
#
# `ArmsPolicy` is an attention policy over a batch whose row $b$ belongs to arm $b$: each attention
# call is split by rows and row $b$ goes to `policies[b]` (its own `PageRetrievalPolicy` with its own
# summaries, or `DensePolicy` for full attention). `decode_arms` copies the dense prefill cache,
# repeats it once per arm and decodes greedily; with `teacher` tokens, the input after step $i$ is
# `teacher[i]` for every arm (teacher forcing) and the logits are returned too.

# %%
class ArmsPolicy(AttentionPolicy):
    "Row b of every attention call goes to policies[b]: the arms of one prompt decoded side by side."
    def __init__(self, policies: list):
        if not policies or not all(isinstance(p, AttentionPolicy) for p in policies):
            raise TypeError("policies must be a non-empty list of AttentionPolicy")
        self.policies = list(policies)

    def __call__(self, q, k, v, ctx):
        if q.shape[0] != len(self.policies): raise ValueError(f"the batch has {q.shape[0]} rows, expected one per policy ({len(self.policies)})")
        def row(b):
            m = ctx.mask if ctx.mask is None or ctx.mask.shape[0] == 1 else ctx.mask[b:b + 1]
            return dataclasses.replace(ctx, key_positions=ctx.key_positions[b:b + 1], mask=m, cache=None)
        return torch.cat([p(q[b:b + 1], k[b:b + 1], v[b:b + 1], row(b)) for b, p in enumerate(self.policies)])


def dense_prefill(ids: torch.Tensor):
    "Dense cache of the prompt ids [1, S] without its last token, and that token [1]."
    cache, _ = chunked_prefill(model, ids[:, :-1].to(device), chunk_size)
    return cache, ids[:, -1].to(device)


def decode_arms(cache, first: torch.Tensor, policies: list, n_new: int, teacher: torch.Tensor | None = None):
    "Greedy tokens [A, n_new] of each arm from a copy of `cache`, starting at token `first` [1]; with teacher [n_new] tokens, teacher forcing, and the logits [A, n_new, V]."
    A = len(policies)
    c = copy.deepcopy(cache)
    c.batch_repeat_interleave(A)
    x, toks, logits = first.view(1, 1).expand(A, 1), [], []
    with torch.no_grad(), patch(model, ArmsPolicy(policies)):
        for i in range(n_new):
            pos = torch.tensor([c.get_seq_length()], device=device)
            out = model(input_ids=x, past_key_values=c, use_cache=True, position_ids=pos.expand(A, 1), logits_to_keep=1)
            step = out.logits[:, -1].float()
            toks.append(step.argmax(-1))
            if teacher is not None: logits.append(step)
            x = (toks[-1] if teacher is None else teacher[i].expand(A)).view(A, 1)
    return torch.stack(toks, 1), (torch.stack(logits, 1) if teacher is not None else None)


def policy_of(method: str, eta: float, fraction: float, context: int) -> AttentionPolicy:
    "The attention policy of one arm: dense for full, else page retrieval within fraction * context tokens."
    if method == "full": return DensePolicy()
    return PageRetrievalPolicy(method, int(fraction * context), page_size, sink, recent, rank, eta,
                               dense_layers=dense_layers, spec_steps=spec_steps, tau=tau)


# %% [markdown]
# Checks on a short prompt: the arms batched give the greedy tokens of each arm decoded alone; a
# retrieval arm whose budget covers the whole cache is full attention; under teacher forcing on full
# attention's greedy tokens, each arm predicts its own free-running tokens up to and including its
# first divergence from full attention (so the teacher-forced first divergence is the free-running one).

# %%
_ids = packed_sequences(tok, 300, "validation", n=1, seed=seed + 1)
_cache, _first = dense_prefill(_ids)
_pols = lambda: [DensePolicy(), policy_of("quest", 0.0, 0.5, 300), policy_of("oval", 0.5, 0.5, 300), policy_of("oval", 0.5, 2.0, 300)]
_tok, _ = decode_arms(_cache, _first, _pols(), check_tokens)
for a, pol in enumerate(_pols()):
    assert torch.equal(decode_arms(_cache, _first, [pol], check_tokens)[0][0], _tok[a]), f"arm {a} batched != alone"
assert torch.equal(_tok[3], _tok[0])                       # budget 600 > cache: dense
_tf, _lg = decode_arms(_cache, _first, _pols(), check_tokens, teacher=_tok[0])
for a in range(len(_tok)):   # teacher forcing on full's tokens = free running, up to and including an arm's first divergence from full
    d = next((i for i in range(check_tokens) if _tok[a, i] != _tok[0, i]), check_tokens - 1)
    assert torch.equal(_tf[a, :d + 1], _tok[a, :d + 1]), f"arm {a}"
assert _cache.get_seq_length() == 299                       # the shared prefill cache is never modified
print("greedy tokens per arm:", _tok.tolist())

# %% [markdown]
# ## The grid
#
# One row per (item, arm). `item_results` runs one prefill and every arm of an item and is cached,
# so the grid's cells of one item cost one decode pass; `run_grid` makes the stage resumable.

# %%
SPARSE = [("quest", 0.0), ("arkvale", 0.0), ("keypca", 0.0), *[("oval", e) for e in etas], ("oracle", 0.0)]
ARMS = [("full", 0.0, 1.0)] + [(m, e, f) for f in budget_fractions for m, e in SPARSE]

def task_item(task: str, context: int, depth, sample: int) -> dict:
    "The make_task item of one cell (seeded by seed, sample and depth)."
    return make_task(task, tok, context, seed=seed * 1000 + sample, **({} if depth is None else {"depth": depth}))

def cut(tokens: list) -> list:
    "Tokens up to the first end-of-text token."
    return next((tokens[:i] for i, t in enumerate(tokens) if t in EOS), tokens)

@lru_cache(maxsize=1)
def item_results(task: str, context: int, depth, sample: int) -> dict:
    "Score, prediction and agreement with full attention's answer for every arm of one task item."
    item = task_item(task, context, depth, sample)
    ids = tok(item["prompt"] + "\n" + item["answer_prefix"], return_tensors="pt").input_ids
    cache, first = dense_prefill(ids)
    toks, _ = decode_arms(cache, first, [policy_of(m, e, f, context) for m, e, f in ARMS], max_new_tokens[task])
    preds = [cut(t) for t in toks.tolist()]
    return {arm: {"score": score_exact(tok.decode(p), item["answer"]), "same_as_full": p == preds[0], "prompt_tokens": ids.shape[1],
                  "prediction": repr(tok.decode(p))} for arm, p in zip(ARMS, preds)}

@lru_cache(maxsize=1)
def generation_results(context: int, sample: int) -> dict:
    "Top-1 agreement, first divergence and KL to full attention for every arm, teacher-forced on full's greedy continuation of a prose window."
    ids = packed_sequences(tok, context, "validation", n=n_gen, seed=seed)[sample:sample + 1]
    cache, first = dense_prefill(ids)
    teacher = decode_arms(cache, first, [DensePolicy()], gen_tokens)[0][0]
    toks, logits = decode_arms(cache, first, [policy_of(m, e, f, context) for m, e, f in ARMS], gen_tokens, teacher=teacher)
    out = {}
    for a, arm in enumerate(ARMS):
        miss = (toks[a] != teacher).nonzero()
        out[arm] = {"agreement": top1_agreement(logits[a], logits[0]).item(), "kl": kl_to_teacher(logits[a], logits[0]).item(),
                    "first_divergence": int(miss[0, 0]) if len(miss) else gen_tokens}
    return out


# %%
ITEMS = [("niah_single", c, d, s) for c in contexts for d in needle_depths for s in range(n_samples)] + \
        [(t, c, None, s) for c in contexts for t in ruler_tasks for s in range(n_samples)]
task_cells = [{"task": t, "context": c, "depth": d, "sample": s, "max_new_tokens": max_new_tokens[t], "method": m, "eta": e, "budget_fraction": f}
              for t, c, d, s in ITEMS for m, e, f in ARMS]
gen_cells = [{"context": c, "sample": s, "gen_tokens": gen_tokens, "method": m, "eta": e, "budget_fraction": f}
             for c in gen_contexts for s in range(n_gen) for m, e, f in ARMS]
# every setting that changes a result is a key column of every row (the run's `common` settings, then the cell's), so a
# resumed grid never reuses rows computed under other settings; the numbers of items are not settings (item i is the
# same whatever their number)
common = {"model": model_name, "dtype": dtype, "device": device, "seed": seed, "chunk_size": chunk_size, "page_size": page_size,
          "rank": rank, "sink": sink, "recent": recent, "dense_layers": dense_layers, "spec_steps": spec_steps, "tau": tau}
task_grid = run_grid(task_cells,
                     lambda c: item_results(c["task"], c["context"], c["depth"], c["sample"])[(c["method"], c["eta"], c["budget_fraction"])],
                     Path(out_dir)/"oval_tasks_grid.csv", desc="oval tasks", params=common)
gen_grid = run_grid(gen_cells,
                    lambda c: generation_results(c["context"], c["sample"])[(c["method"], c["eta"], c["budget_fraction"])],
                    Path(out_dir)/"oval_tasks_generation_grid.csv", desc="oval generation", params=common)

def this_run(grid: pd.DataFrame, cells: list) -> pd.DataFrame:
    "The grid rows of this run's cells (the grid CSV may hold others)."
    want = pd.DataFrame([{**common, **c} for c in cells])
    res = grid.merge(want, on=list(want.columns))
    assert len(res) == len(want), (len(res), len(want))
    return res

tasks_res, gen_res = this_run(task_grid, task_cells), this_run(gen_grid, gen_cells)
tasks_res.insert(1, "family", tasks_res.task.map(lambda t: "needle" if t == "niah_single" else "ruler"))
write_csv(Path(fig_dir)/"oval_tasks_items.csv", tasks_res)
write_csv(Path(fig_dir)/"oval_tasks_generation.csv", gen_res)
tasks_res.head()

# %% [markdown]
# Sanity checks: scores lie in $[0, 1]$; full attention agrees with itself at every position of the
# teacher-forced continuation (its row is the teacher).

# %%
assert tasks_res.score.between(0, 1).all()
full_gen = gen_res[gen_res.method == "full"]
assert (full_gen.agreement == 1).all() and (full_gen.first_divergence == gen_tokens).all()


# %% [markdown]
# ## Table 1/2 analogue
#
# Accuracy per method and budget: the needle test (single-key needle, mean over depths), each
# RULER-style task and their mean, and generation agreement with full attention.

# %%
def label(method: str, eta: float) -> str:
    "Display name of an arm."
    return f"oval eta={eta:g}" if method == "oval" else method

def arm_table(tasks_res: pd.DataFrame, gen_res: pd.DataFrame) -> pd.DataFrame:
    "Per arm: needle accuracy, each RULER task's accuracy, RULER mean, generation agreement, first divergence, KL."
    keys = ["budget_fraction", "method", "eta"]
    per_task = tasks_res.pivot_table(index=keys, columns="task", values="score", aggfunc="mean")
    t = pd.DataFrame(index=per_task.index)
    t["needle"] = per_task["niah_single"]
    for name in ruler_tasks: t[name] = per_task[name]
    t["ruler"] = per_task[ruler_tasks].mean(1)
    t["same_as_full"] = tasks_res.groupby(keys).same_as_full.mean()
    g = gen_res.groupby(keys)[["agreement", "first_divergence", "kl"]].mean()
    t = t.join(g.rename(columns={"agreement": "gen_agreement", "first_divergence": "gen_first_divergence", "kl": "gen_kl"}))
    t = t.reset_index()
    t.insert(1, "arm", [label(m, e) for m, e in zip(t.method, t.eta)])
    t["order"] = [ARMS.index((m, e, f)) for m, e, f in zip(t.method, t.eta, t.budget_fraction)]
    return t.sort_values("order").drop(columns="order").reset_index(drop=True)

table = arm_table(tasks_res, gen_res)
table

# %% [markdown]
# Needle accuracy by depth and context (the needle-in-a-haystack grid, mean over samples).

# %%
needle = tasks_res[tasks_res.family == "needle"].copy()
needle["arm"] = [label(m, e) for m, e in zip(needle.method, needle.eta)]
needle_grid = needle.pivot_table(index=["budget_fraction", "arm"], columns=["context", "depth"], values="score", aggfunc="mean", sort=False)
needle_grid.columns = [f"{c} @ depth {d:g}" for c, d in needle_grid.columns]
needle_grid

# %% [markdown]
# ## Table 4 analogue (sensitivity to $\eta$)
#
# OVAL at each $\eta$ ($\eta = 0$ is key PCA) per budget, on each metric; the best $\eta$ per
# budget and metric against key PCA and Quest. (Stage `oval_quality` does the Table 3 analogue,
# $\eta$ chosen on calibration windows, on activation-level metrics.)

# %%
METRICS = [("needle", max), ("ruler", max), ("same_as_full", max), ("gen_agreement", max), ("gen_kl", min)]
spectral = table[table.method.isin(["keypca", "oval"])]
table4 = spectral.pivot_table(index="eta", columns="budget_fraction", values=[m for m, _ in METRICS], sort=False)
goal = []
for f in budget_fractions:
    t = table[table.budget_fraction == f].set_index("arm")
    ov = t[t.method == "oval"]
    for metric_name, better in METRICS:
        best = better(ov[metric_name])
        sign = 1 if better is max else -1
        goal.append({"budget_fraction": f, "metric": metric_name, "best_eta": ov[metric_name].idxmax() if better is max else ov[metric_name].idxmin(),
                     "best_oval": best, "keypca": t.loc["keypca", metric_name], "quest": t.loc["quest", metric_name],
                     "arkvale": t.loc["arkvale", metric_name], "full": table[(table.method == "full")][metric_name].iloc[0],
                     ">= keypca": sign * (best - t.loc["keypca", metric_name]) >= 0, ">= quest": sign * (best - t.loc["quest", metric_name]) >= 0})
goal = pd.DataFrame(goal)
write_csv(Path(fig_dir)/"oval_tasks_goal.csv", goal)
table4

# %%
goal

# %% [markdown]
# **Figure** (Tables 1/2 and 4 analogue, as curves against $\eta$; one row per budget): needle
# accuracy; the fraction of task answers token-identical to full attention's (needle and RULER-style
# items together: it separates the methods where the accuracy of the small model does not); and the
# mean KL(full || arm) of the teacher-forced continuation. RULER-style accuracy and top-1 agreement
# stay in the tables: in the cpu profile's run at 2-4k tokens the dense model itself solved a quarter
# of the RULER-style items and every sparse arm had the same top-1 agreement, so those panels could
# not tell the methods apart (the summary prints each metric's spread over the sparse arms).

# %%
panels = [("needle", "needle accuracy"), ("same_as_full", "answers identical to full"), ("gen_kl", "generation KL(full || arm)")]
fig, axes = plt.subplots(len(budget_fractions), len(panels), figsize=(12, 3.3 * len(budget_fractions) + 0.8), squeeze=False,
                         sharex=True, layout="constrained")
colors = {"quest": "C1", "arkvale": "C2", "oracle": "k", "full": "C4"}
for i, f in enumerate(budget_fractions):
    t = pd.concat([table[table.budget_fraction == f], table[table.method == "full"]])
    sp = t[t.method.isin(["keypca", "oval"])].sort_values("eta")  # key PCA is OVAL at eta = 0
    for j, (metric_name, name) in enumerate(panels):
        ax = axes[i, j]
        ax.plot(sp.eta, sp[metric_name], marker="o", color="C0", label="OVAL (eta = 0: key PCA)")
        for m, c in colors.items():
            ax.axhline(t[t.method == m][metric_name].iloc[0], color=c, ls="--", lw=1.2, label=m)
        ax.set(ylabel=name, title=f"budget {f:g} of the context", xlabel="eta" if i == len(budget_fractions) - 1 else None)
fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=5, fontsize=9)
fig.suptitle(f"OVAL Tables 1/2 and 4 analogue: decode-time page retrieval on {model_name} vs eta\n"
             f"(contexts {contexts}, page {page_size}, rank {rank})", fontsize=11)
save_figure(fig, Path(fig_dir)/"oval_tasks.png", data=table)  # writes the table to oval_tasks.csv


# %%
def md_table(df: pd.DataFrame) -> str:
    "df as a markdown table, 3 decimals (budget fractions as written)."
    if "budget_fraction" in df: df = df.assign(budget_fraction=df.budget_fraction.map("{:g}".format))
    return df.to_markdown(index=False, floatfmt=".3f")

spread = table[~table.method.isin(["full", "oracle"])][[m for m, _ in METRICS]].agg(lambda x: x.max() - x.min())


# %% [markdown]
# **Paper vs ours.** The paper reports task accuracy of 7-14B models at up to 64k tokens; ours is a
# 135M model at 1-4k tokens, so only the direction of each claim is comparable.

# %%
def per_budget(metric_name: str, fmt) -> str:
    "fmt(row) of the goal table's row of metric_name at each budget, joined."
    return "; ".join(f"budget {r.budget_fraction:g}: {fmt(r)}" for r in goal[goal.metric == metric_name].itertuples())

paper_vs_ours = pd.DataFrame([
    {"claim": "OVAL (best eta) is the best compressed method",
     "paper": "Table 1 / §4.1: best in all nine settings; e.g. Llama 8B average avg@k 55.69 vs FreeKV 51.83, Quest 47.81, "
              "ArkVale 49.64",
     "ours": "needle accuracy, best OVAL / key PCA / Quest / ArkVale: "
             + per_budget("needle", lambda r: f"{r.best_oval:.3f} / {r.keypca:.3f} / {r.quest:.3f} / {r.arkvale:.3f}"),
     "why they differ": "135M model, single-key needle at 1-4k tokens with few items, not long reasoning"},
    {"claim": "OVAL can match or exceed full attention",
     "paper": "Table 2 / §4.2: LongBench v2 Overall 29.82 (OVAL) vs 29.22 (FullKV) on Llama 3.1 8B",
     "ours": "needle accuracy, best OVAL vs full: " + per_budget("needle", lambda r: f"{r.best_oval:.3f} vs {r.full:.3f}"),
     "why they differ": "the needle task is easy for the dense model, so a sparse arm can at most tie it"},
    {"claim": "long generation is model dependent",
     "paper": "Table 2 / §4.2: LongGenBench CR 74.71 (OVAL) vs 78.03 (FreeKV) on Llama 8B, 78.54 vs 76.93 on Qwen 7B",
     "ours": "generation KL(full || arm), best OVAL / key PCA / Quest: "
             + per_budget("gen_kl", lambda r: f"{r.best_oval:.3f} / {r.keypca:.3f} / {r.quest:.3f}"),
     "why they differ": f"KL over {gen_tokens} teacher-forced tokens of prose, not a judged 16k-token completion"},
    {"claim": "no universally optimal eta",
     "paper": "Table 4 / §4.4: the best eta differs across tasks and models",
     "ours": "best eta per metric: " + "; ".join(f"{r.metric} @ {r.budget_fraction:g}: {r.best_eta}" for r in goal.itertuples()),
     "why they differ": "ties are resolved to the smallest eta; few items"},
])
paper_vs_ours

# %%
n_items = tasks_res.groupby("task")[["context", "depth", "sample"]].apply(lambda d: len(d.drop_duplicates())).to_dict()
t4 = table4.copy()
t4.columns = [f"{m} @ {f:g}" for m, f in t4.columns]
lines = [f"{model_name}, decode-time page retrieval after one dense prefill per prompt; page {page_size}, rank {rank}, sink {sink}, recent {recent}, "
         f"layer 0 dense ({dense_layers} dense layers), speculative retrieval {spec_steps} steps with correction at tau={tau}; "
         f"budgets {budget_fractions} of the context (the paper keeps 2048 of up to 16k tokens, 1/8).", "",
         f"Task items (contexts {contexts}, needle depths {needle_depths}, {n_samples} sample(s) each): {n_items}. "
         f"Generation: {n_gen} held-out prose prompt(s) per context {gen_contexts}, {gen_tokens} greedy tokens of full attention, teacher-forced.", "",
         "Accuracy per arm (Table 1/2 analogue; `same_as_full`: fraction of answers token-identical to full attention's):", "",
         md_table(table.drop(columns=["method", "eta"])), "",
         "Needle accuracy by context and depth:", "", md_table(needle_grid.reset_index()), "",
         "Sensitivity to eta (Table 4 analogue; eta = 0 is key PCA):", "", t4.reset_index().to_markdown(index=False, floatfmt=".3f"), "",
         "Goal check, best OVAL eta per budget and metric against key PCA and Quest (gen_kl: lower is better):", "", md_table(goal), "",
         f"OVAL at its best eta is at least key PCA in {int(goal['>= keypca'].sum())} of {len(goal)} (budget, metric) pairs and at least Quest "
         f"in {int(goal['>= quest'].sum())} of {len(goal)}. The best eta is picked on the same items it is scored on (the paper's eta*), "
         "which favours OVAL over the single-setting baselines; stage oval_quality chooses eta on disjoint calibration windows (Table 3).",
         "", "Spread (max - min) of each metric over the sparse arms (the figure shows needle, same_as_full and gen_kl): "
         + ", ".join(f"{m} {v:.3f}" for m, v in spread.items()) + ".",
         "", "Paper vs ours:", "", paper_vs_ours.to_markdown(index=False)]
write_text(Path(out_dir)/"oval_tasks.md", "\n".join(lines) + "\n")
print("\n".join(lines))
