# %% [markdown]
# # KVpop: the distillation student
#
# > KVpop's training-time attention and loss as a `DistillStudent` (Alg. 1, §3.3), and StreamingLLM+ beside it.

# %%
#| default_exp kvpop.student

# %%
#| export
from __future__ import annotations

import inspect
import json
import math
import weakref
from importlib import resources
from pathlib import Path

import torch
from fastcore.basics import patch_to
from torch import Tensor, nn

from sparsekv.attention import attention_scores, check_int, masked_attention, masked_logsumexp, sink_window_visible
from sparsekv.cache import SinkWindowCache
from sparsekv.distill import DistillStudent, load_torch_file, student_spec
from sparsekv.hf import AttentionPolicy, MaskPolicy, dense_attention, heads_mask
from sparsekv.io import file_sha256, write_json
from sparsekv.kvpop.baselines import EvictionMethod
from sparsekv.kvpop.cache import KVpopCache, KVpopPolicy, KVpopScorers
from sparsekv.kvpop.cutoff import check_budget, topk_cutoff
from sparsekv.kvpop.loss import retention_loss, retention_recall, sample_boundary_queries
from sparsekv.kvpop.mask import kvpop_attention, kvpop_mask
from sparsekv.kvpop.target import AGGS, future_attention_target
from sparsekv.models import model_info

# %%
#| hide
import tempfile
from types import SimpleNamespace

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sparsekv.attention import attention_reference
from sparsekv.hf import chunked_prefill, patch
from sparsekv.kvpop.cache import random_scorers
from sparsekv.kvpop.loss import retention_loss_reference
from sparsekv.kvpop.mask import kvpop_mask_reference
from sparsekv.models import load_model



# %% [markdown]
# ## One training step of KVpop (Alg. 1 / Alg. 3)
#
# KVpop retrofits a pretrained model with a fixed per-head KV budget $B = s + w + k$ (Eq. 1) and learns
# which long-range tokens to keep. One training step on a packed batch of sequences of length $S$ is:
#
# 1. **Teacher forward.** The frozen dense model gives logits $z^{T}$ (no gradient). In full fine-tuning
#    the teacher is a frozen copy of the base model taken before training; when only the scorers train
#    (the base is frozen) the teacher is the unpatched model itself.
# 2. **Student forward.** The same model runs with every attention layer replaced by KVpop attention.
#    In layer $\ell$, from its post-RoPE keys and values:
#    - the scorer reads $x_{h,t} = [k_{h,t}; v_{h,t}]$ **detached** from the backbone (§3.3) and predicts raw
#      scores $\hat r_{h,t}$; with the per-head decay $\gamma_h$ they become static priorities
#      $\hat p_{h,t} = \hat r_{h,t} - \lfloor t/n \rfloor \log\gamma_h$ (Eq. 20), in float32 (App. F);
#    - the priorities, **detached**, give each token's rank and each query's cutoff $\tau_q$ (Alg. 2), hence the
#      mask $M$ of Eq. (26): sinks, the window, and the eligible tokens with rank $\le \tau_q$;
#    - exact attention under $M$ gives the layer output and the sparse log-normalizer $\widetilde{\mathrm{LSE}}_d$ (Eq. 9);
#    - the target $r^{\mathrm{tgt}}_{h,t}$ (Eq. 3) comes from one transposed pass over the layer's own $q, k$
#      normalized by $\widetilde{\mathrm{LSE}}$ (Eq. 8–9), without gradient, and receives the same decay:
#      $p^{\mathrm{tgt}}_{h,t} = r^{\mathrm{tgt}}_{h,t} - \lfloor t/n \rfloor \log\gamma_h$ (Eq. 5).
# 3. **Losses.** The distillation loss is the forward KL from the teacher to the student on the teacher's
#    top-256 tokens at temperature 1 (App. F). The retention loss (Eq. 7) compares, at sampled query
#    positions $q \ge s + w + k$ (Eq. 25), the student priorities of the newly eligible token $q - w$ and of
#    the teacher's boundary token; it is averaged over layers.
# 4. **Update.** One backward of the sum, gradient clipping to 1.0, AdamW with two parameter groups.
#
# Where the gradients flow:
#
# - The **ranking is not differentiable** (a sort and a threshold), and the mask is built from detached
#   priorities: the KL never reaches the scorers. The scorers learn only from the retention loss.
# - The scorer inputs are detached, so the retention loss never reaches the backbone: the base model
#   learns only from the KL, through the attention it computes under the fixed mask (its $q, k, v$ and the
#   MLPs), i.e. it adapts to the sparsity pattern the scorers chose.
# - The target is a label: computed under `no_grad` from detached $q, k$ and $\widetilde{\mathrm{LSE}}$.
#   The decays $\gamma_h$ receive gradient through the student priorities only (the teacher's copy of the
#   decay term is detached with the target).
#
# So in scorer-only training (base frozen) the KL has no gradient path at all; it is then only a metric.
#
# The student plugs into the generic loop of [`sparsekv.distill`](06_distill.ipynb) as a `DistillStudent`.

# %% [markdown]
# ### KVpop attention with capture
#
# `KVpopTrainPolicy` is the student forward of step 2. On CUDA it uses `kvpop_attention` (FlexAttention with the
# on-the-fly mask, which returns the sparse LSE with the output). On CPU it attends with SDPA under the dense
# `kvpop_mask` and computes the sparse LSE from the masked scores only when training needs it, outside the
# autograd graph: the LSE is only an input to the target, a label.
# In `train()` mode it records per layer the student priorities (with their graph to the scorer and decay
# parameters) and the decayed target; in `eval()` mode (or under `no_grad`) it only attends, exactly like
# `KVpopMaskPolicy`.
#
# Computing the target inside the forward rather than in `method_loss` keeps only two `[B, Hkv, S]`
# tensors per layer alive instead of the layer's $q$ and $k$; the computation is the same.

# %%
#| export
class KVpopTrainPolicy(AttentionPolicy):
    "KVpop attention on whole sequences (Eq. 26, exact under the mask); in training, records priorities and targets."

    def __init__(self, student: "KVpopStudent"):
        self.student = student

    def attend(self, q, k, v, ctx):
        st = self.student
        if ctx.past_len:
            raise ValueError("KVpop training attention takes whole sequences: call the model without a cache")
        capture = st.training and torch.is_grad_enabled()
        with torch.set_grad_enabled(capture):  # scorer inputs detached: gradients reach only scorers and decays (§3.3)
            pred = st.scorers.priority(ctx.layer_idx, k.detach(), v.detach(), ctx.key_positions)
        if capture and st.target == "dense":  # the dense teacher's own pass: Eq. (2) exactly, as in cached training
            out, lse = dense_attention(q, k, v, ctx.mask, ctx.scale, ctx.dropout), None
        else: out, lse = self._sparse(q, k, v, ctx, pred, capture)
        if capture:
            with torch.no_grad():  # Eq. (8) with the dense or (Eq. 9) the sparse LSE, then the shared decay (Eq. 5)
                r_tgt = future_attention_target(q, k, st.window, lse=lse, agg=st.agg, eps=st.eps, scale=ctx.scale)
                target = st.scorers.decayed(ctx.layer_idx, r_tgt, ctx.key_positions)
            st.captured.append((pred, target))
        return out


