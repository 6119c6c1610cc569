"The KVpop stages' shared helpers: held-out logits bit for bit as the stages computed them before, the oracle."
import pytest
import torch

from sparsekv import methods
from sparsekv.hf import DensePolicy, patch
from sparsekv.kvpop.experiments import OraclePolicy, scored_logits
from sparsekv.models import load_model


def _ids(model, B: int, S: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _sliced(model, ids, n_scored, policy, cache, chunk):
    "Chunk by chunk with every position's logits, the scored ones sliced afterwards (kvpop_distill's former loop)."
    S, out = ids.shape[1], []
    with patch(model, policy):
        for a in range(0, S, chunk):
            pos = torch.arange(a, min(a + chunk, S))
            logits = model(ids[:, pos], past_key_values=cache, use_cache=True, position_ids=pos[None]).logits
            out.append(logits[:, max(0, S - n_scored - a):])
    return torch.cat(out, 1).float()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("method,chunk", [("streaming_llm", 40), ("tova", 1), ("h2o", 7)])
def test_scored_logits_equal_all_logits_sliced(name, method, chunk):
    "Asking the model only for the scored positions' logits gives the same bits as slicing all of them."
    model, _ = load_model(name)
    ids = _ids(model, 2, 40, seed=len(method))
    m = methods.make(method, budget=4 + 8 + 6, sink=4, window=8)
    got = scored_logits(model, ids, 30, m.policy(), m.cache(model), chunk)
    want = _sliced(model, ids, 30, m.policy(), m.cache(model), chunk)
    assert torch.equal(got, want)


def test_scored_logits_one_forward_is_the_model_under_the_policy():
    model, _ = load_model("tiny-llama")
    ids = _ids(model, 1, 24)
    with torch.no_grad(), patch(model, DensePolicy()):
        want = model(ids).logits.float()[:, -10:]
    assert torch.equal(scored_logits(model, ids, 10, DensePolicy()), want)


def test_oracle_with_every_eligible_key_kept_is_dense():
    "A long-range budget holding every eligible key leaves nothing to evict: the oracle attends densely."
    model, _ = load_model("tiny-llama")
    ids = _ids(model, 1, 24)
    dense = scored_logits(model, ids, 24, DensePolicy())
    torch.testing.assert_close(scored_logits(model, ids, 24, OraclePolicy(24, -0.01, 2, 3)), dense,
                               atol=1e-5, rtol=1e-5)
