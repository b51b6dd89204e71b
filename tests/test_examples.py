"""The ported seed example, end to end: launcher, torchrun, MirroredStrategy, kill -9 + restart."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from cluster_utils import REPO, Process, child_env

pytestmark = pytest.mark.e2e

EXAMPLE = str(REPO / "examples" / "custom_training_loop.py")


def _accuracies(output: str) -> list[float]:
    return [float(m) for m in re.findall(r"Test accuracy: ([0-9.]+)", output)]


def _wait(proc: Process, timeout: float):
    result = proc.wait(timeout=timeout)
    return result, result.stdout + result.stderr


def test_two_workers_through_the_launcher_reach_90_percent(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", EXAMPLE]
    # Seeded: an unseeded run's test accuracy is chance's (0.89 in one CI run of 3 epochs).
    argv += ["--epochs", "3", "--seed", "0", "--checkpoint-dir", str(tmp_path / "ckpt")]
    result, output = _wait(Process(argv, child_env(), tmp_path, "launcher"), timeout=300)
    assert result.returncode == 0, output
    for worker in (0, 1):
        epochs = re.findall(rf"\[worker {worker}\] Epoch: (\d+), accuracy", output)
        assert epochs == ["0", "1", "2"], output
    accuracies = _accuracies(output)
    assert len(accuracies) == 2 and min(accuracies) >= 0.90, output
    # Only the chief wrote checkpoints; the other worker's temp dir was removed (seed pattern).
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint", "ckpt-3"]
    assert (tmp_path / "workertemp_1").is_dir()
    assert not (tmp_path / "workertemp_1" / "ckpt").exists()


def test_the_same_script_runs_under_torchrun(tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += [EXAMPLE, "--epochs", "1", "--steps-per-epoch", "10"]
    argv += ["--checkpoint-dir", str(tmp_path / "ckpt")]
    result, output = _wait(Process(argv, child_env(), tmp_path, "torchrun"), timeout=300)
    assert result.returncode == 0, output
    assert len(_accuracies(output)) == 2, output
    assert output.count("Epoch: 0, accuracy") == 2


def test_the_same_loop_on_two_devices_of_one_process(tmp_path):
    argv = [sys.executable, EXAMPLE, "--devices", "cpu:0,cpu:1", "--epochs", "1"]
    argv += ["--steps-per-epoch", "10", "--checkpoint-dir", str(tmp_path / "ckpt")]
    result, output = _wait(Process(argv, child_env(), tmp_path, "mirrored"), timeout=300)
    assert result.returncode == 0, output
    assert len(_accuracies(output)) == 1, output


def test_kill_9_mid_epoch_then_the_job_resumes_from_the_last_checkpoint(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "--max-restarts", "1", EXAMPLE]
    argv += ["--epochs", "3", "--steps-per-epoch", "60", "--checkpoint-dir", str(tmp_path / "ckpt")]
    launcher = Process(argv, child_env(), tmp_path, "launcher", merge_output=True)
    try:
        deadline = time.monotonic() + 240
        while "[worker 0] Epoch: 0," not in launcher.output_so_far():
            assert launcher.proc.poll() is None, launcher.output_so_far()
            assert time.monotonic() < deadline, launcher.output_so_far()
            time.sleep(0.05)
        # The launcher prints every task's pid at start; worker 1 is now in epoch 1.
        pid = int(re.search(r"worker 1 pid (\d+)", launcher.output_so_far())[1])
        os.kill(pid, signal.SIGKILL)
        result, output = _wait(launcher, timeout=300)
    finally:
        launcher.kill_group()
    assert result.returncode == 0, output
    before, _, after = output.partition("restarting the job")
    assert after, output
    # The surviving worker named the lost peer before the launcher stopped it.
    assert "stratagem: PeerLostError on worker 0" in before, before
    assert re.search(r"worker 1 \(localhost:\d+\) was lost during ", before), before
    # The second attempt restored epoch 1 and trained epochs 1 and 2 only.
    assert "Restored" in after and "epoch 1, step 0" in after, after
    assert "Epoch: 0," not in after
    assert re.findall(r"\[worker 0\] Epoch: (\d+),", after) == ["1", "2"]
    assert len(_accuracies(after)) == 2


KERAS_EXAMPLE = str(REPO / "examples" / "keras_fit.py")


def _evaluations(output: str) -> list[tuple[float, float]]:
    found = re.findall(r"Eval loss: ([0-9.e-]+), Eval [Aa]ccuracy: ([0-9.]+)", output)
    return [(float(loss), float(acc)) for loss, acc in found]


def test_keras_example_reaches_93_percent_and_reloads_to_the_same_evaluation(tmp_path):
    # MirroredStrategy() as in the seed: one device here, global batch 64 (TF's run of this
    # recipe on this data: 0.94). Seed 0 fixes the initial weights and the shuffle.
    argv = [sys.executable, KERAS_EXAMPLE, "--seed", "0", "--dir", str(tmp_path / "out")]
    result, output = _wait(Process(argv, child_env(), tmp_path, "keras example"), timeout=300)
    assert result.returncode == 0, output
    assert re.findall(r"Epoch (\d+)/12", output) == [str(e) for e in range(1, 13)], output
    (loss, accuracy), *reloaded = _evaluations(output)
    assert accuracy >= 0.93, output
    # Loaded without and within the scope, the model evaluates as the trained one.
    assert len(reloaded) == 2, output
    for other_loss, other_accuracy in reloaded:
        assert abs(other_loss - loss) <= 1e-6 and abs(other_accuracy - accuracy) <= 1e-6
    out = tmp_path / "out"
    saves = sorted(p.name for p in (out / "training_checkpoints").iterdir())
    assert saves == sorted(["checkpoint", *(f"ckpt_{e}" for e in range(1, 13))])
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "logs" / "train").iterdir())
    assert sorted(p.name for p in (out / "saved_model").iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "program.pt2",
    ]


def test_keras_example_on_two_workers(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", KERAS_EXAMPLE]
    argv += ["--multi-worker", "--epochs", "2", "--dir", str(tmp_path / "out")]
    result, output = _wait(Process(argv, child_env(), tmp_path, "launcher"), timeout=300)
    assert result.returncode == 0, output
    for worker in (0, 1):
        mine = [line for line in output.splitlines() if line.startswith(f"[worker {worker}]")]
        lines = "\n".join(mine)
        evaluations = _evaluations(lines)
        assert len(evaluations) == 3, output
        assert all(abs(e[1] - evaluations[0][1]) <= 1e-6 for e in evaluations), output
    # The chief alone printed the progress (its epoch lines), both workers the evaluations.
    assert re.findall(r"\[worker 1\] Epoch \d+/2", output) == [], output
    assert len(re.findall(r"\[worker 0\] Epoch \d+/2", output)) == 2, output


def test_a_killed_fit_resumes_from_backup_and_ends_as_an_uninterrupted_one(tmp_path):
    script = str(REPO / "tests" / "workers" / "keras_backup.py")

    def launch(name, *extra):
        argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", *extra, script]
        argv += [str(tmp_path / f"{name}-backup")]
        return argv

    plain, plain_output = _wait(
        Process(launch("plain"), child_env(), tmp_path, "plain"), timeout=300
    )
    assert plain.returncode == 0, plain_output
    argv = [*launch("killed", "--max-restarts", "1"), "--kill"]
    launcher = Process(argv, child_env(), tmp_path, "killed", merge_output=True)
    killed, killed_output = _wait(launcher, timeout=300)
    assert killed.returncode == 0, killed_output
    before, _, after = killed_output.partition("restarting the job")
    assert after and "worker 1 failed" in before, killed_output
    pattern = r"\[worker 0\] trained epochs \[([0-9, ]+)\] losses ([0-9. ]+) final accuracy"
    pattern += r" ([0-9.]+)"
    ((full_epochs, full_losses, full_accuracy),) = re.findall(pattern, plain_output)
    ((resumed_epochs, resumed_losses, resumed_accuracy),) = re.findall(pattern, after)
    assert full_epochs == "0, 1, 2, 3, 4, 5"
    assert resumed_epochs == "3, 4, 5"  # killed in epoch 3, which resumed after its batch 4
    # The same batches in the same order, and epoch 3's loss summed over the killed run's first
    # 4 batches and the resumed run's last 16: the same epoch losses as the uninterrupted run.
    expected = [float(v) for v in full_losses.split()[3:]]
    assert [float(v) for v in resumed_losses.split()] == pytest.approx(expected, abs=1e-5)
    assert abs(float(resumed_accuracy) - float(full_accuracy)) <= 0.01
    assert not (tmp_path / "killed-backup").exists()  # removed once the fit finished


PS_EXAMPLE = str(REPO / "examples" / "parameter_server.py")


def _ps_example(tmp_path, *args: str) -> str:
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "--ps", "1", PS_EXAMPLE]
    argv += ["--epochs", "3", "--steps-per-epoch", "40", "--seed", "0", *args]
    result, output = _wait(Process(argv, child_env(), tmp_path, "launcher"), timeout=300)
    assert result.returncode == 0, output
    assert "[stratagem] ps 0 exited 0" in output, output
    return output


def _ps_counts(output: str) -> tuple[int, int, int, int]:
    """(applied, dropped, updates, held back): what the ps reported when the chief asked."""
    applied = r"\[worker 0\] ps applied (\d+) gradients and dropped (\d+)"
    updates = r"\[worker 0\] ps made (\d+) updates and held back (\d+) replies"
    ((a, d),), ((u, h),) = re.findall(applied, output), re.findall(updates, output)
    return int(a), int(d), int(u), int(h)


def test_parameter_server_example_sync_reaches_90_percent_on_a_fixed_schedule(tmp_path):
    # The accuracy claim is checked where the schedule cannot vary: seeded, and in sync mode
    # each update is the mean of both workers' gradients of the same version, whose sum is the
    # same in either arrival order (adding two floats commutes). So the figure below is the
    # same on every run, whatever the load (0.966667 on this machine in 3 runs, one with two
    # busy loops beside it; the epoch losses were equal too). The async interleaving is not
    # repeatable (issue 14: an unseeded async run under load ended at 0.8806), so async is
    # checked on its counts below.
    output = _ps_example(tmp_path, "--mode", "sync")
    # Both workers' 120 gradients, mean of 2 per update: 120 updates, none dropped or held.
    assert _ps_counts(output) == (240, 0, 120, 0), output
    accuracies = _accuracies(output)
    assert len(accuracies) == 1 and accuracies[0] >= 0.90, output  # the chief's, pulled


def test_parameter_server_example_async_applies_every_gradient_in_lockstep(tmp_path):
    # Counts that hold for every interleaving. With max_staleness=0 a worker's reply waits
    # until the other has pushed as many steps: in each round the first of the two pushes is
    # held back until the second is applied (one reply held per round), so when the chief
    # has its last reply both workers' 120 gradients are in, each applied as one update.
    output = _ps_example(tmp_path, "--max-staleness", "0")
    assert _ps_counts(output) == (240, 0, 240, 120), output
    accuracies = _accuracies(output)
    assert len(accuracies) == 1 and 0.0 <= accuracies[0] <= 1.0, output  # evaluated, pulled
