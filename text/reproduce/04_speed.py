# %% [markdown]
# # End-to-end speed: decode tokens per second and time to first token, every method on SmolLM2
#
# > What a user of `sparsekv.methods` measures: whole-model decode steps and prefills, dense against every method, side by side on this CPU, with the attention module's share of each step.

# %% [markdown]
# The attention-module benchmarks (`kvpop_decode`, `quoka_latency`, `oval_latency`) time one
# layer's attention. A user runs the whole model: the weights, the cache and every layer. This
# stage times what `methods.make(name, budget)` gives a user, on SmolLM2-135M, batch 1:
#
# - **decode**: one greedy step at context $L$ under the method's own cache and policy
#   (`Method.cache`, `Method.policy`), against transformers' default (`DynamicCache`, the
#   unpatched model) in the same loop; the budget is `budget_fraction` of $L$ KV entries per KV
#   head. The attention share is the time inside the method's attention policy (scoring,
#   selection, gathering and attention of every layer) over the step's time; the cache share
#   the time inside the cache's `update` (the writes, and an evicting cache's scoring and
#   eviction), for the method and for the default.
# - **time to first token**: the prefill of $L$ prose tokens as `Method.generate` runs it
#   (chunked in `chunk_size` for selection methods, the whole prompt for dense), against the same
#   default, then one decode step.
#
# The contexts in `long_contexts` (32k in the cpu profile) are timed for `long_context_methods`
# only (dense and page retrieval, the methods the 32k goal is about), to keep the stage short.
#
# How each cache reaches context $L$ without a long prefill per method (timing depends on the
# shapes, not the values):
#
# - **dense, selection and retrieval methods** keep every token: their cache is filled with the
#   same $L$ random keys and values per layer (`fill`). A retrieval method builds the summaries of
#   all pages at its first decode step, and a selection method normalizes all keys once; that
#   first step is timed apart (`first_step_seconds`) and excluded from the steady-state steps.
# - **eviction methods** keep at most their budget: their cache is filled by a real chunked
#   prefill of $\min(L, 2B)$ prose tokens under their policy, after which a decode step does the
#   same work at any later position (the cache holds $B$ entries either way). Its row at $L$
#   therefore times the step at position $\min(L, 2B)$; the table says so.
#
# **Clock and ratios.** Each step is timed by the CPU time of the calling thread
# (`time.thread_time`, blind to waits on a shared machine) with wall time beside it; the
# default and the method alternate step by step, and every ratio is the median over steps of
# the ratio within a step. A step times the model's forward alone: `Method.generate` patches the
# model once for all its steps, so entering and leaving the patch (about 10 ms on SmolLM2, a
# walk over every module) is no part of a step. Thread counts are set with
# `torch.set_num_threads`; with 2 threads the CPU time counts only the calling thread's share of
# the work, so at 2 threads the wall clock is the one reported.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "smollm2-135m"
dtype = "float32"
device = "cpu"
contexts = [512, 1024]
budget_fraction = 0.125  # B = budget_fraction * L entries per KV head
method_names = ["dense", "streaming_llm", "tova", "kvpop_mlp", "quoka", "sparq", "quest", "key_pca", "oval"]
long_contexts = []             # contexts timed for long_context_methods only (instead of method_names)
long_context_methods = ["dense", "quest", "oval"]
threads = [1]
repeats = 3
ttft_contexts = [256]
ttft_methods = ["dense", "quoka", "tova"]
ttft_repeats = 1
seed = 0

# %%
import contextlib
import gc
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from sparsekv import methods
from sparsekv.data import token_stream
from sparsekv.hf import chunked_prefill, patch
from sparsekv.io import save_figure, use_style, write_csv, write_text
from sparsekv.models import load_model, model_info

use_style()
model, tok = load_model(model_name, dtype=dtype, device=device)
info = model_info(model)
prose = token_stream(tok)[None].to(device)
cuda = torch.device(device).type == "cuda"
print(info, f"{torch.get_num_threads()} threads by default")


# %%
def cpu_seconds(fn) -> dict:
    "CPU time of this thread and wall time of fn() (synchronized on CUDA, where the wall time is the one to read)."
    if cuda: torch.cuda.synchronize(device)
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    if cuda: torch.cuda.synchronize(device)
    return {"seconds": time.thread_time() - c0, "wall_seconds": time.perf_counter() - w0}


