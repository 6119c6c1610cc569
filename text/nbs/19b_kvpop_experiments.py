# %% [markdown]
# # KVpop: helpers of the experiment notebooks
#
# > Held-out logits, the oracle policy, students, retention, verdicts and figures shared by the KVpop stages.

# %%
#| default_exp kvpop.experiments

# %%
#| export
from __future__ import annotations

import copy
import math
import re
import subprocess
from contextlib import nullcontext
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.colors import BoundaryNorm
from torch import Tensor, nn

from sparsekv.attention import check_int
from sparsekv.distill import student_spec
from sparsekv.hf import AttentionPolicy, dense_attention, patch
from sparsekv.io import atomic_path, write_csv
from sparsekv.kvpop.cache import KVpopScorers
from sparsekv.kvpop.cutoff import topk_cutoff
from sparsekv.kvpop.loss import kept_long_range, retention_recall
from sparsekv.kvpop.mask import kvpop_mask
from sparsekv.kvpop.student import KVpopStudent, write_shipped_manifest
from sparsekv.kvpop.target import future_attention_target
from sparsekv.stats import compare

# %%
#| hide
import json
import tempfile
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.hf import DensePolicy
from sparsekv.kvpop.mask import kvpop_mask_reference
from sparsekv.methods import make
from sparsekv.models import load_model
from sparsekv.stats import paired_ci

torch.set_num_threads(1)  # tiny tensors: threads only add overhead

# %% [markdown]
# The stages [`kvpop_distill`](../reproduce/12_kvpop_distill.ipynb) and
# [`kvpop_train`](../reproduce/13_kvpop_train.ipynb) evaluate KVpop students and their baselines on held-out prose
# windows, and report paired differences. What they share lives here, each piece checked on a tiny random model.

# %%
#| hide
model, tok = load_model("tiny-llama")
ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))


# %% [markdown]
# ## Logits of the scored positions
#
# A stage scores the last `n_scored` positions of each window, where the smallest cache is full. `scored_logits`
# runs the window once under a policy (a mask over the whole sequence), or through an evicting cache, fed a first
# chunk of `first` tokens and then `chunk` tokens at a time. Each chunk asks the model only for the logits of the
# scored positions it holds, so token by token the others cost no memory.

# %% [markdown]
# The check: one forward equals the unpatched model's logits; a cache whose budget holds the whole window evicts
# nothing, so chunk by chunk (any chunking) gives the same logits.

# %%
#| export
@torch.no_grad()
def scored_logits(model: nn.Module, ids: Tensor, n_scored: int, policy: AttentionPolicy | None = None, cache=None,
                  chunk: int | None = None, first: int | None = None) -> Tensor:
    """Float logits [B, n_scored, V] of the last `n_scored` positions of `ids` [B, S] under `policy` (None: the
    unpatched model): one forward, or through `cache` fed a first chunk of `first` tokens (default `chunk`), then
    `chunk` at a time."""
    if not isinstance(ids, Tensor) or ids.dim() != 2: raise TypeError(f"ids must be a 2-d tensor [B, S], got {ids!r}")
    n_scored = check_int(n_scored, "n_scored", 1)
    if n_scored > ids.shape[1]: raise ValueError(f"n_scored must be at most the window, {ids.shape[1]}, got {n_scored}")
    if cache is not None: chunk = check_int(chunk, "chunk", 1)
    ids, start = ids.to(model.device), ids.shape[1] - n_scored
    with nullcontext() if policy is None else patch(model, policy):
        if cache is None: return model(ids, logits_to_keep=n_scored).logits.float()
        parts, bounds = [], [0, *range(first or chunk, ids.shape[1], chunk), ids.shape[1]]
        for a, b in zip(bounds, bounds[1:]):
            pos, keep = torch.arange(a, b, device=ids.device), b - max(a, start)  # keep: scored positions in it
            out = model(ids[:, pos], past_key_values=cache, use_cache=True, position_ids=pos[None],
                        logits_to_keep=max(keep, 1))
            if keep > 0: parts.append(out.logits.float()[:, -keep:])
    return torch.cat(parts, 1)


# %%
full = model(ids).logits.float()
assert_close(scored_logits(model, ids, 20), full[:, -20:])
assert_close(scored_logits(model, ids, 20, DensePolicy()), full[:, -20:], atol=1e-5, rtol=1e-5)
roomy = make("tova", budget=4 + 48 + 1, sink=4, window=48)
for chunk, first in ((1, None), (7, None), (5, 30)):
    assert_close(scored_logits(model, ids, 20, roomy.policy(), roomy.cache(model), chunk, first), full[:, -20:],
                 atol=1e-4, rtol=1e-4)
test_fail(lambda: scored_logits(model, ids, 49), contains="n_scored")
test_fail(lambda: scored_logits(model, ids, 8, roomy.policy(), roomy.cache(model)), contains="chunk")


# %% [markdown]
# ## Recording what each layer attends with
#
# The retention figures read each layer's queries, keys and values of a pass; `Recording` wraps any policy and
# keeps them.

