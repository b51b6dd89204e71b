"""Parallel branches and ensembles on several devices of one host (logical CPU devices here;
two GPUs in the ``cuda`` tests), and the two-branch example end to end."""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback

import pytest
import torch
from torch import nn

import stratagem as sg
from cluster_utils import REPO, Process, child_env

ParallelBranches = sg.distribute.experimental.ParallelBranches
Ensemble = sg.distribute.experimental.Ensemble
DEADLOCK_S = 60


@pytest.fixture(autouse=True)
def _no_stray_threads():
    yield
    # Branch threads are joined before forward returns: no collection needed to end them.
    assert not [t.name for t in threading.enumerate() if t.name.startswith("stratagem-branch")]


def _cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


class _Rendezvous(nn.Module):
    """Returns only if the other branch runs at the same time (each waits for the other)."""

    def __init__(self, mine: threading.Event, other: threading.Event) -> None:
        super().__init__()
        self.mine, self.other = mine, other

    def forward(self, x):
        self.mine.set()
        assert self.other.wait(DEADLOCK_S), "the branches did not run concurrently"
        return x * 2


def test_branches_run_at_once_on_their_devices():
    a, b = threading.Event(), threading.Event()
    model = ParallelBranches(_Rendezvous(a, b), _Rendezvous(b, a), devices=["cpu:0", "/cpu:1"])
    x, y = model(torch.ones(2), torch.full((3,), 2.0))
    assert x.tolist() == [2.0, 2.0] and y.tolist() == [4.0, 4.0, 4.0]
    assert [d.name for d in model.devices] == ["cpu:0", "cpu:1"]


def test_values_and_gradients_equal_sequential():
    left, right = _cnn(0), _cnn(1)
    model = ParallelBranches(left, right, devices=["cpu:0", "cpu:1"])
    threads = torch.get_num_threads()
    xa, xb = torch.randn(6, 1, 8, 8), torch.randn(6, 1, 8, 8)
    labels = torch.randint(0, 5, (6,))

    def loss_and_grads(parallel: bool):
        model.zero_grad(set_to_none=True)
        ya, yb = model(xa, xb) if parallel else (left(xa), right(xb))
        loss = nn.functional.cross_entropy(ya + yb, labels)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_p, grads_p = loss_and_grads(True)
    assert torch.get_num_threads() == threads  # the caller's intra-op threads are restored
    loss_s, grads_s = loss_and_grads(False)
    torch.testing.assert_close(loss_p, loss_s, atol=1e-6, rtol=0)
    for gp, gs in zip(grads_p, grads_s, strict=True):
        torch.testing.assert_close(gp, gs, atol=1e-6, rtol=0)
    with torch.no_grad():  # grad mode reaches the branches' threads
        ya, yb = model(xa, xb)
    assert ya.grad_fn is None and yb.grad_fn is None


def test_devices_from_sg_device_scopes_and_bad_arguments():
    with sg.device("/cpu:1"):
        left = _cnn(0)
    with sg.device("/cpu:2"):
        right = _cnn(1)
    model = ParallelBranches(left, right)
    assert [d.name for d in model.devices] == ["cpu:1", "cpu:2"]
    with pytest.raises(sg.errors.DeviceError, match=r"part\(s\) \[1\] were created outside"):
        ParallelBranches(left, _cnn(2))
    with pytest.raises(sg.errors.DeviceError, match=r"2 part.* but 1 device"):
        ParallelBranches(left, right, devices=["cpu:0"])
    with pytest.raises(ValueError, match="2 branches but forward got 1 input"):
        model(torch.zeros(1, 1, 8, 8))


def test_an_error_in_a_branch_reaches_the_caller_with_its_traceback():
    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError(f"branch failed on shape {tuple(x.shape)}")

    model = ParallelBranches(nn.Identity(), Broken(), devices=["cpu:0", "cpu:1"])
    with pytest.raises(RuntimeError, match=r"branch failed on shape \(2,\)") as info:
        model(torch.zeros(3), torch.zeros(2))
    assert "forward" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]


def test_the_placement_log_names_each_branch_device(caplog):
    caplog.set_level(logging.INFO, logger="stratagem.device_placement")
    model = ParallelBranches(nn.Linear(2, 2), nn.Linear(2, 2), devices=["cpu:0", "cpu:1"])
    sg.debugging.set_log_device_placement(True)
    try:
        model(torch.ones(1, 2), torch.ones(1, 2))
    finally:
        sg.debugging.set_log_device_placement(False)
    lines = {r.getMessage() for r in caplog.records}
    for device in ("CPU:0", "CPU:1"):
        where = f"in device /job:localhost/replica:0/task:0/device:{device}"
        assert f"Executing op aten::addmm {where}" in lines, lines


def test_ensemble_average_equals_the_sequential_one():
    models = [_cnn(seed) for seed in range(3)]
    ensemble = Ensemble(models, devices=["cpu:0", "cpu:1", "cpu:2"])
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        expected = torch.stack([m(x) for m in models]).mean(dim=0)
        got = ensemble(x)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="at least one model"):
        Ensemble([])


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_branches_on_two_gpus_equal_sequential():
    left, right = _cnn(0), _cnn(1)
    model = ParallelBranches(left, right, devices=["/gpu:0", "/gpu:1"])
    xa, xb = torch.randn(6, 1, 8, 8), torch.randn(6, 1, 8, 8)
    ya, yb = model(xa, xb)
    assert ya.device == torch.device("cuda", 0) and yb.device == torch.device("cuda", 1)
    loss = ya.sum() + yb.sum().to("cuda:0")
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    (left(xa.cuda(0)).sum() + right(xb.cuda(1)).sum().to("cuda:0")).backward()
    for gp, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(gp, p.grad, atol=1e-6, rtol=0)
    ensemble = Ensemble([_cnn(3), _cnn(4)], devices=["cuda:0", "cuda:1"])
    assert ensemble(xa).device == torch.device("cuda", 0)


@pytest.mark.e2e
def test_two_branch_example_matches_sequential_and_reports_its_speed(tmp_path):
    argv = [sys.executable, str(REPO / "examples" / "two_branch.py"), "--steps", "20"]
    argv += ["--timing-rounds", "1", "--timing-steps", "2", "--batch", "32"]
    result = Process(argv, child_env(), tmp_path, "two_branch").wait(timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "branches on ['cpu:0', 'cpu:1']" in output or "cuda:0" in output, output
    difference = float(re.search(r"largest difference ([0-9.e+-]+)", output).group(1))
    assert difference <= 1e-6, output
    assert re.search(r"Test accuracy: [0-9.]+", output), output
    assert re.search(r"parallel [0-9.]+, sequential [0-9.]+, ratio [0-9.]+", output), output
