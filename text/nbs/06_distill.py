# %% [markdown]
# # Distillation training
#
# > One distillation loop for every trained KV method (KVpop Alg. 1, App. F), with exact resume and FSDP2.

# %%
#| default_exp distill

# %%
#| export
# Over 400 lines on purpose: the loop, its checkpoints (full config, resume checks) and FSDP sharding share one
# state layout, and resuming exactly depends on all three agreeing.
from __future__ import annotations

import copy
import itertools
import json
import math
import pickle
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from tqdm.auto import tqdm

from sparsekv.eval import kl_to_teacher
from sparsekv.hf import AttentionPolicy, patch
from sparsekv.io import DamagedFileError, atomic_path_with_digest, digest_path, verify_digest

# %%
#| hide
import os
import tempfile

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.eval import token_kl, top1_agreement
from sparsekv.kvpop.cache import random_scorers
from sparsekv.kvpop.student import KVpopStudent, SinkWindowStudent
from sparsekv.models import load_model


# %% [markdown]
# ## The student protocol
#
# Every trained method (KVpop, StreamingLLM+ and DMS) plugs into the same loop as a `DistillStudent`: an
# `nn.Module` holding only the method's **new** parameters, with a training-time attention `policy()`, a
# `method_loss(step)` from what the policy captured during the forward, and an `inference_cache()`.

# %%
#| export
class DistillStudent(nn.Module):
    "A trained KV method: its new parameters (scorers, decays, gates), its training attention and its own loss."

    def policy(self) -> AttentionPolicy:
        """Training-time attention of the student, used as `with hf.patch(model, student.policy()): model(input_ids)` on
        whole (packed) sequences without a cache. In train() mode the policy captures what method_loss needs; in eval()
        mode it only attends (deterministic)."""
        raise NotImplementedError(f"{type(self).__name__} must implement policy()")

    def method_loss(self, step: int) -> tuple[Tensor, dict[str, float]]:
        """Called once after each training forward: the method's own loss (already weighted; a zero tensor when none)
        from what the policy captured during that forward, plus scalar metrics for logging; clears the capture."""
        return torch.zeros(()), {}

    def inference_cache(self):
        "A bounded transformers Cache for decoding with this method (e.g. KVpopCache), or None."
        return None

    def cached_loss(self, batch: dict, step: int) -> tuple[Tensor, dict[str, float]]:
        """`mode="cached"`: the method loss from a batch of cached activations (`sparsekv.kvpop.offline`), without
        running the model; only a method whose loss depends on the frozen base's activations alone can have one."""
        raise NotImplementedError(f"{type(self).__name__} cannot train from cached activations (mode='cached'): "
                                  "its loss needs the model's forward")

    def fsdp_units(self) -> list[nn.Module]:
        "Submodules the policy calls, each one FSDP2 unit (see `shard_for_training`); default: children with params."
        return [m for m in self.children() if any(True for _ in m.parameters())]


# %%
#| hide
from sparsekv.distill import DistillStudent  # noqa: F811 the students below subclass the package's class

# %% [markdown]
# The checks below train students of [`sparsekv.kvpop.student`](17_kvpop_student.ipynb) on the tiny random
# Llama of `sparsekv.models`: here a KVpop student with random scorers.

# %%
model, tok = load_model("tiny-llama", num_layers=2)
student = KVpopStudent(random_scorers(model, seed=1), sink=2, window=4, k=3, n_boundaries=8)
ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

# %% [markdown]
# ## Configuration and learning-rate schedule (App. F, Table 3)
#
# Two AdamW parameter groups, betas $(0.9, 0.95)$, weight decay $10^{-4}$: the base model's existing
# parameters at a constant $8 \cdot 10^{-5}$, and the new parameters (scorers, decays) with a linear warmup
# over 100 steps to $10^{-3}$ followed by a cosine decay to $8 \cdot 10^{-5}$ at the last step. For update
# $i = 0, 1, \dots, T-1$ of $T$ steps with $W$ warmup steps:
#
# $$\eta_i = \begin{cases} \eta_{\max} \dfrac{i+1}{W}, & i < W \\[4pt] \eta_{\min} + \dfrac{\eta_{\max} - \eta_{\min}}{2}\left(1 + \cos \dfrac{\pi (i - W)}{\max(1, T - W)}\right), & i \ge W. \end{cases}$$
#
# `mode="scorer_only"` freezes the base (the fast CPU path); there the KL is only a metric, and computing it
# costs a teacher forward and the LM head of both passes for nothing the optimizer sees, so by default it is
# skipped (`kl_metric=False`): the student forward then stops at the last hidden state of the last position.
#
# `mode="cached"` also freezes the base but never runs it: the batches are activations cached once per training
# window (keys, values and the dense target of every layer, `sparsekv.kvpop.offline`) and the loss is the
# student's `cached_loss`. Only the new parameters train, as in `scorer_only`.

# %%
#| export
MODES = ("full", "scorer_only", "cached")


