# %% [markdown]
# # Evaluation metrics and the evaluation grid
#
# > Metrics shared by every method (agreement, KL, perplexity, recalls and their tails, needle retention, output error, pass@k) and a grid runner.

# %%
#| default_exp eval

# %% [markdown]
# Every method in this project is judged against the **dense teacher**: the same model with
# full attention. Some metrics compare final predictions (next-token agreement, KL,
# perplexity, task accuracy, pass@k); others look inside one attention layer and do not
# depend on how hard a task is (how much attention probability the kept keys carry, how
# far the attention output moves, how many of the oracle's keys a policy keeps).
#
# Conventions shared by the functions below:
#
# - logits are `[..., V]` (usually `[B, S, V]`) and are converted to at least float32
#   before any softmax; a `mask` of valid positions is a boolean tensor of shape
#   `logits.shape[:-1]`;
# - attention tensors follow the project layout: `q [B, Hq, Sq, D]`, `k, v [B, Hkv, Sk, D]`,
#   query head `h*G + g` reads KV head `h`;
# - per-query metrics are returned unreduced (`[B, Hq, Sq]`), so a caller can average per
#   head, per layer or per position; `per_head_mean` is the reduction used in the reports;
# - every function has a brute-force `*_reference` beside it (loops, Python sets, explicit
#   enumeration) that the checks and the tests compare against.

# %%
#| export
# Over 400 lines on purpose: each metric sits beside its brute-force reference, and the evaluation grid's
# results-file bookkeeping (keys, row checks, damaged rows) belongs with the metrics it records.
from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import numbers
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparsekv.attention import check_int, require_finite
from sparsekv.io import write_csv

# %%
import tempfile

from fastcore.test import test_close, test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# ## Input checks
#
# Small helpers shared by the metrics: each raises a `TypeError`/`ValueError` that names the
# argument and what is accepted.

# %%
#| export
def _f32(x: torch.Tensor) -> torch.Tensor:
    "`x` in float32, or float64 if it already is."
    return x.to(torch.promote_types(x.dtype, torch.float32))


# %%
test_eq([_f32(torch.zeros(1, dtype=dt)).dtype for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64)],
        [torch.float32] * 3 + [torch.float64])


# %%
#| export
def _check_float(x, name: str, min_dim: int = 1) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if x.dim() < min_dim: raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")
    if x.numel() == 0: raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


# %%
_x = torch.zeros(2, 3)
assert _check_float(_x, "x", 2) is _x
test_fail(lambda: _check_float(_x.long(), "x"), exc=TypeError,
          contains="x must be a floating-point tensor, got Tensor of dtype torch.int64")
test_fail(lambda: _check_float([1.0], "x"), exc=TypeError, contains="x must be a floating-point tensor, got list")
test_fail(lambda: _check_float(_x, "x", 3), contains="x must have at least 3 dims, got shape (2, 3)")
test_fail(lambda: _check_float(torch.zeros(0, 3), "x"), contains="x must not be empty")


# %%
#| export
def _check_pair(student, teacher, names=("student_logits", "teacher_logits"), min_dim: int = 2):
    _check_float(student, names[0], min_dim), _check_float(teacher, names[1], min_dim)
    if student.shape != teacher.shape:
        raise ValueError(f"{names[0]} {tuple(student.shape)} and {names[1]} {tuple(teacher.shape)} must have the same "
                         "shape")


# %%
_check_pair(torch.zeros(2, 3), torch.ones(2, 3))
test_fail(lambda: _check_pair(torch.zeros(2, 3), torch.zeros(3, 2)),
          contains="student_logits (2, 3) and teacher_logits (3, 2) must have the same shape")
test_fail(lambda: _check_pair(torch.zeros(3), torch.zeros(3)), contains="student_logits must have at least 2 dims")


# %%
#| export
def _check_positions(mask, shape, name: str = "mask"):
    "Validate an optional boolean mask of valid positions of the given shape."
    if mask is None: return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a boolean tensor of shape {tuple(shape)} or None, got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.shape != shape: raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    if not mask.any(): raise ValueError(f"{name} selects no position")
    return mask


# %%
_m = torch.tensor([[True, False]])
test_eq((_check_positions(None, (1, 2)), _check_positions(_m, (1, 2)) is _m), (None, True))
test_fail(lambda: _check_positions(_m.int(), (1, 2)), exc=TypeError,
          contains="mask must be a boolean tensor of shape (1, 2) or None, got torch.int32")
test_fail(lambda: _check_positions(_m, (2, 1)), contains="mask must have shape (2, 1), got (1, 2)")
test_fail(lambda: _check_positions(_m & ~_m, (1, 2)), contains="mask selects no position")


# %%
#| export
def _masked_mean(x: torch.Tensor, mask) -> torch.Tensor:
    "Mean of `x` over the positions where `mask` is True (all positions when `mask` is None)."
    return x.mean() if mask is None else x[mask].mean()


# %%
test_eq(_masked_mean(torch.tensor([1.0, 2.0, 6.0]), None).item(), 3.0)
test_eq(_masked_mean(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([True, False, True])).item(), 3.5)

# %% [markdown]
# Logits of long sequences are large (`[8192, 49152]` is 1.6 GB in float32), and a softmax
# makes several copies. The per-position metrics therefore run over blocks of rows of the
# flattened leading dimensions, which bounds the float32 temporaries to `_ROWS × V`.

# %%
#| export
_ROWS = 512


def _rowwise(fn: Callable, *xs: torch.Tensor) -> torch.Tensor:
    "Apply `fn` to blocks of `_ROWS` rows of `xs` (leading dims of `xs[0]` flattened): a value per row, in those dims."
    lead = xs[0].shape[:-1]
    flat = [x.reshape(-1, *x.shape[len(lead):]) for x in xs]
    out = [fn(*(f[i:i + _ROWS] for f in flat)) for i in range(0, flat[0].shape[0], _ROWS)]
    return torch.cat(out).reshape(lead)


# %%
_x, _y = torch.randn(3, 700, 5), torch.randn(3, 700, 5)  # 2,100 rows: four blocks of 512 and one of 52
_blocks = []
test_eq(_rowwise(lambda a: _blocks.append(len(a)) or a.sum(-1), _x), _x.sum(-1))
test_eq(_blocks, [512] * 4 + [52])
assert_close(_rowwise(lambda a, b: (a * b).sum(-1), _x, _y), (_x * _y).sum(-1))


# %% [markdown]
# ## Next-token agreement with the teacher
#
# At each position the student and the teacher predict a next-token distribution from
# their logits $z^S, z^T \in \mathbb{R}^V$. **Top-1 agreement** is the fraction of valid
# positions where $\arg\max_v z^S_v = \arg\max_v z^T_v$ (ties resolved to the lowest token
# id by `torch.argmax`, the same rule on both sides).

