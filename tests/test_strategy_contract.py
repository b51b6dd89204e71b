"""The common strategy tests: what every single-process strategy does alike, through the
public API alone, including a toy strategy written against ``strategy.extended`` only
(``in_turn_strategy.py``, the example of docs/architecture.md's "Writing a strategy")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stratagem as sg
from in_turn_strategy import InTurnStrategy


def _strategies() -> dict[str, callable]:
    return {
        "default": sg.distribute.get_strategy,
        "one_device": lambda: sg.distribute.OneDeviceStrategy("cpu:0"),
        "mirrored": lambda: sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]),
        "central_storage": lambda: sg.distribute.experimental.CentralStorageStrategy(
            ["cpu:0", "cpu:1"]
        ),
        # A job of one process: nothing to shard (the strategy's null version).
        "fully_sharded": lambda: sg.distribute.experimental.FullyShardedStrategy(),
        "in_turn_2": lambda: InTurnStrategy(2),
        "in_turn_3": lambda: InTurnStrategy(3),
    }


@pytest.fixture(params=list(_strategies()))
def strategy(request):
    return _strategies()[request.param]()


def _data(n: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return x, y


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in module.parameters()])


def test_run_gives_every_replica_its_context_and_values(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        ids = strategy.run(lambda: sg.distribute.get_replica_context().replica_id_in_sync_group)
    assert sorted(int(i) for i in strategy.experimental_local_results(ids)) == list(range(n))
    assert float(strategy.reduce("SUM", ids, axis=None)) == sum(range(n))
    assert float(strategy.reduce("MEAN", ids, axis=None)) == pytest.approx(sum(range(n)) / n)
    rows = strategy.run(
        lambda: torch.full((2,), float(sg.distribute.get_replica_context().local_replica_id))
    )
    assert strategy.gather(rows, axis=0).tolist() == [float(i) for i in range(n) for _ in "ab"]


def test_distributed_dataset_gives_every_example_once_per_epoch(strategy):
    batches = sg.data.Dataset.from_tensor_slices(torch.arange(40)).batch(12)
    seen = []
    for batch in strategy.experimental_distribute_dataset(batches):
        for part in strategy.experimental_local_results(batch):
            seen.extend(int(v) for v in part)
    assert sorted(seen) == list(range(40))


def test_extended_facts_of_a_single_process(strategy):
    e = strategy.extended
    assert e.should_checkpoint and e.should_save_summary and e.should_init
    assert e.communicator.world_size == 1
    assert len(e.worker_devices) == len(e.replica_devices)
    assert strategy.num_replicas_in_sync == len(e.replica_devices)
    assert e.describe()["num_replicas_in_sync"] == strategy.num_replicas_in_sync
    with strategy.scope():
        inside = nn.Linear(2, 2)
    outside = nn.Linear(2, 2)
    owned = e.variable_created_in_scope(inside.weight)
    assert owned == (strategy is not sg.distribute.get_strategy())  # the default owns nothing
    assert not e.variable_created_in_scope(outside.weight)


def _one_device_steps(x: torch.Tensor, y: torch.Tensor, steps: int, batch: int) -> nn.Module:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for s in range(steps):
        xb, yb = x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    return model


def test_custom_loop_equals_one_device_on_the_global_batch(strategy):
    x, y = _data(48)
    with strategy.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loss_fn = sg.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=sg.keras.losses.Reduction.NONE
    )

    def step(inputs):
        xb, yb = inputs
        opt.zero_grad()
        loss = sg.nn.compute_average_loss(loss_fn(yb, model(xb)), global_batch_size=12)
        loss.backward()
        opt.step()
        return loss

    dataset = sg.data.Dataset.from_tensor_slices((x, y)).batch(12)
    total = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        total.append(float(strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)))
    reference = _one_device_steps(x, y, steps=4, batch=12)
    torch.testing.assert_close(_flat(model), _flat(reference), atol=1e-5, rtol=1e-5)
    assert len(total) == 4


def test_fit_evaluate_predict_equal_one_device(strategy, tmp_path):
    x, y = _data(48)

    def fitted(s):
        with s.scope():
            model = sg.keras.Model(_model())
            model.compile(
                optimizer=sg.keras.optimizers.SGD(learning_rate=0.2),
                loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
        return model, history

    model, history = fitted(strategy)
    reference, ref_history = fitted(sg.distribute.get_strategy())
    torch.testing.assert_close(_flat(model.module), _flat(reference.module), atol=1e-5, rtol=1e-5)
    for key in ("loss", "accuracy"):
        assert history.history[key] == pytest.approx(ref_history.history[key], abs=1e-5)
    assert model.evaluate(x, y, batch_size=12, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=12, verbose=0), abs=1e-5
    )
    assert model.predict(x, batch_size=12).shape == (48, 3)


def test_checkpoint_round_trip_of_a_model_built_in_scope(strategy, tmp_path):
    with strategy.scope():
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    saved = _flat(model)
    path = sg.train.Checkpoint(model=model, optimizer=opt).save(tmp_path / "ckpt")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sg.train.Checkpoint(model=model, optimizer=opt).restore(path).assert_consumed()
    torch.testing.assert_close(_flat(model), saved)


def test_in_turn_replicas_cannot_meet_inside_run():
    strategy = InTurnStrategy(2)
    ctx_reduce = lambda: sg.distribute.get_replica_context().all_reduce("SUM", 1.0)  # noqa: E731
    with pytest.raises(NotImplementedError, match="one after another"):
        strategy.run(ctx_reduce)


def test_the_toy_strategy_uses_the_core_contract_only():
    # No capability: the core alone runs its replicas, reduces, gathers, fits and saves it.
    extended = InTurnStrategy(2).extended
    capabilities = sg.distribute.capabilities
    for capability in (
        capabilities.MergesReplicas,
        capabilities.DefersGradients,
        capabilities.PipelinedSteps,
        capabilities.ChiefCoordination,
    ):
        assert not isinstance(extended, capability), capability.__name__
    # The core's required hooks are abstract: a strategy that says nothing cannot be made.
    required = sg.distribute.StrategyExtended.__abstractmethods__
    assert required == {"adopt", "before_optimizer_step"}

    class Silent(sg.distribute.StrategyExtended):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Silent(sg.distribute.get_strategy(), ["cpu:0"], comm=None)


def _subclasses(cls: type) -> list[type]:
    return [c for s in cls.__subclasses__() for c in (s, *_subclasses(s))]


def _unmarked_overrides(classes) -> list[str]:
    """Methods and properties of ``classes`` that redefine a base's without @override."""
    missing = []
    for cls in classes:
        for name, member in vars(cls).items():
            fn = member.fget if isinstance(member, property) else member
            if name.startswith("__") or not (callable(fn) or isinstance(fn, classmethod)):
                continue
            bases = [b for b in cls.__mro__[1:] if b is not object]
            if any(name in vars(b) for b in bases) and not getattr(fn, "__override__", False):
                missing.append(f"{cls.__qualname__}.{name}")
    return missing


