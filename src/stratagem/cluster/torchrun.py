"""The cluster torchrun describes through RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.

torchrun publishes only rank 0's address (MASTER_ADDR:MASTER_PORT, where its agent hosts the
rendezvous store), so the cluster spec is ``{"worker": [master, "<torchrun rank 1>", ...]}``:
the placeholders say honestly that the other addresses are unknown.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from stratagem.cluster.address import check_port, format_address, parse_address
from stratagem.cluster.cluster_spec import ClusterSpec
from stratagem.cluster.resolver import ClusterResolver, env_int, restart_attempt
from stratagem.errors import ClusterConfigError

#: Variables torchrun always sets for its workers; all are needed to join its job.
REQUIRED_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


#: Set by stratagem's elastic agent in every worker it starts: the round's number, which names
#: the workers' own space in the store (a membership change starts workers without a restart).
ELASTIC_ROUND_VARIABLE = "STRATAGEM_ELASTIC_ROUND"
#: Set by the elastic agent in the workers of a round that follows a membership change: what
#: happened, in words, which the job's chief prints where it resumes.
ELASTIC_CHANGE_VARIABLE = "STRATAGEM_ELASTIC_CHANGE"


def torchrun_env_present(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process looks started by torchrun (``RANK`` or ``WORLD_SIZE`` set).

    ``MASTER_ADDR``/``MASTER_PORT`` alone do not count: users set them for other launchers
    (SLURM scripts do), and they mean nothing without a rank.
    """
    env = os.environ if environ is None else environ
    return bool(env.get("RANK") or env.get("WORLD_SIZE"))


def placeholder_address(rank: int) -> str:
    """The stand-in for an address torchrun does not publish."""
    return f"<torchrun rank {rank}>"


def _truthy(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes")


class TorchrunClusterResolver(ClusterResolver):
    """This process as one of torchrun's WORLD_SIZE workers (task_type "worker", id RANK)."""

    def __init__(self, *, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        missing = [name for name in REQUIRED_VARIABLES if not env.get(name)]
        if missing:
            have = {name: env[name] for name in REQUIRED_VARIABLES if env.get(name)}
            raise ClusterConfigError(
                f"torchrun environment is incomplete: {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set (set: {have or 'none'}); "
                f"expected all of {', '.join(REQUIRED_VARIABLES)} (LOCAL_RANK is optional)"
            )
        world_size = env_int(env, "WORLD_SIZE", minimum=1)
        rank = env_int(env, "RANK", minimum=0)
        local_rank = env_int(env, "LOCAL_RANK", minimum=0, default=0)
        assert world_size is not None and rank is not None and local_rank is not None
        if rank >= world_size:
            raise ClusterConfigError(
                f"RANK={rank} is out of range for WORLD_SIZE={world_size}; "
                f"expected 0..{world_size - 1}"
            )
        if local_rank >= world_size:
            raise ClusterConfigError(
                f"LOCAL_RANK={local_rank} is out of range for WORLD_SIZE={world_size}; "
                f"expected 0..{world_size - 1}"
            )
        port = check_port(env["MASTER_PORT"].strip(), "MASTER_PORT")
        host = env["MASTER_ADDR"].strip()
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        try:
            address = format_address(host, port)
            self._master_addr = parse_address(address)
        except ClusterConfigError as err:
            raise ClusterConfigError(
                f"MASTER_ADDR={env['MASTER_ADDR']!r} is not a host name or IP address: {err}"
            ) from None
        super().__init__(
            task_type="worker",
            task_id=rank,
            # Our elastic agent's round: a membership change starts new workers without a restart.
            attempt=restart_attempt(
                env,
                ELASTIC_ROUND_VARIABLE,
                "TORCHELASTIC_RESTART_COUNT",
                "STRATAGEM_RESTART_COUNT",
            ),
        )
        self._spec = ClusterSpec(
            {"worker": [address] + [placeholder_address(i) for i in range(1, world_size)]}
        )
        self._local_rank = local_rank
        self._agent_store = _truthy(env.get("TORCHELASTIC_USE_AGENT_STORE", ""))

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """As the base class, but ``""`` for the workers whose address torchrun does not tell."""
        address = super().master(task_type, task_id, rpc_layer)
        return "" if address.split("://")[-1].startswith("<torchrun") else address

    @property
    def source(self) -> str:
        return "torchrun"

    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK`` (0 when unset)."""
        return self._local_rank

    @property
    def rendezvous_address(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)``."""
        return self._master_addr

    @property
    def agent_store(self) -> bool:
        """``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun's agent already hosts the store."""
        return self._agent_store

    def peer_name(self, rank: int) -> str:
        """``"rank 1"`` (torchrun tells no other addresses); rank 0 with MASTER_ADDR:PORT."""
        world = self.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ClusterConfigError(
                f"rank {rank!r} is not in the torchrun job; expected 0..{world - 1}"
            )
        if rank == 0:
            return f"rank 0 ({self._spec.task_address('worker', 0)})"
        return f"rank {rank}"
