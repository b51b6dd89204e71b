"""The fault matrix: kill -9 and SIGSTOP of each task of a 2-task job, under each strategy whose
tasks run collectives together (MultiWorkerMirrored, a DTensor mesh under strategy.run and in
the script's own loop, a 2-stage pipeline).

For each cell: whether the survivor's report names the fault as expected (``PeerLostError``
for a killed task, ``CollectiveTimeoutError`` for a stopped one), names the victim and the
operation, in one block; whether anything hung; and the seconds from the signal to the report.
The operation timeout is 5 s, so a stopped peer's report is due by 5 s + the liveness probe
(1.5 s) after the survivor's operation began; a killed peer's at once.

Worker 0 is the chief and hosts the rendezvous store; worker 1 is an ordinary task (a mesh
process; the pipeline's second stage). Parameter servers are measured by their own tests.

    python benchmarks/fault_matrix.py              # 16 cells, about 4 minutes on 2 cores
    python benchmarks/fault_matrix.py --quick      # 2 cells
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fault_injection import EXPECTED, inject

STRATEGIES = ("mwms", "mesh", "mesh_loop", "pipeline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two cells: a smoke run")
    parser.add_argument("--runs", type=int, default=1, help="repeat each cell (median seconds)")
    args = parser.parse_args()
    cells = [(s, f, v) for s in STRATEGIES for f in ("kill", "stop") for v in (0, 1)]
    if args.quick:
        cells = [("mwms", "kill", 1), ("mesh", "stop", 0)]
    rows = []
    for strategy, fault, victim in cells:
        seconds, named, hung = [], True, False
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    outcome = inject(strategy, fault, victim, Path(tmp))
                except AssertionError as e:  # a process that did not report or end in time
                    print(f"  {strategy} {fault} worker {victim}: {e}", flush=True)
                    hung = True
                    continue
            report = "\n" + outcome.survivor.stderr
            named = named and (
                f"\nstratagem: {EXPECTED[fault]} on " in report
                and outcome.victim_name in report
                and "Traceback" not in report
                and (outcome.victim is None or outcome.victim.returncode != 0)
            )
            seconds.append(outcome.seconds_to_error)
        row = {
            "strategy": strategy,
            "fault": fault,
            "victim": f"worker {victim}",
            "named": named and not hung,
            "hung": hung,
            "seconds": round(statistics.median(seconds), 2) if seconds else None,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    named = sum(r["named"] for r in rows)
    hung = sum(r["hung"] for r in rows)
    print(f"faults injected: {len(rows)}, named: {named}, hung: {hung}")
    for fault, label in (("kill", "kill -9"), ("stop", "SIGSTOP")):
        times = [r["seconds"] for r in rows if r["fault"] == fault and r["seconds"] is not None]
        if times:
            print(f"{label}: report after {min(times):.2f} to {max(times):.2f} s")


if __name__ == "__main__":
    main()
