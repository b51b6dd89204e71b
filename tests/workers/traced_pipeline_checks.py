"""Traced pipelines of Hugging Face models on two stage processes; each rank saves what it saw.

Usage: traced_pipeline_checks.py OUT_DIR CHECK [CHECK ...]; every rank writes
OUT_DIR/CHECK-rankR.pt. CHECKs: gpt2-GPipe, gpt2-1F1B, gpt2-Interleaved1F1B (GPT-2, its
embedding tied to its head, cut at module paths; 3 steps: losses, this rank's weights, and
predictions), gpt2-untied-copies (1F1B with the shared-parameter handling switched off: the
negative control), gpt2-checkpoint (a whole-model checkpoint written, restored into a fresh
pipeline, training resumed), gpt2-fit (Model.fit), llama-1F1B (a Llama-style decoder).
"""

import sys
from pathlib import Path

import torch

import stratagem as sg
import stratagem.distribute.pipeline_strategy as pipeline_strategy
from real_models import hf_models
from real_models.lm_pipeline import (
    MICROBATCHES,
    every_name,
    fit_gpt2,
    lm_batches,
    lm_loss,
    make_optimizer,
)

OUT = Path(sys.argv[1])
SPLITS = {
    "GPipe": ["transformer.h.1"],
    "1F1B": ["transformer.h.1"],
    # Four chunks over two processes: the embedding (chunk 0) and the head (chunk 3) on
    # different ranks, the attention mask handed on through chunk 1.
    "Interleaved1F1B": ["transformer.h.0", "transformer.h.1", "transformer.ln_f"],
}


def save(name: str, rank: int, value: object) -> None:
    torch.save(value, OUT / f"{name}-rank{rank}.pt")


def strategy_for(schedule: str, split_points: list[str]):
    return sg.distribute.experimental.PipelineStrategy(
        schedule=schedule, num_microbatches=MICROBATCHES, split_points=split_points
    )


def train(
    name: str,
    model: torch.nn.Module,
    schedule: str,
    split_points: list[str],
    predict: bool = False,
) -> None:
    """3 steps; the losses, this rank's weights (under the whole model's names), and with
    ``predict`` the predictions for another batch size (the graphs are traced again)."""
    strategy = strategy_for(schedule, split_points)
    batches = lm_batches()
    sample = batches[0][0][: batches[0][0].shape[0] // MICROBATCHES]
    pipe = strategy.pipeline(model, lm_loss, sample_input=sample)
    opt = make_optimizer(pipe.parameters())
    losses = [pipe.train_step(x, y, opt) for x, y in batches]
    predictions = pipe.predict(batches[0][0][:3]) if predict else None
    save(
        name,
        strategy.rank,
        {
            "losses": losses,
            "weights": every_name(pipe.module),
            "predictions": predictions,
            "repr": repr(pipe),
        },
    )


def untied_copies() -> None:
    """1F1B as gpt2-1F1B, but with no parameter found shared between the stages: each copy
    of the tied weight trains on its own stage's gradient (what the check must catch)."""
    found = pipeline_strategy.shared_between_stages
    pipeline_strategy.shared_between_stages = lambda *args: []  # type: ignore[assignment]
    try:
        train("gpt2-untied-copies", hf_models.gpt2(), "1F1B", SPLITS["1F1B"])
    finally:  # the checks after this one run as they should
        pipeline_strategy.shared_between_stages = found


def checkpoint() -> None:
    """2 steps, a whole-model checkpoint (every stage gathered, the chief writes), a fresh
    pipeline of a model with other weights restored from it, and one more step on both."""
    strategy = strategy_for("1F1B", SPLITS["1F1B"])
    batches = lm_batches()
    sample = batches[0][0][:2]
    model = hf_models.gpt2()
    pipe = strategy.pipeline(model, lm_loss, sample_input=sample)
    strategy.extended.register_whole_model(model, pipe)
    opt = make_optimizer(pipe.parameters())
    for x, y in batches[:2]:
        pipe.train_step(x, y, opt)
    with strategy.scope():  # the checkpoint asks the strategy in scope to gather the stages
        path = sg.train.Checkpoint(model=model).save(str(OUT / "gpt2-ckpt" / "ckpt"))
    at_save = every_name(model)  # gathered: every stage's weights, on every process
    continued = pipe.train_step(*batches[2], opt)

    fresh = hf_models.gpt2(seed=99)
    fresh_pipe = strategy.pipeline(fresh, lm_loss, sample_input=sample)
    strategy.extended.register_whole_model(fresh, fresh_pipe)
    with strategy.scope():
        sg.train.Checkpoint(model=fresh).restore(path)
    restored = every_name(fresh_pipe.module)
    # A fresh optimizer on both sides: the momentum is not part of this checkpoint.
    again = fresh_pipe.train_step(*batches[2], make_optimizer(fresh_pipe.parameters()))
    save(
        "gpt2-checkpoint",
        strategy.rank,
        {
            "path": path,
            "at_save": at_save,
            "restored": restored,
            "tied": fresh.lm_head.weight is fresh.transformer.wte.weight,
            "continued": continued,
            "again": again,
        },
    )


def fit() -> None:
    """Model.fit (1F1B) of GPT-2 traced at the strategy's split point."""
    strategy = strategy_for("1F1B", SPLITS["1F1B"])
    history, model = fit_gpt2(strategy)
    pipe = strategy.extended.pipeline_of(model.module)
    save(
        "gpt2-fit",
        strategy.rank,
        {"loss": history.history["loss"], "weights": every_name(pipe.module)},
    )


def main() -> None:
    for check in sys.argv[2:]:
        if check.startswith("gpt2-") and check.removeprefix("gpt2-") in SPLITS:
            schedule = check.removeprefix("gpt2-")
            train(check, hf_models.gpt2(), schedule, SPLITS[schedule], schedule == "1F1B")
        elif check == "gpt2-untied-copies":
            untied_copies()
        elif check == "gpt2-checkpoint":
            checkpoint()
        elif check == "gpt2-fit":
            fit()
        elif check == "llama-1F1B":
            train(check, hf_models.llama(), "1F1B", ["model.layers.1"])
        else:
            raise SystemExit(f"unknown check {check!r}")
    print("checks done", flush=True)


if __name__ == "__main__":
    main()
