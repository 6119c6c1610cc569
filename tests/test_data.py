"Tests of sparsekv.data: prose corpus, token streams and their cache, packing, reasoning problems, synthetic tasks."
import collections
import copy
import random
import re

import numpy as np
import pytest
import torch

from sparsekv import data
from sparsekv.data import (
    DEPTH_TOLERANCE,
    REASONING_TASKS,
    SYNTHETIC_TASKS,
    clean_verse,
    count_tokens,
    extract_final_answer,
    haystack_clauses,
    make_task,
    packed_positions,
    packed_sequences,
    prose_clauses,
    prose_text,
    prose_tokens,
    read_bible_constants,
    reasoning_problems,
    score_exact,
    score_reasoning,
    token_stream,
    tokenizer_fingerprint,
)


@pytest.fixture(scope="module")
def tok():
    "The SmolLM2 tokenizer of the converted checkpoint."
    from transformers import AutoTokenizer

    from sparsekv.models import ensure_smollm2
    return AutoTokenizer.from_pretrained(ensure_smollm2())


def byte_tokenizer():
    "A byte-level tokenizer without merges: one token per byte, so clauses are long in tokens."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


# --- prose ---------------------------------------------------------------------------------

def test_prose_keeps_every_verse_in_order():
    content, starts, ends, titles = read_bible_constants()
    text = prose_text()
    assert prose_text() is text  # cached
    ids = sorted(starts)
    at = 0
    for vid in sorted(random.Random(0).sample(ids, 300)):
        verse = clean_verse(content[starts[vid]:ends[vid]], vid)
        if not verse: continue
        found = text.find(verse, at)
        assert found >= 0, vid
        at = found + len(verse)
    for bad in ["`", "[", "]", "  ", "\n\n\n", "Psalm 1"]: assert bad not in text
    paragraphs = text.split("\n\n")
    assert [p for p in paragraphs if p in titles] == titles  # each title once, in canon order
    chapters = len({vid // 1000 for vid in ids})
    assert len(paragraphs) == len(titles) + chapters


def test_clean_verse_artefacts():
    raw = " God`s [own]   burnt- offering of first -fruits.    BOOK II      Psalm 42  For the Chief Musician."
    assert clean_verse(raw, 18001001) == "God's own burnt-offering of first-fruits."
    assert clean_verse(" I will observe your statutes.    Don`t utterly forsake me.  BEIT", 19119008) \
        == "I will observe your statutes. Don't utterly forsake me."
    assert clean_verse(" Say YAHWEH.  AND", 1001001) == "Say YAHWEH. AND"  # stanza letters only in Psalm 119


def test_clauses_partition_the_prose():
    text = prose_text()
    starts, sentence = prose_clauses()
    assert starts[0] == 0 and starts[-1] == len(text) and np.all(np.diff(starts) > 0)
    assert len(sentence) == len(starts) - 1
    for i in random.Random(1).sample(range(1, len(sentence)), 500):
        clause = text[starts[i]:starts[i + 1]]
        assert clause[0].isspace() and clause.strip()
        assert re.search(r"[.!?;:,][\"']?$", text[starts[i] - 3:starts[i]]) or clause.startswith("\n\n")
        ends_sentence = re.search(r"[.!?][\"']?$", text[starts[i] - 3:starts[i]]) is not None
        assert bool(sentence[i]) == (ends_sentence or clause.startswith("\n\n"))


# --- token streams -------------------------------------------------------------------------

def test_stream_equals_direct_tokenization(tok):
    text = prose_text()
    starts, _ = prose_clauses()
    stream = token_stream(tok)
    ids, offsets = prose_tokens(tok)
    assert stream.dtype == torch.long and len(stream) == offsets[-1] == len(ids)
    assert 900_000 < len(stream) < 1_100_000
    rng = random.Random(2)
    for _ in range(5):
        a = rng.randrange(len(starts) - 3000)
        b = a + rng.randrange(1, 3000)
        assert token_stream(tok, text[starts[a]:starts[b]]).tolist() == stream[offsets[a]:offsets[b]].tolist()
    assert token_stream(tok, "").tolist() == []
    with pytest.raises(TypeError, match="text must be a str"): token_stream(tok, b"bytes")
    with pytest.raises(TypeError, match="tokenizer must be"): token_stream(None)


def test_stream_cache_on_disk(tok, tmp_path, monkeypatch):
    "The first call tokenizes and writes one file atomically; a fresh process (empty memory cache) reads it back."
    starts, sentence = prose_clauses()
    small = prose_text()[:starts[300]]  # the first 300 clauses stand in for the corpus, to keep the test fast
    monkeypatch.setattr(data, "prose_text", lambda: small)
    monkeypatch.setattr(data, "prose_clauses", lambda: (starts[:301], sentence[:300]))
    monkeypatch.setattr(data, "_prose_hash", lambda: "small")
    monkeypatch.setattr(data, "_PROSE_TOKENS", {})
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path))
    ids, offsets = prose_tokens(tok)
    assert ids.tolist() == token_stream(tok, small).tolist() and len(offsets) == 301
    files = list((tmp_path/"data").iterdir())
    assert [f.name for f in files] == [f"prose-tokens-small-{tokenizer_fingerprint(tok)}.npz"]
    monkeypatch.setattr(data, "_PROSE_TOKENS", {})
    monkeypatch.setattr(data, "encode", lambda *a: pytest.fail("re-tokenized instead of reading the cache"))
    ids2, offsets2 = prose_tokens(tok)
    assert np.array_equal(ids, ids2) and np.array_equal(offsets, offsets2)
    assert list((tmp_path/"data").iterdir()) == files  # no temporary files left behind


