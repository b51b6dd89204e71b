"""FullyShardedStrategy: sharded data parallelism (ZeRO-3 / ZeRO-2, HSDP) on PyTorch's FSDP2.

1. Cluster and process group as for MultiWorkerMirroredStrategy: one process per device, each a
   data-parallel replica; parameters sharded over a 1-D mesh of the job (``shard``), or a 2-D
   ``mesh`` ``("replicate", "shard")`` for HSDP.
2. Scope: each model built inside is sharded with ``fully_shard`` when the scope ends (or
   ``sg.keras.Model(module)`` takes it, or a step comes inside the scope): the chief's initial
   values broadcast first, then every top-level child holding parameters (or each module ``wrap``
   names) becomes a unit, then the root. A tied parameter stays one parameter in one unit (an
   explicit ``wrap`` that splits one is a ``SharedParameterError``).
3. Parameters, gradients and optimizer state are DTensors sharded along dim 0; gradients are
   reduce-scattered during backward, summed (or ``gradient_aggregation="MEAN"``). Checkpoints go
   through DCP (``train/sharded.py``) and restore on any number of processes.
4. A job of one process (an evaluator task too) keeps the model whole; a ps task is refused.
"""

from __future__ import annotations

import collections
import contextlib
import re
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor
from typing_extensions import override

from stratagem.cluster import ClusterResolver
from stratagem.comm import Communicator, ReduceOp
from stratagem.comm.process_group import new_device_mesh, without_backward_context
from stratagem.distribute.capabilities import DefersGradients
from stratagem.distribute.communication_options import (
    CommunicationImplementation,
    CommunicationOptions,
)
from stratagem.distribute.machinery.worker_job import WorkerJob
from stratagem.distribute.machinery.worker_setup import broadcast_initial_values
from stratagem.distribute.strategy import Strategy
from stratagem.distribute.whole_modules import WholeModulesExtended
from stratagem.dtensor import Mesh
from stratagem.errors import SharedParameterError

# Which modules become FSDP units: regexes over module paths (LayoutMap-style, full match),
# or a predicate over (path, module).
WrapPolicy = str | list[str] | tuple[str, ...] | Callable[[str, torch.nn.Module], bool]

HSDP_DIMS = ("replicate", "shard")
# Initial values are broadcast in buckets of about this size: one flat copy of a whole model
# would double the memory that sharding is about to save.


