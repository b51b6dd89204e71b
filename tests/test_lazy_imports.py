"""A job pays at its start only for what it uses: a process that trains with
MultiWorkerMirroredStrategy (its own loop or Keras ``fit``, with checkpoints and callbacks)
never imports FSDP, DTensor, ``torch.distributed.pipelining`` or distributed checkpoint (about
1.4 s of CPU per process, paid by every task of a job on a shared host and at every restart).

The check runs in a fresh interpreter: this test process has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# What the experimental strategies, sharded checkpoints and meshes pull in.
HEAVY = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
)

PROGRAM = textwrap.dedent(
    """
    import json, sys
    import torch
    import stratagem as sg

    def heavy():
        return {m for m in HEAVY if m in sys.modules}

    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    at_start = heavy()
    # torch's own optimizers import torch._dynamo, and it FSDP and DTensor, when they are made:
    # a plain PyTorch job pays that too, so what stratagem adds is counted beyond it.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    baseline = heavy()
    with strategy.scope():
        model = sg.keras.Model(torch.nn.Sequential(torch.nn.Linear(4, 2)))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    callbacks = [sg.keras.callbacks.ModelCheckpoint(sys.argv[1] + "/ckpt"),
                 sg.keras.callbacks.TensorBoard(sys.argv[1] + "/tb")]
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    checkpoint = sg.train.Checkpoint(model=model.module)
    manager = sg.train.CheckpointManager(checkpoint, sys.argv[1] + "/ckpts", max_to_keep=1)
    checkpoint.restore(manager.save())
    assert sg.distribute.experimental.__name__  # the namespace itself is cheap
    print(json.dumps({"at_start": sorted(at_start), "added": sorted(heavy() - baseline)}))
    """
)


def test_a_multi_worker_mirrored_job_imports_no_engine_it_does_not_use(tmp_path):
    program = f"HEAVY = {HEAVY!r}\n" + PROGRAM
    done = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"at_start": [], "added": []}


def test_the_experimental_names_still_resolve_and_are_listed():
    import stratagem as sg

    experimental = sg.distribute.experimental
    for name in experimental.__all__:
        assert getattr(experimental, name) is not None, name
    assert experimental.FullyShardedStrategy.__module__.endswith("fully_sharded_strategy")
    assert "PipelineStrategy" in dir(experimental)