# %%
#| export
class Recording(AttentionPolicy):
    "Attention by `inner`; records each layer's (q, k, v), detached."
    def __init__(self, inner: AttentionPolicy): self.inner, self.qkv = inner, {}

    def __call__(self, q, k, v, ctx):
        self.qkv[ctx.layer_idx] = (q.detach(), k.detach(), v.detach())
        return self.inner(q, k, v, ctx)


# %%
rec = Recording(DensePolicy())
assert_close(scored_logits(model, ids, 48, rec), scored_logits(model, ids, 48, DensePolicy()))
test_eq(sorted(rec.qkv), list(range(model.config.num_hidden_layers)))
test_eq(rec.qkv[0][1].shape, (2, model.config.num_key_value_heads, 48, model.config.head_dim))


# %% [markdown]
# ## The oracle
#
# The ceiling of any scorer of the dense target with a frozen base: KVpop's mask ranked by the dense
# future-attention target itself, decayed as KVpop's priority is (the teacher policy, Eq. 5).

# %% [markdown]
# The check compares it with the mask by definition (`kvpop_mask_reference`, loops) on the same decayed target.

# %%
#| export
class OraclePolicy(AttentionPolicy):
    "KVpop's mask ranked by the dense future-attention target decayed with `log_gamma` (the teacher policy, Eq. 5)."

    def __init__(self, k: int, log_gamma: float, sink: int, window: int):
        self.k, self.log_gamma, self.sink, self.window = k, log_gamma, sink, window

    def attend(self, q, k, v, ctx):
        r = future_attention_target(q, k, self.window, scale=ctx.scale)
        prio = r - ctx.key_positions.float() * self.log_gamma
        rank, cutoff = topk_cutoff(prio, self.k, self.sink, self.window)
        mask = kvpop_mask(rank, cutoff, self.sink, self.window, q.shape[1] // k.shape[1])
        return dense_attention(q, k, v, mask, ctx.scale)


# %%
g = torch.Generator().manual_seed(1)
q, k_, v = (torch.randn(1, h, 24, 8, generator=g) for h in (4, 2, 2))
ctx = SimpleNamespace(scale=8 ** -0.5, key_positions=torch.arange(24))
prio = future_attention_target(q, k_, 3, scale=ctx.scale) - ctx.key_positions.float() * -0.05
ref = dense_attention(q, k_, v, kvpop_mask_reference(prio, 5, 2, 3).repeat_interleave(2, 1), ctx.scale)
assert_close(OraclePolicy(5, -0.05, 2, 3).attend(q, k_, v, ctx), ref)


# %% [markdown]
# ## Students
#
# The paper's decay range, $\gamma \in [0.999, 0.999999]$ per token at 16k tokens, rescaled to a window of `seq_len`
# tokens (the same decay over the same fraction of the sequence); `rescaled_scorers` builds fresh MLP or mLSTM
# scorers with it for every layer.

# %%
#| export
def rescaled_scorers(kind: str, num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int,
                     delay: int = 0) -> KVpopScorers:
    "Fresh MLP or mLSTM (readout delay `delay`) scorers for every layer, decays from Table 3 rescaled to `seq_len`."
    if kind not in ("mlp", "mlstm"): raise ValueError(f"kind must be 'mlp' or 'mlstm', got {kind!r}")
    seq_len = check_int(seq_len, "seq_len", 1)
    scale_w = seq_len / 16384
    decay = dict(gamma_min=0.999 ** (1 / scale_w), gamma_max=0.999999 ** (1 / scale_w))
    args = num_layers, num_kv_heads, head_dim
    sc = KVpopScorers.mlp(*args, **decay) if kind == "mlp" else KVpopScorers.mlstm(*args, delay, **decay)
    for m in sc.scorers:  # the mLSTM's chunkwise form pads S up to its chunk: no longer than the window (same result)
        if hasattr(m, "chunk_size"): m.chunk_size = min(m.chunk_size, seq_len)
    return sc


# %%
sc = rescaled_scorers("mlstm", 2, 2, 16, 64, delay=3)
test_eq(len(sc.scorers), 2)
assert all(m.chunk_size <= 64 for m in sc.scorers)
lg = torch.stack([d() for d in sc.decays])   # per-token log(gamma) inside the rescaled range
assert (lg <= math.log(0.999999) * 256 + 1e-9).all() and (lg >= math.log(0.999) * 256 - 1e-9).all()
test_fail(lambda: rescaled_scorers("gru", 2, 2, 16, 64), contains="kind")


# %% [markdown]
# A full-mode student trains a copy of the base model; `full_params` (a regex of parameter names) restricts which of
# its parameters train.

# %%
#| export
def trainable_copy(model: nn.Module, full_params: str | None = None) -> nn.Module:
    "A copy of `model` whose parameters matching the regex `full_params` (all when None) require grad, the rest not."
    if full_params is not None and not isinstance(full_params, str):
        raise TypeError(f"full_params must be a regex string or None, got {full_params!r}")
    net = copy.deepcopy(model)
    for name, p in net.named_parameters():
        p.requires_grad_(full_params is None or re.search(full_params, name) is not None)
    return net


# %%
net = trainable_copy(model, r"^model\.norm\.")
test_eq([n for n, p in net.named_parameters() if p.requires_grad], ["model.norm.weight"])
assert all(p.requires_grad for p in trainable_copy(model).parameters())
assert net.model.norm.weight is not model.model.norm.weight
test_fail(lambda: trainable_copy(model, 3), contains="full_params")


# %% [markdown]
# The dense-target student of `kvpop_train`: its decay learned from the middle of the range (in $\log\gamma$), or
# fixed at a per-token `log_gamma`.

# %%
#| export
def dense_target_student(model: nn.Module, sink: int, window: int, k: int, scorer: str,
                         log_gamma_range: tuple[float, float], log_gamma: float | None = None, n_boundaries: int = 64,
                         seed: int = 0) -> KVpopStudent:
    """A fresh dense-target student with per-token log(gamma) in `log_gamma_range`; `log_gamma`: a fixed decay, None:
    learned from the midpoint."""
    lg_min, lg_max = log_gamma_range
    if log_gamma is not None and not min(lg_min, lg_max) <= log_gamma <= max(lg_min, lg_max):
        raise ValueError(f"log_gamma must lie in log_gamma_range {log_gamma_range}, got {log_gamma}")
    torch.manual_seed(seed)
    st = KVpopStudent.for_model(model, sink, window, k, scorer=scorer, gamma_min=math.exp(lg_min),
                                gamma_max=math.exp(lg_max), n_boundaries=n_boundaries, target="dense", seed=seed)
    if log_gamma is not None:
        frac = torch.tensor((log_gamma - lg_min) / (lg_max - lg_min))
        for d in st.scorers.decays:
            d.alpha.data.fill_(float(torch.logit(frac)))
            d.alpha.requires_grad_(False)
    return st


# %%
rng = (math.log(0.999) * 8, math.log(0.999999) * 8)
fixed = dense_target_student(model, 2, 4, 6, "mlp", rng, log_gamma=-0.003)
assert_close(torch.stack([d() for d in fixed.scorers.decays]), torch.full((2, 2), -0.003), atol=1e-6, rtol=1e-5)
assert not any(d.alpha.requires_grad for d in fixed.scorers.decays)
learned = dense_target_student(model, 2, 4, 6, "mlp", rng)
assert all(d.alpha.requires_grad for d in learned.scorers.decays)
test_fail(lambda: dense_target_student(model, 2, 4, 6, "mlp", rng, log_gamma=-1.0), contains="log_gamma")


# %% [markdown]
# The decay a student ends with, in one number:

# %%
#| export
def mean_log_gamma(student: KVpopStudent) -> float:
    "The student's per-token log(gamma), averaged over its layers and heads."
    return float(torch.stack([d() for d in student.scorers.decays]).mean())


# %%
assert_close(mean_log_gamma(fixed), -0.003, atol=1e-6, rtol=1e-5)
assert_close(mean_log_gamma(learned), sum(rng) / 2, atol=1e-6, rtol=1e-5)   # alpha = 0: the midpoint in log(gamma)


# %% [markdown]
# ## Shipping a trained student
#
# `kvpop_train` can ship its final students into `sparsekv/checkpoints/<name>/`: the weights with the student's
# spec, the training history and a manifest (settings, commit). A manifest records the settings a student was
# trained with, so a rerun reuses a shipped student whose settings match its own.

# %%
#| export
def git_commit() -> str:
    "The repository's HEAD commit, or 'unknown' outside a git checkout."
    try: return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError): return "unknown"


