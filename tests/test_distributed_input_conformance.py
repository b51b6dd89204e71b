"""Distributed input as TensorFlow's ``tf.distribute`` gives it, translated from TF's tests.

Each test names the TF behaviour it checks and, where there is one, the TF test
(``tensorflow/python/distribute/input_lib_test.py``, ``distribute_lib_test.py``,
``tensorflow/python/data/kernel_tests/rebatch_test.py``) or guide (the distributed input
tutorial, ``site/en/tutorials/distribute/input.ipynb``) it comes from.
"""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from stratagem.config import devices as config_devices
from stratagem.errors import InputError


@pytest.fixture
def two_cpus():
    return sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])


def _local(strategy, dataset):
    return [
        [part.tolist() for part in strategy.experimental_local_results(batch)]
        for batch in strategy.experimental_distribute_dataset(dataset)
    ]


# -- how a global batch is cut ---------------------------------------------------------------


def test_global_batches_are_cut_as_the_guide_shows():
    """The distributed input guide's "Partial batches" examples (experimental_distribute_dataset
    with the default AUTO policy, which is DATA for datasets that read no files, so TF's
    legacy rebatch): each batch in parts of ceil(n / replicas), its own size counting, the last
    parts smaller or empty; a last [4, 5] on 2 replicas is [4] and [5]."""
    dataset = sg.data.Dataset.range(6).batch(4, drop_remainder=False)
    assert _local(sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]), dataset) == [
        [[0, 1], [2, 3]],
        [[4], [5]],
    ]
    three = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    assert _local(three, sg.data.Dataset.range(8).batch(4)) == [
        [[0, 1], [2, 3], []],
        [[4, 5], [6, 7], []],
    ]


def test_indivisible_global_batch_last_batch_cut_by_its_own_size(two_cpus):
    """input_lib_test.testMWMSWithDataSharding's cut on one worker: range(8).batch(3) gives
    [0, 1], [2] per batch and the last batch [6, 7] one example per replica (TF's
    _LegacyRebatchDataset docstring: each batch cut into num_replicas parts)."""
    assert _local(two_cpus, sg.data.Dataset.range(8).batch(3)) == [
        [[0, 1], [2]],
        [[3, 4], [5]],
        [[6], [7]],
    ]


def _off(dataset):
    options = sg.data.Options()
    options.experimental_distribute.auto_shard_policy = sg.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


def test_policy_off_rebatches_the_stream(two_cpus):
    """Under OFF TF rebatches with batch_sizes_for_worker (rebatch_test.testPartialBatch's
    semantics): shares of the full batch, the larger first, and the examples re-cut in turn
    across the input's batch boundaries, so a last [6, 7] fills the first share and the second
    replica gets an empty batch; a repeat's partial batch in the middle is filled from the next
    one."""
    assert _local(two_cpus, _off(sg.data.Dataset.range(8).batch(3))) == [
        [[0, 1], [2]],
        [[3, 4], [5]],
        [[6, 7], []],
    ]
    assert _local(two_cpus, _off(sg.data.Dataset.range(5).batch(3).repeat(2))) == [
        [[0, 1], [2]],
        [[3, 4], [0]],
        [[1, 2], [3]],
        [[4], []],
    ]


class _WorkerOfTwo:
    """What distributed input reads of ``strategy.extended`` on worker ``rank`` of 2 workers
    with 2 CPU replicas each, its agreement all-reduce answered as a peer with the same
    batches would answer it (the real thing runs in test_auto_shard_policies_across_workers)."""

    def __init__(self, rank):
        self.communicator = self
        self.world_size, self.rank = 2, rank
        self.num_replicas_in_sync = 4
        self.replica_devices = (torch.device("cpu"), torch.device("cpu"))

    def split_sizes(self, total, parts, full=None):
        from stratagem.distribute.machinery.input import split_sizes

        return split_sizes(total, parts, full)

    def broadcast(self, tensor, src, what=""):
        tensor.fill_(7)  # the shared shuffle seed

    def all_reduce_async(self, tensor, what=""):
        tensor.mul_(2)  # the other worker counts the same

        class Done:
            def wait(self):
                return None

        return Done()


