"""The distillation loop (with KVpop and StreamingLLM+ students): exact resume, scorer-only freezing,
FSDP2 on 2 CPU processes."""
import copy
import dataclasses
import itertools
import os
import re
import subprocess
import sys
import tempfile

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsekv.distill import (
    DistillConfig,
    distill,
    epoch_batches,
    full_state,
    new_param_lr,
    rank_slice,
    shard_for_training,
    student_spec,
)
from sparsekv.io import verify_digest
from sparsekv.kvpop.cache import random_scorers
from sparsekv.kvpop.student import KVpopStudent, SinkWindowStudent
from sparsekv.models import load_model
from sparsekv.train import main

LOSS_COLS = ["step", "loss", "kl", "method_loss", "retention_loss", "retention_recall", "grad_norm", "lr_base",
             "lr_new"]


def setup(mode="full", seed=0, steps=4, batch=4, scorer="mlp"):
    "Tiny model, a fresh KVpop student, global batches and a config (identical in every process)."
    model, _ = load_model("tiny-llama")
    torch.manual_seed(seed)
    student = KVpopStudent.for_model(model, sink=2, window=4, k=6, n_boundaries=16, scorer=scorer)
    seqs = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(seed + 1))
    cfg = DistillConfig(steps=steps, mode=mode, warmup_steps=2, new_lr=1e-2, new_lr_min=1e-3, seed=seed)
    return model, student, epoch_batches(seqs, batch, steps, seed), cfg


def test_resume_is_bit_identical():
    "6 steps straight == 3 steps, interruption, resume from the checkpoint in a fresh model, 3 more steps."
    model, student, data, cfg = setup("full", steps=6, batch=2)
    cfg.checkpoint_every = 3
    straight = distill(model, student, data, cfg, progress=False)

    def crashing():
        yield from data[:3]
        raise RuntimeError("simulated crash")

    with tempfile.TemporaryDirectory() as d:
        m2, s2, _, _ = setup("full", steps=6, batch=2)
        with pytest.raises(RuntimeError, match="simulated crash"):
            distill(m2, s2, crashing(), cfg, checkpoint_dir=d, progress=False)
        assert sorted(os.listdir(d)) == ["checkpoint.pt", "checkpoint.pt.sha256"]  # atomic: no partial file left
        m2, s2, _, _ = setup("full", steps=6, batch=2, seed=0)
        teacher = copy.deepcopy(m2)  # the teacher is the original base, not restored from the checkpoint
        with torch.no_grad():
            # the checkpoint must overwrite all of it
            for p in itertools.chain(m2.parameters(), s2.parameters()): p.add_(1.0)
        resumed = distill(m2, s2, data, cfg, checkpoint_dir=d, teacher=teacher, progress=False)
    pd.testing.assert_frame_equal(straight[LOSS_COLS], resumed[LOSS_COLS])
    for (n, a), b in zip(itertools.chain(model.named_parameters(), student.named_parameters()),
                         itertools.chain(m2.parameters(), s2.parameters())):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_scorer_only_trains_scorers_only(scorer):
    "scorer_only: the base is untouched (bitwise), the scorers change, the KL is skipped unless kl_metric."
    model, student, data, cfg = setup("scorer_only", steps=3, scorer=scorer)
    base = copy.deepcopy(model.state_dict())
    before = copy.deepcopy(student.state_dict())
    hist = distill(model, student, data, cfg, progress=False)
    assert all(torch.equal(base[k], v) for k, v in model.state_dict().items())
    assert any(not torch.equal(before[k], v) for k, v in student.state_dict().items())
    assert "kl" not in hist and "lr_base" not in hist and (hist.loss == hist.retention_loss).all()
    model, student, data, cfg = setup("scorer_only", steps=2)
    cfg.kl_metric = True
    hist = distill(model, student, data, cfg, progress=False)
    assert (hist.kl > 0).all() and (hist.loss == hist.retention_loss).all()  # a metric, not in the loss


