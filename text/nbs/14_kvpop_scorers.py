# %% [markdown]
# # KVpop: online importance scorers
#
# > KVpop's scorers (§3.3, Eq. 10–11, 35–42): headwise linear and MLP scorers and the stateful mLSTM scorer.

# %%
#| default_exp kvpop.scorers

# %%
#| export
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from fastcore.basics import patch_to
from torch import Tensor, nn

from sparsekv.attention import check_int, require_finite

# %%
#| hide
import copy
import time

from fastcore.test import test_eq, test_fail
from mlstm_kernels.torch.parallel.native.fw import mlstm_parallel_fw
from mlstm_kernels.torch.recurrent.native_step import mlstm_recurrent_step__native_fw
from torch.testing import assert_close

from sparsekv.attention import checks, hot_path


# %% [markdown]
# A KVpop scorer assigns every cached token of every KV head a raw importance score
# $\hat r_{h,t}$; the learned decay and the static priority $\hat r_{h,t} - t\log\gamma_h$ are
# applied afterwards (`sparsekv.kvpop.cutoff`), so the scorers here only produce raw scores
# `r [B, Hkv, S]`.
#
# ## Headwise inputs (Eq. 35)
#
# The input of KV head $h$ at token $t$ is built from cached quantities only,
#
# $$\boldsymbol{x}_{h,t} = [\boldsymbol{k}_{h,t}; \boldsymbol{v}_{h,t}] \in \mathbb{R}^{2d} \qquad \text{(Eq. (35))},$$
#
# with post-RoPE keys and values. The scorer is trained only by the retention loss, never
# through the backbone (§3.3), so the input is *detached*: no gradient reaches $k$ or $v$.
#
# `check_kv` refuses a NaN or infinite key by `require_finite`, a content check: in a patched model's step (the
# cache scores every new token, in every layer) it runs only under `sparsekv.attention.checks`.

# %%
#| export
def check_kv(k: Tensor, v: Tensor, num_kv_heads: int | None = None, head_dim: int | None = None) -> None:
    "Validate keys/values: finite floating-point tensors of one shape [..., Hkv, d] (optionally matching the scorer)."
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.dim() < 2:
            raise TypeError(f"{name} must be a floating-point tensor [B, Hkv, S, d] or [B, Hkv, d], "
                            f"got {getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    require_finite("k", k), require_finite("v", v)  # a scorer maps a NaN key to a NaN priority
    heads_dim = -3 if k.dim() >= 4 else -2
    if num_kv_heads is not None and k.shape[heads_dim] != num_kv_heads:
        raise ValueError(f"k/v have {k.shape[heads_dim]} KV heads, the scorer was built for "
                         f"num_kv_heads={num_kv_heads}")
    if head_dim is not None and k.shape[-1] != head_dim:
        raise ValueError(f"k/v have head dim {k.shape[-1]}, the scorer was built for head_dim={head_dim}")


# %%
check_kv(torch.zeros(2, 3, 5, 4), torch.zeros(2, 3, 5, 4), 3, 4)  # [B, Hkv, S, d] built for 3 heads of dim 4
test_fail(lambda: check_kv(torch.zeros(2, 3, 5, 4), torch.zeros(2, 3, 5, 4), 2), contains="num_kv_heads=2")
test_fail(lambda: check_kv(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), 3, 8), contains="head_dim=8")  # one token
test_fail(lambda: check_kv(torch.zeros(3), torch.zeros(3)), contains="floating-point tensor")
test_fail(lambda: check_kv(torch.full((1, 3, 2, 4), math.nan), torch.zeros(1, 3, 2, 4)), contains="k contains NaN")
with hot_path():  # a step: the shapes only, unless checks() is on
    check_kv(torch.full((1, 3, 2, 4), math.nan), torch.zeros(1, 3, 2, 4))
    with checks(): test_fail(lambda: check_kv(torch.zeros(1, 3, 2, 4), torch.full((1, 3, 2, 4), math.inf)),
                             contains="v contains NaN")


# %%
#| export
def scorer_input(k: Tensor, v: Tensor) -> Tensor:
    "Detached headwise scorer input x = [k; v] along the last dim (Eq. 35)."
    check_kv(k, v)
    x = torch.cat([k, v], dim=-1)
    return x.detach() if x.requires_grad else x  # at inference: no detach to run


# %%
k, v = torch.randn(2, 3, 5, 4, requires_grad=True), torch.randn(2, 3, 5, 4)
x = scorer_input(k, v)
test_eq(x.shape, (2, 3, 5, 8)); assert not x.requires_grad
assert_close(x[..., :4], k.detach()); assert_close(x[..., 4:], v)
test_fail(lambda: scorer_input(k, v[..., :3]), contains="same shape")
test_fail(lambda: scorer_input(k.long(), v), contains="floating-point")
for bad in (math.nan, math.inf, -math.inf):  # every entry is checked, by one reduction
    test_fail(lambda: scorer_input(k.index_fill(-2, torch.tensor([0]), bad), v), contains="k contains NaN")
    test_fail(lambda: scorer_input(k, v.index_fill(-1, torch.tensor([0]), bad)), contains="v contains NaN")


# %% [markdown]
# ## Headwise projections
#
# Every KV head has its own weights: a headwise linear map is a stack of $H$ matrices
# $W^{(h)} \in \mathbb{R}^{d_\mathrm{in} \times d_\mathrm{out}}$, applied as one batched matrix product
# $y_{b,h,s,:} = x_{b,h,s,:} W^{(h)} + b^{(h)}$ instead of a loop over heads. Grouped-query
# attention does not enter: the scorer sees KV heads only, so query heads sharing a KV head
# share its score.

# %%
#| export
class HeadwiseLinear(nn.Module):
    "A linear map per KV head: y[..., h, s, :] = x[..., h, s, :] @ weight[h] + bias[h], one matmul for all heads."
    def __init__(self, num_heads: int, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.num_heads = check_int(num_heads, "num_heads", 1)
        self.weight = nn.Parameter(torch.zeros(num_heads, check_int(in_features, "in_features", 1),
                                               check_int(out_features, "out_features", 1)))
        self.bias = nn.Parameter(torch.zeros(num_heads, out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        "x [..., H, S, in] -> [..., H, S, out]."
        if x.dim() < 3 or x.shape[-3] != self.num_heads or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"x must be [..., H={self.num_heads}, S, {self.weight.shape[1]}], got shape "
                             f"{tuple(x.shape)}")
        lead = x.shape[:-3]
        flat = x.dim() > 3 and lead.numel() == 1  # one batch row (a decode step): one bmm over the heads as they lie
        y = torch.bmm(x.view(x.shape[-3:]), self.weight) if flat else x @ self.weight  # else broadcast over lead
        if self.bias is not None: y = y + self.bias[:, None, :]
        return y.view(*lead, *y.shape[-3:]) if flat else y

    def extra_repr(self) -> str:
        H, i, o = self.weight.shape
        return f"num_heads={H}, in_features={i}, out_features={o}, bias={self.bias is not None}"


# %%
hl = HeadwiseLinear(2, 2, 1)
with torch.no_grad(): hl.weight.copy_(torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]]]))
with torch.no_grad(): hl.bias.copy_(torch.tensor([[0.5], [-1.0]]))
test_eq(hl(torch.ones(1, 2, 1, 2)).detach().flatten().tolist(), [1 + 2 + 0.5, 3 + 4 - 1])  # head by head, by hand
test_eq(repr(HeadwiseLinear(3, 8, 5, bias=False)),
        "HeadwiseLinear(num_heads=3, in_features=8, out_features=5, bias=False)")


# %%
#| export
def headwise_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    "`HeadwiseLinear` by a loop over heads with `F.linear` (x [B,H,S,in])."
    out = [F.linear(x[:, h], weight[h].T, None if bias is None else bias[h]) for h in range(weight.shape[0])]
    return torch.stack(out, dim=1)


# %%
lin = HeadwiseLinear(3, 8, 5)
with torch.no_grad(): lin.weight.normal_(); lin.bias.normal_()
x = torch.randn(2, 3, 7, 8)
assert_close(lin(x), headwise_linear_reference(x, lin.weight, lin.bias))
for one in (x[:1], x[0], x[:1, None], x[:1, :, :1]):  # a single row takes the bmm path: the same values, bit for bit
    assert torch.equal(lin(one), one @ lin.weight + lin.bias[:, None, :])
test_eq(lin(x.unsqueeze(1)).shape, (2, 1, 3, 7, 5))
test_fail(lambda: lin(x[:, :, 4]), contains="must be")
test_fail(lambda: HeadwiseLinear(0, 8, 5), contains="num_heads")


# %% [markdown]
# ## Stateless scorers (Eq. 36)
#
# A stateless scorer maps each token independently, $\hat r_{h,t} = f^{(h)}_\theta(\boldsymbol{x}_{h,t})$
# (Eq. (36)): a headwise linear layer $\hat r = \boldsymbol{w}_h^\top \boldsymbol{x} + b_h$, or a
# headwise two-layer MLP with SiLU,
#
# $$\hat r_{h,t} = \boldsymbol{a}_h^\top \operatorname{SiLU}\big(W_1^{(h)\top}\boldsymbol{x}_{h,t} + \boldsymbol{c}_h\big) + b_h .$$
#
# The last layer starts at zero (App. E.5): every token gets the same score at step 0, a
# neutral ranking that the decay alone orders by recency.