@pytest.mark.parametrize("policy", ["AUTO", "DATA"])
def test_data_shard_gives_each_worker_every_num_workers_th_part(policy):
    """TF's auto_shard rewrite (ShardByData): the legacy rebatch cuts each global batch into
    num_replicas_in_sync parts, then ``shard(num_workers, w)`` keeps every num_workers-th part,
    so worker w's local replica j gets part j * num_workers + w, not a contiguous block."""
    from stratagem.distribute.machinery.input import DistributedDataset

    options = sg.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        sg.data.experimental.AutoShardPolicy, policy
    )
    dataset = sg.data.Dataset.range(16).batch(8).with_options(options)  # parts of 2
    got = [
        [
            [part.tolist() for part in step.values]
            for step in DistributedDataset(_WorkerOfTwo(w), dataset)
        ]
        for w in range(2)
    ]
    assert got[0] == [[[0, 1], [4, 5]], [[8, 9], [12, 13]]]
    assert got[1] == [[[2, 3], [6, 7]], [[10, 11], [14, 15]]]


def test_batch_sizes_for_worker():
    """distribute.batch_sizes_for_worker's docstring: G=7 on 2 workers of 2 replicas gives
    worker 0 [2, 2, 2, 1] and worker 1 [2, 1, 2, 2]."""
    from stratagem.distribute.machinery.input import batch_sizes_for_worker

    assert batch_sizes_for_worker(7, 2, 2, 0) == [2, 2, 2, 1]
    assert batch_sizes_for_worker(7, 2, 2, 1) == [2, 1, 2, 2]
    assert batch_sizes_for_worker(4, 1, 5, 0) == [1, 1, 1, 1, 0]


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_uneven_dataset_batches(two_cpus, drop_remainder):
    """input_lib_test.testUnevenDatasetBatches: range(9).batch(2) on 2 replicas; the last
    global batch only holds data for one replica."""
    expected = [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    if not drop_remainder:
        expected.append([[8], []])
    dataset = sg.data.Dataset.range(9).batch(2, drop_remainder=drop_remainder)
    assert _local(two_cpus, dataset) == expected


def test_global_batch_smaller_than_replica_count():
    """rebatch_test.testEmptySplits: a batch smaller than the number of replicas leaves the
    last replicas empty (batch 4 over 5 replicas)."""
    strategy = sg.distribute.MirroredStrategy([f"cpu:{i}" for i in range(5)])
    dataset = sg.data.Dataset.range(8).batch(4, drop_remainder=True)
    assert _local(strategy, dataset) == [[[0], [1], [2], [3], []], [[4], [5], [6], [7], []]]


def test_empty_replica_batch_trains_as_one_device_does():
    """The guide's "Partial batches": replicas run with dummy empty batches and the loss is
    divided by the global batch size (tf.nn.compute_average_loss), so a step on 2 replicas
    gives the weights a step on one device gives on the whole global batch."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    init = torch.nn.Linear(3, 1).state_dict()

    def train(strategy, batch_size):
        with strategy.scope():
            model = torch.nn.Linear(3, 1)
            model.load_state_dict(init)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        dataset = sg.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)

        def step(inputs):
            features, labels = inputs
            per_example = ((model(features) - labels) ** 2).sum(dim=1)
            loss = sg.nn.compute_average_loss(per_example, global_batch_size=batch_size)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        for batch in strategy.experimental_distribute_dataset(dataset):
            strategy.run(step, args=(batch,))
        return [p.detach().clone() for p in model.parameters()]

    # Global batch 3: batches of 3 ([2], [1]) and 1 ([1], [0]: an empty replica batch).
    one = train(sg.distribute.OneDeviceStrategy("cpu:0"), 3)
    two = train(sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]), 3)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b)


def test_fit_with_an_empty_replica_batch_matches_one_device():
    """Keras fit under MirroredStrategy trains on a last batch that leaves a replica empty
    (TF's dummy batches) with the weights one device reaches."""
    torch.manual_seed(1)
    x, y = torch.randn(7, 2), torch.randn(7, 1)
    init = torch.nn.Linear(2, 1).state_dict()

    def fit(strategy):
        with strategy.scope():
            module = torch.nn.Linear(2, 1)
            module.load_state_dict(init)
            model = sg.keras.Model(module)
        model.compile(optimizer=sg.keras.optimizers.SGD(learning_rate=0.1), loss="mse")
        data = sg.data.Dataset.from_tensor_slices((x, y)).batch(3)  # last batch: 1 example
        model.fit(data, epochs=2, verbose=0)
        return [p.detach().clone() for p in module.parameters()]

    one = fit(sg.distribute.OneDeviceStrategy("cpu:0"))
    two = fit(sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]))
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b)


