# The two commands of the README. Everything runs in .venv, created on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and pinned, so that the package's range installs nothing more;
# override for another build, e.g. `make TORCH=torch==2.9.1 test`.
TORCH ?= torch==2.13.0
# The fast tier leaves out what spawns processes, kills them, trains end to end, and the lab's own tests.
FAST := not multiprocess and not crash and not e2e and not slow and not lab
# Two pytest-xdist workers (a file's tests stay on one worker); `make test XDIST=` runs in one process.
XDIST ?= -n 2 --dist loadfile

.PHONY: demo test test-fast typecheck install clean

$(BIN)/dplightning: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,hf,plots]"
	touch $@

install: $(BIN)/dplightning

demo: install
	$(BIN)/dplightning fit --config configs/quickstart.yaml

# The whole suite, after the type check (CI runs this); prints the 25 slowest tests.
test: typecheck
	$(BIN)/python -m pytest $(XDIST) --durations=25

# A few minutes: every test but the multi-process, crash and end-to-end ones.
test-fast: install
	$(BIN)/python -m pytest $(XDIST) -m "$(FAST)" --durations=25

# mypy on privacy/, strategies/, optim/ and protocols.py (configured in pyproject.toml).
typecheck: install
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache .mypy_cache
