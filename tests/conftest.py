"""Shared test set-up: one torch thread (the machine is shared), seeds, tiny configs and a fake MNIST data root."""

from __future__ import annotations

import os
from pathlib import Path

import pyro
import pytest
import torch

torch.set_num_threads(1)

# the Makefile points PROBCAPS_DATA at ../shared/data when it exists; fall back to that folder directly
REAL_DATA_ROOT = Path(os.environ.get("PROBCAPS_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


def real_mnist_available() -> bool:
    return (REAL_DATA_ROOT / "mnist").is_dir()


requires_real_mnist = pytest.mark.skipif(not real_mnist_available(),
                                         reason=f"real MNIST not present under {REAL_DATA_ROOT}")


@pytest.fixture
def seed():
    """Seed torch and Pyro; returns the seed."""
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    return 0


@pytest.fixture
def pyro_clean():
    """Fresh param store, validation on, module-local params (as the package uses them)."""
    pyro.settings.set(module_local_params=True)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    yield
    pyro.clear_param_store()
    pyro.enable_validation(False)


@pytest.fixture
def fake_mnist_root(tmp_path, monkeypatch):
    """``PROBCAPS_DATA`` pointing at a temporary root holding ``write_fake_mnist`` output (64 train, 32 test).

    The fake files' md5s differ from the official ones: load them with ``verify=False``
    (``placed_mnist(..., verify=False)`` / ``load_mnist(..., verify=False)``); the experiment-level
    ``load_images`` always verifies, so code paths through it must use ``data.dataset = "synthetic"``.
    """
    from probcaps.data import clear_mnist_cache, write_fake_mnist

    root = tmp_path / "data"
    write_fake_mnist(root, n_train=64, n_test=32)
    monkeypatch.setenv("PROBCAPS_DATA", str(root))
    clear_mnist_cache()
    yield root
    clear_mnist_cache()


@pytest.fixture
def no_reexec(monkeypatch):
    """The CLI re-executes itself with allocator settings unless this is set: keep it in-process."""
    monkeypatch.setenv("PROBCAPS_NO_REEXEC", "1")


# Tiny experiment: synthetic digits need a canvas of at least 28 pixels (they are 28x28, pasted unscaled).
TINY_TOML = """
name = "tiny"

[data]
dataset = "synthetic"
canvas_size = 28
max_shift = 0
train_limit = 16
test_limit = 16

[model]
num_parents = 2
num_parts = 3
template_size = 5
canvas_size = 28

[encoder]
channels = [8, 8]
strides = [2, 2]
set_hidden = 16
set_heads = 2
set_inducing = 4
set_blocks = 1
parent_code = 8
head_hidden = 8
part_embedding = 4

[train]
steps = 6
batch_size = 4
lr = 0.003
warmup_steps = 2
log_every = 1
checkpoint_every = 3
seed = 0

[eval]
batch_size = 8
probe_train_limit = 16
probe_max_iter = 50
kmeans_n_init = 1
figures = true
"""


# a 40x40 synthetic capsule model (affNIST-recipe images are 40x40), tiny everywhere else
TINY40 = [
    'data.dataset="synthetic"', "data.canvas_size=40", "data.max_shift=6", "data.train_limit=16", "data.test_limit=16",
    "model.num_parents=2", "model.num_parts=3", "model.template_size=5", "model.canvas_size=40",
    "encoder.channels=[8,8]", "encoder.strides=[2,2]", "encoder.set_hidden=16", "encoder.set_heads=2",
    "encoder.set_inducing=4", "encoder.set_blocks=1", "encoder.parent_code=8", "encoder.head_hidden=8",
    "encoder.part_embedding=4", "train.batch_size=4", "train.log_every=1", "eval.batch_size=8",
    "eval.probe_train_limit=16", "eval.probe_max_iter=50", "eval.kmeans_n_init=1",
]


def train_tiny40(folder: Path, overrides: list[str]) -> Path:
    """``folder/final.pt`` of a capsule model named ``tiny40`` trained from seed 0 with the config ``overrides``."""
    from probcaps.inference.capsule_svi import load_experiment_config, train_capsules

    torch.manual_seed(0)
    cfg = load_experiment_config(None, overrides)
    cfg["name"] = "tiny40"
    train_capsules(cfg, folder, progress=False)
    pyro.clear_param_store()
    return folder / "final.pt"


@pytest.fixture
def tiny_toml(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_TOML)
    return path


#: the tiny capsule model of the guide, test-time VI, likelihood and objective tests: K objects, M parts, T-pixel
#: templates on an S-pixel canvas, and its encoder's sizes
K, M, T, S = 2, 3, 5, 12
TINY_ENCODER = dict(channels=[8, 8], strides=[2, 2], set_hidden=16, set_heads=2, set_inducing=4, set_blocks=1,
                    parent_code=8, head_hidden=8, part_embedding=4)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (tiny models run fastest so, and results do not depend on the machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
