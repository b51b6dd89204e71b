"""A study's storage: the Optuna study in SQLite under the study folder, and its recovery.

Every state change of a study is in its database, so a tuner killed at any moment resumes: the
next one takes the lock (the kernel released the dead one's), reopens the study, checks that it
searches the same space, marks the trials that were in flight as failed (the tuner, not the
script, failed them) and queues their parameters to run again. Those trials do not count toward
``max_trial_count``.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratagem.tune.errors import TuningError

if TYPE_CHECKING:
    import optuna

_INTERRUPTED = "the tuner stopped while this trial ran; its parameters are run again"


def storage_url(study_dir: Path) -> str:
    """The SQLite database of the study in ``study_dir``."""
    return f"sqlite:///{study_dir / 'study.db'}"


@contextmanager
def study_lock(study_dir: Path, display_name: str) -> Iterator[None]:
    """Hold the study's ``tuner.lock``: one tuner at a time runs a study."""
    with open(study_dir / "tuner.lock", "a+") as lock:
        # flock is released by the kernel when the holder dies, even by SIGKILL: a killed tuner
        # never blocks the next one.
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            raise TuningError(
                f"study {display_name!r} in {study_dir} is being run by another tuner "
                f"(pid {holder})"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        yield


def load_study(study_dir: Path, display_name: str) -> optuna.Study | None:
    """The stored study, or None before it has a database (or before this study is in it)."""
    import optuna

    if not (study_dir / "study.db").exists():
        return None
    try:
        return optuna.load_study(study_name=display_name, storage=storage_url(study_dir))
    except KeyError:  # the database exists, this study is not in it (yet)
        return None


def open_study(
    study_dir: Path,
    display_name: str,
    direction: str,
    pruner: optuna.pruners.BasePruner,
    space: Mapping[str, Any],
    metric_id: str,
) -> optuna.Study:
    """Create the study, or open the stored one if it searches the same ``space``; its
    objective is named ``metric_id`` (optuna-dashboard shows "Objective 0" otherwise)."""
    import warnings

    import optuna

    storage = optuna.storages.RDBStorage(
        storage_url(study_dir), engine_kwargs={"connect_args": {"timeout": 60}}
    )
    study = optuna.create_study(
        storage=storage,
        study_name=display_name,
        direction=direction,
        pruner=pruner,
        load_if_exists=True,
    )
    stored = study.user_attrs.get("space")
    if stored is None:
        study.set_user_attr("space", space)
    elif stored != json.loads(json.dumps(space)):
        raise TuningError(
            f"study {display_name!r} in {study_dir} was created with {stored}, "
            f"not {space}; give this search another display_name or base_output_dir"
        )
    if study.metric_names != [metric_id]:
        with warnings.catch_warnings():  # "experimental" in Optuna 3.2 to 5: stable enough here
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([metric_id])
    return study


def resumed_seed(seed: int | None, study: optuna.Study) -> int | None:
    """The sampler's seed: a resumed study must not replay the first run's random draws."""
    return None if seed is None else seed + len(study.get_trials(deepcopy=False))


def requeue(study: optuna.Study, params_by_number: Mapping[int, dict[str, Any]]) -> None:
    """Record the trials numbered as failed by the tuner, and queue their parameters again."""
    from optuna.trial import TrialState

    notes = dict(study.user_attrs.get("notes", {}))
    interrupted = list(study.user_attrs.get("interrupted", []))
    for number, params in params_by_number.items():
        study.tell(number, state=TrialState.FAIL)
        notes[str(number)] = _INTERRUPTED
        interrupted.append(number)
        study.enqueue_trial(params)
    study.set_user_attr("notes", notes)
    study.set_user_attr("interrupted", sorted(interrupted))


def recover_interrupted(study: optuna.Study) -> None:
    """Trials left running by a tuner that died: failed by the tuner, run again."""
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if stale:
        requeue(study, {frozen.number: frozen.params for frozen in stale})


def counted(study: optuna.Study) -> tuple[int, int]:
    """(trials that count toward max_trial_count, of which failed), interrupted ones aside."""
    from optuna.trial import TrialState

    interrupted = set(study.user_attrs.get("interrupted", []))
    ended = [
        t
        for t in study.get_trials(
            deepcopy=False,
            states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL),
        )
        if t.number not in interrupted
    ]
    return len(ended), sum(t.state == TrialState.FAIL for t in ended)