# %%
#| export
class LinearScorer(nn.Module):
    "Headwise linear scorer r[b,h,t] = w_h . [k;v] + b_h (Eq. 36), zero-initialized (neutral ranking)."
    def __init__(self, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = check_int(head_dim, "head_dim", 1)
        self.out = HeadwiseLinear(num_kv_heads, 2 * head_dim, 1)

    def forward(self, k: Tensor, v: Tensor) -> Tensor:
        "Raw scores r [B,Hkv,S] from keys and values [B,Hkv,S,d] (inputs detached)."
        check_kv(k, v, self.num_kv_heads, self.head_dim)
        x = scorer_input(k, v).to(self.out.weight.dtype)
        return self.out(x)[..., 0].float()


# %%
torch.manual_seed(0)
k, v = torch.randn(2, 3, 9, 4), torch.randn(2, 3, 9, 4)
lin = LinearScorer(3, 4)
with torch.no_grad(): lin.out.weight.normal_(); lin.out.bias.normal_()
assert_close(lin(k, v), torch.einsum("bhsi,hi->bhs", torch.cat([k, v], -1), lin.out.weight[..., 0]) + lin.out.bias)


# %%
#| export
class MLPScorer(nn.Module):
    "Headwise two-layer SiLU MLP scorer on [k; v] (Eq. 36); the output layer starts at zero (neutral ranking)."
    def __init__(self, num_kv_heads: int, head_dim: int, hidden: int | None = None):
        super().__init__()
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = check_int(head_dim, "head_dim", 1)
        hidden = head_dim if hidden is None else check_int(hidden, "hidden", 1)
        self.hidden = HeadwiseLinear(num_kv_heads, 2 * head_dim, hidden)
        self.out = HeadwiseLinear(num_kv_heads, hidden, 1)
        with torch.no_grad(): self.hidden.weight.normal_(0.0, (2 * head_dim) ** -0.5)

    def forward(self, k: Tensor, v: Tensor) -> Tensor:
        "Raw scores r [B,Hkv,S] from keys and values [B,Hkv,S,d] (inputs detached)."
        check_kv(k, v, self.num_kv_heads, self.head_dim)
        x = scorer_input(k, v).to(self.out.weight.dtype)
        return self.out(F.silu(self.hidden(x)))[..., 0].float()


# %%
torch.manual_seed(0)
mlp = MLPScorer(3, 4, hidden=6)
k, v = torch.randn(2, 3, 9, 4), torch.randn(2, 3, 9, 4)
assert (mlp(k, v) == 0).all()  # zero-initialized output layer: neutral ranking
test_fail(lambda: mlp(k[:, :2], v[:, :2]), contains="num_kv_heads=3")


# %%
#| export
def mlp_scorer_reference(scorer: MLPScorer, k: Tensor, v: Tensor) -> Tensor:
    "`MLPScorer` token by token and head by head with explicit matrix products."
    B, H, S, _ = k.shape
    r = torch.empty(B, H, S)
    W1, c, a, b = scorer.hidden.weight, scorer.hidden.bias, scorer.out.weight[..., 0], scorer.out.bias[:, 0]
    for h in range(H):
        for t in range(S):
            x = torch.cat([k[:, h, t], v[:, h, t]], -1)
            r[:, h, t] = F.silu(x @ W1[h] + c[h]) @ a[h] + b[h]
    return r


# %%
with torch.no_grad(): mlp.out.weight.normal_(); mlp.out.bias.normal_()
assert_close(mlp(k, v), mlp_scorer_reference(mlp, k, v))


# %% [markdown]
# ## mLSTM scorer: features and gates (Eq. 37, 40, App. A)
#
# Each KV head projects $\boldsymbol{x}_{h,t}$ with small headwise matrices
# $W_{q/k/v}^{(h)} \in \mathbb{R}^{2d\times d/2}$ and applies the Hedgehog feature map to the
# query and key projections (Eq. (37), App. A):
#
# $$\tilde{\boldsymbol{q}}_{h,t} = \phi(W_q^{(h)\top}\boldsymbol{x}_{h,t}),\quad
# \tilde{\boldsymbol{k}}_{h,t} = \phi(W_k^{(h)\top}\boldsymbol{x}_{h,t}),\quad
# \tilde{\boldsymbol{v}}_{h,t} = W_v^{(h)\top}\boldsymbol{x}_{h,t},\qquad
# \phi(\boldsymbol{y}) = [\operatorname{softmax}(\boldsymbol{y}); \operatorname{softmax}(-\boldsymbol{y})] \in \mathbb{R}^{d}.$$
#
# Softmax is computed in its stabilized form $e^{y_j - \max y}/\sum_l e^{y_l - \max y}$, so the
# features are positive and each half sums to one. The scalar gates come from headwise
# projections of the same input, $\alpha^{(i)}, \alpha^{(f)}$, optionally soft-capped,
# $\alpha \mapsto c \tanh(\alpha / c)$, and enter as $i = \exp(\alpha^{(i)})$,
# $f = \sigma(\alpha^{(f)})$ (Eq. (40)); there is no output gate. Everything below works with
# $\log i = \alpha^{(i)}$ and $\log f = \log\sigma(\alpha^{(f)})$.

# %%
#| export
def hedgehog(y: Tensor) -> Tensor:
    "Hedgehog feature map [softmax(y); softmax(-y)] over the last dim (App. A): d/2 -> d positive features."
    return torch.cat([torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)], dim=-1)


# %%
y = torch.randn(4, 6, dtype=torch.float64) * 30  # large inputs: the stabilized softmax must not overflow
phi = hedgehog(y)
e_pos, e_neg = torch.exp(y - y.max(-1, keepdim=True).values), torch.exp(-y - (-y).max(-1, keepdim=True).values)
assert_close(phi, torch.cat([e_pos / e_pos.sum(-1, keepdim=True), e_neg / e_neg.sum(-1, keepdim=True)], -1))
assert (phi >= 0).all() and torch.isfinite(phi).all()
assert_close(phi.sum(-1), torch.full((4,), 2.0, dtype=torch.float64))


# %%
#| export
def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    "Soft-capping cap * tanh(x / cap) of gate pre-activations; identity for cap=None."
    return x if cap is None else cap * torch.tanh(x / cap)


# %%
assert_close(soft_cap(torch.tensor([0.1, 100.0]), 15.0),
             torch.tensor([15 * math.tanh(0.1 / 15), 15 * math.tanh(100 / 15)]))

# %% [markdown]
# ## The recurrence, unstabilized (Eq. 38–39) and stabilized
#
# The state of head $h$ after token $t$ is a matrix memory and a normalizer (Eq. (38)–(39)),
#
# $$\boldsymbol{C}_t = f_t \boldsymbol{C}_{t-1} + i_t\, \tilde{\boldsymbol{k}}_t \tilde{\boldsymbol{v}}_t^\top,\qquad
# \boldsymbol{z}_t = f_t \boldsymbol{z}_{t-1} + i_t\, \tilde{\boldsymbol{k}}_t,\qquad \boldsymbol{C}_{-1} = 0,\ \boldsymbol{z}_{-1} = 0 .$$
#
# $i_t = e^{\alpha^{(i)}_t}$ overflows for large pre-activations, so the stabilized mLSTM carries
# a log-scale $m_t$ and stores $\bar{\boldsymbol{C}}_t = e^{-m_t}\boldsymbol{C}_t$,
# $\bar{\boldsymbol{z}}_t = e^{-m_t}\boldsymbol{z}_t$. Substituting into the update,
#
# $$\bar{\boldsymbol{C}}_t = e^{\log f_t + m_{t-1} - m_t}\,\bar{\boldsymbol{C}}_{t-1} + e^{\log i_t - m_t}\,\tilde{\boldsymbol{k}}_t\tilde{\boldsymbol{v}}_t^\top,
# \qquad m_t = \max(\log f_t + m_{t-1},\ \log i_t),\qquad m_{-1} = -\infty,$$
#
# and the same for $\bar{\boldsymbol{z}}_t$: both factors are $\le 1$, so nothing overflows. With
# $m_{-1} = -\infty$ the max-state unrolls to $m_t = \max_{s \le t}\big(\log i_s + \sum_{r=s+1}^{t}\log f_r\big)$,
# the largest log-weight of any token in the state; the parallel form below uses this
# row maximum, so both forms carry the same $m_t$.
#
# **Readout.** Eq. (10)/(41) reads $\boldsymbol{h} = \tilde{\boldsymbol{q}}^\top\boldsymbol{C}/\tilde{\boldsymbol{q}}^\top\boldsymbol{z}$.
# The factor $e^{-m_t}$ cancels in this ratio, so
# $\boldsymbol{h} = \tilde{\boldsymbol{q}}^\top\bar{\boldsymbol{C}}_t / (\tilde{\boldsymbol{q}}^\top\bar{\boldsymbol{z}}_t + \epsilon)$.
# Hedgehog features are positive, so the denominator is positive: at least one token in the
# state has weight $e^{0} = 1$ after stabilization. The xLSTM implementation instead bounds the
# denominator below, $\max(|\tilde{\boldsymbol{q}}^\top\boldsymbol{z}|, 1)$, i.e.
# $\max(|\tilde{\boldsymbol{q}}^\top\bar{\boldsymbol{z}}|, e^{-m_t})$ in stabilized terms, with the query scaled by
# $d^{-1/2}$; we offer it as `normalizer="mlstm"` (used below to compare with `mlstm_kernels`),
# and use the paper's ratio (`normalizer="ratio"`) by default: with the $d^{-1/2}$-scaled
# positive features $\tilde{\boldsymbol{q}}^\top\boldsymbol{z}$ is typically below one, and the
# lower bound would then replace the normalized readout by an unnormalized sum.