class FullyShardedStrategy(Strategy):
    """``sg.distribute.experimental.FullyShardedStrategy(reshard_after_forward=True, mesh=None,
    mixed_precision=None, cpu_offload=False)``.

    ``mixed_precision``: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, or a dtype
    (``torch.bfloat16``, ``"bfloat16"``) to compute in while gradients are reduced in float32.
    ``cpu_offload``: keep the sharded parameters, gradients and optimizer state in CPU memory
    (FSDP2's ``CPUOffloadPolicy``; for CUDA jobs). ``wrap``: which modules become FSDP units
    (regexes over module paths, or a ``(path, module) -> bool`` predicate); by default every
    top-level child that holds parameters, with tied parameters kept in one unit (the root).
    """

    def __init__(
        self,
        reshard_after_forward: bool = True,
        mesh: Mesh | DeviceMesh | None = None,
        mixed_precision: MixedPrecisionPolicy | torch.dtype | str | None = None,
        cpu_offload: bool = False,
        *,
        wrap: WrapPolicy | None = None,
        communication_options: CommunicationOptions | None = None,
        cluster_resolver: ClusterResolver | None = None,
        gradient_aggregation: ReduceOp | str = ReduceOp.SUM,
    ) -> None:
        extended = FullyShardedExtended(
            self,
            reshard_after_forward=reshard_after_forward,
            mesh=mesh,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            wrap=wrap,
            communication_options=communication_options,
            cluster_resolver=cluster_resolver,
            gradient_aggregation=gradient_aggregation,
        )
        super().__init__(extended)
        self.reshard_after_forward = reshard_after_forward
        self.mesh = extended.device_mesh

    def __repr__(self) -> str:
        return (
            f"FullyShardedStrategy(reshard_after_forward={self.reshard_after_forward}, "
            f"mesh={self.mesh}, num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class FullyShardedExtended(WholeModulesExtended, DefersGradients):
    """Models built in scope sharded by ``fully_shard``; steps as MWMS's, one replica each."""

    def __init__(
        self,
        container: Strategy,
        *,
        reshard_after_forward: bool,
        mesh: Mesh | DeviceMesh | None,
        mixed_precision: MixedPrecisionPolicy | torch.dtype | str | None,
        cpu_offload: bool,
        wrap: WrapPolicy | None,
        communication_options: CommunicationOptions | None,
        cluster_resolver: ClusterResolver | None,
        gradient_aggregation: ReduceOp | str,
    ) -> None:
        name = type(container).__name__
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"{name}: reshard_after_forward must be True (ZeRO-3) or False (ZeRO-2), got "
                f"{reshard_after_forward!r}"
            )
        if not isinstance(cpu_offload, bool):
            raise TypeError(f"{name}: cpu_offload must be True or False, got {cpu_offload!r}")
        options = communication_options or CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(
                f"{name}: communication_options must be "
                f"sg.distribute.experimental.CommunicationOptions, got {options!r}"
            )
        self._mp_policy = _mixed_precision_policy(mixed_precision, name)
        self._wrap = _check_wrap(wrap, name)
        job = WorkerJob.set_up(
            name,
            ("chief", "worker", "evaluator"),
            cluster_resolver,
            operation_timeout=options.timeout_seconds,
        )
        device = job.device
        nccl = device.torch_device.type == "cuda" and (
            options.implementation is not CommunicationImplementation.RING
        )
        # An evaluator, or a job of one, gets a local communicator: nothing to shard.
        comm = job.communicator("cpu:gloo,cuda:nccl" if nccl else "gloo")
        super().__init__(
            container,
            [device],
            comm=comm,
            cluster_resolver=job.resolver,
            gradient_aggregation=gradient_aggregation,
            sync_timeout=job.timeouts.operation,
        )
        if cpu_offload and device.torch_device.type != "cuda":
            warnings.warn(
                f"{name}(cpu_offload=True) keeps the shards in CPU memory between uses on a "
                f"CUDA device, but this worker computes on {device.name}, where they are "
                "already; ignoring cpu_offload",
                stacklevel=4,
            )
            cpu_offload = False
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.device_mesh = _device_mesh(mesh, comm, device.torch_device, name)
        # FSDP's last Works and their tensors (see _HeldAllGather): a few only, as they hold
        # whole gathered parameters and gradients; FSDP waits for each on CPU, so a gloo thread
        # is long done with a Work 4 collectives later.
        self._held_works: collections.deque = collections.deque(maxlen=4)
        self._roots: list[FSDPModule] = []  # the models sharded, for accumulate_gradients

    @override
    def describe(self) -> dict[str, Any]:
        mesh = self.device_mesh
        return {
            **super().describe(),
            "reshard_after_forward": self.reshard_after_forward,
            "mesh": None if mesh is None else dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
        }

    # ------------------------------------------------------------------ placement

    @override
    def distribute_whole(self, module: torch.nn.Module) -> None:
        """Shard ``module`` in place (once; again is a no-op) and claim its new parameters."""
        if isinstance(module, FSDPModule):
            self.claim_module(module)
            return
        if self.device_mesh is None:
            # A job of one (or an evaluator): nothing to shard, but the model still computes
            # on this worker's device, as fully_shard would have put it there. In place
            # (module.to keeps the Parameter objects), so an optimizer made over them holds.
            # A model on the meta device stays there, for the user's to_empty().
            with self.replacing_parameters(module):  # claims the module's tensors
                if not any(t.is_meta for t in module.parameters()):
                    module.to(self._placement_device)
            return
        if not any(True for _ in module.parameters()):
            return  # an activation, a container of nothing yet: nothing to shard
        units = self._units(module)
        _check_dtypes(module, units)
        # Claimed (a module built outside the scope, handed to distribute_module) so that an
        # optimizer made over them is ours, and is pointed at their replacements.
        self.claim_module(module)
        with self.replacing_parameters(module):
            self._fully_shard(module, units)

    def _fully_shard(
        self, module: torch.nn.Module, units: list[tuple[str, torch.nn.Module]]
    ) -> None:
        self._broadcast_initial_values(module)
        settings: dict[str, Any] = {"mesh": self.device_mesh, "mp_policy": self._mp_policy}
        if self.cpu_offload:
            settings["offload_policy"] = CPUOffloadPolicy()
        # Deepest first: fully_shard groups the parameters no inner unit took.
        for _, unit in sorted(units, key=lambda pu: -pu[0].count(".")):
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **settings)
        # The root's backward starts right after its forward: FSDP2's default keeps it
        # gathered then (None), unless ZeRO-2 keeps every unit gathered anyway.
        fully_shard(
            module, reshard_after_forward=None if self.reshard_after_forward else False, **settings
        )
        self._roots.append(cast(FSDPModule, module))
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_custom_all_gather(_HeldAllGather(self._held_works))
                sub.set_custom_reduce_scatter(_HeldReduceScatter(self._held_works))
                if self.gradient_aggregation is ReduceOp.SUM:
                    sub.set_gradient_divide_factor(1.0)  # a sum over the replicas
                    # ... by SUM collectives: gloo has no PREMUL_SUM, the op a factor picks.
                    sub.set_force_sum_reduction_for_comms(True)

    def _units(self, module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """The modules that become FSDP units below the root (which is always one)."""
        ties = tied_parameters(module)
        if self._wrap is None:
            return _default_units(module, ties)
        matched = [
            (path, sub)
            for path, sub in module.named_modules()
            if path and _wrap_matches(self._wrap, path, sub) and not isinstance(sub, FSDPModule)
        ]
        if not matched:
            paths = [path for path, _ in module.named_modules() if path]
            raise ValueError(
                f"FullyShardedStrategy(wrap={_describe_wrap(self._wrap)}) matches no module of "
                f"{type(module).__name__}; its module paths are {paths[:20]}"
                f"{' ...' if len(paths) > 20 else ''} (regexes must match a whole path)"
            )
        _check_ties(ties, [path for path, _ in matched], self._wrap)
        return matched

    def _broadcast_initial_values(self, module: torch.nn.Module) -> None:
        # Not the shards of a unit sharded before: they are the same on every process already.
        everything = [*module.parameters(), *module.buffers()]
        broadcast_initial_values(
            self._comm,
            [t for t in everything if not isinstance(t, DTensor)],
            built="built a model of {n} tensors to shard",
            what="the model to shard",
        )

    # ------------------------------------------------------------------ steps

    @override
    def defer_gradient_reduction(self, defer: bool) -> None:
        # FSDP2's own no_sync: unsharded gradients accumulate, and the next synced backward
        # reduce-scatters them with its own. Only a backward reduces: the last micro-batch's
        # backward must run outside accumulate_gradients() (Model.fit's does).
        for root in self._roots:
            root.set_requires_gradient_sync(not defer, recurse=True)

    @override
    def _run_guard(self) -> contextlib.AbstractContextManager[None]:
        # FSDP runs its all-gathers and reduce-scatters itself: a lost or stuck peer in them is
        # named as in stratagem's own operations, with this step's operation number.
        return self._comm.named_faults("FSDP's collectives", what="the step")

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.device_mesh is None:
            return
        self.repoint(
            optimizer,
            what_happened="FullyShardedStrategy sharded the model",
            remedy="create the optimizer over the sharded model (after the scope's end), or "
            "shard the model first with strategy.distribute_module(model)",
        )


# ---------------------------------------------------------------------- FSDP's collectives


class _HeldAllGather(DefaultAllGather):
    """FSDP2's all-gather, launched as stratagem's own collectives are (``comm/process_group``):
    without backward's Python context in the thread state a gloo Work captures, and with the
    Work and its tensors held here, so that a gloo thread never drops the last reference to a
    Python object, which at interpreter exit aborts the process ("terminate called without an
    active exception")."""

    def __init__(self, held: collections.deque) -> None:
        self._held = held

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        with without_backward_context():
            work = super().__call__(output_tensor, input_tensor, group, async_op)
        self._held.append((work, output_tensor, input_tensor))
        return work


class _HeldReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, launched and held as ``_HeldAllGather``'s all-gather."""

    def __init__(self, held: collections.deque) -> None:
        self._held = held

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work:
        with without_backward_context():
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        self._held.append((work, output_tensor, input_tensor))
        return work


# ---------------------------------------------------------------------- set-up helpers


def _device_mesh(
    mesh: Mesh | DeviceMesh | None, comm: Communicator, device: torch.device, name: str
) -> DeviceMesh | None:
    """The mesh FSDP shards over: the whole job along ``shard``, or the one given (1-D, or
    2-D ``("replicate", "shard")`` for HSDP). None in a job of one."""
    world = comm.world_size
    if isinstance(mesh, Mesh):
        mesh = mesh.device_mesh
    if mesh is None:
        if world == 1:
            return None
        return new_device_mesh(device.type, (world,), ("shard",))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{name}: mesh must be a sg.dtensor.Mesh or a torch DeviceMesh, got "
            f"{type(mesh).__name__}"
        )
    dims = tuple(mesh.mesh_dim_names or ())
    if mesh.size() != world:
        raise ValueError(
            f"{name}: the mesh {dict(zip(dims, mesh.shape))} has {mesh.size()} devices but this "
            f"job has {world} processes; the mesh must span the whole job (one process per "
            "device)"
        )
    if mesh.ndim == 2 and dims != HSDP_DIMS:
        raise ValueError(
            f"{name}: a 2-D mesh gives HSDP and needs the dimensions {HSDP_DIMS} (replicate "
            f"across hosts, shard within one), got {dims}"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(f"{name}: the mesh must be 1-D or 2-D, got {mesh.ndim}-D {dims}")
    return mesh


def _mixed_precision_policy(
    value: MixedPrecisionPolicy | torch.dtype | str | None, name: str
) -> MixedPrecisionPolicy:
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"{name}: mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy, "
            f"a floating dtype or its name ('bfloat16', 'float16'), got {value!r}"
        )
    # Compute in ``dtype``; reduce gradients in float32, which keeps the sum exact enough.
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _check_wrap(wrap: WrapPolicy | None, name: str) -> WrapPolicy | None:
    if wrap is None or callable(wrap):
        return wrap
    patterns = [wrap] if isinstance(wrap, str) else list(wrap)
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(
            f"{name}: wrap must be a regex, a list of regexes or a (path, module) -> bool "
            f"predicate, got {wrap!r}"
        )
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{name}: wrap regex {pattern!r} does not compile: {e}") from None
    return tuple(patterns)


