"""``stratagem run`` in a terminal: the chief's progress bar is live, as under torchrun.

The launcher runs on the slave side of a pty, as in a user's terminal; the test reads the
master side until the launcher ends (with a timeout per read, no sleeps). Keras's bar is drawn
in place (``\\r``) after every batch only when its output is a terminal: the chief gets one, and
the launcher forwards each redraw with the chief's prefix, so the bar is seen at several step
counts before the epoch ends. Worker 1 writes to a pipe: its lines come whole and prefixed.
"""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from cluster_utils import child_env
from stratagem.cluster.launcher import Console

pytestmark = pytest.mark.multiprocess

STEPS = 40  # an epoch long in steps (each one tiny), so that the bar has many redraws

SCRIPT = f"""
import torch
import stratagem as sg
from keras_utils import compiled
from workers.common import keras_data

strategy = sg.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = compiled()
x, y = keras_data({STEPS} * 8)
model.fit(x, y, batch_size=8, epochs=1, shuffle=False)  # verbose="auto": the bar
model.evaluate(x, y, batch_size=8)
print("worker done", strategy.cluster_resolver.task_id, flush=True)
"""

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
TIMEOUT_S = 240


def _run_in_a_terminal(argv: list[str], cwd) -> tuple[int, str]:
    """Run ``argv`` with a pty for its stdout and stderr; all it wrote, and its exit code."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the launcher did not end in time:\n" + b"".join(chunks).decode()
            ready, _, _ = select.select([master], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the launcher (and all it started) closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return code, b"".join(chunks).decode("utf-8", errors="replace")


def test_the_chief_s_progress_bar_is_live_under_the_launcher(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "train.py"]
    code, output = _run_in_a_terminal(argv, tmp_path)
    assert code == 0, output
    plain = ANSI.sub("", output)
    # Every redraw of worker 0's bar, in order: "\r[worker 0]  7/40 ━━━━..."
    counts = [int(c) for c in re.findall(rf"\r\[worker 0\] +(\d+)/{STEPS} ━", plain)]
    assert STEPS in counts, plain  # a bar drawn in place, to its end
    fit_counts = counts[: counts.index(STEPS) + 1]  # up to the first 40/40: fit's epoch
    before_the_end = set(fit_counts) - {STEPS}
    assert len(before_the_end) >= 3, counts  # the bar advanced within the epoch
    assert fit_counts == sorted(fit_counts), counts
    # evaluate draws its bar too, after fit's
    assert len([c for c in counts[len(fit_counts) :] if c < STEPS]) >= 3, counts
    # The finished lines end with a newline, the bar's last state on the line.
    assert re.search(rf"\[worker 0\] {STEPS}/{STEPS} ━{{20}} \d+s \d+\w+/step - accuracy", plain)
    # Worker 1's output (a pipe) comes in whole lines with its prefix.
    lines = plain.replace("\r", "\n").splitlines()
    assert "[worker 1] worker done 1" in lines, plain
    assert "[worker 0] worker done 0" in lines, plain
    assert "[stratagem] job finished: 2 workers exited 0" in lines, plain


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_printed_while_the_bar_is_drawn_goes_above_it():
    out = _Terminal()
    console = Console(out, out)
    console.task_draw("[worker 0] ", "1/3 ━")
    console.task_line("[worker 1] ", "hello\n")
    console.log("worker 1 exited 0")
    console.task_draw("[worker 0] ", "2/3 ━━")
    console.task_line("[worker 0] ", "3/3 ━━━ done\n")
    console.task_line("[worker 1] ", "bye\n")
    assert out.getvalue() == (
        "\r[worker 0] 1/3 ━\x1b[K"
        "\r\x1b[K[worker 1] hello\n[worker 0] 1/3 ━"  # above the bar, then the bar again
        "\r\x1b[K[stratagem] worker 1 exited 0\n[worker 0] 1/3 ━"
        "\r[worker 0] 2/3 ━━\x1b[K"
        "\r[worker 0] 3/3 ━━━ done\x1b[K\n"  # the bar's own end: its line stays
        "[worker 1] bye\n"
    )
    assert not Console(io.StringIO(), io.StringIO()).is_terminal
