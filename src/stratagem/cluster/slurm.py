"""The cluster of a SLURM step (``srun``), as TensorFlow's ``SlurmClusterResolver`` builds it.

SLURM tells each task its global id (SLURM_PROCID), the task count, the step's nodes in its
compressed hostlist syntax (``node[01-03]``) and the tasks per node (``2(x3)``). With the
default block distribution, tasks fill the nodes in order, so task i's node and local index
follow; its address is ``node:port_base + local index`` (unique per host). The tasks are then
dealt to the jobs (``{"ps": 1, "worker": 2}``) in job-name order, and each task may be given its
share of the node's GPUs through ``CUDA_VISIBLE_DEVICES``, all as TensorFlow does.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping

from stratagem.cluster.address import check_port, format_address, parse_address
from stratagem.cluster.cluster_spec import ClusterSpec
from stratagem.cluster.resolver import ClusterResolver, env_int, restart_attempt
from stratagem.cluster.tasks import plural
from stratagem.errors import ClusterConfigError

#: Default rendezvous port base (torch.distributed's customary port) plus SLURM_JOB_ID % 1000,
#: so that two jobs sharing a node rarely collide.
DEFAULT_PORT = 29500

_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TASKS_PER_NODE_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
# The step's own count first, as TF reads it (SLURM_STEP_NUM_TASKS); SLURM_NTASKS may be the
# job's request, inherited from sbatch/salloc, which a step can exceed.
_NTASKS_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS_RE = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
# A guard against "node[0-99999999]" exhausting memory; no SLURM step is this large.
_MAX_HOSTS = 1_000_000


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` at commas outside brackets, checking that brackets balance."""
    items, depth, start = [], 0, 0
    for pos, char in enumerate(text):
        if char == "[":
            if depth:
                raise ClusterConfigError(
                    f"hostlist {text!r}: nested '[' at position {pos}; "
                    f"expected groups like 'node[01-04,07]'"
                )
            depth = 1
        elif char == "]":
            if not depth:
                raise ClusterConfigError(
                    f"hostlist {text!r}: ']' at position {pos} closes nothing; "
                    f"expected groups like 'node[01-04,07]'"
                )
            depth = 0
        elif char == "," and not depth:
            items.append(text[start:pos])
            start = pos + 1
    if depth:
        raise ClusterConfigError(
            f"hostlist {text!r}: '[' is never closed; expected groups like 'node[01-04,07]'"
        )
    items.append(text[start:])
    return items


