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
# # A paged decode kernel
#
# > Decode attention over the chosen pages of a KV cache, read in place by a Triton kernel: no gather, one pass, split across pages.

# %%
#| default_exp oval.kernel

# %% [markdown]
# A page retriever's decode query attends to a few complete pages of $m$ consecutive keys
# (those its summaries ranked highest) and to the partial page at the end of the cache. The
# eager path of [the retrieval policy](32_oval_pages.ipynb) copies those pages out of the
# cache (`gather_pages`) and then runs dense attention over the copy: two reads and one write
# of every chosen key and value, and a handful of operators, each a kernel launch. On a GPU a
# decode step is bound by memory and by launches, so the retrieval family's promise (read
# $B/T$ of the cache) is kept only when the chosen pages are read where they lie. This
# notebook writes that kernel, in the style of FlashDecoding: the page list is cut into
# `splits` contiguous parts, one program per (batch row, KV head, part) walks its pages with an
# online softmax for all $G$ query heads of the KV head at once, and a short reduction merges
# the parts by their log-sum-exps.
#
# Everything here is checked on this machine's CPU under Triton's interpreter
# (`TRITON_INTERPRET=1`, set before Triton is imported); it is timed on a GPU by
# `make gpu-check` when one is lent.

# %%
#| export
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from sparsekv.attention import check_int, content_checks, softmax_scale
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
# For batch row $b$ and KV head $h$ with chosen pages $p_1, \dots, p_n$ (indices of complete
# pages, $p_i < P = \lfloor T/m \rfloor$), the keys a decode query of head $h' \in$ the group
# of $h$ sees are the tokens $\{p_i m + j : 0 \le j < m\}$ of each chosen page and the partial
# page $\{Pm, \dots, T - 1\}$ (empty when $m$ divides $T$). The output is the softmax-weighted
# sum of their values, a page chosen twice counting twice (as the eager gather does). The
# reference below builds those token lists in Python and attends to each row with one softmax.

