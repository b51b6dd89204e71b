"""Building the documentation site for the tests of this folder.

mkdocs is a test dependency (the ``test`` extra, pinned in constraints.txt). Where it is not
installed the site's tests are skipped, except in CI (``CI`` set), where its absence is a
failure: CI installs the extra, so a missing mkdocs there means the install is broken.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BUILD_TIMEOUT_S = 120


def require_mkdocs() -> None:
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as error:
        if os.environ.get("CI"):
            raise AssertionError(
                f"mkdocs is not installed in CI ({error}); the test extra should install it"
            ) from error
        pytest.skip(
            f"mkdocs is not installed ({error}): pip install -c constraints.txt -e '.[test]'"
        )


def build_site(config: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of ``config`` into ``site_dir``: every warning is an error."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(config),
            "-d",
            str(site_dir),
        ],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
