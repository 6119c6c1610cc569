# %% [markdown]
# # KVpop at S = 2,048: scorers trained from cached activations, the decay chosen on held-out windows
#
# > KVpop-MLP and KVpop-mLSTM trained with the base frozen at the paper's window and sinks, CR 75% and 88%, from activations cached once; the decay swept on windows never trained on; the trained scorers against StreamingLLM, TOVA and H2O on held-out prose with paired intervals, beside the dense-target oracle.

# %% [markdown]
# The paper trains KVpop on 16k-token traces for 2,000 steps of 128 sequences, with $s = 4$ sinks and a
# protected window $w = 256$. Here: SmolLM2-135M on prose windows of $S = 2{,}048$ tokens, $s = 4$, $w = 64$
# (the paper's $w/S$ is 1/64; we keep $w = 64$ as the issue asks, i.e. $w/S$ = 1/32), budgets
# $B = (1 - \mathrm{CR})\,S$ per KV head and $k = B - s - w$.
#
# - **Training from cached activations** (`sparsekv.kvpop.offline`): with the base frozen and the dense target
#   (Eq. 2), each training window's keys, values and target are computed once; a step then runs only the
#   scorers. The step-time ratio against the in-model step of Alg. 1 is measured below.
# - **The decay.** The paper's range $\gamma \in [0.999, 0.999999]$ is per token at 16k; per token at $S$ we
#   rescale $\log\gamma$ by $16384/S$ (the same decay over the same fraction of the sequence), and $\alpha = 0$
#   starts at the midpoint of the range in $\log\gamma$. The paper says neither how $\alpha$ is initialised nor
#   whether the decay's gradient is meant to reach it through the student only; both are our choices (the
#   teacher's decay is detached with the target). Several fixed decays and the learned one are trained briefly
#   and compared by the dense model's agreement on `n_select` **training-split windows never trained on**; the
#   best setting trains the final scorers.
# - **Evaluation** on the validation split (disjoint text): top-1 agreement with the dense model and KL on the
#   positions where the CR-75% cache is full, for every method at the same $s, w, k$; paired 95% intervals
#   over windows. KVpop, StreamingLLM and the oracle attend exactly under their masks (one forward); TOVA and
#   H2O decide from attention and run through their evicting cache in chunks of `eviction_chunk` tokens (the
#   queries of a chunk see up to `eviction_chunk - 1` keys more than the budget: an advantage to them). TOVA is
#   run as its paper and kvpress define it (`heads="all"`) and per KV-head group.
# - **Oracle**: the dense future-attention target itself, decayed as KVpop's, used as the priority (the
#   teacher policy of Eq. 5): what a perfect scorer of this target would reach at this budget.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
device = "cpu"
dtype = "float32"
seq_len = 128
sink = 4
window = 8
compressions = [0.75, 0.875]
scorers = ["mlp", "mlstm"]
n_train = 4                    # training windows, cached once (cycled over the steps)
n_select = 2                   # training-split windows never trained on: the decay is chosen on them
n_val = 2                      # held-out validation windows (None: all the split holds)
n_val_train = 0                # training-split windows never trained on, added to the held-out windows
steps = 4                      # optimizer steps per final student
sweep_steps = 2                # optimizer steps per decay setting
sweep_log_gammas = [-0.01, -0.001]   # fixed per-token log(gamma) tried beside the learned decay
new_lr = 1e-3                  # peak learning rate of the scorers (Table 3)
warmup_steps = 1
n_boundaries = 64              # boundary queries per window and step (Eq. 25)
eviction_chunk = 16            # TOVA/H2O: evict every eviction_chunk tokens
recall_queries = 64            # query positions per held-out window at which retention recall is measured
every_token = []               # baselines also run evicting every token (as their papers do), labelled <name>@1
every_token_hours = None       # stop starting every-token batches after this long (None: all windows); a rerun resumes
baseline_batch = 8             # held-out windows per every-token pass (one forward per token: a batch amortizes it)
train = True                   # False: evaluate the shipped scorers (sparsekv/checkpoints) instead of training
ship = False                   # copy the final scorers into sparsekv/checkpoints (the shipped scorers)
eval_methods = ["streaming_llm", "tova:all", "tova:group", "h2o"]   # baselines (name:heads for TOVA/H2O)
seed = 0

# %%
import functools
import math
import time
from pathlib import Path

