"""The documentation builds strictly, and strictness catches what it should.

The site is built with ``mkdocs build --strict``: a link to a missing page or anchor, an API name
in a ``:::`` block or a cross-reference that the code no longer has, fails the build. The last
two tests break a copy of the docs on purpose and check that the build fails, naming the fault.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

from cluster_utils import REPO

from .site_build import build_site, require_mkdocs

DOCS = REPO / "docs"


def test_the_site_builds_strictly(built_site: Path):
    pages = sorted(p.relative_to(built_site).as_posix() for p in built_site.rglob("index.html"))
    for page in ("index.html", "porting/index.html", "troubleshooting/index.html"):
        assert page in pages, pages
    # Every API reference page has rendered objects from the docstrings, not just its title.
    api_pages = sorted((built_site / "api").glob("*/index.html"))
    assert len(api_pages) >= 10, api_pages
    for page in api_pages:
        assert 'class="doc doc-object' in page.read_text(), f"{page}: no API object rendered"


def _copy_of_the_docs(tmp_path: Path) -> Path:
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    # The API pages read the sources from src/, the snippets examples/, beside mkdocs.yml.
    (tmp_path / "src").symlink_to(REPO / "src", target_is_directory=True)
    (tmp_path / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    return tmp_path / "mkdocs.yml"


def test_a_link_to_a_missing_page_or_api_name_fails_the_build(tmp_path: Path):
    require_mkdocs()
    config = _copy_of_the_docs(tmp_path)
    page = config.parent / "docs" / "getting-started.md"
    page.write_text(
        page.read_text()
        + "\n\nSee [a page that is gone](guides/no-such-page.md)"
        + " and [`NoSuchStrategy`][stratagem.distribute.NoSuchStrategy].\n"
    )
    result = build_site(config, tmp_path / "site")
    assert result.returncode != 0, result.stderr[-3000:]
    assert "guides/no-such-page.md" in result.stderr, result.stderr[-3000:]
    assert "stratagem.distribute.NoSuchStrategy" in result.stderr, result.stderr[-3000:]


def test_an_api_name_that_disappeared_fails_the_build(tmp_path: Path):
    require_mkdocs()
    config = _copy_of_the_docs(tmp_path)
    page = config.parent / "docs" / "api" / "distribute.md"
    page.write_text(page.read_text() + "\n::: stratagem.distribute.NoSuchStrategy\n")
    result = build_site(config, tmp_path / "site")
    assert result.returncode != 0, result.stderr[-3000:]
    assert "stratagem.distribute.NoSuchStrategy" in result.stderr, result.stderr[-3000:]


def _error_classes() -> list[str]:
    """Every class named ``*Error`` or ``*Warning`` that stratagem defines."""
    names = set()
    for path in (REPO / "src" / "stratagem").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Warning")):
                names.add(node.name)
    # Keras's loss and metric names, not errors.
    return sorted(names - {"MeanSquaredError", "MeanAbsoluteError"})


def test_troubleshooting_explains_every_error_class():
    text = (DOCS / "troubleshooting.md").read_text()
    headings = set(re.findall(r"^#+ `?(\w+)`?", text, flags=re.MULTILINE))
    missing = [name for name in _error_classes() if name not in headings]
    assert not missing, f"docs/troubleshooting.md has no section for: {missing}"


@pytest.mark.parametrize("document", ["README.md", "docs"])
def test_no_document_speaks_of_issues_or_unfinished_work_by_number(document: str):
    paths = sorted((REPO / document).rglob("*.md")) if document == "docs" else [REPO / document]
    pattern = re.compile(r"\bissues?\b|\bthis task\b|\bthis session\b", re.IGNORECASE)
    offenders = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}"
        for path in paths
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


def test_the_readme_links_point_at_files_of_the_repository():
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, local  # the README is mostly a way into the docs
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing
