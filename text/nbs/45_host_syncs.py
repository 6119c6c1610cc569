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
# (also behind `torch.where(mask)`), `aten.index` with a boolean index, `aten.masked_select`, the
# `unique` family and `aten.equal`. A `TorchDispatchMode` sees every operator a block runs, so
# counting these on the CPU finds the reads a GPU would wait on, without a GPU. (`.tolist()` reads
# without an operator; it is not seen here.)

# %%
#| export
from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparsekv.hf import Method, chunked_prefill

# %%
#| export
SYNC_OPS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2",
                      "aten.unique_dim", "aten.unique_consecutive", "aten.equal"})

def is_sync(op: str, args: tuple) -> bool:
    "Whether the operator `op` (e.g. 'aten.nonzero') called with `args` reads a device value on the host."
    if op in SYNC_OPS: return True
    indices = args[1] if op == "aten.index" and len(args) > 1 else ()
    return any(t is not None and t.dtype == torch.bool for t in indices)


# %%
assert is_sync("aten.nonzero", ()) and not is_sync("aten.topk", ())
_x = torch.arange(4.)
assert is_sync("aten.index", (_x, [_x > 1])) and not is_sync("aten.index", (_x, [torch.tensor([0, 2])]))


# %%
#| export
def _where(skip: int = 2) -> str:
    "The innermost line of sparsekv (else transformers) on the call stack, as 'sparsekv/cache.py:167', or '?'."
    for f in reversed(traceback.extract_stack()[:-skip]):
        for top in ("sparsekv", "transformers"):
            parts = Path(f.filename).parts
            if top in parts: return f"{Path(*parts[parts.index(top):]).as_posix()}:{f.lineno}"
    return "?"


# %%
from fastcore.test import test_eq

test_eq(_where(), "?")  # called from a notebook: no line of the library or of transformers on the stack


# %%
#| export
class HostSyncs(TorchDispatchMode):
    "Within the block, count each operator that reads a device value on the host, by operator and code line."
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = str(func.overloadpacket)
        if is_sync(op, args): self.counts[(op, _where())] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int: return sum(self.counts.values())


# %% [markdown]
# Checked on each way of reading a value back, against operations that stay on the device (a
# `topk`, a gather, a `where` with three arguments, a mask applied by multiplication):

# %%
x = torch.randn(10)
reads = {"item": lambda: x.sum().item(), "int": lambda: int(x.argmax()), "bool": lambda: bool((x > 0).any()),
         "nonzero": lambda: x.nonzero(), "where(mask)": lambda: torch.where(x > 0), "mask index": lambda: x[x > 0],
         "masked_select": lambda: x.masked_select(x > 0), "unique": lambda: x.round().unique(),
         "equal": lambda: torch.equal(x, x)}
for name, read in reads.items():
    with HostSyncs() as rec: read()
    assert rec.total == 1, (name, rec.counts)
with HostSyncs() as rec:
    v, i = x.topk(3)
    x.gather(0, i), torch.where(x > 0, x, 0.0), x * (x > 0)
assert rec.total == 0, rec.counts
def _reads_one(t): return t.max().item()  # noqa: E704
with HostSyncs() as rec: _reads_one(x)
assert list(rec.counts) == [("aten._local_scalar_dense", "?")]  # a line outside the library and transformers: '?'


# %% [markdown]
# ## A method's steps
#
# `step_syncs` runs a method as `Method.generate` does and counts the reads of one phase: the
# prefill of all tokens but the last (in chunks of `chunk_size` when the method has one; divide by the
# number of chunks for a count per chunk), or the decode step of the last token after it. The decode
# step's positions are passed explicitly, so the count is the method's and the model's, not that of
# working out where the step is.

# %%
#| export
def step_syncs(method: Method, model, input_ids: torch.Tensor, phase: str = "decode") -> HostSyncs:
    "Host reads of `method` on `model` prefilling `input_ids[:, :-1]` (`phase='prefill'`) or decoding its last token."
    if phase not in ("decode", "prefill"): raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    S, chunk, rec = input_ids.shape[1], getattr(method, "chunk_size", None), HostSyncs()
    with torch.no_grad(), method.patch(model) as cache:
        with rec if phase == "prefill" else HostSyncs():
            if chunk: cache = chunked_prefill(model, input_ids[:, :-1], chunk, cache=cache)[0]
            else: model(input_ids[:, :-1], past_key_values=cache, use_cache=True)
        if phase == "decode":
            pos = torch.full((input_ids.shape[0], 1), S - 1)
            with rec: model(input_ids[:, -1:], past_key_values=cache, position_ids=pos, use_cache=True)
    return rec


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
