# %% [markdown]
# # DMS: learned eviction with delayed removal
#
# > Dynamic Memory Sparsification, KVpop's trained eviction baseline (§2, §4, App. H): gates, mask, loss, cache.

# %%
#| default_exp kvpop.dms

# %%
#| export
from __future__ import annotations

import contextlib
import inspect
import math
import weakref

import torch
import torch.nn.functional as F
from fastcore.basics import patch_to
from torch import Tensor, nn

from sparsekv.attention import (
    causal_block_mask,
    check_int,
    check_qkv,
    flex_attention_lse,
    gather_kv,
    in_window,
    is_causal,
    sink_window_visible,
)
from sparsekv.cache import EvictingCache, EvictingLayer, EvictionRule
from sparsekv.distill import DistillStudent
from sparsekv.hf import AttentionPolicy, dense_attention, patch
from sparsekv.kvpop.scorers import MLPScorer
from sparsekv.kvpop.student import TrainedMethod
from sparsekv.models import model_info

# %%
#| hide
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv.attention import attention_reference
from sparsekv.hf import DensePolicy
from sparsekv.models import load_model

torch.set_num_threads(1)  # tiny tensors: threads only add overhead


# %% [markdown]
# **Dynamic Memory Sparsification** (DMS; Łańcucki, Staniszewski, Nawrot and Ponti, 2025,
# *Inference-time hyper-scaling with KV cache compression*, arXiv:2506.05345) retrofits a pretrained
# model with a binary *eviction decision* $\alpha_{h,t} \in \{0, 1\}$ per token $t$ and KV head $h$,
# learned by distillation. KVpop uses it as its trained eviction baseline (KVpop §2, §4 "Baselines",
# App. H, Fig. 8) and describes it as: gates trained "with a differentiable relaxation" (a
# Gumbel-sigmoid), and removal *deferred* through a sliding window, so a token marked for eviction
# stays attendable for a short while. We write DMS from that description and from the DMS paper's
# outline; no code was copied. The pieces:
#
# 1. a decision logit $\ell_{h,t}$ per token and KV head, relaxed during training into
#    $\alpha_{h,t} \in (0,1)$ by a Gumbel-sigmoid with temperature $\tau$;
# 2. **delayed eviction**: query $i$ sees key $j \le i$ unconditionally while $i - j < w$; from
#    $i - j \ge w$ on, its logit gets $+\log(1-\alpha_{h,j})$, which is $-\infty$ for a hard eviction;
# 3. a **compression-ratio schedule**: the target eviction fraction rises linearly from 0;
# 4. a **one-sided ratio loss** that only pushes the mean eviction rate *up* towards the current
#    target, next to the distillation KL (added by the training loop, `sparsekv.distill`).
#
# At inference the decisions are hard ($\alpha = [\ell > 0]$) and a token whose decision says evict
# is dropped from the cache once it leaves the window. Unlike KVpop's fixed budget per head, the
# memory of a DMS head depends on the content: that is the point of App. H / Fig. 8, where a few
# heads stay almost dense and many collapse to their window.
#
# **Our interpretations** (marked where they are used):
#
# - *Decision head.* The DMS paper reads the logit off a repurposed neuron of the query/key
#   projection; KVpop instead "matches its parameter count to the KVpop scorers" (§4). So the logit
#   is the headwise two-layer MLP on the detached $[k; v]$ of `sparsekv.kvpop.scorers.MLPScorer`
#   (exactly the parameters of KVpop$_\text{mlp}$'s scorers), plus one scalar bias per (layer, head)
#   that starts the gates closed ($\alpha \approx 0$: dense attention at step 0).
# - *Bias scale.* That bias is stored divided by `bias_scale` (a larger learning rate for it, our
#   stand-in for DMS's rescaled decision neuron), so the eviction rate can follow the schedule within
#   a few hundred optimizer steps instead of thousands.
# - *Relaxation.* Training uses the **soft** Gumbel-sigmoid $\alpha$ inside the mask (no
#   straight-through estimator; `hard=True` switches to straight-through); inference uses hard
#   decisions without noise.
# - *Ratio loss.* One global rate per forward: the mean of the soft $\alpha$ over all layers, KV heads
#   and tokens, $\mathcal L_\text{ratio} = \lambda \max(0, \rho(\text{step}) - \bar\alpha)$. A global
#   rate lets heads specialize (Fig. 8's winner-takes-all allocation).
# - *Window convention.* Query $i$ sees every key with $i - j < w$ ($w$ keys, itself included), the
#   convention of `SinkWindowRule` and KVpop. Sinks are optional and off by default (DMS has none).

# %% [markdown]
# ## The Gumbel-sigmoid relaxation
#
# A hard gate with probability $\sigma(\ell)$ of being 1 can be written with two independent Gumbel
# variables, $[\ell + g_1 - g_0 > 0]$. The difference of two Gumbels is a standard logistic variable
# $L = \log u - \log(1-u)$, $u \sim U(0,1)$, whose CDF is $\sigma$, so
#
# $$P(\ell + L > 0) = P(L > -\ell) = 1 - \sigma(-\ell) = \sigma(\ell).$$
#
# The relaxation replaces the step by a sigmoid of temperature $\tau$:
#
# $$\alpha = \sigma\!\left(\frac{\ell + L}{\tau}\right) \xrightarrow[\tau \to 0]{} [\ell + L > 0],$$
#
# so its mean $\mathbb E_L[\alpha]$ tends to $\sigma(\ell)$ as $\tau \to 0$ and is pulled towards $1/2$
# for larger $\tau$. We keep the noisy pre-activation $z = (\ell + L)/\tau$: the mask needs
# $\log(1-\alpha) = \log\sigma(-z)$, which is finite and has a bounded gradient even where $\alpha$
# rounds to 1 in floating point.

# %%
#| export
def check_temperature(tau) -> float:
    "Validate the Gumbel-sigmoid temperature tau > 0."
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau must be a number > 0, got {tau!r}")
    return float(tau)


# %%
test_eq((check_temperature(2), check_temperature(0.1)), (2.0, 0.1))
for bad in (0, -1.0, True, "1"): test_fail(lambda: check_temperature(bad), contains="tau must be a number > 0")


# %%
#| export
def gumbel_logits(logits: Tensor, tau: float, noise: bool = True, generator: torch.Generator | None = None) -> Tensor:
    "Noisy tempered pre-activations z = (l + L) / tau, L standard logistic (a Gumbel difference); no noise: l / tau."
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point tensor")
    tau = check_temperature(tau)
    if not noise: return logits / tau
    u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)
    u = u.clamp(torch.finfo(torch.float32).tiny, 1 - torch.finfo(torch.float32).eps)
    return (logits + (torch.log(u) - torch.log1p(-u)).to(logits.dtype)) / tau


# %%
_l = torch.tensor([-1.0, 0.0, 2.0])
assert_close(gumbel_logits(_l, 0.5, noise=False), _l / 0.5)
_u = torch.rand(3, generator=torch.Generator().manual_seed(3))  # the draws the logistic noise is made of
assert_close(gumbel_logits(_l, 0.5, generator=torch.Generator().manual_seed(3)),
             (_l + torch.log(_u) - torch.log1p(-_u)) / 0.5)
