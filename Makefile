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

.PHONY: install demo test bench bench-capsnet bench-matrix-capsules report clean

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

# one training step at batch 128, Pyro vs plain torch, at SCAE's sizes (40 parts, 32 objects) with the headline
# config's encoder and the light encoder, eager and with compiled compositing; rows go to results/bench_step.json
# (README table). The light encoder: SCAE's object-encoder width (16, one head) and a lighter, coarser CNN (README: what it costs)
LIGHT_ENCODER = --set "encoder.channels=[64,128,128]" --set "encoder.strides=[2,2,2]" --set encoder.part_features=0 \
  --set encoder.set_hidden=16 --set encoder.set_heads=1
# the pilot encoder: the same CNN with the headline's object encoder at half width (README "Known gaps": its
# 1000-step pilot at the headline's sizes)
# the fast encoder (configs/mnist.toml's): the headline's CNN (10x10 feature map) with bf16 convolutions and the
# object encoder at half width (64, four heads); the headline encoder: the same CNN in float32 with the object
# encoder 128 wide (the first full run's, results/mnist_probe.json)
HEADLINE = --config experiments/configs/mnist.toml --set encoder.set_hidden=128 --set encoder.bf16=false
PILOT_ENCODER = --set "encoder.channels=[64,128,128]" --set "encoder.strides=[2,2,2]" --set encoder.part_features=0 \
  --set encoder.set_hidden=64
bench: install
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, headline encoder" \
	  $(HEADLINE) --json results/bench_step.json
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, headline encoder" --compile \
	  $(HEADLINE) --json results/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, headline encoder, bf16 convolutions" --compile \
	  $(HEADLINE) --set encoder.bf16=true --json results/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, light encoder" $(LIGHT_ENCODER) \
	  --json results/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, light encoder" $(LIGHT_ENCODER) --compile \
	  --json results/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, light encoder, bf16 convolutions" $(LIGHT_ENCODER) \
	  --compile --set encoder.bf16=true --json results/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, pilot encoder" $(PILOT_ENCODER) \
	  --json results/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, pilot encoder" $(PILOT_ENCODER) --compile \
	  --json results/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, fast encoder" --compile \
	  --config experiments/configs/mnist.toml --json results/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "headline config" --parts 24 --parents 16 \
	  $(HEADLINE) --json results/bench_step.json --append

# one CapsNet training step at batch 128, reduced and paper-size configs
bench-capsnet: install
	$(PY) benchmarks/bench_capsnet.py --threads 2 --json results/multimnist_bench.json

# the paper's smallNORB matrix-capsule network (A, B, C, D = 64, 8, 16, 16, 32x32, 3 EM iterations) at batch 64
bench-matrix-capsules: install
	$(PY) benchmarks/bench_matrix_capsules.py --threads 2 --json results/bench_matrix_capsules.json

report: install
	$(VENV)/bin/probcaps report

clean:
	rm -rf runs .pytest_cache
