# %% [markdown]
# # KVpop: distilled eviction against training-free and trained baselines
#
# > Tables 1-2 and Figs. 5-8 analogues on SmolLM2: agreement, KL and perplexity against the dense teacher on held-out prose for StreamingLLM, TOVA, H2O, StreamingLLM+, DMS and KVpop (MLP, mLSTM) at 75% and 88% compression; delayed vs immediate mLSTM readout; retention patterns, retention recall and DMS's per-head eviction.

# %% [markdown]
# The paper distills Qwen3-4B/8B on 16k-token math traces for 2,000 steps and scores pass@1 on
# AIME/HMMT (Table 1) and GPQA-D/LCB (Table 2). On two CPU cores neither the model nor the number
# of steps is within reach, so this stage keeps the *protocol* and shrinks the *scale*:
#
# - **model and data**: SmolLM2-135M, packed windows of `seq_len` tokens of the prose corpus; the
#   students are trained on the training split and every number below is measured on held-out
#   windows of the validation split (disjoint text);
# - **budgets**: compression CR of the window, $B = (1-\text{CR})\,S$ slots per KV head, split into
#   $s$ sinks, a window $w$ and $k = B - s - w$ long-range slots, with the paper's $s = 4$ and its
#   window scaled with the length ($w = 256\,S/16384$);
# - **methods** (all at the same $s, w, k$): the dense teacher; training-free StreamingLLM (sinks and the
#   $w + k$ most recent tokens), TOVA and H2O (`sparsekv.kvpop.baselines`); trained StreamingLLM+
#   (the fixed sink+window pattern, whole model fine-tuned by distillation) and DMS
#   (`sparsekv.kvpop.dms`); KVpop with MLP and mLSTM (delayed readout, delay $w$) scorers
#   trained with the base model frozen (`scorer_only`: only the scorers and their decays learn), and,
#   for Fig. 5, the mLSTM with immediate readout (delay 0). Every student is trained by
#   `sparsekv.distill.distill` (forward KL to the teacher's top-256 logits plus the method's own
#   loss) and checkpointed under `out_dir`, in a folder named by a hash of every setting that shapes the
#   student, so a rerun resumes and a run with other settings trains afresh;
# - **metrics** (Table 1/2 analogue): on the positions where the 75%-compression cache is full (the
#   last $\tfrac34 S$ positions), top-1 agreement with the teacher's next token ("token accuracy vs
#   teacher": 1 for the teacher), KL(teacher || student) over the whole vocabulary, perplexity and
#   next-token accuracy on the text itself, absolute and relative to the teacher.
#
# **Teacher forcing.** StreamingLLM, KVpop, StreamingLLM+ and DMS attend, at every position, to
# exactly what their bounded cache would hold while decoding (a mask over the whole sequence, one
# forward). TOVA and H2O decide from the attention of the queries seen so far; they run through an
# `EvictingCache` in chunks of `eviction_chunk` tokens: within a chunk the queries see the kept
# entries and the chunk densely, eviction happens after the chunk (chunks of one token are exact
# decoding, what every profile but the quick one runs). The held-out windows go through them
# `baseline_batch` at a time: each row of a batch evicts by its own attention, so a batch only shares
# the per-token work of the forward.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
device = "cpu"
dtype = "float32"
seq_len = 256
compressions = [0.75, 0.875]   # 75% and 88%: budgets of S/4 and S/8
sink = 4
window = 4                     # the paper's 256 at 16k tokens, scaled with the length
k_slots = None                 # None: k is (1 - CR) S - sink - window; the gpu profile gives Table 3's k per CR
n_train = 4                    # training windows (cycled); None: every window of the training split
batch_size = 1                 # windows per optimizer step
n_val = 1                      # held-out windows
steps = 2                      # optimizer steps per KVpop student (scorers only)
full_steps = 1                 # optimizer steps per full-mode student (StreamingLLM+, DMS: the whole model)
full_params = None             # full mode: regex of the base parameters that train (None: all of them)
scorer_lr = 1e-3               # peak learning rate of the new parameters (Table 3)
base_lrs = [8e-5, 8e-6]        # candidate learning rates of the base model in full mode (Table 3: 8e-5); the best on:
n_select = 1                   # training-split windows never trained on: the base learning rate is chosen on them
dms_bias_scale = 50.0          # DMS: scale of its per-head gate bias (its effective LR); larger: few steps open gates
eval_every = 1                 # Fig. 5: held-out agreement every eval_every steps
eviction_chunk = 16            # TOVA/H2O teacher forcing: evict every eviction_chunk tokens (1: exact decoding)
baseline_batch = 1             # held-out windows per teacher-forced pass of the training-free baselines
heatmap_tokens = 112           # Fig. 6: the last evictable tokens shown
recall_queries = 16            # Fig. 7: query positions per window
seed = 0

# %%
import inspect
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from sparsekv.kvpop.dms import DMSStudent, eviction_ratios, target_for_budget
from sparsekv.data import packed_sequences
from sparsekv.eval import kl_to_teacher, perplexity, run_grid, token_accuracy, top1_agreement
from sparsekv.hf import AttentionPolicy, DensePolicy, patch
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.kvpop.experiments import (Recording, dms_eviction_figure, final_query_retention, head_recall,
                                        interval_verdict, own_pass_priorities, readout_figure, recall_boxes,
                                        rescaled_scorers, retention_heatmaps, scored_logits, trainable_copy)
from sparsekv.kvpop.loss import kept_long_range
from sparsekv.distill import DistillConfig, distill, epoch_batches
from sparsekv.kvpop.student import KVpopStudent, SinkWindowStudent
from sparsekv.methods import make as make_method
from sparsekv.models import load_model, model_info
from sparsekv.reproduce import fingerprint
from sparsekv.stats import compare, paired_ci