# %%
head = git_commit()
assert head == "unknown" or re.fullmatch(r"[0-9a-f]{40}", head)


# %%
#| export
def ship_student(folder: str | Path, method: str, student: KVpopStudent, history: pd.DataFrame,
                 manifest: dict) -> Path:
    "Write `student`'s weights and spec, its `history` (6 decimals) and `manifest` (with file digests) into `folder`."
    if not isinstance(manifest, dict): raise TypeError(f"manifest must be a dict, got {type(manifest).__name__}")
    folder = Path(folder)
    weights = dict(student=student.state_dict(), spec=dict(method=method, student=student_spec(student)))
    with atomic_path(folder / "trained.pt") as tmp: torch.save(weights, tmp)
    write_csv(folder / "history.csv", history.round(6))  # the learning curve, shipped beside the weights
    return write_shipped_manifest(folder, manifest)


# %%
with tempfile.TemporaryDirectory() as d:
    ship_student(Path(d) / "s", "kvpop_mlp", fixed, pd.DataFrame({"step": [1], "loss": [0.1234567]}), {"steps": 3})
    shipped = json.loads((Path(d) / "s" / "manifest.json").read_text())
    test_eq(shipped["steps"], 3)
    test_eq(pd.read_csv(Path(d) / "s" / "history.csv").loss[0], 0.123457)
    saved = torch.load(Path(d) / "s" / "trained.pt", weights_only=False)
    test_eq(saved["spec"]["method"], "kvpop_mlp")
    assert_close(saved["student"], fixed.state_dict())
test_fail(lambda: ship_student("x", "kvpop_mlp", fixed, pd.DataFrame(), None), contains="manifest")


# %%
#| export
def manifest_matches(manifest: dict, settings: dict) -> bool:
    "Whether `manifest` records every entry of `settings` with the same value."
    return all(manifest.get(key) == value for key, value in settings.items())


