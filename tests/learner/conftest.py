"""Fixtures for learner tests: the tiny model on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.models.tiny import save_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(autouse=True)
def _threads():
    """run_learner sets torch's thread count ([learner] torch_threads): put it back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