def timed(policy):
    """`policy`, its class swapped for a subclass (isinstance checks still hold) that counts its attention calls in
    `policy.calls` and adds their CPU time to `policy.attention_seconds`."""
    class Timed(type(policy)):
        def __call__(self, q, k, v, ctx):
            t = time.thread_time()
            out = super().__call__(q, k, v, ctx)
            self.attention_seconds += time.thread_time() - t
            self.calls += 1
            return out

    policy.__class__, policy.attention_seconds, policy.calls = Timed, 0.0, 0
    return policy


class Decoder:
    """A cache, the policy it decodes under (None: transformers' default, unpatched) and the next token; the CPU time
    inside the cache's `update` (every layer's write, and an evicting cache's scoring and eviction) adds up in
    `cache_seconds`."""

    def __init__(self, cache, policy=None, token: int = 0):
        self.cache, self.policy, self.token = cache, policy, torch.tensor([[token]], device=device)
        self.cache_seconds, update = 0.0, cache.update

        def timed_update(*args, **kwargs):
            t = time.thread_time()
            out = update(*args, **kwargs)
            self.cache_seconds += time.thread_time() - t
            return out
        cache.update = timed_update  # an instance attribute: each attention layer calls cache.update

    def forward(self):
        self.token = model(self.token, past_key_values=self.cache, use_cache=True).logits[:, -1:].argmax(-1)

    def step(self) -> dict:
        """One decode step; the times of the forward alone (`generate` patches the model once for all its steps, so
        entering the patch is not part of a step)."""
        with torch.no_grad(), patch(model, self.policy) if self.policy is not None else contextlib.nullcontext():
            return cpu_seconds(self.forward)

    def attention_seconds(self) -> float:
        return getattr(self.policy, "attention_seconds", float("nan"))


def synthetic_kv(L: int) -> list:
    "L random keys and values per layer, [1, Hkv, L, D] each (the same for every method at this L)."
    g = torch.Generator().manual_seed(seed + L)
    shape = (1, info.num_kv_heads, L, info.head_dim)
    return [tuple(torch.randn(shape, generator=g, dtype=model.dtype).to(device) for _ in "kv")
            for _ in range(info.num_layers)]


def fill(cache, kv: list):
    "`cache` holding the keys and values `kv` in every layer, written as a prefill writes them."
    for layer, (k, v) in enumerate(kv): cache.update(k, v, layer)
    return cache


def make(name: str, L: int) -> methods.Method:
    "Method `name` at a budget of budget_fraction * L entries per KV head (dense: no budget)."
    return methods.make(name) if name == "dense" else methods.make(name, max(1, round(budget_fraction * L)))


def method_decoder(name: str, L: int, kv: list) -> tuple[Decoder, int]:
    "A decoder of method `name` at budget_fraction of L, and the position its steps run at."
    m = make(name, L)
    B, policy = m.budget, timed(m.policy())
    if m.family != "eviction": return Decoder(fill(m.cache(model), kv), policy), L
    n = min(L, 2 * B)  # a bounded cache: steady after 2B tokens
    cache, last = chunked_prefill(model, prose[:, :n], m.chunk_size or n, policy, m.cache(model))
    return Decoder(cache, policy, int(last.argmax(-1))), n


# %% [markdown]
# A check of the synthetic fill: at the smallest context, the default decoding from a real
# prefill of prose and from random keys and values take the same time per step (their ratio is
# printed, not asserted: the machine is shared), and each method's step runs with its policy
# called once per layer.

# %%
L0 = min(contexts)
real = Decoder(chunked_prefill(model, prose[:, :L0], 128)[0])
synth = Decoder(fill(DynamicCache(config=model.config), synthetic_kv(L0)))
for d in (real, synth): d.step()
steps = [{"fill": name, **d.step()} for _ in range(repeats) for name, d in (("real", real), ("synthetic", synth))]
medians = pd.DataFrame(steps).groupby("fill").seconds.median()
synthetic_over_real = medians["synthetic"] / medians["real"]
print(f"synthetic / real fill, time per step: {synthetic_over_real:.2f}")
del real, synth

_dec, _ = method_decoder("quoka", L0, synthetic_kv(L0))
_dec.step()
assert _dec.policy.calls == info.num_layers and _dec.policy.attention_seconds > 0 and _dec.cache_seconds > 0
del _dec


