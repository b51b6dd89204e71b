"""Conformance: TensorFlow's own cluster resolver tests, translated (``tf.`` -> ``sg.``).

Each test names the TF test it translates, from ``tensorflow/python/distribute/
cluster_resolver/``: ``slurm_cluster_resolver_test.py``, ``tfconfig_cluster_resolver_test.py``
and ``cluster_resolver_test.py`` (SimpleClusterResolver). TF compares ``as_cluster_def()``
protos; stratagem has no ClusterDef, so the same jobs are compared through ``as_dict()`` and
the same round trips (``ClusterSpec(spec)``, ``ClusterSpec(spec.as_dict())``). The environment
is patched as TF's ``mock.patch.dict(os.environ, ...)`` does, with pytest's ``monkeypatch``.
Tests marked "stratagem" pin down choices TF leaves open; the porting notes list them.
"""

from __future__ import annotations

import json
import os
import stat

import pytest

import stratagem as sg
from stratagem.cluster import ClusterSpec, expand_hostlist, expand_tasks_per_node, resolve_cluster
from stratagem.cluster.slurm import count_gpus
from stratagem.errors import ClusterConfigError

SlurmClusterResolver = sg.distribute.cluster_resolver.SlurmClusterResolver
TFConfigClusterResolver = sg.distribute.cluster_resolver.TFConfigClusterResolver
SimpleClusterResolver = sg.distribute.cluster_resolver.SimpleClusterResolver

# Every variable a resolver reads: cleared first, so the machine's own cannot leak in.
_VARIABLES = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_STEP_ID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_JOB_ID",
    "SLURM_RESTART_COUNT",
    "CUDA_VISIBLE_DEVICES",
    "STRATAGEM_PORT",
    "MASTER_PORT",
    "TF_CONFIG",
    "STRATAGEM_CONFIG",
    "STRATAGEM_RESTART_COUNT",
    "RANK",
    "WORLD_SIZE",
)


