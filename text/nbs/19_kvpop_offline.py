# %% [markdown]
# # KVpop: training the scorers from cached activations
#
# > Scorer-only KVpop training without running the model: each window's keys, values and dense target computed once.

# %%
#| default_exp kvpop.offline

# %%
#| export
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from sparsekv.distill import DistillConfig, distill, epoch_batches, model_spec, spec_differences
from sparsekv.hf import AttentionPolicy, dense_attention, patch
from sparsekv.io import atomic_path, write_json
from sparsekv.kvpop.student import KVpopStudent
from sparsekv.kvpop.target import future_attention_target

# %%
#| hide
import copy
import tempfile
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.kvpop.cache import random_scorers
from sparsekv.models import load_model

torch.set_num_threads(1)  # tiny tensors: threads only add overhead


# %% [markdown]
# ## What a scorer-only step reads
#
# When only the scorers train (the base frozen, `mode="scorer_only"`), one KVpop step (Alg. 1) runs the whole
# model to obtain, per layer $\ell$, two things: the scorer inputs $x_{h,t} = [k_{h,t}; v_{h,t}]$ (post-RoPE,
# detached) and the target $r^{\mathrm{tgt}}_{h,t}$ (Eq. 3). With the **dense** target (`KVpopStudent(...,
# target="dense")`, Eq. 2 with the dense LSE, the teacher's own pass; see
# [the student](17_kvpop_student.ipynb)) neither depends on the scorers: both are fixed functions of the window.
# The decay does depend on trainable parameters, but it enters only at loss time,
# $p^{\mathrm{tgt}}_{h,t} = r^{\mathrm{tgt}}_{h,t} - \lfloor t/n\rfloor \log\gamma_h$ (Eq. 5), so we store the
# *undecayed* $r^{\mathrm{tgt}}$ and decay it with the current $\gamma$ at every step.
#
# So the model runs once per training window; afterwards a step costs the scorers' forward and backward and the
# boundary loss (Eq. 7), independent of the model's size. The paper's Alg. 1 uses the sparse LSE of the student's
# own pass instead (Eq. 9), which changes with the scorers and cannot be cached; the paper reports the two targets
# match downstream, and the stage [`kvpop_train`](../reproduce/13_kvpop_train.ipynb) measures what the choice does
# here.
#
# Per window of $S$ tokens the cache holds $L \cdot H_{kv} \cdot S \cdot d$ keys and as many values (float16 by
# default; the scorers compute in float32) and $L \cdot H_{kv} \cdot S$ float32 targets: for SmolLM2 (30 layers,
# 3 KV heads, $d = 64$) at $S = 2048$, 47 MB + 0.7 MB.

# %% [markdown]
# ### Capturing one window
#
# `ActivationCapture` is an attention policy that attends densely (the unpatched model's output) and records,
# per layer, the keys, the values and the dense target; `window_activations` runs it on a batch of windows.

# %%
#| export
class ActivationCapture(AttentionPolicy):
    "Dense attention that records per layer the post-RoPE keys and values (in `dtype`) and the dense target (Eq. 2-3)."

    def __init__(self, window: int, agg: str = "max", eps: float = 1e-6, dtype: torch.dtype = torch.float16):
        self.window, self.agg, self.eps, self.dtype = window, agg, eps, dtype
        self.keys, self.values, self.targets = [], [], []

    def attend(self, q, k, v, ctx):
        if ctx.past_len or ctx.mask is not None:
            raise ValueError("activations are captured on whole unpadded windows: call the model without a cache "
                             "or mask")
        self.keys.append(k.detach().to(self.dtype).cpu())
        self.values.append(v.detach().to(self.dtype).cpu())
        self.targets.append(future_attention_target(q, k, self.window, agg=self.agg, eps=self.eps,
                                                    scale=ctx.scale).cpu())
        return dense_attention(q, k, v, None, ctx.scale)


