"""A bad-input sweep the team can rerun: every bad input the team has met and the plain validations of the public API.

Each case declares its expected outcome: `error` (an exception type and a regex that names the argument or the
problem) or `right` (the case returns `(got, want)`, `want` from an independent reference: the dense, unpadded,
single-row or stateless run, or a brute force). Pytest runs each case; as a script,

    OMP_NUM_THREADS=1 .venv/bin/python tests/test_bad_input_sweep.py

classifies every case as clear error / right answer / unclear error (an unexpected exception, or a message that does
not name the problem) / silently wrong (no error where one is due, or an answer unlike the reference), and prints
the counts and the cases that did not pass. The focused regression tests live beside their modules (named in the
comments); a case here is the smallest call that shows the behaviour.
"""
import contextlib
import functools
import io
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable
from unittest import mock

import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # conftest's tiny models when run as a script
from conftest import _load_tiny  # noqa: E402

from sparsekv import (
    methods,  # noqa: E402
    models,  # noqa: E402
)
from sparsekv import reproduce as rp  # noqa: E402
from sparsekv.attention import attention_reference, check_int  # noqa: E402
from sparsekv.cache import SinkWindowCache  # noqa: E402
from sparsekv.distill import DistillConfig, distill, epoch_batches  # noqa: E402
from sparsekv.eval import kl_to_teacher, run_grid  # noqa: E402
from sparsekv.hf import DensePolicy, chunked_prefill, patch  # noqa: E402
from sparsekv.io import DamagedFileError, atomic_path_with_digest  # noqa: E402
from sparsekv.kvpop import student as student_module  # noqa: E402
from sparsekv.kvpop.cache import KVpopCache, KVpopPolicy, random_scorers  # noqa: E402
from sparsekv.kvpop.cutoff import topk_cutoff, topk_cutoff_reference  # noqa: E402
from sparsekv.kvpop.mask import kvpop_mask, kvpop_mask_reference  # noqa: E402
from sparsekv.kvpop.student import KVpopMLP, KVpopMLSTM, KVpopStudent, StreamingLLMPlus  # noqa: E402
from sparsekv.kvpop.target import future_attention_target  # noqa: E402
from sparsekv.models import load_model  # noqa: E402
from sparsekv.oval.basis import page_basis, page_basis_reference  # noqa: E402
from sparsekv.oval.pages import PageRetrievalPolicy  # noqa: E402
from sparsekv.protocol import fit_budget  # noqa: E402
from sparsekv.quoka.policy import QuokaPolicy  # noqa: E402
from sparsekv.quoka.select import quoka_select, quoka_select_reference, unit_keys  # noqa: E402
from sparsekv.select import resolve_budget  # noqa: E402
from sparsekv.train import main as distill_main  # noqa: E402

CLEAR, RIGHT, UNCLEAR, WRONG = "clear error", "right answer", "unclear error", "silently wrong"


@dataclass
class Case:
    "One input: `run()` raises (expect 'error': `exc` whose message matches `match`) or returns (got, want)."
    name: str
    item: str                          # where it comes from: a case met in use, or the API's validation
    expect: str                        # 'error' or 'right'
    run: Callable
    exc: type | tuple = ()
    match: str = ""
    atol: float = 0.0                  # 'right': tolerance of the comparison (0: exactly equal)


CASES: dict[str, Case] = {}


def error(item: str, exc, match: str):
    "Register the decorated function as a case that must raise `exc` with a message matching `match`."
    def deco(fn):
        CASES[fn.__name__] = Case(fn.__name__, item, "error", fn, exc, match)
        return fn
    return deco


def right(item: str, atol: float = 0.0):
    "Register the decorated function, returning (got, want), as a case that must give the reference's answer."
    def deco(fn):
        CASES[fn.__name__] = Case(fn.__name__, item, "right", fn, atol=atol)
        return fn
    return deco


def differs(got, want, atol: float) -> str | None:
    "Why `got` is not `want` (tensors within `atol`, containers element by element), or None."
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))}, want shape {tuple(want.shape)}"
        if got.dtype == torch.bool or not got.is_floating_point(): ok = torch.equal(got, want)
        else: ok = torch.allclose(got.double(), want.double(), rtol=0, atol=atol, equal_nan=False)
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        return None if ok else f"tensors differ (max abs diff {diff:.3g}, atol {atol})"
    if isinstance(want, pd.DataFrame):
        return None if isinstance(got, pd.DataFrame) and got.equals(want) else f"frames differ:\n{got}\nwant\n{want}"
    if isinstance(want, (tuple, list)):
        if len(got) != len(want): return f"got {len(got)} items, want {len(want)}"
        return next((f"[{i}] {d}" for i, (g, w) in enumerate(zip(got, want)) if (d := differs(g, w, atol))), None)
    return None if got == want else f"got {got!r}, want {want!r}"


def classify(case: Case) -> tuple[str, str]:
    "(outcome, detail) of running `case`."
    try:
        out = case.run()
    except Exception as e:  # noqa: BLE001 the point is to see every kind of failure
        msg = f"{type(e).__name__}: {e}"
        if case.expect == "error" and isinstance(e, case.exc) and re.search(case.match, str(e)): return CLEAR, ""
        return UNCLEAR, msg[:400]
    if case.expect == "error": return WRONG, f"no error (returned {type(out).__name__})"
    why = differs(*out, case.atol)
    return (RIGHT, "") if why is None else (WRONG, why)


# --- shared inputs ---------------------------------------------------------------------------------------------

@functools.cache
def tiny(key: str = "llama"):
    "A tiny float32 model of conftest (built once per sweep; cases do not change its weights)."
    return _load_tiny(key)


def ids(B, S, seed):
    return torch.randint(3, 250, (B, S), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def generate(model, prompt, policy=None, mask=None, n=6, beams=1, cache=None):
    "Greedy (or beam) generation under `policy`: (sequences, scores [steps, B*beams, V])."
    mask = torch.ones_like(prompt) if mask is None else mask
    with torch.no_grad(), (patch(model, policy) if policy is not None else contextlib.nullcontext()):
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=n, num_beams=beams, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_scores=True, past_key_values=cache)
    return out.sequences, torch.stack(out.scores)


