"""Cluster resolvers: where this process sits in a job (TensorFlow's ``ClusterResolver`` API).

A resolver answers TF's questions (``cluster_spec()``, ``task_type``, ``task_id``, ``master()``)
and those a process group needs, which every concrete resolver implements: ``source`` (where the
description came from: ``"TF_CONFIG"``, ``"STRATAGEM_CONFIG"``, ``"torchrun"``, ``"SLURM"``,
``"explicit"`` or ``"local"``), ``rank`` and ``world_size`` among the collective members (chief
first, then workers; ``rank`` is None for ps and evaluator), ``local_rank`` (among the members
on this host), ``rendezvous_address`` (None alone), ``agent_store`` (True when torchrun's agent
already hosts the store, so rank 0 connects as a client), ``attempt`` (0 on the first run),
``is_chief``, ``peer_name(rank)`` and ``describe()``.

This module holds the base class and TensorFlow's two resolvers for JSON and explicit clusters;
``torchrun.py`` and ``slurm.py`` read those launchers' variables.
"""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Mapping
from typing import Any

from stratagem.cluster.address import GRPC_PREFIX, parse_address
from stratagem.cluster.cluster_spec import ClusterLike, ClusterSpec
from stratagem.cluster.roles import collective_members, describe_jobs, is_chief, rank_of
from stratagem.cluster.tf_config import (
    TFConfig,
    check_task_type,
    load_tf_config,
    missing_task_error,
    shorten,
    validate_cluster_spec,
    validate_task,
)
from stratagem.errors import ClusterConfigError

_INT_RE = re.compile(r"-?[0-9]+")


def env_int(
    environ: Mapping[str, str], name: str, *, minimum: int = 0, default: int | None = None
) -> int | None:
    """Environment variable ``name`` as an int >= ``minimum``; ``default`` when unset or empty."""
    text = environ.get(name, "")
    if text == "":
        return default
    if not _INT_RE.fullmatch(text.strip()):
        raise ClusterConfigError(f"{name}={text!r} is not an integer; expected an integer")
    value = int(text)
    if value < minimum:
        raise ClusterConfigError(f"{name}={value} is below {minimum}; expected >= {minimum}")
    return value


def restart_attempt(environ: Mapping[str, str], *names: str) -> int:
    """The first of ``names`` that is set, as a restart count (0 when none is)."""
    for name in names:
        value = env_int(environ, name)
        if value is not None:
            return value
    return 0


def _task_name(task_type: str | None, task_id: int | None) -> str:
    if task_type is None:
        return "the local process"
    if task_type in ("chief", "evaluator"):
        return task_type
    return f"{task_type} {task_id}"


