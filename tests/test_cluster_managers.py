"""stratagem under the cluster managers users run, each reproduced as that manager documents it.

Every test runs a 2-process MultiWorkerMirroredStrategy job in the environment the manager
gives its processes: the variables, their values and the host names, with nothing of ours
added. Host names are resolved as on the real cluster, through /etc/hosts (as a headless
Kubernetes service or a small SLURM cluster resolves them), here a private copy mounted in a
user+mount namespace of each process (``unshare -rm``) that maps them to loopback addresses
(127.0.0.1, 127.0.0.2): the C++ side of torch (TCPStore, gloo) resolves them too.

Sources of each environment:
- Kubeflow TFJob: training-operator pkg/controller.v1/tensorflow/tensorflow.go (genTFConfigJSONStr:
  ``{"cluster": ..., "task": ..., "environment": "cloud"}``, addresses
  ``<job>-<type>-<index>.<namespace>.svc:<port>``, the same port in every pod).
- Kubeflow PyTorchJob (v1) and Trainer TrainJob (torch runtime): pkg/controller.v1/pytorch/
  envvar.go and master.go (MASTER_ADDR=<job>-master-0, MASTER_PORT, PET_MASTER_ADDR/PORT,
  WORLD_SIZE, RANK, PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PYTHONUNBUFFERED=0), with
  the container running torchrun, which reads the PET_* variables.
- Ray Train TorchTrainer: ray/train/torch/config.py (_TorchBackend.on_start: MASTER_ADDR/PORT of
  worker 0, then LOCAL_RANK, RANK, LOCAL_WORLD_SIZE, WORLD_SIZE, NODE_RANK, then
  ``init_process_group(init_method="env://")`` in every worker before the train function).
- SLURM ``srun``: the variables srun sets for each task (SLURM_PROCID, SLURM_LOCALID,
  SLURM_NODEID, SLURM_NTASKS, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE, SLURM_JOB_ID ...).
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_utils import CLUSTER_VARS, REPO, Process

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 120

TRAIN = """\
import json, os
import torch
import stratagem as sg

def train():
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    one = torch.ones(1)
    total = strategy.reduce(sg.distribute.ReduceOp.SUM, strategy.run(lambda: one), axis=None)
    print("result", json.dumps({
        "task": [resolver.task_type, resolver.task_id],
        "source": resolver.source,
        "replicas": strategy.num_replicas_in_sync,
        "sum": total.item(),
    }), flush=True)

if __name__ == "__main__":
    train()
"""


@functools.cache
def _hosts_namespace_usable() -> bool:
    """Whether this machine lets an unprivileged process mount its own /etc/hosts."""
    try:
        done = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


needs_hosts = pytest.mark.skipif(
    not _hosts_namespace_usable(),
    reason="unprivileged user+mount namespaces (unshare -rm) are not allowed here",
)


def _with_hosts(argv: list[str], hosts: dict[str, str], workdir: Path) -> list[str]:
    """``argv`` run with /etc/hosts plus ``hosts`` (name -> address), in its own namespace."""
    path = workdir / "hosts"
    if not path.exists():
        lines = [f"{address}\t{name}" for name, address in hosts.items()]
        path.write_text(Path("/etc/hosts").read_text() + "\n" + "\n".join(lines) + "\n")
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["unshare", "-rm", "sh", "-c", script, str(path), *argv]


def _manager_env(variables: dict[str, str]) -> dict[str, str]:
    """The machine's environment without any cluster of ours, plus the manager's variables."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env.update(variables)
    return env


