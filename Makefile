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

.PHONY: install demo test gpu bench bench-gpu bench-render bench-vs-torch-scae bench-capsnet bench-matrix-capsules report clean

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

# the convolutions in bfloat16 where the CPU has bfloat16 kernels (BF16 below), else in float32
demo: install
	$(VENV)/bin/probcaps demo --set encoder.bf16=$(BF16)

# lint and import order first (ruff, configured in pyproject.toml), then the suite
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# one training step at batch 128, Pyro vs plain torch, at SCAE's sizes (40 parts, 32 objects) with the encoders of
# the shipped MNIST recipes; rows go to results/speed/bench_step.json (README table). The recommended encoder
# (configs/mnist.toml's): the CNN with a 10x10 feature map, bf16 convolutions where the CPU has bfloat16 kernels
# (BF16 below; elsewhere bfloat16 is emulated and several times slower, and the recipe says to turn it off), the
# object encoder 64 wide. The headline encoder: the same CNN in float32, the object encoder 128 wide (the first full
# run's, results/mnist_probe/mnist_probe.json). Both with compiled compositing and part CNN, as the recipe trains them.
HEADLINE = --config experiments/configs/mnist.toml --set encoder.set_hidden=128 --set encoder.bf16=false
BF16 = $(shell $(PY) -c "import torch; print(str(torch.ops.mkldnn._is_mkldnn_bf16_supported()).lower())" 2>/dev/null || echo false)
RECOMMENDED = --config experiments/configs/mnist.toml --set encoder.bf16=$(BF16)
# OpenMP threads that sleep while they wait instead of spinning: on a machine shared with other jobs a spinning
# thread holds a core another process needs, and a step of many mid-sized kernels then runs several times slower
bench bench-render bench-vs-torch-scae: export OMP_WAIT_POLICY := PASSIVE
bench: install
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, recommended encoder" --compile \
	  $(RECOMMENDED) --json results/speed/bench_step.json
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, recommended encoder, full-canvas rendering" \
	  --compile --full-canvas $(RECOMMENDED) --json results/speed/bench_step.json --append
	$(PY) benchmarks/bench_step.py --threads 2 --label "SCAE sizes, headline encoder" --compile \
	  $(HEADLINE) --json results/speed/bench_step.json --append

# the model's rendering + compositing (forward + backward) at SCAE's sizes with a trained model's part poses:
# footprint windows against the whole canvas (results/speed/bench_render.json)
bench-render: install
	$(PY) benchmarks/bench_render.py --threads 2 --json results/speed/bench_render.json

# one training step at SCAE's sizes against bdsaglam/torch-scae's own model and loss, fresh processes interleaved
# over rounds (results/speed/bench_vs_torch_scae.json). PEER: a checkout of torch-scae outside this repository, e.g.
#   git --git-dir=<mirror> archive HEAD | tar -x -C /tmp/torch-scae
# PEER_SITE: a folder with its imports beyond torch (pip install --no-deps --target /tmp/scae-deps monty pyyaml)
# PEER_COMMIT: the commit checked out, recorded in the results
PEER ?= /tmp/torch-scae
PEER_SITE ?= /tmp/scae-deps
PEER_COMMIT ?= unknown
bench-vs-torch-scae: install
	$(PY) benchmarks/bench_vs_torch_scae.py --peer-path $(PEER) --peer-site $(PEER_SITE) --peer-commit $(PEER_COMMIT) \
	  --json results/speed/bench_vs_torch_scae.json

# on a GPU machine: each model's training step at paper size and a short MNIST training (results/speed/bench_gpu.json)
bench-gpu: install
	$(PY) benchmarks/bench_gpu.py --device cuda

# the one prepared run for a GPU machine, inside GPU_MINUTES (benchmarks/bench_gpu.py): the step benchmarks above,
# torch-scae's step beside ours where a checkout of it is at PEER, then the paper-size CapsNet on MultiMNIST and the
# MNIST recipe for what the budget leaves; every results JSON written is copied to GPU_OUT (the machine's $$OUT).
# `python benchmarks/bench_gpu.py --tiny` runs the same stages at smoke sizes on a CPU.
GPU_MINUTES ?= 9
GPU_OUT ?= $(OUT)
gpu: install
	$(PY) benchmarks/bench_gpu.py --device cuda --budget-minutes $(GPU_MINUTES) \
	  $(if $(wildcard $(PEER)/torch_scae/factory.py),--peer-path $(PEER) --peer-site $(PEER_SITE)) \
	  $(if $(GPU_OUT),--copy-to $(GPU_OUT))

# one CapsNet training step at batch 128, reduced and paper-size configs
bench-capsnet: install
	$(PY) benchmarks/bench_capsnet.py --threads 2 --json results/multimnist/multimnist_bench.json
	$(PY) benchmarks/bench_capsnet.py --threads 2 --configs paper --compare --repeats 7 --append \
		--variant float32 model.bf16=false model.phase_split=false model.bf16_routing=false \
		--variant bf16 model.phase_split=false model.bf16_routing=false \
		--variant "bf16, phase split" model.bf16_routing=false --variant "bf16, phase split, bf16 routing" \
		--json results/multimnist/multimnist_bench.json

# the paper's smallNORB matrix-capsule network (A, B, C, D = 64, 8, 16, 16, 32x32, 3 EM iterations) at batch 64
bench-matrix-capsules: install
	$(PY) benchmarks/bench_matrix_capsules.py --threads 2 --json results/speed/bench_matrix_capsules.json

# the documentation site (docs/conf.py): the pages of docs/, the tutorials and the API reference from the
# docstrings, into build/docs; strict: any warning (a broken link, a missing reference) fails the build
.PHONY: docs
docs: install
	$(PY) -m sphinx -W --keep-going -b html docs build/docs

report: install
	$(VENV)/bin/probcaps report

clean:
	rm -rf runs .pytest_cache