# %%
test_eq(KVpopTrainPolicy("a student").student, "a student")
test_fail(lambda: KVpopTrainPolicy(None).attend(None, None, None, SimpleNamespace(past_len=3)),
          contains="takes whole sequences: call the model without a cache")


# %% [markdown]
# `_sparse` is the attention under the mask of the priorities. Checked on CPU against `attention_reference` under
# `kvpop_mask_reference` (the mask by loops), with 2 query heads per KV head: the output, and the sparse LSE only
# when capturing:

# %%
#| export
@patch_to(KVpopTrainPolicy)
def _sparse(self, q, k, v, ctx, pred, capture):
    "Attention under the mask of the priorities `pred` (Eq. 26) and, when capturing, its sparse LSE (Eq. 9)."
    st = self.student
    rank, cutoff = topk_cutoff(pred.detach(), st.k, st.sink, st.window)  # float32 ranking, no gradient
    if q.is_cuda and ctx.mask is None:  # FlexAttention with the on-the-fly mask: output and LSE in one pass
        out, lse = kvpop_attention(q, k, v, rank, cutoff, st.sink, st.window, scale=ctx.scale)
    else:
        # dense mask (a model mask, e.g. padding, intersected); on CPU: SDPA, the LSE only when needed, no graph
        m = kvpop_mask(rank, cutoff, st.sink, st.window, q.shape[1] // k.shape[1])
        if ctx.mask is not None: m = m & heads_mask(ctx.mask, q.shape[1])
        if q.is_cuda: out, lse = masked_attention(q, k, v, m, scale=ctx.scale)
        else:
            out = dense_attention(q, k, v, m, ctx.scale, ctx.dropout)
            with torch.no_grad(): lse = masked_logsumexp(attention_scores(q, k, m, ctx.scale)) if capture else None
    return out, lse


# %%
_g = torch.Generator().manual_seed(3)
_q, _k, _v = (torch.randn(2, h, 12, 8, generator=_g) for h in (4, 2, 2))
_pred = torch.randn(2, 2, 12, generator=_g)
_pol = KVpopTrainPolicy(SimpleNamespace(k=3, sink=1, window=2))
_ctx = SimpleNamespace(mask=None, scale=0.3, dropout=0.0)
_out_ref, _lse_ref = attention_reference(_q, _k, _v, kvpop_mask_reference(_pred, 3, 1, 2).repeat_interleave(2, 1),
                                         scale=0.3)
_out, _lse = _pol._sparse(_q, _k, _v, _ctx, _pred, capture=True)
assert_close(_out, _out_ref, atol=1e-5, rtol=1e-5)
assert_close(_lse, _lse_ref, atol=1e-5, rtol=1e-5)
test_eq(_pol._sparse(_q, _k, _v, _ctx, _pred, capture=False)[1], None)

# %% [markdown]
# ### `KVpopStudent`
#
# The student holds the scorers (`KVpopScorers`, MLP or mLSTM) and the budget. `method_loss` samples
# `n_boundaries` query positions with `sample_boundary_queries` (Eq. 25; half of them biased toward the end),
# from a generator seeded by `(seed, step)` so that a resumed run draws the same positions, and averages
# `retention_loss` (Eq. 7, margin weighting on, App. F) over layers. It also logs the top-$k$ retention recall
# of the student against the teacher policy at the same positions (Fig. 7).

# %%
#| export
TARGETS = ("sparse", "dense")

# %%
test_eq(TARGETS[0], "sparse")  # Alg. 1's target comes first: it is `KVpopStudent`'s default
test_eq(set(TARGETS), {"sparse", "dense"})


# %%
#| export
def step_generator(seed: int, step: int) -> torch.Generator:
    "A CPU generator seeded by (seed, step): the same random draws at a step whether the run was resumed or not."
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


# %%
test_eq((step_generator(0, 5).initial_seed(), step_generator(2, 3).initial_seed()), (5, 2_000_009))
test_eq(torch.rand(3, generator=step_generator(1, 7)), torch.rand(3, generator=step_generator(1, 7)))
assert not torch.equal(torch.rand(3, generator=step_generator(1, 7)), torch.rand(3, generator=step_generator(1, 8)))


# %%
#| export
def _check_loss_options(late_frac, omega_min, weight, tau, tau_omega, eps, margin, balance) -> None:
    "Raise unless `KVpopStudent`'s numbers are finite and in range (tau, tau_omega, eps > 0) and its flags bools."
    for name, x, lo, hi in (("late_frac", late_frac, 0, 1), ("omega_min", omega_min, 0, 1),
                            ("weight", weight, 0, math.inf), ("tau", tau, 0, math.inf),
                            ("tau_omega", tau_omega, 0, math.inf), ("eps", eps, 0, math.inf)):
        open_lo = name in ("tau", "tau_omega", "eps")
        if (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
                or not (lo < x if open_lo else lo <= x) or x > hi):
            raise ValueError(f"{name} must be a finite number in {'(' if open_lo else '['}{lo}, {hi}"
                             f"{')' if hi == math.inf else ']'}, got {x!r}")
    for name, x in (("margin", margin), ("balance", balance)):
        if not isinstance(x, bool): raise TypeError(f"{name} must be a bool, got {x!r}")


# %%
_ok = dict(late_frac=0.5, omega_min=0.1, weight=1.0, tau=1.0, tau_omega=1.0, eps=1e-6, margin=True, balance=False)
_check_loss_options(**_ok)
_check_loss_options(**{**_ok, "late_frac": 1, "omega_min": 0, "weight": 0})  # closed ends
test_fail(lambda: _check_loss_options(**{**_ok, "late_frac": 1.5}),
          contains="late_frac must be a finite number in [0, 1]")
test_fail(lambda: _check_loss_options(**{**_ok, "tau": 0}), contains="tau must be a finite number in (0, inf)")
test_fail(lambda: _check_loss_options(**{**_ok, "eps": math.nan}), contains="eps must be a finite number")
test_fail(lambda: _check_loss_options(**{**_ok, "weight": True}), contains="weight must be a finite number")
test_fail(lambda: _check_loss_options(**{**_ok, "balance": 1}), contains="balance must be a bool, got 1")


# %% [markdown]
# The policy's attention must be the KVpop mask of the current scorers, with the sparse LSE. We check the
# output of a patched tiny model layer against `attention_reference` under `kvpop_mask_reference` (the mask
# from its definition, by loops), and that the captured target is `future_attention_target` with the
# reference LSE, decayed.

# %%
#| export
class KVpopStudent(DistillStudent):
    "KVpop (Alg. 1): scorer-ranked sparse attention; retention loss (Eq. 7) on its own sparse pass's target."

    def __init__(self, scorers: KVpopScorers, sink: int, window: int, k: int, n_boundaries: int = 64,
                 late_frac: float = 0.5, tau: float = 1.0, margin: bool = True, omega_min: float = 0.1,
                 tau_omega: float = 1.0, balance: bool = False, agg: str = "max", eps: float = 1e-6,
                 weight: float = 1.0, seed: int = 0, target: str = "sparse"):
        super().__init__()
        if not isinstance(scorers, KVpopScorers):
            raise TypeError(f"scorers must be a KVpopScorers, got {type(scorers).__name__}")
        self.k, self.sink, self.window = check_budget(k, sink, window)
        check_int(n_boundaries, "n_boundaries", 1), check_int(seed, "seed")
        _check_loss_options(late_frac, omega_min, weight, tau, tau_omega, eps, margin, balance)
        if agg not in AGGS: raise ValueError(f"agg must be one of {AGGS}, got {agg!r}")
        self.scorers, self.n_boundaries, self.late_frac = scorers, n_boundaries, late_frac
        self.weight, self.seed = weight, seed
        self.loss_options = dict(tau=tau, margin=margin, omega_min=omega_min, tau_omega=tau_omega, balance=balance)
        if target not in TARGETS: raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        self.agg, self.eps, self.target = agg, eps, target
        self.captured: list[tuple[Tensor, Tensor]] = []


# %%
model, tok = load_model("tiny-llama", num_layers=2)
sc = random_scorers(model, seed=1)
student = KVpopStudent(sc, sink=2, window=4, k=3, n_boundaries=8)
test_eq((student.k, student.sink, student.window, student.captured), (3, 2, 4, []))
test_fail(lambda: KVpopStudent(sc.scorers, sink=2, window=4, k=3), contains="scorers must be a KVpopScorers")


# %%
#| export
@patch_to(KVpopStudent)
def policy(self) -> KVpopTrainPolicy:
    return KVpopTrainPolicy(self)


# %%
ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
attn = model.model.layers[0].self_attn
outputs = []
hook = attn.register_forward_hook(lambda mod, args, out: outputs.append(out[0].detach()))
with patch(model, student.policy()):
    student.train()
    logits = model(ids).logits
hook.remove()
captured = list(student.captured)
# recompute layer 0 by hand: project q, k, v of its input and attend under the reference mask
h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
B, S = ids.shape
hd = attn.head_dim
qh = attn.q_proj(h).view(B, S, -1, hd).transpose(1, 2)
kh = attn.k_proj(h).view(B, S, -1, hd).transpose(1, 2)
vh = attn.v_proj(h).view(B, S, -1, hd).transpose(1, 2)
cos, sin = model.model.rotary_emb(h, torch.arange(S)[None])
qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
prio = sc.priority(0, kh, vh, torch.arange(S).expand(B, kh.shape[1], S))
G = qh.shape[1] // kh.shape[1]
m = kvpop_mask_reference(prio.detach(), 3, 2, 4).repeat_interleave(G, 1)
out_ref, lse_ref = attention_reference(qh, kh, vh, m, scale=attn.scaling)
assert_close(outputs[0], attn.o_proj(out_ref.transpose(1, 2).reshape(B, S, -1)), atol=1e-5, rtol=1e-5)
assert_close(captured[0][0].detach(), prio.detach())
tgt_ref = sc.decayed(0, future_attention_target(qh, kh, 4, lse=lse_ref, method="dense"),
                     torch.arange(S).expand(B, kh.shape[1], S))
assert_close(captured[0][1], tgt_ref, atol=1e-5, rtol=1e-5)
with patch(model, student.policy()):
    student.eval()
    logits_eval = model(ids).logits
test_eq(len(student.captured), len(captured))  # eval mode captures nothing new
assert_close(logits_eval, logits.detach())  # and attends identically
test_eq((type(student.policy()), student.policy().student is student), (KVpopTrainPolicy, True))


# %%
#| export
@patch_to(KVpopStudent)
def fsdp_units(self) -> list[nn.Module]:
    "Each layer's scorer and decay: the policy calls their forward."
    return [*self.scorers.scorers, *self.scorers.decays]


# %%
test_eq(len(student.fsdp_units()), 2 * len(sc.scorers))


# %%
#| export
@patch_to(KVpopStudent)
def inference_cache(self) -> KVpopCache:
    return KVpopCache(self.scorers, self.sink, self.window, self.k)


# %%
test_eq((type(student.inference_cache()), student.inference_cache().rule.budget), (KVpopCache, 2 + 4 + 3))
test_fail(lambda: KVpopStudent("mlp", 2, 4, 3), exc=TypeError, contains="scorers must be a KVpopScorers, got str")
test_fail(lambda: KVpopStudent(sc, 2, 4, 3, agg="median"), contains="agg must be one of")
test_fail(lambda: KVpopStudent(sc, 2, 4, 3, tau=-1.0), contains="tau must be a finite number in (0, inf)")


# %% [markdown]
# Per layer one scorer and one decay; an mLSTM reads out `window` tokens late; student options pass through:

# %%
#| export
@patch_to(KVpopStudent, cls_method=True)
def for_shape(cls, num_layers: int, num_kv_heads: int, head_dim: int, sink: int, window: int, k: int,
              scorer: str = "mlp", n: int = 1, gamma_min: float = 0.999, gamma_max: float = 0.999999,
              device=None, **options) -> "KVpopStudent":
    "`for_model` for a model of `num_layers` layers of `num_kv_heads` KV heads of `head_dim`, on `device`."
    args = num_layers, num_kv_heads, head_dim
    if scorer == "mlp": sc = KVpopScorers.mlp(*args, n=n, gamma_min=gamma_min, gamma_max=gamma_max)
    elif scorer == "mlstm":
        sc = KVpopScorers.mlstm(*args, delay=window, n=n, gamma_min=gamma_min, gamma_max=gamma_max)
    else: raise ValueError(f"scorer must be 'mlp' or 'mlstm', got {scorer!r}")
    return cls(sc.to(device), sink, window, k, **options)


# %%
_st = KVpopStudent.for_shape(3, 2, 8, 2, 4, 3, scorer="mlstm", n=2, seed=7)
test_eq([type(s).__name__ for s in _st.scorers.scorers], ["MLSTMScorer"] * 3)
test_eq((_st.scorers.scorers[0].delay, _st.scorers.n, _st.seed, (_st.sink, _st.window, _st.k)), (4, 2, 7, (2, 4, 3)))
test_eq(len(_st.fsdp_units()), 6)
test_fail(lambda: KVpopStudent.for_shape(3, 2, 8, 2, 4, 3, scorer="gru"), contains="scorer must be 'mlp' or 'mlstm'")


# %%
#| export
@patch_to(KVpopStudent, cls_method=True)
def for_model(cls, model, sink: int, window: int, k: int, scorer: str = "mlp", n: int = 1, gamma_min: float = 0.999,
              gamma_max: float = 0.999999, **options) -> "KVpopStudent":
    "Fresh float32 scorers for `model`'s layers ('mlp', or 'mlstm' with delay = window, §3.3), Table 3 decays."
    info = model_info(model)
    return cls.for_shape(info.num_layers, info.num_kv_heads, info.head_dim, sink, window, k, scorer, n, gamma_min,
                         gamma_max, next(model.parameters()).device, **options)


# %%
_st = KVpopStudent.for_model(model, 2, 4, 3, gamma_min=0.99, gamma_max=0.999)
_info = model_info(model)
test_eq(len(_st.scorers.scorers), _info.num_layers)
# alpha starts at 0: log(gamma) halfway between log(gamma_min) and log(gamma_max), Eq. (21)
assert_close(_st.scorers.decays[0](), torch.full((_info.num_kv_heads,), (math.log(0.99) + math.log(0.999)) / 2))
test_eq(sorted(_st.state_dict()), sorted(KVpopStudent.for_shape(_info.num_layers, _info.num_kv_heads,
                                                                 _info.head_dim, 2, 4, 3).state_dict()))


# %%
#| export
@patch_to(KVpopStudent)
def method_loss(self, step: int) -> tuple[Tensor, dict[str, float]]:
    if not self.captured:
        raise RuntimeError("method_loss needs a training forward under policy() in train() mode first")
    captured, self.captured = self.captured, []
    return self._retention(captured, step)


# %%
test_fail(lambda: KVpopStudent(sc, sink=2, window=4, k=3).method_loss(0), contains="needs a training forward")


# %% [markdown]
# The retention loss averaged over layers equals the loop-based `retention_loss_reference` (Eq. 5–7) per
# layer on the raw scores, and its gradient reaches the scorers and decays only.

# %%
#| export
@patch_to(KVpopStudent)
def _retention(self, captured: list[tuple[Tensor, Tensor]], step: int) -> tuple[Tensor, dict[str, float]]:
    "Eq. (7) averaged over layers at the step's sampled boundary queries, and the top-k retention recall."
    S = captured[0][0].shape[-1]
    q = sample_boundary_queries(S, self.n_boundaries, self.sink, self.window, self.k, self.late_frac,
                                generator=step_generator(self.seed, step), device=captured[0][0].device)
    losses, recalls, (s, w, k) = [], [], (self.sink, self.window, self.k)
    for p, t in captured:
        cut = topk_cutoff(t.detach(), k, s, w)  # the teacher's ranks and cutoffs: for the loss and the recall
        losses.append(retention_loss(p, t, q, s, w, k, target_cutoff=cut, **self.loss_options))
        recalls.append(retention_recall(p.detach(), t, q, s, w, k, cut).float().mean())
    loss, recall = torch.stack(losses).mean(), torch.stack(recalls).mean()
    return self.weight * loss, {"retention_loss": loss.item(), "retention_recall": recall.item()}


# %%
student.captured = captured
loss, metrics = student.method_loss(step=5)
q = sample_boundary_queries(S, 8, 2, 4, 3, generator=step_generator(0, 5))
refs = []
for layer, (p, t) in enumerate(captured):
    pos = torch.arange(S).expand(B, kh.shape[1], S)
    lg = sc.decays[layer]()
    # reference on raw scores: recover them from the priorities (r = p + floor(t/n) log gamma)
    raw_p = p + pos.float() * lg.view(1, -1, 1)
    raw_t = t + pos.float() * lg.detach().view(1, -1, 1)
    refs.append(retention_loss_reference(raw_p, raw_t, lg, q.tolist(), 2, 4, 3))
assert_close(loss, torch.stack(refs).mean(), atol=1e-5, rtol=1e-5)
test_eq(student.captured, [])
loss.backward()
assert all(p.grad is not None for p in sc.parameters() if p.requires_grad and p.numel())
assert all(p.grad is None for p in model.parameters())  # the retention loss never reaches the backbone
sc.zero_grad()

# %% [markdown]
# ### The sparse and the dense target
#
# Alg. 1 normalizes the target with the sparse LSE of the student's own pass (Eq. 9) and runs later layers on the
# sparse model's activations; the paper notes that the dense normalizer gives the exact target of Eq. (2) "where
# exact supervision is desired". `target="dense"` is that exact variant: while training, each layer attends
# densely (the teacher's own pass, so later layers see the teacher's activations too) and the target uses the
# dense LSE; at inference (`eval()`) the student attends under its mask as always. With the base frozen,
# everything this loss reads (post-RoPE keys and values, the undecayed target) is then a fixed function of the
# window, so it can be computed once and cached; `cached_loss` is the same step from those cached tensors, without
# the model ([`sparsekv.kvpop.offline`](19_kvpop_offline.ipynb) builds the cache and checks the two agree).
# Which target to train on is our choice, not the paper's: the sparse one follows Alg. 1, the dense one Eq. (2).

# %%
dense_student = KVpopStudent(sc, sink=2, window=4, k=3, n_boundaries=8, target="dense")
outputs.clear()
hook = attn.register_forward_hook(lambda mod, args, out: outputs.append(out[0].detach()))
with patch(model, dense_student.policy()):
    dense_student.train()
    model(ids)
hook.remove()
out_dense, lse_dense = attention_reference(qh, kh, vh, None, scale=attn.scaling)
assert_close(outputs[0], attn.o_proj(out_dense.transpose(1, 2).reshape(B, S, -1)), atol=1e-5, rtol=1e-5)
tgt_dense = sc.decayed(0, future_attention_target(qh, kh, 4, method="dense"), torch.arange(S).expand(B, kh.shape[1], S))
assert_close(dense_student.captured[0][1], tgt_dense, atol=1e-5, rtol=1e-5)
assert (dense_student.captured[0][1] - captured[0][1]).abs().max() > 1e-3  # the two targets differ
dense_student.captured.clear()
with patch(model, dense_student.policy()):
    dense_student.eval()
    assert_close(model(ids).logits, logits.detach())  # inference is the same sparse attention
test_fail(lambda: KVpopStudent(sc, 2, 4, 3, target="exact"), contains="target must be one of")


# %% [markdown]
# `cached_loss` is the dense student's step from cached tensors: on random keys, values and undecayed targets of
# the two layers it equals `retention_loss_reference` on the scorers' raw scores, averaged over layers; a sparse
# student and a batch of the wrong number of layers are refused:

# %%
#| export
@patch_to(KVpopStudent)
def cached_loss(self, batch: dict, step: int) -> tuple[Tensor, dict[str, float]]:
    """`method_loss` of a `target="dense"` step from cached activations: `batch` holds per layer the post-RoPE
    'keys' and 'values' [B,L,Hkv,S,d] and the undecayed dense 'target' [B,L,Hkv,S] (`sparsekv.kvpop.offline`)."""
    if self.target != "dense":
        raise ValueError("cached activations hold the dense target (Eq. 2): train from them a student built with "
                         f"target='dense', not target={self.target!r}")
    keys, values, r_tgt = batch["keys"], batch["values"], batch["target"]
    if keys.dim() != 5 or keys.shape[1] != len(self.scorers.scorers):
        raise ValueError(f"batch['keys'] must be [B, L={len(self.scorers.scorers)}, Hkv, S, d], got "
                         f"{tuple(keys.shape)}")
    B, L, H, S, _ = keys.shape
    pos = torch.arange(S, device=keys.device).expand(B, H, S)
    captured = []
    for layer in range(L):
        pred = self.scorers.priority(layer, keys[:, layer].float(), values[:, layer].float(), pos)
        with torch.no_grad(): target = self.scorers.decayed(layer, r_tgt[:, layer], pos)
        captured.append((pred, target))
    return self._retention(captured, step)


# %%
_g = torch.Generator().manual_seed(4)
_L, _H, _d = len(sc.scorers), kh.shape[1], kh.shape[-1]
_batch = dict(keys=torch.randn(B, _L, _H, S, _d, generator=_g), values=torch.randn(B, _L, _H, S, _d, generator=_g),
              target=torch.randn(B, _L, _H, S, generator=_g))
_loss, _metrics = dense_student.cached_loss(_batch, step=5)
_refs = [retention_loss_reference(sc.raw(layer, _batch["keys"][:, layer], _batch["values"][:, layer]),
                                  _batch["target"][:, layer], sc.decays[layer](), q.tolist(), 2, 4, 3)
         for layer in range(_L)]
assert_close(_loss, torch.stack(_refs).mean(), atol=1e-5, rtol=1e-5)
test_eq(set(_metrics), {"retention_loss", "retention_recall"})
test_fail(lambda: student.cached_loss(_batch, 5), contains="train from them a student built with target='dense'")
test_fail(lambda: dense_student.cached_loss({**_batch, "keys": _batch["keys"][:, :1]}, 5),
          contains=f"batch['keys'] must be [B, L={_L}, Hkv, S, d]")


# %% [markdown]
# ### StreamingLLM+ at the same budget
#
# StreamingLLM+ trains the base model under a fixed pattern with the same per-head budget $B = s + w + k$:
# we give it the $s$ sinks and a recent window of $w + k$ tokens (the long-range slots become more window).
# It has no new parameters and no method loss, so it is trained in full mode.

# %%
#| export
class SinkWindowPolicy(MaskPolicy):
    "Query p attends to the first `sink` tokens and the `window` most recent ones (itself included)."

    def __init__(self, sink: int, window: int):
        self.sink, self.window = check_int(sink, "sink"), check_int(window, "window", 1)

    def mask(self, q, k, v, ctx):
        t, p = ctx.key_positions[:, :, None, :], ctx.query_positions[None, None, :, None]
        return sink_window_visible(self.sink, self.window)(p, t)


# %%
_ctx = SimpleNamespace(key_positions=torch.arange(8).expand(1, 1, 8), query_positions=torch.arange(6, 8))
test_eq(SinkWindowPolicy(2, 3).mask(None, None, None, _ctx)[0, 0].int().tolist(),
        [[1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1, 1]])
test_fail(lambda: SinkWindowPolicy(2, 0), contains="window")


# %%
#| export
class SinkWindowStudent(DistillStudent):
    "StreamingLLM+ (§4): `sink` sinks and a recent window of `window + k`, KVpop's budget s + w + k; no new parameters."

    def __init__(self, sink: int, window: int, k: int):
        super().__init__()
        self.k, self.sink, self.window = check_budget(k, sink, window)

    def policy(self) -> SinkWindowPolicy:
        return SinkWindowPolicy(self.sink, self.window + self.k)

    def inference_cache(self) -> SinkWindowCache:
        return SinkWindowCache(self.sink, self.window + self.k)


# %%
sw = SinkWindowStudent(2, 4, 3)
with patch(model, sw.policy()): out = model(ids).logits
with torch.no_grad(), patch(model, sw.policy()):
    step_logits = [chunked_prefill(model, ids[:, :j + 1], j + 1, cache=sw.inference_cache())[1] for j in range(S)]
assert_close(out[:, -1], step_logits[-1], atol=1e-5, rtol=1e-5)  # the training mask = the bounded cache's view
test_eq(sum(p.numel() for p in sw.parameters()), 0)


# %% [markdown]
# ## The trained methods
#
# KVpop and StreamingLLM+ are eviction methods (`sparsekv.kvpop.baselines.EvictionMethod`: the budget
# $B = s + w + k$ per KV head, split as there) whose student `sparsekv.distill` trains. `TrainedMethod.student`
# gives a fresh student for training (the CLI `python -m sparsekv.train --student NAME` picks it by
# method name); at inference the method uses the student's bounded cache, fresh (untrained: a neutral
# ranking) unless `checkpoint` names the `trained.pt` the CLI saves. Only the student's state is loaded
# from it: a full-mode run also saves the fine-tuned model (`"model"`), which is the model's to load.

# %% [markdown]
# A `trained.pt` must hold a student of the method that loads it. The CLI stores beside the student's state the
# method's name and `distill.student_spec` (class, submodule classes, parameter shapes), so a checkpoint of
# another method or scorer type (an MLP KVpop checkpoint loaded into `kvpop_mlstm`, a KVpop one into `dms`)
# is refused with an error naming both, and one trained on another model names the differing shapes. A file
# without that description (saved by hand) is still checked against the student's parameter names and shapes.

# %%
#| export
def _modules(spec: dict) -> set[str]:
    "The classes of a student spec's submodules that are not plain torch.nn modules (its scorers, decays, ...)."
    return {c for c in spec["modules"].values() if not hasattr(nn, c)}


# %%
test_eq(_modules(dict(modules={"a": "Linear", "b": "MLPScorer", "c": "ModuleList", "d": "LogDecay"})),
        {"MLPScorer", "LogDecay"})
test_eq(_modules(student_spec(SinkWindowStudent(2, 4, 3))), set())


# %% [markdown]
# Check: a student's own state passes, with or without its description; an MLP checkpoint refuses an mLSTM
# student naming both, with and without the description; a student of another model is refused by its shapes.

# %%
#| export
def check_trained(ckpt, path, name: str, student: nn.Module) -> None:
    "Raise a ValueError unless `ckpt` (a loaded trained.pt) holds a student state for method `name`'s `student`."
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("student"), dict):
        raise ValueError(f"checkpoint {path} holds no 'student' state: pass the trained.pt that python -m "
                         "sparsekv.train saves")
    now, saved = student_spec(student), ckpt.get("spec", {}).get("student")
    if saved is None:  # no description (saved by hand): compare parameter names and shapes
        saved = dict(type="a student", modules={}, shapes={k: list(v.shape) for k, v in ckpt["student"].items()})
    elif (saved["type"], _modules(saved)) != (now["type"], _modules(now)):
        was = ckpt.get("spec", {}).get("method", "another method")
        raise ValueError(f"checkpoint {path} holds a {was} student ({saved['type']}: "
                         f"{', '.join(sorted(_modules(saved))) or 'no submodules'}), not one of {name} "
                         f"({now['type']}: {', '.join(sorted(_modules(now))) or 'no submodules'})")
    missing = sorted(set(now["shapes"]) - set(saved["shapes"]))
    extra = sorted(set(saved["shapes"]) - set(now["shapes"]))
    if missing or extra:
        raise ValueError(f"checkpoint {path} holds another student than {name}'s ({now['type']}: "
                         f"{', '.join(sorted(_modules(now))) or 'no submodules'}): it lacks {len(missing)} of its "
                         f"entries {missing[:2]} and has {len(extra)} others {extra[:2]} "
                         "(another method or scorer type)")
    shapes = [f"{k} {saved['shapes'][k]} (now {v})" for k, v in now["shapes"].items()
              if saved["shapes"][k] != v]
    if shapes:
        raise ValueError(f"checkpoint {path} was trained on another model: the {name} student's shapes differ, "
                         + ", ".join(shapes[:3]))