def test_mesh_strategy_keeps_its_torch_chunk_cut():
    """MeshStrategy documents its own cut (torch.chunk's, which DTensor's Shard uses), for a
    last batch too; it is also TF's legacy rebatch of a shared batch."""
    from stratagem.distribute.machinery.input import split_sizes
    from stratagem.distribute.mesh_strategy import MeshExtended

    # The hook reads no state; a mesh needs a process group, so it is called unbound.
    assert MeshExtended.split_sizes(None, 5, 4, full=9) == [2, 2, 1, 0] == split_sizes(5, 4)


# -- what an element is ------------------------------------------------------------------------


def test_element_unpacks_into_the_batch_structure(two_cpus):
    """input_lib (DistributedIterator.get_next): an element is the dataset's structure with a
    PerReplica per component, so ``for x, y in dist_dataset`` unpacks (the guide's
    "for index, inputs in dist_dataset")."""
    dataset = sg.data.Dataset.from_tensor_slices((torch.arange(4.0), torch.arange(4) * 10))
    seen = []
    for x, y in two_cpus.experimental_distribute_dataset(dataset.batch(4)):
        assert isinstance(x, sg.distribute.PerReplica)
        assert isinstance(y, sg.distribute.PerReplica)
        seen.append(([v.tolist() for v in x.values], [v.tolist() for v in y.values]))
    assert seen == [([[0.0, 1.0], [2.0, 3.0]], [[0, 10], [20, 30]])]


def test_dict_elements_keep_their_keys(two_cpus):
    """rebatch_test.testNestedDictionaryOutput, distributed: a dict element stays a dict."""
    dataset = sg.data.Dataset.range(4).map(lambda x: {"a": x, "b": {"c": x + 1}}).batch(4)
    (element,) = list(two_cpus.experimental_distribute_dataset(dataset))
    assert set(element) == {"a", "b"} and set(element["b"]) == {"c"}
    assert [v.tolist() for v in element["b"]["c"].values] == [[1, 2], [3, 4]]


def test_local_results_of_a_structure_is_one_structure_per_replica(two_cpus):
    """distribute_lib.StrategyExtendedV2._local_results: for a nested value, a tuple with one
    structure per local replica; a leaf that is not per-replica repeats; a plain value is
    ``(value,)``."""
    a = sg.distribute.PerReplica([torch.tensor(0), torch.tensor(1)])
    b = sg.distribute.PerReplica([torch.tensor(10), torch.tensor(11)])
    results = two_cpus.experimental_local_results({"a": a, "pair": (b, 7)})
    assert isinstance(results, tuple) and len(results) == 2
    assert results[1]["a"].item() == 1 and results[1]["pair"][0].item() == 11
    assert results[0]["pair"][1] == 7 and results[1]["pair"][1] == 7
    assert two_cpus.experimental_local_results((5, 6)) == ((5, 6), (5, 6))
    plain = torch.tensor(3.0)
    assert two_cpus.experimental_local_results(plain) == (plain,)


def test_run_results_through_local_results_restore_order(two_cpus):
    """The guide's "Caveats" example: enumerate the dataset, run predict, and put the outputs
    back in order with experimental_local_results."""
    dataset = sg.data.Dataset.range(24).enumerate().batch(6)
    result = {}
    for index, inputs in two_cpus.experimental_distribute_dataset(dataset):
        out_index, outputs = two_cpus.run(lambda i, x: (i, 2 * x), args=(index, inputs))
        indices = [i for a in two_cpus.experimental_local_results(out_index) for i in a.tolist()]
        values = [v for a in two_cpus.experimental_local_results(outputs) for v in a.tolist()]
        result.update(zip(indices, values))
    assert result == {i: 2 * i for i in range(24)}


def test_get_next_as_optional_ends_with_an_empty_optional(two_cpus):
    """The guide's get_next_as_optional example (input_lib_test.testGetNextAsOptional):
    range(9).batch(4) gives ([0 1], [2 3]), ([4 5], [6 7]), ([8], []), then no value."""
    iterator = iter(two_cpus.experimental_distribute_dataset(sg.data.Dataset.range(9).batch(4)))
    seen = []
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        seen.append([v.tolist() for v in two_cpus.experimental_local_results(optional.get_value())])
    assert seen == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
    with pytest.raises(InputError, match="empty Optional"):
        optional.get_value()
    with pytest.raises(StopIteration):
        iterator.get_next()


