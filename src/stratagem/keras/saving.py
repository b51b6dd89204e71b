"""``model.save(path)`` and ``sg.keras.models.load_model(path)``: a self-describing directory.

    <path>/model.safetensors   the module's state_dict (loads in plain PyTorch, see the README)
    <path>/config.json         what the model is, how it was compiled and trained, where
    <path>/program.pt2         a ``torch.export`` program of the module (batch dimension dynamic),
                               when the module exports; it lets ``load_model`` rebuild the module
                               without its Python class

``load_model`` outside any scope gives a single-device model; inside ``strategy.scope()`` the
rebuilt module's parameters are created in the scope, so they are distributed again. The
program is exported in eval mode: a loaded model predicts and evaluates as the original and can
be trained further, but layers that act differently in training (dropout, batch norm) keep their
eval behaviour; pass ``module=`` (a fresh instance of the original class) to get them back.
Only the chief writes (the strategy's ``extended.should_checkpoint``); ``save`` returns on every
worker once the write is complete.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
import warnings
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from stratagem.keras import losses, optimizers
from stratagem.train.sharded import whole_module

if TYPE_CHECKING:
    from stratagem.keras.model import Model

FORMAT = "stratagem.keras.model"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PROGRAM_FILE = "program.pt2"


def _compile_config(model: Model) -> dict[str, Any] | None:
    if model.optimizer is None:
        return None
    torch_optimizer = model.optimizer.torch_optimizer
    loss = model.loss
    return {
        "optimizer": {
            "torch_class": type(torch_optimizer).__name__,
            "learning_rate": model.optimizer.learning_rate,
            "defaults": {k: v for k, v in torch_optimizer.defaults.items() if _plain(v)},
        },
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


def save_model(model: Model, path: str, *, example_input: torch.Tensor | None = None) -> str:
    """Write ``model`` to the directory ``path`` atomically (the chief writes; every worker
    calls it and waits for the write); return the path. ``example_input`` (an input the model
    has seen) lets ``torch.export`` trace the module."""
    path = os.fspath(path)
    extended = model.distribute_strategy.extended
    optimizer = model.optimizer.torch_optimizer if model.optimizer is not None else None
    # Every process: pipeline stages bring their layers (a collective), a ps's values come home.
    extended.before_checkpoint_write([model.module] + ([optimizer] if optimizer else []))
    module = whole_module(model.module)  # a collective for weights laid out on a mesh
    if extended.should_checkpoint:
        _write_model(model, module, path, example_input, extended.describe())
    # Every worker returns once the save is complete, so a load_model that follows reads it.
    extended.barrier("model.save")
    return path


def _write_model(
    model: Model,
    module: torch.nn.Module,
    path: str,
    example_input: torch.Tensor | None,
    distribution: dict[str, Any],
) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        save_file(state, os.path.join(tmp, WEIGHTS_FILE))
        exported, why = _export(example_input, module, os.path.join(tmp, PROGRAM_FILE))
        if not exported:
            warnings.warn(
                f"model.save: no torch.export program ({why}); saved the weights, which "
                "load_model(path, module=...) loads into a fresh module",
                stacklevel=2,
            )
        history = model.history.history if model.history is not None else {}
        config = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch_version": torch.__version__,
            "module": {
                "class": f"{type(module).__module__}.{type(module).__qualname__}",
                "repr": repr(module),
                "parameters": sum(p.numel() for p in module.parameters()),
            },
            "program": PROGRAM_FILE if exported else None,
            "program_missing_because": why,
            "compile": _compile_config(model),
            "training": {"epochs_run": len(next(iter(history.values()), [])), "history": history},
            "distribution": distribution,
        }
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, default=str)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _export(
    example: torch.Tensor | None, module: torch.nn.Module, target: str
) -> tuple[bool, str | None]:
    if example is None:
        return False, "the model never saw an input (fit, evaluate or predict it first)"
    was_training = module.training
    try:
        module.eval()
        batch = torch.export.Dim("batch")
        program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        torch.export.save(program, target)
        return True, None
    except Exception as e:  # a module torch.export cannot trace: weights still load
        return (
            False,
            f"the module did not export: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}",
        )
    finally:
        module.train(was_training)


def load_model(path: str, module: torch.nn.Module | None = None, compile: bool = True) -> Model:
    """A Model from ``model.save``'s directory; inside a strategy scope it is distributed."""
    from stratagem.keras.model import Model

    path = os.fspath(path)
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} is not a saved model: it has no {CONFIG_FILE}")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("format") != FORMAT or config.get("version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{config_path!r} has format {config.get('format')!r} version "
            f"{config.get('version')!r}; expected {FORMAT!r} up to version {FORMAT_VERSION}"
        )
    if module is None:
        if not config.get("program"):
            raise ValueError(
                f"{path!r} holds no exported program ({config.get('program_missing_because')}); "
                f"pass module= (a fresh {config['module']['class']}) to load its weights"
            )
        program = os.path.join(path, config["program"])
        try:
            module = torch.export.load(program).module()
        except Exception as e:
            raise ValueError(f"cannot read the exported program {program!r}: {e}") from e
    weights = os.path.join(path, WEIGHTS_FILE)
    try:
        state = load_file(weights)
    except Exception as e:  # safetensors raises its own error type for damaged files
        raise ValueError(f"cannot read the weights {weights!r} (truncated or damaged?): {e}") from e
    module.load_state_dict(state)
    model = Model(module)
    if compile and config.get("compile"):
        _recompile(model, config["compile"])
    return model


def _recompile(model: Model, spec: dict[str, Any]) -> None:
    opt = spec["optimizer"]
    torch_class = getattr(torch.optim, opt["torch_class"], None)
    if torch_class is None:
        raise ValueError(f"saved optimizer class {opt['torch_class']!r} is not in torch.optim")
    defaults = {k: tuple(v) if isinstance(v, list) else v for k, v in opt["defaults"].items()}
    defaults["lr"] = opt["learning_rate"]
    accepted = inspect.signature(torch_class).parameters
    optimizer = torch_class(
        model.module.parameters(), **{k: v for k, v in defaults.items() if k in accepted}
    )
    loss = None
    if spec.get("loss"):
        options = dict(spec["loss"])
        loss = getattr(losses, options.pop("class"))(**options)
    model.compile(optimizers.BoundOptimizer(optimizer), loss, spec.get("metrics") or [])
