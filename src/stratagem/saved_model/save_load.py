"""``sg.saved_model.save`` and ``sg.saved_model.load`` over ``model.save``'s directory format."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch

from stratagem.keras import saving
from stratagem.keras.io_options import LoadOptions, SaveOptions
from stratagem.keras.model import Model
from stratagem.keras.saving import read_saved
from stratagem.saved_model.loaded import DEFAULT_SERVING_SIGNATURE_DEF_KEY, SERVING, LoadedModel

__all__ = ["load", "save"]


def save(
    obj: Model | torch.nn.Module,
    export_dir: str | os.PathLike[str],
    signatures: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    options: SaveOptions | None = None,
) -> None:
    """Save ``obj`` (an ``sg.keras.Model`` or a ``torch.nn.Module``, built in a strategy's
    scope or not) to the directory ``export_dir`` (``tf.saved_model.save``).

    The serving signature is the forward pass traced by ``torch.export``: on the input a Keras
    model has seen, or on ``signatures``, an example input (or ``{"serving_default":
    example}``): TensorFlow's ``signatures=model.call.get_concrete_function(TensorSpec(...))``,
    where the example's shape and dtype are the spec and its first dimension (the batch) stays
    free. Without either, only the weights are saved and the loaded object has no signatures,
    as in TensorFlow for a model whose functions were never traced. Under a strategy, every
    process calls it and the chief writes (as ``model.save``).
    """
    example = _example_of(signatures)
    if isinstance(obj, LoadedModel) and obj.module is not None:
        obj = obj.module
    if not isinstance(obj, Model | torch.nn.Module):
        raise TypeError(
            f"sg.saved_model.save saves an sg.keras.Model, a torch.nn.Module or a loaded saved "
            f"model, got {type(obj).__module__}.{type(obj).__qualname__}"
        )
    # A Keras model is traced on ``signatures``, else on the input it has seen; one never
    # called saves its weights without signatures, as TF's does (model.save refuses it:
    # Keras's own rule for its format).
    saving.save(obj, os.fspath(export_dir), example_input=example, options=options)


def _example_of(signatures: object) -> torch.Tensor | None:
    if signatures is None or isinstance(signatures, torch.Tensor):
        return signatures
    if isinstance(signatures, Mapping):
        unknown = sorted(set(signatures) - {DEFAULT_SERVING_SIGNATURE_DEF_KEY})
        example = signatures.get(DEFAULT_SERVING_SIGNATURE_DEF_KEY)
        if unknown or not isinstance(example, torch.Tensor):
            raise ValueError(
                f"signatures={dict(signatures)!r}: a saved model has one signature, the module's "
                f"forward pass; expected {{{DEFAULT_SERVING_SIGNATURE_DEF_KEY!r}: an example "
                "input tensor}, an example input tensor, or None"
            )
        return example
    raise TypeError(
        f"signatures must be an example input tensor (the serving function's input spec: its "
        f"shape and dtype, batch dimension free), {{{DEFAULT_SERVING_SIGNATURE_DEF_KEY!r}: "
        f"tensor}} or None, got {type(signatures).__name__}; stratagem traces the module's "
        f"forward pass with torch.export, not a tf.function"
    )


def load(
    export_dir: str | os.PathLike[str],
    tags: str | Iterable[str] | None = None,
    options: LoadOptions | None = None,
) -> LoadedModel:
    """Load the saved model at ``export_dir`` (``tf.saved_model.load``): written by
    ``sg.saved_model.save`` or ``model.save``. Inside ``strategy.scope()`` its weights are
    created in the scope, so they are distributed. Nothing is unpickled."""
    _check_tags(tags)
    path = os.fspath(export_dir)
    saved = read_saved(path, None, options, "saved_model.load")
    return LoadedModel(saved.module, saved.state, saved.config, path)


def _check_tags(tags: object) -> None:
    """TensorFlow picks a MetaGraph by its tags; a saved model here has one, tagged "serve"."""
    if tags is None:
        return
    given = {tags} if isinstance(tags, str) else set(tags) if isinstance(tags, Iterable) else None
    if given != {SERVING}:
        raise ValueError(
            f"tags={tags!r}: a saved model has one MetaGraph, tagged [{SERVING!r}]; pass "
            f"tags=None, {SERVING!r} or [{SERVING!r}]"
        )
