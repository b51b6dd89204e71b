"""The ``stratagem`` command: version, help, argument splitting, bad input.

Mostly ``main(argv)`` in this process (bad input never starts a process); two end-to-end runs
check the installed console script and ``python -m stratagem.cli``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import stratagem
from stratagem import cli

TIMEOUT_S = 60


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"stratagem {stratagem.__version__}\n"


def test_help_lists_the_commands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: stratagem")
    assert "run" in out


def test_run_help(capsys):
    assert cli.main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: stratagem run [options] (script.py | -m module) [args ...]")
    for option in ["--workers", "--ps", "--evaluator", "--max-restarts", "--grace-period", "-m"]:
        assert option in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "stratagem: the following arguments are required: COMMAND"),
        (["launch"], "stratagem: argument COMMAND: invalid choice: 'launch'"),
    ],
)
def test_missing_or_unknown_command(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train.py"], ([], ["train.py"])),
        (["-n", "2", "train.py", "-n", "5"], (["-n", "2"], ["train.py", "-n", "5"])),
        (
            ["--workers=2", "-n2", "--evaluator", "t.py"],
            (["--workers=2", "-n2", "--evaluator"], ["t.py"]),
        ),
        (["--ps", "-1", "t.py", "--x"], (["--ps", "-1"], ["t.py", "--x"])),
        (["-n", "2", "--", "-weird.py", "a"], (["-n", "2"], ["-weird.py", "a"])),
        (["-m", "pkg.mod", "--lr", "3"], ([], ["-m", "pkg.mod", "--lr", "3"])),
        (["--host", "h", "-mpkg", "-m"], (["--host", "h"], ["-m", "pkg", "-m"])),
        (["-n", "2"], (["-n", "2"], [])),
        (["--help", "t.py"], (["--help"], ["t.py"])),
    ],
)
def test_split_command(argv, expected):
    assert cli.split_command(argv) == expected


def test_options_with_value_match_the_parser():
    _, parsers = cli.build_parser()
    with_value = {
        option
        for action in parsers["run"]._actions
        if action.nargs != 0 and action.dest != "module"
        for option in action.option_strings
    }
    assert with_value == set(cli.RUN_OPTIONS_WITH_VALUE)


# A script that must never run: bad input is refused before anything starts.
MARKER_SCRIPT = "open('ran', 'w').close()\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope.py"], "stratagem run: script 'nope.py' not found"),
        (["adir"], "stratagem run: script 'adir' is a directory, expected a Python file"),
        (["-n", "0", "ok.py"], "stratagem run: the number of workers must be at least 1, got 0"),
        (
            ["--ps", "-1", "ok.py"],
            "stratagem run: the number of ps tasks must be 0 or more, got -1",
        ),
        (
            ["--max-restarts", "-1", "ok.py"],
            "stratagem run: the number of restarts must be 0 or more, got -1",
        ),
        (
            ["--grace-period", "-1", "ok.py"],
            "stratagem run: the grace period must be 0 or more seconds, got -1.0",
        ),
        (["--grace-period", "nan", "ok.py"], "stratagem run: the grace period must be 0 or more"),
        ([], "stratagem run: no script given"),
        (["-n", "2", "--ps", "1"], "stratagem run: no script given"),
        (["-m"], "stratagem run: -m needs a module name"),
        (["--host", "", "ok.py"], "stratagem run: the host must be a host name or IP address"),
        (
            ["-n", "x", "ok.py"],
            "stratagem run: argument -n/--workers: expected a number of workers N or a range "
            "MIN:MAX, got 'x'",
        ),
        (["-n"], "stratagem run: argument -n/--workers: expected one argument"),
        (["--bogus", "ok.py"], "stratagem run: unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.py").write_text(MARKER_SCRIPT)
    (tmp_path / "adir").mkdir()
    assert cli.main(["run", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message)
    assert captured.err.count("\n") == 1
    assert captured.out == ""
    assert not (tmp_path / "ran").exists()


def test_console_script_version():
    # The `stratagem` script that pyproject.toml declares, installed beside this interpreter.
    script = shutil.which("stratagem", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the stratagem console script is not installed beside this interpreter")
    result = subprocess.run(
        [script, "--version"], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"stratagem {stratagem.__version__}\n"


def test_module_entry_point_refuses_a_missing_script(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "nope.py", "--lr", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 2
    assert result.stderr == "stratagem run: script 'nope.py' not found\n"
    assert result.stdout == ""
