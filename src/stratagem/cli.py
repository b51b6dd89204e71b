"""The ``stratagem`` command.

``stratagem run`` starts a script as a local TF_CONFIG cluster job (``stratagem.cluster.launcher``).
A subcommand is an entry of ``COMMANDS``: a help line, a function adding its arguments to its
parser, and a function running it on its own arguments (so that ``run`` can keep everything
after the script for the script).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import stratagem
from stratagem.cluster import launcher
from stratagem.cluster.progress import LEVEL_VARIABLE
from stratagem.cluster.tasks import WorkerRange


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, as every bad-input error of stratagem."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class Command:
    help: str  # one line, in `stratagem --help`
    description: str  # in `stratagem <command> --help`
    usage: str | None  # None: argparse writes it
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.ArgumentParser, list[str]], int]  # (its parser, its arguments)
    epilog: str | None = None  # after the options in `stratagem <command> --help`


# --- stratagem run -----------------------------------------------------------------------------

RUN_USAGE = "stratagem run [options] (script.py | -m module) [args ...]"
RUN_DESCRIPTION = """\
Run a script as a cluster job on this machine: N worker tasks (plus ps tasks and an evaluator
if asked), each `python script.py args` with its own TF_CONFIG on free loopback ports. Every
task's output is printed with a prefix such as [worker 0]. When a task fails, the others get
the grace period to exit, then the job is stopped (or restarted, with --max-restarts) and the
launcher exits with the failed task's code. Everything after the script (or after -m module,
or after --) goes to the script unchanged.
"""
# The options that take a value: the command starts at the first argument that is neither one
# of the launcher's options nor such an option's value.
RUN_OPTIONS_WITH_VALUE = (
    "-n",
    "--workers",
    "--ps",
    "--max-restarts",
    "--restart-workers",
    "--grace-period",
    "--host",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--join-timeout",
    "--ps-nodes",
    "--chief-node",
    "--evaluator-node",
)
# What the launcher's exit code says (shown by `stratagem run --help`, and in the README).
RUN_EPILOG = f"""\
exit codes:
  0      the chief and every worker exited 0
  N      the failed task's own exit code, once restarts ran out (128 + S when a signal S killed
         it), so a script's code passes through
  1      the script could not be started; with --nnodes and --max-restarts, also node 0's
         launcher was lost mid-job (NodeLostError: the job cannot restart without it)
  2      a usage error: bad options or values, nothing was started
  {launcher.JOIN_TIMEOUT_EXIT_CODE}    --nnodes: the nodes did not all meet within --join-timeout
         (start them closer together in time, or raise it), also after a link between
         them was cut for longer: every side ends so
  128+S  the launcher received signal S and stopped the job (130: Ctrl-C, 143: SIGTERM)
