"""Cluster resolvers (TF_CONFIG, explicit, torchrun, SLURM) and ``resolve_cluster``."""

from __future__ import annotations

import json

import pytest

from stratagem.cluster import (
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
    resolve_cluster,
    slurm_env_present,
    torchrun_env_present,
)
from stratagem.errors import ClusterConfigError

SEED_CLUSTER = {"worker": ["localhost:12345", "localhost:23456"]}


def tf_config(task_type: str = "worker", index: int = 0, cluster: dict | None = None, **extra):
    return json.dumps(
        {"cluster": cluster or SEED_CLUSTER, "task": {"type": task_type, "index": index}, **extra}
    )


def torchrun_env(rank: int = 1, world_size: int = 4, **extra: str) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % 2),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
    }
    env.update(extra)
    return env


def slurm_env(procid: int = 0, **extra: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": str(procid),
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "5",
        "SLURM_STEP_NODELIST": "node[01-02]",
        "SLURM_STEP_TASKS_PER_NODE": "3,2",
        "SLURM_JOB_ID": "123456",
    }
    env.update(extra)
    return {key: value for key, value in env.items() if value is not None}


# -- TFConfigClusterResolver ------------------------------------------------------------------


def test_seed_worker_one():
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": tf_config(index=1)})
    assert resolver.cluster_spec() == ClusterSpec(SEED_CLUSTER)
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.source == "TF_CONFIG"
    assert (resolver.rank, resolver.world_size, resolver.local_rank) == (1, 2, 1)
    assert resolver.rendezvous_address == ("localhost", 12345)
    assert resolver.is_chief is False
    assert resolver.agent_store is False
    assert resolver.attempt == 0
    assert resolver.master() == "localhost:23456"
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://localhost:12345"
    assert resolver.environment == ""
    assert resolver.num_accelerators() == {}
    assert resolver.describe() == "worker 1 of 2 workers (TF_CONFIG)"
    assert resolver.peer_name(1) == "worker 1 (localhost:23456)"


def test_seed_worker_zero_is_chief():
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": tf_config(index=0)})
    assert resolver.is_chief is True
    assert (resolver.rank, resolver.local_rank) == (0, 0)


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.delenv("STRATAGEM_CONFIG", raising=False)
    monkeypatch.setenv("TF_CONFIG", tf_config(index=1))
    assert TFConfigClusterResolver().task_id == 1


CHIEF_CLUSTER = {
    "chief": ["hostA:1000"],
    "worker": ["hostA:1001", "hostB:1000", "hostA:1002"],
    "ps": ["hostA:2000"],
    "evaluator": ["hostC:3000"],
}


@pytest.mark.parametrize(
    ("task_type", "index", "rank", "local_rank", "chief"),
    [
        ("chief", 0, 0, 0, True),
        ("worker", 0, 1, 1, False),
        ("worker", 1, 2, 0, False),
        ("worker", 2, 3, 2, False),
        ("ps", 0, None, 0, False),
        ("evaluator", 0, None, 0, False),
    ],
)
def test_rank_and_local_rank_with_chief(task_type, index, rank, local_rank, chief):
    env = {"TF_CONFIG": tf_config(task_type, index, CHIEF_CLUSTER)}
    resolver = TFConfigClusterResolver(environ=env)
    assert resolver.rank == rank
    assert resolver.local_rank == local_rank
    assert resolver.is_chief is chief
    assert resolver.world_size == 4
    assert resolver.rendezvous_address == ("hostA", 1000)


def test_local_rank_compares_host_strings_exactly():
    cluster = {"worker": ["localhost:1", "127.0.0.1:2", "localhost:3"]}
    ranks = [
        TFConfigClusterResolver(environ={"TF_CONFIG": tf_config(index=i, cluster=cluster)})
        for i in range(3)
    ]
    assert [r.local_rank for r in ranks] == [0, 0, 1]


def test_peer_names_and_describe_with_chief():
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": tf_config("chief", 0, CHIEF_CLUSTER)})
    assert resolver.peer_name(0) == "chief (hostA:1000)"
    assert resolver.peer_name(3) == "worker 2 (hostA:1002)"
    assert resolver.describe() == "chief of 1 chief, 3 workers, 1 ps, 1 evaluator (TF_CONFIG)"
    with pytest.raises(
        ClusterConfigError, match=r"rank 4 is not a collective member; expected 0..3"
    ):
        resolver.peer_name(4)


