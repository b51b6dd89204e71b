"""How ``sg.keras.Model`` calls a module that is not Keras-shaped (Hugging Face's and friends'),
as Hugging Face's own Keras models do (``TFPreTrainedModel.train_step``):

- a dict ``x`` reaches ``forward`` as keyword arguments when its keys are ``forward``'s
  parameters; otherwise it is passed whole, as one argument;
- without a compiled loss, the model's own loss is the loss: ``y`` reaches ``forward`` as
  ``labels=`` (a dict ``y`` as its keys), and the output's ``.loss`` is read (``own_loss``);
- the compiled loss, the metrics and ``predict`` read one tensor (``prediction``): the output
  itself, else the output named at ``compile(output=...)``, else ``.logits``, else a dict's one
  entry besides ``loss``;
- ``training=`` reaches ``forward`` only when it takes it (``training_mode``).

Anything that cannot work is a ``ModelOutputError`` (or a ``TypeError`` for inputs) that says
what was received and what to pass.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.errors import ModelOutputError

OutputName = str | int  # compile(output=...): a key or attribute, or a tuple's position


@dataclass(frozen=True)
class ForwardSignature:
    """The parameters of a module's ``forward`` that decide how it is called."""

    name: str  # the module's class, for messages
    named: frozenset[str]  # parameters a keyword can reach
    takes_any_keyword: bool  # ``**kwargs``

    def takes(self, parameter: str) -> bool:
        return parameter in self.named


# A module class -> its forward function and that function's signature: every step of fit
# asks (inspect.signature was 5 % of a step of a small model).
_signatures: weakref.WeakKeyDictionary[type, tuple[Any, ForwardSignature]] = (
    weakref.WeakKeyDictionary()
)


def forward_signature(module: torch.nn.Module) -> ForwardSignature:
    """``module.forward``'s parameters (a module whose forward hides its signature, a C
    extension's, is taken to accept any keyword: its own error then names what it lacks).
    Read once per class while ``forward`` is the class's own method; a ``forward`` set on the
    object is read each time."""
    forward = module.forward
    function = getattr(forward, "__func__", None)
    if function is None or getattr(forward, "__self__", None) is not module:
        return _signature(forward, type(module).__name__)
    known = _signatures.get(type(module))
    if known is not None and known[0] is function:
        return known[1]
    signature = _signature(forward, type(module).__name__)
    _signatures[type(module)] = (function, signature)
    return signature


