"""The printed table of a plan: every candidate, its memory, bytes per step, and the verdict."""

from __future__ import annotations

from collections.abc import Sequence

from stratagem.distribute.planner.candidates import Candidate, ClusterShape


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def format_plan(found: Sequence[Candidate], chosen: Candidate, cluster: ClusterShape) -> str:
    """A fixed-width table, one row per candidate, the chosen one marked ``*``; MiB per device."""
    budget = (
        "no memory limit"
        if cluster.memory_per_device is None
        else f"{_mib(cluster.memory_per_device)} MiB per device"
    )
    head = (
        f"Plan for {cluster.world} devices ({cluster.hosts} host(s) x "
        f"{cluster.devices_per_host}), {budget}; MiB per device, sent per step:"
    )
    columns = (
        "",
        "candidate",
        "params",
        "grads",
        "optim",
        "activ",
        "gathered",
        "buffers",
        "peak",
        "sent",
        "verdict",
    )
    rows = []
    for c in found:
        m = c.memory
        verdict = c.reason
        if c is chosen:
            verdict = "chosen: fits, sends least" if c.fits else f"closest: {c.reason}"
        if c is not chosen and c.fits:
            verdict = f"fits; sends {c.bytes_per_step / max(chosen.bytes_per_step, 1):.2f}x"
        rows.append(
            (
                "*" if c is chosen else "",
                c.name,
                _mib(m.params),
                _mib(m.grads),
                _mib(m.optimizer),
                _mib(m.activations),
                _mib(m.gathered),
                _mib(m.buffers),
                _mib(m.peak),
                _mib(c.bytes_per_step),
                verdict,
            )
        )
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        # names left-aligned, figures right-aligned, the verdict last as it comes
        text = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        text += [cell.rjust(w) for cell, w in zip(cells[2:-1], widths[2:-1], strict=True)]
        return "  ".join([*text, cells[-1]]).rstrip()

    return "\n".join([head, line(columns), *(line(r) for r in rows)])