test_fail(lambda: gumbel_logits(torch.tensor([1, 2]), 1.0), exc=TypeError, contains="floating-point")


# %%
#| export
def gumbel_sigmoid(logits: Tensor, tau: float, hard: bool = False, noise: bool = True,
                   generator: torch.Generator | None = None) -> Tensor:
    "Relaxed gate alpha = sigmoid((l + L) / tau); `hard`: decision [l + L > 0], soft gradient (straight-through)."
    z = gumbel_logits(logits, tau, noise, generator)
    soft = torch.sigmoid(z)
    if not hard: return soft
    return (z > 0).to(soft.dtype) + soft - soft.detach()


# %%
assert_close(gumbel_sigmoid(_l, 0.5, noise=False), torch.sigmoid(_l / 0.5))
assert_close(gumbel_sigmoid(_l, 0.5, hard=True, noise=False), torch.tensor([0.0, 0.0, 1.0]))  # the decision [l > 0]


# %% [markdown]
# Check: Monte-Carlo means of the hard gate match $\sigma(\ell)$ at every temperature, and those of the
# soft gate match the quadrature of $\mathbb E[\alpha]$, which approaches $\sigma(\ell)$ as $\tau$
# shrinks and is pulled towards $1/2$ for $\tau = 1$. Without noise the gate is $\sigma(\ell/\tau)$.

# %%
#| export
def gumbel_sigmoid_mean(logits: Tensor, tau: float, n: int = 20001) -> Tensor:
    "Reference E_L[sigmoid((l + L)/tau)] by quadrature over the logistic variable L = logit(u), u on a midpoint grid."
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    L = torch.log(u) - torch.log1p(-u)
    return torch.sigmoid((logits.double()[..., None] + L) / tau).mean(-1)


# %%
g = torch.Generator().manual_seed(0)
ell = torch.tensor([-3.0, -1.0, 0.0, 0.5, 2.0])
n = 200_000
for tau in [0.05, 0.3, 1.0]:
    draws = ell.expand(n, -1)
    hard = gumbel_sigmoid(draws, tau, hard=True, generator=g).mean(0)
    soft = gumbel_sigmoid(draws, tau, generator=g).mean(0)
    se = (0.25 / n) ** 0.5  # largest standard error of a mean of values in [0, 1]
    assert (hard - torch.sigmoid(ell)).abs().max() < 5 * se, (tau, hard)
    assert (soft.double() - gumbel_sigmoid_mean(ell, tau)).abs().max() < 5 * se, (tau, soft)
gap = lambda tau: (gumbel_sigmoid_mean(ell, tau) - torch.sigmoid(ell.double())).abs().max().item()
assert gap(0.01) < 1e-3 < gap(0.3) < gap(1.0)  # the relaxation's bias vanishes as tau -> 0
assert (gumbel_sigmoid_mean(ell, 1.0) - 0.5).abs()[ell != 0].lt((torch.sigmoid(ell) - 0.5).abs()[ell != 0]).all()
assert_close(gumbel_sigmoid(ell, 0.5, noise=False), torch.sigmoid(ell / 0.5))
z = torch.tensor([0.3], requires_grad=True)
gumbel_sigmoid(z, 0.5, hard=True, noise=False).sum().backward()  # straight-through: value 1, gradient of the soft gate
assert_close(z.grad, torch.sigmoid(z / 0.5).detach() * (1 - torch.sigmoid(z / 0.5).detach()) / 0.5)
test_fail(lambda: gumbel_sigmoid(ell, 0.0), contains="tau must be")
test_fail(lambda: gumbel_sigmoid(torch.tensor([1, 2]), 1.0), contains="floating-point")


# %% [markdown]
# ## Delayed eviction: the training mask
#
# For query $i$ and key $j$ of KV head $h$ (positions in one sequence), DMS adds to the attention
# logit
#
# $$b_{h,ij} = \begin{cases} -\infty & j > i \\ 0 & 0 \le i - j < w \\ \log(1 - \alpha_{h,j}) & i - j \ge w. \end{cases}$$
#
# With hard decisions this is the eviction rule itself: a token marked for eviction disappears for
# every query at distance $\ge w$, i.e. after it leaves the window of the $w$ most recent positions.
# With soft $\alpha$, the attention weight of $j$ is scaled by $(1-\alpha_{h,j})$ before
# normalization, so the distillation loss reaches the gate through the attention: a gate is pushed
# open only as far as the teacher's output tolerates losing that token. Note that $\alpha_{h,j}$ of the
# last $w$ tokens of a sequence receives no gradient from attention: no query is far enough.
#
# `dms_mask_bias` builds $b$ `[B,Hkv,S,S]` (float, $-\infty$ for the causal part) from $\alpha$
# `[B,Hkv,S]`, or from $\log(1-\alpha)$ directly; `dms_mask_bias_reference` loops over $(i, j)$.

# %%
#| export
def dms_mask_bias(alpha: Tensor | None, window: int, log_keep: Tensor | None = None) -> Tensor:
    "Additive DMS mask [B,Hkv,S,S]: -inf above the diagonal, 0 if i - j < w, else log(1 - alpha_j) (or `log_keep`)."
    window = check_int(window, "window", 1)
    if log_keep is None:
        if not isinstance(alpha, Tensor) or not alpha.is_floating_point() or alpha.ndim != 3:
            raise TypeError("alpha must be a floating-point tensor [B,Hkv,S]")
        if (alpha < 0).any() or (alpha > 1).any(): raise ValueError("alpha must lie in [0, 1]")
        log_keep = torch.log1p(-alpha)
    elif log_keep.ndim != 3: raise ValueError(f"log_keep must be [B,Hkv,S], got shape {tuple(log_keep.shape)}")
    pos = torch.arange(log_keep.shape[-1], device=log_keep.device)
    i, j, zero = pos[:, None], pos, torch.zeros((), dtype=log_keep.dtype, device=log_keep.device)
    bias = torch.where(in_window(window)(i, j), zero, log_keep[:, :, None, :])  # log(1 - alpha_j) out of the window
    return bias.masked_fill(~is_causal(i, j), float("-inf"))


# %%
# by hand, w = 1 and alpha = (1/2, 0, 3/4): each key is seen fully at its own query, scaled by 1 - alpha_j later
_b = dms_mask_bias(torch.tensor([[[0.5, 0.0, 0.75]]]), 1)[0, 0]
assert_close(_b, torch.tensor([[0.0, -math.inf, -math.inf], [math.log(0.5), 0.0, -math.inf],
                             [math.log(0.5), 0.0, 0.0]]))
assert_close(dms_mask_bias(None, 1, torch.tensor([[[0.5, 1.0, 0.25]]]).log())[0, 0], _b)  # from log(1 - alpha) directly
test_fail(lambda: dms_mask_bias(None, 1, torch.zeros(3)), contains="log_keep must be [B,Hkv,S]")