def test_every_override_of_the_contract_says_so():
    # Each member a strategy redefines carries @override, so that a renamed or removed hook of
    # the contract fails at once instead of silently never being called.
    # Every strategy class, imported: the experimental ones load lazily, on first use, so a
    # run of this file alone would otherwise see only those other tests had imported.
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(sg.distribute.__path__, "stratagem.distribute."):
        importlib.import_module(info.name)

    ours = [
        cls
        for root in (sg.distribute.StrategyExtended, sg.distribute.Strategy)
        for cls in {*_subclasses(root)}
        if cls.__module__.startswith("stratagem.") or cls.__module__ == "in_turn_strategy"
    ]
    assert len(ours) >= 20  # every strategy and its extended (the capabilities' too)
    assert not _unmarked_overrides(ours)

    # ... and the check finds one that does not say so.
    class Unmarked(InTurnStrategy):
        def __repr__(self) -> str:
            return "dunder: not checked"

        def scope(self):
            return super().scope()

    assert _unmarked_overrides([Unmarked]) == [
        "test_every_override_of_the_contract_says_so.<locals>.Unmarked.scope"
    ]


def test_reduce_of_a_structure_reduces_each_value_and_keeps_the_structure(strategy):
    # TF: strategy.reduce("SUM", (a, b)) of what run returned for fn's tuple is a tuple (each
    # value reduced over the replicas), never the two stacked into one tensor.
    n = strategy.num_replicas_in_sync
    values = strategy.run(lambda: (torch.tensor(1.0), {"b": torch.tensor([2.0, 3.0])}))
    total, parts = strategy.reduce("SUM", values, axis=None)
    assert total.shape == () and float(total) == n
    assert set(parts) == {"b"} and parts["b"].tolist() == [2.0 * n, 3.0 * n]
    mean = strategy.reduce(sg.distribute.ReduceOp.MEAN, [torch.tensor(4.0)], axis=None)
    assert isinstance(mean, list) and float(mean[0]) == 4.0