def test_fingerprint_tells_tokenizers_apart(tok, tmp_path):
    from transformers import AutoTokenizer
    tok.save_pretrained(tmp_path)
    # stable across loads (so the disk cache is hit by the next process)...
    fp = lambda: tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path))
    assert fp() == fp()
    # ...and different for tokenizers that map text differently
    grown = copy.deepcopy(tok)
    grown.add_tokens(["<needle>"])
    fingerprints = {tokenizer_fingerprint(tok), tokenizer_fingerprint(grown), tokenizer_fingerprint(byte_tokenizer())}
    assert len(fingerprints) == 3


# --- packing -------------------------------------------------------------------------------

@pytest.mark.parametrize("n_tokens,seq_len,val_fraction", [(1000, 64, 0.1), (997, 7, 0.05), (50, 50, 0.5),
                                                           (128, 1, 0.3), (100, 60, 0.2)])
def test_packed_positions_train_validation_disjoint(n_tokens, seq_len, val_fraction):
    n_val = round(n_tokens*val_fraction)
    parts = {}
    for split in ("train", "validation"):
        pos = packed_positions(n_tokens, seq_len, split, val_fraction)
        size = n_tokens - n_val if split == "train" else n_val
        assert pos.shape == (size // seq_len, seq_len)
        flat = pos.flatten().tolist()
        assert len(set(flat)) == len(flat)  # windows never overlap
        assert all(torch.equal(w, torch.arange(w[0], w[0] + seq_len)) for w in pos)  # each window is contiguous
        lo, hi = (0, n_tokens - n_val) if split == "train" else (n_tokens - n_val, n_tokens)
        assert all(lo <= p < hi for p in flat)
        parts[split] = set(flat)
        drawn = packed_positions(n_tokens, seq_len, split, val_fraction, n=len(pos), seed=3)
        assert set(drawn.flatten().tolist()) == parts[split]  # a permutation of the same windows
    assert not parts["train"] & parts["validation"]


def test_packed_positions_errors():
    with pytest.raises(ValueError, match="split must be one of"): packed_positions(100, 10, "val")
    with pytest.raises(ValueError, match="val_fraction"): packed_positions(100, 10, "train", 0.0)
    with pytest.raises(ValueError, match="seq_len"): packed_positions(100, 0)
    with pytest.raises(ValueError, match=r"n must be in \[0, 9\]"): packed_positions(100, 10, "train", 0.05, n=10)


def test_packed_sequences_are_stream_windows(tok):
    stream = token_stream(tok)
    for split in ("train", "validation"):
        seqs = packed_sequences(tok, 1000, split, n=3, seed=5)
        pos = packed_positions(len(stream), 1000, split, n=3, seed=5)
        assert seqs.shape == (3, 1000) and torch.equal(seqs, stream[pos])
    first_val = packed_sequences(tok, 1000, "validation", n=1)[0]
    assert torch.equal(first_val, stream[len(stream) - round(0.05*len(stream)):][:1000])


# --- reasoning -----------------------------------------------------------------------------

@pytest.mark.parametrize("completion,expected", [
    ("So the total is 1,234 apples.", "1234"), (r"Hence \boxed{-17}. Done in 3 steps.", "-17"),
    ("<answer> 3.50 </answer> 9", "3.5"), ("... 12 + 3 = 15\n#### 15", "15"),
    ("The answer is 12.0, since 3 * 4.", "12"), ("I get +08.", "8"), ("nothing here", None), ("", None),
    ("<answer>Paris</answer>", "Paris"), ("1, 2, 3", "3")])
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected


@pytest.mark.parametrize("task", REASONING_TASKS)
def test_reasoning_round_trip(task):
    problems = reasoning_problems(task, 20, seed=11)
    assert problems == reasoning_problems(task, 20, seed=11)
    assert problems != reasoning_problems(task, 20, seed=12)
    assert all(set(p) == {"question", "answer", "metadata"} and p["metadata"]["source_dataset"] == task
               for p in problems)
    for item in problems:
        assert score_reasoning(task, item, item["answer"]) == 1.0
        assert score_reasoning(task, item, f"Step 1: 2 + 2 = 4.\nSo the final answer is {item['answer']}") == 1.0
        assert score_reasoning(task, item, f"<answer>{int(float(item['answer'])) - 3}</answer>") < 1.0
        assert score_reasoning(task, item, "I cannot solve this.") < 1.0


def test_reasoning_errors():
    with pytest.raises(ValueError, match="task must be one of"): reasoning_problems("gsm8k", 3)
    with pytest.raises(ValueError, match="n must be"): reasoning_problems("chain_sum", 0)
    item = reasoning_problems("chain_sum", 1)[0]
    with pytest.raises(ValueError, match="comes from"): score_reasoning("basic_arithmetic", item, "3")


# --- synthetic tasks -----------------------------------------------------------------------

def haystack_start(tok, prompt: str) -> int:
    "Tokens before the haystack: the instructions end at the prompt's first blank line."
    return count_tokens(tok, prompt[:prompt.index("\n\n") + 2])


def needle_position(tok, prompt: str, needle: str) -> int:
    "Token offset of `needle` in `prompt` (its leading space belongs to its first token)."
    c = prompt.index(needle)
    return count_tokens(tok, prompt[:c - 1 if prompt[c - 1] == " " else c])


@pytest.mark.parametrize("name", list(SYNTHETIC_TASKS))
def test_tasks_deterministic_given_seed(tok, name):
    a, b, c = (make_task(name, tok, 700, seed=s) for s in (3, 3, 4))
    assert a == b
    assert a["prompt"] != c["prompt"] and a["answer"] != c["answer"]
    assert a["task"] == name and a["seed"] == 3 and a["target_tokens"] == 700


@pytest.mark.parametrize("name", list(SYNTHETIC_TASKS))
@pytest.mark.parametrize("target", [256, 1000, 6000])
def test_context_length_near_target(tok, name, target):
    item = make_task(name, tok, target, seed=target + 1)
    assert item["context_tokens"] == count_tokens(tok, item["prompt"])
    # haystack tasks land on the target; the word list moves in steps of one rare word (its repeats)
    assert abs(item["context_tokens"] - target) <= (3*item["rare_repeats"] if name == "common_words" else 1)
    answers = [item["answer"]] if isinstance(item["answer"], str) else item["answer"]
    assert all(re.search(rf"\b{a}\b", item["prompt"]) for a in answers)
    assert score_exact(f"{item['answer_prefix']} {', '.join(answers)}", item["answer"]) == 1.0
    assert score_exact(item["answer_prefix"], item["answer"]) == 0.0


@pytest.mark.parametrize("target", [600, 5000])
def test_needle_at_requested_depth(tok, target):
    rng = random.Random(target)
    for depth in [0.0, 1.0] + [rng.random() for _ in range(8)]:
        item = make_task("niah_single", tok, target, seed=rng.randrange(10**6), depth=depth)
        (needle,) = item["needles"]
        p = needle_position(tok, item["prompt"], needle) - haystack_start(tok, item["prompt"])
        assert abs(p - depth*item["haystack_tokens"]) <= DEPTH_TOLERANCE + 2, (depth, p, item["haystack_tokens"])
        assert abs(p - item["needle_depths"][0]*item["haystack_tokens"]) <= 2


def test_multikey_queried_needle_at_depth(tok):
    for seed, depth in enumerate([0.05, 0.4, 0.95]):
        item = make_task("niah_multikey", tok, 3000, seed=seed, depth=depth, n_keys=6, n_queries=3)
        assert isinstance(item["answer"], list) and len(item["answer"]) == 3 and len(item["needles"]) == 6
        assert all(f"is: {v}." in item["needles"][i] for i, v in enumerate(item["answer"]))
        keys = [re.search(r"for (\S+) is", n).group(1) for n in item["needles"]]
        assert len(set(keys)) == 6 and all(k in item["prompt"].rsplit("\n\n", 1)[1] for k in keys[:3])
        first = item["needles"][0]
        before = [n for n in item["needles"][1:] if item["prompt"].index(n) < item["prompt"].index(first)]
        p = (needle_position(tok, item["prompt"], first) - haystack_start(tok, item["prompt"])
             - sum(count_tokens(tok, " " + n) for n in before))
        assert abs(p - depth*item["haystack_tokens"]) <= DEPTH_TOLERANCE + 2


def test_variable_tracking_answer_resolves_from_prompt(tok):
    for seed in range(4):
        item = make_task("variable_tracking", tok, 1500, seed=seed, n_chains=3, n_hops=3)
        values, order = {}, []
        for var, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", item["prompt"]):
            values[var] = values[rhs[4:]] if rhs.startswith("VAR") else rhs  # fails if used before assigned
            order.append(var)
        assert len(values) == 3*4
        asked = re.search(r"assigned the value (\d+) in", item["prompt"]).group(1)
        holding = [v for v in order if values[v] == asked]
        assert holding == item["answer"]
        assert score_exact(" ".join(holding[:2]), item["answer"]) == 0.5


def test_common_words_counts(tok):
    item = make_task("common_words", tok, 2500, seed=9, n_common=5)
    words = item["prompt"].split("\n\n")[1].split("\n")
    counts = collections.Counter(words)
    assert sorted(w for w, _ in counts.most_common(5)) == sorted(item["answer"])
    assert all(counts[w] == item["common_repeats"] for w in item["answer"])
    assert set(counts.values()) == {item["common_repeats"], item["rare_repeats"]}
    assert item["common_repeats"] > item["rare_repeats"]


def test_score_exact():
    assert score_exact("The special magic number is 1234567.", "1234567") == 1.0
    assert score_exact("It is 91234567 or 12345678", "1234567") == 0.0
    assert score_exact("  The WORDS:\n apple,  RIVER stone", "river stone") == 1.0
    assert score_exact("riverstone", "river stone") == 0.0
    assert score_exact("apple pear", ["pear", "plum", "apple", "fig"]) == 0.5
    assert score_exact("", "x") == 0.0
    with pytest.raises(TypeError, match="prediction must be a str"): score_exact(None, "x")
    with pytest.raises(TypeError, match="non-empty list"): score_exact("x", [])
    with pytest.raises(TypeError, match="non-empty list"): score_exact("x", 5)


def test_task_errors(tok):
    with pytest.raises(ValueError, match="name must be one of"): make_task("niah", tok, 500, 0)
    with pytest.raises(ValueError, match="depth applies"): make_task("variable_tracking", tok, 500, 0, depth=0.3)
    with pytest.raises(ValueError, match="depth must be in"): make_task("niah_single", tok, 500, 0, depth=-0.1)
    with pytest.raises(ValueError, match="too small"): make_task("niah_multikey", tok, 60, 0)
    with pytest.raises(ValueError, match="too large"): make_task("niah_single", tok, 2_000_000, 0)
    with pytest.raises(ValueError, match="context_tokens must be a positive int"): make_task("niah_single", tok, 0, 0)
    with pytest.raises(ValueError, match="too small"): make_task("common_words", tok, 150, 0)
    with pytest.raises(ValueError, match="n_queries"): make_task("niah_multikey", tok, 500, 0, n_keys=2, n_queries=3)
    with pytest.raises(TypeError, match="seed must be an int"): make_task("niah_single", tok, 500, 0.5)
    with pytest.raises(TypeError, match="tokenizer must be"): make_task("niah_single", "gpt2", 500, 0)


@pytest.mark.slow
def test_tasks_with_a_byte_tokenizer(tmp_path, monkeypatch):
    "Another tokenizer (one token per byte): lengths and depths hold in its own tokens, within half its longest clause."
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path))
    byte_tok = byte_tokenizer()
    _, offsets = prose_tokens(byte_tok)
    half_clause = int(np.diff(offsets).max()) // 2 + 1
    for depth in (0.0, 0.3, 0.8):
        item = make_task("niah_single", byte_tok, 3000, seed=1, depth=depth)
        assert abs(item["context_tokens"] - 3000) <= 1
        assert item["context_tokens"] == len(item["prompt"].encode())
        p = needle_position(byte_tok, item["prompt"], item["needles"][0]) - haystack_start(byte_tok, item["prompt"])
        assert abs(p - depth*item["haystack_tokens"]) <= max(DEPTH_TOLERANCE, half_clause) + 2
    pieces, points, _ = haystack_clauses(byte_tok, 10, 500)
    assert len("".join(pieces).encode()) == 500 and points[-1] == 500


