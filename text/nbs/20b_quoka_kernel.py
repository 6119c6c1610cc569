# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     formats: nbs///ipynb,text/nbs///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A fused key-scoring kernel for QuoKA
#
# > QuoKA's score of every cached key in one pass over the cache as it lies: normalization, products with the kept queries and both aggregations in one Triton kernel.

# %%
#| default_exp quoka.kernel

# %% [markdown]
# [Algorithm 1](20_quoka_select.ipynb) scores each cached key $k_t$ by its cosine with the
# chunk's kept, pre-aggregated queries $\bar q_1, \dots, \bar q_n$ and keeps the top $B_{SA}$:
#
# $$s_t = \max_i \; \bar q_i \cdot \frac{k_t}{\max(\lVert k_t \rVert, \epsilon)} .$$
#
# The eager path writes the unit keys into a float32 buffer (`UnitKeyCache`, kept up to date
# between chunks), multiplies them by the queries into an $[n, T]$ score matrix per KV head,
# and reduces it: at 32k keys and $n = 16$ it writes and reads back 2 MB of scores per head
# and reads a float32 copy of the keys that is twice the size of a bfloat16 cache. Because the
# norm is positive it leaves the maximum (and the mean) over queries unchanged, so
#
# $$s_t = \frac{\max_i \, \bar q_i \cdot k_t}{\max(\lVert k_t \rVert, \epsilon)} ,$$
#
# and one kernel can read each key once from the cache itself, take its norm and its products
# with the $n$ query rows, reduce them and write one number: the scores $[B, H_{kv}, T]$ and
# nothing else. The top-$B_{SA}$ step stays `top_budget_indices` (one `topk`).
#
# The same kernel serves the two ablations: the mean over kept queries instead of the maximum
# (`query_agg='mean'`), and the maximum over a group's heads of each head's score instead of
# the pre-aggregated mean query (`gqa_agg='max'`): then the rows are the $G$ heads' queries,
# $n$ each, reduced within each head and then by a maximum across heads.
#
# Everything here is checked on this machine's CPU under Triton's interpreter
# (`TRITON_INTERPRET=1`, set before Triton is imported); `make gpu-check` times it on a GPU
# when one is lent.

# %%
#| export
from __future__ import annotations

import functools

import torch
from torch import Tensor

from sparsekv.attention import check_int
from sparsekv.kvpop.cutoff import require_triton_device

# %%
#| hide
import os

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

# %% [markdown]
# ## What it computes
#
# For batch row $b$, KV head $h$ and rows $r_{b,h,0..R-1}$ cut into `groups` consecutive
# groups of $n = R / \text{groups}$, the score of key $t$ is the maximum over groups of the
# group's maximum (or mean) of $r \cdot \hat k_t$, with $\hat k_t = k_t / \max(\lVert k_t
# \rVert, \epsilon)$. The reference spells that out in float64 with the unit keys formed
# first, the order the eager path uses.

# %%
#| export
_QUERY_AGGS = ("max", "mean")  # as QuoKA's (`sparsekv.quoka.select` builds on this module)


def key_scores_reference(rows: Tensor, k: Tensor, groups: int = 1, query_agg: str = "max",
                         eps: float = 1e-12) -> Tensor:
    "Scores [B, Hkv, T] (float64) of keys k [B, Hkv, T, D] by query rows [B, Hkv, R, D] in `groups` groups, by loops."
    B, Hkv, T, _ = k.shape
    n = rows.shape[2] // groups
    out = torch.empty(B, Hkv, T, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            unit = [k[b, h, t].double() / max(k[b, h, t].double().norm().item(), eps) for t in range(T)]
            for t in range(T):
                per_group = []
                for j in range(groups):
                    s = [float(rows[b, h, j * n + i].double() @ unit[t]) for i in range(n)]
                    per_group.append(max(s) if query_agg == "max" else sum(s) / n)
                out[b, h, t] = max(per_group)
    return out


# %%
# by hand: one head, two rows, keys (3, 4) (norm 5) and (0, 0) (a zero key scores 0 whatever the rows)
_rows, _k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]]), torch.tensor([[[[3.0, 4.0], [0.0, 0.0]]]])
test_eq(key_scores_reference(_rows, _k).flatten().tolist(), [0.8, 0.0])
test_eq(key_scores_reference(_rows, _k, query_agg="mean").flatten().tolist(), [0.7, 0.0])
test_eq(key_scores_reference(_rows, _k, groups=2, query_agg="mean").flatten().tolist(), [0.8, 0.0])  # groups of one


