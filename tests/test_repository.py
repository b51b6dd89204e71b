"""The repository keeps its promises: CI runs the README's test command, no machine paths."""

from __future__ import annotations

import subprocess

from cluster_utils import REPO


def _command_in_ci() -> str:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line for line in lines if line.startswith("python3 -m venv")]
    assert len(commands) == 1, commands
    return commands[0]


def test_ci_runs_the_readme_test_command():
    command = _command_in_ci()
    assert "pytest" in command
    assert command in (REPO / "README.md").read_text()


def test_no_absolute_paths_of_a_machine_in_tracked_files():
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    # This checkout's own location first: the path most likely to leak into a file by accident.
    markers = (str(REPO.resolve()), "/work/", "/root/", "/home/", "/tmp/pytest-")
    offenders = []
    for name in files:
        path = REPO / name
        if name == "tests/test_repository.py":  # it names the markers it looks for
            continue
        if not path.is_file() or path.suffix not in {".py", ".md", ".toml", ".txt", ""}:
            continue
        text = path.read_text(errors="replace")
        for marker in markers:
            if marker in text:
                offenders.append(f"{name}: {marker}")
    assert not offenders, offenders