# %%
#| export
def dms_mask_bias_reference(alpha: Tensor, window: int) -> Tensor:
    "`dms_mask_bias` by a loop over queries i and keys j, with math.log."
    B, H, S = alpha.shape
    out = torch.empty(B, H, S, S, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(S):
                for j in range(S):
                    a = alpha[b, h, j].item()
                    out[b, h, i, j] = (-math.inf if j > i else 0.0 if i - j < window
                                       else (math.log(1 - a) if a < 1 else -math.inf))
    return out


# %%
g = torch.Generator().manual_seed(1)
alpha = torch.rand(2, 3, 9, generator=g, dtype=torch.float64)
alpha[0, 1, 2], alpha[1, 0, 0] = 1.0, 0.0  # a hard eviction and a hard keep
for w in [1, 3, 9, 12]:
    assert_close(dms_mask_bias(alpha, w), dms_mask_bias_reference(alpha, w))
# evicted token 2 vanishes from query 5 = 2 + w on, and is seen by queries 2, 3, 4
test_eq(dms_mask_bias(alpha, 3)[0, 1, 5:, 2].tolist(), [-math.inf] * 4)
test_eq(dms_mask_bias(alpha, 3)[0, 1, 2:5, 2].tolist(), [0.0] * 3)
test_fail(lambda: dms_mask_bias(alpha, 0), contains="window must be")
test_fail(lambda: dms_mask_bias(alpha * 2, 3), contains="alpha must lie in")

# %% [markdown]
# The gradient reaches $\alpha_j$ only through queries at distance $\ge w$: with $S = 9$ and $w = 3$ the
# last 3 gates get none, all others do.

# %%
q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
a = torch.full((1, 2, 9), 0.3, requires_grad=True)
F.scaled_dot_product_attention(q, k, v, attn_mask=dms_mask_bias(a, 3)).square().sum().backward()
test_eq((a.grad[0].abs() > 0).tolist(), [[True] * 6 + [False] * 3] * 2)

# %% [markdown]
# **Attention under the mask.** Training needs exact attention with $b$ added to the logits, and
# gradients to $\log(1-\alpha)$. `dms_attention` has two routes: `"sdpa"` materializes $b$ for the
# query heads (`[B,Hq,S,S]`; autograd on every device, fine on CPU at a few thousand tokens), and
# `"flex"` adds the bias inside a FlexAttention `score_mod` that reads $\log(1-\alpha_{h,j})$ per key
# (query head $hG + g$ reads KV head $h$) under a causal block mask, so nothing of size $S^2$ is
# stored: the route for paper-scale sequences on CUDA (default there). FlexAttention has no backward
# on CPU, so on CPU we check the forward of the flex route against SDPA; the gradient check is a GPU
# test (`tests/test_kvpop_dms.py`).

# %%
#| export
DMS_BACKENDS = ("auto", "sdpa", "flex")

# %%
# the `backend` values of `dms_attention` and `DMSStudent`: 'auto' (the default) picks one of the other two
test_eq(DMS_BACKENDS, ("auto", "sdpa", "flex"))


# %%
#| export
def dms_attention(q: Tensor, k: Tensor, v: Tensor, log_keep: Tensor, window: int, scale: float | None = None,
                  mask: Tensor | None = None, dropout: float = 0.0, backend: str = "auto") -> Tensor:
    """Attention [B,Hq,S,D] of a whole sequence under the DMS bias from `log_keep` = log(1 - alpha) [B,Hkv,S].
    `mask`: an extra boolean mask (e.g. padding, forces 'sdpa'); backend 'auto' = 'flex' on CUDA, else 'sdpa'."""
    if backend not in DMS_BACKENDS: raise ValueError(f"backend must be one of {DMS_BACKENDS}, got {backend!r}")
    G = check_qkv(q, k, v)
    if log_keep.shape != k.shape[:3]:
        raise ValueError(f"log_keep must be [B,Hkv,S] = {tuple(k.shape[:3])}, got {tuple(log_keep.shape)}")
    if k.shape[2] != q.shape[2]: raise ValueError("dms_attention takes a whole sequence: as many queries as keys")
    window = check_int(window, "window", 1)
    if backend == "auto": backend = "flex" if q.is_cuda and mask is None and not dropout else "sdpa"
    if backend == "sdpa":
        bias = dms_mask_bias(None, window, log_keep)
        if mask is not None: bias = bias.masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.repeat_interleave(G, 1).to(q.dtype),
                                              dropout_p=dropout, scale=scale, enable_gqa=G > 1)
    if mask is not None or dropout:
        raise ValueError("backend='flex' takes no extra mask and no dropout: use backend='sdpa'")

    def score_mod(score, b, h, q_idx, kv_idx):  # + log(1 - alpha_j) once the key left the query's window
        return score + torch.where(in_window(window)(q_idx, kv_idx), 0.0, log_keep[b, h // G, kv_idx])

    S = q.shape[2]
    return flex_attention_lse(q, k, v, causal_block_mask(S, S, q.device), score_mod, scale, enable_gqa=G > 1)[0]


# %%
q, k, v = (torch.randn(2, h, 37, 16, generator=g) for h in (6, 2, 2))  # G = 3, a length that is no block multiple
lk = torch.log1p(-torch.rand(2, 2, 37, generator=g))
lk[0, 1, ::4] = -math.inf  # hard evictions
for w in [1, 5]:
    kq, vq = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)  # explicit softmax over the expanded heads
    ref = torch.softmax(q @ kq.transpose(-1, -2) / 4 + dms_mask_bias(None, w, lk).repeat_interleave(3, 1), -1) @ vq
    assert_close(dms_attention(q, k, v, lk, w, backend="sdpa"), ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad(): assert_close(dms_attention(q, k, v, lk, w, backend="flex"), ref, atol=1e-5, rtol=1e-5)
test_fail(lambda: dms_attention(q, k, v, lk[:, :, 1:], 3), contains="log_keep must be")


# %% [markdown]
# ## Hard decisions: the inference mask
#
# At inference $\alpha_{h,t} = [\ell_{h,t} > 0]$ (i.e. $\sigma(\ell) > 1/2$, no noise) and the mask is
# boolean: key $t$ is visible to query $p$ iff $t \le p$ and ($p - t < w$ or $t$ is kept). We write it
# with explicit positions, because the cache keeps different positions per head; optional sinks
# ($t < s$) are never evicted. With hard $\alpha$ it is exactly where `dms_mask_bias` is finite.

# %%
#| export
def dms_visible(evict: Tensor, window: int, key_positions: Tensor, query_positions: Tensor, sink: int = 0) -> Tensor:
    "Boolean [B,Hkv,Sq,Sk]: query p sees key t iff t <= p and (p - t < w, t kept by `evict` [B,Hkv,Sk], or t < sink)."
    if evict.dtype != torch.bool: raise TypeError(f"evict must be boolean, got {evict.dtype}")
    if evict.shape != key_positions.shape:
        raise ValueError(f"evict {tuple(evict.shape)} and key_positions {tuple(key_positions.shape)} must match")
    t, p = key_positions[:, :, None, :], query_positions[:, None]
    # StreamingLLM's sinks and window, or any causal key not marked for eviction
    return sink_window_visible(sink, check_int(window, "window", 1))(p, t) | (is_causal(p, t) & ~evict[:, :, None, :])


# %%
evict = torch.rand(2, 3, 11, generator=g) > 0.5
pos = torch.arange(11).expand(2, 3, 11)
for w in [1, 4]:
    test_eq(dms_visible(evict, w, pos, torch.arange(11)), torch.isfinite(dms_mask_bias(evict.double(), w)))
vis = dms_visible(evict, 4, pos, torch.arange(11), sink=2)
assert vis[..., :2].sum() == torch.tril(torch.ones(11, 11, dtype=torch.bool))[:, :2].sum() * 6  # sinks always visible
test_fail(lambda: dms_visible(evict.float(), 4, pos, torch.arange(11)), contains="evict must be boolean")


# %% [markdown]
# ## Compression-ratio schedule and the one-sided ratio loss
#
# The target fraction of evicted tokens rises linearly from 0 to the final target $\rho^\star$ over
# the first `steps` optimizer steps and stays there:
#
# $$\rho(\text{step}) = \rho^\star \min\!\left(1, \frac{\text{step}}{\text{steps}}\right).$$
#
# (DMS states the target as a compression ratio $CR$; a fraction $\rho$ of evicted tokens is
# $CR = 1/(1-\rho)$, so KVpop's 75 % and 88 % compression are $\rho^\star = 0.75, 0.88$.) The ratio
# loss is one-sided: it pushes the mean gate $\bar\alpha$ up while it is below the target and is zero
# above, leaving the distillation loss free to keep tokens once the quota is met:
#
# $$\mathcal L_\text{ratio} = \max\big(0, \rho(\text{step}) - \bar\alpha\big).$$

# %%
#| export
def check_fraction(name: str, value) -> float:
    "Validate a fraction in [0, 1)."
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


# %%
test_eq((check_fraction("x", 0), check_fraction("x", 0.75)), (0.0, 0.75))
for bad in (1, 1.0, -0.1, True): test_fail(lambda: check_fraction("x", bad), contains="x must be a number in [0, 1)")


# %%
#| export
def ratio_schedule(step: int, steps: int, target: float) -> float:
    "Target eviction fraction at `step`: rises linearly from 0 to `target` over `steps` steps, then constant."
    check_int(step, "step")
    return check_fraction("target", target) * min(1.0, step / check_int(steps, "steps", 1))


# %%
test_eq([ratio_schedule(s, 4, 0.75) for s in [0, 1, 2, 4, 9]], [0.0, 0.1875, 0.375, 0.75, 0.75])
test_fail(lambda: ratio_schedule(3, 0, 0.5), contains="steps must be")


# %%
#| export
def ratio_loss(alpha: Tensor, target: float) -> Tensor:
    "One-sided ratio loss max(0, target - mean(alpha)) over every gate of `alpha`."
    if not isinstance(alpha, Tensor) or not alpha.is_floating_point() or alpha.numel() == 0:
        raise TypeError("alpha must be a non-empty floating-point tensor")
    return torch.relu(check_fraction("target", target) - alpha.float().mean())


# %%
a = torch.tensor([0.1, 0.3], requires_grad=True)
assert_close(ratio_loss(a, 0.5), torch.tensor(0.5 - 0.2))
ratio_loss(a, 0.5).backward()
assert_close(a.grad, torch.tensor([-0.5, -0.5]))  # pushes every gate up equally
test_eq(ratio_loss(torch.tensor([0.6, 0.8]), 0.5).item(), 0.0)  # above the target: no pull back
test_fail(lambda: ratio_loss(a, 1.0), contains="target must be")


# %% [markdown]
# **Matching KVpop's budget** (KVpop §4 trains DMS "with the same budget"; the mapping is our
# interpretation). After $S$ tokens a DMS head holds its window of $w$ tokens plus the kept fraction of
# the $S - w$ older ones, on average $w + (1-\rho)(S-w)$ entries. Equating this with KVpop's budget
# $B = s + w + k$ at the training length gives
#
# $$\rho^\star = 1 - \frac{B - w}{S - w},$$
#
# e.g. $B = 4096$, $w = 256$, $S = 16384$ (75 % compression) gives $\rho^\star \approx 0.762$.

# %%
#| export
def target_for_budget(budget: int, window: int, seq_len: int) -> float:
    "Eviction fraction rho* whose mean cache w + (1 - rho*)(S - w) after `seq_len` tokens is `budget` (s + w + k)."
    budget, window, seq_len = (check_int(x, n, 1)
                               for x, n in ((budget, "budget"), (window, "window"), (seq_len, "seq_len")))
    if not window < budget <= seq_len:
        raise ValueError(f"need window < budget <= seq_len, got {window}, {budget}, {seq_len}")
    return 1 - (budget - window) / (seq_len - window)


# %%
rho = target_for_budget(4096, 256, 16384)
assert abs(256 + (1 - rho) * (16384 - 256) - 4096) < 1e-9 and round(rho, 3) == 0.762
test_eq(target_for_budget(64, 8, 64), 0.0)  # a budget of the whole sequence: nothing to evict
test_fail(lambda: target_for_budget(8, 8, 64), contains="need window < budget")


# %% [markdown]
# ## The decision head
#
# Per layer, an `MLPScorer` (headwise two-layer SiLU MLP on the detached post-RoPE $[k; v]$, the
# same parameters as KVpop$_\text{mlp}$'s scorers; its output layer starts at zero) gives a raw logit;
# a per-(layer, head) bias $c\, b_h$ with $b_h$ initialized to $\ell_0 / c$ closes the gates at the
# start (default $\ell_0 = -5$: $\sigma(-5) \approx 0.7\%$ of tokens evicted) and, through the scale
# $c$ = `bias_scale`, moves $c$ times faster under Adam than a plain bias (our interpretation, see
# the introduction):
#
# $$\ell_{h,t} = \mathrm{MLP}_h([k_t; v_t]) + c\, b_h .$$

# %%
#| export
class DMSDecisions(nn.Module):
    "Eviction logits l[b,h,t] = MLP_h([k_t; v_t]) + bias_scale * b_h per layer (an `MLPScorer`, gates closed at init)."

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int | None = None,
                 init_logit: float = -5.0, bias_scale: float = 50.0):
        super().__init__()
        check_int(num_layers, "num_layers", 1)
        if not bias_scale > 0: raise ValueError(f"bias_scale must be > 0, got {bias_scale!r}")
        self.scorers = nn.ModuleList([MLPScorer(num_kv_heads, head_dim, hidden) for _ in range(num_layers)])
        self.bias_scale = float(bias_scale)
        self.bias = nn.Parameter(torch.full((num_layers, num_kv_heads), float(init_logit) / self.bias_scale))

    @property
    def num_layers(self) -> int: return len(self.scorers)

    def forward(self, layer_idx: int, k: Tensor, v: Tensor) -> Tensor:
        "Logits [B,Hkv,S] (float32) of layer `layer_idx` from its post-RoPE keys and values [B,Hkv,S,d] (detached)."
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must lie in [0, {self.num_layers}), got {layer_idx}")
        return self.scorers[layer_idx](k, v) + self.bias_scale * self.bias[layer_idx, :, None].float()


# %%
# fresh heads: the MLP's output layer is zero, so every logit is init_logit
_dec = DMSDecisions(2, 3, 8, init_logit=-4.0, bias_scale=10.0)
_k6, _v6 = torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8)
assert_close(_dec(1, _k6, _v6), torch.full((1, 3, 6), -4.0))
test_eq((_dec.num_layers, _dec.bias_scale, _dec.bias.shape), (2, 10.0, (2, 3)))
test_fail(lambda: _dec(2, _k6, _v6), contains="layer_idx must lie in [0, 2)")
test_fail(lambda: DMSDecisions(2, 3, 8, bias_scale=0.0), contains="bias_scale must be > 0")


