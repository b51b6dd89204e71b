"""Checks of FullyShardedStrategy on a real job: 4 processes (``four``) or 2 (``two``).

Every process seeds torch differently (rank + 100): the chief's initial values must win.
Each writes what it saw to ``<out>/<mode>-rank<r>.json`` (and the chief, tensors to ``.pt``
files); test_fully_sharded.py checks them. One run per world size keeps the suite fast.

- two: custom loops with SGD and Adam under MWMS and under FullyShardedStrategy (ZeRO-3 and
  ZeRO-2), the bytes each process holds after an Adam step, Model.fit/evaluate/predict under
  both strategies, model.save, the errors; then the restore of the ``four`` run's checkpoint.
- four: Adam and SGD loops against MWMS's, the bytes held, a CheckpointManager save of model +
  optimizer + epoch, and HSDP on a ("replicate", "shard") = (2, 2) mesh.
"""

import json
import os
import sys
import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import stratagem as sg
from workers.common import keras_data
from workers.resume_data import custom_loop

MODE, OUT = sys.argv[1], sys.argv[2]
GLOBAL_BATCH = 24


def build_model() -> torch.nn.Module:
    # Every dim 0 divides by 4, so that a shard is exactly 1/N of each tensor.
    return torch.nn.Sequential(
        torch.nn.Linear(5, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )


class Block(torch.nn.Module):
    """A block of the script's own: torch.compile traces its forward (dynamo skips the frames
    of torch's own modules, nn.Linear's, when they run behind FSDP's hooks)."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def block_model() -> torch.nn.Module:
    return torch.nn.Sequential(Block(5, 32), Block(32, 32), torch.nn.Linear(32, 4))


def batches(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(GLOBAL_BATCH, 5, generator=g),
            torch.randint(0, 4, (GLOBAL_BATCH,), generator=g),
        )
        for _ in range(steps)
    ]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def train(strategy, optimizer_name: str, model=None, build=build_model, counter=None):
    torch.manual_seed(100 + int(os.environ.get("RANK_SEED", "0")))
    with strategy.scope():
        model = build()
        optimizer = make_optimizer(optimizer_name, model.parameters())
    # counter: a torch.compile backend that counts the graphs it compiles (aot_eager's).
    forward = model if counter is None else torch.compile(model, backend=counter)
    dataset = strategy.experimental_distribute_dataset(
        sg.data.Dataset.from_tensor_slices(_stack(batches())).batch(GLOBAL_BATCH)
    )

    def step(batch):
        x, y = batch
        loss = sg.nn.compute_average_loss(F.cross_entropy(forward(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    losses = [
        float(strategy.reduce("SUM", strategy.run(step, args=(b,)), axis=None)) for b in dataset
    ]
    return model, optimizer, losses


def train_accumulated(strategy, optimizer_name: str, accumulate: bool = True):
    """As ``train``, each batch's step made of two halves: the first half's backward in
    ``accumulate_gradients()`` (unless not ``accumulate``), the second's outside. Also how many
    reduce-scatters ran, and the steps."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    torch.manual_seed(100 + int(os.environ.get("RANK_SEED", "0")))
    with strategy.scope():
        model = build_model()
        optimizer = make_optimizer(optimizer_name, model.parameters())
    dataset = strategy.experimental_distribute_dataset(
        sg.data.Dataset.from_tensor_slices(_stack(batches())).batch(GLOBAL_BATCH)
    )

    def backward(x, y):
        per_example = F.cross_entropy(model(x), y, reduction="none")
        sg.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()

    def step(batch):
        x, y = batch
        half = len(x) // 2
        optimizer.zero_grad()
        with strategy.extended.accumulate_gradients() if accumulate else nullcontext():
            backward(x[:half], y[:half])
        backward(x[half:], y[half:])
        optimizer.step()

    counted, original = [0], DefaultReduceScatter.__call__

    def counting(self, *args, **kwargs):
        counted[0] += 1
        return original(self, *args, **kwargs)

    DefaultReduceScatter.__call__ = counting
    try:
        steps = sum(1 for b in dataset if strategy.run(step, args=(b,)) is None)
    finally:
        DefaultReduceScatter.__call__ = original
    return model, counted[0], steps


def _stack(bs):
    return torch.cat([x for x, _ in bs]), torch.cat([y for _, y in bs])


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([full(p).reshape(-1) for p in model.parameters()])


def memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes this process holds of parameters + gradients + optimizer state, and what a
    replica holding all of them would hold (counted from the global shapes)."""
    held = replicated = 0
    for p in model.parameters():
        held += nbytes(local(p)) + nbytes(local(p.grad))
        replicated += 2 * p.numel() * p.element_size()  # a DTensor's numel is the global one
        for value in optimizer.state[p].values():
            if isinstance(value, torch.Tensor):
                held += nbytes(local(value))
                replicated += value.numel() * value.element_size()
    return {"held": held, "replicated": replicated}


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def write(result: dict, rank: int) -> None:
    with open(os.path.join(OUT, f"{MODE}-rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


FSDP = sg.distribute.experimental.FullyShardedStrategy


def two() -> None:
    mwms = sg.distribute.MultiWorkerMirroredStrategy()
    rank = mwms.cluster_resolver.task_id
    os.environ["RANK_SEED"] = str(rank)
    result: dict = {"rank": rank}
    for name in ("sgd", "adam"):
        reference, _, ref_losses = train(mwms, name)
        sharded, optimizer, losses = train(FSDP(), name)
        result[f"{name}_max_diff"] = float((flat(sharded) - flat(reference)).abs().max())
        result[f"{name}_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        result[f"{name}_param_types"] = sorted({type(p).__name__ for p in sharded.parameters()})
        if name == "sgd":
            accumulated, scatters, steps = train_accumulated(FSDP(), name)
            result["accumulated_max_diff"] = float(
                (flat(accumulated) - flat(reference)).abs().max()
            )
            result["reduce_scatters_per_step"] = scatters / steps
            _, scatters, steps = train_accumulated(FSDP(), name, accumulate=False)
            result["reduce_scatters_per_step_each_pass"] = scatters / steps
            # torch.compile of a sharded model (issue 15), against MWMS eager
            counter = CompileCounterWithBackend("aot_eager")
            eager, _, _ = train(mwms, name, build=block_model)
            compiled, _, _ = train(FSDP(), name, build=block_model, counter=counter)
            result["compiled_max_diff"] = float((flat(compiled) - flat(eager)).abs().max())
            result["compiled_graphs"] = counter.frame_count
        if name == "adam":
            result["memory"] = memory(sharded, optimizer)
            result["adam_state_types"] = sorted(
                {type(v).__name__ for s in optimizer.state.values() for v in s.values()}
            )
            zero2, _, _ = train(FSDP(reshard_after_forward=False), name)
            result["zero2_max_diff"] = float((flat(zero2) - flat(reference)).abs().max())
            bf16, _, bf16_losses = train(FSDP(mixed_precision="bfloat16"), name)
            # Means: Adam moves a weight of a tiny gradient by ~lr whatever its sign, so single
            # weights may differ by a whole step.
            result["bf16_mean_diff"] = float((flat(bf16) - flat(reference)).abs().mean())
            result["bf16_loss_diff"] = max(abs(a - b) for a, b in zip(bf16_losses, ref_losses))
            torch.manual_seed(100)  # the chief's initial model (train's seed on rank 0)
            initial = flat(build_model())
            result["trained_vs_initial"] = float((flat(reference) - initial).abs().mean())
            result["bf16_param_types"] = sorted({str(p.dtype) for p in bf16.parameters()})
            x, _ = batches(1)[0]
            result["bf16_output_dtype"] = str(bf16(x).dtype)
    result["describe"] = FSDP().extended.describe()
    result["early_optimizer"] = early_optimizer()
    result["units"] = units()
    result["after_forward"] = after_forward()
    result["fit"] = fit_compare(mwms)
    result["errors"] = errors()
    write(result, rank)


def fit_compare(mwms) -> dict:
    x, y = keras_data()
    y = y % 4
    outcomes = {}
    for label, strategy in (("mwms", mwms), ("fsdp", FSDP())):
        torch.manual_seed(7)
        with strategy.scope():
            model = sg.keras.Model(build_model())
        model.compile(
            sg.keras.optimizers.Adam(0.01),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            ["accuracy"],
        )
        callbacks = []
        if label == "fsdp":  # sharded through DCP, as every checkpoint of this strategy
            callbacks = [
                sg.keras.callbacks.ModelCheckpoint(os.path.join(OUT, "fit_ckpt", "w-{epoch}")),
                sg.keras.callbacks.BackupAndRestore(os.path.join(OUT, "backup")),
            ]
        history = model.fit(
            x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
        )
        outcomes[label] = {
            "history": history.history,
            "evaluate": model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
            "predict": torch.from_numpy(model.predict(x, batch_size=GLOBAL_BATCH)),
            "weights": flat(model.module),
        }
        if label == "fsdp":
            model.save(os.path.join(OUT, "saved_fsdp"))
            outcomes["saved_flat"] = flat(model.module)
    outcomes["resumed"] = resumed_fit(x, y)
    outcomes["resumed_diff"] = float(
        (outcomes["resumed"]["weights"] - outcomes["fsdp"]["weights"]).abs().max()
    )
    # ModelCheckpoint's last file, into a fresh model sharded by the explicit form.
    strategy = FSDP()
    torch.manual_seed(8)
    fresh = strategy.distribute_module(build_model())
    sg.keras.Model(fresh).load_weights(os.path.join(OUT, "fit_ckpt"))
    outcomes["load_weights_diff"] = float((flat(fresh) - outcomes["fsdp"]["weights"]).abs().max())
    outcomes["explicit_types"] = sorted({type(p).__name__ for p in fresh.parameters()})
    a, b = outcomes["mwms"], outcomes["fsdp"]
    diffs = {
        "weights": float((a["weights"] - b["weights"]).abs().max()),
        "predict": float((a["predict"] - b["predict"]).abs().max()),
        "evaluate": max(abs(u - v) for u, v in zip(a["evaluate"], b["evaluate"])),
        "loss": max(abs(u - v) for u, v in zip(a["history"]["loss"], b["history"]["loss"])),
    }
    if torch.distributed.get_rank() == 0:
        torch.save({"weights": outcomes["saved_flat"]}, os.path.join(OUT, "saved_fsdp_flat.pt"))
    diffs["load_weights"] = outcomes["load_weights_diff"]
    diffs["resumed"] = outcomes["resumed_diff"]
    return {
        "diffs": diffs,
        "history": b["history"],
        "explicit_types": outcomes["explicit_types"],
        "resumed_epochs": outcomes["resumed"]["epochs"],
    }


class Interrupt(sg.keras.callbacks.Callback):
    """Stops fit as epoch 1 begins, on every worker at the same point (after the backup of
    epoch 0), as a crash the job restarts from would."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt("interrupted on purpose")


def resumed_fit(x: torch.Tensor, y: torch.Tensor) -> dict:
    """fit_compare's FSDP fit, interrupted after epoch 0, then run again in a fresh model
    (seeded otherwise): BackupAndRestore's sharded backup resumes it at epoch 1."""
    backup = os.path.join(OUT, "backup_resume")
    for attempt, seed in ((0, 7), (1, 99)):
        torch.manual_seed(seed)
        with FSDP().scope():
            model = sg.keras.Model(build_model())
        model.compile(
            sg.keras.optimizers.Adam(0.01),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            ["accuracy"],
        )
        callbacks = [sg.keras.callbacks.BackupAndRestore(backup)]
        if attempt == 0:
            callbacks.append(Interrupt())
        try:
            history = model.fit(
                x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                callbacks=callbacks,
            )  # fmt: skip
        except KeyboardInterrupt:
            continue
    return {"weights": flat(model.module), "epochs": history.epoch}


def units() -> dict:
    """The FSDP units (module paths) by default, by a regex and by a predicate."""
    from torch.distributed.fsdp import FSDPModule

    found = {}
    for label, wrap in (
        ("default", None),
        ("regex", r"[02]"),
        ("predicate", lambda path, m: isinstance(m, torch.nn.Linear) and m.out_features == 4),
    ):
        with FSDP(wrap=wrap).scope():
            model = build_model()
        found[label] = [p for p, m in model.named_modules() if isinstance(m, FSDPModule)]
    # A sharded model inside a new one keeps its units; the new layer becomes one more.
    strategy = FSDP()
    with strategy.scope():
        inner = build_model()
    with strategy.scope():
        outer = torch.nn.Sequential(inner, torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(outer.parameters(), lr=0.1)
    x, _ = batches(1)[0]
    strategy.run(lambda: outer(x).square().mean().backward())
    optimizer.step()
    found["nested"] = [p for p, m in outer.named_modules() if isinstance(m, FSDPModule)]
    found["nested_types"] = sorted({type(p).__name__ for p in outer.parameters()})
    return found


def after_forward() -> dict:
    """What layer 0 holds between forward and backward: its shard (ZeRO-3) or the whole
    gathered weight (ZeRO-2); after backward, its shard either way."""
    found = {}
    for label, reshard in (("zero3", True), ("zero2", False)):
        strategy = FSDP(reshard_after_forward=reshard)
        with strategy.scope():
            model = build_model()
        x, y = batches(1)[0]
        seen = {}

        def step(model=model, x=x, y=y, seen=seen):
            loss = F.cross_entropy(model(x), y)
            seen["forward"] = type(model[0].weight).__name__
            loss.backward()
            seen["backward"] = type(model[0].weight).__name__

        strategy.run(step)
        found[label] = seen
    return found


def early_optimizer() -> dict:
    """An optimizer made over a model built outside the scope, which distribute_module then
    shards: its first step updates the shards, the same on every process."""
    strategy = FSDP()
    torch.manual_seed(9)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    strategy.distribute_module(model)
    before = flat(model)
    x, y = batches(1)[0]
    strategy.run(lambda: F.cross_entropy(model(x), y).backward())
    optimizer.step()
    return {
        "types": sorted({type(p).__name__ for g in optimizer.param_groups for p in g["params"]}),
        "moved": float((flat(model) - before).abs().max()),
        "checksum": float(flat(model).sum()),
    }


def errors() -> dict:
    found = {}

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(4, 2))
            self.b = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))

    def mixed():
        with FSDP().scope():
            Mixed()

    found["mixed_dtypes"] = error_of(mixed)

    def wrap_nothing():
        with FSDP(wrap=r"blocks\.\d+").scope():
            build_model()

    found["wrap"] = error_of(wrap_nothing)
    # A mesh of process 0 alone (made on every process: its groups are collectives).
    lone = torch.distributed.device_mesh.DeviceMesh("cpu", [0], mesh_dim_names=("shard",))
    found["mesh_size"] = error_of(lambda: FSDP(mesh=lone))
    odd = sg.dtensor.create_mesh([("hosts", 1), ("local", 2)], devices=["cpu:0"] * 2)
    found["mesh_dims"] = error_of(lambda: FSDP(mesh=odd))

    def outside():
        strategy = FSDP()
        extra = torch.nn.Linear(4, 4)
        with strategy.scope():
            model = build_model()
        torch.optim.SGD([*model.parameters(), *extra.parameters()], lr=0.1).step()

    found["outside"] = error_of(outside)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found["cpu_offload_kept"] = FSDP(cpu_offload=True).extended.cpu_offload
    found["cpu_offload_warning"] = [str(w.message) for w in caught]
    return found