import pandas as pd
import torch

import sparsekv
from sparsekv.data import packed_sequences
from sparsekv.distill import DistillConfig
from sparsekv.eval import kl_to_teacher, run_grid, top1_agreement
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.kvpop.experiments import (OraclePolicy, activation_recall, ahead_status, batched_cell, compare_figure,
                                        dense_target_student, git_commit, loss_figure, manifest_matches,
                                        mean_log_gamma, pair_summary, scored_logits, ship_student, versus_baseline)
from sparsekv.kvpop.offline import ActivationBatches, cache_activations, step_seconds, train_offline
from sparsekv.kvpop.student import KVpopStudent, shipped_checkpoints, write_shipped_manifest
from sparsekv.methods import make as make_method
from sparsekv.models import load_model, model_info
from sparsekv.stats import compare, compare_table

# %%
use_style()
torch.manual_seed(seed)
model, tok = load_model(model_name, dtype=dtype, device=device)
model.requires_grad_(False)
S = seq_len
budgets = {cr: round((1 - cr) * S) for cr in compressions}
ks = {cr: budgets[cr] - sink - window for cr in compressions}
n_scored = S - budgets[min(compressions)]
windows = packed_sequences(tok, S, "train", n=n_train + n_select + n_val_train, seed=seed)
train_ids, select_ids = windows[:n_train], windows[n_train:n_train + n_select]
# the validation split holds 23 windows at S = 2,048: more held-out windows come from the training split (never
# trained on)
val_ids = torch.cat([packed_sequences(tok, S, "validation", n=n_val, seed=seed), windows[n_train + n_select:]])
lg_min, lg_max = (math.log(g) * 16384 / S for g in (0.999, 0.999999))   # the paper's range per token at S
out = Path(out_dir) / "kvpop_train"
print(model_info(model), f"; S={S}, sink {sink}, window {window}, budgets {budgets}, k {ks}; {n_train} train, "
      f"{n_select} selection, {len(val_ids)} held-out windows ({n_val_train} of them from the training split); "
      f"log gamma range [{lg_min:.2e}, {lg_max:.2e}]; "
      f"{torch.get_num_threads()} threads")


# %% [markdown]
# ## Cached activations and what they save

# %%
def student_for(scorer: str, cr: float, log_gamma: float | None) -> KVpopStudent:
    "A fresh dense-target student; `log_gamma`: a fixed per-token decay, None: learned from the midpoint."
    return dense_target_student(model, sink, window, ks[cr], scorer, (lg_min, lg_max), log_gamma, n_boundaries, seed)


activations = out / f"activations_S{S}_w{window}"


@functools.cache
def training_store():
    "Every training window's activations, cached when a student is first trained (a rerun resumes the folder)."
    return cache_activations(model, train_ids, activations, window=window)


if train:
    first_store = cache_activations(model, train_ids[:1], activations, window=window)
    per_window_mb = sum(t.numel() * t.element_size() for t in first_store[0].values()) / 2**20
    first = ActivationBatches(first_store, [[0]])[0]  # train_ids[0]'s activations
    speed = pd.DataFrame([dict(scorer=sc, **step_seconds(model, student_for(sc, min(compressions), None),
                                                         train_ids[:1], first, repeats=2)) for sc in scorers])
    print(f"{per_window_mb:.1f} MB of activations per window")
    display(speed)


# %% [markdown]
# ## The decay, chosen on windows never trained on

# %%
def dense_logits(ids: torch.Tensor) -> torch.Tensor:
    return scored_logits(model, ids, n_scored)


def policy_logits(ids: torch.Tensor, policy, cache=None, chunk: int | None = None, first: int | None = None):
    "Logits of the scored positions under `policy` (`scored_logits`)."
    return scored_logits(model, ids, n_scored, policy, cache, chunk, first)


def metrics(logits: torch.Tensor, teacher: torch.Tensor) -> dict:
    return dict(agreement=top1_agreement(logits, teacher).item(), kl=kl_to_teacher(logits, teacher).item())