# %%
_cap = ActivationCapture(2)
_q, _k, _v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
_ctx = SimpleNamespace(past_len=0, mask=None, scale=0.5)
assert_close(_cap.attend(_q, _k, _v, _ctx), dense_attention(_q, _k, _v, None, 0.5))  # the model's own output
test_eq((_cap.keys[0], _cap.values[0]), (_k.half(), _v.half()))                    # float16 by default
assert_close(_cap.targets[0], future_attention_target(_q, _k, 2, scale=0.5))
test_fail(lambda: _cap.attend(_q, _k, _v, SimpleNamespace(past_len=3, mask=None, scale=0.5)),
          contains="captured on whole unpadded windows")


# %% [markdown]
# The captured tensors must be what the student's dense-target step sees in every layer: the keys and values its
# scorers read and the target it decays. We run both on a tiny model and compare layer by layer.

# %%
#| export
def window_activations(model, ids: Tensor, window: int, agg: str = "max", eps: float = 1e-6,
                       dtype: torch.dtype = torch.float16) -> dict[str, Tensor]:
    """One dense forward of windows `ids` [B, S]: 'keys', 'values' [B, L, Hkv, S, d] in `dtype` and the undecayed
    dense 'target' [B, L, Hkv, S] float32, on the CPU."""
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError(f"ids must be a [B, S] tensor of token ids, got {getattr(ids, 'shape', type(ids).__name__)}")
    cap = ActivationCapture(window, agg, eps, dtype)
    with torch.no_grad(), patch(model, cap):
        model(input_ids=ids.to(next(model.parameters()).device), logits_to_keep=1)
    return dict(keys=torch.stack(cap.keys, 1), values=torch.stack(cap.values, 1), target=torch.stack(cap.targets, 1))


# %%
model, tok = load_model("tiny-llama", num_layers=2)
ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
acts = window_activations(model, ids, window=4, dtype=torch.float32)
test_eq(acts["keys"].shape, (2, 2, model.config.num_key_value_heads, 40, 16))
test_eq(acts["target"].shape, (2, 2, model.config.num_key_value_heads, 40))
student = KVpopStudent(random_scorers(model, seed=1), sink=2, window=4, k=6, n_boundaries=16, target="dense").train()
with patch(model, student.policy()): model(ids, logits_to_keep=1)
pos = torch.arange(40).expand(2, model.config.num_key_value_heads, 40)
for layer, (pred, target) in enumerate(student.captured):
    assert_close(pred, student.scorers.priority(layer, acts["keys"][:, layer], acts["values"][:, layer], pos))
    assert_close(target, student.scorers.decayed(layer, acts["target"][:, layer], pos))
student.captured.clear()


# %% [markdown]
# ### The store
#
# `cache_activations` writes one file per window into a folder, atomically, beside a `manifest.json` naming what the
# activations depend on: the model (its class, config and a checksum of its weights), $S$, $w$, the aggregation,
# $\varepsilon$ and the storage dtype. A rerun skips the windows already written (an interrupted run loses at most
# one window); a folder made for another model or setting is refused with the fields that differ.
# `ActivationStore.batches` gives the batches of `distill`'s `mode="cached"` in the order of `epoch_batches`,
# read lazily, so a resumed training reads no skipped batch.

# %%
#| export
def weights_checksum(model) -> str:
    "SHA-1 of the model's parameters and buffers (names, dtypes, bytes): which weights produced the activations."
    h = hashlib.sha1()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# %%
_lin = torch.nn.Linear(3, 2)
_sum = weights_checksum(_lin)
test_eq((len(_sum), weights_checksum(copy.deepcopy(_lin))), (40, _sum))  # a SHA-1; the same weights, the same sum
with torch.no_grad(): _lin.weight[0, 0] += 1e-3
assert weights_checksum(_lin) != _sum
assert weights_checksum(_lin.double()) != weights_checksum(_lin.float())  # the dtype is part of it


# %%
#| export
def store_manifest(model, seq_len: int, window: int, agg: str, eps: float, dtype: torch.dtype) -> dict:
    "What a folder of cached activations depends on."
    manifest = dict(version=1, model=model_spec(model), weights=weights_checksum(model), seq_len=seq_len,
                    window=window, agg=agg, eps=eps, dtype=str(dtype).removeprefix("torch."))
    return json.loads(json.dumps(manifest, default=str))  # as read back from manifest.json (string keys)