def _port_free_on_both() -> int:
    """A port free on 127.0.0.1 and on 127.0.0.2: every pod of a job uses the same port."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.2", port))
            except OSError:
                continue
            return port
    raise AssertionError("no port free on both 127.0.0.1 and 127.0.0.2")


def _run_pods(tmp_path: Path, pods: list[tuple[list[str], dict[str, str]]], hosts=None) -> list:
    """Start every pod (argv, its manager's variables), wait for all, return their results."""
    (tmp_path / "train.py").write_text(TRAIN)
    processes = []
    try:
        for i, (argv, variables) in enumerate(pods):
            if hosts is not None:
                argv = _with_hosts(argv, hosts, tmp_path)
            processes.append(
                Process(argv, _manager_env(variables), tmp_path, f"pod{i}", merge_output=True)
            )
        results = [p.wait(TIMEOUT_S) for p in processes]
    finally:
        for p in processes:
            p.kill_group()
    for i, r in enumerate(results):
        assert r.returncode == 0, f"pod {i} exited {r.returncode}:\n{r.stdout}"
    return results


def _results(results) -> list[dict]:
    found = [
        json.loads(line.split("result ", 1)[1])
        for r in results
        for line in r.stdout.splitlines()
        if "result {" in line
    ]
    assert len(found) == 2, [r.stdout for r in results]
    return found


# --- Kubeflow TFJob ----------------------------------------------------------------------------


@needs_hosts
def test_kubeflow_tfjob_chief_and_worker_by_service_names(tmp_path):
    port = _port_free_on_both()
    job, namespace = "mnist", "kubeflow"
    cluster = {
        "chief": [f"{job}-chief-0.{namespace}.svc:{port}"],
        "worker": [f"{job}-worker-0.{namespace}.svc:{port}"],
    }
    hosts = {f"{job}-chief-0.{namespace}.svc": "127.0.0.1"}
    hosts[f"{job}-worker-0.{namespace}.svc"] = "127.0.0.2"

    def pod(task_type: str) -> tuple[list[str], dict[str, str]]:
        tf_config = {"cluster": cluster, "task": {"type": task_type, "index": 0}}
        tf_config["environment"] = "cloud"
        return [sys.executable, "train.py"], {"TF_CONFIG": json.dumps(tf_config)}

    found = _results(_run_pods(tmp_path, [pod("chief"), pod("worker")], hosts))
    assert sorted(tuple(r["task"]) for r in found) == [("chief", 0), ("worker", 0)]
    assert all(r["source"] == "TF_CONFIG" and r["replicas"] == 2 for r in found)
    assert all(r["sum"] == 2.0 for r in found)


# --- Kubeflow PyTorchJob / TrainJob: torchrun in every pod -------------------------------------


@needs_hosts
def test_kubeflow_pytorchjob_runs_torchrun_from_pet_variables(tmp_path):
    port = _port_free_on_both()
    master = "mnist-master-0"  # the master's service, in the job's namespace

    def pod(rank: int) -> tuple[list[str], dict[str, str]]:
        variables = {
            "PYTHONUNBUFFERED": "0",
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(rank),
            "PET_NNODES": "2",
        }
        # The manifest's command: torchrun reads PET_NNODES, PET_NODE_RANK, PET_MASTER_*.
        return [sys.executable, "-m", "torch.distributed.run", "train.py"], variables

    hosts = {master: "127.0.0.1", "mnist-worker-0": "127.0.0.2"}
    found = _results(_run_pods(tmp_path, [pod(0), pod(1)], hosts))
    assert sorted(tuple(r["task"]) for r in found) == [("worker", 0), ("worker", 1)]
    assert all(r["source"] == "torchrun" and r["sum"] == 2.0 for r in found)


# --- Ray Train TorchTrainer --------------------------------------------------------------------

# What Ray's _TorchBackend does in each worker actor before it calls the train function.
RAY_WORKER = """\
import datetime, os, sys
import torch.distributed as dist
from train import train

rank, world, port = int(sys.argv[1]), 2, sys.argv[2]
os.environ["MASTER_ADDR"] = "127.0.0.1"  # worker 0's node address
os.environ["MASTER_PORT"] = port         # a free port on worker 0's node
os.environ["LOCAL_RANK"] = "0"
os.environ["RANK"] = str(rank)
os.environ["LOCAL_WORLD_SIZE"] = "1"
os.environ["WORLD_SIZE"] = str(world)
os.environ["NODE_RANK"] = str(rank)
dist.init_process_group(
    backend="gloo", init_method="env://", rank=rank, world_size=world,
    timeout=datetime.timedelta(seconds=1800),
)
train()
"""


def test_ray_train_torchtrainer_workers_with_its_process_group(tmp_path):
    (tmp_path / "ray_worker.py").write_text(RAY_WORKER)
    port = str(_port_free_on_both())
    pods = [([sys.executable, "ray_worker.py", str(rank), port], {}) for rank in (0, 1)]
    found = _results(_run_pods(tmp_path, pods))
    assert sorted(tuple(r["task"]) for r in found) == [("worker", 0), ("worker", 1)]
    assert all(r["source"] == "torchrun" and r["sum"] == 2.0 for r in found)


# --- SLURM srun ----------------------------------------------------------------------------------


def _slurm_job_id() -> int:
    """A job id whose rendezvous port (29500 + id % 1000) is free on both loopback addresses.

    The search starts at a random offset (from the system's randomness, not a seeded
    generator): starting at 29500 every time, two copies of the suite running side by side
    found the same free port at the same moment and one job met the other's rendezvous."""
    start = random.SystemRandom().randrange(1000)
    for k in range(1000):
        offset = (start + k) % 1000
        port = 29500 + offset
        try:
            for address in ("127.0.0.1", "127.0.0.2"):
                with socket.socket() as s:
                    s.bind((address, port))
        except OSError:
            continue
        return 4_242_000 + offset
    raise AssertionError("no free port in 29500..30499")


def srun_env(procid: int, job_id: int) -> dict[str, str]:
    """What ``srun -N2 --ntasks-per-node=1 python train.py`` sets for task ``procid``."""
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_NODELIST": "node[01-02]",
        "SLURM_NTASKS": "2",
        "SLURM_NPROCS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": "node[01-02]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(procid),
        "SLURMD_NODENAME": f"node0{procid + 1}",
        "SLURM_CPUS_ON_NODE": "1",
    }


