# Every target creates .venv on first use (a fresh machine needs only python3.11 and make).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

# torch is pinned to the CPU build in pyproject.toml; pip never pulls a CUDA build with that pin.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[export,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# One test process for now. `-n 2 --dist loadfile` (pytest-xdist, installed) runs two, each export built once per run
# (tests/conftest.py built_once); it is not yet measured alone on a fresh clone.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