# %%
_man = store_manifest(model, 40, 4, "max", 1e-6, torch.float16)
test_eq({k: _man[k] for k in ("version", "seq_len", "window", "agg", "eps", "dtype")},
        dict(version=1, seq_len=40, window=4, agg="max", eps=1e-6, dtype="float16"))
test_eq((_man["weights"], json.loads(json.dumps(_man))), (weights_checksum(model), _man))


# %%
#| export
class ActivationBatches(Sequence):
    "Lazily loaded batches of a store: item i stacks the windows `indices[i]` (a sequence, so `distill` can slice it)."

    def __init__(self, store: "ActivationStore", indices: list[list[int]]):
        self.store, self.indices = store, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice): return ActivationBatches(self.store, self.indices[i])
        rows = [self.store[j] for j in self.indices[i]]
        return {key: torch.stack([r[key] for r in rows]) for key in ("keys", "values", "target")}


# %%
_windows = [{k: torch.full((2,), float(i)) for k in ("keys", "values", "target")} for i in range(3)]  # a stand-in store
_ab = ActivationBatches(_windows, [[0, 2], [1, 1], [2, 0]])
test_eq((len(_ab), _ab[0]["keys"].tolist(), _ab[1]["target"].tolist()), (3, [[0.0, 0.0], [2.0, 2.0]], [[1.0, 1.0]] * 2))
test_eq((type(_ab[1:]), _ab[1:].indices), (ActivationBatches, [[1, 1], [2, 0]]))


# %%
#| export
class ActivationStore:
    "A folder of cached activations (`cache_activations`): `store[i]` is window i's 'ids', 'keys', 'values', 'target'."

    def __init__(self, folder):
        self.folder = Path(folder)
        path = self.folder / "manifest.json"
        if not path.is_file(): raise FileNotFoundError(f"{path} not found: build the store with cache_activations")
        self.manifest = json.loads(path.read_text())
        self.n = len(list(self.folder.glob("window_*.pt")))

    def path(self, i: int) -> Path:
        return self.folder / f"window_{i:05d}.pt"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not 0 <= i < self.n: raise IndexError(f"window index must lie in [0, {self.n}), got {i}")
        return torch.load(self.path(i), map_location="cpu", weights_only=True, mmap=True)

    def check(self, model, student: KVpopStudent) -> None:
        "Raise a ValueError naming every field where the store does not fit `model` and `student`."
        now = dict(model=model_spec(model), window=student.window, agg=student.agg, eps=student.eps)
        now = json.loads(json.dumps(now, default=str))
        diffs = spec_differences({k: self.manifest[k] for k in now}, now, where="the store")
        if self.manifest["weights"] != weights_checksum(model): diffs.append("weights (another checkpoint)")
        if diffs: raise ValueError(f"the activations in {self.folder} do not fit this model and student; they differ "
                                   "in " + "; ".join(diffs))

    def batches(self, batch_size: int, steps: int, seed: int = 0) -> ActivationBatches:
        "`steps` batches of `batch_size` windows, reshuffled per epoch from `seed` (the order of `epoch_batches`)."
        order = epoch_batches(torch.arange(self.n)[:, None], batch_size, steps, seed)
        return ActivationBatches(self, [b[:, 0].tolist() for b in order])


# %%
# a store written by hand: a manifest and two windows
with tempfile.TemporaryDirectory() as d:
    test_fail(lambda: ActivationStore(d), exc=FileNotFoundError, contains="build the store with cache_activations")
    write_json(Path(d) / "manifest.json", {"window": 4})
    for i in range(2): torch.save({"ids": torch.tensor([i])}, Path(d) / f"window_{i:05d}.pt")
    _st = ActivationStore(d)
    test_eq((len(_st), _st.manifest, _st[1]["ids"].tolist()), (2, {"window": 4}, [1]))
    test_eq(_st.path(1), Path(d) / "window_00001.pt")
    test_fail(lambda: _st[2], exc=IndexError, contains="window index must lie in [0, 2)")
    _order = epoch_batches(torch.arange(2)[:, None], 1, 5, 3)
    test_eq(_st.batches(1, 5, seed=3).indices, [b[:, 0].tolist() for b in _order])