# %%
#| export
def top1_agreement(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    "Fraction of valid positions where the student's and the teacher's most likely next tokens agree."
    _check_pair(student_logits, teacher_logits)
    mask = _check_positions(mask, teacher_logits.shape[:-1])
    same = student_logits.argmax(-1) == teacher_logits.argmax(-1)
    return _masked_mean(same.float(), mask)


# %%
# by hand: the teacher's top tokens are 1, 1, 0 and the student's 1, 0, 0
_t, _s = torch.tensor([[[0.0, 5], [0, 1], [2, 1]]]), torch.tensor([[[1.0, 2], [3, 1], [4, 0]]])
test_close(top1_agreement(_s, _t).item(), 2 / 3, eps=1e-6)
test_eq(top1_agreement(_s, _t, torch.tensor([[True, True, False]])).item(), 0.5)


# %%
#| export
def top1_agreement_reference(student_logits, teacher_logits, mask=None) -> float:
    "Brute-force `top1_agreement`: a Python loop over positions."
    s = student_logits.reshape(-1, student_logits.shape[-1]).tolist()
    t = teacher_logits.reshape(-1, teacher_logits.shape[-1]).tolist()
    m = [True] * len(s) if mask is None else mask.reshape(-1).tolist()
    hits = [s_.index(max(s_)) == t_.index(max(t_)) for s_, t_, ok in zip(s, t, m) if ok]
    return sum(hits) / len(hits)


# %%
torch.manual_seed(0)
t = torch.randn(3, 7, 5)
s = t + 0.8 * torch.randn(3, 7, 5)
m = torch.rand(3, 7) > 0.3
test_close(top1_agreement(s, t).item(), top1_agreement_reference(s, t), eps=1e-6)
test_close(top1_agreement(s, t, m).item(), top1_agreement_reference(s, t, m), eps=1e-6)
test_eq(top1_agreement(t, t).item(), 1.0)
test_fail(lambda: top1_agreement(s, t[:, :6]), contains="same shape")
test_fail(lambda: top1_agreement(s, t, m[:, :6]), contains="mask must have shape")
test_fail(lambda: top1_agreement(s, t, torch.zeros(3, 7, dtype=torch.bool)), contains="selects no position")


# %% [markdown]
# ## KL divergence to the teacher
#
# With $\log p_v = z_v - \operatorname{LSE}(z)$, $\operatorname{LSE}(z) = \log\sum_u e^{z_u}$
# (`log_softmax`, computed in float32), the forward KL from the teacher to the student at
# one position is
#
# $$\mathrm{KL}(p^T \,\|\, p^S) = \sum_{v=1}^{V} p^T_v \left(\log p^T_v - \log p^S_v\right),$$
#
# where a term with $p^T_v = 0$ counts as $0$. `kl_to_teacher` averages it over the valid
# positions. Gradients flow to the student logits, so the same function is a
# distillation loss.
#
# ### Restricted to the teacher's top-$k$ logits
#
# KVpop's distillation loss (App. F: "KL Top-$k$ 256", temperature 1, forward KL) evaluates
# the KL only on the teacher's $k$ largest logits. We define it as the KL between the two
# distributions **renormalized on that set**. Let $\mathcal{T}$ be the indices of the
# teacher's top-$k$ logits at the position (chosen by `torch.topk`; exact ties at the
# boundary are rare in practice and resolved by `torch.topk`), and
#
# $$\tilde p^T_i = \frac{e^{z^T_i}}{\sum_{j\in\mathcal T} e^{z^T_j}}, \qquad
#   \tilde p^S_i = \frac{e^{z^S_i}}{\sum_{j\in\mathcal T} e^{z^S_j}}, \qquad i \in \mathcal T,$$
#
# $$\mathrm{KL}_{\mathcal T} = \sum_{i\in\mathcal T} \tilde p^T_i\left(\log\tilde p^T_i - \log\tilde p^S_i\right).$$
#
# Both are proper distributions on $\mathcal T$, so $\mathrm{KL}_{\mathcal T} \ge 0$, with
# equality iff the student's logits on $\mathcal T$ equal the teacher's up to one constant;
# at $k = V$ it is the full KL. The teacher's mass outside $\mathcal T$ is dropped, and the
# student is not penalized for mass it puts outside $\mathcal T$.
#
# The variant `renormalize_student=False` keeps the student's *full* log-probabilities
# $\log p^S_i$ on $\mathcal T$. Since $\log p^S_i = \log\tilde p^S_i + \log m^S_{\mathcal T}$
# with $m^S_{\mathcal T} = \sum_{j\in\mathcal T} p^S_j$ the student's mass on $\mathcal T$,
#
# $$\sum_{i\in\mathcal T}\tilde p^T_i\left(\log\tilde p^T_i - \log p^S_i\right)
#   = \mathrm{KL}_{\mathcal T} - \log m^S_{\mathcal T} \;\ge\; \mathrm{KL}_{\mathcal T},$$
#
# i.e. it adds a penalty for the student's mass outside the teacher's top-$k$.

# %%
#| export
def _kl_from_log_probs(lt: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    "Row sums of p_t (log p_t - log p_s), with 0 where p_t = 0."
    pt = lt.exp()
    return torch.where(pt > 0, pt * (lt - ls), 0.0).sum(-1)


# %%
# p_t = (1/2, 1/2, 0), p_s = (1/4, 1/2, 1/4): KL = 1/2 log 2; a zero of p_t counts 0 even against log p_s = -inf
_lt, _ls = torch.tensor([[0.5, 0.5, 0.0]]).log(), torch.tensor([[0.25, 0.5, 0.25]]).log()
test_close(_kl_from_log_probs(_lt, _ls).item(), 0.5 * math.log(2), eps=1e-6)
_ls_inf = _ls.index_fill(-1, torch.tensor([2]), -math.inf)
test_close(_kl_from_log_probs(_lt, _ls_inf).item(), 0.5 * math.log(2), eps=1e-6)


# %%
#| export
def _kl_rows(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _kl_from_log_probs(F.log_softmax(_f32(t), -1), F.log_softmax(_f32(s), -1))


# %%
_s, _t = torch.randn(4, 7), torch.randn(4, 7)
_kl_torch = F.kl_div(F.log_softmax(_s, -1), F.log_softmax(_t, -1), reduction="none", log_target=True).sum(-1)
assert_close(_kl_rows(_s, _t), _kl_torch)
test_eq(_kl_rows(_s.half(), _t.half()).dtype, torch.float32)


# %%
#| export
def _topk_kl_rows(s: torch.Tensor, t: torch.Tensor, k: int, renormalize_student: bool) -> torch.Tensor:
    s, t = _f32(s), _f32(t)
    zt, idx = t.topk(k, dim=-1)
    zs = s.gather(-1, idx)
    ls = F.log_softmax(zs, -1) if renormalize_student else zs - s.logsumexp(-1, keepdim=True)
    return _kl_from_log_probs(F.log_softmax(zt, -1), ls)


# %%
assert_close(_topk_kl_rows(_s, _t, 7, True), _kl_rows(_s, _t))  # k = V: the full KL
test_eq(_topk_kl_rows(_s, _t, 1, True), torch.zeros(4))          # one token renormalized: both put all mass on it
# not renormalized, k = 1: minus the student's log-probability of the teacher's top token
assert_close(_topk_kl_rows(_s, _t, 1, False), -F.log_softmax(_s, -1).gather(-1, _t.argmax(-1, keepdim=True))[:, 0])


# %%
#| export
def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, top_k: int | None = None,
             renormalize_student: bool = True) -> torch.Tensor:
    """Per-position KL(teacher || student) of logits `[..., V]`, on all tokens or the teacher's `top_k` (renormalized);
    -inf logits (masked tokens) are allowed, NaN and +inf refused."""
    _check_pair(student_logits, teacher_logits)
    require_finite("student_logits", student_logits, neg_inf=True)
    require_finite("teacher_logits", teacher_logits, neg_inf=True)
    if top_k is None: return _rowwise(_kl_rows, student_logits, teacher_logits)
    k = check_int(top_k, "top_k", 1, teacher_logits.shape[-1])
    return _rowwise(lambda s, t: _topk_kl_rows(s, t, k, renormalize_student), student_logits, teacher_logits)


# %%
_s3, _t3 = torch.randn(2, 300, 6), torch.randn(2, 300, 6)  # 600 rows: two blocks
assert_close(token_kl(_s3, _t3),
             F.kl_div(F.log_softmax(_s3, -1), F.log_softmax(_t3, -1), reduction="none", log_target=True).sum(-1))
assert_close(token_kl(_s3, _t3, top_k=6), token_kl(_s3, _t3))
test_fail(lambda: token_kl(_s3, _t3, top_k=0), contains="top_k must be an int in [1, 6]")


# %%
#| export
def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                  top_k: int | None = None, renormalize_student: bool = True) -> torch.Tensor:
    "Mean over valid positions of KL(teacher || student) (see `token_kl`)."
    mask = _check_positions(mask, teacher_logits.shape[:-1])
    return _masked_mean(token_kl(student_logits, teacher_logits, top_k, renormalize_student), mask)


# %%
_first = torch.arange(300).expand(2, 300) < 100
test_close(kl_to_teacher(_s3, _t3, _first).item(), token_kl(_s3, _t3)[:, :100].mean().item(), eps=1e-6)
test_close(kl_to_teacher(_s3, _t3, top_k=2).item(), token_kl(_s3, _t3, top_k=2).mean().item(), eps=1e-6)


# %% [markdown]
# The brute-force reference works one position at a time in float64 with explicit
# exponentials, and picks the top-$k$ set with Python's `sorted`:
#
# Checks: both variants against the reference; $k = V$ gives the full KL; the identity
# $\mathrm{KL}_{\mathcal T}$ minus $\log m^S_{\mathcal T}$; invariance to adding a constant
# to the student's logits; zero for a student equal to the teacher on $\mathcal T$ up to a
# shift; gradients reach the student.

# %%
#| export
def token_kl_reference(student_logits, teacher_logits, top_k=None, renormalize_student=True) -> torch.Tensor:
    "Brute-force `token_kl`: per position, explicit float64 softmaxes over the (top-k) token set."
    V = teacher_logits.shape[-1]
    s2, t2 = student_logits.double().reshape(-1, V), teacher_logits.double().reshape(-1, V)
    out = []
    for s, t in zip(s2, t2):
        idx = sorted(range(V), key=lambda i: -t[i].item())[:top_k or V]
        pt = t[idx].exp() / t[idx].exp().sum()
        ps = s[idx].exp() / (s[idx] if renormalize_student else s).exp().sum()
        out.append(sum(p * (p.log() - q.log()) for p, q in zip(pt, ps) if p > 0))
    return torch.stack(out).reshape(teacher_logits.shape[:-1])


# %%
torch.manual_seed(1)
V = 11
t = 2 * torch.randn(2, 5, V)
s = t + torch.randn(2, 5, V)
assert_close(token_kl(s, t), token_kl_reference(s, t).float(), rtol=1e-5, atol=1e-6)
for k in (1, 3, V):
    for renorm in (True, False):
        assert_close(token_kl(s, t, top_k=k, renormalize_student=renorm),
                     token_kl_reference(s, t, top_k=k, renormalize_student=renorm).float(), rtol=1e-5, atol=1e-6)
assert_close(token_kl(s, t, top_k=V), token_kl(s, t))
idx = t.topk(4, -1).indices
m_s = F.softmax(s, -1).gather(-1, idx).sum(-1)
assert_close(token_kl(s, t, top_k=4, renormalize_student=False), token_kl(s, t, top_k=4) - m_s.log())
assert_close(token_kl(s + 3.0, t), token_kl(s, t))
s_on_T = torch.full_like(t, -5.0).scatter(-1, idx, t.gather(-1, idx) + 1.5)  # equal to the teacher on T up to +1.5
assert_close(token_kl(s_on_T, t, top_k=4), torch.zeros(2, 5), atol=1e-6, rtol=0)
assert (token_kl(s, t) >= 0).all() and (token_kl(s, t, top_k=3) >= 0).all()
m = torch.tensor([[True, False, True, True, False], [False, False, True, False, False]])
test_close(kl_to_teacher(s, t, m).item(), token_kl_reference(s, t)[m].mean().item(), eps=1e-5)
s_req = s.clone().requires_grad_()
kl_to_teacher(s_req, t, top_k=4).backward()
assert s_req.grad.abs().sum() > 0 and torch.isfinite(s_req.grad).all()
test_fail(lambda: token_kl(s, t, top_k=V + 1), contains="top_k must be an int in [1, 11]")
test_fail(lambda: token_kl(s, t.long()), contains="teacher_logits must be a floating-point tensor")
# NaN or +inf logits would give a NaN KL; -inf (a masked token) is allowed, see below
nan_s, inf_t = s.index_fill(-1, torch.tensor([2]), math.nan), t.index_fill(-1, torch.tensor([0]), math.inf)
test_fail(lambda: kl_to_teacher(nan_s, t), contains="student_logits contains NaN")
test_fail(lambda: kl_to_teacher(s, inf_t), contains="teacher_logits contains NaN")

# %% [markdown]
# A teacher that gives some tokens probability exactly zero (logit $-\infty$) contributes
# nothing there, and low-precision logits are promoted to float32:

# %%
t_inf = t.clone(); t_inf[..., 0] = -float("inf")
assert torch.isfinite(token_kl(s, t_inf)).all()
assert_close(token_kl(s, t_inf), token_kl_reference(s, t_inf).float(), rtol=1e-5, atol=1e-6)
assert_close(token_kl(s.bfloat16(), t.bfloat16()), token_kl(s.bfloat16().float(), t.bfloat16().float()))
test_eq(token_kl(s.bfloat16(), t.bfloat16()).dtype, torch.float32)


# %% [markdown]
# ## Perplexity and token accuracy
#
# With `labels` the input ids (the Hugging Face convention), the logits at position $t$
# predict the label at $t+1$: `shift=True` pairs `logits[..., :-1, :]` with
# `labels[..., 1:]`. Positions whose label is `ignore_index` (-100) are not scored. With
# $\mathcal V$ the scored positions,
#
# $$\mathrm{NLL}_t = -\log p_\theta(y_{t+1}\mid x_{\le t}) = \operatorname{LSE}(z_t) - z_{t, y_{t+1}},
#   \qquad \mathrm{PPL} = \exp\Big(\frac{1}{|\mathcal V|}\sum_{t\in\mathcal V}\mathrm{NLL}_t\Big),$$
#
# and token accuracy is the fraction of $t \in \mathcal V$ with $\arg\max_v z_{t,v} = y_{t+1}$.
# To aggregate perplexity over several batches, sum `token_nll`'s values and count its
# valid positions, then exponentiate the ratio (a mean of per-batch perplexities is not the
# perplexity of the union).

# %%
#| export
def _shifted(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, shift: bool):
    "Validate `logits [..., S, V]`, `labels [..., S]`; return the aligned pair and the mask of scored positions."
    _check_float(logits, "logits", 2)
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels).__name__)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, got "
                         f"{tuple(labels.shape)}")
    V = logits.shape[-1]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bad.any():
        raise ValueError(f"labels must be in [0, {V}) or ignore_index={ignore_index}, got {labels[bad][0].item()}")
    if shift:
        if logits.shape[-2] < 2:
            raise ValueError(f"shift=True needs at least 2 positions, got logits of shape {tuple(logits.shape)}")
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    return logits, labels, labels != ignore_index


# %%
_z, _y = torch.randn(2, 4, 5), torch.tensor([[1, 2, -100, 4], [0, -100, 3, 3]])
test_eq(_shifted(_z, _y, -100, True), (_z[:, :-1], _y[:, 1:], _y[:, 1:] != -100))
test_eq(_shifted(_z, _y, -100, False), (_z, _y, _y != -100))
test_fail(lambda: _shifted(_z[:, :1], _y[:, :1], -100, True), contains="shift=True needs at least 2 positions")
test_fail(lambda: _shifted(_z, _y + 5, -100, True), contains="labels must be in [0, 5) or ignore_index=-100, got 6")


# %%
#| export
def token_nll(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
              shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    "Per-position negative log-likelihood of the (next-token) labels, 0 where not scored, and the scored mask."
    logits, labels, valid = _shifted(logits, labels, ignore_index, shift)
    nll = _rowwise(lambda z, y: F.cross_entropy(_f32(z), y, ignore_index=ignore_index, reduction="none"),
                   logits, labels)
    return nll, valid


# %%
_nll, _v = token_nll(_z, _y)
_lp = F.log_softmax(_z[:, :-1], -1)
for b, i in zip(*torch.nonzero(_v, as_tuple=True)):
    test_close(_nll[b, i].item(), -_lp[b, i, _y[b, i + 1]].item(), eps=1e-5)
test_eq(_nll[~_v], torch.zeros(int((~_v).sum())))


# %%
#| export
def perplexity(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
               shift: bool = True) -> torch.Tensor:
    "exp of the mean next-token negative log-likelihood over the scored positions."
    nll, valid = token_nll(logits, labels, ignore_index, shift)
    if not valid.any(): raise ValueError(f"labels has no position to score (all equal ignore_index={ignore_index})")
    return (nll.sum() / valid.sum()).exp()


# %%
test_close(perplexity(_z, _y).item(), math.exp(_nll[_v].mean().item()), eps=1e-4)
test_close(perplexity(torch.zeros(2, 4, 5), _y).item(), 5.0, eps=1e-5)  # uniform over 5 tokens


# %%
#| export
def token_accuracy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                   shift: bool = True) -> torch.Tensor:
    "Fraction of scored positions where the most likely (next) token equals the label."
    logits, labels, valid = _shifted(logits, labels, ignore_index, shift)
    if not valid.any(): raise ValueError(f"labels has no position to score (all equal ignore_index={ignore_index})")
    return (logits.argmax(-1) == labels)[valid].float().mean()


# %%
# predictions 2, 2, 0 for the labels 2, 1 and an ignored one: one hit in two
_z2, _y2 = F.one_hot(torch.tensor([[2, 2, 0, 1]]), 5).float(), torch.tensor([[0, 2, 1, -100]])
test_eq(token_accuracy(_z2, _y2).item(), 0.5)
test_eq(token_accuracy(_z2, torch.tensor([[2, 2, 0, 1]]), shift=False).item(), 1.0)


# %%
#| export
def perplexity_reference(logits, labels, ignore_index=-100, shift=True) -> float:
    "Brute-force `perplexity`: a Python loop over positions with explicit float64 softmaxes."
    z2, y2 = logits.double(), labels
    if shift: z2, y2 = z2[..., :-1, :], y2[..., 1:]
    nlls = [-(z[y].exp() / z.exp().sum()).log().item()
            for z, y in zip(z2.reshape(-1, z2.shape[-1]), y2.reshape(-1).tolist()) if y != ignore_index]
    return math.exp(sum(nlls) / len(nlls))


# %%
torch.manual_seed(2)
z = 3 * torch.randn(2, 9, 13)
y = torch.randint(0, 13, (2, 9))
y[0, 3] = y[1, 0] = y[1, 7] = -100
test_close(perplexity(z, y).log().item(), math.log(perplexity_reference(z, y)), eps=1e-5)
test_close(perplexity(z, y, shift=False).log().item(), math.log(perplexity_reference(z, y, shift=False)), eps=1e-5)
# independent check with torch's own mean cross-entropy on explicitly shifted tensors
test_close(perplexity(z, y).log().item(), F.cross_entropy(z[:, :-1].reshape(-1, 13), y[:, 1:].reshape(-1)).item(),
           eps=1e-5)
nll, valid = token_nll(z, y)
test_eq(valid, y[:, 1:] != -100)
test_eq(nll[~valid], torch.zeros(int((~valid).sum())))
pred, lab = z[:, :-1].argmax(-1), y[:, 1:]
acc_ref = (sum(int(p == l) for p, l in zip(pred.flatten().tolist(), lab.flatten().tolist()) if l != -100)
           / int((lab != -100).sum()))
test_close(token_accuracy(z, y).item(), acc_ref, eps=1e-6)
# a model that puts all its mass on the right next token: perplexity 1, accuracy 1
perfect = F.one_hot(y.roll(-1, 1).clamp_min(0), 13).float() * 100
test_close(perplexity(perfect, y).item(), 1.0, eps=1e-5)
test_eq(token_accuracy(perfect, y).item(), 1.0)
# uniform logits: perplexity = V
test_close(perplexity(torch.zeros(2, 9, 13), y).item(), 13.0, eps=1e-4)
test_fail(lambda: perplexity(z, torch.full_like(y, -100)), contains="no position to score")
test_fail(lambda: perplexity(z, y.clamp_min(0) + 13), contains="labels must be in [0, 13)")
test_fail(lambda: perplexity(z, y[:, :8]), contains="labels must have shape")
test_fail(lambda: perplexity(z, y.float()), contains="labels must be an integer tensor")


