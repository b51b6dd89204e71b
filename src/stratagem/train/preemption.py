"""Save a checkpoint and stop when the job is about to be preempted (TF's
``tf.distribute.experimental.PreemptionCheckpointHandler`` and ``TerminationConfig``).

A signal (SIGTERM by default; SLURM's ``--signal=USR1@90`` sends SIGUSR1) only sets a flag: a
save in the middle of a step, between two collectives, would hang or tear the job. At the next
``run()`` (or ``save_checkpoint_if_preempted()``) the workers agree, with one all-reduce of the
flags, whether any of them was signalled, so that all save the same step or none does; then
the checkpoint is written and ``exit_fn`` runs (default: exit with status 143, 128 + SIGTERM,
which managers read as "stopped by a signal"). At construction the latest checkpoint is
restored, as TensorFlow's handler does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.cluster import progress
from stratagem.cluster.slurm_requeue import requeue_job
from stratagem.comm import ReduceOp
from stratagem.comm.process_group import live_connection
from stratagem.train.checkpoint import Checkpoint, say_restored
from stratagem.train.checkpoint_manager import CheckpointManager, latest_checkpoint

#: The exit status after a preemption checkpoint when no ``exit_fn`` is given.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


@dataclass(frozen=True)
class TerminationConfig:
    """How to notice a coming termination, how to save, how to exit (TF's names).

    ``termination_watcher_fn() -> bool`` is polled at every check besides the signals;
    ``save_fn()`` replaces the checkpoint write; ``exit_fn()`` runs after the save;
    ``grace_period`` (seconds between the notice and the kill) is recorded for the user's
    planning: the save happens at the next step whatever it is; ``signals`` are the ones that
    mean a termination is coming (stratagem's addition: TF watches its platform's).
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], None] | None = None
    grace_period: float | None = None
    save_fn: Callable[[], None] | None = None
    signals: tuple[int, ...] = (signal.SIGTERM,)


def slurm_requeue_config(
    *, signals: Iterable[int] = (signal.SIGUSR1, signal.SIGTERM), grace_period: float = 90
) -> TerminationConfig:
    """SLURM's auto-requeue, as Lightning's ``SLURMEnvironment`` does it: on SIGUSR1 (from
    ``#SBATCH --signal=USR1@90``) or SIGTERM, save, then the chief runs ``scontrol requeue``
    and every task exits 0; the requeued job resumes from the checkpoint."""

    def exit_fn() -> None:
        rank = int(os.environ.get("SLURM_PROCID", "0") or 0)
        if rank == 0:  # one requeue per job, by the chief (SLURM task 0)
            requeue_job()
            progress.info("requeued the SLURM job after the preemption checkpoint")
        sys.exit(0)

    return TerminationConfig(exit_fn=exit_fn, grace_period=grace_period, signals=tuple(signals))


class PreemptionCheckpointHandler:
    """Checkpoint at the first step boundary after a termination notice, then exit."""

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | os.PathLike | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        self._resolver = cluster_resolver
        self._config = termination_config or TerminationConfig()
        target = checkpoint_or_checkpoint_manager
        if isinstance(target, CheckpointManager):
            self._manager: CheckpointManager | None = target
            self._checkpoint: Checkpoint | None = None
            target.restore_or_initialize()
        elif isinstance(target, Checkpoint):
            if checkpoint_dir is None:
                raise ValueError(
                    "PreemptionCheckpointHandler with a Checkpoint needs checkpoint_dir (where "
                    "to save and restore), got None; or pass a CheckpointManager"
                )
            self._manager = None
            self._checkpoint = target
            self._dir = os.fspath(checkpoint_dir)
            latest = latest_checkpoint(self._dir)
            if latest is not None:
                target.restore(latest)
                say_restored(target, latest, None)
        else:
            raise TypeError(
                "checkpoint_or_checkpoint_manager must be an sg.train.Checkpoint or "
                f"CheckpointManager, got {type(target).__name__}"
            )
        self._received: int | None = None
        self._run_calls = 0
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionCheckpointHandler must be created in the main thread: signal "
                "handlers can only be installed there"
            )
        for signum in self._config.signals:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only a flag: the save waits for a step boundary that every worker reaches.
        if self._received is None:
            self._received = signum

    @property
    def total_run_calls(self) -> int:
        """How many times ``run`` has been called in this process."""
        return self._run_calls

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one step, then save and exit if any worker was told it will be terminated."""
        result = distributed_train_function(*args, **kwargs)
        self._run_calls += 1
        self.save_checkpoint_if_preempted()
        return result

    def save_checkpoint_if_preempted(self) -> None:
        """At a step boundary every worker reaches: save and exit when a notice came."""
        if not self._agreed():
            return
        reason = signal.Signals(self._received).name if self._received else "a termination notice"
        progress.info(f"saving a checkpoint before termination ({reason} received by the job)")
        if self._config.save_fn is not None:
            self._config.save_fn()
        elif self._manager is not None:
            self._manager.save()
        else:
            assert self._checkpoint is not None
            self._checkpoint.save(os.path.join(self._dir, "ckpt"))
        if self._config.exit_fn is not None:
            self._config.exit_fn()
        else:
            sys.exit(PREEMPTED_EXIT_CODE)

    def _agreed(self) -> bool:
        """Whether any worker got a notice: one all-reduce, so that all save or none does."""
        watcher = self._config.termination_watcher_fn
        local = self._received is not None or bool(watcher is not None and watcher())
        comm = live_connection()
        if comm is None or comm.world_size == 1:
            return local
        flag = torch.tensor([1.0 if local else 0.0])
        comm.all_reduce(flag, ReduceOp.MAX, what="the preemption check")
        if flag.item() > 0 and self._received is None:
            self._received = 0  # told by a peer
        return flag.item() > 0
