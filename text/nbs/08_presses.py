# %% [markdown]
# # kvpress presses as methods
#
# > kvpress's presses in sparsekv's harness: `presses.make("snapkv", budget=256)` is a `Method` like any other, so its rows sit beside ours in one table.

# %%
#| default_exp presses

# %%
#| export
from __future__ import annotations

import contextlib
import importlib
import importlib.util

from transformers import DynamicCache

from sparsekv.attention import check_int
from sparsekv.hf import DensePolicy, Method, attention_modules, left_padding, patch

# %%
#| hide
import torch
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close

from sparsekv import methods
from sparsekv.hf import measure_attended
from sparsekv.models import load_model
from sparsekv.protocol import continuation, measured_budget

torch.set_num_threads(1)  # tiny model: threads only add overhead


# %% [markdown]
# [kvpress](https://github.com/NVIDIA/kvpress) is the library people use to compress a KV cache. Its
# *presses* work mostly in one setting, **post-prefill compression** (its decoding wrappers, which compress
# every few generated tokens, are not run here). The prompt is prefilled densely, and as each
# attention layer finishes the prefill the press scores that layer's cached entries and keeps the best
# `int(S * (1 - compression_ratio))` of the prompt's `S`; generation then appends to the compressed cache,
# which grows again by one entry per new token. Our eviction methods evict *while reading* (a bounded cache
# from the first token on), our selection methods choose keys per prefill chunk, and retrieval methods
# choose pages per decode query: kvpress cannot express those, but its setting is easy to express here.
#
# This module runs a press as a sparsekv `Method` (it needs kvpress: the `peers` extra):
#
# - the budget is ours: `budget` entries per KV head after the prefill, turned into the ratio that makes
#   the press keep exactly that many of the prompt's tokens (`keep_ratio`);
# - attention is sparsekv's exact `DensePolicy` over what the press kept, so `measure_attended` measures the
#   entries every query attended to, as for every other method;
# - the press's own scoring (`press.compress`, kvpress's public interface) runs from a forward hook of ours
#   on each attention module after the first prefill call, the moment kvpress's own hook runs.
#
# Presses are not entries of `sparsekv.methods`' registry (that holds this package's methods and needs no
# optional dependency); `presses.make(name, budget, **press_options)` builds one, `presses.names()` lists
# them.
#
# ## The ratio that keeps `budget` entries
#
# kvpress keeps $n(S, \rho) = \lfloor S(1 - \rho)\rfloor$ of $S$ entries at compression ratio $\rho$
# (`compute_n_kept`, at least 1; StreamingLLM writes the same floor). To keep $b < S$ entries we choose
# $\rho = 1 - (b + \frac12)/S$: then $S(1-\rho) = b + \frac12$, whose floor is $b$ with half an entry of
# room for rounding either way. At $b \ge S$ nothing is compressed ($\rho = 0$).

# %%
#| export
def keep_ratio(budget: int, n_tokens: int) -> float:
    "kvpress's compression ratio that keeps exactly `budget` of `n_tokens` entries (0 when they all fit)."
    check_int(budget, "budget", 1); check_int(n_tokens, "n_tokens", 1)
    return 0.0 if budget >= n_tokens else 1 - (budget + 0.5) / n_tokens


# %%
for S in range(1, 300):
    for b in range(1, S + 3):
        rho = keep_ratio(b, S)
        assert 0 <= rho < 1
        test_eq(max(1, int(S * (1 - rho))), min(b, S))   # kvpress's count at that ratio
test_fail(lambda: keep_ratio(0, 10), contains="budget")

# %% [markdown]
# ## Which presses
#
# The presses below run offline from a compression ratio alone (checked on the tiny model further down).
# Presses that wrap another press (AdaKV, ChunkKV, Block, Decoding and the like) or hook attention
# themselves are not included: AdaKV masks entries per head through kvpress's own attention patch, which our
# exact attention does not read. These need downloads or a model they were fitted on, so they cannot run on
# these machines: QFilter, DuoAttention, KVzip, FastKVzip, KVzap, KVgrad, RestoreKV, LUKV and the
# ExpectedAttention statistics variant. ObservedAttention needs the attention weights of an eager forward,
# which our exact attention does not return.

