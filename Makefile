# Quick start: `make quickstart` trains Graphormer+URPE on ZINC-12k; `make test` runs the tests.
# Both create the virtual environment first when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch (the quick start and tests need no GPU); an unpinned torch pulls several
# GB of CUDA wheels.
TORCH_PIN := torch==2.13.0
NUMPY_PIN := numpy>=1.26,<2.5
STAMP := $(VENV)/.installed

.PHONY: quickstart test env clean

env: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard cython_ext/*.pyx)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip>=23"
	$(BIN)/pip install -q "$(TORCH_PIN)" "$(NUMPY_PIN)"
	$(BIN)/pip install -q -e ".[test,fused,hpopt]"
	touch $@

quickstart: $(STAMP)
	$(BIN)/python scripts/quickstart.py

# Two test processes (pytest-xdist), whole files each, so module fixtures are built once.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf build graphormer_urpe/data/*.so cython_ext/*.c