@pytest.fixture
def environ(monkeypatch):
    """``mock.patch.dict(os.environ, values)``: set ``values`` on a clean slate."""
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def patch(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return patch


def verify_cluster_spec_equality(spec: ClusterSpec, expected: dict) -> None:
    """TF's ``_verifyClusterSpecEquality``, without the ClusterDef proto."""
    assert spec.as_dict() == expected
    assert ClusterSpec(spec).as_dict() == expected
    assert ClusterSpec(spec.as_dict()).as_dict() == expected
    assert spec == ClusterSpec(expected)


# -- slurm_cluster_resolver_test.py -----------------------------------------------------------


def test_expand_hostlist():
    """TF ``SlurmClusterResolverTest.test_expand_hostlist``."""
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("n[1,3]") == ["n1", "n3"]
    assert expand_hostlist("n[1-3]") == ["n1", "n2", "n3"]
    assert expand_hostlist("n[1-2],m5,o[3-4,6,7-9]") == [
        "n1",
        "n2",
        "m5",
        "o3",
        "o4",
        "o6",
        "o7",
        "o8",
        "o9",
    ]
    assert expand_hostlist("n[0001-0003],m5,o[009-011]") == [
        "n0001",
        "n0002",
        "n0003",
        "m5",
        "o009",
        "o010",
        "o011",
    ]


def test_expand_tasks_per_node():
    """TF ``SlurmClusterResolverTest.test_expand_tasks_per_node``."""
    assert expand_tasks_per_node("2") == [2]
    assert expand_tasks_per_node("2,1,3") == [2, 1, 3]
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("3(x2),2,11(x4)") == [3, 3, 2, 11, 11, 11, 11]
    assert expand_tasks_per_node("13(x10)") == [13] * 10


def test_slurm_simple_retrieval_from_env(environ):
    """TF ``testSimpleRetrievalFromEnv``: every default read from the step's variables."""
    environ(
        SLURM_PROCID="0",
        SLURM_STEP_NUM_TASKS="3",
        SLURM_STEP_TASKS_PER_NODE="1(x3)",
        SLURM_STEP_NODELIST="t02n13,t02n41,t02n43",
        CUDA_VISIBLE_DEVICES="0",
    )
    resolver = SlurmClusterResolver()
    verify_cluster_spec_equality(
        resolver.cluster_spec(), {"worker": ["t02n13:8888", "t02n41:8888", "t02n43:8888"]}
    )
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert resolver.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_slurm_simple_successful_retrieval(environ):
    """TF ``testSimpleSuccessfulRetrieval``: two jobs, dealt in job-name order."""
    environ(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NODELIST="t02n13,t02n41,t02n43")
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        port_base=8888,
        tasks_per_node=1,
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    verify_cluster_spec_equality(
        resolver.cluster_spec(), {"ps": ["t02n13:8888"], "worker": ["t02n41:8888", "t02n43:8888"]}
    )
    assert resolver.get_task_info() == ("ps", 0)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # auto_set_gpu=False


def test_slurm_simple_master_retrieval(environ):
    """TF ``testSimpleMasterRetrieval``: task and rpc layer are settable; master follows."""
    environ(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NODELIST="t02n13,t02n41,t02n43")
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        port_base=8888,
        tasks_per_node=1,
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    resolver.task_type = "worker"
    resolver.task_id = 1
    assert resolver.master() == "grpc://t02n43:8888"
    resolver.rpc_layer = "ab"
    assert resolver.master("ps", 0) == "ab://t02n13:8888"
    assert resolver.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"


def test_slurm_task_per_node_not_set_retrieval(environ):
    """TF ``testTaskPerNodeNotSetRetrieval``: tasks per node from SLURM_STEP_TASKS_PER_NODE."""
    environ(
        SLURM_PROCID="0",
        SLURM_STEP_NUM_TASKS="3",
        SLURM_STEP_TASKS_PER_NODE="1(x3)",
        SLURM_STEP_NODELIST="t02n13,t02n41,t02n43",
    )
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        port_base=8888,
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    verify_cluster_spec_equality(
        resolver.cluster_spec(), {"ps": ["t02n13:8888"], "worker": ["t02n41:8888", "t02n43:8888"]}
    )


def test_slurm_multi_task_per_node_retrieval(environ):
    """TF ``testMultiTaskPerNodeRetrieval``: ports per node, one GPU per task."""
    environ(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="5",
        SLURM_STEP_TASKS_PER_NODE="2(x2),1",
        SLURM_STEP_NODELIST="t02n13,t02n41,t02n43",
        CUDA_VISIBLE_DEVICES="",
    )
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4},
        port_base=8888,
        gpus_per_node=2,
        gpus_per_task=1,
        auto_set_gpu=True,
    )
    verify_cluster_spec_equality(
        resolver.cluster_spec(),
        {
            "ps": ["t02n13:8888"],
            "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"],
        },
    )
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert resolver.get_task_info() == ("worker", 0)


def test_slurm_multiple_gpus_per_task_retrieval(environ):
    """TF ``testMultipleGpusPerTaskRetrieval``: local task 1 of its node gets GPUs 2 and 3."""
    environ(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="5",
        SLURM_STEP_TASKS_PER_NODE="2(x2),1",
        SLURM_STEP_NODELIST="t02n13,t02n41,t02n43",
        CUDA_VISIBLE_DEVICES="",
    )
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4},
        port_base=8888,
        gpus_per_node=4,
        gpus_per_task=2,
        auto_set_gpu=True,
    )
    verify_cluster_spec_equality(
        resolver.cluster_spec(),
        {
            "ps": ["t02n13:8888"],
            "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"],
        },
    )
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert resolver.num_accelerators() == {"GPU": 2}


def _step(**extra: str) -> dict[str, str]:
    """A three-node, five-task step as a plain mapping (the resolver's ``environ``)."""
    env = {
        "SLURM_PROCID": "3",
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
        "SLURM_STEP_NODELIST": "n[1-2],n5",
    }
    env.update(extra)
    return env


