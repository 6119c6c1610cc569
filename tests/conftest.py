"""Pytest configuration: `slow` tests run with --run-slow, `gpu` tests only where CUDA is available, `peers` tests (the
kvpress cross-checks) with --peers, in the peer environment (`make test-peers`)."""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels compile only for a GPU; here they run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    "Two test workers share two cores; tiny tensors gain nothing from intra-op threads, which then spin (10x slower)."
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")
    parser.addoption("--peers", action="store_true",
                     help="run the tests marked peers (kvpress cross-checks; kvpress missing is then a failure)")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow: run with `make test-all` (--run-slow)"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA device"))
        if "peers" in item.keywords and not config.getoption("--peers"):
            item.add_marker(pytest.mark.skip(reason="peers: a kvpress cross-check, run by `make test-peers`"))


@pytest.fixture(scope="session")
def kvpress():
    "kvpress, which only the peer environment holds; with --peers its absence fails the test instead of skipping it."
    try: return importlib.import_module("kvpress")
    except ImportError as e:
        pytest.fail(f"--peers runs the kvpress cross-checks, but kvpress is not installed ({e}): run them with "
                    "`make test-peers`, which builds the peer environment .venv-peers")


# every tiny model a test uses: (load_model name, config overrides); all share load_model's default seed
TINY_MODELS = {"llama": ("tiny-llama", {}), "qwen3": ("tiny-qwen3", {}),
               "llama-g1": ("tiny-llama", dict(num_kv_heads=4)), "llama-g4": ("tiny-llama", dict(num_kv_heads=1))}


def _load_tiny(key, dtype="float32"):
    "A fresh `TINY_MODELS[key]` in `dtype`. Fixtures are module-scoped: tests patch, hook or train their model."
    from sparsekv.models import load_model

    name, overrides = TINY_MODELS[key]
    return load_model(name, dtype=dtype, **overrides)[0]


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-g1"])
def tiny_model(request):
    "Each tiny seeded float32 model: Llama (GQA, G = 2), Qwen3 and Llama with G = 1."
    return _load_tiny(request.param)


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def every_tiny_model(request):
    "The three of `tiny_model` and Llama with G = 4 (one KV head)."
    return _load_tiny(request.param)


@pytest.fixture(scope="module")
def tiny_llama():
    "The tiny seeded float32 Llama (GQA, G = 2)."
    return _load_tiny("llama")


@pytest.fixture(scope="module")
def tiny_llama64():
    "The tiny Llama (G = 2) in float64, for comparisons with brute force at tight tolerance."
    return _load_tiny("llama", "float64")


@pytest.fixture(scope="module", params=["llama", "llama-g1"], ids=["gqa", "mha"])
def tiny_llama64_gqa_mha(request):
    "The float64 tiny Llama with G = 2 (GQA) and with G = 1 (MHA)."
    return _load_tiny(request.param, "float64")