def _wrap_matches(wrap: WrapPolicy, path: str, module: torch.nn.Module) -> bool:
    if callable(wrap):
        return bool(wrap(path, module))
    return any(re.fullmatch(p, path) for p in wrap)


def _describe_wrap(wrap: WrapPolicy) -> str:
    return repr(list(wrap)) if isinstance(wrap, tuple) else repr(wrap)


# ---------------------------------------------------------------------- tied parameters
#
# FSDP2 shards a parameter in exactly one unit: the unit that holds it replaces it by a sharded
# DTensor under every name it has below that unit. A parameter registered under two names
# (tied embeddings: GPT-2's ``lm_head.weight is transformer.wte.weight``) that two units hold
# would be sharded twice, two tensors where the model had one (torch refuses it at the first
# forward), so the units are chosen, or checked, so that each tied parameter has one unit.


def tied_parameters(module: torch.nn.Module) -> list[tuple[str, ...]]:
    """The parameters of ``module`` registered under several names, each as its names in
    module order; found by identity, since only the tensor says that two names are one."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(found) for found in names.values() if len(found) > 1]


def _inside(name: str, path: str) -> bool:
    """Whether the parameter or module ``name`` lies in the module at ``path`` ('' is the root)."""
    return not path or name == path or name.startswith(path + ".")


def _unit_of(name: str, unit_paths: list[str]) -> str:
    """The unit that shards parameter ``name``: the deepest unit around it, else the root ('')."""
    return max((u for u in unit_paths if _inside(name, u)), key=len, default="")


def _splits_a_tie(path: str, ties: list[tuple[str, ...]]) -> bool:
    """Whether the module at ``path`` holds some, but not all, of a tied parameter's names."""
    return any(0 < sum(_inside(n, path) for n in names) < len(names) for names in ties)