def _signature(forward: Any, name: str) -> ForwardSignature:
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ForwardSignature(name, frozenset(), takes_any_keyword=True)
    named = frozenset(
        p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    return ForwardSignature(name, named, any_keyword)


def spreads(signature: ForwardSignature, x: Mapping[str, Any]) -> bool:
    """Whether a dict ``x`` is ``forward``'s keyword arguments (rather than one argument): all
    its keys are named parameters, or ``forward`` takes ``**kwargs`` and some key is one (an HF
    model's ``forward(input_ids=None, ..., **kwargs)``). A ``forward(batch)`` whose parameter
    is none of the keys gets the dict whole."""
    keys = [k for k in x if isinstance(k, str)]
    if len(keys) != len(x) or not keys:
        return False
    named = [k for k in keys if signature.takes(k)]
    return len(named) == len(keys) or (signature.takes_any_keyword and bool(named))


def call_arguments(
    signature: ForwardSignature, x: Any, extra: Mapping[str, Any] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``forward``'s positional and keyword arguments for the input ``x`` and the keyword
    arguments ``extra`` (labels, ``training``)."""
    extra = dict(extra or {})
    if isinstance(x, Mapping) and spreads(signature, x):
        kwargs = dict(x)
        twice = sorted(set(kwargs) & set(extra))
        if twice:
            raise ValueError(
                f"{signature.name}.forward would get {twice} twice: from the input dict x "
                f"(keys {sorted(kwargs)}) and as keyword arguments (fit's y goes as labels=); "
                "give each in one place"
            )
        return (), {**kwargs, **extra}
    return (x,), extra


def labels_arguments(signature: ForwardSignature, y: Any) -> dict[str, Any]:
    """``y`` as ``forward``'s keyword arguments, for a model whose own loss is the loss: a
    tensor as ``labels=``, a dict as its keys (``start_positions=``, ``end_positions=``)."""
    if isinstance(y, Mapping):
        unknown = sorted(str(k) for k in y if not isinstance(k, str) or not signature.takes(k))
        if unknown:
            raise ModelOutputError(
                f"compile was given no loss, so the model's own loss is the loss and y's keys "
                f"go to {signature.name}.forward as keyword arguments; but forward takes no "
                f"{unknown}. Rename them to forward's parameters, or compile a loss"
            )
        return dict(y)
    if not signature.takes("labels"):
        raise ModelOutputError(
            f"compile was given no loss, so the model's own loss is the loss and y goes to "
            f"{signature.name}.forward as labels=; but forward takes no 'labels' parameter. "
            "Compile a loss (model.compile(optimizer, loss=...)): y then goes to it"
        )
    return {"labels": y}


def labels_in(x: Any) -> Any:
    """The labels an input dict carries (HF's batches of ``input_ids`` and ``labels``), else
    None: the targets of the metrics (and of a compiled loss) when fit is given no ``y``."""
    if isinstance(x, Mapping):
        return x.get("labels")
    return None


def own_loss(output: Any, signature: ForwardSignature) -> torch.Tensor:
    """The loss the module computed itself (``output.loss``, or a dict's ``"loss"``): a
    scalar, the mean over this replica's part of the batch."""
    has_field = (isinstance(output, Mapping) and "loss" in output) or hasattr(output, "loss")
    value = _field(output, "loss")
    if value is None:
        if has_field or _declares_loss(output):
            raise ModelOutputError(
                f"compile was given no loss, so the loss is {signature.name}'s own, but its "
                f"{type(output).__name__} came back with loss=None: it computes a loss only "
                "when given labels. Give fit/evaluate y (it reaches forward as labels=), or "
                "batches whose input dict holds 'labels'"
            )
        raise ModelOutputError(
            f"compile was given no loss, and {signature.name}'s output "
            f"({_describe(output)}) has no .loss to train on: compile a loss "
            "(model.compile(optimizer, loss=...)), or return an output with a .loss"
        )
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ModelOutputError(
            f"{signature.name}'s output .loss must be one number (a scalar tensor, the batch's "
            f"mean loss); got {shape}"
        )
    return value.reshape(())


def prediction(output: Any, name: OutputName | None) -> torch.Tensor:
    """The tensor of ``output`` the compiled loss, the metrics and ``predict`` read."""
    if name is not None:
        value = _named(output, name)
        if not isinstance(value, torch.Tensor):
            raise ModelOutputError(
                f"compile(output={name!r}) names no tensor of the model's output "
                f"({_describe(output)}); name one of its tensors"
            )
        return value
    if isinstance(output, torch.Tensor):
        return output
    logits = _field(output, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping):
        tensors = {k: v for k, v in output.items() if k != "loss" and isinstance(v, torch.Tensor)}
        if len(tensors) == 1:
            return next(iter(tensors.values()))
    raise ModelOutputError(
        f"the compiled loss, the metrics and predict need one tensor of the model's output, "
        f"but it is {_describe(output)} with no .logits: name the one to read with "
        "model.compile(..., output=NAME) (a key or attribute, or a position in a tuple)"
    )


def examples_in(x: Any) -> int:
    """The number of examples in a replica's input: the leading dimension of its first
    tensor (a dict's too)."""
    for leaf in torch.utils._pytree.tree_leaves(x):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return int(leaf.shape[0])
    raise ModelOutputError(
        f"cannot tell how many examples an input of type {type(x).__name__} holds (no tensor "
        "with a batch dimension), which the model's own loss needs to be weighted by"
    )


@contextlib.contextmanager
def training_mode(module: torch.nn.Module, training: bool | None) -> Iterator[None]:
    """Keras's ``training=`` for one call: the module (every submodule) in train or eval mode,
    the modes it had restored after; None leaves the modes as they are."""
    if training is None:
        yield
        return
    before = [(m, m.training) for m in module.modules()]
    try:
        module.train(bool(training))
    except NotImplementedError:
        pass  # a module rebuilt from a torch.export program keeps the mode it was exported in
    try:
        yield
    finally:
        for submodule, mode in before:
            submodule.training = mode


def _named(output: Any, name: OutputName) -> Any:
    if isinstance(name, int) and not isinstance(name, bool):
        if isinstance(output, tuple | list) and -len(output) <= name < len(output):
            return output[name]
        if isinstance(output, Mapping) and hasattr(output, "to_tuple"):
            parts = output.to_tuple()  # a ModelOutput by position, as HF indexes it
            if -len(parts) <= name < len(parts):
                return parts[name]
        return None
    return _field(output, name) if isinstance(name, str) else None


def _field(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):
        return output.get(name)
    if isinstance(output, torch.Tensor | tuple | list):
        return None
    return getattr(output, name, None)


def _declares_loss(output: Any) -> bool:
    # A dataclass output (HF's ModelOutput) declares ``loss`` even when the field is None.
    fields = getattr(type(output), "__dataclass_fields__", None)
    return bool(fields) and "loss" in fields


def _describe(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {list(output.shape)}"
    if isinstance(output, Mapping):
        return f"{type(output).__name__} with keys {sorted(map(str, output))}"
    if isinstance(output, tuple | list):
        kinds = ", ".join(type(v).__name__ for v in output)
        return f"a {type(output).__name__} of {len(output)} ({kinds})"
    return f"a {type(output).__name__}"