@dataclass
class DistillConfig:
    "Hyper-parameters of `distill` (App. F, Table 3)."
    steps: int = 2000
    mode: str = "full"                          # "full" (base + new params), "scorer_only" or "cached" (base frozen)
    base_lr: float = 8e-5                       # existing params: constant
    new_lr: float = 1e-3                        # new params: peak after warmup
    new_lr_min: float = 8e-5                    # new params: end of the cosine
    warmup_steps: int = 100
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    kl_top_k: int = 256
    kl_temperature: float = 1.0
    kl_metric: bool = False                     # scorer_only: also compute the (gradient-free) KL as a metric
    grad_accum: int = 1                         # micro-batches per step (the paper's global batch 128 by accumulation)
    checkpoint_every: int | None = None
    bf16: bool = True                           # bf16 autocast on CUDA (ranking and decay stay float32)
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES: raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("steps", "warmup_steps", "kl_top_k", "grad_accum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "warmup_steps" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'warmup_steps' else 1}, got {v!r}")
        if self.checkpoint_every is not None and (not isinstance(self.checkpoint_every, int)
                                                  or self.checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be None or an int >= 1, got {self.checkpoint_every!r}")
        for name in ("base_lr", "new_lr", "new_lr_min", "grad_clip", "kl_temperature"):
            if not getattr(self, name) > 0: raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.new_lr_min > self.new_lr:
            raise ValueError(f"new_lr_min ({self.new_lr_min}) must be <= new_lr ({self.new_lr})")
        self.betas = tuple(self.betas)


# %%
test_eq((DistillConfig().steps, DistillConfig(betas=[0.8, 0.9]).betas), (2000, (0.8, 0.9)))
test_fail(lambda: DistillConfig(mode="lora"), contains="mode")
test_fail(lambda: DistillConfig(warmup_steps=-1), contains="warmup_steps must be an int >= 0")
test_fail(lambda: DistillConfig(grad_accum=True), contains="grad_accum must be an int >= 1")
test_fail(lambda: DistillConfig(checkpoint_every=0), contains="checkpoint_every must be None or an int >= 1")
test_fail(lambda: DistillConfig(new_lr_min=2e-3), contains="new_lr_min (0.002) must be <= new_lr (0.001)")


# %% [markdown]
# The schedule, by hand at the paper's numbers over 400 steps: $10^{-5}$ at the first update, the peak $10^{-3}$ at
# the last warmup update and the first after it, halfway down the cosine ($\eta_{\min} + (\eta_{\max} -
# \eta_{\min})/2$) at update 250, and the floor from the last step on.

# %%
#| export
def new_param_lr(i: int, config: DistillConfig) -> float:
    "Learning rate of the new parameters at update i (0-based): linear warmup, cosine new_lr -> new_lr_min (Table 3)."
    W, T = config.warmup_steps, config.steps
    if i < W: return config.new_lr * (i + 1) / W
    frac = min(1.0, (i - W) / max(1, T - W))
    return config.new_lr_min + 0.5 * (config.new_lr - config.new_lr_min) * (1 + math.cos(math.pi * frac))


# %%
cfg = DistillConfig(steps=400)
test_eq([new_param_lr(i, cfg) for i in (0, 99, 100, 400, 500)], [1e-5, 1e-3, 1e-3, 8e-5, 8e-5])
assert math.isclose(new_param_lr(250, cfg), (1e-3 + 8e-5) / 2)
test_eq(new_param_lr(0, DistillConfig(steps=3, warmup_steps=0)), 1e-3)


# %% [markdown]
# The parameter groups: the base model's only in full mode, and a run with nothing to train is refused.

# %%
#| export
def trainable_groups(model: nn.Module, student: DistillStudent, config: DistillConfig) -> list[dict]:
    "AdamW groups: 'base' (the model, full mode only, constant LR) and 'new' (the student), skipping empty ones."
    groups = []
    if config.mode == "full":
        groups.append(dict(name="base", params=[p for p in model.parameters() if p.requires_grad], lr=config.base_lr))
    groups.append(dict(name="new", params=[p for p in student.parameters() if p.requires_grad], lr=config.new_lr))
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError(f"nothing to train: mode={config.mode!r} and {type(student).__name__} has no parameters")
    return groups


# %%
lin = torch.nn.Linear(2, 2)
kv = KVpopStudent(random_scorers(model), 2, 4, 3)
test_eq([(g["name"], g["lr"]) for g in trainable_groups(lin, kv, DistillConfig())], [("base", 8e-5), ("new", 1e-3)])
test_eq([g["name"] for g in trainable_groups(lin, kv, DistillConfig(mode="scorer_only"))], ["new"])
base = trainable_groups(lin, kv, DistillConfig())[0]["params"]
assert all(a is b for a, b in zip(base, lin.parameters(), strict=True))
test_fail(lambda: trainable_groups(lin, SinkWindowStudent(2, 4, 3), DistillConfig(mode="scorer_only")),
          contains="nothing to train")


# %% [markdown]
# Check: the schedule the optimizer applies, stepped as in training, against the formula written out
# by hand with the paper's numbers (peak $10^{-3}$ after 100 steps, $8\cdot 10^{-5}$ at the end).

# %%
#| export
def make_optimizer(model: nn.Module, student: DistillStudent, config: DistillConfig):
    "(AdamW over `trainable_groups`, LambdaLR applying the constant base LR and `new_param_lr`)."
    groups = trainable_groups(model, student, config)
    opt = torch.optim.AdamW(groups, betas=config.betas, weight_decay=config.weight_decay)
    lambdas = [(lambda i: 1.0) if g["name"] == "base" else (lambda i: new_param_lr(i, config) / config.new_lr)
               for g in groups]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas)


# %%
cfg = DistillConfig(steps=400)
lin = torch.nn.Linear(2, 2)
opt, sched = make_optimizer(lin, KVpopStudent(random_scorers(model), 2, 4, 3), cfg)
seen_lr = []
for _ in range(cfg.steps):
    seen_lr.append({g["name"]: g["lr"] for g in opt.param_groups})
    opt.step(); sched.step()
brute = [1e-3 * (i + 1) / 100 if i < 100 else 8e-5 + (1e-3 - 8e-5) * (1 + math.cos(math.pi * (i - 100) / 300)) / 2
         for i in range(400)]
assert_close(torch.tensor([r["new"] for r in seen_lr]), torch.tensor(brute, dtype=torch.float32), rtol=1e-6, atol=0)
test_eq({r["base"] for r in seen_lr}, {8e-5})
test_eq(max(brute), 1e-3)
assert abs(seen_lr[-1]["new"] - 8e-5) < 1e-7  # the cosine ends at the floor


# %% [markdown]
# ## The distillation loss
#
# Forward KL from teacher to student on the teacher's top-256 tokens, both distributions renormalized on that
# set (`eval.kl_to_teacher`, App. F: "KL reverse: false"), at temperature $T$ (logits divided by $T$, the loss
# scaled by $T^2$ so that its gradient does not shrink with $T$).

# %%
#| export
def distill_kl(student_logits: Tensor, teacher_logits: Tensor, top_k: int = 256, temperature: float = 1.0) -> Tensor:
    "Mean forward KL(teacher || student) over positions on the teacher's `top_k` tokens at `temperature` (App. F)."
    T = temperature
    return kl_to_teacher(student_logits / T, teacher_logits.detach() / T,
                         top_k=min(top_k, teacher_logits.shape[-1])) * T * T


# %%
zs, zt = torch.randn(2, 5, 40), torch.randn(2, 5, 40)
assert_close(distill_kl(zs, zt, top_k=8), token_kl(zs, zt, top_k=8).mean())
assert_close(distill_kl(zs, zt, top_k=8, temperature=2.0), 4 * token_kl(zs / 2, zt / 2, top_k=8).mean())


# %% [markdown]
# ## Data, checkpoints and the loop
#
# `batches` is any re-iterable sequence of `[B, S]` token batches, `grad_accum` per step; `epoch_batches` makes one from
# packed sequences (deterministic shuffles per epoch). A checkpoint holds everything a resumed run needs to
# continue **bit-identically**: model (full mode), student, optimizer, scheduler, the number of batches consumed,
# RNG states and the history so far. It is written atomically (`io.atomic_path`), so an interrupted write
# leaves the previous checkpoint, and with its SHA-256 beside it (`checkpoint.pt.sha256`,
# `io.atomic_path_with_digest`), checked before it is resumed: a checkpoint changed on disk after it was
# written would otherwise load with some weights or optimizer moments silently different. The boundary positions are drawn from generators seeded by the step, so
# they do not depend on the process' RNG stream.
#
# Under `torch.distributed` every rank takes its slice of each global batch; state dicts are gathered to full
# tensors with `torch.distributed.checkpoint.state_dict` (a no-op for an unsharded model) and rank 0 writes.

