"""The README's real-model recipe is the index notebook's recipe cell (so the two cannot drift) and builds the methods
its prose describes; every relative link in the README leads to a file of the repository or a page of the docs site.
The recipe itself runs where the docs build executes the index notebook, not here."""
import ast
import re
from pathlib import Path

import nbformat
import pytest

from sparsekv import methods
from sparsekv.docs import page_name
from sparsekv.kvpop.student import shipped_checkpoints

ROOT = Path(__file__).resolve().parent.parent
README = ROOT/"README.md"
INDEX = ROOT/"nbs"/"index.ipynb"
RECIPE = "## Real-model recipe"
# a markdown link [text](target "title"); the text may hold one level of brackets
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def section(md: str, heading: str) -> str:
    "The text of the level-2 section `heading` of markdown `md`, up to the next level-2 heading."
    start = md.index(heading + "\n")
    end = md.find("\n## ", start + len(heading))
    return md[start:] if end < 0 else md[start:end]


def readme_recipe() -> str:
    "The code of the README recipe section's one python block."
    blocks = re.findall(r"^```python\n(.*?)^```", section(README.read_text(), RECIPE), re.S | re.M)
    assert len(blocks) == 1, f"the README's {RECIPE!r} section must hold one python block, found {len(blocks)}"
    return blocks[0].strip()


def notebook_recipe() -> str:
    "The one code cell of the index notebook between the recipe's heading and the next level-2 heading."
    cells, inside, code = nbformat.read(INDEX, as_version=4).cells, False, []
    for c in cells:
        if c.cell_type == "markdown" and re.search(r"^## ", c.source, re.M):
            inside = c.source.lstrip().startswith(RECIPE)
        elif inside and c.cell_type == "code":
            code.append(c.source.strip())
    assert len(code) == 1, f"the index notebook's {RECIPE!r} section must hold one code cell, found {len(code)}"
    return code[0]


def test_readme_recipe_is_the_notebook_cell():
    code = notebook_recipe()
    assert readme_recipe() == code, "README.md's recipe differs from nbs/index.ipynb's: regenerate the README"
    assert 'load_model("smollm2-135m")' in code and ":1500]" in code and ".generate(" in code


def recipe_runs() -> list:
    "The recipe's `runs` (its method objects; no model runs)."
    assigns = {", ".join(n.id for n in ast.walk(s.targets[0]) if isinstance(n, ast.Name)): s
               for s in ast.parse(notebook_recipe()).body if isinstance(s, ast.Assign)}
    ns = {"methods": methods}
    exec(compile(ast.Module([assigns["n_new, B"], assigns["runs"]], []), "recipe", "exec"), ns)
    return ns["runs"]


def test_recipe_methods_and_parameters():
    "The recipe builds with this library, with the split and parameters its prose states."
    dense, kvpop, quoka, oval = recipe_runs()
    assert (dense.name, kvpop.name, quoka.name, oval.name) == ("dense", "kvpop_mlstm", "quoka", "oval")
    assert (kvpop.budget, kvpop.sink, kvpop.window, kvpop.k) == (384, 4, 64, 316)
    assert (quoka.budget, quoka.chunk_size, quoka.n_q) == (384, 128, 16)
    assert (oval.budget, oval.page_size, oval.rank, oval.eta, oval.sink, oval.recent) == (384, 32, 8, 0.25, 32, 32)
    for m in (kvpop, quoka, oval): assert m.name in methods.names()


def test_recipe_runs_the_shipped_kvpop_scorers():
    "The recipe's KVpop loads the scorers shipped in the package (trained for SmolLM2 at CR 75%), not fresh ones."
    kvpop = recipe_runs()[1]
    assert Path(kvpop.checkpoint).is_file()
    assert Path(kvpop.checkpoint).parent.name == "smollm2-135m-cr75-mlstm" in shipped_checkpoints()


def relative_links(md: str) -> list[str]:
    "Targets of the markdown links in `md` (outside code) that stay in the repository."
    md = FENCE.sub("", md)
    md = re.sub(r"`[^`\n]*`", "code", md)  # a link's text may be code; code elsewhere holds no link
    return [t for t in LINK.findall(md) if not re.match(r"[a-z][a-z0-9+.-]*:|#|/", t)]


def docs_pages() -> set[str]:
    "Page names the docs site builds from the notebooks."
    return {page_name(p.relative_to(ROOT)) for p in [*ROOT.glob("nbs/*.ipynb"), *ROOT.glob("reproduce/*.ipynb")]}


def test_relative_links_finds_links():
    md = ("[`patch`](nbs/03_hf.ipynb) [a [b]](x.md#y) [web](https://x.org) [top](#a) [abs](/etc)\n"
          "`[no](code.md)`\n```\n[no](fence.md)\n```\n")
    assert relative_links(md) == ["nbs/03_hf.ipynb", "x.md#y"]


@pytest.mark.parametrize("target", relative_links(README.read_text()))
def test_readme_link_exists(target):
    path = target.split("#")[0]
    if path.endswith(".html"):
        page = Path(path.removeprefix("_docs/")).with_suffix("").as_posix()  # the site builds into _docs/
        assert page in docs_pages(), f"README links {target}: no such docs page"
    else:
        assert (ROOT/path).exists(), f"README links {target}: no such file"


def test_readme_has_links():
    assert len(relative_links(README.read_text())) >= 1


def test_readme_lists_every_method():
    "The README's list of methods is `methods.names()`."
    text = README.read_text()
    assert [n for n in methods.names() if f"`{n}`" not in text] == []
