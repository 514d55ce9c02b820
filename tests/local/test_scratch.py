"""Where a throwaway run's directory goes: in memory for the demo, unless TMPDIR says else."""

from __future__ import annotations

import os

import pytest

from streamrl.config import load_toml
from streamrl.local import pipeline
from streamrl.local.demo import DEMO_CONFIG
from streamrl.local.pipeline import LocalPipeline, memory_scratch


def test_the_temporary_directory_goes_where_scratch_says_and_is_removed(tmp_path):
    p = LocalPipeline(load_toml(DEMO_CONFIG), scratch=tmp_path)
    assert p.dir.parent == tmp_path and p.dir.is_dir()
    p.__exit__(None, None, None)  # as `with` leaves it (Redis never started)
    assert not p.dir.exists()


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm here")
def test_memory_scratch_is_dev_shm_unless_tmpdir_is_set_or_it_is_short_of_room(monkeypatch):
    monkeypatch.delenv("TMPDIR", raising=False)
    assert memory_scratch() == "/dev/shm"
    st = os.statvfs("/dev/shm")
    assert memory_scratch(min_free=st.f_blocks * st.f_frsize + 1) is None  # more than it holds
    monkeypatch.setenv("TMPDIR", "/var/tmp")
    assert memory_scratch() is None  # the user's choice stands


def test_no_memory_filesystem_means_tempfiles_default(monkeypatch, tmp_path):
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.setattr(pipeline, "_MEMORY_FS", str(tmp_path / "absent"))
    assert memory_scratch() is None