# %% [markdown]
# ## The kernel
#
# One program per (row, block of `BLOCK_T` keys). It loads its keys once ($[T_b, D]$, strided
# reads straight from the cache, any float dtype), takes their norms, and for each group loads
# the group's rows ($[n, D]$, padded to 16), multiplies them by the keys in float32
# (`tl.dot` with `input_precision='ieee'`: no TF32 rounding) and reduces over the rows; a
# running maximum takes the groups; the result is divided by the clamped norms and stored.
# Padded rows are zero: they add nothing to a mean and are masked out of a maximum.

# %%
#| export
@functools.cache
def _key_scores_kernel():
    "Build the Triton kernel of the fused key scores (imported lazily: Triton is optional)."
    import triton
    import triton.language as tl

    # tl.sum and tl.max are jit functions of Triton's library, which the interpreter runs only if Triton was imported
    # with it on (transformers imports Triton early): here their builtins, tl.reduce of their combine functions
    @triton.jit
    def kernel(r_ptr, k_ptr, o_ptr, sr_b, sr_h, sr_n, sr_d, sk_b, sk_h, sk_t, sk_d, Hkv, T, n, groups, eps,
               MEAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
               D: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)   # row = b * Hkv + h
        b, h = row // Hkv, row % Hkv
        i, t, d = tl.arange(0, BLOCK_N), block * BLOCK_T + tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D)
        im, tm, dm = i < n, t < T, d < D
        key = tl.load(k_ptr + b * sk_b + h * sk_h + t[:, None] * sk_t + d[None, :] * sk_d, tm[:, None] & dm[None, :],
                      0.0).to(tl.float32)
        norm = tl.maximum(tl.sqrt(tl.reduce(key * key, 1, tl.standard._sum_combine)), eps)   # [BLOCK_T]
        best = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        for j in range(groups):
            q = tl.load(r_ptr + b * sr_b + h * sr_h + (j * n + i)[:, None] * sr_n + d[None, :] * sr_d,
                        im[:, None] & dm[None, :], 0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(key), input_precision="ieee")                               # [BLOCK_N, BLOCK_T]
            if MEAN: agg = tl.reduce(s, 0, tl.standard._sum_combine) / n
            else: agg = tl.reduce(tl.where(im[:, None], s, float("-inf")), 0, tl.standard._elementwise_max)
            best = tl.maximum(best, agg)
        tl.store(o_ptr + row * T + t, best / norm, tm)

    return kernel


# %%
_kernel = _key_scores_kernel()
assert _key_scores_kernel() is _kernel  # built once


# %% [markdown]
# `key_scores` checks its arguments, launches the kernel on a grid of (rows, key blocks) and
# returns the scores. It computes in float32: a float64 cache is refused (the eager path
# serves it, in float64).

# %%
#| export
def _check_key_scores(rows: Tensor, k: Tensor, groups: int, query_agg: str) -> int:
    "The rows per group n of `key_scores`' arguments, after checking them."
    if not isinstance(k, Tensor) or k.dim() != 4 or k.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"k must be a float16, bfloat16 or float32 cache [B, Hkv, T, D], got "
                         f"{getattr(k, 'dtype', type(k).__name__)} {tuple(getattr(k, 'shape', ()))}")
    if (not isinstance(rows, Tensor) or rows.dim() != 4 or not rows.is_floating_point()
            or rows.shape[:2] != k.shape[:2] or rows.shape[3] != k.shape[3] or rows.device != k.device):
        raise ValueError(f"rows must be float [B, Hkv, R, D] = [{k.shape[0]}, {k.shape[1]}, R, {k.shape[3]}] on "
                         f"{k.device}, got {getattr(rows, 'dtype', type(rows).__name__)} "
                         f"{tuple(getattr(rows, 'shape', ()))}")
    groups = check_int(groups, "groups", 1)
    if rows.shape[2] == 0 or rows.shape[2] % groups:
        raise ValueError(f"rows must hold a positive multiple of groups={groups} rows, got {rows.shape[2]}")
    if query_agg not in _QUERY_AGGS: raise ValueError(f"query_agg must be one of {_QUERY_AGGS}, got {query_agg!r}")
    require_triton_device(k)
    return rows.shape[2] // groups


