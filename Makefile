# The two commands a newcomer needs:  `make demo`  and  `make test`.
# Both create .venv on first use (torch pinned to the CPU build this project is tested with).
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test bench lint bytecode

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "torch==2.13.0" -e ".[train,dev]"
	touch $(STAMP)

# streamrl is installed editable, so pip compiled none of its modules; where the environment
# sets PYTHONDONTWRITEBYTECODE (these machines do), every process that imports them compiled
# them again (~0.35 s each). compileall writes what is missing or stale, and is quick after.
bytecode: $(STAMP)
	$(VENV)/bin/python -m compileall -q streamrl tests bench

demo: bytecode
	$(VENV)/bin/streamrl demo

# two workers: most tests wait on processes they start (Redis, rq workers, a learner), so
# two at once fit a 2-core machine; the vLLM tests stay together on one (tests/conftest.py)
TEST_WORKERS ?= 2
test: bytecode
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

bench: $(STAMP)
	$(VENV)/bin/streamrl bench pipeline --tasks 4000 --group-size 4 --json
	$(VENV)/bin/streamrl bench pipeline --tasks 4000 --group-size 4 --turns 3 --json

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