SLURM_TRAIN = """\
import os, torch
import stratagem as sg

strategy = sg.distribute.MultiWorkerMirroredStrategy()
step = torch.tensor(0)
manager = sg.train.CheckpointManager(sg.train.Checkpoint(step=step), "ckpts", max_to_keep=2)
handler = sg.train.PreemptionCheckpointHandler(
    strategy.cluster_resolver, manager, termination_config=sg.train.slurm_requeue_config()
)
print("resumed at", int(step), "as", strategy.cluster_resolver.source, flush=True)
one = torch.ones(1)

def train_step():
    strategy.reduce(sg.distribute.ReduceOp.SUM, strategy.run(lambda: one), axis=None)
    step.add_(1)
    print("step", int(step), flush=True)

target = int(os.environ.get("STEPS", "0"))  # 0: until the job is told to stop
while target == 0 or int(step) < target:
    handler.run(train_step)
print("finished at", int(step), flush=True)
"""


def _start_pods(tmp_path, pods, hosts, prefix: str) -> list[Process]:
    processes = []
    for i, (argv, variables) in enumerate(pods):
        argv = _with_hosts(argv, hosts, tmp_path)
        env = _manager_env(variables)
        processes.append(Process(argv, env, tmp_path, f"{prefix}{i}", merge_output=True))
    return processes


def _wait_for(proc: Process, text: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while text not in proc.output_so_far():
        assert proc.proc.poll() is None, f"{proc.name} exited:\n{proc.output_so_far()}"
        assert time.monotonic() < deadline, f"{proc.name} never printed {text!r}"
        time.sleep(0.05)


@needs_hosts
def test_slurm_srun_job_checkpoints_and_requeues_on_sigusr1(tmp_path):
    """srun on two nodes; SIGUSR1 before the time limit (``--signal=USR1@90``) reaches every
    task; they save one checkpoint at the same step, task 0 runs ``scontrol requeue <job>``, all
    exit 0; the requeued job (SLURM_RESTART_COUNT=1) resumes from that checkpoint."""
    (tmp_path / "train.py").write_text(SLURM_TRAIN)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # records how it was called, as the real one would act
    scontrol.write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    scontrol.chmod(0o755)
    log = tmp_path / "scontrol.log"
    job_id = _slurm_job_id()
    hosts = {"node01": "127.0.0.1", "node02": "127.0.0.2"}
    path = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SCONTROL_LOG": str(log)}

    def pods(**extra: str) -> list:
        argv = [sys.executable, "train.py"]
        return [(argv, {**srun_env(i, job_id), **path, **extra}) for i in (0, 1)]

    first = _start_pods(tmp_path, pods(), hosts, "run1-")
    try:
        for p in first:
            _wait_for(p, "step 3\n")
        for p in first:
            p.proc.send_signal(signal.SIGUSR1)
        results = [p.wait(TIMEOUT_S) for p in first]
    finally:
        for p in first:
            p.kill_group()
    for r in results:
        assert r.returncode == 0, r.stdout
        assert "resumed at 0 as SLURM" in r.stdout
        assert "saving a checkpoint before termination (SIGUSR1 received by the job)" in r.stdout
    assert log.read_text() == f"requeue {job_id}\n"  # once, by task 0
    assert "requeued the SLURM job" in results[0].stdout
    saved = [int(r.stdout.split("step ")[-1].split()[0]) for r in results]
    assert saved[0] == saved[1] >= 3  # both stopped after the same step

    second = _start_pods(
        tmp_path, pods(SLURM_RESTART_COUNT="1", STEPS=str(saved[0] + 2)), hosts, "run2-"
    )
    try:
        again = [p.wait(TIMEOUT_S) for p in second]
    finally:
        for p in second:
            p.kill_group()
    for r in again:
        assert r.returncode == 0, r.stdout
        assert f"resumed at {saved[0]} as SLURM" in r.stdout
        assert f"finished at {saved[0] + 2}" in r.stdout
    assert log.read_text() == f"requeue {job_id}\n"  # no second requeue


def test_requeue_command_names_the_job_or_the_array_task():
    from stratagem.cluster.slurm_requeue import requeue_command, requeue_job
    from stratagem.errors import ClusterConfigError

    assert requeue_command({"SLURM_JOB_ID": "77"}) == ["scontrol", "requeue", "77"]
    array = {"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "78", "SLURM_ARRAY_TASK_ID": "2"}
    assert requeue_command(array) == ["scontrol", "requeue", "78_2"]
    with pytest.raises(ClusterConfigError, match="SLURM_JOB_ID is not set"):
        requeue_command({})

    def refuse(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "Invalid job id specified\n")

    with pytest.raises(ClusterConfigError, match=r"scontrol requeue 77 exited 1: Invalid job id"):
        requeue_job({"SLURM_JOB_ID": "77"}, run=refuse)


def test_a_started_group_of_another_size_is_refused_by_name():
    """A group someone else started must be the one the environment describes."""
    import torch.distributed as dist

    from stratagem.cluster import TorchrunClusterResolver
    from stratagem.comm.process_group import connect
    from stratagem.errors import RendezvousError

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RendezvousError) as info:
            connect(TorchrunClusterResolver(environ=env))
    finally:
        dist.destroy_process_group()
    assert str(info.value).startswith(
        "torch.distributed was already initialised as rank 0 of 1, but worker 0 of 2 workers "
        "(torchrun) is rank 0 of 2; expected the same rank and size"
    )