# %%
mlp, mlstm = (KVpopStudent.for_model(model, 2, 4, 3, scorer=s) for s in ("mlp", "mlstm"))
ck = dict(student=mlp.state_dict(), spec=dict(method="kvpop_mlp", student=student_spec(mlp)))
check_trained(ck, "t.pt", "kvpop_mlp", KVpopStudent.for_model(model, 2, 4, 3))
check_trained(dict(student=mlp.state_dict()), "t.pt", "kvpop_mlp", KVpopStudent.for_model(model, 2, 4, 3))
test_fail(lambda: check_trained(ck, "t.pt", "kvpop_mlstm", mlstm),
          contains="holds a kvpop_mlp student (KVpopStudent: HeadwiseLinear, KVpopScorers, LogDecay, MLPScorer), "
                   "not one of kvpop_mlstm (KVpopStudent: HeadwiseLinear, KVpopScorers, LogDecay, MLSTMScorer)")
test_fail(lambda: check_trained(dict(student=mlp.state_dict()), "t.pt", "kvpop_mlstm", mlstm),
          contains="holds another student than kvpop_mlstm's (KVpopStudent: HeadwiseLinear, KVpopScorers, LogDecay, "
                   "MLSTMScorer)")
other_model = load_model("tiny-llama", num_layers=2, num_kv_heads=1)[0]
test_fail(lambda: check_trained(ck, "t.pt", "kvpop_mlp", KVpopStudent.for_model(other_model, 2, 4, 3)),
          contains="trained on another model")