def test_slurm_requested_tasks_must_match_assigned_ones():
    """TF's check in ``SlurmClusterResolver.__init__``: "Requested N tasks but only M were
    assigned" (a RuntimeError in TF; a ClusterConfigError, a ValueError, here)."""
    with pytest.raises(ClusterConfigError, match=r"^Requested 4 tasks .* but 5 were assigned"):
        SlurmClusterResolver(jobs={"ps": 1, "worker": 3}, gpus_per_node=0, environ=_step())
    # TF's condition is ``sum(jobs) != num_tasks`` (every version of slurm_cluster_resolver.py):
    # asking for more tasks than SLURM assigned is refused too, not only fewer.
    with pytest.raises(ClusterConfigError, match=r"^Requested 6 tasks .* but 5 were assigned"):
        SlurmClusterResolver(jobs={"ps": 1, "worker": 5}, gpus_per_node=0, environ=_step())


def test_slurm_a_step_with_more_tasks_than_the_job_requested_is_read_from_its_own_variables(
    environ,
):
    """TF reads the step's variables only (SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE,
    SLURM_STEP_NODELIST): a step of 5 tasks, several per node, whose environment still says
    the job asked for 2 (SLURM_NTASKS, from sbatch), is TF's ``testMultiTaskPerNodeRetrieval``
    cluster, with its GPUs."""
    environ(
        SLURM_PROCID="1",
        SLURM_NTASKS="2",
        SLURM_STEP_NUM_TASKS="5",
        SLURM_STEP_TASKS_PER_NODE="2(x2),1",
        SLURM_STEP_NODELIST="t02n13,t02n41,t02n43",
        CUDA_VISIBLE_DEVICES="",
    )
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 4}, gpus_per_node=4, gpus_per_task=2)
    verify_cluster_spec_equality(
        resolver.cluster_spec(),
        {
            "ps": ["t02n13:8888"],
            "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"],
        },
    )
    assert resolver.get_task_info() == ("worker", 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_slurm_more_gpus_than_the_node_has_is_refused():
    """TF's check "Requested more GPUs per node then available": 2 tasks x 2 GPUs > 3."""
    with pytest.raises(
        ClusterConfigError,
        match=r"more GPUs per node than available: 2 tasks per node x gpus_per_task=2 > "
        r"gpus_per_node=3",
    ):
        SlurmClusterResolver(gpus_per_node=3, gpus_per_task=2, environ=_step())


def test_slurm_default_gpus_per_task_divides_the_node():
    """TF: ``gpus_per_task`` defaults to ``gpus_per_node // max tasks per node``."""
    env = _step(CUDA_VISIBLE_DEVICES="0,1,2,3,4")
    resolver = SlurmClusterResolver(environ=env)  # 5 GPUs, 2 tasks per node: 2 each
    assert resolver.num_accelerators() == {"GPU": 2}
    resolver.cluster_spec()
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # procid 3 is local task 1 of n2


def test_slurm_tasks_per_node_as_a_dict():
    """TF's ``tasks_per_node={hostname: tasks}``: hosts and counts given, not read."""
    env = {"SLURM_PROCID": "2"}
    resolver = SlurmClusterResolver(
        jobs={"chief": 1, "worker": 2},
        port_base=2000,
        tasks_per_node={"a": 1, "b": 2},
        auto_set_gpu=False,
        environ=env,
    )
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["a:2000"],
        "worker": ["b:2000", "b:2001"],
    }
    assert resolver.get_task_info() == ("worker", 1)
    assert (resolver.rank, resolver.world_size, resolver.is_chief) == (2, 3, False)


def test_slurm_several_jobs_give_stratagem_roles():
    """stratagem: a SLURM step with a ps job has TF's roles: the ps takes no part in the
    collectives, the first worker is the chief and hosts the rendezvous."""
    env = _step(SLURM_PROCID="0")
    resolver = SlurmClusterResolver(
        jobs={"worker": 4, "ps": 1}, port_base=7000, auto_set_gpu=False, environ=env
    )
    assert resolver.get_task_info() == ("ps", 0)  # "ps" sorts before "worker"
    assert (resolver.rank, resolver.world_size, resolver.is_chief) == (None, 4, False)
    assert resolver.rendezvous_address == ("n1", 7001)
    assert resolver.describe() == "ps 0 of 4 workers, 1 ps (SLURM)"


