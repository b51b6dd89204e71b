"""Conformance: TensorFlow's ``ClusterSpec`` and ``multi_worker_util`` tests, translated.

From ``tensorflow/python/training/server_lib_test.py`` (``ClusterSpecTest``, ``ServerDefTest``'s
round trips) and ``tensorflow/python/distribute/multi_worker_util_test.py``. stratagem has no
``ClusterDef`` proto: round trips go through ``as_dict()``. ``multi_worker_util`` is private in
TF; stratagem's equivalents are ``is_chief`` (same arguments, Keras's order), ``rank_of``
(``id_in_cluster`` for the collective members), ``collective_members`` (``worker_count``,
``collective_leader``) and the resolvers' checks (``_validate_cluster_spec``). Each test names
the TF test it translates.
"""

from __future__ import annotations

import json

import pytest

import stratagem as sg
from stratagem.cluster import (
    SimpleClusterResolver,
    collective_members,
    is_chief,
    load_tf_config,
    rank_of,
)
from stratagem.errors import ClusterConfigError

ClusterSpec = sg.train.ClusterSpec

PS_WORKER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}
FULL = {
    "chief": ["127.0.0.1:1234"],
    "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
    "ps": ["127.0.0.1:1926", "127.0.0.1:3141"],
}

# -- server_lib_test.py: ClusterSpecTest ------------------------------------------------------


def test_string_conversion():
    """TF ``ClusterSpecTest.testStringConversion``: the same text."""
    spec = ClusterSpec({"ps": ["ps0:1111"], "worker": ["worker0:3333", "worker1:4444"]})
    expected = "ClusterSpec({'ps': ['ps0:1111'], 'worker': ['worker0:3333', 'worker1:4444']})"
    assert str(spec) == expected


def test_proto_dict_def_equivalences():
    """TF ``testProtoDictDefEquivalences``: a spec, a copy and its dict describe one cluster."""
    spec = ClusterSpec(PS_WORKER)
    for other in (ClusterSpec(spec), ClusterSpec(spec.as_dict()), ClusterSpec(dict(PS_WORKER))):
        assert other == spec
        assert other.as_dict() == PS_WORKER


def test_proto_dict_def_equivalences_with_zero_worker():
    """TF ``testProtoDictDefEquivalencesWithZeroWorker``: a job may have no task."""
    spec = ClusterSpec({"ps": ["ps0:2222", "ps1:2222"], "worker": []})
    assert spec.as_dict() == {"ps": ["ps0:2222", "ps1:2222"], "worker": []}
    assert spec.num_tasks("worker") == 0
    assert spec.job_tasks("worker") == []
    assert ClusterSpec(spec.as_dict()) == spec


def test_cluster_spec_accessors():
    """TF ``testClusterSpecAccessors``: dense and sparse jobs, ValueError for unknown ones."""
    original = {**PS_WORKER, "sparse": {0: "sparse0:2222", 3: "sparse3:2222"}}
    spec = ClusterSpec(original)
    assert spec.as_dict() == original
    assert [spec.num_tasks(job) for job in ("ps", "worker", "sparse")] == [2, 3, 2]
    assert spec.task_address("ps", 0) == "ps0:2222"
    assert spec.task_address("sparse", 0) == "sparse0:2222"
    assert spec.task_indices("ps") == [0, 1]
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.task_indices("sparse") == [0, 3]
    assert spec.job_tasks("ps") == ["ps0:2222", "ps1:2222"]
    assert spec.job_tasks("worker") == PS_WORKER["worker"]
    assert spec.job_tasks("sparse") == ["sparse0:2222", None, None, "sparse3:2222"]
    for call in (
        lambda: spec.num_tasks("unknown"),
        lambda: spec.task_address("unknown", 0),
        lambda: spec.task_address("sparse", 2),
        lambda: spec.task_indices("unknown"),
        lambda: spec.job_tasks("unknown"),
    ):
        with pytest.raises(ValueError):
            call()


def test_empty_cluster_spec_is_false():
    """TF ``testEmptyClusterSpecIsFalse`` and ``testNonEmptyClusterSpecIsTrue``."""
    assert not ClusterSpec({})
    assert ClusterSpec({"job": ["host:port"]})


def test_eq():
    """TF ``testEq``: a sparse job with index 0 equals the dense one."""
    assert ClusterSpec({}) == ClusterSpec({})
    assert ClusterSpec({"job": ["host:2222"]}) == ClusterSpec({"job": ["host:2222"]})
    assert ClusterSpec({"job": {0: "host:2222"}}) == ClusterSpec({"job": ["host:2222"]})