# %%
use_style()
torch.manual_seed(seed)
model, tok = load_model(model_name, dtype=dtype, device=device)
model.requires_grad_(False)
info = model_info(model)
S = seq_len
scale_w = S / 16384
budgets = {cr: round((1 - cr) * S) for cr in compressions}
ks = {cr: (budgets[cr] - sink - window if k_slots is None else k_slots[i]) for i, cr in enumerate(compressions)}
for cr in compressions:
    if ks[cr] < 1:
        raise ValueError(f"compression {cr} leaves no long-range slot at seq_len={S}, sink={sink}, window={window}")
n_scored = S - budgets[min(compressions)]   # positions where the 75%-compression cache is full
# the first n_train windows are the same for any n_select (one seeded permutation)
windows = packed_sequences(tok, S, "train", n=None if n_train is None else n_train + n_select, seed=seed).to(device)
train_ids, select_ids = windows[:len(windows) - n_select], windows[len(windows) - n_select:]
val_ids = packed_sequences(tok, S, "validation", n=n_val, seed=seed).to(device)
print(info, f"; S={S}, budgets {budgets}, sink {sink}, window {window}, k {ks}; {n_scored} scored positions; "
      f"{len(train_ids)} train / {n_val} held-out windows; {torch.get_num_threads()} threads")


# %% [markdown]
# ## Evaluation
#
# `student_logits` runs one held-out window under a policy (one masked forward), or through an
# evicting cache chunk by chunk; the dense teacher's logits and the metrics of a window are computed
# once and cached. `Recording` wraps any policy and keeps each layer's $(q, k, v)$, which the
# retention figures read.

# %%
def student_logits(ids: torch.Tensor, policy: AttentionPolicy, cache=None, chunk: int = 1, net=None) -> torch.Tensor:
    "Logits of the last n_scored positions of `ids` under `policy` on `net` (default: the base model), `scored_logits`."
    return scored_logits(model if net is None else net, ids, n_scored, policy, cache, chunk)


@lru_cache(maxsize=None)
def teacher(i: int) -> tuple[torch.Tensor, dict]:
    "Dense logits of held-out window i and its per-layer (q, k, v)."
    rec = Recording(DensePolicy())
    return student_logits(val_ids[i:i + 1], rec), rec.qkv


def window_metrics(logits: torch.Tensor, i: int) -> dict:
    "Agreement and KL vs the teacher, perplexity and next-token accuracy on held-out window i (scored positions)."
    t = teacher(i)[0]
    labels = val_ids[i:i + 1, S - n_scored + 1:]
    return {"agreement": top1_agreement(logits, t).item(), "kl": kl_to_teacher(logits, t).item(),
            "ppl": perplexity(logits[:, :-1], labels, shift=False).item(),
            "accuracy": token_accuracy(logits[:, :-1], labels, shift=False).item()}


# %% [markdown]
# The dense teacher agrees with itself and has KL 0; the chunked cache path with a budget larger than
# the window evicts nothing and must reproduce the teacher's logits (a check of the evaluation
# plumbing that can fail).

