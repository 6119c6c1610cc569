"""The contract every method of `sparsekv.methods` keeps (as kvpress's test_presses): dense at a large budget, batches,
bounded caches, clean patches, budget errors."""
import pytest
import torch

from sparsekv import methods
from sparsekv.hf import ATTN_NAME, Method, measure_attended
from sparsekv.methods import SelectionMethod
from sparsekv.protocol import continuation

PAPER_METHODS = {"dense", "streaming_llm", "tova", "h2o", "streaming_llm_plus", "dms", "kvpop_mlp", "kvpop_mlstm",
               "quoka", "mean_scores", "sample_attention", "sparq", "loki", "lessismore", "quest", "arkvale", "key_pca",
               "oval", "oracle_pages"}
PROMPT, NEW = 20, 6
# every registered method, and compositions whose decode method evicts (the prompt handed over)
NAMES = methods.names() + ["quoka+kvpop_mlstm", "dense+streaming_llm"]
GEN = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def build(name: str, budget) -> Method:
    "Method `name` at `budget` with the parameters each method states for small prompts (`Method.small_params`)."
    if name == "prefill_decode":
        return methods.make(name, budget=budget, prefill=build("quoka", budget), decode=build("oval", budget))
    if "+" in name:
        return methods.make(name, budget, **{f"{role}_params": methods.get(part).small_params
                                            for role, part in zip(("prefill", "decode"), name.split("+"))})
    return methods.make(name, budget=budget, **methods.get(name).small_params)


def prompt(model, B=2, seed=0):
    return torch.randint(3, model.config.vocab_size, (B, PROMPT), generator=torch.Generator().manual_seed(seed))


def test_every_method_of_the_papers_is_registered():
    assert PAPER_METHODS <= set(methods.names())
    assert all(methods.get(n).family in ("dense", "eviction", "selection", "retrieval") for n in methods.names())


@pytest.mark.parametrize("name", NAMES)
def test_budget_of_the_whole_sequence_is_dense(tiny_model, name):
    "At a budget of the whole sequence (prompt + new tokens) every method generates the dense tokens and scores."
    ids, scored = prompt(tiny_model), dict(return_dict_in_generate=True, output_scores=True, **GEN)
    with torch.no_grad(): want = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), **scored)
    got = build(name, PROMPT + NEW).generate(tiny_model, ids, **scored)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_generate_a_batch_of_two_within_the_budget(tiny_llama, name):
    "A small budget: `generate` gives [2, prompt + new] ids; an eviction cache holds at most the budget between steps."
    budget, ids = 8, prompt(tiny_llama, seed=1)
    m = build(name, budget)
    assert m.generate(tiny_llama, ids, **GEN).shape == (2, PROMPT + NEW)
    handover = m.name == "prefill_decode" and m.decode.family == "eviction"  # the prompt is read in full first
    if m.family != "eviction" and not handover: return
    held = []
    with torch.no_grad(), m.patch(tiny_llama) as cache:
        sizes = lambda *_: held.append(max(layer.keys.shape[2] for layer in cache.layers))  # noqa: E731
        hook = tiny_llama.register_forward_hook(sizes)
        try: tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **GEN)
        finally: hook.remove()
    assert len(held) == NEW
    if handover: assert held[0] == PROMPT and max(held[1:]) <= budget, held
    elif m.exact_budget: assert max(held) <= budget, held
    else: assert max(held) <= PROMPT + NEW  # DMS: a learned target, see test_dms_budget_is_a_learned_target


def per_layer_head(meter) -> dict:
    "(layer, head) -> (queries, total attended entries, max), over both phases (chunked prefill runs the last prompt"
    " token as a decode step, `generate` with the whole prompt as prefill)."
    out = {}
    for r in meter.per_head():
        n, total, most = out.get((r["layer"], r["head"]), (0, 0.0, 0))
        out[r["layer"], r["head"]] = (n + r["queries"], total + r["mean"] * r["queries"], max(most, r["max"]))
    return {key: (n, round(total, 6), most) for key, (n, total, most) in out.items()}


@pytest.mark.parametrize("name", NAMES)
def test_measured_budget_of_the_whole_sequence_is_dense(tiny_llama, name):
    "At a budget of the whole sequence every query of every layer and head attends to what dense attention does."
    ids = prompt(tiny_llama)
    with measure_attended() as dense: build("dense", PROMPT + NEW).generate(tiny_llama, ids, **GEN)
    with measure_attended() as got: build(name, PROMPT + NEW).generate(tiny_llama, ids, **GEN)
    assert per_layer_head(got) == per_layer_head(dense)


def nominal_bound(m: Method, phase: str, budget: int) -> int | None:
    """The most KV entries a query of the last layer may attend to at nominal `budget`, as each family defines its
    budget: eviction holds `budget` entries; a prefill selection adds the chunk's own keys (decode: the new token);
    page retrieval adds the partial page its complete pages leave out. None: no bound (dense, learned DMS, prefill of
    decode-time methods and of eviction's one-chunk prompt)."""
    if m.family == "eviction" and m.exact_budget: return budget if phase == "decode" else None
    if m.name == "prefill_decode": return nominal_bound(m.prefill if phase == "prefill" else m.decode, phase, budget)
    if m.family == "selection": return budget + (m.chunk_size if phase == "prefill" else 1)
    if m.family == "retrieval": return budget + m.page_size - 1 if phase == "decode" else None
    return None


