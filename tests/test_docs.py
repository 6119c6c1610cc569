"""The docs site builds offline: every page renders its math in headless Chromium, every relative link and anchor
resolves, and every exported function and class is an indexed API entry that reads as its docstring."""
import ast
import base64
import functools
import html
import http.server
import re
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from sparsekv.docs import build_docs, module_index, page_name, pipeline_stages, project_root

ROOT = project_root(Path(__file__).parent)
# Pages checked in depth (screenshot, sidebar): the home page, a derivation page, an experiment page.
PAGES = ["index", "attention", "reproduce/demo"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Every docs test shares one build: `make test` keeps them on one xdist worker (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("docs")


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("Debian's chromium is needed for the docs test: `apt-get install chromium` "
                    "(`make test` does this as root)")
    return exe


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args): pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    "Every page, unexecuted but for the attention notebook (links, anchors and math do not need outputs)."
    dest = tmp_path_factory.mktemp("docs")
    build_docs(ROOT, dest=dest, execute=["00_attention"])
    handler = functools.partial(QuietHandler, directory=str(dest))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield dest, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def site_pages(dest: Path) -> list[str]:
    "Page names of the built notebooks (not Sphinx's own genindex/search)."
    return sorted(p.relative_to(dest).with_suffix("").as_posix() for p in dest.rglob("*.html")
                  if not p.relative_to(dest).parts[0].startswith("_") and p.stem not in ("genindex", "search"))


def run_chromium(args: list[str], crashes_allowed: int = 2) -> str:
    "Chromium's stdout; a browser that dies by a signal (headless Chromium segfaults now and then) is restarted."
    for attempt in range(crashes_allowed + 1):
        got = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if got.returncode >= 0 or attempt == crashes_allowed: break
    if got.returncode != 0:
        raise subprocess.CalledProcessError(got.returncode, args, got.stdout, got.stderr)
    return got.stdout


def rendered_dom(url: str, profile: Path, screenshot: Path | None = None) -> str:
    "The DOM of `url` after its scripts (MathJax) ran, as Chromium sees it."
    args = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=15000"]
    if screenshot is not None:
        run_chromium([*args, "--window-size=1280,1600", f"--screenshot={screenshot}", url])
    return run_chromium([*args, "--dump-dom", url])


def test_run_chromium_restarts_only_a_crashed_browser(tmp_path):
    "A browser killed by a signal is restarted (up to twice); an ordinary failure is reported at once."
    count = tmp_path/"runs"
    crash_once = f'echo x >> {count}; [ $(wc -l < {count}) -ge 2 ] && echo ok || kill -SEGV $$'
    assert run_chromium(["sh", "-c", crash_once]) == "ok\n" and len(count.read_text().split()) == 2
    with pytest.raises(subprocess.CalledProcessError) as err:
        run_chromium(["sh", "-c", f"echo y >> {tmp_path/'fails'}; exit 3"])
    assert err.value.returncode == 3 and len((tmp_path/"fails").read_text().split()) == 1
    with pytest.raises(subprocess.CalledProcessError) as err:
        run_chromium(["sh", "-c", f"echo z >> {tmp_path/'crashes'}; kill -SEGV $$"])
    assert err.value.returncode < 0 and len((tmp_path/"crashes").read_text().split()) == 3


@pytest.fixture(scope="module")
def doms(site, tmp_path_factory):
    "The rendered DOM of every page, three Chromiums at a time."
    dest, base = site
    tmp = tmp_path_factory.mktemp("chromium")
    pages = site_pages(dest)
    with ThreadPoolExecutor(3) as ex:
        got = ex.map(lambda i_p: rendered_dom(f"{base}/{i_p[1]}.html", tmp/f"profile{i_p[0] % 3}_{i_p[0]}"),
                     enumerate(pages))
        return dict(zip(pages, got))


def visible_text(html_: str, code: bool = True) -> str:
    "Text outside <script>/<style> and tags (and outside <pre>/<code> unless `code`), entities decoded."
    html_ = re.sub(r"<(script|style)\b.*?</\1>", "", html_, flags=re.S | re.I)
    if not code: html_ = re.sub(r"<(pre|code)\b.*?</\1>", " ", html_, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", " ", html_))


def test_site_has_every_notebook_under_its_module_name(site):
    dest, _ = site
    want = {page_name(p.relative_to(ROOT)) for p in [*ROOT.glob("nbs/*.ipynb"), *ROOT.glob("reproduce/*.ipynb")]}
    assert want <= set(site_pages(dest)), f"pages missing: {sorted(want - set(site_pages(dest)))}"
    assert page_name("nbs/10_kvpop_target.ipynb") == "kvpop_target"
    assert page_name("reproduce/12_kvpop_distill.ipynb") == "reproduce/kvpop_distill"


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_math(site, page, tmp_path):
    dest, base = site
    assert (dest/f"{page}.html").is_file()
    dom = rendered_dom(f"{base}/{page}.html", tmp_path/"profile", screenshot=tmp_path/"page.png")
    assert "mjx-container" in dom, f"no MathJax-rendered math on {page}"
    assert "cdn" not in " ".join(re.findall(r'src="([^"]+)"', dom)).lower(), "a script is loaded from a CDN"
    # the sidebar lists every page of the site
    for other in PAGES[1:]:
        if other == page: continue  # the current page links to itself as "#"
        assert re.search(rf'href="(\.\./)?{re.escape(other)}\.html"', dom), f"sidebar of {page} lacks {other}"
    assert (tmp_path/"page.png").stat().st_size > 10_000


def test_no_raw_math_on_any_page(site, doms):
    "After MathJax ran, no page shows TeX delimiters outside code: every `$...$` and `\\(...\\)` was typeset."
    dest, _ = site
    raw = {}
    for page, dom in doms.items():
        text = visible_text(dom, code=False)
        if found := re.findall(r".{0,40}(?:\$|\\\(|\\\)|\\\[|\\\]).{0,40}", text):
            raw[page] = found[:3]
        if 'class="math' in (dest/f"{page}.html").read_text():
            assert "mjx-container" in dom, f"MathJax did not run on {page}"
    assert not raw, f"raw TeX left on {len(raw)} pages: {raw}"


class Links(HTMLParser):
    "The ids and the hrefs of one HTML page."
    def __init__(self):
        super().__init__()
        self.ids, self.hrefs = set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a: self.ids.add(a["id"])
        if tag == "a" and "name" in a: self.ids.add(a["name"])
        for k in ("href", "src"):
            if a.get(k): self.hrefs.append(a[k])


def parse(path: Path) -> Links:
    p = Links()
    p.feed(path.read_text())
    return p


def test_every_relative_link_and_anchor_resolves(site):
    dest, _ = site
    pages = {p: parse(p) for p in dest.rglob("*.html") if "_static" not in p.parts}
    dead = []
    for page, links in pages.items():
        for href in links.hrefs:
            u = urlsplit(href)
            if u.scheme or u.netloc: continue  # external: the test does not go online
            target = (page.parent/unquote(u.path)).resolve() if u.path else page
            if u.path.endswith("/"): target = target/"index.html"
            if not target.exists():
                dead.append(f"{page.relative_to(dest)}: {href} (no file)")
            elif u.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if unquote(u.fragment) not in ids: dead.append(f"{page.relative_to(dest)}: {href} (no anchor)")
    assert not dead, f"{len(dead)} dead links:\n" + "\n".join(dead[:40])


def test_no_link_leaves_for_a_docs_host(site):
    "The site builds locally and is hosted nowhere: no host is configured and no page links to one."
    dest, _ = site
    assert module_index(ROOT)["settings"]["doc_host"] == ""
    bad = [p.name for p in dest.rglob("*.html") if any("sparsekv.github.io" in h for h in parse(p).hrefs)]
    assert not bad, f"links to sparsekv.github.io on {bad}"


def test_modules_name_no_docs_address():
    "With no docs host, nbdev writes no `Docs:` line into the modules: none points at a site that does not exist."
    for py in (ROOT/"sparsekv").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(py.read_text())) or ""
        assert not re.search(r"^Docs: ", doc, re.M), f"{py.relative_to(ROOT)} names a docs address"


def exported_symbols() -> list[tuple[str, str, str]]:
    "(page, module, name) of every public top-level function and class nbdev indexed."
    res = []
    for mod, syms in module_index(ROOT)["syms"].items():
        for full, (url, _) in syms.items():
            name = full[len(mod) + 1:]
            if "." not in name and not name.startswith("_"): res.append((url.split(".html")[0], mod, name))
    return res


def test_api_reference_indexes_every_exported_name(site):
    """Each public function and class is an entry: an anchor on its page, a line of that page's contents, genindex,
    search."""
    dest, _ = site
    genindex, search = (dest/"genindex.html").read_text(), (dest/"searchindex.js").read_text()
    missing = []
    for page, mod, name in exported_symbols():
        full, text = f"{mod}.{name}", (dest/f"{page}.html").read_text()
        toc = text[text.find('class="toc-tree"'):]
        checks = {"anchor": f'id="{full}"' in text, "contents": f'href="#{full}"' in toc,
                  "genindex": f'{page}.html#{full}"' in genindex, "search": f'"{name}"' in search}
        if not all(checks.values()): missing.append(f"{full}: {[k for k, v in checks.items() if not v]}")
    assert not missing, f"{len(missing)} API entries incomplete:\n" + "\n".join(missing[:30])


def typography(text: str) -> str:
    "Sphinx's smart quotes, dashes and ellipses undone: typography, not a change of content."
    return text.translate(str.maketrans("‘’“”", "''\"\"")).replace("–", "--").replace("—", "---").replace("…", "...")


def test_classes_render_as_classes_and_docstrings_literally(site):
    dest, _ = site
    import importlib
    import inspect
    wrong = []
    for page, mod, name in exported_symbols():
        obj = getattr(importlib.import_module(mod), name)
        entry = re.search(rf'<dt class="sig sig-object py" id="{re.escape(mod)}\.{name}">(.*?)</dt>\s*<dd>(.*?)</dd>',
                          (dest/f"{page}.html").read_text(), re.S)
        if entry is None: wrong.append(f"{mod}.{name}: no entry"); continue
        sig, body = entry.groups()
        if inspect.isclass(obj) != ("<span class=\"pre\">class</span>" in sig): wrong.append(f"{mod}.{name}: kind")
        doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        want = " ".join(re.sub(r"`([^`\n]+)`", r"\1", inspect.cleandoc(doc or "")).split())
        got = " ".join(html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"</p>", " ", body))).split())
        if typography(want) not in typography(got): wrong.append(f"{mod}.{name}: docstring reads {got[:120]!r}")
    assert not wrong, f"{len(wrong)} API entries wrong:\n" + "\n".join(wrong[:30])


