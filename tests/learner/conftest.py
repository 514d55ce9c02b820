"""Fixtures for learner tests: the tiny model on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.models.tiny import save_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")
