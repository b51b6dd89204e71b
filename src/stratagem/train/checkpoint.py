"""``Checkpoint``: TensorFlow's object-based checkpoints for modules, optimizers and tensors.

What a checkpoint looks like on disk, and how it is written atomically, is ``storage``; how
saved values are checked against live objects and loaded into them is ``restore``. Only the
chief writes (see ``Checkpoint.write``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from functools import partial
from typing import Any, Protocol, Union, runtime_checkable

import torch

from stratagem.distribute import StrategyExtended, capabilities, strategy_for
from stratagem.errors import CheckpointError, CheckpointMatchError
from stratagem.train import sharded
from stratagem.train.background_writes import (
    BackgroundWrites,
    CheckpointOptions,
    is_async,
    snapshot,
)
from stratagem.train.restore import (
    LoadStatus,
    RestoreReport,
    check_module,
    check_optimizer,
    check_tensor,
    copy_into,
    dtype_name,
    load_into,
)
from stratagem.train.storage import (
    FORMAT,
    FORMAT_VERSION,
    read_checkpoint,
    record_in_index,
    write_atomically,
)
from stratagem.train.tied import tied_names

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointMatchError",
    "CheckpointOptions",
    "LoadStatus",
]

_ACCEPTED = (
    "torch.nn.Module, torch.optim.Optimizer, torch.Tensor, stratagem.train.Checkpoint, "
    "an sg.keras.Model or its optimizer, or an object with state_dict() and load_state_dict() "
    "(LR scheduler, metric, GradScaler)"
)


@runtime_checkable
class SupportsStateDict(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


Trackable = Union[
    torch.nn.Module, torch.optim.Optimizer, torch.Tensor, "Checkpoint", SupportsStateDict
]
PathLike = Union[str, "os.PathLike[str]"]


# Objects of the layers above (a Keras model, a Keras optimizer) that a checkpoint tracks through
# what they hold, as TensorFlow tracks a Keras model's layers and optimizer. Registered by the
# package that defines them (keras), so that this layer needs no import of it.
_STAND_INS: dict[type, Callable[[Any], object]] = {}
_COMPOSITES: dict[type, tuple[Callable[[Any], dict[str, object]], str]] = {}


def register_stand_in(cls: type, stand_in: Callable[[Any], object]) -> None:
    """Track an instance ``x`` of ``cls`` as ``stand_in(x)``, which holds its state (a Keras
    ``BoundOptimizer`` as its ``torch.optim`` optimizer)."""
    _STAND_INS[cls] = stand_in


def register_composite(
    cls: type, children: Callable[[Any], dict[str, object]], primary: str
) -> None:
    """Track an instance ``x`` of ``cls`` as a nested checkpoint of ``children(x)`` (asked anew
    at each save and restore: a Keras model's optimizer appears at ``compile``). ``primary``
    names the child that ``x`` stands for where a checkpoint holds that child alone: a Keras
    model restores from a checkpoint of its module, and a module from a Keras model's."""
    _COMPOSITES[cls] = (children, primary)


def view_of(value: object) -> object:
    """What a checkpoint saves for ``value``: itself; what it stands in for; or, for a
    composite, a ``Checkpoint`` of its children (whose ``primary_name`` says its primary)."""
    for klass in type(value).__mro__:
        if klass in _STAND_INS:
            return view_of(_STAND_INS[klass](value))
        if klass in _COMPOSITES:
            children, primary = _COMPOSITES[klass]
            view = Checkpoint(**children(value))
            view._primary = primary
            return view
    return value


def kind_of(value: object) -> str | None:
    """The kind a trackable is saved as; None when it cannot be tracked."""
    value = view_of(value)
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


class Checkpoint:
    """Groups trackable objects and saves or restores them together (``tf.train.Checkpoint``).

    ``Checkpoint(model=m, optimizer=opt, epoch=torch.tensor(0))``: each value is a module, an
    optimizer, a tensor (restored in place into the same tensor object), a nested
    ``Checkpoint``, or any object with ``state_dict()``/``load_state_dict()``. Trackables are
    attributes (``ckpt.model``); assigning a new attribute tracks one more object, as in TF.
    """

    def __init__(self, **trackables: Trackable) -> None:
        self._trackables: dict[str, Any] = {}
        self._primary: str | None = None  # set on the view of a composite (see view_of)
        # TensorFlow's save counter: numbers the paths of save() and is itself checkpointed.
        self._save_counter = torch.zeros((), dtype=torch.int64)
        self._writes = BackgroundWrites()  # asynchronous saves (CheckpointOptions)
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
        if kind_of(value) is None:
            raise TypeError(
                f"Checkpoint cannot track {name!r}: got {type(value).__module__}."
                f"{type(value).__qualname__}, expected {_ACCEPTED}"
            )
        if isinstance(value, Checkpoint) and (value is self or value._reaches(self)):
            raise ValueError(f"Checkpoint cannot track {name!r}: it would contain itself")
        self._trackables[name] = value

    def _views(self) -> dict[str, Any]:
        """The trackables as they are saved (``view_of``), by name."""
        return {name: view_of(value) for name, value in self._trackables.items()}

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

    def save(self, file_prefix: PathLike, options: CheckpointOptions | None = None) -> str:
        """Increment ``save_counter`` and write to ``f"{file_prefix}-{save_counter}"``.

        Also records the new checkpoint as the latest in the ``checkpoint`` index file of the
        prefix's directory, as TensorFlow does, so ``latest_checkpoint`` finds it. With
        ``options=CheckpointOptions(enable_async=True)`` the write (and the index) happens in
        the background; ``sync()`` waits for it.
        """
        prefix = os.fspath(file_prefix)
        asynchronous = is_async(options)

        def index(written: str) -> None:
            if is_writer(self):
                record_in_index(os.path.dirname(written) or ".", os.path.basename(written))

        written = write_numbered(self, lambda number: f"{prefix}-{number}", asynchronous, index)
        if not asynchronous:
            complete_save(self, "Checkpoint.save")
        return written

    def sync(self) -> None:
        """Wait until this checkpoint's asynchronous saves are written (TF's ``sync``); raises
        the error of one that failed. Collective under a strategy whose processes train in
        step, as a save is: every process calls it, and each returns once the chief's write is
        complete, so any of them can restore it next."""
        self._writes.wait()
        complete_save(self, "Checkpoint.sync")

    def write(self, file_path: PathLike, options: CheckpointOptions | None = None) -> str:
        """Write a checkpoint at exactly ``file_path`` (no counter change); return the path.

        Only the chief writes. Mirrored state is identical on every replica, so the chief's copy
        is the checkpoint; other processes would only race it for the same path. They create the
        parent directory (so code that removes a per-worker temporary directory afterwards, as
        TensorFlow's multi-worker tutorial does, works) and return the same path without
        writing. The exceptions hold state that differs between processes: a checkpoint of
        weights laid out on a mesh (``sg.dtensor``), where every process writes its own shards,
        collectively (``sharded.py``); and a model split into pipeline stages, whose stages
        first bring their layers to every process (a collective hook), so the chief writes the
        whole model.

        Under a strategy whose processes train in step (every one but a parameter server's), a
        save is collective, as TensorFlow's is: every process calls it, and each returns once
        the checkpoint is complete, so any of them can restore it next (``complete_save``).

        Which process is the chief, and what state must be brought home first (a parameter
        server's), is the business of the strategy that distributes the tracked objects
        (``strategy.extended``: ``should_checkpoint``, ``before_checkpoint_write``).
        """
        asynchronous = is_async(options)
        path = self._write(file_path, asynchronous)
        if not asynchronous:
            complete_save(self, "Checkpoint.write")
        return path

    def _write(
        self,
        file_path: PathLike,
        asynchronous: bool = False,
        then: Callable[[str], None] | None = None,
    ) -> str:
        """``write`` without waiting for the other processes: the callers that go on to update
        an index (``then``, run after the write: in the background for an asynchronous one)
        complete the save after it."""
        self._writes.wait()  # one write at a time, and a failed one is reported now
        path, deferred = self._write_now(os.fspath(file_path), asynchronous)
        if deferred is None:
            if then is not None:
                then(path)
            return path

        def write() -> None:
            deferred()
            if then is not None:
                then(path)

        self._writes.start(path, write)
        return path

    def _write_now(self, path: str, asynchronous: bool) -> tuple[str, Callable[[], None] | None]:
        """What every process does of a write now, the chief's file included unless
        ``asynchronous``: then the file write of a copy of the values is returned, to run in
        the background. Returns the path written and that deferred write (or None)."""
        if not os.path.basename(path):
            raise ValueError(f"checkpoint path {path!r} names a directory, expected a file name")
        extended = self._extended()
        for obj in self._objects():
            # Every process: state spread over the workers (each one's input position) is
            # gathered before the chief writes.
            prepare = getattr(obj, "prepare_checkpoint", None)
            if callable(prepare):
                prepare()
        tracked = self._tracked()
        if sharded.holds_dtensors(tracked):
            if asynchronous:
                raise CheckpointError(
                    f"cannot save {path!r} asynchronously: it holds sharded or laid-out weights, "
                    "written collectively through torch.distributed.checkpoint; save it without "
                    "CheckpointOptions(enable_async=True)"
                )
            # Weights laid out on a mesh (sg.dtensor): every process writes its own shards.
            meta = self._meta(extended)
            return sharded.write(tracked, path, meta, self._describe_shards()), None
        # Every process: pipeline stages gather (a collective), a ps's state comes home.
        extended.before_checkpoint_write(self._objects())
        if not extended.should_checkpoint:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            return path, None
        state, described = self._collect()
        meta = {**self._meta(extended), "trackables": described}
        if not asynchronous:
            write_atomically(path, state, meta)
            return path, None
        # Training goes on changing the tensors while the copy is written.
        return path, partial(write_atomically, path, snapshot(state), meta)

    def _extended(self) -> StrategyExtended:
        """The contract of the strategy that distributes what this checkpoint tracks."""
        return strategy_for(self._objects()).extended

    def _meta(self, extended: StrategyExtended) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "save_counter": int(self._save_counter),
            "created": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
            "torch_version": torch.__version__,
            "distribution": extended.describe(),
        }

    def _tracked(self) -> sharded.Tracked:
        """What this checkpoint tracks, as it is saved, for a sharded checkpoint (DCP)."""
        return sharded.Tracked(
            {n: v._tracked() if isinstance(v, Checkpoint) else v for n, v in self._views().items()},
            self._save_counter,
        )

    def _describe_shards(self) -> dict[str, Any]:
        """What a sharded checkpoint's ``meta.json`` says of its trackables (DCP's files hold
        the values)."""
        described: dict[str, Any] = {}
        for name, obj in self._views().items():
            info: dict[str, Any] = {"kind": kind_of(obj), "type": type(obj).__name__}
            if isinstance(obj, Checkpoint):
                info["trackables"] = obj._describe_shards()
            elif isinstance(obj, torch.Tensor):
                info["shape"] = list(obj.shape)
            elif isinstance(obj, torch.nn.Module) and (tied := tied_names(obj)):
                info["tied"] = tied  # written once, under the first name (sharded.py)
            described[name] = info
        return described

    def _collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(what ``state.pt`` holds, what ``meta.json`` says about it), recursively."""
        state: dict[str, Any] = {}
        described: dict[str, Any] = {}
        for name, obj in self._views().items():
            kind = kind_of(obj)
            info: dict[str, Any] = {"kind": kind, "type": type(self._trackables[name]).__name__}
            if isinstance(obj, Checkpoint):
                state[name], info["trackables"] = obj._collect()
                info["save_counter"] = int(obj._save_counter)
                if obj._primary is not None:
                    info["primary"] = obj._primary
            elif isinstance(obj, torch.Tensor):
                # clone: a view would otherwise save its whole underlying storage.
                state[name] = obj.detach().clone()
                info["dtype"] = dtype_name(obj.dtype)
                info["shape"] = list(obj.shape)
                if obj.numel() == 1 and not obj.is_complex():
                    value = obj.item()
                    if value == value and abs(value) != float("inf"):  # JSON has no NaN or inf
                        info["value"] = value
            else:
                state[name] = obj.state_dict()
                if isinstance(obj, torch.nn.Module) and (tied := tied_names(obj)):
                    # torch.save writes the tensor these names share once.
                    info["tied"] = tied
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
        self._writes.wait()  # as TF: a restore waits for this checkpoint's saves under way
        path = os.fspath(save_path)
        meta, state = read_checkpoint(path)  # both from one save, whatever saves run meanwhile
        if meta.get("sharded"):
            # Collective, resharding to the live layouts.
            return sharded.restore(self._tracked(), path, meta)
        apply: list[Callable[[], None]] = []
        report = RestoreReport()
        self._plan(state, meta.get("trackables", {}), path, "", apply, report)
        for step in apply:
            step()
        # Parameter servers: the restored state goes back to the ps.
        self._extended().after_checkpoint_restore(self._objects())
        return LoadStatus(path, report.unused, report.unrestored, report.matched)

    def _objects(self) -> list[object]:
        """Every trackable, nested checkpoints' included."""
        found: list[object] = []
        for obj in self._views().values():
            found.extend(obj._objects() if isinstance(obj, Checkpoint) else [obj])
        return found

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
        report: RestoreReport,
    ) -> None:
        """Check ``state`` against the trackables and queue the in-place restores."""
        if not isinstance(state, Mapping):
            raise CheckpointError(
                f"checkpoint {path!r}: expected a dict of saved trackables at "
                f"{prefix.rstrip('.') or 'the top level'}, found {type(state).__name__}"
            )
        for name, obj in self._views().items():
            full = prefix + name
            if name not in state:
                report.unrestored.append(full)
                continue
            saved = state[name]
            info = described.get(name) or {}
            obj, saved, info = _match_primary(obj, saved, info, full, report)
            kind = kind_of(obj)
            saved_kind = info.get("kind")
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
                nested = info.get("trackables", {})
                obj._plan(saved, nested, path, full + ".", apply, report)
            elif isinstance(obj, torch.Tensor):
                apply.append(partial(copy_into, obj, check_tensor(full, obj, saved, path)))
            elif isinstance(obj, torch.nn.Module):
                check_module(full, obj, saved, path)
                apply.append(partial(load_into, full, obj, saved, path))
            elif isinstance(obj, torch.optim.Optimizer):
                check_optimizer(full, obj, saved, path)
                apply.append(partial(load_into, full, obj, saved, path))
            else:
                apply.append(partial(load_into, full, obj, saved, path))
        report.unused.extend(
            prefix + name
            for name in state
            if name not in self._trackables and name != "save_counter"
        )
        counter = state.get("save_counter")
        if counter is not None:
            counter = check_tensor(prefix + "save_counter", self._save_counter, counter, path)
            apply.append(partial(copy_into, self._save_counter, counter))