# %%
#| export
PRESSES = {  # name: kvpress class
    "knorm": "KnormPress", "snapkv": "SnapKVPress", "expected_attention": "ExpectedAttentionPress",
    "tova": "TOVAPress", "streaming_llm": "StreamingLLMPress", "keydiff": "KeyDiffPress",
    "pyramidkv": "PyramidKVPress", "lagkv": "LagKVPress", "random": "RandomPress",
    "leverage": "LeverageScorePress", "cur": "CURPress", "compactor": "CompactorPress",
    "non_causal_attention": "NonCausalAttnPress",
}


def names() -> list[str]:
    "The presses `make` builds, sorted."
    return sorted(PRESSES)


# %%
test_eq(names()[:3], ["compactor", "cur", "expected_attention"])
test_eq(len(names()), len(set(PRESSES.values())))


# %%
#| export
def available() -> bool:
    "Whether kvpress is installed here (the peer environment), so that presses run."
    return importlib.util.find_spec("kvpress") is not None


# %%
test_eq(available(), importlib.util.find_spec("kvpress") is not None)


# %% [markdown]
# kvpress caps transformers below 5.3, so it lives in an environment of its own (`make peers` builds
# `.venv-peers`; the README says which transformers each holds). Elsewhere a press is refused in one line
# that says so:

# %%
#| export
def make_press(name: str, **options):
    "A fresh kvpress press `name` (one of `names()`) with its `options`; the ratio is set at each prefill."
    if name not in PRESSES: raise ValueError(f"name must be one of {names()}, got {name!r}")
    try: kvpress = importlib.import_module("kvpress")
    except ImportError as e:
        raise ImportError("presses need kvpress, which caps transformers below 5.3: `make peers` builds the peer "
                          "environment .venv-peers that has it (or pip install 'sparsekv[peers]' in its own "
                          "environment)") from e
    if "compression_ratio" in options:
        raise TypeError("compression_ratio: the press keeps `budget` entries; pass budget to make() instead")
    return getattr(kvpress, PRESSES[name])(**options)


# %%
test_fail(lambda: make_press("snapk"), contains="name must be one of")
if not available(): test_fail(lambda: make_press("knorm"), contains="`make peers` builds the peer environment")


# %% [markdown]
# ## Compressing to the budget after the prefill
#
# `compress_after_prefill(model, press, budget)` hooks every attention module. After a module's first
# prefill call, when the cache holds exactly the call's tokens (kvpress's test, there on the last cache
# position), it sets the press's ratio for that prompt length and replaces the layer's keys
# and values by what `press.compress` keeps. Later calls (decode steps) leave the cache alone. As kvpress does,
# it lends each attention module the model's rotary embedding for the block (presses that rotate queries read
# it there), and takes it back afterwards.

# %%
#| export
def is_first_prefill(layer, n_queries: int) -> bool:
    "Whether an attention call of `n_queries` tokens read the whole prompt: its cache `layer` holds exactly those."
    return layer.get_seq_length() == n_queries


# %%
from types import SimpleNamespace

layer = SimpleNamespace(get_seq_length=lambda: 5)
test_eq([is_first_prefill(layer, n) for n in (1, 4, 5)], [False, False, True])


# %%
#| export
@contextlib.contextmanager
def compress_after_prefill(model, press, budget: int):
    "Within the block, each attention layer's prefill cache is cut to `budget` entries per KV head by `press`."
    check_int(budget, "budget", 1)

    def hook(module, args, kwargs, output):
        h = kwargs["hidden_states"]
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        if not is_first_prefill(layer, h.shape[1]): return output
        press.compression_ratio = keep_ratio(budget, layer.keys.shape[2])
        if press.compression_ratio:
            layer.keys, layer.values = press.compress(module, h, layer.keys, layer.values, output[1], kwargs)
        return output

    press.post_init_from_model(model)
    mods = attention_modules(model)
    # presses that rotate queries (ExpectedAttention, SnapKV's window) read the model's RoPE from the module
    lent = [m for m in mods if not hasattr(m, "rotary_emb")]
    for m in lent: m.rotary_emb = model.model.rotary_emb
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in mods]
    try: yield
    finally:
        for hd in handles: hd.remove()
        for m in lent: del m.rotary_emb


# %%
with contextlib.ExitStack() as stack:
    test_fail(lambda: stack.enter_context(compress_after_prefill(None, None, 0)), contains="budget must be an int >= 1")


