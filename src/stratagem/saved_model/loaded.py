"""``LoadedModel``: what ``sg.saved_model.load`` returns, as TensorFlow's loaded object.

TensorFlow's ``tf.saved_model.load`` gives a plain object, not a Keras model: it is callable
(the model's forward pass), lists its ``variables`` and ``trainable_variables``, and holds its
serving functions in ``signatures``; ``signatures["serving_default"](x)`` returns a dict of
named output tensors. Names: TensorFlow names a Keras model's outputs after its output layers
(``{"dense_1": ...}``) and a plain function's ``output_0``, ``output_1``...; a torch module has
no output layer names, so outputs are always ``output_<i>`` (a dict output keeps its keys).
``module`` is the rebuilt ``torch.nn.Module``. The loaded object is itself a module (its one
submodule is ``module``), so it trains as a layer of a new model: ``sg.keras.Model(loaded)``,
built in any strategy's scope, where TensorFlow writes ``hub.KerasLayer(loaded,
trainable=True)`` inside a ``tf.keras.Model``; ``trainable`` is that switch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

DEFAULT_SERVING_SIGNATURE_DEF_KEY = "serving_default"
SERVING = "serve"  # the one tag a saved model has (tf.saved_model.SERVING)


def named_outputs(outputs: Any) -> dict[str, Any]:
    """A signature's result, as TensorFlow shapes it: ``{"output_0": tensor}`` for one
    tensor, ``output_<i>`` for a tuple or list, the keys of a dict."""
    if isinstance(outputs, Mapping):
        return {str(k): v for k, v in outputs.items()}
    if isinstance(outputs, tuple | list):
        return {f"output_{i}": v for i, v in enumerate(outputs)}
    return {"output_0": outputs}


class ServingFunction:
    """A serving signature: the module's forward pass returning a dict of named outputs.

    It runs without autograd, as TensorFlow's signature runs with no tape watching: its
    outputs are plain values (``requires_grad`` False, ``.numpy()`` works) and no graph of the
    forward pass is kept. ``no_grad`` rather than ``inference_mode``: an output may still feed
    a model that trains. The loaded object's own ``__call__`` stays differentiable, as TF's
    restored functions are (fine-tuning a loaded model goes through it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with torch.no_grad():
            return named_outputs(self._module(*args, **kwargs))

    def __repr__(self) -> str:
        return f"ServingFunction({type(self._module).__name__})"


class LoadedModel(torch.nn.Module):
    """A loaded saved model: callable, with ``signatures``, ``variables``,
    ``trainable_variables`` and the rebuilt ``module``; a ``torch.nn.Module`` whose weights
    are the loaded ones, so a new model trains them (``sg.keras.Model(loaded)``)."""

    def __init__(
        self,
        module: torch.nn.Module | None,
        state: dict[str, torch.Tensor],
        config: dict[str, Any],
        path: str,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self._path = path
        self._state = state
        # A save without a program (a model that never saw an input) has no signatures, as a
        # TensorFlow SavedModel without traced functions has none.
        self.signatures: dict[str, ServingFunction] = (
            {} if module is None else {DEFAULT_SERVING_SIGNATURE_DEF_KEY: ServingFunction(module)}
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is None:
            raise ValueError(
                f"the saved model at {self._path!r} has no function to call: it was saved "
                f"without a program ({self.config.get('program_missing_because')}); save it "
                "after the model has seen an input, or with signatures=<an example input>"
            )
        return self.module(*args, **kwargs)

    @property
    def variables(self) -> list[torch.Tensor]:
        """Every weight: parameters and buffers (TensorFlow's non-trainable variables)."""
        if self.module is None:
            return list(self._state.values())
        return [*self.module.parameters(), *self.module.buffers()]

    @property
    def trainable_variables(self) -> list[torch.Tensor]:
        if self.module is None:
            return []
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    def trainable(self) -> bool:
        """``hub.KerasLayer``'s switch: whether training updates the loaded weights."""
        return any(p.requires_grad for p in self.parameters())

    @trainable.setter
    def trainable(self, value: bool) -> None:
        self.requires_grad_(bool(value))

    def __repr__(self) -> str:
        return f"LoadedModel({self._path!r}, signatures={sorted(self.signatures)})"