def _match_primary(
    live: object, saved: Any, info: Mapping[str, Any], name: str, report: RestoreReport
) -> tuple[object, Any, Mapping[str, Any]]:
    """Pair a composite with a checkpoint of its primary child alone, and the other way round
    (``register_composite``): ``(live object, saved state, its description)`` to match."""
    saved_kind = info.get("kind")
    nested = saved_kind == "checkpoint" or (
        saved_kind is None and isinstance(saved, Mapping) and "save_counter" in saved
    )
    if isinstance(live, Checkpoint) and live._primary is not None and not nested:
        # A Keras model restoring from a checkpoint of its module: the module restores.
        report.unrestored.extend(f"{name}.{n}" for n in live._trackables if n != live._primary)
        return view_of(live._trackables[live._primary]), saved, info
    primary = info.get("primary")
    if (
        not isinstance(live, Checkpoint)
        and saved_kind == "checkpoint"
        and primary is not None
        and isinstance(saved, Mapping)
        and primary in saved
    ):
        # A module restoring from a checkpoint of a Keras model: from the model's module.
        report.unused.extend(f"{name}.{n}" for n in saved if n not in (primary, "save_counter"))
        return live, saved[primary], (info.get("trackables") or {}).get(primary) or {}
    return live, saved, info


def write_numbered(
    checkpoint: Checkpoint,
    path_for: Callable[[int], str],
    asynchronous: bool = False,
    then: Callable[[str], None] | None = None,
) -> str:
    """Advance ``save_counter`` and ``write`` to ``path_for(new count)``, then ``then(path)``;
    return the path. A failed write did not happen: the counter goes back, so the next save
    reuses its number (an asynchronous one's failure is raised later, its number used)."""
    counter = checkpoint.save_counter
    counter.add_(1)
    try:
        return checkpoint._write(path_for(int(counter)), asynchronous, then)
    except BaseException:
        counter.sub_(1)
        raise


