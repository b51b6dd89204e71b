"""``TensorBoard``: event files of the logs in Keras's layout, weight histograms and a profile
of chosen batches, written by the chief (Keras 3's ``keras/src/callbacks/tensorboard.py``)."""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from typing import Any

import torch

from stratagem.keras.callbacks.callback import Callback, Logs, is_chief
from stratagem.keras.callbacks.straggler_notes import StragglerNotes


class TensorBoard(Callback):
    """TensorBoard event files, as Keras lays them out: ``<log_dir>/train`` and
    ``<log_dir>/validation`` with ``epoch_loss``, ``epoch_accuracy``... per epoch, the learning
    rate as ``epoch_learning_rate``, and with ``update_freq="batch"`` (or every N batches)
    ``batch_*`` scalars by global step. Written by the chief through ``SummaryWriter``.

    - ``histogram_freq=N``: every N epochs, a histogram of each weight,
      ``<parameter name>/histogram`` (torch's names: ``0.weight``) at step ``epoch``, in
      ``train``. Weights sharded on a mesh are gathered first (every worker takes part); on a
      pipeline the chief's histograms are of the stages it holds.
    - ``profile_batch=N`` or ``(start, stop)`` (or Keras's ``"start,stop"``): the global
      training batches from ``start`` to ``stop`` (counted from 1) are profiled with
      ``torch.profiler`` on the chief, and the trace written as Chrome trace JSON to
      ``<log_dir>/train/plugins/profile/<date_time>/<host>.pt.trace.json`` (TensorBoard's
      profile directory; open it in TensorBoard's PyTorch profiler plugin, or
      ``chrome://tracing`` / Perfetto). 0 profiles nothing.
    - ``write_steps_per_second=True``: ``batch_steps_per_second`` and
      ``epoch_steps_per_second``, as Keras.

    ``write_graph`` (Keras's default True) writes nothing: a torch module has no Keras graph to
    draw. ``write_images`` and ``embeddings_freq`` / ``embeddings_metadata`` are not
    implemented and refuse a non-default value.
    """

    def __init__(
        self,
        log_dir: str = "logs",
        histogram_freq: int = 0,
        write_graph: bool = True,
        write_images: bool = False,
        write_steps_per_second: bool = False,
        update_freq: str | int = "epoch",
        profile_batch: int | str | tuple[int, int] | list[int] = 0,
        embeddings_freq: int = 0,
        embeddings_metadata: Any = None,
    ) -> None:
        super().__init__()
        if update_freq not in ("epoch", "batch") and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(
                f"update_freq must be 'epoch', 'batch' or a positive int; got {update_freq!r}"
            )
        if (
            isinstance(histogram_freq, bool)
            or not isinstance(histogram_freq, int)
            or (histogram_freq < 0)
        ):
            raise ValueError(f"histogram_freq must be an integer >= 0; got {histogram_freq!r}")
        for name, value in [
            ("write_images", write_images),
            ("embeddings_freq", embeddings_freq),
            ("embeddings_metadata", embeddings_metadata),
        ]:
            if value:
                raise NotImplementedError(
                    f"TensorBoard({name}={value!r}) is not implemented in stratagem (Keras "
                    "writes weight images and embedding checkpoints); leave it at its default"
                )
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = histogram_freq
        self.write_graph = write_graph
        self.write_steps_per_second = write_steps_per_second
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self._start_batch, self._stop_batch = _profile_range(profile_batch)
        self._writers: dict[str, Any] = {}
        self._step = 0
        self._profiler: torch.profiler.profile | None = None
        self._batch_start = 0.0
        self._epoch_start, self._epoch_first_step = 0.0, 0
        self._training = False  # between on_train_begin and on_train_end
        self._stragglers = StragglerNotes()

    @property
    def needs_batch_logs(self) -> bool:
        return self.update_freq != "epoch"

    def _writer(self, split: str) -> Any:
        if split not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            self._writers[split] = SummaryWriter(os.path.join(self.log_dir, split))
        return self._writers[split]

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._step = 0
        self._training = True

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch_start, self._epoch_first_step = time.time(), self._step

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self._step += 1  # the global batch, from 1 (Keras's _global_train_batch)
        self._batch_start = time.time()
        if self._step == self._start_batch and is_chief(self.model):
            self._start_profiler()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._profiler is not None and self._step >= self._stop_batch:
            self._stop_profiler()
        if not is_chief(self.model):
            return
        for line in self._stragglers.fresh(self.model):  # named once, at the step it was found
            self._writer("train").add_text("stragglers", line, self._step)
        if self.write_steps_per_second:
            elapsed = max(time.time() - self._batch_start, 1e-9)
            self._writer("train").add_scalar("batch_steps_per_second", 1 / elapsed, self._step)
        if self.update_freq == "epoch" or self._step % self.update_freq:
            return
        for name, value in (logs or {}).items():
            self._writer("train").add_scalar(f"batch_{name}", value, self._step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        weights = (
            self._weights() if self.histogram_freq and epoch % self.histogram_freq == 0 else []
        )
        if not is_chief(self.model):
            return
        logs = dict(logs or {})
        if "learning_rate" not in logs and self.model is not None and self.model.optimizer:
            logs["learning_rate"] = self.model.optimizer.learning_rate
        if self.write_steps_per_second:
            steps = self._step - self._epoch_first_step
            logs["steps_per_second"] = steps / max(time.time() - self._epoch_start, 1e-9)
        for name, value in logs.items():
            split, tag = ("validation", name[4:]) if name.startswith("val_") else ("train", name)
            self._writer(split).add_scalar(f"epoch_{tag}", value, epoch)
        for name, weight in weights:
            self._writer("train").add_histogram(f"{name}/histogram", weight, epoch)
        for writer in self._writers.values():
            writer.flush()

    def _weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight whole, on the CPU: gathering a mesh's shards is a collective, so every
        worker calls this, in the same order."""
        assert self.model is not None
        # No DTensor exists until torch.distributed.tensor is loaded: asking sys.modules keeps
        # every job that has no mesh from importing it (about 0.5 s of CPU at its start).
        dtensor = sys.modules.get("torch.distributed.tensor")
        found = []
        for name, p in self.model.module.named_parameters():
            is_shard = dtensor is not None and isinstance(p, dtensor.DTensor)
            whole = p.detach().full_tensor() if is_shard else p.detach()
            found.append((name, whole.float().cpu()))
        return found

    def _start_profiler(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        except Exception as e:  # profiling must not fail training (Keras logs and goes on)
            self._profiler = None
            warnings.warn(f"TensorBoard could not start the profiler: {e}", stacklevel=2)

    def _stop_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        try:
            profiler.__exit__(None, None, None)
            run = time.strftime("%Y_%m_%d_%H_%M_%S")
            directory = os.path.join(self.log_dir, "train", "plugins", "profile", run)
            os.makedirs(directory, exist_ok=True)
            profiler.export_chrome_trace(
                os.path.join(directory, f"{socket.gethostname()}.pt.trace.json")
            )
        except Exception as e:
            warnings.warn(f"TensorBoard could not write the profile: {e}", stacklevel=2)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._profiler is not None:  # fit ended before the last batch to profile
            self._stop_profiler()
        self._training = False
        self._close_writers()

    def on_test_end(self, logs: Logs | None = None) -> None:
        # Keras: each evaluation's logs against the optimizer's iterations, under validation/
        # (fit's validation, evaluate, and so a SidecarEvaluator's evaluations too).
        if not logs or not is_chief(self.model) or self.model.optimizer is None:
            return
        step = int(self.model.optimizer.iterations)
        writer = self._writer("validation")
        for name, value in logs.items():
            writer.add_scalar(f"evaluation_{name}_vs_iterations", value, step)
        writer.flush()
        if not self._training:
            self._close_writers()  # an evaluate outside fit leaves no writer open

    def _close_writers(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


def _profile_range(profile_batch: Any) -> tuple[int, int]:
    """Keras's ``_init_profile_batch``: an int N (batch N alone; 0 none), a pair (start, stop),
    or the string ``"start,stop"``; positive, stop not before start."""
    message = (
        "profile_batch must be a non-negative integer or 2-tuple of positive integers. A pair "
        f"of positive integers signifies a range of batches to profile. Found: {profile_batch}"
    )
    if isinstance(profile_batch, str):
        try:
            profile_batch = [int(v) for v in profile_batch.split(",")]
        except ValueError:
            raise ValueError(message) from None
        if len(profile_batch) == 1:
            profile_batch = profile_batch[0]
    if isinstance(profile_batch, int) and not isinstance(profile_batch, bool):
        start = stop = profile_batch
    elif isinstance(profile_batch, tuple | list) and len(profile_batch) == 2:
        start, stop = profile_batch
    else:
        raise ValueError(message)
    if start < 0 or stop < start:
        raise ValueError(message)
    return start, stop