# %%
#| export
def cache_activations(model, sequences: Tensor, folder, window: int, agg: str = "max", eps: float = 1e-6,
                      dtype: torch.dtype = torch.float16, progress: bool = True) -> ActivationStore:
    """Cache `window_activations` of every window of `sequences` [N, S] in `folder`, one file per window, resuming
    a folder of the same setting (`manifest.json`); returns the store."""
    if not isinstance(sequences, Tensor) or sequences.dim() != 2:
        raise ValueError("sequences must be a [N, S] tensor of token ids")
    folder = Path(folder)
    manifest = store_manifest(model, sequences.shape[1], window, agg, eps, dtype)
    path = folder / "manifest.json"
    if path.is_file():
        diffs = spec_differences(json.loads(path.read_text()), manifest, where="the folder")
        if diffs: raise ValueError(f"{folder} holds activations of another setting ({'; '.join(diffs)}): use "
                                   "another folder or delete it")
    else: write_json(path, manifest)
    for i in tqdm(range(sequences.shape[0]), desc="cache activations", disable=not progress):
        out = folder / f"window_{i:05d}.pt"
        if out.is_file():
            if not torch.equal(torch.load(out, weights_only=True, mmap=True)["ids"], sequences[i]):
                raise ValueError(f"{out} holds another window than sequences[{i}]: use another folder or delete it")
            continue
        acts = {k: v[0] for k, v in window_activations(model, sequences[i:i + 1], window, agg, eps, dtype).items()}
        with atomic_path(out) as tmp: torch.save(dict(ids=sequences[i].clone(), **acts), tmp)
    return ActivationStore(folder)


# %%
with tempfile.TemporaryDirectory() as d:
    store = cache_activations(model, ids, d, window=4, dtype=torch.float32, progress=False)
    test_eq(len(store), 2)
    assert_close(store[1]["keys"], acts["keys"][1])
    assert_close(store[0]["target"], acts["target"][0])
    stamp = store.path(0).stat().st_mtime_ns
    cache_activations(model, ids, d, window=4, dtype=torch.float32, progress=False)  # resumes: nothing rewritten
    test_eq(store.path(0).stat().st_mtime_ns, stamp)
    test_fail(lambda: cache_activations(model, ids, d, window=8, dtype=torch.float32, progress=False),
              contains="window (4 in the folder, 8 now)")
    test_fail(lambda: cache_activations(model, ids.flip(0), d, window=4, dtype=torch.float32, progress=False),
              contains="holds another window")
    test_fail(lambda: store.check(model, KVpopStudent(random_scorers(model), 2, 8, 6)), contains="window")
    batches = store.batches(batch_size=1, steps=5, seed=0)
    test_eq(len(batches), 5)
    test_eq(len(batches[3:]), 2)
    test_eq(batches[0]["keys"].shape, (1, *acts["keys"].shape[1:]))

# %% [markdown]
# ## A cached step is the dense-target step
#
# `KVpopStudent.cached_loss` computes the loss of `method_loss` from a cached batch. From float32 activations, the
# loss and every gradient equal those of the in-model scorer-only step with `target="dense"` on the same windows at
# the same step (same sampled boundary queries); float16 storage changes the loss by rounding only.

# %%
with tempfile.TemporaryDirectory() as d:
    batch32, batch16 = (cache_activations(model, ids, Path(d) / name, window=4, dtype=dt, progress=False)
                        .batches(2, 1)[0] for name, dt in (("f32", torch.float32), ("f16", torch.float16)))
student = KVpopStudent(random_scorers(model, seed=2, kind="mlstm", delay=4), sink=2, window=4, k=6,
                       n_boundaries=16, target="dense").train()
