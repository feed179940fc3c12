"""MNIST: where the files live, loading them (checked), and downloading them.

The four official gzip IDX files live in ``<data root>/mnist/``.  The data root is, in order: the
``data_dir`` argument (the CLI's ``--data-dir``), the environment variable ``PROBCAPS_DATA``, or
``$XDG_CACHE_HOME/probcaps`` (default ``~/.cache/probcaps``).  Data is never stored in the repository.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..io import atomic_write
from .idx import read_idx

__all__ = ["MNIST_FILES", "MNIST_SPLITS", "MNIST_MIRRORS", "DATA_ENV_VAR", "resolve_data_root", "user_cache_dir",
           "mnist_dir", "md5_file", "load_mnist", "download_mnist", "download_checked", "clear_mnist_cache"]

DATA_ENV_VAR = "PROBCAPS_DATA"

# The official files: name -> (size in bytes, md5).  Sizes and md5s from the published MNIST files.
MNIST_FILES: dict[str, tuple[int, str]] = {
    "train-images-idx3-ubyte.gz": (9912422, "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "train-labels-idx1-ubyte.gz": (28881, "d53e105ee54ea40749a09fcbcd1e9432"),
    "t10k-images-idx3-ubyte.gz": (1648877, "9fb629c4189551a2d022fa330f9573f3"),
    "t10k-labels-idx1-ubyte.gz": (4542, "ec29112dd5afa0611ce80d1b7f02629c"),
}

# split -> (images file, labels file, number of examples)
MNIST_SPLITS: dict[str, tuple[str, str, int]] = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 60000),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 10000),
}

MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")

_HOW_TO_FIX = (f"pass --data-dir DIR (the folder holding mnist/), set {DATA_ENV_VAR}=DIR, "
               f"or run `probcaps download` to fetch the files")

# In-process caches of decoded arrays and md5s, keyed by (resolved path, size, mtime_ns) so a rewritten file is re-read.
_ARRAY_CACHE: dict[tuple, np.ndarray] = {}
_MD5_CACHE: dict[tuple, str] = {}


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/probcaps`` (``~/.cache/probcaps`` when unset or empty): the default data root, and where
    generated data sets are cached."""
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache") / "probcaps"


def resolve_data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The data root: ``data_dir`` if given, else ``$PROBCAPS_DATA``, else :func:`user_cache_dir`."""
    root = str(data_dir or "") or os.environ.get(DATA_ENV_VAR)
    return Path(root).expanduser() if root else user_cache_dir()


def mnist_dir(root: str | os.PathLike) -> Path:
    """``root/"mnist"``: the folder holding the four IDX files."""
    return Path(root) / "mnist"


def md5_file(path: str | os.PathLike) -> str:
    """Hex md5 of a file, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def _load_file(path: Path, ndim: int, verify: bool) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path}: MNIST file not found; {_HOW_TO_FIX}")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if verify:
        if key not in _MD5_CACHE:
            _MD5_CACHE[key] = md5_file(path)
        expected, found = MNIST_FILES[path.name][1], _MD5_CACHE[key]
        if found != expected:
            raise DataError(f"{path}: md5 mismatch: expected {expected}, found {found} (corrupt or not the official "
                            f"file; delete it and run `probcaps download`, or load with verify=False for test files)")
    if key not in _ARRAY_CACHE:
        _ARRAY_CACHE[key] = read_idx(path, ndim=ndim)
    return _ARRAY_CACHE[key]


def clear_mnist_cache() -> None:
    """Forget the decoded arrays and md5s cached by :func:`load_mnist`."""
    _ARRAY_CACHE.clear()
    _MD5_CACHE.clear()


def load_mnist(split: str, data_dir: str | os.PathLike | None = None,
               verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the ``"train"`` (60000 examples) or ``"test"`` (10000) split from ``<data root>/mnist`` (the root
    resolved from ``data_dir`` by :func:`resolve_data_root`): ``images`` uint8 ``(N, 28, 28)`` and ``labels`` int64
    ``(N,)``, fresh tensors (safe to modify).  ``verify`` checks each file's md5 against :data:`MNIST_FILES` (files
    written by :func:`probcaps.data.write_fake_mnist` need ``verify=False``).  A DataError for a missing folder or
    file, an md5 mismatch, a malformed IDX file, or a label/image count mismatch."""
    if split not in MNIST_SPLITS:
        raise ValueError(f"load_mnist: split must be one of {sorted(MNIST_SPLITS)}, got {split!r}")
    folder = mnist_dir(resolve_data_root(data_dir))
    if not folder.is_dir():
        raise DataError(f"{folder}: MNIST folder not found; {_HOW_TO_FIX}")
    images_name, labels_name, _ = MNIST_SPLITS[split]
    images = _load_file(folder / images_name, ndim=3, verify=verify)
    labels = _load_file(folder / labels_name, ndim=1, verify=verify)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{folder / images_name}: expected 28x28 images, found {images.shape[1]}x{images.shape[2]}")
    if labels.shape[0] != images.shape[0]:
        raise DataError(f"{folder / labels_name}: {labels.shape[0]} labels but {folder / images_name} has "
                        f"{images.shape[0]} images")
    if labels.size and labels.max() > 9:
        raise DataError(f"{folder / labels_name}: label {int(labels.max())} out of range 0..9")
    # copies, so callers can modify what they get without corrupting the cache
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


def download_checked(folder: Path, files: dict[str, tuple[int, str]], mirrors, hash_name: str, timeout: float,
                     force: bool = False, log=print) -> Path:
    """Download each of ``files`` (``{name: (size in bytes, hex digest)}``) into ``folder``, trying every mirror (a
    URL prefix) in turn; a file is written (atomically, so an interrupted download never leaves a partial file)
    only once its size and ``hash_name`` digest (a :mod:`hashlib` name) are right.  A file already there with the
    right digest is kept unless ``force``.  Returns ``folder``; DataError when a file cannot be fetched intact."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (size, digest) in files.items():
        target = folder / name
        if not force and target.is_file() and hashlib.new(hash_name, target.read_bytes()).hexdigest() == digest:
            log(f"{target}: present, {hash_name} ok")
            continue
        failures = []
        for mirror in mirrors:
            url = mirror + name
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "probcaps"}),
                                            timeout=timeout) as response:
                    payload = response.read()
            except (urllib.error.URLError, OSError, ValueError) as e:
                failures.append(f"{url}: {e}")
                continue
            found = hashlib.new(hash_name, payload).hexdigest()
            if len(payload) != size or found != digest:
                failures.append(f"{url}: got {len(payload)} bytes with {hash_name} {found}, expected {size} bytes "
                                f"with {hash_name} {digest}")
                continue
            atomic_write(target, lambda f: f.write(payload))
            log(f"{target}: downloaded from {url}")
            break
        else:
            raise DataError(f"{target}: could not download from any mirror ({'; '.join(failures)})")
    return folder


def download_mnist(root: str | os.PathLike | None = None, mirrors=MNIST_MIRRORS, timeout: float = 60.0,
                   force: bool = False, log=print) -> Path:
    """Download the four MNIST files into ``root/mnist`` (root resolved as in :func:`resolve_data_root`), each
    checked by size and md5 (:func:`download_checked`); returns the mnist folder."""
    return download_checked(mnist_dir(resolve_data_root(root)), MNIST_FILES, mirrors, "md5", timeout, force, log)