# %%
assert manifest_matches({"a": 1, "b": [2], "c": 3}, {"a": 1, "b": [2]})
assert not manifest_matches({"a": 1}, {"a": 1, "b": 2})


# %% [markdown]
# ## Retention
#
# A KVpop student's priorities on its own (sparse) forward pass over a window: `own_pass_priorities` records each
# layer's keys and values under the student's policy and scores them, the layers stacked in the batch dimension.

# %% [markdown]
# The check: the first layer's keys and values do not depend on what attention kept, so its priorities equal the
# scorers' on a dense pass.

# %%
#| export
def own_pass_priorities(net: nn.Module, student: KVpopStudent, ids: Tensor, n_scored: int) -> tuple[Tensor, dict]:
    """Priorities [L, Hkv, S] of `student`'s scorers on its own forward over the window `ids` [1, S] on `net`, and that
    pass's recorded (q, k, v) per layer."""
    if ids.dim() != 2 or ids.shape[0] != 1: raise ValueError(f"ids must be one window [1, S], got {tuple(ids.shape)}")
    rec = Recording(student.policy())
    scored_logits(net, ids, n_scored, rec)
    S, H = ids.shape[1], rec.qkv[0][1].shape[1]
    pos = torch.arange(S, device=ids.device).expand(1, H, S)
    with torch.no_grad():
        prio = torch.cat([student.scorers.priority(l, rec.qkv[l][1], rec.qkv[l][2], pos) for l in range(len(rec.qkv))])
    return prio, rec.qkv


# %%
st = KVpopStudent.for_model(model, 2, 4, 6, scorer="mlp")
own, own_qkv = own_pass_priorities(model, st, ids[:1], 10)
test_eq(own.shape, (model.config.num_hidden_layers, model.config.num_key_value_heads, 48))
dense_rec = Recording(DensePolicy())
scored_logits(model, ids[:1], 10, dense_rec)
with torch.no_grad():
    assert_close(own[:1], st.scorers.priority(0, *dense_rec.qkv[0][1:], torch.arange(48).expand(1, 2, 48)))
test_fail(lambda: own_pass_priorities(model, st, ids, 10), contains="one window")


# %% [markdown]
# ### At the final query
#
# Which of the last `n_tokens` evictable tokens ($s \le t \le S - 1 - w$) each layer's KV heads keep at the final
# query (Fig. 6 / Fig. 9), from priorities whose batch dimension holds the layers.

# %% [markdown]
# The check, by definition: at the final query each head keeps the $k$ best eligible priorities (ties: earlier first).

# %%
#| export
def final_query_retention(priority: Tensor, sink: int, window: int, k: int, n_tokens: int):
    """(heads keeping each token [L, hi - lo], lo, hi): per layer (the batch dim of `priority` [L, H, S]), how many
    heads keep each of the last `n_tokens` evictable tokens lo <= t < hi at the final query."""
    if priority.dim() != 3: raise ValueError(f"priority must be [L, H, S], got shape {tuple(priority.shape)}")
    S = priority.shape[-1]
    kept = kept_long_range(priority, [S - 1], sink, window, k)  # [L, Hkv, 1, S]
    hi = S - window            # evictable at the final query S - 1: sink <= t <= S - 1 - w
    lo = max(sink, hi - check_int(n_tokens, "n_tokens", 1))
    return kept[:, :, 0, lo:hi].sum(1).cpu().numpy(), lo, hi


# %%
prio = torch.randn(3, 2, 40, generator=torch.Generator().manual_seed(2))
counts, lo, hi = final_query_retention(prio, 2, 5, 6, 10)
test_eq((lo, hi), (25, 35))
best = [[set(sorted(range(2, 35), key=lambda t: (-prio[l, h, t].item(), t))[:6]) for h in range(2)] for l in range(3)]
test_eq(counts, np.array([[sum(t in best[l][h] for h in range(2)) for t in range(lo, hi)] for l in range(3)]))
test_fail(lambda: final_query_retention(prio[0], 2, 5, 6, 10), contains="priority")


# %% [markdown]
# Retention recall of one held-out window's cached activations (`sparsekv.kvpop.offline`): for each method, the
# fraction of the teacher's top-$k$ that its priority keeps at `queries` positions from the first full cache to the
# end, averaged over layers and heads, against the **undecayed** target and (for a student) the target **decayed**
# by its own $\gamma$. A method without a student is StreamingLLM: the most recent tokens.

# %% [markdown]
# The check: a target that increases with the position makes the teacher's top-$k$ the most recent tokens:
# StreamingLLM's choice, recall 1.