# %%
#| export
NORMALIZERS = ("ratio", "mlstm")

def check_normalizer(normalizer: str) -> str:
    "Validate the readout normalizer name."
    if normalizer not in NORMALIZERS: raise ValueError(f"normalizer must be one of {NORMALIZERS}, got {normalizer!r}")
    return normalizer


# %%
test_eq([check_normalizer(n) for n in ("ratio", "mlstm")], ["ratio", "mlstm"])
test_fail(lambda: check_normalizer("xlstm"), contains="normalizer must be one of ('ratio', 'mlstm')")


# %%
#| export
class MLSTMState(NamedTuple):
    "Stabilized mLSTM state per head: C = e^-m C_raw [B,H,dk,dv], n = e^-m z_raw [B,H,dk], m [B,H] (float32)."
    C: Tensor
    n: Tensor
    m: Tensor


# %%
test_eq(MLSTMState._fields, ("C", "n", "m"))
test_eq(MLSTMState(*"abc").n, "b")


# %%
#| export
def mlstm_init_state(B: int, H: int, dk: int, dv: int, device=None, dtype=torch.float32) -> MLSTMState:
    "Empty state: C = 0, n = 0, m = -inf (no token yet)."
    return MLSTMState(torch.zeros(B, H, dk, dv, device=device, dtype=dtype),
                      torch.zeros(B, H, dk, device=device, dtype=dtype),
                      torch.full((B, H), -math.inf, device=device, dtype=dtype))


# %%
st = mlstm_init_state(2, 3, 4, 5, dtype=torch.float64)
test_eq([tuple(x.shape) for x in st], [(2, 3, 4, 5), (2, 3, 4), (2, 3)])
test_eq((st.C.abs().sum().item(), st.n.abs().sum().item()), (0, 0))  # empty
test_eq((st.m.max().item(), st.m.dtype), (-math.inf, torch.float64))  # no token yet


# %% [markdown]
# One step from the empty state by hand: $m_0 = \max(\log f - \infty, \log i) = \log i$, the old state
# decays by $e^{-\infty} = 0$ and the write gets $e^{\log i - m_0} = 1$, so $\bar C = \tilde k \tilde v^\top$,
# $\bar n = \tilde k$. A second step with $\log i = \log f + m_0$ weighs the old state and the new write
# alike (both factors are 1) and sets $m_1 = \log i$.

# %%
#| export
def mlstm_step(state: MLSTMState, k: Tensor, v: Tensor, log_i: Tensor, log_f: Tensor) -> MLSTMState:
    "One stabilized mLSTM update with key feature k [B,H,dk], value v [B,H,dv], log-gates [B,H] (Eq. 38-39)."
    kept = log_f + state.m  # the log weight of the old state
    m = torch.maximum(kept, log_i)
    decay, write = torch.exp(kept - m), torch.exp(log_i - m)
    wk = write[..., None] * k  # the new key, weighted: C gains wk v^T, n gains wk
    C = torch.addcmul(decay[..., None, None] * state.C, wk[..., :, None], v[..., None, :])
    return MLSTMState(C, torch.addcmul(wk, decay[..., None], state.n), m)


# %%
k1, v1 = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[3.0, 4.0, 5.0]]])
st = mlstm_step(mlstm_init_state(1, 1, 2, 3), k1, v1, torch.tensor([[0.7]]), torch.tensor([[-0.2]]))
test_eq(st.C, torch.tensor([[[[3.0, 4, 5], [6, 8, 10]]]])); test_eq(st.n, k1); test_eq(st.m, torch.tensor([[0.7]]))
st2 = mlstm_step(st, k1, v1, torch.tensor([[0.5]]), torch.tensor([[-0.2]]))  # log i = log f + m: weights 1 and 1
assert_close(st2.C, 2 * st.C); assert_close(st2.n, 2 * st.n); assert_close(st2.m, torch.tensor([[0.5]]))


# %% [markdown]
# The readout by hand: with $\tilde q = (4, 0, 0, 0)$ ($d^{-1/2}\tilde q = (2, 0, 0, 0)$), the first row of
# $\bar C$ is $(0, 1)$ and $\bar n = 0.1$: the ratio gives $(0, 2) / 0.2 = (0, 10)$, the `"mlstm"` normalizer
# $(0, 2) / \max(0.2, e^{-m}) = (0, 2)$ at $m = 0$; several queries at once, $[B,H,n,d_k]$, read alike.

# %%
#| export
def mlstm_readout(state: MLSTMState, q: Tensor, normalizer: str = "ratio", eps: float = 1e-6) -> Tensor:
    "Readout h = q C / (q z) of a stabilized state for features q [B,H,dk] or [B,H,n,dk] (Eq. 41): [B,H,(n,)dv]."
    one = q.dim() == 3
    q = (q[:, :, None] if one else q) * q.shape[-1] ** -0.5
    (B, H, n, dk), dv = q.shape, state.C.shape[-1]
    flat = q.reshape(B * H, n, dk)  # one batched product per state matrix over the heads: [B,H,n,dv], [B,H,n,1]
    num = torch.bmm(flat, state.C.reshape(B * H, dk, dv)).view(B, H, n, dv)
    qn = torch.bmm(flat, state.n.reshape(B * H, dk, 1)).view(B, H, n, 1)
    den = (qn.abs() if check_normalizer(normalizer) == "ratio"
           else torch.maximum(qn.abs(), torch.exp(-state.m)[..., None, None]))
    h = num / (den + eps)
    return h[:, :, 0] if one else h


# %%
st = MLSTMState(torch.arange(8.0).view(1, 1, 4, 2), torch.full((1, 1, 4), 0.1), torch.zeros(1, 1))
q4 = torch.tensor([[[4.0, 0, 0, 0]]])
assert_close(mlstm_readout(st, q4, "ratio", eps=0.0), torch.tensor([[[0.0, 10.0]]]))
assert_close(mlstm_readout(st, q4, "mlstm", eps=0.0), torch.tensor([[[0.0, 2.0]]]))
assert_close(mlstm_readout(st, torch.stack([q4, 2 * q4], 2), eps=0.0), torch.tensor([[[[0.0, 10.0], [0.0, 10.0]]]]))


# %% [markdown]
# Check: in float64 on small inputs (pre-activations small enough that $e^{\alpha}$ is exact),
# stepping the stabilized state and reading it out equals the unstabilized recurrence, for
# both normalizers; the state itself equals $e^{-m_t}$ times the raw state.

# %%
#| export
def mlstm_unstabilized_reference(q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, log_f: Tensor, delay: int = 0,
                                 normalizer: str = "ratio") -> Tensor:
    "Delayed readouts h[u] = q_u C_t / (q_u z_t), t = min(u+delay, S-1), by loops with raw exp gates (no eps)."
    B, H, S, dk = q.shape
    C, z = torch.zeros(B, H, dk, v.shape[-1], dtype=q.dtype), torch.zeros(B, H, dk, dtype=q.dtype)
    states = []
    for t in range(S):
        f, i = torch.exp(log_f[..., t]), torch.exp(log_i[..., t])
        C = f[..., None, None] * C + i[..., None, None] * torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
        z = f[..., None] * z + i[..., None] * k[:, :, t]
        states.append((C, z))
    h = torch.empty(B, H, S, v.shape[-1], dtype=q.dtype)
    for u in range(S):
        C, z = states[min(u + delay, S - 1)]
        qu = q[:, :, u] * dk ** -0.5
        qz = (qu * z).sum(-1, keepdim=True).abs()
        den = qz if normalizer == "ratio" else torch.clamp(qz, min=1.0)
        h[:, :, u] = torch.einsum("bhk,bhkv->bhv", qu, C) / den
    return h


