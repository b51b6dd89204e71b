"""Every page of the built site, loaded in a real headless Chromium: it renders (title and
heading), logs no console error, loads nothing from another host, and every link within the
site answers 200.

The site is served from 127.0.0.1 on a free port by a thread of this process. Chromium is
installed from the distribution's packages when missing and we are root (CI); elsewhere the test
is skipped, saying why. A small broken site checks that the checks see what they look for.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urldefrag, urlsplit

import pytest

from .browser import Browser, PageVisit, find_or_install_chromium

pytest.importorskip("websocket", reason="websocket-client is not installed (the test extra)")
# A machine without Chromium installs it first (apt-get, as root): minutes, once per machine.
pytestmark = pytest.mark.timeout(900)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _served(directory: Path) -> Iterator[str]:
    """``directory`` over HTTP on 127.0.0.1 and a free port; yields the root's URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    executable, why = find_or_install_chromium()
    if executable is None:
        pytest.skip(f"no Chromium to load the site in: {why}")
    chromium = Browser(executable, tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield chromium
    finally:
        chromium.close()


def _pages(site: Path) -> list[str]:
    """Each page's path under the site's root, as a browser asks for it."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site).as_posix()
        if relative.split("/")[0] in ("assets", "search"):
            continue
        pages.append("" if relative == "." else f"{relative}/")
    return pages


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def _problems(browser: Browser, root: str, pages: list[str]) -> tuple[list[str], int]:
    """Visit each page; what is wrong with them, and how many distinct local URLs they link."""
    visits: list[PageVisit] = [browser.visit(root + page) for page in pages]
    problems = [
        f"{v.url}: title {v.title!r}, heading {v.heading!r}, errors {v.errors}"
        for v in visits
        if v.errors or not v.heading.strip() or "stratagem" not in v.title
    ]
    origin = urlsplit(root).netloc
    # The site works offline: a page loads nothing from another host (the network may be closed).
    problems += [
        f"{v.url} loads {asset} from another host"
        for v in visits
        for asset in v.assets
        if urlsplit(asset).netloc != origin
    ]
    targets: dict[str, str] = {}  # a link or asset without its fragment -> a page that has it
    for visit in visits:
        for link in visit.links + visit.assets:
            parts = urlsplit(link)
            if parts.scheme in ("http", "https") and parts.netloc == origin:
                targets.setdefault(urldefrag(link).url, visit.url)
    for target in sorted(targets):
        status = _status(target)
        if status != 200:
            problems.append(f"{target} (linked from {targets[target]}): HTTP {status}")
    return problems, len(targets)


def test_every_page_renders_without_errors_and_every_link_resolves(
    built_site: Path, browser: Browser
):
    pages = _pages(built_site)
    assert len(pages) >= 20, pages
    with _served(built_site) as root:
        problems, linked = _problems(browser, root, pages)
    assert not problems, "\n".join(problems)
    # The visits did read links: the navigation alone links every page.
    assert linked >= len(pages), linked


def test_the_checks_see_a_script_error_a_console_error_and_a_broken_link(
    tmp_path: Path, browser: Browser
):
    (tmp_path / "index.html").write_text(
        "<html><head><title>Home - stratagem</title></head><body><article><h1>Home</h1>"
        '<a href="gone/">a page that is gone</a> <a href="ok/">a page</a>'
        "<script>console.error('a console error'); notAFunction();</script>"
        "</article></body></html>"
    )
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "index.html").write_text(
        "<html><head><title>stratagem</title></head><body><article>no heading</article>"
        "</body></html>"
    )
    with _served(tmp_path) as root:
        problems, _ = _problems(browser, root, ["", "ok/"])
    report = "\n".join(problems)
    assert len(problems) == 3, report
    assert "a console error" in problems[0] and "notAFunction" in problems[0], report
    assert problems[1].startswith(f"{root}ok/: title 'stratagem', heading ''"), report
    assert problems[2] == f"{root}gone/ (linked from {root}): HTTP 404", report
