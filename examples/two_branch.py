"""Two CNN branches over two inputs, run at once on two devices (the book chapter's "parallel
execution across devices").

Each digit image is cut into its left and right halves; one small CNN reads the left half,
another the right, and a linear head classifies their joined features. With
``sg.distribute.experimental.ParallelBranches`` the two branches run concurrently, one per
device: on two GPUs when there are two, else on two logical CPU devices (threads sharing the
CPU's cores). The script

1. checks that the parallel forward gives the same outputs, loss and gradients as running the
   branches one after the other (to 1e-6);
2. trains a few hundred steps and reports test accuracy;
3. times training steps and inference both ways, side by side, and prints the ratios as
   measured.

    python examples/two_branch.py                    # devices: 2 GPUs, else cpu:0 and cpu:1
    python examples/two_branch.py --devices cpu:0 cpu:1 --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

import stratagem as sg


def branch() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )


class TwoBranchNet(nn.Module):
    """Left half → branch 0 on devices[0]; right half → branch 1 on devices[1]; head on 0."""

    def __init__(self, devices: list[str]) -> None:
        super().__init__()
        with sg.device(devices[0]):
            left = branch()
            self.head = nn.Linear(2 * 16 * 14 * 7, 10)
        with sg.device(devices[1]):
            right = branch()
        self.branches = sg.distribute.experimental.ParallelBranches(left, right)
        self.parallel = True

    def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            a, b = self.branches(left, right)
        else:  # the reference: the same branches, one after the other, in this thread
            (dev_a, dev_b) = (d.torch_device for d in self.branches.devices)
            a = self.branches.branches[0](left.to(dev_a))
            b = self.branches.branches[1](right.to(dev_b))
        head_device = self.head.weight.device
        return self.head(torch.cat([a.to(head_device), b.to(head_device)], dim=1))


def halves(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return images[..., :14].contiguous(), images[..., 14:].contiguous()


def default_devices() -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return ["cuda:0", "cuda:1"]
    return ["cpu:0", "cpu:1"]


def check_equivalence(model: TwoBranchNet, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The largest difference between parallel and sequential outputs, loss and gradients."""
    results = []
    for parallel in (True, False):
        model.parallel = parallel
        model.zero_grad(set_to_none=True)
        logits = model(*halves(images))
        loss = nn.functional.cross_entropy(logits, labels.to(logits.device))
        loss.backward()
        grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
        results.append((logits.detach().cpu(), loss.detach().cpu(), grads))
    (lp, sp, gp), (ls, ss, gs) = results
    diffs = [(lp - ls).abs().max(), (sp - ss).abs()] + [(a - b).abs().max() for a, b in zip(gp, gs)]
    model.parallel = True
    return float(max(diffs))


def time_steps(model, optimizer, batches, parallel: bool, device, train: bool) -> float:
    model.parallel = parallel
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for images, labels in batches:
        if not train:  # inference: the forward alone, where the branches overlap throughout
            with torch.no_grad():
                model(*halves(images))
            continue
        optimizer.zero_grad(set_to_none=True)
        logits = model(*halves(images))
        nn.functional.cross_entropy(logits, labels.to(logits.device)).backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    model.parallel = True
    return len(batches) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs=2, default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timing-rounds", type=int, default=5)
    parser.add_argument("--timing-steps", type=int, default=10)
    args = parser.parse_args()
    devices = args.devices or default_devices()
    if devices[0].startswith("cpu") and devices[1].startswith("cpu"):
        # Two logical CPU devices: the branches' threads share the process's cores.
        sg.config.set_logical_device_configuration(
            sg.config.list_physical_devices("CPU")[0],
            [sg.config.LogicalDeviceConfiguration()] * 2,
        )
    torch.manual_seed(0)
    (x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=28)
    x_train = torch.from_numpy(x_train / np.float32(255))[:, None]
    x_test = torch.from_numpy(x_test / np.float32(255))[:, None]
    y_train, y_test = (
        torch.from_numpy(y_train.astype(np.int64)),
        torch.from_numpy(y_test.astype(np.int64)),
    )
    model = TwoBranchNet(devices)
    print(f"branches on {[d.name for d in model.branches.devices]}", flush=True)

    difference = check_equivalence(model, x_train[:64], y_train[:64])
    print(f"parallel vs sequential: largest difference {difference:.2e} (outputs, loss, grads)")
    if difference > 1e-6:
        raise SystemExit(f"parallel branches differ from sequential by {difference:.2e} > 1e-6")

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train = sg.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2048, seed=0)
    train = train.repeat().batch(args.batch).prefetch(sg.data.AUTOTUNE)
    for step, (images, labels) in enumerate(train.take(args.steps)):
        optimizer.zero_grad(set_to_none=True)
        logits = model(*halves(images))
        loss = nn.functional.cross_entropy(logits, labels.to(logits.device))
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        predictions = model(*halves(x_test)).argmax(dim=1).cpu()
    accuracy = float((predictions == y_test).float().mean())
    print(f"Test accuracy: {accuracy:.4f}")

    # Side by side: rounds of parallel and sequential steps on the same batches, the order
    # alternating, the ratio of the medians; training steps (whose backward is sequential on
    # CPU) and inference (forward only).
    batches = list(train.take(args.timing_steps))
    head_device = model.head.weight.device
    for train_step in (True, False):
        speeds: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.timing_rounds):
            for parallel in (True, False) if r % 2 == 0 else (False, True):
                speeds[parallel].append(
                    time_steps(model, optimizer, batches, parallel, head_device, train_step)
                )
        par, seq = statistics.median(speeds[True]), statistics.median(speeds[False])
        print(
            f"{'training' if train_step else 'inference'} steps/s: parallel {par:.2f}, "
            f"sequential {seq:.2f}, ratio {par / seq:.3f} (median of {args.timing_rounds} "
            f"rounds of {args.timing_steps} steps, {torch.get_num_threads()} intra-op threads)"
        )


if __name__ == "__main__":
    main()
