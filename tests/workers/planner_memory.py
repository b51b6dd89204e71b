"""One process of the planner's memory check: train a few steps under a strategy the planner
built, and write the measured peak of live tensor bytes next to the planner's prediction.

argv: model name (``gpt2``, ``llama``, ...), candidate kind (``mirrored``, ``zero3``, ...),
output folder; sizes as ``key=value`` after them (the model's config overrides). The peak is
read from torch's profiler memory events (``profile_memory=True``): every CPU allocation and
free from before the model is built, summed in time order, its maximum during two steps after
the first (which makes the optimizer's state) once the initial broadcasts are let go. Writes
``<out>/<kind>-rank<r>.json``.
"""

import dataclasses
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import stratagem as sg
from real_models import hf_models
from stratagem.distribute.planner import ClusterShape

NAME, KIND, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
SIZES = {k: json.loads(v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
BATCH = 4


def make() -> torch.nn.Module:
    """The model named, from a Hugging Face config at the sizes given (random weights)."""
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
    torch.manual_seed(0)
    return cls(config).train()


def batch() -> dict[str, torch.Tensor]:
    if NAME == "resnet":
        return {"pixel_values": hf_models.images(BATCH), "labels": hf_models.labels(BATCH, 4)}
    ids = hf_models.tokens(BATCH, seq=SIZES.get("seq", hf_models.SEQ))
    if NAME == "bert":
        return {"input_ids": ids, "labels": hf_models.labels(BATCH, 3)}
    if NAME == "t5":
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids, "labels": ids}


def peak_during_last_steps(prof: profile) -> int:
    """The largest sum of the CPU allocations and frees recorded since profiling began, in
    time order, during the last two steps."""
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    start = min(e.start_ns() for e in events if e.name() == "planner-last-steps")
    live = peak = 0
    for e in events:
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
            live += e.nbytes()
            if e.start_ns() >= start:
                peak = max(peak, live)
    return peak


def main() -> None:
    with torch.device("meta"):
        planned = sg.distribute.plan(make(), batch(), ClusterShape(1, 2), optimizer="adam")
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
            loss = model(**data).loss
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