def test_element_spec_is_per_replica_with_unknown_batch(two_cpus):
    """DistributedDataset.element_spec (the guide's "Using the element_spec property"): a
    PerReplica spec per component, the batch dimension None."""
    dataset = sg.data.Dataset.from_tensors(([1.0], [1.0])).repeat(10).batch(4)
    dist = two_cpus.experimental_distribute_dataset(dataset)
    features, labels = dist.element_spec
    assert isinstance(features, sg.distribute.PerReplica)
    assert features.values[0] == sg.data.TensorSpec((None, 1), torch.float32)
    assert iter(dist).element_spec[1].values == labels.values
    one = sg.distribute.OneDeviceStrategy("cpu:0").experimental_distribute_dataset(dataset)
    assert one.element_spec == (sg.data.TensorSpec((None, 1)), sg.data.TensorSpec((None, 1)))


def test_from_function_gives_empty_batches_to_replicas_without_data(two_cpus):
    """The guide's "Partial batches": with distribute_datasets_from_function, replicas left
    without data at the end get a batch of size 0 while another replica still has data."""

    def dataset_fn(ctx):
        return sg.data.Dataset.range(6).batch(2)  # 3 per-replica batches for 2 replicas

    batches = list(two_cpus.distribute_datasets_from_function(dataset_fn))
    assert [[v.tolist() for v in b.values] for b in batches] == [[[0, 1], [2, 3]], [[4, 5], []]]


def test_string_components_are_distributed(two_cpus):
    """tf.string components distribute like any other (the guide's preprocessing example
    feeds strings); here they are numpy arrays of str."""
    dataset = sg.data.Dataset.from_tensor_slices(["a", "c", "e", "f"]).batch(4)
    (element,) = list(two_cpus.experimental_distribute_dataset(dataset))
    assert [v.tolist() for v in element.values] == [["a", "c"], ["e", "f"]]


# -- InputContext (distribute_lib_test.InputContextTest) ---------------------------------------


def test_input_context_per_replica_batch_size():
    """distribute_lib_test.testPerReplicaBatchSize: 12 over 6 replicas is 2; an indivisible
    global batch raises ValueError."""
    ctx = sg.distribute.InputContext(
        num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6
    )
    assert ctx.get_per_replica_batch_size(12) == 2
    with pytest.raises(ValueError, match="not divisible"):
        ctx.get_per_replica_batch_size(13)


def test_input_context_properties():
    """distribute_lib_test.testProperties: the pipeline count and id, replicas in sync, and
    the defaults (1 pipeline, id 0, 1 replica)."""
    ctx = sg.distribute.InputContext(
        num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6
    )
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 6)
    default = sg.distribute.InputContext()
    assert (default.num_input_pipelines, default.input_pipeline_id) == (1, 0)
    assert default.num_replicas_in_sync == 1


def test_input_context_str():
    """distribute_lib_test.testStr, with sg. for tf. (the porting rule)."""
    one = sg.distribute.InputContext(
        num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=42
    )
    assert str(one) == "sg.distribute.InputContext(input pipeline id 0, total: 1)"
    three = sg.distribute.InputContext(
        num_input_pipelines=3, input_pipeline_id=1, num_replicas_in_sync=42
    )
    assert str(three) == "sg.distribute.InputContext(input pipeline id 1, total: 3)"


def test_input_context_given_to_dataset_fn(two_cpus):
    """distribute_datasets_from_function calls the function with this worker's InputContext
    (one pipeline per worker; the replicas in sync over all workers)."""
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return sg.data.Dataset.range(4).batch(ctx.get_per_replica_batch_size(4))

    list(two_cpus.distribute_datasets_from_function(dataset_fn))
    (ctx,) = contexts
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 2)


# -- logical devices (tf.config) ---------------------------------------------------------------


@pytest.fixture
def fresh_device_config(monkeypatch):
    """Devices not yet initialized: the configuration is process-wide, and earlier tests
    created strategies."""
    monkeypatch.setattr(config_devices, "_initialized", False)
    monkeypatch.setattr(config_devices, "_cpu_config", None)


def test_split_cpu_gives_mirrored_strategy_its_replicas(fresh_device_config):
    """tf.config.set_logical_device_configuration splits the CPU; MirroredStrategy() with no
    devices uses every logical device (mirrored_strategy.all_local_devices); changing the
    configuration afterwards raises RuntimeError, as TF does once devices are initialized."""
    (cpu,) = sg.config.list_physical_devices("CPU")
    sg.config.set_logical_device_configuration(
        cpu, [sg.config.LogicalDeviceConfiguration() for _ in range(3)]
    )
    assert len(sg.config.get_logical_device_configuration(cpu)) == 3
    strategy = sg.distribute.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 3
    assert [d.name for d in sg.config.list_logical_devices("CPU")] == [
        "/device:CPU:0",
        "/device:CPU:1",
        "/device:CPU:2",
    ]
    with pytest.raises(RuntimeError, match="cannot be modified after being initialized"):
        sg.config.set_logical_device_configuration(cpu, [sg.config.LogicalDeviceConfiguration()])
    # The same configuration again is no change, as in TF.
    sg.config.set_logical_device_configuration(
        cpu, [sg.config.LogicalDeviceConfiguration() for _ in range(3)]
    )


