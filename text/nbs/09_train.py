# %% [markdown]
# # Training from the command line
#
# > `python -m sparsekv.train --student kvpop_mlp ...`: any trained method of the registry, distilled by `sparsekv.distill`, in one process or under `torchrun`.

# %%
#| default_exp train

# %% [markdown]
# `main` is the command line: `torchrun --nproc_per_node N -m sparsekv.train --model ... --steps ...`
# (or plain `python -m sparsekv.train` for one process). It builds the student of a trained method
# (`sparsekv.methods`: KVpop-MLP, KVpop-mLSTM, StreamingLLM+, DMS) at the budget sink + window + k,
# trains it with [the distillation loop](06_distill.ipynb) on packed prose sequences
# (`data.packed_sequences`, train split), evaluates agreement with the teacher on held-out ones, and
# writes the history CSV and the trained student (and model, in full mode) to `--out`, the student
# with its method's name and `student_spec`, so that loading it into another method fails clearly
# (`kvpop.student.check_trained`). `tests/test_distill.py` runs two CPU processes with the `gloo`
# backend and compares them with one process on the same global batches. A mistake in the arguments
# or files (an unknown method or model, a budget out of range) prints one line, as argparse does for an
# unknown option; `--debug` shows its traceback.

# %%
#| export
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from sparsekv import methods
from sparsekv.data import packed_sequences
from sparsekv.distill import (
    DistillConfig,
    distill,
    epoch_batches,
    full_state,
    shard_for_training,
    student_spec,
    teacher_eval,
    world,
)
from sparsekv.io import atomic_path_with_digest, write_csv
from sparsekv.models import load_model

# %%
#| export
# the CLI's earlier names
STUDENT_ALIASES = {"kvpop": "kvpop_mlp", "kvpop-mlstm": "kvpop_mlstm", "sinkwindow": "streaming_llm_plus"}

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparsekv.train",
                                description="KVpop distillation (torchrun for several processes)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--student", default="kvpop_mlp",
                   help="a trained method of sparsekv.methods (kvpop_mlp, kvpop_mlstm, streaming_llm_plus, dms; "
                   "also the earlier names kvpop, kvpop-mlstm, sinkwindow), at budget sink + window + k")
    p.add_argument("--mode", default="scorer_only", choices=("full", "scorer_only"),
                   help="(training from cached activations: sparsekv.kvpop.offline.train_offline)")
    for name, default in [("--sink", 4), ("--window", 64), ("--k", 192), ("--seq-len", 1024)]:
        p.add_argument(name, type=int, default=default)
    p.add_argument("--batch-size", type=int, default=2, help="global batch (split over ranks)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches of --batch-size per step")
    p.add_argument("--n-train", type=int, default=None, help="training sequences (default: steps * batch size)")
    p.add_argument("--n-eval", type=int, default=0, help="held-out sequences for the agreement curve (0: none)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--new-lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="folder for history.csv, the checkpoint and the trained weights")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error in the arguments or files")
    return p.parse_args(argv)


# %%
a = parse_args(["--student", "kvpop", "--seq-len", "32"])
assert (a.student, a.seq_len, a.sink, a.window, a.k, a.mode) == ("kvpop", 32, 4, 64, 192, "scorer_only")
assert STUDENT_ALIASES[a.student] in methods.names()


# %%
#| export
def _build(a: argparse.Namespace, device: torch.device):
    "The model, the student, the training sequences and the evaluation (or None) that `a` asks for."
    name = STUDENT_ALIASES.get(a.student, a.student)
    trained = [n for n in methods.names() if hasattr(methods.get(n), "student")]
    if name not in trained: raise ValueError(f"--student must be a trained method, one of {trained}, got {a.student!r}")
    method = methods.make(name, budget=a.sink + a.window + a.k, sink=a.sink, window=a.window)
    model, tok = load_model(a.model, device=device)
    n_train = a.n_train or a.steps * a.grad_accum * a.batch_size
    seqs = packed_sequences(tok, a.seq_len, "train", n=n_train, seed=a.seed)
    eval_fn = teacher_eval(model, packed_sequences(tok, a.seq_len, "validation", n=a.n_eval)) if a.n_eval else None
    torch.manual_seed(a.seed)
    return name, model, method.student(model, seed=a.seed, seq_len=a.seq_len, steps=a.steps), seqs, eval_fn