# %% [markdown]
# ## The student's attention: `DMSPolicy`
#
# One policy serves training and inference:
#
# - **training** (`student.training`, a whole sequence without a cache): gates from the
#   Gumbel-sigmoid, sinks forced to keep, exact attention under the bias $b$ by `dms_attention`
#   (the student's `backend`). The gates of every layer are handed to the student for the ratio loss.
# - **evaluation**: hard decisions $[\ell > 0]$ and the boolean `dms_visible` mask; with a plain
#   (or no) cache the decisions of every key are recomputed from the keys the cache returns (the head
#   is stateless), so this also gives the teacher-forced reference for the bounded cache below.
# - with a `DMSCache` (any mode): the cache's own rule says what each query sees; decode queries are
#   masked too, since the cache holds padding entries (see below).

# %%
#| export
class DMSPolicy(AttentionPolicy):
    "DMS attention: soft delayed-eviction mask in training, hard `dms_visible` mask in evaluation or from a `DMSCache`."

    def __init__(self, student: "DMSStudent"):
        self.student = student
        self.evictions: dict[int, Tensor] = {}  # evaluation: hard decisions [B,Hkv,Sk] per layer of the last call

    def attend(self, q, k, v, ctx):
        s = self.student
        layer = ctx.cache_layer
        if isinstance(layer, EvictingLayer) and isinstance(layer.rule, DMSRule):
            return dense_attention(q, k, v, layer.rule.visible(layer, ctx.query_positions), ctx.scale, ctx.dropout)
        logits = s.decisions(ctx.layer_idx, k, v)
        sinks = ctx.key_positions < s.sink
        if not s.training:
            evict = (logits > 0) & ~sinks
            self.evictions[ctx.layer_idx] = evict
            m = dms_visible(evict, s.window, ctx.key_positions, ctx.query_positions, s.sink)
            if ctx.mask is not None: m = m & ctx.mask
            return dense_attention(q, k, v, m, ctx.scale, ctx.dropout)
        if ctx.past_len:
            raise ValueError("DMSPolicy trains on whole sequences: call the model without a cache in train mode")
        z = gumbel_logits(logits, s.tau)
        alpha, log_keep = torch.sigmoid(z), F.logsigmoid(-z)  # log(1 - alpha) from z: finite where alpha rounds to 1
        if s.hard:  # straight-through: hard gates forward, the soft gates' gradient backward
            hard = z > 0
            alpha = hard.to(alpha.dtype) + alpha - alpha.detach()
            log_keep = torch.zeros_like(log_keep).masked_fill(hard, float("-inf")) + log_keep - log_keep.detach()
        alpha, log_keep = alpha.masked_fill(sinks, 0.0), log_keep.masked_fill(sinks, 0.0)
        if torch.is_grad_enabled(): s.capture(alpha, (logits.detach() > 0) & ~sinks)  # a no-grad forward leaves nothing
        return dms_attention(q, k, v, log_keep, s.window, ctx.scale, ctx.mask, ctx.dropout, s.backend)