test_fail(lambda: check_trained({"model": {}}, "t.pt", "kvpop_mlp", mlp), contains="holds no 'student' state")

# %% [markdown]
# Every file a trained student loads from carries its SHA-256: the training CLI (`python -m sparsekv.train`) writes
# `trained.pt.sha256` beside a `trained.pt` (`io.atomic_path_with_digest`), and a shipped student's `manifest.json`
# records the size and digest of each file of its folder under `files` (`write_shipped_manifest` adds them).
# `trained_digests` finds the record of a file, and loading refuses a file that does not match it
# (`distill.load_torch_file`), naming what re-installs or retrains it: some bytes zeroed in a `trained.pt` still load
# as a valid state, with changed weights.
#
# Every shipped student's folder holds these files:

# %%
#| export
SHIPPED_FILES = ("trained.pt", "history.csv")

# %%
for _d in Path(str(resources.files("sparsekv") / "checkpoints")).iterdir():
    if _d.is_dir(): test_eq([n for n in SHIPPED_FILES if (_d / n).is_file()], list(SHIPPED_FILES))


# %% [markdown]
# The digest of `b"abc"` is the SHA-256 test vector of FIPS 180-2; the manifest's other entries stay:

# %%
#| export
def manifest_with_digests(folder: str | Path, manifest: dict) -> dict:
    "`manifest` with `files`: the size and SHA-256 of each of `SHIPPED_FILES` in `folder` (what a load checks)."
    folder = Path(folder)
    missing = [n for n in SHIPPED_FILES if not (folder / n).is_file()]
    if missing: raise FileNotFoundError(f"{folder} lacks {missing}: a shipped student needs {list(SHIPPED_FILES)}")
    return {**manifest, "files": {n: {"bytes": (folder / n).stat().st_size, "sha256": file_sha256(folder / n)}
                                  for n in SHIPPED_FILES}}