def test_sinkwindow_student_full_mode():
    "StreamingLLM+ has no new parameters: it trains the base only, at the constant base LR; scorer_only is refused."
    model, _, data, cfg = setup("full", steps=2)
    student = SinkWindowStudent(2, 4, 6)
    base = copy.deepcopy(model.state_dict())
    hist = distill(model, student, data, cfg, progress=False)
    assert (hist.method_loss == 0).all() and (hist.lr_base == cfg.base_lr).all() and "lr_new" not in hist
    assert any(not torch.equal(base[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="nothing to train"):
        distill(model, student, data, DistillConfig(steps=1, mode="scorer_only"), progress=False)


def test_grad_accum_equals_one_big_batch():
    "2 micro-batches of 2 sequences per step == 1 batch of 4 (equal-size means; same boundary positions per step)."
    model, student, data, cfg = setup("full", steps=3, batch=4)
    distill(model, student, data, cfg, progress=False)
    m2, s2, _, _ = setup("full", steps=3, batch=4)
    cfg.grad_accum = 2
    distill(m2, s2, [half for b in data for half in b.chunk(2)], cfg, progress=False)
    for (n, a), b in zip(itertools.chain(model.named_parameters(), student.named_parameters()),
                         itertools.chain(m2.parameters(), s2.parameters())):
        # out.bias has a noise gradient (see the FSDP test)
        if n.endswith("out.bias"): assert (a - b).abs().max() <= cfg.steps * cfg.new_lr
        else: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)


def test_bad_inputs():
    model, student, data, cfg = setup("full", steps=4)
    with pytest.raises(ValueError, match="ran out"): distill(model, student, data[:2], cfg, progress=False)
    with pytest.raises(ValueError, match="mode"): DistillConfig(mode="lora")
    with pytest.raises(ValueError, match="steps"): DistillConfig(steps=0)
    with pytest.raises(TypeError, match="student"): distill(model, torch.nn.Linear(1, 1), data, cfg)
    with pytest.raises(RuntimeError, match="method_loss"): KVpopStudent(random_scorers(model), 2, 4, 6).method_loss(0)
    with pytest.raises(ValueError, match="n_boundaries"): KVpopStudent(random_scorers(model), 2, 4, 6, n_boundaries=0)


def _fsdp_worker(rank: int, world: int, tmp: str, mode: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    try:
        model, student, data, cfg = setup(mode)
        cfg.checkpoint_every = cfg.steps
        teacher = copy.deepcopy(model) if mode == "full" else model
        assert rank_slice(data[0]).shape[0] == data[0].shape[0] // world
        shard_for_training(model, student, teacher)
        hist = distill(model, student, data, cfg, teacher=teacher, checkpoint_dir=f"{tmp}/ckpt", progress=False)
        torch.save(dict(history=hist, model=full_state(model), student=full_state(student)), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["full", "scorer_only"])
def test_fsdp2_two_processes_match_one(mode):
    """FSDP2 on 2 CPU processes (gloo): identical gathered parameters on both ranks, equal to one process on the
    global batch."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_fsdp_worker, args=(2, tmp, mode), nprocs=2, start_method="fork")
        r0, r1 = (torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(2))
        ckpt = torch.load(f"{tmp}/ckpt/checkpoint.pt", weights_only=False)
    for part in ("model", "student"):
        assert r0[part].keys() == r1[part].keys()
        for k in r0[part]: assert torch.equal(r0[part][k], r1[part][k]), k
    model, student, data, cfg = setup(mode)
    single = distill(model, student, data, cfg, progress=False)
    cols = ["loss", "retention_loss", "grad_norm"] + (["kl"] if mode == "full" else [])
    torch.testing.assert_close(torch.tensor(r0["history"][cols].values), torch.tensor(single[cols].values),
                               rtol=1e-4, atol=1e-6)
    ref = dict(model=model.state_dict(), student=student.state_dict())
    for part in ("model", "student"):
        for k, v in r0[part].items():
            if k.endswith("out.bias"):
                # The pairwise loss (Eq. 7) compares two scores of one head: the score bias cancels and its gradient is
                # rounding noise, which Adam normalizes to steps of up to ~lr. Only that bound holds across reductions.
                assert (v - ref[part][k]).abs().max() <= cfg.steps * cfg.new_lr, k
            else: torch.testing.assert_close(v, ref[part][k], rtol=1e-4, atol=1e-6, msg=f"{part}.{k}")
    assert ckpt["spec"]["student"] == student_spec(student)  # no FSDP wrapper class names: resumable in one process
    for k, v in ckpt["model"].items():  # the checkpoint written under FSDP holds the same full tensors
        part, name = k.split(".", 1)
        assert torch.equal(v, r0[part][name]), k


def test_main_single_process(tmp_path):
    "The command line in one process: trains, evaluates agreement, writes history.csv and the weights."
    hist = main(["--model", "tiny-llama", "--seq-len", "32", "--steps", "2", "--batch-size", "2", "--sink", "2",
                 "--window", "4", "--k", "6", "--n-eval", "1", "--eval-every", "2", "--warmup-steps", "1",
                 "--out", str(tmp_path)])
    assert list(hist.kind) == ["eval", "train", "train", "eval"]
    trained = torch.load(tmp_path / "trained.pt")
    # scorer-only: no model weights; the student with its method and description (see test_kvpop_student)
    assert (tmp_path / "history.csv").is_file() and set(trained) == {"student", "spec"}
    assert trained["spec"]["method"] == "kvpop_mlp" and trained["spec"]["student"]["type"] == "KVpopStudent"
    assert verify_digest(tmp_path / "trained.pt", "retrain it")  # written with its digest, checked when loaded


def test_module_runs_as_a_script(tmp_path):
    "`python -m sparsekv.train`, as users and torchrun start it (not `main` imported): trains and writes its files."
    run = subprocess.run([sys.executable, "-m", "sparsekv.train", "--model", "tiny-llama", "--seq-len", "32",
                          "--steps", "2", "--batch-size", "2", "--sink", "2", "--window", "4", "--k", "6",
                          "--warmup-steps", "1", "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "trained.pt").is_file() and len((tmp_path / "history.csv").read_text().splitlines()) == 3


# --- the command line: a user error is one line, a bug keeps its traceback -------------

@pytest.mark.parametrize("args,msg", [
    (["--student", "quoka"], "--student must be a trained method, one of"),
    (["--student", "nope"], "--student must be a trained method"),
    (["--model", "tiny-llama", "--window", "0"], "window must be an int >= 1, got 0"),
    (["--model", "tiny-llama", "--sink", "-1"], "sink must be an int >= 0, got -1"),
    (["--model", "./no-such-folder"], "could not load './no-such-folder'"),
])
def test_cli_user_error_is_one_line(args, msg, capsys):
    with pytest.raises(SystemExit) as e: main(args + ["--steps", "1", "--seq-len", "16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("python -m sparsekv.train: error: ") and msg in err and "--debug" in err
    with pytest.raises((ValueError, OSError), match=re.escape(msg)):
        main(args + ["--steps", "1", "--seq-len", "16", "--debug"])


def test_cli_keeps_the_traceback_of_a_bug(monkeypatch):
    import sparsekv.train as d
    monkeypatch.setattr(d, "load_model", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"): main(["--model", "tiny-llama", "--steps", "1"])


def test_cli_as_a_process_prints_one_line(tmp_path):
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-m", "sparsekv.train", "--student", "quoka"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        res.stderr.strip()] and "--student must be a trained method" in res.stderr, res.stderr


# --- checkpoints answer for one run only ------------------------------------------------------

def _checkpointed(d, mode="scorer_only", steps=2, **student_kw):
    "Train `steps` steps with a checkpoint in `d`; return the setup's model, data and config."
    model, _, data, cfg = setup(mode, steps=steps)
    torch.manual_seed(0)
    student = KVpopStudent.for_model(model, **{**dict(sink=2, window=4, k=6, n_boundaries=16), **student_kw})
    cfg.checkpoint_every = 1
    distill(model, student, data, cfg, checkpoint_dir=d, progress=False)
    return model, data, cfg


def test_checkpoint_stores_full_config_and_student_budget(tmp_path):
    model, data, cfg = _checkpointed(tmp_path)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["config"] == dataclasses.asdict(cfg)
    spec = ckpt["spec"]["student"]
    st = spec["settings"]
    assert spec["type"] == "KVpopStudent" and (st["sink"], st["window"], st["k"]) == (2, 4, 6)
    assert ckpt["spec"]["model"]["config"]["num_hidden_layers"] == model.config.num_hidden_layers


@pytest.mark.parametrize("change,field", [
    (dict(window=8), "student.settings.window"),
    (dict(k=5), "student.settings.k"),
    (dict(scorer="mlstm"), "student.modules"),
    (dict(config=dict(new_lr=5e-3)), "config.new_lr"),
    (dict(config=dict(base_lr=1e-4)), "config.base_lr"),
    (dict(config=dict(seed=1)), "config.seed"),
    (dict(config=dict(warmup_steps=1)), "config.warmup_steps"),
    # same architecture, other weights: allowed in scorer_only (the base is not in the checkpoint)
    (dict(model=dict(seed=3)), None),
    (dict(model=dict(num_layers=3)), "model.config.num_hidden_layers"),
])
def test_resume_refuses_another_run(tmp_path, change, field):
    "Another budget, scorer type, learning rate or model: refused with an error naming the field, before any training."
    _checkpointed(tmp_path)
    model, _ = load_model("tiny-llama", **change.get("model", {}))
    torch.manual_seed(0)
    kw = {k: v for k, v in change.items() if k not in ("config", "model")}
    student = KVpopStudent.for_model(model, **{**dict(sink=2, window=4, k=6, n_boundaries=16), **kw})
    _, _, data, cfg = setup("scorer_only", steps=2)
    cfg = DistillConfig(**{**dataclasses.asdict(cfg), "checkpoint_every": 1, **change.get("config", {})})
    if field is None:
        distill(model, student, data, cfg, checkpoint_dir=tmp_path, progress=False)
        return
    with pytest.raises(ValueError, match=f"belongs to another run.*{re.escape(field)}"):
        distill(model, student, data, cfg, checkpoint_dir=tmp_path, progress=False)


def test_resume_refuses_other_mode_and_checkpoint_beyond_steps(tmp_path):
    model, data, cfg = _checkpointed(tmp_path, steps=3)
    student = KVpopStudent.for_model(model, sink=2, window=4, k=6, n_boundaries=16)
    with pytest.raises(ValueError, match=r"config.mode \('scorer_only' in the checkpoint, 'full' now\)"):
        distill(model, student, data, dataclasses.replace(cfg, mode="full"), checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="at step 3, beyond config.steps=2"):
        distill(model, student, data, dataclasses.replace(cfg, steps=2), checkpoint_dir=tmp_path, progress=False)


def test_resume_refuses_checkpoint_without_description(tmp_path):
    _checkpointed(tmp_path)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    del ckpt["spec"]
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    (tmp_path / "checkpoint.pt.sha256").unlink()  # an older version wrote neither the description nor the digest
    model, student, data, cfg = setup("scorer_only", steps=2)
    with pytest.raises(ValueError, match="older version"), pytest.warns(UserWarning, match="loaded unverified"):
        distill(model, student, data, cfg, checkpoint_dir=tmp_path, progress=False)


def test_extending_steps_resumes_on_the_new_schedule(tmp_path):
    """steps 2 -> 5: the run resumes at step 2 and its learning rates follow the schedule of 5 steps from the first
    resumed update."""
    model, _, cfg = _checkpointed(tmp_path, mode="full", steps=2)
    longer = dataclasses.replace(cfg, steps=5)
    m2, s2, data, _ = setup("full", steps=5)
    hist = distill(m2, s2, data, longer, checkpoint_dir=tmp_path, progress=False)
    assert hist.step.tolist() == [1, 2, 3, 4, 5]
    assert hist.lr_new.tolist()[2:] == pytest.approx([new_param_lr(i, longer) for i in (2, 3, 4)], rel=1e-12, abs=0)
    assert (hist.lr_base == cfg.base_lr).all()

