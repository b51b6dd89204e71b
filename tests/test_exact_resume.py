"""Exact resume on another number of workers: a job stopped after step 7 of 20 and resumed on
fewer or more workers ends with the weights of an uninterrupted run, every example seen exactly
as often as in it (a ledger of the ids each worker consumed), for a custom loop that checkpoints
its distributed iterator and for ``fit`` with ``BackupAndRestore(save_freq=3)`` on an
``sg.data.Dataset``."""

from __future__ import annotations

import shutil
import sys
from collections import Counter

import pytest
import torch

from cluster_utils import WORKERS, Process, child_env, run_cluster
from workers.resume_data import (
    EPOCHS,
    EXAMPLES,
    GLOBAL_BATCH,
    STOP,
    uninterrupted,
    uninterrupted_fit,
)

pytestmark = pytest.mark.multiprocess

SCRIPT = WORKERS / "resume_checks.py"
FIT_BACKUP_STEP = 6  # the last backup of save_freq=3 before the stop after batch 7


def _run(workdir, phase: str, workers: int) -> list[dict]:
    for i, r in enumerate(run_cluster(SCRIPT, workers, workdir, args=[phase], timeout=240)):
        r.check(f"{phase} on {workers} worker(s), worker {i}")
    return [torch.load(workdir / f"{phase}-{i}.pt") for i in range(workers)]


def _steps(outs: list[dict], loop: str, keep: int | None = None) -> list[list[int]]:
    """The ids of each step over all workers (worker by worker), the first ``keep`` steps;
    ``loop`` names the loop's results in each worker's output (or "": the output itself)."""
    per_worker = [(o[loop] if loop else o)["seen"][:keep] for o in outs]
    assert len({len(s) for s in per_worker}) == 1, "workers ran different numbers of steps"
    return [sorted(i for seen in step for i in seen) for step in zip(*per_worker)]


def _assert_equal_weights(actual: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-6, atol=1e-7, msg=what + name)


def test_a_job_resumed_on_another_number_of_workers_ends_as_an_uninterrupted_one(tmp_path):
    batches, custom_reference = uninterrupted()
    fit_reference = uninterrupted_fit()
    assert Counter(i for b in batches for i in b) == {i: EPOCHS for i in range(EXAMPLES)}
    for first_workers, second_workers in [(2, 1), (2, 3), (1, 2)]:
        first_dir = tmp_path / f"first-on-{first_workers}"
        if not first_dir.exists():
            first_dir.mkdir()
            _run(first_dir, "first", first_workers)
        work = tmp_path / f"{first_workers}-to-{second_workers}"
        shutil.copytree(first_dir, work)
        first = [torch.load(work / f"first-{i}.pt") for i in range(first_workers)]
        second = _run(work, "second", second_workers)
        case = f"{first_workers} then {second_workers} workers: "
        for loop, kept, reference in [
            ("custom", STOP, custom_reference),
            ("fit", FIT_BACKUP_STEP, fit_reference),
        ]:
            # The ledger: step by step, the examples of the uninterrupted run's global batch.
            ledger = _steps(first, loop, kept) + _steps(second, loop)
            assert ledger == batches, f"{case}{loop}: the steps saw other examples"
            _assert_equal_weights(second[0][loop]["final"], reference, f"{case}{loop}: ")
            # Restored, not replayed: the resumed pipeline maps only examples not yet made
            # (replaying the stopped run's steps would map their examples again).
            left = (len(batches) - kept) * GLOBAL_BATCH
            calls = second[0][loop]["map_calls"]
            assert calls <= left, f"{case}{loop}: {calls} map calls for {left} examples left"
        # Positions of the workers' own streams: restored on as many workers, refused on others.
        for i, out in enumerate(first):
            went_on = out["per_worker"]["went_on"]
            assert went_on and out["per_worker"]["restored"] == went_on, f"{case}worker {i}"
        for out in second:
            refused = out["per_worker"]["refused"]
            assert (
                refused is not None
                and (f"is {first_workers} worker(s)' own streams; this job has {second_workers}")
                in refused
            ), refused


def _ps_job(workdir, phase: str, workers: int) -> list[dict]:
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", str(workers), "--ps", "1"]
    argv += [str(WORKERS / "ps_resume.py"), phase]
    result = Process(argv, child_env(), workdir, phase, merge_output=True).wait(timeout=240)
    assert result.returncode == 0, result.stdout
    return [torch.load(workdir / f"{phase}-{i}.pt") for i in range(workers)]


def test_a_sync_parameter_server_job_resumed_on_one_worker_ends_as_an_uninterrupted_one(
    tmp_path,
):
    """Sync ps, 2 workers then 1 (the same global batch; a DATA dataset: each worker takes its
    part of every global batch): the ps's parameters end as one process's on the global
    batches, and the workers' ledger has every example of each step's global batch, none
    repeated and none skipped. The position restored is the chief's, saved with the ps's
    values after the same update (the commit point)."""
    batches, reference = uninterrupted()
    first = _ps_job(tmp_path, "first", 2)
    second = _ps_job(tmp_path, "second", 1)
    # Each worker took its own half of each global batch: nothing consumed twice in a step.
    for step in zip(*(f["seen"] for f in first)):
        assert not set(step[0]) & set(step[1]), step
    ledger = _steps(first, "", None) + _steps(second, "", None)
    consumed = Counter(i for step in ledger for i in step)
    assert consumed == {i: EPOCHS for i in range(EXAMPLES)}, "repeats or gaps in the ledger"
    assert ledger == batches, "the steps saw other examples than the uninterrupted run's"
    # One update of the ps per step: STOP, then the rest on a new ps holding the restored values.
    assert first[0]["steps"] == STOP and second[0]["steps"] == len(batches) - STOP
    _assert_equal_weights(second[0]["final"], reference, "sync ps 2 then 1 worker: ")
