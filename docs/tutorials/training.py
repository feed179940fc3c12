# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Training at scale
#
# A training run is a config (a TOML recipe and `--set` overrides), a run folder that receives checkpoints and a
# log, and the training loop around the loss of the [generative model tutorial](generative_model.py). From the shell:
#
# ```bash
# probcaps train --config experiments/configs/mnist.toml --out runs/mnist
# ```
#
# This tutorial runs the same steps from Python, for two steps, in a temporary folder: the config, a run, `--resume`,
# TensorBoard, and loading the result; `torchrun` closes it.

# %%
import json
import os
import tempfile
from pathlib import Path

import torch

import probcaps
import probcaps.experiments
from probcaps.inference.capsule_svi import load_experiment_config, train_capsules

# the test suite runs every tutorial in a tiny mode: a tiny model on synthetic digits instead of the MNIST recipe
TINY = os.environ.get("PROBCAPS_TUTORIAL_TINY") == "1"
torch.manual_seed(0)
run_root = Path(tempfile.mkdtemp(prefix="probcaps_tutorial_"))

# %% [markdown]
# ## The config
#
# A recipe is a TOML file with one section per part of the system: `data`, `model` (the generative model),
# `encoder` (the guide), `train` and `eval`. Every key can be overridden as on the command line's `--set`; a key that
# does not exist, or a value out of range, is a one-line `ConfigError`.

# %%
recipe = Path(probcaps.experiments.__file__).parent / "configs" / "mnist.toml"
# torch.compile makes long runs faster but takes a while to compile: off for two steps
overrides = ["train.steps=2", "train.compile=false", "train.log_every=1", "train.checkpoint_every=1"]
if TINY:
    overrides += ['data.dataset="synthetic"', "data.train_limit=16", "data.test_limit=16", "train.batch_size=8",
                  "model.num_parents=2", "model.num_parts=3", "model.template_size=5", "encoder.channels=[8,8]",
                  "encoder.strides=[2,2]", "encoder.set_hidden=16", "encoder.set_heads=2", "encoder.set_inducing=4",
                  "encoder.set_blocks=1", "encoder.parent_code=8", "encoder.head_hidden=8",
                  "encoder.part_embedding=4", "encoder.bf16=false"]
cfg = load_experiment_config(recipe, overrides)
print(cfg["name"])
cfg["train"]

# %% [markdown]
# ## A run
#
# `train_capsules` is what `probcaps train` calls. The run folder gets `checkpoint.pt` (every
# `train.checkpoint_every` steps), `final.pt` at the end, and `log.jsonl`: one JSON record every `train.log_every`
# steps (the loss, the gradient norm, the learning rate, the throughput).

# %%
run = run_root / "mnist"
state = train_capsules(cfg, run, progress=False)
print(f"{state.step} steps in {state.wall_time_s:.1f} s")
print(sorted(p.name for p in run.iterdir()))
for line in (run / "log.jsonl").read_text().splitlines():
    print(json.loads(line))

# %% [markdown]
# ## `--resume`
#
# A run continues exactly where its last checkpoint left it: the model, the optimiser, the RNG states and the
# position in the epoch are all in `checkpoint.pt`, so a run stopped (Ctrl-C and SIGTERM write a checkpoint first)
# and resumed takes the same steps as one run through. Asking for more steps continues a finished run:
#
# ```bash
# probcaps train --config experiments/configs/mnist.toml --out runs/mnist --resume --set train.steps=4
# ```

# %%
longer = load_experiment_config(recipe, [*overrides, "train.steps=4"])
state = train_capsules(longer, run, resume=True, progress=False)
print(f"now at step {state.step}")
print([json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()])

# %% [markdown]
# ## TensorBoard
#
# `--tensorboard` (`tensorboard=True` here) mirrors the log to `OUT/tensorboard`, which TensorBoard reads:
#
# ```bash
# probcaps train --config experiments/configs/mnist.toml --out runs/mnist --tensorboard
# tensorboard --logdir runs/
# ```

# %%
watched = run_root / "watched"
train_capsules(cfg, watched, progress=False, tensorboard=True)
sorted(p.name for p in (watched / "tensorboard").iterdir())

# %% [markdown]
# ## The trained model
#
# A run's `final.pt` loads like a shipped model, by path:

# %%
model = probcaps.load(run / "final.pt")
x, _ = model.load_images("test", limit=4)
print(model)
model.log_likelihood_bound(x, seed=0)

# %% [markdown]
# ## Many processes: `torchrun`
#
# Data-parallel training needs no launcher of the package's own: under `torchrun` every process computes the loss of
# its share of each batch and the update is the one a single process would take on the whole batch; rank 0 alone
# writes the checkpoints and the log (which resume only under the same number of processes). On one machine with two
# GPUs (or two CPU processes):
#
# ```bash
# torchrun --nproc_per_node=2 -m probcaps train --config experiments/configs/mnist.toml --out runs/mnist2 --device cuda
# ```
#
# Evaluation and test-time VI split their batches the same way (`probcaps evaluate`, `probcaps ttvi` under
# `torchrun`).

# %%
import shutil  # noqa: E402

shutil.rmtree(run_root)
