"""The KVpop stages' shared helpers: held-out logits bit for bit as the stages computed them before, the oracle, the
stages' runs (shipped students found again, checkpoint folders kept) and the decode benchmark's caches."""
import pytest
import torch

from sparsekv import methods
from sparsekv.hf import DensePolicy, patch
from sparsekv.kvpop.experiments import (
    DecodeBench,
    DistillRun,
    OraclePolicy,
    TrainRun,
    agreement_kl,
    decode_tables,
    fast_forward,
    filled_kvpop_decoder,
    scored_logits,
)
from sparsekv.kvpop.student import shipped_checkpoints
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


def test_a_rerun_of_the_shipping_profile_finds_its_shipped_students():
    "Every shipped student was trained with the settings `TrainRun` records: a rerun of its profile reuses it."
    model, tok = load_model("tiny-llama")
    shipped = shipped_checkpoints()
    assert shipped, "the package ships trained students"
    for name, manifest in shipped.items():
        run = TrainRun(model, tok, manifest["model"], manifest["seq_len"], manifest["sink"], manifest["window"],
                       [manifest["compression"]], [manifest["method"].removeprefix("kvpop_")],
                       n_train=manifest["data"]["n_windows"], n_select=0, n_val=1, steps=manifest["steps"],
                       new_lr=manifest["new_lr"], n_boundaries=manifest["n_boundaries"], ship=True)
        run.chosen = manifest["decay"]
        sc = manifest["method"].removeprefix("kvpop_")
        assert run.shipped_name(sc, manifest["compression"]) == name
        assert run.already_shipped(sc, manifest["compression"]), name
        run.chosen = "learned"
        assert not run.already_shipped(sc, manifest["compression"])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_every_token_baseline_fed_its_budget_in_one_chunk_is_token_by_token(name, tmp_path):
    "No eviction before the cache holds its budget: the first B tokens in one chunk give what one by one gives."
    model, tok = load_model(name)
    run = TrainRun(model, tok, name, 64, 2, 4, [0.75], ["mlp"], n_train=1, n_select=0, n_val=2, baseline_batch=2,
                   out_dir=tmp_path)
    for baseline in ("tova:all", "h2o"):
        m = run.evicting_baseline(baseline, 0.75)
        one_by_one = run.logits(run.val_ids, m.policy(), m.cache(model), 1)
        rows = run.every_token_metrics(baseline, 0.75, 0)
        want = [agreement_kl(one_by_one[j:j + 1], run.logits(run.val_ids[j:j + 1])) for j in range(2)]
        assert [r["agreement"] for r in rows] == [w["agreement"] for w in want]
        torch.testing.assert_close([r["kl"] for r in rows], [w["kl"] for w in want], atol=1e-6, rtol=1e-4)


def test_the_cpu_profiles_students_keep_their_checkpoint_folders():
    """The folder a `kvpop_distill` student trains in is named by a hash of its settings; these are the names the cpu
    profile's students had before the stage's helpers moved into the library, so its reruns resume them."""
    model, tok = load_model("tiny-llama")
    run = DistillRun(model, tok, "smollm2-135m", "float32", "cpu", 512, [0.75], 4, 8, n_train=16, batch_size=1,
                     n_val=2, n_select=2, steps=8, full_steps=6, scorer_lr=0.01, dms_bias_scale=500.0, eval_every=4,
                     eviction_chunk=1, baseline_batch=2, out_dir="runs/cpu")
    run.base_lr = 8e-6
    want = {"dms": "f332f5fbad4fff5a", "kvpop_mlp": "f33689f3b9c3a06f", "kvpop_mlp_full": "8554bca20fbcbe6f",
            "kvpop_mlstm": "8ffccfcb7acdd070", "kvpop_mlstm_immediate": "69dc043a2a8719d9",
            "streaming_llm_plus": "df408f2bbd8e1951"}
    got = {m: run.training(m, 0.75)[1].name for m in want}
    assert got == {m: f"{m}_S512_cr0.75_{h}" for m, h in want.items()}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_decode_memory_is_bounded_for_kvpop_and_linear_for_dense(name):
    "Across contexts a KVpop cache holds the same bytes; a dense cache grows by two tensors of keys per token."
    model, tok = load_model(name)
    bench = DecodeBench(model, tok, [[2, 4, 6]], 8, 24)
    bench.steady(3, 1)
    mem, lat = bench.context_sweep([32, 48, 96], 1)
    cfg = model.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * bench.head_dim * 4   # float32 keys and values
    dense = mem[mem.method == "dense"].set_index("L").cache_bytes
    assert (dense == dense.index * per_token).all()
    for m in bench.kv:
        kv = mem[mem.method == m]
        assert kv.cache_bytes.nunique() == 1 and (kv.cache_bytes < dense[32]).all()
        assert (kv.step_peak_bytes > kv.cache_bytes).all()
    table, ratios, names = decode_tables(mem, lat, list(bench.kv))
    assert names == list(bench.kv) and list(ratios.L) == [32, 48, 96]


def test_fast_forward_keeps_the_kept_set_and_moves_the_next_position():
    "A fast-forwarded KVpop cache holds the same entries (its sinks in place, the rest moved) and decodes at L."
    model, tok = load_model("tiny-llama")
    bench = DecodeBench(model, tok, [[2, 4, 6]], 8, 24)
    for kind in ("mlp", "mlstm"):
        dec = filled_kvpop_decoder(model, bench.prose, kind, 2, 4, 6, 8)
        ff = dec.copy()
        fast_forward(ff.cache, 200)
        for a, b in zip(dec.cache.layers, ff.cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert torch.equal(torch.where(a.positions >= 2, a.positions + 200 - a.seen, a.positions), b.positions)
        assert ff.cache.get_seq_length() == 200
