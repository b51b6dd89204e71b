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

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 180

UNGUARDED = """\
import stratagem as sg
import torch

def train(scale):
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    one = torch.ones(1) * scale
    total = strategy.reduce(sg.distribute.ReduceOp.SUM, strategy.run(lambda: one), axis=None)
    print("sum", total.item())

sg.launch.notebook_launcher(train, args=(3.0,), num_workers=2)
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
    (tmp_path / "unguarded.py").write_text(UNGUARDED)
    done = _python(["unguarded.py"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert sorted(line for line in lines if "sum" in line) == [
        "[worker 0] sum 6.0",
        "[worker 1] sum 6.0",
    ]
    assert lines[-1] == "launcher returned"  # once: the workers never ran the script's top
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


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"function": 3}, TypeError, "needs a function, got int"),
        ({"function": print, "num_workers": 0}, ValueError, "num_workers must be .* got 0"),
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