def _default_units(
    module: torch.nn.Module, ties: list[tuple[str, ...]]
) -> list[tuple[str, torch.nn.Module]]:
    """Every top-level child that holds parameters, but a child that would split a tie (GPT-2's
    ``transformer``, whose ``wte`` shares its weight with ``lm_head``) gives way to its own
    children, recursively, so that the modules holding the tied parameter (``wte``,
    ``lm_head``) are no unit and the root, which holds every name, shards it. So does a
    container without a forward (``ModuleList``): FSDP gathers a unit in its forward's hook."""
    units: list[tuple[str, torch.nn.Module]] = []

    def visit(parent: torch.nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            path = prefix + name
            # A module sharded before (a model inside a new one) is a unit already.
            if isinstance(child, FSDPModule) or not any(True for _ in child.parameters()):
                continue
            if _splits_a_tie(path, ties) or type(child).forward is torch.nn.Module.forward:
                visit(child, path + ".")
            else:
                units.append((path, child))

    visit(module, "")
    return units


def _check_ties(ties: list[tuple[str, ...]], unit_paths: list[str], wrap: WrapPolicy) -> None:
    """Refuse units (an explicit ``wrap=``) that put a tied parameter's names in two units."""
    for names in ties:
        owners = {name: _unit_of(name, unit_paths) for name in names}
        first = names[0]
        other = next((n for n in names if owners[n] != owners[first]), None)
        if other is None:
            continue
        holders = sorted({owners[n] for n in names} - {""})
        ancestor = _common_ancestor(first, other)
        around = f" (or make their common ancestor {ancestor!r} the unit)" if ancestor else ""
        raise SharedParameterError(
            f"FullyShardedStrategy(wrap={_describe_wrap(wrap)}) splits the tied parameter "
            f"{first!r}: it is one tensor with {other!r}, but {first!r} falls in the FSDP unit "
            f"{owners[first] or '(the root)'!r} and {other!r} in "
            f"{owners[other] or '(the root)'!r}, and FSDP shards a parameter in one unit only. "
            f"Keep every name of it in one unit: leave {holders} out of wrap= so that the "
            f"root holds it{around}, or leave wrap= out: the default keeps each tied "
            "parameter in one unit"
        )


def _common_ancestor(a: str, b: str) -> str:
    """The deepest module around both parameters ``a`` and ``b`` ('' for the root)."""
    common: list[str] = []
    for x, y in zip(a.split(".")[:-1], b.split(".")[:-1]):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def _check_dtypes(module: torch.nn.Module, units: list[tuple[str, torch.nn.Module]]) -> None:
    """FSDP2 reduces one unit's gradients in one flat collective, so the trainable parameters
    of a unit (those no inner unit takes) must share a dtype."""
    unit_of: dict[int, str] = {}
    for path, unit in sorted(units, key=lambda pu: -pu[0].count(".")):
        for p in unit.parameters():
            unit_of.setdefault(id(p), path)
    groups: dict[str, dict[torch.dtype, list[str]]] = {}
    for path, p in module.named_parameters():
        if p.requires_grad:
            unit = unit_of.get(id(p), "")
            groups.setdefault(unit, {}).setdefault(p.dtype, []).append(path)
    for unit, by_dtype in groups.items():
        if len(by_dtype) > 1:
            found = {str(d): paths[:3] for d, paths in by_dtype.items()}
            raise TypeError(
                f"FullyShardedStrategy: the FSDP unit {unit or '(the root)'!r} of "
                f"{type(module).__name__} holds trainable parameters of several dtypes {found}, "
                "which FSDP cannot reduce in one flat collective; cast the model to one dtype "
                "(mixed_precision= computes in another), or make each dtype's layers their own "
                "unit with wrap="
            )
