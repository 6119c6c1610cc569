"The top-level API of `sparsekv/__init__.py`: light to import; every public name of every module resolves from it."
import importlib
import subprocess
import sys

import sparsekv

AMBIGUOUS = {"main", "METHODS", "retention_recall", "distill", "names", "make"}  # documented in sparsekv/__init__.py


def test_import_is_light():
    code = "import sys, sparsekv; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_resolves():
    for mod in sparsekv._modules():
        m = importlib.import_module(f"sparsekv.{mod}")
        for name in getattr(m, "__all__", ()):
            if name not in AMBIGUOUS: assert getattr(sparsekv, name) is getattr(m, name), (mod, name)
    assert {"load_model", "patch", "chunked_prefill", "methods", "QuokaPolicy", "PageRetrievalPolicy", "KVpopStudent",
            "DistillConfig", "distill", "distill_loop"} <= set(dir(sparsekv))
    from sparsekv import chunked_prefill, load_model, methods, patch  # noqa: F401  the README's import


def test_ambiguous_names_have_one_documented_meaning():
    from sparsekv import eval as ev
    from sparsekv.kvpop import loss, target
    assert sparsekv.retention_recall is ev.retention_recall and sparsekv.kvpop_retention_recall is loss.retention_recall
    assert sparsekv.TARGET_METHODS is target.METHODS
    assert sparsekv.make is sparsekv.methods.make and sparsekv.names is sparsekv.methods.names
    assert sparsekv.distill_main is importlib.import_module("sparsekv.train").main
    assert sparsekv.distill is importlib.import_module("sparsekv.distill")
    assert sparsekv.distill_loop is sparsekv.distill.distill
    for name in ("main", "METHODS"):
        try: getattr(sparsekv, name)
        except AttributeError as e: assert "ambiguous" in str(e)
        else: raise AssertionError(f"sparsekv.{name} should be withheld")
    assert {"kvpop_retention_recall", "TARGET_METHODS", "SUMMARY_METHODS", "distill_main"} <= set(dir(sparsekv))
