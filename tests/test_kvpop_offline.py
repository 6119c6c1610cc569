"Training KVpop's scorers from cached activations: the same step as the in-model dense-target step, a careful store."
import json

import pytest
import torch

from sparsekv import methods
from sparsekv.data import packed_sequences
from sparsekv.distill import DistillConfig
from sparsekv.hf import measure_attended, patch
from sparsekv.kvpop.cache import random_scorers
from sparsekv.kvpop.offline import ActivationStore, cache_activations, cached_eval, train_offline, window_activations
from sparsekv.kvpop.student import KVpopStudent, shipped_checkpoints
from sparsekv.models import SMOLLM2_NAME, load_model


def _ids(model, B: int, S: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,kv_heads", [("tiny-llama", None), ("tiny-qwen3", None), ("tiny-llama", 4)])
@pytest.mark.parametrize("kind", ["mlp", "mlstm"])
def test_cached_step_equals_in_model_dense_step(name, kv_heads, kind):
    "Loss and every gradient of a cached step equal the in-model step with target='dense' (GQA groups of 1 too)."
    model, _ = load_model(name, **({} if kv_heads is None else dict(num_kv_heads=kv_heads)))
    ids = _ids(model, 2, 33, seed=len(name))
    st = KVpopStudent(random_scorers(model, seed=5, kind=kind, delay=3 if kind == "mlstm" else 0), sink=1, window=3,
                      k=5, n_boundaries=12, target="dense").train()
    with patch(model, st.policy()): model(input_ids=ids, logits_to_keep=1)
    loss_model, m_model = st.method_loss(7)
    g_model = torch.autograd.grad(loss_model, list(st.parameters()), allow_unused=True)
    loss_cached, m_cached = st.cached_loss(window_activations(model, ids, 3, dtype=torch.float32), 7)
    g_cached = torch.autograd.grad(loss_cached, list(st.parameters()), allow_unused=True)
    torch.testing.assert_close(loss_cached, loss_model, rtol=1e-5, atol=1e-6)
    assert m_cached["retention_recall"] == pytest.approx(m_model["retention_recall"])
    for a, b in zip(g_cached, g_model):
        assert (a is None) == (b is None)
        if a is not None: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_sparse_and_dense_targets_differ_and_a_sparse_student_refuses_cached_batches():
    model, _ = load_model("tiny-llama")
    ids = _ids(model, 1, 40)
    acts = window_activations(model, ids, 4, dtype=torch.float32)
    sparse = KVpopStudent(random_scorers(model, seed=1), sink=2, window=4, k=4).train()
    with patch(model, sparse.policy()): model(input_ids=ids, logits_to_keep=1)
    pos = torch.arange(40).expand(1, model.config.num_key_value_heads, 40)
    sparse_target = sparse.captured[-1][1]
    dense_target = sparse.scorers.decayed(model.config.num_hidden_layers - 1, acts["target"][:, -1], pos)
    assert (sparse_target - dense_target).abs().max() > 1e-3  # a budget of 10 of 40 keys changes the normalizer
    with pytest.raises(ValueError, match="target='dense'"): sparse.cached_loss(acts, 0)
    dense = KVpopStudent(sparse.scorers, 2, 4, 4, target="dense")
    with pytest.raises(ValueError, match=r"batch\['keys'\] must be \[B, L=2"):
        dense.cached_loss({k: v[:, :1] for k, v in acts.items()}, 0)


def test_window_shorter_than_the_budget_is_refused_by_name():
    "A window with no query past s + w + k leaves no boundary to learn: the error names the sizes."
    model, _ = load_model("tiny-llama")
    st = KVpopStudent(random_scorers(model), sink=2, window=4, k=10, target="dense")
    with pytest.raises(ValueError, match="S=12 leaves no query position"):
        st.cached_loss(window_activations(model, _ids(model, 1, 12), 4), 0)


def test_store_refuses_another_model_and_bad_sequences(tmp_path):
    model, _ = load_model("tiny-llama")
    store = cache_activations(model, _ids(model, 3, 24), tmp_path / "a", window=4, progress=False)
    assert len(store) == 3 and json.loads((tmp_path / "a" / "manifest.json").read_text())["seq_len"] == 24
    other, _ = load_model("tiny-llama")  # the same config, other weights
    with torch.no_grad(): next(other.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="weights"):
        store.check(other, KVpopStudent(random_scorers(other), 2, 4, 4))
    with pytest.raises(ValueError, match="sequences must be a \\[N, S\\]"):
        cache_activations(model, _ids(model, 1, 24)[0], tmp_path / "b", window=4)
    with pytest.raises(FileNotFoundError, match="cache_activations"): ActivationStore(tmp_path / "nothing")
    with pytest.raises(IndexError, match=r"\[0, 3\)"): store[3]


def test_training_lowers_the_held_out_loss_and_raises_recall(tmp_path):
    model, _ = load_model("tiny-llama")
    train = cache_activations(model, _ids(model, 8, 48, seed=1), tmp_path / "t", window=4, progress=False)
    val = cache_activations(model, _ids(model, 2, 48, seed=2), tmp_path / "v", window=4, progress=False)
    torch.manual_seed(0)
    st = KVpopStudent(random_scorers(model, seed=0), sink=2, window=4, k=8, n_boundaries=32, target="dense")
    before = cached_eval(st, val)
    train_offline(model, st, train, DistillConfig(steps=30, mode="cached", new_lr=3e-2, new_lr_min=3e-3,
                                                  warmup_steps=2), batch_size=2, progress=False)
    after = cached_eval(st, val)
    assert after["retention_loss"] < before["retention_loss"], (before, after)
    assert after["retention_recall"] > before["retention_recall"] + 0.05, (before, after)


def shipped(name: str):
    "Shipped scorer `name` as a test parameter: slow unless its model is SmolLM2 (the second model's parts are big)."
    bundled = shipped_checkpoints()[name]["model"] == SMOLLM2_NAME
    return pytest.param(name, id=name, marks=() if bundled else pytest.mark.slow)


SHIPPED = [shipped(n) for n in sorted(shipped_checkpoints())]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_scorers_load_by_name(name):
    "Each shipped checkpoint loads with one call and its manifest describes the weights it ships."
    manifest = shipped_checkpoints()[name]
    model, _ = load_model(manifest["model"])
    m = methods.make(manifest["method"], budget=manifest["budget"], checkpoint=name)
    assert (m.sink, m.window, m.k) == (manifest["sink"], manifest["window"], manifest["k"])
    st = m.trained_student(model)
    got = float(torch.stack([d() for d in st.scorers.decays]).mean().detach())
    assert got == pytest.approx(manifest["mean_log_gamma"], rel=1e-5)
    assert any(p.abs().sum() > 0 for n, p in st.named_parameters() if "out" in n or "score" in n)  # trained, not zero
    with pytest.raises(ValueError, match="was trained with sink=4, window=64"):
        methods.make(manifest["method"], budget=manifest["budget"], window=32, checkpoint=name)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_scorers_keep_exactly_their_budget_on_a_real_window(name):
    "After a held-out prose window longer than the budget, every decode query of every layer and head sees the budget."
    manifest = shipped_checkpoints()[name]
    model, tok = load_model(manifest["model"])
    budget = manifest["budget"]
    ids = packed_sequences(tok, budget + 2 * manifest["window"], "validation", n=1)
    m = methods.make(manifest["method"], budget=budget, checkpoint=name)
    with measure_attended() as meter: m.generate(model, ids, max_new_tokens=3)
    decode = [r for r in meter.per_head() if r["phase"] == "decode"]
    assert len(decode) == model.config.num_hidden_layers * model.config.num_attention_heads
    assert {(r["mean"], r["max"]) for r in decode} == {(budget, budget)}, name
    # the cache at its peak: the budget, one more for a recurrent scorer (its pending token waits for its score)
    assert meter.stored("decode")["entries"] == budget + (manifest["method"] == "kvpop_mlstm")


def test_some_scorers_are_shipped():
    "The package ships KVpop scorers for SmolLM2 at CR 75% and 88% (the cpu profile evaluates them)."
    assert {f"smollm2-135m-cr{c}-{s}" for c in (75, 88) for s in ("mlp", "mlstm")} <= set(shipped_checkpoints())
