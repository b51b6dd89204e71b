"""The benchmarks still run: a smoke run of each, checking the shape of what they report.

The figures themselves are not asserted (a shared 2-core machine is too noisy for timed tests);
they are measured by hand and quoted in the README.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest

from cluster_utils import REPO, Process, child_env

pytestmark = pytest.mark.e2e


def test_allreduce_benchmark_smoke_run_reports_every_row(tmp_path):
    out = tmp_path / "results.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "allreduce_strategies.py"), "--quick"]
    argv += ["--json", str(out)]
    result = Process(argv, child_env(), tmp_path, "benchmark").wait(timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8, rows
    for row in rows:
        assert row["samples_per_s"] and min(row["samples_per_s"]) > 0, row
        assert math.isfinite(row["ratio_of_medians"]) and row["ratio_of_medians"] > 0, row
    # The table printed for the README has the same rows.
    table = [line for line in output.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows), output  # header, rule, rows


def test_fit_overhead_benchmark_smoke_run_reports_both_figures(tmp_path):
    out = tmp_path / "results.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "fit_overhead.py"), "--quick"]
    argv += ["--json", str(out)]
    result = Process(argv, child_env(), tmp_path, "benchmark").wait(timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    results = json.loads(out.read_text())
    assert math.isfinite(results["one_device_fit_overhead_median_of_runs"]), results
    assert results["two_workers_fit_over_ddp_median_of_runs"] > 0, results
    assert all(v > 0 for v in results["one_device_ms_per_step"].values()), results
    assert "| fit overhead vs a hand-written loop" in output, output


def test_stragglers_benchmark_smoke_run_drops_the_stragglers_late_gradients(tmp_path):
    out = tmp_path / "results.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "stragglers.py"), "--quick"]
    argv += ["--modes", "backup", "--json", str(out)]
    result = Process(argv, child_env(), tmp_path, "benchmark").wait(timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    backup = json.loads(out.read_text())["results"]["backup"]
    assert backup["steps_per_s"] > 0 and 0 <= backup["accuracy"] <= 1, backup
    # Worker 2 is three times slower: sync with a backup worker drops its late gradients.
    assert backup["dropped"] > 0, backup
    assert "| backup |" in output, output


def test_ps_transport_benchmark_smoke_run_reports_the_ratio(tmp_path):
    argv = [sys.executable, str(REPO / "benchmarks" / "ps_transport.py"), "--quick"]
    result = Process(argv, child_env(), tmp_path, "benchmark").wait(timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    ((ratio,),) = [re.findall(r"ours / raw rpc, median of 1 runs: ([0-9.]+)", output)]
    assert float(ratio) > 0, output
