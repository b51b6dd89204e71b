"""Sharded checkpoints: ``Checkpoint`` state that holds DTensors goes through DCP.

When a tracked module, optimizer or tensor holds a DTensor (a weight laid out by ``sg.dtensor``
or sharded), ``Checkpoint.write`` hands the whole state to ``torch.distributed.checkpoint``:
every process writes only its own shards, with each tensor's global shape, so ``restore`` on
another mesh (another number of processes, other layouts) reads the slices each shard needs.
Modules and optimizers go through DCP's ``get_/set_model_state_dict`` and
``get_/set_optimizer_state_dict`` (optimizer state keyed by parameter path), so an optimizer is
saved with a module of the same checkpoint that owns its parameters. A tied tensor is written
once (``tied.py``) and restored into every name of it. On disk: ``meta.json``
(``"sharded": true``), DCP's ``.metadata`` and ``__<rank>_0.distcp`` files, written into a
hidden sibling that process 0 swaps into place once every process has written its part. Saving
and restoring are collective: every process calls them.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stratagem.comm import plain_data
from stratagem.comm.dtensor_check import is_dtensor
from stratagem.distribute import tensors_of
from stratagem.errors import CheckpointError
from stratagem.train.atomic_dir import publish
from stratagem.train.manifest import MANIFEST_FILE, write_manifest
from stratagem.train.restore import LoadStatus, copy_into
from stratagem.train.storage import hidden_sibling, is_checkpoint, write_file
from stratagem.train.tied import tied_names, with_aliases, without_aliases


@dataclass(frozen=True)
class Tracked:
    """What a checkpoint tracks, as it is saved, handed in by ``Checkpoint`` (which sits above
    this module): each object by name (``checkpoint.view_of``: a Keras model as a nested
    checkpoint of its module and optimizer), a nested checkpoint as a ``Tracked`` of its own;
    and the checkpoint's save counter, which DCP writes and restores in place."""

    objects: dict[str, Any]
    save_counter: torch.Tensor


def _trackables(tracked: Tracked) -> Iterator[tuple[str, Any]]:
    """Every trackable, nested checkpoints flattened, with dotted names."""
    for name, obj in tracked.objects.items():
        if isinstance(obj, Tracked):
            for inner, value in _trackables(obj):
                yield f"{name}.{inner}", value
        else:
            yield name, obj


def holds_dtensors(tracked: Tracked) -> bool:
    """Whether any trackable holds a DTensor, which makes the checkpoint a sharded one."""
    return any(is_dtensor(t) for _, obj in _trackables(tracked) for t in tensors_of(obj))


def _owner(optimizer: torch.optim.Optimizer, root: Tracked, name: str) -> torch.nn.Module:
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for _, obj in _trackables(root):
        if isinstance(obj, torch.nn.Module) and params <= {id(p) for p in obj.parameters()}:
            return obj
    raise CheckpointError(
        f"cannot checkpoint optimizer {name!r} with sharded parameters: no module tracked by the "
        "same Checkpoint owns all its parameters; track the model too (Checkpoint(model=..., "
        "optimizer=...)) so that its state is saved by parameter path"
    )


