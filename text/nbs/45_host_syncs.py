# %% [markdown]
# # Host synchronizations
#
# > Which operations of a decode step or a prefill chunk make the host wait for the device, and where in the code they are.

# %%
#| default_exp syncs

# %% [markdown]
# On an accelerator the host queues kernels and moves on; it waits only when it needs a value the
# device computes: `t.item()`, `int(t)`, `bool(t)` (an `if` on a tensor), the indices of `nonzero`,
# the result of a boolean mask (its length depends on the data), `unique`, `torch.equal`. Each such
# read empties the queue: the host sits idle while the device finishes, then the device sits idle while
# the host issues the next kernels. A decode step of a small model is a few hundred short kernels, so
# a handful of waits per layer is the difference between a step bound by memory bandwidth and one bound
# by the host. CUDA graphs and `torch.compile(fullgraph=True)` cannot capture a step that reads a value
# back either.
#
# Every such read goes through PyTorch's dispatcher as one of a few operators, on the CPU as on a GPU:
# `aten._local_scalar_dense` (what `.item()`, `int()`, `float()` and `bool()` call), `aten.nonzero`
# (also behind `torch.where(mask)`), `aten.index` and `aten.index_put` with a boolean index,
# `aten.masked_select`, the `unique` family, `aten.equal` and `aten.allclose` (both return a Python bool),
# `aten.bincount` and `aten.repeat_interleave` with a tensor of repeats and no `output_size` (their output
# size is a value). A `TorchDispatchMode` sees every operator a block runs, so counting these on the CPU
# finds the reads a GPU would wait on, without a GPU. (`.tolist()` reads without an operator; it is not
# seen here.)

# %%
#| export
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from sparsekv.hf import Method, chunked_prefill

# %%
#| export
SYNC_OPS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2",
                      "aten.unique_dim", "aten.unique_consecutive", "aten.equal", "aten.allclose", "aten.bincount"})

def is_sync(op: str, args: tuple, kwargs: dict | None = None) -> bool:
    "Whether the operator `op` (e.g. 'aten.nonzero') called with `args`, `kwargs` reads a device value on the host."
    if op in SYNC_OPS: return True
    if op == "aten.repeat_interleave":  # repeats as a tensor: the output size is their sum, unless given
        return isinstance(args[0], torch.Tensor) and args[0].dim() > 0 and (kwargs or {}).get("output_size") is None
    indices = args[1] if op in ("aten.index", "aten.index_put", "aten.index_put_") and len(args) > 1 else ()
    return any(t is not None and t.dtype == torch.bool for t in indices)


# %%
assert is_sync("aten.nonzero", ()) and not is_sync("aten.topk", ())
_x = torch.arange(4.)
assert is_sync("aten.index", (_x, [_x > 1])) and not is_sync("aten.index", (_x, [torch.tensor([0, 2])]))
assert is_sync("aten.index_put_", (_x, [_x > 1], _x)) and not is_sync("aten.index_put_", (_x, [torch.tensor([0])], _x))
_r = torch.tensor([1, 2])
assert is_sync("aten.repeat_interleave", (_r,)) and not is_sync("aten.repeat_interleave", (_r,), {"output_size": 3})


# %%
#| export
def _frame(stack) -> str:
    "The innermost frame of `stack` (frame summaries) in sparsekv or transformers, as 'sparsekv/cache.py:167', or '?'."
    for f in reversed(stack or []):
        parts = Path(f.filename).parts
        for top in ("sparsekv", "transformers"):
            if top in parts: return f"{Path(*parts[parts.index(top):]).as_posix()}:{f.lineno}"
    return "?"


def _where(skip: int = 2) -> str:
    "The innermost line of sparsekv or transformers on the call stack (`_frame`), the `skip` innermost frames left out."
    return _frame(traceback.extract_stack()[:-skip])


# %%
from fastcore.test import test_close, test_eq, test_fail

test_eq(_where(), "?")  # called from a notebook: no line of the library or of transformers on the stack


