"""Runs pipeline checks on one stage process and saves what each rank saw, for the tests.

Usage: pipeline_checks.py OUT_DIR CHECK [CHECK ...]; every rank writes OUT_DIR/CHECK-rankR.pt.
CHECKs: grads-GPipe, grads-1F1B, grads-Interleaved1F1B (one step's gradients),
stash-on / stash-off (PipeDream passes watched by a recorder), checkpoint (save, train on,
restore, retrain: the same weights), pipedream-train (weights after 2 PipeDream steps),
pipedream-carry (the same without draining between the steps, then a flush), and with
4 processes (2 stages x 2 replicas) dp-grads and dp-pipedream-train; lost-SCHEDULE (last:
stage 1 exits, stage 0 records the error of its next step). Tied embeddings (the first and the
last stage share a parameter): tied-GPipe, tied-1F1B, tied-Interleaved1F1B, tied-PipeDream
(3 steps: losses and weights, or the error), tied-checkpoint (save, restore, gather into a
whole model), tied-fit (Model.fit and a whole-model checkpoint), with 4 processes dp-tied.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import build_model, build_tied_model, global_batches, make_optimizer, token_batches

import stratagem as sg

OUT = Path(sys.argv[1])


def model_with_seed() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model()


def save(name: str, rank: int, value: object) -> None:
    torch.save(value, OUT / f"{name}-rank{rank}.pt")


def grads(schedule: str, num_replicas: int = 1, name: str | None = None) -> None:
    split = [2] if schedule != "Interleaved1F1B" else [1, 2, 4]
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule=schedule, num_microbatches=4, split_points=split, num_replicas=num_replicas
    )
    pipe = strategy.pipeline(model_with_seed(), F.cross_entropy)
    x, y = global_batches(1)[0]
    loss = pipe.compute_gradients(x, y)
    got = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    # torch's schedules fix shapes at their first step: another batch size gets its own.
    loss16 = pipe.compute_gradients(x[:16], y[:16])
    got16 = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    save(
        name or f"grads-{schedule}",
        strategy.rank,
        {"loss": loss, "grads": got, "loss16": loss16, "grads16": got16},
    )


class Watcher:
    """Records, per micro-batch, the weights live at its forward and the gradients it applied."""

    def __init__(self) -> None:
        self.forward_weights: dict[int, dict[str, torch.Tensor]] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self.versions: dict[int, tuple[int, int]] = {}
        self.backwards: dict[int, tuple[torch.Tensor | None, dict[str, torch.Tensor]]] = {}
        self.step = 0

    def forward(self, stage, micro_batch, version, module, x) -> None:
        key = self.step * 100 + micro_batch
        self.forward_weights[key] = {n: p.detach().clone() for n, p in module.named_parameters()}
        self.inputs[key] = x.detach().clone()
        self.versions[key] = (version, -1)

    def backward(self, stage, micro_batch, version, grad_output, grads) -> None:
        key = self.step * 100 + micro_batch
        g = None if grad_output is None else grad_output.clone()
        self.backwards[key] = (g, {n: t.clone() for n, t in grads.items()})


def stash(on: bool) -> None:
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule="PipeDream", num_microbatches=4, split_points=[2], weight_stashing=on
    )
    watcher = Watcher()
    pipe = strategy.pipeline(model_with_seed(), F.cross_entropy, recorder=watcher)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for step, (x, y) in enumerate(global_batches(2)):
        watcher.step = step
        pipe.train_step(x, y, opt)
    targets = {}
    if pipe.is_last_stage:
        for step, (_, y) in enumerate(global_batches(2)):
            for i, t in enumerate(y.chunk(4)):
                targets[step * 100 + i] = t
    save(
        f"stash-{'on' if on else 'off'}",
        strategy.rank,
        {
            "stage": pipe.stage,
            "forward_weights": watcher.forward_weights,
            "inputs": watcher.inputs,
            "backward": watcher.backwards,
            "targets": targets,
            "max_versions_in_flight": pipe._runner.engine.max_versions_in_flight,
            "layers": list(pipe.module._modules),
        },
    )


def pipedream_train(num_replicas: int) -> None:
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule="PipeDream", num_microbatches=4, split_points=[2], num_replicas=num_replicas
    )
    pipe = strategy.pipeline(model_with_seed(), F.cross_entropy)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = [pipe.train_step(x, y, opt) for x, y in global_batches(2)]
    weights = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    name = "pipedream-train" if num_replicas == 1 else "dp-pipedream-train"
    save(name, strategy.rank, {"losses": losses, "weights": weights})


def pipedream_carry() -> None:
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule="PipeDream", num_microbatches=4, split_points=[2], drain_each_step=False
    )
    pipe = strategy.pipeline(model_with_seed(), F.cross_entropy)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses, in_flight = [], []
    for x, y in global_batches(2):
        losses.append(pipe.train_step(x, y, opt))
        in_flight.append(pipe._runner.engine.in_flight)
    pipe.flush()
    weights = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    save(
        "pipedream-carry",
        strategy.rank,
        {"losses": losses, "in_flight": in_flight, "weights": weights},
    )


def lost_stage(schedule: str) -> None:
    """Stage 1 dies after one step; stage 0 must fail with a named error, not hang."""
    import os
    import time

    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule=schedule, num_microbatches=4, split_points=[2]
    )
    pipe = strategy.pipeline(model_with_seed(), F.cross_entropy)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = global_batches(1)[0]
    pipe.train_step(x, y, opt)
    if strategy.rank == 1:
        os._exit(0)  # no goodbye: as if killed
    start = time.monotonic()
    try:
        pipe.train_step(x, y, opt)
        error = ""
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    save(f"lost-{schedule}", 0, {"error": error, "seconds": time.monotonic() - start})
    os._exit(0)  # the group's peer is gone: skip the exit handshake


def checkpoint() -> None:
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule="1F1B", num_microbatches=2, split_points=[2]
    )
    batches = global_batches(4)
    pipe = strategy.pipeline(model_with_seed(), F.cross_entropy)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    epoch = torch.tensor(0)
    for x, y in batches[:2]:
        pipe.train_step(x, y, opt)
    epoch += 2
    path = str(OUT / "ckpt")
    pipe.save(path, opt, epoch=epoch)
    continued = [pipe.train_step(x, y, opt) for x, y in batches[2:]]
    after = {n: p.detach().clone() for n, p in pipe.named_parameters()}

    torch.manual_seed(99)  # a fresh model and optimizer with other weights
    fresh = strategy.pipeline(build_model(), F.cross_entropy)
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.01)
    epoch2 = torch.tensor(0)
    fresh.restore(path, opt2, epoch=epoch2)
    resumed = [fresh.train_step(x, y, opt2) for x, y in batches[2:]]
    again = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    save(
        "checkpoint",
        strategy.rank,
        {
            "epoch": int(epoch2),
            "continued": continued,
            "resumed": resumed,
            "after": after,
            "again": again,
        },
    )


TIED_SPLITS = {
    "GPipe": ["act"],
    "1F1B": ["act"],
    "PipeDream": ["act"],
    "Interleaved1F1B": [2, 3, 4],
}


def tied_model(
    seed: int = 0, *, tie_mlp: bool = False, other_copy: bool = False
) -> torch.nn.Module:
    """The tied model; ``other_copy``: this process's tied weight starts different, as if the
    processes had not seeded alike (the pipeline must start every copy from one of them)."""
    torch.manual_seed(seed)
    model = build_tied_model(tie_mlp)
    if other_copy:
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)
    return model


def every_name(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights under every name, a tied one under each of its names."""
    return {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


def tied(schedule: str, num_replicas: int = 1, name: str | None = None) -> None:
    """3 steps (SGD with momentum) of the tied model: the losses and this rank's weights, or
    the error that refused the pipeline."""
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule=schedule,
        num_microbatches=4,
        split_points=TIED_SPLITS[schedule],
        num_replicas=num_replicas,
    )
    # 1F1B: the processes seed alike (as a user's script does); else their copies differ.
    model = tied_model(
        tie_mlp=schedule in ("GPipe", "Interleaved1F1B"),
        other_copy=strategy.rank != 0 and (schedule != "1F1B" or num_replicas > 1),
    )
    name = name or f"tied-{schedule}"
    try:
        pipe = strategy.pipeline(model, F.cross_entropy)
    except Exception as e:
        save(name, strategy.rank, {"error": f"{type(e).__name__}: {e}"})
        return
    opt = make_optimizer("sgd", pipe.parameters())
    losses = [pipe.train_step(x, y, opt) for x, y in token_batches(3)]
    save(name, strategy.rank, {"error": "", "losses": losses, "weights": every_name(pipe.module)})