def test_slurm_gpus_follow_an_inherited_cuda_visible_devices():
    """stratagem: where CUDA_VISIBLE_DEVICES lists the node's GPUs (``4,5,6,7``), a task gets
    the entries at its positions; TF writes the positions themselves, naming GPUs the job may
    not own. Without the variable both give the same answer (tests above)."""
    env = _step(SLURM_PROCID="1", CUDA_VISIBLE_DEVICES="4,5,6,7")
    resolver = SlurmClusterResolver(environ=env)
    assert resolver.task_gpus == ["6", "7"]
    resolver.cluster_spec()
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    resolver.cluster_spec()  # every call sets it again, as TF; the same value
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_slurm_without_gpus_leaves_cuda_visible_devices_alone(monkeypatch):
    """stratagem: on a node without ``nvidia-smi`` there are 0 GPUs (TF raises); no task gets
    a GPU, so CUDA_VISIBLE_DEVICES is not set and ``num_accelerators()`` is empty."""
    monkeypatch.setattr("stratagem.cluster.slurm.shutil.which", lambda name: None)
    env = _step()
    resolver = SlurmClusterResolver(environ=env)
    resolver.cluster_spec()
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert resolver.num_accelerators() == {}


def test_count_gpus_reads_nvidia_smi(tmp_path, monkeypatch):
    """TF ``get_num_gpus``: CUDA_VISIBLE_DEVICES's entries if set, else the ``GPU`` lines of
    ``nvidia-smi --list-gpus`` (a fake one here)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: A (UUID: x)'\necho 'GPU 1: A (UUID: y)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert count_gpus({}) == 2
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "3,5,7"}) == 3
    assert count_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"jobs": {}}, r"jobs must be a non-empty dict .* got \{\}"),
        ({"jobs": {"worker": -1, "ps": 6}}, r"jobs\['worker'\] must be an int >= 0, got -1"),
        ({"tasks_per_node": 0}, r"tasks_per_node must be an int >= 1, got 0"),
        ({"gpus_per_task": -1}, r"gpus_per_task must be an int >= 0, got -1"),
        ({"port_base": 65535}, r"port base 65535 plus 2 tasks per node exceeds port 65535"),
        ({"port_base": "x"}, r"port_base must be an integer"),
    ],
)
def test_slurm_bad_arguments_are_named(kwargs, pattern):
    """stratagem: every argument is checked, the message echoes the value."""
    with pytest.raises(ClusterConfigError, match=pattern):
        SlurmClusterResolver(**{"gpus_per_node": 2, **kwargs}, environ=_step())


def test_resolve_cluster_builds_the_slurm_resolver_without_touching_gpus(monkeypatch):
    """stratagem: ``resolve_cluster()`` (what strategies use) builds every task a worker on
    stratagem's port and leaves CUDA_VISIBLE_DEVICES as the launcher set it."""
    monkeypatch.setattr("stratagem.cluster.slurm.shutil.which", lambda name: 1 / 0)  # unused
    env = _step(SLURM_STEP_ID="0", STRATAGEM_PORT="4000")
    resolver = resolve_cluster(env)
    assert type(resolver) is SlurmClusterResolver
    assert resolver.cluster_spec().job_tasks("worker")[3] == "n2:4001"
    assert "CUDA_VISIBLE_DEVICES" not in env


# -- tfconfig_cluster_resolver_test.py --------------------------------------------------------

_PS_WORKER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}


