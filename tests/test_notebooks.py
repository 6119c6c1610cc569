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


def export_cells() -> list[tuple[str, int, bool]]:
    "Each export cell of the library's notebooks: (notebook, lines with its `#| export`, followed directly by a check)."
    rows = []
    for path in sorted(ROOT.glob("nbs/*.ipynb")):
        nb = nbformat.read(path, as_version=4).cells
        for i, c in enumerate(nb):
            src = c.source.strip()
            if c.cell_type != "code" or not src.startswith("#| export"): continue
            after = nb[i + 1] if i + 1 < len(nb) else None
            checked = after is not None and after.cell_type == "code" and not after.source.startswith("#| export")
            rows.append((path.name, len(src.splitlines()), checked))
    return rows


def test_export_cells_are_short_and_checked():
    "fastcore's scale: one short definition per export cell, each followed directly by the cell that checks it."
    rows = export_cells()
    sizes = sorted(n for _, n, _ in rows)
    assert len(rows) > 500 and sizes[len(sizes) // 2] <= 10, f"median export cell {sizes[len(sizes) // 2]} lines"
    assert sizes[-1] <= 60, [(nb, n) for nb, n, _ in rows if n > 60]
    assert sum(c for *_, c in rows) >= 0.8 * len(rows), f"{sum(c for *_, c in rows)} of {len(rows)} followed by a check"


@pytest.mark.parametrize("path", sorted(ROOT.glob("reproduce/*.ipynb")), ids=lambda p: p.name)
def test_stage_notebook_reads_as_a_document(path):
    "A stage notebook is parameters, one run, its tables and figures: its helpers live in the library."
    code = [line for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"
            for line in c.source.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= 300, f"{path.name}: {len(code)} lines of code"