# %%
with tempfile.TemporaryDirectory() as d:
    for n in SHIPPED_FILES: (Path(d)/n).write_bytes(b"abc")
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    test_eq(manifest_with_digests(d, {"name": "x"}),
            {"name": "x", "files": {n: {"bytes": 3, "sha256": abc} for n in SHIPPED_FILES}})
    (Path(d)/"trained.pt").unlink()
    test_fail(lambda: manifest_with_digests(d, {}), exc=FileNotFoundError, contains="lacks ['trained.pt']")


# %%
#| export
def write_shipped_manifest(folder: str | Path, manifest: dict) -> Path:
    "Write `folder/manifest.json`: `manifest` with the digests of the folder's files (`manifest_with_digests`)."
    return write_json(Path(folder) / "manifest.json", manifest_with_digests(folder, manifest))


# %%
with tempfile.TemporaryDirectory() as d:
    for n in SHIPPED_FILES: (Path(d)/n).write_bytes(n.encode())
    write_shipped_manifest(d, {"name": "x", "files": "replaced"})
    test_eq(json.loads((Path(d)/"manifest.json").read_text()),
            {"name": "x", "files": {n: {"bytes": len(n), "sha256": file_sha256(Path(d)/n)} for n in SHIPPED_FILES}})
    (Path(d)/"history.csv").unlink()
    test_fail(lambda: write_shipped_manifest(d, {}), contains="lacks ['history.csv']")