def test_ne():
    """TF ``testNe``: other jobs, other addresses, other order are different clusters."""
    assert ClusterSpec({}) != ClusterSpec({"job": ["host:2223"]})
    assert ClusterSpec({"job1": ["host:2222"]}) != ClusterSpec({"job2": ["host:2222"]})
    assert ClusterSpec({"job": ["host:2222"]}) != ClusterSpec({"job": ["host:2223"]})
    assert ClusterSpec({"job": ["host:2222", "host:2223"]}) != ClusterSpec(
        {"job": ["host:2223", "host:2222"]}
    )


@pytest.mark.parametrize(
    "cluster",
    [
        {"local": ["localhost:2222"]},  # ServerDefTest.testLocalServer
        {"local": ["localhost:2222", "localhost:2223"]},  # testTwoProcesses
        PS_WORKER,  # testTwoJobs
        {"ps": ["ps0:2222", "ps1:2222"], "worker": {0: "worker0:2222", 2: "worker2:2222"}},
    ],
)
def test_server_def_round_trips(cluster):
    """TF ``ServerDefTest`` (``testLocalServer``, ``testTwoProcesses``, ``testTwoJobs``,
    ``testDenseAndSparseJobs``): any job name, dense or sparse, survives the round trip."""
    spec = ClusterSpec(cluster)
    assert ClusterSpec(spec.as_dict()) == spec
    assert spec.as_dict() == cluster


# -- multi_worker_util_test.py ----------------------------------------------------------------


def test_normalize_cluster_spec_inputs():
    """TF ``NormalizeClusterSpecTest`` (``testDictAsInput``, ``testClusterSpecAsInput``,
    ``testUnexpectedInput``): a dict or a ClusterSpec is a cluster; a list is a ValueError."""
    assert ClusterSpec(FULL).as_dict() == ClusterSpec(ClusterSpec(FULL)).as_dict() == FULL
    with pytest.raises(ValueError, match=r"ClusterSpec expects a dict .* got list"):
        ClusterSpec(["127.0.0.1:8964", "127.0.0.1:2333"])  # type: ignore[arg-type]


def test_is_chief_cluster_with_chief():
    """TF ``IsChiefTest.testClusterWithChief`` (stratagem's argument order is Keras's
    ``_is_chief(task_type, task_id, cluster_spec)``)."""
    assert is_chief("chief", 0, FULL) is True
    assert is_chief("worker", 0, FULL) is False


def test_is_chief_cluster_without_chief():
    """TF ``IsChiefTest.testClusterWithoutChief``: worker 0 is the chief; a task the cluster
    does not have is an error (raised by the resolver that would hold it: stratagem's
    ``is_chief`` is Keras's ``_is_chief``, which checks nothing)."""
    cluster = {"worker": ["127.0.0.1:8964", "127.0.0.1:2333"]}
    assert is_chief("worker", 0, cluster) is True
    assert is_chief("worker", 1, cluster) is False
    assert SimpleClusterResolver(cluster, task_type="worker", task_id=0).is_chief is True
    with pytest.raises(ValueError, match=r"task.type 'chief' is not a job of the cluster"):
        SimpleClusterResolver(cluster, task_type="chief", task_id=0)
    with pytest.raises(ValueError, match=r"task.index 2 is out of range for job 'worker'"):
        SimpleClusterResolver(cluster, task_type="worker", task_id=2)


def test_evaluator_is_not_the_chief_who_writes():
    """TF ``IsChiefTest.testEvaluatorIsChief`` is a deliberate difference: stratagem's
    ``is_chief`` decides who writes checkpoints and logs, Keras's
    ``distributed_file_utils._is_chief`` rule, where the evaluator is not the chief (TF's
    ``multi_worker_util.is_chief`` calls it "chief of itself"; an evaluator runs alone anyway)."""
    cluster = {**FULL, "evaluator": ["127.0.0.1:2019"]}
    del cluster["ps"]
    assert is_chief("evaluator", 0, cluster) is False
    assert is_chief("evaluator", 0, FULL) is False  # not listed: valid, and not the chief


def test_evaluator_strategy_checkpoints_as_tf_chief_of_itself():
    """TF's ``multi_worker_util.is_chief`` gives True for the evaluator ("chief of itself"),
    and ``CollectiveAllReduceExtended`` answers ``should_checkpoint`` and
    ``should_save_summary`` with it: under ``MultiWorkerMirroredStrategy`` an evaluator task
    (alone, one replica) writes its checkpoints and summaries. The names shared with TF follow
    TF; only ``is_chief`` (Keras's who-writes rule) says False for it."""

    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]}
    resolver = SimpleClusterResolver(cluster, task_type="evaluator", task_id=0)
    strategy = sg.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.should_checkpoint is True
    assert strategy.extended.should_save_summary is True
    assert resolver.is_chief is False


