"""``sg.keras.models``: ``load_model``, where Keras keeps it: a ``Model`` from ``model.save``'s
directory (the format is ``saving.py``), compiled as it was saved."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from stratagem.keras import losses, optimizers
from stratagem.keras.io_options import LoadOptions
from stratagem.keras.mixed_precision import LossScaleOptimizer
from stratagem.keras.model import Model
from stratagem.keras.saving import read_saved
from stratagem.keras.serializable import ClassPolicy

__all__ = ["load_model"]


def load_model(
    path: str,
    module: torch.nn.Module | None = None,
    compile: bool = True,
    options: LoadOptions | None = None,
    *,
    custom_objects: Mapping[str, type] | None = None,
    safe_mode: bool = True,
    allow_packages: Iterable[str] | str = (),
) -> Model:
    """A Model from ``model.save``'s directory; inside a strategy scope it is distributed.
    ``options``: an ``sg.saved_model.LoadOptions`` (``experimental_io_device``).

    The module: ``module`` when given (the weights are loaded into it); else a fresh one of the
    saved class, built from its saved config, when that class is registered
    (``sg.keras.saving.register_keras_serializable``), in ``custom_objects`` or from a package
    in ``allow_packages`` (``safe_mode=False``: any class, for a file you trust); else the
    saved ``torch.export`` program. A class refused with no program raises
    ``sg.keras.saving.UnregisteredClassError``, saying how to allow it."""
    classes = ClassPolicy.of(custom_objects, allow_packages, safe_mode)
    saved = read_saved(path, module, options, "load_model", classes)
    if saved.module is None:
        raise ValueError(
            f"{path!r} holds no exported program ({saved.config.get('program_missing_because')}"
            f") and no config to rebuild its module from "
            f"({saved.config.get('rebuild_missing_because')}); pass module= (a fresh "
            f"{saved.config['module']['class']}) to load its weights"
        )
    model = Model(saved.module, dtype=saved.config.get("dtype_policy"))
    if compile and saved.config.get("compile"):
        _recompile(model, saved.config["compile"])
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
    steps = opt.get("gradient_accumulation_steps")  # absent from files saved before it existed
    bound = optimizers.BoundOptimizer(optimizer, steps)
    scaling = opt.get("loss_scale")
    if scaling is not None:
        bound = LossScaleOptimizer(
            bound,
            dynamic=bool(scaling["dynamic"]),
            initial_scale=float(scaling["initial_scale"]),
            dynamic_growth_steps=scaling["dynamic_growth_steps"],
        )
        state = bound.trackables()  # in place: the scale and the counter reached
        state["loss_scale"].fill_(float(scaling["scale"]))
        state["dynamic_counter"].fill_(int(scaling["counter"] or 0))
    model.compile(bound, loss, spec.get("metrics") or [])