def tied_checkpoint() -> None:
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule="1F1B", num_microbatches=4, split_points=["act"]
    )
    batches = token_batches(4)
    pipe = strategy.pipeline(tied_model(), F.cross_entropy)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    for x, y in batches[:2]:
        pipe.train_step(x, y, opt)
    at_save = every_name(pipe.module)
    path = OUT / "tied-ckpt"
    pipe.save(str(path), opt)
    written = sorted(torch.load(path / f"stage-{pipe.stage}.pt", weights_only=True)["model"])
    continued = [pipe.train_step(x, y, opt) for x, y in batches[2:]]

    fresh = strategy.pipeline(tied_model(99), F.cross_entropy)
    if pipe.stage == 1:  # this copy of the tie drifted: the restore must load it from the save
        with torch.no_grad():
            fresh.module.lm_head.weight.mul_(2.0)
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh.restore(str(path), opt2)
    restored = every_name(fresh.module)
    resumed = [fresh.train_step(x, y, opt2) for x, y in batches[2:]]
    # Every stage into a whole model built with other weights: the tie filled from one tensor.
    whole = tied_model(7)
    fresh.gather_module(whole)
    save(
        "tied-checkpoint",
        strategy.rank,
        {
            "written": written,
            "at_save": at_save,
            "restored": restored,
            "continued": continued,
            "resumed": resumed,
            "after": every_name(pipe.module),
            "again": every_name(fresh.module),
            "whole": every_name(whole),
            "whole_tied": whole.wte.weight is whole.lm_head.weight,
        },
    )


