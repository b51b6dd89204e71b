"""Task roles (chief, worker, ps, evaluator) and the rank order of all-reduce strategies.

TensorFlow's rules, kept exactly so that ported code decides "am I the chief?" the same way:
the chief is the ``chief`` task, else ``worker`` 0 when the cluster has no ``chief`` job. The
all-reduce strategies number their members chief first, then workers by index; ``ps``,
``evaluator`` and tasks of any other job take no part in collectives.

TensorFlow has two chief rules that differ on the evaluator: Keras's
``distributed_file_utils._is_chief`` (who writes checkpoints and logs: never the evaluator)
and ``multi_worker_util.is_chief`` (where the evaluator, alone in its own partition, is "chief
of itself"). stratagem's ``is_chief`` decides who writes, so it is Keras's; an evaluator writes
its own files anyway because it runs alone (a one-replica strategy).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection

from stratagem.cluster.cluster_spec import ClusterLike, ClusterSpec
from stratagem.errors import ClusterConfigError

#: The task types TensorFlow's strategies know, in the order messages list them.
TASK_TYPES = ("chief", "worker", "ps", "evaluator")

#: Task types that join collectives (all-reduce, broadcast), in rank order.
COLLECTIVE_TASK_TYPES = ("chief", "worker")


def is_chief(task_type: str | None, task_id: int | None, cluster_spec: ClusterLike) -> bool:
    """Whether a task is the chief: Keras's ``distributed_file_utils._is_chief`` rule, exactly.

    ``task_type`` None (no cluster, a single process) is the chief; so is the ``chief`` task;
    so is ``worker`` 0 when the cluster has no ``chief`` job. Nothing else is (``ps``,
    ``evaluator``, other jobs). Like Keras's, it checks nothing: the resolvers validate tasks
    (as TF's ``multi_worker_util._validate_cluster_spec``) when they are built.
    """
    return (
        task_type is None
        or task_type == "chief"
        or (
            task_type == "worker" and task_id == 0 and "chief" not in ClusterSpec(cluster_spec).jobs
        )
    )


def is_coordinated(cluster_spec: ClusterLike) -> bool:
    """Whether the cluster trains TF2's way: a ``chief`` coordinates (``ClusterCoordinator``)
    and its ``worker`` tasks serve it. Without a chief every worker runs the loop itself
    (between-graph parameter servers, collectives)."""
    jobs = ClusterSpec(cluster_spec).jobs
    return "chief" in jobs and "worker" in jobs


def _suggest(name: str, choices: Collection[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def collective_members(cluster_spec: ClusterLike) -> list[tuple[str, int]]:
    """``(task_type, task_id)`` of the tasks that join collectives, in rank order.

    The chief (if any) is rank 0, then the workers by ascending index. Sparse worker jobs keep
    their indices, so worker 3 of ``{"worker": {1: ..., 3: ...}}`` is rank 1.
    """
    spec = ClusterSpec(cluster_spec)
    return [
        (job, index)
        for job in COLLECTIVE_TASK_TYPES
        if job in spec.jobs
        for index in spec.task_indices(job)
    ]


def rank_of(task_type: str | None, task_id: int | None, cluster_spec: ClusterLike) -> int | None:
    """The collective rank of a task; None for tasks outside collectives (``ps``,
    ``evaluator``, any other job).

    ``task_type`` None (a process outside any cluster) is rank 0 of a world of one.
    """
    if task_type is None:
        return 0
    if task_type not in COLLECTIVE_TASK_TYPES:
        return None
    members = collective_members(cluster_spec)
    try:
        return members.index((task_type, task_id))  # type: ignore[arg-type]
    except ValueError:
        raise ClusterConfigError(
            f"task {task_type} {task_id!r} is not in the cluster; "
            f"its collective tasks are {members}"
        ) from None


def describe_jobs(cluster_spec: ClusterLike) -> str:
    """``"1 chief, 2 workers, 1 ps"``: the size of each job, in ``TASK_TYPES`` order."""
    spec = ClusterSpec(cluster_spec)
    order = [job for job in TASK_TYPES if job in spec.jobs]
    order += [job for job in spec.jobs if job not in TASK_TYPES]
    parts = []
    for job in order:
        count = spec.num_tasks(job)
        plural = "" if count == 1 or job == "ps" else "s"
        parts.append(f"{count} {job}{plural}")
    return ", ".join(parts) if parts else "no tasks"


def check_task_types(
    cluster_spec: ClusterLike, allowed: Collection[str], strategy_name: str
) -> None:
    """Raise ``ClusterConfigError`` if the cluster has a job ``strategy_name`` cannot use.

    For example ``MultiWorkerMirroredStrategy cannot use task type 'ps' (cluster has ps:
    1 task); it uses chief, worker, evaluator``.
    """
    spec = ClusterSpec(cluster_spec)
    bad = [job for job in spec.jobs if job not in allowed]
    if not bad:
        return
    bad.sort(key=lambda job: (TASK_TYPES.index(job) if job in TASK_TYPES else len(TASK_TYPES), job))
    names = ", ".join(repr(job) for job in bad)
    counts = ", ".join(
        f"{job}: {spec.num_tasks(job)} task{'' if spec.num_tasks(job) == 1 else 's'}" for job in bad
    )
    known = [job for job in TASK_TYPES if job in allowed]
    known += sorted(job for job in allowed if job not in TASK_TYPES)
    noun = "task type" if len(bad) == 1 else "task types"
    hints = "".join(_suggest(job, allowed) for job in bad if job not in TASK_TYPES)
    raise ClusterConfigError(
        f"{strategy_name} cannot use {noun} {names}{hints} (cluster has {counts}); "
        f"it uses {', '.join(known)}"
    )