A task's own code can be any of these: the launcher's last line (job failed: ...) says which.
"""


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--workers",
        type=_count_or_range("workers"),
        default=1,
        metavar="N",
        help="worker tasks (default 1; with --nnodes, this node's); MIN:MAX for an elastic job"
        " on torch's elastic agent: it goes on while MIN workers live, and --max-restarts"
        " starts a lost worker again",
    )
    parser.add_argument(
        "--ps",
        type=int,
        default=0,
        metavar="K",
        help="ps tasks (default 0; with --nnodes, the whole job's)",
    )
    parser.add_argument("--evaluator", action="store_true", help="add one evaluator task")
    parser.add_argument(
        "--chief", action="store_true", help="add a chief task (without it, worker 0 is the chief)"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart the whole job up to R times after a failure (default 0; with --nnodes,"
        " agreed by every node, each given the same R: a failed task or node restarts all)",
    )
    parser.add_argument(
        "--restart-workers",
        type=int,
        default=0,
        metavar="W",
        help="with --ps (a ClusterCoordinator's cluster, or between-graph workers): restart a"
        " worker that fails alone (not the chief), up to W times per worker; it rejoins the"
        " running job and takes work again (default 0)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds the other tasks get to exit after one fails or the workers finish, and"
        " after SIGTERM when the launcher is interrupted (default 5)",
    )
    parser.add_argument(
        "--host",
        default=None,
        help="host name in the tasks' addresses (default localhost; with --nnodes, node 0's is"
        " --master-addr and another node's the address it reaches node 0 from)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="the tasks do not report their start (who is missing, the strategy started);"
        " the same as STRATAGEM_LOG_LEVEL=warning in every task",
    )
    nodes = parser.add_argument_group(
        "multi-node jobs",
        "run the same command on every machine, each with its --node-rank and the same\n"
        "STRATAGEM_JOB_SECRET; every task gets the TF_CONFIG of the whole job. Placement:\n"
        "  workers    -n on each node (node R's follow those of nodes 0..R-1; -n may differ,\n"
        "             -n 0: a machine for ps or evaluator tasks only)\n"
        "  ps         --ps K in all, ps j on node j mod N (or in turn on the --ps-nodes)\n"
        "  chief      on node 0 (or --chief-node R)\n"
        "  evaluator  on node 0 (or --evaluator-node R)\n"
        "every node must be given the same --ps, --chief, --evaluator and placement options",
    )
    nodes.add_argument(
        "--nnodes",
        type=_count_or_range("nodes"),
        default=None,
        metavar="N",
        help="machines in the job; MIN:MAX for an elastic job on torch's elastic agent (it goes"
        " on while MIN nodes live, and admits a node that joins, up to MAX)",
    )
    nodes.add_argument(
        "--node-rank", type=int, default=None, metavar="R", help="this machine's index, 0..N-1"
    )
    nodes.add_argument(
        "--master-addr",
        default=None,
        metavar="HOST",
        help="node 0's address (where launchers meet)",
    )
    nodes.add_argument(
        "--master-port",
        type=int,
        default=launcher.DEFAULT_MASTER_PORT,
        metavar="P",
        help=f"the port node 0's launcher listens on (default {launcher.DEFAULT_MASTER_PORT})",
    )
    nodes.add_argument(
        "--join-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a node's launcher waits for the others, said when it starts waiting"
        f" (default {launcher.DEFAULT_TIMEOUT_S:g}; torchrun's --rdzv-conf join_timeout); past"
        f" it the launcher exits {launcher.JOIN_TIMEOUT_EXIT_CODE}",
    )
    nodes.add_argument(
        "--ps-nodes",
        default=None,
        metavar="R,R...",
        help="the nodes that take the ps tasks in turn: ps j on the (j mod count)-th node listed"
        " (default every node: ps j on node j mod N)",
    )
    nodes.add_argument(
        "--chief-node", type=int, default=None, metavar="R", help="the chief's node (default 0)"
    )
    nodes.add_argument(
        "--evaluator-node",
        type=int,
        default=None,
        metavar="R",
        help="the evaluator's node (default 0)",
    )
    parser.add_argument(
        "--tolerate-worker-loss",
        action="store_true",
        help="a worker other than the chief that fails is reported and the job goes on without"
        " it (asynchronous parameter-server training)",
    )
    # Shown by --help only: split_command takes the command off before argparse sees it.
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m")
    parser.add_argument("script", nargs="?", help="the Python script to run")
    parser.add_argument("args", nargs="*", help="arguments for the script, passed unchanged")


def split_command(
    argv: Sequence[str], options_with_value: Sequence[str] = RUN_OPTIONS_WITH_VALUE
) -> tuple[list[str], list[str]]:
    """Split ``stratagem run``'s arguments into the launcher's options and the command.

    The command starts at the first argument that is neither an option nor an option's value,
    at ``-m``, or after ``--``; from there on every argument is the script's, even one that looks
    like a launcher option. (argparse's REMAINDER cannot do this: after ``-m module`` it takes the
    script's ``--flag`` for one of its own.) ``-mpkg`` becomes ``["-m", "pkg"]``.
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if arg.startswith("-m"):
            module = [arg[2:]] if len(arg) > 2 else []
            return list(argv[:i]), ["-m", *module, *argv[i + 1 :]]
        if arg == "-" or not arg.startswith("-"):
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in options_with_value else 1
    return list(argv), []


def _count_or_range(what: str) -> Callable[[str], int | str]:
    """``-n`` and ``--nnodes``: a number, or ``MIN:MAX`` (checked when the job is made)."""

    def parse(text: str) -> int | str:
        if ":" in text:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number of {what} N or a range MIN:MAX, got {text!r}"
            ) from None

    return parse


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    options, target = split_command(argv)
    args = parser.parse_args(options)
    ps_range = isinstance(args.workers, str) and args.ps and args.nnodes is None
    if (isinstance(args.workers, str) and not ps_range) or isinstance(args.nnodes, str):
        return _run_elastic(parser, args, target)
    nodes, host = _nodes(parser, args)
    try:
        # -n MIN:MAX --ps K: a ps job keeps its own rule, workers come and go and the ps
        # stays: MAX workers, going on without a lost one (not the chief) while MIN are left.
        workers = WorkerRange.parse(args.workers) if ps_range else None
        return launcher.launch(
            target,
            workers=args.workers if workers is None else workers.maximum,
            ps=args.ps,
            evaluator=args.evaluator,
            chief=args.chief,
            max_restarts=args.max_restarts,
            grace_period=args.grace_period,
            host=host,
            tolerate_worker_loss=args.tolerate_worker_loss or workers is not None,
            quiet=args.quiet,
            nodes=nodes,
            restart_workers=args.restart_workers,
            min_workers=0 if workers is None else workers.minimum,
        )
    except launcher.JoinTimeoutError as exc:  # not a usage error: the same command may work later
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return launcher.JOIN_TIMEOUT_EXIT_CODE
    except launcher.NodeLostError as exc:  # the job ran and failed, as a task's failure would
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    except launcher.LaunchError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2


