"""``SidecarEvaluatorModelExport``: a ``SidecarEvaluator``'s callback that keeps the best model
it evaluated (tf_keras's, in ``distribute/sidecar_evaluator.py``)."""

from __future__ import annotations

import os
import re
from typing import Any

from stratagem.keras.callbacks.callback import Logs
from stratagem.keras.callbacks.model_checkpoint import ModelCheckpoint
from stratagem.train import latest_checkpoint


class SidecarEvaluatorModelExport(ModelCheckpoint):
    """Saves the model at ``export_filepath`` after an evaluation that is the best so far.

    A ``ModelCheckpoint`` with ``save_best_only=True`` (its other arguments: ``monitor``,
    ``mode``, ``save_weights_only``, ``verbose``...) whose saves happen at ``on_test_end``.
    ``{epoch}`` in ``export_filepath`` is the training epoch of the checkpoint evaluated: the
    number in its name, read with ``checkpoint_filepath`` (the training's
    ``ModelCheckpoint`` path, ``".../ckpt-{epoch}"``). ``SidecarEvaluator`` tells it which
    checkpoint it evaluates; used elsewhere it takes, as TensorFlow's does, the latest
    checkpoint in ``checkpoint_filepath``'s directory.
    """

    def __init__(self, export_filepath: str, checkpoint_filepath: str, **kwargs: Any) -> None:
        if "{epoch" not in os.fspath(checkpoint_filepath):
            raise ValueError(
                f"SidecarEvaluatorModelExport: checkpoint_filepath must hold '{{epoch}}' (the "
                f"training's ModelCheckpoint path, e.g. '.../ckpt-{{epoch}}'), got "
                f"{checkpoint_filepath!r}"
            )
        super().__init__(filepath=export_filepath, save_best_only=True, **kwargs)
        self.checkpoint_filepath = os.fspath(checkpoint_filepath)
        self._evaluated: str | None = None  # told by SidecarEvaluator
        self.export_index = 0  # the epoch (from 0) of the checkpoint evaluated

    def set_evaluated_checkpoint(self, path: str) -> None:
        """The checkpoint the coming evaluation is of (``SidecarEvaluator`` calls it)."""
        self._evaluated = path

    def on_test_begin(self, logs: Logs | None = None) -> None:
        path = self._evaluated or latest_checkpoint(os.path.dirname(self.checkpoint_filepath))
        epoch = None if path is None else self._epoch_in(path)
        self.export_index = 0 if epoch is None else epoch - 1

    def on_test_end(self, logs: Logs | None = None) -> None:
        self._save(self.export_index, logs or {})

    def _epoch_in(self, path: str) -> int | None:
        """The ``{epoch}`` of ``path`` by ``checkpoint_filepath``'s pattern."""
        name = os.path.basename(os.path.normpath(path))
        template = os.path.basename(self.checkpoint_filepath)
        pattern = re.sub(
            r"\\\{epoch(?::[^}]*)?\\\}", r"(?P<epoch>\\d+)", re.escape(template), count=1
        )
        pattern = re.sub(r"\\\{[^}]*\\\}", r".*?", pattern)  # other fields: anything
        m = re.fullmatch(pattern, name)
        return int(m["epoch"]) if m else None