# %%
#| export
@torch.no_grad()
def activation_recall(batch: dict, students: dict, sink: int, window: int, k: int, queries: int) -> list[dict]:
    """Rows (method, teacher, recall) of one window's cached activations `batch` ('keys', 'values', 'target'): mean
    retention recall over layers and heads for each method of `students` (None: StreamingLLM)."""
    keys, values, r_tgt = (batch[n].float() for n in ("keys", "values", "target"))
    L, H, S = keys.shape[1:4]
    pos = torch.arange(S).expand(1, H, S)
    q = torch.linspace(sink + window + k, S - 1, check_int(queries, "queries", 1)).round().long().unique()
    rows = []
    for method, st in students.items():
        for teacher in ("undecayed",) if st is None else ("undecayed", "decayed"):
            recall = []
            for l in range(L):
                target = r_tgt[:, l] if teacher == "undecayed" else st.scorers.decayed(l, r_tgt[:, l], pos)
                pred = pos.float() if st is None else st.scorers.priority(l, keys[:, l], values[:, l], pos)
                recall.append(retention_recall(pred, target, q, sink, window, k).mean())
            rows.append(dict(method=method, teacher=teacher, recall=float(torch.stack(recall).mean())))
    return rows


# %%
S_ = 32
batch = dict(keys=torch.randn(1, 2, 2, S_, 16), values=torch.randn(1, 2, 2, S_, 16),
             target=torch.arange(S_, dtype=torch.float32).expand(1, 2, 2, S_).clone())
rows = activation_recall(batch, {"streaming_llm": None, "kvpop_mlp": fixed}, 2, 4, 6, 8)
test_eq([(r["method"], r["teacher"]) for r in rows],
        [("streaming_llm", "undecayed"), ("kvpop_mlp", "undecayed"), ("kvpop_mlp", "decayed")])
test_eq(rows[0]["recall"], 1.0)
assert all(0 <= r["recall"] <= 1 for r in rows)


# %% [markdown]
# ## Verdicts
#
# A paired difference decides a comparison only where its 95% interval excludes 0 over at least `min_items` windows
# (below that the percentile interval undercovers, see [the statistics](41_stats.ipynb)). `interval_verdict` words
# one interval from `paired_ci`.

# %%
#| export
def interval_verdict(ci: tuple[float, float, float] | None, n: int, min_items: int,
                     higher_is_better: bool = True) -> str:
    """'ahead', 'behind' or 'undecided' by whether the interval `ci` (difference, lo, hi) excludes 0 (undecided below
    `min_items` items), with the difference and interval; None: one window, no interval."""
    if ci is None: return "one window: no interval"
    d, lo, hi = ci
    better, worse = (lo > 0, hi < 0) if higher_is_better else (hi < 0, lo > 0)
    word = ("undecided (too few windows)" if n < min_items else
            "ahead" if better else "behind" if worse else "undecided")
    return f"{word}, {d:+.4f} [{lo:+.4f}, {hi:+.4f}]"


# %%
x = np.linspace(0, 1, 20)
ci = paired_ci(x + 0.5, x)
test_eq(interval_verdict(ci, 20, 16), f"ahead, +0.5000 [{ci[1]:+.4f}, {ci[2]:+.4f}]")
assert interval_verdict(ci, 20, 16, higher_is_better=False).startswith("behind")
assert interval_verdict(ci, 8, 16).startswith("undecided (too few windows)")
assert interval_verdict(paired_ci(x, x[::-1]), 20, 16).startswith("undecided,")
test_eq(interval_verdict(None, 1, 16), "one window: no interval")


# %% [markdown]
# `versus_baseline` compares every method of a long results table with one baseline (`compare` with that baseline
# alone) and words each difference: "ahead" or "behind" only where the interval excludes 0, otherwise "tied", and
# "undecided" below `compare`'s `min_items`.

# %%
#| export
def versus_baseline(results: pd.DataFrame, baseline: str, metric: str, budget: str = "compression") -> pd.DataFrame:
    """`compare`'s rows of `results` with `baseline` as the only baseline, the metric named, `better` (the difference's
    sign; `agreement` is higher-better, others lower-better) and the `verdict` in words."""
    cmp = compare(results, metric, budget=budget, baselines=[baseline], higher_is_better=metric == "agreement")
    min_items = cmp.attrs["min_items"]
    cmp = cmp[cmp.baseline == baseline].assign(metric=metric)
    cmp["better"] = (cmp.diff_base > 0) == (metric == "agreement")

    def verdict(r) -> str:
        word = ("ahead" if r.better else "behind") if r.base_sig else "tied"
        if r.n < min_items: word = "undecided (too few windows)"
        return f"{word}, {r.diff_base:+.4f} [{r.base_lo:+.4f}, {r.base_hi:+.4f}]"
    return cmp.assign(verdict=[verdict(r) for r in cmp.itertuples()])


# %%
res = pd.DataFrame([dict(item=i, method=m, compression=0.5, agreement=v, kl=1 - v)
                    for i in range(20) for m, v in (("dense", 1.0), ("good", 0.9 + i / 1000), ("bad", 0.5 + i / 200))])
vs = versus_baseline(res, "bad", "agreement")
test_eq(list(vs.method), ["good"])
gap = (res[res.method == "good"].agreement.to_numpy() - res[res.method == "bad"].agreement.to_numpy()).mean()
assert vs.verdict.iloc[0].startswith(f"ahead, {gap:+.4f} [")
assert versus_baseline(res, "bad", "kl").verdict.iloc[0].startswith(f"ahead, {-gap:+.4f} [")
assert versus_baseline(res[res.item < 8], "bad", "agreement").verdict.iloc[0].startswith("undecided (too few")
assert versus_baseline(res, "good", "agreement").verdict.iloc[0].startswith("behind")