def padded_vs_alone(make_policy, n=8, pad=4, long=17):
    "Row 1 of a batch left-padded by `pad` against the same prompt alone: (its new tokens and scores, alone's)."
    model, short = tiny(), ids(1, long - pad, 31)
    batch = torch.cat([ids(1, long, 30), torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    seq, scores = generate(model, batch, make_policy(), mask, n)
    seq1, scores1 = generate(model, short, make_policy(), None, n)
    return (seq[1, long:], scores[:, 1]), (seq1[0, long - pad:], scores1[:, 0])


class RebuiltPages(PageRetrievalPolicy):
    "The stateless reference of page retrieval: summaries rebuilt from the cache at every call (as test_oval_pages)."
    def summary(self, k, v, ctx):
        self.summaries.pop(ctx.layer_idx, None)
        return super().summary(k, v, ctx)


PAGES = dict(token_budget=12, page_size=4, sink=4, recent=4, rank=2)


# --- item 1: beam search keeps the state beside the cache in step (test_quoka_policy, test_oval_pages,
#     test_kvpop_cache::test_batch_operations_move_the_scorer_state) ---------------------------------------------

@right("1 beam search", atol=1e-5)
def beam_quoka_unit_keys():
    prompt = ids(1, 17, 8)
    return (generate(tiny(), prompt, QuokaPolicy(n_q=3, budget=5), beams=3),
            generate(tiny(), prompt, QuokaPolicy(n_q=3, budget=5, cache_unit_keys=False), beams=3))


@right("1 beam search", atol=1e-5)
def beam_oval_page_summaries():
    prompt = ids(1, 13, 5)
    return (generate(tiny(), prompt, PageRetrievalPolicy("oval", **PAGES), n=12, beams=3),
            generate(tiny(), prompt, RebuiltPages("oval", **PAGES), n=12, beams=3))


@right("1 beam search", atol=1e-5)
def beam_quest_page_summaries():
    prompt = ids(1, 13, 5)
    return (generate(tiny(), prompt, PageRetrievalPolicy("quest", **PAGES), n=12, beams=3),
            generate(tiny(), prompt, RebuiltPages("quest", **PAGES), n=12, beams=3))


@right("1 beam search", atol=1e-5)
def beam_kvpop_mlstm_reorder_cache():
    "reorder_cache mid-decode equals a cache fed the reordered rows from the start (mLSTM state and queue)."
    model, x = tiny(), ids(3, 14, 6)
    scorers = random_scorers(model, seed=2, kind="mlstm", delay=3)
    moved, ref = KVpopCache(scorers, 1, 3, 3), KVpopCache(scorers, 1, 3, 3)
    order, got, want = torch.tensor([2, 0, 1]), [], []
    with torch.no_grad(), patch(model, KVpopPolicy()):
        for t in range(x.shape[1]):
            if t == 8: moved.reorder_cache(order)
            got.append(model(x[order if t >= 8 else slice(None), t:t + 1], past_key_values=moved).logits)
            want.append(model(x[order, t:t + 1], past_key_values=ref).logits)
    return torch.cat(got[8:], 1), torch.cat(want[8:], 1)


@right("1 beam search", atol=1e-5)
def beam_sink_window_cache_equals_plain():
    prompt = ids(1, 7, 12)
    return generate(tiny(), prompt, DensePolicy(), beams=3, cache=SinkWindowCache(1, 64)), generate(
        tiny(), prompt, beams=3)


# --- item 2: padded batches equal each row alone (being fixed with the padded-batch work in 03/04/05, 21/22, 31/32)

@right("2 padded batch", atol=1e-4)
def padded_quoka_policy():
    return padded_vs_alone(lambda: QuokaPolicy(n_q=3, budget=5))


for _method in ("quest", "arkvale", "keypca", "oval", "oracle"):
    def _padded(method=_method):
        return padded_vs_alone(lambda: PageRetrievalPolicy(method, **PAGES), n=12)
    _padded.__name__ = f"padded_pages_{_method}"
    right("2 padded batch", atol=1e-4)(_padded)


@right("2 padded batch", atol=1e-5)
def padded_chunked_prefill_dense():
    model, short = tiny(), ids(1, 9, 41)
    batch = torch.cat([ids(1, 13, 40), torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    return chunked_prefill(model, batch, 4, attention_mask=mask)[1][1], chunked_prefill(model, short, 4)[1][0]


@right("2 padded batch", atol=1e-4)
def padded_dense_generate():
    return padded_vs_alone(lambda: DensePolicy())


# --- item 3: stale results (test_eval::test_grid_params_are_part_of_the_key, test_distill resume tests) -----------

def _grid_fn(c):
    return {"acc": c["budget"] * c.get("window", 1) / 1000}


@right("3 stale results")
def grid_changed_window_recomputes():
    cells = [{"budget": b} for b in (2, 4)]
    with tempfile.TemporaryDirectory() as d:
        run_grid(cells, lambda c: {"acc": c["budget"] * 4 / 1000}, Path(d) / "g.csv", params={"window": 4})
        got = run_grid(cells, lambda c: {"acc": c["budget"] * 8 / 1000}, Path(d) / "g.csv", params={"window": 8})
        want = run_grid(cells, lambda c: {"acc": c["budget"] * 8 / 1000}, Path(d) / "fresh.csv", params={"window": 8})
    return got.acc.tolist(), want.acc.tolist()


@functools.cache
def _trained_checkpoint():
    "A 2-step scorer-only run of the tiny Llama with a checkpoint (its folder lives as long as the sweep)."
    d = tempfile.mkdtemp(prefix="sweep-distill-")
    model = tiny()
    torch.manual_seed(0)
    student = KVpopStudent.for_model(model, sink=2, window=4, k=6, n_boundaries=8)
    seqs = ids(4, 24, 3)
    cfg = DistillConfig(steps=2, mode="scorer_only", warmup_steps=1, checkpoint_every=1)
    distill(model, student, epoch_batches(seqs, 2, 2), cfg, checkpoint_dir=d, progress=False)
    return d, seqs, cfg


def _resume(window=4, scorer="mlp", **config):
    d, seqs, cfg = _trained_checkpoint()
    student = KVpopStudent.for_model(tiny(), sink=2, window=window, k=6, n_boundaries=8, scorer=scorer)
    cfg = DistillConfig(**{**cfg.__dict__, **config})
    return distill(tiny(), student, epoch_batches(seqs, 2, cfg.steps), cfg, checkpoint_dir=d, progress=False)


@error("3 stale results", ValueError, r"student\.settings\.window \(4 in the checkpoint, 8 now\)")
def resume_with_another_window():
    _resume(window=8)


@error("3 stale results", ValueError, r"config\.new_lr \(0\.001 in the checkpoint, 0\.002 now\)")
def resume_with_another_learning_rate():
    _resume(new_lr=2e-3)


@error("3 stale results", ValueError, r"beyond config\.steps=1")
def resume_checkpoint_beyond_steps():
    _resume(steps=1)


@error("3 stale results", ValueError, r"student\.modules\.\S+ \('MLPScorer' in the checkpoint, 'MLSTMScorer' now\)")
def resume_with_another_scorer_type():
    _resume(scorer="mlstm")


# --- item 4: damaged results files (test_eval::test_grid_damaged_row_is_recomputed and its neighbours) ------------

def _damaged_grid(edit):
    cells = [{"method": m, "budget": b} for m in ("a", "b") for b in (256, 512)]
    fn = lambda c: {"acc": c["budget"] / 1000}  # noqa: E731
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.csv"
        run_grid(cells, fn, path)
        lines = path.read_text().splitlines()
        path.write_text("\n".join(edit(lines)) + "\n")
        with warnings.catch_warnings():  # a damaged row is announced by a warning
            warnings.simplefilter("ignore")
            got = run_grid(cells, fn, path)
        return got[["method", "budget", "acc"]].to_dict("records"), [{**c, "acc": c["budget"] / 1000} for c in cells]


@right("4 damaged results")
def grid_row_cut_short():
    return _damaged_grid(lambda ls: ls[:2] + [ls[2].rsplit(",", 2)[0]] + ls[3:])


@right("4 damaged results")
def grid_row_with_extra_field():
    return _damaged_grid(lambda ls: ls[:2] + [ls[2] + ",surplus"] + ls[3:])


@right("4 damaged results")
def grid_key_rewritten_as_float():
    return _damaged_grid(lambda ls: ls[:2] + [ls[2].replace(",512,", ",512.0,", 1)] + ls[3:])


@error("4 damaged results", ValueError, r"g\.csv has no valid header line")
def grid_lost_header():
    _damaged_grid(lambda ls: ls[1:])


@error("4 damaged results", ValueError, r"cannot read the grid results file .*g\.csv")
def grid_unreadable_file():
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "g.csv").write_bytes(b"\xff\xfe\x00garbage\x00\x81")
        run_grid([{"x": 1}], lambda c: {"m": 1.0}, Path(d) / "g.csv")


# --- item 5: stage bookkeeping (test_reproduce: killed forced stage, --only and Ctrl-C, SIGTERM, unique names) ----

def _toy_pipeline(root: Path) -> Path:
    "Two one-output stages writing the content of `root/run_id` (as test_reproduce.toy_project, without a kernel)."
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook
    (root / "reproduce").mkdir()
    lines = ["stages:"]
    for name in ("a", "b"):
        body = (f"from pathlib import Path\nPath(fig_dir, '{name}.txt').write_text("
                "open(Path(fig_dir).parent.parent / 'run_id').read())")
        nb = new_notebook(cells=[new_code_cell("#| parameters\nprofile = 'quick'\nfig_dir = out_dir = '.'\nn = 1"),
                                 new_code_cell(body)])
        nbformat.write(nb, root / "reproduce" / f"{name}.ipynb")
        lines += [f"  {name}:", f"    notebook: reproduce/{name}.ipynb",
                  "    params: {quick: {n: 1}, cpu: {n: 1}, gpu: {n: 1}}",
                  f"    outputs: ['figures/{{profile}}/{name}.txt']"]
    (root / "reproduce" / "pipeline.yaml").write_text("\n".join(lines) + "\n")
    return root / "reproduce" / "pipeline.yaml"


def _fake_papermill(src, dest, parameters=None, cwd=None, **kw):
    "Run a toy notebook's cells in this process (no kernel: the sweep stays fast), its parameters after the first."
    import nbformat
    nb = nbformat.read(src, as_version=4)
    env, here = {}, os.getcwd()
    os.chdir(cwd or here)
    try:
        for i, cell in enumerate(nb.cells):
            exec(cell.source, env)  # noqa: S102 the toy notebooks above
            if i == 0: env.update(parameters or {})
    finally: os.chdir(here)
    nbformat.write(nb, dest)
    return nb


@contextlib.contextmanager
def _toy_project_run():
    "A toy project in a temporary folder whose two stages ran once (run id 'first'), papermill run in-process."
    import papermill
    with tempfile.TemporaryDirectory() as d, mock.patch.object(papermill, "execute_notebook", _fake_papermill):
        root = Path(d)
        (root / "run_id").write_text("first")
        pipe = _toy_pipeline(root)
        rp.run_pipeline("quick", pipeline=pipe, progress=False)
        yield root, pipe


@right("5 stage bookkeeping")
def only_b_keeps_a_up_to_date():
    with _toy_project_run() as (root, pipe):
        (root / "run_id").write_text("second")
        status = rp.run_pipeline("quick", only="b", force=True, pipeline=pipe, progress=False)
        summary = (root / "reproduce" / "runs" / "quick" / "summary.md").read_text()
        a_row = next(line for line in summary.splitlines() if line.startswith("| a |"))
        outputs = [(root / "figures" / "quick" / f"{n}.txt").read_text() for n in "ab"]
    return (a_row.split("|")[2].strip().startswith("up to date"), status["b"].startswith("ran"), outputs), (
        True, True, ["first", "second"])


@right("5 stage bookkeeping")
def forced_stage_killed_is_redone_on_rerun():
    "A forced stage that fails after its stamp was invalidated runs again on a plain rerun: one run's outputs."
    with _toy_project_run() as (root, pipe):
        (root / "run_id").unlink()  # the forced run of a dies before writing its output
        with contextlib.suppress(rp.StageFailed):
            rp.run_pipeline("quick", only="a", force=True, pipeline=pipe, progress=False)
        (root / "run_id").write_text("third")
        status = rp.run_pipeline("quick", pipeline=pipe, progress=False)
        out = (root / "figures" / "quick" / "a.txt").read_text()
    return (status["a"].startswith("ran"), out), (True, "third")


@right("5 stage bookkeeping")
def ctrl_c_keeps_older_outputs_up_to_date():
    "Ctrl-C in the first stage of a forced run: the other stage's valid older outputs stay up to date in the summary."
    with _toy_project_run() as (root, pipe):

        def interrupted(stage, *args, **kwargs): raise KeyboardInterrupt
        with mock.patch.object(rp, "run_stage", interrupted), contextlib.suppress(KeyboardInterrupt):
            rp.run_pipeline("quick", force=True, pipeline=pipe, progress=False)
        summary = (root / "reproduce" / "runs" / "quick" / "summary.md").read_text()
        b_row = next(line for line in summary.splitlines() if line.startswith("| b |")).split("|")[2].strip()
        b_state = rp.stage_state(rp.load_stages(pipe, "quick")[1], root, "quick")
    return (b_row.split(" (")[0], b_state.split(" (")[0]), ("up to date", "up to date")


@right("5 stage bookkeeping")
def temporary_notebooks_unique_per_run():
    import papermill
    seen = []

    def recording(src, dest, **kw):
        seen.append((Path(src).name, Path(dest).name))
        return _fake_papermill(src, dest, **kw)
    with tempfile.TemporaryDirectory() as d, mock.patch.object(papermill, "execute_notebook", recording):
        (Path(d) / "run_id").write_text("x")
        pipe = _toy_pipeline(Path(d))
        for _ in range(2): rp.run_pipeline("quick", only="a", force=True, pipeline=pipe, progress=False)
        left = list((Path(d) / "reproduce" / "runs" / "quick").glob(".*.ipynb"))
    return (len(set(seen)), left), (2, [])


# SIGTERM cleaned up like Ctrl-C needs a process of its own: test_reproduce::test_sigterm_cleans_up_like_ctrl_c


# --- item 6: non-finite input (test_attention, test_kvpop_target, test_eval, test_oval_basis) ------------------

@error("6 non-finite", ValueError, r"\bq contains NaN")
def nan_in_q_attention_reference():
    q = randn(1, 2, 4, 8).index_fill(2, torch.tensor([1]), math.nan)
    attention_reference(q, randn(1, 2, 4, 8, seed=1), randn(1, 2, 4, 8, seed=2))


@error("6 non-finite", ValueError, r"\bk contains NaN or inf")
def inf_in_k_future_attention_target():
    k = randn(1, 2, 8, 8, seed=1).index_fill(2, torch.tensor([3]), math.inf)
    future_attention_target(randn(1, 2, 8, 8), k, 2)


@error("6 non-finite", ValueError, r"student_logits contains NaN")
def nan_in_kl_to_teacher():
    kl_to_teacher(randn(2, 3, 10).index_fill(1, torch.tensor([0]), math.nan), randn(2, 3, 10, seed=1))


@error("6 non-finite", ValueError, r"\bK contains NaN or inf")
def nan_in_page_basis():
    page_basis(randn(2, 8, 16).index_fill(-2, torch.tensor([2]), math.nan), randn(2, 8, 16, seed=1))


# --- item 7: contracts (test_attention, test_kvpop_mask, test_oval_pages, test_hf, test_reproduce) ---------------

@error("7 contracts", ValueError, r"Sq.*Sk|more queries than keys")
def more_queries_than_keys():
    attention_reference(randn(1, 2, 6, 8), randn(1, 2, 4, 8, seed=1), randn(1, 2, 4, 8, seed=2))


@error("7 contracts", ValueError, r"sink|window")
def kvpop_mask_ranks_for_another_sink():
    rank, cutoff = topk_cutoff(randn(1, 2, 12), 3, 2, 4)
    kvpop_mask(rank, cutoff, 1, 4)


@error("7 contracts", ValueError, r"rank")
def kvpop_mask_negative_ranks():
    rank, cutoff = topk_cutoff(randn(1, 2, 12), 3, 2, 4)
    kvpop_mask(rank - 20, cutoff, 2, 4)


@error("7 contracts", ValueError, r"eta must be")
def page_retrieval_eta_out_of_range():
    PageRetrievalPolicy("oval", 64, eta=2.0)


@error("7 contracts", ValueError, r"chunk_size must be an int >= 1")
def chunk_size_true():
    chunked_prefill(tiny(), ids(1, 6, 1), True)


@error("7 contracts", ValueError, r"pipeline\.yaml.*empty|empty.*pipeline\.yaml")
def empty_pipeline_file():
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "pipeline.yaml").write_text("")
        rp.load_stages(Path(d) / "pipeline.yaml", "quick")


@error("7 contracts", ValueError, r"pipeline\.yaml.*not valid YAML")
def invalid_pipeline_yaml():
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "pipeline.yaml").write_text("stages: {a: [1\n")
        rp.load_stages(Path(d) / "pipeline.yaml", "quick")


@error("7 contracts", ValueError, r"pipeline\.yaml.*must be a mapping with notebook")
def wrongly_shaped_pipeline_yaml():
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "pipeline.yaml").write_text("stages:\n  a: [1, 2]\n")
        rp.load_stages(Path(d) / "pipeline.yaml", "quick")