# %%
#| export
def epoch_batches(sequences: Tensor, batch_size: int, steps: int, seed: int = 0) -> list[Tensor]:
    "`steps` batches `[batch_size, S]` of `sequences` `[N, S]`, reshuffled per epoch from `seed`, no partial batch."
    if not isinstance(sequences, Tensor) or sequences.dim() != 2:
        raise ValueError("sequences must be a [N, S] tensor of token ids")
    n = sequences.shape[0]
    if not isinstance(batch_size, int) or not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be an int in [1, {n}], got {batch_size!r}")
    per_epoch, out, epoch = n // batch_size, [], 0
    while len(out) < steps:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        out += [sequences[order[i * batch_size:(i + 1) * batch_size]] for i in range(per_epoch)]
        epoch += 1
    return out[:steps]


# %%
rows = torch.arange(5)[:, None].expand(5, 3)                      # 5 sequences, row i all i
bs = epoch_batches(rows, 2, 5, seed=7)
test_eq((len(bs), bs[0].shape), (5, (2, 3)))
for e, (a, b) in enumerate((bs[0:2], bs[2:4])):                    # 2 full batches per epoch, no repeat within one
    test_eq(torch.cat([a, b])[:, 0], torch.randperm(5, generator=torch.Generator().manual_seed(7 + e))[:4])
test_eq(epoch_batches(rows, 2, 5, seed=7)[4], bs[4])
test_fail(lambda: epoch_batches(rows, 6, 1), contains="batch_size must be an int in [1, 5]")
test_fail(lambda: epoch_batches(rows[0], 1, 1), contains="[N, S]")


# %%
#| export
def world() -> tuple[int, int]:
    "(rank, world size): (0, 1) without an initialized process group."
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


# %%
test_eq(world(), (0, 1))                                           # this notebook runs in one process


# %%
#| export
def rank_slice(batch: Tensor) -> Tensor:
    "This rank's rows of a global batch (equal contiguous slices)."
    rank, n = world()
    if batch.shape[0] % n:
        raise ValueError(f"the global batch size {batch.shape[0]} must be divisible by the world size {n}")
    return batch.chunk(n)[rank] if n > 1 else batch


# %%
assert rank_slice(ids) is ids                                      # one process: the whole batch


# %% [markdown]
# The state a checkpoint saves: the model's only in full mode.

# %%
#| export
def _state_container(model: nn.Module, student: DistillStudent, config: DistillConfig) -> nn.Module:
    "One module whose state dict covers what is trained (keys 'model.*' in full mode, 'student.*')."
    return nn.ModuleDict({"model": model, "student": student} if config.mode == "full" else {"student": student})


# %%
test_eq({k.split(".")[0] for k in _state_container(model, student, DistillConfig()).state_dict()}, {"model", "student"})
test_eq(set(_state_container(model, student, DistillConfig(mode="scorer_only")).state_dict()),
        {f"student.{k}" for k in student.state_dict()})


# %%
#| export
def rng_state() -> dict:
    "Python, NumPy, torch CPU (and CUDA) RNG states."
    st = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state())
    if torch.cuda.is_available(): st["cuda"] = torch.cuda.get_rng_state_all()
    return st


# %%
st = rng_state()
assert {"python", "numpy", "torch"} <= set(st) and torch.equal(st["torch"], torch.get_rng_state())


# %% [markdown]
# Restoring the states replays the same draws from every generator:

# %%
#| export
def set_rng_state(st: dict) -> None:
    "Restore what `rng_state` returned."
    random.setstate(st["python"]); np.random.set_state(st["numpy"]); torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available(): torch.cuda.set_rng_state_all(st["cuda"])


# %%
draw = lambda: (random.random(), np.random.rand(), torch.rand(1).item())
st = rng_state()
first = draw()
set_rng_state(st)
test_eq(draw(), first)

# %% [markdown]
# A checkpoint answers for one run only. Resuming checks that the run is the same one: the full `DistillConfig`,
# the model (its class and config) and the student (its class, its budget and other settings such as `sink`,
# `window`, `k`, the types of its submodules, e.g. MLP or mLSTM scorers, and its parameter shapes). Any difference
# is refused with an error naming the differing fields, since training on would silently mix two experiments.
# Two fields may differ: `checkpoint_every` (it changes nothing that is computed) and `steps`, which may grow
# (extending a run); a checkpoint beyond `config.steps` is refused. A changed learning rate is refused too (train
# with another `checkpoint_dir` to try one). When `steps` grows, the rest of the run follows the new schedule (the
# cosine now ends at the new last step): the learning rates of the next update are recomputed from the current
# config rather than taken from the optimizer state saved in the checkpoint.

# %%
#| export
RESUMABLE_CHANGES = ("steps", "checkpoint_every")

# %%
test_eq(RESUMABLE_CHANGES, ("steps", "checkpoint_every"))
assert set(RESUMABLE_CHANGES) <= set(asdict(DistillConfig()))


# %% [markdown]
# A student's settings are its plain attributes, those a JSON file could hold:

# %%
#| export
def _plain(v) -> bool:
    "Whether `v` is a JSON-like value (scalars, and lists, tuples or dicts of them)."
    if isinstance(v, (bool, int, float, str, type(None))): return True
    if isinstance(v, (list, tuple)): return all(_plain(x) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _plain(x) for k, x in v.items())


# %%
test_eq([_plain(v) for v in (None, 3, "a", (1, [2.0, {"k": True}]))], [True] * 4)
test_eq([_plain(v) for v in (torch.ones(1), {1: 2}, [nn.Linear(1, 1)])], [False] * 3)


# %%
#| export
def _class_name(m) -> str:
    "Class name of `m`, without the FSDP wrapper class that `fully_shard` puts in front."
    return next(c.__name__ for c in type(m).__mro__ if not issubclass(c, FSDPModule))


# %%
class FSDPLinear(FSDPModule, nn.Linear): pass                      # the class fully_shard puts in front
sharded = nn.Linear(1, 1)
sharded.__class__ = FSDPLinear                                     # as fully_shard does
test_eq((type(sharded).__name__, _class_name(sharded), _class_name(nn.Linear(1, 1))),
        ("FSDPLinear", "Linear", "Linear"))


# %%
#| export
def student_spec(student: nn.Module) -> dict:
    "What identifies a student: class, plain settings (sink, window, k, ...), submodule classes, parameter shapes."
    settings = {k: v for k, v in vars(student).items() if not k.startswith("_") and k != "training" and _plain(v)}
    return dict(type=_class_name(student), settings=settings,
                modules={n: _class_name(m) for n, m in student.named_modules() if n},
                shapes={n: list(p.shape) for n, p in student.state_dict().items()})


# %%
sp = student_spec(student)
test_eq((sp["type"], sp["settings"]["sink"], sp["settings"]["window"], sp["settings"]["k"]), ("KVpopStudent", 2, 4, 3))
test_eq(sp["shapes"], {n: list(p.shape) for n, p in student.state_dict().items()})
assert "training" not in sp["settings"] and sp["modules"]


# %%
#| export
def model_spec(model: nn.Module) -> dict:
    "What identifies the base model: its class and its config (without the folder it was loaded from)."
    config = getattr(model, "config", None)
    drop = ("_name_or_path", "transformers_version")
    config = {k: v for k, v in config.to_dict().items() if k not in drop} if config else {}
    return dict(type=_class_name(model), config=config)