# %%
#| export
@contextlib.contextmanager
def _quiet_stderr():
    "Within the block, the process's stderr (file descriptor 2) goes nowhere: the profiler's own log lines stay out."
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null: os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# %%
#| export
class HostSyncs(TorchDispatchMode):
    """Within the block, count each operator that reads a device value on the host, by operator and code line, and
    every operator dispatched (`ops`: each one is host work, a kernel launch on an accelerator). Reads inside another
    operator's kernel (`torch.linalg.eigh` checks its solver's status with one), which no dispatch mode sees, are
    found by the profiler and counted at 'inside aten::<the operator called>'."""
    def __init__(self):
        super().__init__()
        self.counts, self.ops, self._prof = Counter(), 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = str(func.overloadpacket)
        self.ops += 1
        if is_sync(op, args, kwargs): self.counts[(op, _where())] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        if not torch.autograd.profiler._is_profiler_enabled:  # (a profiler of the caller's: its events are its own)
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            with _quiet_stderr(): self._prof.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        prof, self._prof = self._prof, None
        if prof is not None:
            with _quiet_stderr(): prof.__exit__(*exc)
            for outer in kernel_reads(prof.events()): self.counts[("aten._local_scalar_dense", f"inside {outer}")] += 1

    @property
    def total(self) -> int: return sum(self.counts.values())


# the operators whose own reads the dispatch mode counts (`is_sync`), as the profiler names them
_SEEN = frozenset({"aten::repeat_interleave", "aten::index", "aten::index_put", "aten::index_put_",
                   *(op.replace(".", "::", 1) for op in SYNC_OPS)})


@functools.cache
def _decomposed(name: str) -> bool:
    "Whether every overload of the operator `name` ('aten::item') decomposes before a dispatch mode sees it."
    packet = getattr(torch.ops.aten, name.split("::", 1)[1], None)
    return packet is not None and all(getattr(packet, o).has_kernel_for_dispatch_key(
        torch._C.DispatchKey.CompositeImplicitAutograd) for o in packet.overloads())


def kernel_reads(events) -> list[str]:
    """Per value read back (`_local_scalar_dense`) among the profiler `events` inside another operator's kernel, which
    a dispatch mode does not see: that operator, the outermost kernel around the read (the one the mode saw)."""
    found = []
    for e in events:
        if e.name != "aten::_local_scalar_dense": continue
        kernel = None
        while e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
            e = e.cpu_parent
            if not _decomposed(e.name): kernel = e.name
        if kernel is not None and kernel not in _SEEN: found.append(kernel)
    return found


# %% [markdown]
# Checked on each way of reading a value back, against operations that stay on the device (a
# `topk`, a gather, a `where` with three arguments, a mask applied by multiplication):

# %%
x = torch.randn(10)
reads = {"item": lambda: x.sum().item(), "int": lambda: int(x.argmax()), "bool": lambda: bool((x > 0).any()),
         "nonzero": lambda: x.nonzero(), "where(mask)": lambda: torch.where(x > 0), "mask index": lambda: x[x > 0],
         "masked_select": lambda: x.masked_select(x > 0), "unique": lambda: x.round().unique(),
         "equal": lambda: torch.equal(x, x), "allclose": lambda: torch.allclose(x, x),
         "mask assignment": lambda: x.clone().__setitem__(x > 0, 0.0), "bincount": lambda: (x > 0).long().bincount(),
         "repeat_interleave": lambda: x.repeat_interleave((x > 0).long())}
for name, read in reads.items():
    with HostSyncs() as rec: read()
    assert rec.total == 1, (name, rec.counts)
with HostSyncs() as rec:
    v, i = x.topk(3)
    x.gather(0, i), torch.where(x > 0, x, 0.0), x * (x > 0), x.repeat_interleave(2)
    x.repeat_interleave(torch.full((10,), 2), output_size=20)
assert rec.total == 0, rec.counts
test_eq(rec.ops, 14)  # as dispatched, views and decompositions too: repeat_interleave by an int is 4 operators
def _reads_one(t): return t.max().item()  # noqa: E704
with HostSyncs() as rec: _reads_one(x)
assert list(rec.counts) == [("aten._local_scalar_dense", "?")]  # a line outside the library and transformers: '?'
# a read inside a kernel: linalg.eigh checks its solver's status (on a GPU, a copy back); a QR checks none
sym = torch.randn(3, 4, 4)
with HostSyncs() as rec: torch.linalg.eigh(sym @ sym.mT), torch.linalg.qr(sym)
test_eq(dict(rec.counts), {("aten._local_scalar_dense", "inside aten::_linalg_eigh"): 1})


