# %% [markdown]
# # Attention and its log-sum-exp
#
# > Dense reference attention with its log-sum-exp, masks, GQA, chunking, block merging and Flex/SDPA backends.

# %%
#| default_exp attention

# %%
#| export
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
import operator
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

# %%
#| hide
import itertools

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# Every method in this package (KVpop, QuoKA, OVAL) changes *which keys* a query attends
# to, and measures the effect through two numbers per query: the attention output and the
# log-sum-exp (LSE) of its scores. This notebook derives both, builds the brute-force
# reference the rest of the package is checked against, and the faster backends that must
# agree with it.
#
# ## Softmax attention
#
# Take one query head. Query $i$ has vector $q_i \in \mathbb{R}^D$; the keys and values are
# $k_j, v_j$ for $j = 0, \dots, S_k - 1$. The *scores* are scaled dot products
#
# $$s_{ij} = c\, q_i^\top k_j, \qquad c = 1/\sqrt{D} \text{ by default},$$
#
# the attention weights are their softmax over keys, and the output is the weighted mean
# of the values:
#
# $$p_{ij} = \frac{\exp s_{ij}}{\sum_{j'} \exp s_{ij'}}, \qquad o_i = \sum_j p_{ij}\, v_j .$$
#
# A boolean mask $M_{ij}$ (True = attend) removes keys by setting $s_{ij} = -\infty$:
# then $\exp s_{ij} = 0$, so the key gets weight 0 and drops out of the normalizer,
# exactly as if the sums ran over allowed keys only (KVpop Eq. (9) writes the masked
# normalizer as $\sum_{t'} M_{d,t'} \exp \ell(d, t')$).
#
# ## The log-sum-exp normalizer
#
# Name the logarithm of the softmax denominator
#
# $$\mathrm{lse}_i = \log \sum_j \exp s_{ij}$$
#
# (KVpop Eq. (28)). Dividing by $\exp \mathrm{lse}_i$ is subtracting $\mathrm{lse}_i$ in the
# exponent, so the weights and the output become (KVpop Eq. (29))
#
# $$p_{ij} = \exp(s_{ij} - \mathrm{lse}_i), \qquad o_i = \sum_j \exp(s_{ij} - \mathrm{lse}_i)\, v_j .$$
#
# One number per query row therefore carries the whole normalization: given
# $\mathrm{lse}_i$, any single weight $p_{ij}$ can be recomputed from its score alone. This is
# why attention kernels return it next to the output, and why KVpop's training target and
# the merge of partial results below are written in terms of it.
#
# **The max trick.** $\exp$ overflows float32 for arguments above about $88.7$ and
# underflows to $0$ below about $-103$, so evaluating the sum literally fails on large or
# very negative scores. For any finite $m$, factoring $e^m$ out of the sum gives
#
# $$\log \sum_j e^{s_j} = \log\Big(e^m \sum_j e^{s_j - m}\Big) = m + \log \sum_j e^{s_j - m}.$$
#
# Choosing $m = \max_j s_j$ makes every term $e^{s_j - m} \in (0, 1]$ with the largest one
# exactly $1$, so the sum lies in $[1, S_k]$: it cannot overflow, and its logarithm is
# never $\log 0$; what remains is ordinary rounding.
#
# **Fully masked rows.** If a row has no allowed key, every $s_{ij} = -\infty$ and the
# maximum is $-\infty$ too; $s_{ij} - m$ would be $-\infty - (-\infty) = \text{NaN}$. The
# empty sum is $0$, so the honest values are $\mathrm{lse}_i = \log 0 = -\infty$ and
# $o_i = 0$ (a sum of no values). The implementation shifts such rows by $0$ instead of
# $-\infty$, and keeps the gradient finite (zero) as well. **Convention of this package: a
# fully masked row has `out = 0` and `lse = -inf`, never NaN.**

# %%
#| export
def masked_logsumexp(s: Tensor, dim: int = -1) -> Tensor:
    "log sum exp(s) along `dim` by the max trick; all -inf rows give -inf with a zero (not NaN) gradient."
    m = s.amax(dim, keepdim=True).detach()  # lse does not depend on the shift, so it carries no gradient
    m = m.masked_fill(m == -math.inf, 0.0)  # fully masked row: shift by 0, not -inf (-inf - -inf = nan)
    total = torch.exp(s - m).sum(dim, keepdim=True)  # in [1, n] unless the row is fully masked
    empty = total == 0
    lse = m + torch.log(total.masked_fill(empty, 1.0))
    return lse.masked_fill(empty, -math.inf).squeeze(dim)


# %% [markdown]
# Check: on scores far outside float32's `exp` range, the literal formula in float32
# overflows or hits $\log 0$, while the max trick matches the literal formula evaluated in
# Python's float64 row by row (an independent computation). Masked entries are $-\infty$;
# a fully masked row gives $-\infty$, and the gradient (the softmax) has no NaN.

# %%
def _lse_loops(s):
    "Row-wise log sum exp of the finite entries, in Python float64 with the max trick; -inf for an empty row."
    rows = []
    for row in s.tolist():
        kept = [x for x in row if x != -math.inf]
        m = max(kept, default=0.0)
        rows.append(m + math.log(sum(math.exp(x - m) for x in kept)) if kept else -math.inf)
    return torch.tensor(rows, dtype=torch.float64)

torch.manual_seed(0)
s = torch.randn(6, 11) * 30 + torch.tensor([0., 150., -200., 0., 0., 0.])[:, None]
s[3, ::2] = -math.inf                   # partly masked row
s[4] = -math.inf                        # fully masked row
naive = torch.log(torch.exp(s).sum(-1))
assert torch.isinf(naive[1]) and naive[1] > 0          # exp(150+) overflows float32
assert torch.isinf(naive[2]) and naive[2] < 0          # exp(-200+) underflows: log 0
assert_close(masked_logsumexp(s).double(), _lse_loops(s), rtol=1e-6, atol=1e-5)
test_eq(masked_logsumexp(s)[4].item(), -math.inf)
s.requires_grad_(True)
masked_logsumexp(s)[[0, 1, 2, 3, 5]].sum().backward()
assert torch.isfinite(s.grad).all()
assert_close(s.grad[0], torch.softmax(s[0].detach(), -1))   # d lse / d s = softmax
test_eq(s.grad[4], torch.zeros(11))


# %% [markdown]
# ## Grouped-query attention (GQA)
#
# Tensors follow `scaled_dot_product_attention`: queries `[B, Hq, Sq, D]`, keys and values
# `[B, Hkv, Sk, D]` with $H_q = H_{kv} G$. The $G$ query heads of a group share one KV
# head: **query head $hG + g$ reads KV head $h$** ($g = 0, \dots, G-1$). Repeating each KV
# head $G$ times in place turns GQA into ordinary multi-head attention; the repeat is only
# for readability in the reference, the kernels below broadcast instead.

# %%
#| export
def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    "Repeat each KV head `n_rep` times: [B, Hkv, S, D] -> [B, Hkv*n_rep, S, D], head h*n_rep+g <- head h."
    if n_rep == 1: return x
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)


# %%
#| export
def check_qkv(q: Tensor, k: Tensor, v: Tensor | None = None) -> int:
    "Validate q [B,Hq,Sq,D], k [B,Hkv,Sk,D] and v [B,Hkv,Sk,Dv] (Hq a multiple of Hkv); return G = Hq // Hkv."
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, x in named:
        if not isinstance(x, Tensor): raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4: raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(x.shape)}")
        if not x.is_floating_point(): raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.dtype != q.dtype: raise TypeError(f"q, k, v must share one dtype, got q {q.dtype} and {name} {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"q, k, v must be on one device, got q on {q.device} and {name} on {x.device}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must have the same head dim D, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"the number of query heads Hq={q.shape[1]} must be a multiple of "
                         f"the KV heads Hkv={k.shape[1]}")
    if q.shape[2] < 1 or k.shape[2] < 1:
        raise ValueError(f"q and k need at least one position, got Sq={q.shape[2]}, Sk={k.shape[2]}")
    if v is not None and v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k and v must agree in [B, Hkv, Sk], got {tuple(k.shape[:3])} and {tuple(v.shape[:3])}")
    return q.shape[1] // k.shape[1]


