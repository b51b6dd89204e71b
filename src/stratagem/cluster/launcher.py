"""Run a script as a TF_CONFIG cluster of local processes (``stratagem run``).

Every task (chief, workers, parameter servers, an evaluator) is ``python script args`` with its
own ``TF_CONFIG``, in its own session and process group, so that stopping a task also stops what
it started and a terminal's Ctrl-C reaches only the launcher, which forwards it. The launcher
streams each task's output with a prefix, stops the whole job when one task fails (after a grace
period in which the survivors may report the lost peer themselves), and restarts it when asked.

Its parts: ``tasks.py`` builds each attempt's tasks (free ports, TF_CONFIGs, environments),
``attempt.py`` runs one attempt (start, stream, watch, stop); this module checks the arguments and
runs attempts until one succeeds or the restarts run out.

POSIX only (sessions, process groups, ``waitid``). It imports nothing heavy itself (no torch),
so that it starts fast and depends on nothing it launches.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from stratagem.cluster.agreement import Agreement
from stratagem.cluster.attempt import (
    KILL_TIMEOUT_S,
    Console,
    Interrupts,
    Job,
    Outcome,
    describe_status,
    exit_code_of,
)
from stratagem.cluster.nodes import (
    DEFAULT_MASTER_PORT,
    DEFAULT_TIMEOUT_S,
    JOIN_TIMEOUT_EXIT_CODE,
    JoinTimeoutError,
    LostLink,
    NodeLostError,
    Nodes,
    Placement,
    address_towards,
    meet_nodes,
    meeting_place,
)
from stratagem.cluster.progress import LEVEL_VARIABLE
from stratagem.cluster.tasks import (
    CONFLICTING_ENV,
    CONFLICTING_ENV_PREFIXES,
    RESTART_WORKERS_VARIABLE,
    TASK_TYPES,
    LaunchError,
    Task,
    build_tf_configs,
    count_tasks,
    free_ports,
    make_tasks,
    plural,
    task_env,
)

__all__ = [  # the launcher's parts, used by jobs, tuning and tests through this module
    "CONFLICTING_ENV",
    "CONFLICTING_ENV_PREFIXES",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TIMEOUT_S",
    "JOIN_TIMEOUT_EXIT_CODE",
    "KILL_TIMEOUT_S",
    "TASK_TYPES",
    "Console",
    "Interrupts",
    "Job",
    "JoinTimeoutError",
    "LaunchError",
    "NodeLostError",
    "Nodes",
    "Outcome",
    "Placement",
    "Task",
    "address_towards",
    "build_tf_configs",
    "check_arguments",
    "describe_status",
    "exit_code_of",
    "free_ports",
    "launch",
    "make_tasks",
    "plural",
    "run_job",
    "task_env",
]


def usable_cpus() -> int:
    # The CPUs this process may run on (taskset, cgroup cpusets), not all of the machine's.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_arguments(
    target: Sequence[str],
    *,
    workers: int,
    ps: int,
    max_restarts: int,
    grace_period: float,
    host: str,
    chief: bool = False,
    restart_workers: int = 0,
    multinode: bool = False,
) -> None:
    """Raise ``LaunchError`` for arguments ``launch`` cannot run; it starts nothing before this.

    A job with a chief may have no workers (a chief alone is a job of one, as on Vertex AI).
    ``restart_workers`` needs ps tasks: only a parameter-server job's worker can rejoin a
    running job (a collective group cannot take a member back).
    """
    # A node of a multi-node job may run no worker (a ps or evaluator machine): the job's
    # workers are counted when the nodes meet.
    if workers < (0 if chief or multinode else 1):
        if chief or multinode:
            raise LaunchError(f"the number of workers must be 0 or more, got {workers}")
        raise LaunchError(f"the number of workers must be at least 1, got {workers}")
    if ps < 0:
        raise LaunchError(f"the number of ps tasks must be 0 or more, got {ps}")
    if max_restarts < 0:
        raise LaunchError(f"the number of restarts must be 0 or more, got {max_restarts}")
    if restart_workers < 0:
        raise LaunchError(f"the number of worker restarts must be 0 or more, got {restart_workers}")
    if restart_workers and not ps:
        raise LaunchError(
            f"--restart-workers {restart_workers} restarts a parameter-server job's worker "
            f"alone, which needs ps tasks (got ps={ps}): a worker of a collective job cannot "
            "rejoin it; restart the whole job with --max-restarts"
        )
    if not (math.isfinite(grace_period) and grace_period >= 0):
        raise LaunchError(f"the grace period must be 0 or more seconds, got {grace_period}")
    if not host or any(c.isspace() for c in host):
        raise LaunchError(f"the host must be a host name or IP address, got {host!r}")
    if not target:
        raise LaunchError(
            "no script given; expected a script path or -m module, then its arguments"
        )
    if target[0] == "-m":
        if len(target) < 2 or not target[1]:
            raise LaunchError("-m needs a module name, as in -m package.train")
        return
    script = target[0]
    if script.startswith("-"):
        raise LaunchError(f"expected a script path or -m module, got option {script!r}")
    if not os.path.exists(script):
        raise LaunchError(f"script {script!r} not found")
    if os.path.isdir(script):
        raise LaunchError(f"script {script!r} is a directory, expected a Python file")


def launch(
    target: Sequence[str],
    *,
    workers: int = 1,
    ps: int = 0,
    evaluator: bool = False,
    chief: bool = False,
    max_restarts: int = 0,
    grace_period: float = 5.0,
    host: str = "localhost",
    python: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    tolerate_worker_loss: bool = False,
    quiet: bool = False,
    nodes: Nodes | None = None,
    restart_workers: int = 0,
    min_workers: int = 0,
) -> int:
    """Run ``python *target`` as a local cluster job; return the exit code for the launcher.

    With ``tolerate_worker_loss`` (parameter-server training), a worker other than the chief
    that fails is reported as lost and the job goes on without it, while ``min_workers`` are
    left. With
    ``restart_workers`` R (a cluster with a chief and ps tasks: a ClusterCoordinator's), a
    worker that fails while the chief runs is restarted alone, up to R times per worker; it
    rejoins the running job. A failed chief or ps still ends the attempt (``max_restarts``).

    ``target`` is what follows the interpreter: ``["train.py", *args]`` or
    ``["-m", "package.train", *args]``. Returns 0 when the chief and workers exited 0; the
    failed task's exit code (128 + signal when killed) when restarts ran out; 128 + signal when
    the launcher was interrupted. Raises ``LaunchError`` for bad arguments, before starting
    anything.

    ``quiet``: the tasks do not report their start (``STRATAGEM_LOG_LEVEL=warning`` in each).
    ``nodes``: this launcher runs node ``nodes.node_rank``'s tasks of a job over
    ``nodes.nnodes`` machines: its ``workers``, and the ``ps``, ``chief`` and ``evaluator``
    tasks of the whole job that ``Placement`` puts on it (``stratagem.cluster.nodes``); with
    ``max_restarts``, every attempt's end is agreed with the other nodes' launchers
    (``stratagem.cluster.agreement``): a failure on any node restarts the job on all of them.
    """
    base_env = None
    if quiet:
        base_env = {**os.environ, LEVEL_VARIABLE: "warning"}
    return run_job(
        target,
        workers=workers,
        ps=ps,
        evaluator=evaluator,
        chief=chief,
        max_restarts=max_restarts,
        grace_period=grace_period,
        host=host,
        python=python,
        console=Console(out or sys.stdout, err or sys.stderr),
        tolerate_worker_loss=tolerate_worker_loss,
        base_env=base_env,
        nodes=nodes,
        restart_workers=restart_workers,
        min_workers=min_workers,
    ).exit_code


def run_job(
    target: Sequence[str],
    *,
    workers: int = 1,
    ps: int = 0,
    evaluator: bool = False,
    chief: bool = False,
    max_restarts: int = 0,
    grace_period: float = 5.0,
    host: str = "localhost",
    python: str | None = None,
    console: Console | None = None,
    base_env: Mapping[str, str] | None = None,
    omp_threads: int | None = None,
    interrupts: Interrupts | None = None,
    tolerate_worker_loss: bool = False,
    nodes: Nodes | None = None,
    restart_workers: int = 0,
    min_workers: int = 0,
) -> Outcome:
    """``launch``, returning the job's ``Outcome`` (exit code and reason) instead of the code.

    For callers that run jobs themselves (``sg.jobs.CustomJob``, tuning trials): ``base_env``
    replaces ``os.environ`` as the tasks' environment; ``omp_threads`` sets OMP_NUM_THREADS in
    every task (default: the usable CPUs divided by the tasks, unless ``base_env`` sets it);
    ``interrupts`` stops the job when called (``interrupts(signal.SIGTERM, None)``) from another
    thread, as a signal to the launcher would.
    """
    check_arguments(
        target,
        workers=workers,
        ps=ps,
        max_restarts=max_restarts,
        grace_period=grace_period,
        host=host,
        chief=chief,
        restart_workers=restart_workers,
        multinode=nodes is not None,
    )
    if nodes is None:
        counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
    else:
        _check_nodes(
            nodes,
            ps=ps,
            evaluator=evaluator,
            chief=chief,
            restart_workers=restart_workers,
        )
        # This node's own tasks share its CPUs.
        counts = Placement(nodes, ps=ps, chief=chief, evaluator=evaluator).counts_on(
            nodes.node_rank, workers
        )
    num_tasks = sum(counts.values())
    base_env = dict(os.environ if base_env is None else base_env)
    # Only this launcher's own setting: the tasks' coordinator waits for restarted workers.
    base_env.pop(RESTART_WORKERS_VARIABLE, None)
    if restart_workers:
        base_env[RESTART_WORKERS_VARIABLE] = str(restart_workers)
    if omp_threads is None and "OMP_NUM_THREADS" not in base_env:
        omp_threads = max(1, usable_cpus() // num_tasks)
    python = python or sys.executable
    console = console or Console(sys.stdout, sys.stderr)
    command = shlex.join([os.path.basename(python), *target])

    # Said once, in the first start message: the one setting the launcher makes for the user.
    omp_note = (
        ""
        if omp_threads is None
        else f"; OMP_NUM_THREADS={omp_threads} in each task ({plural(usable_cpus(), 'CPU')} /"
        f" {plural(num_tasks, 'task')}, to avoid oversubscription; set it to override)"
    )

    with (interrupts or Interrupts()).installed() as interrupts, contextlib.ExitStack() as job:
        # Node 0 of a job that may restart listens from its first meeting to the end: a node
        # coming back finds it there, and a refused port tells it node 0's launcher is gone.
        server = None
        if nodes is not None and nodes.node_rank == 0 and max_restarts:
            server = job.enter_context(meeting_place(nodes))
        lost: LostLink | None = None  # this node lost node 0's link in the last attempt
        attempt = 0
        while True:
            agreement: Agreement | None = None
            if nodes is None:
                tasks = make_tasks(
                    counts, host=host, restart=attempt, base_env=base_env, omp_threads=omp_threads
                )
            else:
                met = meet_nodes(
                    nodes,
                    workers,
                    host=host,
                    restart=attempt,
                    base_env=base_env,
                    omp_threads=omp_threads,
                    log=console.log,
                    stopped=lambda: interrupts.signum is not None,
                    ps=ps,
                    chief=chief,
                    evaluator=evaluator,
                    max_restarts=max_restarts,
                    server=server,
                    lost=lost,
                )
                lost = None
                if met is None:  # a signal while waiting for the other nodes
                    assert interrupts.signum is not None
                    name = signal.Signals(interrupts.signum).name
                    console.log(f"job stopped: received {name} while the nodes met")
                    return Outcome(128 + interrupts.signum, f"stopped: received {name}")
                tasks = met.tasks
                if max_restarts:  # the attempt's end is agreed with the other nodes
                    attempt = met.attempt  # node 0's: a node started again learns it here
                    agreement = Agreement(met, nodes, max_restarts, console.log)
            try:
                with Job(
                    tasks,
                    target,
                    grace_period=grace_period,
                    python=python,
                    console=console,
                    interrupts=interrupts,
                    tolerate_worker_loss=tolerate_worker_loss,
                    restart_workers=restart_workers,
                    min_workers=min_workers,
                    remote=None if agreement is None else agreement.remote_failure,
                ) as job:
                    try:
                        job.start()
                    except OSError as exc:
                        console.log(f"could not start {command}: {exc}")
                        return Outcome(1, f"could not start {command}: {exc}")
                    attempts = (
                        f" (attempt {attempt + 1} of {max_restarts + 1})" if max_restarts else ""
                    )
                    where = f" ({nodes.name})" if nodes is not None else ""
                    console.log(
                        f"started {count_tasks(tasks)}{where}: {command}{attempts}{omp_note}"
                    )
                    omp_note = ""
                    outcome = job.wait()
                    if agreement is not None:  # before stopping what is left: others wait
                        agreement.report(outcome, interrupts.signum)
                if interrupts.signum is not None:  # the user's stop wins over any outcome
                    name = signal.Signals(interrupts.signum).name
                    console.log(f"job stopped: received {name}")
                    return Outcome(128 + interrupts.signum, f"stopped: received {name}")
                assert outcome is not None
                if agreement is not None:
                    decision = agreement.settle(outcome, lambda: interrupts.signum)
                    if decision.kind == "done":
                        console.log(f"job finished: {outcome.reason}; {decision.reason}")
                        return Outcome(0, f"{outcome.reason}; {decision.reason}")
                    if decision.kind == "failed":
                        console.log(f"job failed: {decision.reason}")
                        return Outcome(decision.exit_code, decision.reason)
                    attempt, lost = decision.next_attempt, agreement.lost
                    console.log(
                        f"restarting the job on every node (restart {attempt} of "
                        f"{max_restarts}): {decision.reason}"
                    )
                    continue
            finally:
                if agreement is not None:
                    agreement.close()
            if outcome.exit_code == 0:
                console.log(f"job finished: {outcome.reason}")
                return outcome
            if attempt == max_restarts:
                restarts = plural(max_restarts, "restart")
                console.log(f"job failed: {outcome.reason} (after {restarts})")
                return Outcome(outcome.exit_code, f"{outcome.reason} (after {restarts})")
            attempt += 1
            console.log(f"restarting the job (restart {attempt} of {max_restarts})")


def _check_nodes(
    nodes: Nodes,
    *,
    ps: int,
    evaluator: bool,
    chief: bool,
    restart_workers: int,
) -> None:
    """A job over several machines is restarted whole (``--max-restarts``, agreed by every
    node: ``stratagem.cluster.agreement``), but its workers are not restarted alone: a node's
    launcher would have to rejoin the others mid-attempt, which is not built yet; say so before
    starting."""
    nodes.check()
    moved = [
        (flag, needs)
        for flag, given, needs, wanted in (
            ("--ps-nodes", bool(nodes.ps_nodes), "--ps", ps),
            ("--chief-node", nodes.chief_node != 0, "--chief", chief),
            ("--evaluator-node", nodes.evaluator_node != 0, "--evaluator", evaluator),
        )
        if given and not wanted
    ]
    if moved:
        flag, needs = moved[0]
        raise LaunchError(f"{flag} places a task the job does not have: it needs {needs}")
    if restart_workers:
        raise LaunchError(
            f"--nnodes cannot restart a worker alone yet (got --restart-workers "
            f"{restart_workers}): its node's launcher would have to rejoin the others"
        )