# --- tasks the default model solves --------------------------------------------------------------

NEW_TASKS = ("passkey", "induction_copy", "kv_retrieval")


@pytest.mark.parametrize("name", NEW_TASKS)
def test_new_task_answer_once_at_requested_depth(tok, name):
    rng = random.Random(name)
    for depth in [0.0, 1.0] + [rng.random() for _ in range(4)]:
        target, seed = rng.choice([300, 1200, 4096]), rng.randrange(10**6)
        item = make_task(name, tok, target, seed=seed, depth=depth)
        assert item == make_task(name, tok, target, seed=seed, depth=depth)
        assert item["depth"] == depth and abs(item["context_tokens"] - target) <= 1
        assert item["prompt"].count(item["answer"]) == 1 and item["answer"] not in item["answer_prefix"]
        (needle,) = item["needles"]
        assert item["answer"] in needle
        p = needle_position(tok, item["prompt"], needle) - haystack_start(tok, item["prompt"])
        assert abs(p - depth*item["haystack_tokens"]) <= DEPTH_TOLERANCE + 2, (depth, p, item["haystack_tokens"])


@pytest.mark.parametrize("name", NEW_TASKS)
def test_new_task_smallest_context_that_fits(tok, name):
    "Below the instructions, question and needle there is no room: refused; one token more gives a real prompt."
    smallest = next(n for n in range(10, 400) if not _too_small(tok, name, n))
    item = make_task(name, tok, smallest, seed=0, depth=0.5)
    assert abs(item["context_tokens"] - smallest) <= 1 and item["haystack_tokens"] >= 1
    assert item["prompt"].count(item["answer"]) == 1
    with pytest.raises(ValueError, match="context_tokens=.* is too small"):
        make_task(name, tok, smallest - 1, seed=0, depth=0.5)


def _too_small(tok, name, n) -> bool:
    try: make_task(name, tok, n, seed=0, depth=0.5)
    except ValueError as e:
        if "too small" in str(e): return True
        raise
    return False


def test_passkey_phrasings_and_digits(tok):
    for phrasing, (needle, question, prefix) in enumerate(data.PASSKEY_PHRASINGS):
        item = make_task("passkey", tok, 500, seed=phrasing, depth=0.3, phrasing=phrasing, digits=6)
        assert item["phrasing"] == phrasing and len(item["answer"]) == 6
        assert item["needles"] == [needle.format(value=item["answer"])]
        assert item["prompt"].endswith(question) and item["answer_prefix"] == prefix
        # the same seed and depth in another phrasing: same number, same start of the haystack
        other = make_task("passkey", tok, 500, seed=phrasing, depth=0.3, phrasing=(phrasing + 1) % 4, digits=6)
        assert other["answer"] == item["answer"] and other["prompt"][:150] == item["prompt"][:150]
    drawn = [make_task("passkey", tok, 200, seed=s) for s in range(60)]
    assert {d["phrasing"] for d in drawn} == set(range(len(data.PASSKEY_PHRASINGS)))
    assert {len(d["answer"]) for d in drawn} == {5, 6, 7}
    assert all(re.fullmatch(r"[1-9]\d*", d["answer"]) for d in drawn)


