"The top-level API of `sparsekv/__init__.py`: light to import; the submodules and a curated set of names, nothing more."
import importlib
import pkgutil
import subprocess
import sys

import pytest

import sparsekv

# The curated names and the modules they come from: what a user calls, as the README and the docs show it.
API = {
    "models": ["load_model"],
    "hf": ["patch", "chunked_prefill", "Method", "measure_attended", "ModelShape", "scoring_cost", "AttentionPolicy",
           "DensePolicy", "MaskPolicy", "SelectionPolicy"],
    "methods": ["names", "make"],
    "cache": ["EvictionRule", "SinkWindowRule", "TopScoreRule", "EvictingCache", "SinkWindowCache"],
    "kvpop.cache": ["KVpopScorers", "KVpopCache", "KVpopPolicy"],
    "kvpop.student": ["KVpopStudent", "shipped_checkpoints"],
    "quoka.policy": ["QuokaPolicy"],
    "oval.pages": ["PageRetrievalPolicy"],
    "distill": ["DistillConfig"],
    "eval": ["perplexity", "top1_agreement", "token_kl", "kl_to_teacher", "token_nll", "token_accuracy",
             "attention_mass_recall", "attention_fidelity", "relative_output_error", "retention_recall",
             "needle_retention", "pass_at_k", "avg_at_k"],
    "data": ["make_task"],
    "protocol": ["answer", "continuation", "fit_budget", "measured_budget"],
    "costs": ["matched"],
    "stats": ["paired_ci", "compare"],
}
CURATED = {name: mod for mod, names in API.items() for name in names}
MODULES = {m.name for m in pkgutil.iter_modules(sparsekv.__path__) if not m.name.startswith("_")}
# helpers that build test fixtures or time code: they stay in their modules
TEST_HELPERS = {"tiny_model", "tiny_config", "byte_tokenizer", "random_scorers", "bench_cutoff", "bench_target"}


def test_import_is_light():
    "`import sparsekv`, its `__all__` and `dir` import neither torch nor transformers."
    code = ("import sys, sparsekv; sparsekv.__all__; dir(sparsekv); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_and_dir_are_the_curated_names():
    assert set(sparsekv.__all__) == set(CURATED) | MODULES
    assert {n for n in dir(sparsekv) if not n.startswith("__")} == set(sparsekv.__all__)
    assert {"attention", "kvpop", "quoka", "oval", "methods", "distill", "eval", "protocol"} <= MODULES


@pytest.mark.parametrize("name,mod", sorted(CURATED.items()))
def test_curated_names_resolve_to_their_module(name, mod):
    assert getattr(sparsekv, name) is getattr(importlib.import_module(f"sparsekv.{mod}"), name)


def test_modules_resolve():
    for mod in MODULES: assert getattr(sparsekv, mod) is importlib.import_module(f"sparsekv.{mod}")
    assert sparsekv.distill.distill is importlib.import_module("sparsekv.distill").distill  # the module, not the loop
    from sparsekv import chunked_prefill, load_model, methods, patch  # noqa: F401  the README's import


def test_no_reference_and_no_test_helper_at_the_top():
    assert not [n for n in sparsekv.__all__ if n.endswith("_reference") or n.startswith(("check_", "bench_"))]
    assert not TEST_HELPERS & set(sparsekv.__all__)


def test_names_of_several_modules_have_one_meaning():
    assert sparsekv.retention_recall is importlib.import_module("sparsekv.eval").retention_recall
    assert sparsekv.make is sparsekv.methods.make and sparsekv.names is sparsekv.methods.names


@pytest.mark.parametrize("name,where", [
    ("attention_reference", ["sparsekv.attention.attention_reference"]),
    ("tiny_model", ["sparsekv.models.tiny_model"]),
    ("random_scorers", ["sparsekv.kvpop.cache.random_scorers"]),
    ("get", ["sparsekv.methods.get"]),
    ("SMOLLM2", ["sparsekv.costs.SMOLLM2"]),
    ("main", ["sparsekv.docs.main", "sparsekv.reproduce.main", "sparsekv.train.main"]),
    ("METHODS", ["sparsekv.kvpop.target.METHODS", "sparsekv.oval.summaries.METHODS"]),
])
def test_a_name_outside_the_api_says_where_it_lives(name, where):
    with pytest.raises(AttributeError, match="not in the top-level API") as e: getattr(sparsekv, name)
    assert all(w in str(e.value) for w in where), str(e.value)
    for w in where:
        mod, attr = w.rsplit(".", 1)
        assert hasattr(importlib.import_module(mod), attr)


def test_unknown_and_private_names():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"): _ = sparsekv.no_such_name
    assert not hasattr(sparsekv, "_no_such_name") and not hasattr(sparsekv, "__wrapped__")
