"""The benchmarks still run: a smoke run of each, checking the shape of what they report.

The figures themselves are not asserted (a shared 2-core machine is too noisy for timed tests);
they are measured by hand and quoted in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch

from cluster_utils import REPO, Process, child_env

pytestmark = pytest.mark.e2e


def _smoke_run(tmp_path, script: str, *args: str) -> str:
    """Run ``benchmarks/<script> --quick *args``; its output, after checking it exited 0."""
    argv = [sys.executable, str(REPO / "benchmarks" / script), "--quick", *args]
    result = Process(argv, child_env(), tmp_path, "benchmark").wait(timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_allreduce_benchmark_smoke_run_reports_every_row(tmp_path):
    out = tmp_path / "results.json"
    output = _smoke_run(tmp_path, "allreduce_strategies.py", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8, rows
    for row in rows:
        assert row["samples_per_s"] and min(row["samples_per_s"]) > 0, row
        assert math.isfinite(row["ratio_of_medians"]) and row["ratio_of_medians"] > 0, row
    # The table printed for docs/benchmarks.md has the same rows.
    table = [line for line in output.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows), output  # header, rule, rows


def test_startup_benchmark_smoke_run_reports_both_jobs(tmp_path):
    output = _smoke_run(tmp_path, "startup.py")
    ((row,),) = [re.findall(r"^(\{\"n\": 2, .*\})$", output, re.MULTILINE)]
    row = json.loads(row)
    assert row["ours_s"] > 0 and row["torchrun_s"] > 0 and row["ratio"] > 0, row
    # The strategy's start is part of the job it is measured in.
    assert 0 < row["strategy_start_s"] < row["ours_s"], row


def test_fit_overhead_benchmark_smoke_run_reports_both_figures(tmp_path):
    out = tmp_path / "results.json"
    output = _smoke_run(tmp_path, "fit_overhead.py", "--json", str(out))
    results = json.loads(out.read_text())
    assert math.isfinite(results["one_device_fit_overhead_median_of_runs"]), results
    assert results["two_workers_fit_over_ddp_median_of_runs"] > 0, results
    assert all(v > 0 for v in results["one_device_ms_per_step"].values()), results
    assert "| fit overhead vs a hand-written loop" in output, output


def test_stragglers_benchmark_smoke_run_drops_the_stragglers_late_gradients(tmp_path):
    out = tmp_path / "results.json"
    output = _smoke_run(tmp_path, "stragglers.py", "--modes", "backup", "--json", str(out))
    backup = json.loads(out.read_text())["results"]["backup"]
    assert backup["steps_per_s"] > 0 and 0 <= backup["accuracy"] <= 1, backup
    # Worker 2 is three times slower: sync with a backup worker drops its late gradients.
    assert backup["dropped"] > 0, backup
    assert "| backup |" in output, output


def test_coordinator_benchmark_smoke_run_reports_the_coordinated_rate(tmp_path):
    # One coordinated job, 2 steps per function (the multi-step path), and a between-graph job
    # beside a process that wakes and spins as a chief does, under one busy process.
    out = tmp_path / "results.json"
    argv = ["--variants", "coordinated,between_waker", "--delay", "0", "--steps-per-function", "2"]
    output = _smoke_run(tmp_path, "coordinator.py", *argv, "--load", "1", "--json", str(out))
    results = json.loads(out.read_text())
    (rate,) = results["samples"]["coordinated"]
    assert rate > 0, output
    (rate,) = results["samples"]["between_waker"]
    assert rate > 0, output
    # The CPU the job's processes used per update (/proc: every CI machine is Linux), a
    # fraction of a second per update and more than none.
    (cpu_ms,) = results["cpu_ms"]["coordinated"]
    assert 0 < cpu_ms < 1000, output
    assert re.search(r"^\| coordinated \| [0-9.]+ \| [0-9.]+ \|$", output, re.MULTILINE), output
    assert "(--load 1)" in output, output


def test_ps_transport_benchmark_smoke_run_reports_the_ratio(tmp_path):
    output = _smoke_run(tmp_path, "ps_transport.py")
    ((ratio,),) = [re.findall(r"ours / raw rpc, median of 1 runs: ([0-9.]+)", output)]
    assert float(ratio) > 0, output


def test_pipeline_benchmark_smoke_run_reports_every_row(tmp_path):
    out = tmp_path / "results.json"
    output = _smoke_run(tmp_path, "pipeline.py", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    # GPipe at M = 1, 2, 4, 8; 1F1B at M = 2, 4, 8 (it needs M >= K); PipeDream at M = 4, 8,
    # draining every step and not.
    assert [(r["schedule"], r["m"]) for r in rows] == [
        ("GPipe", 1), ("GPipe", 2), ("1F1B", 2), ("GPipe", 4), ("1F1B", 4),
        ("GPipe", 8), ("1F1B", 8), ("PipeDream", 4), ("PipeDream (no drain)", 4),
        ("PipeDream", 8), ("PipeDream (no drain)", 8),
    ]  # fmt: skip
    for row in rows:
        assert 0 <= row["bubble_measured"] < 1 and row["samples_per_s"] > 0, row
        drains = "no drain" not in row["schedule"]
        theory = 1 / (row["m"] + 1) if drains else 1 / (3 * row["m"] + 1)
        assert row["bubble_theory"] == pytest.approx(theory), row
        assert all(mib > 0 for mib in row["peak_activation_mib"]), row
    # Only PipeDream keeps weight copies (its stash); the synchronous schedules keep none.
    for row in rows:
        stashed = row["peak_stashed_weights_mib"]
        pipedream = row["schedule"].startswith("PipeDream")
        assert (min(stashed) > 0) if pipedream else (max(stashed) == 0), row
    # GPipe holds every micro-batch's activations at once, 1F1B at most K of them.
    gpipe8, f1b8 = rows[5], rows[6]
    assert gpipe8["peak_activation_mib"][0] > f1b8["peak_activation_mib"][0], rows
    table = [line for line in output.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows), output


def test_prefetch_benchmark_smoke_run_reports_the_overlap_ratios(tmp_path):
    out = tmp_path / "results.json"
    _smoke_run(tmp_path, "prefetch.py", "--json", str(out))
    results = json.loads(out.read_text())
    assert set(results["steps_per_s"]) == {"input", "compute", "plain", "prefetch", "parallel"}
    assert all(v > 0 for v in results["steps_per_s"].values()), results
    for key in ("prefetch_vs_max(input,compute)", "plain_vs_sum(input+compute)"):
        assert math.isfinite(results[key]) and results[key] > 0, results


def test_placement_log_benchmark_smoke_run_reports_off_and_on(tmp_path):
    out = tmp_path / "results.json"
    _smoke_run(tmp_path, "placement_log.py", "--json", str(out))
    results = json.loads(out.read_text())
    assert set(results["steps_per_s"]) == {"never", "off", "on"}, results
    assert results["off_vs_never"] > 0 and results["on_vs_never"] > 0, results


def test_mixed_precision_benchmark_smoke_run_halves_the_bytes(tmp_path):
    out = tmp_path / "results.json"
    output = _smoke_run(tmp_path, "mixed_precision.py", "--json", str(out))
    results = json.loads(out.read_text())
    # Counted, not timed: the bf16-compressed all-reduce sends half a float32 one's bytes.
    assert results["bytes_per_step"]["float32"] > 0, results
    assert results["bytes_ratio"] == pytest.approx(0.5, abs=1e-4), results
    assert math.isfinite(results["speed_ratio_median_of_blocks"]), results
    assert '| compression="bf16" |' in output, output


def test_gpu_training_benchmark_tiny_cpu_run_reports_every_way(tmp_path):
    # Two processes on the CPU (gloo): the path the GPU run takes with one process per GPU.
    out = tmp_path / "results.json"
    output = _smoke_run(
        tmp_path, "gpu_training.py", "--device", "cpu", "--tiny", "--json", str(out)
    )
    results = json.loads(out.read_text())
    assert results["processes"] == 2 and results["config"]["layers"] == 2, results
    rows = results["rows"]
    assert set(rows) == {"raw", "ddp", "fit", "mwms"}, rows
    for row in rows.values():
        assert len(row["tokens_per_s"]) == results["blocks"] and min(row["tokens_per_s"]) > 0
        assert row["mfu"] is None, row  # no peak FLOP/s for a CPU
    # The FLOP count: every parameter but the two embedding tables, 6·N + 12·L·T·d per token.
    c = results["config"]
    d, layers, vocab = c["width"], c["layers"], c["vocab"]
    n = layers * (12 * d * d + 13 * d) + 2 * d + d * vocab
    assert results["matmul_parameters"] == n, results
    assert results["flops_per_token"] == 6 * n + 12 * layers * c["seq"] * d, results
    for key in ("mwms_over_ddp", "fit_mfu_over_raw_mfu"):
        assert math.isfinite(results[key]) and results[key] > 0, results
    table = [line for line in output.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + 4 + 2 + 2, output  # the ways' table and the ratios' table


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_training_benchmark_tiny_cuda_run_reports_mfu(tmp_path):
    # The GPU run's path in a minute: one process, the tiny model, MFU from the peak table.
    out = tmp_path / "results.json"
    _smoke_run(
        tmp_path, "gpu_training.py", "--device", "cuda", "--tiny", "--nprocs", "1",
        "--json", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert results["processes"] == 1 and results["device"] != "cpu", results
    for row in results["rows"].values():
        assert min(row["tokens_per_s"]) > 0, row
        if results["peak_flops"]:  # a GPU of the table: an MFU, and a plausible one
            assert 0 < row["mfu"] < 1, (row, results["peak_source"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_training_step_makes_the_host_wait_for_the_gpu(tmp_path):
    # fit and the custom loops (MWMS, OneDevice) on one GPU: no synchronizing call whose count
    # grows with the steps (a per-step .item() stalls the queue of kernels every step).
    output = _smoke_run(tmp_path, "gpu_sync_points.py", "--check")
    assert output.count("== ") == 3, output


def test_exit_aborts_benchmark_smoke_run_counts_both_ways(tmp_path):
    # Two rounds: no drained process may abort (the plain ones may: that is the race).
    output = _smoke_run(tmp_path, "exit_aborts.py")
    table = [line for line in output.splitlines() if line.startswith("| ")]
    assert len(table) == 4 and "| gloo threads drained first | 4 | 0 | 0 |" in table, output


def test_checkpoint_benchmark_smoke_run_reports_every_variant(tmp_path):
    out = tmp_path / "results.json"
    output = _smoke_run(tmp_path, "checkpoints.py", "--json", str(out))
    ratios = json.loads(out.read_text())["ratios"]
    assert set(ratios) == {"none", "sync", "async", "dcp_async"}
    assert ratios["none"] == 1.0 and all(r > 0 for r in ratios.values()), ratios
    assert "| async |" in output
