"""Mixed precision with Keras's API (``sg.keras.mixed_precision``) and torch.amp custom loops.

Single-process here (the default strategy and MirroredStrategy over two CPU replicas); the
multi-worker checks (bf16 accuracy, an overflow on one worker, GradScaler) share one 2-process
run at the end.
"""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from workers.poison import Poison, poisoned_model

mp = sg.keras.mixed_precision
LOSS = sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    mp.set_global_policy(None)


def _data(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------- Policy


@pytest.mark.parametrize(
    "name, compute, variable",
    [
        ("float32", "float32", "float32"),
        ("mixed_bfloat16", "bfloat16", "float32"),
        ("mixed_float16", "float16", "float32"),
        ("bfloat16", "bfloat16", "bfloat16"),
        ("float16", "float16", "float16"),
    ],
)
def test_policy_names_and_dtypes(name, compute, variable):
    policy = mp.Policy(name)
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (name, compute, variable)
    assert repr(policy) == f'<Policy "{name}">' and mp.Policy(policy) == policy


def test_unknown_policy_names_the_value_and_the_valid_names():
    with pytest.raises(ValueError, match=r"'mixed_int8'.*'mixed_float16', 'mixed_bfloat16'"):
        mp.Policy("mixed_int8")
    with pytest.raises(TypeError, match="int"):
        mp.set_global_policy(16)


def test_global_policy_is_read_when_the_model_is_constructed():
    assert mp.global_policy().name == "float32"
    mp.set_global_policy("mixed_bfloat16")
    assert mp.global_policy() == mp.Policy("mixed_bfloat16")
    model = sg.keras.Model(poisoned_model())
    mp.set_global_policy("float32")
    later = sg.keras.Model(poisoned_model())
    assert model.dtype_policy.name == "mixed_bfloat16" and model.compute_dtype == "bfloat16"
    assert later.dtype_policy.name == "float32"
    assert sg.keras.Model(poisoned_model(), dtype="mixed_float16").variable_dtype == "float32"
    mp.set_global_policy(None)
    assert mp.global_policy().name == "float32"


def test_a_single_dtype_policy_needs_weights_of_that_dtype():
    with pytest.raises(ValueError, match=r"'bfloat16' keeps weights in bfloat16.*\['float32'\]"):
        sg.keras.Model(poisoned_model(), dtype="bfloat16")
    model = sg.keras.Model(poisoned_model().to(torch.bfloat16), dtype="bfloat16")
    assert model(torch.randn(4, 5)).dtype == torch.bfloat16  # float32 inputs are cast


# ---------------------------------------------------------------------- LossScaleOptimizer


def _lso_over_one_weight(**kwargs):
    w = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.Adam([w], lr=0.1)
    return w, inner, mp.LossScaleOptimizer(inner, **kwargs)


def _step(opt, w, overflow=False):
    opt.zero_grad()
    loss = (w * torch.tensor([1.0, 2.0, float("inf") if overflow else 3.0])).sum()
    opt.get_scaled_loss(loss).backward()
    opt.step()


def test_loss_scale_defaults_are_keras():
    _, _, opt = _lso_over_one_weight()
    assert float(opt.loss_scale) == 2.0**15 and opt.dynamic_growth_steps == 2000
    assert int(opt.dynamic_counter) == 0 and opt.dynamic
    assert sg.keras.optimizers.LossScaleOptimizer is mp.LossScaleOptimizer


def test_dynamic_scale_grows_after_growth_steps_and_halves_on_overflow_skipping_the_step():
    w, inner, opt = _lso_over_one_weight(initial_scale=8.0, dynamic_growth_steps=2)
    _step(opt, w)
    assert float(opt.loss_scale) == 8 and int(opt.dynamic_counter) == 1
    # The gradient was unscaled before the update: Adam's first moment holds the true gradient.
    torch.testing.assert_close(inner.state[w]["exp_avg"], 0.1 * torch.tensor([1.0, 2.0, 3.0]))
    _step(opt, w)
    assert float(opt.loss_scale) == 16 and int(opt.dynamic_counter) == 0
    before, state = w.detach().clone(), {k: v.clone() for k, v in inner.state[w].items()}
    _step(opt, w, overflow=True)
    assert float(opt.loss_scale) == 8 and int(opt.dynamic_counter) == 0
    assert torch.equal(w.detach(), before)  # skipped: weights and optimizer state untouched
    assert all(torch.equal(inner.state[w][k], v) for k, v in state.items())
    for _ in range(5):  # halving stops at 1, as TF2's
        _step(opt, w, overflow=True)
    assert float(opt.loss_scale) == 1


def test_fixed_scale_never_skips_and_unscaled_gradients_are_new_tensors():
    w, _, opt = _lso_over_one_weight(dynamic=False, initial_scale=4.0)
    assert opt.dynamic_counter is None
    grads = opt.get_unscaled_gradients([torch.full((3,), 8.0), None])
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and grads[1] is None
    assert float(opt.get_scaled_loss(lambda: torch.tensor(2.0))()) == 8.0
    _step(opt, w, overflow=True)
    assert float(opt.loss_scale) == 4.0 and not torch.isfinite(w).all()


def test_bad_loss_scale_arguments_echo_the_value():
    _, inner, opt = _lso_over_one_weight()
    with pytest.raises(ValueError, match="initial_scale"):
        mp.LossScaleOptimizer(inner, dynamic=False)
    with pytest.raises(ValueError, match="dynamic_growth_steps must be an integer >= 1, got 0"):
        mp.LossScaleOptimizer(inner, dynamic_growth_steps=0)
    with pytest.raises(TypeError, match="another LossScaleOptimizer"):
        mp.LossScaleOptimizer(opt)
    with pytest.raises(TypeError, match="got int: 3"):
        mp.LossScaleOptimizer(3)


def test_loss_scale_is_part_of_checkpoints(tmp_path):
    w, _, opt = _lso_over_one_weight(initial_scale=8.0, dynamic_growth_steps=5)
    _step(opt, w)
    _step(opt, w, overflow=True)
    _step(opt, w)
    path = sg.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
    _step(opt, w, overflow=True)
    assert (float(opt.loss_scale), int(opt.dynamic_counter)) == (2.0, 0)
    sg.train.Checkpoint(optimizer=opt).restore(path)
    assert (float(opt.loss_scale), int(opt.dynamic_counter)) == (4.0, 1)
    # A Keras model tracks its optimizer's scale too.
    x, y = _data()
    model = sg.keras.Model(poisoned_model(), dtype="mixed_float16")
    model.compile(mp.LossScaleOptimizer(sg.keras.optimizers.SGD(0.1), initial_scale=64.0), LOSS)
    model.module[-1].replica = 0
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    saved = sg.train.Checkpoint(model=model).save(str(tmp_path / "model"))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert float(model.optimizer.loss_scale) == 16.0
    sg.train.Checkpoint(model=model).restore(saved)
    assert float(model.optimizer.loss_scale) == 32.0


# ---------------------------------------------------------------------- Model.fit

LOCAL_STRATEGIES = pytest.mark.parametrize(
    "make",
    [
        lambda: sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: sg.distribute.experimental.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    ],
    ids=["mirrored", "central_storage"],
)


def test_mixed_bfloat16_fit_computes_in_bf16_with_float32_weights_state_and_loss():
    mp.set_global_policy("mixed_bfloat16")
    x, y = _data()
    model = sg.keras.Model(poisoned_model())
    seen = []
    model.module[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    model.compile(sg.keras.optimizers.Adam(0.01), LOSS, ["accuracy"])
    assert not isinstance(model.optimizer, mp.LossScaleOptimizer)  # bf16 needs no scaling
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert set(seen) == {torch.bfloat16} and len(seen) == 4
    assert {p.dtype for p in model.module.parameters()} == {torch.float32}
    state = [v for s in model.optimizer.state.values() for v in s.values()]
    assert state and {v.dtype for v in state} == {torch.float32}
    assert all(torch.isfinite(torch.tensor(history.history["loss"])))
    assert model.predict(x).dtype == "float32"  # outputs cast up, as the loss sees them
    assert isinstance(model.evaluate(x, y, verbose=0)[0], float)


def test_mixed_float16_compile_wraps_the_optimizer_in_a_loss_scale_optimizer():
    model = sg.keras.Model(poisoned_model(), dtype="mixed_float16")
    seen = []
    model.module[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    model.compile("sgd", LOSS)
    assert isinstance(model.optimizer, mp.LossScaleOptimizer)
    model.fit(*_data(), batch_size=16, epochs=1, verbose=0)
    assert set(seen) == {torch.float16} and int(model.optimizer.dynamic_counter) == 2


@LOCAL_STRATEGIES
def test_overflow_on_one_local_replica_skips_the_step_on_both(make):
    strategy = make()
    torch.manual_seed(3)
    with strategy.scope():
        model = sg.keras.Model(poisoned_model(), dtype="mixed_float16")
    reference = sg.keras.Model(poisoned_model(), dtype="mixed_float16")
    reference.module.load_state_dict(model.module.state_dict())
    for m in (model, reference):  # SGD: a gradient unscaled twice or not at all would show
        m.compile(mp.LossScaleOptimizer(sg.keras.optimizers.SGD(0.5), initial_scale=256.0), LOSS)
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    reference.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert (float(model.optimizer.loss_scale), int(model.optimizer.dynamic_counter)) == (256, 1)
    before = _weights(model.module)
    for k, v in before.items():  # each replica unscaled its own gradients, once
        torch.testing.assert_close(v, reference.module.state_dict()[k], rtol=1e-3, atol=1e-3)
    model.module[-1].replica = 1  # replica 1's gradients overflow, replica 0's do not
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # Skipped by both (without agreement replica 0 would wait in the step's merge call alone),
    # the scale halved once, not once per replica thread.
    assert (float(model.optimizer.loss_scale), int(model.optimizer.dynamic_counter)) == (128, 0)
    for k, v in _weights(model.module).items():
        assert torch.equal(v, before[k]), k
    model.module[-1].replica = None
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert int(model.optimizer.dynamic_counter) == 1
    assert any(not torch.equal(v, before[k]) for k, v in _weights(model.module).items())


# ---------------------------------------------------------------------- GradScaler custom loops


@LOCAL_STRATEGIES
@pytest.mark.parametrize("inside_run", [False, True], ids=["step_after_run", "step_in_run"])
def test_grad_scaler_custom_loop_with_local_replicas_agrees_and_equals_one_device(make, inside_run):
    """torch.amp.GradScaler in a custom loop: backward inside strategy.run, the scaler's
    step and update either after it, in the cross-replica context (one scaler per process, as
    with DDP), where the replicas' gradients are already summed, or inside it, where they are
    merge calls that run once on the summed gradients: one decision for both replicas."""
    strategy = make()
    torch.manual_seed(5)
    with strategy.scope():
        module = poisoned_model()
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
    reference = poisoned_model()
    reference.load_state_dict(module.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = _data()

    def replica_step(xb, yb):
        with torch.autocast("cpu", dtype=torch.float16):
            logits = module(xb)
        loss = sg.nn.compute_average_loss(
            torch.nn.functional.cross_entropy(logits.float(), yb, reduction="none")
        )
        scaler.scale(loss).backward()
        if inside_run:  # the ordinary loop's order, unchanged, inside the replica function
            scaler.step(opt)
            scaler.update()

    def step():
        opt.zero_grad()
        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        strategy.run(replica_step, args=batch)
        if not inside_run:
            scaler.step(opt)
            scaler.update()

    step()
    ref_opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        logits = reference(x)
    torch.nn.functional.cross_entropy(logits.float(), y).backward()
    ref_opt.step()
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, reference.state_dict()[k], rtol=1e-3, atol=1e-3)
    before = _weights(module)
    module[-1].replica = 1
    step()
    assert scaler.get_scale() == 512.0
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


# ---------------------------------------------------------------------- two workers


@pytest.mark.multiprocess
def test_two_workers_mixed_precision(tmp_path):
    results = run_cluster(WORKERS / "mixed_precision_checks.py", 2, tmp_path, timeout=240)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    outs = [torch.load(tmp_path / f"mp-{i}.pt") for i in range(2)]
    # (a) mixed_bfloat16 fit reaches the float32 run's test accuracy within 0.01.
    for out in outs:
        assert abs(out["bf16_accuracy"] - out["f32_accuracy"]) <= 0.01, out
        assert out["f32_accuracy"] > 0.8, out
        assert out["bf16_activations"] == [torch.bfloat16]
        assert out["bf16_weights"] == [torch.float32] and out["bf16_state"] == [torch.float32]
    # (b) mixed_float16, an overflow on worker 1 only: skipped on both, scale halved on both.
    for out in outs:
        assert out["lso_scale"] == [256.0, 128.0] and out["lso_counter"] == [1, 0], out
        for k, v in out["lso_after"].items():
            assert torch.equal(v, out["lso_before"][k]), k
    for k, v in outs[0]["lso_after"].items():
        assert torch.equal(v, outs[1]["lso_after"][k]), k
    # (c) GradScaler custom loop: the same decision and scale on both workers.
    for out in outs:
        assert out["scaler_scale"] == [1024.0, 512.0], out
        assert out["scaler_skipped_unchanged"], out
    for k, v in outs[0]["scaler_weights"].items():
        assert torch.equal(v, outs[1]["scaler_weights"][k]), k
    # (d) FSDP, an inf in worker 1's shard alone: both skip (LossScaleOptimizer agrees the flag,
    # inside strategy.run and outside it; torch's DTensor rule MAX-reduces GradScaler's).
    for key in ("fsdp_lso", "fsdp_scaler", "fsdp_lso_outside_run"):
        for out in outs:
            assert out[f"{key}_scale"] == [1024.0, 512.0], (key, out[f"{key}_scale"])
            assert out[f"{key}_skipped_unchanged"], key
    # (e) MeshStrategy fit: an overflowing example in worker 1's part of the batch.
    for out in outs:
        assert out["mesh_scale"] == 128.0 and out["mesh_skipped_unchanged"], out["mesh_scale"]


def test_poison_layer_is_an_identity_until_armed():
    layer = Poison()
    x = torch.randn(2, 3, requires_grad=True)
    layer(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 3))


def test_saved_model_keeps_its_policy_and_its_loss_scale(tmp_path):
    x, y = _data()
    model = sg.keras.Model(poisoned_model(), dtype="mixed_float16")
    scaled = mp.LossScaleOptimizer(
        sg.keras.optimizers.SGD(0.1), initial_scale=64, dynamic_growth_steps=3
    )
    model.compile(scaled, LOSS)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 2 finite steps: counter 2 of 3
    model.save(str(tmp_path / "saved"))
    loaded = sg.keras.models.load_model(str(tmp_path / "saved"))
    assert loaded.dtype_policy.name == "mixed_float16"
    assert isinstance(loaded.optimizer, mp.LossScaleOptimizer)
    # The wrapper's config and the scale it reached, as Keras saves them.
    assert loaded.optimizer.dynamic_growth_steps == 3 and loaded.optimizer.initial_scale == 64
    assert float(loaded.optimizer.loss_scale) == 64 and int(loaded.optimizer.dynamic_counter) == 2
    torch.testing.assert_close(
        torch.from_numpy(loaded.predict(x)), torch.from_numpy(model.predict(x))
    )
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # The third finite step since the last change doubles the scale; the fourth counts 1.
    assert float(loaded.optimizer.loss_scale) == 128 and int(loaded.optimizer.dynamic_counter) == 1


# ---------------------------------------------------------------------- CUDA (skipped without)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize(
    "policy, dtype", [("mixed_bfloat16", torch.bfloat16), ("mixed_float16", torch.float16)]
)
def test_cuda_fit_computes_in_the_policy_dtype_and_skips_an_overflow_everywhere(
    gpus, policy, dtype
):
    if gpus > GPUS:
        pytest.skip(f"needs {gpus} CUDA device(s), found {GPUS}")
    devices = [f"cuda:{i}" for i in range(gpus)]
    strategy = (
        sg.distribute.OneDeviceStrategy(devices[0])
        if gpus == 1
        else sg.distribute.MirroredStrategy(devices)
    )
    with strategy.scope():
        model = sg.keras.Model(poisoned_model(), dtype=policy)
    seen = []
    model.module[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    model.compile(sg.keras.optimizers.Adam(0.01), LOSS)
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert set(seen) == {dtype}
    assert {(p.dtype, p.device.type) for p in model.module.parameters()} == {
        (torch.float32, "cuda")
    }
    if policy != "mixed_float16":
        return
    scale, before = float(model.optimizer.loss_scale), _weights(model.module)
    model.module[-1].replica = gpus - 1
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert float(model.optimizer.loss_scale) == scale / 2
    assert all(torch.equal(v, before[k]) for k, v in _weights(model.module).items())


def test_a_pipeline_fit_refuses_a_policy_it_would_not_apply():
    strategy = sg.distribute.experimental.PipelineStrategy(num_stages=1, num_microbatches=2)
    with strategy.scope():
        model = sg.keras.Model(poisoned_model(), dtype="mixed_bfloat16")
    model.compile("sgd", LOSS)
    with pytest.raises(ValueError, match=r"policy 'mixed_bfloat16'.*float32 only"):
        model.fit(*_data(), batch_size=16, epochs=1, verbose=0)


def test_loss_scaling_with_gradient_accumulation_steps_once_per_accumulated_step():
    x, y = _data()
    torch.manual_seed(0)
    accumulating = sg.keras.Model(poisoned_model(), dtype="mixed_float16")
    reference = sg.keras.Model(poisoned_model(), dtype="mixed_float16")
    reference.module.load_state_dict(accumulating.module.state_dict())
    accumulating.compile(sg.keras.optimizers.SGD(0.5, gradient_accumulation_steps=2), LOSS)
    reference.compile(sg.keras.optimizers.SGD(0.5), LOSS)
    assert isinstance(accumulating.optimizer, mp.LossScaleOptimizer)
    assert accumulating.optimizer.gradient_accumulation_steps == 2
    accumulating.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # 2 micro-batches
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)  # 1 step, 2x batch
    # Unscaled and checked once, at the update: one finite step, equal to the 2x batch's.
    assert int(accumulating.optimizer.dynamic_counter) == 1
    for k, v in accumulating.module.state_dict().items():
        torch.testing.assert_close(v, reference.module.state_dict()[k], rtol=1e-3, atol=1e-3)