def test_readme_links_exist():
    "The README links notebooks and docs pages by repository paths that exist (or by full URLs)."
    readme = (ROOT/"README.md").read_text()
    dead = [u for u in re.findall(r"\]\(([^)\s]+)\)", readme)
            if not urlsplit(u).scheme and not (ROOT/unquote(urlsplit(u).path)).exists()]
    assert not dead, f"README links to paths that do not exist: {dead}"
    assert "sparsekv.github.io" not in readme


# --- the Results page and the executed runs -----------------------------------------------------


def article(page_html: str) -> str:
    "The main content of a built page (not the sidebar, header or footer)."
    return page_html[page_html.index("<article"):page_html.index("</article>")]


def images(fragment: str) -> dict[str, str]:
    "Image file name -> alt text of each image in an HTML fragment."
    found = re.findall(r'<img alt="([^"]*)" src="([^"]+)"', fragment)
    return {Path(src).name: html.unescape(alt) for alt, src in found}


def plain(fragment: str) -> str:
    "The text of an HTML fragment as it reads (tags dropped, entities decoded, spaces collapsed)."
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def test_results_page_shows_every_figure_under_its_caption(site):
    dest, _ = site
    main = article((dest/"results.html").read_text())
    shown, text = images(main), plain(main)
    for stage in pipeline_stages(ROOT):
        assert f'make reproduce ARGS="--only {stage.name}"' in text, f"no command for {stage.name}"
        for png in (p for p in stage.outputs if p.suffix == ".png"):
            caption = stage.captions.get(png) or stage.description
            if png.exists(): assert shown.get(png.name) == " ".join(re.sub(r"[`*$]", "", caption).split()), png
            else: assert f"{png.relative_to(ROOT).as_posix()} has not been generated yet" in text, png
        if not (ROOT/"reproduce"/"runs"/"cpu"/f"{stage.name}.md").exists():
            assert f"reproduce/runs/cpu/{stage.name}.md is not committed" in text, stage.name
    links = re.findall(r'(?:href|src)="([^"]+)"', main)
    assert links and not [u for u in links if urlsplit(u).scheme or u.startswith("/")], "absolute links"
    assert 'href="results.html"' in article((dest/"index.html").read_text())