def _tf_config(task: dict | None = None, cluster: dict | None = None, **extra: object) -> str:
    config: dict = {"cluster": _PS_WORKER if cluster is None else cluster, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


def test_tf_config_normal_cluster_spec_read(environ):
    """TF ``testNormalClusterSpecRead``."""
    environ(TF_CONFIG=_tf_config({"type": "ps", "index": 0}))
    verify_cluster_spec_equality(TFConfigClusterResolver().cluster_spec(), _PS_WORKER)


def test_tf_config_automatic_master_read(environ):
    """TF ``testAutomaticMasterRead``."""
    environ(TF_CONFIG=_tf_config({"type": "ps", "index": 0}))
    assert TFConfigClusterResolver().master() == "ps0:2222"


def test_tf_config_specified_task_type_and_index_master_read(environ):
    """TF ``testSpecifiedTaskTypeAndIndexMasterRead``."""
    environ(TF_CONFIG=_tf_config({"type": "ps", "index": 0}))
    assert TFConfigClusterResolver().master("worker", 1) == "worker1:2222"


def test_tf_config_session_master_read(environ):
    """TF ``testSessionMasterRead``: ``session_master`` wins."""
    environ(TF_CONFIG=_tf_config({"type": "ps", "index": 0}, session_master="sessionmaster:2222"))
    assert TFConfigClusterResolver().master() == "sessionmaster:2222"


def test_tf_config_rpc_layer_read(environ):
    """TF ``testRpcLayerRead``."""
    environ(TF_CONFIG=_tf_config({"type": "ps", "index": 0}, rpc_layer="grpc"))
    assert TFConfigClusterResolver().master() == "grpc://ps0:2222"


def test_tf_config_task_type_index_rpc_read(environ):
    """TF ``testTaskTypeIndexRpcRead``."""
    environ(TF_CONFIG=_tf_config({"type": "ps", "index": 0}, rpc_layer="grpc"))
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, "grpc")


def test_tf_config_parameter_overrides(environ):
    """TF ``testParameterOverrides``: arguments override TF_CONFIG; attributes are settable."""
    environ(TF_CONFIG=_tf_config({"type": "ps", "index": 1}, rpc_layer="grpc"))
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0)
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)
    resolver.task_type = "worker"
    resolver.task_id = 1
    resolver.rpc_layer = "test"
    assert resolver.master() == "test://worker1:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "test")


def test_tf_config_task_type_cast_to_string(environ):
    """TF ``testTaskTypeCastToString``: any job name; an int task type is read as a string."""
    cluster = {"123456": ["ps0:2222", "ps1:2222"], "worker": _PS_WORKER["worker"]}
    environ(TF_CONFIG=_tf_config({"type": 123456, "index": 0}, cluster, rpc_layer="grpc"))
    resolver = TFConfigClusterResolver()
    assert resolver.task_type == "123456"
    assert resolver.master() == "grpc://ps0:2222"


def test_tf_config_task_index_cast_to_integer(environ):
    """TF ``testTaskIndexCastToInteger``."""
    environ(TF_CONFIG=_tf_config({"type": "ps", "index": "1"}, rpc_layer="grpc"))
    assert TFConfigClusterResolver().task_id == 1


def test_tf_config_task_index_override(environ):
    """TF ``testTaskIndexOverride``."""
    cluster = {"worker": ["worker0:2222", "worker1:2222"]}
    environ(TF_CONFIG=_tf_config({"type": "worker", "index": "0"}, cluster))
    assert TFConfigClusterResolver(task_id=1).task_id == 1


def test_tf_config_zero_items_in_cluster_spec_master_read(environ):
    """TF ``testZeroItemsInClusterSpecMasterRead``."""
    environ(TF_CONFIG="\n    {}\n    ")
    assert TFConfigClusterResolver().master() == ""


def test_tf_config_one_item_in_cluster_spec_master_read(environ):
    """TF ``testOneItemInClusterSpecMasterRead``: a cluster without "task" is accepted, and a
    cluster of one task has no master to name."""
    environ(TF_CONFIG=_tf_config(cluster={"worker": ["worker0:2222"]}))
    resolver = TFConfigClusterResolver()
    assert resolver.master() == ""
    assert resolver.task_type is None


