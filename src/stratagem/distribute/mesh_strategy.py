"""MeshStrategy: the Strategy interface over a DTensor mesh, for custom loops and ``Model.fit``.

1. The mesh comes from ``sg.dtensor.create_mesh`` (one process per device). Its ``batch``
   dimension (``batch_dim_name``) holds the data-parallel replicas; processes that differ only
   along other dimensions (``model``) are parts of one replica and see the same data.
2. Scope: parameters are laid out by ``layout_map`` (regex paths → layouts; unmatched, or no
   map: replicated) when the model is whole: at the scope's end, when ``sg.keras.Model(module)``
   takes it, or at the first step inside the scope. An optimizer made before is re-pointed.
3. ``run(fn, args)``: each replica's part of the batch becomes one DTensor split along ``batch``
   (``torch.chunk``'s cut); DTensor decides every collective. Results come back per replica, as
   under every other strategy, so ``reduce``, metrics and the loss convention work unchanged
   (``reduce``, ``gather`` and metrics communicate among the replicas only).
4. A step runs under ``dtensor.mesh_step``: tensors made inside ``forward`` are replicated, and
   an operator DTensor cannot shard is a named ``ShardingRuleError``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from typing_extensions import override

from stratagem.comm import Communicator, LocalCommunicator
from stratagem.comm.process_group import (
    GroupCommunicator,
    ProcessGroupCommunicator,
    live_connection,
)
from stratagem.distribute.capabilities import DefersGradients
from stratagem.distribute.machinery.input import (
    chunk_sizes,
    record_global_batch_size,
    recorded_global_batch_size,
)
from stratagem.distribute.machinery.replica_devices import ReplicaDevice
from stratagem.distribute.strategy import Strategy
from stratagem.distribute.whole_modules import WholeModulesExtended
from stratagem.dtensor import (
    Layout,
    LayoutMap,
    Mesh,
    MeshError,
    apply_layout_map,
    mesh_step,
    translate,
)


class MeshStrategy(Strategy):
    """``sg.distribute.experimental.MeshStrategy(mesh, layout_map=None, batch_dim_name=...)``."""

    def __init__(
        self,
        mesh: Mesh,
        layout_map: LayoutMap | None = None,
        batch_dim_name: str = "batch",
    ) -> None:
        extended = MeshExtended(self, mesh, layout_map, batch_dim_name)
        super().__init__(extended)
        self.mesh = mesh
        self.layout_map = extended.layout_map
        self.batch_dim_name = batch_dim_name

    def __repr__(self) -> str:
        return (
            f"MeshStrategy({self.mesh}, batch_dim_name={self.batch_dim_name!r}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class MeshExtended(WholeModulesExtended, DefersGradients):
    """Weights laid out by a LayoutMap; steps on global DTensors split along ``batch``."""

    def __init__(
        self,
        container: Strategy,
        mesh: Mesh,
        layout_map: LayoutMap | None,
        batch_dim_name: str,
    ) -> None:
        if not isinstance(mesh, Mesh):
            raise MeshError(
                f"MeshStrategy needs a sg.dtensor.Mesh (sg.dtensor.create_mesh(...)), got "
                f"{type(mesh).__name__}"
            )
        if not mesh.contains_dim(batch_dim_name):
            raise MeshError(
                f"MeshStrategy: mesh {mesh} has no dimension {batch_dim_name!r} to split batches "
                f"along; its dimensions are {list(mesh.dim_names)} (pass batch_dim_name=)"
            )
        if layout_map is None:
            layout_map = LayoutMap(mesh)
        elif not isinstance(layout_map, LayoutMap) or layout_map.mesh != mesh:
            raise MeshError(
                f"MeshStrategy: layout_map must be a sg.dtensor.LayoutMap on {mesh}, got "
                f"{layout_map!r}"
            )
        self.mesh = mesh
        self.layout_map = layout_map
        self.batch_dim_name = batch_dim_name
        self._batch_rows: int | None = None  # the global batch of the run under way
        device = torch.device(mesh.device_type)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self._job = _job_communicator(mesh)
        super().__init__(
            container,
            [ReplicaDevice(str(device), device)],
            comm=_replica_communicator(mesh, batch_dim_name, self._job),
        )

    @override
    def barrier(self, what: str) -> None:
        # Every process of the job, not just the replicas: a model-parallel peer of another
        # replica must also wait for the chief's write.
        self._job.barrier(what=what)

    @override
    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "mesh": dict(zip(self.mesh.dim_names, self.mesh.shape)),
            "batch_dim_name": self.batch_dim_name,
        }

    # ------------------------------------------------------------------ placement

    # A mesh owns what it lays out (DTensors); buffers it leaves local are no one's.
    claims_buffers_in_scope = False

    @override
    def distribute_whole(self, module: torch.nn.Module) -> None:
        """Lay ``module`` out (in place; again is a no-op) and claim its DTensors."""
        with self.replacing_parameters(module):
            apply_layout_map(module, self.layout_map)

    @override
    def owns_after(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, DTensor)

    @override
    def defer_gradient_reduction(self, defer: bool) -> None:
        if defer:
            raise NotImplementedError(
                "MeshStrategy cannot accumulate gradients without reducing them "
                "(accumulate_gradients(), gradient_accumulation_steps): DTensor reduces each "
                "gradient inside backward itself. Accumulate in one pass instead (a larger "
                "batch), or use MultiWorkerMirroredStrategy or FullyShardedStrategy"
            )

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.repoint(
            optimizer,
            what_happened="MeshStrategy laid the model out on the mesh",
            remedy="create the optimizer over the laid-out model (after a step or the scope's "
            "end), or lay the model out first with strategy.distribute_module(model)",
        )

    # ------------------------------------------------------------------ run

    # ``fn`` runs on global DTensors split along ``batch``; results per replica (see above).

    @override
    def _run_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._to_mesh((args, kwargs))

    @override
    def _run_guard(self) -> contextlib.AbstractContextManager[None]:
        stack = contextlib.ExitStack()
        # DTensor runs its collectives itself: a lost or stuck peer is named all the same
        # (and an error of this process's own, such as the next one, stays itself).
        stack.enter_context(self._job.named_faults("DTensor's collectives", what="the step"))
        stack.enter_context(
            mesh_step.named_operator_errors(self.mesh.dim_names, self.batch_dim_name)
        )
        stack.enter_context(mesh_step.shardable_attention(self.mesh.device_type))
        # Tensors the model makes in forward (position ids, masks) are the same everywhere.
        stack.enter_context(mesh_step.replicated_plain_tensors())
        return stack

    @override
    def _leave_run(self) -> None:
        self._batch_rows = None

    def _to_mesh(self, structure: Any) -> Any:
        """Each tensor of this replica's batch → one DTensor of the global batch."""
        leaves = [t for t in pytree.tree_leaves(structure) if _is_batch_part(t)]
        if not leaves:
            return structure
        replicas = self.num_replicas_in_sync
        rows = leaves[0].shape[0]
        total = recorded_global_batch_size(structure)
        if total is None:  # not from a distributed dataset: ask the other replicas
            sizes = self._comm.all_gather(torch.tensor([rows]), what="the replicas' batch sizes")
            total = int(sum(int(s) for s in sizes))
        self._batch_rows = total
        expected = chunk_sizes(total, replicas)[self._comm.rank]
        device = self._devices[0].torch_device

        def to_mesh(t: Any) -> Any:
            if not _is_batch_part(t):
                return t
            if t.shape[0] != expected:
                raise ValueError(
                    f"replica {self._comm.rank} of {replicas} holds {t.shape[0]} examples of a "
                    f"global batch of {total}; a mesh cuts a batch along "
                    f"{self.batch_dim_name!r} as torch.chunk does, {chunk_sizes(total, replicas)}"
                    " (strategy.experimental_distribute_dataset cuts it so)"
                )
            layout = Layout.batch_sharded(self.mesh, self.batch_dim_name, t.dim())
            laid = translate.batch_part_to_mesh(t.to(device), layout, total)
            record_global_batch_size(laid, total)
            return laid

        return pytree.tree_map(to_mesh, structure)

    @override
    def replica_values(self, structure: Any) -> Any:
        """DTensors → this replica's own value (``translate.replica_part``)."""
        rows = self._batch_rows

        def local(t: Any) -> Any:
            if not isinstance(t, DTensor):
                return t
            return translate.replica_part(t, self.mesh, self.batch_dim_name, rows)

        return pytree.tree_map(local, structure)

    @override
    def split_sizes(self, total: int, parts: int, full: int | None = None) -> list[int]:
        return chunk_sizes(total, parts)  # DTensor's cut of this batch, whatever ``full`` is


def _is_batch_part(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0


def _job_communicator(mesh: Mesh) -> Communicator:
    """The connection of the whole job the mesh spans (``create_mesh`` started it), or a local
    one where stratagem started none (a mesh of one, or a group torch was given elsewhere)."""
    job = live_connection()
    return job if job is not None else LocalCommunicator()


def _replica_communicator(mesh: Mesh, batch_dim_name: str, job: Communicator) -> Communicator:
    """Collectives among the replicas: the processes along ``batch`` with this one's other
    coordinates (every group computes the same values, so reducing within one suffices)."""
    if mesh.dim_size(batch_dim_name) == 1:
        return LocalCommunicator()
    if not isinstance(job, ProcessGroupCommunicator):
        raise MeshError(
            f"MeshStrategy over {mesh}: torch.distributed was started outside stratagem "
            f"({dist.get_world_size()} processes), so the job has no stratagem communicator; "
            "let sg.dtensor.create_mesh start it (stratagem run, TF_CONFIG, torchrun or SLURM)"
        )
    return GroupCommunicator(job, mesh.device_mesh.get_group(batch_dim_name))
