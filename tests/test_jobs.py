"""``sg.jobs.CustomJob`` and ``stratagem job run``: real jobs of tiny scripts through the launcher.

The task script (``workers/job_task.py``) records what each task was handed; the tests read
those records, the job directory, ``job.json`` and the per-task logs after the job ended.
"""

from __future__ import annotations

import json

import pytest

import stratagem as sg
from cluster_utils import WORKERS
from stratagem import cli
from stratagem.jobs import JobConfigError, JobFailedError, JobState

pytestmark = pytest.mark.e2e

SCRIPT = WORKERS / "job_task.py"


def read_seen(job_dir):
    return {p.stem.removeprefix("seen-"): json.loads(p.read_text()) for p in job_dir.glob("seen-*")}


def test_job_hands_every_task_its_directories_and_records_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    job = sg.jobs.CustomJob(
        "my job",
        SCRIPT,
        args=["--word", "hi"],
        replica_count=3,
        environment_variables={"JOB_TEST_VAR": "42"},
        base_output_dir=tmp_path / "jobs",
    )
    assert job.run(stream_logs=False) is job
    assert job.state is JobState.JOB_STATE_SUCCEEDED
    assert job.job_dir.parent == (tmp_path / "jobs").resolve()
    assert job.job_dir.name.startswith("my-job-")

    seen = read_seen(job.job_dir)
    # Vertex AI's pools: the first replica is the chief, the others workers.
    assert sorted(seen) == ["chief-0", "worker-0", "worker-1"]
    for record in seen.values():
        env = record["env"]
        assert env["STRATAGEM_MODEL_DIR"] == str(job.job_dir / "model")
        assert env["STRATAGEM_CHECKPOINT_DIR"] == str(job.job_dir / "checkpoints")
        assert env["STRATAGEM_TENSORBOARD_LOG_DIR"] == str(job.job_dir / "tensorboard")
        for name in ("MODEL", "CHECKPOINT", "TENSORBOARD_LOG"):
            assert env[f"AIP_{name}_DIR"] == env[f"STRATAGEM_{name}_DIR"]
        assert env["JOB_TEST_VAR"] == "42"
        assert int(env["OMP_NUM_THREADS"]) >= 1
        assert record["word"] == "hi"

    state = json.loads((job.job_dir / "job.json").read_text())
    assert state["state"] == "JOB_STATE_SUCCEEDED"
    assert state["exit_code"] == 0
    assert state["exit_reason"] == "1 chief and 2 workers exited 0"
    assert state["model_saved"] is True
    assert state["model_dir"] == str(job.model_dir)
    assert state["start_time"] <= state["end_time"]
    assert (job.model_dir / "model.txt").read_text() == "weights"

    logs = {p.name: p.read_text() for p in job.log_dir.iterdir()}
    assert sorted(logs) == ["chief.log", "launcher.log", "worker-0.log", "worker-1.log"]
    assert logs["chief.log"] == "task chief 0 says hi\n"
    assert logs["worker-1.log"] == "task worker 1 says hi\n"
    assert "job finished" in logs["launcher.log"]


def test_failed_job_raises_with_reason_and_log(tmp_path):
    job = sg.jobs.CustomJob(
        "bad", SCRIPT, args=["--fail", "worker"], replica_count=2, base_output_dir=tmp_path
    )
    with pytest.raises(JobFailedError) as info:
        job.run(stream_logs=False)
    message = str(info.value)
    assert "job 'bad' failed: worker 0 failed: exit code 3" in message
    assert "last lines of worker-0.log" in message
    assert "failing on purpose" in message
    assert job.state is JobState.JOB_STATE_FAILED
    assert job.exit_code == 3
    state = json.loads((job.job_dir / "job.json").read_text())
    assert state["state"] == "JOB_STATE_FAILED"
    assert state["exit_reason"].startswith("worker 0 failed: exit code 3")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_count": 0}, "replica_count must be an int >= 1, got 0"),
        ({"ps_replica_count": -1}, "ps_replica_count must be an int >= 0, got -1"),
        ({"args": "--lr 3"}, "args must be a list of strings, got '--lr 3'"),
        ({"environment_variables": {"A": 1}}, "must map strings to strings, got {'A': 1}"),
        ({"script_path": "nope.py"}, "script_path 'nope.py' not found"),
        ({"display_name": ""}, "display_name must be a non-empty string, got ''"),
    ],
)
def test_bad_job_arguments(kwargs, message):
    arguments = {"display_name": "j", "script_path": SCRIPT, **kwargs}
    with pytest.raises(JobConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        sg.jobs.CustomJob(**arguments)


def test_cli_job_run(tmp_path, capsys):
    argv = ["job", "run", "--quiet", "--base-output-dir", str(tmp_path), "--replica-count", "2"]
    assert cli.main([*argv, "--env", "JOB_TEST_VAR=x", str(SCRIPT), "--word", "cli"]) == 0
    err = capsys.readouterr().err
    (job_dir,) = tmp_path.iterdir()
    assert f"job 'job_task' JOB_STATE_SUCCEEDED: {job_dir}" in err
    assert f"model directory: {job_dir / 'model'}" in err
    seen = read_seen(job_dir)
    assert {r["env"]["JOB_TEST_VAR"] for r in seen.values()} == {"x"}
    assert {r["word"] for r in seen.values()} == {"cli"}

    assert cli.main([*argv, str(SCRIPT), "--fail", "chief"]) == 3
    assert "failed: chief failed: exit code 3" in capsys.readouterr().err