def _run_elastic(
    parser: argparse.ArgumentParser, args: argparse.Namespace, target: list[str]
) -> int:
    """``-n MIN:MAX`` or ``--nnodes MIN:MAX``: the job on torch's elastic agent (imported only
    here: it needs torch)."""
    several = isinstance(args.nnodes, str)
    if several and isinstance(args.workers, str):
        parser.error(
            f"--nnodes {args.nnodes} takes a number of workers per node, not a range (got -n "
            f"{args.workers})"
        )
    if isinstance(args.nnodes, int):
        parser.error(
            f"-n {args.workers} (an elastic job of workers on this machine) cannot be combined "
            f"with --nnodes {args.nnodes}; give --nnodes MIN:MAX for an elastic job of machines"
        )
    needed = [
        flag
        for flag, value in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr))
        if several and value is None
    ]
    if needed:
        parser.error(f"--nnodes {args.nnodes} needs {' and '.join(needed)}")
    others = [
        flag
        for flag, given in (
            ("--ps", args.ps),
            ("--chief", args.chief),
            ("--evaluator", args.evaluator),
            ("--restart-workers", args.restart_workers),
            ("--tolerate-worker-loss", args.tolerate_worker_loss),
            ("--ps-nodes", args.ps_nodes is not None),
            ("--chief-node", args.chief_node is not None),
            ("--evaluator-node", args.evaluator_node is not None),
        )
        if given
    ]
    if not several:
        others += [
            flag
            for flag, value in (
                ("--node-rank", args.node_rank),
                ("--master-addr", args.master_addr),
            )
            if value is not None
        ]
    if others:
        what = f"--nnodes {args.nnodes}" if several else f"-n {args.workers}"
        parser.error(
            f"{what} (an elastic job) cannot be combined with {', '.join(others)}: elastic "
            "jobs run workers only, for now"
        )
    host = args.host
    try:
        launcher.check_arguments(
            target,
            workers=1,
            ps=0,
            max_restarts=args.max_restarts,
            grace_period=args.grace_period,
            host=host or "localhost",
        )
        from stratagem.elastic.agent import NodePlace, run_elastic

        workers = WorkerRange.parse(str(args.workers))
        place = None
        if several:
            place = NodePlace(
                WorkerRange.parse(args.nnodes, what="nodes"),
                args.node_rank,
                args.master_addr,
                args.master_port,
            )
            if host is None:
                master = args.master_addr
                host = master if args.node_rank == 0 else launcher.address_towards(master)
    except launcher.LaunchError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    base_env = {**os.environ, LEVEL_VARIABLE: "warning"} if args.quiet else None
    omp = max(1, launcher.usable_cpus() // workers.maximum)
    return run_elastic(
        target,
        workers=workers,
        max_restarts=args.max_restarts,
        grace_period=args.grace_period,
        host=host or "localhost",
        base_env=base_env,
        omp_threads=None if "OMP_NUM_THREADS" in os.environ else omp,
        place=place,
        join_timeout_s=600.0 if args.join_timeout is None else args.join_timeout,
    ).exit_code


def _nodes(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[launcher.Nodes | None, str]:
    """The multi-node options as ``Nodes`` (None without --nnodes), and the tasks' host."""
    given = [
        flag
        for flag, value in (
            ("--node-rank", args.node_rank),
            ("--master-addr", args.master_addr),
            ("--join-timeout", args.join_timeout),
            ("--ps-nodes", args.ps_nodes),
            ("--chief-node", args.chief_node),
            ("--evaluator-node", args.evaluator_node),
        )
        if value is not None
    ]
    if args.nnodes is None:
        if given:
            verb = "needs" if len(given) == 1 else "need"
            parser.error(f"{' and '.join(given)} {verb} --nnodes")
        return None, "localhost" if args.host is None else args.host
    missing = [
        flag
        for flag, value in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr))
        if value is None
    ]
    if missing:
        parser.error(f"--nnodes needs {' and '.join(missing)}")
    for flag, value, needs, wanted in (
        ("--ps-nodes", args.ps_nodes, "--ps", args.ps),
        ("--chief-node", args.chief_node, "--chief", args.chief),
        ("--evaluator-node", args.evaluator_node, "--evaluator", args.evaluator),
    ):
        if value is not None and not wanted:
            parser.error(f"{flag} places a task the job does not have: it needs {needs}")
    timeout = launcher.DEFAULT_TIMEOUT_S if args.join_timeout is None else args.join_timeout
    nodes = launcher.Nodes(
        args.nnodes,
        args.node_rank,
        args.master_addr,
        args.master_port,
        timeout_s=timeout,
        ps_nodes=_node_list(parser, "--ps-nodes", args.ps_nodes),
        chief_node=0 if args.chief_node is None else args.chief_node,
        evaluator_node=0 if args.evaluator_node is None else args.evaluator_node,
    )
    host = args.host
    if host is None:
        host = (
            args.master_addr if args.node_rank == 0 else launcher.address_towards(args.master_addr)
        )
    return nodes, host