def _state(tracked: Tracked, root: Tracked) -> dict[str, Any]:
    """The DCP state dict of ``tracked``: tensors (shards included) where the values live."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {}
    for name, obj in tracked.objects.items():
        if isinstance(obj, Tracked):
            state[name] = _state(obj, root)
        elif isinstance(obj, torch.nn.Module):
            # A tied tensor once, under its first name (DCP would write it under each).
            whole = get_model_state_dict(obj)
            state[name] = without_aliases(whole, _ties(obj, whole))
        elif isinstance(obj, torch.optim.Optimizer):
            state[name] = get_optimizer_state_dict(_owner(obj, root, name), obj)
        elif isinstance(obj, torch.Tensor):
            state[name] = obj
        else:
            state[name] = _tensors_only(obj.state_dict(), name)
    state["save_counter"] = tracked.save_counter
    return state


_PLAIN = "__plain_data__"


def _tensors_only(state: Any, name: str) -> Any:
    """A trackable's state as DCP writes it without a pickle: as it is when it holds only
    tensors (in dicts); else (an iterator's position: numbers, strings, lists) one uint8 tensor
    of its plain-data frame (``comm.plain_data``), which a restore reads as a tensor and
    decodes without unpickling anything."""
    if _all_tensors(state):
        return state
    frame = plain_data.encode(state, what=f"the state of {name!r}")
    return {_PLAIN: torch.frombuffer(bytearray(frame), dtype=torch.uint8)}


def _all_tensors(state: Any) -> bool:
    if isinstance(state, dict):
        return all(isinstance(k, str) and _all_tensors(v) for k, v in state.items())
    return isinstance(state, torch.Tensor)


def _from_tensors_only(value: Any, name: str, path: str) -> Any:
    if isinstance(value, dict) and set(value) == {_PLAIN}:
        frame = value[_PLAIN].numpy().tobytes()
        return plain_data.decode(
            frame, sender=f"checkpoint {path!r}", what=f"the state of {name!r}"
        )
    return value


def _ties(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, str]:
    """The tied names of ``module`` (``{alias: first name}``) whose first name ``state`` has."""
    return {alias: name for alias, name in tied_names(module).items() if name in state}


def _load(
    tracked: Tracked, root: Tracked, state: dict[str, Any], saved: dict[str, Any], path: str
) -> None:
    """Put the values DCP loaded into ``state`` back into the trackables."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for name, obj in tracked.objects.items():
        if name not in saved:
            continue
        value = state[name]
        if isinstance(obj, Tracked):
            _load(obj, root, value, saved[name].get("trackables", {}), path)
        elif isinstance(obj, torch.nn.Module):
            # Each tied name gets the value read once for the tensor they share.
            set_model_state_dict(obj, with_aliases(value, _ties(obj, value), f"module {name!r}"))
        elif isinstance(obj, torch.optim.Optimizer):
            set_optimizer_state_dict(_owner(obj, root, name), obj, value)
        elif isinstance(obj, torch.Tensor):
            if value is not obj:
                copy_into(obj, value)
        else:
            obj.load_state_dict(_from_tensors_only(value, name, path))


def _from_process_0(value: Any, *, what: str) -> Any:
    """Process 0's ``value`` on every process, as plain data (``comm.plain_data``): never a
    pickle, which ``dist.broadcast_object_list`` would unpickle from whoever is process 0."""
    rank = dist.get_rank()
    # NCCL moves only CUDA tensors; gloo, CPU ones.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    frame = plain_data.encode(value, what=what) if rank == 0 else b""
    size = torch.tensor([len(frame)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    plain_data.check_announced_size(n, sender="process 0", what=what)
    if rank == 0:
        buffer = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0)
    if rank == 0:
        return value
    return plain_data.decode(buffer.cpu().numpy().tobytes(), sender="process 0", what=what)


def write(tracked: Tracked, path: str, meta: dict[str, Any], described: dict[str, Any]) -> str:
    """Every process writes its shards; process 0 adds ``meta.json`` (``meta``, and
    ``described``, what the checkpoint says of its trackables) and renames into place."""
    import json

    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        raise CheckpointError(f"cannot write sharded checkpoint {path!r}: no process group runs")
    path = os.path.normpath(path)
    rank = dist.get_rank()
    problem = None
    occupied = os.path.lexists(path) and not is_checkpoint(path)
    if rank == 0 and occupied and not (os.path.isdir(path) and not os.listdir(path)):
        problem = (
            f"refusing to overwrite {path!r}: it exists and is not a stratagem checkpoint; "
            "expected a free path, an empty directory or an earlier checkpoint"
        )
    tmp = _from_process_0(
        (problem, hidden_sibling(path, "tmp") if rank == 0 else None),
        what=f"the staging directory of sharded checkpoint {path!r}",
    )
    if tmp[0]:
        raise CheckpointError(tmp[0])
    tmp = tmp[1]
    state = _state(tracked, tracked)
    dcp.save(state, checkpoint_id=tmp)  # collective: returns once every process has written
    problem = None
    if rank == 0:
        try:
            meta = {**meta, "sharded": True, "trackables": described}
            meta["checksums"] = MANIFEST_FILE
            text = json.dumps(meta, indent=2, default=str) + "\n"
            write_file(os.path.join(tmp, "meta.json"), text)
            write_manifest(tmp, os.listdir(tmp))  # every process's shards are written by now
            publish(tmp, path)  # in one step, replacing an earlier checkpoint (atomic_dir)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            problem = f"cannot write sharded checkpoint {path!r}: {e}"
    # Everyone returns once the checkpoint is in place.
    problem = _from_process_0(problem, what=f"the outcome of sharded checkpoint {path!r}")
    if problem:
        raise CheckpointError(problem)
    return path


def restore(tracked: Tracked, path: str, meta: dict[str, Any]) -> LoadStatus:
    """Load every trackable the checkpoint holds, resharded to the live layouts."""
    # Imported here, not at the top: DCP pulls in FSDP and DTensor (about 1 s of CPU per
    # process), which a job that never reads a sharded checkpoint should not pay at its start.
    import torch.distributed.checkpoint as dcp

    from stratagem.train.dcp_reader import SafeLoadPlanner, SafeReader, read_dcp_metadata

    saved = meta.get("trackables", {})
    metadata = read_dcp_metadata(path)  # refuses what would run code, naming it
    state = _state(tracked, tracked)
    _expect_saved_entries(tracked, state, metadata, ())
    wanted = {
        name: value for name, value in state.items() if name in saved or name == "save_counter"
    }
    _expect_saved_shapes(wanted, metadata, path)
    try:
        # Never DCP's own reader and planner: they unpickle (dcp_reader).
        dcp.load(wanted, storage_reader=SafeReader(path, metadata), planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        unsafe = _unsafe_cause(e)
        if unsafe is not None:
            raise unsafe from e
        raise CheckpointError(f"cannot restore sharded checkpoint {path!r}: {e}") from e
    _load(tracked, tracked, state, saved, path)
    unrestored = [name for name in tracked.objects if name not in saved]
    unused = [name for name in saved if name not in tracked.objects]
    return LoadStatus(path, unused, unrestored, len(saved) - len(unused))


def _expect_saved_entries(
    tracked: Tracked, state: dict[str, Any], metadata: Any, prefix: tuple[str, ...]
) -> None:
    """Give each trackable that is no module, optimizer or tensor (its ``state_dict`` has the
    keys it has now, perhaps none yet: a fresh BackupAndRestore's progress) the tensor entries
    the checkpoint saved for it, as empty tensors of their saved shapes for DCP to fill."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = metadata.planner_data or {}
    for name, obj in tracked.objects.items():
        if isinstance(obj, Tracked):
            _expect_saved_entries(obj, state[name], metadata, (*prefix, name))
            continue
        if isinstance(obj, torch.nn.Module | torch.optim.Optimizer | torch.Tensor):
            continue
        here = (*prefix, name)
        expected: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            path = tuple(paths.get(key, key.split(".")))
            if path[: len(here)] != here or len(path) == len(here):
                continue
            if not isinstance(md, TensorStorageMetadata):
                continue  # only tensors are read back (dcp_reader: nothing is unpickled)
            node = expected
            for part in path[len(here) : -1]:
                node = node.setdefault(str(part), {})
            node[str(path[-1])] = torch.empty(md.size, dtype=md.properties.dtype)
        if expected:
            live = state[name]
            state[name] = {**live, **expected} if isinstance(live, dict) else expected


def _expect_saved_shapes(state: dict[str, Any], metadata: Any, path: str) -> None:
    """Refuse, by name, tensors the checkpoint lacks or saved with another global shape (a
    model with other layers or widths): DCP reshards to any mesh and layout, but not to another
    model, and would fail inside its planner on every process with its own traceback."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = metadata.planner_data or {}
    saved = {
        tuple(str(part) for part in paths.get(key, key.split("."))): md
        for key, md in metadata.state_dict_metadata.items()
    }
    differ, missing = [], []
    for where, tensor in _flat_tensors(state, ()):
        name, md = ".".join(where), saved.get(where)
        if md is None:
            # (A value saved whole above this one, such as a list, is DCP's to match.)
            if not any(where[:i] in saved for i in range(1, len(where))):
                missing.append(name)
        elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(tensor.shape):
            differ.append(f"{name}: saved {list(md.size)}, here {list(tensor.shape)}")
    problems = []
    if differ:
        problems.append(
            f"{len(differ)} tensor(s) have another global shape than saved ({_some(differ)})"
        )
    if missing:
        problems.append(f"{len(missing)} tensor(s) are not in it ({_some(missing)})")
    if problems:
        raise CheckpointError(
            f"cannot restore sharded checkpoint {path!r}: {'; and '.join(problems)}; a sharded "
            "checkpoint restores on any mesh and layouts, into objects of the saved shapes (the "
            "same model)"
        )


def _some(items: list[str]) -> str:
    return "; ".join(items[:6]) + ("; ..." if len(items) > 6 else "")


def _flat_tensors(state: Any, where: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Each tensor of a nested state with its path (DCP's, before it joins it with dots)."""
    if isinstance(state, torch.Tensor):
        yield where, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _flat_tensors(value, (*where, str(key)))
    elif isinstance(state, list | tuple):
        for i, value in enumerate(state):
            yield from _flat_tensors(value, (*where, str(i)))


def _unsafe_cause(error: BaseException) -> CheckpointError | None:
    """The CheckpointError (a refusal of dcp_reader) that DCP wrapped in its own exception,
    which keeps each process's failure in ``failures``."""
    for failure in getattr(error, "failures", {}).values():
        if isinstance(failure, CheckpointError):
            return failure
        if isinstance(failure, tuple) and failure and isinstance(failure[0], CheckpointError):
            return failure[0]
    cause = error.__cause__ or error.__context__
    return cause if isinstance(cause, CheckpointError) else None


def whole_module(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with whole tensors: itself, or a copy whose DTensor weights (a mesh's shards)
    are gathered, which every process must ask for. The copy exports as a plain module."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in fsdp:
        unit.reshard()  # local: a unit still gathered (after an eval forward) holds its shards
    if not any(is_dtensor(t) for t in [*module.parameters(), *module.buffers()]):
        return module
    plain = _without_fsdp(module, {}) if fsdp else copy.deepcopy(module)
    # One whole parameter per sharded one, by identity: a tied parameter (two names, one
    # tensor) is gathered once and stays one parameter under both names.
    # (The shard is kept beside its whole copy so that its id is not reused meanwhile.)
    gathered: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}
    for submodule in plain.modules():  # the same order on every process: one gather each
        for name, p in list(submodule._parameters.items()):
            if is_dtensor(p):
                if id(p) not in gathered:
                    whole = torch.nn.Parameter(p.detach().full_tensor(), p.requires_grad)
                    gathered[id(p)] = (p, whole)
                submodule._parameters[name] = gathered[id(p)][1]
        for name, b in list(submodule._buffers.items()):
            if is_dtensor(b):
                submodule._buffers[name] = b.full_tensor()
    return plain


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


def _without_fsdp(module: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    """A copy of a module sharded by FSDP2's ``fully_shard`` as the plain class it was
    (``FSDPLinear`` → ``Linear``), without FSDP's state and forward hooks: FSDP refuses
    ``copy.deepcopy``. Its parameters are still the shards; ``whole_module`` gathers them."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    state = fully_shard.state(module) if isinstance(module, FSDPModule) else None
    plain = cls.__new__(cls)
    for key, value in module.__dict__.items():
        if key.startswith("__composable_api_state_key"):  # FSDP's state and registry
            continue
        if key == "_modules":
            value = {n: None if m is None else _without_fsdp(m, memo) for n, m in value.items()}
        elif key in ("_parameters", "_buffers"):
            # The same tensors, read only: whole_module replaces the shards by whole copies.
            value = dict(value)
        elif state is not None and key in _HOOK_DICTS:
            value = copy.copy(value)
            for hook_id, hook in list(value.items()):
                if getattr(hook, "__self__", None) is state:
                    del value[hook_id]
            value = copy.deepcopy(value, memo)
        else:
            value = copy.deepcopy(value, memo)
        plain.__dict__[key] = value
    return plain
