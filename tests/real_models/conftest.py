"""The real-model tests need transformers (an optional test dependency, pinned in
constraints.txt and installed by the README's test command); without it they are skipped."""

import pytest

pytest.importorskip(
    "transformers",
    reason="transformers is not installed (pip install -c constraints.txt -e '.[test]')",
)