# %%
# on a stand-in student: random decision heads of one layer, one sink, a window of 2, 2 query heads per KV head
torch.manual_seed(0)
_dec = DMSDecisions(1, 2, 8, init_logit=0.0)
for _p in _dec.scorers.parameters(): nn.init.normal_(_p)
_q, _k, _v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
_pos = torch.arange(6).expand(1, 2, 6)
_ctx = SimpleNamespace(cache_layer=None, layer_idx=0, key_positions=_pos, query_positions=torch.arange(6), mask=None,
                       scale=0.3, dropout=0.0, past_len=0)
# evaluation: hard decisions (sinks kept) and exact attention under dms_visible
_pol = DMSPolicy(SimpleNamespace(decisions=_dec, sink=1, window=2, training=False))
_out = _pol.attend(_q, _k, _v, _ctx)
with torch.no_grad(): _evict = (_dec(0, _k, _v) > 0) & (_pos >= 1)
test_eq(_pol.evictions[0], _evict)
_vis = dms_visible(_evict, 2, _pos, torch.arange(6), 1).repeat_interleave(2, 1)
assert_close(_out, attention_reference(_q, _k, _v, _vis, scale=0.3)[0], atol=1e-5, rtol=1e-5)
# training with hard gates: the same noise drawn again gives the mask; the captured gates are the hard decisions
_caps = []
_train = SimpleNamespace(decisions=_dec, sink=1, window=2, training=True, tau=0.1, hard=True, backend="sdpa",
                         capture=lambda alpha, evict: _caps.append((alpha, evict)))
torch.manual_seed(1)
_out = DMSPolicy(_train).attend(_q, _k, _v, _ctx)
torch.manual_seed(1)
_z = gumbel_logits(_dec(0, _k, _v), 0.1)
_lk = torch.zeros_like(_z).masked_fill(_z > 0, -math.inf).masked_fill(_pos < 1, 0.0)
assert_close(_out, dms_attention(_q, _k, _v, _lk.detach(), 2, 0.3, backend="sdpa"))
assert_close(_caps[0][0].detach(), ((_z > 0) & (_pos >= 1)).float())
test_fail(lambda: DMSPolicy(_train).attend(_q, _k, _v, SimpleNamespace(**{**vars(_ctx), "past_len": 3})),
          contains="trains on whole sequences")


# %% [markdown]
# ## The bounded cache: `DMSRule`, `DMSCache`
#
# The rule scores each new entry at insertion with its decision logit (stored as the entry's score)
# and shows query $p$ the entries `dms_visible` allows: an entry marked for eviction disappears once
# $p - t \ge w$, for good (the rule is monotone in $p$, as `EvictionRule` requires).
#
# **Padding.** The `transformers` cache is rectangular: within a layer every head must return the same
# number of entries, and the model builds one attention mask per forward from layer 0's size, so all
# layers must hold the same number too (`sparsekv.hf` checks it). DMS's heads keep *different* numbers
# of tokens. So the cache keeps, in every head of every layer, $M$ slots, where $M$ is the largest
# number of entries any head of any layer still shows the next query; a head with fewer live entries
# fills its remaining slots with dead (evicted) entries, which `dms_visible` hides from every later
# query (eviction is permanent), so they never change an output. Since the layers are evicted one
# after the other after attention, a `DMSLayer` defers its eviction and the last layer compacts all
# layers together. The physical memory is therefore that of the busiest head; the *logical* memory per
# head (`DMSCache.live_counts`) is what a ragged (paged) layout would store, the quantity of Fig. 8.
# Decode queries must be masked (the padding is not visible), which `DMSPolicy` does. $M$ is a shape decided by
# the learned decisions, so the host reads it: once per step for all layers (the one read back of a DMS decode
# step; a cache of fixed capacity with masks would need none).