# %% [markdown]
# A `trained.pt` in a folder whose manifest records it is a shipped student's (re-installing restores it); any other
# is a training run's (its digest file, written by the training CLI).

# %%
#| export
def trained_digests(path: str | Path) -> tuple[list[str] | None, Path | None, str]:
    """(digests, where recorded, what rebuilds it) of a trained.pt: its folder's manifest (a shipped student), else its
    digest file; digests None when neither records one."""
    path = Path(path)
    manifest = path.parent / "manifest.json"
    try: entry = json.loads(manifest.read_text())["files"][path.name]
    except (OSError, ValueError, KeyError, TypeError): entry = None
    if isinstance(entry, dict) and "sha256" in entry:
        return [entry["sha256"]], manifest, (f"re-install sparsekv (pip install --force-reinstall --no-deps sparsekv; "
                                             f"in a clone: git checkout -- {path.parent}) or retrain it (the "
                                             "kvpop_train stage with ship=True)")
    return None, None, ("retrain it (python -m sparsekv.train --out FOLDER writes trained.pt with its digest) or "
                        "restore it and its .sha256 from a copy")


# %%
with tempfile.TemporaryDirectory() as d:
    for n in SHIPPED_FILES: (Path(d)/n).write_bytes(n.encode())
    test_eq(trained_digests(Path(d)/"trained.pt")[:2], (None, None))
    write_shipped_manifest(d, {})
    test_eq(trained_digests(Path(d)/"trained.pt")[:2], ([file_sha256(Path(d)/"trained.pt")], Path(d)/"manifest.json"))
    assert "re-install sparsekv" in trained_digests(Path(d)/"trained.pt")[2]


# %% [markdown]
# The shipped students are the folders of `sparsekv/checkpoints` that hold a `trained.pt` and its manifest:

# %%
#| export
def shipped_checkpoints() -> dict[str, dict]:
    "The trained students shipped in `sparsekv/checkpoints`: name -> manifest (model, data, settings, metrics, files)."
    root = resources.files("sparsekv") / "checkpoints"
    if not root.is_dir(): return {}
    out = {}
    for d in sorted(root.iterdir(), key=lambda d: d.name):
        if not ((d / "trained.pt").is_file() and (d / "manifest.json").is_file()): continue
        try: out[d.name] = json.loads((d / "manifest.json").read_text())
        except ValueError as e:
            raise ValueError(f"{d / 'manifest.json'} is not valid JSON ({e}): re-install sparsekv") from e
    return out


# %%
_root = Path(str(resources.files("sparsekv") / "checkpoints"))
test_eq(list(shipped_checkpoints()), sorted(d.name for d in _root.iterdir()
                                            if (d / "trained.pt").is_file() and (d / "manifest.json").is_file()))
