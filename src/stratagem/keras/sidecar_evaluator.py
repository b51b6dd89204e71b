"""``SidecarEvaluator``: a dedicated evaluator task that evaluates the checkpoints a training
job writes, as they appear (``tf.keras.utils.SidecarEvaluator``, tf_keras's
``distribute/sidecar_evaluator.py``).

It runs in its own process beside the training, with no strategy of the training's (the
default strategy, or any it was built under), and reads the directory the chief writes: the
checkpoints of ``sg.train.CheckpointManager`` (a ``Checkpoint(model=..., optimizer=...)``) or of
``sg.keras.callbacks.ModelCheckpoint(filepath=".../ckpt-{epoch}")``. It follows them with
``sg.train.checkpoints_iterator``, so a checkpoint is only read once whole and checked against its
manifest.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem.errors import CheckpointError
from stratagem.keras.callbacks.callback import Callback, format_logs
from stratagem.keras.callbacks.sidecar_evaluator_model_export import SidecarEvaluatorModelExport
from stratagem.keras.model import Model
from stratagem.train.checkpoints_iterator import checkpoints_iterator
from stratagem.train.manifest import DamagedSaveError
from stratagem.train.storage import read_checkpoint

__all__ = ["Evaluation", "SidecarEvaluator", "SidecarEvaluatorExperimental"]

# Top-level tensors of a custom loop's checkpoint that count its steps (TF's evaluator reads
# the optimizer's ``iter``; a torch optimizer without per-parameter steps keeps none).
_STEP_NAMES = ("iterations", "step", "global_step")
_NUMBERED = re.compile(r"-(\d+)$")  # "<ckpt_name>-<n>": CheckpointManager's and ModelCheckpoint's


@dataclass
class Evaluation:
    """One evaluated checkpoint: its path, its number (``ckpt-<n>``) and training step when
    known, and the metrics ``model.evaluate`` returned."""

    path: str
    number: int | None
    step: int | None
    logs: dict[str, float] = field(default_factory=dict)


class SidecarEvaluator:
    """Evaluates each new checkpoint in ``checkpoint_dir`` with ``model.evaluate(data)``.

    ``model`` is an ``sg.keras.Model`` of the trained architecture, compiled with the loss and
    metrics to report; ``data`` is what ``model.evaluate`` takes as ``x`` (a dataset of batches,
    or an ``(x, y)`` pair of arrays). ``start()`` waits for a checkpoint, restores the model's
    weights from it (and ``model.optimizer.iterations`` from the training step it records:
    the optimizer's step count, or a tensor named ``iterations``, ``step`` or ``global_step``),
    runs ``evaluate(data, steps=steps, callbacks=callbacks)``, prints the metrics with the
    checkpoint's step, and waits for the next one. As TensorFlow's, it always takes the latest
    checkpoint, so it skips those written while it evaluated; and a checkpoint it cannot load
    (deleted by ``max_to_keep`` meanwhile, or damaged) is skipped with a message.

    It stops after evaluating a checkpoint whose name ends in ``-<n>`` with
    ``n >= max_evaluations`` (TF's rule: with one checkpoint per epoch, pass the number of
    epochs, and it stops at the training's last one); without ``max_evaluations`` it evaluates
    until stopped. Beyond TensorFlow, ``timeout`` (seconds) bounds each wait for a new
    checkpoint: after it, the evaluator stops, or raises ``TimeoutError`` when
    ``max_evaluations`` is set and its checkpoint never came (the training died). While it
    waits it prints ``waiting for a new checkpoint in DIR (30s)`` every 30 seconds.

    ``evaluations`` lists what it evaluated (``Evaluation``: path, number, step, metrics).
    """

    def __init__(
        self,
        model: Model,
        data: Any,
        checkpoint_dir: str | os.PathLike[str],
        steps: int | None = None,
        max_evaluations: int | None = None,
        callbacks: Iterable[Callback] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        # The model and the directory are checked when evaluation starts, as TF's evaluator
        # takes anything here (SidecarEvaluator(None, None, None) only warns, under its
        # deprecated experimental name).
        for name, value in (("steps", steps), ("max_evaluations", max_evaluations)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(
                    f"SidecarEvaluator: {name} must be a positive integer or None, got {value!r}"
                )
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise ValueError(
                f"SidecarEvaluator: timeout must be a number of seconds >= 0 or None, got "
                f"{timeout!r}"
            )
        self.model = model
        self.data = data
        self.checkpoint_dir: Any = (
            os.fspath(checkpoint_dir) if isinstance(checkpoint_dir, str | os.PathLike) else None
        )
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.callbacks = list(callbacks or [])
        self.timeout = timeout
        self.evaluations: list[Evaluation] = []
        self.poll_secs = 1.0  # how often the directory is looked at while waiting
        self.report_every_secs: float | None = 30.0  # how often waiting is reported

    def start(self) -> None:
        """Evaluate checkpoints as they appear, until the last one (see the class)."""
        if not isinstance(self.model, Model):
            raise TypeError(
                f"SidecarEvaluator needs an sg.keras.Model (compiled with the metrics to "
                f"report), got {type(self.model).__module__}.{type(self.model).__qualname__}"
            )
        if self.checkpoint_dir is None:
            raise TypeError(
                "SidecarEvaluator needs checkpoint_dir, the directory the training writes its "
                "checkpoints to (a str or path); it was given none"
            )
        for path in checkpoints_iterator(
            self.checkpoint_dir,
            timeout=self.timeout,
            timeout_fn=self._timed_out,
            poll_secs=self.poll_secs,
            report_every_secs=self.report_every_secs,
        ):
            number = _number(path)
            if self.max_evaluations is not None and number is None:
                raise ValueError(
                    f"SidecarEvaluator: max_evaluations={self.max_evaluations} stops at the "
                    f"checkpoint numbered {self.max_evaluations} ('<name>-"
                    f"{self.max_evaluations}'), but {path!r} has no '-<number>' at the end of its "
                    f"name; save with sg.train.CheckpointManager, or ModelCheckpoint(filepath="
                    f"'.../ckpt-{{epoch}}')"
                )
            try:
                step = self._restore(path)
            except (FileNotFoundError, DamagedSaveError) as e:
                # Deleted by the training's max_to_keep, or damaged: as TF, on to the next one.
                print(
                    f"SidecarEvaluator: cannot load the checkpoint at {path} ({e}); skipping it",
                    flush=True,
                )
                continue
            print(f"SidecarEvaluator: evaluating {path} (step {_or_unknown(step)})", flush=True)
            for callback in self.callbacks:
                if isinstance(callback, SidecarEvaluatorModelExport):
                    callback.set_evaluated_checkpoint(path)  # its {epoch}, without a race
            logs = self.model.evaluate(
                self.data, steps=self.steps, callbacks=self.callbacks, verbose=0, return_dict=True
            )
            self.evaluations.append(Evaluation(path, number, step, dict(logs)))
            print(
                f"SidecarEvaluator: {os.path.basename(path)} step {_or_unknown(step)}: "
                f"{format_logs(logs)}",
                flush=True,
            )
            last = self.max_evaluations
            if last is not None and number is not None and number >= last:
                print("SidecarEvaluator: last checkpoint evaluated; stopping", flush=True)
                return

    def _restore(self, path: str) -> int | None:
        """Load the model's weights from ``path``; return the training step it records."""
        meta, state = read_checkpoint(path)
        if meta.get("sharded"):  # laid-out weights (DCP's files): load_weights reshards them
            state = {"model": None}
        if not isinstance(state, Mapping) or "model" not in state:
            held = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(
                f"SidecarEvaluator: checkpoint {path!r} holds {held}, expected a 'model' "
                f"(sg.train.Checkpoint(model=..., optimizer=...) or ModelCheckpoint's)"
            )
        try:
            self.model.load_weights(path)
        except (FileNotFoundError, DamagedSaveError):
            raise
        except CheckpointError as e:
            raise CheckpointError(
                f"SidecarEvaluator: cannot restore the model from {path!r}: {e} (is the model "
                f"the same architecture as the one trained?)"
            ) from e
        step = _step_of(state)
        if step is not None and self.model.optimizer is not None:
            self.model.optimizer.iterations = step  # TF: optimizer.iterations.assign(...)
        return step

    def _timed_out(self) -> bool:
        """No new checkpoint for ``timeout`` seconds: stop, or fail when the last is missing."""
        last = self.evaluations[-1].path if self.evaluations else "none"
        if self.max_evaluations is not None:
            raise TimeoutError(
                f"SidecarEvaluator: no new checkpoint in {self.checkpoint_dir!r} for "
                f"{self.timeout:g}s, and the last one (numbered {self.max_evaluations}, "
                f"max_evaluations) never came; last evaluated: {last}. Did the training stop "
                f"early, or save elsewhere?"
            )
        print(
            f"SidecarEvaluator: no new checkpoint in {self.checkpoint_dir} for {self.timeout:g}s "
            f"(last evaluated: {last}); stopping",
            flush=True,
        )
        return True


class SidecarEvaluatorExperimental(SidecarEvaluator):
    """Deprecated: ``sg.keras.experimental.SidecarEvaluator``, as in TensorFlow; use
    ``sg.keras.utils.SidecarEvaluator``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "`sg.keras.experimental.SidecarEvaluator` endpoint is deprecated and will be removed "
            "in a future release. Please use `sg.keras.utils.SidecarEvaluator`.",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)


def _number(path: str) -> int | None:
    m = _NUMBERED.search(os.path.basename(os.path.normpath(path)))
    return int(m[1]) if m else None


def _or_unknown(step: int | None) -> str:
    return "unknown" if step is None else str(step)


def _step_of(state: Mapping[str, Any]) -> int | None:
    """The training step a checkpoint records: a top-level step tensor of a custom loop (or
    ``ModelCheckpoint``'s ``iterations``), a ``BackupAndRestore`` backup's, else its
    optimizer's step count (Adam's, RMSprop's: per parameter, all equal), looked for at the
    top level and inside a Keras model's saved optimizer; None when it records none (SGD)."""
    for name in _STEP_NAMES:
        value = state.get(name)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return int(value.item())
    progress = state.get("progress")  # BackupAndRestore's backup: fit's optimizer iterations
    if isinstance(progress, Mapping):
        value = progress.get("optimizer_iterations")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return int(value.item())
    model = state.get("model")
    for holder in (state, model if isinstance(model, Mapping) else {}):
        optimizer = holder.get("optimizer")
        if isinstance(optimizer, Mapping) and isinstance(optimizer.get("state"), Mapping):
            steps = [
                int(s["step"].item() if isinstance(s["step"], torch.Tensor) else s["step"])
                for s in optimizer["state"].values()
                if isinstance(s, Mapping) and "step" in s
            ]
            if steps:
                return max(steps)
    return None
