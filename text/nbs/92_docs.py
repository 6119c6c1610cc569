# %% [markdown]
# # The docs site and the README
#
# > `python -m sparsekv.docs`: executes the notebooks, runs nbdev's notebook processing and builds an offline static site with Sphinx.

# %%
#| default_exp docs

# %% [markdown]
# nbdev renders its sites with Quarto, which cannot be installed on a machine without
# internet. We keep nbdev's own notebook processing (`FilterDefaults`: front matter,
# `show_doc` for every exported name, hidden cells removed) and hand its output to
# [Sphinx](https://www.sphinx-doc.org) with [MyST-NB](https://myst-nb.readthedocs.io), the
# notebook reader of Jupyter Book, and the Furo theme. Math is typeset in the browser by a
# copy of MathJax 3 installed with npm next to the virtual environment: no CDN.
#
# The build, step by step:
#
# 1. **Execute.** Notebooks are committed without outputs (`clear_all = true`), so each
#    notebook of `nbs/` is executed by nbdev's own test runner (`test_nb`, skipping the
#    `slow`/`gpu`/`notest` cells) into a mirror folder `_build/exec/`. Executed copies are
#    cached by a hash of the notebook and of the library's sources. Notebooks of
#    `reproduce/` are taken already executed from the pipeline's last run
#    (`reproduce/runs/<profile>/`, preferring `gpu`, then `cpu`, then `quick`), or shown
#    unexecuted when the pipeline has not run.
# 2. **Process.** nbdev's `FilterDefaults` processors turn each notebook into a docs page.
#    We keep the exported code visible (this is a reference implementation: the code is
#    meant to be read), so `rm_export` is skipped. Quarto-only markup is translated for
#    MyST-NB: the YAML front matter becomes the page title, `#| echo: false` becomes the
#    `remove-input` tag.
# 3. **Render.** Sphinx builds `_docs/`, with a sidebar listing every notebook.

# %%
#| export
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import yaml

from sparsekv.io import write_text

# %%
#| export
SKIP_FLAGS = ("notest", "slow", "gpu")
PROFILE_PREFERENCE = ("gpu", "cpu", "quick")

def project_root(start: str | os.PathLike | None = None) -> Path:
    "The nearest folder at or above `start` holding a `pyproject.toml` with `[tool.nbdev]`."
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        p = d/"pyproject.toml"
        if p.is_file() and "[tool.nbdev]" in p.read_text(): return d
    raise FileNotFoundError(f"no pyproject.toml with [tool.nbdev] at or above {here}")


# %% [markdown]
# ## 1. Executing notebooks, with a cache

# %%
#| export
def library_digest(root: Path) -> str:
    "Hash of the library's sources: executed notebooks are stale when the library changes."
    h = hashlib.sha256()
    for p in sorted((root/"sparsekv").rglob("*.py")): h.update(p.read_bytes())
    return h.hexdigest()

def execute_notebook(src: Path, dest: Path, digest: str) -> Path:
    "Execute notebook `src` with nbdev's test runner into `dest`, reusing `dest` if `src` and the library are unchanged."
    from nbdev.test import test_nb
    key = hashlib.sha256(src.read_bytes() + digest.encode()).hexdigest()
    stamp = dest.with_suffix(".sha256")
    if dest.exists() and stamp.exists() and stamp.read_text() == key: return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.with_name(f".{dest.stem}.partial.ipynb")
    shutil.copyfile(src, work)
    # test_nb runs in the notebook's folder; notebooks import the library and use no relative paths.
    ok, _ = test_nb(work, skip_flags=list(SKIP_FLAGS), save=True, showerr=True)
    if not ok:
        work.unlink(missing_ok=True)
        raise RuntimeError(f"executing {src} for the docs failed (see the traceback above)")
    os.replace(work, dest)
    write_text(stamp, key)
    return dest