test_eq(shipped_checkpoints()["smollm2-135m-cr75-mlstm"]["method"], "kvpop_mlstm")


# %%
#| export
def shipped_checkpoint(name: str, method: str, sink: int | None, window: int | None) -> tuple[Path, int, int]:
    "(path of trained.pt, sink, window) of shipped checkpoint `name` for `method`; sink and window default to its own."
    manifest = shipped_checkpoints()[name]
    if manifest["method"] != method:
        raise ValueError(f"checkpoint {name!r} holds a {manifest['method']} student, not one of {method}")
    trained = dict(sink=manifest["sink"], window=manifest["window"])
    given = dict(sink=trained["sink"] if sink is None else sink, window=trained["window"] if window is None else window)
    if given != trained:  # the mLSTM's readout delay is the window, and the scorers learnt that split
        raise ValueError(f"checkpoint {name!r} was trained with sink={trained['sink']}, window={trained['window']}; "
                         f"got sink={given['sink']}, window={given['window']}")
    return Path(str(resources.files("sparsekv") / "checkpoints" / name / "trained.pt")), given["sink"], given["window"]


# %%
_cm = shipped_checkpoints()["smollm2-135m-cr75-mlp"]
test_eq(shipped_checkpoint("smollm2-135m-cr75-mlp", "kvpop_mlp", None, _cm["window"]),
        (_root / "smollm2-135m-cr75-mlp" / "trained.pt", _cm["sink"], _cm["window"]))
test_fail(lambda: shipped_checkpoint("smollm2-135m-cr75-mlp", "kvpop_mlstm", None, None),
          contains="holds a kvpop_mlp student, not one of kvpop_mlstm")
test_fail(lambda: shipped_checkpoint("smollm2-135m-cr75-mlp", "kvpop_mlp", _cm["sink"] + 1, None),
          contains=f"was trained with sink={_cm['sink']}, window={_cm['window']}; got sink={_cm['sink'] + 1}")


# %% [markdown]
# The base class splits the budget as every eviction method does and leaves the student to its subclasses:

# %%
#| export
class TrainedMethod(EvictionMethod):
    """An eviction method trained by `distill`: `student(model)` for training; at inference its cache, from a fresh
    student (untrained) or the `checkpoint`: a `trained.pt` (the training CLI's, its 'student' state) or the name
    of a shipped one (`shipped_checkpoints()`, e.g. 'smollm2-135m-cr75-mlstm'; its sink and window by default)."""
    mode = "scorer_only"  # the distill mode its paper trains it in

    def __init__(self, budget: int, sink: int | None = None, window: int | None = None,
                 checkpoint: str | Path | None = None, chunk_size: int | None = None):
        if isinstance(checkpoint, str) and checkpoint in shipped_checkpoints():
            checkpoint, sink, window = shipped_checkpoint(checkpoint, self.name, sink, window)
        super().__init__(budget, sink, window, chunk_size)
        if self.k < 1:
            raise ValueError(f"budget={self.budget} leaves no long-range slot after sink={self.sink} and "
                             f"window={self.window}: "
                                        f"{self.name} needs budget >= sink + window + 1")
        if checkpoint is not None and not Path(checkpoint).is_file():
            raise FileNotFoundError(f"checkpoint must be the trained.pt that python -m sparsekv.train saves or a "
                                    f"shipped one of {sorted(shipped_checkpoints())}, {checkpoint!r} is neither")
        self.checkpoint, self._students = checkpoint, weakref.WeakKeyDictionary()

    def student(self, model, seed: int = 0, seq_len: int | None = None, steps: int | None = None) -> DistillStudent:
        "A fresh student for `model`; a method may use the training's sequence length `seq_len` and `steps` steps."
        raise NotImplementedError(f"{type(self).__name__} must implement student(model, ...)")

    def cache(self, model):
        return self.trained_student(model).inference_cache()


# %%
_tm = TrainedMethod(9, 2, 4)
test_eq((_tm.sink, _tm.window, _tm.k, _tm.checkpoint, _tm.mode), (2, 4, 3, None, "scorer_only"))
test_fail(lambda: _tm.student(model), exc=NotImplementedError, contains="TrainedMethod must implement student")
test_fail(lambda: TrainedMethod(6, 2, 4), contains="no long-range slot")
test_fail(lambda: TrainedMethod(9, 2, 4, checkpoint="missing/trained.pt"), contains="python -m sparsekv.train saves")


# %% [markdown]
# Without a checkpoint the student is the method's fresh one, in eval mode, built once per model; its cache is the
# student's bounded cache:

# %%
#| export
@patch_to(TrainedMethod)
def trained_student(self, model) -> DistillStudent:
    "The inference student of `model` in eval mode (fresh, or loaded from `checkpoint`), built once per model."
    if model not in self._students:
        st = self.student(model)
        if self.checkpoint is not None:
            digests, recorded_in, rebuild = trained_digests(self.checkpoint)
            ckpt = load_torch_file(self.checkpoint, rebuild, digests, recorded_in,
                                   map_location=next(model.parameters()).device, weights_only=True)
            check_trained(ckpt, self.checkpoint, self.name, st)
            st.load_state_dict(ckpt["student"])
        self._students[model] = st.eval()
    return self._students[model]


# %%
_tm.student = lambda model: SinkWindowStudent(2, 4, 3)
_ts = _tm.trained_student(model)
test_eq((type(_ts), _ts.training, _tm.trained_student(model) is _ts), (SinkWindowStudent, False, True))
test_eq((type(_tm.cache(model)), _tm.cache(model).rule.window), (SinkWindowCache, 4 + 3))


# %% [markdown]
# Options reach the student, and are checked when the method is built; a shipped checkpoint brings its own split
# and decay range:

# %%
#| export
class KVpopMLP(TrainedMethod):
    "KVpop with MLP scorers (§3.3): a `KVpopCache` of s sinks, w recent, k best priorities; options: `KVpopStudent`."
    name, scorer = "kvpop_mlp", "mlp"

    def __init__(self, budget: int, sink: int | None = None, window: int | None = None,
                 checkpoint: str | Path | None = None, chunk_size: int | None = None, **options):
        if isinstance(checkpoint, str) and checkpoint in shipped_checkpoints():
            # the decay range is no parameter (only alpha is): the scorers' own, from the manifest
            lg_min, lg_max = shipped_checkpoints()[checkpoint]["log_gamma_range"]
            options = dict(gamma_min=math.exp(lg_min), gamma_max=math.exp(lg_max), **options)
        super().__init__(budget, sink, window, checkpoint, chunk_size)
        accepted = ((set(inspect.signature(KVpopStudent.for_model).parameters)
                     | set(inspect.signature(KVpopStudent).parameters))
                    - {"model", "scorers", "sink", "window", "k", "scorer", "seed", "options", "device"})
        if set(options) - accepted:
            raise TypeError(f"unexpected options {sorted(set(options) - accepted)} for {self.name}; accepted: "
                            f"{sorted(accepted)}")
        self.options = options
        # every option checked now, on scorers of one layer and head, instead of when a model is patched
        KVpopStudent.for_shape(1, 1, 2, self.sink, self.window, self.k, scorer=self.scorer, **options)

    def student(self, model, seed: int = 0, seq_len: int | None = None, steps: int | None = None) -> KVpopStudent:
        return KVpopStudent.for_model(model, self.sink, self.window, self.k, scorer=self.scorer, seed=seed,
                                      **self.options)

    def policy(self) -> KVpopPolicy:
        return KVpopPolicy()


