"""examples/dtensor_layouts.py end to end on 4 processes through the launcher."""

from __future__ import annotations

import re
import sys

import pytest

from cluster_utils import REPO, Process, child_env

pytestmark = pytest.mark.e2e

EXAMPLE = str(REPO / "examples" / "dtensor_layouts.py")


def test_the_seed_port_trains_data_and_tensor_parallel_to_90_percent(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "4", EXAMPLE]
    launcher = Process(argv, child_env(), tmp_path, "launcher", merge_output=True)
    result = launcher.wait(timeout=300)
    output = result.stdout
    assert result.returncode == 0, output
    accuracy = dict(re.findall(r"\[worker 0\] ([A-Za-z. -]+) test accuracy: ([0-9.]+)", output))
    assert set(accuracy) == {
        "data-parallel",
        "tensor-parallel",
        "Model.fit tensor-parallel",
    }, output
    assert min(float(a) for a in accuracy.values()) >= 0.90, output
    assert output.count("Epoch:  2") == 2, output
    # The LayoutMap examples print the layouts of the seed (kernel specs reversed for weights).
    expected = "Layout.from_string(sharding_specs:unsharded,batch, mesh:|batch=4|)"
    assert output.count(f"[worker 0] {expected}") == 2, output
    tensor_parallel = (
        "sharding_specs:model,unsharded, mesh:|batch=2|model=2|) local shape: (64, 784)"
    )
    assert f"d1.weight with layout: Layout.from_string({tensor_parallel}" in output
    # Only worker 0 prints the results.
    assert "[worker 1] data-parallel" not in output