def _node_list(parser: argparse.ArgumentParser, flag: str, value: str | None) -> tuple[int, ...]:
    """``"0,2"`` as (0, 2); () when not given."""
    if value is None:
        return ()
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        parser.error(f"{flag} expects node ranks separated by commas, as 0,2; got {value!r}")


# --- stratagem job run -------------------------------------------------------------------------

JOB_USAGE = "stratagem job run [options] script.py [args ...]"
JOB_DESCRIPTION = """\
Run a script as a training job (sg.jobs.CustomJob): one chief and replica-count - 1 workers
(plus ps tasks if asked) through the launcher, in a fresh job directory under --base-output-dir.
Every task finds the job's model, checkpoint and TensorBoard folders in STRATAGEM_MODEL_DIR,
STRATAGEM_CHECKPOINT_DIR and STRATAGEM_TENSORBOARD_LOG_DIR (and AIP_MODEL_DIR,
AIP_CHECKPOINT_DIR, AIP_TENSORBOARD_LOG_DIR, as on Vertex AI); each task's output goes to
logs/<task>.log and job.json records the state, the exit reason and the model folder.
Everything after the script goes to the script unchanged.
"""
JOB_OPTIONS_WITH_VALUE = (
    "--display-name",
    "--replica-count",
    "--ps-replica-count",
    "--env",
    "--base-output-dir",
    "--max-restarts",
    "--grace-period",
)


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["run"], help="what to do with the job")
    parser.add_argument("--display-name", default=None, help="job name (default: the script's)")
    parser.add_argument(
        "--replica-count", type=int, default=1, metavar="N", help="chief + workers (default 1)"
    )
    parser.add_argument(
        "--ps-replica-count", type=int, default=0, metavar="K", help="ps tasks (default 0)"
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for every task (repeatable)",
    )
    parser.add_argument(
        "--base-output-dir",
        default=None,
        metavar="DIR",
        help="where job directories are made (default ./stratagem_jobs)",
    )
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R")
    parser.add_argument("--grace-period", type=float, default=5.0, metavar="S")
    parser.add_argument("--quiet", action="store_true", help="task output to the log files only")
    parser.add_argument("script", nargs="?", help="the Python script to run")
    parser.add_argument("args", nargs="*", help="arguments for the script, passed unchanged")