# %%
#| export
class DMSRule(EvictionRule):
    "DMS at inference: an entry whose hard decision says evict is invisible to queries at distance >= `window`."

    def __init__(self, decisions: DMSDecisions, window: int, sink: int = 0):
        if not isinstance(decisions, DMSDecisions):
            raise TypeError(f"decisions must be DMSDecisions, got {type(decisions).__name__}")
        check_int(sink, "sink")
        self.decisions, self.window, self.sink = decisions, check_int(window, "window", 1), sink

    def scores(self, layer, keys, values, positions):
        "The entries' decision logits l (evict iff l > 0)."
        with torch.no_grad(): return self.decisions(layer.layer_idx, keys, values)

    def visible(self, layer, query_positions):
        return dms_visible(layer.scores > 0, self.window, layer.positions, query_positions, self.sink)


# %%
# scores 1, 1, -1, 1, -1 mark positions 0, 1, 3 for eviction; with one sink and w = 2, query 4 sees 0 (a sink),
# not 1 (evicted, 3 back), 2 (kept), 3 and 4 (in the window)
_rule = DMSRule(_dec, 2, sink=1)
_l5 = SimpleNamespace(layer_idx=0, positions=torch.arange(5).expand(1, 1, 5),
                      scores=torch.tensor([[[1.0, 1, -1, 1, -1]]]))
test_eq(_rule.visible(_l5, torch.tensor([4]))[0, 0, 0].int().tolist(), [1, 0, 1, 1, 1])
assert_close(_rule.scores(SimpleNamespace(layer_idx=0), _k, _v, _pos), _dec(0, _k, _v).detach())
test_fail(lambda: DMSRule(MLPScorer(2, 8), 2), exc=TypeError, contains="decisions must be DMSDecisions")


# %%
#| export
class DMSLayer(EvictingLayer):
    "An `EvictingLayer` whose eviction the `DMSCache` performs for all layers at once, after the last layer."

    def __init__(self, rule: DMSRule, layer_idx: int, cache: "DMSCache"):
        super().__init__(rule, layer_idx)
        self._cache = weakref.ref(cache)

    def evict(self, next_position: int | None = None) -> None:
        cache = self._cache()
        if self.layer_idx == cache.num_layers - 1: cache.compact(self.seen if next_position is None else next_position)


# %%
class _Cache:
    "A stand-in cache of two layers that records compactions."
    num_layers, calls = 2, []
    def compact(self, next_position): self.calls.append(next_position)


_stand_in = _Cache()
DMSLayer(_rule, 0, _stand_in).evict()  # not the last layer: deferred
_last = DMSLayer(_rule, 1, _stand_in)
_last.seen = 5
_last.evict(); _last.evict(7)
test_eq(_stand_in.calls, [5, 7])


# %%
#| export
class DMSCache(EvictingCache):
    "Bounded DMS cache (inside `patch(model, student.policy())`): each head keeps its live entries, padded alike."
    layers_compile = False  # its compaction reads the live counts back (no compiled decode, see `OptInCompile`)

    def __init__(self, decisions: DMSDecisions, window: int, sink: int = 0):
        super().__init__(DMSRule(decisions, window, sink))
        self.num_layers = decisions.num_layers

    def layer(self, layer_idx: int) -> DMSLayer:
        if layer_idx >= self.num_layers:
            raise ValueError(f"layer_idx {layer_idx} >= the decisions' num_layers={self.num_layers}")
        while len(self.layers) <= layer_idx: self.layers.append(DMSLayer(self.rule, len(self.layers), self))
        return self.layers[layer_idx]

    def live(self, next_position: int) -> list[Tensor]:
        "Per layer, boolean [B,Hkv,N]: the entries `next_position` still sees."
        pos = torch.tensor([next_position], device=self.layers[0].positions.device)
        return [self.rule.visible(l, pos)[:, :, 0] for l in self.layers]

    def live_counts(self) -> Tensor:
        "Entries each head still needs for the next token, [L,B,Hkv] (logical memory; the tensors hold the maximum)."
        return torch.stack([v.sum(-1) for v in self.live(self.get_seq_length())])


# %%
_c = DMSCache(_dec, 2, sink=1)
test_eq((type(_c.layer(0)), _c.layer(0)._cache() is _c, _c.num_layers), (DMSLayer, True, 1))
test_fail(lambda: _c.layer(1), contains="layer_idx 1 >= the decisions' num_layers=1")
_c.layer(0).arm()
_c.update(_k, _v, 0)
# brute force: at the next position 6 an entry lives if it is a sink, in the window (6 - t < 2) or not marked
_live = [[sum(t < 1 or 6 - t < 2 or not _evict[0, h, t] for t in range(6)) for h in range(2)]]
test_eq(_c.live_counts().tolist(), [_live])
test_eq(_c.live(6)[0].sum(-1).tolist(), _live)


# %%
#| export
@patch_to(DMSCache)
def compact(self, next_position: int) -> None:
    "Keep in each layer and head the entries visible to `next_position`, padded with dead ones to the most."
    if any(not l.is_initialized for l in self.layers): return
    live = self.live(next_position)
    # the tensors' size is the busiest head's count, decided by the decisions: one read a step, for all layers
    M = int(torch.stack([v.sum(-1).amax() for v in live]).amax())
    for l, vis in zip(self.layers, live):
        if M == vis.shape[-1]: continue
        # live first, then padding
        idx = torch.argsort((~vis).to(torch.uint8), dim=-1, stable=True)[..., :M].sort(-1).values
        l.keys, l.values = gather_kv(l.keys, l.values, idx)
        l.positions, l.scores = l.positions.gather(2, idx), l.scores.gather(2, idx)


# %%
_before_k, _live6 = _c.layer(0).keys.clone(), _c.live(6)[0]
_c.compact(6)
_kept = _c.layer(0).positions
test_eq(_kept.shape[-1], max(_live[0]))  # padded to the busiest head
for h in range(2):
    assert set(_live6[0, h].nonzero().flatten().tolist()) <= set(_kept[0, h].tolist())  # every live entry stays
    test_eq(_c.layer(0).keys[0, h], _before_k[0, h, _kept[0, h]])
test_eq(_c.live_counts().tolist(), [_live])  # the padding is dead


# %% [markdown]
# ## `DMSStudent`: the distillation-student protocol
#
# The student's parameters are the decision heads only. `policy()` is the attention above;
# `method_loss(step)` returns $\lambda\,\mathcal L_\text{ratio}$ against $\rho(\text{step})$ from the
# gates the last training forward captured (all layers together), and clears the capture. Its metrics
# are the training eviction rate $\bar\alpha$ and the rate inference would have, the fraction of
# noise-free logits above 0: the two differ until the logits move away from 0 (the logistic noise has
# unit scale whatever $\tau$), which the KL has to drive; `inference_cache()` is a fresh `DMSCache`. The distillation
# KL is the training loop's (`sparsekv.distill.distill`).

