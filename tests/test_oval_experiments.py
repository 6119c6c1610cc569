"""The OVAL stages' shared helpers (`sparsekv.oval.experiments`): the arms decoded side by side as each alone, on both
tiny architectures; the latency policies are the registry's; bad input."""
import pandas as pd
import pytest
import torch

from sparsekv import methods
from sparsekv.models import load_model
from sparsekv.oval.experiments import (
    arm_policy,
    decode_arms,
    decode_policies,
    generation_arms,
    held_back_prefill,
    registry_name,
    retrieval_arms,
    this_run,
)

KW = dict(page_size=8, sink=8, recent=8, spec_steps=2, tau=0.8)


def _ids(model, S: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(seed))


def _policies():
    return [arm_policy("full", 0.0, 0)] + [arm_policy(m, e, 24, **KW) for m, e in retrieval_arms([0.5, 1.0])]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_arms_batched_decode_as_each_alone(name):
    "Every arm of one batch gives the greedy tokens it gives decoded alone from the same prefill."
    model, _ = load_model(name)
    cache, first = held_back_prefill(model, _ids(model, 80), 32)
    toks = decode_arms(model, cache, first, _policies(), 5)[0]
    for a, policy in enumerate(_policies()):
        assert torch.equal(decode_arms(model, cache, first, [policy], 5)[0][0], toks[a]), f"arm {a}"
    assert cache.get_seq_length() == 79


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_generation_arms_first_divergence_is_free_running(name):
    "Teacher-forced on full attention's tokens, an arm's first divergence is where its own greedy tokens leave them."
    model, _ = load_model(name)
    ids = _ids(model, 80, seed=1)
    out = generation_arms(model, ids, _policies(), 6, 32)
    cache, first = held_back_prefill(model, ids, 32)
    free = decode_arms(model, cache, first, _policies(), 6)[0]
    for a, row in enumerate(out):
        want = next((i for i in range(6) if free[a, i] != free[0, i]), 6)
        assert row["first_divergence"] == want, a
    assert out[0]["agreement"] == 1.0 and out[0]["kl"] == pytest.approx(0.0, abs=1e-6)


def test_decode_policies_are_the_registry_policies():
    "The latency stage's policies are those of `methods.make` for each summary's method."
    got = decode_policies(["full", "quest", "keypca", "oval"], 256, 32, 32, 32, 8, 0.25)
    assert type(got["full"]) is type(methods.make("dense").policy())
    for n in ("quest", "keypca", "oval"):
        want = methods.make(registry_name(n), 256, page_size=32, sink=32, recent=32, rank=8,
                            **({"eta": 0.25} if n == "oval" else {})).policy()
        assert (got[n].method, got[n].budget, got[n].sink, got[n].recent) == (want.method, want.budget, want.sink,
                                                                             want.recent)
        assert vars(got[n].spec) == vars(want.spec)


def test_bad_input():
    model, _ = load_model("tiny-llama")
    ids = _ids(model, 20)
    cache, first = held_back_prefill(model, ids, 8)
    with pytest.raises(ValueError, match="eta"): retrieval_arms([1.5])
    with pytest.raises(ValueError, match="summary must be one of"): registry_name("key_pca")
    with pytest.raises(ValueError, match="summary must be one of"): arm_policy("dense", 0.0, 16)
    with pytest.raises(ValueError, match="ids must be"): held_back_prefill(model, ids[0], 8)
    with pytest.raises(ValueError, match="n_new"): decode_arms(model, cache, first, _policies(), 0)
    with pytest.raises(ValueError, match="teacher"): decode_arms(model, cache, first, _policies(), 3, torch.zeros(2))
    with pytest.raises(TypeError, match="policies"): decode_arms(model, cache, first, [], 2)
    with pytest.raises(ValueError, match="rows of the"): this_run(pd.DataFrame({"x": [1]}), [{"x": 2}])