def train_student(scorer: str, cr: float, log_gamma: float | None, n_steps: int, tag: str
                  ) -> tuple[KVpopStudent, pd.DataFrame]:
    "Train (or resume) one student from the cached activations; its history is saved beside its checkpoint."
    st = student_for(scorer, cr, log_gamma)
    config = DistillConfig(steps=n_steps, mode="cached", new_lr=new_lr, new_lr_min=min(8e-5, new_lr),
                           warmup_steps=min(warmup_steps, n_steps), checkpoint_every=max(1, n_steps // 10), seed=seed)
    folder = out / tag
    hist = train_offline(model, st, training_store(), config, checkpoint_dir=folder)
    write_csv(folder / "history.csv", hist)
    return st.eval(), hist


if train:
    sweep_students, select_teacher = {}, {}

    def sweep_cell(c: dict) -> dict:
        "Train (or load) the student of one decay setting; its agreement with the dense model on one selection window."
        name, i = c["decay"], c["window"]
        if name not in sweep_students:
            lg = None if name == "learned" else float(name)
            sweep_students[name] = train_student(scorers[0], min(compressions), lg, sweep_steps,
                                                 f"sweep_{scorers[0]}_{name}")[0]
        if i not in select_teacher: select_teacher[i] = dense_logits(select_ids[i:i + 1])
        st = sweep_students[name]
        return dict(final_log_gamma=mean_log_gamma(st),
                    **metrics(policy_logits(select_ids[i:i + 1], st.policy()), select_teacher[i]))

    names = [f"{lg:g}" for lg in sweep_log_gammas] + ["learned"]
    sweep = run_grid([dict(decay=n, window=i) for n in names for i in range(len(select_ids))], sweep_cell,
                     Path(out_dir) / "kvpop_train_sweep_grid.csv", desc="decay sweep",
                     params=dict(model=model_name, S=S, scorer=scorers[0], sweep_steps=sweep_steps))
    sweep["decay"] = sweep.decay.astype(str)
    sweep_table = sweep.groupby("decay", sort=False)[["agreement", "kl", "final_log_gamma"]].mean()
    chosen = sweep_table.agreement.idxmax()
    write_csv(Path(fig_dir) / "kvpop_train_decay_sweep.csv", sweep)
    print(f"chosen decay: {chosen}")
    display(sweep_table)


# %% [markdown]
# ## The final scorers
#
# With `ship=True` each final student is written to `sparsekv/checkpoints/<model>-cr<CR>-<scorer>/` as soon as it
# is trained: its weights, its training history and a manifest (model, data windows, settings, steps, commit; the
# validation metrics once the evaluation below has run), where
# `methods.make("kvpop_mlstm", budget=..., checkpoint="smollm2-135m-cr75-mlstm")` finds it. A run that finds a
# shipped student trained with exactly its settings reuses it instead of training it again, so a run interrupted
# after some students (hours on a CPU) resumes from the committed ones.

# %%
def shipped_name(sc: str, cr: float) -> str:
    return f"{model_name}-cr{round(cr * 100)}-{sc}"


def shipped_folder(sc: str, cr: float) -> Path:
    return Path(sparsekv.__file__).parent / "checkpoints" / shipped_name(sc, cr)


def training_settings(sc: str, cr: float) -> dict:
    "Everything a final student's training depends on: a shipped student with the same settings is this student."
    return dict(method=f"kvpop_{sc}", model=model_name, budget=sink + window + ks[cr], sink=sink, window=window,
                k=ks[cr], seq_len=S, compression=cr, decay=chosen, log_gamma_range=[lg_min, lg_max], steps=steps,
                batch_size=1, new_lr=new_lr, n_boundaries=n_boundaries, target="dense",
                data=dict(corpus="World English Bible (prose)", split="train", seq_len=S, n_windows=n_train,
                          seed=seed))


def shipped_student(sc: str, cr: float) -> KVpopStudent:
    m = make_method(f"kvpop_{sc}", budget=sink + window + ks[cr], checkpoint=shipped_name(sc, cr))
    return m.trained_student(model)


def already_shipped(sc: str, cr: float) -> bool:
    "Whether the shipped student of (sc, cr) was trained with this run's settings (by an interrupted run of it)."
    return manifest_matches(shipped_checkpoints().get(shipped_name(sc, cr), {}), training_settings(sc, cr))


trained, histories, reused = {}, [], []
for cr in compressions:
    for sc in scorers:
        if not train:  # the shipped scorers, as a user gets them
            trained[(sc, cr)] = shipped_student(sc, cr)
            chosen = shipped_checkpoints()[shipped_name(sc, cr)]["decay"]
            continue
        if ship and already_shipped(sc, cr):
            trained[(sc, cr)] = shipped_student(sc, cr)
            hist = pd.read_csv(shipped_folder(sc, cr) / "history.csv")
            reused.append(shipped_name(sc, cr))
        else:
            trained[(sc, cr)], hist = train_student(sc, cr, None if chosen == "learned" else float(chosen), steps,
                                                    f"{sc}_cr{round(cr * 1000)}_{chosen}")
            if ship:
                ship_student(shipped_folder(sc, cr), f"kvpop_{sc}", trained[(sc, cr)], hist,
                             dict(name=shipped_name(sc, cr), **training_settings(sc, cr),
                                  mean_log_gamma=mean_log_gamma(trained[(sc, cr)]), commit=git_commit(),
                                  validation=None))
        histories.append(hist.assign(scorer=sc, compression=cr))
print(f"reused shipped students trained by an earlier run of these settings: {reused or 'none'}")
if train:
    history = pd.concat(histories)
    save_figure(loss_figure(history, max(1, steps // 20)), Path(fig_dir) / "kvpop_train_loss.png", history)
{(sc, cr): round(mean_log_gamma(st), 6) for (sc, cr), st in trained.items()}


# %% [markdown]
# ## Held-out evaluation

# %%
def evicting_baseline(name: str, cr: float):
    "TOVA or H2O, `name` as 'method:heads' (heads default 'group'), at compression cr's budget, sinks and window."
    base, _, heads = name.partition(":")
    return make_method(base, budget=sink + window + ks[cr], sink=sink, window=window, heads=heads or "group")


def method_logits(name: str, cr: float, ids: torch.Tensor) -> torch.Tensor:
    if name.startswith("kvpop_"): return policy_logits(ids, trained[(name.removeprefix("kvpop_"), cr)].policy())
    if name == "oracle":
        return policy_logits(ids, OraclePolicy(ks[cr], mean_log_gamma(trained[(scorers[0], cr)]), sink, window))
    if name == "streaming_llm":
        m = make_method(name, budget=sink + window + ks[cr], sink=sink, window=window)
        return policy_logits(ids, m.policy(), m.cache(model), S)  # exact in one chunk
    m = evicting_baseline(name, cr)
    return policy_logits(ids, m.policy(), m.cache(model), eviction_chunk)


methods = [*eval_methods, *[f"kvpop_{sc}" for sc in scorers], "oracle"]
teacher_cache = {}


def cell(c: dict) -> dict:
    i = c["item"]
    if i not in teacher_cache: teacher_cache.clear(); teacher_cache[i] = dense_logits(val_ids[i:i + 1])
    t = teacher_cache[i]
    if c["method"] == "dense": return metrics(t, t)
    return metrics(method_logits(c["method"], c["compression"], val_ids[i:i + 1]), t)


cells = [dict(item=i, method=m, compression=cr) for i in range(len(val_ids)) for cr in compressions
         for m in (["dense"] if cr == compressions[0] else []) + methods]
students = ", ".join(f"{shipped_name(sc, cr)} of {shipped_checkpoints()[shipped_name(sc, cr)]['commit'][:10]}"
                     if ship or not train else f"{shipped_name(sc, cr)} trained in this run" for sc, cr in trained)
grid = run_grid(cells, cell, Path(out_dir) / "kvpop_train_eval_grid.csv", desc="held-out windows",
                params=dict(model=model_name, S=S, sink=sink, window=window, chosen=chosen,
                            eviction_chunk=eviction_chunk, n_val_train=n_val_train,
                            scorers_from=f"trained, {steps} steps" if train else "shipped", students=students))
dense_rows = grid[grid.method == "dense"]
results = pd.concat([grid[grid.method != "dense"]] + [dense_rows.assign(compression=cr) for cr in compressions])
tables = {}
for metric, better in (("agreement", True), ("kl", False)):
    cmp = compare(results, metric, budget="compression", baselines=eval_methods, higher_is_better=better)
    tables[metric] = cmp
    write_csv(Path(fig_dir) / f"kvpop_train_{metric}.csv", cmp)
compare_table(tables["agreement"], "base")

# %%
save_figure(compare_figure(tables, compressions, len(val_ids)), Path(fig_dir) / "kvpop_train.png", results)

# %% [markdown]
# ## Every student against every baseline
#
# The goal is each KVpop student ahead of each baseline, not only of the best one. Below, each student's
# paired difference to each baseline over the same held-out windows (`compare` with that baseline alone): "ahead"
# or "behind" only where the 95% interval excludes 0 over at least `min_items` windows, otherwise "tied".
# StreamingLLM+ (the model trained under StreamingLLM's pattern) is not in this stage: training the whole model at
# S = 2,048 does not fit a CPU session; `kvpop_distill` compares it with the same students' recipe at S = 512.

# %%
kvpop_methods = [f"kvpop_{sc}" for sc in scorers]


min_items = tables["agreement"].attrs["min_items"]
pairs = pd.concat([versus_baseline(results, b, m) for b in eval_methods for m in ("agreement", "kl")])
pairs = pairs[pairs.method.isin(kvpop_methods)]
versus = pairs.pivot_table(index=["budget", "method", "baseline"], columns="metric", values="verdict",
                           aggfunc="first", sort=False)


ahead_of_all = {m: ahead_status(pairs[pairs.method == m], min_items) for m in kvpop_methods}
write_csv(Path(fig_dir) / "kvpop_train_pairs.csv", pairs)
versus


# %% [markdown]
# ## Baselines evicting every token
#
# The tables above let TOVA and H2O evict every `eviction_chunk` tokens, so a query sees up to `eviction_chunk - 1`
# keys beyond the budget: an advantage to them. Eviction at every token is what the TOVA and H2O papers
# do; that is one forward per token (on 2 cores about a minute per window, baseline and compression, at
# `baseline_batch` windows per pass), so the baselines in `every_token` run it on as many held-out windows as
# `every_token_hours` allows, and a rerun adds more. No eviction happens before the cache holds its budget $B$, so
# the first $B$ tokens go in as one chunk, exactly as one by one (checked on the quick profile by running them one
# by one). Below, over the windows done: the students, and the same baseline evicting in chunks, each against the
# baseline evicting every token.

# %%
def every_token_metrics(name: str, cr: float, a: int) -> list[dict]:
    "Metrics of held-out windows a, a + 1, ... (one batch) under baseline `name` evicting every token."
    m = evicting_baseline(name, cr)
    logits = policy_logits(val_ids[a:a + baseline_batch], m.policy(), m.cache(model), 1, first=m.budget)
    return [metrics(logits[j:j + 1], dense_logits(val_ids[a + j:a + j + 1])) for j in range(logits.shape[0])]


if S <= 256:  # short windows (the quick profile): the first B tokens in one chunk give what one by one gives
    for name in every_token:
        m = evicting_baseline(name, min(compressions))
        # the same evictions: float noise only (a different kept set moves logits by far more than 1e-3)
        torch.testing.assert_close(policy_logits(val_ids[:1], m.policy(), m.cache(model), 1, first=m.budget),
                                   policy_logits(val_ids[:1], m.policy(), m.cache(model), 1), atol=1e-3, rtol=1e-4)


# one held-out window under a baseline evicting every token (its whole batch computed once)
every_token_cell = batched_cell(lambda c, a: every_token_metrics(c["method"].removesuffix("@1"), c["compression"], a),
                                baseline_batch, key=lambda c: (c["method"], c["compression"]))


every_pairs, every_versus, every_done = pd.DataFrame(), None, "no baseline evicting every token in this profile"
if every_token:
    start, parts = time.perf_counter(), []
    for m, cr, a in [(m, cr, a) for m in every_token for cr in compressions for a in range(0, len(val_ids),
                                                                                          baseline_batch)]:
        # the time box holds between batches: a batch started is finished and saved; one past it only reads
        over = every_token_hours is not None and time.perf_counter() - start > every_token_hours * 3600
        parts.append(run_grid([dict(item=i, method=f"{m}@1", compression=cr)
                               for i in range(a, min(a + baseline_batch, len(val_ids)))], every_token_cell,
                              Path(out_dir) / "kvpop_train_every_token_grid.csv", desc=f"{m} every token, CR {cr}",
                              params=dict(model=model_name, S=S, sink=sink, window=window,
                                          baseline_batch=baseline_batch), time_limit=0 if over else None))
    every = pd.concat(parts)
    every_windows = {cr: every[every.compression == cr].groupby("item").method.count() for cr in compressions}
    every_windows = {cr: n[n == len(every_token)].index for cr, n in every_windows.items()}
    every_done = ", ".join(f"CR {cr:.1%}: {len(w)} of {len(val_ids)} windows" for cr, w in every_windows.items())
    ready = {cr: w for cr, w in every_windows.items() if len(w) >= 2}  # an interval needs two windows
    if ready:
        both = pd.concat([results, every])
        on_them = pd.concat([both[(both.compression == cr) & both.item.isin(w)] for cr, w in ready.items()])
        every_pairs = pd.concat([versus_baseline(on_them, f"{b}@1", m) for b in every_token
                                 for m in ("agreement", "kl")])
        # the students, and each chunked baseline against its own every-token run
        every_pairs = every_pairs[every_pairs.method.isin(kvpop_methods)
                                  | (every_pairs.method + "@1" == every_pairs.baseline)]
        write_csv(Path(fig_dir) / "kvpop_train_every_token.csv", every_pairs)
        every_versus = every_pairs.pivot_table(index=["budget", "method", "baseline", "n"], columns="metric",
                                               values="verdict", aggfunc="first", sort=False).reset_index()
print(every_done)
every_versus

# %% [markdown]
# ## Retention recall (Fig. 7 analogue at S = 2,048)
#
# The fraction of the teacher's top-$k$ long-range tokens that a student keeps, at `recall_queries` query
# positions evenly spaced from the first full cache to the end of each held-out window, averaged over layers and
# KV heads. Two teachers, labelled: the **undecayed** dense future-attention target (Eq. 8: the paper's
# "full-attention teacher's top-k" read literally), and the target **decayed** by the student's own $\gamma$
# (Eq. 5: what its loss trains against, and what the training history's recall measures). StreamingLLM (the $k$
# most recent eligible tokens) is the reference; it has no decay. The held-out windows' activations are cached
# as the training windows' are (keys, values and the undecayed target, once per window).

# %%
val_store = cache_activations(model, val_ids, out / f"val_activations_S{S}_w{window}", window=window)


def window_recall(i: int) -> list[dict]:
    "Mean retention recall of held-out window i for each student and StreamingLLM, each compression and teacher."
    batch = ActivationBatches(val_store, [[i]])[0]
    return [dict(window=i, compression=cr, **row) for cr in compressions for row in activation_recall(
        batch, {m: trained.get((m.removeprefix("kvpop_"), cr)) for m in ["streaming_llm", *kvpop_methods]},
        sink, window, ks[cr], recall_queries)]


recall = pd.DataFrame([row for i in range(len(val_ids)) for row in window_recall(i)])
write_csv(Path(fig_dir) / "kvpop_train_recall.csv", recall)
recall_table = recall.groupby(["compression", "method", "teacher"], sort=False).recall.agg(["mean", "sem"])
recall_table

# %% [markdown]
# ## Paper vs ours
#
# The paper's numbers are quoted from its Table 1 (Qwen3-4B, average pass@1 on AIME/HMMT relative to the teacher,
# 16k tokens, B = 4,096 / 2,048; its KVpop trains every parameter for 2,000 steps of 128 sequences). Ours: top-1
# agreement with the dense model on held-out prose (the dense model's is 1, so it is already relative), the
# scorers trained with the base frozen. The metrics differ, so the comparable parts are the ordering of the
# methods and the size of the gaps. The oracle row is the ceiling of any scorer of this target at this budget with
# this frozen base: the dense future-attention target itself, decayed, used as the priority.

# %%
# Table 1, Qwen3-4B, Rel.; the paper's TOVA is ours with heads="all"
PAPER_REL = {0.75: {"streaming_llm": 0.76, "tova:all": 0.73, "kvpop_mlp": 0.98, "kvpop_mlstm": 0.98},
             0.875: {"streaming_llm": 0.47, "tova:all": 0.58, "kvpop_mlp": 0.93, "kvpop_mlstm": 0.97}}
agreement = tables["agreement"].set_index(["method", "budget"])["mean"]
paper_rows = [{"method": m, **{k: v for cr in compressions for k, v in (
                  (f"paper rel. pass@1, CR {cr:.1%}", PAPER_REL.get(cr, {}).get(m)),
                  (f"ours agreement, CR {cr:.1%}", agreement[(m, cr)]))}}
              for m in [*eval_methods, *kvpop_methods, "oracle"]]


def gap_closed(m: str, cr: float) -> str:
    "The share of TOVA's agreement gap to the oracle that method m closes (none to close: n/a)."
    room = agreement[("oracle", cr)] - agreement[("tova:all", cr)]
    return f"{(agreement[(m, cr)] - agreement[('tova:all', cr)]) / room:.0%}" if room > 0 else "n/a"


mlstm_recall = recall_table.loc[(min(compressions), "kvpop_mlstm")]["mean"]
paper = ["| claim | paper | ours | why they differ |", "|---|---|---|---|",
         f"| KVpop keeps ~0.98 of the teacher at CR 75% (Table 1) | KVpop 0.98, KVpop-MLP 0.98 | KVpop-mLSTM "
         f"{agreement[('kvpop_mlstm', 0.75)]:.3f}, KVpop-MLP {agreement[('kvpop_mlp', 0.75)]:.3f}; the oracle "
         f"{agreement[('oracle', 0.75)]:.3f} | the oracle is the ceiling of a scorer with this frozen base, below "
         "0.98: what remains is the base's own adaptation (the paper trains all parameters) |"
         if 0.75 in compressions else "",
         "| learned eviction far ahead of TOVA (Table 1, CR 75% / 88%) | +0.25 / +0.39 relative pass@1 | "
         + ", ".join(f"KVpop-{sc} {agreement[(f'kvpop_{sc}', cr)] - agreement[('tova:all', cr)]:+.3f} at CR "
                     f"{cr:.1%} ({gap_closed(f'kvpop_{sc}', cr)} of TOVA's gap to the oracle)"
                     for sc in scorers for cr in compressions)
         + " | the oracle itself is only " + ", ".join(
             f"{agreement[('oracle', cr)] - agreement[('tova:all', cr)]:+.3f}" for cr in compressions)
         + " above TOVA on this model and length (the paper's TOVA collapses at 16k): little room to win |",
         f"| KVpop recovers the teacher's top-k (Fig. 7, §4.3, CR 75%) | \"a global mean recall of 81%\" | "
         f"KVpop-mLSTM {mlstm_recall['undecayed']:.2f} against the undecayed teacher, {mlstm_recall['decayed']:.2f} "
         f"against the teacher decayed by its own gamma (CR {min(compressions):.1%}) | S = {S:,} and w = {window} "
         "instead of 16,384 and 256; the paper does not say which teacher |"]
pd.DataFrame(paper_rows)

# %% [markdown]
# ## The goals, measured
#
# Each goal of the issue beside what this run measured. "yes" only where every paired interval the goal needs
# excludes 0 in the goal's direction over at least `min_items` windows; StreamingLLM+ (the whole model trained
# under StreamingLLM's pattern) is compared in `kvpop_distill` at S = 512, not here.

# %%
goals = [dict(goal=f"{m} ahead of {', '.join(eval_methods)} at each CR on agreement and KL",
              measured=pair_summary(rows, min_items), met=ahead_status(rows, min_items))
         for m in kvpop_methods for rows in [pairs[pairs.method == m]]]
goals.append(dict(goal="ahead of StreamingLLM+", measured="not in this stage (kvpop_distill, S = 512)",
                  met="not measured here"))
if 0.75 in compressions:
    goals.append(dict(goal="agreement with the dense model >= 0.98 at CR 75% (the paper's relative accuracy)",
                      measured=", ".join(f"{m} {agreement[(m, 0.75)]:.3f}" for m in kvpop_methods)
                      + f"; the oracle, ceiling of any scorer with this frozen base, {agreement[('oracle', 0.75)]:.3f}",
                      met="yes" if all(agreement[(m, 0.75)] >= 0.98 for m in kvpop_methods) else "no"))
if train:
    goals.append(dict(goal="a training step from cached activations >= 50x faster than the in-model step",
                      measured=", ".join(f"{r.scorer} {r.ratio:.1f}x ({r.in_model_s:.1f} s vs {r.cached_s:.2f} s)"
                                         for r in speed.itertuples()),
                      met=", ".join(f"{r.scorer} {'yes' if r.ratio >= 50 else 'no'}" for r in speed.itertuples())))
if every_token:
    enough = tables["agreement"].attrs["min_items"]
    students_every = every_pairs[every_pairs.method.isin(kvpop_methods)] if len(every_pairs) else every_pairs
    goals.append(dict(goal=f"ahead of {', '.join(every_token)} evicting every token", measured=every_done + (
                          f"; {pair_summary(students_every, min_items)}" if len(students_every) else ""),
                      met="; ".join(f"CR {cr:.1%}: " + (ahead_status(students_every[students_every.budget == cr],
                                                                     min_items)
                                                        if len(w) >= enough else "undecided (too few windows)")
                                    for cr, w in every_windows.items())))
goals = pd.DataFrame(goals)
goals


# %% [markdown]
# ## Shipped scorers
#
# The manifests of this run's students, with their agreement on the held-out windows (written into the shipped
# manifests when `ship=True`).

# %%
def manifest_of(sc: str, cr: float) -> dict:
    agree = tables["agreement"].set_index(["method", "budget"]).loc[(f"kvpop_{sc}", cr)]
    validation = dict(windows=len(val_ids), agreement=float(agree["mean"]), se=float(agree["se"]))
    if ship: return {**shipped_checkpoints()[shipped_name(sc, cr)], "validation": validation}
    return dict(name=shipped_name(sc, cr), **training_settings(sc, cr),
                mean_log_gamma=mean_log_gamma(trained[(sc, cr)]), commit=git_commit(), validation=validation)


shipped = [manifest_of(sc, cr) for sc, cr in trained] if train else list(shipped_checkpoints().values())
for (sc, cr), manifest in zip(trained, shipped) if train and ship else ():
    write_shipped_manifest(shipped_folder(sc, cr), manifest)
pd.DataFrame(shipped)


# %%
def md(df: pd.DataFrame) -> str:
    return df.to_markdown(floatfmt=".4f")


source = (f"{n_train} training windows (cached once, {per_window_mb:.0f} MB each), {steps} steps per student, decay "
          f"chosen on {n_select} training-split windows never trained on" if train else
          f"the shipped scorers ({', '.join(shipped_name(sc, cr) for sc in scorers for cr in compressions)})")
if reused: source += f" (trained by an earlier, interrupted run of these settings and shipped: {', '.join(reused)})"
summary = [f"SmolLM2 ({model_name}), S={S}, sink {sink}, window {window}, k {ks}; {source}; {len(val_ids)} "
           f"held-out windows ({len(val_ids) - n_val_train} from the validation split, {n_val_train} never-trained "
           "ones from "
           f"the training split); TOVA/H2O evict every {eviction_chunk} tokens; decay {chosen}.", ""]
if train:
    summary += ["Step time (one window, alternated in one run):", "", md(speed), "",
                f"Decay sweep (KVpop-{scorers[0]}, CR {min(compressions):.1%}, {sweep_steps} steps; agreement with "
                "the dense model on the selection windows):", "", md(sweep_table), ""]
summary += ["Each student against each baseline (paired 95% intervals over the held-out windows; ahead/behind only "
            "where the interval excludes 0):", "", versus.reset_index().to_markdown(index=False), "",
            "Ahead of every baseline at every compression on both metrics: "
            + ", ".join(f"{m} {ahead_of_all[m]}" for m in kvpop_methods), ""]
if every_token:
    summary += [f"Against the baselines evicting every token ({every_done}; the same baseline evicting every "
                f"{eviction_chunk} tokens is the row that shows what chunks gave it):", "",
                "(fewer than 2 windows done)" if every_versus is None else every_versus.to_markdown(index=False), ""]
summary += ["The goals, measured:", "", goals.to_markdown(index=False), ""]
summary += [f"Retention recall at {recall_queries} query positions per window, mean and s.e. over windows:", "",
            md(recall_table), "", "Paper vs ours:", "", md(pd.DataFrame(paper_rows)), "",
            *[line for line in paper if line]]
summary += ["", "Agreement with the dense model, mean ± s.e.:", "",
            compare_table(tables["agreement"]).to_markdown(), "",
            "Agreement, difference to the best baseline [95% paired interval] (* excludes 0):", "",
            compare_table(tables["agreement"], "base").to_markdown(), "",
            "KL(dense || method), mean ± s.e.:", "", compare_table(tables["kl"]).to_markdown(), "",
            "KL, difference to the best baseline [95% paired interval]:", "",
            compare_table(tables["kl"], "base").to_markdown()]
write_text(Path(out_dir) / "kvpop_train.md", "\n".join(summary) + "\n")
print("\n".join(summary))