def _expand_group(group: str, text: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]``; the width of the low end is kept."""
    values: list[str] = []
    for part in group.split(","):
        match = _RANGE_RE.fullmatch(part)
        if not match:
            raise ClusterConfigError(
                f"hostlist {text!r}: {part!r} in '[{group}]' is not a number or a range "
                f"'lo-hi'; expected groups like 'node[01-04,07]'"
            )
        low_text, high_text = match.group(1), match.group(2)
        low = int(low_text)
        high = int(high_text) if high_text is not None else low
        if high < low:
            raise ClusterConfigError(
                f"hostlist {text!r}: range {part!r} runs backwards; expected lo <= hi"
            )
        if high - low >= _MAX_HOSTS:
            raise ClusterConfigError(
                f"hostlist {text!r}: range {part!r} has {high - low + 1} hosts; "
                f"expected at most {_MAX_HOSTS}"
            )
        width = len(low_text)
        values.extend(str(value).zfill(width) for value in range(low, high + 1))
    return values


def expand_hostlist(text: str) -> list[str]:
    """Expand SLURM's hostlist syntax, in order: ``"node[01-02,07],gpu5"`` ->
    ``["node01", "node02", "node07", "gpu5"]``.

    Zero padding of a range's low end is kept (``[08-10]`` -> 08, 09, 10); several bracket
    groups in one name expand as a cartesian product (``rack[1-2]-n[3-4]`` -> rack1-n3,
    rack1-n4, rack2-n3, rack2-n4).
    """
    if not isinstance(text, str) or not text:
        raise ClusterConfigError(
            f"hostlist must be a non-empty string such as 'node[01-04]', got {text!r}"
        )
    if any(char.isspace() for char in text):
        raise ClusterConfigError(
            f"hostlist {text!r} contains whitespace; expected a list like 'node[01-04],gpu5'"
        )
    hosts: list[str] = []
    for item in _split_top_level(text):
        if not item:
            raise ClusterConfigError(
                f"hostlist {text!r} has an empty entry; expected names separated by single commas"
            )
        # Alternate literal text and bracket groups: "rack[1-2]-n[3-4]" ->
        # ["rack"], ["1", "2"], ["-n"], ["3", "4"]. Brackets balance (checked above).
        pieces: list[list[str]] = []
        pos = 0
        while pos < len(item):
            if item[pos] == "[":
                close = item.index("]", pos)
                group = item[pos + 1 : close]
                if not group:
                    raise ClusterConfigError(
                        f"hostlist {text!r}: '[]' is empty; expected groups like 'node[01-04,07]'"
                    )
                pieces.append(_expand_group(group, text))
                pos = close + 1
            else:
                end = item.find("[", pos)
                end = len(item) if end < 0 else end
                pieces.append([item[pos:end]])
                pos = end
        if len(hosts) + math.prod(len(piece) for piece in pieces) > _MAX_HOSTS:
            raise ClusterConfigError(f"hostlist {text!r} expands to more than {_MAX_HOSTS} hosts")
        hosts.extend("".join(combo) for combo in itertools.product(*pieces))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's tasks-per-node syntax: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    if not isinstance(text, str) or not text:
        raise ClusterConfigError(
            f"tasks per node must be a non-empty string such as '2(x3),1', got {text!r}"
        )
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS_RE.fullmatch(part)
        if not match:
            raise ClusterConfigError(
                f"tasks per node {text!r}: {part!r} is not 'N' or 'N(xM)'; "
                f"expected a list like '2(x3),1'"
            )
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count < 1 or repeat < 1:
            raise ClusterConfigError(
                f"tasks per node {text!r}: {part!r} has a zero count; expected counts >= 1"
            )
        counts.extend([count] * repeat)
    return counts


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if environ.get(name):
            return name, environ[name]
    return None


def _task_count(environ: Mapping[str, str]) -> tuple[str, int] | None:
    found = _first_set(environ, _NTASKS_VARIABLES)
    if found is None:
        return None
    value = env_int(environ, found[0], minimum=1)
    assert value is not None
    return found[0], value


def slurm_env_present(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a task of an ``srun`` step (SLURM_PROCID and SLURM_STEP_ID set,
    with a task count > 0). A batch script outside ``srun`` is not: it is one process."""
    env = os.environ if environ is None else environ
    if not (env.get("SLURM_PROCID") and env.get("SLURM_STEP_ID")):
        return False
    found = _first_set(env, _NTASKS_VARIABLES)
    if found is None:
        return False
    text = found[1].strip()
    # A malformed count still counts as present, so that the resolver reports it.
    return not text.isdecimal() or int(text) > 0


def _even_spread(ntasks: int, nodes: int) -> list[int]:
    """SLURM's default block layout: the first ``ntasks % nodes`` nodes take one task more."""
    base, extra = divmod(ntasks, nodes)
    return [base + 1 if i < extra else base for i in range(nodes)]


def default_port_base(environ: Mapping[str, str]) -> int:
    """stratagem's port base for a SLURM step: STRATAGEM_PORT, else MASTER_PORT, else
    29500 + SLURM_JOB_ID % 1000 (so that two jobs sharing a node rarely collide)."""
    for name in ("STRATAGEM_PORT", "MASTER_PORT"):
        if environ.get(name):
            return check_port(environ[name].strip(), name)
    job_id = env_int(environ, "SLURM_JOB_ID", default=0)
    assert job_id is not None
    return DEFAULT_PORT + job_id % 1000