# %%
#| export
def reproduce_notebooks(root: Path) -> dict[Path, Path]:
    "Map each pipeline notebook to its latest executed copy (or to itself when no profile has run it)."
    spec = yaml.safe_load((root/"reproduce"/"pipeline.yaml").read_text()) or {}
    res = {}
    for name, s in (spec.get("stages") or {}).items():
        src = root/s["notebook"]
        runs = [root/"reproduce"/"runs"/p/f"{name}.ipynb" for p in PROFILE_PREFERENCE]
        res[src] = next((r for r in runs if r.exists()), src)
    return res


# %% [markdown]
# ## 2. nbdev's processing, translated for MyST-NB

# %%
#| export
_re_directive = re.compile(r"^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$")

def _split_directives(src: str) -> tuple[dict, str]:
    "Leading `#| name: value` lines of a cell as a dict, and the remaining source."
    lines, dirs = src.splitlines(), {}
    while lines and (m := _re_directive.match(lines[0])):
        dirs[m.group(1)] = m.group(2)
        lines.pop(0)
    return dirs, "\n".join(lines)

def _title_cell(raw: str):
    "A Markdown title cell from nbdev's YAML front matter."
    from nbformat.v4 import new_markdown_cell
    fm = yaml.safe_load(raw.strip().strip("-")) or {}
    text = f"# {fm.get('title', 'Untitled')}"
    if fm.get("description"): text += f"\n\n> {fm['description']}"
    return new_markdown_cell(text)

_re_source_link = re.compile(r"^\[source\]\([^)]*\)\{[^}]*\}\s*$", re.MULTILINE)

def _clean_show_doc(md: str) -> str:
    "Drop show_doc's rule and repository link (a rule cannot sit inside an output block)."
    return _re_source_link.sub("", md).lstrip().removeprefix("---").lstrip()

def myst_cells(nb):
    "Translate the Quarto-specific markup nbdev's processors leave in `nb` for MyST-NB, in place."
    from nbformat.v4 import new_code_cell
    cells = []
    for c in nb.cells:
        if c.cell_type == "raw" and c.source.lstrip().startswith("---"):
            cells.append(_title_cell(c.source)); continue
        if c.cell_type == "markdown" and c.source.startswith("<!-- WARNING"): continue
        if c.cell_type == "code":
            dirs, c.source = _split_directives(c.source)
            if dirs.get("include") == "false": continue
            tags = [t for d, t in (("echo", "remove-input"), ("output", "remove-output")) if dirs.get(d) == "false"]
            # a fresh cell: nbdev's bookkeeping keys and execution timings are not valid nbformat
            c = new_code_cell(c.source, outputs=c.get("outputs", []), metadata={"tags": tags},
                              execution_count=c.get("execution_count"))
            for o in c.get("outputs", []):
                md = o.get("data", {}).get("text/markdown")
                if md and "show_doc" in c.source: o["data"]["text/markdown"] = _clean_show_doc("".join(md))
        cells.append(c)
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
    return nb


# %% [markdown]
# nbdev's `exec_show_docs` re-runs every cell that *contains* an import, to define the names
# `show_doc` documents. A check cell that imports something and then uses variables of earlier
# cells fails when run alone. The notebooks were already executed in full in step 1, so we
# re-run only what `show_doc` needs: exported cells, pure import cells and `show_doc` calls.

# %%
#| export
import ast

from nbdev.processors import exec_show_docs

_SHOW_DIRECTIVES = {"export", "exports", "exporti", "exec_doc"}

def _is_show_doc(t: ast.stmt) -> bool:
    return isinstance(t, ast.Expr) and isinstance(t.value, ast.Call) and getattr(t.value.func, "id", None) == "show_doc"

def needs_context(cell) -> bool:
    "A non-exported code cell doing more than imports or `show_doc`: it only runs after the cells before it."
    if cell.cell_type != "code" or cell.directives_.keys() & _SHOW_DIRECTIVES: return False
    trees = cell.parsed_()
    return bool(trees) and not all(isinstance(t, (ast.Import, ast.ImportFrom)) or _is_show_doc(t) for t in trees)

