"""``Checkpoint``: TensorFlow's object-based checkpoints for modules, optimizers and tensors.

One checkpoint is a directory at the path it was saved to::

    <path>/state.pt    one ``torch.save`` of {name: state}, always loaded with ``weights_only=True``
    <path>/meta.json   what the checkpoint holds, readable without torch

It is written into a hidden sibling directory and renamed into place, so a crash mid-save leaves
the previous checkpoint intact and no half-written directory under the final name. Only the chief
writes (see ``Checkpoint.write``). The helpers at the bottom (validity, the ``checkpoint`` index
file, leftovers of interrupted saves) are shared with ``checkpoint_manager``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from functools import partial
from typing import Any, Protocol, Union, runtime_checkable

import torch

from stratagem.comm import current_communicator, distribution_context
from stratagem.errors import StratagemError

__all__ = ["Checkpoint", "CheckpointError", "CheckpointMatchError", "LoadStatus"]

FORMAT = "stratagem.checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "state.pt"
META_FILE = "meta.json"
INDEX_FORMAT = "stratagem.checkpoint_index"
INDEX_VERSION = 1
DEFAULT_INDEX_FILENAME = "checkpoint"  # TensorFlow's name for the same file

# ".<name>.tmp-<pid>-<hex>" is a save in progress, ".<name>.old-<pid>-<hex>" the checkpoint it
# replaces, ".<name>.del-<pid>-<hex>" one being deleted. All are hidden so that scans of a
# directory never mistake them for checkpoints.
_LEFTOVER = re.compile(r"^\.(?P<target>.+)\.(?P<what>tmp|old|del)-(?P<pid>\d+)-[0-9a-f]{8}$")

_ACCEPTED = (
    "torch.nn.Module, torch.optim.Optimizer, torch.Tensor, stratagem.train.Checkpoint, "
    "or an object with state_dict() and load_state_dict() (LR scheduler, metric, GradScaler)"
)


class CheckpointError(StratagemError, ValueError):
    """A checkpoint cannot be written, read, or matched to the objects it should restore."""


class CheckpointMatchError(CheckpointError, AssertionError):
    """A ``LoadStatus`` assertion failed (an AssertionError too, as in TensorFlow)."""


@runtime_checkable
class SupportsStateDict(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


Trackable = Union[
    torch.nn.Module, torch.optim.Optimizer, torch.Tensor, "Checkpoint", SupportsStateDict
]
PathLike = Union[str, "os.PathLike[str]"]


def _kind(value: object) -> str | None:
    """The kind a trackable is saved as; None when it cannot be tracked."""
    if isinstance(value, Checkpoint):
        return "checkpoint"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return "state"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _few(items: list[str], limit: int = 8) -> str:
    """``items`` for an error message, cut after ``limit`` entries."""
    shown = ", ".join(repr(i) for i in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class Checkpoint:
    """Groups trackable objects and saves or restores them together (``tf.train.Checkpoint``).

    ``Checkpoint(model=m, optimizer=opt, epoch=torch.tensor(0))``: each value is a module, an
    optimizer, a tensor (restored in place into the same tensor object), a nested
    ``Checkpoint``, or any object with ``state_dict()``/``load_state_dict()``. Trackables are
    attributes (``ckpt.model``); assigning a new attribute tracks one more object, as in TF.
    """

    def __init__(self, **trackables: Trackable) -> None:
        self._trackables: dict[str, Any] = {}
        # TensorFlow's save counter: numbers the paths of save() and is itself checkpointed.
        self._save_counter = torch.zeros((), dtype=torch.int64)
        for name, value in trackables.items():
            self._track(name, value)

    # --- trackables -----------------------------------------------------------------------

    def _track(self, name: str, value: object) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            raise ValueError(
                f"Checkpoint cannot track an object under the name {name!r}: names starting with "
                f"'_' and the names of Checkpoint's own attributes (save, write, restore, read, "
                f"save_counter) are reserved; choose another keyword"
            )
        if _kind(value) is None:
            raise TypeError(
                f"Checkpoint cannot track {name!r}: got {type(value).__module__}."
                f"{type(value).__qualname__}, expected {_ACCEPTED}"
            )
        if isinstance(value, Checkpoint) and (value is self or value._reaches(self)):
            raise ValueError(f"Checkpoint cannot track {name!r}: it would contain itself")
        self._trackables[name] = value

    def _reaches(self, other: Checkpoint) -> bool:
        return any(
            v is other or (isinstance(v, Checkpoint) and v._reaches(other))
            for v in self._trackables.values()
        )

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, i.e. for trackables.
        if not name.startswith("_"):
            trackables = self.__dict__.get("_trackables", {})
            if name in trackables:
                return trackables[name]
            raise AttributeError(
                f"Checkpoint has no trackable {name!r}; it tracks {sorted(trackables)}"
            )
        raise AttributeError(name)

    def __setattr__(self, name: str, value: object) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            self._track(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._trackables))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={type(v).__name__}" for k, v in self._trackables.items())
        return f"Checkpoint({inner})"

    @property
    def save_counter(self) -> torch.Tensor:
        """0-d int64 tensor: how many times ``save`` was called (restored with the checkpoint)."""
        return self._save_counter

    # --- saving ---------------------------------------------------------------------------

    def save(self, file_prefix: PathLike) -> str:
        """Increment ``save_counter`` and write to ``f"{file_prefix}-{save_counter}"``.

        Also records the new checkpoint as the latest in the ``checkpoint`` index file of the
        prefix's directory, as TensorFlow does, so ``latest_checkpoint`` finds it.
        """
        number = self._advance_counter()
        path = f"{os.fspath(file_prefix)}-{number}"
        try:
            written = self.write(path)
        except BaseException:
            self._rewind_counter()
            raise
        if current_communicator().is_chief:
            record_in_index(os.path.dirname(path) or ".", os.path.basename(path))
        return written

    def write(self, file_path: PathLike) -> str:
        """Write a checkpoint at exactly ``file_path`` (no counter change); return the path.

        Only the chief writes. Mirrored state is identical on every replica, so the chief's copy
        is the checkpoint; other processes would only race it for the same path. They create the
        parent directory (so code that removes a per-worker temporary directory afterwards, as
        TensorFlow's multi-worker tutorial does, works) and return the same path without
        writing or waiting for anyone: a save is never a synchronisation point.
        """
        path = os.fspath(file_path)
        if not os.path.basename(path):
            raise ValueError(f"checkpoint path {path!r} names a directory, expected a file name")
        if not current_communicator().is_chief:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            return path
        state, described = self._collect()
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "save_counter": int(self._save_counter),
            "created": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
            "torch_version": torch.__version__,
            "distribution": distribution_context(),
            "trackables": described,
        }
        _write_atomically(path, state, meta)
        return path

    def _advance_counter(self) -> int:
        self._save_counter.add_(1)
        return int(self._save_counter)

    def _rewind_counter(self) -> None:
        # A failed save did not happen: the next one reuses its number.
        self._save_counter.sub_(1)

    def _collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(what ``state.pt`` holds, what ``meta.json`` says about it), recursively."""
        state: dict[str, Any] = {}
        described: dict[str, Any] = {}
        for name, obj in self._trackables.items():
            kind = _kind(obj)
            info: dict[str, Any] = {"kind": kind, "type": type(obj).__name__}
            if isinstance(obj, Checkpoint):
                state[name], info["trackables"] = obj._collect()
                info["save_counter"] = int(obj._save_counter)
            elif isinstance(obj, torch.Tensor):
                # clone: a view would otherwise save its whole underlying storage.
                state[name] = obj.detach().clone()
                info["dtype"] = _dtype_name(obj.dtype)
                info["shape"] = list(obj.shape)
                if obj.numel() == 1 and not obj.is_complex():
                    value = obj.item()
                    if value == value and abs(value) != float("inf"):  # JSON has no NaN or inf
                        info["value"] = value
            else:
                state[name] = obj.state_dict()
            described[name] = info
        state["save_counter"] = self._save_counter.clone()
        return state, described

    # --- restoring ------------------------------------------------------------------------

    def restore(self, save_path: PathLike | None) -> LoadStatus:
        """Restore every trackable in place from the checkpoint at ``save_path``.

        Everything is checked before anything is changed (names, kinds, shapes, dtypes,
        parameter groups), so a mismatch raises ``CheckpointError`` and leaves the objects as
        they were. Saved values without a trackable, and trackables absent from the file, are
        reported by the returned ``LoadStatus`` (``assert_consumed``), as in TensorFlow.
        ``restore(None)`` restores nothing (TF allows it, for code that starts fresh).
        """
        if save_path is None:
            return LoadStatus(None)
        path = os.fspath(save_path)
        meta = read_meta(path)
        state = _load_state(path)
        apply: list[Callable[[], None]] = []
        report = _Report()
        self._plan(state, meta.get("trackables", {}), path, "", apply, report)
        for step in apply:
            step()
        return LoadStatus(path, report.unused, report.unrestored, report.matched)

    def read(self, save_path: PathLike | None) -> LoadStatus:
        """The counterpart of ``write``: the same as ``restore``."""
        return self.restore(save_path)

    def _plan(
        self,
        state: Mapping[str, Any],
        described: Mapping[str, Any],
        path: str,
        prefix: str,
        apply: list[Callable[[], None]],
        report: _Report,
    ) -> None:
        """Check ``state`` against the trackables and queue the in-place restores."""
        if not isinstance(state, Mapping):
            raise CheckpointError(
                f"checkpoint {path!r}: expected a dict of saved trackables at "
                f"{prefix.rstrip('.') or 'the top level'}, found {type(state).__name__}"
            )
        for name, obj in self._trackables.items():
            full = prefix + name
            if name not in state:
                report.unrestored.append(full)
                continue
            saved = state[name]
            kind = _kind(obj)
            saved_kind = (described.get(name) or {}).get("kind")
            if saved_kind is None:  # undescribed: a tensor can still be told from a dict
                is_tensor = isinstance(saved, torch.Tensor)
                if is_tensor == (kind == "tensor"):
                    saved_kind = kind
                else:
                    saved_kind = "tensor" if is_tensor else "state_dict"
            if saved_kind != kind:
                raise CheckpointError(
                    f"cannot restore {full!r} from {path!r}: it was saved as a {saved_kind} but "
                    f"is tracked as a {kind} ({type(obj).__name__})"
                )
            report.matched += 1
            if isinstance(obj, Checkpoint):
                nested = (described.get(name) or {}).get("trackables", {})
                obj._plan(saved, nested, path, full + ".", apply, report)
            elif isinstance(obj, torch.Tensor):
                apply.append(partial(_copy_into, obj, _check_tensor(full, obj, saved, path)))
            elif isinstance(obj, torch.nn.Module):
                _check_module(full, obj, saved, path)
                apply.append(partial(_load_into, full, obj, saved, path))
            elif isinstance(obj, torch.optim.Optimizer):
                _check_optimizer(full, obj, saved, path)
                apply.append(partial(_load_into, full, obj, saved, path))
            else:
                apply.append(partial(_load_into, full, obj, saved, path))
        report.unused.extend(
            prefix + name
            for name in state
            if name not in self._trackables and name != "save_counter"
        )
        counter = state.get("save_counter")
        if counter is not None:
            counter = _check_tensor(prefix + "save_counter", self._save_counter, counter, path)
            apply.append(partial(_copy_into, self._save_counter, counter))


class _Report:
    def __init__(self) -> None:
        self.unused: list[str] = []
        self.unrestored: list[str] = []
        self.matched = 0


def _check_tensor(name: str, target: torch.Tensor, saved: object, path: str) -> torch.Tensor:
    if not isinstance(saved, torch.Tensor):
        raise CheckpointError(
            f"cannot restore tensor {name!r} from {path!r}: saved value is a "
            f"{type(saved).__name__}, expected a tensor"
        )
    if saved.shape != target.shape or saved.dtype != target.dtype:
        raise CheckpointError(
            f"cannot restore tensor {name!r} from {path!r}: saved shape {list(saved.shape)} "
            f"dtype {_dtype_name(saved.dtype)}, tracked tensor has shape {list(target.shape)} "
            f"dtype {_dtype_name(target.dtype)}"
        )
    return saved


def _copy_into(target: torch.Tensor, saved: torch.Tensor) -> None:
    # In place, so every reference the program holds (a loop's `epoch`) sees the restored value.
    with torch.no_grad():
        target.copy_(saved)


def _check_module(name: str, module: torch.nn.Module, saved: object, path: str) -> None:
    if not isinstance(saved, Mapping):
        raise CheckpointError(
            f"cannot restore module {name!r} from {path!r}: saved value is a "
            f"{type(saved).__name__}, expected a state_dict"
        )
    current = module.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing or unexpected:
        raise CheckpointError(
            f"cannot restore module {name!r} ({type(module).__name__}) from {path!r}: "
            f"missing keys [{_few(missing)}], unexpected keys [{_few(unexpected)}]"
        )
    wrong = [
        f"{k}: saved {list(saved[k].shape)}, module has {list(v.shape)}"
        for k, v in current.items()
        if isinstance(v, torch.Tensor)
        and isinstance(saved[k], torch.Tensor)
        and saved[k].shape != v.shape
    ]
    if wrong:
        raise CheckpointError(
            f"cannot restore module {name!r} ({type(module).__name__}) from {path!r}: "
            f"shape mismatch for {'; '.join(wrong)}"
        )


def _check_optimizer(name: str, opt: torch.optim.Optimizer, saved: object, path: str) -> None:
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= set(saved):
        raise CheckpointError(
            f"cannot restore optimizer {name!r} from {path!r}: expected an optimizer state_dict "
            f"with 'state' and 'param_groups', found {type(saved).__name__}"
        )
    have = [len(g["params"]) for g in opt.param_groups]
    got = [len(g.get("params", ())) for g in saved["param_groups"]]
    if have != got:
        raise CheckpointError(
            f"cannot restore optimizer {name!r} ({type(opt).__name__}) from {path!r}: saved "
            f"parameter groups hold {got} parameters, the optimizer's hold {have}"
        )


def _load_into(name: str, obj: Any, saved: Any, path: str) -> None:
    try:
        obj.load_state_dict(saved)
    except Exception as e:
        raise CheckpointError(
            f"cannot restore {name!r} ({type(obj).__name__}) from {path!r}: {e}"
        ) from e


class LoadStatus:
    """What a restore matched; TensorFlow's ``CheckpointLoadStatus``.

    ``unused`` names saved values no trackable took, ``unrestored`` trackables the file did not
    have (nested ones as ``outer.inner``). Unless ``expect_partial()`` or an assertion was
    called, a status with either is reported by a warning when it is discarded, as in TF.
    """

    def __init__(
        self,
        save_path: str | None,
        unused: list[str] | None = None,
        unrestored: list[str] | None = None,
        matched: int = 0,
    ) -> None:
        self.save_path = save_path
        self.unused: tuple[str, ...] = tuple(unused or ())
        self.unrestored: tuple[str, ...] = tuple(unrestored or ())
        self.matched = matched
        self._checked = False

    def _nothing(self) -> CheckpointMatchError:
        return CheckpointMatchError(
            "no checkpoint was given (save_path=None); nothing was restored"
        )

    def assert_consumed(self) -> LoadStatus:
        """Raise unless every saved value was restored and every trackable was in the file."""
        self._checked = True
        if self.save_path is None:
            raise self._nothing()
        if self.unused or self.unrestored:
            raise CheckpointMatchError(
                f"checkpoint {self.save_path!r} and the trackables differ: saved values without "
                f"a trackable [{_few(list(self.unused))}], trackables not in the checkpoint "
                f"[{_few(list(self.unrestored))}]"
            )
        return self

    def assert_existing_objects_matched(self) -> LoadStatus:
        """Raise unless every trackable was in the file (extra saved values are allowed)."""
        self._checked = True
        if self.save_path is None:
            raise self._nothing()
        if self.unrestored:
            raise CheckpointMatchError(
                f"checkpoint {self.save_path!r} has no value for the trackables "
                f"[{_few(list(self.unrestored))}]"
            )
        return self

    def assert_nontrivial_match(self) -> LoadStatus:
        """Raise unless at least one trackable was restored."""
        self._checked = True
        if self.save_path is None:
            raise self._nothing()
        if self.matched == 0:
            raise CheckpointMatchError(
                f"checkpoint {self.save_path!r} matched none of the trackables "
                f"(missing: [{_few(list(self.unrestored))}])"
            )
        return self

    def expect_partial(self) -> LoadStatus:
        """Declare a partial match intended: no warning about unmatched values."""
        self._checked = True
        return self

    def __del__(self) -> None:
        if self._checked or not (self.unused or self.unrestored):
            return
        try:
            warnings.warn(
                f"restoring {self.save_path!r} left saved values unused "
                f"[{_few(list(self.unused))}] and trackables unrestored "
                f"[{_few(list(self.unrestored))}]; call expect_partial() on the status if "
                f"that is intended",
                stacklevel=2,
            )
        except Exception:  # interpreter shutdown: nowhere left to warn
            pass


# --- on-disk helpers (shared with checkpoint_manager) ---------------------------------------


def read_meta(path: str) -> dict[str, Any]:
    """The parsed ``meta.json`` of the checkpoint at ``path``; a CheckpointError says why not."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}; use latest_checkpoint(directory) to find the newest one"
        )
    expected = f"expected a directory holding {META_FILE} and {STATE_FILE} written by stratagem"
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a stratagem checkpoint: it is a file, {expected}")
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path!r} is not a stratagem checkpoint: it has no {META_FILE}; {expected} "
            f"(a directory of checkpoints? use latest_checkpoint({path!r}))"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path!r} is unreadable ({e}); {expected}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"{path!r} is not a stratagem checkpoint: {META_FILE} has format {found!r}, "
            f"expected {FORMAT!r}"
        )
    version = meta.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path!r} has format version {version!r}; this stratagem reads "
            f"versions up to {FORMAT_VERSION}"
        )
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise CheckpointError(f"checkpoint {path!r} has no {STATE_FILE}; {expected}")
    return meta


def _load_state(path: str) -> Any:
    state_path = os.path.join(path, STATE_FILE)
    try:
        # weights_only: a checkpoint is data; unpickling arbitrary objects would run code.
        # map_location: restores copy into the trackables' own devices, wherever they are.
        return torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot load {state_path!r} with torch.load(weights_only=True): {e}"
        ) from e


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete stratagem checkpoint directory."""
    try:
        read_meta(path)
    except (OSError, CheckpointError):
        return False
    return True


def _fsync_dir(path: str) -> None:
    # Makes renames and new entries durable; not possible on every platform (Windows).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def hidden_sibling(path: str, what: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _write_atomically(path: str, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write a checkpoint directory at ``path`` so that readers see the old one or the new one."""
    path = os.path.normpath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.lexists(path) and not (
        is_checkpoint(path) or (os.path.isdir(path) and not os.listdir(path))
    ):
        raise CheckpointError(
            f"refusing to overwrite {path!r}: it exists and is not a stratagem checkpoint; "
            f"expected a free path, an empty directory or an earlier checkpoint"
        )
    tmp = hidden_sibling(path, "tmp")
    old: str | None = None
    os.mkdir(tmp)
    try:
        state_path = os.path.join(tmp, STATE_FILE)
        with open(state_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        # Refuse now what restore would refuse later, when it is too late to fix.
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(state_path)
        if unsafe:
            raise CheckpointError(
                f"cannot save {path!r}: the state holds objects that torch.load(weights_only="
                f"True) refuses: {sorted(unsafe)}; keep state_dicts to tensors and plain Python "
                f"values, or allow them with torch.serialization.add_safe_globals"
            )
        # default=str: a strategy may record values JSON lacks (a torch.device); text will do.
        _write_file(os.path.join(tmp, META_FILE), json.dumps(meta, indent=2, default=str) + "\n")
        _fsync_dir(tmp)
        if os.path.lexists(path):
            old = hidden_sibling(path, "old")
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(os.path.dirname(path) or ".")
    except BaseException:
        if old is not None and not os.path.lexists(path):
            os.rename(old, path)  # put the previous checkpoint back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_file(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def leftover(name: str) -> tuple[str, str, int] | None:
    """(target name, "tmp", "old" or "del", pid) when ``name`` is left by an interrupted write."""
    m = _LEFTOVER.match(name)
    return (m["target"], m["what"], int(m["pid"])) if m else None


# --- the index file: ``<directory>/checkpoint``, JSON -------------------------------------


def read_index(directory: str, filename: str = DEFAULT_INDEX_FILENAME) -> dict[str, Any] | None:
    """The index of ``directory``; None when absent or not ours (a TensorFlow text file, say)."""
    try:
        with open(os.path.join(directory, filename), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        return None
    entries = index.get("checkpoints")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries
    ):
        return None
    return index


def write_index(
    directory: str,
    entries: list[tuple[str, float]],
    latest: str | None,
    last_preserved_time: float | None = None,
    filename: str = DEFAULT_INDEX_FILENAME,
) -> None:
    """Replace the index atomically: names are relative to ``directory``, oldest first."""
    index = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "latest": latest,
        "checkpoints": [{"name": n, "time": t} for n, t in entries],
        "last_preserved_time": last_preserved_time,
    }
    target = os.path.join(directory, filename)
    tmp = hidden_sibling(target, "tmp")
    try:
        _write_file(tmp, json.dumps(index, indent=2) + "\n")
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def record_in_index(directory: str, name: str, when: float | None = None) -> None:
    """Make ``name`` the latest checkpoint of ``directory``'s index, keeping the other entries."""
    index = read_index(directory) or {}
    entries = [
        (e["name"], float(e.get("time") or 0.0))
        for e in index.get("checkpoints", [])
        if e["name"] != name
    ]
    entries.append((name, time.time() if when is None else when))
    write_index(directory, entries, name, index.get("last_preserved_time"))