def tied_fit() -> None:
    """Model.fit (1F1B), then a whole-model checkpoint through sg.train.Checkpoint."""
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule="1F1B", num_microbatches=4, split_points=["act"]
    )
    batches = token_batches(2)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    torch.manual_seed(0)
    with strategy.scope():
        model = sg.keras.Model(build_tied_model())
        model.compile(
            sg.keras.optimizers.Adam(0.01),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    pipe = strategy.extended.pipeline_of(model.module)
    path = sg.train.Checkpoint(model=model.module).save(str(OUT / "tied-fit-ckpt" / "ckpt"))
    save(
        "tied-fit",
        strategy.rank,
        {"loss": history.history["loss"], "weights": every_name(pipe.module), "path": path},
    )


def main() -> None:
    for check in sys.argv[2:]:
        if check.startswith("grads-"):
            grads(check.removeprefix("grads-"))
        elif check == "dp-grads":
            grads("1F1B", num_replicas=2, name="dp-grads")
        elif check in ("stash-on", "stash-off"):
            stash(check == "stash-on")
        elif check == "pipedream-train":
            pipedream_train(1)
        elif check == "pipedream-carry":
            pipedream_carry()
        elif check == "dp-pipedream-train":
            pipedream_train(2)
        elif check.startswith("lost-"):
            lost_stage(check.removeprefix("lost-"))
        elif check == "checkpoint":
            checkpoint()
        elif check.startswith("tied-") and check.removeprefix("tied-") in TIED_SPLITS:
            tied(check.removeprefix("tied-"))
        elif check == "tied-checkpoint":
            tied_checkpoint()
        elif check == "tied-fit":
            tied_fit()
        elif check == "dp-tied":
            tied("1F1B", num_replicas=2, name="dp-tied")
        else:
            raise SystemExit(f"unknown check {check!r}")
    print("checks done", flush=True)


if __name__ == "__main__":
    main()
