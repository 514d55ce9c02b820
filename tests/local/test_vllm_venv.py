"""A machine that cannot build vLLM's venv (no Python 3.11, no package index) says so as
``VLLMCannotInstall``, which the ``vllm`` fixture turns into a skip with the reason; the
server failing on a venv that exists stays an error."""

from __future__ import annotations

import pytest

from streamrl.local.vllm import _STAMP, VLLMCannotInstall, VLLMUnavailable, vllm_venv


def test_a_base_python_that_cannot_make_a_venv_is_cannot_install(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMRL_VLLM_BASE_PYTHON", "/bin/false")  # `-m venv` exits 1
    log = tmp_path / "venv.log"
    with pytest.raises(VLLMCannotInstall, match=r"creating the vLLM venv failed at `/bin/false"):
        vllm_venv(tmp_path / "venv", log=log)
    assert not (tmp_path / "venv" / _STAMP).exists()  # nothing marked as installed
    assert issubclass(VLLMCannotInstall, VLLMUnavailable)  # callers catching the wider error