# %% [markdown]
# ## Decode

# %%
def decode_rows(name: str, L: int, kv: list) -> list[dict]:
    "Steady-state decode steps of `name` at L alternating with the default's at each thread count, and its first step."
    torch.set_num_threads(max(threads))
    base = Decoder(fill(DynamicCache(config=model.config), kv))
    dec, at = method_decoder(name, L, kv)
    first = dec.step()["wall_seconds"]  # summaries, unit keys: built once
    base.step()
    rows = []
    for n in threads:
        torch.set_num_threads(n)
        for j in range(repeats):
            for who, d in [("default", base), (name, dec)][::(-1) ** j]:  # alternate who goes first
                a0, c0 = d.attention_seconds(), d.cache_seconds
                t = d.step()
                rows.append({"L": L, "threads": n, "method": name, "who": who, "step": j, "position": at, **t,
                             "attention_seconds": d.attention_seconds() - a0, "cache_seconds": d.cache_seconds - c0,
                             "first_step_seconds": first})
    return rows


decode = []
for L in tqdm([*contexts, *long_contexts], desc="contexts"):
    kv = synthetic_kv(L)
    names = long_context_methods if L in long_contexts else method_names
    for name in tqdm(names, desc=f"L={L}", leave=False):
        decode += decode_rows(name, L, kv)
        gc.collect()  # a Decoder and its cache reference each other (the timed update): free them before the next
    del kv
decode = pd.DataFrame(decode)
decode.groupby(["L", "threads", "method", "who"], sort=False)[["seconds", "wall_seconds"]].median()


# %%
def step_ratios(df: pd.DataFrame, keys: list, col: str, how: str = "median") -> pd.Series:
    "Per keys: the `how` (median, min, max) over steps of default / method of `col` within a step."
    wide = df.pivot_table(index=keys + ["step"], columns="who", values=col)
    return (wide["default"] / wide.drop(columns="default").max(axis=1)).groupby(keys).agg(how)


keys = ["L", "threads", "method"]
own = decode[decode.who != "default"].groupby(keys, sort=False)
default = decode[decode.who == "default"].groupby(keys, sort=False)
summary = pd.DataFrame({
    "position": own.position.first(),
    "ms_per_token": 1e3 * own.wall_seconds.median(),
    **{f"speedup_{how}_{clock}": step_ratios(decode, keys, col, how)
       for how in ("median", "min", "max") for clock, col in (("cpu", "seconds"), ("wall", "wall_seconds"))},
    "attention_share": own.attention_seconds.median() / own.seconds.median(),
    "cache_share": own.cache_seconds.median() / own.seconds.median(),
    "default_cache_share": default.cache_seconds.median() / default.seconds.median(),
    "first_step_s": own.first_step_seconds.first(),
}).reset_index()
on_cpu_clock = (summary.threads == 1) & (not cuda)
for how, name in (("median", "speedup"), ("min", "slowest_step"), ("max", "fastest_step")):
    summary[name] = summary[f"speedup_{how}_cpu"].where(on_cpu_clock, summary[f"speedup_{how}_wall"])
summary["tokens_per_s"] = 1e3 / summary.ms_per_token
write_csv(Path(fig_dir)/"speed_decode.csv", summary)
summary


# %% [markdown]
# ## Time to first token