def test_sparse_workers_rank_by_position():
    cluster = {"worker": {"1": "a:1", "3": "b:1"}}
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": tf_config(index=3, cluster=cluster)})
    assert (resolver.rank, resolver.world_size) == (1, 2)
    assert resolver.rendezvous_address == ("a", 1)
    assert resolver.is_chief is False


def test_ipv6_cluster():
    cluster = {"worker": ["[::1]:2222", "[::1]:2223"]}
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": tf_config(index=1, cluster=cluster)})
    assert resolver.rendezvous_address == ("::1", 2222)
    assert resolver.local_rank == 1
    assert resolver.master(rpc_layer="grpc") == "grpc://[::1]:2223"


def test_explicit_task_overrides_json():
    env = {"TF_CONFIG": tf_config(index=0)}
    resolver = TFConfigClusterResolver("worker", 1, environ=env)
    assert (resolver.task_id, resolver.rank) == (1, 1)
    assert TFConfigClusterResolver(task_id=1, environ=env).task_type == "worker"


def test_explicit_task_allows_tf_config_without_task():
    env = {"TF_CONFIG": json.dumps({"cluster": SEED_CLUSTER})}
    assert TFConfigClusterResolver("worker", 1, environ=env).rank == 1


def test_explicit_task_is_validated():
    env = {"TF_CONFIG": tf_config(index=0)}
    with pytest.raises(ClusterConfigError, match=r"task.index 5 is out of range .* expected 0..1"):
        TFConfigClusterResolver("worker", 5, environ=env)
    with pytest.raises(ClusterConfigError, match=r"task.type 'ps' is not a job"):
        TFConfigClusterResolver("ps", 0, environ=env)


def test_explicit_rpc_layer_and_environment_override_json():
    env = {"TF_CONFIG": tf_config(rpc_layer="grpc", environment="cloud")}
    plain = TFConfigClusterResolver(environ=env)
    assert (plain.rpc_layer, plain.environment) == ("grpc", "cloud")
    assert plain.master() == "grpc://localhost:12345"
    custom = TFConfigClusterResolver(rpc_layer="gloo", environment="", environ=env)
    assert (custom.rpc_layer, custom.environment) == ("gloo", "")


def test_task_attributes_are_settable_and_derived_values_follow():
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": tf_config(index=0)})
    resolver.task_id = 1
    assert (resolver.rank, resolver.is_chief) == (1, False)


@pytest.mark.parametrize(
    "env", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "{}"}, {"STRATAGEM_CONFIG": " ", "TF_CONFIG": ""}]
)
def test_no_config_is_a_local_process(env):
    resolver = TFConfigClusterResolver(environ=env)
    assert resolver.source == "local"
    assert not resolver.cluster_spec()
    assert (resolver.task_type, resolver.task_id) == (None, None)
    assert (resolver.rank, resolver.world_size, resolver.local_rank) == (0, 1, 0)
    assert resolver.rendezvous_address is None
    assert resolver.is_chief is True
    assert resolver.master() == ""
    assert resolver.peer_name(0) == "the local process"
    assert resolver.describe() == "a single process without a cluster (local)"


def test_restart_attempt_from_launcher():
    env = {"TF_CONFIG": tf_config(), "STRATAGEM_RESTART_COUNT": "2"}
    assert TFConfigClusterResolver(environ=env).attempt == 2
    with pytest.raises(ClusterConfigError, match=r"STRATAGEM_RESTART_COUNT='x' is not an integer"):
        TFConfigClusterResolver(environ={"STRATAGEM_RESTART_COUNT": "x"})


def test_stratagem_config_takes_precedence():
    resolver = TFConfigClusterResolver(environ={"STRATAGEM_CONFIG": tf_config(index=1)})
    assert (resolver.source, resolver.task_id) == ("STRATAGEM_CONFIG", 1)


def test_equal_stratagem_config_and_tf_config_are_fine():
    text = tf_config(index=1)
    same = json.dumps(json.loads(text), indent=2)  # same content, other spelling
    resolver = TFConfigClusterResolver(environ={"STRATAGEM_CONFIG": text, "TF_CONFIG": same})
    assert (resolver.source, resolver.rank) == ("STRATAGEM_CONFIG", 1)


