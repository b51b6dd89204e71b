"""A GPU per trial: the machine's GPUs divided between parallel trials.

The book chapter's advice for tuning on one machine: run one trial per GPU, each seeing only
its own through ``CUDA_VISIBLE_DEVICES`` (with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so the numbers
are nvidia-smi's). ``devices_per_trial=k`` cuts the visible GPUs into groups of ``k``; each
running trial holds one group, and a trial that ends hands its group to the next one.
"""

from __future__ import annotations

from collections.abc import Mapping

from stratagem.cluster import launcher
from stratagem.cluster.slurm import count_gpus
from stratagem.tune.errors import TuningConfigError


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this process may hand out: ``CUDA_VISIBLE_DEVICES``'s entries when it is set
    (IDs or UUIDs, as CUDA takes them), else ``0..n-1`` for nvidia-smi's n GPUs."""
    text = environ.get("CUDA_VISIBLE_DEVICES")
    if text is not None:
        return [item.strip() for item in text.split(",") if item.strip()]
    return [str(i) for i in range(count_gpus(environ))]


def device_groups(
    environ: Mapping[str, str], devices_per_trial: int, parallel_trials: int
) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` values, one per trial that may run at once."""
    gpus = visible_gpus(environ)
    groups = [
        ",".join(gpus[i : i + devices_per_trial])
        for i in range(0, len(gpus) - devices_per_trial + 1, devices_per_trial)
    ]
    if len(groups) < parallel_trials:
        source = (
            f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
            if "CUDA_VISIBLE_DEVICES" in environ
            else "nvidia-smi"
        )
        raise TuningConfigError(
            f"{parallel_trials} parallel trial(s) x devices_per_trial={devices_per_trial} need "
            f"{launcher.plural(parallel_trials * devices_per_trial, 'GPU')}; this machine has "
            f"{len(gpus)} "
            f"({source}). Lower parallel_trial_count or devices_per_trial"
        )
    return groups
