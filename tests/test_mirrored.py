"""MirroredStrategy: several logical CPU devices in one process, on replica threads."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import stratagem as sg
from stratagem.errors import DeviceError, InputError, ReplicaError
from workers.common import build_model, global_batches, make_optimizer, reference_training


def _train(strategy, optimizer_name, *, step_inside_run=True, accumulate=1):
    torch.manual_seed(7)
    with strategy.scope():
        model = build_model()
        optimizer = make_optimizer(optimizer_name, model.parameters())
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dataset = strategy.experimental_distribute_dataset(global_batches())

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        for _ in range(accumulate):
            per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            (sg.nn.compute_average_loss(per_example) / accumulate).backward()
        if step_inside_run:
            optimizer.step()

    for batch in dataset:
        strategy.run(step, args=(batch,))
        if not step_inside_run:
            optimizer.step()  # cross-replica: gradients were summed when run returned
    return initial, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
@pytest.mark.parametrize(
    "variant",
    [
        {"devices": ["cpu:0", "cpu:1"]},
        {"devices": ["cpu:0", "cpu:1", "cpu:2"], "ops": sg.distribute.HierarchicalCopyAllReduce()},
        {"devices": ["cpu:0", "cpu:1"], "step_inside_run": False},
        {"devices": ["cpu:0", "cpu:1"], "accumulate": 2},
    ],
    ids=["2-replicas", "3-replicas-hierarchical", "step-outside-run", "accumulate-2"],
)
def test_same_parameters_as_one_process_on_the_global_batch(optimizer_name, variant):
    strategy = sg.distribute.MirroredStrategy(variant["devices"], variant.get("ops"))
    initial, final = _train(
        strategy,
        optimizer_name,
        step_inside_run=variant.get("step_inside_run", True),
        accumulate=variant.get("accumulate", 1),
    )
    expected = reference_training(initial, optimizer_name, global_batches())
    for k in expected:
        torch.testing.assert_close(final[k], expected[k], rtol=1e-5, atol=1e-6)


def test_replicas_run_on_their_own_threads_and_copies():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        layer = torch.nn.Linear(2, 2)
    seen = {}

    def fn():
        ctx = sg.distribute.get_replica_context()
        seen[ctx.replica_id_in_sync_group] = (threading.get_ident(), layer.weight.data_ptr())
        return torch.tensor(float(ctx.replica_id_in_sync_group))

    result = strategy.run(fn)
    assert isinstance(result, sg.distribute.PerReplica)
    assert [v.item() for v in result.values] == [0.0, 1.0]
    assert seen[0][0] == threading.get_ident() != seen[1][0]
    # Same physical device: the replica's copy shares storage with the primary (no refresh).
    assert seen[0][1] == seen[1][1]


def test_buffers_are_refreshed_from_the_primary():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        bn = torch.nn.BatchNorm1d(3)
    x = sg.distribute.PerReplica([torch.zeros(4, 3), torch.full((4, 3), 10.0)])
    strategy.run(lambda v: bn(v), args=(x,))
    # Replica 0 (all zeros) owns the primary stats; replica 1 updated its own copy...
    assert torch.allclose(bn.running_mean, torch.zeros(3))
    means = strategy.run(lambda: bn.running_mean.clone())
    # ...which the next run refreshed from the primary before computing.
    assert all(torch.allclose(m, torch.zeros(3)) for m in means.values)


def test_a_replica_that_skips_the_optimizer_step_is_an_error_not_a_hang():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def step():
        layer(torch.ones(1, 2)).sum().backward()
        if sg.distribute.get_replica_context().replica_id_in_sync_group == 0:
            optimizer.step()

    with pytest.raises(ReplicaError, match="returned from the step function without reaching"):
        strategy.run(step)


def test_an_error_in_one_replica_reaches_the_caller():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])

    def step():
        if sg.distribute.get_replica_context().replica_id_in_sync_group == 1:
            raise ValueError("boom in replica 1")

    with pytest.raises(ValueError, match="boom in replica 1"):
        strategy.run(step)
    # The group is usable again afterwards.
    assert len(strategy.run(lambda: torch.ones(1)).values) == 2


def test_replica_all_reduce_and_reduce():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])

    def fn():
        ctx = sg.distribute.get_replica_context()
        return ctx.all_reduce("SUM", torch.tensor([float(ctx.replica_id_in_sync_group)]))

    result = strategy.run(fn)
    assert [v.item() for v in result.values] == [3.0, 3.0, 3.0]
    per_replica = sg.distribute.PerReplica(
        [torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([])]
    )
    assert strategy.reduce("SUM", per_replica, axis=0).item() == 6.0
    assert strategy.reduce("MEAN", per_replica, axis=0).item() == 2.0
    assert strategy.gather(per_replica, axis=0).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: strategy.reduce("SUM", torch.ones(1)))


def test_grad_mode_reaches_replica_threads():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with torch.no_grad():
        flags = strategy.run(torch.is_grad_enabled)
    assert flags.values == (False, False)


def test_nccl_falls_back_on_cpu_with_a_clear_message():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"], sg.distribute.NcclAllReduce())
    messages = [str(w.message) for w in caught]
    assert any(
        "NcclAllReduce needs one distinct CUDA device per replica, but the replicas are on "
        "cpu:0, cpu:1; reducing with ReductionToOneDevice" in m
        for m in messages
    ), messages
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
    strategy.run(lambda: layer(torch.ones(1, 2)).sum().backward())
    torch.testing.assert_close(layer.weight.grad, torch.full((1, 2), 2.0))


@pytest.mark.parametrize(
    "ops",
    [sg.distribute.ReductionToOneDevice(), sg.distribute.HierarchicalCopyAllReduce(num_packs=2)],
)
def test_cross_device_ops(ops):
    values = [torch.tensor([1.0, 2.0]) * (i + 1) for i in range(5)]
    sums = ops.batch_reduce("SUM", [values, [v[:1] for v in values]], torch.device("cpu"))
    assert sums[0].tolist() == [15.0, 30.0] and sums[1].tolist() == [15.0]
    assert ops.reduce("MEAN", values, torch.device("cpu")).tolist() == [3.0, 6.0]
    assert ops.reduce("MAX", values, torch.device("cpu")).tolist() == [5.0, 10.0]
    with pytest.raises(ValueError, match="different shapes"):
        ops.reduce("SUM", [torch.ones(2), torch.ones(3)], torch.device("cpu"))


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (["tpu:0"], "unknown device 'tpu:0'"),
        (["cuda:7"], "does not exist"),
        (["cpu:0", "/cpu:0"], "more than once"),
        ([], "devices is empty"),
        ("cpu:0", "must be a list"),
    ],
)
def test_bad_devices(devices, message):
    with pytest.raises(DeviceError, match=message):
        sg.distribute.MirroredStrategy(devices)


def test_indivisible_global_batch_splits_as_tf():
    # TF's rebatch: shares as even as possible, the larger first (issue 12; input_lib_test).
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    dataset = strategy.experimental_distribute_dataset([torch.ones(7, 2)])
    assert [len(v) for v in next(iter(dataset)).values] == [4, 3]


def test_last_partial_batch_is_split_not_dropped_and_loss_uses_its_true_size():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    batches = [torch.arange(8.0), torch.arange(3.0)]
    sizes, denominators = [], []
    for batch in strategy.experimental_distribute_dataset(batches):
        sizes.append([len(v) for v in batch.values])

        def fn(x):
            loss = sg.nn.compute_average_loss(torch.ones_like(x))
            denominators.append(round(len(x) / loss.item()) if len(x) else None)

        strategy.run(fn, args=(batch,))
    # TF's cut under the default AUTO policy (its legacy rebatch): a last batch of 3 in parts
    # of ceil(3 / 2), as a full one; the loss divides by the batch's true size.
    assert sizes == [[4, 4], [2, 1]]
    assert sorted(d for d in denominators if d) == [3, 3, 8, 8]


def test_input_context_and_per_replica_pipelines():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return [torch.full((2,), float(i)) for i in range(4)]

    batches = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert (contexts[0].num_input_pipelines, contexts[0].num_replicas_in_sync) == (1, 2)
    assert contexts[0].get_per_replica_batch_size(64) == 32
    with pytest.raises(InputError, match="not divisible"):
        contexts[0].get_per_replica_batch_size(63)
    assert [[v[0].item() for v in b.values] for b in batches] == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_mean_gradient_aggregation_option(accumulate):
    """PyTorch's convention: each replica's mean loss, gradients averaged over replicas."""
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"], gradient_aggregation="mean")
    torch.manual_seed(3)
    with strategy.scope():
        model = build_model()
        optimizer = make_optimizer("adam", model.parameters())
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        for _ in range(accumulate):
            (torch.nn.functional.cross_entropy(model(x), y) / accumulate).backward()
        optimizer.step()

    for batch in strategy.experimental_distribute_dataset(global_batches()):
        strategy.run(step, args=(batch,))
    expected = reference_training(initial, "adam", global_batches())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-5, atol=1e-6)
    # Outside run nothing is scaled: a plain backward gives the plain gradient.
    model.zero_grad()
    model(torch.ones(1, 5)).sum().backward()
    plain = build_model()
    plain.load_state_dict(model.state_dict())
    plain(torch.ones(1, 5)).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)