class exec_show_docs_in_isolation(exec_show_docs):
    "nbdev's `exec_show_docs`, skipping the cells that need the notebook's earlier state."
    def __call__(self, cell):
        if not needs_context(cell): super().__call__(cell)


# %%
#| export
def docs_processors(procs) -> list:
    "nbdev's docs processors, keeping exported code visible and executing only what `show_doc` needs."
    swap = {exec_show_docs: exec_show_docs_in_isolation}
    return [swap.get(p, p) for p in procs if p.__name__ != "rm_export"]

def process_notebook(src: Path, dest: Path, root: Path) -> Path:
    "Run nbdev's docs processors on notebook `src` and write the MyST-NB-ready page to `dest`."
    import nbformat
    from fastcore.nbio import nb2str, read_nb
    from nbdev.processors import FilterDefaults
    cwd = Path.cwd()
    os.chdir(root)  # nbdev's processors read the project's config from the working directory
    try:
        nb = read_nb(src)
        procs = FilterDefaults()
        procs.base_procs = lambda: docs_processors(FilterDefaults.base_procs(procs))
        with warnings.catch_warnings():  # the mixed-cell warning concerns cells we no longer re-run
            warnings.filterwarnings("ignore", message="Found cells containing imports")
            procs(nb)
    finally:
        os.chdir(cwd)
    nb = nbformat.reads(nb2str(nb), as_version=4)
    myst_cells(nb)
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return dest


# %% [markdown]
# ## 3. Sphinx

# %%
#| export
SPHINX_CONF = '''\
project = "sparsekv"
author = "sparsekv developers"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "mathjax"]
html_theme = "furo"
html_title = "sparsekv"
html_static_path = ["_static"]
mathjax_path = "mathjax/tex-chtml.js"
mathjax3_config = {"tex": {"tags": "ams"}}
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "attrs_inline"]
myst_heading_anchors = 3
nb_execution_mode = "off"
nb_render_markdown_format = "myst"
nb_merge_streams = True
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type", "misc.highlighting_failure"]
'''

def toctree(caption: str, pages: list[str]) -> str:
    "A hidden MyST toctree: the sidebar section `caption` listing `pages`."
    return "\n".join(["```{toctree}", ":hidden:", f":caption: {caption}", "", *pages, "```"])

def page_name(rel: Path) -> str:
    return rel.with_suffix("").as_posix()


# %%
#| export
def build_docs(root: str | os.PathLike | None = None, dest: str | os.PathLike | None = None,
               mathjax: str | os.PathLike | None = None, execute: bool | list[str] = True,
               only: list[str] | None = None) -> Path:
    "Build the static site into `dest` (default `_docs/`) from all notebooks or `only` these (by stem); `execute` may name the only ones to run."
    import nbformat
    from nbformat.v4 import new_markdown_cell
    root = project_root(root)
    dest = Path(dest) if dest else root/"_docs"
    mathjax = Path(mathjax) if mathjax else root/".venv/mathjax/node_modules/mathjax/es5/tex-chtml.js"
    if not mathjax.is_file(): raise FileNotFoundError(f"mathjax: {mathjax} not found (run `make docs`, which installs it)")
    site, exec_dir = root/"_build"/"site", root/"_build"/"exec"
    shutil.rmtree(site, ignore_errors=True)
    digest = library_digest(root)
    wanted = lambda p: only is None or p.stem in only or p.stem == "index"
    lib = sorted(p for p in (root/"nbs").glob("*.ipynb") if wanted(p))
    pages = {}
    for src in lib:
        run = execute is True or (execute and src.stem in execute)
        pages[src.relative_to(root/"nbs")] = execute_notebook(src, exec_dir/src.name, digest) if run else src
    for src, executed in reproduce_notebooks(root).items():
        if wanted(src): pages[src.relative_to(root)] = executed
    for rel, src in pages.items(): process_notebook(src, site/rel, root)
    index = nbformat.read(site/"index.ipynb", as_version=4)
    library = [page_name(r) for r in pages if r.parts[0] != "reproduce" and r.stem != "index"]
    experiments = [page_name(r) for r in pages if r.parts[0] == "reproduce"]
    index.cells.append(new_markdown_cell(toctree("Library", library) + "\n\n" + toctree("Experiments", experiments)))
    nbformat.write(index, site/"index.ipynb")
    write_text(site/"conf.py", SPHINX_CONF)
    shutil.copytree(mathjax.parent, site/"_static"/"mathjax")
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", "auto", str(site), str(dest)], check=True)
    return dest