def test_different_stratagem_config_and_tf_config_are_an_error():
    env = {"STRATAGEM_CONFIG": tf_config(index=1), "TF_CONFIG": tf_config(index=0)}
    with pytest.raises(ClusterConfigError) as info:
        TFConfigClusterResolver(environ=env)
    message = str(info.value)
    assert "STRATAGEM_CONFIG and TF_CONFIG are both set but differ" in message
    assert "(task worker 1)" in message
    assert "(task worker 0)" in message


def test_invalid_tf_config_beside_stratagem_config_is_reported():
    env = {"STRATAGEM_CONFIG": tf_config(index=1), "TF_CONFIG": "{bad"}
    with pytest.raises(ClusterConfigError, match=r"^TF_CONFIG is not valid JSON"):
        TFConfigClusterResolver(environ=env)


def test_invalid_stratagem_config_names_it():
    with pytest.raises(ClusterConfigError, match=r"^STRATAGEM_CONFIG: cluster.worker\[0\]"):
        TFConfigClusterResolver(
            environ={"STRATAGEM_CONFIG": tf_config(cluster={"worker": ["nohost"]})}
        )


# -- SimpleClusterResolver --------------------------------------------------------------------


def test_simple_resolver_tensorflow_signature():
    resolver = SimpleClusterResolver(
        ClusterSpec(SEED_CLUSTER),
        "grpc://localhost:12345",
        task_type="worker",
        task_id=1,
        num_accelerators={"GPU": 2},
        rpc_layer="grpc",
    )
    assert resolver.source == "explicit"
    assert resolver.master() == "grpc://localhost:12345"
    assert resolver.master("worker", 1) == "grpc://localhost:23456"
    assert resolver.num_accelerators() == {"GPU": 2}
    assert (resolver.rank, resolver.world_size, resolver.local_rank) == (1, 2, 1)
    assert resolver.describe() == "worker 1 of 2 workers (explicit)"


def test_simple_resolver_without_master_or_task():
    resolver = SimpleClusterResolver(SEED_CLUSTER)
    assert resolver.master() == ""
    assert resolver.task_type is None
    assert resolver.is_chief is True


@pytest.mark.parametrize(
    ("cluster", "task", "pattern"),
    [
        ({"worker": ["localhost"]}, {}, r"SimpleClusterResolver: cluster.worker\[0\]: .*port"),
        ({"worker": ["a:1", "a:1"]}, {}, r"have the same address 'a:1'"),
        ({"worker": ["a:1"]}, {"task_type": "worker", "task_id": 1}, r"expected 0..0"),
        ({"worker": ["a:1"]}, {"task_type": "ps", "task_id": 0}, r"'ps' is not a job"),
    ],
)
def test_simple_resolver_validates(cluster, task, pattern):
    with pytest.raises(ClusterConfigError, match=pattern):
        SimpleClusterResolver(cluster, **task)


# -- torchrun ---------------------------------------------------------------------------------


def test_torchrun_resolver():
    env = torchrun_env(
        rank=1,
        world_size=4,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="3",
    )
    resolver = TorchrunClusterResolver(environ=env)
    assert resolver.source == "torchrun"
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert (resolver.rank, resolver.world_size, resolver.local_rank) == (1, 4, 1)
    assert resolver.rendezvous_address == ("10.0.0.1", 29400)
    assert resolver.agent_store is True
    assert resolver.attempt == 3
    assert resolver.is_chief is False
    assert resolver.cluster_spec().job_tasks("worker") == [
        "10.0.0.1:29400",
        "<torchrun rank 1>",
        "<torchrun rank 2>",
        "<torchrun rank 3>",
    ]
    assert resolver.master() == ""  # its own address is not published
    assert resolver.master("worker", 0) == "10.0.0.1:29400"
    assert resolver.peer_name(2) == "rank 2"
    assert resolver.peer_name(0) == "rank 0 (10.0.0.1:29400)"
    assert resolver.describe() == "worker 1 of 4 workers (torchrun)"


def test_torchrun_defaults():
    env = torchrun_env(rank=0, world_size=1)
    del env["LOCAL_RANK"]
    resolver = TorchrunClusterResolver(environ=env)
    assert (resolver.rank, resolver.local_rank, resolver.attempt) == (0, 0, 0)
    assert resolver.agent_store is False
    assert resolver.is_chief is True


def test_torchrun_ipv6_master_addr():
    for host in ("::1", "[::1]"):
        resolver = TorchrunClusterResolver(environ=torchrun_env(MASTER_ADDR=host))
        assert resolver.rendezvous_address == ("::1", 29400)
        assert resolver.cluster_spec().task_address("worker", 0) == "[::1]:29400"