def four() -> None:
    strategy = FSDP()
    rank = strategy.cluster_resolver.task_id
    os.environ["RANK_SEED"] = str(rank)
    result: dict = {"rank": rank}
    model, optimizer, _ = train(strategy, "adam")
    result["memory"] = memory(model, optimizer)
    mwms = sg.distribute.MultiWorkerMirroredStrategy()  # the same job's connection
    reference, _, _ = train(mwms, "adam")
    result["adam_max_diff"] = float((flat(model) - flat(reference)).abs().max())
    sgd, _, _ = train(strategy, "sgd")
    sgd_reference, _, _ = train(mwms, "sgd")
    result["sgd_max_diff"] = float((flat(sgd) - flat(sgd_reference)).abs().max())
    result["local_shapes"] = {n: list(local(p).shape) for n, p in model.named_parameters()}
    epoch = torch.tensor(3)
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch)
    manager = sg.train.CheckpointManager(checkpoint, os.path.join(OUT, "ckpt"), max_to_keep=2)
    result["saved_path"] = manager.save()
    expected = {n: full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for slot, value in optimizer.state[p].items():
            expected[f"{n}/{slot}"] = full(value)
    if rank == 0:
        torch.save(expected, os.path.join(OUT, "expected.pt"))
    # Stopped after step 7 of 20 with the iterator in the checkpoint; restore_two goes on.
    stopped = custom_loop(strategy, "first", os.path.join(OUT, "resume", "ckpt"))
    result["resume_first"] = {"seen": stopped.seen}
    # HSDP: replicate across the 2 "hosts", shard within each.
    mesh = sg.dtensor.create_mesh([("replicate", 2), ("shard", 2)], devices=["cpu:0"] * 4)
    hsdp, _, _ = train(FSDP(mesh=mesh), "adam")
    result["hsdp_local_shapes"] = {n: list(local(p).shape) for n, p in hsdp.named_parameters()}
    result["hsdp_placements"] = str(next(hsdp.parameters()).placements)
    result["hsdp_vs_fsdp"] = float((flat(hsdp) - flat(model)).abs().max())
    write(result, rank)


def restore_two() -> None:
    strategy = FSDP()
    rank = strategy.cluster_resolver.task_id
    torch.manual_seed(55)
    with strategy.scope():
        model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    epoch = torch.tensor(0)
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch)
    path = sg.train.latest_checkpoint(os.path.join(OUT, "ckpt"))
    checkpoint.restore(path).assert_consumed()
    expected = torch.load(os.path.join(OUT, "expected.pt"), weights_only=True)
    params = dict(model.named_parameters())
    diffs = {}
    for key, value in expected.items():
        name, _, slot = key.partition("/")
        got = optimizer.state[params[name]][slot] if slot else params[name]
        diffs[key] = float((full(got).float() - value.float()).abs().max())
    resumed = custom_loop(strategy, "second", os.path.join(OUT, "resume", "ckpt"))
    write(
        {
            "rank": rank,
            "resumed_seen": resumed.seen,
            "resumed_final": {n: full(p).tolist() for n, p in resumed.net.named_parameters()},
            "restored_path": path,
            "restored_diffs": diffs,
            "restored_epoch": int(epoch),
            "restored_local_shapes": {n: list(local(p).shape) for n, p in params.items()},
        },
        rank,
    )


if MODE == "two":
    two()
    MODE = "restore"
    restore_two()
elif MODE == "four":
    four()
else:
    raise SystemExit(f"unknown mode {MODE!r}")
