"The docs site builds offline and renders its math in headless Chromium."
import functools
import http.server
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from sparsekv.docs import build_docs, project_root

ROOT = project_root(Path(__file__).parent)
# The home page, one library notebook with derivations and one experiment notebook.
PAGES = ["index", "00_attention", "reproduce/00_demo"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("Debian's chromium is needed for the docs test: `apt-get install chromium` (.ci/run does this)")
    return exe


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args): pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    dest = tmp_path_factory.mktemp("docs")
    build_docs(ROOT, dest=dest, only=[Path(p).name for p in PAGES], execute=["00_attention"])
    handler = functools.partial(QuietHandler, directory=str(dest))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield dest, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def rendered_dom(url: str, tmp_path: Path, screenshot: Path | None = None) -> str:
    "The DOM of `url` after its scripts (MathJax) ran, as Chromium sees it."
    args = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path/'chromium'}", "--virtual-time-budget=15000"]
    if screenshot is not None:
        subprocess.run([*args, "--window-size=1280,1600", f"--screenshot={screenshot}", url],
                       capture_output=True, timeout=120, check=True)
    return subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True).stdout


def visible_text(html: str) -> str:
    "Text outside <script>/<style> and tags."
    html = re.sub(r"<(script|style)\b.*?</\1>", "", html, flags=re.S | re.I)
    return re.sub(r"<[^>]+>", " ", html)


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_math(site, page, tmp_path):
    dest, base = site
    assert (dest/f"{page}.html").is_file()
    dom = rendered_dom(f"{base}/{page}.html", tmp_path, screenshot=tmp_path/"page.png")
    assert "mjx-container" in dom, f"no MathJax-rendered math on {page}"
    assert "$$" not in visible_text(dom), f"raw $$ left on {page}"
    assert "cdn" not in " ".join(re.findall(r'src="([^"]+)"', dom)).lower(), "a script is loaded from a CDN"
    # the sidebar lists every page of the site
    for other in PAGES[1:]:
        if other == page: continue  # the current page links to itself as "#"
        assert f'{other}.html"' in dom, f"sidebar of {page} lacks {other}"
    assert (tmp_path/"page.png").stat().st_size > 10_000


def test_api_reference_from_show_doc(site):
    dest, _ = site
    html = (dest/"00_attention.html").read_text()
    assert "attention_reference" in html and "mask" in html