# %%
#| export
class DMSStudent(DistillStudent):
    "DMS as a distillation student: decision heads, delayed-eviction policy, ratio loss vs the schedule, bounded cache."

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, window: int, target: float, ramp_steps: int,
                 tau: float = 0.1, weight: float = 1.0, hard: bool = False, sink: int = 0, hidden: int | None = None,
                 init_logit: float = -5.0, bias_scale: float = 50.0, backend: str = "auto"):
        super().__init__()
        self.decisions = DMSDecisions(num_layers, num_kv_heads, head_dim, hidden, init_logit, bias_scale)
        self.window, self.target = check_int(window, "window", 1), check_fraction("target", target)
        self.ramp_steps, self.tau = check_int(ramp_steps, "ramp_steps", 1), check_temperature(tau)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        if not isinstance(hard, bool): raise TypeError(f"hard must be a bool, got {hard!r}")
        check_int(sink, "sink")
        if backend not in DMS_BACKENDS: raise ValueError(f"backend must be one of {DMS_BACKENDS}, got {backend!r}")
        self.weight, self.hard, self.sink, self.backend = float(weight), bool(hard), sink, backend
        self._captured: list[Tensor] = []
        self._decided: list[Tensor] = []

    def capture(self, alpha: Tensor, evict: Tensor) -> None:
        "Record a layer's gates alpha [B,Hkv,S] and noise-free decisions [l > 0] (called by the policy in training)."
        self._captured.append(alpha)
        self._decided.append(evict)

    def policy(self) -> DMSPolicy:
        return DMSPolicy(self)

    def inference_cache(self) -> DMSCache:
        return DMSCache(self.decisions, self.window, self.sink)


# %%
_st = DMSStudent(2, 3, 8, window=4, target=0.5, ramp_steps=10, sink=1)
test_eq((type(_st.policy()), type(_st.inference_cache()), _st.inference_cache().num_layers), (DMSPolicy, DMSCache, 2))
# the decision heads are the only parameters
test_eq(sorted(n for n, _ in _st.named_parameters()),
        sorted("decisions." + n for n, _ in _st.decisions.named_parameters()))
test_fail(lambda: DMSStudent(2, 3, 8, 4, 1.0, 10), contains="target must be a number in [0, 1)")
test_fail(lambda: DMSStudent(2, 3, 8, 4, 0.5, 10, weight=-1), contains="weight must be a finite number >= 0")
test_fail(lambda: DMSStudent(2, 3, 8, 4, 0.5, 10, backend="triton"), contains="backend must be one of")


# %%
#| export
@patch_to(DMSStudent, cls_method=True)
def for_model(cls, model, window: int, target: float, ramp_steps: int, **kwargs) -> "DMSStudent":
    "A student sized for `model`'s layers, KV heads and head dim, on its device."
    info = model_info(model)
    device = next(model.parameters()).device
    return cls(info.num_layers, info.num_kv_heads, info.head_dim, window, target, ramp_steps, **kwargs).to(device)


# %%
_tiny = load_model("tiny-llama")[0]
_st = DMSStudent.for_model(_tiny, window=4, target=0.5, ramp_steps=10, tau=0.2)
_info = model_info(_tiny)
test_eq((_st.decisions.num_layers, _st.decisions.bias.shape[1], _st.tau), (_info.num_layers, _info.num_kv_heads, 0.2))


# %%
#| export
@patch_to(DMSStudent)
def method_loss(self, step: int) -> tuple[Tensor, dict[str, float]]:
    "weight * max(0, rho(step) - mean alpha) over the captured gates, metrics, and clear the capture."
    target = ratio_schedule(step, self.ramp_steps, self.target)
    if not self._captured: return torch.zeros((), device=self.decisions.bias.device), {"eviction_target": target}
    alpha, evict = torch.stack(self._captured), torch.stack(self._decided)
    self._captured, self._decided = [], []
    loss = self.weight * ratio_loss(alpha, target)
    with torch.no_grad():
        metrics = {"eviction_rate": alpha.mean().item(), "eviction_rate_inference": evict.float().mean().item(),
                   "eviction_target": target, "ratio_loss": loss.item()}
    return loss, metrics


# %%
test_eq(_st.method_loss(5), (torch.zeros(()), {"eviction_target": 0.25}))  # nothing captured
_st.capture(torch.tensor([[[0.1, 0.2]]]), torch.tensor([[[False, True]]]))
_loss, _metrics = _st.method_loss(10)  # target 0.5 at the end of the ramp
assert_close(_loss, torch.tensor(0.5 - 0.15))
test_eq((_metrics["eviction_rate_inference"], _metrics["eviction_target"], _st._captured), (0.5, 0.5, []))

# %% [markdown]
# **Check: the bounded cache computes the teacher-forced hard-decision attention.** A student with
# random decision heads (its bias at 0, so about half the tokens are marked) on the tiny Llama
# (fp32): decoding token by token with `DMSCache`, and a chunked prefill followed by decoding, give
# the logits of one forward pass under `DMSPolicy` in evaluation mode, at every position; the cache
# holds fewer entries than tokens; `generate` runs with it.

# %%
model, _ = load_model("tiny-llama")
torch.manual_seed(0)
student = DMSStudent.for_model(model, window=4, target=0.5, ramp_steps=10, init_logit=0.0).eval()
for p in student.decisions.scorers.parameters(): p.data.add_(torch.randn_like(p))
ids = torch.randint(3, 259, (2, 30), generator=torch.Generator().manual_seed(2))
with torch.no_grad(), patch(model, student.policy()): ref = model(ids).logits


def dms_decode(model, student, ids, prefill=0, chunk=1):
    "Logits [B,S,V] of a chunked prefill of `prefill` tokens then token-by-token decoding with the student's cache."
    cache, rows = student.inference_cache(), []
    with torch.no_grad(), patch(model, student.policy()):
        for a in range(0, prefill, chunk):
            pos = torch.arange(a, min(a + chunk, prefill))
            rows.append(model(ids[:, pos], past_key_values=cache, position_ids=pos.expand(ids.shape[0], -1)).logits)
        for t in range(prefill, ids.shape[1]): rows.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
    return torch.cat(rows, 1), cache


got, cache = dms_decode(model, student, ids)
assert_close(got, ref, atol=1e-5, rtol=0)
got2, _ = dms_decode(model, student, ids, prefill=13, chunk=5)
assert_close(got2, ref, atol=1e-5, rtol=0)
with torch.no_grad(): dense = model(ids).logits
assert (ref - dense).abs().max() > 1e-2  # eviction really changes the outputs
counts = cache.live_counts()
print("live entries per (layer, batch, head) after 30 tokens:", counts.tolist(),
      "| slots:", cache.layers[0].keys.shape[2])
# heads differ; padding to the max
assert cache.layers[0].keys.shape[2] == counts.max() < 30 and counts.min() < counts.max()
with torch.no_grad(), patch(model, student.policy()):
    out = model.generate(ids[:1, :6], attention_mask=torch.ones_like(ids[:1, :6]),
                         past_key_values=student.inference_cache(),
                         max_new_tokens=5, do_sample=False, pad_token_id=0)
    seq = ids[:1, :6]
    for _ in range(5): seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)  # the masked reference, greedily
test_eq(out, seq)


# %% [markdown]
# ## Eviction ratios per head (App. H, Fig. 8)
#
# KVpop App. H reports, per layer and KV head, the median over sequences of the **eviction ratio**:
# 0 for dense attention, 1 for attention restricted to the sliding window. With hard decisions, for a
# sequence of $S$ tokens the long-range tokens are those that left the last query's window,
# $s \le t \le S - 1 - w$; the ratio is the fraction of them marked for eviction.
# `eviction_ratios` runs one evaluation forward and returns `[B, L, Hkv]` (take the median over the
# batch for Fig. 8).
#
# Check on a hand-built student: with the MLP output at zero, each head's logit is its bias, so a head
# with bias $+3$ evicts every long-range token (ratio 1) and one with $-3$ none (ratio 0). A content-
# dependent head is compared with the decisions recomputed from the layer's own keys and values.

