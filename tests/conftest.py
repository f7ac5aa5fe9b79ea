from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


@pytest.fixture
def tiny_manifest() -> dict:
    """examples/tiny-cpu.yaml as a dict, for tests that derive variants of it."""
    return yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