# %% [markdown]
# ## The method
#
# `PressMethod` is a `Method` of the eviction family (it keeps a subset of the prompt's entries), with one
# difference the leaderboard names as its setting: it compresses once, after the prefill, and does not bound
# what generation adds. Its cache is transformers' `DynamicCache`, the cache kvpress edits. A padded batch is
# refused: kvpress keeps the same number of entries in every row, padding included.

# %%
#| export
class PressMethod(Method):
    "kvpress press `press` (see `names()`): dense prefill, the prompt's cache cut to `budget` entries per KV head."
    family = "eviction"
    setting = "post-prefill compression"

    def __init__(self, budget: int, press: str = "snapkv", **press_options):
        super().__init__(budget)
        make_press(press, **press_options)  # refuse a bad name or option now
        self.name, self.press, self.press_options = f"kvpress_{press}", press, press_options

    def policy(self) -> DensePolicy:
        return DensePolicy()

    def cache(self, model) -> DynamicCache:
        return DynamicCache(config=model.config)

    @contextlib.contextmanager
    def patch(self, model):
        "Exact attention under `patch`, the press hooked in; yields a fresh `DynamicCache`."
        with patch(model, self.policy()), compress_after_prefill(model, make_press(self.press, **self.press_options),
                                                                 self.budget):
            yield self.cache(model)

    def generate(self, model, input_ids, attention_mask=None, **kwargs):
        if left_padding(attention_mask, input_ids) is not None:
            raise ValueError(f"attention_mask: {self.name} keeps the same number of entries in every row, padding "
                             "included; generate each prompt alone or batch prompts of equal length")
        return super().generate(model, input_ids, **kwargs)


# %%
test_eq((PressMethod.family, PressMethod.setting), ("eviction", "post-prefill compression"))
test_fail(lambda: PressMethod(16, "snapk"), contains="name must be one of")


# %%
#| export
def make(name: str, budget: int, **press_options) -> PressMethod:
    "kvpress press `name` as a method keeping `budget` entries per KV head after the prefill."
    return PressMethod(budget, name, **press_options)


# %%
test_fail(lambda: make("snapk", 16), contains="name must be one of")
test_fail(lambda: make("knorm", 0), contains="budget")

# %% [markdown]
# ## Checks
#
# On the tiny Llama (4 query heads over 2 KV heads, 2 layers), a 40-token prompt and a budget of 16: every
# press leaves exactly 16 entries per KV head in every layer after the prefill (PyramidKV: 16 on average over
# the layers, its pyramid), each decode step adds one, and `measure_attended` sees the decode queries attend to
# exactly what is cached. At a budget of the whole prompt every press generates the dense tokens.

# %%
#| peers
model, _ = load_model("tiny-llama")
ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
with torch.no_grad(): dense = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
options = {"snapkv": dict(window_size=8), "pyramidkv": dict(window_size=8)}  # kvpress's windows need S > window
for name in names():
    m = make(name, 16, **options.get(name, {}))
    with measure_attended() as meter, torch.no_grad(), m.patch(model) as cache:
        model(ids, past_key_values=cache)
        kept = [layer.keys.shape[2] for layer in cache.layers]
        model(ids[:, :1], past_key_values=cache)  # one decode step
    per_layer = [layer.keys.shape[2] for layer in cache.layers]
    if name == "pyramidkv": test_eq(sum(kept), 16 * len(kept))
    else: test_eq(kept, [16] * len(kept))
    test_eq(per_layer, [k + 1 for k in kept])
    test_eq(measured_budget(meter)["decode_mean"], sum(per_layer) / len(per_layer))
    test_eq(make(name, 40, **options.get(name, {})).generate(model, ids, **gen), dense)
print(f"{len(names())} presses run here: {', '.join(names())}")

# %% [markdown]
# **The hook is kvpress's.** Our hook must leave the cache exactly as kvpress's own context manager does
# with the same press and ratio: for every press, after the prefill the kept keys and values are identical.

# %%
#| peers
for name in names():
    ours, theirs = make(name, 16, **options.get(name, {})), DynamicCache(config=model.config)
    torch.manual_seed(0)  # RandomPress and the leverage sketches draw
    with torch.no_grad(), ours.patch(model) as cache: model(ids, past_key_values=cache)
    press = make_press(name, **options.get(name, {}))
    press.compression_ratio = keep_ratio(16, ids.shape[1])
    torch.manual_seed(0)
    with torch.no_grad(), press(model): model(ids, past_key_values=theirs)
    for a, b in zip(cache.layers, theirs.layers):
        assert_close(a.keys, b.keys); assert_close(a.values, b.values)