# %%
torch.manual_seed(0)
B, H, S, dk, dv = 2, 3, 12, 6, 3
q = hedgehog(torch.randn(B, H, S, dk // 2, dtype=torch.float64))
kf = hedgehog(torch.randn(B, H, S, dk // 2, dtype=torch.float64))
vf = torch.randn(B, H, S, dv, dtype=torch.float64)
log_i, log_f = torch.randn(B, H, S, dtype=torch.float64), F.logsigmoid(torch.randn(B, H, S, dtype=torch.float64) + 2)
for normalizer in NORMALIZERS:
    st = mlstm_init_state(B, H, dk, dv, dtype=torch.float64)
    h = []
    for t in range(S):
        st = mlstm_step(st, kf[:, :, t], vf[:, :, t], log_i[..., t], log_f[..., t])
        h.append(mlstm_readout(st, q[:, :, t], normalizer, eps=0.0))
    assert_close(torch.stack(h, 2), mlstm_unstabilized_reference(q, kf, vf, log_i, log_f, 0, normalizer))
raw_C = sum(torch.exp(log_i[..., s] + log_f[..., s + 1:].sum(-1))[..., None, None]
            * kf[:, :, s, :, None] * vf[:, :, s, None, :] for s in range(S))
assert_close(st.C * torch.exp(st.m)[..., None, None], raw_C)

# %% [markdown]
# Check against an independent implementation: `mlstm_kernels`' pure-PyTorch recurrent step
# (`mlstm_kernels.torch.recurrent.native_step`) carries the same stabilized state
# $(\bar{\boldsymbol{C}}, \bar{\boldsymbol{n}}, m)$; it takes the forget gate as a pre-activation
# and its readout is the `"mlstm"` normalizer. Started from $m = -\infty$ it must match ours
# step by step, in float32 and with large input-gate pre-activations where $e^{\alpha}$ alone
# would overflow.

# %%
torch.manual_seed(1)
B, H, S, dk, dv = 2, 3, 20, 8, 4
q, kf = hedgehog(torch.randn(B, H, S, dk // 2)), hedgehog(torch.randn(B, H, S, dk // 2))
vf, i_pre, f_pre = torch.randn(B, H, S, dv), 60 * torch.randn(B, H, S), 3 * torch.randn(B, H, S)
ours, theirs = mlstm_init_state(B, H, dk, dv), mlstm_init_state(B, H, dk, dv)
theirs = (theirs.C, theirs.n, theirs.m[..., None])
for t in range(S):
    ours = mlstm_step(ours, kf[:, :, t], vf[:, :, t], i_pre[..., t], F.logsigmoid(f_pre[..., t]))
    h_theirs, theirs = mlstm_recurrent_step__native_fw(*theirs, q[:, :, t], kf[:, :, t], vf[:, :, t],
                                                       i_pre[..., t, None], f_pre[..., t, None])
    assert_close(mlstm_readout(ours, q[:, :, t], "mlstm"), h_theirs)
    for a, b in zip(ours, (theirs[0], theirs[1], theirs[2][..., 0])): assert_close(a, b)
assert torch.isfinite(ours.C).all()


# %% [markdown]
# ## Delayed readout (Eq. 41) and its parallel form
#
# A token $u$ needs a score only when it leaves the protected window of $w$ tokens, at query
# $q = u + w$. By then the state has absorbed the $w$ tokens after $u$, and the delayed
# readout uses the query feature of $u$ with the state after token $u + w$ (Eq. (41)):
#
# $$\boldsymbol{h}_{u\mid u+w} = \frac{\tilde{\boldsymbol{q}}_u^\top\boldsymbol{C}_{u+w}}{\tilde{\boldsymbol{q}}_u^\top\boldsymbol{z}_{u+w}},
# \qquad \hat r_u = \boldsymbol{a}_h^\top\operatorname{SiLU}(\operatorname{Norm}(\boldsymbol{h}_{u\mid u+w})) + b_h \quad \text{(Eq. (42))}.$$
#
# `delay = 0` is the immediate readout (the ablation of Figure 5). In a sequence of length $S$
# the last $w$ tokens have no state $u + w$ yet; they read the last state $t(u) = \min(u+w, S-1)$.
# During training these scores never matter (a token $u > S-1-w$ is inside the window for every
# query $\le S-1$); at decode time the bounded cache scores them again when they leave the window.
#
# **Parallel form.** Unrolling Eq. (38), with $F_t = \sum_{r \le t}\log f_r$,
#
# $$\boldsymbol{C}_t = \sum_{s \le t} e^{F_t - F_s + \log i_s}\,\tilde{\boldsymbol{k}}_s\tilde{\boldsymbol{v}}_s^\top,
# \qquad \tilde{\boldsymbol{q}}_u^\top\boldsymbol{C}_{t(u)} = \sum_{s \le t(u)} e^{D_{us}}\,(\tilde{\boldsymbol{q}}_u^\top\tilde{\boldsymbol{k}}_s)\,\tilde{\boldsymbol{v}}_s^\top,
# \qquad D_{us} = F_{t(u)} - F_s + \log i_s ,$$
#
# and the same with $\tilde{\boldsymbol{v}}_s \to 1$ for the normalizer. Row $u$ is stabilized by
# its maximum $m_{t(u)} = \max_{s \le t(u)} D_{us}$ (the recurrent max-state), giving
# $\boldsymbol{h}_u = \sum_s e^{D_{us} - m}\,S_{us}\tilde{\boldsymbol{v}}_s / (|\sum_s e^{D_{us}-m} S_{us}| + \epsilon)$
# with $S_{us} = \tilde{\boldsymbol{q}}_u^\top\tilde{\boldsymbol{k}}_s/\sqrt{d}$: a masked $S\times S$ product,
# quadratic in $S$ (fine for a few thousand tokens), with the mask shifted by the delay.

# %%
#| export
def readout_positions(S: int, delay: int, device=None) -> Tensor:
    "Index of the state each token reads: t(u) = min(u + delay, S - 1) (Eq. 41; the last tokens read the last state)."
    return torch.clamp(torch.arange(S, device=device) + check_int(delay, "delay"), max=S - 1)


# %%
test_eq(readout_positions(5, 2).tolist(), [2, 3, 4, 4, 4])


# %%
#| export
def mlstm_parallel(q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, log_f: Tensor, delay: int = 0,
                   normalizer: str = "ratio", eps: float = 1e-6) -> Tensor:
    "Delayed mLSTM readouts h[u] of state min(u+delay, S-1): a masked quadratic form, stabilized per row, [B,H,S,dv]."
    S, dk = q.shape[-2], q.shape[-1]
    t_of_u = readout_positions(S, delay, q.device)
    cum_f = torch.cumsum(log_f, dim=-1)
    log_D = cum_f[..., t_of_u, None] - cum_f[..., None, :] + log_i[..., None, :]  # [B,H,S(u),S(s)]
    log_D = log_D.masked_fill(torch.arange(S, device=q.device) > t_of_u[:, None], -math.inf)
    m = log_D.amax(-1, keepdim=True)  # = recurrent max-state m_{t(u)}
    W = torch.exp(log_D - m) * (q @ k.transpose(-1, -2)) * dk ** -0.5
    qn = W.sum(-1, keepdim=True)
    den = qn.abs() if check_normalizer(normalizer) == "ratio" else torch.maximum(qn.abs(), torch.exp(-m))
    return (W @ v) / (den + eps)


# %%
torch.manual_seed(2)
B, H, S, dk, dv = 2, 3, 15, 6, 3
q = hedgehog(torch.randn(B, H, S, dk // 2, dtype=torch.float64))
kf = hedgehog(torch.randn(B, H, S, dk // 2, dtype=torch.float64))
vf = torch.randn(B, H, S, dv, dtype=torch.float64)
log_i, log_f = torch.randn(B, H, S, dtype=torch.float64), F.logsigmoid(torch.randn(B, H, S, dtype=torch.float64) + 2)
for delay in (0, 1, 4, 14, 20):
    for normalizer in NORMALIZERS:
        ref = mlstm_unstabilized_reference(q, kf, vf, log_i, log_f, delay, normalizer)
        assert_close(mlstm_parallel(q, kf, vf, log_i, log_f, delay, normalizer, eps=0.0), ref)

torch.manual_seed(3)
q3, k3 = hedgehog(torch.randn(B, H, 64, 8)), hedgehog(torch.randn(B, H, 64, 8))
v3, i_pre, f_pre = torch.randn(B, H, 64, 5), 30 * torch.randn(B, H, 64), 3 * torch.randn(B, H, 64)
h_theirs, _, _ = mlstm_parallel_fw(q3, k3, v3, i_pre, f_pre)
assert_close(mlstm_parallel(q3, k3, v3, i_pre, F.logsigmoid(f_pre), 0, "mlstm"), h_theirs)


# %% [markdown]
# Checks: parallel = recurrent = the unstabilized float64 reference, for several delays
# (including a delay longer than the sequence), and the immediate readout matches
# `mlstm_kernels`' parallel native forward (`mlstm_kernels.torch.parallel.native.fw`), which uses
# the `"mlstm"` normalizer.

# %%
#| export
def mlstm_recurrent(q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, log_f: Tensor, delay: int = 0,
                    normalizer: str = "ratio", eps: float = 1e-6) -> Tensor:
    "`mlstm_parallel` by stepping the state token by token and reading token u = t - delay after step t (decode order)."
    B, H, S, dk = q.shape
    state = mlstm_init_state(B, H, dk, v.shape[-1], q.device, q.dtype)
    h = torch.empty(B, H, S, v.shape[-1], device=q.device, dtype=q.dtype)
    for t in range(S):
        state = mlstm_step(state, k[:, :, t], v[:, :, t], log_i[..., t], log_f[..., t])
        if t >= delay: h[:, :, t - delay] = mlstm_readout(state, q[:, :, t - delay], normalizer, eps)
    for u in range(max(S - delay, 0), S):  # tokens still inside the window read the last state
        h[:, :, u] = mlstm_readout(state, q[:, :, u], normalizer, eps)
    return h


# %%
for delay in (0, 1, 4, 14, 20):
    for normalizer in NORMALIZERS:
        ref = mlstm_unstabilized_reference(q, kf, vf, log_i, log_f, delay, normalizer)
        assert_close(mlstm_recurrent(q, kf, vf, log_i, log_f, delay, normalizer, eps=0.0), ref)


# %% [markdown]
# ## Chunkwise form for long sequences
#
# The quadratic form needs $S \times S$ matrices per head: 1 GiB per head in float32 at
# $S = 16384$. Two observations give a form with memory linear in $S$.
#
# *Delay is a shift of the query.* The readout after step $t$ uses the query of token
# $t - w$, so the delayed readouts are the immediate readouts of the shifted query sequence
# $\tilde{\boldsymbol{q}}'_t = \tilde{\boldsymbol{q}}_{t-w}$ (zero for $t < w$), moved back by $w$:
# $\boldsymbol{h}_{u \mid u+w} = \boldsymbol{h}'_{u+w}$; the last $w$ tokens read the final state.
#
# *Chunkwise immediate readout.* Split the sequence into chunks of $L$ tokens and let
# $b_t = \sum_{r \in \text{chunk},\, r \le t}\log f_r$ be the cumulative log-forget-gate inside
# token $t$'s chunk. With $(\bar{\boldsymbol{C}}^-, \bar{\boldsymbol{n}}^-, m^-)$ the stabilized state
# entering the chunk, unrolling Eq. (38) inside the chunk gives
#
# $$\boldsymbol{C}_t = e^{b_t + m^-}\bar{\boldsymbol{C}}^- + \sum_{s \le t,\ s \in \text{chunk}} e^{b_t - b_s + \log i_s}\,\tilde{\boldsymbol{k}}_s\tilde{\boldsymbol{v}}_s^\top,$$
#
# so with $m_t = \max(b_t + m^-, \max_s (b_t - b_s + \log i_s))$ the readout of row $t$ is an
# intra-chunk $L \times L$ masked product plus the inter-chunk term
# $e^{b_t + m^- - m_t}\,\tilde{\boldsymbol{q}}_t^\top\bar{\boldsymbol{C}}^-$ (same for the normalizer).
# Sequences are padded to a multiple of $L$ with tokens that neither write ($\log i = -\infty$)
# nor decay ($\log f = 0$), which leaves the state unchanged.
#
# *The states at chunk boundaries, all at once.* The same unrolling at $t$ = the last token of chunk
# $j$ gives the state after it. With $F_j$ the chunk's total log-forget, $g_{js} = F_j - b_{js} + \log i_{js}$
# the log-weight of its token $s$ in that state and $a_j = \max_s g_{js}$, the chunk's own writes are
# $e^{a_j}\Delta\boldsymbol{C}_j$ with $\Delta\boldsymbol{C}_j = \sum_s e^{g_{js} - a_j}\tilde{\boldsymbol{k}}_s
# \tilde{\boldsymbol{v}}_s^\top$ (one batched product for all chunks). Between chunk $j'$ and the end of chunk
# $j \ge j'$ they decay by $F_{j'+1} + \dots + F_j = \Phi_j - \Phi_{j'}$, $\Phi_j = \sum_{i \le j} F_i$, so
#
# $$W_{jj'} = \Phi_j - \Phi_{j'} + a_{j'},\qquad m_j = \max_{j' \le j} W_{jj'},\qquad
# \bar{\boldsymbol{C}}_j = \sum_{j' \le j} e^{W_{jj'} - m_j}\,\Delta\boldsymbol{C}_{j'}$$
#
# (and $\bar{\boldsymbol{n}}_j$ alike): an $N \times N$ lower-triangular matrix times the stacked chunk
# writes, no loop over chunks. A sequence that continues a state $(\bar{\boldsymbol{C}}_0, \bar{\boldsymbol{n}}_0,
# m_0)$ (a prefill chunk after earlier ones, in the cache) adds one column: that state is $e^{m_0}\bar{\boldsymbol{C}}_0$
# unstabilized and decays by $\Phi_j$ up to the end of chunk $j$, so $W_{j,0} = \Phi_j + m_0$ with
# $\bar{\boldsymbol{C}}_0$ as its write; it is also the state entering the first chunk. Unrolling the recurrence $m_j = \max(F_j + m_{j-1}, a_j)$ from the empty
# state's $m = -\infty$ gives the same stabilizer $m_j$, so the states equal the recurrent ones. The small
# matrix is computed in float64: over many chunks the differences $\Phi_j - \Phi_{j'}$ of float32 sums lose
# precision (at $S = 2048$ and $L = 1$ the readouts drifted to $4 \cdot 10^{-5}$ from the float64 reference,
# against $10^{-6}$ for a loop over chunks).
#
# The chunk length trades the $L \times L$ intra-chunk work, $O(SLd)$, against the per-chunk states,
# $O(Nd^2)$ with $N = S/L$. The default $L = 64$ was chosen with the benchmark after the scorer module
# below, which times a training step (forward and backward) at $S = 2048$ per chunk length and prints its
# own run: larger chunks, such as 256, leave the cache with their $L \times L$ intra-chunk tensors, and the
# form above has no loop over chunks (a loop of $N$ state updates, each a handful of small operations and
# their backward).
#
# The states entering each of 6 chunks of 7 tokens are the recurrent states after 0, 7, ..., 35 tokens,
# and the final state the one after 42, with large input-gate pre-activations:

# %%
#| export
def chunk_states(k: Tensor, v: Tensor, b: Tensor, log_i: Tensor, initial: MLSTMState | None = None
                 ) -> tuple[tuple[Tensor, Tensor, Tensor], MLSTMState]:
    """The stabilized states entering each chunk, (C [B,H,N,dk,dv], n [B,H,N,dk], m [B,H,N]), and the final state, of
    chunked k [B,H,N,L,dk], v [B,H,N,L,dv], in-chunk cumulative log-forget b and log-input gates [B,H,N,L], starting
    from the state `initial` (None: the empty state)."""
    B, H, N, L, dk = k.shape
    F_j = b[..., -1]                                                   # each chunk's total log-forget
    g = F_j[..., None] - b + log_i                                     # log-weight of token s in its chunk's end state
    a = g.amax(-1)
    kw = k * torch.exp(g - a[..., None])[..., None]
    dC, dn = kw.transpose(-1, -2) @ v, kw.sum(-2)                      # each chunk's own writes, scaled by e^-a_j
    # N x N in float64: differences of cumulative sums over many chunks lose float32 precision
    Phi = torch.cumsum(F_j.double(), -1)
    W = (Phi[..., :, None] - Phi[..., None, :] + a.double()[..., None, :]).masked_fill(
        torch.ones(N, N, dtype=torch.bool, device=k.device).triu(1), -math.inf)  # chunk j' in the state after chunk j
    if initial is not None:  # one more column: the initial state, e^m0 of it decayed by every chunk up to j
        W = torch.cat([Phi[..., None] + initial.m.double()[..., None, None], W], -1)
        dC, dn = torch.cat([initial.C[:, :, None], dC], 2), torch.cat([initial.n[:, :, None], dn], 2)
    m = W.amax(-1)
    E = torch.exp(W - m[..., None]).to(k.dtype)
    C, n, m = (E @ dC.flatten(-2)).view(B, H, N, dk, -1), E @ dn, m.to(k.dtype)
    first = mlstm_init_state(B, H, dk, v.shape[-1], k.device, k.dtype) if initial is None else initial
    entering = tuple(torch.cat([e[:, :, None], x[:, :, :-1]], 2) for e, x in zip(first, (C, n, m)))
    return entering, MLSTMState(C[:, :, -1], n[:, :, -1], m[..., -1])


# %%
torch.manual_seed(5)
B, H, S, dk, dv = 2, 3, 45, 8, 4
q, kf = hedgehog(torch.randn(B, H, S, dk // 2)), hedgehog(torch.randn(B, H, S, dk // 2))
vf, log_i, log_f = torch.randn(B, H, S, dv), 20 * torch.randn(B, H, S), F.logsigmoid(2 * torch.randn(B, H, S) + 2)
chunked = lambda x: x[:, :, :42].reshape(B, H, 6, 7, *x.shape[3:])
entering, last = chunk_states(chunked(kf), chunked(vf), chunked(log_f).cumsum(-1), chunked(log_i))
state = mlstm_init_state(B, H, dk, dv)
for t in range(42):
    if t % 7 == 0:
        for a, b in zip(entering, state): assert_close(a[:, :, t // 7], b, rtol=1e-4, atol=1e-5)
    state = mlstm_step(state, kf[:, :, t], vf[:, :, t], log_i[..., t], log_f[..., t])
for a, b in zip(last, state): assert_close(a, b, rtol=1e-4, atol=1e-5)


# %%
#| export
def mlstm_chunkwise_immediate(q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, log_f: Tensor, normalizer: str = "ratio",
                              eps: float = 1e-6, chunk_size: int = 64, initial: MLSTMState | None = None
                              ) -> tuple[Tensor, MLSTMState]:
    """Immediate readouts h[t] from state t ([B,H,S,dv]) by the chunkwise form, and the final state; the tokens
    continue the state `initial` (None: they start the sequence)."""
    B, H, S, dk = q.shape
    dv, L = v.shape[-1], check_int(chunk_size, "chunk_size", 1)
    N, pad = -(-S // L), -S % L
    q, k, v = (F.pad(t, (0, 0, 0, pad)).reshape(B, H, N, L, -1) for t in (q, k, v))
    log_i = F.pad(log_i, (0, pad), value=-math.inf).reshape(B, H, N, L)  # padding writes nothing ...
    b = torch.cumsum(F.pad(log_f, (0, pad)).reshape(B, H, N, L), dim=-1)  # ... and does not decay
    (C_in, n_in, m_in), state = chunk_states(k, v, b, log_i, initial)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    log_D = (b[..., :, None] - b[..., None, :] + log_i[..., None, :]).masked_fill(~causal, -math.inf)
    log_prev = b + m_in[..., None]  # log-scale of the entering state at row t
    m = torch.maximum(log_prev, log_D.amax(-1))
    qs = q * dk ** -0.5
    W = torch.exp(log_D - m[..., None]) * (qs @ k.transpose(-1, -2))
    prev = torch.exp(log_prev - m)[..., None]
    num = W @ v + prev * (qs @ C_in)
    qn = W.sum(-1, keepdim=True) + prev * (qs @ n_in[..., None])
    den = qn.abs() if check_normalizer(normalizer) == "ratio" else torch.maximum(qn.abs(), torch.exp(-m)[..., None])
    return (num / (den + eps)).reshape(B, H, N * L, dv)[:, :, :S], state


# %%
_, final = mlstm_chunkwise_immediate(q, kf, vf, log_i, log_f, chunk_size=7)
state = mlstm_init_state(B, H, dk, dv)
for t in range(S): state = mlstm_step(state, kf[:, :, t], vf[:, :, t], log_i[..., t], log_f[..., t])
for a, b in zip(final, state): assert_close(a, b)
# continuing a state: rows t0.. and the final state as if the sequence had been read whole, for splits inside the
# first chunk, on a chunk boundary and in the last chunk; from the empty state, as without one
whole, whole_final = mlstm_chunkwise_immediate(q, kf, vf, log_i, log_f, chunk_size=7)
for t0 in (1, 14, 40):
    state = mlstm_init_state(B, H, dk, dv)
    for t in range(t0): state = mlstm_step(state, kf[:, :, t], vf[:, :, t], log_i[..., t], log_f[..., t])
    for chunk_size in (1, 7, 64):
        h, final = mlstm_chunkwise_immediate(*(x[:, :, t0:] for x in (q, kf, vf, log_i, log_f)), chunk_size=chunk_size,
                                             initial=state)
        assert_close(h, whole[:, :, t0:], rtol=1e-4, atol=1e-5)
        for a, b in zip(final, whole_final): assert_close(a, b)
assert_close(mlstm_chunkwise_immediate(q, kf, vf, log_i, log_f, chunk_size=7, initial=mlstm_init_state(B, H, dk, dv)),
             (whole, whole_final))


# %% [markdown]
# Check: the chunkwise form equals the quadratic form for chunk sizes that do and do not
# divide $S$, a single chunk, chunks of one token, and delays shorter and longer than a chunk
# or the sequence; the final state equals the recurrent one.

# %%
#| export
def mlstm_chunkwise(q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, log_f: Tensor, delay: int = 0,
                    normalizer: str = "ratio", eps: float = 1e-6, chunk_size: int = 64) -> Tensor:
    "`mlstm_parallel` with memory linear in S: immediate chunkwise readout of the query shifted by `delay`, [B,H,S,dv]."
    S, w = q.shape[-2], min(check_int(delay, "delay"), q.shape[-2])
    q_read = torch.cat([torch.zeros_like(q[:, :, :w]), q[:, :, :S - w]], dim=2)  # step t reads token t - w
    h, final = mlstm_chunkwise_immediate(q_read, k, v, log_i, log_f, normalizer, eps, chunk_size)
    return torch.cat([h[:, :, w:], mlstm_readout(final, q[:, :, S - w:], normalizer, eps)], dim=2)


# %%
for chunk_size in (1, 7, 16, 45, 64):
    for delay in (0, 3, 20, 44, 60):
        for normalizer in NORMALIZERS:
            assert_close(mlstm_chunkwise(q, kf, vf, log_i, log_f, delay, normalizer, chunk_size=chunk_size),
                         mlstm_parallel(q, kf, vf, log_i, log_f, delay, normalizer), rtol=1e-4, atol=1e-5)
# many chunks (1,024 of one token): the float64 chunk matrix keeps the readouts at float32 accuracy
g = torch.Generator().manual_seed(6)
q1, k1 = (hedgehog(torch.randn(1, 2, 1024, 8, generator=g)) for _ in range(2))
v1, i1, f1 = torch.randn(1, 2, 1024, 8, generator=g), torch.randn(1, 2, 1024, generator=g), F.logsigmoid(
    2 * torch.randn(1, 2, 1024, generator=g) + 2)
want = mlstm_parallel(*(t.double() for t in (q1, k1, v1, i1, f1)), delay=5)
assert (mlstm_chunkwise(q1, k1, v1, i1, f1, 5, chunk_size=1).double() - want).abs().max() < 4e-6  # float32 sums: 1.5e-5


# %% [markdown]
# ## The scorer module (Eq. 37, 40–42) and its initialization (App. E.5)
#
# `MLSTMScorer` wires it together per KV head: projections $2d \to d/2$, Hedgehog features
# ($d/2 \to d$) for query and key, a $d/2$-dimensional value, two gate pre-activations from a
# headwise $2d \to 2$ map (soft-capped), the delayed readout, an optional parameter-free
# layer norm over $\boldsymbol{h}$, and the score head $\boldsymbol{a}_h^\top\operatorname{SiLU}(\cdot) + b_h$.
# The mLSTM core runs in float32 at least; scores are float32 (ranking is done in float32, App. F).
# `forward` uses the chunkwise form (`chunk_size` tokens per chunk; a sequence no longer than
# one chunk is exactly the quadratic form).
#
# Initialization (App. E.5): $W_q$ and $W_k$ start from the key pathway and $W_v$ from the
# value pathway as identity-style maps (the first $d/2$ coordinates of $\boldsymbol{k}$ resp.
# $\boldsymbol{v}$) plus small noise; the score head is zero, so all scores are equal at step 0
# (neutral ranking); the gate weights are zero and the forget-gate bias is spread over
# $[3, 6]$ across heads ($\sigma(3) \approx 0.95$ to $\sigma(6) \approx 0.998$: memories of
# roughly 20 to 400 tokens), the input-gate bias is 0 (with the ratio readout only differences
# of input-gate pre-activations matter).
#
# For decoding, `init_state`, `step(state, k_t, v_t)`, `query_feature(k_u, v_u)` and
# `readout(state, q_feature)` give the recurrent form: the cache steps the state with every
# new token and scores token $u = t - w$ with the state after $t$.

# %%
#| export
class MLSTMScorer(nn.Module):
    "Headwise mLSTM scorer, Hedgehog features, delayed readout (Eq. 37-42); parallel `forward`, recurrent `step`."
    def __init__(self, num_kv_heads: int, head_dim: int, *, delay: int, soft_cap: float | None = 15.0,
                 norm: bool = False, normalizer: str = "ratio", eps: float = 1e-6,
                 forget_bias: tuple[float, float] = (3.0, 6.0),
                 input_bias: float = 0.0, init_std: float = 0.02, chunk_size: int = 64):
        super().__init__()
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = check_int(head_dim, "head_dim", 1)
        if head_dim % 2: raise ValueError(f"head_dim must be even (Hedgehog halves the projection), got {head_dim}")
        if soft_cap is not None and not soft_cap > 0:
            raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap!r}")
        self.delay, self.soft_cap, self.norm = check_int(delay, "delay"), soft_cap, bool(norm)
        self.normalizer, self.eps = check_normalizer(normalizer), float(eps)
        self.chunk_size = check_int(chunk_size, "chunk_size", 1)
        half = head_dim // 2
        self.q_proj, self.k_proj, self.v_proj = (HeadwiseLinear(num_kv_heads, 2 * head_dim, half, bias=False)
                                                 for _ in range(3))
        self.gates = HeadwiseLinear(num_kv_heads, 2 * head_dim, 2)  # columns: input, forget pre-activation
        self.score = HeadwiseLinear(num_kv_heads, half, 1)  # a_h, b_h of Eq. (42)
        with torch.no_grad():
            eye = torch.eye(head_dim, half)  # picks the first d/2 coordinates
            for proj, offset in ((self.q_proj, 0), (self.k_proj, 0), (self.v_proj, head_dim)):
                proj.weight.normal_(0.0, init_std)
                proj.weight[:, offset:offset + head_dim] += eye
            self.gates.bias[:, 0] = input_bias
            self.gates.bias[:, 1] = torch.linspace(*forget_bias, num_kv_heads) if num_kv_heads > 1 else forget_bias[0]

    def extra_repr(self) -> str:
        return (f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, delay={self.delay}, "
                f"soft_cap={self.soft_cap}, "
                f"norm={self.norm}, normalizer={self.normalizer!r}")


# %%
ini = MLSTMScorer(3, 8, delay=2, init_std=0.0)
eye = torch.eye(8, 4).expand(3, 8, 4)
for proj, rows in ((ini.q_proj, slice(0, 8)), (ini.k_proj, slice(0, 8)), (ini.v_proj, slice(8, 16))):
    assert torch.equal(proj.weight[:, rows], eye)  # the first d/2 coordinates of k (for q and k) or of v
    assert torch.equal(proj.weight.sum((1, 2)), torch.full((3,), 4.0))  # and nothing else
assert torch.equal(ini.gates.bias, torch.tensor([[0.0, 3.0], [0.0, 4.5], [0.0, 6.0]]))  # forget bias over [3, 6]
assert not ini.gates.weight.any() and not ini.score.weight.any() and not ini.score.bias.any()
test_eq(MLSTMScorer(1, 8, delay=2).gates.bias[0, 1].item(), 3.0)
test_fail(lambda: MLSTMScorer(3, 7, delay=1), contains="head_dim must be even")
test_fail(lambda: MLSTMScorer(3, 8, delay=1, soft_cap=0), contains="soft_cap must be > 0")
assert "delay=2" in repr(ini) and "normalizer='ratio'" in repr(ini)


# %% [markdown]
# `_input` is the detached $[k; v]$ in the parameters' dtype, one token at decode made a sequence of one:

# %%
#| export
@patch_to(MLSTMScorer)
def _input(self, k: Tensor, v: Tensor) -> Tensor:
    "Detached [k; v] as [B,H,S,2d] in the parameter dtype (one token [B,H,d] gets S = 1)."
    check_kv(k, v, self.num_kv_heads, self.head_dim)
    if k.dim() not in (3, 4):
        raise ValueError(f"k must be [B, Hkv, S, d] or [B, Hkv, d], got shape {tuple(k.shape)}")
    x = scorer_input(k, v).to(self.q_proj.weight.dtype)
    return x if k.dim() == 4 else x[:, :, None]


# %%
fs = MLSTMScorer(3, 8, delay=2)
kx, vx = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
test_eq(fs._input(kx[:, :, 0], vx[:, :, 0]).shape, (2, 3, 1, 16))
assert not fs._input(kx.clone().requires_grad_(), vx).requires_grad  # detached
test_fail(lambda: fs._input(kx[None], vx[None]), contains="k must be [B, Hkv, S, d] or [B, Hkv, d]")


# %% [markdown]
# `features` gives the read and key features, the value and the log-gates of every token (or of one
# token at decode). At initialization the gate weights are zero, so $\log i$ is the input bias 0 and
# $\log f = \log\sigma(15\tanh(b/15))$ of each head's forget bias $b$:

# %%
#| export
@patch_to(MLSTMScorer)
def features(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    "(q~, k~, v~, log i, log f) for keys/values [B,H,S,d] or one token [B,H,d]; float32 at least."
    x = self._input(k, v)
    acc = torch.promote_types(x.dtype, torch.float32)
    q, kf = hedgehog(self.q_proj(x).to(acc)), hedgehog(self.k_proj(x).to(acc))
    pre = soft_cap(self.gates(x).to(acc), self.soft_cap)
    out = q, kf, self.v_proj(x).to(acc), pre[..., 0], F.logsigmoid(pre[..., 1])
    return out if k.dim() == 4 else tuple(t.squeeze(2) for t in out)


# %%
q_, kf_, vf_, li, lf = fs.features(kx, vx)
test_eq([tuple(t.shape) for t in (q_, kf_, vf_, li, lf)],
        [(2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 4), (2, 3, 6), (2, 3, 6)])
assert_close(q_[..., :4].sum(-1), torch.ones(2, 3, 6))  # each Hedgehog half sums to one
assert_close(li, torch.zeros(2, 3, 6))
assert_close(lf, F.logsigmoid(15 * torch.tanh(torch.tensor([3.0, 4.5, 6.0]) / 15))[:, None].expand(2, 3, 6))
for a, b in zip(fs.features(kx[:, :, 4], vx[:, :, 4]), (q_, kf_, vf_, li, lf)): assert_close(a, b[:, :, 4])


# %% [markdown]
# ### The score head against loops (Eq. 11, 42)
#
# The last step, $\hat r_u = \boldsymbol{a}_h^\top\operatorname{SiLU}(\operatorname{Norm}(\boldsymbol{h}_u)) + b_h$,
# is the stateless part of the scorer: one dot product per token after an elementwise SiLU,
# with the optional parameter-free layer norm $\operatorname{Norm}(\boldsymbol{h}) =
# (\boldsymbol{h} - \mu)/\sqrt{\sigma^2 + 10^{-5}}$ ($\mu$, $\sigma^2$ the mean and the biased
# variance over the $d/2$ coordinates). Check `score_head` against the same formula by loops
# over batch, head and token, each sum written out in Python floats, with and without the norm,
# for a sequence of readouts and for one token (decode). With the norm the score ignores a
# positive rescaling of $\boldsymbol{h}$ (up to the norm's $10^{-5}$), without it it does not;
# this matters for the output gate below.

# %%
#| export
@patch_to(MLSTMScorer)
def score_head(self, h: Tensor) -> Tensor:
    "Raw score a_h . SiLU(Norm(h)) + b_h (Eq. 42) of readouts h [B,H,S,d/2] or [B,H,d/2]."
    if self.norm: h = F.layer_norm(h, h.shape[-1:])
    one = h.dim() == 3  # [B,H,d/2]: a single token
    r = self.score(F.silu(h[:, :, None] if one else h).to(self.score.weight.dtype))[..., 0].float()
    return r[:, :, 0] if one else r


# %%
def _score_head_loops(sc, h):
    "Eq. (42) by loops over batch, head and token: layer norm, SiLU and the dot product written out in Python floats."
    a, b = sc.score.weight[..., 0].tolist(), sc.score.bias[:, 0].tolist()   # a[head][j], b[head]
    B, H, S, n = h.shape
    r = torch.empty(B, H, S)
    for i in range(B):
        for hd in range(H):
            for t in range(S):
                x = h[i, hd, t].tolist()
                if sc.norm:                                   # parameter-free layer norm, biased variance, eps 1e-5
                    mu = sum(x) / n
                    var = sum((xj - mu) ** 2 for xj in x) / n
                    x = [(xj - mu) / math.sqrt(var + 1e-5) for xj in x]
                silu = [xj / (1 + math.exp(-xj)) for xj in x]                # SiLU(x) = x sigma(x)
                r[i, hd, t] = sum(a[hd][j] * silu[j] for j in range(n)) + b[hd]
    return r

torch.manual_seed(6)
h = 3 * torch.randn(2, 3, 7, 4)                        # readouts [B, H, S, d/2] for d = 8, over SiLU's curved part
for norm in (False, True):
    sc = MLSTMScorer(3, 8, delay=2, norm=norm)
    assert (sc.score_head(h) == 0).all()              # zero score head at initialization
    with torch.no_grad(): sc.score.weight.normal_(); sc.score.bias.normal_()
    ref = _score_head_loops(sc, h)
    assert_close(sc.score_head(h), ref)
    assert_close(sc.score_head(h[:, :, 4]), ref[:, :, 4])   # one token [B, H, d/2] (decode)
    assert_close(sc.score_head(h.double()), ref)            # float64 readouts, float32 scores
    if norm: assert_close(sc.score_head(2.5 * h), ref, rtol=1e-4, atol=1e-4)   # the norm ignores the scale of h
    else: assert not torch.allclose(sc.score_head(2.5 * h), ref)


# %% [markdown]
# Checks: at initialization every score is equal (zero score head); with a random score head
# the parallel and recurrent forms agree for delayed and immediate readout, and the scores
# read the right states (the delayed score of token $u$ equals the immediate score that token
# $u$'s query feature would get at position $u + w$).

# %%
#| export
@patch_to(MLSTMScorer)
def forward(self, k: Tensor, v: Tensor) -> Tensor:
    "Raw scores r [B,Hkv,S] with the delayed readout, chunkwise-parallel form (training and prefill)."
    if k.dim() != 4: raise ValueError(f"k must be [B, Hkv, S, d] for the parallel form, got shape {tuple(k.shape)}")
    return self.score_head(mlstm_chunkwise(*self.features(k, v), self.delay, self.normalizer, self.eps,
                                           self.chunk_size))


# %%
torch.manual_seed(4)
B, H, S, d, w = 2, 3, 40, 8, 5
k, v = torch.randn(B, H, S, d), torch.randn(B, H, S, d)
sc = MLSTMScorer(H, d, delay=w)
assert (sc(k, v) == 0).all()  # zero score head: neutral ranking
with torch.no_grad(): sc.score.weight.normal_(); sc.score.bias.normal_(); sc.gates.weight.normal_(0, 0.1)
sc6 = copy.deepcopy(sc); sc6.chunk_size = 6
assert_close(sc6(k, v), sc6.score_head(mlstm_parallel(*sc6.features(k, v), w)))
test_fail(lambda: sc(k[:, :, 0], v[:, :, 0]), contains="for the parallel form")


# %%
#| export
@patch_to(MLSTMScorer)
def init_state(self, batch_size: int, device=None) -> MLSTMState:
    "Empty recurrent state for `batch_size` sequences."
    half = self.head_dim // 2
    return mlstm_init_state(batch_size, self.num_kv_heads, self.head_dim, half, device,
                            torch.promote_types(self.q_proj.weight.dtype, torch.float32))


# %%
st = sc.init_state(B)
test_eq([tuple(x.shape) for x in st], [(B, H, d, d // 2), (B, H, d), (B, H)])
test_eq((st.m.max().item(), st.C.dtype), (-math.inf, torch.float32))
test_eq(MLSTMScorer(H, d, delay=w).double().init_state(1).C.dtype, torch.float64)


# %%
#| export
@patch_to(MLSTMScorer)
def step(self, state: MLSTMState, k: Tensor, v: Tensor) -> MLSTMState:
    "Absorb one token, keys/values [B,Hkv,d], into the state (decode)."
    _, kf, vf, log_i, log_f = self.features(k, v)
    return mlstm_step(state, kf, vf, log_i, log_f)


# %%
state = sc.init_state(B)
for t in range(S): state = sc.step(state, k[:, :, t], v[:, :, t])
_, final = mlstm_chunkwise_immediate(*sc.features(k, v))
for a, b in zip(state, final): assert_close(a, b)


# %%
#| export
@patch_to(MLSTMScorer)
def query_feature(self, k: Tensor, v: Tensor) -> Tensor:
    "Read query feature q~ of tokens with keys/values [B,Hkv,(S,)d]."
    q = hedgehog(self.q_proj(x := self._input(k, v)).to(torch.promote_types(x.dtype, torch.float32)))
    return q if k.dim() == 4 else q[:, :, 0]


# %%
assert_close(sc.query_feature(k, v), sc.features(k, v)[0])
assert_close(sc.query_feature(k[:, :, 3], v[:, :, 3]), sc.features(k, v)[0][:, :, 3])


# %%
#| export
@patch_to(MLSTMScorer)
def readout(self, state: MLSTMState, q_feature: Tensor) -> Tensor:
    "Raw score [B,Hkv] of the token with read feature q_feature [B,Hkv,d] from the current state (Eq. 41-42)."
    return self.score_head(mlstm_readout(state, q_feature, self.normalizer, self.eps))


# %%
# the delayed score of token u reads u's query feature from the state after token u + w
u = 7
q_u = sc6.query_feature(k[:, :, u], v[:, :, u])
state = sc6.init_state(B)
for t in range(u + w + 1): state = sc6.step(state, k[:, :, t], v[:, :, t])
assert_close(sc6(k, v)[:, :, u], sc6.readout(state, q_u))


# %%
#| export
@patch_to(MLSTMScorer)
def recurrent(self, k: Tensor, v: Tensor) -> Tensor:
    "`forward` in decode order: step token t, score token t - delay; the last `delay` read the final state."
    B, H, S, _ = k.shape
    state, q = self.init_state(B, k.device), self.query_feature(k, v)
    r = torch.empty(B, H, S, device=k.device)
    for t in range(S):
        state = self.step(state, k[:, :, t], v[:, :, t])
        if t >= self.delay: r[:, :, t - self.delay] = self.readout(state, q[:, :, t - self.delay])
    for u in range(max(S - self.delay, 0), S): r[:, :, u] = self.readout(state, q[:, :, u])
    return r


# %%
assert_close(sc(k, v), sc.recurrent(k, v))
sc0 = MLSTMScorer(H, d, delay=0); sc0.load_state_dict(sc.state_dict())
assert_close(sc0(k, v), sc0.recurrent(k, v))
assert not torch.allclose(sc6(k, v), sc0(k, v))


# %% [markdown]
# Benchmark (no assertion, these machines are noisy): one training step of the chunkwise form, forward
# and backward through a 3-head scorer at $S = 2048$, $d = 64$ (SmolLM2's KV heads), per chunk length,
# timed in alternation (best of 3) and printed as a ratio to $L = 256$; the readouts of every length
# agree to rounding.

# %%
def chunk_step_seconds(chunk_sizes=(32, 64, 128, 256), S: int = 2048, repeats: int = 3) -> dict:
    "Best time of forward + backward of MLSTMScorer(3, 64) over S tokens per chunk length, alternating the lengths."
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 3, S, 64, generator=g), torch.randn(1, 3, S, 64, generator=g)
    scorer, best = MLSTMScorer(3, 64, delay=64), dict.fromkeys(chunk_sizes, math.inf)
    for _ in range(repeats):
        for L in chunk_sizes:
            scorer.chunk_size = L
            start = time.perf_counter()
            scorer(k, v).square().mean().backward()
            best[L] = min(best[L], time.perf_counter() - start)
    return best

step_s = chunk_step_seconds()
_x = torch.randn(1, 3, 2048, 64, generator=torch.Generator().manual_seed(1))
_feats = MLSTMScorer(3, 64, delay=64).features(_x, _x.flip(2))
for L in (32, 128, 256): assert_close(mlstm_chunkwise(*_feats, 64, chunk_size=L), mlstm_chunkwise(*_feats, 64))
print("  ".join(f"L = {L}: {1e3 * t:.0f} ms ({step_s[256] / t:.2f}x of L = 256)" for L, t in step_s.items()))

# %% [markdown]
# ## The output gate of Eq. (12), and what dropping it changes
#
# The mLSTM of xLSTM (App. A) has a third gate besides $i_t$ and $f_t$: a vector output gate
# computed from the token, $\boldsymbol{o}_t = \sigma(\boldsymbol{x}_t W_{og})$ with $W_{og} \in
# \mathbb{R}^{d \times d_v}$, which multiplies the normalized retrieval coordinate by coordinate
# (Eq. (12)):
#
# $$\boldsymbol{h}_t = \boldsymbol{o}_t \odot \frac{\phi(\boldsymbol{q}_t)\,\boldsymbol{C}_t}{\phi(\boldsymbol{q}_t)\,\boldsymbol{z}_t}.$$
#
# KVpop's scorer removes it (App. A, to keep the retrofit small); `MLSTMScorer` has no output
# gate. What that does and does not change:
#
# - **Nothing before the score head.** The gate acts on the readout only, after the state has
#   been read: $\boldsymbol{C}_t$, $\boldsymbol{z}_t$, the stabilizer $m_t$, the delayed readout and
#   the equivalence of the recurrent, parallel and chunkwise forms checked above are the same
#   with or without it. In the score of token $u$ it would sit between the ratio of Eq. (41)
#   and the score head, $\hat r_u = \boldsymbol{a}_h^\top\operatorname{SiLU}(\operatorname{Norm}(\boldsymbol{o}_u
#   \odot \boldsymbol{h}_{u\mid u+w})) + b_h$, with the gate computed, say, from the scored token's
#   $\boldsymbol{x}_u$ (the paper does not say which token's input a delayed readout would gate
#   with; the check below uses $u$).
# - **One projection less.** Per KV head $W_{og}$ would be a $2d \times d/2$ matrix, $d^2$
#   parameters. Without it the scorer has $3d^2 + 4d + d/2 + 3$ per head (the counts below);
#   the gate would add about a third.
# - **The score function, in general.** $\boldsymbol{o}_u \in (0, 1)^{d/2}$ changes from token to
#   token and from coordinate to coordinate, and SiLU is not linear, so the gate cannot be
#   folded into $\boldsymbol{a}_h$: a gated head can score, and rank, tokens differently from the
#   gate-free one on the same state. The gate is not a no-op; dropping it restricts the score
#   head to the gate-free family, which is the gated one at $\boldsymbol{o} \equiv 1$ (the limit
#   of large gate pre-activations).
# - **Two cases where it changes nothing.** A gate of all ones is no gate. And with the norm, a
#   gate that has one value per token, $\boldsymbol{o}_u = c_u \boldsymbol{1}$, is absorbed by the
#   layer norm up to its constant: $\operatorname{Norm}_\varepsilon(c\,\boldsymbol{h}) =
#   \operatorname{Norm}_{\varepsilon/c^2}(\boldsymbol{h})$; without the norm even such a scalar gate
#   changes the ranking.
#
# Check on a small scorer with random score head and gate weights, for `norm=False` and
# `norm=True`: the readout is computed independently (the unstabilized float64 loop reference);
# an output gate of all ones, given exactly or as $\sigma$ of pre-activations shifted by 40
# (which is 1 in float32), reproduces the gate-free scores; a vector gate from a random
# $W_{og}$ changes the scores and the order of the tokens; a per-token scalar gate only moves
# the norm's $\varepsilon$ to $\varepsilon / c^2$ with the norm, and reorders tokens without it.

# %%
torch.manual_seed(7)
B, H, S, d, w = 1, 2, 16, 8, 3
k, v = torch.randn(B, H, S, d), torch.randn(B, H, S, d)
for norm in (False, True):
    sc = MLSTMScorer(H, d, delay=w, norm=norm)
    with torch.no_grad(): sc.score.weight.normal_(); sc.score.bias.normal_(); sc.gates.weight.normal_(0, 0.1)
    q, kf, vf, log_i, log_f = sc.features(k, v)
    h = mlstm_unstabilized_reference(q.double(), kf.double(), vf.double(), log_i.double(), log_f.double(), w).float()
    r = sc(k, v)                                                          # the gate-free scorer
    x = scorer_input(k, v)                                                # x_u = [k_u; v_u] of the scored token
    pre = torch.einsum("bhsi,hio->bhso", x, torch.randn(H, 2 * d, d // 2))     # x_u W_og, Eq. (12)
    for o in (torch.ones_like(h), torch.sigmoid(pre + 40)):               # sigma(40 + .) is 1 in float32
        test_eq(o, torch.ones_like(h))
        assert_close(sc.score_head(o * h), r, rtol=1e-4, atol=1e-4)      # an all-ones gate is no gate
    gated = sc.score_head(torch.sigmoid(pre) * h)                         # a vector gate: other scores, other ranking
    assert (gated - r).abs().max() > 0.1 and not torch.equal(gated.argsort(-1), r.argsort(-1))
    c = torch.empty(B, H, S, 1).uniform_(0.2, 1.0)                        # one gate value per token
    if norm:  # LN(c h) with eps is LN(h) with eps / c^2: the scalar gate only moves the norm's eps
        hn = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-5 / c ** 2)
        assert_close(sc.score_head(c * h), sc.score(F.silu(hn))[..., 0], rtol=1e-4, atol=1e-4)
    else: assert not torch.equal(sc.score_head(c * h).argsort(-1), r.argsort(-1))
    print(f"norm={norm}: max |score change| vector gate {(gated - r).abs().max().item():.3f}, "
          f"scalar gate {(sc.score_head(c * h) - r).abs().max().item():.2e}")


# %% [markdown]
# ## Parameter counts
#
# Per KV head the mLSTM scorer has three $2d \times d/2$ projections, a $2d \to 2$ gate map with
# bias and a $d/2 \to 1$ score head: $3d^2 + 2(2d+1) + d/2 + 1$ parameters. The counts per
# layer for the two model shapes of the project (SmolLM2-135M: 3 KV heads of $d = 64$;
# Qwen3-4B: 8 KV heads of $d = 128$):

# %%
#| export
def count_parameters(module: nn.Module) -> int:
    "Number of scalar parameters of `module`."
    return sum(p.numel() for p in module.parameters())


# %%
for name, H, d in (("SmolLM2-135M", 3, 64), ("Qwen3-4B", 8, 128)):
    n_mlstm = count_parameters(MLSTMScorer(H, d, delay=256))
    test_eq(n_mlstm, H * (3 * d * d + 2 * (2 * d + 1) + d // 2 + 1))
    n_mlp, n_lin = count_parameters(MLPScorer(H, d)), count_parameters(LinearScorer(H, d))
    test_eq(n_mlp, H * (2 * d * d + d + d + 1)); test_eq(n_lin, H * (2 * d + 1))
    print(f"{name}: per layer mLSTM {n_mlstm:,}  MLP(hidden=d) {n_mlp:,}  linear {n_lin:,}")
