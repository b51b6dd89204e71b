"""``sg.device`` (TF's ``tf.device``) and the placement log (``sg.debugging``)."""

from __future__ import annotations

import logging

import pytest
import torch

import stratagem as sg
from stratagem.distribute.machinery.device_scope import current_device, module_device

CUDA = torch.cuda.is_available()
needs_two_gpus = pytest.mark.skipif(
    not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("/cpu:0", "cpu:0"),
        ("cpu:1", "cpu:1"),
        ("/device:CPU:1", "cpu:1"),
        ("/job:w/task:0/cpu:2", "cpu:2"),
    ],
)
def test_device_scope_names_and_places_modules_and_tensors(spec, name):
    with sg.device(spec):
        assert current_device().name == name
        layer = torch.nn.Linear(3, 2)
        relu = torch.nn.ReLU()
        t = torch.zeros(2)
    assert current_device() is None
    assert layer.weight.device.type == "cpu" and t.device.type == "cpu"
    assert module_device(layer).name == name
    assert module_device(relu) is None  # nothing registered: nothing to place


def test_device_scopes_nest_and_the_innermost_wins():
    with sg.device("/cpu:0"):
        outer = torch.nn.Linear(2, 2)
        with sg.device("/cpu:1"):
            inner = torch.nn.Linear(2, 2)
            assert current_device().name == "cpu:1"
        after = torch.nn.Linear(2, 2)
    assert [module_device(m).name for m in (outer, inner, after)] == ["cpu:0", "cpu:1", "cpu:0"]


def test_bad_device_names_are_named_errors():
    with pytest.raises(sg.errors.DeviceError, match="unknown device 'tpu:0'"), sg.device("tpu:0"):
        pass
    if not CUDA:
        with (
            pytest.raises(sg.errors.DeviceError, match=r"'/gpu:1' does not exist"),
            sg.device("/gpu:1"),
        ):
            pass
    assert current_device() is None


def test_a_strategy_scope_wins_and_a_foreign_device_is_an_error():
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        with sg.device("cpu:1"):  # one of the strategy's devices: the strategy places it
            layer = torch.nn.Linear(2, 2)
        with (
            pytest.raises(sg.errors.DeviceError, match=r"sg.device\('cpu:2'\) inside"),
            sg.device("cpu:2"),
        ):
            pass
    assert module_device(layer) is None  # placed by the strategy, not by the device scope
    outside = pytest.raises(sg.errors.DeviceError, match=r"outside the scope of MirroredStrategy")
    with outside, sg.device("/cpu:3"), strategy.scope():
        pass
    with sg.device("/cpu:1"), strategy.scope():  # compatible: fine in this order too
        torch.nn.Linear(2, 2)
    # The default strategy places nothing: its scope keeps the device scope's placement.
    with sg.device("/cpu:3"), sg.distribute.get_strategy().scope():
        layer = torch.nn.Linear(2, 2)
    assert module_device(layer).name == "cpu:3"


@pytest.mark.cuda
@needs_two_gpus
def test_device_scope_places_on_the_named_gpu():
    with sg.device("/gpu:1"):
        layer = torch.nn.Linear(3, 2)
        t = torch.ones(2)
        with sg.device("cuda:0"):
            u = torch.ones(2)
    assert layer.weight.device == torch.device("cuda", 1) and t.device == torch.device("cuda", 1)
    assert u.device == torch.device("cuda", 0)


@pytest.fixture
def placement_log(caplog):
    caplog.set_level(logging.INFO, logger="stratagem.device_placement")
    yield caplog
    sg.debugging.set_log_device_placement(False)


def _modes():
    """The function and dispatch modes of this thread (torch's own listing)."""
    return (
        torch.overrides._get_current_function_mode_stack(),
        torch.utils._python_dispatch._get_current_dispatch_mode_stack(),
    )


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "stratagem.device_placement"]


def test_placement_log_is_off_by_default_and_installs_nothing(placement_log):
    assert sg.debugging.get_log_device_placement() is False
    torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert _lines(placement_log) == []
    assert _modes() == ([], [])


def test_placement_log_logs_each_op_and_module_once_per_device(placement_log):
    with sg.device("/cpu:1"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
    x = torch.ones(4, 2)
    sg.debugging.set_log_device_placement(True)
    for _ in range(3):
        model(x).sum()
    with sg.device("/cpu:0"):
        torch.ones(2) + 1
    sg.debugging.set_log_device_placement(False)
    model(x)  # off again: nothing more
    lines = _lines(placement_log)
    cpu1 = "in device /job:localhost/replica:0/task:0/device:CPU:1"
    cpu0 = "in device /job:localhost/replica:0/task:0/device:CPU:0"
    assert f"Executing module Linear {cpu1}" in lines
    assert f"Executing module ReLU {cpu1}" in lines  # runs where its parent was placed
    assert f"Executing module Sequential {cpu1}" in lines
    assert f"Executing op aten::addmm {cpu1}" in lines
    assert f"Executing op aten::sum {cpu0}" in lines
    assert f"Executing op aten::ones {cpu0}" in lines
    assert len(lines) == len(set(lines))  # once per (op, device), though called three times
    assert _modes() == ([], [])


def test_set_log_device_placement_takes_a_bool():
    with pytest.raises(TypeError, match="True or False"):
        sg.debugging.set_log_device_placement("yes")


def test_the_log_turned_on_inside_a_device_scope_outlives_it(placement_log):
    # A function mode pushed inside torch's device context would be popped in its place.
    with sg.device("/cpu:1"):
        sg.debugging.set_log_device_placement(True)
    assert _modes()[0] == []  # the device scope is gone, nothing of it left behind
    torch.ones(3) * 2
    sg.debugging.set_log_device_placement(False)
    assert _modes() == ([], [])
    cpu0 = "in device /job:localhost/replica:0/task:0/device:CPU:0"
    assert f"Executing op aten::mul.Tensor {cpu0}" in _lines(placement_log)


def test_backward_ops_are_logged_too(placement_log):
    layer = torch.nn.Linear(2, 2)
    sg.debugging.set_log_device_placement(True)
    layer(torch.ones(1, 2)).sum().backward()
    sg.debugging.set_log_device_placement(False)
    assert any(line.startswith("Executing op aten::mm ") for line in _lines(placement_log))