# %%
def ttft_seconds(name: str, L: int) -> dict:
    """Times of `name`'s prefill of L prose tokens (in its chunks, else in one call) and its first decode step (which
    builds a retrieval method's page summaries)."""
    m = make(name, L)

    def run():
        policy = m.policy()
        cache, last = chunked_prefill(model, prose[:, :L], m.chunk_size or L, policy, m.cache(model))
        with torch.no_grad(), patch(model, policy):
            model(last.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
    return cpu_seconds(run)


def default_ttft(L: int) -> dict:
    "transformers' default: one forward over the prompt into a DynamicCache, then one decode step."
    def run():
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            last = model(prose[:, :L], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            model(last.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
    return cpu_seconds(run)


ttft = []
torch.set_num_threads(max(threads))
for L in ttft_contexts:
    for name in ttft_methods:
        for j in range(ttft_repeats):
            ttft += [{"L": L, "method": name, "who": "default", "step": j, **default_ttft(L)},
                     {"L": L, "method": name, "who": name, "step": j, **ttft_seconds(name, L)}]
ttft = pd.DataFrame(ttft)
ttft_summary = pd.DataFrame({
    "seconds": ttft[ttft.who != "default"].groupby(["L", "method"], sort=False).wall_seconds.median(),
    "speedup": step_ratios(ttft, ["L", "method"], "wall_seconds")}).reset_index()
write_csv(Path(fig_dir)/"speed_ttft.csv", ttft_summary)
ttft_summary

# %%
fig, axes = plt.subplots(1, len(threads), figsize=(5.2 * len(threads) + 1.5, 3.8), squeeze=False, sharey=True,
                         layout="constrained")
for ax, n in zip(axes[0], threads):
    for m, g in summary[summary.threads == n].groupby("method", sort=False):
        ax.plot(g.L, g.speedup, marker="o", label=m)
    ax.axhline(1, color="k", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="context $L$ (tokens)", title=f"{n} thread(s)")
axes[0][0].set_ylabel("decode speed-up over transformers' default")
fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside right", fontsize=9)
fig.suptitle(f"End-to-end decode, {model_name}, batch 1, budget {budget_fraction:g} of the context per KV head")
save_figure(fig, Path(fig_dir)/"speed_decode.png", data=summary)
plt.show()


# %% [markdown]
# ## Summary and the goals

# %%
def at(df: pd.DataFrame, **where) -> pd.Series:
    "The one row of df matching `where` (None if absent)."
    rows = df.loc[(df[list(where)] == pd.Series(where)).all(axis=1)]
    return rows.iloc[0] if len(rows) else None


def goal_line(what: str, row, target: float) -> str:
    "A goal's row; a median below target whose steps' ratios reach it reads as a tie (no difference the steps show)."
    if row is None: return f"| {what} | >= {target:g}x | not measured in this profile |"
    if row.speedup >= target: verdict = "met"
    elif row.fastest_step >= target: verdict = f"tied: the steps' ratios span {row.slowest_step:.2f}-{row.fastest_step:.2f}x"
    else: verdict = "not met"
    return f"| {what} | >= {target:g}x | {row.speedup:.2f}x ({verdict}) |"


n1 = min(threads)
goals = ["| goal | target | measured (1 thread) |", "|---|---|---|",
         goal_line("OVAL decode at 8k", at(summary, L=8192, threads=n1, method="oval"), 1.5),
         goal_line("OVAL decode at 32k", at(summary, L=32768, threads=n1, method="oval"), 2.5),
         goal_line("KVpop (MLP) decode at 2k", at(summary, L=2048, threads=n1, method="kvpop_mlp"), 1.0),
         goal_line("dense (GrowingCache) at 1k: no slower", at(summary, L=1024, threads=n1, method="dense"), 1.0),
         goal_line("dense (GrowingCache) at 8k: faster", at(summary, L=8192, threads=n1, method="dense"), 1.0)]
lines = [f"{model_name} ({info.num_layers} layers, {info.num_kv_heads} KV heads, d = {info.head_dim}, {dtype}), batch 1, "
         f"on this CPU. Budget B = {budget_fraction:g} L per KV head. Speed-up: transformers' default "
         "(DynamicCache, unpatched) over the method, the median over "
         f"{repeats} alternating steps of the ratio within a step (CPU time of the thread at 1 thread, wall time at "
         f"more; slowest_step and fastest_step: the smallest and largest of those ratios). Synthetic against real fill at L = {L0}: {synthetic_over_real:.2f}x per step. Eviction methods run "
         "at position min(L, 2B) (their cache holds B entries at any later position). Attention share: time inside "
         "the method's attention policy (scoring, selection, attention) over the step; cache share: time inside the "
         "cache's update (writes; an evicting cache's scoring and eviction), the method's and the default's.", "",
         summary.drop(columns=summary.filter(like="speedup_").columns).to_markdown(index=False, floatfmt=".3g"), "",
         f"Time to first token ({max(threads)} thread(s), wall): prefill of L prose tokens as `Method.generate` runs "
         "it, then one decode step; speed-up over the default's one-call prefill.", "",
         ttft_summary.to_markdown(index=False, floatfmt=".3g"), "", "**Goals of the end-to-end speed issue**", "",
         *goals, ""]
write_text(Path(out_dir)/"speed.md", "\n".join(lines))
print("\n".join(lines))