def _visible_devices(text: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of entries; None when unset, [] when empty."""
    if text is None:
        return None
    return [item.strip() for item in text.split(",") if item.strip()]


def count_gpus(environ: Mapping[str, str]) -> int:
    """GPUs on this node, as TF's ``get_num_gpus``: the entries of ``CUDA_VISIBLE_DEVICES`` if it
    is set, else the ``GPU`` lines of ``nvidia-smi --list-gpus``; 0 where there is no
    ``nvidia-smi`` (a CPU node; TensorFlow raises there)."""
    visible = _visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        return len(visible)
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return 0
    try:
        listing = subprocess.run(
            [executable, "--list-gpus"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise ClusterConfigError(
            f"could not count this node's GPUs with 'nvidia-smi --list-gpus' ({err}); "
            f"expected it to work, or gpus_per_node= given to SlurmClusterResolver"
        ) from None
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def _check_count(value: object, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ClusterConfigError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def _check_jobs(jobs: object) -> dict[str, int]:
    """``jobs`` as ``{name: count}`` in TF's order: sorted by job name."""
    if not isinstance(jobs, Mapping) or not jobs:
        raise ClusterConfigError(
            f"jobs must be a non-empty dict {{job_name: number_of_tasks}} such as "
            f"{{'ps': 1, 'worker': 2}}, got {jobs!r}"
        )
    checked: dict[str, int] = {}
    for name, count in jobs.items():
        if not isinstance(name, str) or not name:
            raise ClusterConfigError(f"jobs: job names must be non-empty strings, got {name!r}")
        checked[name] = _check_count(count, f"jobs[{name!r}]")
    return dict(sorted(checked.items()))


class SlurmClusterResolver(ClusterResolver):
    """TensorFlow's ``SlurmClusterResolver``: this process as task SLURM_PROCID of the step.

    The arguments are TensorFlow's, with its defaults and meaning:

    * ``jobs`` -- ``{job_name: number_of_tasks}``; the step's tasks are dealt to the jobs in
      job-name order (``{"ps": 1, "worker": 2}``: task 0 is ps 0, tasks 1 and 2 workers 0 and
      1). Default: every task a ``worker``. The counts must add up to the step's tasks.
    * ``port_base`` -- each node's first task listens on it, the next on ``port_base + 1``...
      ``None`` (a stratagem extension, what ``resolve_cluster()`` uses) takes STRATAGEM_PORT,
      else MASTER_PORT, else 29500 + SLURM_JOB_ID % 1000.
    * ``gpus_per_node`` -- default: ``CUDA_VISIBLE_DEVICES``'s entries, else ``nvidia-smi``'s
      count (0 on a node without it); ``gpus_per_task`` -- default: ``gpus_per_node`` divided
      by the most tasks on a node.
    * ``tasks_per_node`` -- an int for every node of SLURM_STEP_NODELIST, or
      ``{hostname: tasks}``; default: SLURM_STEP_TASKS_PER_NODE (``2(x3),1``).
    * ``auto_set_gpu`` -- ``cluster_spec()`` sets ``CUDA_VISIBLE_DEVICES`` to this task's GPUs
      (local task i of a node gets GPUs ``i*gpus_per_task`` onwards; where CUDA_VISIBLE_DEVICES
      was set, its entries at those positions). Nothing is set when a task gets no GPU.
    * ``rpc_layer`` -- the scheme ``master()`` puts in front of an address.

    Hosts keep SLURM's node-list order (the order SLURM places tasks in); TensorFlow sorts the
    host names, which is the same order whenever the names sort as SLURM lists them. A
    SLURM_LOCALID that disagrees with the block layout (a cyclic ``--distribution``) is an
    error rather than a wrong address. ``environ`` (default ``os.environ``) is read once, and
    is where ``CUDA_VISIBLE_DEVICES`` is set.
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int | None = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str | None = "grpc",
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        procid = env_int(env, "SLURM_PROCID", minimum=0)
        if procid is None:
            raise ClusterConfigError(
                "SLURM environment is incomplete: SLURM_PROCID not set; "
                "expected to run inside an srun step"
            )
        hosts, per_node, described = self._task_configuration(env, tasks_per_node)
        assigned = sum(per_node)
        if jobs is None:
            jobs = {"worker": assigned}
        checked_jobs = _check_jobs(jobs)
        if sum(checked_jobs.values()) != assigned:
            raise ClusterConfigError(
                f"Requested {plural(sum(checked_jobs.values()), 'task')} (jobs={checked_jobs}) but "
                f"{assigned} were assigned ({dict(zip(hosts, per_node))}); expected the job "
                f"sizes to add up to the step's tasks"
            )
        if procid >= assigned:
            raise ClusterConfigError(
                f"SLURM_PROCID={procid} is out of range for {plural(assigned, 'task')}; "
                f"expected 0..{assigned - 1}"
            )
        base = default_port_base(env) if port_base is None else check_port(port_base, "port_base")
        if base + max(per_node) - 1 > 65535:
            raise ClusterConfigError(
                f"port base {base} plus {plural(max(per_node), 'task')} per node exceeds port "
                f"65535; expected a port base <= {65536 - max(per_node)}"
            )

        addresses: list[str] = []
        placement: list[tuple[str, int]] = []  # (node, local index) by SLURM_PROCID
        for node, tasks in zip(hosts, per_node):
            for local in range(tasks):
                address = format_address(node, base + local)
                try:
                    parse_address(address)
                except ClusterConfigError as err:
                    raise ClusterConfigError(f"{described} names host {node!r}: {err}") from None
                addresses.append(address)
                placement.append((node, local))

        node, derived_local = placement[procid]
        local = env_int(env, "SLURM_LOCALID", minimum=0, default=derived_local)
        if local != derived_local:
            raise ClusterConfigError(
                f"SLURM_LOCALID={local} but block distribution places SLURM_PROCID={procid} "
                f"at local index {derived_local} on {node!r}; expected SLURM's default "
                f"--distribution=block (stratagem derives addresses from it)"
            )

        cluster: dict[str, list[str]] = {}
        start = 0
        task_type, task_id = "worker", procid
        for job, count in checked_jobs.items():
            cluster[job] = addresses[start : start + count]
            if start <= procid < start + count:
                task_type, task_id = job, procid - start
            start += count

        super().__init__(
            task_type=task_type,
            task_id=task_id,
            rpc_layer=rpc_layer,
            attempt=restart_attempt(env, "STRATAGEM_RESTART_COUNT", "SLURM_RESTART_COUNT"),
        )
        self._environ = env
        self._spec = ClusterSpec(cluster)
        self._local_rank = derived_local
        self._port_base = base
        self._max_tasks_per_node = max(per_node)
        self._visible = _visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        self._gpus_resolved = False
        self._auto_set_gpu = auto_set_gpu
        # Counting GPUs may run nvidia-smi: only when something needs the count now.
        if auto_set_gpu or gpus_per_node is not None or gpus_per_task is not None:
            self._resolve_gpus()

    @staticmethod
    def _task_configuration(
        env: Mapping[str, str],
        tasks_per_node: int | Mapping[str, int] | None,
    ) -> tuple[list[str], list[int], str]:
        """The step's hosts, the number of tasks on each (in placement order), and where the
        hosts came from (for messages)."""
        if isinstance(tasks_per_node, Mapping):
            if not tasks_per_node:
                raise ClusterConfigError(
                    "tasks_per_node={} names no host; expected {hostname: number_of_tasks}"
                )
            hosts = [str(host) for host in tasks_per_node]
            counts = [
                _check_count(count, f"tasks_per_node[{host!r}]")
                for host, count in tasks_per_node.items()
            ]
            if not sum(counts):
                raise ClusterConfigError(f"tasks_per_node={dict(tasks_per_node)} has no task")
            return hosts, counts, f"tasks_per_node={dict(tasks_per_node)!r}"
        nodelist = _first_set(env, _NODELIST_VARIABLES)
        if nodelist is None:
            raise ClusterConfigError(
                f"SLURM environment is incomplete: {' or '.join(_NODELIST_VARIABLES)} not set; "
                f"expected to run inside an srun step"
            )
        hosts = expand_hostlist(nodelist[1])
        described = f"{nodelist[0]}={nodelist[1]!r}"
        if tasks_per_node is not None:
            count = _check_count(tasks_per_node, "tasks_per_node", minimum=1)
            return hosts, [count] * len(hosts), described
        count_found = _task_count(env)
        per_node_found = _first_set(env, _TASKS_PER_NODE_VARIABLES)
        if per_node_found is None:
            if count_found is None:
                raise ClusterConfigError(
                    f"SLURM environment is incomplete: {' or '.join(_NTASKS_VARIABLES)} not set "
                    f"(nor {' or '.join(_TASKS_PER_NODE_VARIABLES)}); expected to run inside an "
                    f"srun step, or tasks_per_node= given"
                )
            return hosts, _even_spread(count_found[1], len(hosts)), described
        per_node_name, per_node_text = per_node_found
        per_node = expand_tasks_per_node(per_node_text)
        if len(per_node) != len(hosts):
            raise ClusterConfigError(
                f"{per_node_name}={per_node_text!r} gives {plural(len(per_node), 'node')} but "
                f"{nodelist[0]}={nodelist[1]!r} lists {len(hosts)}; expected one count per node"
            )
        if count_found is not None and sum(per_node) != count_found[1]:
            raise ClusterConfigError(
                f"{per_node_name}={per_node_text!r} adds up to {plural(sum(per_node), 'task')} but "
                f"{count_found[0]}={count_found[1]}; expected them to agree"
            )
        return hosts, per_node, described

    def _resolve_gpus(self) -> tuple[int, int]:
        """``(gpus_per_node, gpus_per_task)``, counting and checking them the first time."""
        if not self._gpus_resolved:
            per_node = self._gpus_per_node
            if per_node is None:
                per_node = count_gpus(self._environ)
            per_node = _check_count(per_node, "gpus_per_node")
            per_task = self._gpus_per_task
            if per_task is None:
                per_task = per_node // self._max_tasks_per_node
            per_task = _check_count(per_task, "gpus_per_task")
            if self._max_tasks_per_node * per_task > per_node:
                raise ClusterConfigError(
                    f"Requested more GPUs per node than available: {self._max_tasks_per_node} "
                    f"tasks per node x gpus_per_task={per_task} > gpus_per_node={per_node}; "
                    f"expected at most {per_node // self._max_tasks_per_node} GPUs per task"
                )
            self._gpus_per_node, self._gpus_per_task = per_node, per_task
            self._gpus_resolved = True
        assert self._gpus_per_node is not None and self._gpus_per_task is not None
        return self._gpus_per_node, self._gpus_per_task

    # -- TensorFlow's API -------------------------------------------------------------------

    def cluster_spec(self) -> ClusterSpec:
        """The step's cluster; with ``auto_set_gpu``, also sets this task's
        ``CUDA_VISIBLE_DEVICES`` (as TensorFlow does, at every call)."""
        if self._auto_set_gpu:
            gpus = self.task_gpus
            if gpus and isinstance(self._environ, MutableMapping):
                self._environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return self._spec

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this process, as TensorFlow's method."""
        return self.task_type, self.task_id

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: object = None,
    ) -> dict[str, int]:
        """``{"GPU": gpus_per_task}`` (every task gets as many, as TF); ``{}`` without GPUs."""
        per_task = self._resolve_gpus()[1]
        return {"GPU": per_task} if per_task else {}

    # -- stratagem extensions ---------------------------------------------------------------

    @property
    def task_gpus(self) -> list[str]:
        """The ``CUDA_VISIBLE_DEVICES`` entries this task gets: local task i of its node gets
        GPUs ``i*gpus_per_task`` onwards (entries of the inherited CUDA_VISIBLE_DEVICES at those
        positions, where it lists them); [] when tasks get no GPU."""
        per_task = self._resolve_gpus()[1]
        first = self._local_rank * per_task
        visible = self._visible or []
        return [
            visible[index] if index < len(visible) else str(index)
            for index in range(first, first + per_task)
        ]

    @property
    def source(self) -> str:
        return "SLURM"

    @property
    def port_base(self) -> int:
        """The port of each node's first task; the rendezvous listens on it on the first node."""
        return self._port_base

    @property
    def local_rank(self) -> int:
        """``SLURM_LOCALID``: this task's index on its node."""
        return self._local_rank
