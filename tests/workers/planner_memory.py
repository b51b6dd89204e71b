"""One process of the planner's memory check: train a few steps under a strategy the planner
built, and write the measured peak of live tensor bytes next to the planner's prediction.

argv: model name (a Hugging Face one, ``gpt2``, ``llama``, ..., or one of ``EXAMPLES``, the
models our examples train), candidate kind (``mirrored``, ``zero3``, ...), output folder;
sizes as ``key=value`` after them (a Hugging Face config's overrides). The peak is
read from torch's profiler memory events (``profile_memory=True``): every CPU allocation and
free from before the model is built (a collective's scratch that gloo frees unseen, when it
returns), summed in time order, its maximum during two steps after
the first (which makes the optimizer's state) once the initial broadcasts are let go. Writes
``<out>/<kind>-rank<r>.json``.
"""

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

import stratagem as sg
from stratagem.distribute.planner import ClusterShape

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import mnist  # examples/mnist.py: the seed's CNN, which several examples train

NAME, KIND, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
SIZES = {k: json.loads(v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
BATCH = 4


def _mlp(*widths: int, first: tuple[nn.Module, ...] = ()) -> nn.Sequential:
    """``Linear`` layers of these widths with a ``ReLU`` between each two, after ``first``,
    in one flat ``Sequential`` (its top-level children are FSDP's units)."""
    layers: list[nn.Module] = list(first)
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


# The models our examples train (those that are scripts are copied here, layer for layer),
# their input per example, and the example's batch per replica on 2 processes.
EXAMPLES = {
    # mnist.py: parameter_server.py, custom_training_loop.py, multi_worker_keras.py
    "mnist_cnn": (mnist.build_cnn_model, (28, 28), 64),
    # keras_fit.py, save_and_load.py
    "keras_cnn": (
        lambda: nn.Sequential(
            nn.Unflatten(1, (1, 28)),
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(13 * 13 * 32, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        ),
        (28, 28),
        64,
    ),
    # custom_training.py
    "custom_cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 2 * 2, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        ),
        (1, 8, 8),
        64,
    ),
    # keras3_distribution.py, dtensor_layouts.py (batch 128 over 2 replicas)
    "keras3_mlp": (lambda: _mlp(28 * 28, 128, 10, first=(nn.Flatten(),)), (28, 28), 64),
    # parameter_server_coordinator.py's Model.fit part (global batch 64)
    "ps_mlp": (lambda: _mlp(64, 64, 10), (64,), 32),
    # sharded_fit.py (batch 64 per replica)
    "sharded_mlp": (lambda: _mlp(64, 256, 256, 10), (64,), 64),
}


def make() -> nn.Module:
    """The model named: one of ``EXAMPLES``, else from a Hugging Face config at the sizes
    given (random weights)."""
    torch.manual_seed(0)
    if NAME in EXAMPLES:
        return EXAMPLES[NAME][0]().train()
    from real_models import hf_models

    t = hf_models.transformers
    sizes = {k: v for k, v in SIZES.items() if k != "seq"}
    vocab = {"vocab_size": hf_models.VOCAB}
    if NAME == "gpt2":
        config, cls = t.GPT2Config(**vocab, n_positions=64, **sizes), t.GPT2LMHeadModel
    elif NAME == "bert":
        config = t.BertConfig(**vocab, max_position_embeddings=64, num_labels=3, **sizes)
        cls = t.BertForSequenceClassification
    elif NAME == "llama":
        config = t.LlamaConfig(**vocab, max_position_embeddings=64, **sizes)
        cls = t.LlamaForCausalLM
    elif NAME == "t5":
        config = t.T5Config(**vocab, decoder_start_token_id=0, **sizes)
        cls = t.T5ForConditionalGeneration
    else:
        config = t.ResNetConfig(num_labels=4, layer_type="basic", **sizes)
        cls = t.ResNetForImageClassification
    return cls(config).train()


def batch() -> dict[str, torch.Tensor] | tuple[torch.Tensor, torch.Tensor]:
    """One replica's batch: an example model's (inputs, labels), or a Hugging Face model's
    keyword inputs (labels among them)."""
    if NAME in EXAMPLES:
        _, shape, size = EXAMPLES[NAME]
        g = torch.Generator().manual_seed(0)
        return torch.rand(size, *shape, generator=g), torch.randint(0, 10, (size,), generator=g)
    from real_models import hf_models

    if NAME == "resnet":
        return {"pixel_values": hf_models.images(BATCH), "labels": hf_models.labels(BATCH, 4)}
    ids = hf_models.tokens(BATCH, seq=SIZES.get("seq", hf_models.SEQ))
    if NAME == "bert":
        return {"input_ids": ids, "labels": hf_models.labels(BATCH, 3)}
    return {"input_ids": ids, "labels": ids}


def loss_of(model: nn.Module, data: dict[str, torch.Tensor] | tuple[torch.Tensor, ...]):
    """The training loss: an example's cross-entropy on its logits, a Hugging Face model's own
    ``.loss``."""
    if isinstance(data, tuple):
        x, y = data
        return nn.functional.cross_entropy(model(x), y)
    return model(**data).loss


def _collective_around(event) -> object | None:
    """The ``c10d::`` operation an allocation was made in, if any."""
    parent = event.parent
    while parent is not None:
        if parent.name.startswith("c10d::"):
            return parent
        parent = parent.parent
    return None


def peak_during_last_steps(prof: profile) -> int:
    """The largest sum of the CPU allocations and frees recorded since profiling began, in
    time order, during the last two steps. Gloo frees a collective's scratch copy (its
    reduce-scatter clones the input) on its own thread, which the profiler does not record,
    now and then: an allocation whose address is handed out again before its free is seen was
    freed unseen, when the ``c10d::`` operation that made it returned (else by then); a
    collective's scratch never seen freed, likewise."""
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        events.append(e)
        stack.extend(e.children)
    start = min(e.start_time_ns for e in events if e.name == "planner-last-steps")
    allocations = sorted(
        (e for e in events if e.tag == _EventType.Allocation and e.typed[1].device.type == "cpu"),
        key=lambda e: e.start_time_ns,
    )
    live: dict[int, object] = {}
    changes = []

    def freed_unseen(e, by: int | None) -> None:
        collective = _collective_around(e)
        at = collective.end_time_ns if collective is not None else by
        if at is not None:
            changes.append((at if by is None else min(at, by), -e.typed[1].alloc_size))

    for e in allocations:
        fields = e.typed[1]
        if fields.alloc_size > 0:
            if fields.ptr in live:
                freed_unseen(live[fields.ptr], e.start_time_ns)
            live[fields.ptr] = e
            changes.append((e.start_time_ns, fields.alloc_size))
        elif fields.ptr in live:
            del live[fields.ptr]
            changes.append((e.start_time_ns, fields.alloc_size))
    for e in live.values():
        freed_unseen(e, None)
    total = peak = 0
    for at, size in sorted(changes, key=lambda c: c[0]):
        total += size
        if at >= start:
            peak = max(peak, total)
    return peak


def main() -> None:
    with torch.device("meta"):
        # The planner sees what a user gives it: the model and its inputs (an example's
        # inputs only; its loss, on 10 logits per example, is not traced).
        data = batch()
        inputs = data[0] if isinstance(data, tuple) else data
        planned = sg.distribute.plan(make(), inputs, ClusterShape(1, 2), optimizer="adam")
    chosen = next(c for c in planned.candidates if c.kind == KIND)
    strategy = dataclasses.replace(planned, chosen=chosen).build()
    rank = strategy.cluster_resolver.task_id
    # Profiling starts before the model exists: the profiler records the frees of what it
    # saw allocated only.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with strategy.scope():
            model = make()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        data = batch()

        def step() -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_of(model, data)
            loss.backward()
            optimizer.step()
            return loss.detach()

        strategy.run(step)  # the optimizer's state is made
        # The communicator keeps the tensors of its last 64 collectives (comm.process_group),
        # the initial broadcasts among them, until a long job's first steps push them out:
        # 64 reductions of a scalar do that here.
        for _ in range(64):
            strategy.reduce("SUM", torch.zeros(()), axis=None)
        with record_function("planner-last-steps"):
            strategy.run(step)
            strategy.run(step)
    result = {
        "measured": peak_during_last_steps(prof),
        "predicted": chosen.memory.peak,
        "memory": dataclasses.asdict(chosen.memory),
    }
    with open(f"{OUT}/{KIND}-rank{rank}.json", "w") as f:
        json.dump(result, f)
    print("planner memory done", rank)


if __name__ == "__main__":
    main()
