"""Helpers shared by the tests: servers, venvs and clients that a test starts by PID."""

import os

# The device the hf backend's tests sample on: ``cpu`` here; a GPU run sets
# ``STREAMRL_TEST_DEVICE=cuda`` (the learner's tests follow ``device = "auto"`` already).
TEST_DEVICE = os.environ.get("STREAMRL_TEST_DEVICE", "cpu")
