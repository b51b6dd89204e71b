"""The documentation site, built once (``mkdocs build --strict``) for the tests of this folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster_utils import REPO

from .site_build import build_site, require_mkdocs


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's site, built with --strict into a temporary folder."""
    require_mkdocs()
    site = tmp_path_factory.mktemp("site")
    result = build_site(REPO / "mkdocs.yml", site)
    assert result.returncode == 0, (
        f"mkdocs build --strict failed (exit {result.returncode}):\n{result.stderr[-6000:]}"
    )
    assert (site / "index.html").is_file(), sorted(p.name for p in site.iterdir())
    return site
