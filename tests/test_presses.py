"""kvpress's presses as sparsekv methods (`sparsekv.presses`): exact budgets, kvpress's own result, dense when
everything fits, agreement with sparsekv's TOVA, bad input; on every tiny model (GQA, Qwen3, a GQA group of 1)."""
import pytest
import torch
from torch.testing import assert_close
from transformers import DynamicCache

from sparsekv import methods, presses
from sparsekv.hf import attention_modules, measure_attended
from sparsekv.protocol import measured_budget, window_logits

pytestmark = [pytest.mark.peers, pytest.mark.usefixtures("kvpress")]

OPTIONS = {"snapkv": dict(window_size=8), "pyramidkv": dict(window_size=8)}  # kvpress's windows need S > window
S = 40


def prompt(model, seed=0, n=S):
    return torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def press_method(name, budget):
    return presses.make(name, budget, **OPTIONS.get(name, {}))


@pytest.mark.parametrize("name", presses.names())
@pytest.mark.parametrize("budget", [1, 7, 16])
def test_keeps_the_budget_and_decode_reads_it(tiny_model, name, budget):
    "After the prefill each layer holds `budget` entries per KV head (PyramidKV: on average); decode adds one."
    ids = prompt(tiny_model)
    with measure_attended() as meter, torch.no_grad(), press_method(name, budget).patch(tiny_model) as cache:
        tiny_model(ids, past_key_values=cache)
        kept = [layer.keys.shape[2] for layer in cache.layers]
        tiny_model(ids[:, :1], past_key_values=cache)
    after = [layer.keys.shape[2] for layer in cache.layers]
    if name == "pyramidkv": assert abs(sum(kept) / len(kept) - budget) <= 1
    else: assert kept == [budget] * len(kept)
    assert after == [k + 1 for k in kept]
    assert measured_budget(meter)["decode_mean"] == sum(after) / len(after)


@pytest.mark.parametrize("name", presses.names())
def test_same_cache_as_kvpress_itself(tiny_model, name):
    "Our hook leaves exactly what kvpress's own context manager leaves, with the same press and ratio."
    ids = prompt(tiny_model, seed=1)
    had_rope = [hasattr(m, "rotary_emb") for m in attention_modules(tiny_model)]
    torch.manual_seed(0)
    with torch.no_grad(), press_method(name, 12).patch(tiny_model) as ours: tiny_model(ids, past_key_values=ours)
    assert [hasattr(m, "rotary_emb") for m in attention_modules(tiny_model)] == had_rope  # the RoPE lent is back
    press = presses.make_press(name, **OPTIONS.get(name, {}))
    press.compression_ratio = presses.keep_ratio(12, S)
    theirs = DynamicCache(config=tiny_model.config)
    torch.manual_seed(0)
    with torch.no_grad(), press(tiny_model): tiny_model(ids, past_key_values=theirs)
    for a, b in zip(ours.layers, theirs.layers):
        assert_close(a.keys, b.keys)
        assert_close(a.values, b.values)


@pytest.mark.parametrize("name", presses.names())
def test_dense_when_the_prompt_fits(tiny_model, name):
    ids = prompt(tiny_model, seed=2, n=24)
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad(): want = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
    assert torch.equal(press_method(name, 24).generate(tiny_model, ids, **gen), want)


def test_tova_press_agrees_with_sparsekv_tova(tiny_model):
    "kvpress's TOVA keeps the last token + the best by the last query's head-mean attention: ours, heads='all'."
    ids = prompt(tiny_model, seed=3)
    gen = dict(return_dict_in_generate=True, output_scores=True, max_new_tokens=2, do_sample=False, pad_token_id=0)
    theirs = presses.make("tova", 10).generate(tiny_model, ids, **gen)
    ours = methods.make("tova", budget=11, sink=0, window=2, heads="all").generate(tiny_model, ids, **gen)
    assert torch.equal(theirs.sequences, ours.sequences)
    for a, b in zip(theirs.scores, ours.scores): assert_close(a, b)


def test_streaming_llm_press_agrees_with_dense_prefill_then_streaming_llm(tiny_model):
    "kvpress's StreamingLLM press keeps 4 sinks + the last prompt tokens: sparsekv's StreamingLLM handed the prompt."
    ids = prompt(tiny_model, seed=4)
    gen = dict(return_dict_in_generate=True, output_scores=True, max_new_tokens=2, do_sample=False, pad_token_id=0)
    theirs = presses.make("streaming_llm", 10).generate(tiny_model, ids, **gen)
    ours = methods.make("dense+streaming_llm", 11, decode_params=dict(sink=4, window=2))
    ours = ours.generate(tiny_model, ids, **gen)
    assert torch.equal(theirs.sequences, ours.sequences)
    for a, b in zip(theirs.scores, ours.scores): assert_close(a, b)
    dense = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
    assert not torch.allclose(dense.scores[1], ours.scores[1], atol=1e-3)  # the budget binds at the decode step


def test_teacher_forced_decode_keeps_positions_after_a_press(tiny_model):
    "The protocol's continuation decodes token t at position t, also after a press cut the prompt's cache."
    win = prompt(tiny_model, seed=5)
    ours = methods.make("dense+streaming_llm", 11, decode_params=dict(sink=4, window=2))
    theirs = presses.make("streaming_llm", 10)
    got = [window_logits(m, tiny_model, win[:, :S - 6], S - 8) for m in (theirs, ours)]  # 2 steps: the same entries
    assert_close(got[0], got[1])


def test_bad_input(tiny_llama):
    with pytest.raises(ValueError, match="name must be one of"): presses.make("snapk", 8)
    with pytest.raises(TypeError, match="pass budget"): presses.make("knorm", 8, compression_ratio=0.5)
    with pytest.raises(ValueError, match="budget"): presses.make("knorm", 0)
    with pytest.raises(TypeError): presses.make("knorm", 8, window_size=4)  # KnormPress takes no window
    ids = prompt(tiny_llama)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    with pytest.raises(ValueError, match="padding"):
        presses.make("knorm", 8).generate(tiny_llama, ids, attention_mask=mask, max_new_tokens=2)
