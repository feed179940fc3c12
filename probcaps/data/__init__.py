"""Data: IDX files, MNIST loading/downloading, digit placement and rotation, deterministic batches."""

from .idx import read_idx, write_idx
from .loaders import (
    PlacedMNIST,
    derive_seed,
    epoch_order,
    iterate_batches,
    num_batches,
    placed_mnist,
    seeded_generator,
    synthetic_digits,
    write_fake_mnist,
)
from .mnist import (
    DATA_ENV_VAR,
    MNIST_FILES,
    MNIST_MIRRORS,
    MNIST_SPLITS,
    clear_mnist_cache,
    download_mnist,
    load_mnist,
    md5_file,
    mnist_dir,
    resolve_data_root,
)
from .transforms import place_on_canvas, random_offsets, rotate, to_float

__all__ = [
    "read_idx",
    "write_idx",
    "MNIST_FILES",
    "MNIST_SPLITS",
    "MNIST_MIRRORS",
    "DATA_ENV_VAR",
    "resolve_data_root",
    "mnist_dir",
    "md5_file",
    "load_mnist",
    "download_mnist",
    "clear_mnist_cache",
    "random_offsets",
    "place_on_canvas",
    "rotate",
    "to_float",
    "PlacedMNIST",
    "placed_mnist",
    "num_batches",
    "epoch_order",
    "iterate_batches",
    "derive_seed",
    "seeded_generator",
    "synthetic_digits",
    "write_fake_mnist",
]
