"""Test-wide fixtures: no inherited cluster variables."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_utils import CLUSTER_VARS

# Every coordinator a test starts (its jobs inherit this) describes each function again where
# it kept the last description, and fails if the two differ (shipping.KeptDescriptions).
os.environ["STRATAGEM_CHECK_KEPT_DESCRIPTIONS"] = "1"


@pytest.fixture(autouse=True)
def _no_cluster_environment(monkeypatch):
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