class ClusterResolver(abc.ABC):
    """Where this process sits in a job; TensorFlow's API plus stratagem's extensions.

    ``task_type``, ``task_id``, ``rpc_layer`` and ``environment`` are plain settable attributes,
    as in TensorFlow; the derived values (``rank``, ``is_chief``...) follow them.
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str = "",
        attempt: int = 0,
    ) -> None:
        self.task_type = task_type
        self.task_id = task_id
        self.rpc_layer = rpc_layer
        self.environment = environment
        #: Restart attempt of the job this process belongs to (stratagem extension).
        self.attempt = attempt

    # -- TensorFlow's API -------------------------------------------------------------------

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster this process belongs to (empty when it runs alone)."""

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """Address of a task (default: this one), as ``rpc_layer://host:port`` when a layer is
        given (argument, else ``self.rpc_layer``); ``""`` without a cluster or a task."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        spec = self.cluster_spec()
        if task_type is None or task_id is None or not spec:
            return ""
        return _master_url(spec.task_address(task_type, task_id), rpc_layer or self.rpc_layer)

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """Accelerators per type on a task. Empty here: the cluster layer imports no torch; the
        communication layer counts devices."""
        return {}

    # -- stratagem extensions ---------------------------------------------------------------

    @property
    @abc.abstractmethod
    def source(self) -> str:
        """Where the description came from ("TF_CONFIG", "torchrun", "local"...)."""

    @property
    def rank(self) -> int | None:
        """Position among the collective members; None for ps, evaluator and other jobs.

        A cluster without a task for this process has no answer (TF's strategies refuse it
        too: "you must also specify task_type and task_id"): a ``ClusterConfigError``.
        """
        spec = self.cluster_spec()
        if not spec:
            return 0
        if self.task_type is None:
            raise missing_task_error(f"{type(self).__name__} ({self.source})", spec)
        return rank_of(self.task_type, self.task_id, spec)

    @property
    def world_size(self) -> int:
        """Number of collective members (chief and workers); 1 without a cluster."""
        return len(collective_members(self.cluster_spec())) or 1

    @property
    def local_rank(self) -> int:
        """Index among the collective members whose host string equals this task's."""
        rank = self.rank
        spec = self.cluster_spec()
        if rank is None or not spec:
            return 0
        members = collective_members(spec)
        hosts = [parse_address(spec.task_address(*member))[0] for member in members[: rank + 1]]
        return hosts[:rank].count(hosts[rank])

    @property
    def rendezvous_address(self) -> tuple[str, int] | None:
        """Rank 0's ``(host, port)``: where the rendezvous store listens; None alone."""
        spec = self.cluster_spec()
        members = collective_members(spec)
        if not members:
            return None
        return parse_address(spec.task_address(*members[0]))

    @property
    def agent_store(self) -> bool:
        """True when an outside agent hosts the rendezvous store (torchrun does)."""
        return False

    @property
    def is_chief(self) -> bool:
        """TensorFlow's chief rule: the ``chief`` task, else worker 0 without a chief job."""
        return is_chief(self.task_type, self.task_id, self.cluster_spec())

    def peer_name(self, rank: int) -> str:
        """``"worker 1 (localhost:23456)"``: who holds collective ``rank``, for error messages."""
        spec = self.cluster_spec()
        members = collective_members(spec)
        if not members and rank == 0:
            return "the local process"
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(members):
            raise ClusterConfigError(
                f"rank {rank!r} is not a collective member; expected 0..{len(members) - 1} "
                f"({describe_jobs(spec)})"
            )
        task_type, task_id = members[rank]
        return f"{_task_name(task_type, task_id)} ({spec.task_address(task_type, task_id)})"

    def describe(self) -> str:
        """``"worker 1 of 2 workers (TF_CONFIG)"``: this process in one line."""
        spec = self.cluster_spec()
        if not spec:
            return f"a single process without a cluster ({self.source})"
        task = _task_name(self.task_type, self.task_id)
        return f"{task} of {describe_jobs(spec)} ({self.source})"

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.describe()}>"


def _master_url(address: str, rpc_layer: str | None) -> str:
    if not rpc_layer:
        return address
    if address.startswith(GRPC_PREFIX):  # TF_CONFIG addresses may carry it already
        address = address[len(GRPC_PREFIX) :]
    return f"{rpc_layer}://{address}"


def _read_configs(environ: Mapping[str, str], require_task: bool) -> tuple[TFConfig, str]:
    """The config from STRATAGEM_CONFIG (preferred) or TF_CONFIG, and its variable's name.

    Both set is allowed only when they agree: otherwise which one describes this process
    is a guess, and a wrong guess joins the wrong job.
    """
    ours = environ.get("STRATAGEM_CONFIG", "")
    theirs = environ.get("TF_CONFIG", "")
    if ours.strip():
        config = load_tf_config(ours, "STRATAGEM_CONFIG", require_task=require_task)
        if theirs.strip():
            other = load_tf_config(theirs, "TF_CONFIG", require_task=require_task)
            if other != config:
                raise ClusterConfigError(
                    "STRATAGEM_CONFIG and TF_CONFIG are both set but differ: "
                    f"STRATAGEM_CONFIG={shorten(ours)!r} (task {config.task_type} "
                    f"{config.task_id}), TF_CONFIG={shorten(theirs)!r} (task {other.task_type} "
                    f"{other.task_id}); expected only one of them, or the same content in both"
                )
        return config, "STRATAGEM_CONFIG"
    return load_tf_config(theirs, "TF_CONFIG", require_task=require_task), "TF_CONFIG"


