"""The real-model tests need transformers (an optional test dependency, pinned in
constraints.txt and installed by the README's test command): without it they are skipped
locally, and fail where ``CI`` is set (there its absence is a broken install)."""

import os

import pytest

INSTALL = "pip install -c constraints.txt -e '.[test]'"

try:
    import transformers  # noqa: F401
except ImportError as error:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(
            f"CI={os.environ['CI']!r} but transformers cannot be imported ({error}); the "
            f"real-model tests must run in CI: install it with the README's test command "
            f"({INSTALL})",
            pytrace=False,
        )
    pytest.skip(f"transformers is not installed ({INSTALL})", allow_module_level=True)
