"""The data and model of the exact-resume checks (``resume_checks.py`` and its test)."""

import torch

import stratagem as sg
from workers.common import build_model

STOP, EXAMPLES, GLOBAL_BATCH, EPOCHS = 7, 120, 12, 2
MAP_CALLS = [0]  # calls of the pipeline's map function in this process


def _mapped(features: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    MAP_CALLS[0] += 1
    return features * 1.0, label


def examples() -> sg.data.Dataset:
    """The 120 examples, (features with their id last, label), in their first order."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(EXAMPLES, 5, generator=g)
    y = torch.randint(0, 3, (EXAMPLES,), generator=g)
    ids = torch.arange(EXAMPLES, dtype=torch.float32)[:, None]
    return sg.data.Dataset.from_tensor_slices((torch.cat([x, ids], 1), y))


def dataset(seed: int | None = 7) -> sg.data.Dataset:
    """Examples whose last feature is their id, through a streaming shuffle (a buffer of 37 of
    120; ``seed=None``: the job's seed, another in each job), map, batch, repeat and prefetch:
    20 global batches of 12."""
    shuffled = examples().shuffle(37, seed=seed)
    return shuffled.map(_mapped).batch(GLOBAL_BATCH).repeat(EPOCHS).prefetch(2)


class Ledgered(torch.nn.Module):
    """The model on the features, recording the ids of the examples it sees in training."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_model()
        self.seen: list[list[int]] = []

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.append(features[:, -1].long().tolist())
        return self.net(features[:, :-1])


def data_sharded() -> sg.data.Dataset:
    """``dataset()`` with ``AutoShardPolicy.DATA``: a sync parameter-server job's workers each
    take their part of every global batch (under AUTO each would read all of it, as in TF)."""
    options = sg.data.Options()
    options.experimental_distribute.auto_shard_policy = sg.data.AutoShardPolicy.DATA
    return dataset().with_options(options)


def custom_loop(strategy, phase: str, path: str, data=dataset) -> Ledgered:
    """The custom loop of the checks: ``first`` trains STOP steps and writes a checkpoint of
    the model, the optimizer and the distributed iterator (over ``data()``) at ``path``;
    ``second`` restores it and trains to the end. Returns the model (its ``seen``: this
    process's ledger)."""
    MAP_CALLS[0] = 0
    model, optimizer, iterator, step, checkpoint = loop_objects(strategy, data)
    if phase == "second":
        checkpoint.restore(path)

    train_steps(strategy, model, optimizer, iterator, step, checkpoint, phase, path)
    return model


def loop_objects(strategy, data=dataset) -> tuple:
    """The custom loop's model, optimizer, distributed iterator (over ``data()``), step
    counter, and a checkpoint of all four."""
    torch.manual_seed(0)
    with strategy.scope():
        model = Ledgered()
    # After the scope: FullyShardedStrategy shards the model as its scope ends.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    iterator = iter(strategy.experimental_distribute_dataset(data()))
    step = torch.zeros((), dtype=torch.int64)
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer, iterator=iterator, step=step)
    return model, optimizer, iterator, step, checkpoint


def train_steps(
    strategy, model, optimizer, iterator, step, checkpoint, phase, path, begin=None, end=None
) -> None:
    """The custom loop's steps over ``iterator`` (``step`` counted in place); ``first`` writes
    ``checkpoint`` at ``path`` after STOP steps and stops there. ``begin(step)`` and
    ``end(step)``, if given, are called around each step (``step``: the step's number)."""

    def train(batch):
        features, labels = batch
        per_example = torch.nn.functional.cross_entropy(model(features), labels, reduction="none")
        loss = sg.nn.compute_average_loss(per_example)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for batch in iterator:
        if begin is not None:
            begin(int(step))
        strategy.run(train, args=(batch,))
        step += 1
        if end is not None:
            end(int(step) - 1)
        if phase == "first" and int(step) == STOP:
            checkpoint.write(path)
            break


def uninterrupted() -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """One process, no strategy, never stopped: each global batch's ids (sorted) and the final
    weights of the custom loop (plain torch on the global batch)."""
    torch.manual_seed(0)
    model = Ledgered()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = []
    for features, labels in dataset():
        batches.append(sorted(features[:, -1].long().tolist()))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(features), labels).backward()
        optimizer.step()
    return batches, {k: v.detach().clone() for k, v in model.net.state_dict().items()}


def uninterrupted_fit() -> dict[str, torch.Tensor]:
    """One process, no strategy, never stopped: ``fit``'s final weights on ``dataset()``."""
    torch.manual_seed(0)
    keras_model = sg.keras.Model(Ledgered())
    keras_model.compile(
        sg.keras.optimizers.SGD(0.1, momentum=0.9),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    keras_model.fit(dataset(), epochs=1, verbose=0)
    return {k: v.detach().clone() for k, v in keras_model.module.net.state_dict().items()}


def per_worker_positions(strategy, phase: str, path: str) -> dict:
    """``distribute_datasets_from_function``: each worker reads its own shard, so the saved
    position is every worker's. ``first``: save after 3 steps, then both the iterator that went
    on and a fresh one restored from the save (on as many workers) read the rest; ``second``:
    a restore on another number of workers, which must be refused by name."""

    def dataset_fn(ctx):
        return (
            sg.data.Dataset.range(40)
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .shuffle(5)
            .batch(ctx.get_per_replica_batch_size(12))
        )

    def ids(batch) -> list[int]:
        return [int(v) for v in strategy.experimental_local_results(batch)[0]]

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    checkpoint = sg.train.Checkpoint(iterator=iterator)
    if phase == "second":
        try:
            checkpoint.restore(path)
        except sg.errors.CheckpointError as e:  # naming the iterator, the InputError's words
            return {"refused": str(e)}
        return {"refused": None}
    for _ in range(3):
        next(iterator)
    checkpoint.write(path)
    went_on = [ids(b) for b in iterator]
    restored = iter(strategy.distribute_datasets_from_function(dataset_fn))
    sg.train.Checkpoint(iterator=restored).restore(path)
    return {"went_on": went_on, "restored": [ids(b) for b in restored]}