# %% [markdown]
# ## The README
#
# `README.md` is generated from `nbs/index.ipynb` (the docs home page) by the same
# processing, then written as GitHub-flavoured Markdown with nbconvert. `make test` checks it
# is up to date.

# %%
#| export
def readme_text(root: str | os.PathLike | None = None) -> str:
    "The README generated from `nbs/index.ipynb`."
    import tempfile
    import nbformat
    from nbconvert import MarkdownExporter
    root = project_root(root)
    with tempfile.TemporaryDirectory() as d:
        nb = nbformat.read(process_notebook(root/"nbs"/"index.ipynb", Path(d)/"index.ipynb", root), as_version=4)
    body, _ = MarkdownExporter(exclude_output=True).from_notebook_node(nb)
    note = "<!-- Generated from nbs/index.ipynb by `python -m sparsekv.docs --readme`: edit the notebook. -->\n\n"
    return note + re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"

def write_readme(root: str | os.PathLike | None = None) -> Path:
    "Regenerate `README.md` from `nbs/index.ipynb`."
    root = project_root(root)
    return write_text(root/"README.md", readme_text(root))


# %%
#| export
def main(argv: list[str] | None = None) -> int:
    "Command line: `python -m sparsekv.docs [--readme] [--dest DIR] [--mathjax FILE] [--no-execute]`."
    ap = argparse.ArgumentParser(prog="python -m sparsekv.docs", description="Build the sparsekv docs site or README.")
    ap.add_argument("--readme", action="store_true", help="only regenerate README.md from nbs/index.ipynb")
    ap.add_argument("--dest", help="output folder (default: _docs/)")
    ap.add_argument("--mathjax", help="path to MathJax 3's es5/tex-chtml.js")
    ap.add_argument("--no-execute", action="store_true", help="render notebooks without executing them")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="build only these notebooks (file stems) and the home page")
    a = ap.parse_args(argv)
    if a.readme: print(f"wrote {write_readme()}"); return 0
    out = build_docs(dest=a.dest, mathjax=a.mathjax, execute=not a.no_execute, only=a.only)
    print(f"built {len(list(out.rglob('*.html')))} pages into {out}")
    return 0


# %%
#| export
#| eval: false
if __name__ == "__main__": sys.exit(main())

# %% [markdown]
# ## Checks

# %%
from fastcore.test import test_eq
from nbformat.v4 import new_code_cell, new_notebook, new_raw_cell

nb = new_notebook(cells=[new_raw_cell("---\ntitle: T\ndescription: D\n---"),
                         new_code_cell("#| echo: false\n#| output: asis\nshow_doc(f)"),
                         new_code_cell("#| include: false\nx = 1"), new_code_cell("y = 2")])
myst_cells(nb)
test_eq(nb.cells[0].source, "# T\n\n> D")
test_eq((nb.cells[1].source, nb.cells[1].metadata.tags), ("show_doc(f)", ["remove-input"]))
test_eq([c.source for c in nb.cells[2:]], ["y = 2"])

# %%
from fastcore.nbio import mk_cell, new_nb
from nbdev.process import NBProcessor

def _cell(src):
    return NBProcessor(nb=new_nb([mk_cell(src)])).nb.cells[0]

test_eq([needs_context(_cell(s)) for s in ["import torch", "show_doc(f)", "#| export\nimport os\nx = 1",
                                           "import torch\nassert x == 1", "y = f(x)"]],
        [False, False, False, True, True])

# %%
# The committed README is what the index notebook generates.
root = project_root()
test_eq((root/"README.md").read_text(), readme_text(root))