def test_induction_copy_repeats_the_marked_words(tok):
    for seed, n_words in [(0, 1), (1, 6), (2, 20)]:
        item = make_task("induction_copy", tok, 1500, seed=seed, depth=0.4, n_words=n_words)
        marker = re.fullmatch(r"The sentence that starts with ([A-Z]{5}) is: \1:", item["answer_prefix"]).group(1)
        assert item["needles"] == [f"{marker}: {item['answer']}."]
        assert item["prompt"].count(marker) == 2  # the sentence and the question
        words = item["answer"].split()
        assert len(words) == n_words and set(words) <= set(data.prose_words())
        assert score_exact(f"{marker}: {item['answer']}.", item["answer"]) == 1.0
        assert score_exact(" ".join(words[:-1]), item["answer"]) == 0.0


def test_kv_retrieval_asks_one_key_of_the_block(tok):
    asked = set()
    for seed in range(24):
        item = make_task("kv_retrieval", tok, 800, seed=seed, depth=0.7, n_pairs=5)
        pairs = re.findall(r"([a-z]+-[a-z]+) = (\d{4})", item["needles"][0])
        key = re.fullmatch(r"In the list of key-value pairs, (\S+) =", item["answer_prefix"]).group(1)
        assert len(pairs) == 5 and len({k for k, _ in pairs}) == 5 and len({v for _, v in pairs}) == 5
        assert pairs[item["key_index"]] == (key, item["answer"])
        assert item["prompt"].endswith(f"what is the value of {key}?")
        asked.add(item["key_index"])
    assert asked == set(range(5))
    one = make_task("kv_retrieval", tok, 300, seed=3, depth=0.0, n_pairs=1)
    assert one["key_index"] == 0 and one["needles"][0].count(" = ") == 1