# %%
_mlp = KVpopMLP(9, 2, 4, n_boundaries=5, tau=2.0)
test_eq((_mlp.student(model, seed=3).n_boundaries, _mlp.student(model).loss_options["tau"]), (5, 2.0))
test_eq((_mlp.student(model, seed=3).seed, type(_mlp.policy())), (3, KVpopPolicy))
test_fail(lambda: KVpopMLP(9, 2, 4, tau=0), contains="tau must be a finite number in (0, inf)")
_shipped = KVpopMLP(512, checkpoint="smollm2-135m-cr75-mlp")
test_eq((_shipped.sink, _shipped.window, _shipped.checkpoint.name), (_cm["sink"], _cm["window"], "trained.pt"))
assert_close(math.log(_shipped.options["gamma_min"]), _cm["log_gamma_range"][0])


# %%
#| export
class KVpopMLSTM(KVpopMLP):
    "KVpop with mLSTM scorers read out `window` tokens late (§3.3, delayed readout)."
    name, scorer = "kvpop_mlstm", "mlstm"


# %%
_ml = KVpopMLSTM(9, 2, 4).student(model)
test_eq(({type(s).__name__ for s in _ml.scorers.scorers}, _ml.scorers.scorers[0].delay), ({"MLSTMScorer"}, 4))


# %% [markdown]
# Check: the methods build the students the classes above build by hand (same scorers from the same seed),
# their caches keep s + w + k entries per head while generating, a checkpoint's student state is loaded, and a
# budget without a long-range slot is refused.

# %%
#| export
class StreamingLLMPlus(TrainedMethod):
    "StreamingLLM+ (§4): StreamingLLM's sinks and window + k recent tokens, the base model fine-tuned (full mode)."
    name, mode = "streaming_llm_plus", "full"

    def student(self, model, seed: int = 0, seq_len: int | None = None, steps: int | None = None) -> SinkWindowStudent:
        return SinkWindowStudent(self.sink, self.window, self.k)


# %%
m = KVpopMLSTM(2 + 4 + 3, sink=2, window=4)
torch.manual_seed(0)
by_hand = KVpopStudent.for_model(model, 2, 4, 3, scorer="mlstm")
torch.manual_seed(0)
st = m.student(model)
test_eq((st.sink, st.window, st.k), (2, 4, 3))
for a, b in zip(by_hand.state_dict().values(), st.state_dict().values()): assert torch.equal(a, b)
with m.patch(model) as cache:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=5,
                         do_sample=False, pad_token_id=0)
test_eq(out.shape, (2, 24 + 5))
# bounded: s + w + k (the mLSTM's unread token included)
test_eq({layer.keys.shape[2] for layer in cache.layers}, {2 + 4 + 3})
test_eq(type(StreamingLLMPlus(9, 2, 4).cache(model)).__name__, "SinkWindowCache")
test_eq(StreamingLLMPlus(9, 2, 4).cache(model).rule.window, 4 + 3)
with tempfile.TemporaryDirectory() as d:
    for p in st.parameters(): p.data.add_(1.0)
    torch.save({"student": st.state_dict()}, Path(d)/"trained.pt")
    loaded = KVpopMLSTM(9, 2, 4, checkpoint=Path(d)/"trained.pt").trained_student(model)
    for a, b in zip(st.state_dict().values(), loaded.state_dict().values()): assert torch.equal(a, b)
    test_eq(loaded.training, False)
test_fail(lambda: KVpopMLP(6, sink=2, window=4), contains="no long-range slot")
test_fail(lambda: KVpopMLP(9, checkpoint="missing/trained.pt"), contains="is neither")
test_fail(lambda: KVpopMLP(9, tau_typo=1.0), contains="unexpected options")

# %% [markdown]
# Check the digests: every shipped file matches its manifest; a copy of a shipped folder loads without a word, and
# with 256 bytes of its `trained.pt` zeroed (size and modification time kept) is refused naming the file, the
# digest expected and how to re-install it. A `trained.pt` written with its digest file behaves the same way; one
# without (saved by hand, or by an older version) loads with a warning saying how to record its digest, and one that
# torch cannot read is refused naming it.

# %%
import os
import shutil
import warnings

from sparsekv.io import DamagedFileError, atomic_path_with_digest


def zero_bytes(path, n=256):
    "Zero `n` bytes in the middle of `path`, keeping its size and modification time."
    st = path.stat()
    with open(path, "r+b") as f: f.seek(st.st_size // 2); f.write(bytes(n))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def load_quietly(method):
    "The method's trained student for the tiny model, and the warnings loading it raised."
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        method.trained_student(model)
    return [str(x.message) for x in w]


root = Path(str(resources.files("sparsekv") / "checkpoints"))
for name, manifest in shipped_checkpoints().items():
    test_eq(sorted(manifest["files"]), sorted(SHIPPED_FILES))
    for f, entry in manifest["files"].items():
        test_eq((entry["bytes"], entry["sha256"]), ((root/name/f).stat().st_size, file_sha256(root/name/f)))
with tempfile.TemporaryDirectory() as d:
    shipped = Path(shutil.copytree(root/"smollm2-135m-cr75-mlp", Path(d)/"cr75"))
    test_eq(trained_digests(shipped/"trained.pt")[:2],
            ([shipped_checkpoints()["smollm2-135m-cr75-mlp"]["files"]["trained.pt"]["sha256"]],
             shipped/"manifest.json"))
    zero_bytes(shipped/"trained.pt")
    sm = load_model("tiny-llama", num_layers=30, num_heads=9, num_kv_heads=3, hidden_size=9 * 64)[0]
    test_fail(lambda: KVpopMLP(512, 4, 64, checkpoint=shipped/"trained.pt").trained_student(sm), exc=DamagedFileError,
              contains=f"{shipped/'trained.pt'} is damaged: its SHA-256 is")
    test_fail(lambda: KVpopMLP(512, 4, 64, checkpoint=shipped/"trained.pt").trained_student(sm),
              contains="re-install sparsekv")
    user = Path(d)/"run"/"trained.pt"
    with atomic_path_with_digest(user) as tmp: torch.save({"student": st.state_dict()}, tmp)
    test_eq(load_quietly(KVpopMLSTM(9, 2, 4, checkpoint=user)), [])
    zero_bytes(user)
    test_fail(lambda: KVpopMLSTM(9, 2, 4, checkpoint=user).trained_student(model), exc=DamagedFileError,
              contains=f"{user} is damaged")
    (Path(d)/"run"/"trained.pt.sha256").unlink()
    torch.save({"student": st.state_dict()}, user)
    assert "loaded unverified" in load_quietly(KVpopMLSTM(9, 2, 4, checkpoint=user))[0]
    os.truncate(user, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        test_fail(lambda: KVpopMLSTM(9, 2, 4, checkpoint=user).trained_student(model), exc=DamagedFileError,
                  contains=f"{user} cannot be read by torch.load")
