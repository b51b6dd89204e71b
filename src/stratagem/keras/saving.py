"""``model.save(path)`` and ``sg.keras.models.load_model(path)``: a self-describing directory.

    <path>/model.safetensors   the state_dict (plain PyTorch loads it); a tied tensor once, its
                               other names in the metadata (``load_model`` ties them again)
    <path>/config.json         what the model is, how it was compiled and trained, where
    <path>/manifest.json       the size and SHA-256 of each other file, checked before loading
    <path>/program.pt2         a ``torch.export`` program of the module, when it exports, so
                               ``load_model`` rebuilds it without its Python class (eval mode)

``config.json`` records the module's class and, when it describes itself, its config: a class
registered or allowed (``serializable``) is rebuilt from it, else the program is used.
``sg.saved_model`` reads and writes the same directory. ``load_model`` inside a scope
distributes the module. Only the chief writes; every worker returns once done. A save appears
whole or not at all (``train.atomic_dir``); loading never unpickles.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from stratagem.distribute import strategy_for
from stratagem.keras import losses, optimizers
from stratagem.keras.exported_program import export_program, load_program
from stratagem.keras.io_options import LoadOptions, SaveOptions, check_options
from stratagem.keras.mixed_precision import LossScaleOptimizer
from stratagem.keras.serializable import ClassPolicy, describe, is_registered, rebuild
from stratagem.keras.serializable import UnregisteredClassError as UnregisteredClassError
from stratagem.keras.serializable import get_custom_objects as get_custom_objects
from stratagem.keras.serializable import get_registered_name as get_registered_name
from stratagem.keras.serializable import get_registered_object as get_registered_object
from stratagem.keras.serializable import (
    register_keras_serializable as register_keras_serializable,
)
from stratagem.train.atomic_dir import hidden_sibling, open_files, publish
from stratagem.train.manifest import (
    MANIFEST_FILE,
    DamagedSaveError,
    check_file,
    read_manifest,
    write_manifest,
)
from stratagem.train.sharded import whole_module
from stratagem.train.tied import tie, tied_names, with_aliases, without_aliases

if TYPE_CHECKING:
    from stratagem.distribute import Strategy, StrategyExtended
    from stratagem.keras import metrics
    from stratagem.keras.callbacks.history import History
    from stratagem.keras.mixed_precision.policy import Policy

FORMAT = "stratagem.keras.model"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PROGRAM_FILE = "program.pt2"
# The safetensors metadata entry (JSON) of a tied tensor's other names: {alias: name written}.
TIED_METADATA = "stratagem.tied"


class SavedModel(Protocol):
    """What ``save`` reads of a Keras model: an ``sg.keras.Model`` is one. Saving sits below
    the model whose ``save`` calls it (``load_model``, which makes a ``Model``, is in
    ``models.py``), so it names only these members."""

    module: torch.nn.Module
    optimizer: optimizers.BoundOptimizer | None
    loss: losses.Loss | None
    compiled_metrics: list[metrics.Metric]
    history: History | None
    dtype_policy: Policy
    distribute_strategy: Strategy

    @property
    def example_input(self) -> torch.Tensor | None: ...


def _compile_config(model: SavedModel) -> dict[str, Any] | None:
    if model.optimizer is None:
        return None
    torch_optimizer = model.optimizer.torch_optimizer
    loss = model.loss
    optimizer: dict[str, Any] = {
        "torch_class": type(torch_optimizer).__name__,
        "learning_rate": model.optimizer.learning_rate,
        "defaults": {k: v for k, v in torch_optimizer.defaults.items() if _plain(v)},
        "gradient_accumulation_steps": model.optimizer.gradient_accumulation_steps,
    }
    if isinstance(model.optimizer, LossScaleOptimizer):
        # Keras saves the wrapper's config and its scale variables: a loaded model goes on
        # with the scale reached, not the initial one.
        counter = model.optimizer.dynamic_counter
        optimizer["loss_scale"] = {
            "dynamic": model.optimizer.dynamic,
            "initial_scale": model.optimizer.initial_scale,
            "dynamic_growth_steps": model.optimizer.dynamic_growth_steps,
            "scale": float(model.optimizer.loss_scale),
            "counter": None if counter is None else int(counter),
        }
    return {
        "optimizer": optimizer,
        "loss": None if loss is None else {"class": type(loss).__name__, **_loss_options(loss)},
        "metrics": [m.name for m in model.compiled_metrics],
    }


def _plain(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _loss_options(loss: losses.Loss) -> dict[str, Any]:
    options = {"name": loss.name}
    if hasattr(loss, "from_logits"):
        options["from_logits"] = loss.from_logits
    return options


def example_for(module: torch.nn.Module, input_shape: Any) -> torch.Tensor:
    """An input of ``input_shape`` (Keras's: ``None`` for the batch) that the module accepts:
    what ``model.build(input_shape)`` gives ``save`` to trace the program on."""
    if not isinstance(input_shape, tuple | list | torch.Size) or not input_shape:
        raise ValueError(
            f"input_shape must be a non-empty tuple such as (None, 28, 28), got {input_shape!r}"
        )
    dims = list(input_shape)
    if dims[0] is None:
        dims[0] = 2  # torch.export specialises a dimension of size 1; the batch stays dynamic
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ValueError(
            f"input_shape={tuple(input_shape)!r}: every dimension but the batch (the first, "
            "which may be None) must be a positive integer: the program is traced on that shape"
        )
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    example = torch.zeros(dims, device=device)
    was_training = module.training
    try:  # as Keras's build calls the model once: a shape the module rejects fails here
        module.eval()
        with torch.no_grad():
            module(example)
    except Exception as e:
        raise ValueError(
            f"the module does not accept an input of shape {tuple(input_shape)!r}: "
            f"{type(e).__name__}: {e}"
        ) from e
    finally:
        module.train(was_training)
    return example.cpu()


def save(
    obj: SavedModel | torch.nn.Module,
    path: str,
    *,
    example_input: torch.Tensor | None = None,
    options: SaveOptions | None = None,
) -> str:
    """Write ``obj`` to the directory ``path`` and return the path: the one way in for
    ``model.save`` and ``sg.saved_model.save``. A Keras model is written with its compile,
    dtype policy and training sections (``saved_by`` "model.save"), its program traced on
    ``example_input`` or else on the input it has seen (``example_input``); a plain
    ``torch.nn.Module`` with its weights, and its program when ``example_input`` is given
    (``saved_by`` "saved_model.save"). The chief writes (the strategy that distributes the
    module, or the one in scope, for a plain module); every worker calls it and waits."""
    if isinstance(obj, torch.nn.Module):
        extended = strategy_for([obj]).extended
        return _save(obj, path, example_input, options, extended, [], {}, "saved_model.save")
    optimizer = obj.optimizer.torch_optimizer if obj.optimizer is not None else None
    history = obj.history.history if obj.history is not None else {}
    keras = {
        "compile": _compile_config(obj),
        "dtype_policy": obj.dtype_policy.name,  # Keras saves each layer's policy
        "training": {"epochs_run": len(next(iter(history.values()), [])), "history": history},
    }
    return _save(
        obj.module,
        path,
        obj.example_input if example_input is None else example_input,
        options,
        obj.distribute_strategy.extended,
        [optimizer] if optimizer is not None else [],
        keras,
        "model.save",
    )


def _save(
    module: torch.nn.Module,
    path: str,
    example_input: torch.Tensor | None,
    options: SaveOptions | None,
    extended: StrategyExtended,
    others: list[object],
    keras: dict[str, Any],
    caller: str,
) -> str:
    check_options(options, SaveOptions, caller)
    path = os.fspath(path)
    # Every process: pipeline stages bring their layers (a collective), a ps's values come home.
    extended.before_checkpoint_write([module, *others])
    whole = whole_module(module)  # a collective for weights laid out on a mesh
    if extended.should_checkpoint:
        _write(whole, path, example_input, keras, extended.describe(), caller)
    # Every worker returns once the save is complete, so a load_model that follows reads it.
    extended.barrier(caller)
    return path


def _write(
    module: torch.nn.Module,
    path: str,
    example_input: torch.Tensor | None,
    keras: dict[str, Any],
    distribution: dict[str, Any],
    caller: str,
) -> None:
    path = os.path.normpath(os.path.abspath(path))
    _check_replaceable(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = hidden_sibling(path, "tmp")
    os.mkdir(tmp)
    try:
        state, tied = _weights(module)
        with open(os.path.join(tmp, WEIGHTS_FILE), "wb") as f:
            f.write(save_safetensors(state, metadata={TIED_METADATA: json.dumps(tied)}))
        target = os.path.join(tmp, PROGRAM_FILE)
        exported, why, dropped = _export(example_input, module, target)
        rebuilt, rebuild_why = describe(module)
        whole = exported and not dropped
        if not whole and not (rebuilt is not None and is_registered(module)):
            program = (
                f"a torch.export program that leaves out the outputs {dropped} (objects "
                "torch.export cannot carry)"
                if exported
                else f"no torch.export program ({why})"
            )
            warnings.warn(_needs_help(caller, program, rebuilt, rebuild_why), stacklevel=4)
        config = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch_version": torch.__version__,
            "saved_by": caller,
            "module": {
                "class": f"{type(module).__module__}.{type(module).__qualname__}",
                "repr": repr(module),
                "parameters": sum(p.numel() for p in module.parameters()),
            },
            "tied": tied,
            "program": PROGRAM_FILE if exported else None,
            "program_missing_because": None if exported else why,
            "program_outputs_left_out": dropped,
            "rebuild": rebuilt,  # the class and its config, when it describes itself
            "rebuild_missing_because": rebuild_why,
            "compile": keras.get("compile"),
            "dtype_policy": keras.get("dtype_policy"),
            "training": keras.get("training"),
            "distribution": distribution,
            "checksums": MANIFEST_FILE,
        }
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, default=str)
        # Last, inside the staged save: the size and SHA-256 of every other file.
        write_manifest(tmp, [n for n in os.listdir(tmp) if n != MANIFEST_FILE])
        publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _needs_help(
    caller: str, program: str, rebuilt: dict[str, Any] | None, rebuild_why: str | None
) -> str:
    """What loading this save as it came will need, said at save time: its program is missing
    or partial, and its class is not registered (load_model needs it allowed) or has no
    config to be rebuilt from."""
    if rebuilt is None:
        return (
            f"{caller}: {program} and no config to rebuild the module from ({rebuild_why}); "
            "load_model(path, module=...) loads the weights into a fresh module"
        )
    path = rebuilt["class"]
    short, package = path.rsplit(".", 1)[-1], path.split(".", 1)[0]
    return (
        f"{caller}: {program}; saved the config of {short}, which load_model(path) rebuilds "
        f"only once the class is allowed: "
        f"load_model(path, allow_packages=({package!r},)), custom_objects={{{short!r}: "
        f"{short}}}, or sg.keras.saving.register_keras_serializable() on the class"
    )


def _weights(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors ``model.safetensors`` holds, and the tied names left out of them.

    A tied tensor (two names, one parameter) is written once, under its first name, with its
    other names in the file's metadata, as Hugging Face writes tied embeddings: safetensors
    refuses two names for one memory ("Some tensors share memory"), and a copy under each
    name would load as two parameters."""
    full = module.state_dict()
    tied = {a: n for a, n in tied_names(module).items() if a in full and n in full}
    state = {k: v.detach().cpu().contiguous() for k, v in without_aliases(full, tied).items()}
    return state, tied


def _check_replaceable(path: str) -> None:
    """A save replaces an earlier save or an empty directory, never other files."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        entries = os.listdir(path)
        if not entries or CONFIG_FILE in entries:
            return
        shown = sorted(entries)[:5]
        raise FileExistsError(
            f"refusing to save over {path!r}: it is a directory holding {shown} but no "
            f"{CONFIG_FILE}, so not an earlier save; expected a free path, an empty directory "
            "or an earlier save"
        )
    raise FileExistsError(
        f"refusing to save over {path!r}: it is a file; a saved model is a directory (expected "
        "a free path, an empty directory or an earlier save)"
    )


def _on_cpu(module: torch.nn.Module) -> torch.nn.Module:
    """The module to trace: itself when it lives on the CPU, else a copy there. The example
    input kept for the trace is a CPU tensor (a module on a GPU would not take it), and the
    program, like the weights file, then loads on any machine."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.device.type == "cpu" for t in tensors):
        return module
    # Each tensor is replaced by a plain CPU copy before the deep copy reaches it: the copy
    # takes none of the hooks a strategy put on the tensors (a gradient reducer's, which
    # holds the process group).
    memo: dict[int, object] = {}
    for t in tensors:
        plain = t.detach().cpu()
        memo[id(t)] = (
            torch.nn.Parameter(plain, t.requires_grad)
            if isinstance(t, torch.nn.Parameter)
            else plain
        )
    return copy.deepcopy(module, memo)


def _export(
    example: torch.Tensor | None, module: torch.nn.Module, target: str
) -> tuple[bool, str | None, list[str]]:
    """Whether the program was written, why not, and the outputs it leaves out."""
    if example is None:
        return False, "the model never saw an input (fit, evaluate or predict it first)", []
    try:
        with open(target, "wb") as f:
            dropped = export_program(_on_cpu(module), example, f)
        return True, None, dropped
    except Exception as e:  # a module torch.export cannot trace: weights still load
        first = (str(e).splitlines() or [""])[0]
        return False, f"the module did not export: {type(e).__name__}: {first}", []


@dataclass
class Saved:
    """What one save directory holds, read consistently: its config, its weights, and its
    module when it has a program (or when one was given)."""

    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    module: torch.nn.Module | None


def read_saved(
    path: str,
    module: torch.nn.Module | None,
    options: LoadOptions | None,
    caller: str,
    classes: ClassPolicy | None = None,
) -> Saved:
    """Read the save at ``path``: every file from one and the same save, nothing unpickled.
    The module is ``module`` when given; else a fresh one of its class, from the saved config,
    when ``classes`` allows that class; else rebuilt from the program (inside a strategy
    scope, its parameters are created in the scope). The weights are loaded into it. A class
    refused with no program to fall back on (TF revives a model from its functions when its
    class is unknown) raises ``UnregisteredClassError``."""
    check_options(options, LoadOptions, caller)
    path = os.fspath(path)
    try:
        optional = [PROGRAM_FILE, MANIFEST_FILE]
        with open_files(path, [CONFIG_FILE, WEIGHTS_FILE], optional=optional) as files:
            manifest = None
            if MANIFEST_FILE in files:  # every file checked before any of its bytes is used
                manifest = read_manifest(path, files[MANIFEST_FILE], None, "saved model")
                check_file(path, CONFIG_FILE, files[CONFIG_FILE], manifest, "saved model")
            config = _parse_config(path, files[CONFIG_FILE].read())
            if manifest is None:
                manifest = read_manifest(path, None, config, "saved model")  # old: warns
            program = files.get(PROGRAM_FILE) if config.get("program") else None
            if manifest is not None:
                check_file(path, WEIGHTS_FILE, files[WEIGHTS_FILE], manifest, "saved model")
                if config.get("program"):
                    check_file(path, PROGRAM_FILE, program, manifest, "saved model")
            if module is None and classes is not None and config.get("rebuild"):
                try:
                    module = rebuild(config["rebuild"], classes)
                except UnregisteredClassError:
                    if program is None:
                        raise
            if module is None and program is not None:
                module = load_program(program, os.path.join(path, PROGRAM_FILE))
            weights = os.path.join(path, WEIGHTS_FILE)
            data = files[WEIGHTS_FILE].read()
            try:
                state = load_safetensors(data)
            except Exception as e:  # safetensors raises its own error type for damaged files
                raise ValueError(
                    f"cannot read the weights {weights!r} (truncated or damaged?): {e}"
                ) from e
    except (FileNotFoundError, NotADirectoryError) as e:
        if os.path.exists(os.path.join(path, MANIFEST_FILE)):
            raise DamagedSaveError(
                f"saved model {path!r} is damaged: a file its manifest lists is missing "
                f"({e.strerror or e})"
            ) from None
        raise FileNotFoundError(
            f"{path!r} is not a saved model: it has no {CONFIG_FILE} and {WEIGHTS_FILE} "
            f"({e.strerror or e})"
        ) from None
    tied = _tied_in(data, weights)
    state = with_aliases(state, tied, f"the weights {weights!r}")
    if module is not None:
        module.load_state_dict(state)
        # A program's module holds a copy under each name: one tensor again, as saved.
        tie(module, tied, f"the weights {weights!r}")
    return Saved(config, state, module)


def _tied_in(data: bytes, weights: str) -> dict[str, str]:
    """The tied names that a weights file records in its metadata (``{alias: name}``); none
    in a file written before ties were recorded, or by another tool."""
    # The header (a little-endian u64 length, then JSON) was checked by safetensors' load.
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    text = metadata.get(TIED_METADATA)
    if text is None:
        return {}
    try:
        tied = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{weights!r}: its {TIED_METADATA!r} metadata is not JSON ({e})") from e
    if not isinstance(tied, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tied.items()
    ):
        raise ValueError(
            f"{weights!r}: its {TIED_METADATA!r} metadata is {text[:200]!r}; expected a JSON "
            "object of names ({alias: the name written})"
        )
    return tied


def _parse_config(path: str, text: bytes) -> dict[str, Any]:
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{config_path!r} is not JSON ({e})") from e
    if (
        not isinstance(config, dict)
        or config.get("format") != FORMAT
        or not isinstance(config.get("version", 0), int)
        or config.get("version", 0) > FORMAT_VERSION
    ):
        found = config if not isinstance(config, dict) else config.get("format")
        version = config.get("version") if isinstance(config, dict) else None
        raise ValueError(
            f"{config_path!r} has format {found!r} version {version!r}; expected {FORMAT!r} up "
            f"to version {FORMAT_VERSION}"
        )
    return config