# --- item 8: the model cache (test_models: broken folders moved aside and reconverted, load errors name folders) --

def _tiny_converter(gguf_path, dest):
    "A stand-in for the GGUF conversion: a real tiny model folder with its completion marker."
    model, tok = load_model("tiny-llama", seed=7)
    with models.atomic_folder(dest) as tmp:
        model.save_pretrained(tmp); tok.save_pretrained(tmp)
        models.write_completion_marker(tmp)
    return dest


def _cached_folder_damaged(kind):
    "Damage the cached default-model folder (a stand-in conversion) and load it again: (its logits, fresh ones)."
    x = torch.tensor([[1, 5, 9]])
    with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, {"SPARSEKV_CACHE": d}), \
            mock.patch.object(models, "convert_gguf_to_hf", _tiny_converter), contextlib.redirect_stderr(io.StringIO()):
        folder = models.ensure_smollm2()
        w = folder / "model.safetensors"
        if kind == "corrupted weights":
            with open(w, "r+b") as f: f.seek(w.stat().st_size // 2); f.write(b"\xff" * 4096)
        else: (folder / kind).unlink()
        model, _ = load_model()
        with torch.no_grad(): return model(x).logits, load_model("tiny-llama", seed=7)[0](x).logits


@right("8 model cache", atol=1e-6)
def cached_folder_with_corrupted_weights_is_reconverted():
    return _cached_folder_damaged("corrupted weights")


@right("8 model cache", atol=1e-6)
def cached_folder_without_config_is_reconverted():
    return _cached_folder_damaged("config.json")


def _damaged_local_folder(edit):
    with tempfile.TemporaryDirectory() as d:
        model, tok = load_model("tiny-qwen3")
        model.save_pretrained(d); tok.save_pretrained(d)
        edit(Path(d))
        load_model(d)


@error("8 model cache", OSError, r"could not load the model folder /")
def truncated_safetensors_names_the_folder():
    _damaged_local_folder(lambda d: os.truncate(d / "model.safetensors", 1000))


@error("8 model cache", OSError, r"the model folder /\S+ has no tokenizer")
def missing_tokenizer_names_the_folder():
    _damaged_local_folder(lambda d: (d / "tokenizer.json").unlink())


# --- unclear errors --------------------------------------------------------------------------------

@error("unclear errors", ValueError, r"priority is a meta tensor.*tensor with data")
def meta_priority_topk_cutoff():
    topk_cutoff(torch.empty(1, 2, 16, device="meta"), 4, 1, 2)


@error("unclear errors", ValueError, r"q_chunk is a meta tensor.*tensor with data")
def meta_tensors_quoka_select():
    quoka_select(torch.empty(1, 4, 8, 16, device="meta"), torch.empty(1, 2, 32, 16, device="meta"), budget=8)


@error("unclear errors", ValueError, r"K is a meta tensor.*tensor with data")
def meta_pages_page_basis():
    page_basis(torch.empty(2, 8, 16, device="meta"), torch.empty(2, 8, 16, device="meta"))


@error("unclear errors", ValueError, r"input_ids must be token ids in \[0, 259\)")
def token_id_beyond_vocab_chunked_prefill():
    x = ids(1, 6, 2)
    x[0, 3] = 259
    chunked_prefill(tiny(), x, 2)


@error("unclear errors", ValueError, r"input_ids must be token ids in \[0, 259\)")
def negative_token_id_chunked_prefill():
    x = ids(1, 6, 2)
    x[0, 3] = -1
    chunked_prefill(tiny(), x, 2)


@error("unclear errors", ValueError, r"past_key_values already holds")
def reused_filled_cache_with_new_prompt():
    model = tiny()
    cache, _ = chunked_prefill(model, ids(1, 8, 3), 4)
    generate(model, ids(1, 5, 4), DensePolicy(), n=2, cache=cache)


def _trained_pt(method_cls, d):
    "The trained.pt the distill CLI writes for `method_cls` (at budget 9 = 2 + 4 + 3), without training."
    st = method_cls(9, 2, 4).student(tiny())
    from sparsekv.distill import student_spec
    path = Path(d) / "trained.pt"
    torch.save(dict(student=st.state_dict(), spec=dict(method=method_cls.name, student=student_spec(st))), path)
    return path


@error("unclear errors", ValueError, r"holds a kvpop_mlp student \(KVpopStudent: .*MLPScorer\), not one of "
       r"kvpop_mlstm \(KVpopStudent: .*MLSTMScorer\)")
def mlp_checkpoint_into_mlstm_method():
    with tempfile.TemporaryDirectory() as d: KVpopMLSTM(9, 2, 4, checkpoint=_trained_pt(KVpopMLP, d)).cache(tiny())


@error("unclear errors", ValueError, r"holds a kvpop_mlp student .*not one of streaming_llm_plus \(SinkWindowStudent")
def kvpop_checkpoint_into_streaming_llm_plus():
    with tempfile.TemporaryDirectory() as d:
        StreamingLLMPlus(9, 2, 4, checkpoint=_trained_pt(KVpopMLP, d)).cache(tiny())


@error("unclear errors", ValueError, r"holds another student than kvpop_mlp's \(KVpopStudent: .*MLPScorer\)")
def hand_saved_mlstm_state_into_mlp_method():
    with tempfile.TemporaryDirectory() as d:
        torch.save({"student": KVpopMLSTM(9, 2, 4).student(tiny()).state_dict()}, Path(d) / "trained.pt")
        KVpopMLP(9, 2, 4, checkpoint=Path(d) / "trained.pt").cache(tiny())


@error("unclear errors", OSError,
       r"'no-such-org/no-such-model'.*offline, use load_model\('smollm2-135m'\).*local folder")
def unknown_model_offline_fails_fast():
    models.hub_reachable.cache_clear()
    t0 = time.perf_counter()
    try: load_model("no-such-org/no-such-model")
    finally:
        if time.perf_counter() - t0 > 10: raise AssertionError("took over 10 s to refuse an unknown model offline")


class CLIError(Exception):
    "The one line a command printed on stderr before exiting with status 2."


def distill_cli(*args):
    "Run the distill CLI; its one-line error (status 2, no traceback) as a CLIError."
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err): distill_main(list(args) + ["--steps", "1", "--seq-len", "16"])
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines()
        if e.code == 2 and len(lines) == 1 and "Traceback" not in lines[0]: raise CLIError(lines[0]) from None
        raise
    return "no error"


