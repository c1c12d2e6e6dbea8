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

# Two test processes (pytest-xdist), a file at a time each, dealt in the order tests/conftest.py sorts them (the
# longest first, not xdist's most-tests-first); exports both need are built once per run (tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -n 2 --dist loadfile --no-loadscope-reorder

test-all: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
