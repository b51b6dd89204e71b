"""TensorFlow's own ``ParameterServerStrategy`` + ``ClusterCoordinator`` on the work that
``benchmarks/coordinator.py`` gives stratagem's: the anchor its ``--tf-python`` runs.

Run with a Python that has ``tensorflow-cpu`` (and ``scikit-learn``, for the digits); TF is
never a dependency of stratagem or of its CI. One job is 1 chief, 2 workers and 1 ps, each its
own process on this machine (gRPC servers on free ports, ``TF_CONFIG``): the chief schedules, for
``--seconds``, with at most 8 functions in flight,

- ``--empty``: functions doing nothing: functions/s (the dispatch cost);
- otherwise: ``--steps-per-function`` training steps of an MLP 64-128-10 on digits (batch 32,
  SGD with momentum 0.9, lr 0.05, the variables on the ps, each worker's own shuffled
  per-worker dataset): updates/s (a step counter on the ps, read before and after).

It prints ``RESULT {"per_s": ...}`` as stratagem's jobs do.

    /path/to/tf-venv/bin/python benchmarks/coordinator_tf.py --steps-per-function 10
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from job_cpu import job_cpu_seconds, per_update_ms  # this file's folder: stdlib only

BATCH = 32


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def digits():
    """The digits as float32 rows of 64 in [0, 1] and int64 labels (sklearn's copy)."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int64)


def serve() -> None:
    """A worker or ps task: a gRPC server until the chief's job ends it."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol="grpc",
        start=True,
    )
    server.join()


def chief(args: argparse.Namespace) -> None:
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    x, y = digits()
    with strategy.scope():
        init = tf.keras.initializers.GlorotUniform(seed=0)
        weights = [
            tf.Variable(init((64, 128))),
            tf.Variable(tf.zeros(128)),
            tf.Variable(init((128, 10))),
            tf.Variable(tf.zeros(10)),
        ]
        moments = [tf.Variable(tf.zeros_like(w)) for w in weights]
        steps = tf.Variable(0, dtype=tf.int64)

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).repeat().batch(BATCH)

    steps_per_function = args.steps_per_function

    @tf.function
    def train(iterator):
        for _ in range(steps_per_function):  # TF's steps_per_execution, in a custom loop
            features, labels = next(iterator)
            with tf.GradientTape() as tape:
                hidden = tf.nn.relu(tf.matmul(features, weights[0]) + weights[1])
                logits = tf.matmul(hidden, weights[2]) + weights[3]
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
                )
            grads = tape.gradient(loss, weights)
            for w, m, g in zip(weights, moments, grads):  # tf.keras SGD's momentum rule
                m.assign(0.9 * m - 0.05 * g)
                w.assign_add(m)
            steps.assign_add(1)

    @tf.function
    def empty():
        return tf.constant(0)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    fn, fn_args = (empty, ()) if args.empty else (train, (iterator,))
    for _ in range(4):  # every worker's first call (tracing, its connections)
        coordinator.schedule(fn, args=fn_args)
    coordinator.join()
    before = int(steps.numpy())
    cpu_before = job_cpu_seconds()
    outstanding: list = []
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        while len(outstanding) < 8:  # keep every worker busy: a few queued behind each
            outstanding.append(coordinator.schedule(fn, args=fn_args))
        outstanding.pop(0).fetch()
        done += 1
    coordinator.join()
    seconds = time.perf_counter() - start
    cpu_after = job_cpu_seconds()
    done += len(outstanding)
    updates = done if args.empty else int(steps.numpy()) - before
    cpu_ms = per_update_ms(cpu_before, cpu_after, updates)
    print("RESULT " + json.dumps({"per_s": updates / seconds, "cpu_ms": cpu_ms}), flush=True)


def launch(args: argparse.Namespace) -> None:
    """Start the 4 tasks of a job, each with its TF_CONFIG; the chief's output is ours."""
    chief_port, w0, w1, ps0 = free_ports(4)
    cluster = {
        "chief": [f"localhost:{chief_port}"],
        "worker": [f"localhost:{w0}", f"localhost:{w1}"],
        "ps": [f"localhost:{ps0}"],
    }
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    argv = [sys.executable, __file__, "--seconds", str(args.seconds)]
    argv += ["--steps-per-function", str(args.steps_per_function)]
    if args.empty:
        argv.append("--empty")

    def start(task_type: str, index: int, role: str) -> subprocess.Popen:
        config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
        out = None if role == "--chief" else subprocess.DEVNULL
        return subprocess.Popen(
            [*argv, role], env={**env, "TF_CONFIG": json.dumps(config)}, stdout=out, stderr=out
        )

    servers = [start("worker", 0, "--serve"), start("worker", 1, "--serve")]
    servers.append(start("ps", 0, "--serve"))
    try:
        code = start("chief", 0, "--chief").wait(timeout=args.seconds + 300)
    finally:
        for proc in servers:  # only the processes started here, by their own handle
            proc.kill()
            proc.wait()
    if code != 0:
        sys.exit(f"the TF chief exited {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--empty", action="store_true", help="schedule empty functions")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds")
    parser.add_argument("--steps-per-function", type=int, default=1)
    args = parser.parse_args()
    if args.serve:
        serve()
    elif args.chief:
        chief(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
