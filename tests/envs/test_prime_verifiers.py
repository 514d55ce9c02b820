"""The ``verifiers`` environment's options, refused where they enter, and what it says where
PyPI ``verifiers`` is not installed (the project's venv: it pins openai < 3). The environment
itself, through real workers against a taskset verifiers ships: tests/test_verifiers_pypi.py."""

from __future__ import annotations

import importlib.util
import random

import pytest

from streamrl.envs.base import OptionError
from streamrl.envs.registry import make_env


def test_options_are_checked_where_they_enter():
    with pytest.raises(OptionError, match="needs a taskset id"):
        make_env("verifiers")
    with pytest.raises(OptionError, match="policy_endpoint"):
        make_env("verifiers", taskset="nemo_gym", policy_endpoint="nowhere")
    with pytest.raises(OptionError, match="no option 'harnes'"):
        make_env("verifiers", taskset="nemo_gym", harnes="null")
    env = make_env("verifiers", taskset="nemo_gym", policy_endpoint="127.0.0.1:8300")
    assert env.serves_episodes and env.endpoint_address == ("127.0.0.1", 8300)
    assert env.verifier_id == ("verifiers", "nemo_gym/1")


@pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is not None, reason="verifiers is installed here"
)
def test_without_verifiers_it_says_what_to_install():
    env = make_env("verifiers", taskset="nemo_gym")
    with pytest.raises(OptionError, match=r"pip install 'verifiers==0\.4\.0'"):
        env.generate(random.Random(0), 0)
