# Everyday targets. `make demo` and `make test` set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DATA   ?= data/stdlib
# The main job's layout: tensor parallel 2 inside pipeline parallel 2 (1F1B, 4 micro-batches),
# 4 ranks; the global batch (32 sequences of 128 bytes) is the demo preset's.
DEMO_LAYOUT ?= --nproc 4 --dp 1 --tp 2 --pp 2 --schedule 1f1b --microbatches 4 --micro-batch-size 8

.PHONY: setup demo test test-fast test-timing test-kernels lint format bench clean

setup: $(STAMP)

# Every install goes through constraints.txt, which pins torch to the local CPU build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip -c constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tessera data prepare --source stdlib --out $(DATA) --if-missing
	$(VENV)/bin/tessera train --preset demo $(DEMO_LAYOUT) --data $(DATA) --out runs/demo

# Every test but those marked `timing`: no assertion of `make test` reads a stopwatch, so it
# passes on a busy machine (benchmarks/busy_suite.sh runs it beside busy loops).
test: $(STAMP)
	$(PY) -m pytest -q -m "not timing"

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not timing"

# The tests whose assertions are windows of measured seconds (calibrate's measurements on
# the real clock, the 1T search's CPU seconds): each has a counterpart in `make test` that
# checks the same logic on a fake clock or a count. A busy machine moves them; .ci/run
# reports their failures without failing.
test-timing: $(STAMP)
	$(PY) -m pytest -q -m timing

# The multi-process tests again under another CPU kernel set than this machine's: their
# tolerances must not hold on one set of kernels only. Not the timing tests (make
# test-timing): their windows are in seconds, which a kernel set only moves; their
# fake-clock counterparts run here. ATEN_CPU_CAPABILITY=default on an AVX2 or AVX-512
# machine, avx2 where the native set is default; KERNELS=... picks one.
CAPABILITY := import torch; print(torch.backends.cpu.get_cpu_capability().lower())
test-kernels: $(STAMP)
	@native=$$($(PY) -c "$(CAPABILITY)"); kernels="$(KERNELS)"; \
	if [ -z "$$kernels" ]; then \
	  if [ "$$native" = default ]; then kernels=avx2; else kernels=default; fi; fi; \
	got=$$(ATEN_CPU_CAPABILITY=$$kernels $(PY) -c "$(CAPABILITY)"); \
	if [ "$$got" = "$$native" ]; then \
	  echo "test-kernels: ATEN_CPU_CAPABILITY=$$kernels runs the native $$native kernels here; skipped"; \
	  exit 0; fi; \
	echo "test-kernels: multi-process tests with ATEN_CPU_CAPABILITY=$$kernels (native: $$native)"; \
	ATEN_CPU_CAPABILITY=$$kernels $(PY) -m pytest -q -m "multiprocess and not timing"

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks
	$(PY) -m ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