# %%
#| export
def eviction_ratios(student: DMSStudent, model, input_ids: Tensor) -> Tensor:
    "Fraction [B,L,Hkv] of each sequence's long-range tokens (sink <= t <= S-1-w) whose hard decision is evict."
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be an int64 tensor [B,S]")
    S, lo = input_ids.shape[1], student.sink
    hi = S - student.window  # long-range tokens: lo <= t < hi
    if hi <= lo: raise ValueError(f"input_ids needs more than sink + window = {lo + student.window} tokens, got {S}")
    pol, mode = student.policy(), student.training
    student.eval()
    try:
        with torch.no_grad(), patch(model, pol): model(input_ids)
    finally: student.train(mode)
    return torch.stack([pol.evictions[l][..., lo:hi].float().mean(-1) for l in range(student.decisions.num_layers)], 1)


# %%
hand = DMSStudent.for_model(model, window=4, target=0.5, ramp_steps=10, sink=1)
with torch.no_grad(): hand.decisions.bias.copy_(torch.tensor([[3.0, -3.0], [-3.0, 3.0]]) / hand.decisions.bias_scale)
test_eq(eviction_ratios(hand, model, ids).tolist(), [[[1.0, 0.0], [0.0, 1.0]]] * 2)
r = eviction_ratios(student, model, ids)


class _FirstLayerKV(DensePolicy):
    "Dense attention that records layer 0's post-RoPE keys and values (the same under any policy)."
    def attend(self, q, k, v, ctx):
        if ctx.layer_idx == 0: self.kv = k, v
        return super().attend(q, k, v, ctx)


rec = _FirstLayerKV()
with torch.no_grad(), patch(model, rec): model(ids)
with torch.no_grad(): want = (student.decisions(0, *rec.kv) > 0)[..., :30 - 4].float().mean(-1)
assert_close(r[:, 0], want)
test_fail(lambda: eviction_ratios(student, model, ids[:, :4]), contains="needs more than")

# %% [markdown]
# ## A few training steps
#
# A short distillation on the tiny Llama: the student model is the base with the DMS policy, the
# teacher the same frozen weights dense; the loss is the forward KL of the next-token distributions
# (written inline here; the project's loop is `sparsekv.distill.distill`) plus the ratio loss, and
# only the decision heads train. The eviction rate follows the rising target $\rho$ (0 to 0.6 over 20
# steps) with a lag, then settles a little above it: the one-sided loss stops pushing at the target
# and only the KL pulls back, which on a random tiny model barely depends on the context.
# We use Adam without momentum ($\beta_1 = 0$) here; with momentum the rate
# overshoots further on this model, since nothing resists it (a real model's KL does).

# %%
torch.manual_seed(0)
st = DMSStudent.for_model(model, window=8, target=0.6, ramp_steps=20).train()
opt = torch.optim.Adam(st.parameters(), lr=3e-3, betas=(0.0, 0.999))
data = torch.randint(3, 259, (4, 64), generator=torch.Generator().manual_seed(5))
with torch.no_grad(): teacher = F.log_softmax(model(data).logits, -1)
log = []
for step in range(50):
    with patch(model, st.policy()): student_logp = F.log_softmax(model(data).logits, -1)
    kl = F.kl_div(student_logp, teacher, log_target=True, reduction="none").sum(-1).mean()
    rl, m = st.method_loss(step)
    opt.zero_grad()
    (kl + rl).backward()
    opt.step()
    log.append((step, m["eviction_target"], m["eviction_rate"], kl.item()))
for row in log[::5] + log[-1:]: print("step %2d  target %.3f  eviction rate %.3f  KL %.5f" % row)
rates = torch.tensor([r[2] for r in log])
assert rates[0] < 0.02 and (rates[-10:] - 0.6).abs().max() < 0.15  # starts dense, settles near the target
assert max(p.grad.abs().max() for p in st.decisions.scorers.parameters()) > 0  # the KL reaches the MLP through the mask


# %% [markdown]
# ## DMS as a method
#
# For `sparsekv.methods`, DMS is a trained eviction method (`TrainedMethod`, the budget split into sinks,
# window and the rest as for KVpop) whose budget is **not a bound**: its training meets the eviction target
# `target_for_budget(budget, window, seq_len)` on average (hence `exact_budget = False`), and at inference
# each head keeps what its hard decisions say. A fresh (untrained) student evicts nothing: its gates start
# closed. Its policy belongs to its student, so `patch` patches with the student's policy and yields its cache.
#
# Check: a fresh DMS generates what the dense model generates (its gates are closed), with a bounded
# `DMSCache`; the training student's target is the one `target_for_budget` gives.

# %%
#| export
class DMS(TrainedMethod):
    "DMS (§4): learned gates; `budget` sets the training target (met on average), `options` go to `DMSStudent`."
    name, mode, exact_budget = "dms", "full", False

    def __init__(self, budget: int, sink: int | None = None, window: int | None = None, checkpoint=None,
                 chunk_size: int | None = None, **options):
        super().__init__(budget, sink, window, checkpoint, chunk_size)
        accepted = set(inspect.signature(DMSStudent).parameters) - {"num_layers", "num_kv_heads", "head_dim",
                                                                    "window", "target", "ramp_steps", "sink"}
        if set(options) - accepted:
            raise TypeError(f"unexpected options {sorted(set(options) - accepted)} for dms; accepted: "
                            f"{sorted(accepted)}")
        self.options = options
        DMSStudent(1, 1, 2, self.window, 0.0, 1, sink=self.sink, **options)  # every option checked now, cheaply

    def student(self, model, seed: int = 0, seq_len: int | None = None, steps: int | None = None) -> DMSStudent:
        "A fresh student, target `target_for_budget` at `seq_len` (None: 0, for inference), ramped over 3/4 of `steps`."
        target = 0.0 if seq_len is None else target_for_budget(self.budget, self.window, seq_len)
        return DMSStudent.for_model(model, self.window, target, max(1, 3 * (steps or 1) // 4), sink=self.sink,
                                    **self.options)

    def policy(self):
        raise NotImplementedError("DMS attends with its student's policy: use patch(model) (or "
                                  "trained_student(model).policy())")

    @contextlib.contextmanager
    def patch(self, model):
        st = self.trained_student(model)
        with patch(model, st.policy()): yield st.inference_cache()


# %%
ids = torch.randint(3, 259, (2, 12), generator=torch.Generator().manual_seed(4))
gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
with torch.no_grad(): dense_out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
m = DMS(16, sink=2, window=4)
test_eq(m.generate(model, ids, **gen), dense_out)
with m.patch(model) as cache: test_eq(type(cache).__name__, "DMSCache")
st = m.student(model, seq_len=64, steps=40)
test_eq((st.target, st.ramp_steps, st.window, st.sink), (target_for_budget(16, 4, 64), 30, 4, 2))
test_fail(lambda: DMS(16, bias=1.0), contains="unexpected options")
