"""The docs site (issue 70 item 4): ``mkdocs build --strict`` builds it in seconds with no broken link and no
page outside the navigation, refuses a page whose link is broken, naming it, and every page of the built
site opens in Chromium with every link to the site reaching a page (and its anchor) and every image shown.
Integration tier: two builds (about 3 s each) and Chromium over the site's pages (about 15 s)."""

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest
from train_helpers import REPO

MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file"]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([*MKDOCS, str(config), "--site-dir", str(site)], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as CI builds it, served on 127.0.0.1; its base URL and the build's seconds."""
    root = tmp_path_factory.mktemp("site")
    started = time.perf_counter()
    built = build(REPO / "mkdocs.yml", root)
    seconds = time.perf_counter() - started
    assert built.returncode == 0, built.stderr[-4000:]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", root, seconds
    server.shutdown()


def test_the_site_builds_strictly_in_seconds_and_a_broken_link_fails_the_build(site, tmp_path):
    _, root, seconds = site
    assert seconds < 60, seconds  # about 3 s here, most of it starting Python and MkDocs
    assert (root / "reference/flags/index.html").is_file() and (root / "examples/custom_env/index.html").is_file()
    # the same docs with one link broken: the strict build fails naming the page and the link
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copytree(REPO / "scripts", copy / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "mkdocs.yml").write_text((REPO / "mkdocs.yml").read_text())
    page = copy / "docs/engines.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    broken = build(copy / "mkdocs.yml", tmp_path / "broken")
    assert broken.returncode != 0
    assert "engines.md" in broken.stderr and "no-such-page.md" in broken.stderr, broken.stderr[-2000:]


def test_every_page_opens_in_chromium_with_no_broken_link_or_missing_image(site, browser):
    base, root, _ = site
    pages = sorted(p.relative_to(root).parent.as_posix() for p in root.rglob("index.html"))
    assert len(pages) >= 25, pages  # the home, 15 topic pages, 7 examples, 2 reference pages
    context = browser.new_context()
    tab = context.new_page()
    seen: dict[str, set[str]] = {}  # URL of a page -> the ids on it
    links, broken, missing, shown = [], [], [], []
    for page in pages:
        url = urljoin(base, "" if page == "." else page + "/")
        response = tab.goto(url)
        assert response.status == 200, url
        seen[url] = set(tab.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))
        hrefs = tab.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
        links += [(url, href) for href in hrefs if urlparse(href).netloc == urlparse(base).netloc]
        images = tab.eval_on_selector_all("img", "els => els.map(e => [e.src, e.complete && e.naturalWidth > 0])")
        missing += [(url, src) for src, ok in images if not ok]
        shown += [src for src, ok in images if ok]
    for source, href in links:
        target, anchor = urldefrag(href)
        if target not in seen:
            response = tab.goto(target)
            if response is None or response.status != 200:
                broken.append((source, href))
                continue
            seen[target] = set(tab.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))
        if anchor and anchor not in seen[target]:
            broken.append((source, href))
    context.close()
    assert broken == [] and missing == []
    assert len(links) > 500 and any(src.endswith("/inspect_viewer.png") for src in shown)  # the home's picture
