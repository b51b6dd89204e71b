"""Per-process parameter memory with Linear weights sharded over ``model=2``, vs replicated.

Two processes form a ``(batch=1, model=2)`` mesh. The same MLP is built twice under a
LayoutMap: once replicated (an empty map), once tensor-parallel (``fc1`` column-wise, ``fc2``
row-wise, as examples/dtensor_layouts.py does). Each process then counts the bytes of the tensor
storage it actually holds — parameters, and parameters plus Adam's state after one step — and
the figure is sharded / replicated, the larger over the two processes.

    python benchmarks/dtensor_memory.py              # starts its 2 processes itself
    python benchmarks/dtensor_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def build_mlp(sizes: tuple[int, int, int]) -> torch.nn.Module:
    torch.manual_seed(0)
    d_in, hidden, d_out = sizes
    return torch.nn.Sequential(
        collections.OrderedDict(
            fc1=torch.nn.Linear(d_in, hidden),
            act=torch.nn.ReLU(),
            fc2=torch.nn.Linear(hidden, d_out),
        )
    )


def held_bytes(tensors) -> int:
    """Bytes of the storage behind each tensor's local part, each storage counted once."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(mesh, sizes: tuple[int, int, int] = (784, 4096, 10)) -> dict[str, int]:
    """Bytes this process holds for the replicated and the tensor-parallel MLP."""
    from stratagem import dtensor

    U = dtensor.UNSHARDED
    tensor_parallel = dtensor.LayoutMap(mesh)
    tensor_parallel["fc1.weight"] = dtensor.Layout(["model", U], mesh)
    tensor_parallel["fc1.bias"] = dtensor.Layout(["model"], mesh)
    tensor_parallel["fc2.weight"] = dtensor.Layout([U, "model"], mesh)
    out: dict[str, int] = {}
    x = dtensor.copy_to_mesh(
        torch.randn(8, sizes[0]), dtensor.Layout.batch_sharded(mesh, "batch", 2)
    )
    for name, layout_map in (("replicated", dtensor.LayoutMap(mesh)), ("sharded", tensor_parallel)):
        with layout_map.scope():
            model = build_mlp(sizes)
        params = list(model.parameters())
        out[f"{name}_parameter_bytes"] = held_bytes(params)
        optimizer = torch.optim.Adam(params, lr=1e-3)
        model(x).sum().backward()
        optimizer.step()
        state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
        out[f"{name}_parameter_and_adam_bytes"] = held_bytes(params + state)
    return out


def worker(json_path: str) -> None:
    from stratagem import dtensor

    mesh = dtensor.create_mesh([("batch", 1), ("model", 2)])
    result = measure(mesh)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, result)
    if torch.distributed.get_rank() == 0:
        rows = {
            "parameters": max(
                r["sharded_parameter_bytes"] / r["replicated_parameter_bytes"] for r in everyone
            ),
            "parameters + Adam state": max(
                r["sharded_parameter_and_adam_bytes"] / r["replicated_parameter_and_adam_bytes"]
                for r in everyone
            ),
        }
        print("| per process | replicated bytes | sharded bytes | sharded / replicated |")
        print("| --- | --- | --- | --- |")
        r = everyone[0]
        print(
            f"| parameters | {r['replicated_parameter_bytes']} | "
            f"{r['sharded_parameter_bytes']} | {rows['parameters']:.3f} |"
        )
        print(
            f"| parameters + Adam state | {r['replicated_parameter_and_adam_bytes']} | "
            f"{r['sharded_parameter_and_adam_bytes']} | {rows['parameters + Adam state']:.3f} |"
        )
        if json_path:
            Path(json_path).write_text(
                json.dumps({"processes": everyone, "ratios": rows}, indent=1)
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="", help="write the figures here as JSON")
    args = parser.parse_args()
    if os.environ.get("TF_CONFIG") or os.environ.get("WORLD_SIZE"):
        worker(args.json)
        return
    # Started plainly: run this file as a 2-process job through stratagem's launcher.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import clean_env

    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.run(argv, env=clean_env({}), timeout=600).returncode)


if __name__ == "__main__":
    main()