def test_logical_device_configuration_checks(fresh_device_config):
    """TF refuses a CPU memory limit and an unknown device; the experimental aliases exist."""
    (cpu,) = sg.config.experimental.list_physical_devices("CPU")
    with pytest.raises(ValueError, match="memory_limit"):
        sg.config.set_logical_device_configuration(
            cpu, [sg.config.LogicalDeviceConfiguration(memory_limit=100)]
        )
    with pytest.raises(ValueError, match="PhysicalDevice"):
        sg.config.set_logical_device_configuration("/cpu:0", [])
    assert sg.config.list_physical_devices("TPU") == []
    sg.config.experimental.set_virtual_device_configuration(
        cpu, [sg.config.experimental.VirtualDeviceConfiguration()] * 2
    )
    devices = sg.config.experimental.list_logical_devices("CPU")
    strategy = sg.distribute.MirroredStrategy(devices)  # LogicalDevice objects, as TF takes
    assert strategy.num_replicas_in_sync == 2


# -- auto-shard policies across 2 workers --------------------------------------------------------


@pytest.mark.multiprocess
def test_auto_shard_policies_across_workers(tmp_path):
    """tf.data.experimental.AutoShardPolicy in experimental_distribute_dataset on 2 workers
    (the guide's "Sharding"): DATA and AUTO give each worker its slice of every global batch;
    OFF gives each worker all of its own copy (each global batch cut in workers x replicas
    parts, as TF's rebatch); HINT fills in shard(SHARD_HINT, SHARD_HINT); FILE raises, as TF
    does for a dataset that reads no files."""
    results = run_cluster(WORKERS / "autoshard_checks.py", 2, tmp_path, timeout=180)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    a, b = (torch.load(tmp_path / f"result-{i}.pt") for i in range(2))
    for policy in ("AUTO", "DATA"):
        assert a[policy] == [[0, 1], [4, 5], [8, 9]]
        assert b[policy] == [[2, 3], [6, 7], [10, 11]]
    assert a["OFF"] == b["OFF"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    # TF's rebatch re-cuts each worker's own stream ([0, 2, 4, 6], [8, 10] into twos): no
    # empty step at the end.
    assert a["HINT"] == [[0, 2], [4, 6], [8, 10]]
    assert b["HINT"] == [[1, 3], [5, 7], [9, 11]]
    for out in (a, b):
        assert "AutoShardPolicy.FILE" in out["FILE"] and "no sg.data source" in out["FILE"]
        assert "only AutoShardPolicy.HINT fills in" in out["HINT_without_policy"]
        # input_lib_test.testMWMSPartialBatch: each worker's range(12).batch(8) rebatched into
        # batches of 4, the last one [8..11] on its own step (not cut again with an empty part).
        assert out["TF_PARTIAL_OFF"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        # testMWMSPartialBatchWithLegacyRebatch: no static batch size, so each batch is cut by
        # its own size: the last one of 4 into [8, 9] and [10, 11].
        assert out["TF_LEGACY_OFF"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11]]
    # testMWMSWithDataSharding (AUTO and DATA): range(8).batch(3), the last batch [6, 7] cut
    # by its own size (TF's legacy rebatch under a data shard), one example per worker.
    for policy in ("AUTO", "DATA"):
        assert a[f"TF_DATA_SHARDING_{policy}"] == [[0, 1], [3, 4], [6]]
        assert b[f"TF_DATA_SHARDING_{policy}"] == [[2], [5], [7]]
    # batch_sizes_for_worker(7, 2, 1, i): [4, 3] then [3, 4]; every step holds 7 examples.
    assert a["ROTATED"] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10], [11, 12, 13]]
    assert b["ROTATED"] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]
    assert a["ROTATED_AVERAGE"] == pytest.approx([4 / 7, 3 / 7, 4 / 7, 3 / 7])
    assert b["ROTATED_AVERAGE"] == pytest.approx([3 / 7, 4 / 7, 3 / 7, 4 / 7])
    # A worker whose own stream ended gets an empty batch while the other still has one.
    assert a["HINT_UNEVEN"] == [[0, 2], [4, 6], [8, 10], [12]]
    assert b["HINT_UNEVEN"] == [[1, 3], [5, 7], [9, 11], []]