# %%
_r, _kk = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 10, 8)
test_eq(_check_key_scores(_r, _kk, 2, "max"), 2)
test_fail(lambda: _check_key_scores(_r, _kk.double(), 1, "max"), contains="k must be a float16, bfloat16 or float32")
test_fail(lambda: _check_key_scores(_r, _kk[:, :1], 1, "max"), contains="rows must be float [B, Hkv, R, D] = [1, 1")
test_fail(lambda: _check_key_scores(_r[..., :4], _kk, 1, "max"), contains="rows must be float")
test_fail(lambda: _check_key_scores(_r.long(), _kk, 1, "max"), contains="rows must be float")
test_fail(lambda: _check_key_scores(_r, _kk, 3, "max"), contains="multiple of groups=3")
test_fail(lambda: _check_key_scores(_r[:, :, :0], _kk, 1, "max"), contains="positive multiple")
test_fail(lambda: _check_key_scores(_r, _kk, 0, "max"), contains="groups must be")
test_fail(lambda: _check_key_scores(_r, _kk, 1, "sum"), contains="query_agg must be one of")


# %%
#| export
def key_scores(rows: Tensor, k: Tensor, groups: int = 1, query_agg: str = "max", eps: float = 1e-12,
               block_t: int = 64) -> Tensor:
    """Scores [B, Hkv, T] float32 of the keys k [B, Hkv, T, D] (read in place, any strides) by the query rows
    [B, Hkv, R, D]: per group of R / `groups` rows, the max (or mean) of row . k / max(|k|, eps); then the max over
    groups. By the Triton kernel (CUDA, or TRITON_INTERPRET=1)."""
    n, (B, Hkv, T, D) = _check_key_scores(rows, k, groups, query_agg), k.shape
    out = torch.empty(B, Hkv, T, dtype=torch.float32, device=k.device)
    if T == 0: return out
    import triton  # optional: imported on first use
    block_t = triton.next_power_of_2(check_int(block_t, "block_t", 16))
    _key_scores_kernel()[(B * Hkv, triton.cdiv(T, block_t))](
        rows, k, out, *rows.stride(), *k.stride(), Hkv, T, n, groups, float(eps), MEAN=query_agg == "mean",
        BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_T=block_t, BLOCK_D=max(16, triton.next_power_of_2(D)), D=D)
    return out


# %% [markdown]
# The kernel against the reference: random caches, one to seventeen rows, both aggregations,
# one group or several, head dims that are not powers of two, caches shorter and longer than
# a block, a zero key, float16 and bfloat16 caches, and a cache that is a strided slice of a
# larger buffer (as a preallocated cache is).

# %%
torch.manual_seed(0)
for B, Hkv, R, groups, T, D, agg in ((1, 1, 1, 1, 5, 8, "max"), (2, 3, 6, 3, 70, 12, "mean"),
                                     (1, 2, 17, 1, 130, 64, "max"), (2, 1, 8, 4, 33, 20, "max"),
                                     (1, 2, 4, 1, 1, 4, "mean")):
    rows, k = torch.randn(B, Hkv, R, D), torch.randn(B, Hkv, T, D)
    k[0, 0, 0] = 0.0  # a zero key scores 0
    got = key_scores(rows, k, groups, agg)
    test_eq((got.shape, got.dtype), ((B, Hkv, T), torch.float32))
    assert_close(got, key_scores_reference(rows, k, groups, agg).float(), atol=1e-5, rtol=1e-5)
    test_eq(float(got[0, 0, 0]), 0.0)
# a cache preallocated for 96 tokens, 41 filled, keys with the head dim not last in memory; half precision in
buf = torch.randn(1, 2, 96, 16)
k, rows = buf.mT.contiguous().mT[:, :, :41], torch.randn(1, 2, 16, 3).mT
assert not (k.is_contiguous() or rows.is_contiguous())
assert_close(key_scores(rows, k, block_t=16), key_scores_reference(rows, k).float(), atol=1e-5, rtol=1e-5)
for dtype in (torch.float16, torch.bfloat16):
    assert_close(key_scores(rows, k.to(dtype)), key_scores_reference(rows, k.to(dtype)).float(), atol=1e-5, rtol=1e-5)
test_eq(key_scores(rows, k[:, :, :0]).shape, (1, 2, 0))  # no key: no score