# %% [markdown]
# **Agreement with sparsekv's own TOVA.** kvpress's TOVA press keeps the prompt's last token and the
# entries the last query attends to most, averaged over every head. Ours with `heads="all"`, no sinks and a
# window of 2 does the same on a prompt read in one call (the window's second slot is the token generation
# adds), so at kvpress's 16 ours has budget 17. The first two generated tokens' logits agree (the second is
# the first to read the compressed cache; after it ours evicts again while kvpress's cache grows).

# %%
#| peers
scored = dict(return_dict_in_generate=True, output_scores=True, max_new_tokens=2, do_sample=False, pad_token_id=0)
theirs = make("tova", 16).generate(model, ids, **scored)
ours = methods.make("tova", budget=17, sink=0, window=2, heads="all").generate(model, ids, **scored)
test_eq(theirs.sequences, ours.sequences)
for a, b in zip(theirs.scores, ours.scores): assert_close(a, b)
full = make("tova", 40).generate(model, ids, **scored)
assert not torch.allclose(full.scores[1], theirs.scores[1])   # the budget changes the second token's logits


# %% [markdown]
# **What a press keeps at a small budget.** SnapKV and PyramidKV never score their observation window, the
# prompt's last `window_size` tokens (64 by default): they keep it whole and choose the rest of the budget
# among the tokens before it. At a budget of at most `window_size` entries a press keeps the window and
# nothing else, no attention sink and no earlier token. That is the leaderboard's setting (a
# 448-token prompt cut to 64 entries so that decoding 64 tokens stays within 128), and SmolLM2 without its
# sink collapses: SnapKV and PyramidKV agree with dense on 0.41-0.42 of the tokens there, kvpress's TOVA and
# StreamingLLM (which keeps the sink) on 0.79 and 0.78 (the `cpu-full` leaderboard, 80 windows). On
# SmolLM2's first 448 validation tokens at 64 entries, SnapKV and PyramidKV kept exactly positions 384-447
# (one layer and head checked by hand). The check below shows it on the tiny Llama: with a window of 8 and a
# budget of 8, SnapKV keeps exactly the prompt's last 8 positions in every layer and KV head.

# %%
#| peers
def kept_positions(cache: DynamicCache, dense: DynamicCache) -> torch.Tensor:
    "Prompt position of each key `cache` kept, per layer and KV head ([layers, H_kv, kept]), matched in `dense`'s keys."
    return torch.stack([torch.cdist(a.keys[0], b.keys[0]).argmin(-1) for a, b in zip(cache.layers, dense.layers)])


dense_cache = DynamicCache(config=model.config)
with torch.no_grad(), patch(model, DensePolicy()): model(ids, past_key_values=dense_cache)
with torch.no_grad(), make("snapkv", 8, window_size=8).patch(model) as cache: model(ids, past_key_values=cache)
kept = kept_positions(cache, dense_cache).sort(-1).values
test_eq(kept, torch.arange(32, 40).expand_as(kept))          # the window alone: no sink, nothing earlier
with torch.no_grad(), make("streaming_llm", 8).patch(model) as cache: model(ids, past_key_values=cache)
assert (kept_positions(cache, dense_cache) == 0).any(-1).all()  # kvpress's StreamingLLM keeps the sink

# %% [markdown]
# **In the protocol's harness.** A press runs through `sparsekv.protocol.continuation` like every method:
# agreement, KL and NLL against dense and the measured budget per window. Bad input is refused:

# %%
#| peers
windows = torch.randint(3, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
rows = continuation(make("knorm", 16), model, windows, prefix=32)
test_eq(len(rows), 2)
assert all(0 <= r["agreement"] <= 1 and r["decode_max"] <= 16 + 15 for r in rows)
test_fail(lambda: make("knorm", 16, compression_ratio=0.5), contains="pass budget")
padded = torch.ones_like(ids).index_fill(1, torch.tensor([0, 1]), 0)          # two tokens of left padding
test_fail(lambda: make("knorm", 8).generate(model, ids, attention_mask=padded, **gen), contains="padding")