# %%
m0 = window_metrics(teacher(0)[0], 0)
assert m0["agreement"] == 1.0 and abs(m0["kl"]) < 1e-6
tova = make_method("tova", budget=sink + S + 1, sink=sink, window=S)
torch.testing.assert_close(student_logits(val_ids[:1], tova.policy(), tova.cache(model), max(S // 4, 1)),
                           teacher(0)[0], atol=2e-3, rtol=1e-3)
m0

# %% [markdown]
# ## Training-free baselines
#
# StreamingLLM's sink+window pattern is exact as one masked chunk (`SinkWindowRule` masks every
# query of a chunk exactly); TOVA and H2O use chunks of `eviction_chunk` tokens. TOVA is its paper's
# (attention averaged over every query head, one kept set for all KV heads); `tova_group` averages
# within each KV head's group, the variant earlier runs of this stage used as "TOVA".

# %%
BASELINE_SPECS = {"streaming_llm": ("streaming_llm", {}), "tova": ("tova", {}),
                  "tova_group": ("tova", {"heads": "group"}), "h2o": ("h2o", {})}


def baseline_logits(name: str, cr: float, rows: slice) -> torch.Tensor:
    """Teacher-forced logits [len(rows), n_scored, V] of training-free baseline `name` at compression cr on held-out
    windows `rows`."""
    base, options = BASELINE_SPECS[name]
    m = make_method(base, budget=sink + window + ks[cr], sink=sink, window=window, **options)
    return student_logits(val_ids[rows], m.policy(), m.cache(model), S if name == "streaming_llm" else eviction_chunk)


@lru_cache(maxsize=None)
def baseline_metrics(name: str, cr: float) -> tuple[dict, ...]:
    "`window_metrics` of baseline `name` at compression cr on every held-out window, `baseline_batch` windows per pass."
    out = []
    for a in range(0, n_val, baseline_batch):
        logits = baseline_logits(name, cr, slice(a, a + baseline_batch))
        out += [window_metrics(row[None], i) for i, row in enumerate(logits, a)]
    return tuple(out)


# %% [markdown]
# StreamingLLM through the evicting cache, one chunk, equals the same rule fed one token at a time
# (exact decoding) on a short prefix; so the one-chunk shortcut is no approximation.

# %%
n_chk = min(S, budgets[max(compressions)] + 8)   # evicts for 8 steps
sllm = make_method("streaming_llm", budget=sink + window + ks[max(compressions)], sink=sink, window=window)
with torch.no_grad(), patch(model, sllm.policy()):
    one_chunk = model(val_ids[:1, :n_chk], past_key_values=sllm.cache(model), use_cache=True).logits
    cache, stepped = sllm.cache(model), []
    for t in range(n_chk):
        stepped.append(model(val_ids[:1, t:t + 1], past_key_values=cache, use_cache=True).logits)
# bfloat16 (the gpu profile) keeps 8 bits of mantissa: one chunk and token by token round differently, by about an ulp
tol = dict(atol=2e-3, rtol=1e-3) if one_chunk.dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
torch.testing.assert_close(one_chunk, torch.cat(stepped, 1), **tol)


# %% [markdown]
# ## Training the students
#
# Every trained method goes through the same loop, `distill` (App. F, Table 3: AdamW, betas
# (0.9, 0.95), weight decay $10^{-4}$, clipping 1.0, warmup then cosine for the new parameters,
# constant LR for the base; here `steps` steps of one window each). KVpop's per-head decays keep
# Table 3's range $\gamma \in [0.999, 0.999999]$ per $16384/S$ tokens (the window is scaled the same
# way, so a token's decay over one window matches the paper's). Full-mode students (StreamingLLM+,
# DMS, and KVpop-MLP as the paper trains it, `kvpop_mlp_full`) train a copy of the base model, with the
# frozen base as the teacher (`full_params` can restrict
# which of its parameters train: the quick smoke test trains only the final norm, so its optimizer
# state stays small; every other profile trains them all); the other KVpop students train only
# their scorers. The history of the delayed and immediate mLSTM students records the held-out
# agreement every `eval_every` steps (Fig. 5).
#
# **Few steps.** The KVpop scorers start from a zero score head, i.e. from pure recency (StreamingLLM's
# choice); DMS's gates start closed (no eviction) and its target eviction rate ramps up over the first
# three quarters of training (`target_for_budget`: the rate whose mean cache equals $s + w + k$). With
# tens of steps instead of 2,000, the cpu profile raises the scorers' peak LR (`scorer_lr`) and DMS's
# bias scale (`dms_bias_scale`, the effective LR of its per-head gate bias) so that both can move at
# all; DMS's budget is only met on average, and only once its gates have learned to close: after the few
# steps of the cpu profiles they stay mostly open, so the table reports the fraction of keys each method's
# final query may attend to (`KV kept at end`, from DMS's hard decisions), and a comparison with DMS is at
# equal budget only where that fraction matches.

# %%
def kvpop_scorers(kind: str, delay: int = 0):
    "Fresh MLP or mLSTM (readout delay `delay`) scorers for every layer, decays from Table 3 rescaled to S."
    return rescaled_scorers(kind, info.num_layers, info.num_kv_heads, info.head_dim, S, delay).to(device)


STUDENTS = {  # method: (student factory at budget k, training mode)
    "streaming_llm_plus": (lambda k: SinkWindowStudent(sink, window, k), "full"),
    "dms": (lambda k: DMSStudent(info.num_layers, info.num_kv_heads, info.head_dim, window,
                                 target_for_budget(sink + window + k, window, S),
                                 ramp_steps=max(1, 3 * full_steps // 4), sink=sink, bias_scale=dms_bias_scale), "full"),
    "kvpop_mlp": (lambda k: KVpopStudent(kvpop_scorers("mlp"), sink, window, k, seed=seed), "scorer_only"),
    # the paper's own setting (Table 3, trainable parameters: all): scorers and base model, full_steps steps
    "kvpop_mlp_full": (lambda k: KVpopStudent(kvpop_scorers("mlp"), sink, window, k, seed=seed), "full"),
    "kvpop_mlstm": (lambda k: KVpopStudent(kvpop_scorers("mlstm", window), sink, window, k, seed=seed), "scorer_only"),
    "kvpop_mlstm_immediate": (lambda k: KVpopStudent(kvpop_scorers("mlstm", 0), sink, window, k, seed=seed),
                              "scorer_only"),
}
FIG5 = ("kvpop_mlstm", "kvpop_mlstm_immediate")


def heldout_eval(net, student) -> dict:
    "Agreement, KL, perplexity and accuracy of the student on held-out window 0 (Fig. 5)."
    return window_metrics(student_logits(val_ids[:1], student.policy(), net=net), 0)


def run_digest(method: str, cr: float, config: DistillConfig, fig5: bool) -> str:
    "Hash of every setting that shapes `method`'s trained student at compression cr and its checkpointed history."
    # the base's learning rate trains nothing in scorer-only mode: choosing another must not retrain those students
    settings = asdict(config) | ({} if config.mode == "full" else {"base_lr": None})
    return fingerprint(dict(config=settings, method=method, model=model_name, dtype=dtype, device=device,
                            seq_len=S, sink=sink, window=window, k=ks[cr], n_train=n_train, batch_size=batch_size,
                            data_seed=seed, dms_bias_scale=dms_bias_scale if method == "dms" else None,
                            fig5_eval=[eval_every, n_scored] if fig5 else None,  # the history's eval rows
                            **({"full_params": full_params} if full_params and config.mode == "full" else {})))


def train_student(method: str, cr: float, lr: float | None = None):
    """(network, student in eval mode, training history) of `method` at compression cr, trained or resumed from out_dir;
    full mode trains the base at lr (default base_lr)."""
    make, mode = STUDENTS[method]
    student = make(ks[cr]).to(device)
    net = model if mode == "scorer_only" else trainable_copy(model, full_params)
    n = full_steps if mode == "full" else steps
    config = DistillConfig(steps=n, mode=mode, base_lr=base_lr if lr is None else lr, new_lr=scorer_lr,
                           warmup_steps=max(1, n // 20), checkpoint_every=n, seed=seed)
    fig5 = method in FIG5 and cr == min(compressions)
    folder = Path(out_dir)/"kvpop_distill"/f"{method}_S{S}_cr{cr:g}_{run_digest(method, cr, config, fig5)}"
    history = distill(net, student, epoch_batches(train_ids, batch_size, n, seed), config, checkpoint_dir=folder,
                      eval_fn=heldout_eval if fig5 else None, eval_every=eval_every if fig5 else None, teacher=model)
    return net.eval().requires_grad_(False), student.eval(), history


trained_scorers = lru_cache(maxsize=None)(train_student)  # scorer-only students share the base model: keep them all
trained_full = lru_cache(maxsize=2)(train_student)        # a full-mode student holds a copy of the model: keep two


def trained(method: str, cr: float):
    "`train_student(method, cr)`, kept in memory for the rest of the run (full-mode students: the last two)."
    return (trained_full if STUDENTS[method][1] == "full" else trained_scorers)(method, cr)


# %% [markdown]
# ## The base learning rate, chosen on windows never trained on
#
# Table 3's base LR ($8 \times 10^{-5}$, constant) goes with batches of 128 sequences of 16k tokens; a cpu
# step here is one window of $S$ tokens, thousands of times fewer tokens, so each step's gradient is far
# noisier and the paper's LR need not transfer (our choice, not the paper's). Each candidate in `base_lrs`
# trains StreamingLLM+ and KVpop-MLP full at the lower compression for `full_steps` steps; the LR with the
# highest mean token accuracy vs the dense teacher over both methods on `n_select` **training-split windows
# never trained on** becomes `base_lr` for every full-mode student. The held-out windows the results are
# reported on take no part in the choice. The `cpu` profile lists one candidate, $8 \times 10^{-6}$, the choice of
# the four-candidate sweep that the `cpu-full` profile runs (its first run, commit 87ab639, chose it), to stay
# within the hour.

# %%
SELECT_METHODS = ("streaming_llm_plus", "kvpop_mlp_full")


@lru_cache(maxsize=None)
def select_teacher(i: int) -> torch.Tensor:
    "Dense logits of selection window i."
    return student_logits(select_ids[i:i + 1], DensePolicy())


def selection_rows(lr: float) -> list[dict]:
    "Token accuracy vs the teacher on every selection window of each SELECT_METHODS student trained at base LR lr."
    out, cr = [], min(compressions)
    for m in SELECT_METHODS:
        net, student, _ = train_student(m, cr, lr)
        for i in range(n_select):
            logits = student_logits(select_ids[i:i + 1], student.policy(), net=net)
            out.append({"base_lr": lr, "method": m, "window": i,
                        "agreement": top1_agreement(logits, select_teacher(i)).item()})
        del net, student  # a full copy of the model and its optimizer's checkpoint: one at a time
    return out


if not base_lrs or n_select < 1:
    raise ValueError(f"base_lrs must list at least one learning rate and n_select be >= 1, got {base_lrs}, {n_select}")
lr_choice = pd.DataFrame([r for lr in base_lrs for r in selection_rows(lr)])
# in base_lrs's order, so a tie goes to the first listed (the paper's)
lr_table = lr_choice.pivot_table(index="base_lr", columns="method", values="agreement",
                                 aggfunc="mean").reindex(base_lrs)
lr_table["mean"] = lr_table[list(SELECT_METHODS)].mean(axis=1)
base_lr = float(lr_table["mean"].idxmax())
lr_table = lr_table.reset_index()
write_csv(Path(fig_dir)/"kvpop_distill_base_lr.csv", lr_table)
print(f"base LR chosen: {base_lr:g}")
lr_table

# %% [markdown]
# ## Table 1/2 analogue
#
# One `run_grid` row per (method, compression, held-out window); the dense teacher is the row with
# compression 0. Rows are written as they finish, so an interrupted run resumes. The run's settings
# (`settings`: model, budgets, data, learning rates, the scored positions) are key columns of every
# row, so a run with other settings computes its cells again instead of reusing rows of another run;
# they are left out of the table (the summary states them).

# %%
BASELINES = tuple(BASELINE_SPECS)
METHODS = ("dense", *BASELINES, "streaming_llm_plus", "dms", "kvpop_mlp", "kvpop_mlstm", "kvpop_mlp_full")


def method_logits(method: str, cr: float, i: int) -> torch.Tensor:
    """Teacher-forced logits of the dense teacher or trained `method` at compression cr on held-out window i
    (baselines: `baseline_metrics`)."""
    if method == "dense": return teacher(i)[0]
    net, student, _ = trained(method, cr)
    return student_logits(val_ids[i:i + 1], student.policy(), net=net)


def kv_kept(method: str, cr: float, i: int) -> float:
    """Fraction of the window's keys the final query may attend to: (s + w + k) / S, DMS's from its hard decisions, 1
    for dense."""
    if method == "dense": return 1.0
    if method != "dms": return budgets[cr] / S
    net, student, _ = trained(method, cr)
    rho = eviction_ratios(student, net, val_ids[i:i + 1]).mean().item()   # evicted fraction of long-range tokens
    return (sink + window + (1 - rho) * (S - sink - window)) / S


def cell_metrics(cell: dict) -> dict:
    m, cr, i = cell["method"], cell["compression"], cell["window"]
    metrics = baseline_metrics(m, cr)[i] if m in BASELINES else window_metrics(method_logits(m, cr, i), i)
    return {**metrics, "kv_kept": kv_kept(m, cr, i)}


cells = [{"seq_len": S, "steps": steps, "full_steps": full_steps, "method": "dense", "compression": 0.0, "window": i}
         for i in range(n_val)]
cells += [{"seq_len": S, "steps": steps, "full_steps": full_steps, "method": m, "compression": cr, "window": i}
          for m in METHODS[1:] for cr in compressions for i in range(n_val)]
settings = {"model_name": model_name, "dtype": dtype, "device": device, "sink": sink,
            "attention_window": window,   # "window" is the cells' held-out window
            "k_slots": str(k_slots), "n_train": n_train, "batch_size": batch_size, "scorer_lr": scorer_lr,
            "base_lr": base_lr, "dms_bias_scale": dms_bias_scale, "eviction_chunk": eviction_chunk, "seed": seed,
            "n_scored": n_scored, **({"full_params": full_params} if full_params else {})}
grid = run_grid(cells, cell_metrics, Path(out_dir)/"kvpop_distill_grid.csv", desc="kvpop distill", params=settings)
grid = grid.drop(columns=list(settings))
keys = ["seq_len", "steps", "full_steps", "method", "compression", "window"]
res = grid.merge(pd.DataFrame(cells), on=keys)
assert len(res) == len(cells)
write_csv(Path(fig_dir)/"kvpop_distill_cells.csv", res)

# %%
mean = res.groupby(["compression", "method"], sort=False)[["agreement", "kl", "ppl", "accuracy", "kv_kept"]].mean()
mean = mean.reset_index()
dense = mean[mean.method == "dense"].iloc[0]
mean["rel_accuracy"] = mean.accuracy / dense.accuracy
mean["rel_ppl"] = mean.ppl / dense.ppl
# binomial standard error over the scored positions of every held-out window (positions taken as independent)
mean.insert(mean.columns.get_loc("agreement") + 1, "agreement_se",
            np.sqrt(mean.agreement * (1 - mean.agreement) / (n_val * n_scored)))
mean.insert(1, "budget", [budgets.get(cr, S) for cr in mean.compression])
write_csv(Path(fig_dir)/"kvpop_distill_table.csv", mean)
mean

# %% [markdown]
# ## Fig. 5 analogue: delayed vs immediate mLSTM readout
#
# Held-out agreement with the teacher over training steps, for the mLSTM scorer read out $w$ tokens
# late (its state has seen the token's near future when it is ranked) and read out immediately.

# %%
cr5 = min(compressions)
curves = pd.concat([trained(m, cr5)[2].assign(method=m) for m in FIG5])
curves = curves[curves.kind == "eval"][["method", "step", "agreement", "kl", "ppl", "accuracy"]].reset_index(drop=True)
fig = readout_figure(curves, dict(zip(FIG5, (f"delayed readout (delay {window})", "immediate readout (delay 0)"))),
                     n_scored)
fig.axes[0].set_title(f"mLSTM scorer, CR {cr5:.0%}, S = {S}, held-out window 0; band: ±1 s.e. over {n_scored} "
                      "positions")
fig.suptitle("KVpop Fig. 5 analogue: delayed vs immediate readout of the mLSTM scorer")
save_figure(fig, Path(fig_dir)/"kvpop_distill_fig5_delayed_readout.png", data=curves)
curves


# %% [markdown]
# ## Fig. 6/9 analogue: which tokens KVpop keeps
#
# For held-out windows, the KVpop students' priorities on their own (sparse) forward pass; at the
# final query, the number of KV heads of each layer that keep each of the last `heatmap_tokens`
# evictable tokens ($s \le t \le S - 1 - w$) among their $k$ long-range slots.

# %%
@lru_cache(maxsize=None)
def student_pass(method: str, cr: float, i: int) -> tuple[torch.Tensor, dict]:
    "`own_pass_priorities` of a KVpop student on held-out window i."
    net, student, _ = trained(method, cr)
    return own_pass_priorities(net, student, val_ids[i:i + 1], n_scored)


def retention_counts(method: str, cr: float, i: int) -> tuple[np.ndarray, int, int]:
    "`final_query_retention` of a KVpop student's own pass over held-out window i."
    return final_query_retention(student_pass(method, cr, i)[0], sink, window, ks[cr], heatmap_tokens)


# %% [markdown]
# Check against the definition: at the final query, every layer and head keeps exactly $k$
# long-range tokens (more eligible tokens than slots), the heatmap's tokens are a subset of them.

# %%
prio0 = student_pass("kvpop_mlstm", cr5, 0)[0]
kept0 = kept_long_range(prio0, [S - 1], sink, window, ks[cr5])
assert (kept0.sum(-1) == ks[cr5]).all()
for l, h in ((0, 0), (info.num_layers - 1, info.num_kv_heads - 1)):   # brute force: the k best eligible priorities
    elig = list(range(sink, S - window))
    best = sorted(elig, key=lambda t: (-prio0[l, h, t].item(), t))[:ks[cr5]]
    assert set(torch.nonzero(kept0[l, h, 0]).flatten().tolist()) == set(best)


# %%
def token_labels(i: int, lo: int, hi: int) -> list[str]:
    "The token strings of held-out window i at positions lo..hi-1, whitespace made visible."
    return [tok.decode([t]).replace("\n", "\\n").replace(" ", "\u2423") for t in val_ids[i, lo:hi].tolist()]

panels = [("kvpop_mlstm", 0), ("kvpop_mlp", 0)] + [("kvpop_mlstm", i) for i in range(1, min(n_val, 3))]
counts = {(m, i): retention_counts(m, cr5, i) for m, i in panels}   # (heads keeping each token, lo, hi)
heat_rows = [{"method": m, "window": i, "layer": l, "position": lo + j, "heads_keeping": int(c)}
             for (m, i), (n, lo, hi) in counts.items() for l in range(n.shape[0]) for j, c in enumerate(n[l])]
fig = retention_heatmaps([(f"{m}, held-out window {i}", n, token_labels(i, lo, hi)) for (m, i), (n, lo, hi)
                          in counts.items()], info.num_kv_heads, heatmap_tokens)
lo, hi = counts[panels[-1]][1:]
fig.suptitle(f"KVpop Fig. 6 / Fig. 9 analogue: KV heads of each layer keeping each of the last {hi - lo} evictable "
             f"tokens at the final query (CR {cr5:.0%}, S = {S})")
save_figure(fig, Path(fig_dir)/"kvpop_distill_fig6_retention.png", data=pd.DataFrame(heat_rows))


# %% [markdown]
# ## Fig. 7 analogue: retention recall against the teacher's top-k
#
# For each layer and KV head: the fraction of the teacher's top-$k$ long-range tokens (the
# future-attention target of the dense teacher's $q, k$, Eq. 8) that the student keeps under the same
# budget, averaged over `recall_queries` query positions from the first full cache to the end of each
# held-out window. StreamingLLM (the $k$ most recent eligible tokens) is the reference. Two teachers,
# labelled: the **undecayed** target (the figure), and the target **decayed** by each KVpop student's own
# learned $\gamma$ (Eq. 5: the ranking its loss trains against; StreamingLLM has no decay).

# %%
def recall_per_head(method: str, cr: float, i: int, decayed: bool = False) -> np.ndarray:
    """Retention recall [L, Hkv] of `method` against the teacher's future-attention top-k on held-out window i;
    `decayed`: the target decayed by the student's own gamma."""
    if method == "streaming_llm":
        pred = torch.arange(S, dtype=torch.float32, device=device).expand(L, info.num_kv_heads, S)
    else: pred = student_pass(method, cr, i)[0]
    return head_recall(teacher(i)[1], scalings, pred, sink, window, ks[cr], recall_queries,
                       trained(method, cr)[1].scorers.decayed if decayed else None)

L, scalings = info.num_layers, [layer.self_attn.scaling for layer in model.model.layers]

RECALL = ("kvpop_mlstm", "kvpop_mlp", "streaming_llm")
TEACHERS = {m: ("undecayed",) if m == "streaming_llm" else ("undecayed", "decayed") for m in RECALL}
recall_rows = [{"method": m, "teacher": t, "compression": cr, "window": i, "layer": l, "head": h, "recall": r}
               for m in RECALL for t in TEACHERS[m] for cr in compressions for i in range(n_val)
               for l, row in enumerate(recall_per_head(m, cr, i, t == "decayed")) for h, r in enumerate(row)]
recall = pd.DataFrame(recall_rows)
fig = recall_boxes(recall[recall.teacher == "undecayed"], list(RECALL), ks, info.num_layers)
fig.suptitle("KVpop Fig. 7 analogue: recall of the dense teacher's (undecayed) future-attention top-k per layer "
             f"(boxes over KV heads and {n_val} held-out window(s))")
save_figure(fig, Path(fig_dir)/"kvpop_distill_fig7_recall.png", data=recall)
recall.groupby(["compression", "method", "teacher"]).recall.mean()

# %% [markdown]
# ## Fig. 8 analogue: DMS's per-head eviction against KVpop's fixed budget
#
# DMS's median (over held-out windows) fraction of long-range tokens ($s \le t < S - w$) its hard
# decisions evict, per layer and KV head (0: dense, 1: window only); KVpop evicts, at the final
# query, the same fraction $1 - k/(S - s - w)$ in every head by construction.

# %%
net_d, dms_student, _ = trained("dms", cr5)
ratios = torch.cat([eviction_ratios(dms_student, net_d, val_ids[i:i + 1]) for i in range(n_val)])
ratios = ratios.median(0).values.cpu().numpy()
kvpop_ratio = 1 - ks[cr5] / (S - sink - window)
fig = dms_eviction_figure(ratios, kvpop_ratio)
fig.suptitle(f"KVpop Fig. 8 analogue (App. H): DMS's per-head eviction vs KVpop's fixed budget "
             f"(CR {cr5:.0%}, S = {S}, {full_steps} DMS training steps)")
save_figure(fig, Path(fig_dir)/"kvpop_distill_fig8_dms_eviction.png",
            data=pd.DataFrame([{"layer": l, "head": h, "dms_ratio": ratios[l, h], "kvpop_ratio": kvpop_ratio}
                               for l in range(info.num_layers) for h in range(info.num_kv_heads)]))


# %% [markdown]
# ## Goal check and fragment
#
# The goal: KVpop-mLSTM keeps at least 95% of the dense teacher's token accuracy at 75% compression
# (token accuracy vs the teacher is the top-1 agreement, which is 1 for the teacher) and beats
# StreamingLLM, TOVA, H2O and StreamingLLM+ at every compression. "Beats" means ahead on agreement with
# the paired 95% interval over the held-out windows excluding 0, not a higher mean; the table after the
# goal gives every KVpop student against every baseline on agreement and KL.

# %%
def value(method: str, cr: float, col: str = "agreement") -> float:
    return float(mean[(mean.method == method) & (mean.compression == cr)][col].iloc[0])


def paired(a: str, b: str, cr: float, metric: str = "agreement") -> tuple[float, float, float] | None:
    """Mean paired difference a - b of `metric` over the held-out windows at compression cr, 95% interval (None: one
    window)."""
    x, y = (res[(res.method == m) & (res.compression == cr)].sort_values("window")[metric].to_numpy() for m in (a, b))
    return paired_ci(x, y) if len(x) > 1 else None


# the project's rule (`compare`): below this many items the percentile interval undercovers (0.88 at 8, 41_stats)
MIN_ITEMS = inspect.signature(compare).parameters["min_items"].default


def verdict(ci: tuple[float, float, float] | None, higher_is_better: bool = True) -> str:
    "`interval_verdict` over the held-out windows."
    return interval_verdict(ci, n_val, MIN_ITEMS, higher_is_better)


GOAL_BASELINES = ("streaming_llm", "tova", "h2o", "streaming_llm_plus")
kv = {cr: value("kvpop_mlstm", cr) for cr in compressions}
keeps = kv[cr5] >= 0.95
beats = {cr: {b: paired("kvpop_mlstm", b, cr) for b in GOAL_BASELINES} for cr in compressions}
met = keeps and n_val >= MIN_ITEMS and all(ci is not None and ci[1] > 0 for v in beats.values() for ci in v.values())
goal = [f"**Goal {'met' if met else 'not met'}.** KVpop-mLSTM's held-out token accuracy vs the teacher at CR "
        f"{cr5:.0%} is "
        f"{kv[cr5]:.4f} ({'>=' if keeps else '<'} 0.95); its next-token accuracy on the text is "
        f"{value('kvpop_mlstm', cr5, 'rel_accuracy'):.3f} of the teacher's."]
for cr in compressions:
    goal.append(f"At CR {cr:.1%}, KVpop-mLSTM {kv[cr]:.4f} against " + "; ".join(
        f"{b} {value(b, cr):.4f} ({verdict(ci)})" for b, ci in beats[cr].items()) + ".")
print("\n".join(goal))

# %%
KVPOP = ("kvpop_mlp", "kvpop_mlstm", "kvpop_mlp_full")
# DMS keeps what its gates leave open, not the budget: its measured KV beside each row says when a pair is unequal
def pair_verdicts(a: str, b: str, cr: float) -> dict:
    "Verdicts of a against b at compression cr: token accuracy (higher is better) and KL (lower is better)."
    return {"agreement": verdict(paired(a, b, cr)), "kl": verdict(paired(a, b, cr, "kl"), higher_is_better=False)}


versus = pd.DataFrame([{"compression": cr, "kvpop": a, "baseline": b, "baseline KV kept": value(b, cr, "kv_kept"),
                        "KVpop KV kept": value(a, cr, "kv_kept"), **pair_verdicts(a, b, cr)}
                       for cr in compressions for a in KVPOP for b in (*BASELINES, "streaming_llm_plus", "dms")])
versus

# %% [markdown]
# ## What adapting the model adds (the paper's StreamingLLM → StreamingLLM+ step)
#
# The paper trains all parameters for every trained method (Table 3). Here each full-mode student trains
# `full_steps` steps; the pairs below isolate one change each, as paired differences over the same held-out
# windows (mean and 95% bootstrap interval; ahead or behind only where the interval excludes 0 over at least
# 16 windows): training the model under a fixed pattern (StreamingLLM+ vs StreamingLLM), adapting the model
# under KVpop's learned eviction (full vs scorer-only, equal steps when `full_steps = steps`), and each trained
# method against the best training-free baseline. Token accuracy vs the teacher: higher is better; KL: lower. The last rows give the other side of
# adapting the model: each full-mode student's own model run with dense attention against the teacher
# (agreement minus 1, and KL; both 0 for an unchanged model), i.e. how far the adaptation moved the model itself.

# %%
PAIRS = [("streaming_llm_plus", "streaming_llm"), ("kvpop_mlp_full", "kvpop_mlp"),
         ("kvpop_mlp_full", "streaming_llm_plus"), ("dms", "streaming_llm_plus"), ("kvpop_mlp", "tova"),
         ("kvpop_mlp_full", "tova")]


def adaptation_rows() -> pd.DataFrame:
    "Verdicts of each pair (a against b) over the held-out windows, per compression."
    return pd.DataFrame([{"compression": cr, "pair": f"{a} - {b}", **pair_verdicts(a, b, cr)}
                         for cr in compressions for a, b in PAIRS])


adaptation = adaptation_rows()


def drift_rows() -> list[dict]:
    "Each full-mode student's own model with dense attention against the teacher: how far adaptation moved it."
    out = []
    for m in (m for m in METHODS if m in STUDENTS and STUDENTS[m][1] == "full"):
        for cr in compressions:
            net = trained(m, cr)[0]
            rows = [window_metrics(student_logits(val_ids[i:i + 1], DensePolicy(), net=net), i) for i in range(n_val)]
            out.append({"compression": cr, "pair": f"{m}'s model, dense attention - teacher",
                        "agreement": f"{np.mean([r['agreement'] for r in rows]) - 1:+.4f}",
                        "kl": f"{np.mean([r['kl'] for r in rows]):+.4f}"})
    return out


# the cost side: with dense attention, an unchanged model would agree with the teacher exactly (KL 0)
adaptation = pd.concat([adaptation, pd.DataFrame(drift_rows())], ignore_index=True)
write_csv(Path(fig_dir)/"kvpop_distill_adaptation.csv", adaptation)
adaptation

# %% [markdown]
# ## Paper vs ours
#
# The paper's numbers are quoted from its text (Table 1: Qwen3-4B, average pass@1 relative to the
# teacher); ours come from this run. The metrics differ (pass@1 on math problems there, top-1
# agreement with the teacher on held-out prose here), so only the ordering of the methods is comparable.

# %%
# the paper trains every parameter of its KVpop (Table 3): its MLP number stands beside both of ours
PAPER_REL = {0.75: dict(streaming_llm=0.76, tova=0.73, streaming_llm_plus=0.92, dms=0.96, kvpop_mlp=0.98,
                        kvpop_mlstm=0.98, kvpop_mlp_full=0.98),
             0.875: dict(streaming_llm=0.47, tova=0.58, streaming_llm_plus=0.74, dms=0.89, kvpop_mlp=0.93,
                         kvpop_mlstm=0.97, kvpop_mlp_full=0.93)}
sparse = [m for m in METHODS if m != "dense"]
rows = [{"method": m, **{k: v for cr in compressions for k, v in (
            (f"paper rel. pass@1, CR {cr:.1%}", PAPER_REL.get(cr, {}).get(m)),
            (f"ours token acc. vs teacher, CR {cr:.1%}", value(m, cr)),
            (f"ours s.e., CR {cr:.1%}", value(m, cr, "agreement_se")))}} for m in sparse]
best = {cr: max(sparse, key=lambda m: value(m, cr)) for cr in compressions}
last = curves.groupby("method").last()
delay_gain = 100 * (last.agreement[FIG5[0]] - last.agreement[FIG5[1]])
delay_se = 100 * np.sqrt(2 * last.agreement[FIG5[0]] * (1 - last.agreement[FIG5[0]]) / n_scored)
mlstm_recall = recall[(recall.method == "kvpop_mlstm") & (recall.compression == cr5)].groupby("teacher").recall.mean()
paper = ["| claim | paper | ours | why they differ |", "|---|---|---|---|",
         "| KVpop beats every sparse baseline (Table 1, §4.1) | \"At CR=75%, all methods improve, but the ordering "
         "holds, "
         "KVpop outperforms all sparse baselines on average\" | best sparse method by token accuracy vs teacher: "
         + ", ".join(f"{best[cr]} at CR {cr:.1%}" for cr in compressions) + " | "
         f"{steps} scorer steps and {full_steps} full-mode steps instead of 2,000, prose instead of math traces, "
         "135M |",
         f"| delayed mLSTM readout beats immediate (Fig. 5, §4.2) | \"a 0.2-point increase in token accuracy\" after "
         f"2,000 steps | {delay_gain:+.2f} points after {steps} steps (s.e. of the difference {delay_se:.2f}) | "
         f"one held-out window of {n_scored} positions cannot resolve 0.2 points |",
         f"| KVpop recovers the teacher's top-k (Fig. 7, §4.3, CR 75%) | \"a global mean recall of 81%\" | "
         f"{mlstm_recall['undecayed']:.2f} against the undecayed teacher, {mlstm_recall['decayed']:.2f} against the "
         f"teacher decayed by its own gamma (KVpop-mLSTM, CR {cr5:.0%}) | scorers start from recency and train "
         f"{steps} steps; the "
         "paper's \"full-attention teacher's top-k\" does not say whether the decay applies |",
         "| DMS concentrates its budget in few heads (Fig. 8, App. H) | \"A small subset of heads uses nearly the full "
         "long-range token budget ... many other heads ... collapse to sliding-window-only attention\" | "
         f"{(ratios <= 0.1).mean():.0%} of heads evict at most 10%, {(ratios >= 0.9).mean():.0%} at least 90% | "
         f"{full_steps} DMS steps with its gate bias scaled by {dms_bias_scale:g} |"]
pd.DataFrame(rows)


# %%
def md_table(df: pd.DataFrame) -> str:
    "df as a markdown table, 4 decimals; a missing value (a method the paper does not report) as a dash."
    return df.to_markdown(index=False, floatfmt=".4f", missingval="-")

table = mean.rename(columns={"agreement": "token acc. vs teacher", "kl": "KL(teacher||student)", "ppl": "perplexity",
                             "accuracy": "next-token acc.", "rel_accuracy": "next-token acc. rel.",
                             "rel_ppl": "perplexity rel.",
                             "kv_kept": "KV kept at end", "agreement_se": "s.e."})
lines = [f"SmolLM2-135M, held-out prose windows of S={S} tokens ({n_val} windows, metrics on the last {n_scored} "
         "positions, "
         f"where the 75% cache is full); budgets B=(1-CR)S = {budgets} per KV head: sinks s={sink}, window w={window} "
         f"(the paper's 256 at 16k scaled), long-range k={ks}. Students trained on {len(train_ids)} training windows, "
         f"{batch_size} per step: "
         f"KVpop scorers only (base frozen) for {steps} steps, StreamingLLM+, DMS and KVpop-MLP full "
         f"{'the whole model' if full_params is None else f'the base parameters matching {full_params!r}'} for "
         f"{full_steps} steps "
         f"(the paper: 2,000 steps of 128 x 16k tokens, base and scorers). TOVA/H2O evict every {eviction_chunk} "
         "tokens. "
         "This is a small-scale run of the protocol, not the paper's scale.", "",
         f"Base learning rate of the full-mode students: {base_lr:g}, the best of {base_lrs} (Table 3: 8e-5) by mean "
         "token "
         f"accuracy vs the teacher of {' and '.join(SELECT_METHODS)} at CR {min(compressions):.0%} on {n_select} "
         "training-split windows never trained on:", "", lr_table.to_markdown(index=False, floatfmt=".4g"), "",
         "Table 1/2 analogue (mean over held-out windows; relative = divided by the dense teacher):", "",
         md_table(table), "",
         *goal, "",
         f"Every KVpop student against every baseline (paired differences KVpop - baseline over the {n_val} held-out "
         f"windows, 95% bootstrap intervals; ahead/behind only when the interval excludes 0 over at least {MIN_ITEMS} "
         "windows; KL: lower is ahead; "
         "the KV each keeps at the end beside it: a pair is at equal budget only where the two agree):", "",
         versus.to_markdown(index=False, floatfmt=".4f"), "",
         "Paper vs ours (Table 1 relative pass@1 of Qwen3-4B, quoted; ours: token accuracy vs the teacher and its "
         "binomial standard error; different metrics, so compare the ordering):", "", md_table(pd.DataFrame(rows)), "",
         *paper, "",
         f"What adapting the model adds (paired differences a - b over the {n_val} held-out windows, 95% bootstrap "
         f"intervals, ahead/behind as above; {steps} scorer-only steps, {full_steps} full-mode steps):", "",
         adaptation.to_markdown(index=False), "",
         "Fig. 7 analogue, mean top-k retention recall vs the teacher's future-attention target (undecayed, or "
         "decayed by "
         "the student's own gamma) over layers, heads, windows:", "",
         md_table(recall.groupby(["compression", "method", "teacher"]).recall.mean().reset_index()), "",
         f"Fig. 8 analogue: DMS evicts a median {np.median(ratios):.3f} of long-range tokens per head at CR {cr5:.0%} "
         f"(range {ratios.min():.3f}-{ratios.max():.3f} over heads); KVpop evicts {kvpop_ratio:.3f} in every head at "
         "the final query.", "",
         "Fig. 5 analogue, held-out token accuracy vs the teacher during training (mLSTM, delayed and immediate "
         "readout):", "",
         md_table(curves[["method", "step", "agreement"]].pivot(index="step", columns="method",
                                                                values="agreement").reset_index())]
write_text(Path(out_dir)/"kvpop_distill.md", "\n".join(lines) + "\n")
print("\n".join(lines))