# %%
#| export
def ahead_status(rows: pd.DataFrame, min_items: int) -> str:
    "Whether every pair of `versus_baseline` rows is ahead: yes, no, or undecided where a pair has too few windows."
    if (rows.n < min_items).any(): return "undecided (too few windows)"
    return "yes" if (rows.base_sig & rows.better).all() else "no"


# %%
both = pd.concat([versus_baseline(res, "bad", "agreement"), versus_baseline(res, "good", "agreement")])
test_eq(ahead_status(both.iloc[:1], 16), "yes")
test_eq(ahead_status(both, 16), "no")
test_eq(ahead_status(both, 32), "undecided (too few windows)")


# %%
#| export
def pair_summary(rows: pd.DataFrame, min_items: int) -> str:
    "How many `versus_baseline` rows are ahead, how many too few windows decide, and each decided pair not ahead."
    won, few = rows.base_sig & rows.better, rows.n < min_items
    text = f"{int(won.sum())} of {len(rows)} pairs ahead" + (f", {int(few.sum())} undecided (too few windows)"
                                                              if few.any() else "")
    return text + "".join(f"; {r.method} vs {r.baseline}, {r.metric}, CR {r.budget:.1%}: {r.verdict}"
                          for r in rows[~won & ~few].itertuples())


# %%
test_eq(pair_summary(both, 16), f"1 of 2 pairs ahead; bad vs good, agreement, CR 50.0%: {both.verdict.iloc[1]}")
test_eq(pair_summary(both, 32), "1 of 2 pairs ahead, 2 undecided (too few windows)")


# %% [markdown]
# Retention recall per layer and head of a pass whose queries, keys and values were recorded (`Recording`): the
# teacher's top-$k$ of the undecayed future-attention target (Eq. 8), or of that target decayed by a student's own
# $\gamma$ (`decayed`, the student's `scorers.decayed`), against the priorities `pred` [L, H, S].

# %% [markdown]
# The check: ranking by the target itself recalls all of its top-$k$; ranking by recency recalls what
# `retention_recall` says.

# %%
#| export
def head_recall(qkv: dict, scalings: list[float], pred: Tensor, sink: int, window: int, k: int, queries: int,
                decayed=None) -> np.ndarray:
    """Retention recall [L, Hkv] of priorities `pred` [L, Hkv, S] against the top-k of the future-attention target of
    each layer's recorded (q, k, v) in `qkv`, at `queries` positions from the first full cache; with `decayed`,
    `decayed(l, target, pos)` decays the target first."""
    S = pred.shape[-1]
    pos = torch.arange(S, device=pred.device).expand(1, pred.shape[1], S)
    qpos = torch.linspace(sink + window + k, S - 1, check_int(queries, "queries", 1)).round().long().unique()
    out = []
    for l in range(pred.shape[0]):
        q, key, _ = qkv[l]
        target = future_attention_target(q, key, window, scale=scalings[l])
        if decayed is not None: target = decayed(l, target, pos)
        out.append(retention_recall(pred[l:l + 1], target, qpos, sink, window, k).mean(-1)[0])
    return torch.stack(out).cpu().numpy()


# %%
qkv = {l: rec.qkv[l] for l in rec.qkv}   # the tiny model's recorded pass above, window row 0
qkv = {l: tuple(t[:1] for t in v) for l, v in qkv.items()}
scal = [model.model.layers[l].self_attn.scaling for l in qkv]
own_t = torch.cat([future_attention_target(q, key, 4, scale=scal[l]) for l, (q, key, _) in qkv.items()])
test_eq(head_recall(qkv, scal, own_t, 2, 4, 6, 8), np.ones((2, 2), dtype=np.float32))
recent = torch.arange(48.).expand(2, 2, 48)
qp = torch.linspace(12, 47, 8).round().long().unique()
ref = np.stack([retention_recall(recent[l:l + 1], own_t[l:l + 1], qp, 2, 4, 6).mean(-1)[0].numpy() for l in range(2)])
test_eq(head_recall(qkv, scal, recent, 2, 4, 6, 8), ref)


# %% [markdown]
# ## Figures
#
# The figures of `kvpop_distill`, each from its data (returned beside the figure where the function assembles it).
# The retention heatmaps (Fig. 6 / Fig. 9): one panel per (title, head counts [L, n], token labels), coloured by the
# number of KV heads keeping each token.

