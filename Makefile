# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch first, pinned: a plain `pip install pyro-ppl` would pull the newest torch with gigabytes of CUDA packages.
TORCH ?= torch==2.13.0
SHARED_DATA := $(abspath ../shared/data)
export PROBCAPS_DATA ?= $(if $(wildcard $(SHARED_DATA)/mnist),$(SHARED_DATA),)
export MALLOC_MMAP_THRESHOLD_ := 1000000000
export MALLOC_TRIM_THRESHOLD_ := 1000000000

.PHONY: install demo test bench report clean

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/probcaps demo

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/bench_step.py

report: install
	$(VENV)/bin/probcaps report

clean:
	rm -rf runs .pytest_cache
