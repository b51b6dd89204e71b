"""Parsing and validation of ``TF_CONFIG`` (and ``STRATAGEM_CONFIG``, the same format).

``TF_CONFIG`` is JSON like ``{"cluster": {"worker": ["localhost:12345", "localhost:23456"]},
"task": {"type": "worker", "index": 0}}``. Every mistake is a ``ClusterConfigError`` that names
the variable, quotes the offending value and says what was expected, before any process
connects. Where TensorFlow is silent or lax: an empty string, whitespace or ``{}`` means no
cluster (one local process); a ``task`` without a ``cluster`` is an error; ``task.index`` is an
int or a string of decimal digits (not ``true``, ``1.0`` or ``"-1"``); duplicate addresses are
compared as strings (``localhost:1`` is not ``127.0.0.1:1``; a leading ``grpc://`` is ignored).
Accepted as TensorFlow accepts them: any job name (which jobs a strategy can use is
``roles.check_task_types``), an integer ``task.type`` (read as its string), an ``evaluator``
task the cluster does not list, ``rpc_layer`` (``""`` for none) and ``session_master``; unknown
top-level keys are ignored.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stratagem.cluster.address import parse_address
from stratagem.cluster.cluster_spec import ClusterSpec
from stratagem.cluster.roles import TASK_TYPES
from stratagem.errors import ClusterConfigError

_EXAMPLE = (
    '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


@dataclass(frozen=True)
class TFConfig:
    """A parsed, validated TF_CONFIG. ``task_type``/``task_id`` are None without a cluster."""

    cluster_spec: ClusterSpec
    task_type: str | None
    task_id: int | None
    rpc_layer: str | None
    environment: str
    #: TF's ``"session_master"`` key: what ``master()`` returns when set.
    session_master: str | None = None


def shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (with ``...``) so errors stay readable."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _suggest(name: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _position(job: str, index: int) -> str:
    return f"cluster.{job}[{index}]"


def validate_cluster_spec(spec: ClusterSpec, source: str) -> None:
    """Check what a job needs before processes connect: at least one task per job, parseable
    unique addresses, at most one chief and one evaluator (TF's ``_validate_cluster_spec``).

    Any job name is accepted, as TensorFlow does. ``source`` ("TF_CONFIG",
    "SimpleClusterResolver") starts every message.
    """
    seen: dict[tuple[str, int], str] = {}
    for job in spec.jobs:
        if not job:
            raise ClusterConfigError(
                f"{source}: cluster has a job with an empty name; expected names such as "
                f"{list(TASK_TYPES)}"
            )
        if spec.num_tasks(job) == 0:
            raise ClusterConfigError(
                f"{source}: cluster.{job} is empty; expected at least one 'host:port' address "
                f"(or leave the job out)"
            )
        for index in spec.task_indices(job):
            address = spec.task_address(job, index)
            where = _position(job, index)
            try:
                parsed = parse_address(address)
            except ClusterConfigError as err:
                raise ClusterConfigError(f"{source}: {where}: {err}") from None
            if parsed in seen:
                raise ClusterConfigError(
                    f"{source}: {seen[parsed]} and {where} have the same address {address!r}; "
                    f"expected every task to have its own host:port"
                )
            seen[parsed] = where
    for job in ("chief", "evaluator"):
        if job in spec.jobs and spec.num_tasks(job) > 1:
            raise ClusterConfigError(
                f"{source}: cluster.{job} has {spec.num_tasks(job)} tasks "
                f"{[a for a in spec.job_tasks(job) if a is not None]}; expected at most one {job}"
            )


def check_task_index(value: object, source: str) -> int:
    """``task.index`` as an int: an int (not a bool) or a string of decimal digits."""
    if isinstance(value, str) and value.isascii() and value.isdecimal():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterConfigError(
            f"{source}: task.index must be a non-negative integer, "
            f"got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ClusterConfigError(
            f"{source}: task.index must be a non-negative integer, got {value}"
        )
    return value


def check_task_type(value: object, source: str) -> str:
    """``task.type`` as a string: a string, or an int read as its digits (TF casts with ``str``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise ClusterConfigError(
            f"{source}: task.type must be a job name such as 'worker', "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def validate_task(spec: ClusterSpec, task_type: object, task_id: object, source: str) -> int:
    """Check that ``(task_type, task_id)`` is a task of ``spec``; return the index as an int.

    An ``evaluator`` the cluster does not list is accepted (index 0: there is at most one), as
    TF's ``multi_worker_util._validate_cluster_spec`` accepts it.
    """
    task_type = check_task_type(task_type, source)
    if task_type == "evaluator" and task_type not in spec.jobs:
        index = check_task_index(task_id, source)
        if index != 0:
            raise ClusterConfigError(
                f"{source}: task.index {index} for an evaluator the cluster does not list; "
                f"expected 0 (there is at most one evaluator)"
            )
        return index
    if task_type not in spec.jobs:
        jobs = spec.jobs
        have = f"one of the cluster's jobs {jobs}" if jobs else "a job, but the cluster is empty"
        raise ClusterConfigError(
            f"{source}: task.type {task_type!r} is not a job of the cluster"
            f"{_suggest(task_type, jobs)}; expected {have}"
        )
    index = check_task_index(task_id, source)
    indices = spec.task_indices(task_type)
    if index not in indices:
        if indices == list(range(len(indices))):
            valid = f"0..{len(indices) - 1}"
        else:
            valid = f"one of {indices}"
        raise ClusterConfigError(
            f"{source}: task.index {index} is out of range for job {task_type!r} with "
            f"{len(indices)} task{'' if len(indices) == 1 else 's'}; expected {valid}"
        )
    return index


def _raw_cluster(cluster: object, source: str) -> ClusterSpec:
    """Check the JSON shapes of ``cluster`` with positions in the messages; build the spec."""
    if not isinstance(cluster, dict):
        raise ClusterConfigError(
            f'{source}: "cluster" must be an object {{job_name: ["host:port", ...]}}, '
            f"got {type(cluster).__name__} {cluster!r}"
        )
    jobs: dict[str, list[str] | dict[int, str]] = {}
    for job, tasks in cluster.items():
        if isinstance(tasks, list):
            items: list[tuple[Any, Any]] = list(enumerate(tasks))
        elif isinstance(tasks, dict):
            items = list(tasks.items())
        else:
            raise ClusterConfigError(
                f'{source}: cluster.{job} must be a list ["host:port", ...] or an object '
                f'{{"index": "host:port"}}, got {type(tasks).__name__} {tasks!r}'
            )
        if not items:
            raise ClusterConfigError(
                f"{source}: cluster.{job} is empty; expected at least one 'host:port' address "
                f"(or leave the job out)"
            )
        for key, address in items:
            if isinstance(tasks, dict) and not (key.isascii() and key.isdecimal()):
                raise ClusterConfigError(
                    f"{source}: cluster.{job} key {key!r} is not a task index; "
                    f'expected non-negative integers such as {{"0": "host:port"}}'
                )
            if not isinstance(address, str):
                raise ClusterConfigError(
                    f"{source}: cluster.{job}[{key}] must be a 'host:port' string, "
                    f"got {type(address).__name__} {address!r}"
                )
        if isinstance(tasks, list):
            jobs[job] = tasks
            continue
        sparse: dict[int, str] = {}
        for key, address in items:
            if int(key) in sparse:  # "1" and "01": JSON keeps both, they are one index
                raise ClusterConfigError(
                    f"{source}: cluster.{job} gives task index {int(key)} twice "
                    f"({sparse[int(key)]!r} and {address!r}); expected each index once"
                )
            sparse[int(key)] = address
        jobs[job] = sparse
    return ClusterSpec(jobs)


def _optional_str(data: Mapping[str, Any], key: str, source: str) -> str | None:
    value = data.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ClusterConfigError(
            f'{source}: "{key}" must be a string, got {type(value).__name__} {value!r}'
        )
    return value


def load_tf_config(text: str, source: str = "TF_CONFIG", *, require_task: bool = True) -> TFConfig:
    """Parse and validate a TF_CONFIG string into a ``TFConfig``.

    ``require_task=False`` lets a non-empty cluster come without ``"task"``, as TensorFlow's
    ``TFConfigClusterResolver`` allows (its task is then None, or what the caller names).
    """
    if not isinstance(text, str):
        raise ClusterConfigError(
            f"{source} must be a JSON string, got {type(text).__name__} {text!r}"
        )
    empty = TFConfig(ClusterSpec(), None, None, None, "")
    if not text.strip():
        return empty
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ClusterConfigError(
            f"{source} is not valid JSON ({err}); received {shorten(text)!r}; "
            f"expected a JSON object like {_EXAMPLE}"
        ) from None
    if not isinstance(data, dict):
        raise ClusterConfigError(
            f"{source} must be a JSON object, got {type(data).__name__} {shorten(text)!r}; "
            f"expected a JSON object like {_EXAMPLE}"
        )
    if not data:
        return empty
    if "cluster" not in data:
        raise ClusterConfigError(
            f'{source} has no "cluster" (keys: {sorted(data)}); received {shorten(text)!r}; '
            f"expected a JSON object like {_EXAMPLE}"
        )
    spec = _raw_cluster(data["cluster"], source)
    validate_cluster_spec(spec, source)
    rpc_layer = _optional_str(data, "rpc_layer", source)
    environment = _optional_str(data, "environment", source) or ""
    session_master = _optional_str(data, "session_master", source)

    if "task" not in data:
        if spec and require_task:
            raise missing_task_error(source, spec)
        return TFConfig(spec, None, None, rpc_layer, environment, session_master)
    task = data["task"]
    if not isinstance(task, dict):
        raise ClusterConfigError(
            f'{source}: "task" must be an object {{"type": ..., "index": ...}}, '
            f"got {type(task).__name__} {task!r}"
        )
    missing = [key for key in ("type", "index") if key not in task]
    if missing:
        raise ClusterConfigError(
            f'{source}: "task" {task!r} has no {" or ".join(repr(k) for k in missing)}; '
            f'expected {{"type": "worker", "index": 0}}'
        )
    task_id = validate_task(spec, task["type"], task["index"], source)
    task_type = check_task_type(task["type"], source)
    return TFConfig(spec, task_type, task_id, rpc_layer, environment, session_master)


def missing_task_error(source: str, spec: ClusterSpec) -> ClusterConfigError:
    """The error for a cluster that names no task for this process."""
    return ClusterConfigError(
        f"{source} describes a cluster ({shorten(repr(spec.as_dict()))}) but no "
        f'"task"; expected "task": {{"type": <one of {spec.jobs}>, "index": <int>}} '
        f"saying which task this process is (or task_type= and task_id= given to the resolver)"
    )


def parse_tf_config(
    text: str, source: str = "TF_CONFIG"
) -> tuple[ClusterSpec, str | None, int | None, str | None]:
    """Parse a TF_CONFIG string into ``(cluster_spec, task_type, task_id, rpc_layer)``.

    Empty text or ``{}`` gives an empty spec and ``None`` task. Every invalid input raises
    ``ClusterConfigError`` naming ``source``; see the module docstring for the rules.
    """
    config = load_tf_config(text, source)
    return config.cluster_spec, config.task_type, config.task_id, config.rpc_layer
