"""The cluster of a SLURM step (``srun``): one worker per task, addresses from the node list.

SLURM tells each task its global id (SLURM_PROCID), the task count, the step's nodes in its
compressed hostlist syntax (``node[01-03]``) and the tasks per node (``2(x3)``). With the
default block distribution, tasks fill the nodes in order, so task i's node and local index
follow; its address is ``node:port_base + local index`` (unique per host).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Mapping

from stratagem.cluster.address import check_port, format_address, parse_address
from stratagem.cluster.resolver import ClusterResolver, env_int, restart_attempt
from stratagem.cluster.spec import ClusterSpec
from stratagem.errors import ClusterConfigError

#: Default rendezvous port base (torch.distributed's customary port) plus SLURM_JOB_ID % 1000,
#: so that two jobs sharing a node rarely collide.
DEFAULT_PORT = 29500

_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TASKS_PER_NODE_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_NTASKS_VARIABLES = ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")
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


def _port_base(environ: Mapping[str, str], port_base: int | None) -> int:
    if port_base is not None:
        return check_port(port_base, "port_base")
    for name in ("STRATAGEM_PORT", "MASTER_PORT"):
        if environ.get(name):
            return check_port(environ[name].strip(), name)
    job_id = env_int(environ, "SLURM_JOB_ID", default=0)
    assert job_id is not None
    return DEFAULT_PORT + job_id % 1000


class SlurmClusterResolver(ClusterResolver):
    """This process as worker SLURM_PROCID of the step's SLURM_NTASKS workers.

    Assumes SLURM's default block distribution; a SLURM_LOCALID that disagrees with it (a
    cyclic ``--distribution``) is an error rather than a wrong address.
    """

    def __init__(
        self, *, port_base: int | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        env = os.environ if environ is None else environ
        procid = env_int(env, "SLURM_PROCID", minimum=0)
        count = _task_count(env)
        nodelist = _first_set(env, _NODELIST_VARIABLES)
        missing = [
            name
            for name, value in (
                ("SLURM_PROCID", procid),
                (" or ".join(_NTASKS_VARIABLES), count),
                (" or ".join(_NODELIST_VARIABLES), nodelist),
            )
            if value is None
        ]
        if missing:
            raise ClusterConfigError(
                f"SLURM environment is incomplete: {'; '.join(missing)} not set; "
                f"expected to run inside an srun step"
            )
        assert procid is not None and count is not None and nodelist is not None
        ntasks_name, ntasks = count
        if procid >= ntasks:
            raise ClusterConfigError(
                f"SLURM_PROCID={procid} is out of range for {ntasks_name}={ntasks}; "
                f"expected 0..{ntasks - 1}"
            )
        nodes = expand_hostlist(nodelist[1])
        per_node_found = _first_set(env, _TASKS_PER_NODE_VARIABLES)
        if per_node_found is None:
            per_node = _even_spread(ntasks, len(nodes))
        else:
            per_node_name, per_node_text = per_node_found
            per_node = expand_tasks_per_node(per_node_text)
            if len(per_node) != len(nodes):
                raise ClusterConfigError(
                    f"{per_node_name}={per_node_text!r} gives {len(per_node)} nodes but "
                    f"{nodelist[0]}={nodelist[1]!r} lists {len(nodes)}; expected one count per node"
                )
            if sum(per_node) != ntasks:
                raise ClusterConfigError(
                    f"{per_node_name}={per_node_text!r} adds up to {sum(per_node)} tasks but "
                    f"{ntasks_name}={ntasks}; expected them to agree"
                )
        base = _port_base(env, port_base)
        if base + max(per_node) - 1 > 65535:
            raise ClusterConfigError(
                f"port base {base} plus {max(per_node)} tasks per node exceeds port 65535; "
                f"expected a port base <= {65536 - max(per_node)}"
            )

        addresses: list[str] = []
        placement: list[tuple[str, int]] = []  # (node, local index) by SLURM_PROCID
        for node, tasks in zip(nodes, per_node):
            for local in range(tasks):
                address = format_address(node, base + local)
                try:
                    parse_address(address)
                except ClusterConfigError as err:
                    raise ClusterConfigError(
                        f"{nodelist[0]}={nodelist[1]!r} names host {node!r}: {err}"
                    ) from None
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
        super().__init__(
            task_type="worker",
            task_id=procid,
            attempt=restart_attempt(env, "STRATAGEM_RESTART_COUNT", "SLURM_RESTART_COUNT"),
        )
        self._spec = ClusterSpec({"worker": addresses})
        self._local_rank = derived_local
        self._port_base = base

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

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