def test_tf_config_any_job_name(environ):
    """TF ``testNumAcceleratorsFilterTasksByEnvVar``'s cluster: jobs ``worker1``/``worker2``
    are accepted (its device counting needs TF's runtime; stratagem's ``num_accelerators()``
    on a TF_CONFIG resolver is ``{}``: the cluster layer imports no torch)."""
    cluster = {"worker1": ["w10:2222"], "worker2": ["w21:2222", "w22:2222", "w23:2222"]}
    environ(TF_CONFIG=_tf_config({"type": "worker1", "index": "0"}, cluster, rpc_layer="grpc"))
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("worker1", 0)
    assert resolver.master(task_type="worker2", task_id=2) == "grpc://w23:2222"
    assert resolver.num_accelerators() == {}
    # A job no collective uses: no rank; a strategy says it cannot use the job.
    assert (resolver.rank, resolver.is_chief) == (None, False)
    with pytest.raises(ClusterConfigError, match=r"cannot use task types 'worker1', 'worker2'"):
        sg.cluster.check_task_types(resolver.cluster_spec(), ("chief", "worker"), "Strategy")


def test_tf_config_evaluator_outside_the_cluster(environ):
    """TF ``multi_worker_util._validate_cluster_spec`` (``testEvaluatorNotInCluster``): an
    evaluator task the cluster does not list is valid; it runs beside the cluster."""
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"]}
    environ(TF_CONFIG=_tf_config({"type": "evaluator", "index": 0}, cluster))
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("evaluator", 0)
    assert (resolver.rank, resolver.world_size, resolver.is_chief) == (None, 3, False)
    assert resolver.describe() == "evaluator of 1 chief, 2 workers (TF_CONFIG)"
    assert resolve_cluster().task_type == "evaluator"


def test_tf_config_without_task_cannot_join_a_strategy(environ):
    """stratagem: TF's resolver accepts a cluster without "task", but a process must know its
    task to join (TF's strategies raise too): ``rank`` and ``resolve_cluster()`` say so."""
    environ(TF_CONFIG=_tf_config(cluster={"worker": ["a:1", "b:1"]}))
    resolver = TFConfigClusterResolver()
    with pytest.raises(ClusterConfigError, match=r"describes a cluster .* but no \"task\""):
        _ = resolver.rank
    with pytest.raises(ClusterConfigError, match=r"^TF_CONFIG describes a cluster"):
        resolve_cluster()
    resolver.task_type, resolver.task_id = "worker", 1  # TF: set them, and it works
    assert resolver.rank == 1


# -- cluster_resolver_test.py (SimpleClusterResolver) -----------------------------------------


def test_init_simple_cluster_resolver():
    """TF ``testInitSimpleClusterResolver`` (``task_index`` is today's ``task_id``)."""
    resolver = SimpleClusterResolver(
        ClusterSpec(_PS_WORKER),
        task_type="ps",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 8},
        rpc_layer="grpc",
    )
    assert (resolver.task_type, resolver.task_id) == ("ps", 1)
    assert resolver.environment == "cloud"
    assert resolver.num_accelerators() == {"GPU": 8}
    assert resolver.rpc_layer == "grpc"


def test_override_simple_cluster_resolver():
    """TF ``testOverrideSimpleClusterResolver``."""
    resolver = SimpleClusterResolver(
        ClusterSpec(_PS_WORKER), task_type="ps", task_id=1, environment="cloud", rpc_layer="grpc"
    )
    resolver.task_type = "worker"
    resolver.task_id = 2
    resolver.rpc_layer = "http"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 2, "http")
    assert resolver.rank == 2


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("worker", 0, "grpc"), "grpc://worker0:2222"),  # testSimpleOverrideMasterWithTaskIndexZero
        (("worker", 2, "grpc"), "grpc://worker2:2222"),  # testSimpleOverrideMasterWithRpcLayer
        (("worker", 2, None), "worker2:2222"),  # testSimpleOverrideMaster
    ],
)
def test_simple_override_master(args, expected):
    """TF ``testSimpleOverrideMaster*``: ``master(task_type, task_id, rpc_layer)``."""
    assert SimpleClusterResolver(ClusterSpec(_PS_WORKER)).master(*args) == expected


def test_simple_resolver_keeps_sparse_jobs():
    """TF ``testRetainSparseJobWithNoMerging`` (without UnionClusterResolver, which stratagem
    does not have): a sparse job stays sparse."""
    sparse = {"worker": {1: "worker0:2222", 3: "worker1:2222", 5: "worker2:2222"}}
    verify_cluster_spec_equality(SimpleClusterResolver(ClusterSpec(sparse)).cluster_spec(), sparse)