# %% [markdown]
# ## A method's steps
#
# `step_syncs` runs a method as `Method.generate` does and counts the reads of one phase: the
# prefill of all tokens but the last (in chunks of `chunk_size` when the method has one; divide by the
# number of chunks for a count per chunk), or the decode step of the last token after it (with `steps > 1`,
# the last of that many decode steps after the prefill of all tokens but those: a step in the steady state of
# generation, after the first one). Only the model's calls are counted: the decode step's positions are passed
# explicitly, and the checks
# `chunked_prefill` makes of the prompt before its first chunk (the token ids in the vocabulary: one read a
# prompt, while nothing is queued yet) are not part of a chunk. So the count is the method's and the model's,
# per step or chunk.

# %%
#| export
@contextlib.contextmanager
def _in_calls(model, rec: HostSyncs):
    "Within the block, record with `rec` inside each forward call of `model` only (hooks; also when a call raises)."
    def enter(*args): rec.__enter__()  # a hook returns None: a value would replace the call's inputs or output
    def leave(*args): rec.__exit__(None, None, None)
    pre, post = model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)
    try: yield rec
    finally: pre.remove(), post.remove()


# %%
_lin = torch.nn.Linear(2, 2)
_lin.register_forward_hook(lambda m, a, out: out.sum().item())  # a read inside each call
with _in_calls(_lin, HostSyncs()) as rec:
    _lin(torch.ones(2)), _lin(torch.ones(2)), torch.ones(2).sum().item()  # two calls, one read outside them
assert rec.total == 2 and not _lin._forward_pre_hooks and len(_lin._forward_hooks) == 1


# %%
#| export
@contextlib.contextmanager
def _after_prefill(method: Method | None, model, input_ids: torch.Tensor, steps: int, record: HostSyncs | None = None
                   ):
    """Within the block, `method` (None: transformers' default, unpatched, its `DynamicCache`) patched on `model`, its
    cache holding the prefill of `input_ids[:, :-steps]` (recorded by `record`); yields step(p), a decode call at p."""
    S, chunk = input_ids.shape[1], getattr(method, "chunk_size", None)
    if not 1 <= steps < S:
        raise ValueError(f"steps must be an int in [1, {S - 1}] (tokens after a prefill), got {steps!r}")
    unpatched = contextlib.nullcontext(DynamicCache(config=model.config))
    with torch.no_grad(), unpatched if method is None else method.patch(model) as cache:
        with _in_calls(model, record) if record is not None else contextlib.nullcontext():
            if chunk: cache = chunked_prefill(model, input_ids[:, :-steps], chunk, cache=cache)[0]
            else: model(input_ids[:, :-steps], past_key_values=cache, use_cache=True)

        def step(p: int):
            pos = torch.full((input_ids.shape[0], 1), p, device=input_ids.device)
            return model(input_ids[:, p:p + 1], past_key_values=cache, position_ids=pos, use_cache=True).logits
        yield step


# %%
#| export
def step_syncs(method: Method | None, model, input_ids: torch.Tensor, phase: str = "decode", steps: int = 1
               ) -> HostSyncs:
    """Host reads (and operators) of `method` (None: transformers' default, unpatched, its `DynamicCache`) on `model`
    prefilling `input_ids[:, :-steps]` (`phase='prefill'`) or in the last of the `steps` decode steps after them."""
    if phase not in ("decode", "prefill"): raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    S, rec = input_ids.shape[1], HostSyncs()
    with _after_prefill(method, model, input_ids, steps, rec if phase == "prefill" else None) as step:
        for p in range(S - steps, S) if phase == "decode" else ():
            with rec if p == S - 1 else contextlib.nullcontext(): step(p)
    return rec


# %%
#| hide
# nbdev-test runs several notebooks in one process: a notebook that defines a method class registers it in the
# package's registry in place of the package's own (same name), and its functions' globals are that notebook's
# namespace, gone by now, which TorchDynamo cannot resolve. The checks below run the package's own classes.
def _package_classes(cls):
    for sub in cls.__subclasses__():
        if sub.__module__.startswith("sparsekv."): yield sub
        yield from _package_classes(sub)


import sparsekv.methods  # noqa: E402,F401  (every method's module)

for _cls in _package_classes(Method):
    if "name" in _cls.__dict__: Method.registry[_cls.name] = _cls

# %% [markdown]
# Checked on the tiny model: unpatched (dense) attention reads nothing back, in a decode step or a
# prefill chunk, so every read a method's step makes is the method's; and a method whose policy reads
# one value per layer is counted once per layer, at its line.

# %%
from sparsekv import methods
from sparsekv.models import load_model

