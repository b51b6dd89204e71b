"""``ClusterSpec``: which tasks a job has, by job name and task index (as ``tf.train.ClusterSpec``).

A job is dense (``{"worker": ["a:1", "b:2"]}``, indices 0..n-1) or sparse
(``{"worker": {1: "b:2"}}``, only some indices), as TensorFlow allows. The spec checks the
*shape* of its input (names, indices, strings) but not address syntax: TensorFlow does not,
and specs derived from torchrun hold placeholders for addresses nobody published. Parsers of
user configuration (TF_CONFIG) check addresses with ``parse_address``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import TypeAlias

from stratagem.errors import ClusterConfigError

#: What ``ClusterSpec`` accepts: a dense list or a sparse ``{index: address}`` map per job.
JobTasks: TypeAlias = "Sequence[str] | Mapping[int, str]"
#: Anything ``ClusterSpec(...)`` accepts; functions taking a spec take this too.
ClusterLike: TypeAlias = "ClusterSpec | Mapping[str, JobTasks] | None"


def _task_index(job: str, key: object) -> int:
    """A sparse job's key as an int; decimal strings are accepted because JSON keys are strings."""
    if isinstance(key, bool):  # bool is an int subclass, but True is no task index
        raise ClusterConfigError(
            f"ClusterSpec job {job!r}: task index must be a non-negative int, got {key!r}"
        )
    if isinstance(key, str) and key.isdecimal() and key.isascii():
        key = int(key)
    if not isinstance(key, int):
        raise ClusterConfigError(
            f"ClusterSpec job {job!r}: task index must be a non-negative int, "
            f"got {type(key).__name__} {key!r}"
        )
    if key < 0:
        raise ClusterConfigError(
            f"ClusterSpec job {job!r}: task index must be a non-negative int, got {key}"
        )
    return key


def _job_tasks(job: str, tasks: object) -> dict[int, str]:
    if isinstance(tasks, Mapping):
        pairs = [(_task_index(job, key), address) for key, address in tasks.items()]
    elif isinstance(tasks, (list, tuple)):
        pairs = list(enumerate(tasks))
    else:
        raise ClusterConfigError(
            f"ClusterSpec job {job!r}: tasks must be a list of addresses or a dict "
            f"{{task_index: address}}, got {type(tasks).__name__} {tasks!r}"
        )
    result: dict[int, str] = {}
    for index, address in pairs:
        if not isinstance(address, str):
            raise ClusterConfigError(
                f"ClusterSpec job {job!r} task {index}: address must be a str, "
                f"got {type(address).__name__} {address!r}"
            )
        if index in result:
            raise ClusterConfigError(
                f"ClusterSpec job {job!r}: task index {index} is given twice "
                f"({result[index]!r} and {address!r})"
            )
        result[index] = address
    return dict(sorted(result.items()))


class ClusterSpec:
    """The tasks of a cluster: ``{job_name: [address, ...]}`` or ``{job_name: {index: address}}``.

    ``ClusterSpec(None)`` and ``ClusterSpec({})`` are empty (falsy): a single local process.
    The spec is immutable; ``as_dict()`` returns fresh containers.
    """

    def __init__(self, cluster: ClusterLike = None) -> None:
        self._jobs: dict[str, dict[int, str]] = {}
        if cluster is None:
            return
        if isinstance(cluster, ClusterSpec):
            self._jobs = {job: dict(tasks) for job, tasks in cluster._jobs.items()}
            return
        if not isinstance(cluster, Mapping):
            raise ClusterConfigError(
                "ClusterSpec expects a dict {job_name: [address, ...]} or "
                f"{{job_name: {{task_index: address}}}}, got {type(cluster).__name__} {cluster!r}"
            )
        for job, tasks in cluster.items():
            if not isinstance(job, str):
                raise ClusterConfigError(
                    f"ClusterSpec job names must be str, got {type(job).__name__} {job!r}"
                )
            self._jobs[job] = _job_tasks(job, tasks)
        self._jobs = dict(sorted(self._jobs.items()))

    # -- TensorFlow's API -------------------------------------------------------------------

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Jobs as lists when their indices are 0..n-1, else as ``{index: address}`` dicts."""
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            if list(tasks) == list(range(len(tasks))):
                result[job] = list(tasks.values())
            else:
                result[job] = dict(tasks)
        return result

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has (for a sparse job, the ones present, not max+1)."""
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of ``job_name``, ascending."""
        return list(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of ``job_name``."""
        tasks = self._tasks(job_name)
        if isinstance(task_index, bool) or task_index not in tasks:
            raise ClusterConfigError(
                f"ClusterSpec has no task {task_index!r} in job {job_name!r}; "
                f"expected one of its task indices {list(tasks)}"
            )
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str | None]:
        """Addresses of ``job_name`` by index, ``None`` where a sparse job has no task."""
        tasks = self._tasks(job_name)
        if not tasks:
            return []
        return [tasks.get(index) for index in range(max(tasks) + 1)]

    # -- Python protocol --------------------------------------------------------------------

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self._jobs == other._jobs
        if isinstance(other, Mapping):
            try:
                return self._jobs == ClusterSpec(other)._jobs
            except ClusterConfigError:
                return False
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to dicts, so not hashable

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    # -- helpers ----------------------------------------------------------------------------

    def _tasks(self, job_name: str) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except (KeyError, TypeError):
            pass
        hint = ""
        if isinstance(job_name, str):
            close = difflib.get_close_matches(job_name, self._jobs, n=1)
            if close:
                hint = f" (did you mean {close[0]!r}?)"
        raise ClusterConfigError(
            f"ClusterSpec has no job {job_name!r}{hint}; expected one of {self.jobs}"
        )
