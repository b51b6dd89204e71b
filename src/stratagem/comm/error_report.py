"""How a process of a job reports the error that ends it: one readable block.

For stratagem's own errors (``StratagemError``: a lost or stuck peer, a rendezvous that failed, a
forged record) the process prints one block instead of a traceback through torch and gloo:

    stratagem: PeerLostError on worker 0 (localhost:2222)
      worker 1 (localhost:2223) was lost during all_reduce of gradients (operation #12) ...
      raised at train.py:41, in step
      (the full traceback: run again with STRATAGEM_DEBUG=1)

Any other error (a bug in the script, most likely) keeps Python's full traceback, as does every
error with ``STRATAGEM_DEBUG=1``. The hook also records that the process is failing, which the
liveness server tells peers as the process ends.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from stratagem.errors import StratagemError

DEBUG_VARIABLE = "STRATAGEM_DEBUG"
_OURS = str(Path(__file__).resolve().parent.parent)  # src/stratagem
# Frames of these are not "the user's code": Python's own library, installed packages (torch).
_NOT_USERS = (_OURS, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])
_state = {"failing": False, "me": ""}
_previous_hook: Any = None
# The live connection's diagnosis of an error that was not one of ours: a collective that failed
# outside stratagem's own operations (DTensor's in a mesh job's own loop, the script's own
# torch.distributed calls) becomes the same named error (a lost or stopped peer); None when the
# error is no transport failure. Set by the communicator while it is connected.
_diagnose: Any = None


def set_diagnosis(diagnose: Any) -> None:
    """``diagnose(error) -> StratagemError | None`` for uncaught errors; None to stop."""
    global _diagnose
    _diagnose = diagnose


def failing() -> bool:
    """Whether an uncaught exception is ending this process."""
    return _state["failing"]


def mark_failing() -> None:
    """This process is ending because of an error its own code caught."""
    _state["failing"] = True


def install(me: str) -> None:
    """Report uncaught errors of this process (``me`` names it) as described above.

    Called before the rendezvous (its errors are ours too) and again after
    ``init_process_group``, whose hook (prefixing each line with ``[rank0]:``) it then drops:
    other errors go to the hook Python had before either of us."""
    global _previous_hook
    _state["me"] = me
    if _previous_hook is None:
        _previous_hook = sys.excepthook
    sys.excepthook = _hook


def _debug() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "").strip() not in ("", "0")


def _hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    _state["failing"] = True
    if not isinstance(error, StratagemError) and _diagnose is not None and not _debug():
        try:
            named = _diagnose(error)
        except Exception:  # a diagnosis that fails must not hide the error itself
            named = None
        if isinstance(named, StratagemError):
            error = named
    if not isinstance(error, StratagemError) or _debug():
        (_previous_hook or sys.__excepthook__)(kind, error, tb)
        return
    sys.stderr.write(block(error, tb, me=_state["me"]))
    sys.stderr.flush()


def block(error: BaseException, tb: TracebackType | None, *, me: str) -> str:
    """The readable report of ``error``: its type, who raised it, its message, and the line of
    the user's code it came through (the last frame outside stratagem and torch)."""
    lines = [f"stratagem: {type(error).__name__} on {me or f'process {os.getpid()}'}"]
    lines += [f"  {line}" for line in str(error).splitlines() or [""]]
    user = [
        f
        for f in traceback.extract_tb(tb)
        if not f.filename.startswith(_NOT_USERS) and "site-packages" not in f.filename
    ]
    if user:
        frame = user[-1]
        lines.append(f"  raised at {Path(frame.filename).name}:{frame.lineno}, in {frame.name}")
    lines.append(f"  (the full traceback: run again with {DEBUG_VARIABLE}=1)")
    return "\n".join(lines) + "\n"
