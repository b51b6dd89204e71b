"""The planner's predicted peak per process against the measured peak of live tensor bytes.

For Hugging Face models built from configs (tens of MB of parameters; nothing downloaded)
and the models our examples train (``examples/``: at their own batches), under
MultiWorkerMirroredStrategy and FSDP ZeRO-3 on 2 CPU processes, each process trains Adam steps
(``tests/workers/planner_memory.py``) and reads its peak of live tensor bytes from torch's
profiler memory events. Prints one row per (model, strategy): predicted, measured (the larger
of the two processes; the median of ``--runs`` jobs), predicted/measured. The figures of
torch 2.13 on gloo are in ``docs/guides/planner.md`` (every row within 0.96-1.01).

    .venv/bin/python benchmarks/planner_memory.py --runs 3 [--models hf|examples|NAME ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cluster_utils import WORKERS, run_cluster

MODELS = {
    "gpt2": ["n_embd=384", "n_layer=4", "n_head=4"],
    "gpt2-untied": ["n_embd=384", "n_layer=4", "n_head=4", "tie_word_embeddings=false"],
    "bert": ["hidden_size=384", "num_hidden_layers=4", "num_attention_heads=4"],
    "llama": [
        "hidden_size=384",
        "intermediate_size=1024",
        "num_hidden_layers=4",
        "num_attention_heads=4",
        "num_key_value_heads=4",
    ],
    "t5": ["d_model=384", "d_ff=1024", "num_layers=2", "num_heads=4", "d_kv=96"],
    "resnet": ["embedding_size=64", "hidden_sizes=[128,256,512,1024]", "depths=[1,1,1,1]"],
}
# The models our examples train, at the examples' own sizes and batches (the worker's EXAMPLES).
EXAMPLES = ["mnist_cnn", "keras_cnn", "custom_cnn", "keras3_mlp", "ps_mlp", "sharded_mlp"]
MODELS.update({name: [] for name in EXAMPLES})
GROUPS = {"hf": [m for m in MODELS if m not in EXAMPLES], "examples": EXAMPLES, "all": list(MODELS)}


def one_job(name: str, kind: str, sizes: list[str]) -> tuple[int, int]:
    """(predicted, measured) bytes of one 2-process job: the larger of its processes' peaks."""
    with tempfile.TemporaryDirectory() as d:
        args = [name.split("-")[0], kind, d, *sizes]
        results = run_cluster(WORKERS / "planner_memory.py", 2, Path(d), args=args, timeout=600)
        for r in results:
            if r.returncode:
                raise SystemExit(f"{name} {kind} failed:\n{r.stderr[-3000:]}")
        rows = [json.loads(p.read_text()) for p in sorted(Path(d).glob("*.json"))]
    return rows[0]["predicted"], max(r["measured"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="jobs per row (the median is shown)")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=[*GROUPS, *MODELS],
        default=["all"],
        help="models, or groups of them: hf (the Hugging Face configs), examples, all",
    )
    args = parser.parse_args()
    runs = args.runs
    names = [m for a in args.models for m in GROUPS.get(a, [a])]
    print(f"{'model':<12} {'strategy':<9} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6}")
    for name in dict.fromkeys(names):
        sizes = MODELS[name]
        for kind in ("mirrored", "zero3"):
            jobs = [one_job(name, kind, sizes) for _ in range(runs)]
            predicted = jobs[0][0]
            measured = statistics.median(m for _, m in jobs)
            print(
                f"{name:<12} {kind:<9} {predicted / 2**20:>14.2f} {measured / 2**20:>13.2f} "
                f"{predicted / measured:>6.2f}"
            )


if __name__ == "__main__":
    main()