@pytest.mark.parametrize(
    ("missing", "listed"),
    [
        (["MASTER_ADDR"], "MASTER_ADDR is not set"),
        (["MASTER_ADDR", "MASTER_PORT"], "MASTER_ADDR, MASTER_PORT are not set"),
        (["RANK", "WORLD_SIZE"], "RANK, WORLD_SIZE are not set"),
    ],
)
def test_torchrun_partial_env_lists_missing(missing, listed):
    env = torchrun_env()
    for name in missing:
        del env[name]
    with pytest.raises(ClusterConfigError, match=rf"torchrun environment is incomplete: {listed}"):
        TorchrunClusterResolver(environ=env)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"RANK": "one"}, r"RANK='one' is not an integer"),
        ({"WORLD_SIZE": "2.0"}, r"WORLD_SIZE='2.0' is not an integer"),
        ({"RANK": "-1"}, r"RANK=-1 is below 0; expected >= 0"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, r"WORLD_SIZE=0 is below 1"),
        ({"RANK": "4"}, r"RANK=4 is out of range for WORLD_SIZE=4; expected 0..3"),
        ({"LOCAL_RANK": "9"}, r"LOCAL_RANK=9 is out of range for WORLD_SIZE=4"),
        ({"LOCAL_RANK": "x"}, r"LOCAL_RANK='x' is not an integer"),
        ({"MASTER_PORT": "abc"}, r"MASTER_PORT must be an integer in 1..65535, got 'abc'"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT must be in 1..65535, got 70000"),
        ({"MASTER_ADDR": "bad host"}, r"MASTER_ADDR='bad host' is not a host name"),
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, r"TORCHELASTIC_RESTART_COUNT='x'"),
    ],
)
def test_torchrun_bad_values(changes, pattern):
    with pytest.raises(ClusterConfigError, match=pattern):
        TorchrunClusterResolver(environ=torchrun_env(**changes))


def test_torchrun_empty_variable_counts_as_missing():
    with pytest.raises(ClusterConfigError, match=r"incomplete: MASTER_PORT is not set"):
        TorchrunClusterResolver(environ=torchrun_env(MASTER_PORT=""))


@pytest.mark.parametrize(
    ("env", "present"),
    [
        (torchrun_env(), True),
        ({"RANK": "0"}, True),
        ({"WORLD_SIZE": "2"}, True),
        ({"MASTER_ADDR": "a", "MASTER_PORT": "1"}, False),
        ({"RANK": ""}, False),
        ({}, False),
    ],
)
def test_torchrun_env_present(env, present):
    assert torchrun_env_present(env) is present


# -- SLURM ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("gpu5", ["gpu5"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("rack[1-2]-n[3-4]", ["rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"]),
        ("a,b[1],c", ["a", "b1", "c"]),
        ("x[001]y", ["x001y"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("", r"non-empty string"),
        ("node[1-3", r"'\[' is never closed"),
        ("node1-3]", r"'\]' at position 7 closes nothing"),
        ("node[1-[2]]", r"nested '\['"),
        ("node[]", r"'\[\]' is empty"),
        ("node[a-b]", r"'a-b' in '\[a-b\]' is not a number or a range"),
        ("node[3-1]", r"range '3-1' runs backwards"),
        ("node[1-2-3]", r"'1-2-3' .* is not a number"),
        ("a,,b", r"has an empty entry"),
        ("a, b", r"contains whitespace"),
        ("n[0-99999999]", r"has 100000000 hosts; expected at most"),
    ],
)
def test_expand_hostlist_rejects(text, pattern):
    with pytest.raises(ClusterConfigError, match=pattern) as info:
        expand_hostlist(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]), ("8(x2)", [8, 8])],
)
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(3)", "x", "2(x0)", "0", "2,", "2 (x3)"])
def test_expand_tasks_per_node_rejects(text):
    with pytest.raises(ClusterConfigError, match=r"tasks per node") as info:
        expand_tasks_per_node(text)
    assert repr(text) in str(info.value)


def slurm(env: dict[str, str], **kwargs) -> SlurmClusterResolver:
    """stratagem's SLURM resolver as ``resolve_cluster`` builds it (its port default, no GPUs)."""
    return SlurmClusterResolver(**{"port_base": None, "auto_set_gpu": False, **kwargs}, environ=env)