def write_recorded(checkpoint: Checkpoint, path: PathLike) -> str:
    """``checkpoint.write(path)``, recorded as the latest in the ``checkpoint`` index of its
    directory (the chief), complete on every process when it returns (``ModelCheckpoint``'s
    save: ``latest_checkpoint`` of the directory finds it on any worker)."""
    written = checkpoint._write(path)
    if is_writer(checkpoint):
        record_in_index(os.path.dirname(written) or ".", os.path.basename(written))
    complete_save(checkpoint, "the save of " + os.path.basename(written))
    return written


def complete_save(checkpoint: Checkpoint, what: str) -> None:
    """The end of a save on every process: wait until the chief has written it (and its
    index), so that a restore of it right after, on any worker, reads it. TensorFlow's save is
    collective under a multi-worker strategy: when every worker has returned from it, the
    checkpoint is complete. Not under a parameter-server strategy (``ChiefCoordination``): its
    chief saves alone while the workers train on (or serve it), so there is nobody to wait for.
    """
    extended = checkpoint._extended()
    if isinstance(extended, capabilities.ChiefCoordination):
        return
    extended.barrier(what)


def is_writer(checkpoint: Checkpoint) -> bool:
    """Whether this process writes ``checkpoint`` (the chief of the strategy of what it
    tracks); the others only read."""
    return checkpoint._extended().should_checkpoint


def say_resumed(extended: StrategyExtended, where: str) -> None:
    """After a restore at a job's start: the chief says where an elastic job resumed when its
    workers changed (what the agent told it, then ``where``); nothing otherwise."""
    change = extended.membership_change
    if change and extended.should_save_summary:
        print(f"{change}: resumed at {where}", flush=True)


def say_restored(checkpoint: Checkpoint, path: str, step: torch.Tensor | None) -> None:
    """``say_resumed`` for a custom loop's restore of ``path`` (its step, where counted)."""
    at = f"step {int(step)} " if step is not None else ""
    say_resumed(checkpoint._extended(), f"{at}from {os.path.basename(path)}")