# %%
#| export
def retention_heatmaps(panels: list[tuple[str, np.ndarray, list[str]]], n_heads: int, n_tokens: int):
    "Figure of one heatmap per panel (title, heads keeping each token [L, n], token labels), one colour per count."
    if not panels: raise ValueError("panels must hold at least one (title, counts, labels)")
    cmap = plt.get_cmap("viridis", n_heads + 1)   # one colour per count 0..H
    norm = BoundaryNorm(np.arange(n_heads + 2) - 0.5, cmap.N)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(12, 0.16 * n_tokens + 2), 3.2 * len(panels)),
                             squeeze=False, layout="constrained")
    for ax, (title, counts, labels) in zip(axes[:, 0], panels):
        im = ax.imshow(counts, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.grid(False)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set(ylabel="layer", title=title)
    fig.colorbar(im, ax=axes[:, 0], ticks=range(n_heads + 1), label=f"KV heads keeping the token (of {n_heads})",
                 shrink=0.8)
    return fig


# %%
fig = retention_heatmaps([("a", counts, list("abcdefghij")), ("b", counts, list("abcdefghij"))], 2, 10)
test_eq(len(fig.axes), 3)   # two panels and the colour bar
test_eq(fig.axes[0].images[0].get_array().tolist(), counts.tolist())
plt.close(fig)
test_fail(lambda: retention_heatmaps([], 2, 10), contains="panels")


# %% [markdown]
# Retention recall per layer (Fig. 7): one row of panels per compression, boxes over KV heads (and windows) for each
# method side by side.

# %%
#| export
def recall_boxes(recall: pd.DataFrame, methods: list[str], ks: dict, n_layers: int):
    "Figure of boxes of `recall` (columns method, compression, layer, recall) per layer, one panel per compression."
    compressions = list(ks)
    fig, axes = plt.subplots(len(compressions), 1, figsize=(13, 3.5 * len(compressions)), squeeze=False,
                             sharex=True, layout="constrained")
    for ax, cr in zip(axes[:, 0], compressions):
        for j, m in enumerate(methods):
            r = recall[(recall.method == m) & (recall.compression == cr)]
            ax.boxplot([r[r.layer == l].recall for l in range(n_layers)],
                       positions=np.arange(n_layers) + (j - 1) * 0.27,
                       widths=0.25, patch_artist=True, boxprops=dict(facecolor=f"C{j}", alpha=0.6),
                       medianprops=dict(color="k"), showfliers=False, manage_ticks=False)
        means = recall[recall.compression == cr].groupby("method").recall.mean()
        ax.set(ylabel="top-k retention recall", ylim=(0, 1),
               title=f"CR {cr:.0%}, k = {ks[cr]}; mean " + ", ".join(f"{m} {means[m]:.2f}" for m in methods))
    axes[-1, 0].set(xlabel="layer", xticks=range(n_layers))
    fig.legend([plt.Rectangle((0, 0), 1, 1, facecolor=f"C{j}", alpha=0.6) for j in range(len(methods))], methods,
               loc="outside right")
    return fig


# %%
rr = pd.DataFrame([dict(method=m, compression=cr, layer=l, head=h, recall=(l + h) / 4)
                   for m in ("a", "b") for cr in (0.5, 0.75) for l in range(3) for h in range(2)])
fig = recall_boxes(rr, ["a", "b"], {0.5: 6, 0.75: 3}, 3)
test_eq(len(fig.axes), 2)
assert fig.axes[0].get_title().endswith(f"a {rr.recall.mean():.2f}, b {rr.recall.mean():.2f}")
plt.close(fig)


# %% [markdown]
# DMS's eviction ratio per layer and KV head (Fig. 8), as a map and sorted against KVpop's one ratio for every head.

# %%
#| export
def dms_eviction_figure(ratios: np.ndarray, kvpop_ratio: float):
    "Figure of DMS's eviction `ratios` [L, Hkv] as a map and sorted, against KVpop's fixed `kvpop_ratio`."
    if np.ndim(ratios) != 2: raise ValueError(f"ratios must be [layers, KV heads], got shape {np.shape(ratios)}")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 6), layout="constrained", width_ratios=(1, 2))
    im = a1.imshow(ratios, aspect="auto", cmap="magma", vmin=0, vmax=1, interpolation="nearest")
    a1.grid(False)
    a1.set(title=f"DMS per layer and KV head (mean {ratios.mean():.2f})", xlabel="KV head", ylabel="layer",
           xticks=range(ratios.shape[1]))
    fig.colorbar(im, ax=a1, location="left", label="eviction ratio (0 dense, 1 window only)")
    order = np.sort(ratios.ravel())
    a2.step(np.arange(1, order.size + 1), order, where="mid", label="DMS, heads sorted")
    a2.axhline(kvpop_ratio, color="C1", ls="--", label=f"KVpop, every head ({kvpop_ratio:.2f})")
    a2.set(xlabel="KV heads of all layers, sorted", ylabel="eviction ratio", ylim=(-0.03, 1.03),
           title="the same heads sorted, against KVpop's fixed ratio")
    fig.legend(loc="outside lower center", ncols=2)
    return fig


# %%
rat = np.array([[0.9, 0.1], [0.5, 0.3]])
fig = dms_eviction_figure(rat, 0.6)
test_eq(fig.axes[1].lines[0].get_ydata().tolist(), [0.1, 0.3, 0.5, 0.9])
test_eq(fig.axes[0].get_title(), "DMS per layer and KV head (mean 0.45)")
plt.close(fig)
test_fail(lambda: dms_eviction_figure(rat.ravel(), 0.6), contains="ratios")


# %% [markdown]
# Held-out agreement over training steps (Fig. 5): one line per method, a band of one binomial standard error over the
# `n_scored` positions of the window.