model, tok = load_model("tiny-llama")
ids = torch.randint(3, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
assert step_syncs(methods.make("dense"), model, ids).total == 0
assert step_syncs(methods.make("dense"), model, ids, "prefill").total == 0

class ReadsNorm(Method):
    "Dense attention that reads the norm of each layer's queries back on the host (a sync per layer)."
    def policy(self):
        pol = super().policy()
        attend = pol.attend
        def reading(q, k, v, ctx):
            if q.norm().item() < 0: raise AssertionError
            return attend(q, k, v, ctx)
        pol.attend = reading
        return pol

rec = step_syncs(ReadsNorm(8), model, ids)
assert [(op, n) for (op, _), n in rec.counts.items()] == [("aten._local_scalar_dense", model.config.num_hidden_layers)]
# in chunks: once per layer and chunk (299 tokens in chunks of 100: 3), not the prompt's checks before them
chunked = ReadsNorm(8)
chunked.chunk_size = 100
rec = step_syncs(chunked, model, ids, "prefill")
assert [(op, n) for (op, _), n in rec.counts.items()] == [("aten._local_scalar_dense",
                                                           3 * model.config.num_hidden_layers)]
# the third of three decode steps: once per layer too; steps must leave a prefill
rec = step_syncs(ReadsNorm(8), model, ids, steps=3)
assert [(op, n) for (op, _), n in rec.counts.items()] == [("aten._local_scalar_dense", model.config.num_hidden_layers)]
test_fail(lambda: step_syncs(ReadsNorm(8), model, ids, steps=300), contains="steps must be an int in [1, 299]")

# %% [markdown]
# Every operator is counted too (`ops`): a policy that adds two operators per layer (the norm and its
# read) adds exactly two per layer to the dense step's count; transformers' own step, unpatched, is
# the baseline the methods' counts are compared with.

# %%
L = model.config.num_hidden_layers
dense_ops = step_syncs(methods.make("dense"), model, ids).ops
test_eq(step_syncs(ReadsNorm(8), model, ids).ops, dense_ops + 2 * L)
default = step_syncs(None, model, ids)
assert default.total == 0 and default.ops > 10 * L, default.ops
test_eq(step_syncs(None, model, ids, steps=2).ops, default.ops)   # a step's count does not depend on the step


# %% [markdown]
# ## Compiling a step
#
# A step that reads nothing back and keeps no Python state it cannot trace is one graph for
# `torch.compile`, which then fuses its operators (inductor) or replays it (CUDA graphs):
# `step_graph_breaks` asks TorchDynamo (`torch._dynamo.explain`, tracing only, nothing is compiled)
# where it would split the last of `steps` decode steps, as `step_syncs` runs them. Content checks
# and `measure_attended` stand aside while a step is traced (see `content_checks`). The first steps
# after the prefill build per-layer state (unit keys, page summaries) and are not asked.

# %%
#| export
def step_graph_breaks(method: Method | None, model, input_ids: torch.Tensor, steps: int = 3) -> list[str]:
    """Where `torch.compile` would split the last of `steps` decode steps of `method` (None: transformers' default)
    on `model` after the prefill of `input_ids[:, :-steps]`: one line per graph break (reason, code line); []: one
    graph, so `fullgraph=True` compiles it. A break is listed once however often it recurs."""
    S, log = input_ids.shape[1], logging.getLogger("torch._dynamo")
    level = log.level
    with _after_prefill(method, model, input_ids, steps) as step:
        for p in range(S - steps, S - 1): step(p)
        log.setLevel(logging.ERROR)  # each break is also logged as a warning with its whole stack
        try: found = torch._dynamo.explain(step)(S - 1)  # (forgets its traced graphs when done)
        finally: log.setLevel(level)
    return list(dict.fromkeys(f"{str(b.reason).strip().splitlines()[0]} at {_frame(b.user_stack)}"
                              for b in found.break_reasons))



# %% [markdown]
# Checked on the tiny model: transformers' own step and sparsekv's dense step trace as one graph; a
# method that reads a value back per layer (`ReadsNorm` above) is split where its policy is called.

# %%
test_eq(step_graph_breaks(None, model, ids), [])
test_eq(step_graph_breaks(methods.make("dense"), model, ids), [])
_breaks = step_graph_breaks(ReadsNorm(8), model, ids)
assert any("item()" in b and "sparsekv/hf.py" in b for b in _breaks), _breaks
test_fail(lambda: step_graph_breaks(None, model, ids, steps=0), contains="steps must be an int")


# %% [markdown]
# `decode_seconds` times decode steps eagerly or compiled. The step is compiled with
# `fullgraph=True` (a break would raise) and dynamic shapes (the cache grows by one entry a step),
# after two eager steps that build each layer's state; the first compiled call, the compilation, is
# timed apart. (It resets TorchDynamo first, so it forgets what was compiled before.) Its logits come back with the times, so that compiled and eager steps can be compared.
#
# A later step may compile again where what the graph guards on changes: a buffer that doubles
# when full, a page that completes. That is rare by design (growth is geometric), so the run goes
# on and lists those positions (`recompiled`), their times left out of `step_seconds`; a third
# recompilation ends the run (what the step guards on then changes nearly every step).

# %%
#| export
def decode_seconds(method: Method | None, model, input_ids: torch.Tensor, steps: int, backend: str | None = None
                   ) -> dict:
    """Wall seconds of each of the last `steps` decode steps of `method` (None: transformers' default) on `model` after
    the prefill of the tokens before them and two eager steps, and their logits [n, V]; `backend`: the `torch.compile`
    backend that compiles the step (None: eager), its first call (`compile_seconds`) apart. Positions whose compiled
    step compiled again (`recompiled`: a buffer's growth, a page boundary) are listed and left out of the times; the
    third ends the run, as does a step that cannot be compiled as one graph (`error`: TorchDynamo's reason)."""
    S = input_ids.shape[1]
    if not isinstance(steps, int) or not 2 <= steps < S - 2:
        raise ValueError(f"steps must be an int in [2, {S - 3}] (a compiled first step and timed ones), got {steps!r}")
    times, logits, recompiled, error, compile_seconds = [], [], [], None, None
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731 (graphs compiled so far)
    with _after_prefill(method, model, input_ids, steps + 2) as step:
        step(S - steps - 2), step(S - steps - 1)
        if backend is not None: torch._dynamo.reset()  # a fresh compilation (steps of other runs share its code)
        run = step if backend is None else torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
        sync = torch.cuda.synchronize if input_ids.is_cuda else lambda: None  # a GPU step has ended when it syncs
        for i, p in enumerate(range(S - steps, S)):
            sync()
            before, t0 = graphs(), time.perf_counter()
            try: logits.append(run(p)[0, -1])
            except torch._dynamo.exc.TorchDynamoException as e:
                error = str(e).strip().splitlines()[0]
                break
            sync()
            seconds = time.perf_counter() - t0
            if graphs() == before: times.append(seconds)
            elif not i: compile_seconds = seconds
            else:
                recompiled.append(p)
                if len(recompiled) == 3: break
    return {"step_seconds": times, "compile_seconds": compile_seconds, "recompiled": recompiled, "error": error,
            "logits": torch.stack(logits) if logits else None}


# %% [markdown]
# Checked on the tiny model with the `eager` backend (TorchDynamo traces the step as one graph and
# runs it as it is: the check of a compiled step without code generation): the compiled steps'
# logits equal the eager ones for dense attention and for one method of each family.

# %%
for _name in ("dense", "tova", "quoka", "oval"):
    _m = methods.make(_name) if _name == "dense" else methods.make(_name, 64)
    _eager, _traced = decode_seconds(_m, model, ids, 4), decode_seconds(_m, model, ids, 4, backend="eager")
    _n = len(_traced["logits"])  # all 4 steps: the first compiles, any that compiles again is listed
    test_eq((_n, len(_eager["step_seconds"]), _eager["compile_seconds"], _eager["recompiled"]), (4, 4, None, []))
    test_eq(len(_traced["step_seconds"]), 3 - len(_traced["recompiled"]))
    assert _traced["compile_seconds"] > 0 and set(_traced["recompiled"]) <= set(range(297, 300)), _traced["recompiled"]
    test_close(_traced["logits"], _eager["logits"], eps=1e-5)
# QuoKA's unit keys fill their buffer at 256 keys and it doubles: the steps around it compile again, are listed,
# and the run goes on to the end with the eager logits
_eager, _traced = (decode_seconds(methods.make("quoka", 64), model, ids[:, :260], 4, backend=_b)
                   for _b in (None, "eager"))
assert _traced["recompiled"] and set(_traced["recompiled"]) <= {257, 258, 259}, _traced["recompiled"]
test_eq(len(_traced["step_seconds"]), 3 - len(_traced["recompiled"]))
test_close(_traced["logits"], _eager["logits"], eps=1e-5)
test_fail(lambda: decode_seconds(None, model, ids, 1), contains="steps must be an int in [2, 297]")