def test_count_workers():
    """TF ``NumWorkersTest.testCountWorker``: the chief counts as a worker."""
    assert len(collective_members(FULL)) == 3
    resolver = SimpleClusterResolver(FULL, task_type="worker", task_id=1)
    assert resolver.world_size == 3


def test_count_workers_of_an_empty_cluster():
    """TF ``NumWorkersTest.testTaskTypeNotFound`` (TF raises; stratagem: no collective
    members, and a resolver without a cluster is a world of one)."""
    assert collective_members({}) == []
    assert SimpleClusterResolver({}).world_size == 1


def test_ps_and_evaluator_have_no_id():
    """TF ``IdInClusterTest.testPsId`` and ``NumWorkersTest.testCountPs``: a ps has no id
    among the workers (TF raises; ``rank_of`` is None). An evaluator (TF's
    ``testEvaluatorId``: id 0 of its own partition) takes no part in collectives either."""
    assert rank_of("ps", 0, {"chief": ["127.0.0.1:1234"], "ps": ["127.0.0.1:7566"]}) is None
    assert rank_of("evaluator", 0, {**FULL, "evaluator": ["127.0.0.1:7566"]}) is None


def test_id_in_cluster():
    """TF ``IdInClusterTest.testChiefId`` and ``testWorkerId``: the chief is 0, then the
    workers by index."""
    assert rank_of("chief", 0, FULL) == 0
    assert rank_of("worker", 1, FULL) == 2
    no_chief = {"worker": FULL["worker"], "ps": FULL["ps"]}
    assert rank_of("worker", 1, no_chief) == 1


def test_multiple_chiefs():
    """TF ``IdInClusterTest.testMultipleChiefs``: at most one chief."""
    cluster = {"chief": ["127.0.0.1:8258", "127.0.0.1:7566"]}
    with pytest.raises(ValueError, match=r"cluster.chief has 2 tasks .* expected at most one"):
        SimpleClusterResolver(cluster, task_type="chief", task_id=0)


@pytest.mark.parametrize(
    ("cluster", "task", "leader"),
    [
        (FULL, ("worker", 0), ("chief", 0)),  # testChiefAsLeader
        ({"worker": FULL["worker"], "ps": FULL["ps"]}, ("worker", 1), ("worker", 0)),
    ],
)
def test_collective_leader(cluster, task, leader):
    """TF ``CollectiveLeaderTest.testChiefAsLeader`` and ``testWorkerAsLeader``: the chief
    leads, else worker 0; stratagem's leader hosts the rendezvous (rank 0)."""
    assert collective_members(cluster)[0] == leader
    resolver = SimpleClusterResolver(cluster, task_type=task[0], task_id=task[1])
    assert resolver.rendezvous_address == sg.cluster.parse_address(cluster[leader[0]][leader[1]])


def test_local_leader():
    """TF ``CollectiveLeaderTest.testLocalLeader``: no cluster, no leader to meet."""
    assert SimpleClusterResolver({}).rendezvous_address is None


def test_leader_for_evaluator():
    """TF ``CollectiveLeaderTest.testLeaderForEvaluator``: the evaluator joins no collective."""
    cluster = {**FULL, "evaluator": ["127.0.0.1:2019"]}
    resolver = SimpleClusterResolver(cluster, task_type="evaluator", task_id=0)
    assert resolver.rank is None


def test_evaluator_not_in_cluster():
    """TF ``ClusterSpecValidationTest.testEvaluatorNotInCluster``: every listed task and an
    unlisted evaluator are valid tasks."""
    for task_type in ("chief", "worker", "ps", "evaluator"):
        resolver = SimpleClusterResolver(FULL, task_type=task_type, task_id=0)
        assert resolver.task_type == task_type
    text = json.dumps({"cluster": FULL, "task": {"type": "evaluator", "index": 0}})
    assert load_tf_config(text).task_type == "evaluator"


def test_worker_not_in_cluster():
    """TF ``ClusterSpecValidationTest.testWorkerNotInCluster``: a worker must be listed."""
    cluster = {"chief": ["127.0.0.1:1234"], "ps": ["127.0.0.1:1926", "127.0.0.1:3141"]}
    SimpleClusterResolver(cluster, task_type="evaluator", task_id=0)
    with pytest.raises(ClusterConfigError, match=r"task.type 'worker' is not a job of the"):
        SimpleClusterResolver(cluster, task_type="worker", task_id=0)
