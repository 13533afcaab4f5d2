# The two commands of the README. Everything runs in .venv, created on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and pinned, so that the package's range installs nothing more;
# override for another build, e.g. `make TORCH=torch==2.9.1 test`.
TORCH ?= torch==2.13.0

.PHONY: demo test install clean

$(BIN)/dplightning: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(BIN)/dplightning

demo: install
	$(BIN)/dplightning fit --config configs/quickstart.yaml

test: install
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