# %%
#| export
def readout_figure(curves: pd.DataFrame, labels: dict, n_scored: int):
    "Figure of `curves` (method, step, agreement) per method of `labels` (method -> label), with a ±1 s.e. band."
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    for m, label in labels.items():
        c = curves[curves.method == m]
        se = np.sqrt(c.agreement * (1 - c.agreement) / n_scored)  # binomial, over the scored positions
        ax.plot(c.step, c.agreement, marker="o", label=label)
        ax.fill_between(c.step, c.agreement - se, c.agreement + se, alpha=0.2, color=ax.lines[-1].get_color())
    ax.set(xlabel="training step", ylabel="held-out token accuracy vs teacher")
    fig.legend(loc="outside right")
    return fig


# %%
cv = pd.DataFrame(dict(method=["a", "a", "b", "b"], step=[1, 2, 1, 2], agreement=[0.5, 0.9, 0.6, 0.7]))
fig = readout_figure(cv, {"a": "first", "b": "second"}, 100)
test_eq([line.get_label() for line in fig.axes[0].lines], ["first", "second"])
test_eq(fig.axes[0].lines[1].get_ydata().tolist(), [0.6, 0.7])
plt.close(fig)


# %% [markdown]
# `kvpop_train`'s training curves: the retention loss of each (scorer, compression), as a running mean over `smooth`
# steps.

# %%
#| export
def loss_figure(history: pd.DataFrame, smooth: int):
    "Figure of the running mean over `smooth` steps of the retention loss of each scorer and compression in `history`."
    smooth = check_int(smooth, "smooth", 1)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (sc, cr), h in history[history.kind == "train"].groupby(["scorer", "compression"]):
        ax.plot(h.step, h.retention_loss.rolling(smooth, min_periods=1).mean(), label=f"{sc}, CR {cr:.1%}")
    ax.set(xlabel="step", ylabel="retention loss (running mean)", title="KVpop scorers from cached activations")
    ax.legend()
    return fig


# %%
hist = pd.DataFrame(dict(kind=["train"] * 3 + ["eval"], step=[1, 2, 3, 3], retention_loss=[3.0, 1.0, 2.0, 9.0],
                         scorer="mlp", compression=0.75))
fig = loss_figure(hist, 2)
test_eq(fig.axes[0].lines[0].get_ydata().tolist(), [3.0, 2.0, 1.5])
plt.close(fig)
test_fail(lambda: loss_figure(hist, 0), contains="smooth")


# %% [markdown]
# The held-out comparison: each metric's `compare` table as means with 95% error bars, one panel per metric, one
# series per compression.

# %%
#| export
def compare_figure(tables: dict, compressions: list, n_windows: int):
    "Figure of each metric's `compare` table in `tables` (metric -> table): mean and 95% error bars of every method."
    fig, axes = plt.subplots(1, len(tables), figsize=(5 * len(tables), 3.8), squeeze=False)
    for ax, (metric, cmp) in zip(axes[0], tables.items()):
        for cr in compressions:
            rows = cmp[(cmp.budget == cr) & (cmp.method != "dense")]
            ax.errorbar(range(len(rows)), rows["mean"], yerr=1.96 * rows["se"], fmt="o", label=f"CR {cr:.1%}",
                        capsize=3, alpha=0.9)
            ax.set_xticks(range(len(rows)), rows.method, rotation=35, ha="right")
        ax.set(ylabel=metric, title=f"{metric} vs the dense model ({n_windows} held-out windows)")
        ax.legend()
    return fig


# %%
tab = compare(res, "agreement", budget="compression")
fig = compare_figure({"agreement": tab, "kl": compare(res, "kl", budget="compression", higher_is_better=False)},
                     [0.5], 20)
test_eq(len(fig.axes), 2)
test_eq(fig.axes[0].get_ylabel(), "agreement")
test_eq([t.get_text() for t in fig.axes[0].get_xticklabels()], ["good", "bad"])
plt.close(fig)


# %% [markdown]
# ## Grids in batches
#
# A grid cell is one window, but some methods run several windows per forward. `batched_cell` turns a function of
# the batch starting at window `a` into a grid cell function: the batch is computed once, for its first window, and
# kept until another batch is asked for.

# %%
#| export
def batched_cell(batch_fn, batch_size: int, key=lambda c: ()):
    """A grid cell function of `c['item']` from `batch_fn(c, a)`, the rows of the batch of `batch_size` windows starting
    at a; one batch (per `key(c)`) is kept at a time."""
    batch_size = check_int(batch_size, "batch_size", 1)
    memo = {}

    def cell(c: dict) -> dict:
        i = c["item"]
        a = i - i % batch_size
        if (key(c), a) not in memo:
            memo.clear()
            memo[(key(c), a)] = batch_fn(c, a)
        return memo[(key(c), a)][i - a]
    return cell


# %%
calls = []
cell = batched_cell(lambda c, a: calls.append(a) or [dict(item=j) for j in range(a, a + 3)], 3, key=lambda c: c["m"])
test_eq([cell(dict(item=i, m="x"))["item"] for i in range(7)], list(range(7)))
test_eq(calls, [0, 3, 6])
cell(dict(item=7, m="y"))
test_eq(calls, [0, 3, 6, 6])
test_fail(lambda: batched_cell(lambda c, a: [], 0), contains="batch_size")