# %%
#| export
def paged_decode_reference(q: Tensor, k: Tensor, v: Tensor, pages: Tensor, page_size: int,
                           scale: float | None = None) -> Tensor:
    "Decode attention [B, Hq, 1, D] of q over the complete pages `pages` [B, Hkv, n] of k, v and the partial page."
    B, Hkv, T, D = k.shape
    G, m, s = q.shape[1] // Hkv, page_size, softmax_scale(scale, D)
    out = torch.empty(q.shape, dtype=q.dtype)
    for b in range(B):
        for h in range(Hkv):
            tokens = [p * m + j for p in pages[b, h].tolist() for j in range(m)] + list(range(T // m * m, T))
            keys, values = k[b, h, tokens].double(), v[b, h, tokens].double()
            for g in range(G):
                w = torch.softmax(keys @ q[b, h * G + g, 0].double() * s, dim=0)
                out[b, h * G + g, 0] = (w @ values).to(q.dtype)
    return out


# %%
# by hand: one KV head of one query head, page size 2, T = 5 (pages 0, 1 and the partial page {4}); choosing page 1
# attends to tokens 2, 3, 4. Keys that score 0 weigh their values equally.
_k, _v = torch.zeros(1, 1, 5, 2), torch.arange(10.).view(1, 1, 5, 2)
_out = paged_decode_reference(torch.ones(1, 1, 1, 2), _k, _v, torch.tensor([[[1]]]), 2)
test_eq(_out.flatten().tolist(), [(4 + 6 + 8) / 3, (5 + 7 + 9) / 3])
# no page chosen: the partial page alone; a page chosen twice counts twice (tokens 0, 1, 0, 1, 4)
test_eq(paged_decode_reference(torch.ones(1, 1, 1, 2), _k, _v, torch.zeros(1, 1, 0, dtype=torch.long), 2)
        .flatten().tolist(), [8.0, 9.0])
assert_close(paged_decode_reference(torch.ones(1, 1, 1, 2), _k, _v, torch.tensor([[[0, 0]]]), 2).flatten(),
             torch.tensor([(0 + 2 + 0 + 2 + 8) / 5, (1 + 3 + 1 + 3 + 9) / 5]))


# %% [markdown]
# ## The kernel
#
# One program per (row, KV head, part). It loads the $G$ queries of its KV head once
# ($[G, D]$, padded to powers of two), then for each of its page-list entries $i$ loads one
# page of keys and values ($[m, D]$, strided reads straight from the cache) and updates the
# running maximum $\mu$, normalizer $\ell$ and weighted sum $a$ of every query:
#
# $$\mu' = \max(\mu, \max_j s_j), \quad \ell' = \ell\, e^{\mu - \mu'} + \sum_j e^{s_j - \mu'},
# \quad a' = a\, e^{\mu - \mu'} + \sum_j e^{s_j - \mu'} v_j .$$
#
# Entry $i = n$ is the partial page: the list is read with the page index $P$ past its end,
# so the page starting at $Pm$ is read with its tokens $\ge T$ masked. A part writes its
# normalized output $a/\ell$ and its log-sum-exp $\mu + \log \ell$ ($-\infty$ for a part with
# no key); the parts merge as $o = \sum_s \mathrm{softmax}(\mathrm{lse})_s\, o_s$.
# The products are sums of elementwise products (not `tl.dot`): at one query per head there
# is nothing for a tensor core to do, and the kernel then compiles for any $G$, $m$, $D$.

# %%
#| export
@functools.cache
def _paged_decode_kernel():
    "Build the Triton kernel of the paged decode (imported lazily: Triton is optional)."
    import triton
    import triton.language as tl

    # tl.sum, tl.max and tl.zeros are jit functions of Triton's library, which the interpreter runs only if Triton was
    # imported with it on (transformers imports Triton early): here their builtins, tl.reduce of their combine functions
    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, pages_ptr, o_ptr, lse_ptr, sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h,
               sv_t, sv_d, sp_b, sp_h, sp_n, Hkv, G, n, per, T, m, scale, BLOCK_G: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)   # row = b * Hkv + h
        b, h = row // Hkv, row % Hkv
        g, j, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
        gm, dm = g < G, d < D
        q = tl.load(q_ptr + b * sq_b + (h * G + g)[:, None] * sq_h + d[None, :] * sq_d, gm[:, None] & dm[None, :], 0.0)
        q = q.to(tl.float32) * scale
        mu = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        ell = tl.full((BLOCK_G,), 0.0, tl.float32)
        acc = tl.full((BLOCK_G, BLOCK_D), 0.0, tl.float32)
        for i in range(part * per, tl.minimum(part * per + per, n + 1)):
            page = tl.load(pages_ptr + b * sp_b + h * sp_h + i * sp_n, mask=i < n, other=T // m)  # n: partial page
            t = page * m + j
            tm = (j < m) & (t < T)
            kv_mask = tm[:, None] & dm[None, :]
            key = tl.load(k_ptr + b * sk_b + h * sk_h + t[:, None] * sk_t + d[None, :] * sk_d, kv_mask, 0.0)
            key = key.to(tl.float32)
            s = tl.reduce(q[:, None, :] * key[None, :, :], 2, tl.standard._sum_combine)  # [BLOCK_G, BLOCK_M]
            s = tl.where(tm[None, :], s, float("-inf"))
            new = tl.maximum(mu, tl.reduce(s, 1, tl.standard._elementwise_max))
            safe = tl.where(new == float("-inf"), 0.0, new)   # no key yet: keep the sums at 0, not NaN
            p = tl.exp(s - safe[:, None])
            alpha = tl.exp(mu - safe)
            val = tl.load(v_ptr + b * sv_b + h * sv_h + t[:, None] * sv_t + d[None, :] * sv_d, kv_mask, 0.0)
            val = val.to(tl.float32)
            ell = ell * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            acc = acc * alpha[:, None] + tl.reduce(p[:, :, None] * val[None, :, :], 1, tl.standard._sum_combine)
            mu = new
        out = (row * tl.num_programs(1) + part) * BLOCK_G + g                               # [rows, parts, BLOCK_G]
        tl.store(o_ptr + out[:, None] * BLOCK_D + d[None, :], acc / tl.maximum(ell, 1e-30)[:, None])
        tl.store(lse_ptr + out, tl.where(ell > 0, mu + tl.log(tl.maximum(ell, 1e-30)), float("-inf")))

    return kernel


# %%
_kernel = _paged_decode_kernel()
assert _paged_decode_kernel() is _kernel  # built once


# %% [markdown]
# How many parts: enough programs to fill a GPU (its multiprocessors, twice over) but at least
# four pages a part, so that the merge stays small beside the reads; one part when the list is
# short. On a CPU under the interpreter the count only changes how the work is cut.

# %%
#| export
def default_splits(rows: int, entries: int, device: torch.device) -> int:
    "Parts to cut a page list of `entries` (pages + the partial page) into, for `rows` (batch row, KV head) programs."
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(math.ceil(2 * units / max(rows, 1)), entries // 4))


# %%
test_eq(default_splits(3, 65, torch.device("cpu")), 1)   # a CPU: one part
test_eq(default_splits(3, 3, torch.device("cpu")), 1)    # a short list: one part


# %% [markdown]
# `paged_decode` checks its arguments, launches the kernel on a grid of (rows, parts) and
# merges the parts. Its values are checked outside the per-step path only (reading them back
# would make the host wait, see `content_checks`).

# %%
#| export
def _check_paged(q: Tensor, k: Tensor, v: Tensor, pages: Tensor, page_size: int) -> int:
    "The group size G of a paged decode's arguments, after checking them (page values outside the per-step path)."
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be one decode query [B, Hq, 1, D], got {tuple(q.shape)}")
    if (k.dim() != 4 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]
            or q.shape[1] % k.shape[1]):
        raise ValueError(f"k and v must be [B, Hkv, T, D] with Hq a multiple of Hkv for q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    m, (B, Hkv, T, _) = check_int(page_size, "page_size", 1), k.shape
    if pages.dtype != torch.long or pages.dim() != 3 or pages.shape[:2] != (B, Hkv):
        raise ValueError(f"pages must be int64 [B, Hkv, n] = [{B}, {Hkv}, n], got {pages.dtype} {tuple(pages.shape)}")
    if pages.shape[2] == 0 and T % m == 0:
        raise ValueError(f"no key to attend: no page chosen and T={T} fills its pages")
    if content_checks() and pages.numel() and not 0 <= int(pages.min()) <= int(pages.max()) < T // m:
        raise ValueError(f"pages must be indices of complete pages, in [0, {T // m}), got values outside it")
    require_triton_device(q)
    return q.shape[1] // Hkv


# %%
_q, _k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 10, 8)
_p = torch.zeros(1, 2, 1, dtype=torch.long)
test_eq(_check_paged(_q, _k, _k, _p, 4), 2)
test_fail(lambda: _check_paged(_q.expand(1, 4, 2, 8), _k, _k, _p, 4), contains="one decode query")
test_fail(lambda: _check_paged(_q, _k, _k[:, :1], _p, 4), contains="k and v must be")
test_fail(lambda: _check_paged(_q, _k, _k, _p.int(), 4), contains="pages must be int64")
test_fail(lambda: _check_paged(_q, _k, _k, _p + 2, 4), contains="complete pages, in [0, 2)")  # page 2 is partial
test_fail(lambda: _check_paged(_q, _k, _k, _p, 0), contains="page_size must be")
test_fail(lambda: _check_paged(_q, _k[:, :, :8], _k[:, :, :8], _p[..., :0], 4), contains="no key to attend")


# %%
#| export
def paged_decode(q: Tensor, k: Tensor, v: Tensor, pages: Tensor, page_size: int, scale: float | None = None,
                 splits: int | None = None) -> Tensor:
    """Decode attention [B, Hq, 1, D] of q over the complete pages `pages` [B, Hkv, n] of k, v [B, Hkv, T, D] and the
    partial page, by the Triton kernel (CUDA, or TRITON_INTERPRET=1), read in place; `splits`: parts of the list."""
    G, (B, Hkv, T, D), n = _check_paged(q, k, v, pages, page_size), k.shape, pages.shape[2]
    parts = default_splits(B * Hkv, n + 1, q.device) if splits is None else check_int(splits, "splits", 1)
    per = math.ceil((n + 1) / parts)
    from triton import next_power_of_2 as pow2  # block sizes (Triton, optional, is imported on first use)
    BG, BD = pow2(G), pow2(D)
    o = torch.empty(B * Hkv, parts, BG, BD, dtype=torch.float32, device=q.device)
    lse = torch.empty(B * Hkv, parts, BG, dtype=torch.float32, device=q.device)
    _paged_decode_kernel()[(B * Hkv, parts)](
        q, k, v, pages, o, lse, q.stride(0), q.stride(1), q.stride(3), *k.stride(), *v.stride(), *pages.stride(),
        Hkv, G, n, per, T, page_size,
        softmax_scale(scale, D), BLOCK_G=BG, BLOCK_M=pow2(page_size), BLOCK_D=BD, D=D)
    out = o[..., :G, :D] if parts == 1 else (lse[..., :G].softmax(1)[..., None] * o[..., :G, :D]).sum(1, keepdim=True)
    return out.reshape(B, Hkv * G, 1, D).to(q.dtype)


# %% [markdown]
# The kernel against the reference: random caches, several group sizes, page sizes that are
# not powers of two, caches that end with or without a partial page, pages chosen twice, no
# page, every split count, a cache that is a strided slice of a larger buffer (as a
# preallocated cache is) and tensors of any strides.

# %%
torch.manual_seed(0)
for B, Hkv, G, T, m, D, n, parts in ((1, 1, 1, 8, 4, 8, 1, 1), (2, 2, 3, 37, 5, 16, 4, 2), (1, 3, 7, 64, 8, 12, 5, 3),
                                     (2, 1, 2, 22, 4, 8, 0, 1), (1, 2, 4, 33, 16, 32, 2, 5)):
    q, k, v = torch.randn(B, Hkv * G, 1, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    pages = torch.randint(0, T // m, (B, Hkv, n))
    want = paged_decode_reference(q, k, v, pages, m)
    assert_close(paged_decode(q, k, v, pages, m, splits=parts), want, atol=1e-5, rtol=1e-5)
    assert_close(paged_decode(q, k, v, pages, m), want, atol=1e-5, rtol=1e-5)
# a cache preallocated for 48 tokens, 29 of them filled; a scale of its own
buf = torch.randn(2, 2, 48, 8)
k, v, q, pages = buf[:, :, :29], buf.flip(2)[:, :, :29], torch.randn(2, 4, 1, 8), torch.tensor([[[0, 6], [3, 3]]] * 2)
assert_close(paged_decode(q, k, v, pages, 4, scale=0.3, splits=2), paged_decode_reference(q, k, v, pages, 4, 0.3),
             atol=1e-5, rtol=1e-5)
# head dim not the last in memory, pages a strided view
kt, qt = k.mT.contiguous().mT, q.transpose(1, 3).contiguous().transpose(1, 3)
pt = torch.stack([pages, pages], -1)[..., 0]
assert_close(paged_decode(qt, kt, v, pt, 4), paged_decode_reference(q, k, v, pages, 4), atol=1e-5, rtol=1e-5)
# half and bfloat16 in, the same out (the kernel accumulates in float32, as the reference in float64)
for dtype in (torch.float16, torch.bfloat16):
    out = paged_decode(q.to(dtype), k.to(dtype), v.to(dtype), pages, 4)
    test_eq(out.dtype, dtype)
    assert_close(out, paged_decode_reference(q.to(dtype), k.to(dtype), v.to(dtype), pages, 4))
