"""Test-wide fixtures: no inherited cluster variables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_utils import CLUSTER_VARS


@pytest.fixture(autouse=True)
def _no_cluster_environment(monkeypatch):
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
