"""``sg.launch.notebook_launcher``: a function as a local cluster, from wherever users call it.

From a script without a ``__main__`` guard, from ``python -c``, and from the example notebook
run in a real Jupyter kernel (nbclient, ipykernel: test extras): the workers are forked, each
worker's output comes back prefixed, and a failing worker is a ``WorkerFailedError`` naming it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import stratagem as sg
from cluster_utils import REPO, child_env
from stratagem.cluster.tasks import free_ports

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 180

UNGUARDED = """\
import json, os
import stratagem as sg
import torch

def train(scale):
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    one = torch.ones(1) * scale
    total = strategy.reduce(sg.distribute.ReduceOp.SUM, strategy.run(lambda: one), axis=None)
    print("sum", total.item())
    print("cluster", json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])

# Accelerate's keywords, as its own notebook_launcher takes them (the port as a string).
sg.launch.notebook_launcher(train, args=(3.0,), num_processes=2, use_port="{port}")
print("launcher returned")
"""

# Worker 1 fails before the rendezvous; worker 0 then waits for it until it is stopped.
FAILING = """
import json, os
import stratagem as sg
def job():
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        raise ValueError("worker 1 broke")
    sg.distribute.MultiWorkerMirroredStrategy()
    print("never")
try:
    sg.launch.notebook_launcher(job, num_workers=2, grace_period=0.5)
except sg.launch.WorkerFailedError as e:
    print("caught", e)
"""

# Both workers fail at once (each waits for the other's file first) with long tracebacks:
# printed line by line as they come, the two would mix; each must come whole.
BOTH_FAIL = """
import json, os, pathlib
import stratagem as sg
def ping(index, depth):  # two functions in turn: Python folds a frame repeated in a row
    if depth == 0:
        raise ValueError(f"worker {index} broke")
    pong(index, depth - 1)
def pong(index, depth):
    ping(index, depth)
def job():
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    pathlib.Path(f"ready-{index}").touch()
    while not pathlib.Path(f"ready-{1 - index}").exists():
        pass
    ping(index, 60)
try:
    sg.launch.notebook_launcher(job, num_processes=2)
except sg.launch.WorkerFailedError as e:
    print("caught", e)
"""


def _python(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        start_new_session=True,
    )


def test_from_a_script_without_a_main_guard(tmp_path):
    port = free_ports(1)[0]
    (tmp_path / "unguarded.py").write_text(UNGUARDED.replace("{port}", str(port)))
    done = _python(["unguarded.py"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert sorted(line for line in lines if "sum" in line) == [
        "[worker 0] sum 6.0",
        "[worker 1] sum 6.0",
    ]
    assert lines[-1] == "launcher returned"  # once: the workers never ran the script's top
    cluster = next(line for line in lines if line.startswith("[worker 0] cluster"))
    assert f"'localhost:{port}'" in cluster.split("[")[2].split(",")[0], cluster  # use_port
    assert done.stdout.count("launcher returned") == 1
    assert "[worker 1] [stratagem] worker 1 of 2 workers (TF_CONFIG)" in done.stdout


def test_from_python_c_a_failing_worker_is_named(tmp_path):
    done = _python(["-c", FAILING], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker 1] ValueError: worker 1 broke" in done.stdout
    assert (
        "caught worker 1 exited 1: ValueError: worker 1 broke; the others: worker 0 " in done.stdout
    )
    assert "never" not in done.stdout


def test_two_failing_workers_show_one_traceback_each(tmp_path):
    done = _python(["-c", BOTH_FAIL], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for index in (0, 1):
        prefix = f"[worker {index}] "
        start = lines.index(prefix + "Traceback (most recent call last):")
        end = lines.index(f"{prefix}ValueError: worker {index} broke")
        block = lines[start : end + 1]
        assert len(block) > 120, block  # 120 frames, without source lines (python -c)
        assert all(line.startswith(prefix) for line in block), "\n".join(block)
    assert "caught worker " in done.stdout


UNSUPPORTED = sg.launch.UnsupportedLaunchOption


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"function": 3}, TypeError, "needs a function, got int"),
        ({"function": print, "num_workers": 0}, ValueError, "num_workers must be .* got 0"),
        ({"function": print, "num_processes": 0}, ValueError, "num_processes must be .* got 0"),
        (
            {"function": print, "num_processes": 2, "num_workers": 2},
            TypeError,
            "give one of them",
        ),
        ({"function": print, "num_nodes": 2}, UNSUPPORTED, r"num_nodes=2.*stratagem run --nnodes"),
        ({"function": print, "node_rank": 1}, UNSUPPORTED, r"node_rank=1"),
        ({"function": print, "mixed_precision": "fp16"}, UNSUPPORTED, r"set_global_policy"),
        ({"function": print, "use_port": "http"}, ValueError, r"use_port must be .* got 'http'"),
        ({"function": print, "master_addr": "no-such-host.invalid"}, ValueError, "master_addr"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        sg.launch.notebook_launcher(**kwargs)


def test_the_example_notebook_runs_in_a_jupyter_kernel(tmp_path):
    import nbclient  # test extras: a real Jupyter kernel, as a user's notebook has
    import nbformat

    notebook = nbformat.read(REPO / "examples" / "notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=TIMEOUT_S, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    text = "\n".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream"
    )
    for worker in (0, 1):
        assert f"[worker {worker}] worker {worker}: accuracy " in text, text
    assert "caught: worker 1 exited 1: ValueError: worker 1 has no data" in text, text
