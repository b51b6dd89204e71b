"""TensorFlow's distributed input guide, ported (examples/distributed_input.py), run as a user
runs it: what it prints is what the guide shows, cell by cell."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cluster_utils import REPO, child_env

EXAMPLE = REPO / "examples" / "distributed_input.py"


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(),
        cwd=tmp_path_factory.mktemp("guide"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_cpu_split_into_two_logical_devices(output):
    """Cells 8-9: set_logical_device_configuration gives two logical CPUs."""
    assert "0) LogicalDevice(name='/device:CPU:0', device_type='CPU')" in output
    assert "1) LogicalDevice(name='/device:CPU:1', device_type='CPU')" in output


def test_bare_mirrored_strategy_has_two_replicas(output):
    """Cell 14: a global batch of 16 goes to 2 replicas (8 each), as a pair of PerReplica."""
    first = output.split("PerReplica", 1)[1]
    assert re.match(r"\(\{\n  0: tensor\(\[\[1\.\](,\n\s+\[1\.\]){7}\]\),\n  1: ", first), first


def test_every_loop_ran(output):
    """Cells 33 and 35: 7 global batches in the for loop, then 10 epochs x 5 steps."""
    assert output.count("Loss is ") == 7 + 50


def test_get_next_as_optional_output(output):
    """Cell 37: the guide's three steps, the last with an empty replica batch."""
    assert (
        "(tensor([0, 1]), tensor([2, 3]))\n"
        "(tensor([4, 5]), tensor([6, 7]))\n"
        "(tensor([8]), tensor([], dtype=torch.int64))\n"
    ) in output


def test_element_spec_printed(output):
    """Cell 40: the distributed dataset's spec: per replica, batch dimension None."""
    spec = output.split("element_spec: ", 1)[1].split("\n})", 1)[0]
    assert "TensorSpec(shape=(None, 1), dtype=torch.float32" in spec


def test_string_lookup_batches(output):
    """Cell 51: strings batched per replica and looked up: the guide's [1 3]/[0 1], [3 0]/[1 3],
    [0 1]/[3 0]."""
    section = output.split("element_spec: ", 1)[1]
    found = re.findall(r"  [01]: tensor\(\[(\d), (\d)\]\)", section)[:6]
    assert found == [("1", "3"), ("0", "1"), ("3", "0"), ("1", "3"), ("0", "1"), ("3", "0")]


def test_outputs_put_back_in_order(output):
    """Cell 60: every index of range(24) maps to twice its value."""
    (line,) = [line for line in output.splitlines() if line.startswith("{")]
    pairs = re.findall(r"np\.int64\((\d+)\): np\.int64\((\d+)\)", line)
    assert {int(i): int(v) for i, v in pairs} == {i: 2 * i for i in range(24)}


def test_values_from_function_and_generator(output):
    """Cells 63 and 66: replica ids 0 and 1, four times; then 4 steps of a generator's
    4-vectors, 2 values per replica."""
    assert output.count("PerReplica({\n  0: tensor(0),\n  1: tensor(1)\n})") == 4
    tail = output.rsplit("1: tensor(1)\n})", 1)[1]
    # A value under 1e-4 makes torch print the pair in scientific notation (5.0000e-05).
    number = r"([0-9.]+(?:e[+-]\d+)?)"
    vectors = re.findall(rf"  [01]: tensor\(\[{number}, {number}\]\)", tail)
    assert len(vectors) == 8
    assert all(0.0 <= float(v) < 1.0 for pair in vectors for v in pair)
