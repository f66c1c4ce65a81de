# Everyday targets. `make demo` and `make test` set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DATA   ?= data/stdlib
NPROC  ?= 2

.PHONY: setup demo test test-fast lint format bench clean

setup: $(STAMP)

# Every install goes through constraints.txt, which pins torch to the local CPU build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip -c constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tessera data prepare --source stdlib --out $(DATA) --if-missing
	$(VENV)/bin/tessera train --preset demo --nproc $(NPROC) --data $(DATA) --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks
	$(PY) -m ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