def test_slurm_addresses_follow_block_layout():
    resolver = slurm(slurm_env(procid=4, SLURM_LOCALID="1"))
    assert resolver.cluster_spec().job_tasks("worker") == [
        "node01:29956",
        "node01:29957",
        "node01:29958",
        "node02:29956",
        "node02:29957",
    ]
    assert resolver.source == "SLURM"
    assert (resolver.task_type, resolver.task_id) == ("worker", 4)
    assert (resolver.rank, resolver.world_size, resolver.local_rank) == (4, 5, 1)
    assert resolver.rendezvous_address == ("node01", 29956)
    assert resolver.port_base == 29956  # 29500 + 123456 % 1000
    assert resolver.describe() == "worker 4 of 5 workers (SLURM)"
    assert resolver.peer_name(3) == "worker 3 (node02:29956)"


@pytest.mark.parametrize(
    ("port_base", "extra", "expected"),
    [
        (4000, {"STRATAGEM_PORT": "5000", "MASTER_PORT": "6000"}, 4000),
        (None, {"STRATAGEM_PORT": "5000", "MASTER_PORT": "6000"}, 5000),
        (None, {"MASTER_PORT": "6000"}, 6000),
        (None, {}, 29956),
        (None, {"SLURM_JOB_ID": None}, 29500),
    ],
)
def test_slurm_port_precedence(port_base, extra, expected):
    resolver = slurm(slurm_env(**extra), port_base=port_base)
    assert resolver.rendezvous_address == ("node01", expected)


def test_slurm_even_spread_without_tasks_per_node():
    env = slurm_env(procid=2, SLURM_STEP_TASKS_PER_NODE=None, SLURM_LOCALID="2")
    resolver = slurm(env, port_base=7000)
    hosts = [a.split(":")[0] for a in resolver.cluster_spec().job_tasks("worker")]
    assert hosts == ["node01", "node01", "node01", "node02", "node02"]
    assert resolver.local_rank == 2


def test_slurm_falls_back_to_job_variables():
    env = slurm_env(
        procid=1,
        SLURM_STEP_NODELIST=None,
        SLURM_STEP_TASKS_PER_NODE=None,
        SLURM_NTASKS=None,
        SLURM_STEP_NUM_TASKS="2",
        SLURM_JOB_NODELIST="a,b",
        SLURM_TASKS_PER_NODE="1(x2)",
    )
    resolver = slurm(env, port_base=7000)
    assert resolver.cluster_spec().job_tasks("worker") == ["a:7000", "b:7000"]
    assert resolver.local_rank == 0


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"SLURM_PROCID": None}, r"SLURM environment is incomplete: SLURM_PROCID not set"),
        (
            {"SLURM_NTASKS": None, "SLURM_STEP_TASKS_PER_NODE": None},
            r"incomplete: SLURM_STEP_NUM_TASKS or SLURM_NTASKS not set",
        ),
        ({"SLURM_STEP_NODELIST": None}, r"SLURM_STEP_NODELIST or SLURM_JOB_NODELIST"),
        (
            {"SLURM_PROCID": "5"},
            r"SLURM_PROCID=5 is out of range for 5 tasks; expected 0..4",
        ),
        ({"SLURM_NTASKS": "five"}, r"SLURM_NTASKS='five' is not an integer"),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "5"},
            r"SLURM_STEP_TASKS_PER_NODE='5' gives 1 node but SLURM_STEP_NODELIST",
        ),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "2(x3)"},
            r"SLURM_STEP_TASKS_PER_NODE='2\(x3\)' gives 3 nodes but "
            r"SLURM_STEP_NODELIST='node\[01-02\]' lists 2",
        ),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "2,2"},
            r"adds up to 4 tasks but SLURM_NTASKS=5",
        ),
        ({"SLURM_LOCALID": "1"}, r"SLURM_LOCALID=1 but block distribution places SLURM_PROCID=0"),
        ({"STRATAGEM_PORT": "65534"}, r"port base 65534 plus 3 tasks per node exceeds port 65535"),
        ({"MASTER_PORT": "0"}, r"MASTER_PORT must be in 1..65535, got 0"),
    ],
)
def test_slurm_bad_environment(changes, pattern):
    env = slurm_env(**changes)
    with pytest.raises(ClusterConfigError, match=pattern):
        slurm(env)