# %%
args = parse_args(["--model", "tiny-llama", "--seq-len", "32", "--steps", "2",
                   "--sink", "2", "--window", "4", "--k", "6"])
name, model, student, seqs, eval_fn = _build(args, torch.device("cpu"))
assert name == "kvpop_mlp" and seqs.shape == (4, 32) and eval_fn is None and type(student).__name__ == "KVpopStudent"


# %%
#| export
def train_from_args(a: argparse.Namespace) -> pd.DataFrame:
    "Train as `main`'s parsed arguments say; under torchrun (WORLD_SIZE > 1) with FSDP2, nccl on CUDA, gloo on CPU."
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = torch.device(a.device)
    if distributed:
        if device.type == "cuda": device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        name, model, student, seqs, eval_fn = _build(a, device)
        config = DistillConfig(steps=a.steps, mode=a.mode, new_lr=a.new_lr, new_lr_min=min(8e-5, a.new_lr),
                               warmup_steps=a.warmup_steps, grad_accum=a.grad_accum,
                               checkpoint_every=a.checkpoint_every, seed=a.seed)
        teacher = copy.deepcopy(model) if config.mode == "full" else model
        if distributed: shard_for_training(model, student, teacher)
        out = Path(a.out) if a.out else None
        history = distill(model, student, epoch_batches(seqs, a.batch_size, a.steps * a.grad_accum, a.seed), config,
                          checkpoint_dir=out if a.checkpoint_every else None, eval_fn=eval_fn, eval_every=a.eval_every,
                          teacher=teacher)
        weights = dict(student=full_state(student), spec=dict(method=name, student=student_spec(student)),
                       **({"model": full_state(model)} if config.mode == "full" else {}))
        if out is not None and world()[0] == 0:
            write_csv(out / "history.csv", history)
            with atomic_path_with_digest(out / "trained.pt") as tmp: torch.save(weights, tmp)
        return history
    finally:
        if distributed: dist.destroy_process_group()


# %%
import tempfile

with tempfile.TemporaryDirectory() as d:
    hist = train_from_args(parse_args(["--model", "tiny-llama", "--seq-len", "32", "--steps", "2", "--sink", "2",
                                       "--window", "4", "--k", "6", "--warmup-steps", "1", "--out", d]))
    assert list(hist.kind) == ["train", "train"] and set(torch.load(Path(d)/"trained.pt")) == {"student", "spec"}

# %% [markdown]
# Each mistake gives one line naming it and exit status 2, no traceback; with `--debug`, the error itself:

# %%
#| export
# the errors of bad arguments or files (a missing model, a wrong budget): one line, no traceback
USER_ERRORS = (ValueError, TypeError, OSError)

def main(argv=None) -> pd.DataFrame:
    """Command-line training (see `parse_args`): the history. An error in the arguments or files (`USER_ERRORS`) prints
    one line and exits with status 2 (with `--debug`: raised, with its traceback); any other error is raised."""
    a = parse_args(argv)
    try: return train_from_args(a)
    except USER_ERRORS as e:
        if a.debug: raise
        print(f"python -m sparsekv.train: error: {e} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


# %%
import contextlib
import io

from fastcore.test import test_eq, test_fail

for args, said in [(["--student", "quoka"], "--student must be a trained method"),
                   (["--model", "tiny-llama", "--window", "0"], "window must be an int >= 1, got 0"),
                   (["--model", "./no-such-folder"], "could not load './no-such-folder'")]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err): test_fail(lambda: main(args + ["--steps", "1"]), exc=SystemExit)
    test_eq(err.getvalue().count("\n"), 1)
    assert err.getvalue().startswith("python -m sparsekv.train: error: ") and said in err.getvalue(), err.getvalue()
test_fail(lambda: main(["--student", "quoka", "--debug"]), contains="--student must be a trained method")

# %% [markdown]
# Run as `python -m sparsekv.train`, this file is the module `__main__`, a second copy of
# `sparsekv.train`: the entry point calls the package's `main`, so that every class it meets is the
# package's own.

# %%
#| export
#| eval: false
if __name__ == "__main__":
    from sparsekv.train import main as package_main
    package_main()