@error("unclear errors", CLIError, r"error: --student must be a trained method")
def distill_cli_untrained_method():
    distill_cli("--student", "quoka")


@error("unclear errors", CLIError, r"error: window must be an int >= 1, got 0")
def distill_cli_bad_window():
    distill_cli("--model", "tiny-llama", "--window", "0")


@error("unclear errors", CLIError, r"error: could not load 'no/such'")
def distill_cli_unknown_model():
    distill_cli("--model", "no/such")


# --- every artifact carries its digest: shipped scorers, trained.pt, distill checkpoints, stage outputs -----------

def damage(path: Path, n: int = 256, at: float = 0.5) -> Path:
    """Zero `n` bytes of `path` from `at` of its length, keeping its size and modification time: a silent disk error
    (the damaged-file fixture of the checkpoint, shipped-scorer and stamp cases)."""
    st = path.stat()
    start = min(int(st.st_size * at), st.st_size - 1)
    with open(path, "r+b") as f:
        f.seek(start)
        old = f.read(n)
        f.seek(start)
        f.write(bytes(len(old)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert any(old) and (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    return path


SHIPPED = "smollm2-135m-cr75-mlp"


@contextlib.contextmanager
def _shipped_copy():
    "A copy of shipped scorer SHIPPED that `checkpoint=SHIPPED` reads instead of the package's (which stays intact)."
    root = Path(str(student_module.resources.files("sparsekv") / "checkpoints"))
    with tempfile.TemporaryDirectory() as d:
        shutil.copytree(root / SHIPPED, Path(d) / "checkpoints" / SHIPPED)
        with mock.patch.object(student_module, "resources", SimpleNamespace(files=lambda package: Path(d))):
            yield Path(d) / "checkpoints" / SHIPPED


@functools.cache
def smollm2_shaped():
    "A tiny random model of SmolLM2's layers, KV heads and head dim (what the shipped scorers were trained for)."
    return load_model("tiny-llama", num_layers=30, num_heads=9, num_kv_heads=3, hidden_size=9 * 64, head_dim=64)[0]


@right("damaged artifacts")
def shipped_scorer_loads_verified():
    "The intact shipped scorer loads without a warning, its state the file's own."
    with _shipped_copy() as folder, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        st = methods.make("kvpop_mlp", 512, checkpoint=SHIPPED).trained_student(smollm2_shaped())
        want = torch.load(folder / "trained.pt", weights_only=True)["student"]
    got = st.state_dict()
    return ([str(x.message) for x in w if "unverified" in str(x.message)], [torch.equal(got[k], want[k]) for k in want]
            ), ([], [True] * len(want))


@error("damaged artifacts", DamagedFileError,
       rf"{SHIPPED}/trained\.pt is damaged: its SHA-256 is [0-9a-f]{{64}}, expected [0-9a-f]{{64}} \(recorded in "
       r"\S+manifest\.json\); re-install sparsekv")
def shipped_scorer_with_bytes_zeroed():
    with _shipped_copy() as folder:
        damage(folder / "trained.pt")
        methods.make("kvpop_mlp", 512, checkpoint=SHIPPED).cache(smollm2_shaped())


def _user_trained_pt(d, digest=True) -> Path:
    "A trained.pt as the distill CLI writes it (with its digest file, or without: an older version's) at budget 9."
    st = KVpopMLP(9, 2, 4).student(tiny())
    path = Path(d) / "trained.pt"
    with atomic_path_with_digest(path) as tmp: torch.save({"student": st.state_dict()}, tmp)
    if not digest: (Path(d) / "trained.pt.sha256").unlink()
    return path


def _load_user_trained(edit, digest=True):
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a file without a digest loads with a warning
        path = edit(_user_trained_pt(d, digest))
        KVpopMLP(9, 2, 4, checkpoint=path).cache(tiny())


@error("damaged artifacts", DamagedFileError, r"/trained\.pt is damaged: its SHA-256 is .*\.sha256\); retrain it")
def user_trained_pt_with_bytes_zeroed():
    _load_user_trained(damage)


@error("damaged artifacts", DamagedFileError, r"/trained\.pt is damaged: its SHA-256 is")
def user_trained_pt_cut_short():
    _load_user_trained(lambda p: os.truncate(p, 1000) or p)


@error("damaged artifacts", DamagedFileError, r"/trained\.pt cannot be read by torch\.load .*damaged, cut short")
def user_trained_pt_cut_short_without_digest():
    _load_user_trained(lambda p: os.truncate(p, 1000) or p, digest=False)


@error("damaged artifacts", DamagedFileError, r"/trained\.pt cannot be read by torch\.load \(EOFError")
def user_trained_pt_empty_without_digest():
    _load_user_trained(lambda p: p.write_bytes(b"") and p or p, digest=False)


def _resume_damaged(edit):
    "Resume the sweep's 2-step distill run from a copy of its checkpoint folder, damaged by `edit(checkpoint.pt)`."
    d, seqs, cfg = _trained_checkpoint()
    with tempfile.TemporaryDirectory() as copy, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shutil.copytree(d, copy, dirs_exist_ok=True)
        edit(Path(copy) / "checkpoint.pt")
        student = KVpopStudent.for_model(tiny(), sink=2, window=4, k=6, n_boundaries=8)
        distill(tiny(), student, epoch_batches(seqs, 2, cfg.steps), cfg, checkpoint_dir=copy, progress=False)


@error("damaged artifacts", DamagedFileError,
       r"/checkpoint\.pt is damaged: its SHA-256 is .*; delete it and checkpoint\.pt\.sha256 to train from the start")
def distill_checkpoint_with_kib_zeroed():
    _resume_damaged(lambda p: damage(p, 1024))


@error("damaged artifacts", DamagedFileError, r"/checkpoint\.pt is damaged: its SHA-256 is")
def distill_checkpoint_cut_short():
    _resume_damaged(lambda p: os.truncate(p, p.stat().st_size // 2))


@error("damaged artifacts", DamagedFileError, r"/checkpoint\.pt cannot be read by torch\.load \(EOFError")
def distill_checkpoint_empty_without_digest():
    _resume_damaged(lambda p: (p.write_bytes(b""), p.with_name("checkpoint.pt.sha256").unlink()))


@right("damaged artifacts")
def stage_output_changed_in_place_is_stale():
    "An output with bytes changed (size and modification time kept) makes its stage stale; the rerun remakes it."
    with _toy_project_run() as (root, pipe):
        out = root / "figures" / "quick" / "a.txt"
        damage(out, 2, at=0.0)
        state = rp.stage_state(rp.load_stages(pipe, "quick")[0], root, "quick")
        status = rp.run_pipeline("quick", pipeline=pipe, progress=False)
        return (state, status["a"].startswith("ran"), status["b"], out.read_text()), (
            "stale: output changed since the run: a.txt", True, "up to date (skipped)", "first")


@right("damaged artifacts")
def stage_output_truncated_is_stale():
    with _toy_project_run() as (root, pipe):
        out = root / "figures" / "quick" / "b.txt"
        os.truncate(out, 2)
        status = rp.run_pipeline("quick", pipeline=pipe, progress=False)
        return (status["a"], status["b"].startswith("ran"), out.read_text()), ("up to date (skipped)", True, "first")


@right("damaged artifacts")
def stamp_without_output_digests_stays_up_to_date():
    "A stamp written before outputs were hashed (the committed runs'): up to date, saying its outputs are not recorded."
    with _toy_project_run() as (root, pipe):
        stamp = rp.stamp_path(root, "quick", "a")
        rp.write_json(stamp, {k: v for k, v in rp.read_stamp(stamp).items() if k != "outputs"})
        state = rp.stage_state(rp.load_stages(pipe, "quick")[0], root, "quick")
        status = rp.run_pipeline("quick", pipeline=pipe, progress=False)
        return (state.startswith("up to date (made "), state.endswith("outputs not recorded in its stamp: recorded at "
                                                                       "its next run)"), status["a"]), (
            True, True, "up to date (skipped)")


@error("damaged artifacts", ValueError, r"stage 'a' in \S+pipeline\.yaml: inputs pattern 'data/\*\.csv' matches no "
       r"file")
def pipeline_inputs_pattern_matching_nothing():
    with tempfile.TemporaryDirectory() as d:
        pipe = _toy_pipeline(Path(d))
        pipe.write_text(pipe.read_text().replace("  b:", "    inputs: ['data/*.csv']\n  b:"))
        rp.load_stages(pipe, "quick")


@error("damaged artifacts", ValueError, r"\S+pipeline\.yaml is not UTF-8 text")
def pipeline_file_not_utf8():
    with tempfile.TemporaryDirectory() as d:
        pipe = _toy_pipeline(Path(d))
        pipe.write_bytes(pipe.read_bytes() + "# caf\u00e9\n".encode("latin-1"))
        rp.load_stages(pipe, "quick")


# --- methods validated when made: names, compositions, parameters; what only the model knows at patch ------------

@error("validated at make", TypeError, r"name must be a method name \(a str\).*got None")
def make_none_name():
    methods.make(None, 48)


@error("validated at make", TypeError, r"name must be a method name \(a str\).*got 123")
def make_int_name():
    methods.make(123, 48)


@error("validated at make", ValueError, r"name 'quoka\+oval\+quest' composes 3 methods; a composition is "
       r"'prefill\+decode' of two")
def make_nested_composition():
    methods.make("quoka+oval+quest", 48)


@error("validated at make", ValueError, r"family must be one of \('dense', 'eviction', 'selection', 'retrieval'\)")
def names_of_unknown_family():
    methods.names("bogus_family")


@error("validated at make", TypeError, r"prefill_params must be a dict .*got str 'n_q=2'")
def make_prefill_params_not_a_mapping():
    methods.make("quoka+oval", 48, prefill_params="n_q=2")


@error("validated at make", TypeError, r"decode_params must be a dict")
def make_decode_params_not_a_mapping():
    methods.make("quoka+oval", 48, decode_params=["eta", 0.5])


@error("validated at make", ValueError, r"r \(channels kept\) must be an int >= 1, got 0")
def make_sparq_rank_zero():
    methods.make("sparq", 48, r=0)


@error("validated at make", ValueError, r"r \(principal directions\) must be an int >= 1, got -1")
def make_loki_negative_rank():
    methods.make("loki", 48, r=-1)


@error("validated at make", TypeError, r"seed must be an int >= 0, got 'x'")
def make_sample_attention_string_seed():
    methods.make("sample_attention", 48, seed="x")


@error("validated at make", ValueError, r"n_q must be an int >= 1, got 0")
def make_sample_attention_no_queries():
    methods.make("sample_attention", 48, n_q=0)


@error("validated at make", ValueError, r"n_boundaries must be an int >= 1, got 0")
def make_kvpop_option_out_of_range():
    methods.make("kvpop_mlp", 48, n_boundaries=0)


@error("validated at make", ValueError, r"selection_layers must be layer indices in \[0, 2\) of this model \(2 "
       r"layers\), got \(99,\)")
def lessismore_layer_beyond_the_model():
    methods.make("lessismore", 12, selection_layers=(99,), chunk_size=8).generate(
        tiny(), ids(1, 20, 3), max_new_tokens=2, do_sample=False, pad_token_id=0)


@error("validated at make", ValueError,
       r"r \(channels kept, at most the head dim\) must be an int in \[1, 16\], got 17")
def sparq_rank_beyond_head_dim():
    methods.make("sparq", 12, r=17, chunk_size=8).generate(tiny(), ids(1, 20, 3), max_new_tokens=2, do_sample=False,
                                                           pad_token_id=0)


@right("validated at make")
def budget_beyond_any_sequence_is_dense():
    "A budget no sequence can fill (10**12 entries) is not preallocated: the method keeps everything, like dense."
    x = ids(1, 17, 5)
    with torch.no_grad(): want = tiny().generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6,
                                                 do_sample=False, pad_token_id=0)
    return methods.make("kvpop_mlp", 10**12).generate(tiny(), x, max_new_tokens=6, do_sample=False,
                                                      pad_token_id=0), want


for _name in [n for n in methods.names() if n != "prefill_decode"] + ["quoka+kvpop_mlstm"]:
    def _empty(name=_name):
        methods.make(name, 12, **methods.get(name).small_params).generate(tiny(), ids(2, 17, 1)[:0], max_new_tokens=2,
                                                                           do_sample=False, pad_token_id=0)
    _empty.__name__ = f"empty_batch_{_name.replace('+', '_then_')}"
    error("validated at make", ValueError, r"input_ids must be a non-empty .*\(0, 17\)")(_empty)


@error("validated at make", ValueError, r"input_ids must be a non-empty .*\(0, 17\)")
def empty_batch_chunked_prefill():
    chunked_prefill(tiny(), ids(2, 17, 1)[:0], 4)


def _fit(measurement):
    return fit_budget("tova", 16, lambda m: measurement)


@error("validated at make", TypeError, r"measure must return a dict holding 'decode_max'.*tova at budget 16")
def fit_budget_measurement_without_decode_max():
    _fit({"prefill_max": 12.0})


@error("validated at make", TypeError, r"measure's decode_max must be a number of KV entries, got '12'")
def fit_budget_measurement_as_text():
    _fit({"decode_max": "12"})


@error("validated at make", ValueError, r"measure's decode_max must be a finite count >= 0, got inf")
def fit_budget_infinite_measurement():
    _fit({"decode_max": math.inf})


@right("validated at make")
def grid_none_and_empty_string_are_two_settings():
    "params={'window': None} then {'window': ''}: each computes its own rows, and reruns reuse only their own."
    calls = []
    def fn(c):
        calls.append(c["budget"])
        return {"acc": c["budget"] / 1000}
    with tempfile.TemporaryDirectory() as d:
        for window in (None, "", None, ""): run_grid([{"budget": 2}], fn, Path(d) / "g.csv", params={"window": window})
        first = (Path(d) / "g.csv").read_text().splitlines()[1].split(",")[0]
    return (calls, first), ([2, 2], "")


# --- non-finite input: every entry checked, by a reduction, not the positions that happen to be read --------------

def _q_with(value, at):
    q = randn(1, 4, 8, 16)
    q[at] = value
    return q


for _value, _label in ((math.nan, "nan"), (math.inf, "inf"), (-math.inf, "neg_inf")):
    for _at, _where in (((0, 0, 2, 3), "dropped_query"), ((0, 0, 0, 0), "first_query")):
        def _nonfinite(value=_value, at=_at):
            quoka_select(_q_with(value, at), randn(1, 2, 32, 16, seed=1), 2, 5)
        _nonfinite.__name__ = f"quoka_select_{_label}_in_{_where}"
        error("non-finite everywhere", ValueError, r"q_chunk contains NaN or inf")(_nonfinite)


@error("non-finite everywhere", ValueError, r"k_cache contains NaN or inf")
def quoka_decode_select_inf_key():
    from sparsekv.quoka.select import quoka_decode_select
    k = randn(1, 2, 32, 16, seed=1)
    k[0, 1, 30, 5] = math.inf
    quoka_decode_select(randn(1, 4, 1, 16), k, 5)


@error("non-finite everywhere", ValueError, r"k_unit must be the unit keys of k_cache")
def quoka_select_unit_keys_of_other_keys():
    k = randn(1, 2, 32, 16, seed=1)
    quoka_select(randn(1, 4, 8, 16), k, 2, 5, k_unit=unit_keys(randn(1, 2, 32, 16, seed=9)))


@error("non-finite everywhere", ValueError, r"\bq contains NaN or inf")
def nan_in_page_score_query():
    from sparsekv.oval.basis import page_score
    mu, B, R = page_basis(randn(2, 8, 16), randn(2, 8, 16, seed=1), rank=2)
    page_score(randn(2, 16).index_fill(-1, torch.tensor([3]), math.nan), mu, B, R)


@error("non-finite everywhere", ValueError, r"\bk contains NaN or inf")
def inf_in_scorer_keys():
    from sparsekv.kvpop.scorers import MLPScorer
    k = randn(1, 2, 8, 16).index_fill(2, torch.tensor([6]), -math.inf)
    MLPScorer(2, 16)(k, randn(1, 2, 8, 16, seed=1))


@error("non-finite everywhere", ValueError, r"\bK contains NaN or inf")
def nan_in_quest_page_keys():
    from sparsekv.oval.summaries import QuestSummary
    QuestSummary().summarize(randn(1, 2, 16, 16).index_fill(2, torch.tensor([9]), math.nan), None, 4)


# --- plain validation of the public API: shapes, heads, budgets, dtypes, empty and length-1 input, bool ints ----

@error("validation", ValueError, r"\bq must be 4-D")
def attention_q_3d():
    attention_reference(randn(2, 4, 8), randn(1, 2, 4, 8), randn(1, 2, 4, 8))


@error("validation", ValueError, r"query heads Hq=3 must be a multiple of the KV heads Hkv=2")
def attention_heads_not_multiple():
    attention_reference(randn(1, 3, 4, 8), randn(1, 2, 4, 8), randn(1, 2, 4, 8))


@error("validation", TypeError, r"q, k, v must share one dtype")
def attention_dtype_mismatch():
    attention_reference(randn(1, 2, 4, 8), randn(1, 2, 4, 8, dtype=torch.float64), randn(1, 2, 4, 8))


@error("validation", TypeError, r"\bq must be a floating-point tensor")
def attention_int_queries():
    attention_reference(torch.ones(1, 2, 4, 8, dtype=torch.long), randn(1, 2, 4, 8), randn(1, 2, 4, 8))


@error("validation", ValueError, r"at least one position")
def attention_no_keys():
    attention_reference(randn(1, 2, 1, 8), randn(1, 2, 0, 8), randn(1, 2, 0, 8))


@right("validation", atol=1e-12)
def attention_one_key_is_its_value():
    v = randn(1, 2, 1, 8, seed=2, dtype=torch.float64)
    out, lse = attention_reference(randn(1, 2, 1, 8, dtype=torch.float64), randn(1, 2, 1, 8, seed=1,
                                                                                   dtype=torch.float64), v)
    return out, v


@error("validation", ValueError, r"\bk must be an int >= 1")
def topk_cutoff_k_zero():
    topk_cutoff(randn(1, 2, 12), 0, 2, 4)


@error("validation", TypeError, r"\bk must be an int")
def topk_cutoff_k_bool():
    topk_cutoff(randn(1, 2, 12), True, 2, 4)


@error("validation", ValueError, r"window must be an int >= 1")
def topk_cutoff_window_zero():
    topk_cutoff(randn(1, 2, 12), 3, 2, 0)


@error("validation", ValueError, r"priority contains NaN")
def topk_cutoff_nan_priority():
    topk_cutoff(randn(1, 2, 12).index_fill(2, torch.tensor([5]), math.nan), 3, 2, 4)


@error("validation", TypeError, r"priority must be a 3-D real tensor")
def topk_cutoff_2d_priority():
    topk_cutoff(randn(2, 12), 3, 2, 4)


@right("validation")
def topk_cutoff_length_one():
    p = randn(2, 3, 1)
    return topk_cutoff(p, 1, 0, 1), topk_cutoff_reference(p, 1, 0, 1)


@right("validation")
def kvpop_mask_equals_reference():
    p = randn(1, 2, 15)
    rank, cutoff = topk_cutoff(p, 3, 2, 4)
    return kvpop_mask(rank, cutoff, 2, 4), kvpop_mask_reference(p, 3, 2, 4)


@error("validation", ValueError, r"budget")
def quoka_budget_zero():
    quoka_select(randn(1, 4, 8, 16), randn(1, 2, 32, 16, seed=1), budget=0)


@error("validation", ValueError, r"budget")
def quoka_budget_fraction_above_one():
    quoka_select(randn(1, 4, 8, 16), randn(1, 2, 32, 16, seed=1), budget=1.5)


@error("validation", TypeError, r"n_q \(N_Q\) must be an int")
def quoka_n_q_bool():
    quoka_select(randn(1, 4, 8, 16), randn(1, 2, 32, 16, seed=1), n_q=True, budget=8)


@error("validation", ValueError, r"q_chunk \(as q\) / k_cache \(as k\).*multiple")
def quoka_heads_not_multiple():
    quoka_select(randn(1, 3, 8, 16), randn(1, 2, 32, 16, seed=1), budget=8)


@right("validation")
def quoka_budget_above_cache_keeps_all():
    q, k = randn(1, 4, 8, 16), randn(1, 2, 6, 16, seed=1)
    return quoka_select(q, k, budget=10), torch.arange(6).expand(1, 2, 6)


@right("validation")
def quoka_single_query_equals_reference():
    q, k = randn(1, 4, 1, 16, dtype=torch.float64), randn(1, 2, 20, 16, seed=1, dtype=torch.float64)
    return quoka_select(q, k, 4, 5), quoka_select_reference(q, k, 4, 5)


@right("validation")
def resolve_budget_fraction_one_is_all():
    return resolve_budget(1.0, 37), 37


@right("validation", atol=1e-10)
def page_basis_single_token_page():
    K, V = randn(3, 1, 8, dtype=torch.float64), randn(3, 1, 8, seed=1, dtype=torch.float64)
    return page_basis(K, V)[0], page_basis_reference(K, V)[0]


@error("validation", TypeError, r"rank must be an int")
def page_basis_rank_bool():
    page_basis(randn(2, 8, 16), randn(2, 8, 16, seed=1), rank=True)


@error("validation", TypeError, r"\bK must be a floating-point tensor")
def page_basis_int_keys():
    page_basis(torch.ones(2, 8, 16, dtype=torch.long), randn(2, 8, 16))


@error("validation", ValueError, r"\bV must be \[..., m, dv\]")
def page_basis_mismatched_values():
    page_basis(randn(2, 8, 16), randn(2, 5, 16))


@error("validation", ValueError, r"budget")
def make_method_budget_zero():
    methods.make("tova", budget=0)


@error("validation", (TypeError, ValueError), r"budget")
def make_method_budget_bool():
    methods.make("tova", budget=True)


@error("validation", ValueError, r"name must be one of")
def make_unknown_method():
    methods.make("tovaa", budget=8)


@error("validation", TypeError, r"tova takes no parameter \['windw'\]")
def make_method_unknown_parameter():
    methods.make("tova", budget=8, windw=4)


@error("validation", ValueError, r"no long-range slot")
def trained_method_budget_without_long_range_slot():
    KVpopMLP(6, sink=2, window=4)


@error("validation", ValueError, r"window must be an int >= 1")
def sink_window_cache_window_zero():
    SinkWindowCache(1, 0)


@error("validation", TypeError, r"window must be an int")
def sink_window_cache_window_bool():
    SinkWindowCache(1, True)


@error("validation", ValueError, r"chunk_size must be an int >= 1")
def chunked_prefill_chunk_zero():
    chunked_prefill(tiny(), ids(1, 6, 1), 0)


@right("validation", atol=1e-5)
def chunked_prefill_equals_dense():
    x = ids(2, 11, 9)
    with torch.no_grad(): return chunked_prefill(tiny(), x, 3)[1], tiny()(x).logits[:, -1]


@right("validation", atol=1e-5)
def chunked_prefill_single_token():
    x = ids(1, 1, 9)
    with torch.no_grad(): return chunked_prefill(tiny(), x, 4)[1], tiny()(x).logits[:, -1]


@error("validation", ValueError, r"input_ids must be a non-empty")
def chunked_prefill_empty_prompt():
    chunked_prefill(tiny(), torch.zeros(1, 0, dtype=torch.long), 4)


@error("validation", TypeError, r"dtype must be a floating torch\.dtype")
def load_model_int_dtype():
    load_model("tiny-llama", dtype="int8")


@error("validation", TypeError, r"name_or_path must be")
def load_model_number_as_name():
    load_model(42)


@error("validation", ValueError, r"steps must be an int >= 1")
def distill_config_steps_bool():
    DistillConfig(steps=True)


@error("validation", ValueError, r"mode must be one of")
def distill_config_unknown_mode():
    DistillConfig(mode="lora")


@error("validation", ValueError, r"future_attention_target|window")
def future_target_window_zero():
    future_attention_target(randn(1, 2, 8, 8), randn(1, 2, 8, 8, seed=1), 0)


@error("validation", ValueError, r"shape|student_logits|teacher_logits")
def kl_to_teacher_shape_mismatch():
    kl_to_teacher(randn(2, 3, 10), randn(2, 3, 11))


@error("validation", TypeError, r"x must be an int")
def check_int_refuses_bool():
    check_int(True, "x", 0)


# --- pytest and the script ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_case(name):
    case = CASES[name]
    outcome, detail = classify(case)
    assert outcome == (CLEAR if case.expect == "error" else RIGHT), f"{outcome}: {detail}"


def sweep(names=None) -> dict[str, list]:
    "Classify every case (or `names`): {outcome: [(name, item, detail), ...]}."
    found = {CLEAR: [], RIGHT: [], UNCLEAR: [], WRONG: []}
    for name in names or CASES:
        outcome, detail = classify(CASES[name])
        found[outcome].append((name, CASES[name].item, detail))
    return found


if __name__ == "__main__":
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    found = sweep(sys.argv[1:] or None)
    n = sum(map(len, found.values()))
    print(f"{n} cases in {time.perf_counter() - t0:.0f} s: " + ", ".join(f"{len(v)} {k}" for k, v in found.items()))
    for outcome in (UNCLEAR, WRONG):
        for name, item, detail in found[outcome]: print(f"  {outcome}: {name} [{item}] {detail}")
    sys.exit(1 if found[UNCLEAR] or found[WRONG] else 0)
