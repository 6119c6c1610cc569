"""The first run on a GPU: every CUDA path of sparsekv once, in a few minutes, with one report.

    make gpu-check          # on a CUDA machine (10 minutes at most)
    make gpu-check DRY=1    # the same parts on this CPU: tiny shapes, eager FlexAttention, Triton interpreted, gloo

Each part runs in its own process under its own time limit, so one failure or hang does not eat the rest:

- tests:    the gpu-marked tests (and, on CUDA, the gpu cells of the notebooks);
- flex:     compiled FlexAttention for the KVpop target and mask, forward and backward, against the dense path;
- triton:   the Triton cutoff kernel (Alg. 2) against the torch backend at 64k tokens;
- paged:    the Triton paged decode kernel of the retrieval family against the eager gather-then-attend path and dense
            decode attention, at SmolLM2-135M's and Qwen3-4B's attention shapes, 32k tokens, pages of 32, budget 1/16;
- quoka:    QuoKA's fused key-scoring kernel against the eager scores over cached unit keys, at the same two shapes,
            32k keys, a chunk of 128 queries, N_Q = 16 (scores and the whole selection, budget 1/16);
- torchrun: a few bf16 distillation steps under `torchrun` (FSDP2 with two or more processes);
- bench:    prefill and per-token decode time of dense, KVpop, QuoKA and OVAL (QuoKA and OVAL also with their Triton
            kernels) at 32k tokens on the largest model at hand, ratios against dense from the same run, and dense
            chunked prefill at QuoKA's chunk size (QuoKA's time-to-first-token baseline);
- compiled: per-token decode of transformers' static cache with its compiled step (CUDA graphs) against sparsekv dense
            compiled and eager, on the same model at 32k.

The report goes to `--out` as gpu_check.json and gpu_check.md; each part's numbers are printed as it ends. Without CUDA
and without --dry it says so in one line and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("tests", "syncs", "flex", "triton", "paged", "quoka", "torchrun", "bench", "compiled")
LIMITS = {"tests": 150, "syncs": 60, "flex": 90, "triton": 60, "paged": 60, "quoka": 60,  # seconds a part on a GPU
          "torchrun": 120, "bench": 180, "compiled": 180}
RESULT = "GPU_CHECK_RESULT "  # the line a part's process ends its output with, then its numbers as JSON


# --- the parts: each runs in its own process and returns its numbers; `ok` says whether its checks passed -------------

def part_tests(dry: bool) -> dict:
    "The gpu-marked tests; on CUDA also the notebooks' gpu cells. Dry: only collected (they need CUDA to run)."
    # only the files that hold gpu tests: the others import dev tools (papermill, nbdev) a GPU image may lack
    files = [str(f) for f in sorted((ROOT / "tests").glob("test_*.py")) if "pytest.mark.gpu" in f.read_text()]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           *(["--collect-only"] if dry else []), *files]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", out.stdout)}
    res = {"pytest": counts, "pytest_rc": out.returncode}
    if dry:  # "23/2054 tests collected (2031 deselected)": the gpu tests are the 23
        res["collected"] = int((re.search(r"(\d+)(?:/\d+)? tests? collected", out.stdout) or [0, 0])[1])
        res["ok"] = out.returncode == 0 and res["collected"] > 0
        res["note"] = "collected only: the gpu tests need CUDA"
        return res
    notebooks = sorted(p.name for p in (ROOT / "nbs").glob("*.ipynb") if "#| gpu" in p.read_text())
    nbdev_test = shutil.which("nbdev-test", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if nbdev_test is None:  # sparsekv installed without its dev extra: the tests still tell
        res |= {"notebooks": notebooks, "notebooks_rc": None, "note": "notebooks not run: nbdev-test is not installed"}
        res["ok"] = out.returncode == 0 and counts.get("passed", 0) > 0
        return res
    nb = subprocess.run([nbdev_test, "--flags", "gpu", "--file-re", "^(" + "|".join(re.escape(n) for n in notebooks)
                         + ")$"], cwd=ROOT, capture_output=True, text=True)
    res |= {"notebooks": notebooks, "notebooks_rc": nb.returncode}
    res["ok"] = out.returncode == 0 and nb.returncode == 0 and counts.get("passed", 0) > 0
    return res


def part_syncs(dry: bool) -> dict:
    """Every registered method's prefill and three decode steps, and every selection method's chunked prefill, on the
    tiny model with each call of the model under CUDA's sync debug mode "error": a call that reads a device value on
    the host raises (the checks of the prompt before the first call may read). Dry: on the CPU, the reads of the
    third step or of the chunks counted by the dispatcher (`sparsekv.syncs`), as the tests do."""
    import torch

    from sparsekv import methods
    from sparsekv.models import load_model
    from sparsekv.syncs import step_syncs

    device = "cpu" if dry else "cuda"
    model = load_model("tiny-llama", device=device)[0]
    ids = torch.randint(3, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0)).to(device)
    def make(name):
        if name == "dense": return methods.make(name)
        return methods.make(name, 64, **({"selection_layers": [0]} if name == "lessismore" else {}))
    runs = [(n, "decode", 3) for n in methods.names()]
    runs += [(n, "prefill", 1) for n in methods.names("selection")]
    reads = {}
    for name, phase, steps in runs:
        label = f"{name} {phase}"
        if dry:
            reads[label] = step_syncs(make(name), model, ids, phase, steps).total
            continue
        hooks = [model.register_forward_pre_hook(lambda *a: torch.cuda.set_sync_debug_mode("error")),
                 model.register_forward_hook(lambda *a: torch.cuda.set_sync_debug_mode("default"))]
        try: step_syncs(make(name), model, ids, phase, steps); reads[label] = 0
        except RuntimeError as e: reads[label] = str(e).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for h in hooks: h.remove()
    reading = {k: v for k, v in reads.items() if v}
    # DMS reads its compaction's size once a step by design (its cache is as long as its busiest head's live entries);
    # not removed yet: the eigendecompositions (torch.linalg.eigh checks its solver's status on the host) of Loki's
    # principal directions, every call, and of OVAL's page bases (key PCA's and prefill_decode's too), as pages complete
    known = {"dms decode", "loki decode", "loki prefill", "oval decode", "key_pca decode", "prefill_decode decode"}
    return {"steps": len(reads), "reading": reading, "known": sorted(known), "ok": set(reading) <= known}


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda": torch.cuda.synchronize()


def _seconds(fn, device, repeats: int = 3) -> float:
    "Best wall time of `fn()` over `repeats` runs after one warm-up (which compiles)."
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def part_flex(dry: bool) -> dict:
    """Compiled FlexAttention (eager on the CPU) for the KVpop target and mask against the dense path: forward in
    float32 and bfloat16, backward of the mask's attention (CUDA only: FlexAttention has no backward on the CPU)."""
    import torch

    from sparsekv.kvpop.cutoff import topk_cutoff
    from sparsekv.kvpop.mask import kvpop_attention
    from sparsekv.kvpop.target import future_attention_target

    device = "cpu" if dry else "cuda"
    B, Hkv, G, S, D, window, sink, k = (1, 2, 2, 256, 16, 16, 4, 64) if dry else (1, 8, 4, 4096, 128, 64, 4, 1024)
    gen = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(B, h, S, D, generator=gen).to(device) for h in (Hkv * G, Hkv, Hkv))
    res = {"shape": f"B={B} Hq={Hkv * G} Hkv={Hkv} S={S} D={D}", "device": device}
    want = future_attention_target(q, kk, window, method="dense")
    got = future_attention_target(q, kk, window, method="flex")
    res["target_max_abs_diff"] = float((got - want).abs().max())
    rank, cutoff = topk_cutoff(torch.randn(B, Hkv, S, generator=gen).to(device), k, sink, window)
    ref_out, _ = kvpop_attention(q, kk, v, rank, cutoff, sink, window, backend="reference")
    out, _ = kvpop_attention(q, kk, v, rank, cutoff, sink, window, backend="flex")
    res["mask_max_abs_diff"] = float((out - ref_out).abs().max())
    bf = [x.bfloat16() for x in (q, kk, v)]
    res["mask_bf16_max_abs_diff"] = float((kvpop_attention(*bf, rank, cutoff, sink, window, backend="flex")[0].float()
                                           - ref_out).abs().max())
    ok = res["target_max_abs_diff"] < 1e-3 and res["mask_max_abs_diff"] < 1e-4 and res["mask_bf16_max_abs_diff"] < 5e-2
    if dry: res["backward"] = "not run: FlexAttention has no backward on the CPU"
    else:
        grads = []
        for backend in ("flex", "reference"):
            leaves = [x.clone().requires_grad_() for x in (q, kk, v)]
            kvpop_attention(*leaves, rank, cutoff, sink, window, backend=backend)[0].square().sum().backward()
            grads.append([x.grad for x in leaves])
        res["mask_grad_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(*grads))
        ok = ok and res["mask_grad_max_abs_diff"] < 1e-3
        flex_s = _seconds(lambda: kvpop_attention(q, kk, v, rank, cutoff, sink, window, backend="flex"), device)
        dense_s = _seconds(lambda: kvpop_attention(q, kk, v, rank, cutoff, sink, window, backend="sdpa"), device)
        res |= {"mask_flex_ms": 1e3 * flex_s, "mask_dense_ms": 1e3 * dense_s, "mask_dense_over_flex": dense_s / flex_s}
    res["ok"] = bool(ok)
    return res


def part_triton(dry: bool) -> dict:
    "The Triton cutoff kernel against the torch backend (equal cutoffs) and their times; dry: interpreted, 512 tokens."
    import torch

    from sparsekv.kvpop.cutoff import topk_cutoff

    device = "cpu" if dry else "cuda"
    BH, S, k, sink, window = (2, 512, 64, 4, 16) if dry else (8, 65536, 2016, 4, 256)
    priority = torch.randn(1, BH, S, generator=torch.Generator().manual_seed(0)).to(device)
    (r_t, c_t), (r_k, c_k) = (topk_cutoff(priority, k, sink, window, backend=b) for b in ("torch", "triton"))
    res = {"S": S, "BH": BH, "k": k, "device": device, "equal": bool(torch.equal(c_t, c_k) and torch.equal(r_t, r_k))}
    if not dry:
        torch_s = _seconds(lambda: topk_cutoff(priority, k, sink, window, backend="torch"), device)
        triton_s = _seconds(lambda: topk_cutoff(priority, k, sink, window, backend="triton"), device)
        res |= {"torch_ms": 1e3 * torch_s, "triton_ms": 1e3 * triton_s, "torch_over_triton": torch_s / triton_s}
    res["ok"] = res["equal"]
    return res


def part_paged(dry: bool) -> dict:
    """The paged decode kernel against the eager page attention (max abs difference) and both against dense decode
    attention over the whole cache (times, ratios); bf16 on a GPU. Dry: interpreted, 512 tokens, float32, no times."""
    import torch

    from sparsekv.hf import dense_attention
    from sparsekv.oval.pages import page_attention

    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    T, m = (512, 8) if dry else (32768, 32)
    res, ok, gen = {"T": T, "page_size": m, "budget": T // 16, "device": device}, True, torch.Generator().manual_seed(0)
    for shape, (Hq, Hkv, D) in {"smollm2-135m": (9, 3, 64), "qwen3-4b": (32, 8, 128)}.items():
        q, k, v = (torch.randn(1, h, s, D, generator=gen).to(device, dtype) for h, s in ((Hq, 1), (Hkv, T), (Hkv, T)))
        pages = torch.randperm(T // m, generator=gen)[:T // 16 // m].sort().values.expand(1, Hkv, -1).to(device)
        eager = lambda: page_attention(q, k, v, pages, m)  # noqa: E731
        fused = lambda: page_attention(q, k, v, pages, m, backend="triton")  # noqa: E731
        r = {"max_abs_diff": float((fused().float() - eager().float()).abs().max())}
        ok = ok and r["max_abs_diff"] < (1e-5 if dry else 2e-2)
        if not dry:
            times = {n: _seconds(f, device, repeats=20) for n, f in
                     (("dense", lambda: dense_attention(q, k, v)), ("eager", eager), ("triton", fused))}
            r |= {f"{n}_us": 1e6 * t for n, t in times.items()}
            r |= {f"{n}_over_triton": times[n] / times["triton"] for n in ("eager", "dense")}
        res[shape] = r
    res["ok"] = bool(ok)
    return res


def part_quoka(dry: bool) -> dict:
    """QuoKA's key scores by the fused kernel against the eager path (unit keys already cached, as the policy keeps
    them): max abs difference of the scores, and times of the scores and of the selection (budget 1/16) both ways; bf16
    on a GPU. Dry: interpreted, 512 keys, a chunk of 16, float32, no times."""
    import torch

    from sparsekv.quoka.select import quoka_scores, quoka_select, unit_keys

    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    T, S, n_q = (512, 16, 4) if dry else (32768, 128, 16)
    res, ok, gen = {"T": T, "chunk": S, "n_q": n_q, "device": device}, True, torch.Generator().manual_seed(0)
    for shape, (Hq, Hkv, D) in {"smollm2-135m": (9, 3, 64), "qwen3-4b": (32, 8, 128)}.items():
        q, k = (torch.randn(1, h, s, D, generator=gen).to(device, dtype) for h, s in ((Hq, S), (Hkv, T)))
        k_unit = unit_keys(k)
        runs = {"eager": lambda: quoka_scores(q, k, n_q, k_unit=k_unit),  # noqa: E731
                "triton": lambda: quoka_scores(q, k, n_q, backend="triton"),
                "eager_select": lambda: quoka_select(q, k, n_q, T // 16, k_unit=k_unit),
                "triton_select": lambda: quoka_select(q, k, n_q, T // 16, backend="triton")}
        r = {"max_abs_diff": float((runs["triton"]() - runs["eager"]()).abs().max())}
        ok = ok and r["max_abs_diff"] < 1e-4
        if not dry:
            times = {n: _seconds(f, device, repeats=20) for n, f in runs.items()}
            r |= {f"{n}_us": 1e6 * t for n, t in times.items()}
            r |= {"eager_over_triton": times["eager"] / times["triton"],
                  "select_eager_over_triton": times["eager_select"] / times["triton_select"]}
        res[shape] = r
    res["ok"] = bool(ok)
    return res


def part_torchrun(dry: bool) -> dict:
    """A few distillation steps of KVpop-MLP under torchrun: bf16 autocast on CUDA, FSDP2 when there are two or more
    processes (one per GPU; dry: two gloo processes on the CPU with a tiny model)."""
    import torch

    n = 2 if dry else torch.cuda.device_count()
    model = "tiny-llama" if dry else "smollm2-135m" if _smollm2_installed() else "tiny-qwen3"
    with tempfile.TemporaryDirectory(prefix="sparsekv-gpu-check-") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               "-m", "sparsekv.distill", "--model", model, "--steps", "3", "--warmup-steps", "1",
               "--seq-len", "64" if dry else "1024", "--batch-size", str(2 * n), "--sink", "4",
               "--window", "8" if dry else "64", "--k", "16" if dry else "192", "--out", out]
        if dry: cmd += ["--device", "cpu"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        hist = Path(out, "history.csv")
        steps = len(hist.read_text().splitlines()) - 1 if hist.exists() else 0
    res = {"processes": n, "model": model, "rc": run.returncode, "steps": steps, "seconds": time.perf_counter() - start,
           "fsdp2": n > 1, "bf16": not dry}
    if run.returncode:  # the workers' own error lines first: torchrun's traceback of its own fills the tail
        res["errors"] = [ln for ln in run.stderr.splitlines() if "error" in ln.lower()][:5]
        res["stderr_tail"] = run.stderr[-800:]
    res["ok"] = run.returncode == 0 and steps == 3
    return res


# SmolLM2-135M's shape: where its weights are not installed, random weights of this shape time the same
SMOLLM2_SHAPE = dict(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                     vocab_size=49152, tie_word_embeddings=True,
                     rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})


def _smollm2_installed() -> bool:
    "Whether SmolLM2-135M's weights are installed (by the package's own lookup of its GGUF file)."
    from sparsekv.models import smollm2_gguf_path
    try: smollm2_gguf_path()
    except (ImportError, OSError): return False
    return True


def _bench_model(dry: bool):
    "The model to time: tiny-llama when dry, else SmolLM2-135M, or random weights of its shape if it is not installed."
    from sparsekv.models import load_model
    if dry: return "tiny-llama", load_model("tiny-llama")[0]
    if _smollm2_installed(): return "smollm2-135m", load_model("smollm2-135m", dtype="bfloat16", device="cuda")[0]
    return "smollm2-135m-shape (random weights)", load_model("tiny-llama", "bfloat16", "cuda", **SMOLLM2_SHAPE)[0]


def _clocked(generate, steps: int, device) -> list[float]:
    "Seconds from the call to each new token's logits (generate asks for them once per token, after its step)."
    start, ticks = time.perf_counter(), []

    def tick(input_ids, scores):
        _sync(device)
        ticks.append(time.perf_counter() - start)
        return scores
    generate(max_new_tokens=1 + steps, min_new_tokens=1 + steps, logits_processor=[tick], do_sample=False,
             pad_token_id=0)
    return ticks


def _timed(generate, steps: int, device) -> dict:
    "Time to first token and the median per-token decode of one generate call."
    ticks = _clocked(generate, steps, device)
    per_token = sorted(b - a for a, b in zip(ticks, ticks[1:]))  # one by one: no noisy prefill time subtracted
    return {"prefill_s": ticks[0], "decode_ms": 1e3 * per_token[len(per_token) // 2]}


def part_bench(dry: bool) -> dict:
    """Prefill (time to first token) and per-token decode of dense, KVpop, QuoKA and OVAL (the last two also with
    their Triton kernels) on one prompt, ratios to dense; and dense chunked prefill at QuoKA's chunk size (its time to
    first token's baseline)."""
    import torch

    from sparsekv import methods
    from sparsekv.hf import DensePolicy, chunked_prefill

    device = "cpu" if dry else "cuda"
    S, steps, budget = (512, 8, 64) if dry else (32768, 64, 2048)
    name, model = _bench_model(dry)
    ids = torch.randint(3, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(0)).to(device)
    res = {"model": name, "context": S, "decode_steps": steps, "budget": budget, "device": device, "methods": {}}
    methods.make("dense").generate(model, ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
    gens = {"dense": methods.make("dense").generate,
            # the unpatched model: tells our overhead from transformers'
            "hf_sdpa": lambda model, ids, **kw: model.generate(ids, **kw),
            **{m: methods.make(m, budget).generate for m in ("kvpop_mlp", "quoka", "oval")},
            **{f"{m}_triton": methods.make(m, budget, backend="triton").generate for m in ("quoka", "oval")}}
    runs = {label: partial(gen, model, ids) for label, gen in gens.items()}
    for label, gen in gens.items():
        # a short call first: what compiles on first use (Triton kernels, FlexAttention) is not the timed call's
        gen(model, ids[:, :S // 8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        res["methods"][label] = _timed(runs[label], steps, device)
    chunk = methods.make("quoka", budget).chunk_size
    with torch.no_grad():
        res["dense_chunked_prefill_s"] = _seconds(lambda: chunked_prefill(model, ids[:, :-1], chunk, DensePolicy()),
                                                  device, repeats=1)
    res["quoka_chunk_size"] = chunk
    prof, calls = torch.profiler.profile(), []

    def decode_only(input_ids, scores):  # from the first new token's logits to the fifth's: 4 decode steps
        calls.append(None)
        if len(calls) == 1: prof.start()
        if len(calls) == 5: prof.stop()
        return scores
    # where a dense decode step's time goes (host or device), for the speed work
    runs["dense"](max_new_tokens=5, min_new_tokens=5, logits_processor=[decode_only], do_sample=False, pad_token_id=0)
    res["dense_profile_top_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    dense = res["methods"]["dense"]
    for label, r in res["methods"].items():
        r["prefill_speedup"] = dense["prefill_s"] / r["prefill_s"]
        r["decode_speedup"] = dense["decode_ms"] / r["decode_ms"]
        if label.startswith("quoka"): r["prefill_over_dense_chunked"] = r["prefill_s"] / res["dense_chunked_prefill_s"]
    res["ok"] = True
    return res


def part_compiled(dry: bool) -> dict:
    """Per-token decode compiled: transformers' static cache with its compiled step (CUDA graphs by inductor's
    'reduce-overhead' on a GPU), against sparsekv dense with `compile=True` (inductor, dynamic shapes, fullgraph) and
    eager, on the bench's model and prompt. Dry: the eager backend, a 2-layer model, no graphs."""
    import torch
    from transformers import CompileConfig

    from sparsekv import methods

    device = "cpu" if dry else "cuda"
    S, steps = (256, 6) if dry else (32768, 32)
    name, model = _bench_model(dry)
    ids = torch.randint(3, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(0)).to(device)
    static = CompileConfig(fullgraph=True, backend="eager" if dry else "inductor",
                           mode=None if dry else "reduce-overhead")
    static._compile_all_devices = True  # transformers compiles on CUDA only unless told
    backend = "eager" if dry else True
    runs = {"hf_static_compiled": partial(model.generate, ids, cache_implementation="static", compile_config=static),
            "dense": partial(methods.make("dense").generate, model, ids),
            "dense_compiled": partial(methods.make("dense").generate, model, ids, compile=backend)}
    res = {"model": name, "context": S, "decode_steps": steps, "device": device, "methods": {}}
    for label, generate in runs.items():
        start = time.perf_counter()
        _clocked(generate, 2, device)  # compiles (the steps after the first)
        res["methods"][label] = {"first_call_s": time.perf_counter() - start, **_timed(generate, steps, device)}
    ref = res["methods"]["hf_static_compiled"]["decode_ms"]
    for r in res["methods"].values(): r["decode_over_hf_static_compiled"] = r["decode_ms"] / ref
    res["ok"] = True
    return res


# --- the driver: one process per part, a time limit each, one report --------------------------------------------------

def run_part(name: str, dry: bool, limit: float) -> dict:
    "Run part `name` in its own process under `limit` seconds: its numbers, status and time."
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry and name in ("triton", "paged", "quoka", "bench"): env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, __file__, "--part", name] + (["--dry"] if dry else [])
    start = time.perf_counter()
    try: run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=limit)
    except subprocess.TimeoutExpired as e:
        tail = e.stdout or b""
        tail = (tail.decode() if isinstance(tail, bytes) else tail)[-1500:]
        return {"status": "timeout", "seconds": limit, "output_tail": tail}
    seconds = time.perf_counter() - start
    line = next((ln for ln in reversed(run.stdout.splitlines()) if ln.startswith(RESULT)), None)
    if run.returncode or line is None:
        return {"status": "error", "seconds": seconds, "output_tail": (run.stdout + run.stderr)[-3000:]}
    res = json.loads(line[len(RESULT):])
    return {"status": "ok" if res.pop("ok") else "failed", "seconds": seconds, **res}


def report_md(report: dict) -> str:
    "The report as markdown: one section per part, its status, time and numbers."
    lines = [f"# GPU check ({'dry run on the CPU' if report['dry'] else report['device']})", "",
             f"{report['date']}, torch {report['torch']}, {report['seconds']:.0f} s in all.", ""]
    for name, r in report["parts"].items():
        lines += [f"## {name}: {r['status']} ({r['seconds']:.0f} s)", "", "```",
                  json.dumps({k: v for k, v in r.items() if k not in ("status", "seconds")}, indent=1), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="run on the CPU with tiny shapes (no CUDA needed)")
    p.add_argument("--out", default=str(ROOT / "reproduce" / "runs" / "gpu-check"), help="folder of the report")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts, of {', '.join(PARTS)}")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # run one part in this process
    a = p.parse_args(argv)
    if a.part:
        res = globals()[f"part_{a.part}"](a.dry)
        print(RESULT + json.dumps(res))
        return 0
    parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad: p.error(f"--parts must name parts of {PARTS}, got {bad}")
    import torch
    if not a.dry and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here, nothing checked (make gpu-check DRY=1 runs the parts on this CPU)")
        return 0
    start = time.perf_counter()
    report = {"dry": a.dry, "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "device": "cpu" if a.dry else torch.cuda.get_device_name(), "parts": {}}
    for name in parts:
        print(f"gpu-check: {name} (limit {LIMITS[name] * (3 if a.dry else 1)} s) ...", flush=True)
        r = report["parts"][name] = run_part(name, a.dry, LIMITS[name] * (3 if a.dry else 1))
        print(f"  {r['status']} in {r['seconds']:.0f} s: "
              + json.dumps({k: v for k, v in r.items() if k not in ("status", "seconds", "output_tail")}), flush=True)
        if "output_tail" in r: print("  " + r["output_tail"][-1500:].replace("\n", "\n  "), flush=True)
    report["seconds"] = time.perf_counter() - start
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(report_md(report))
    failed = [n for n, r in report["parts"].items() if r["status"] != "ok"]
    print(f"gpu-check: {len(parts) - len(failed)}/{len(parts)} parts ok"
          + (f", not ok: {', '.join(failed)}" if failed else "") + f"; report in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
