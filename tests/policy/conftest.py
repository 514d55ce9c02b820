"""Fixtures for the policy backends: the tiny model written to disk once per session."""

from __future__ import annotations

import pytest

from streamrl.models.tiny import save_tiny
from streamrl.schema import Message, Task


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def _copy_task(task_id: str, words: str = "a b c") -> Task:
    prompt_id, _, k = task_id.partition(":")
    return Task(
        task_id=task_id,
        prompt_id=prompt_id,
        k=int(k or 0),
        group_size=4,
        env="copy",
        input=[Message(role="user", content=f"copy : {words}")],
    )


@pytest.fixture
def copy_task():
    """Factory: a ``copy`` task whose prompt is ``copy : <words>``."""
    return _copy_task
