"""Single-process behaviour of the strategy API: default strategy, scopes, OneDevice, threads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import stratagem as sg
from cluster_utils import child_env


def test_outside_any_scope_the_default_strategy_runs_one_replica():
    strategy = sg.distribute.get_strategy()
    assert strategy is sg.distribute.get_strategy()
    assert strategy.num_replicas_in_sync == 1
    assert not sg.distribute.has_strategy()
    ctx = sg.distribute.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0
    assert strategy.run(lambda x: x * 2, args=(torch.ones(2),)).tolist() == [2.0, 2.0]
    assert strategy.reduce("SUM", torch.ones(3), axis=0).item() == 3.0
    # Code outside any scope is untouched: nothing is claimed, placed or hooked.
    layer = torch.nn.Linear(2, 2)
    assert sg.distribute.machinery.scope_hooks.owner_of(layer.weight) is None


def test_scope_contexts_and_what_it_captures():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    outside = torch.nn.Linear(2, 2)
    with strategy.scope():
        assert sg.distribute.get_strategy() is strategy
        assert sg.distribute.in_cross_replica_context()
        assert sg.distribute.get_replica_context() is None
        inside = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    owner = sg.distribute.machinery.scope_hooks.owner_of
    assert all(owner(p) is strategy for p in inside.parameters())
    assert all(owner(b) is strategy for b in inside.buffers())
    assert owner(outside.weight) is None
    other = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope(), pytest.raises(RuntimeError, match="mixing strategies"), other.scope():
        pass


def test_an_optimizer_mixing_distributed_and_plain_parameters_is_refused():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        inside = torch.nn.Linear(2, 1)
    outside = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([*inside.parameters(), *outside.parameters()], lr=0.1)
    with pytest.raises(RuntimeError, match="2 created outside it"):
        optimizer.step()


def test_distribute_module_is_the_explicit_form_of_scope():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    model = torch.nn.Linear(3, 1)
    assert strategy.distribute_module(model) is model
    assert sg.distribute.machinery.scope_hooks.owner_of(model.weight) is strategy
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = sg.distribute.PerReplica([torch.ones(2, 3), 2 * torch.ones(2, 3)])
    strategy.run(lambda v: model(v).sum().backward(), args=(x,))
    torch.testing.assert_close(model.weight.grad, torch.full((1, 3), 6.0))
    optimizer.step()


def test_one_device_strategy_places_what_scope_creates():
    strategy = sg.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu"
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.worker_devices == ("cpu:0",)
    (batch,) = list(strategy.experimental_distribute_dataset([torch.ones(4, 2)]))
    assert batch.shape == (4, 2)


def test_values_from_function_and_local_results():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group))
    )
    assert [v.item() for v in strategy.experimental_local_results(values)] == [0.0, 1.0]
    assert strategy.reduce("SUM", values).item() == 1.0


def test_compute_average_loss():
    per_example = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert sg.nn.compute_average_loss(per_example, global_batch_size=8).item() == 1.25
    weighted = sg.nn.compute_average_loss(per_example, sample_weight=0.5, global_batch_size=4)
    assert weighted.item() == 1.25
    assert sg.nn.compute_average_loss(per_example).item() == 2.5  # one replica: the local batch
    with pytest.raises(ValueError, match="reduction='none'"):
        sg.nn.compute_average_loss(per_example.mean())
    assert sg.nn.scale_regularization_loss(torch.tensor(6.0)).item() == 6.0


def test_threading_settings():
    """In a fresh process: inter-op threads can only be set before any parallel work."""
    code = """
import torch, stratagem as sg
sg.config.threading.set_inter_op_parallelism_threads(3)
sg.config.threading.set_intra_op_parallelism_threads(1)
assert sg.config.threading.get_inter_op_parallelism_threads() == 3
assert sg.config.threading.get_intra_op_parallelism_threads() == 1
torch.jit.fork(torch.add, torch.ones(1), 1).wait()   # starts the inter-op pool
try:
    sg.config.threading.set_inter_op_parallelism_threads(2)
except RuntimeError as e:
    assert "already started" in str(e), e
    print("refused")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "refused"
    with pytest.raises(ValueError, match="int >= 0"):
        sg.config.threading.set_intra_op_parallelism_threads(-1)


def test_mwms_in_a_world_of_one_trains_without_gradient_hooks(monkeypatch):
    """A job of one process has nothing to all-reduce: MWMS puts no hook on the parameters
    (each is a Python call per parameter in every backward, and a copy of each gradient into
    a bucket and back), and trains as plain PyTorch does."""
    for var in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(4, 3)

    def step(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        net(x).square().sum().backward()
        optimizer.step()

    for _ in range(3):
        strategy.run(step, args=(model, opt))
        step(reference, ref_opt)
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert not p._backward_hooks and not p._post_accumulate_grad_hooks
        assert torch.equal(p.detach(), ref.detach())