@pytest.mark.parametrize("name", NAMES)
def test_measured_budget_within_the_nominal_one(tiny_llama, name):
    "At a small budget, the last layer's queries attend to no more entries than the family's nominal bound allows."
    budget, ids, m = 8, prompt(tiny_llama, seed=1), build(name, 8)
    with measure_attended() as meter: m.generate(tiny_llama, ids, **GEN)
    last = tiny_llama.config.num_hidden_layers - 1
    for phase in ("prefill", "decode"):
        bound = nominal_bound(m, phase, budget)
        if bound is None: continue
        most = max(r["max"] for r in meter.per_head() if r["phase"] == phase and r["layer"] == last)
        assert most <= bound < PROMPT, (phase, most, bound)  # within the bound, and the bound leaves keys out


@pytest.mark.parametrize("name", NAMES)
def test_continuation_at_the_whole_window_is_dense(tiny_llama, name):
    "The protocol's teacher-forced continuation: dense at a budget of the whole window, a measured budget below it."
    win = prompt(tiny_llama, B=1, seed=3)
    with torch.no_grad(): dense = tiny_llama(win).logits[:, 11:-1]
    (whole,) = continuation(build(name, PROMPT), tiny_llama, win, prefix=12, dense_logits=dense)
    assert whole["agreement"] == 1.0 and abs(whole["kl"]) < 1e-4, whole
    (small,) = continuation(build(name, 8), tiny_llama, win, prefix=12, dense_logits=dense)
    if methods.get(name).family != "dense" and build(name, 8).exact_budget:
        assert small["decode_max"] < whole["decode_max"] == PROMPT - 1, small


def test_a_cache_of_one_entry_still_decodes(tiny_llama):
    "A decode query whose evicting cache keeps only itself is recorded as decode (not as a one-token prefill)."
    ids = prompt(tiny_llama, B=1)
    with measure_attended() as meter: methods.make("streaming_llm", 1).generate(tiny_llama, ids, **GEN)
    decode = [r for r in meter.per_head() if r["phase"] == "decode"]
    assert {r["queries"] for r in decode} == {NEW - 1} and meter.max("decode") == 1, decode  # every step, every layer


def test_dms_budget_is_a_learned_target(tiny_llama):
    "DMS keeps what its gates say: closed (fresh) gates keep everything, open gates keep only the sinks and the window."
    m = methods.make("dms", budget=8)
    assert not m.exact_budget and m.family == "eviction"
    st = m.trained_student(tiny_llama)
    ids = prompt(tiny_llama, seed=2)
    with torch.no_grad(), m.patch(tiny_llama) as cache: tiny_llama(ids, past_key_values=cache)
    assert cache.live_counts().min() == PROMPT
    with torch.no_grad():
        st.decisions.bias.fill_(5.0 / st.decisions.bias_scale)
        with m.patch(tiny_llama) as cache: tiny_llama(ids, past_key_values=cache)
    assert cache.live_counts().max() <= m.sink + m.window


@pytest.mark.parametrize("name", NAMES)
def test_patch_restores_the_model(tiny_llama, name):
    "After the block, also one left by an exception: the same attention implementation, no hooks, the same outputs."
    ids = prompt(tiny_llama, B=1)
    impl = tiny_llama.config._attn_implementation
    with torch.no_grad(): before = tiny_llama(ids).logits
    m = build(name, 8)
    with torch.no_grad(), m.patch(tiny_llama) as cache:
        assert tiny_llama.config._attn_implementation == ATTN_NAME
        tiny_llama(ids, past_key_values=cache)
    with pytest.raises(RuntimeError, match="inside"):
        with m.patch(tiny_llama): raise RuntimeError("inside")
    assert tiny_llama.config._attn_implementation == impl
    assert sum(len(mod._forward_pre_hooks) + len(mod._forward_hooks) for mod in tiny_llama.modules()) == 0
    with torch.no_grad(): assert torch.equal(tiny_llama(ids).logits, before)


@pytest.mark.parametrize("name", methods.names())
def test_bad_budget_is_refused(name):
    fraction = issubclass(methods.get(name), SelectionMethod) and name != "prefill_decode"
    bad = [0, -4, True, 2.5, "8", [8]] + ([] if fraction else [0.5])
    for b in bad:
        with pytest.raises((TypeError, ValueError), match="budget"): methods.make(name, budget=b)
    if fraction: assert methods.make(name, budget=0.5).budget == 0.5


def test_unknown_names_and_parameters_are_refused():
    with pytest.raises(ValueError, match="name must be one of"): methods.make("snapkv", budget=8)
    with pytest.raises(TypeError, match="accepted"): methods.make("oval", budget=64, eta_typo=0.5)
    with pytest.raises(TypeError, match="accepted"): methods.make("tova", budget=64, eta=0.5)