def test_a_committed_run_fills_its_experiment_page_and_results(tmp_path):
    "With a cpu run (made up here) the experiment page shows its figure and the Results page its summary."
    import nbformat
    from nbformat.v4 import new_output
    demo = next(s for s in pipeline_stages(ROOT) if s.name == "demo")
    png = next(p for p in demo.outputs if p.suffix == ".png")
    runs = tmp_path/"runs"
    (runs/"cpu"/".stamps").mkdir(parents=True)
    nb = nbformat.read(demo.notebook, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "parameters" not in c.source)
    cell.outputs = [new_output("display_data", data={"image/png": base64.b64encode(png.read_bytes()).decode()})]
    nbformat.write(nb, runs/"cpu"/"demo.ipynb")
    (runs/"cpu"/"demo.md").write_text("# Paper vs ours\n\n| quantity | paper | ours |\n|---|---|---|\n"
                                      "| keys holding 90% | 1% | 0.2% |\n")
    (runs/"cpu"/".stamps"/"demo.json").write_text('{"seconds": 75}')
    dest = build_docs(ROOT, dest=tmp_path/"site", execute=False, only=["00_demo"], runs=runs)
    page = article((dest/"reproduce"/"demo.html").read_text())
    assert images(page) and "reproduce/runs/cpu/demo.ipynb" in plain(page)
    results = article((dest/"results.html").read_text())
    split = results.index('<section id="smollm2-baseline">')
    section, rest = results[results.index('<section id="demo">'):split], results[split:]
    assert "<table" in section and "keys holding 90%" in plain(section) and "<h3>Paper vs ours" in section
    assert "is not committed" not in plain(section) and "took ~75 s" in plain(section)
    assert 'href="reproduce/demo.html"' in section and png.name in images(section)
    assert "is not committed" in plain(rest)