def test_slurm_accepts_underscore_host_names():
    env = slurm_env(
        SLURM_STEP_NODELIST="node_[1-2]", SLURM_NTASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)"
    )
    spec = slurm(env, port_base=7000).cluster_spec()
    assert spec.job_tasks("worker") == ["node_1:7000", "node_2:7000"]


def test_slurm_rejects_bad_host_names():
    env = slurm_env(SLURM_STEP_NODELIST="no/de[1-2]")
    with pytest.raises(ClusterConfigError, match=r"SLURM_STEP_NODELIST='no/de\[1-2\]' names host"):
        slurm(env)


@pytest.mark.parametrize(
    ("env", "present"),
    [
        (slurm_env(), True),
        (slurm_env(SLURM_STEP_ID=None), False),  # a batch script outside srun
        (slurm_env(SLURM_PROCID=None), False),
        (slurm_env(SLURM_NTASKS="0"), False),
        (slurm_env(SLURM_NTASKS=None), False),
        (slurm_env(SLURM_NTASKS=None, SLURM_STEP_NUM_TASKS="2"), True),
        (slurm_env(SLURM_NTASKS="x"), True),  # present, so the resolver reports the bad value
        ({}, False),
    ],
)
def test_slurm_env_present(env, present):
    assert slurm_env_present(env) is present


def test_slurm_restart_count():
    env = slurm_env(SLURM_RESTART_COUNT="1")
    assert slurm(env).attempt == 1


# -- resolve_cluster --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "kind", "source"),
    [
        ({}, TFConfigClusterResolver, "local"),
        ({"TF_CONFIG": tf_config(index=1)}, TFConfigClusterResolver, "TF_CONFIG"),
        ({"STRATAGEM_CONFIG": tf_config()}, TFConfigClusterResolver, "STRATAGEM_CONFIG"),
        ({**torchrun_env(), **slurm_env()}, TorchrunClusterResolver, "torchrun"),
        (slurm_env(), SlurmClusterResolver, "SLURM"),
        ({"TF_CONFIG": "{}", **torchrun_env()}, TorchrunClusterResolver, "torchrun"),
        ({"TF_CONFIG": tf_config(), **slurm_env()}, TFConfigClusterResolver, "TF_CONFIG"),
        (slurm_env(SLURM_STEP_ID=None), TFConfigClusterResolver, "local"),
    ],
)
def test_resolve_cluster_priority(env, kind, source):
    resolver = resolve_cluster(env)
    assert type(resolver) is kind
    assert resolver.source == source


def test_resolve_cluster_reads_os_environ(monkeypatch):
    for name in ("STRATAGEM_CONFIG", "TF_CONFIG", "RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_CONFIG", tf_config(index=1))
    assert resolve_cluster().task_id == 1


def test_resolve_cluster_agreeing_tf_config_and_torchrun():
    env = {"TF_CONFIG": tf_config(index=1), **torchrun_env(rank=1, world_size=2)}
    assert resolve_cluster(env).source == "TF_CONFIG"


def test_resolve_cluster_world_size_mismatch():
    env = {"TF_CONFIG": tf_config(index=1), **torchrun_env(rank=1, world_size=3)}
    with pytest.raises(
        ClusterConfigError,
        match=r"^world-size mismatch: TF_CONFIG describes 2 workers but WORLD_SIZE=3",
    ):
        resolve_cluster(env)


def test_resolve_cluster_world_size_mismatch_with_chief():
    env = {"TF_CONFIG": tf_config("chief", 0, CHIEF_CLUSTER), **torchrun_env(0, 2)}
    with pytest.raises(ClusterConfigError, match=r"describes 4 collective members \(1 chief"):
        resolve_cluster(env)


def test_resolve_cluster_rank_mismatch():
    env = {"TF_CONFIG": tf_config(index=1), **torchrun_env(rank=0, world_size=2)}
    with pytest.raises(
        ClusterConfigError,
        match=r"^rank mismatch: TF_CONFIG makes this process rank 1 \(worker 1\) but RANK=0",
    ):
        resolve_cluster(env)


def test_resolve_cluster_reports_invalid_config():
    with pytest.raises(ClusterConfigError, match=r"^TF_CONFIG is not valid JSON"):
        resolve_cluster({"TF_CONFIG": "{", **torchrun_env()})
    with pytest.raises(ClusterConfigError, match=r"torchrun environment is incomplete"):
        resolve_cluster({"RANK": "0"})
