"""The ``stratagem`` command.

``stratagem run`` starts a script as a local TF_CONFIG cluster job (``stratagem.cluster.launcher``).
A subcommand is an entry of ``COMMANDS``: a help line, a function adding its arguments to its
parser, and a function running it on its own arguments (so that ``run`` can keep everything
after the script for the script).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import stratagem
from stratagem.cluster import launcher


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
RUN_OPTIONS_WITH_VALUE = ("-n", "--workers", "--ps", "--max-restarts", "--grace-period", "--host")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", "--workers", type=int, default=1, metavar="N", help="worker tasks (default 1)"
    )
    parser.add_argument("--ps", type=int, default=0, metavar="K", help="ps tasks (default 0)")
    parser.add_argument("--evaluator", action="store_true", help="add one evaluator task")
    parser.add_argument(
        "--chief", action="store_true", help="add a chief task (without it, worker 0 is the chief)"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart the whole job up to R times after a failure (default 0)",
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
        "--host", default="localhost", help="host name in the tasks' addresses (default localhost)"
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


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
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
        i += 2 if arg in RUN_OPTIONS_WITH_VALUE else 1
    return list(argv), []


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    options, target = split_command(argv)
    args = parser.parse_args(options)
    try:
        return launcher.launch(
            target,
            workers=args.workers,
            ps=args.ps,
            evaluator=args.evaluator,
            chief=args.chief,
            max_restarts=args.max_restarts,
            grace_period=args.grace_period,
            host=args.host,
            tolerate_worker_loss=args.tolerate_worker_loss,
        )
    except launcher.LaunchError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2


COMMANDS: dict[str, Command] = {
    "run": Command(
        help="run a script as a local cluster job (workers, ps, evaluator)",
        description=RUN_DESCRIPTION,
        usage=RUN_USAGE,
        add_arguments=_add_run_arguments,
        run=_run,
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