def test_niah_multikey_with_two_keys(tok):
    item = make_task("niah_multikey", tok, 2000, seed=5, depth=0.5, n_keys=2)
    assert len(item["needles"]) == 2 and isinstance(item["answer"], str)
    assert item["prompt"].count(item["answer"]) == 1 and f"is: {item['answer']}." in item["needles"][0]


@pytest.mark.parametrize("name,options,match", [
    ("passkey", {"phrasing": 4}, "phrasing must be an int in"), ("passkey", {"phrasing": -1}, "phrasing must be"),
    ("passkey", {"phrasing": 1.0}, "phrasing must be"), ("passkey", {"digits": 0}, "digits must be an int in"),
    ("passkey", {"digits": 19}, "digits must be"), ("passkey", {"digits": True}, "digits must be"),
    ("induction_copy", {"n_words": 0}, "n_words must be an int in"), ("induction_copy", {"n_words": 65}, "n_words"),
    ("kv_retrieval", {"n_pairs": 0}, "n_pairs must be an int in"), ("kv_retrieval", {"n_pairs": 2.5}, "n_pairs"),
    ("kv_retrieval", {"depth": 1.01}, "depth must be in"), ("induction_copy", {"depth": -0.01}, "depth must be in"),
    ("passkey", {"depth": float("nan")}, "depth must be in")])
def test_new_task_bad_arguments(tok, name, options, match):
    with pytest.raises(ValueError, match=match): make_task(name, tok, 500, 0, **options)


def test_depth_tasks():
    assert set(data.DEPTH_TASKS) == {"niah_single", "niah_multikey", "passkey", "induction_copy", "kv_retrieval"}
