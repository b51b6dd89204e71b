"""A process's own error is never reported as a lost peer.

The failure this guards: two processes of a mesh job hit the same operator error in a step;
one exits first, and the other reported ``PeerLostError: worker 1 ... was lost during DTensor's
collectives`` with the operator error as its "underlying error", because the lost-peer
diagnosis asked only whether the peers were alive. It now asks the exception first: only a
transport failure is about the peers. A killed peer during a collective is still named
(test_fault_matrix.py: the mesh's kill -9 case).
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from cluster_utils import WORKERS, Process, child_env
from stratagem.comm.process_group import is_communication_failure, underlying_error
from stratagem.dtensor import ShardingRuleError
from stratagem.errors import PeerLostError

SHAPE_ERROR = "a and b must have same reduction dim, but got [4, 4] X [5, 2]"


def _wait_for_text(proc: Process, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.output_so_far():
        assert proc.proc.poll() is None, f"{proc.name} exited before printing {text!r}"
        assert time.monotonic() < deadline, f"{proc.name} never printed {text!r}"
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_the_same_local_error_on_a_peer_that_exited_first_is_reported_as_itself(tmp_path):
    """``stratagem run -n 2``: worker 1's step raises a shape error and it exits; then worker
    0's step raises the same error. Both report the shape error, worker 0 no lost peer."""
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "--grace-period", "120"]
    argv += [str(WORKERS / "mesh_local_error.py"), str(tmp_path)]
    launcher = Process(argv, child_env(), tmp_path, "launcher", merge_output=True)
    try:
        _wait_for_text(launcher, "worker 1 failed")
        (tmp_path / "go").touch()  # worker 1 has exited: worker 0 may now raise
        result = launcher.wait(timeout=120)
    finally:
        launcher.kill_group()
    output = result.stdout
    assert result.returncode != 0, output
    for worker in (0, 1):
        lines = [line for line in output.splitlines() if line.startswith(f"[worker {worker}] ")]
        said = "\n".join(lines)
        assert f"RuntimeError: {SHAPE_ERROR}" in said, output
        assert "PeerLostError" not in said and "was lost during" not in said, output


# gloo's own words when a peer goes away or never answers (torch 2.13), NCCL's type, ours.
TRANSPORT_FAILURES = [
    RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [127.0.0.1]:25754. This is typically caused by a remote worker crashing."
    ),
    RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "60000ms for recv operation to complete"
    ),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer"),
    torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1"),
    # A pipeline's transfer names the rank it lost; the communicator then names the task.
    PeerLostError("rank 1 was lost during the pipeline transfer of activations"),
]

LOCAL_ERRORS = [
    RuntimeError(SHAPE_ERROR),
    RuntimeError(
        "aten.embedding.default: got mixed torch.Tensor and DTensor, need to convert all "
        "torch.Tensor to DTensor before calling distributed operators!"
    ),
    ShardingRuleError("DTensor has no sharding rule for operator aten.x.default"),
    NotImplementedError("a user's unfinished layer"),
]


@pytest.mark.parametrize("error", TRANSPORT_FAILURES, ids=lambda e: str(e)[-40:])
def test_a_transport_failure_is_about_the_peers(error):
    assert is_communication_failure(error)


@pytest.mark.parametrize("error", LOCAL_ERRORS, ids=lambda e: type(e).__name__ + str(e)[:20])
def test_an_error_of_the_process_own_computation_is_not(error):
    assert not is_communication_failure(error)


@pytest.mark.parametrize(
    "lost, owner",
    [(["worker 0 (localhost:39719)"], "worker 0 (localhost:39719)'s"), ([], "a peer's")],
)
def test_gloo_s_own_port_is_named_as_such_and_whose(lost, owner):
    # gloo names the far end of its own connection, on a port none of the job's addresses has.
    error = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:54957: "
        "Connection reset by peer"
    )
    assert underlying_error(error, lost) == (
        f"Read error [127.0.0.1]:54957 ({owner} gloo connection, on a port of gloo's own, not "
        "its address in the cluster): Connection reset by peer"
    )