class TFConfigClusterResolver(ClusterResolver):
    """The cluster described by ``STRATAGEM_CONFIG`` if set, else ``TF_CONFIG``.

    The variables are read once, at construction (from ``environ``, default ``os.environ``;
    TensorFlow re-reads TF_CONFIG at every call). ``task_type``/``task_id``/``rpc_layer``/
    ``environment`` arguments override the JSON's, as in TensorFlow; a cluster without
    ``"task"`` is accepted, as TF does (the task is then None until set). Neither variable set
    (or ``{}``): a single local process, ``source == "local"``.
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        config, variable = _read_configs(env, require_task=False)
        spec = config.cluster_spec
        if task_type is not None:
            task_type = check_task_type(task_type, f"{variable} with task_type={task_type!r}")
        final_type = task_type if task_type is not None else config.task_type
        final_id = task_id if task_id is not None else config.task_id
        if spec and (task_type is not None or task_id is not None):
            where = f"{variable} with task_type={task_type!r}, task_id={task_id!r} given"
            final_id = validate_task(spec, final_type, final_id, where)
        super().__init__(
            task_type=final_type,
            task_id=final_id,
            rpc_layer=rpc_layer if rpc_layer is not None else config.rpc_layer,
            environment=environment if environment is not None else config.environment,
            attempt=restart_attempt(env, "STRATAGEM_RESTART_COUNT"),
        )
        self._spec = spec
        self._session_master = config.session_master
        self._source = variable if spec else "local"

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """TF's rule: the config's ``session_master`` if set; ``""`` when the cluster is empty
        or is one job of one task; else the task's address (default: this one) as
        ``rpc_layer://host:port`` when a layer is given (argument, else ``self.rpc_layer``)."""
        if self._session_master is not None:
            return self._session_master
        spec = self._spec
        if not spec or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        return super().master(task_type, task_id, rpc_layer)

    @property
    def source(self) -> str:
        return self._source


class SimpleClusterResolver(ClusterResolver):
    """A cluster given in code, as TensorFlow's ``SimpleClusterResolver`` (``source`` "explicit").

    The arguments are TensorFlow's, in its order. Addresses are checked with ``parse_address``
    (and for duplicates) like TF_CONFIG's, because ranks connect to them.
    """

    def __init__(
        self,
        cluster_spec: ClusterLike,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        spec = ClusterSpec(cluster_spec)
        where = "SimpleClusterResolver"
        if spec:
            validate_cluster_spec(spec, where)
            if task_type is not None or task_id is not None:
                task_id = validate_task(spec, task_type, task_id, where)
        env = os.environ if environ is None else environ
        super().__init__(
            task_type=task_type,
            task_id=task_id,
            rpc_layer=rpc_layer,
            environment=environment,
            attempt=restart_attempt(env, "STRATAGEM_RESTART_COUNT"),
        )
        self._spec = spec
        self._master = master
        self._num_accelerators = dict(num_accelerators or {})

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """The named task's address, else the ``master`` given at construction (as TF)."""
        if task_type is not None and task_id is not None:
            address = self._spec.task_address(task_type, task_id)
        else:
            address = self._master
        if not address:
            return ""
        return _master_url(address, rpc_layer or self.rpc_layer)

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """The ``num_accelerators`` given at construction (``{}`` by default), as TF."""
        return dict(self._num_accelerators)

    @property
    def source(self) -> str:
        return "explicit"
