"Repository hygiene: notebooks are committed clean and in step with their jupytext twins."
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted([*ROOT.glob("nbs/*.ipynb"), *ROOT.glob("reproduce/*.ipynb")], key=str)


def twin(nb_path: Path) -> Path:
    return ROOT/"text"/nb_path.relative_to(ROOT).with_suffix(".py")


def cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        assert not c.get("outputs") and c.get("execution_count") is None, \
            f"{path.name}: outputs committed (make clean-nbs)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_matches_text_twin(path):
    assert twin(path).is_file(), f"{path.name} has no text twin {twin(path)} (make sync)"
    assert cells(nbformat.read(path, as_version=4)) == cells(jupytext.read(twin(path))), \
        f"{path.name} and {twin(path).name} differ (make sync)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_opens_on_the_project_kernel(path):
    "JupyterLab opens each notebook on the kernel of the environment it runs in (`python3`), without asking."
    spec = nbformat.read(path, as_version=4).metadata.get("kernelspec", {})
    assert spec.get("name") == "python3" and spec.get("language") == "python", f"{path.name}: kernelspec {spec}"
