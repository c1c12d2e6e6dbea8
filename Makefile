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

# Two test processes (pytest-xdist), a test file each at a time, dealt longest first (tests/conftest.py LONGEST_FILES,
# not xdist's most-tests-first): each export is built once per run by the first to ask (tests/conftest.py built_once),
# and most of a test's time is one core's (an emulator call, a QNN compile).
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -n 2 --dist loadfile --no-loadscope-reorder

test-all: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