# %% [markdown]
# ## Attention-mass recall
#
# Inside one attention layer, query $i$ of query head $h G + g$ scores the keys of KV head
# $h$: $s_{ij} = q_i \cdot k_j / \sqrt{D}$ (or a given `scale`). Dense attention spreads
# probability over the allowed keys $\mathcal A_i$ (by default causal, with the queries
# aligned to the last $S_q$ keys: $j \le i + S_k - S_q$; or any boolean `mask`, True =
# attend, as in `sparsekv.attention.attention_reference`):
#
# $$a_{ij} = \frac{e^{s_{ij}}}{\sum_{l\in\mathcal A_i} e^{s_{il}}}
#          = \exp\!\big(s_{ij} - \operatorname{LSE}_{\mathcal A_i}(s_i)\big), \qquad j\in\mathcal A_i .$$
#
# A sparse method keeps a set $\mathcal K_i$ of keys (per KV head, possibly per query). The
# **attention-mass recall** is the dense probability that falls on kept keys. Summing the
# line above over $j \in \mathcal K_i\cap\mathcal A_i$,
#
# $$m_i = \sum_{j\in\mathcal K_i\cap\mathcal A_i} a_{ij}
#       = \frac{\sum_{j\in\mathcal K_i\cap\mathcal A_i} e^{s_{ij}}}{\sum_{l\in\mathcal A_i} e^{s_{il}}}
#       = \exp\!\big(\operatorname{LSE}_{\mathcal K_i\cap\mathcal A_i}(s_i) - \operatorname{LSE}_{\mathcal A_i}(s_i)\big) \in [0, 1].$$
#
# Two log-sum-exps (each computed stably with its own maximum) replace the normalized
# probabilities. Kept keys outside $\mathcal A_i$ (in a query's future) carry no dense
# mass and do not count. A row with no allowed key has no dense distribution: its recall
# is NaN, and `per_head_mean` skips it.
#
# `keep` is given either as a boolean mask (True = kept) broadcastable to `[B, Hq, Sq, Sk]`
# (a KV-head mask `[B, Hkv, Sq|1, Sk]` is expanded to the group), or as integer indices of
# kept keys, `[B, H, n]` (one set for all queries) or `[B, H, Sq, n]` (a set per query), with
# `H` either `Hkv` (shared by the group) or `Hq`. Scores are formed for `chunk` queries at a
# time, never more than `[B, Hq, chunk, Sk]`.

# %%
#| export
def _check_qk(q, k, v=None) -> int:
    "Validate the attention layout; return the group size G = Hq / Hkv."
    _check_float(q, "q", 4), _check_float(k, "k", 4)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D [B, H, S, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    (B, Hq, _, D), (Bk, Hkv, _, Dk) = q.shape, k.shape
    if (B, D) != (Bk, Dk):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head dim")
    if Hq % Hkv: raise ValueError(f"the query heads ({Hq}) must be a multiple of the KV heads ({Hkv})")
    if v is not None:
        _check_float(v, "v", 4)
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} in batch, heads and length")
    return Hq // Hkv


# %%
test_eq(_check_qk(torch.zeros(1, 6, 2, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5)), 3)
test_fail(lambda: _check_qk(torch.zeros(1, 6, 2, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 2, 4)),
          contains="v (1, 2, 2, 4) must match k (1, 2, 3, 4)")
test_fail(lambda: _check_qk(torch.zeros(1, 6, 2, 4, 1), torch.zeros(1, 2, 3, 4)), contains="must be 4-D")


# %%
#| export
def _broadcast_mask(m: torch.Tensor, name: str, B: int, Hq: int, G: int, Sq: int, Sk: int) -> torch.Tensor:
    "A boolean mask made broadcastable to [B, Hq, Sq, Sk], expanding a KV-head dim to its query heads."
    if m.dim() != 4:
        raise ValueError(f"{name} must be a 4-D boolean mask broadcastable to [B, Hq, Sq, Sk] = {[B, Hq, Sq, Sk]}, "
                         f"got shape {tuple(m.shape)}")
    if G > 1 and m.shape[1] == Hq // G: m = m.repeat_interleave(G, dim=1)
    try:
        ok = torch.broadcast_shapes(m.shape, (B, Hq, Sq, Sk)) == (B, Hq, Sq, Sk)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(m.shape)} is not broadcastable to "
                         f"[B, Hq, Sq, Sk] = {[B, Hq, Sq, Sk]}")
    return m


# %%
_kvm = torch.tensor([True, False]).view(1, 2, 1, 1)  # per KV head, G = 3
test_eq(_broadcast_mask(_kvm, "keep", 1, 6, 3, 2, 3)[0, :, 0, 0].tolist(), [True] * 3 + [False] * 3)
test_eq(_broadcast_mask(torch.ones(1, 1, 1, 3, dtype=torch.bool), "keep", 2, 6, 3, 2, 3).shape, (1, 1, 1, 3))
test_fail(lambda: _broadcast_mask(torch.ones(1, 1, 3, dtype=torch.bool), "keep", 1, 6, 3, 2, 3),
          contains="keep must be a 4-D boolean mask")
test_fail(lambda: _broadcast_mask(torch.ones(1, 4, 1, 3, dtype=torch.bool), "mask", 1, 6, 3, 2, 3),
          contains="mask of shape (1, 4, 1, 3) is not broadcastable")


# %%
#| export
def _keep_mask(keep, B: int, Hq: int, G: int, Sq: int, Sk: int) -> torch.Tensor:
    "The kept keys as a boolean mask broadcastable to [B, Hq, Sq, Sk], from a mask or from indices."
    if not isinstance(keep, torch.Tensor):
        raise TypeError(f"keep must be a boolean mask or an integer index tensor, got {type(keep).__name__}")
    if keep.dtype == torch.bool: return _broadcast_mask(keep, "keep", B, Hq, G, Sq, Sk)
    if keep.is_floating_point() or keep.is_complex():
        raise TypeError(f"keep must be a boolean mask or an integer index tensor, got {keep.dtype}")
    Hkv = Hq // G
    if (keep.dim() not in (3, 4) or keep.shape[0] != B or keep.shape[1] not in (Hkv, Hq)
            or (keep.dim() == 4 and keep.shape[2] != Sq)):
        raise ValueError(f"keep indices must have shape [B, H, n] or [B, H, Sq, n] with B={B}, H in {{{Hkv}, {Hq}}}, "
                         f"Sq={Sq}; got {tuple(keep.shape)}")
    if keep.numel() and (keep.min() < 0 or keep.max() >= Sk):
        raise ValueError(f"keep indices must be in [0, {Sk}), got [{keep.min().item()}, {keep.max().item()}]")
    idx = keep if keep.dim() == 4 else keep[:, :, None]
    m = torch.zeros(*idx.shape[:3], Sk, dtype=torch.bool, device=keep.device).scatter_(-1, idx.long(), True)
    return m.repeat_interleave(G, dim=1) if m.shape[1] != Hq else m


# %%
# KV head 0 keeps keys 0 and 2, KV head 1 key 1 (twice); G = 2 query heads each
_km = _keep_mask(torch.tensor([[[0, 2], [1, 1]]]), 1, 4, 2, 3, 4)
test_eq(_km[0, :, 0].int().tolist(), [[1, 0, 1, 0]] * 2 + [[0, 1, 0, 0]] * 2)
test_eq(_km.shape, (1, 4, 1, 4))
test_fail(lambda: _keep_mask([0, 1], 1, 4, 2, 3, 4), exc=TypeError, contains="got list")
test_fail(lambda: _keep_mask(torch.tensor([[[4], [0]]]), 1, 4, 2, 3, 4), contains="keep indices must be in [0, 4)")
test_fail(lambda: _keep_mask(torch.tensor([[[0]]]), 1, 4, 2, 3, 4), contains="keep indices must have shape")


# %%
#| export
def _allowed_mask(mask, B: int, Hq: int, G: int, Sq: int, Sk: int, device) -> torch.Tensor:
    "Keys dense attention may use: causal aligned to the last Sq keys when `mask` is None."
    if mask is None:
        i, j = torch.arange(Sq, device=device)[:, None], torch.arange(Sk, device=device)
        return (j <= i + (Sk - Sq))[None, None]
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a boolean tensor (True = attend) or None, got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}")
    return _broadcast_mask(mask, "mask", B, Hq, G, Sq, Sk)


# %%
# two queries aligned to the last two of four keys
test_eq(_allowed_mask(None, 1, 1, 1, 2, 4, "cpu")[0, 0].int().tolist(), [[1, 1, 1, 0], [1, 1, 1, 1]])
test_fail(lambda: _allowed_mask(torch.ones(1, 1, 2, 4), 1, 1, 1, 2, 4, "cpu"), exc=TypeError,
          contains="mask must be a boolean tensor (True = attend) or None, got torch.float32")


# %%
#| export
def _query_rows(m: torch.Tensor, sl: slice) -> torch.Tensor:
    return m[:, :, sl] if m.shape[2] > 1 else m


# %%
_rows_m = torch.arange(10).view(1, 1, 5, 2)
test_eq(_query_rows(_rows_m, slice(1, 3)), _rows_m[:, :, 1:3])
test_eq(_query_rows(_rows_m[:, :, :1], slice(1, 3)), _rows_m[:, :, :1])  # one row for every query


# %%
#| export
def _score_blocks(q, k, scale, chunk: int):
    "Yield (query slice, scores [B, Hq, c, Sk] in float32+) per block of `chunk` queries, k not repeated per group."
    B, Hq, Sq, D = q.shape
    Hkv, G = k.shape[1], q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    kf = _f32(k)
    for i in range(0, Sq, chunk):
        qi = _f32(q[:, :, i:i + chunk]).to(kf.dtype)
        c = qi.shape[2]
        s = torch.einsum("bhgqd,bhkd->bhgqk", qi.reshape(B, Hkv, G, c, D), kf) * scale
        yield slice(i, i + c), s.reshape(B, Hq, c, -1)


# %%
_g = torch.Generator().manual_seed(0)
_q, _k = torch.randn(2, 6, 5, 4, generator=_g), torch.randn(2, 2, 7, 4, generator=_g)
_blocks = list(_score_blocks(_q, _k, None, 2))
test_eq([sl for sl, _ in _blocks], [slice(0, 2), slice(2, 4), slice(4, 5)])
assert_close(torch.cat([s for _, s in _blocks], 2), _q @ _k.repeat_interleave(3, 1).transpose(-1, -2) / 2)


# %%
#| export
def _masked_lse(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, s, -math.inf).logsumexp(-1)


# %%
_sc = torch.tensor([[0.0, 1.0, 2.0]])
test_close(_masked_lse(_sc, torch.tensor([[True, False, True]])).item(), math.log(1 + math.e ** 2), eps=1e-6)
test_eq(_masked_lse(_sc, torch.zeros(1, 3, dtype=torch.bool)).item(), -math.inf)


# %%
#| export
def _mass(lse_kept: torch.Tensor, lse_all: torch.Tensor) -> torch.Tensor:
    "exp(lse_kept - lse_all), NaN where no key is allowed."
    return torch.where(torch.isfinite(lse_all), (lse_kept - lse_all).exp(), math.nan)


# %%
test_close(_mass(torch.tensor(math.log(0.25)), torch.tensor(0.0)).item(), 0.25, eps=1e-7)
test_eq(_mass(torch.tensor(-math.inf), torch.tensor(0.0)).item(), 0.0)  # nothing kept
assert _mass(torch.tensor(-math.inf), torch.tensor(-math.inf)).isnan()  # nothing allowed


# %%
#| export
def _prepare(q, k, v, keep, mask, scale, chunk):
    G = _check_qk(q, k, v)
    check_int(chunk, "chunk", 1)
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    return (_keep_mask(keep, B, Hq, G, Sq, Sk).to(q.device),
            _allowed_mask(mask, B, Hq, G, Sq, Sk, q.device).to(q.device))


# %%
_kept, _allowed = _prepare(_q, _k, None, torch.tensor([[[0], [6]]]).expand(2, 2, 1), None, None, 512)
test_eq((_kept.shape, _allowed.shape), ((2, 6, 1, 7), (1, 1, 5, 7)))
test_eq(_kept[0, :, 0].nonzero()[:, 1].tolist(), [0] * 3 + [6] * 3)  # KV head 0 keeps key 0, head 1 key 6
test_fail(lambda: _prepare(_q, _k, None, _kept, None, "0.5", 512), exc=TypeError,
          contains="scale must be a number or None, got str")
test_fail(lambda: _prepare(_q, _k, None, _kept, None, None, 0), contains="chunk must be an int >= 1")


# %%
#| export
def attention_mass_recall(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor | None = None,
                          scale: float | None = None, chunk: int = 512) -> torch.Tensor:
    "Fraction of each query's dense attention on the kept keys, `[B, Hq, Sq]` (NaN where no key is allowed)."
    kept, allowed = _prepare(q, k, None, keep, mask, scale, chunk)
    out = []
    for sl, s in _score_blocks(q, k, scale, chunk):
        a = _query_rows(allowed, sl)
        out.append(_mass(_masked_lse(s, a & _query_rows(kept, sl)), _masked_lse(s, a)))
    return torch.cat(out, dim=2)