def _job(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    from stratagem import jobs

    options, target = split_command(argv[1:], JOB_OPTIONS_WITH_VALUE)
    args = parser.parse_args(argv[:1] + options)
    if not target:
        parser.error("no script given; expected a script path, then its arguments")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    script, script_args = target[0], target[1:]
    try:
        job = jobs.CustomJob(
            args.display_name or Path(script).stem,
            script,
            args=script_args,
            replica_count=args.replica_count,
            ps_replica_count=args.ps_replica_count,
            environment_variables=env,
            base_output_dir=args.base_output_dir,
            max_restarts=args.max_restarts,
            grace_period=args.grace_period,
        )
    except jobs.JobConfigError as exc:
        parser.error(str(exc))
    try:
        job.run(stream_logs=not args.quiet)
    except jobs.JobFailedError as exc:
        print(f"[stratagem] {exc}", file=sys.stderr)
        return job.exit_code or 1
    print(f"[stratagem] job {job.display_name!r} {job.state}: {job.job_dir}", file=sys.stderr)
    print(f"[stratagem] model directory: {job.model_dir}", file=sys.stderr)
    return 0


# --- stratagem tune ----------------------------------------------------------------------------

TUNE_USAGE = "stratagem tune [options] study.json"
TUNE_DESCRIPTION = """\
Run a hyperparameter tuning study (sg.tune.HyperparameterTuningJob) from a JSON study file:
trials of the script with the parameters as --name value arguments, Bayesian search (TPE),
parallel trials, median stopping. Prints a row as each trial starts and ends and the best so far,
then draws study.png (objective by trial, parameter importance) in the study folder. The study
is stored in SQLite there: run the same command again to resume an interrupted study.
"""


def _add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="study.json", help="the study file")
    parser.add_argument(
        "--base-output-dir",
        default=None,
        metavar="DIR",
        help="where the study folder goes (default: the file's base_output_dir, else"
        " stratagem_jobs beside the file)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw study.png")


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _tune(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    import signal

    from stratagem.tune.spec_file import load_tuning_job
    from stratagem.tune.table import TrialTable

    args = parser.parse_args(argv)
    try:
        job = load_tuning_job(args.spec, args.base_output_dir)
    except ValueError as exc:  # every bad-input error of the file, the specs and the job
        parser.error(str(exc))
    from stratagem.tune import TuningError

    table = TrialTable(job.metric_id, job.goal, job.parameter_spec)
    done = len(job.trials)
    print(
        f"[stratagem] study {job.display_name!r} in {job.study_dir}: "
        f"{launcher.plural(job.max_trial_count, 'trial')}, {job.parallel_trial_count} in parallel"
        + (f" (resuming after {launcher.plural(done, 'trial')})" if done else ""),
        file=sys.stderr,
    )
    from stratagem.tune.hparams import dashboard_commands

    for command in dashboard_commands(job.storage_url, job.study_dir / "tensorboard"):
        print(f"[stratagem] watch it with: {command}", file=sys.stderr)
    # SIGTERM, as Ctrl-C: stop the trials in flight and record them, rather than orphan them.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        job.run(progress=table)
    except TuningError as exc:
        print(f"[stratagem] study failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[stratagem] study interrupted; run the same command to resume", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    best = job.best_trial
    if best is None:
        print("[stratagem] no trial succeeded", file=sys.stderr)
    else:
        value = best.final_measurement.get(job.metric_id)
        params = ", ".join(f"{k}={v!r}" for k, v in best.parameters.items())
        print(f"best trial {best.id}: {job.metric_id}={value!r} with {params}")
    if not args.no_plot:
        print(f"[stratagem] plot: {job.plot()}", file=sys.stderr)
    return 0 if best is not None else 1


COMMANDS: dict[str, Command] = {
    "run": Command(
        help="run a script as a local cluster job (workers, ps, evaluator)",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        usage=RUN_USAGE,
        add_arguments=_add_run_arguments,
        run=_run,
    ),
    "job": Command(
        help="run a script as a training job with model, checkpoint and log directories",
        description=JOB_DESCRIPTION,
        usage=JOB_USAGE,
        add_arguments=_add_job_arguments,
        run=_job,
    ),
    "tune": Command(
        help="run or resume a hyperparameter tuning study from a JSON study file",
        description=TUNE_DESCRIPTION,
        usage=TUNE_USAGE,
        add_arguments=_add_tune_arguments,
        run=_tune,
    ),
}


# --- the stratagem command ---------------------------------------------------------------------


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``stratagem`` parser and the parser of each subcommand, by name."""
    parser = _Parser(
        prog="stratagem",
        description="TensorFlow-style distribution strategies for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"stratagem {stratagem.__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", title="commands", required=True
    )
    parsers = {}
    for name, command in COMMANDS.items():
        parsers[name] = subparsers.add_parser(
            name,
            help=command.help,
            description=command.description,
            epilog=command.epilog,
            usage=command.usage,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(parsers[name])
    return parser, parsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``stratagem`` on ``argv`` (default ``sys.argv[1:]``); return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, parsers = build_parser()
    try:
        if argv and argv[0] in COMMANDS:
            # Each command parses its own arguments: `run` must leave the script's alone.
            return COMMANDS[argv[0]].run(parsers[argv[0]], argv[1:])
        parser.parse_args(argv)  # --help, --version or an error: each exits
        return 2
    except SystemExit as exc:  # argparse exits; main returns, so that it can be called in-process
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