with patch(model, student.policy()): model(ids, logits_to_keep=1)
loss_model, _ = student.method_loss(step=3)
grads_model = torch.autograd.grad(loss_model, list(student.parameters()))
loss_cached, _ = student.cached_loss(batch32, step=3)  # the store's batch order is shuffled: the loss is a mean
grads_cached = torch.autograd.grad(loss_cached, list(student.parameters()))
assert_close(loss_cached, loss_model, rtol=1e-5, atol=1e-6)
for g_c, g_m in zip(grads_cached, grads_model): assert_close(g_c, g_m, rtol=1e-4, atol=1e-6)
loss16, _ = student.cached_loss(batch16, step=3)
assert (loss16 - loss_model).abs() < 1e-2 * loss_model.abs()
print(f"loss in-model {loss_model.item():.6f}, cached float32 {loss_cached.item():.6f}, float16 {loss16.item():.6f}")
test_fail(lambda: KVpopStudent(student.scorers, 2, 4, 6).cached_loss(batch32, 0), contains="target='dense'")


# %% [markdown]
# ## Training
#
# `train_offline` is `distill` in `mode="cached"` over a store's batches: the same optimizer groups, learning-rate
# schedule, clipping, checkpoints and exact resume as every other trained method; the base model is passed only to
# check that the store belongs to it and to describe it in the checkpoint. `cached_eval` scores a student on a
# store of held-out windows: the retention loss and the top-$k$ recall against the decayed dense teacher at fixed
# boundary queries, so evaluations at different steps compare the same decisions.

# %%
#| export
def cached_eval(student: KVpopStudent, store: ActivationStore, step: int = 0) -> dict[str, float]:
    "Mean retention loss and recall of `student` over every window of `store` at the boundary queries of `step`."
    was = student.training
    student.eval()
    with torch.no_grad():
        rows = [student.cached_loss(b, step)[1] for b in ActivationBatches(store, [[i] for i in range(len(store))])]
    student.train(was)
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


# %%
with tempfile.TemporaryDirectory() as d:
    _store = cache_activations(model, ids, d, window=4, dtype=torch.float32, progress=False)
    _st = KVpopStudent(random_scorers(model, seed=3), sink=2, window=4, k=6, n_boundaries=16, target="dense").train()
    _got = cached_eval(_st, _store, step=2)
    _rows = [_st.cached_loss({k: v[None] for k, v in _store[i].items() if k != "ids"}, 2)[1] for i in range(2)]
    test_eq(set(_got), {"retention_loss", "retention_recall"})
    for k in _got: assert abs(_got[k] - (_rows[0][k] + _rows[1][k]) / 2) < 1e-6
    test_eq(_st.training, True)  # restored


# %% [markdown]
# Training lowers the held-out retention loss, and a run stopped after 3 of 6 steps and resumed from its
# checkpoint ends with exactly the scorers of the uninterrupted run.

# %%
#| export
def train_offline(model, student: KVpopStudent, store: ActivationStore, config: DistillConfig, batch_size: int = 1,
                  checkpoint_dir=None, val_store: ActivationStore | None = None, eval_every: int | None = None,
                  progress: bool = True) -> pd.DataFrame:
    """Train `student`'s scorers (and decays) on `store` with `distill` (`config.mode` must be 'cached'); evaluate on
    `val_store` every `eval_every` steps; resume from `checkpoint_dir`. The history, as `distill` returns it."""
    if config.mode != "cached": raise ValueError(f"config.mode must be 'cached' for training from activations, got "
                                                 f"{config.mode!r}")
    store.check(model, student)
    if val_store is not None: val_store.check(model, student)
    eval_fn = None if val_store is None else (lambda m, st: cached_eval(st, val_store))
    batches = store.batches(batch_size, config.steps * config.grad_accum, config.seed)
    return distill(model, student, batches, config, checkpoint_dir=checkpoint_dir, eval_fn=eval_fn,
                   eval_every=eval_every if val_store is not None else None, progress=progress)


# %%
def fresh_student(seed=0):
    torch.manual_seed(seed)
    return KVpopStudent(random_scorers(model, seed=seed, std=0.0), sink=2, window=4, k=6, n_boundaries=16,
                        target="dense")