# %%
ms = model_spec(model)
test_eq((ms["type"], ms["config"]["num_hidden_layers"], "_name_or_path" in ms["config"]),
        ("LlamaForCausalLM", 2, False))
test_eq(model_spec(nn.Linear(1, 1)), {"type": "Linear", "config": {}})


# %% [markdown]
# The differences are named by their dotted path, with both values:

# %%
#| export
def spec_differences(saved, now, prefix: str = "", where: str = "the checkpoint") -> list[str]:
    """Dotted names of the fields where the nested dicts `saved` (kept in `where`) and `now` differ (tuples and lists
    compare equal)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [d for k in sorted(set(saved) | set(now), key=str)
                for d in spec_differences(saved.get(k), now.get(k), f"{prefix}{k}.", where)]
    same = json.dumps(saved, sort_keys=True, default=str) == json.dumps(now, sort_keys=True, default=str)
    return [] if same else [f"{prefix.rstrip('.')} ({saved!r} in {where}, {now!r} now)"]


# %%
test_eq(spec_differences({"a": {"b": 1, "c": (1, 2)}}, {"a": {"b": 2, "c": [1, 2]}, "d": 0}, "x."),
        ["x.a.b (1 in the checkpoint, 2 now)", "x.d (None in the checkpoint, 0 now)"])
test_eq(spec_differences({"a": 1}, {"a": 1}), [])


# %% [markdown]
# A checkpoint after 3 updates of 2 micro-batches each, read back: the step, the batches consumed, the states, the
# config and the description of the model and student.

# %%
#| export
def save_checkpoint(path, model, student, opt, sched, config: DistillConfig, step: int, history: list[dict]) -> None:
    """Write the training state after `step` updates, the full config and what identifies the model and student, to
    `path` atomically (every rank calls it; rank 0 writes)."""
    model_sd, opt_sd = get_state_dict(_state_container(model, student, config), opt,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if world()[0] == 0:
        ckpt = dict(step=step, batches_consumed=step * config.grad_accum, model=model_sd, optimizer=opt_sd,
                    scheduler=sched.state_dict(), rng=rng_state(), history=history, config=asdict(config),
                    spec=dict(model=model_spec(model), student=student_spec(student)))
        with atomic_path_with_digest(path) as tmp: torch.save(ckpt, tmp)
    if world()[1] > 1: dist.barrier()


# %%
cfg_ck = DistillConfig(steps=5, mode="scorer_only", grad_accum=2)
opt_ck, sched_ck = make_optimizer(model, student, cfg_ck)
with tempfile.TemporaryDirectory() as d:
    save_checkpoint(Path(d)/"c.pt", model, student, opt_ck, sched_ck, cfg_ck, 3, [{"step": 3}])
    ck = torch.load(Path(d)/"c.pt", weights_only=False)
    assert digest_path(Path(d)/"c.pt").exists()
test_eq((ck["step"], ck["batches_consumed"], ck["history"], ck["config"]), (3, 6, [{"step": 3}], asdict(cfg_ck)))
test_eq(set(ck["model"]), {f"student.{k}" for k in student.state_dict()})
test_eq(set(ck["spec"]), {"model", "student"})

# %% [markdown]
# `load_torch_file` is `torch.load` behind that check. A file written without a digest (by an older version, or
# saved by hand) still loads, with a warning saying how to record its digest; one that `torch.load` cannot read is
# a `DamagedFileError` naming it, instead of the zip reader's "failed finding central directory", an empty
# `EOFError`, an `OSError [Errno 22]` or a `KeyError` of the unpickler.

# %%
#| export
# what torch.load raises on damaged bytes (the zip reader's RuntimeError, OSError [Errno 22] of a cut file, ...)
UNREADABLE = (RuntimeError, EOFError, KeyError, ValueError, OSError, pickle.UnpicklingError)


def load_torch_file(path, rebuild: str, digests: list[str] | None = None, recorded_in=None, **load_kwargs):
    """`torch.load(path, **load_kwargs)` after `io.verify_digest(path, rebuild, digests, recorded_in)`; a file without
    a recorded digest loads with a warning; bytes torch cannot read raise a `DamagedFileError` naming `path`."""
    verified = verify_digest(path, rebuild, digests, recorded_in)
    if not verified:
        warnings.warn(f"{path} has no recorded digest ({digest_path(path).name}; written by an older sparsekv or by "
                      "hand), so it is loaded unverified; if you trust it, record its digest with "
                      f"sparsekv.io.record_digest({str(path)!r})", stacklevel=3)
    try: return torch.load(path, **load_kwargs)
    except UNREADABLE as e:
        if verified: raise  # intact bytes: the error is not the file's
        raise DamagedFileError(f"{path} cannot be read by torch.load ({type(e).__name__}: {e}): it is damaged, cut "
                               f"short or not a torch file; {rebuild}") from e


# %%
with tempfile.TemporaryDirectory() as d:
    f = Path(d)/"x.pt"
    with atomic_path_with_digest(f) as tmp: torch.save({"a": torch.ones(3)}, tmp)
    test_eq(load_torch_file(f, "rebuild it", weights_only=True)["a"], torch.ones(3))
    digest_path(f).unlink()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load_torch_file(f, "rebuild it", weights_only=True)
    assert "loaded unverified" in str(w[0].message) and "record_digest" in str(w[0].message)
    f.write_bytes(b"not a torch file")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        test_fail(lambda: load_torch_file(f, "rebuild it", weights_only=True), exc=DamagedFileError,
                  contains=f"{f} cannot be read by torch.load")


# %%
#| export
def check_resume(ckpt: dict, path, model, student, config: DistillConfig) -> None:
    "Raise a ValueError naming each field where checkpoint `ckpt`'s run differs from this one (more `steps` is fine)."
    if "spec" not in ckpt:
        raise ValueError(f"checkpoint {path} was written without its model and student description (an older "
                         "version of sparsekv), so resuming it cannot be checked; delete it to train from the start")
    diffs = spec_differences({k: v for k, v in ckpt["config"].items() if k not in RESUMABLE_CHANGES},
                             {k: v for k, v in asdict(config).items() if k not in RESUMABLE_CHANGES}, "config.")
    diffs += spec_differences(ckpt["spec"], dict(model=model_spec(model), student=student_spec(student)))
    if diffs: raise ValueError(f"checkpoint {path} belongs to another run; it differs in " + "; ".join(diffs)
                               + ". Use another checkpoint_dir (or delete it) to train this configuration")
    if ckpt["step"] > config.steps:
        raise ValueError(f"checkpoint {path} is at step {ckpt['step']}, beyond config.steps={config.steps}; pass "
                         f"steps >= {ckpt['step']}")


# %%
ck_ok = dict(step=3, config=asdict(cfg_ck), spec=dict(model=model_spec(model), student=student_spec(student)))
check_resume(ck_ok, "c.pt", model, student, DistillConfig(**{**asdict(cfg_ck), "steps": 9, "checkpoint_every": 2}))
test_fail(lambda: check_resume(ck_ok, "c.pt", model, student, DistillConfig(**{**asdict(cfg_ck), "base_lr": 1e-4})),
          contains="checkpoint c.pt belongs to another run; it differs in config.base_lr (8e-05 in the checkpoint")
test_fail(lambda: check_resume(ck_ok, "c.pt", model, student, DistillConfig(**{**asdict(cfg_ck), "steps": 2})),
          contains="beyond config.steps=2")
test_fail(lambda: check_resume({"step": 1}, "c.pt", model, student, cfg_ck), contains="without its model and student")


# %% [markdown]
# Loading restores the training state: a checkpoint of one student read into another gives the first's weights.

# %%
#| export
def load_checkpoint(path, model, student, opt, sched, config: DistillConfig) -> tuple[int, list[dict]]:
    "Restore checkpoint `path` of this run (`check_resume`) into model, student, optimizer, scheduler: (step, history)."
    ckpt = load_torch_file(path, f"delete it and {digest_path(path).name} to train from the start (or restore both "
                           "from a copy)", map_location="cpu", weights_only=False)
    check_resume(ckpt, path, model, student, config)
    set_state_dict(_state_container(model, student, config), opt, model_state_dict=ckpt["model"],
                   optim_state_dict=ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
    sched.load_state_dict(ckpt["scheduler"])
    # the learning rates of the next update come from this config's schedule, not from the saved optimizer state
    for g, f, base in zip(opt.param_groups, sched.lr_lambdas, sched.base_lrs): g["lr"] = base * f(sched.last_epoch)
    set_rng_state(ckpt["rng"])
    return ckpt["step"], ckpt["history"]


# %%
other = copy.deepcopy(student)
for p_ in other.parameters(): p_.data.add_(1.0)
opt_o, sched_o = make_optimizer(model, other, cfg_ck)
with tempfile.TemporaryDirectory() as d:
    save_checkpoint(Path(d)/"c.pt", model, student, opt_ck, sched_ck, cfg_ck, 3, [{"step": 3}])
    test_eq(load_checkpoint(Path(d)/"c.pt", model, other, opt_o, sched_o, cfg_ck), (3, [{"step": 3}]))
for a_, b_ in zip(student.parameters(), other.parameters()): assert torch.equal(a_, b_)


# %% [markdown]
# The loop. `distill` returns the history as a DataFrame: one `kind="train"` row per update (`step` = updates
# done after it) with the total loss, the KL, the method's loss and metrics, the gradient norm before clipping,
# the learning rates used, the wall time and the process' CPU time (robust on a shared machine); and
# `kind="eval"` rows from `eval_fn(model, student)` before training and every `eval_every` updates (the model
# and student in `eval()` mode, under `no_grad`).

# %%
#| export
def _all_mean(values: dict[str, float]) -> dict[str, float]:
    "Average scalar metrics over ranks (identity in one process)."
    if world()[1] == 1 or not values: return values
    t = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(values, (t / world()[1]).tolist()))


# %%
test_eq((_all_mean({"loss": 0.5, "kl": 2.0}), _all_mean({})), ({"loss": 0.5, "kl": 2.0}, {}))


# %% [markdown]
# An evaluation runs with the model and student in `eval()` mode and without gradients, and leaves their modes
# as they were:

# %%
#| export
def _run_eval(eval_fn, model, student, step: int) -> dict:
    was = model.training, student.training
    model.eval(); student.eval()
    with torch.no_grad(): row = dict(step=step, kind="eval", **eval_fn(model, student))
    model.train(was[0]); student.train(was[1])
    return row


# %%
seen = {}
def probe(m, s_):
    seen.update(training=(m.training, s_.training), grad=torch.is_grad_enabled())
    return {"x": 1.0}
model.train(); student.train()
test_eq(_run_eval(probe, model, student, 7), {"step": 7, "kind": "eval", "x": 1.0})
test_eq((seen, model.training, student.training), ({"training": (False, False), "grad": False}, True, True))
model.eval()


# %% [markdown]
# One micro-batch: in scorer-only mode the loss is the method's alone and only the student gets gradients; in full
# mode it adds the KL to the teacher.

# %%
#| export
def _micro_step(model, teacher, student, batch, config, step: int, autocast) -> dict[str, float]:
    """Forward (teacher, then student under its policy; `cached`: the student's loss on cached activations) and
    backward of one micro-batch; its scalar losses and metrics."""
    if config.mode == "cached":
        loss, metrics = student.cached_loss(batch, step)
        (loss / config.grad_accum).backward()
        return dict(loss=loss.item(), method_loss=loss.item(), **metrics)
    ids, full = batch, config.mode == "full"
    need_kl = full or config.kl_metric
    with autocast:
        if need_kl:
            with torch.no_grad(): t_logits = teacher(input_ids=ids).logits
        with patch(model, student.policy()):
            # scorer-only: skip the LM head
            out = model(input_ids=ids) if need_kl else model(input_ids=ids, logits_to_keep=1)
        m_loss, metrics = student.method_loss(step)
        kl = distill_kl(out.logits, t_logits, config.kl_top_k, config.kl_temperature) if need_kl else None
        loss = m_loss + kl if full else m_loss
    (loss / config.grad_accum).backward()
    return dict(loss=loss.item(), method_loss=m_loss.item(), **metrics, **({} if kl is None else {"kl": kl.item()}))


# %%
off = torch.autocast("cpu", enabled=False)
student.train()
r = _micro_step(model, model, student, ids, DistillConfig(mode="scorer_only"), 0, off)
test_eq((r["loss"], "kl" in r), (r["method_loss"], False))
assert all(p_.grad is None for p_ in model.parameters()) and any(p_.grad is not None for p_ in student.parameters())
r = _micro_step(model, model, student, ids, DistillConfig(mode="full", grad_accum=2), 0, off)
assert math.isclose(r["loss"], r["method_loss"] + r["kl"], rel_tol=1e-6) and r["kl"] > 0
assert any(p_.grad is not None for p_ in model.parameters())
model.zero_grad(set_to_none=True); student.zero_grad(set_to_none=True)


# %% [markdown]
# The loop's pieces: where a run starts (a checkpoint's step and history, or step 0 with the seed set and a first
# evaluation), the scalars of one step (the mean over its `grad_accum` micro-batches) and its row of the history.

# %%
#| export
def _resume(checkpoint_dir, model, student, opt, sched, config: DistillConfig, eval_fn):
    "(checkpoint path or None, first step, history): a checkpoint's if `checkpoint_dir` holds one, else step 0, seeded."
    path = Path(checkpoint_dir) / "checkpoint.pt" if checkpoint_dir is not None else None
    start, history = 0, []
    if path is not None and path.exists(): start, history = load_checkpoint(path, model, student, opt, sched, config)
    else: torch.manual_seed(config.seed)
    if eval_fn is not None and start == 0: history.append(_run_eval(eval_fn, model, student, 0))
    return path, start, history


# %%
test_eq(_resume(None, model, student, opt_ck, sched_ck, cfg_ck, None), (None, 0, []))
test_eq(torch.rand(1), (torch.manual_seed(cfg_ck.seed), torch.rand(1))[1])          # seeded from config.seed
with tempfile.TemporaryDirectory() as d:
    test_eq(_resume(d, model, student, opt_ck, sched_ck, cfg_ck, probe)[1:],
            (0, [{"step": 0, "kind": "eval", "x": 1.0}]))
    save_checkpoint(Path(d)/"checkpoint.pt", model, student, opt_ck, sched_ck, cfg_ck, 3, [{"step": 3}])
    test_eq(_resume(d, model, student, opt_ck, sched_ck, cfg_ck, probe), (Path(d)/"checkpoint.pt", 3, [{"step": 3}]))


# %%
#| export
def _step_scalars(it, model, teacher, student, config: DistillConfig, i: int, autocast, device) -> dict[str, float]:
    "Run the `grad_accum` micro-batches of update i from the iterator `it`: their losses and metrics, averaged."
    sums: dict[str, float] = {}
    for _ in range(config.grad_accum):
        batch = next(it, None)
        if batch is None:
            raise ValueError(f"batches ran out during step {i + 1} of {config.steps} "
                             f"(grad_accum={config.grad_accum})")
        batch = ({k: rank_slice(v).to(device) for k, v in batch.items()} if isinstance(batch, dict)
                 else rank_slice(batch).to(device))
        scalars = _micro_step(model, teacher, student, batch, config, i, autocast)
        for k, v in scalars.items(): sums[k] = sums.get(k, 0.0) + v / config.grad_accum
    return sums


# %%
cfg2 = DistillConfig(steps=3, mode="scorer_only", grad_accum=2)
a_ = _micro_step(model, model, student, ids[:1], cfg2, 1, off)["loss"]
b_ = _micro_step(model, model, student, ids[1:], cfg2, 1, off)["loss"]
sums = _step_scalars(iter([ids[:1], ids[1:]]), model, model, student, cfg2, 1, off, torch.device("cpu"))
assert math.isclose(sums["loss"], (a_ + b_) / 2, rel_tol=1e-6)
test_fail(lambda: _step_scalars(iter([ids]), model, model, student, cfg2, 2, off, torch.device("cpu")),
          contains="batches ran out during step 3 of 3 (grad_accum=2)")
student.zero_grad(set_to_none=True)


# %%
#| export
def _train_row(i: int, sums: dict[str, float], gnorm, lrs: dict[str, float], t0: float, c0: float) -> dict:
    "The history row of update i: the scalars averaged over ranks, the gradient norm, learning rates and times."
    return dict(step=i + 1, kind="train", **_all_mean(sums),
                grad_norm=float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm),
                **lrs, seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0)


# %%
row = _train_row(4, {"loss": 0.5}, torch.tensor(2.0), {"lr_new": 1e-3}, time.perf_counter(), time.process_time())
test_eq({k: row[k] for k in ("step", "kind", "loss", "grad_norm", "lr_new")},
        {"step": 5, "kind": "train", "loss": 0.5, "grad_norm": 2.0, "lr_new": 1e-3})
assert 0 <= row["seconds"] < 60 and 0 <= row["cpu_seconds"] < 60


# %% [markdown]
# What the loop refuses before it starts:

# %%
#| export
def _check_distill_args(student, config, eval_fn, eval_every) -> None:
    if not isinstance(student, DistillStudent):
        raise TypeError(f"student must be a DistillStudent, got {type(student).__name__}")
    if not isinstance(config, DistillConfig):
        raise TypeError(f"config must be a DistillConfig, got {type(config).__name__}")
    if eval_every is not None and eval_fn is None: raise ValueError("eval_every needs an eval_fn")


# %%
_check_distill_args(student, cfg2, probe, 1)
test_fail(lambda: _check_distill_args(nn.Linear(1, 1), cfg2, None, None), contains="student must be a DistillStudent")
test_fail(lambda: _check_distill_args(student, asdict(cfg2), None, None), contains="config must be a DistillConfig")
test_fail(lambda: _check_distill_args(student, cfg2, None, 1), contains="eval_every needs an eval_fn")


# %% [markdown]
# The loop itself. Check on the tiny model: two scorer-only updates with an evaluation before and after each,
# the learning rates of the schedule, and the inputs it refuses.

# %%
#| export
def distill(model, student: DistillStudent, batches, config: DistillConfig, checkpoint_dir=None, eval_fn=None,
            eval_every: int | None = None, teacher=None, progress: bool = True) -> pd.DataFrame:
    """Train `student` (and in full mode `model`) by distillation from the dense teacher (Alg. 1); resume from
    `checkpoint_dir/checkpoint.pt` when it exists. `teacher`: default a frozen copy of `model` (full) or `model` itself
    (scorer_only). `batches`: re-iterable global batches [B, S] (`cached`: dicts of cached activations, e.g.
    `ActivationStore.batches`), `config.grad_accum` per step; a sequence resumes without reading skipped batches."""
    _check_distill_args(student, config, eval_fn, eval_every)
    full = config.mode == "full"
    if teacher is None: teacher = copy.deepcopy(model) if full else model
    teacher.requires_grad_(False)
    teacher.eval()
    if not full: model.requires_grad_(False)
    device = next(model.parameters()).device
    opt, sched = make_optimizer(model, student, config)
    trainable = [p for g in opt.param_groups for p in g["params"]]
    path, start, history = _resume(checkpoint_dir, model, student, opt, sched, config, eval_fn)
    model.train(full); student.train()
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=config.bf16 and device.type == "cuda")
    skip = start * config.grad_accum
    it = iter(batches[skip:]) if isinstance(batches, Sequence) else itertools.islice(iter(batches), skip, None)
    bar = tqdm(range(start, config.steps), initial=start, total=config.steps, desc=f"distill {config.mode}",
               disable=not progress or world()[0] != 0)
    for i in bar:
        t0, c0 = time.perf_counter(), time.process_time()
        lrs = {f"lr_{g['name']}": g["lr"] for g in opt.param_groups}
        sums = _step_scalars(it, model, teacher, student, config, i, autocast, device)
        gnorm = torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
        opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
        history.append(row := _train_row(i, sums, gnorm, lrs, t0, c0))
        bar.set_postfix(loss=f"{row['loss']:.4f}")
        if eval_fn is not None and eval_every and (i + 1) % eval_every == 0:
            history.append(_run_eval(eval_fn, model, student, i + 1))
        if path is not None and config.checkpoint_every and ((i + 1) % config.checkpoint_every == 0
                                                             or i + 1 == config.steps):
            save_checkpoint(path, model, student, opt, sched, config, i + 1, history)
    model.eval(); student.eval()
    return pd.DataFrame(history)


# %%
cfg2 = DistillConfig(steps=2, mode="scorer_only", warmup_steps=1)
h = distill(model, copy.deepcopy(student), [ids] * 2, cfg2, eval_fn=probe, eval_every=1, progress=False)
test_eq(list(zip(h.step, h.kind)), [(0, "eval"), (1, "train"), (1, "eval"), (2, "train"), (2, "eval")])
test_eq(h[h.kind == "train"].lr_new.tolist(), [new_param_lr(i, cfg2) for i in range(2)])
test_fail(lambda: distill(model, copy.deepcopy(student), [ids], cfg2, progress=False),
          contains="batches ran out during step 2 of 2")
test_fail(lambda: distill(model, nn.Linear(1, 1), [ids], cfg2), contains="student must be a DistillStudent")
test_fail(lambda: distill(model, student, [ids], cfg2, eval_every=1), contains="eval_every needs an eval_fn")


# %% [markdown]
# ### Held-out agreement with the teacher
#
# Fig. 5 of the paper follows the student's token accuracy against the teacher during training. `teacher_eval`
# stores the dense model's top-$k$ logits on held-out sequences once (before training), and returns an
# `eval_fn` giving the student's top-1 agreement with the teacher and the top-$k$ KL.
#
# Check against `eval.top1_agreement` and `eval.token_kl` computed from full logits.

# %%
#| export
def teacher_eval(model, sequences: Tensor, top_k: int = 256, batch_size: int = 1):
    "An `eval_fn(model, student)` -> {'agreement', 'kl'} on `sequences` [N, S] vs dense `model` (make before training)."
    device = next(model.parameters()).device
    chunks = sequences.split(batch_size)
    with torch.no_grad():
        teacher = [model(input_ids=c.to(device)).logits.float().topk(top_k, dim=-1) for c in chunks]

    def eval_fn(model, student) -> dict:
        agree, kl, n = 0.0, 0.0, 0
        with patch(model, student.policy()):
            for c, (tv, ti) in zip(chunks, teacher):
                z = model(input_ids=c.to(device)).logits.float()
                agree += (z.argmax(-1) == ti[..., 0]).float().sum().item()
                # renormalized on the teacher's top-k
                lt, ls = F.log_softmax(tv, -1), F.log_softmax(z.gather(-1, ti), -1)
                kl += (lt.exp() * (lt - ls)).sum().item()
                n += c.numel()
        return dict(agreement=agree / n, kl=kl / n)
    return eval_fn


# %%
ev = teacher_eval(model, ids, top_k=16)
dense_logits = model(input_ids=ids).logits.detach()
student.eval()
with patch(model, student.policy()): sparse_logits = model(input_ids=ids).logits.detach()
res = ev(model, student)
assert_close(torch.tensor(res["agreement"]), top1_agreement(sparse_logits, dense_logits).float())
assert_close(torch.tensor(res["kl"]), token_kl(sparse_logits, dense_logits, top_k=16).mean(), atol=1e-5, rtol=1e-5)


# %% [markdown]
# ## Scorer-only training on a tiny model
#
# With the base frozen, a few steps on one fixed batch must lower the retention loss of the scorers: the
# target is fixed by the frozen model (up to the mask, which the scorers change), the MLP output layer starts
# at zero (a neutral ranking) and learns. We use a larger learning rate than the paper's so that a handful of
# steps shows it, and compare the loss of the trained scorers on the same batch and boundary positions
# (`method_loss(0)` draws the step-0 positions) with the loss before training.

# %%
def retention_loss_on(model, student, ids, step=0):
    "Retention loss of `student` on `ids` at the boundary positions of `step` (no update)."
    student.train()
    with patch(model, student.policy()): model(input_ids=ids, logits_to_keep=1)
    loss, _ = student.method_loss(step)
    return loss.item()

model, tok = load_model("tiny-llama")
torch.manual_seed(0)
student = KVpopStudent.for_model(model, sink=2, window=4, k=8, n_boundaries=64)
fixed = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
before = retention_loss_on(model, student, fixed)
cfg = DistillConfig(steps=20, mode="scorer_only", new_lr=3e-2, new_lr_min=3e-3, warmup_steps=2)
hist = distill(model, student, [fixed] * cfg.steps, cfg, progress=False)
after = retention_loss_on(model, student, fixed)
train_rows = hist[hist.kind == "train"]
print(f"retention loss at step 0: {before:.4f}, after {cfg.steps} steps: {after:.4f}")
print(train_rows[["step", "retention_loss", "retention_recall", "lr_new"]].iloc[::5].to_string(index=False))
assert after < before - 0.01, (before, after)
assert not any(p.requires_grad for p in model.parameters())  # scorer-only: the base stayed frozen


# %% [markdown]
# ## Checkpoint and resume
#
# An interrupted run resumes from its last checkpoint and continues exactly: we train 6 steps in one go, and
# 3 steps + a crash (the data iterator fails when asked for batch 4) + a restart from a fresh model and
# student, and compare the trained parameters and every logged loss bit for bit.

# %%
def fresh(seed=0):
    m, _ = load_model("tiny-llama")
    torch.manual_seed(seed)
    return m, KVpopStudent.for_model(m, sink=2, window=4, k=8, n_boundaries=16)

seqs = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(2))
cfg = DistillConfig(steps=6, mode="full", warmup_steps=2, checkpoint_every=3)
data = epoch_batches(seqs, 2, cfg.steps)
m1, s1 = fresh()
straight = distill(m1, s1, data, cfg, progress=False)

def crash_after(batches, n):
    for i, b in enumerate(batches):
        if i == n: raise RuntimeError("simulated crash")
        yield b

class Restartable:
    "Iterable that crashes after `n` batches the first time it is iterated."
    def __init__(self, batches, n): self.batches, self.n, self.calls = batches, n, 0
    def __iter__(self):
        self.calls += 1
        return crash_after(self.batches, self.n) if self.calls == 1 else iter(self.batches)

with tempfile.TemporaryDirectory() as d:
    m2, s2 = fresh()
    it = Restartable(data, 3)
    test_fail(lambda: distill(m2, s2, it, cfg, checkpoint_dir=d, progress=False), contains="simulated crash")
    m2, s2 = fresh()
    resumed = distill(m2, s2, it, cfg, checkpoint_dir=d, progress=False)
cols = ["step", "loss", "kl", "retention_loss", "grad_norm", "lr_base", "lr_new"]
pd.testing.assert_frame_equal(straight[cols], resumed[cols])
for (n, a), b in zip(itertools.chain(m1.named_parameters(), s1.named_parameters()),
                     itertools.chain(m2.parameters(), s2.parameters())):
    assert torch.equal(a, b), n
print(resumed[cols].to_string(index=False))

# %% [markdown]
# A checkpoint records the config and the student's budget, and refuses a resume with another window or another
# learning rate, or with fewer steps than it has done, naming the fields. Extending the run continues on the new
# schedule: the learning rates of the resumed updates are those of `new_param_lr` for the new number of steps.

# %%
with tempfile.TemporaryDirectory() as d:
    m0, _ = load_model("tiny-llama")
    torch.manual_seed(0)
    s0 = KVpopStudent.for_model(m0, sink=2, window=4, k=8, n_boundaries=16)
    seqs0 = torch.randint(0, m0.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(3))
    cfg0 = DistillConfig(steps=2, mode="scorer_only", warmup_steps=1, checkpoint_every=1)
    distill(m0, s0, epoch_batches(seqs0, 2, 2), cfg0, checkpoint_dir=d, progress=False)
    ck = torch.load(Path(d)/"checkpoint.pt", weights_only=False)
    test_eq((ck["step"], ck["config"], ck["spec"]["student"]["settings"]["window"]), (2, asdict(cfg0), 4))
    other = KVpopStudent.for_model(m0, sink=2, window=8, k=8, n_boundaries=16)
    test_fail(lambda: distill(m0, other, epoch_batches(seqs0, 2, 2), cfg0, checkpoint_dir=d, progress=False),
              contains="student.settings.window (4 in the checkpoint, 8 now)")
    test_fail(lambda: distill(m0, s0, epoch_batches(seqs0, 2, 2), DistillConfig(**{**asdict(cfg0), "new_lr": 2e-3}),
                              checkpoint_dir=d, progress=False),
              contains="config.new_lr (0.001 in the checkpoint, 0.002 now)")
    test_fail(lambda: distill(m0, s0, epoch_batches(seqs0, 2, 1), DistillConfig(**{**asdict(cfg0), "steps": 1}),
                              checkpoint_dir=d, progress=False), contains="beyond config.steps=1")
    cfg4 = DistillConfig(**{**asdict(cfg0), "steps": 4})
    longer = distill(m0, s0, epoch_batches(seqs0, 2, 4), cfg4, checkpoint_dir=d, progress=False)
    test_eq(longer.step.tolist(), [1, 2, 3, 4])
    assert_close(torch.tensor(longer.lr_new.tolist()[2:]), torch.tensor([new_param_lr(i, cfg4) for i in (2, 3)]),
                 rtol=0, atol=0)


# %% [markdown]
# A checkpoint changed after it was written is refused before anything loads: 1 KiB zeroed in the middle (size and
# modification time kept, so no listing shows it) names the file and the digests; so does one cut short. A checkpoint
# without its digest file (an older version's) resumes with a warning; one torch cannot read, without a digest, is
# refused naming the file.

# %%
def zero_bytes(path, n=1024):
    "Zero `n` bytes in the middle of `path`, keeping its size and modification time (a silent disk error)."
    st = path.stat()
    with open(path, "r+b") as f: f.seek(st.st_size // 2); f.write(bytes(n))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


with tempfile.TemporaryDirectory() as d:
    ck = Path(d)/"checkpoint.pt"
    distill(m0, s0, epoch_batches(seqs0, 2, 2), cfg0, checkpoint_dir=d, progress=False)
    good = ck.read_bytes()
    resume = lambda: distill(m0, s0, epoch_batches(seqs0, 2, 2), cfg0, checkpoint_dir=d, progress=False)
    zero_bytes(ck)
    test_fail(resume, exc=DamagedFileError, contains=f"{ck} is damaged: its SHA-256 is")
    test_fail(resume, contains="to train from the start")
    os.truncate(ck, len(good) // 2)
    test_fail(resume, exc=DamagedFileError, contains=f"{ck} is damaged")
    ck.write_bytes(good)
    (Path(d)/"checkpoint.pt.sha256").unlink()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        resume()
    assert any("loaded unverified" in str(x.message) for x in w), [str(x.message) for x in w]
    ck.write_bytes(b"")
    test_fail(resume, exc=DamagedFileError, contains=f"{ck} cannot be read by torch.load")


# %% [markdown]
# ## Several processes: FSDP2 under `torchrun`
#
# On several devices the base model, its frozen teacher and the student are sharded with FSDP2
# (`torch.distributed.fsdp.fully_shard`): every decoder layer is one unit, then the root. The student's
# units are the modules its policy calls (`fsdp_units`: each layer's scorer and decay for KVpop), so FSDP
# gathers their parameters before the call and reduce-scatters their gradients after the backward.
# Each rank trains on its slice of the global batch; FSDP averages the gradients, so one step is the step
# of a single process on the whole batch (the retention loss averages over batch rows, except with the
# head-wise `balance` weights, which normalize over the rank's rows). On CUDA the base model keeps float32
# master weights and computes in bfloat16 with float32 gradient reductions (App. F); the student stays in
# float32 (decay and ranking in float32).

# %%
#| export
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    "The repeated blocks of a transformers model (the classes in its `_no_split_modules`)."
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers: raise ValueError(f"found no decoder layer ({sorted(names)}) in {type(model).__name__}")
    return layers


# %%
m2l, _ = load_model("tiny-llama", num_layers=2)
test_eq([type(l).__name__ for l in decoder_layers(m2l)], ["LlamaDecoderLayer"] * 2)
assert decoder_layers(m2l)[1] is m2l.model.layers[1]
test_fail(lambda: decoder_layers(nn.Linear(1, 1)), contains="found no decoder layer ([]) in Linear")


# %% [markdown]
# Sharding needs a process group, so the check records the units `fully_shard` is called on instead: every
# decoder layer, then the root, with bf16 compute and float32 reductions when asked.

# %%
#| export
def shard_model(model: nn.Module, mixed_precision: bool | None = None) -> nn.Module:
    "FSDP2-shard `model`: each decoder layer, then the root; bf16 compute with fp32 reductions on CUDA (App. F)."
    if mixed_precision is None: mixed_precision = next(model.parameters()).is_cuda
    kw = (dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
          if mixed_precision else {})
    for layer in decoder_layers(model): fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


# %%
calls, real_fully_shard = [], fully_shard
fully_shard = lambda m, **kw: calls.append((m, kw))
try:
    assert shard_model(m2l) is m2l
    shard_model(m2l, mixed_precision=True)
finally: fully_shard = real_fully_shard
assert len(calls) == 6 and all(m is want for (m, _), want in zip(calls, [*m2l.model.layers, m2l] * 2))
test_eq([kw for _, kw in calls[:3]], [{}] * 3)                     # CPU: no mixed precision by default
mp = calls[-1][1]["mp_policy"]
test_eq((mp.param_dtype, mp.reduce_dtype), (torch.bfloat16, torch.float32))


# %%
#| export
def shard_for_training(model: nn.Module, student: DistillStudent, teacher: nn.Module | None = None) -> None:
    "FSDP2 for `distill` in an initialized process group: the model, the teacher (if separate), the student's units."
    if not dist.is_initialized():
        raise RuntimeError("shard_for_training needs torch.distributed initialized (run under torchrun)")
    shard_model(model)
    if teacher is not None and teacher is not model: shard_model(teacher)
    for unit in student.fsdp_units(): fully_shard(unit)


# %%
test_fail(lambda: shard_for_training(m2l, student), exc=RuntimeError, contains="needs torch.distributed initialized")


# %% [markdown]
# The full state of an unsharded module is its state dict, detached, on the CPU:

# %%
#| export
def full_state(module: nn.Module) -> dict[str, Tensor]:
    "The full (gathered) parameters and buffers of a possibly sharded module, on the CPU, on every rank."
    sd = module.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in sd.items()}


# %%
fs = full_state(student)
test_eq(list(fs), list(student.state_dict()))
for k, v in student.state_dict().items(): assert torch.equal(fs[k], v) and not fs[k].requires_grad

# %% [markdown]
# The command line that trains a method with this loop (`python -m sparsekv.train`, or `torchrun` for
# several processes) is [its own module](09_train.ipynb): it builds the student from the method registry,
# which sits above this module.