# %% [markdown]
# Check against the definition, head by head, and that bad layouts are refused:

# %%
k = torch.randn(2, 3, 5, 4)
for G in (1, 2, 4):
    kr = repeat_kv(k, G)
    test_eq(kr.shape, (2, 3 * G, 5, 4))
    for hq in range(3 * G): test_eq(kr[:, hq], k[:, hq // G])
q = torch.randn(2, 6, 5, 4)
test_eq(check_qkv(q, k, k), 2)
test_fail(lambda: check_qkv(torch.randn(2, 4, 5, 4), k, k), contains="multiple of the KV heads")
test_fail(lambda: check_qkv(q, k.double(), k.double()), contains="share one dtype")
test_fail(lambda: check_qkv(q, k[..., :3], k), contains="head dim")
test_fail(lambda: check_qkv(q[0], k, k), contains="must be 4-D")
test_fail(lambda: check_qkv(q, k, k[:, :, :4]), contains="k and v must agree")

# %% [markdown]
# ## Checks of tensor contents, and the per-step path
#
# Two kinds of checks guard the entry points. Checks of what a caller passes (a shape, a dtype, a Python
# int, an option) read nothing from the device. Checks of what a tensor *holds* (a NaN or an infinity, an index
# out of range, a repeated index) must read a value back: on an accelerator the host then waits until the
# device has finished everything queued before it (see [the host synchronizations](45_host_syncs.ipynb)). Once
# per call of a function is harmless; once per layer of every decoded token or prefill chunk, it makes the step
# wait on the host. So the content checks run wherever a function is called directly, and are skipped inside
# the *per-step path*: the attention modules of a model patched by `sparsekv.hf.patch`, which mark their
# forward calls with `hot_path`. For debugging, `checks` turns them on there too: within `with checks():` a
# NaN key in a decode step raises the same error a direct call does. Library code asks `content_checks`
# before a check that reads a tensor's values.

# %%
#| export
_CHECKS: contextvars.ContextVar = contextvars.ContextVar("sparsekv_step_checks", default=False)
_IN_STEP: contextvars.ContextVar = contextvars.ContextVar("sparsekv_in_step", default=0)  # open hot paths


@contextlib.contextmanager
def checks(on: bool = True):
    "Within the block, run (`on=True`) or skip the checks of tensor contents in the per-step path too."
    if not isinstance(on, bool): raise TypeError(f"on must be a bool, got {on!r}")
    token = _CHECKS.set(on)
    try: yield
    finally: _CHECKS.reset(token)


# %%
#| export
@contextlib.contextmanager
def hot_path():
    "Mark the block as a per-step path (a decode step, a prefill chunk): content checks skip it unless `checks`."
    if torch.compiler.is_compiling():  # a compiled step runs no content check (see `content_checks`): nothing to mark
        yield
        return
    _IN_STEP.set(_IN_STEP.get() + 1)  # a count, not a saved value: open blocks may close in any order (hooks)
    try: yield
    finally: _IN_STEP.set(_IN_STEP.get() - 1)


# %%
#| export
def content_checks() -> bool:
    """Whether checks of tensor contents run here: always outside the per-step path, inside it only under `checks`;
    never while `torch.compile` traces (a check reads a value back, which would split the graph)."""
    return not torch.compiler.is_compiling() and (_CHECKS.get() or not _IN_STEP.get())


# %% [markdown]
# Outside the per-step path the checks run; inside it they run only under `checks()`; `checks(False)` turns
# them off again in a nested block; the state is restored on exit, also when the block raises:

# %%
assert content_checks()
with hot_path():
    assert not content_checks()
    with checks():
        assert content_checks()
        with checks(False): assert not content_checks()
        assert content_checks()
    assert not content_checks()
with checks(): assert content_checks()       # outside the per-step path they run anyway
try:
    with hot_path(), checks(): raise KeyError
except KeyError: pass
assert content_checks() and not _CHECKS.get() and not _IN_STEP.get()
_a, _b = hot_path(), hot_path()  # two opened by hooks, closed in the order they were opened
_a.__enter__(), _b.__enter__()
_a.__exit__(None, None, None)
assert not content_checks()
_b.__exit__(None, None, None)
assert content_checks()
test_fail(lambda: checks(1).__enter__(), contains="on must be a bool")


# %% [markdown]
# One NaN or infinity in an input spreads through a softmax to whole rows of output. The entry
# points check their inputs with `require_finite` (one pass over the tensor), naming the tensor;
# where `-inf` is part of the contract (masked logits) it can be allowed. It is a content check: inside the
# per-step path it runs only under `checks()`.
#
# The pass is a reduction over every entry, never a sample: the **sum** (in float32 at least). In IEEE
# arithmetic a NaN or an infinity anywhere makes the sum NaN or infinite (inf + finite = inf, inf - inf = NaN,
# NaN + anything = NaN), so a finite sum proves every entry finite; only a sum that is not finite (a NaN, an
# infinity, or finite entries whose sum overflows) is looked at entry by entry, to tell the overflow apart. A
# sum reads the tensor once at memory speed: on this CPU about 50 times faster than `torch.isfinite(x).all()`,
# which writes a boolean tensor first (0.06 ms against 2.9 ms for a float32 cache of 4,096 keys of 3 heads of
# 64 dims). With `neg_inf` the reduction is the max, which NaN propagates: `max < inf` exactly when no entry is NaN
# or +inf.

# %%
#| export
def require_finite(name: str, x: Tensor | None, neg_inf: bool = False) -> None:
    """Raise ValueError if x holds NaN or inf (`neg_inf=True` allows -inf, e.g. masked logits), checking every entry
    by one reduction; None, meta, empty and integer tensors: no check; in the per-step path only under `checks`."""
    if x is None or x.device.type == "meta" or not x.is_floating_point() or x.numel() == 0: return
    if not content_checks(): return  # the per-step path reads no value back (see `checks`)
    if neg_inf: ok = x.amax().item() < math.inf  # NaN < inf is False
    else: ok = math.isfinite((x.sum() if x.dtype in (torch.float32, torch.float64) else x.sum(dtype=torch.float32))
                             .item())
    if not ok and not neg_inf: ok = bool(torch.isfinite(x).all())  # the sum overflowed, or an entry is not finite
    if not ok: raise ValueError(f"{name} contains NaN or {'+inf' if neg_inf else 'inf'}")


# %%
require_finite("q", q)
require_finite("logits", torch.tensor([0.0, -math.inf]), neg_inf=True)
test_fail(lambda: require_finite("q", q.index_fill(2, torch.tensor([1]), math.nan)), contains="q contains NaN or inf")
test_fail(lambda: require_finite("k", torch.tensor([-math.inf])), contains="k contains NaN or inf")
test_fail(lambda: require_finite("t", torch.tensor([math.inf]), neg_inf=True), contains="t contains NaN or +inf")
test_fail(lambda: require_finite("t", torch.tensor([math.nan]), neg_inf=True), contains="t contains NaN or +inf")
# the sum is exact: every position of a tensor, every non-finite value, in each float dtype; finite entries whose
# sum overflows pass; -inf and inf in one tensor (sum NaN) fail
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    x = torch.randn(3, 4, 5).to(dtype)
    require_finite("x", x)
    for i in range(x.numel()):
        for bad in (math.nan, math.inf, -math.inf):
            test_fail(lambda: require_finite("x", x.flatten().index_fill(0, torch.tensor([i]), bad)),
                      contains="x contains NaN or inf")
    test_fail(lambda: require_finite("x", x.flatten().index_fill(0, torch.tensor([7]), math.nan), neg_inf=True),
              contains="x contains NaN or +inf")
require_finite("huge", torch.full((4,), 3e38))                 # finite: the float32 sum overflows, then re-checked
require_finite("huge", torch.full((4,), 6e4, dtype=torch.float16))
test_fail(lambda: require_finite("both", torch.tensor([math.inf, -math.inf, 1.0])), contains="both contains NaN or inf")
require_finite("empty", torch.empty(0, 3)), require_finite("ids", torch.arange(5))
with hot_path():  # the per-step path: skipped, unless checks() is on
    require_finite("q", torch.tensor([math.nan]))
    with checks(): test_fail(lambda: require_finite("q", torch.tensor([math.nan])), contains="q contains NaN or inf")


# %% [markdown]
# A `meta` tensor has a shape and no data: shape checks pass on it, but a step that reads values (a sort, a
# threshold, an eigendecomposition) fails deep inside with `Tensor.item() cannot be called on meta tensors`.
# Entry points that need values say so up front with `require_data`.

# %%
#| export
def require_data(name: str, x: Tensor | None) -> None:
    "Raise ValueError if x is a `meta` tensor (a shape without data); None passes."
    if x is not None and x.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (a shape without data): this needs a tensor with data "
                         "(e.g. on cpu or cuda)")


# %%
require_data("q", q); require_data("mask", None)
test_fail(lambda: require_data("priority", torch.empty(2, 3, device="meta")), contains="priority is a meta tensor")


# %% [markdown]
# Every integer argument in the package (a window $w$, sink count $s$, budget $k$, a number of
# heads, a chunk size) goes through one validator. It takes any integral number (a NumPy int too)
# except a bool, and refuses anything else with a message naming the argument and the accepted range.
# The error is a `ValueError`; for a value that is not an integer at all (a bool, a float, a string)
# it is also a `TypeError`, so callers may catch either.

# %%
#| export
class IntArgumentError(ValueError, TypeError):
    "A bad integer argument; a `TypeError` too, since a non-integer is also the wrong type."


# %%
assert issubclass(IntArgumentError, ValueError) and issubclass(IntArgumentError, TypeError)


# %%
#| export
def check_int(x, name: str, lo: int = 0, hi: int | None = None) -> int:
    "`x` as an `int` if it is an integer (not a bool) in [`lo`, `hi`]; else raise naming `name` and the range."
    # traced by torch.compile, x may be a symbol (a length): checked when the same step ran eagerly, kept symbolic
    if torch.compiler.is_compiling(): return x
    msg = lambda: f"{name} must be " + (f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]") + f", got {x!r}"  # noqa: E731
    if isinstance(x, bool) or not isinstance(x, numbers.Integral): raise IntArgumentError(msg())
    if x < lo or (hi is not None and x > hi): raise ValueError(msg())
    return int(x)


# %%
for lo, hi in ((0, None), (1, None), (0, 12), (-3, 3)):
    for x in range(-5, 15):
        if lo <= x and (hi is None or x <= hi): test_eq(check_int(x, "x", lo, hi), x)
        else: test_fail(lambda: check_int(x, "x", lo, hi), contains="x must be an int")
test_eq(type(check_int(torch.tensor(3).numpy()[()], "n")), int)
test_fail(lambda: check_int(0, "window", 1), contains="window must be an int >= 1, got 0")
test_fail(lambda: check_int(13, "n", 0, 12), contains="n must be an int in [0, 12], got 13")
for bad in (True, False, 2.0, "3", None, torch.tensor(3)):
    test_fail(lambda: check_int(bad, "k"), contains="k must be an int >= 0")
    test_fail(lambda: check_int(bad, "k"), exc=TypeError)
    test_fail(lambda: check_int(bad, "k"), exc=ValueError)
for bad in (-1, 13):  # an integer out of range is a ValueError only
    try: check_int(bad, "n", 0, 12)
    except ValueError as e: assert not isinstance(e, TypeError)
    else: raise AssertionError("check_int accepted an out-of-range int")


# %% [markdown]
# A count that changes at every decode step (the keys a layer has seen) is best kept as a *shape*:
# `torch.compile` traces a shape as a symbol, so a step compiled once serves every length, while an
# `int` attribute is traced as a constant and the step is compiled again each time it changes.
# `shape_count` keeps such a count in the shape of an empty tensor on the `meta` device (no data).

# %%
#| export
def shape_count(n: int) -> Tensor:
    "The count n (an int >= 0) as the shape [0, n] of an empty meta tensor: read it back as `.shape[1]`."
    return torch.empty(0, check_int(n, "n"), device="meta")


# %%
test_eq([shape_count(n).shape[1] for n in (0, 7)], [0, 7])
test_eq(shape_count(5).untyped_storage().nbytes(), 0)
test_fail(lambda: shape_count(-1), contains="n must be an int >= 0")


# %% [markdown]
# Methods that keep a different subset of keys in each KV head index them per head, `idx [B,Hkv,n]`;
# `gather_keys` takes those entries of keys or values along the sequence. On the CPU, `gather` along
# the sequence of a `[B,Hkv,S,D]` tensor walks the index one element at a time, while taking whole
# `D`-wide rows of a two-dimensional table copies each row at once (an embedding lookup, `index_select`,
# or `gather` along dim 0 with an expanded index: PyTorch's fast path): ~8x faster at a decode step's
# sizes (128 rows of 64 from each of three heads: ~15 µs against ~120). `row_table` views a tensor's
# memory as that table when its entries are whole rows of it — a cache's capacity buffer read up to its
# length is — so that per-head indices become row numbers; elsewhere (another device, a compiled graph,
# a tensor being differentiated, an unusual layout) the plain `gather` runs. Both return a new tensor,
# not a view: a compiled step that reads what an eager one wrote sees the same kind of input.

# %%
#| export
def gather_index(idx: Tensor, D: int) -> Tensor:
    "Per-KV-head entry indices `idx` `[B,Hkv,n]` as the index `[B,Hkv,n,D]` that gathers entries of width D."
    return idx[..., None].expand(-1, -1, -1, D)


def row_table(x: Tensor) -> tuple[Tensor, int] | None:
    """`x` `[B,H,S,D]` as a table `[R,D]` of the D-wide rows of its memory and the rows from one head's first
    entry to the next's, where eager CPU code gains by taking rows (None elsewhere: use `gather`)."""
    B, H, S, D = x.shape
    sb, sh, ss, sd = x.stride()
    if H == 1 and B > 1: sh = sb  # a lone head's stride is free: the next head is the next batch row's
    if x.device.type != "cpu" or torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled()):
        return None
    if (D > 1 and sd != 1) or (S > 1 and ss != D) or sh % D or (B > 1 and sb != H * sh) or x.numel() == 0:
        return None
    return x.as_strided((((B * H) - 1) * sh // D + S, D), (D, 1)), sh // D


def _rows(idx: Tensor, step: int) -> Tensor:
    "Per-head indices `idx` `[B,H,n]` as row numbers of a `row_table` whose heads start `step` rows apart."
    B, H, _ = idx.shape
    # each head's first row, by a stepped arange (heads expanded over one memory, step 0, all start at row 0)
    first = torch.arange(0, B * H * step, step, device=idx.device) if step else idx.new_zeros(B * H)
    return idx + first.view(B, H, 1)


def gather_keys(x: Tensor, idx: Tensor) -> Tensor:
    "The entries `idx` `[B,Hkv,n]` of `x` `[B,Hkv,S,D]` along the sequence, per KV head."
    if (t := row_table(x)) is None: return x.gather(2, gather_index(idx, x.shape[-1]))
    return F.embedding(_rows(idx, t[1]), t[0])


# %%
x, idx = torch.randn(2, 3, 7, 4), torch.randint(0, 7, (2, 3, 5))
loops = lambda x, idx: torch.stack([torch.stack([x[b, h, idx[b, h]] for h in range(x.shape[1])])
                                    for b in range(x.shape[0])])
test_eq(gather_keys(x, idx), loops(x, idx))
buf = torch.randn(2, 3, 16, 4)  # a capacity buffer read up to its length: rows of a table
test_eq(row_table(buf[:, :, :7])[1], 16)
# every layout: contiguous, a buffer's prefix, one batch row or head of a larger tensor, transposed heads and
# sequence (no table: gather), a lone head, a lone entry, a tensor being differentiated (no table: gather)
for x in (buf[:, :, :7], buf[1:, :, :7], buf[:, 1:2, :7], buf.transpose(1, 2)[:, :, :7], buf[:, :1, :7],
          buf[:1, :, :1], buf[..., :2, :7, :], buf[:, :, :7].clone().requires_grad_()):
    i = torch.randint(0, x.shape[2], (*x.shape[:2], 5))
    test_eq(gather_keys(x, i).detach(), loops(x, i).detach())
test_eq(row_table(buf.transpose(1, 2)[:, :, :7]), None)
test_eq(row_table(buf[:, :, :7].clone().requires_grad_()), None)


# %%
#| export
def gather_kv(k: Tensor, v: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    "`gather_keys` of keys and values at once: one index serves both when their layouts agree."
    tk, tv = row_table(k), row_table(v)
    if tk is not None and tv is not None and tk[1] == tv[1]:
        rows = _rows(idx, tk[1])
        return F.embedding(rows, tk[0]), F.embedding(rows, tv[0])
    i = gather_index(idx, k.shape[-1])
    return k.gather(2, i), v.gather(2, i if v.shape[-1] == k.shape[-1] else gather_index(idx, v.shape[-1]))


# %%
x, idx = torch.randn(2, 3, 7, 4), torch.randint(0, 7, (2, 3, 5))
for v in (torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 6), torch.randn(2, 3, 16, 4)[:, :, :7]):
    test_eq(gather_kv(x, v, idx), (loops(x, idx), loops(v, idx)))  # as wide, wider, another layout


# %% [markdown]
# ## Visibility as composed predicates
#
# The eviction and selection methods all say which key position $t$ a query at position $p$
# sees by combining a few conditions: causality $t \le p$, the $s$ attention sinks $t < s$, and
# the window of the $w$ most recent positions $p - t < w$ (the query itself included). StreamingLLM
# (and the fixed part of KVpop's budget, Eq. (1)) keeps
#
# $$\mathrm{visible}(p, t) = [t \le p] \wedge ([t < s] \vee [p - t < w]),$$
#
# and the keys a method may evict are the causal ones neither sinks nor window protect,
# $E(p) = \{t : s \le t \le p - w\}$ (KVpop Eq. (4)). Following attention-gym's mask
# factories, each condition is written once as a *predicate* of (query position, key position)
# and the patterns are composed with `and_masks`, `or_masks` and `not_mask`. The predicates
# work elementwise on broadcastable tensors, so one predicate gives a dense mask (positions
# `[Sq, 1]` against `[Sk]`, or per-head positions of a cache) and a FlexAttention `mask_mod`
# (`position_mask_mod` below).

# %%
#| export
def and_masks(*preds):
    "The predicate (p, t) -> bool true where every one of `preds` is true."
    if not preds: raise ValueError("and_masks needs at least one predicate")
    return lambda p, t: functools.reduce(operator.and_, (f(p, t) for f in preds))


# %%
a, b = torch.rand(5, 6) > 0.5, torch.rand(5, 6) > 0.5
fa, fb = (lambda p, t: a[p, t]), (lambda p, t: b[p, t])
p, t = torch.arange(5)[:, None], torch.arange(6)
test_eq(and_masks(fa, fb)(p, t), a & b)
test_fail(lambda: and_masks(), contains="at least one predicate")


# %%
#| export
def or_masks(*preds):
    "The predicate (p, t) -> bool true where any one of `preds` is true."
    if not preds: raise ValueError("or_masks needs at least one predicate")
    return lambda p, t: functools.reduce(operator.or_, (f(p, t) for f in preds))


# %%
test_eq(or_masks(fa, fb)(p, t), a | b)
test_fail(lambda: or_masks(), contains="at least one predicate")


# %%
#| export
def not_mask(pred):
    "The predicate (p, t) -> bool true where `pred` is false."
    return lambda p, t: ~pred(p, t)


# %%
test_eq(not_mask(fa)(p, t), ~a)


# %%
#| export
def is_causal(p, t):
    "Key position t is at or before query position p."
    return t <= p


# %%
test_eq(is_causal(torch.tensor(2), torch.arange(5)), torch.tensor([True, True, True, False, False]))


# %%
#| export
def in_sinks(s: int):
    "Predicate: key t is one of the first `s` positions (an attention sink), t < s."
    return lambda p, t: t < s


# %%
test_eq(in_sinks(2)(torch.tensor(9), torch.arange(5)), torch.tensor([True, True, False, False, False]))


# %%
#| export
def in_window(w: int):
    "Predicate: key t is among the `w` most recent positions of query p (p itself included), p - t < w."
    return lambda p, t: p - t < w


# %%
test_eq(in_window(2)(torch.tensor(3), torch.arange(5)), torch.tensor([False, False, True, True, True]))


# %%
#| export
def sink_window_visible(s: int, w: int):
    "Predicate of StreamingLLM's pattern (the fixed part of KVpop Eq. (1)): causal and (sink or window)."
    return and_masks(is_causal, or_masks(in_sinks(s), in_window(w)))


# %% [markdown]
# Check the composed predicates against explicit loops over positions, on dense position grids
# and on per-head positions of a cache that kept a different subset in each head:

# %%
for s, w in [(0, 1), (2, 1), (0, 4), (3, 5), (9, 2)]:
    p, t = torch.arange(12)[:, None], torch.arange(12)
    want_vis = torch.tensor([[t_ <= p_ and (t_ < s or p_ - t_ < w) for t_ in range(12)] for p_ in range(12)])
    test_eq(sink_window_visible(s, w)(p, t), want_vis)
    pos = torch.randint(0, 30, (2, 3, 7)).sort(-1).values                       # [B, Hkv, N] positions per head
    qp = torch.tensor([4, 17, 29])
    got = sink_window_visible(s, w)(qp[:, None], pos[:, :, None, :])              # [B, Hkv, Sq, N]
    for b, h, i, j in itertools.product(range(2), range(3), range(3), range(7)):
        tt, pp = pos[b, h, j].item(), qp[i].item()
        test_eq(got[b, h, i, j].item(), tt <= pp and (tt < s or pp - tt < w))


# %%
#| export
def evictable(s: int, w: int):
    "Predicate of E(p) = {t : s <= t <= p - w} (KVpop Eq. (4)): causal keys neither sinks nor window protect."
    return and_masks(is_causal, not_mask(or_masks(in_sinks(s), in_window(w))))


# %%
for s, w in [(0, 1), (2, 1), (0, 4), (3, 5), (9, 2)]:
    p, t = torch.arange(12)[:, None], torch.arange(12)
    want_vis = torch.tensor([[t_ <= p_ and (t_ < s or p_ - t_ < w) for t_ in range(12)] for p_ in range(12)])
    want_evict = torch.tensor([[s <= t_ <= p_ - w for t_ in range(12)] for p_ in range(12)])
    test_eq(evictable(s, w)(p, t), want_evict)
    test_eq(want_vis | want_evict, torch.ones(12, 12, dtype=torch.bool).tril())  # the causal keys, split in two


# %% [markdown]
# ## Masks
#
# A mask is a boolean tensor, True = attend, broadcastable to `[B, Hq, Sq, Sk]` (so
# `[Sq, Sk]` applies one pattern everywhere and `[B, 1, 1, Sk]` is a padding mask).
#
# **Causal, aligned to the last keys.** When `Sq < Sk` the queries are the *last* `Sq`
# positions of the sequence: a prefill chunk or a decode step appended to a cache of
# $S_k - S_q$ earlier keys. Query $i$ sits at absolute position $S_k - S_q + i$ and sees
# key $j$ iff
#
# $$j \le i + (S_k - S_q).$$
#
# With a general offset $o$ the rule is $j \le i + o$; the chunked variant below uses it to
# build the rows of one query chunk. (`scaled_dot_product_attention(is_causal=True)` aligns
# to the *first* keys instead, which is why the package never uses that flag for
# `Sq != Sk`.) When `Sq > Sk` the first queries see no key: fully masked rows.

# %%
#| export
def causal_mask(Sq: int, Sk: int, device=None, offset: int | None = None) -> Tensor:
    "Boolean [Sq, Sk] mask, True = attend: query i sees key j iff j <= i + offset (default Sk - Sq: last Sq positions)."
    if offset is None: offset = Sk - Sq
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)
    return is_causal(i + offset, j)


# %%
#| export
def check_mask(mask: Tensor, shape: tuple, device) -> Tensor:
    "Validate a boolean `mask` broadcastable to `shape` = (B, Hq, Sq, Sk) on `device`; return it as a 4-D view."
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a torch.bool tensor (True = attend), got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.device != torch.device(device):
        raise ValueError(f"mask must be on {device} (with q, k, v), got {mask.device}")
    if mask.dim() > 4: raise ValueError(f"mask must have at most 4 dims [B, Hq, Sq, Sk], got shape {tuple(mask.shape)}")
    mask = mask[(None,) * (4 - mask.dim())]
    if any(m not in (1, n) for m, n in zip(mask.shape, shape)):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to [B, Hq, Sq, Sk] = {tuple(shape)}")
    return mask


# %%
def _causal_loops(Sq, Sk, offset):
    return torch.tensor([[j <= i + offset for j in range(Sk)] for i in range(Sq)])

for Sq, Sk in [(5, 5), (1, 7), (3, 8), (6, 2)]:
    test_eq(causal_mask(Sq, Sk), _causal_loops(Sq, Sk, Sk - Sq))
    test_eq(causal_mask(Sq, Sk, offset=2), _causal_loops(Sq, Sk, 2))
test_eq(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())
test_eq(causal_mask(1, 9), torch.ones(1, 9, dtype=torch.bool))         # decode: the new token sees all
test_eq(causal_mask(6, 2).any(-1), torch.tensor([False] * 4 + [True] * 2))   # Sq > Sk: fully masked rows
test_eq(check_mask(torch.ones(1, 9, dtype=torch.bool), (2, 3, 4, 9), "cpu").shape, (1, 1, 1, 9))
test_fail(lambda: check_mask(torch.ones(4, 8, dtype=torch.bool), (2, 3, 4, 9), "cpu"), contains="does not broadcast")
test_fail(lambda: check_mask(torch.ones(4, 9), (2, 3, 4, 9), "cpu"), contains="torch.bool")


# %% [markdown]
# ## The reference
#
# `attention_reference` writes the formulas above literally: repeat the KV heads, form all
# scores, mask them, take the LSE by the max trick and weight the values by
# $\exp(s_{ij} - \mathrm{lse}_i)$. It materializes `[B, Hq, Sq, Sk]` scores in float32 (or
# float64 for float64 inputs) and returns the output in the input's dtype, the LSE in
# float32, natural log. It is the ground truth; the other backends are tested against it.

# %%
#| export
def softmax_scale(scale: float | None, D: int) -> float:
    "The score scale: `scale`, or 1/sqrt(D) when None."
    if scale is None: return 1.0 / math.sqrt(D)
    if torch.compiler.is_compiling(): return scale  # traced as a symbol: checked when the same step ran eagerly
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None (for 1/sqrt(D)), got {scale!r}")
    return float(scale)


# %%
test_eq(softmax_scale(None, 16), 0.25)
test_eq(softmax_scale(2, 16), 2.0)
test_fail(lambda: softmax_scale(math.nan, 16), contains="scale must be a finite number")


# %%
#| export
def attention_scores(q: Tensor, k: Tensor, mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    "Scores s_ij = scale * q_i.k_j, [B, Hq, Sq, Sk] in float32 (float64 input: float64), -inf where `mask` is False."
    G = check_qkv(q, k)
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    mask = causal_mask(Sq, Sk, q.device) if mask is None else check_mask(mask, (B, Hq, Sq, Sk), q.device)
    acc = torch.promote_types(q.dtype, torch.float32)
    s = softmax_scale(scale, D) * (q.to(acc) @ repeat_kv(k.to(acc), G).transpose(-1, -2))
    return s.masked_fill(~mask, -math.inf)


# %%
q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
want = torch.stack([q[0, h] @ k[0, h // 2].T for h in range(4)])[None] / math.sqrt(8)
assert_close(attention_scores(q, k), want.masked_fill(~causal_mask(3, 5), -math.inf))


# %%
#| export
def attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                        scale: float | None = None, check_finite: bool = True) -> tuple[Tensor, Tensor]:
    """Dense softmax attention: (out [B,Hq,Sq,Dv] in q's dtype, lse [B,Hq,Sq] natural log).
    `mask`: boolean, True = attend, broadcastable to [B,Hq,Sq,Sk]; None = causal with the queries
    at the last Sq positions (so Sq <= Sk). A fully masked row gives out = 0 and lse = -inf.
    `check_finite`: refuse NaN or inf in q, k, v."""
    G = check_qkv(q, k, v)
    if mask is None and q.shape[2] > k.shape[2]:
        raise ValueError(f"more queries (Sq={q.shape[2]}) than keys (Sk={k.shape[2]}) with mask=None: the causal "
                         "queries align to the last keys, so the first ones would see none; pass a mask")
    if check_finite:
        for name, x in (("q", q), ("k", k), ("v", v)): require_finite(name, x)
    s = attention_scores(q, k, mask, scale)  # s_ij, -inf where masked
    lse = masked_logsumexp(s)  # KVpop Eq. (28)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])  # Eq. (29); a fully masked row is all 0
    out = p @ repeat_kv(v.to(s.dtype), G)  # o_i = sum_j exp(s_ij - lse_i) v_j
    return out.to(q.dtype), lse


# %% [markdown]
# Check against the definition evaluated independently: explicit loops over batch, query
# head and query, in Python float64, over the allowed keys only (GQA by the index rule
# $h_{kv} = h_q // G$), with odd lengths, decode-like `Sq = 1`, `Sq > Sk` and a random mask
# with fully masked rows. Then against PyTorch's own `scaled_dot_product_attention`.

# %%
def _attention_loops(q, k, v, mask, scale):
    "Attention by explicit loops in float64 over allowed keys; mask is a full [B,Hq,Sq,Sk] bool tensor."
    B, Hq, Sq, _ = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, Sq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(Sq):
                keys = [j for j in range(k.shape[2]) if mask[b, h, i, j]]
                if not keys: continue
                s = [scale * float(q[b, h, i].double() @ k[b, h // G, j].double()) for j in keys]
                m = max(s)
                lse[b, h, i] = m + math.log(sum(math.exp(x - m) for x in s))
                for j, x in zip(keys, s): out[b, h, i] += math.exp(x - lse[b, h, i]) * v[b, h // G, j].double()
    return out, lse

torch.manual_seed(1)
for B, Hkv, G, Sq, Sk in [(2, 2, 3, 7, 7), (1, 1, 4, 1, 9), (2, 3, 1, 5, 12), (1, 2, 2, 6, 3)]:
    q, k, v = torch.randn(B, Hkv * G, Sq, 8), torch.randn(B, Hkv, Sk, 8), torch.randn(B, Hkv, Sk, 8)
    for mask in (None, torch.rand(B, Hkv * G, Sq, Sk) > 0.6):
        full = causal_mask(Sq, Sk).expand(B, Hkv * G, Sq, Sk) if mask is None else mask
        if mask is None and Sq > Sk:  # more queries than keys: only with a mask saying what each sees
            test_fail(lambda: attention_reference(q, k, v), contains="more queries (Sq=6) than keys (Sk=3)")
            mask = full
        out, lse = attention_reference(q, k, v, mask)
        want_out, want_lse = _attention_loops(q, k, v, full, 8 ** -0.5)
        assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
        assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
        test_eq(torch.isneginf(lse), ~full.any(-1))      # fully masked rows: lse = -inf ...
        test_eq(out[~full.any(-1)].abs().sum().item(), 0)   # ... and out = 0
        assert not out.isnan().any()

# %%
q, k, v = torch.randn(2, 6, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
mask = torch.rand(2, 1, 9, 9) > 0.3
mask[..., 0] = True   # SDPA's convention for fully masked rows is not the point of this check
assert_close(attention_reference(q, k, v, mask)[0],
             F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
# Sq = Sk
assert_close(attention_reference(q, k, v)[0], F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
assert_close(attention_reference(q, k, v, scale=0.3)[1], attention_scores(q, k, scale=0.3).logsumexp(-1))
test_fail(lambda: attention_reference(q, k, v, scale="big"), contains="scale must be")
for name, bad in (("q", q.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(math.nan))),
                  ("k", k.index_put((torch.tensor(0), torch.tensor(1)), torch.tensor(math.inf)))):
    args = dict(q=q, k=k, v=v) | {name: bad}
    test_fail(lambda: attention_reference(**args), contains=f"{name} contains NaN or inf")
    assert attention_reference(**args, check_finite=False)[0].isnan().any()  # what the check prevents


# %% [markdown]
# ## Chunking over queries is exact
#
# Row $i$ of the output and $\mathrm{lse}_i$ depend only on $q_i$, on row $i$ of the mask
# and on all keys and values: there is no interaction between query rows. So splitting the
# queries into chunks of `chunk` rows, computing each chunk with the reference and
# concatenating gives the same result, while only `[B, Hq, chunk, Sk]` scores exist at a
# time. The causal rows of the chunk starting at query $a$ are `causal_mask(c, Sk,
# offset=Sk - Sq + a)` (the rule $j \le (a + i') + S_k - S_q$ for local index $i'$), built
# per chunk rather than sliced out of a full `[Sq, Sk]` mask.

# %%
#| export
def attention_chunked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
                      chunk: int = 256, check_finite: bool = True) -> tuple[Tensor, Tensor]:
    "`attention_reference` computed `chunk` query rows at a time: same (out, lse), at most [B, Hq, chunk, Sk] scores."
    G = check_qkv(q, k, v)
    check_int(chunk, "chunk", 1)
    if check_finite:  # once, not per chunk
        for name, x in (("q", q), ("k", k), ("v", v)): require_finite(name, x)
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    if mask is not None: mask = check_mask(mask, (B, Hq, Sq, Sk), q.device)
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # once for all chunks
    outs, lses = [], []
    for a in range(0, Sq, chunk):
        e = min(a + chunk, Sq)
        if mask is None: rows = causal_mask(e - a, Sk, q.device, offset=Sk - Sq + a)
        else: rows = mask[:, :, a:e] if mask.shape[2] > 1 else mask
        out, lse = attention_reference(q[:, :, a:e], k, v, rows, scale, check_finite=False)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


# %%
torch.manual_seed(2)
q, k, v = torch.randn(2, 6, 33, 8), torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
rand = torch.rand(2, 6, 33, 40) > 0.7
rand[0, 1, 4] = False   # a fully masked row
for mask in (None, rand, rand[:1, :1], torch.rand(2, 1, 1, 40) > 0.5):
    want_out, want_lse = attention_reference(q, k, v, mask)
    for chunk in (1, 5, 32, 33, 100):
        out, lse = attention_chunked(q, k, v, mask, chunk=chunk)
        assert_close(out, want_out, rtol=1e-5, atol=1e-6)
        assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
test_fail(lambda: attention_chunked(q, k, v, chunk=0), contains="chunk must be")


# %% [markdown]
# ## Merging partial attention across key blocks
#
# Split the keys of a row into two disjoint blocks $A$ and $B$ (two pages, the cache and
# a new chunk, the kept and the evicted keys). Attention restricted to each block gives
# $(o_A, L_A)$ and $(o_B, L_B)$ with $L_X = \log \sum_{j \in X} e^{s_j}$ and
# $o_X = \sum_{j\in X} e^{s_j - L_X} v_j$. Since the sum over $A \cup B$ is the sum of the
# two sums,
#
# $$L = \log\big(e^{L_A} + e^{L_B}\big) = \operatorname{logaddexp}(L_A, L_B),$$
#
# and multiplying $o_X$ by $e^{L_X - L}$ turns its normalizer $e^{L_X}$ into $e^{L}$:
#
# $$o = \sum_{j \in A \cup B} e^{s_j - L} v_j = e^{L_A - L}\, o_A + e^{L_B - L}\, o_B .$$
#
# The two weights are positive, sum to 1, and $e^{L_A - L}$ is exactly the attention mass
# the full softmax puts on block $A$. An empty block has $L_X = -\infty$ and weight $0$; if
# both are empty, $L = -\infty$ and $o = 0$, the fully masked convention. This identity is
# how split-KV kernels combine partial results, how KVpop evaluates masses with a reused
# LSE (Eq. (8)–(9)), and how selection methods (QuoKA, OVAL) measure the mass they keep.

# %%
#| export
def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    "Attention over disjoint key blocks A and B combined into attention over A u B: lse = logaddexp(lse_a, lse_b)."
    lse = torch.logaddexp(lse_a, lse_b)
    shift = lse.masked_fill(lse == -math.inf, 0.0)  # both blocks empty: weights exp(-inf) = 0, out = 0
    w_a, w_b = torch.exp(lse_a - shift)[..., None], torch.exp(lse_b - shift)[..., None]
    out = w_a * out_a.to(lse.dtype) + w_b * out_b.to(lse.dtype)
    return out.to(out_a.dtype), lse


# %% [markdown]
# Check: split the keys at every position, compute each block with the reference on its
# slice of a causal mask with `Sq > Sk` (so some rows are empty in one block, and the first
# two rows in both), merge, and compare with the reference on all keys; the weight of block
# $A$ equals the reference's probability mass on $A$.

# %%
torch.manual_seed(3)
q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
full = causal_mask(9, 7)    # Sq > Sk: the first two rows see no key at all
want_out, want_lse = attention_reference(q, k, v, full)
p = torch.exp(attention_scores(q, k, full) - want_lse[..., None]).nan_to_num()
for split in range(1, 7):
    out_a, lse_a = attention_reference(q, k[:, :, :split], v[:, :, :split], full[:, :split])
    out_b, lse_b = attention_reference(q, k[:, :, split:], v[:, :, split:], full[:, split:])
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    assert_close(out, want_out)
    assert_close(lse, want_lse)
    seen = ~torch.isneginf(want_lse)
    assert_close(torch.exp(lse_a - want_lse)[seen], p[..., :split].sum(-1)[seen])
test_eq(torch.isneginf(lse[0, 0, :2]).all().item(), True)
test_eq(out[0, :, :2].abs().sum().item(), 0)


# %% [markdown]
# ## FlexAttention
#
# [FlexAttention](https://pytorch.org/blog/flexattention/) (`torch.nn.attention.flex_attention`)
# takes the attention pattern as two small functions of the indices, which it compiles
# into a fused kernel on the GPU:
#
# - `mask_mod(b, h, q_idx, kv_idx) -> bool`: whether query `q_idx` of head `h` may see key
#   `kv_idx`. `create_block_mask` evaluates it once per `(128, 128)` tile to build a
#   `BlockMask` that lets the kernel skip empty tiles;
# - `score_mod(score, b, h, q_idx, kv_idx) -> score`: rewrites a score before the softmax
#   (KVpop's transposed pass subtracts a per-query LSE this way, Eq. (33)).
#
# Both may read tensors captured in their closure (the attention-gym style), so any mask or
# bias held in memory becomes a `mask_mod`/`score_mod` by indexing. Broadcast dimensions are
# expanded as views (no copy) because the kernel calls the function with the real batch and
# head indices.
#
# `flex_attention(..., return_aux=AuxRequest(lse=True))` also returns the LSE. The Triton
# kernel works in base 2 (`exp2`, scores times $1/\ln 2$); in torch 2.13 `flex_attention`
# multiplies the LSE by $\ln 2$ before returning it, so it arrives in natural log (checked
# below against the reference). For a row with no allowed key the kernel keeps the running
# max at $-\infty$ and the denominator at $1$, so it returns `lse = -inf` and `out = 0`: the
# package's convention, also checked below.
#
# Devices: on CUDA, `flex_attention` is run through `torch.compile` (compiled once per
# process and cached), which generates the fused kernel, forward and backward. On CPU it is
# run eagerly, which materializes the scores (fine up to a few thousand tokens) and has
# **no backward**: CPU training goes through the dense-mask SDPA path instead
# (`masked_attention` below chooses).

# %%
#| export
def position_mask_mod(pred, offset: int = 0):
    "FlexAttention mask_mod of a position predicate `pred(p, t)`: query i sits at position i + offset, key j at j."
    def mask_mod(b, h, q_idx, kv_idx): return pred(q_idx + offset, kv_idx)
    return mask_mod


# %%
qi, kj = torch.arange(4)[:, None], torch.arange(7)
want = torch.tensor([[p - t < 2 for t in range(7)] for p in range(3, 7)])
test_eq(position_mask_mod(in_window(2), 3)(0, 0, qi, kj), want)


# %%
#| export
def causal_mask_mod(offset: int = 0):
    "FlexAttention mask_mod of `causal_mask`: query i sees key j iff j <= i + offset."
    return position_mask_mod(is_causal, offset)


# %%
test_eq(causal_mask_mod(3)(0, 0, qi, kj), causal_mask(4, 7))


# %%
#| export
def mask_mod_from_bool(mask: Tensor):
    "FlexAttention mask_mod reading a captured boolean mask [B, H, Sq, Sk] (True = attend)."
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        raise TypeError("mask must be a 4-D torch.bool tensor [B, H, Sq, Sk], got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)} "
                        f"of shape {tuple(getattr(mask, 'shape', ()))}")
    def mask_mod(b, h, q_idx, kv_idx): return mask[b, h, q_idx, kv_idx]
    return mask_mod


# %%
m = torch.rand(1, 2, 4, 7) > 0.5
test_eq(mask_mod_from_bool(m)(0, 1, qi, kj), m[0, 1])
test_fail(lambda: mask_mod_from_bool(m.float()), contains="mask must be a 4-D torch.bool tensor")


# %%
#| export
def bias_score_mod(bias: Tensor):
    "FlexAttention score_mod adding a captured bias [B, H, Sq, Sk] to each score."
    if not isinstance(bias, Tensor) or not bias.is_floating_point() or bias.dim() != 4:
        raise TypeError("bias must be a 4-D floating-point tensor [B, H, Sq, Sk], got "
                        f"{getattr(bias, 'dtype', type(bias).__name__)}")
    def score_mod(score, b, h, q_idx, kv_idx): return score + bias[b, h, q_idx, kv_idx]
    return score_mod


# %%
bias = torch.randn(1, 2, 4, 7)
test_eq(bias_score_mod(bias)(torch.ones(4, 7), 0, 1, qi, kj), 1 + bias[0, 1])
test_fail(lambda: bias_score_mod(m), contains="bias must be a 4-D floating-point tensor")


# %%
#| export
def block_mask_from_bool(mask: Tensor, shape: tuple) -> BlockMask:
    "FlexAttention BlockMask for a boolean mask broadcastable to `shape` = (B, Hq, Sq, Sk), True = attend."
    B, H, Sq, Sk = shape
    mask = check_mask(mask, shape, mask.device)
    # The block mask is computed once per broadcast dim (None); the kernel still indexes with real b, h.
    return create_block_mask(mask_mod_from_bool(mask.expand(shape)), None if mask.shape[0] == 1 else B,
                             None if mask.shape[1] == 1 else H, Sq, Sk, device=mask.device)


# %%
bm = block_mask_from_bool(m, (1, 2, 4, 7))
test_eq(bm.seq_lengths, (4, 7))
test_eq(bm.mask_mod(0, 1, qi, kj), m[0, 1])


# %%
#| export
def causal_block_mask(Sq: int, Sk: int, device=None, offset: int | None = None) -> BlockMask:
    "FlexAttention BlockMask of `causal_mask(Sq, Sk, device, offset)`."
    return create_block_mask(causal_mask_mod(Sk - Sq if offset is None else offset), None, None, Sq, Sk, device=device)


# %%
test_eq(causal_block_mask(4, 7).mask_mod(0, 0, qi, kj), causal_mask(4, 7))
test_eq(causal_block_mask(4, 7, offset=1).mask_mod(0, 0, qi, kj), causal_mask(4, 7, offset=1))


# %%
#| export
@functools.cache
def compiled_flex_attention():
    "`flex_attention` through `torch.compile`, built once per process (the fused kernel on CUDA)."
    return torch.compile(flex_attention)


# %%
assert compiled_flex_attention() is compiled_flex_attention()   # built once, then cached


# %%
#| export
def flex_attention_lse(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None = None, score_mod=None,
                       scale: float | None = None, enable_gqa: bool | None = None) -> tuple[Tensor, Tensor]:
    """FlexAttention returning (out in q's dtype, lse [B,Hq,Sq] float32 natural log); compiled on CUDA, eager on CPU.
    A row with no allowed key gives out = 0, lse = -inf. No backward on CPU: use `masked_attention` there."""
    G = check_qkv(q, k, v)
    if enable_gqa is None: enable_gqa = G > 1
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=softmax_scale(scale, q.shape[-1]),
                  enable_gqa=enable_gqa, return_aux=AuxRequest(lse=True))
    if q.is_cuda:
        out, aux = compiled_flex_attention()(q, k, v, **kwargs)
        return out, aux.lse
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError("FlexAttention has no backward on CPU: call under torch.no_grad(), detach q, k, v, "
                         "or use masked_attention(..., backend='sdpa') for gradients")
    with warnings.catch_warnings():  # eager on CPU is intended: silence the advice to compile
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = flex_attention(q.detach(), k.detach(), v.detach(), **kwargs)
    return out, aux.lse


# %% [markdown]
# Checks on CPU (eager): the causal `mask_mod` with the last-keys alignment, a random
# boolean mask with fully masked rows (a full mask and a broadcast `[Sq, Sk]` one), and a
# captured additive bias, each against the reference or the dense computation. The LSE
# agreeing with the reference shows it is in natural log.

# %%
torch.manual_seed(4)
B, Hkv, G, Sq, Sk, D = 2, 2, 3, 7, 33, 16
q, k, v = torch.randn(B, Hkv * G, Sq, D), torch.randn(B, Hkv, Sk, D), torch.randn(B, Hkv, Sk, D)
out, lse = flex_attention_lse(q, k, v, causal_block_mask(Sq, Sk))
want_out, want_lse = attention_reference(q, k, v)
assert_close(out, want_out, rtol=1e-5, atol=1e-5)
assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
for mask in (torch.rand(B, Hkv * G, Sq, Sk) > 0.8, torch.rand(Sq, Sk) > 0.8):
    mask[..., 2, :] = False                      # fully masked rows
    out, lse = flex_attention_lse(q, k, v, block_mask_from_bool(mask, (B, Hkv * G, Sq, Sk)))
    want_out, want_lse = attention_reference(q, k, v, mask)
    assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[..., 2]).all() and out[..., 2, :].abs().sum() == 0
bias = torch.randn(B, Hkv * G, Sq, Sk)
out, lse = flex_attention_lse(q, k, v, score_mod=bias_score_mod(bias))
s = attention_scores(q, k, torch.ones(Sq, Sk, dtype=torch.bool)) + bias
assert_close(lse, s.logsumexp(-1), rtol=1e-5, atol=1e-5)
assert_close(out, torch.softmax(s, -1) @ repeat_kv(v, G), rtol=1e-5, atol=1e-5)
test_fail(lambda: flex_attention_lse(q.clone().requires_grad_(), k, v), contains="no backward on CPU")
# one predicate, two uses: a position predicate as mask_mod gives the attention of its dense mask
pred, off = sink_window_visible(3, 5), Sk - Sq
bm = create_block_mask(position_mask_mod(pred, off), None, None, Sq, Sk, device="cpu")
want = torch.tensor([[j <= i + off and (j < 3 or i + off - j < 5) for j in range(Sk)] for i in range(Sq)])
for got, ref in zip(flex_attention_lse(q, k, v, bm), attention_reference(q, k, v, want)):
    assert_close(got, ref, rtol=1e-5, atol=1e-5)


# %% [markdown]
# ## One entry point: `masked_attention`
#
# `masked_attention(q, k, v, mask)` runs boolean-mask attention on the backend that fits
# the device and whether gradients are needed, and returns `(out, lse)` like the reference:
#
# | `backend` | what runs | autograd |
# |---|---|---|
# | `"auto"` | `"flex"` on CUDA, `"sdpa"` elsewhere | yes |
# | `"flex"` | FlexAttention with a `BlockMask` from the mask (compiled on CUDA, eager on CPU) | CUDA only |
# | `"sdpa"` | `scaled_dot_product_attention` with the boolean mask for `out`; the LSE from the dense masked scores | yes |
# | `"chunked"` | `attention_chunked` | yes |
# | `"reference"` | `attention_reference` | yes |
#
# The dense-mask path gives SDPA one allowed key in rows that have none (so no backend
# produces NaN there), then sets those rows of `out` to 0; its LSE uses the same
# `masked_logsumexp` as the reference. `need_grad=None` means "if autograd is recording and
# an input requires grad"; `need_grad=False` runs without autograd (so FlexAttention can run
# on CPU inputs that require grad), and asking `"flex"` for gradients on CPU is an error.

# %%
#| export
def sdpa_attention_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                       scale: float | None = None) -> tuple[Tensor, Tensor]:
    "Boolean-mask attention via `scaled_dot_product_attention` (autograd on any device), LSE from dense masked scores."
    G = check_qkv(q, k, v)
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    mask = causal_mask(Sq, Sk, q.device) if mask is None else check_mask(mask, (B, Hq, Sq, Sk), q.device)
    scale = softmax_scale(scale, D)
    seen = mask.any(-1, keepdim=True)  # rows with at least one allowed key
    # Rows with no key attend to all keys inside SDPA (finite values and gradients), then are zeroed.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~seen, scale=scale, enable_gqa=G > 1)
    return out.masked_fill(~seen, 0.0), masked_logsumexp(attention_scores(q, k, mask, scale))


# %%
q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
mask = torch.rand(1, 1, 6, 6) > 0.5
mask[..., 1, :] = False                       # a fully masked row: out 0, lse -inf
for got, want in zip(sdpa_attention_lse(q, k, v, mask), attention_reference(q, k, v, mask)):
    assert_close(got, want, rtol=1e-5, atol=1e-6)

# %%
#| export
BACKENDS = ("auto", "reference", "chunked", "sdpa", "flex")

def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None,
                     backend: str = "auto", need_grad: bool | None = None) -> tuple[Tensor, Tensor]:
    """Boolean-mask attention (True = attend; None = causal, queries at the last positions) on the backend
    fitting the device and `need_grad`: (out in q's dtype, lse [B,Hq,Sq] natural log, -inf for rows with no key)."""
    if backend not in BACKENDS: raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    G = check_qkv(q, k, v)
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    if mask is not None: mask = check_mask(mask, (B, Hq, Sq, Sk), q.device)
    if need_grad is None: need_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if backend == "auto": backend = "flex" if q.is_cuda else "sdpa"
    if backend == "flex" and need_grad and not q.is_cuda:
        raise ValueError(f"backend='flex' has no backward on {q.device.type}: use backend='sdpa' (or 'auto') when "
                         "gradients are needed")
    with torch.set_grad_enabled(need_grad):
        # as on every backend: no finiteness check; mask=None with Sq > Sk gives rows with no key
        if backend == "reference":
            return attention_reference(q, k, v, causal_mask(Sq, Sk, q.device) if mask is None else mask, scale,
                                       check_finite=False)
        if backend == "chunked": return attention_chunked(q, k, v, mask, scale, check_finite=False)
        if backend == "sdpa": return sdpa_attention_lse(q, k, v, mask, scale)
        block_mask = (causal_block_mask(Sq, Sk, q.device) if mask is None
                      else block_mask_from_bool(mask, (B, Hq, Sq, Sk)))
        return flex_attention_lse(q, k, v, block_mask, scale=scale, enable_gqa=G > 1)


# %% [markdown]
# Check: every backend against the reference, on a causal and a random mask with fully
# masked rows, in float32 and bfloat16; then gradients through the SDPA path against
# autograd through the reference (fully masked rows included: their gradients are 0, not NaN).

# %%
torch.manual_seed(5)
B, Hkv, G, Sq, Sk, D = 2, 1, 4, 33, 33, 16
q, k, v = torch.randn(B, Hkv * G, Sq, D), torch.randn(B, Hkv, Sk, D), torch.randn(B, Hkv, Sk, D)
rand = torch.rand(B, 1, Sq, Sk) > 0.5
rand[..., :3, :] = False
for mask in (None, rand):
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        want_out, want_lse = attention_reference(qd, kd, vd, mask)
        for backend in BACKENDS:
            out, lse = masked_attention(qd, kd, vd, mask, backend=backend)
            test_eq(out.dtype, dtype)
            assert_close(out, want_out, rtol=tol, atol=tol)
            assert_close(lse, want_lse, rtol=tol, atol=tol)
test_fail(lambda: masked_attention(q, k, v, rand, backend="triton"), contains="backend must be one of")
test_fail(lambda: masked_attention(q, k, v, rand[..., :5]), contains="does not broadcast")


# %%
def _grads(fn, q, k, v, mask):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v, mask)
    # a loss that weights every output entry differently
    w = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    ((out * w).sum() + lse.masked_fill(lse.isneginf(), 0).sum()).backward()
    return q.grad, k.grad, v.grad

for backend in ("sdpa", "chunked"):
    got = _grads(lambda *a: masked_attention(*a, backend=backend), q, k, v, rand)
    want = _grads(attention_reference, q, k, v, rand)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert_close(g, w, rtol=1e-4, atol=1e-5)
qg = q.clone().requires_grad_()
test_fail(lambda: masked_attention(qg, k, v, rand, backend="flex"), contains="no backward on cpu")
out, lse = masked_attention(qg, k, v, rand, backend="flex", need_grad=False)   # the input requires grad, none is needed
assert not out.requires_grad

# %% [markdown]
# ## On a GPU
#
# The compiled FlexAttention kernel only exists on CUDA. This cell (flagged `gpu`, run by
# `make test-all` on a machine with CUDA) checks it against the reference in float32 and
# bfloat16 with GQA, odd lengths, decode-like `Sq = 1` and fully masked rows, and that
# its gradients match autograd through the reference.

# %%
#| gpu
torch.manual_seed(6)
dev = "cuda"
for G, Sq, Sk in [(1, 1, 130), (3, 33, 33), (4, 7, 130), (4, 130, 130)]:
    q, k, v = (torch.randn(2, 2 * G, Sq, 64, device=dev), torch.randn(2, 2, Sk, 64, device=dev),
               torch.randn(2, 2, Sk, 64, device=dev))
    rand = torch.rand(2, 2 * G, Sq, Sk, device=dev) > 0.7
    rand[:, :, 0] = False
    for mask in (None, rand):
        for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
            qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
            want_out, want_lse = attention_reference(qd, kd, vd, mask)
            out, lse = masked_attention(qd, kd, vd, mask)
            assert_close(out, want_out, rtol=tol, atol=tol)
            assert_close(lse, want_lse, rtol=tol, atol=tol)
        got = _grads(lambda *a: masked_attention(*a, backend="flex"), q, k, v, mask)
        for g, w in zip(got, _grads(attention_reference, q, k, v, mask)):
            assert torch.isfinite(g).all()
            assert_close(g, w, rtol=1e-4, atol=1e-4)
