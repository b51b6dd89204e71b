"""Test-wide fixtures: no inherited cluster variables, no leftover process group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

_CLUSTER_VARS = (
    "TF_CONFIG",
    "STRATAGEM_CONFIG",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_STEP_ID",
)


@pytest.fixture(autouse=True)
def _no_cluster_environment(monkeypatch):
    for name in _CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    from stratagem.comm import runtime

    runtime.set_current_communicator(None)