# %%
# one query, two keys of scores 0 and log 3: probabilities 1/4 and 3/4
_q1, _k1 = torch.tensor([[[[1.0]]]]), torch.tensor([[[[0.0], [math.log(3)]]]])
test_close(attention_mass_recall(_q1, _k1, torch.tensor([[[1]]]), scale=1.0).item(), 0.75, eps=1e-6)
test_close(attention_mass_recall(_q1, _k1, torch.tensor([[[0]]]), scale=1.0).item(), 0.25, eps=1e-6)


# %% [markdown]
# The reference loops over batch, query head and query, builds each probability row with an
# explicit softmax in float64 (`exp` divided by its sum, no LSE), and sums it over the kept
# keys. It takes full boolean masks `[B, Hq, Sq, Sk]`.

# %%
#| export
def attention_fidelity_reference(q, k, v, keep, allowed, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    "Brute-force mass recall and relative output error of kept keys per (batch, head, query); masks `[B,Hq,Sq,Sk]`."
    B, Hq, Sq, D = q.shape
    G = Hq // k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    mass, err = (torch.full((B, Hq, Sq), math.nan, dtype=torch.float64),
                 torch.full((B, Hq, Sq), math.nan, dtype=torch.float64))
    for b in range(B):
        for h in range(Hq):
            kh, vh = k[b, h // G].double(), v[b, h // G].double()
            for i in range(Sq):
                a, kk = allowed[b, h, i], allowed[b, h, i] & keep[b, h, i]
                if not a.any(): continue
                w = (kh[a] @ q[b, h, i].double() * scale).exp()
                p = w / w.sum()
                mass[b, h, i] = p[kk[a]].sum()
                o_dense = p @ vh[a]
                if kk.any():
                    wk = (kh[kk] @ q[b, h, i].double() * scale).exp()
                    o_kept = (wk / wk.sum()) @ vh[kk]
                else:
                    o_kept = torch.zeros(v.shape[-1], dtype=torch.float64)
                n = o_dense.norm()
                if n > 0: err[b, h, i] = (o_kept - o_dense).norm() / n
    return mass, err


# %%
def _rand_qkv(B=2, Hkv=2, G=3, Sq=5, Sk=9, D=4, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hkv * G, Sq, D, generator=g), torch.randn(B, Hkv, Sk, D, generator=g),
            torch.randn(B, Hkv, Sk, Dv or D, generator=g))

q, k, v = _rand_qkv()
B, Hq, Sq, D = q.shape; Hkv, Sk = k.shape[1], k.shape[2]
causal = (torch.arange(Sk) <= torch.arange(Sq)[:, None] + (Sk - Sq)).expand(B, Hq, Sq, Sk)
keep = torch.rand(B, Hq, Sq, Sk, generator=torch.Generator().manual_seed(1)) > 0.5
mass_ref, _ = attention_fidelity_reference(q, k, v, keep, causal)
assert_close(attention_mass_recall(q, k, keep), mass_ref.float())
assert_close(attention_mass_recall(q, k, keep, chunk=2), mass_ref.float())  # chunking over queries changes nothing
assert_close(attention_mass_recall(q, k, keep, scale=0.3),
             attention_fidelity_reference(q, k, v, keep, causal, scale=0.3)[0].float())
# keeping every key recalls all the mass; keeping none, nothing
assert_close(attention_mass_recall(q, k, torch.ones(1, 1, 1, Sk, dtype=torch.bool)), torch.ones(B, Hq, Sq))
assert_close(attention_mass_recall(q, k, torch.zeros(1, 1, 1, Sk, dtype=torch.bool)), torch.zeros(B, Hq, Sq))

# %% [markdown]
# Kept indices per KV head give the same result as the equivalent mask built by hand, with
# every query head of the group using its KV head's set; per-query index sets likewise:

# %%
n = 4
idx = torch.stack([torch.stack([torch.randperm(Sk, generator=torch.Generator().manual_seed(10 * b + h))[:n]
                                 for h in range(Hkv)]) for b in range(B)])