train_ids = torch.randint(0, model.config.vocab_size, (6, 40), generator=torch.Generator().manual_seed(1))
with tempfile.TemporaryDirectory() as d:
    tr = cache_activations(model, train_ids, Path(d) / "train", window=4, progress=False)
    va = cache_activations(model, ids, Path(d) / "val", window=4, progress=False)
    cfg = DistillConfig(steps=6, mode="cached", new_lr=3e-2, new_lr_min=3e-3, warmup_steps=1, checkpoint_every=3)
    st = fresh_student()
    hist = train_offline(model, st, tr, cfg, batch_size=2, val_store=va, eval_every=6, progress=False)
    evals = hist[hist.kind == "eval"]
    assert evals.retention_loss.iloc[-1] < evals.retention_loss.iloc[0], evals
    load_batch, loaded = ActivationBatches.__getitem__, []

    def killed_at_step_4(self, i):  # the process dies while reading the 4th batch
        if not isinstance(i, slice):
            loaded.append(i)
            if len(loaded) == 4: raise KeyboardInterrupt
        return load_batch(self, i)

    ActivationBatches.__getitem__ = killed_at_step_4
    try: train_offline(model, fresh_student(), tr, cfg, batch_size=2, checkpoint_dir=Path(d) / "ckpt", progress=False)
    except KeyboardInterrupt: pass
    finally: ActivationBatches.__getitem__ = load_batch
    test_eq(torch.load(Path(d) / "ckpt" / "checkpoint.pt", weights_only=False)["step"], 3)
    resumed = fresh_student()  # a new process: only the checkpoint carries the state
    train_offline(model, resumed, tr, cfg, batch_size=2, checkpoint_dir=Path(d) / "ckpt", progress=False)
    for a, b in zip(st.state_dict().values(), resumed.state_dict().values()): assert_close(a, b)
    test_fail(lambda: train_offline(model, fresh_student(), tr, DistillConfig(mode="scorer_only")), contains="'cached'")


# %% [markdown]
# ## What caching saves
#
# `step_seconds` times, alternately on the same windows, one in-model scorer-only step of Alg. 1 (the model's
# forward under the student's sparse attention, the target from its sparse LSE, the backward through the
# scorers) and one step from cached activations. The model's forward is what caching removes, so the ratio grows
# with the model; the stage [`kvpop_train`](../reproduce/13_kvpop_train.ipynb) reports it on SmolLM2.

# %%
#| export
def step_seconds(model, student: KVpopStudent, ids: Tensor, batch: dict[str, Tensor], repeats: int = 3
                 ) -> dict[str, float]:
    """Median seconds of one in-model scorer-only step (Alg. 1, `target='sparse'`) on windows `ids` and of one cached
    step on `batch`, the same windows' activations, alternated; and their ratio."""
    opts = dict(n_boundaries=student.n_boundaries, late_frac=student.late_frac, agg=student.agg, eps=student.eps,
                **student.loss_options)
    in_model = KVpopStudent(student.scorers, student.sink, student.window, student.k, target="sparse", **opts).train()
    cached = KVpopStudent(student.scorers, student.sink, student.window, student.k, target="dense", **opts).train()

    def model_step():
        with patch(model, in_model.policy()): model(input_ids=ids, logits_to_keep=1)
        in_model.method_loss(0)[0].backward()

    def cached_step():
        cached.cached_loss(batch, 0)[0].backward()

    times = {"in_model": [], "cached": []}
    for _ in range(repeats):
        for name, fn in (("in_model", model_step), ("cached", cached_step)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            student.scorers.zero_grad(set_to_none=True)
    out = {f"{k}_s": float(torch.tensor(v).median()) for k, v in times.items()}
    return dict(**out, ratio=out["in_model_s"] / out["cached_s"])


# %%
speed = step_seconds(model, fresh_student(), ids, batch32)
print({k: round(v, 4) for k, v in speed.items()})
assert speed["cached_s"] > 0 and speed["in_model_s"] > 0
