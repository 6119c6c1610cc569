"""Padded batches: every method either gives each left-padded row what the row gets alone, or refuses
padding with a clear error before any work."""
import pytest
import torch

from sparsekv import methods
from sparsekv.hf import Method, chunked_prefill

BUDGET, LENS, NEW = 8, (29, 20), 4
GEN = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def build(name: str) -> Method:
    "Method `name` at BUDGET with its parameters for small prompts (`Method.small_params`: chunks of 8, pages of 4)."
    if name == "prefill_decode":
        return methods.make(name, budget=BUDGET, prefill=build("quoka"), decode=build("oval"))
    if "+" in name:
        return methods.make(name, BUDGET, **{f"{role}_params": methods.get(part).small_params
                                             for role, part in zip(("prefill", "decode"), name.split("+"))})
    return methods.make(name, budget=BUDGET, **methods.get(name).small_params)


def padded_batch(seed=0):
    "Two prompts of LENS tokens, left-padded (with id 0) to the longer: ids, mask [2, S] and the prompts alone."
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 259, (n,), generator=g) for n in LENS]
    S = max(LENS)
    ids, mask = torch.zeros(2, S, dtype=torch.long), torch.zeros(2, S, dtype=torch.long)
    for b, r in enumerate(rows): ids[b, S - len(r):], mask[b, S - len(r):] = r, 1
    return ids, mask, [r[None] for r in rows]


def refuses_padding(name: str) -> bool:
    "Eviction methods keep a bounded cache per batch column: they take unpadded batches only (also handed a prompt)."
    return methods.get(name.split("+")[-1]).family == "eviction"


@pytest.mark.parametrize("name", methods.names() + ["quoka+kvpop_mlstm"])
def test_padded_rows_equal_rows_alone_or_refuse(tiny_llama, name):
    ids, mask, alone = padded_batch()
    m = build(name)
    if refuses_padding(name):
        calls = []
        hook = tiny_llama.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            with pytest.raises(ValueError, match="attention_mask.*unpadded batches only.*each prompt alone"):
                m.generate(tiny_llama, ids, attention_mask=mask, **GEN)
        finally: hook.remove()
        assert not calls  # refused before any work
        return
    out = m.generate(tiny_llama, ids, attention_mask=mask, **GEN)
    for b, row in enumerate(alone):
        assert torch.equal(out[b, ids.shape[1] - row.shape[1]:], build(name).generate(tiny_llama, row, **GEN)[0]), b


@pytest.mark.parametrize("name", [n for n in methods.names() if not refuses_padding(n)])
def test_padded_prefill_logits_equal_rows_alone(tiny_llama, name):
    "The prompt's last logits under the method (chunked where it chunks), padded batch against each row alone."
    ids, mask, alone = padded_batch(seed=1)
    m = build(name)
    chunk = m.chunk_size or ids.shape[1]
    with m.patch(tiny_llama) as cache:
        last = chunked_prefill(tiny_llama, ids, chunk, cache=cache, attention_mask=mask)[1]
    for b, row in enumerate(alone):
        with m.patch(tiny_llama) as cache: want = chunked_prefill(tiny_llama, row, chunk, cache=cache)[1]
        torch.testing.assert_close(last[b], want[0], atol=1e-4, rtol=0)
        if m.family == "selection":  # the budget really selects in the prefill
            assert (want[0] - chunked_prefill(tiny_llama, row, chunk)[1][0]).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["quoka", "oval", "quest"])
def test_padded_beam_search_equals_rows_alone(tiny_llama, name):
    "Beam search over a padded batch: each row's best beam is the one it finds alone."
    ids, mask, alone = padded_batch(seed=2)
    beams = dict(GEN, num_beams=3)
    out = build(name).generate(tiny_llama, ids, attention_mask=mask, **beams)
    for b, row in enumerate(alone):
        assert torch.equal(out[b, ids.shape[1] - row.shape[1]:], build(name).generate(tiny_llama, row, **beams)[0])


def test_padding_errors(tiny_llama):
    ids, mask, _ = padded_batch()
    m = build("quoka")
    with pytest.raises(ValueError, match="pad on the left"): m.generate(tiny_llama, ids, attention_mask=mask.flip(-1))
    with pytest.raises(ValueError, match="0 \\(padding\\) and 1"): m.generate(tiny_llama, ids, attention_mask=mask * 3)
    with pytest.raises(ValueError, match="at least one token"):
        m.generate(tiny_llama, ids, attention_mask=mask * torch.tensor([[1], [0]]))