hand = torch.zeros(B, Hq, Sq, Sk, dtype=torch.bool)
for b in range(B):
    for h in range(Hq):
        for j in idx[b, h // (Hq // Hkv)].tolist(): hand[b, h, :, j] = True
assert_close(attention_mass_recall(q, k, idx), attention_mass_recall(q, k, hand))
assert_close(attention_mass_recall(q, k, hand[:, ::Hq // Hkv]), attention_mass_recall(q, k, hand))  # KV-head mask
idx_q = torch.randint(0, Sk, (B, Hq, Sq, n), generator=torch.Generator().manual_seed(3))
hand_q = torch.zeros(B, Hq, Sq, Sk, dtype=torch.bool).scatter(-1, idx_q, True)
assert_close(attention_mass_recall(q, k, idx_q), attention_mass_recall(q, k, hand_q))

# %% [markdown]
# A custom dense mask, including a fully masked query row (recall NaN there), and the
# boundary cases of the input checks:

# %%
dense_mask = torch.rand(B, 1, Sq, Sk, generator=torch.Generator().manual_seed(4)) > 0.3
dense_mask[0, 0, 2] = False
got = attention_mass_recall(q, k, keep, mask=dense_mask)
ref = attention_fidelity_reference(q, k, v, keep, dense_mask.expand(B, Hq, Sq, Sk))[0].float()
assert got[0, :, 2].isnan().all()
assert_close(got, ref, equal_nan=True)
test_fail(lambda: attention_mass_recall(q, k[:, :, :, :3], keep), contains="must agree in batch and head dim")
test_fail(lambda: attention_mass_recall(q[:, :5], k, keep), contains="must be a multiple of the KV heads")
test_fail(lambda: attention_mass_recall(q, k, keep[:, :, :, :4]), contains="not broadcastable")
test_fail(lambda: attention_mass_recall(q, k, idx + Sk), contains="keep indices must be in [0, 9)")
test_fail(lambda: attention_mass_recall(q, k, idx[:, :1]), contains="keep indices must have shape")
test_fail(lambda: attention_mass_recall(q, k, keep.float()), contains="keep must be a boolean mask")
test_fail(lambda: attention_mass_recall(q, k, keep, chunk=0), contains="chunk must be an int >= 1")


# %% [markdown]
# ## Relative attention-output error
#
# The output of query $i$ is $o_i = \sum_j a_{ij} v_j \in \mathbb{R}^{D_v}$. We measure a
# sparse output against the dense one by the relative Euclidean error over the head
# dimension, per batch element, query head and query:
#
# $$e_i = \frac{\lVert o^{\mathrm{sparse}}_i - o^{\mathrm{dense}}_i\rVert_2}{\lVert o^{\mathrm{dense}}_i\rVert_2}.$$
#
# It is undefined (NaN) where the dense output is the zero vector (e.g. a fully masked
# row). Reports average $e_i$ over batch and queries for each head (`per_head_mean`, which
# skips NaN), then over heads. A mean of per-query ratios weighs every query equally,
# unlike a ratio of Frobenius norms, which is dominated by queries with large outputs.
#
# `relative_output_error` takes the two outputs, however the sparse one was computed.
# When the sparse method is exact attention over a kept set, `attention_fidelity` computes
# both the mass recall and the output error from `q, k, v` and `keep` in one pass. It uses
# the decomposition of the dense output into the kept part and the rest: with
# $\mathcal R_i = \mathcal A_i \setminus \mathcal K_i$ and $o^{\mathcal S}_i$ the attention
# output renormalized on a set $\mathcal S$,
#
# $$o^{\mathrm{dense}}_i = m_i\, o^{\mathcal K}_i + (1-m_i)\, o^{\mathcal R}_i
#   \quad\Longrightarrow\quad
#   o^{\mathcal K}_i - o^{\mathrm{dense}}_i = (1-m_i)\big(o^{\mathcal K}_i - o^{\mathcal R}_i\big),$$
#
# so the output error is the missing mass times how far the dropped keys' values are from
# the kept keys' values: a high recall bounds the error, but the error can also be small at
# low recall when the dropped values resemble the kept ones (OVAL's observation, §1). If no
# allowed key is kept, the sparse output is $0$ and the error is $1$.

# %%
#| export
def relative_output_error(o_sparse: torch.Tensor, o_dense: torch.Tensor) -> torch.Tensor:
    "Per-row relative error ||o_sparse - o_dense||_2 / ||o_dense||_2 over the last dim (NaN where o_dense = 0)."
    _check_pair(o_sparse, o_dense, ("o_sparse", "o_dense"), 1)
    a, b = _f32(o_sparse), _f32(o_dense)
    b = b.to(torch.promote_types(a.dtype, b.dtype))
    den = b.norm(dim=-1)
    return torch.where(den > 0, (a - b).norm(dim=-1) / den, math.nan)


# %%
# |(3, 4) - (0, 5)| / |(0, 5)| = sqrt(10) / 5; NaN against a zero output
test_close(relative_output_error(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])).item(), math.sqrt(10) / 5,
           eps=1e-6)
assert relative_output_error(torch.ones(2), torch.zeros(2)).isnan()


# %%
#| export
def per_head_mean(x: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    "Mean of a per-query metric over every dim but `head_dim` (default `[B, H, S]` -> `[H]`), skipping NaN."
    _check_float(x, "x", 1)
    return x.movedim(head_dim, 0).reshape(x.shape[head_dim], -1).nanmean(-1)


# %%
_ph = torch.tensor([[[1.0, math.nan], [2.0, 4.0]], [[3.0, 5.0], [6.0, math.nan]]])  # [B=2, H=2, S=2]
test_eq(per_head_mean(_ph).tolist(), [3.0, 4.0])
test_eq(per_head_mean(_ph, head_dim=2).tolist(), [3.0, 4.5])


# %%
#| export
def _attend(s: torch.Tensor, m: torch.Tensor, lse: torch.Tensor, v: torch.Tensor, G: int) -> torch.Tensor:
    "Attention output over the keys in `m` given their LSE; 0 for rows with no key."
    p = torch.where(m, (s - lse.nan_to_num(neginf=0.0)[..., None]).exp(), 0.0)
    B, Hq, c, Sk = p.shape
    return torch.einsum("bhgqk,bhkd->bhgqd", p.reshape(B, Hq // G, G, c, Sk), v).reshape(B, Hq, c, -1)


# %%
_s4, _m4 = torch.randn(1, 4, 3, 5), torch.rand(1, 4, 3, 5) > 0.3
_m4[..., 0] = True
_v4 = torch.randn(1, 2, 5, 6)
assert_close(_attend(_s4, _m4, _masked_lse(_s4, _m4), _v4, 2),
             torch.softmax(_s4.masked_fill(~_m4, -math.inf), -1) @ _v4.repeat_interleave(2, 1))
_none = torch.zeros_like(_m4)
test_eq(_attend(_s4, _none, _masked_lse(_s4, _none), _v4, 2), torch.zeros(1, 4, 3, 6))


# %% [markdown]
# Checks: `relative_output_error` against a loop; `attention_fidelity` against the
# reference (with a value dim different from the key dim); the decomposition above; the
# error is 0 when every key is kept and 1 when none is; agreement with
# `sparsekv.attention.attention_reference`.

# %%
#| export
def attention_fidelity(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                       mask: torch.Tensor | None = None, scale: float | None = None,
                       chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    "Attention-mass recall and relative output error of exact attention over the kept keys vs dense, `[B, Hq, Sq]`."
    kept, allowed = _prepare(q, k, v, keep, mask, scale, chunk)
    G = q.shape[1] // k.shape[1]
    vf = _f32(v).to(torch.promote_types(_f32(q).dtype, _f32(k).dtype))
    mass, err = [], []
    for sl, s in _score_blocks(q, k, scale, chunk):
        a = _query_rows(allowed, sl)
        kk = a & _query_rows(kept, sl)
        lse_all, lse_kept = _masked_lse(s, a), _masked_lse(s, kk)
        mass.append(_mass(lse_kept, lse_all))
        err.append(relative_output_error(_attend(s, kk, lse_kept, vf, G), _attend(s, a, lse_all, vf, G)))
    return torch.cat(mass, dim=2), torch.cat(err, dim=2)


# %%
a_, b_ = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
b_[0, 1, 2] = 0
loop = torch.tensor([[[((x - y).norm() / y.norm()).item() if y.norm() > 0 else math.nan for x, y in zip(xr, yr)]
                      for xr, yr in zip(xh, yh)] for xh, yh in zip(a_, b_)])
assert_close(relative_output_error(a_, b_), loop, equal_nan=True)
e = relative_output_error(a_, b_)
assert_close(per_head_mean(e),
             torch.tensor([[e[:, h].flatten()[~e[:, h].flatten().isnan()].mean().item() for h in range(3)]]).squeeze(0))

q, k, v = _rand_qkv(Dv=6, seed=5)
mass, err = attention_fidelity(q, k, v, keep)
mass_ref, err_ref = attention_fidelity_reference(q, k, v, keep, causal)
assert_close(mass, mass_ref.float())
assert_close(err, err_ref.float(), equal_nan=True)
assert_close(attention_fidelity(q, k, v, keep, chunk=3)[1], err)
assert_close(attention_fidelity(q, k, v, idx)[0], attention_mass_recall(q, k, idx))

# the decomposition o_dense = m o_K + (1 - m) o_R, on one row in float64
b, h, i = 1, 4, 3
kv = h // (Hq // Hkv)
A, K = causal[b, h, i], causal[b, h, i] & keep[b, h, i]
R = A & ~K
sc = k[b, kv].double() @ q[b, h, i].double() / math.sqrt(D)
def _out(S): w = sc[S].exp(); return (w / w.sum()) @ v[b, kv].double()[S]
m_ = sc[K].exp().sum() / sc[A].exp().sum()
assert_close(_out(A), m_ * _out(K) + (1 - m_) * _out(R))
test_close(err[b, h, i].item(), ((1 - m_) * (_out(K) - _out(R)).norm() / _out(A).norm()).item(), eps=1e-5)

all_keys, no_keys = torch.ones(1, 1, 1, Sk, dtype=torch.bool), torch.zeros(1, 1, 1, Sk, dtype=torch.bool)
assert_close(attention_fidelity(q, k, v, all_keys)[1], torch.zeros(B, Hq, Sq), atol=1e-6, rtol=0)
assert_close(attention_fidelity(q, k, v, no_keys)[1], torch.ones(B, Hq, Sq))
test_fail(lambda: attention_fidelity(q, k, v[:, :, :4], keep), contains="must match k")
test_fail(lambda: relative_output_error(a_, b_[..., :4]), contains="same shape")

# %%
from sparsekv.attention import attention_reference

# %%
o_dense, _ = attention_reference(q, k, v)
o_kept, _ = attention_reference(q, k, v, mask=causal & keep)
assert_close(relative_output_error(o_kept, o_dense), err, equal_nan=True, atol=1e-5, rtol=1e-4)


# %% [markdown]
# ## Retention recall against an oracle
#
# For a cache policy that keeps a set $\mathcal K$ of tokens per head under a budget, and
# an oracle that would keep the top-$k$ tokens $\mathcal O_k$ by some score (KVpop's
# Figure 7 uses the dense teacher's retention target), the **retention recall** of a head
# is
#
# $$r = \frac{\lvert \mathcal K \cap \mathcal O_k \rvert}{\lvert \mathcal O_k\rvert} = \frac{\lvert \mathcal K \cap \mathcal O_k \rvert}{k}.$$
#
# $\mathcal O_k$ must not depend on how a sort breaks ties, so `oracle_topk` ranks by
# descending score and, among equal scores, by ascending position (a stable descending
# sort). Positions that may not be chosen (sinks, the protected window, padding) get the
# score $-\infty$; asking for more oracle positions than there are finite scores is an
# error. NaN scores are rejected.

# %%
#| export
def oracle_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    "Indices `[..., k]` of the `k` highest `scores` along the last dim, equal scores ordered by lower position first."
    _check_float(scores, "scores", 1)
    k = check_int(k, "k", 1, scores.shape[-1])
    if scores.isnan().any(): raise ValueError("scores must not contain NaN")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    if (scores.gather(-1, order) == -math.inf).any():
        raise ValueError(f"k={k} exceeds the number of eligible (finite-score) positions in some row of scores")
    return order


# %%
test_eq(oracle_topk(torch.tensor([[1.0, 3, 3, 2, 3], [0, -math.inf, 5, 1, 2]]), 2).tolist(), [[1, 2], [2, 4]])
test_fail(lambda: oracle_topk(torch.tensor([1.0, -math.inf]), 2), contains="exceeds the number of eligible")


# %%
#| export
def retention_recall(kept: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    "Fraction of the oracle's top-`k` positions (by `scores [..., S]`) that `kept` retains, per row `[...]`."
    _check_float(scores, "scores", 1)
    S = scores.shape[-1]
    if not isinstance(kept, torch.Tensor) or kept.is_floating_point():
        raise TypeError("kept must be a boolean mask [..., S] or integer indices [..., n], got "
                        f"{getattr(kept, 'dtype', type(kept).__name__)}")
    if kept.dtype == torch.bool:
        if kept.shape != scores.shape:
            raise ValueError(f"kept mask must have the shape of scores {tuple(scores.shape)}, got {tuple(kept.shape)}")
        mask = kept
    else:
        if kept.shape[:-1] != scores.shape[:-1]:
            raise ValueError(f"kept indices must have shape [..., n] with ... = {tuple(scores.shape[:-1])}, got "
                             f"{tuple(kept.shape)}")
        if kept.numel() and (kept.min() < 0 or kept.max() >= S):
            raise ValueError(f"kept indices must be in [0, {S}), got [{kept.min().item()}, {kept.max().item()}]")
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, kept.long(), True)  # duplicates count once
    return mask.gather(-1, oracle_topk(scores, k)).float().mean(-1)


# %%
_sc4 = torch.tensor([4.0, 3, 2, 1])  # the oracle's top 2: positions 0 and 1
test_eq(retention_recall(torch.tensor([1, 3]), _sc4, 2).item(), 0.5)
test_eq(retention_recall(torch.tensor([True, True, False, False]), _sc4, 2).item(), 1.0)
test_fail(lambda: retention_recall(_sc4, _sc4, 2), exc=TypeError, contains="kept must be a boolean mask")


# %%
#| export
def retention_recall_reference(kept_sets: list[set], scores: list[list[float]], k: int) -> list[float]:
    "Brute-force `retention_recall` for rows given as Python sets of kept positions and lists of scores."
    out = []
    for kept, row in zip(kept_sets, scores):
        oracle = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
        out.append(len(set(kept) & set(oracle)) / k)
    return out


# %%
g = torch.Generator().manual_seed(6)
sc = torch.randint(0, 4, (3, 2, 12), generator=g).float()  # few distinct values: many ties
sc[0, 0, :3] = -math.inf
kept_idx = torch.stack([torch.stack([torch.randperm(12, generator=g)[:5] for _ in range(2)]) for _ in range(3)])
for kk in (1, 5, 9):
    got = retention_recall(kept_idx, sc, kk)
    ref = retention_recall_reference([set(r) for r in kept_idx.reshape(-1, 5).tolist()], sc.reshape(-1, 12).tolist(),
                                     kk)
    assert_close(got.flatten(), torch.tensor(ref))
kept_mask = torch.zeros(3, 2, 12, dtype=torch.bool).scatter(-1, kept_idx, True)
assert_close(retention_recall(kept_mask, sc, 5), retention_recall(kept_idx, sc, 5))
# duplicates count once
assert_close(retention_recall(torch.cat([kept_idx, kept_idx], -1), sc, 5), retention_recall(kept_idx, sc, 5))
# ties go to the lower position, whatever the row's order in memory
test_eq(oracle_topk(torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0]), 2).tolist(), [1, 2])
test_eq(retention_recall(oracle_topk(sc[1:], 4), sc[1:], 4), torch.ones(2, 2))
test_fail(lambda: retention_recall(kept_idx, sc, 10), contains="exceeds the number of eligible")
test_fail(lambda: retention_recall(kept_idx, sc, 13), contains="k must be an int in [1, 12]")
test_fail(lambda: oracle_topk(torch.tensor([1.0, math.nan]), 1), contains="NaN")
test_fail(lambda: retention_recall(kept_idx[:2], sc, 3), contains="kept indices must have shape")
test_fail(lambda: retention_recall(kept_idx + 12, sc, 3), contains="kept indices must be in [0, 12)")


# %% [markdown]
# ## More than the mean
#
# A mean over queries and heads can hide what decides a task. The mean attention-mass recall
# of a chunk's queries is also exactly what keeping the keys of highest mean softmax score over
# those queries maximizes (the mean-of-scores baseline, at the cost of dense attention), so
# ranking methods by it alone favours that selection by construction. Three views sit beside
# it:
#
# - the **low tail** of the per-query mass recall: a selection that keeps 95% of the mass on
#   average can still drop most of it for the few queries that need a rare key;
# - **needle retention**: whether the tokens the answer is read from are kept at all, per
#   head, whatever the current queries' scores say about them;
# - the **relative output error** per query and head, $e_i$ above: `relative_output_error`
#   for two given outputs, or `attention_fidelity` for exact attention over a kept set (it
#   returns the mass recall and $e_i$ from one pass). These are the functions to call; OVAL's
#   `retrieval_quality` ([the OVAL pages](32_oval_pages.ipynb)) scores page retrieval through
#   `attention_fidelity` and adds no output error of its own.
#
# ### Low quantiles of a per-query metric
#
# Write $x_{(0)} \le x_{(1)} \le \dots \le x_{(n-1)}$ for the $n$ non-NaN entries of a
# per-query metric (all batch elements, heads and queries), sorted. Its $q$-quantile with
# linear interpolation (the default of `numpy.quantile` and `torch.quantile`) puts the
# order statistics at the evenly spaced levels $i/(n-1)$ and joins them by straight lines:
# with $h = (n-1)\,q$ and $l = \lfloor h\rfloor$,
#
# $$Q(q) = x_{(l)} + (h - l)\,\big(x_{(l+1)} - x_{(l)}\big),$$
#
# where the second term is $0$ when $h$ is an integer (so $Q(0)$ is the minimum and $Q(1)$
# the maximum). The **5th-percentile attention mass** of a selection is
# `query_quantile(attention_mass_recall(q, k, keep), 0.05)`: 95% of the queries keep at least
# that much of their dense attention. NaN entries (rows with no allowed key) are skipped, as
# in `per_head_mean`; a metric with no finite entry has a NaN quantile. With `head_dim` the
# quantile is taken per head, over the other dims.

# %%
#| export
def _quantile_1d(x: torch.Tensor, q: float) -> torch.Tensor:
    "Linear-interpolation `q`-quantile of the non-NaN entries of a 1-D `x` (NaN when there are none)."
    x = x[~x.isnan()].sort().values
    if not len(x): return torch.tensor(math.nan, dtype=x.dtype, device=x.device)
    h = q * (len(x) - 1)
    lo = math.floor(h)
    return x[lo] + (h - lo) * (x[min(lo + 1, len(x) - 1)] - x[lo])


# %%
test_eq(_quantile_1d(torch.tensor([3.0, math.nan, 1.0, 2.0]), 0.25).item(), 1.5)  # h = 0.5: halfway from 1 to 2
test_eq(_quantile_1d(torch.tensor([3.0, 1.0, 2.0]), 1.0).item(), 3.0)
assert _quantile_1d(torch.tensor([math.nan]), 0.5).isnan()


# %%
#| export
def query_quantile(x: torch.Tensor, q: float = 0.05, head_dim: int | None = None) -> torch.Tensor:
    "The `q`-quantile (linear interpolation, NaN skipped) of a per-query metric over all entries, or per `head_dim`."
    _check_float(x, "x", 1)
    if isinstance(q, bool) or not isinstance(q, numbers.Real):
        raise TypeError(f"q must be a number in [0, 1] (0.05: the 5th percentile), got {q!r}")
    if not 0 <= q <= 1: raise ValueError(f"q must be a number in [0, 1] (0.05: the 5th percentile), got {q!r}")
    if head_dim is None: return _quantile_1d(x.flatten(), float(q))
    head_dim = check_int(head_dim, "head_dim", -x.dim(), x.dim() - 1)
    return torch.stack([_quantile_1d(row, float(q)) for row in x.movedim(head_dim, 0).reshape(x.shape[head_dim], -1)])


# %%
_qq = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
test_eq((query_quantile(_qq, 0.5).item(), query_quantile(_qq, 0.0).item()), (1.5, 0.0))
test_eq(query_quantile(_qq, 0.5, head_dim=0).tolist(), [0.5, 2.5])


# %% [markdown]
# The reference walks the straight segments between the levels $i/(n-1)$ in a Python loop
# and interpolates on the one that holds $q$:
#
# Checks: against the loop and against `numpy.nanquantile` (an independent implementation),
# with NaN entries, many tied values and per head; the minimum, median and maximum; the
# 5th-percentile mass recall of a random selection lies between the smallest and the mean.

# %%
#| export
def query_quantile_reference(values: list[float], q: float) -> float:
    "Brute-force `query_quantile` of a list: the segment of the sorted non-NaN values whose levels i/(n-1) bracket q."
    xs = sorted(x for x in values if not math.isnan(x))
    if not xs: return math.nan
    if len(xs) == 1: return xs[0]
    n = len(xs)
    for i in range(n - 1):
        if i / (n - 1) <= q <= (i + 1) / (n - 1):
            t = q * (n - 1) - i
            return xs[i] + t * (xs[i + 1] - xs[i])
    raise ValueError(f"q must be in [0, 1], got {q}")


# %%
g = torch.Generator().manual_seed(7)
x_ = torch.randint(0, 5, (2, 3, 11), generator=g).float() / 4  # few distinct values: many ties
x_[0, 1, :4] = math.nan
for q_ in (0.0, 0.05, 0.3, 0.5, 0.95, 1.0):
    test_close(query_quantile(x_, q_).item(), query_quantile_reference(x_.flatten().tolist(), q_), eps=1e-6)
    test_close(query_quantile(x_, q_).item(), float(np.nanquantile(x_.numpy(), q_)), eps=1e-6)
    per_h = [query_quantile_reference(x_[:, h].flatten().tolist(), q_) for h in range(3)]
    assert_close(query_quantile(x_, q_, head_dim=1), torch.tensor(per_h))
    assert_close(query_quantile(x_, q_, head_dim=-1),
                 torch.tensor(np.nanquantile(x_.movedim(-1, 0).reshape(11, -1).numpy(), q_, axis=1)).float())
fin = x_[~x_.isnan()]
test_eq([query_quantile(x_, 0.0).item(), query_quantile(x_, 1.0).item()], [fin.min().item(), fin.max().item()])
test_close(query_quantile(x_, 0.5).item(), float(np.median(fin.numpy())), eps=1e-6)  # an even count: the mid-point
test_eq(query_quantile(torch.tensor([0.25]), 0.05).item(), 0.25)              # one query
assert query_quantile(torch.full((2, 3), math.nan)).isnan()                      # nothing to rank
test_eq(query_quantile(x_.double()).dtype, torch.float64)
q, k, v = _rand_qkv(seed=8)
mass = attention_mass_recall(q, k, torch.rand(2, 6, 5, 9, generator=g) > 0.5)  # the 5th-percentile mass
test_close(query_quantile(mass, 0.05).item(), float(np.quantile(mass.numpy(), 0.05)), eps=1e-6)
test_fail(lambda: query_quantile(x_, 1.5), contains="q must be a number in [0, 1]")
test_fail(lambda: query_quantile(x_, "0.05"), contains="q must be a number in [0, 1]")
test_fail(lambda: query_quantile(x_, head_dim=3), contains="head_dim must be an int in [-3, 2]")
test_fail(lambda: query_quantile(x_.long()), contains="x must be a floating-point tensor")


# %% [markdown]
# ### Needle retention
#
# A needle occupies a set $\mathcal N_b$ of token positions of batch element $b$ (the tokens
# of the needle sentence, or only those of the answer; the caller decides). A method keeps
# the set $\mathcal K_{bhi}$ of KV entries for head $h$ and query $i$ (or one set for all of a
# chunk's queries). The **needle retention** is the fraction of the needle it keeps,
#
# $$\rho_{bhi} = \frac{\lvert \mathcal K_{bhi} \cap \mathcal N_b \rvert}{\lvert \mathcal N_b \rvert} \in [0, 1],$$
#
# $0$ when every needle token is evicted and $1$ when all are kept. It reads the selection
# only, not the scores: a selection that follows the chunk's current attention can keep most
# of the mass and still evict the needle a later question needs.
#
# The selection comes in the forms of `attention_mass_recall`: a boolean mask (True = kept)
# `[B, H, S]` or `[B, H, Sq, S]`, or integer indices `[B, H, n]` or `[B, H, Sq, n]` (what
# `top_budget_indices`, `quoka_select` and the baselines return; a repeated index counts
# once). `H` is the number of heads the selection is made for. A selection per KV head is
# shared by the $G$ query heads of its group, so their retentions are equal;
# `query_heads=Hq` repeats each KV head's value over its group (query head $hG + g$ gets KV
# head $h$'s), which aligns the result with `[B, Hq, Sq]` metrics ($G = 1$ changes nothing).
# The needle is given as positions `[m]` (one needle for the whole batch) or `[B, m]`, or as
# a boolean mask `[S]` or `[B, S]`. The result is `[B, H]` (or `[B, Hq]`), with a query
# dim when the selection has one.
#
# `needle_summary` reduces it for a report: the mean retention over batch, heads and queries,
# and the fraction of heads (and queries) that keep the whole needle ($\rho = 1$).

# %%
#| export
def _check_selection(keep) -> torch.Tensor:
    "Refuse a selection that is not a 3-D or 4-D boolean mask or integer index tensor."
    if not isinstance(keep, torch.Tensor) or keep.is_floating_point() or keep.is_complex():
        raise TypeError("keep must be a boolean mask [B, H, (Sq,) S] or integer indices [B, H, (Sq,) n], got "
                        f"{getattr(keep, 'dtype', type(keep).__name__)}")
    if keep.dim() not in (3, 4):
        raise ValueError(f"keep must be [B, H, S] or [B, H, Sq, S] (mask), [B, H, n] or [B, H, Sq, n] (indices), got "
                         f"shape {tuple(keep.shape)}")
    if keep.dtype != torch.bool and keep.numel() and keep.min() < 0:
        raise ValueError(f"keep indices must be >= 0, got {keep.min().item()}")
    return keep


# %%
_sel = torch.tensor([[[0, 2]]])
assert _check_selection(_sel) is _sel
test_fail(lambda: _check_selection(_sel[0]), contains="keep must be [B, H, S] or [B, H, Sq, S]")
test_fail(lambda: _check_selection(-_sel - 1), contains="keep indices must be >= 0, got -3")
test_fail(lambda: _check_selection(_sel.float()), exc=TypeError, contains="keep must be a boolean mask")


# %%
#| export
def _check_needle(needle, B: int) -> torch.Tensor:
    "The needle as a tensor of positions `[m]`/`[B, m]` or a boolean mask `[S]`/`[B, S]`, checked."
    what = "needle must be integer positions [m] or [B, m], or a boolean mask [S] or [B, S]"
    if isinstance(needle, (list, tuple)) and all(isinstance(p, numbers.Integral) and not isinstance(p, bool)
                                                  for p in needle):
        needle = torch.tensor(needle, dtype=torch.long)
    if not isinstance(needle, torch.Tensor) or needle.is_floating_point() or needle.is_complex():
        raise TypeError(f"{what}, got {getattr(needle, 'dtype', type(needle).__name__)}")
    if needle.dim() not in (1, 2) or (needle.dim() == 2 and needle.shape[0] != B):
        raise ValueError(f"{what} with B={B}, got shape {tuple(needle.shape)}")
    if needle.shape[-1] == 0 or (needle.dtype == torch.bool and not needle.any(-1).all()):
        raise ValueError("needle must hold at least one position (per batch element)")
    if needle.dtype != torch.bool and needle.min() < 0:
        raise ValueError(f"needle positions must be >= 0, got {needle.min().item()}")
    return needle


# %%
test_eq(_check_needle([3, 5], 2), torch.tensor([3, 5]))
test_fail(lambda: _check_needle(torch.tensor([[1], [2], [3]]), 2), contains="with B=2, got shape (3, 1)")
test_fail(lambda: _check_needle(torch.tensor([[True, False], [False, False]]), 2), contains="at least one position")
test_fail(lambda: _check_needle([-1], 1), contains="needle positions must be >= 0, got -1")
test_fail(lambda: _check_needle([1.0], 1), exc=TypeError, contains="needle must be integer positions")


# %%
#| export
def _sequence_length(keep: torch.Tensor, needle: torch.Tensor) -> int:
    "S: the last dim of whichever of the two is a mask (they must agree), else one past the largest position."
    masks = {name: x.shape[-1] for name, x in (("keep", keep), ("needle", needle)) if x.dtype == torch.bool}
    if len(set(masks.values())) > 1:
        raise ValueError(f"the masks keep and needle must cover the same S positions, got {masks}")
    if not masks: return 1 + max(int(needle.max()), int(keep.max()) if keep.numel() else -1)
    S = next(iter(masks.values()))
    for name, x in (("keep", keep), ("needle", needle)):
        if x.dtype != torch.bool and x.numel() and x.max() >= S:
            raise ValueError(f"{name} positions must be in [0, {S}) (the mask's length), got {x.max().item()}")
    return S


# %%
test_eq(_sequence_length(torch.tensor([[[0, 7]]]), torch.tensor([3])), 8)  # one past the largest position
_mask5 = torch.zeros(1, 1, 5, dtype=torch.bool)
test_eq(_sequence_length(_mask5, torch.tensor([3])), 5)
test_fail(lambda: _sequence_length(_mask5, torch.zeros(4, dtype=torch.bool)),
          contains="must cover the same S positions")
test_fail(lambda: _sequence_length(_mask5, torch.tensor([5])), contains="needle positions must be in [0, 5)")


# %%
#| export
def needle_retention(keep: torch.Tensor, needle, query_heads: int | None = None) -> torch.Tensor:
    "Fraction of the needle's tokens each head (and query) keeps, `[B, H(, Sq)]`; `query_heads` repeats KV heads."
    keep = _check_selection(keep)
    if query_heads is not None and check_int(query_heads, "query_heads", 1) % keep.shape[1]:
        raise ValueError(f"query_heads ({query_heads}) must be a multiple of keep's heads ({keep.shape[1]})")
    needle = _check_needle(needle, keep.shape[0]).to(keep.device)
    S = _sequence_length(keep, needle)
    nm = needle if needle.dtype == torch.bool else torch.zeros(*needle.shape[:-1], S, dtype=torch.bool,
                                                                device=keep.device).scatter_(-1, needle.long(), True)
    nm = nm.expand(keep.shape[0], S).reshape(keep.shape[0], *[1] * (keep.dim() - 2), S)
    if keep.dtype == torch.bool: hits = (keep & nm).sum(-1)
    else:  # count each distinct kept index once: sorted, a position counts where it first appears
        idx = keep.long().sort(-1).values
        first = torch.ones_like(idx, dtype=torch.bool)
        first[..., 1:] = idx[..., 1:] != idx[..., :-1]
        hits = (nm.expand(*idx.shape[:-1], S).gather(-1, idx) & first).sum(-1)
    rho = hits.float() / nm.sum(-1).float()
    return rho if query_heads is None else rho.repeat_interleave(query_heads // keep.shape[1], dim=1)


# %%
# keys 0, 2, 2, 5 kept, the needle at 2 and 3: half of it (the repeated 2 counts once)
test_eq(needle_retention(torch.tensor([[[0, 2, 2, 5]]]), [2, 3]).tolist(), [[0.5]])
test_eq(needle_retention(torch.tensor([[[0, 2, 2, 5]]]), [2, 3], query_heads=2).tolist(), [[0.5, 0.5]])


# %% [markdown]
# The reference takes Python sets, one per row (batch, head, query), and the needle's set of
# each row:

# %%
#| export
def needle_retention_reference(kept_sets: list[set], needle_sets: list[set]) -> list[float]:
    "Brute-force `needle_retention` for rows given as Python sets of kept positions and of needle positions."
    return [len(set(kept) & set(needle)) / len(set(needle)) for kept, needle in zip(kept_sets, needle_sets)]


# %%
test_eq(needle_retention_reference([{1, 2}, {4}], [{2, 3}, {4}]), [0.5, 1.0])


# %% [markdown]
# Checks: per-query index sets of each KV head (with repeats) and needles that differ per
# batch element, against the sets of a loop over batch, query head and query ($G = 3$ and
# $G = 1$); a mask gives what its indices give; the edge cases (the needle evicted: 0, kept
# whole: 1, a selection with more entries than the sequence) and the summary against its
# definition.

# %%
#| export
def needle_summary(retention: torch.Tensor) -> dict[str, float]:
    "Mean needle retention over batch, heads (and queries), and the fraction of those that keep the whole needle."
    _check_float(retention, "retention", 1)
    if retention.isnan().any() or (retention < 0).any() or (retention > 1).any():
        raise ValueError("retention must hold fractions in [0, 1] (the output of needle_retention)")
    return {"needle_retention": retention.mean().item(), "needle_whole": (retention == 1).float().mean().item()}


# %%
g = torch.Generator().manual_seed(9)
B, Hkv, Sq, S, n = 2, 2, 4, 16, 6
idx = torch.randint(0, S, (B, Hkv, Sq, n), generator=g)   # repeats likely
needle = torch.stack([torch.randperm(S, generator=g)[:3] for _ in range(B)])
for G in (3, 1):
    got = needle_retention(idx, needle, query_heads=Hkv * G)
    test_eq(got.shape, (B, Hkv * G, Sq))
    rows = [(b, h, i) for b in range(B) for h in range(Hkv * G) for i in range(Sq)]
    ref = needle_retention_reference([set(idx[b, h // G, i].tolist()) for b, h, i in rows],
                                     [set(needle[b].tolist()) for b, h, i in rows])
    assert_close(got.flatten(), torch.tensor(ref))
kept_mask = torch.zeros(B, Hkv, Sq, S, dtype=torch.bool).scatter(-1, idx, True)
needle_mask = torch.zeros(B, S, dtype=torch.bool).scatter(-1, needle, True)
for kk, nn in ((kept_mask, needle), (idx, needle_mask), (kept_mask, needle_mask)):
    assert_close(needle_retention(kk, nn), needle_retention(idx, needle))
# one set for all queries: [B, H, n] -> [B, H]
test_eq(needle_retention(idx[:, :, 0], [1, 5]).shape, (B, Hkv))
# evicted: 0; kept whole: 1; a selection of 3 S entries (each position three times) keeps everything
test_eq(needle_retention(torch.tensor([[[0, 1, 2]]]), [5, 6]), torch.zeros(1, 1))
test_eq(needle_retention(torch.tensor([[[4, 5, 6, 9]]]), [5, 6]), torch.ones(1, 1))
test_eq(needle_retention(torch.arange(S).repeat(3).expand(B, Hkv, 3 * S), needle), torch.ones(B, Hkv))
rho = needle_retention(idx, needle, query_heads=6)
vals = rho.flatten().tolist()
test_close(needle_summary(rho)["needle_retention"], sum(vals) / len(vals), eps=1e-6)
test_close(needle_summary(rho)["needle_whole"], sum(r == 1.0 for r in vals) / len(vals), eps=1e-12)
test_fail(lambda: needle_retention(idx.float(), needle), contains="keep must be a boolean mask")
test_fail(lambda: needle_retention(idx, needle[:1].expand(3, 3)), contains="needle must be integer positions")
test_fail(lambda: needle_retention(idx, []), contains="at least one position")
test_fail(lambda: needle_retention(kept_mask, [S]), contains="needle positions must be in [0, 16)")
test_fail(lambda: needle_retention(idx, torch.arange(8) < 2), contains="keep positions must be in [0, 8)")
test_fail(lambda: needle_retention(idx, needle, query_heads=5), contains="must be a multiple of keep's heads (2)")
test_fail(lambda: needle_summary(rho + 1), contains="retention must hold fractions in [0, 1]")


# %% [markdown]
# ## pass@k and avg@k
#
# For reasoning tasks a problem gets $n$ sampled answers, $c$ of them correct. **pass@k** is
# the probability that at least one of $k$ answers drawn without replacement from the $n$
# is correct; the unbiased estimator (Chen et al., 2021, *Evaluating Large Language Models
# Trained on Code*) is one minus the chance that all $k$ are wrong:
#
# $$\text{pass@}k = 1 - \frac{\binom{n-c}{k}}{\binom{n}{k}}.$$
#
# The binomials overflow for large $n$; the ratio is a short product of factors in
# $(0, 1]$. Writing out the factorials,
#
# $$\frac{\binom{n-c}{k}}{\binom{n}{k}} = \frac{(n-c)!\,(n-k)!}{n!\,(n-c-k)!}
#   = \frac{\prod_{i=n-c+1}^{n}(i-k)}{\prod_{i=n-c+1}^{n} i} = \prod_{i=n-c+1}^{n}\Big(1 - \frac{k}{i}\Big),$$
#
# valid when $n - c \ge k$; when $n - c < k$ every draw of $k$ contains a correct answer and
# pass@k $= 1$. **avg@k** (OVAL §4) is the mean correctness over all $k$ samples of a
# problem, i.e. $c/n$ with $n = k$. Both are averaged over problems; `correct` is a
# boolean array `[problems, n]`.

# %%
#| export
def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    "Unbiased pass@k of one problem with `c` correct answers among `n` samples: 1 - C(n-c, k) / C(n, k)."
    n = check_int(n, "n", 1)
    c, k = check_int(c, "c", 0, n), check_int(k, "k", 1, n)
    if n - c < k: return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# %%
test_close(pass_at_k_estimate(4, 1, 2), 1 - 3 / 6, eps=1e-12)  # 1 - C(3, 2) / C(4, 2)
test_eq((pass_at_k_estimate(4, 3, 2), pass_at_k_estimate(4, 0, 2)), (1.0, 0.0))


# %%
#| export
def _correct_matrix(correct) -> np.ndarray:
    if isinstance(correct, torch.Tensor): correct = correct.detach().cpu().numpy()
    a = np.asarray(correct)
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"correct must be a non-empty 2-D array [problems, n], got shape {a.shape}")
    if a.dtype != bool and not (np.issubdtype(a.dtype, np.integer) and np.isin(a, (0, 1)).all()):
        raise TypeError(f"correct must hold booleans (or 0/1 integers), got dtype {a.dtype}")
    return a.astype(bool)


# %%
test_eq(_correct_matrix([[1, 0], [0, 0]]).tolist(), [[True, False], [False, False]])
test_fail(lambda: _correct_matrix([[2, 0]]), exc=TypeError, contains="correct must hold booleans")
test_fail(lambda: _correct_matrix(np.zeros((0, 3), bool)), contains="non-empty 2-D array")


# %%
#| export
def pass_at_k(correct, k: int) -> float:
    "Mean over problems of the unbiased pass@k, from a boolean array `correct [problems, n]`."
    a = _correct_matrix(correct)
    return float(np.mean([pass_at_k_estimate(a.shape[1], int(row.sum()), k) for row in a]))


# %%
test_close(pass_at_k([[True, False, False, False], [True, True, True, True]], 2), (0.5 + 1.0) / 2, eps=1e-12)


# %%
#| export
def avg_at_k(correct) -> float:
    "Mean correctness over all samples and problems of a boolean array `correct [problems, k]` (avg@k)."
    return float(_correct_matrix(correct).mean())


# %%
test_eq(avg_at_k(np.array([[True, False], [True, True]])), 0.75)


# %% [markdown]
# The reference enumerates every $k$-subset of the $n$ samples, for every $n \le 8$ and
# every $c$ and $k$:

# %%
#| export
def pass_at_k_reference(correct_row, k: int) -> float:
    "Brute-force pass@k of one problem: the fraction of all k-subsets of its samples that contain a correct one."
    subsets = list(itertools.combinations(list(correct_row), k))
    return sum(any(s) for s in subsets) / len(subsets)


# %%
for n_ in range(1, 9):
    for c_ in range(n_ + 1):
        for k_ in range(1, n_ + 1):
            test_close(pass_at_k_estimate(n_, c_, k_), pass_at_k_reference([True] * c_ + [False] * (n_ - c_), k_),
                       eps=1e-12)
corr = np.random.default_rng(0).random((6, 8)) < 0.3
test_close(pass_at_k(corr, 3), np.mean([pass_at_k_reference(r, 3) for r in corr]), eps=1e-12)
test_close(pass_at_k(corr, 1), avg_at_k(corr), eps=1e-12)  # pass@1 is the mean accuracy
test_eq(avg_at_k(torch.tensor([[1, 0, 1, 1]])), 0.75)
# large n: no overflow
test_close(pass_at_k_estimate(10_000, 3, 5_000), 1 - math.comb(9_997, 5_000) / math.comb(10_000, 5_000), eps=1e-12)
test_fail(lambda: pass_at_k(corr, 9), contains="k must be an int in [1, 8]")
test_fail(lambda: pass_at_k_estimate(4, 5, 1), contains="c must be an int in [0, 4]")
test_fail(lambda: pass_at_k(np.array([0.5, 1.0])[None], 1), contains="correct must hold booleans")
test_fail(lambda: pass_at_k([True, False], 1), contains="2-D array")

# %% [markdown]
# ## The evaluation grid
#
# Experiments sweep (policy × budget × task × ...). `run_grid(cells, fn, path, params=...)` takes the
# cells as dicts of scalars (`{"method": "quoka", "budget": 1024, "task": "niah"}`), calls
# `fn(cell)` for each, which returns a dict of metrics, and keeps one **tidy** CSV at `path`:
# one row per cell, with the cell's keys, its metrics, `wall_s` (seconds spent in `fn`) and
# `row_check` (see below). After every cell the whole CSV is rewritten atomically
# (`sparsekv.io.write_csv`), so an interrupted run (an exception, a killed process) keeps every
# finished cell, and a rerun **resumes**: a cell is skipped when a row of the CSV has the same
# values in every key column of the grid (a key a cell lacks matches an empty field) and a
# valid `row_check`. Rows of the CSV that belong to no cell of this grid are kept as they are.
# A tqdm bar shows progress, starting at the number of cells already done.
#
# **Every setting that changes a result is part of the key.** A cell holds what varies within
# the sweep; `params` holds the settings of the whole run (model, dtype, seed, sequence
# length, window, learning rates, number of training windows, ...), which become key columns
# of every row. A rerun with a changed setting therefore recomputes every cell (the old rows
# stay in the file, under their own settings) instead of reusing results made with the old
# one. `fn` receives the cell alone.
#
# Matching compares text, so values are written in a canonical form and old rows are read
# back as text: `None` is empty, booleans `True`/`False`, integers as digits, floats by
# `repr` (which round-trips exactly), one-element tensors and NumPy scalars as their Python
# value. An integer key `1` and a float key `1.0` are different cells. The empty string is not `None`
# (`window=""` and `window=None` are two settings), so it is stored as `""` (two quote characters) and any string
# made of quote characters only gets two more; every other string is stored as it is. `None` keeps the empty field
# older files hold, so their rows still match. Metric names may not
# repeat a cell key, `wall_s` or `row_check`. The function returns the rows of this grid's
# cells, one per cell in the order of `cells`, read with pandas' type inference (columns empty
# in all of them are left out).
#
# **Damaged files.** A results file can be edited by hand, cut by a full disk or mangled by a
# spreadsheet. `row_check` is a hash of the row's non-empty fields and of the names of its key
# columns, so a row that was cut short, edited (a key `1` rewritten as `1.0`), or written for
# another set of keys never counts as a finished cell: its cell is computed again (with a
# warning naming the file and row). Rows with the wrong number of fields or an unreadable
# `wall_s` are dropped from the file at the next write; rows without a `row_check` (older
# files) are kept but recomputed. A file without a header line that names `wall_s`, or one
# that cannot be read as CSV text, raises an error naming the path.

# %%
#| export
WALL_TIME, ROW_CHECK = "wall_s", "row_check"
_RESERVED = (WALL_TIME, ROW_CHECK)

# %%
# the column names results files hold: renaming them would orphan every finished cell on disk
test_eq((WALL_TIME, ROW_CHECK, _RESERVED), ("wall_s", "row_check", ("wall_s", "row_check")))


# %%
#| export
def _cell_text(value, name: str) -> str:
    "The CSV text of a cell key or metric value, in a canonical form that round-trips exactly."
    if isinstance(value, torch.Tensor):
        if value.numel() != 1: raise TypeError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if value is None: return ""
    if isinstance(value, (bool, np.bool_)): return str(bool(value))
    if isinstance(value, numbers.Integral): return str(int(value))
    if isinstance(value, numbers.Real): return repr(float(value))
    if isinstance(value, str): return value + '""' if set(value) <= {'"'} else value  # '' apart from None
    raise TypeError(f"{name} must be a str, int, float, bool, None or a one-element tensor, got {type(value).__name__}")


# %%
test_eq([_cell_text(v, "x") for v in (None, True, np.int64(3), 0.1, torch.tensor([2.5]), "a", "", '"')],
        ["", "True", "3", "0.1", "2.5", "a", '""', '"""'])
test_fail(lambda: _cell_text(torch.zeros(2), "x"), exc=TypeError, contains="x must be a scalar")
test_fail(lambda: _cell_text([1], "x"), exc=TypeError, contains="got list")


# %%
#| export
def _check_keys(d: Mapping, what: str) -> dict:
    "`d` as a dict, after checking it maps strings other than the reserved column names to values."
    if not isinstance(d, Mapping): raise TypeError(f"{what} must be a dict of keys to scalars, got {type(d).__name__}")
    for key in d:
        if not isinstance(key, str) or key in _RESERVED:
            raise ValueError(f"{what} keys must be strings other than {_RESERVED}, got {key!r}")
    return dict(d)


# %%
test_eq(_check_keys({"a": 1}, "params"), {"a": 1})
test_fail(lambda: _check_keys({"wall_s": 1}, "params"), contains="params keys must be strings other than")
test_fail(lambda: _check_keys([1], "each cell"), exc=TypeError, contains="each cell must be a dict")


# %%
#| export
def _grid_cells(cells, params=None) -> tuple[list[dict], dict, list[str]]:
    "Check the cells and the run's params; return both as dicts and the key columns (params first), first-seen order."
    cells = list(cells)
    if not cells: raise ValueError("cells is empty: pass at least one dict of cell keys")
    cells = [_check_keys(c, "each cell") for c in cells]
    params = _check_keys({} if params is None else params, "params")
    if both := sorted({key for c in cells for key in c} & set(params)):
        raise ValueError(f"params and the cells both set {both}: a setting belongs to one of them")
    return cells, params, list(dict.fromkeys([*params, *(key for c in cells for key in c)]))


# %%
test_eq(_grid_cells([{"m": "a", "b": 1}, {"t": 2}], {"model": "x"}),
        ([{"m": "a", "b": 1}, {"t": 2}], {"model": "x"}, ["model", "m", "b", "t"]))
test_fail(lambda: _grid_cells([{"m": 1}], {"m": 2}), contains="both set ['m']")
test_fail(lambda: _grid_cells([]), contains="cells is empty")


# %% [markdown]
# Reading the file back: the header, then each row as text, sorting out damaged rows.

# %%
#| export
def _row_check(row: Mapping[str, str], keys: Iterable[str]) -> str:
    "Hash of a row's non-empty fields and of the names of its (non-empty) key columns."
    fields = sorted((c, v) for c, v in row.items() if v != "" and c != ROW_CHECK)
    return hashlib.sha256(json.dumps([fields, sorted(k for k in keys if row.get(k, ""))]).encode()).hexdigest()[:16]


# %%
_r = {"m": "a", "b": "", WALL_TIME: "0.1"}
test_eq(_row_check(_r, ["m", "b"]),
        hashlib.sha256(json.dumps([[["m", "a"], [WALL_TIME, "0.1"]], ["m"]]).encode()).hexdigest()[:16])
test_eq(_row_check({**_r, ROW_CHECK: "x"}, ["m"]), _row_check(_r, ["m", "b"]))  # empty fields and the check don't count
assert _row_check(_r, ["m"]) not in (_row_check({**_r, "m": "b"}, ["m"]), _row_check(_r, ["m", WALL_TIME]))


# %%
#| export
def _is_wall_time(text: str) -> bool:
    try: return float(text) >= 0
    except ValueError: return False


# %%
test_eq([_is_wall_time(t) for t in ("0.5", "0", "-1", "nan", "x", "")], [True, True, False, False, False, False])


# %%
#| export
def _read_grid(path: Path) -> tuple[list[dict], list[str], list[int]]:
    "The well-formed rows of the results file at `path` (as text), its columns, and the line numbers of malformed rows."
    if not path.exists(): return [], [], []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            lines = [(reader.line_num, r) for r in reader if r]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"cannot read the grid results file {path} ({e}); move it away to recompute its cells") from e
    if not lines: return [], [], []
    header = lines[0][1]
    if WALL_TIME not in header or "" in header or len(set(header)) != len(header):
        raise ValueError(f"{path} has no valid header line (it must name each column once, {WALL_TIME!r} among them; "
                         f"got {header[:8]}): not a run_grid results file; move it away to recompute its cells")
    rows, bad = [], []
    for n, fields in lines[1:]:
        row = dict(zip(header, fields))
        if len(fields) == len(header) and _is_wall_time(row[WALL_TIME]): rows.append(row)
        else: bad.append(n)
    return rows, header, bad


# %%
with tempfile.TemporaryDirectory() as d:
    _p = Path(d) / "g.csv"
    test_eq(_read_grid(_p), ([], [], []))
    _p.write_text("m,wall_s\na,0.5\nb\nc,-1\nd,1\n")  # line 3 cut short, line 4 with a negative time
    test_eq(_read_grid(_p), ([{"m": "a", "wall_s": "0.5"}, {"m": "d", "wall_s": "1"}], ["m", "wall_s"], [3, 4]))
    _p.write_text("m,x\na,1\n")
    test_fail(lambda: _read_grid(_p), contains="has no valid header line")


# %% [markdown]
# The runner itself.

# %%
#| export
def _grid_frame(rows: list[dict], columns: list[str], keys: list[str]) -> pd.DataFrame:
    "The text `rows` as a DataFrame with pandas' type inference, without `row_check` and columns empty in every row."
    if not rows: return pd.DataFrame(columns=keys)
    keep = [c for c in columns if c != ROW_CHECK and (c in keys or any(r.get(c, "") for r in rows))]
    buf = io.StringIO()
    pd.DataFrame(rows, columns=keep).to_csv(buf, index=False)
    buf.seek(0)
    return pd.read_csv(buf)


# %%
_rows2 = [{"m": "a", "x": "1", "e": "", ROW_CHECK: "h"}, {"m": "b", "x": "2.5", "e": "", ROW_CHECK: "h"}]
_df = _grid_frame(_rows2, ["m", "x", "e", ROW_CHECK], ["m"])
test_eq((list(_df.columns), _df.x.tolist()), (["m", "x"], [1.0, 2.5]))  # types inferred; the empty column left out
test_eq(list(_grid_frame([], [], ["m", "b"]).columns), ["m", "b"])


# %%
#| export
def _cell_texts(cells: list[dict], params: dict, keys: list[str]) -> list[tuple[str, ...]]:
    "Each cell's key texts (`params` included) in the order of `keys`; a cell given twice is refused."
    texts = [tuple(_cell_text({**params, **c}.get(key), f"cell[{key!r}]") for key in keys) for c in cells]
    if len(set(texts)) != len(texts):
        dup = next(c for c, t in zip(cells, texts) if texts.count(t) > 1)
        raise ValueError(f"cells contains the same cell twice: {dup}")
    return texts


# %%
test_eq(_cell_texts([{"b": 1}, {"b": 2.0, "t": None}], {"m": "x"}, ["m", "b", "t"]),
        [("x", "1", ""), ("x", "2.0", "")])
test_fail(lambda: _cell_texts([{"b": 1}, {"b": 1}], {}, ["b"]), contains="cells contains the same cell twice: {'b': 1}")


# %%
#| export
def _finished(path: Path, rows: list[dict], bad: list[int], cells: list[dict], texts: list[tuple], keys: list[str]
              ) -> dict[int, int]:
    "Cell index -> index of its last valid row in `rows`; warns about malformed lines and rows failing their check."
    by_key = {}
    for n, r in enumerate(rows): by_key.setdefault(tuple(r.get(key, "") for key in keys), []).append(n)
    found, suspect = {}, []
    for i, text in enumerate(texts):
        valid = [n for n in by_key.get(text, []) if rows[n].get(ROW_CHECK, "") == _row_check(rows[n], keys)]
        if valid: found[i] = valid[-1]
        elif text in by_key: suspect.append(cells[i])
    if bad or suspect:
        warnings.warn(f"{path}: damaged results: " + (f"malformed lines {bad} are dropped; " if bad else "")
                      + (f"the rows of {len(suspect)} cell(s) fail their {ROW_CHECK} (edited, cut, older, or made for "
                         f"other key columns), e.g. {suspect[0]}; "
                         if suspect else "") + "those cells are computed again", stacklevel=2)
    return found


# %%
_keys = ["b"]
_ok = [{"b": "1", WALL_TIME: "0.1"}, {"b": "2", WALL_TIME: "0.1"}, {"b": "1", WALL_TIME: "0.2"}]
for _r in _ok: _r[ROW_CHECK] = _row_check(_r, _keys)
test_eq(_finished(Path("g.csv"), _ok, [], [{"b": 1}, {"b": 3}], [("1",), ("3",)], _keys), {0: 2})  # the last valid row
_bad = [{**_ok[0], ROW_CHECK: "edited"}]
with warnings.catch_warnings(record=True) as _w:
    warnings.simplefilter("always")
    test_eq(_finished(Path("g.csv"), _bad, [7], [{"b": 1}], [("1",)], _keys), {})
test_eq(str(_w[0].message), "g.csv: damaged results: malformed lines [7] are dropped; the rows of 1 cell(s) fail their "
        "row_check (edited, cut, older, or made for other key columns), e.g. {'b': 1}; those cells are computed again")


# %%
#| export
def _grid_row(cell: dict, keys: list[str], text: tuple[str, ...], metrics, wall: float) -> dict:
    "The CSV row (texts) of a computed cell: its keys, `fn`'s metrics (checked), the wall time and the row check."
    if not isinstance(metrics, Mapping):
        raise TypeError(f"fn must return a dict of metrics, got {type(metrics).__name__} for cell {cell}")
    clash = [m for m in metrics if m in keys or m in _RESERVED or not isinstance(m, str)]
    if clash:
        raise ValueError(f"fn returned metric names that are not strings or repeat a cell key, {WALL_TIME!r} "
                         f"or {ROW_CHECK!r}: {clash}")
    row = {**dict(zip(keys, text)), **{m: _cell_text(x, f"metric {m!r}") for m, x in metrics.items()},
           WALL_TIME: repr(wall)}
    row[ROW_CHECK] = _row_check(row, keys)
    return row


# %%
_row = _grid_row({"b": 1}, ["b"], ("1",), {"acc": torch.tensor(0.5)}, 0.25)
test_eq(_row, {"b": "1", "acc": "0.5", WALL_TIME: "0.25", ROW_CHECK: _row_check(_row, ["b"])})
test_fail(lambda: _grid_row({"b": 1}, ["b"], ("1",), [0.5], 0.1), exc=TypeError, contains="fn must return a dict")
test_fail(lambda: _grid_row({"b": 1}, ["b"], ("1",), {"b": 2}, 0.1), contains="repeat a cell key")


# %% [markdown]
# A grid interrupted by an exception at its third cell keeps the two finished cells; the
# rerun computes only the missing ones, and a third run computes nothing:

# %%
#| export
def run_grid(cells: Iterable[Mapping], fn: Callable[[dict], Mapping], path: str | os.PathLike, desc: str | None = None,
             params: Mapping | None = None, time_limit: float | None = None) -> pd.DataFrame:
    """Compute `fn(cell)` for every cell not yet in the CSV at `path` (keys: the cell's and `params`), adding one row
    per cell atomically; return this grid's rows. With `time_limit` (seconds) no cell starts after that long: the
    rows returned are the cells done, in cell order, and `attrs["pending"]` counts the others (0 when complete)."""
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float))
                                   or not time_limit >= 0):
        raise ValueError(f"time_limit must be a number of seconds >= 0 or None, got {time_limit!r}")
    cells, params, keys = _grid_cells(cells, params)
    texts = _cell_texts(cells, params, keys)
    path = Path(path)
    rows, columns, bad = _read_grid(path)
    found = _finished(path, rows, bad, cells, texts, keys)
    todo = [i for i in range(len(cells)) if i not in found]
    start = time.perf_counter()
    with tqdm(total=len(cells), initial=len(cells) - len(todo), desc=desc, unit="cell") as bar:
        for i in todo:
            if time_limit is not None and time.perf_counter() - start >= time_limit: break
            cell = cells[i]
            bar.set_postfix_str(", ".join(f"{key}={val}" for key, val in cell.items()))
            t0 = time.perf_counter()
            metrics = fn(dict(cell))
            row = _grid_row(cell, keys, texts[i], metrics, time.perf_counter() - t0)
            found[i] = len(rows)
            rows.append(row)
            columns = list(dict.fromkeys([*columns, *(c for c in row if c != ROW_CHECK), ROW_CHECK]))
            write_csv(path, pd.DataFrame(rows, columns=columns))
            bar.update()
    out = _grid_frame([rows[found[i]] for i in range(len(cells)) if i in found], columns, keys)
    out.attrs["pending"] = len(cells) - len(found)
    return out


# %%
calls = []
def _fn(cell, fail_at=None):
    calls.append(dict(cell))
    if len(calls) == fail_at: raise RuntimeError("interrupted")
    return {"acc": cell["budget"] / 1000, "kl": torch.tensor(0.5 * cell["budget"])}

grid = [{"method": m, "budget": b, "task": "niah"} for m in ("dense", "quoka") for b in (256, 512)]
with tempfile.TemporaryDirectory() as d:
    p = Path(d) / "grid.csv"
    test_fail(lambda: run_grid(grid, lambda c: _fn(c, fail_at=3), p, desc="grid"), contains="interrupted")
    test_eq(len(pd.read_csv(p)), 2)
    calls.clear()
    df = run_grid(grid, _fn, p, desc="grid")
    test_eq(calls, grid[2:])
    test_eq(list(df.columns), ["method", "budget", "task", "acc", "kl", "wall_s"])
    test_eq(df[["method", "budget"]].values.tolist(), [[c["method"], c["budget"]] for c in grid])
    test_close(df["kl"].tolist(), [0.5 * c["budget"] for c in grid])
    calls.clear()
    run_grid(grid, _fn, p)
    test_eq(calls, [])
    test_eq(sorted(x.name for x in Path(d).iterdir()), ["grid.csv"])
    test_fail(lambda: run_grid(grid + grid[:1], _fn, p), contains="same cell twice")
    test_fail(lambda: run_grid([{"budget": 1}], lambda c: {"budget": 2}, Path(d) / "x.csv"),
              contains="repeat a cell key")
    test_fail(lambda: run_grid([], _fn, p), contains="cells is empty")

# %% [markdown]
# A time limit stops a long grid between cells: with none left (`time_limit=0`) only the rows already
# in the file come back, in cell order, and `attrs["pending"]` counts the rest; a later call
# completes the grid.

# %%
with tempfile.TemporaryDirectory() as d:
    p = Path(d) / "grid.csv"
    run_grid(grid[1::2], _fn, p)                                             # every other cell done
    calls.clear()
    part = run_grid(grid, _fn, p, time_limit=0)
    test_eq((calls, part.attrs["pending"]), ([], 2))
    test_eq(part[["method", "budget"]].values.tolist(), [[c["method"], c["budget"]] for c in grid[1::2]])
    whole = run_grid(grid, _fn, p, time_limit=3600)
    test_eq((calls, whole.attrs["pending"], len(whole)), (grid[0::2], 0, 4))
    test_fail(lambda: run_grid(grid, _fn, p, time_limit=-1), contains="time_limit must be")
    none = run_grid(grid, _fn, Path(d) / "new.csv", time_limit=0)                # nothing done yet
    test_eq((len(none), list(none.columns), none.attrs["pending"]), (0, ["method", "budget", "task"], 4))

# %% [markdown]
# The run's settings are keys too: the same cells under another `window` are computed again
# (the rows of the first run stay in the file), and each call returns its own rows only.

# %%
with tempfile.TemporaryDirectory() as d:
    p = Path(d) / "grid.csv"
    calls.clear()
    a = run_grid(grid, _fn, p, params={"model": "tiny-llama", "window": 4})
    b = run_grid(grid, _fn, p, params={"model": "tiny-llama", "window": 8})
    test_eq(calls, grid + grid)  # nothing reused across settings
    test_eq((len(a), len(b), len(pd.read_csv(p))), (4, 4, 8))
    test_eq((set(a.window), set(b.window)), ({4}, {8}))
    calls.clear()
    test_eq(len(run_grid(grid, _fn, p, params={"model": "tiny-llama", "window": 4})), 4)
    test_eq(calls, [])
    test_fail(lambda: run_grid(grid, _fn, p, params={"budget": 1}), contains="both set ['budget']")

# %% [markdown]
# `None` and the empty string are two settings: each computes its own rows, a rerun of either reuses its own, and
# `None` is stored as the empty field older files hold. The canonical text keeps every string apart from every other.

# %%
with tempfile.TemporaryDirectory() as d:
    p = Path(d) / "grid.csv"
    calls.clear()
    for window in (None, "", None, ""): run_grid(grid[:2], _fn, p, params={"window": window})
    test_eq(calls, grid[:2] * 2)
    test_eq([line.split(",")[0] for line in p.read_text().splitlines()[1:]], ["", "", '""""""', '""""""'])
texts = ["", '"', '""', "a", 'a""', "None"]
test_eq(len({_cell_text(t, "x") for t in texts} | {_cell_text(None, "x")}), len(texts) + 1)

# %% [markdown]
# A damaged file: a row cut short, a row with an extra field and a key rewritten from `256` to
# `256.0` (as a spreadsheet would). The brute-force expectation: exactly the damaged cells are
# computed again, each cell comes back once and no metric is missing; a lost header is an error
# naming the file.

# %%
with tempfile.TemporaryDirectory() as d:
    p = Path(d) / "grid.csv"
    run_grid(grid, _fn, p)
    lines = p.read_text().splitlines()
    lines[1] = lines[1].rsplit(",", 2)[0]                                   # dense/256: cut short
    lines[2] += ",extra"                                                    # dense/512: extra field
    lines[3] = lines[3].replace("quoka,256,", "quoka,256.0,")               # quoka/256: key rewritten
    p.write_text("\n".join(lines) + "\n")
    calls.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        df = run_grid(grid, _fn, p)
    test_eq(calls, grid[:3])
    assert "damaged" in str(w[0].message) and str(p) in str(w[0].message)
    test_eq(df[["method", "budget"]].values.tolist(), [[c["method"], c["budget"]] for c in grid])
    assert not df.isna().any().any()
    calls.clear(); run_grid(grid, _fn, p); test_eq(calls, [])
    p.write_text("\n".join(p.read_text().splitlines()[1:]) + "\n")       # header lost
    test_fail(lambda: run_grid(grid, _fn, p), contains=f"{p} has no valid header line")
