"""The example of the README and of the docs' home and getting-started pages
(examples/quickstart.py) runs and learns: two MirroredStrategy replicas of one CPU, Keras's fit
on the digits. The docs include the file; the README holds a copy, which must stay the same."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cluster_utils import REPO, child_env

QUICKSTART = REPO / "examples" / "quickstart.py"


@pytest.mark.e2e
def test_the_quickstart_example_learns_the_digits(tmp_path):
    result = subprocess.run(
        [sys.executable, str(QUICKSTART)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    accuracy = re.findall(r"Test accuracy: ([0-9.]+)", output)
    assert len(accuracy) == 1, output[-3000:]
    # 5 epochs of an MLP on 8x8 digits: about 0.90 (0.897 and 0.900 in two runs); chance is 0.1.
    assert float(accuracy[0]) >= 0.8, output[-3000:]


def test_the_readme_shows_the_quickstart_example_as_it_is():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    # The file less its docstring: the code a reader copies.
    code = QUICKSTART.read_text().split('"""', 2)[2].lstrip("\n")
    assert code in blocks, "README.md's python block differs from examples/quickstart.py"
