"""smallNORB (LeCun, Huang & Bottou 2004): the original binary matrix files, the paper's preprocessing and the
viewpoint splits of Hinton, Sabour & Frosst (2018).

File format ("binary matrix", little-endian): a 4-byte magic giving the element type (:data:`NORB_MAGIC`), a
4-byte number of dimensions ``ndim``, then ``max(3, ndim)`` 4-byte dimensions (unused ones are 1), then the
elements in C order.  The six files (gzip as distributed, or raw) live in ``<data root>/smallnorb/``:

- ``*-dat.mat``: uint8 ``(24300, 2, 96, 96)`` stereo pairs; ``*-cat.mat``: int32 ``(24300,)`` classes 0..4
  (animal, human, airplane, truck, car); ``*-info.mat``: int32 ``(24300, 4)`` = instance (0..9), elevation index
  (0..8: 30 to 70 degrees in steps of 5), azimuth (0, 2, .., 34: times 10 degrees), lighting (0..5).

The paper's preprocessing: each image downsampled to 48x48 (here: 2x2 area average of the 96x96 left-camera
image), then random 32x32 crops during training and the centre 32x32 crop at test time (:func:`crop32`).  This
loader and the synthetic stand-in (:mod:`probcaps.data.synthetic_norb`) both return a :class:`NorbSet`.
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import DataError
from ..io import atomic_write
from .idx import array_after_header, read_maybe_gzipped
from .loaders import TensorRecord
from .mnist import download_checked, resolve_data_root

__all__ = ["NORB_MAGIC", "NORB_CLASSES", "SMALLNORB_FILES", "SMALLNORB_SPLITS", "TRAIN_AZIMUTHS", "ELEVATIONS",
           "NorbSet", "read_norb_matrix", "write_norb_matrix", "load_smallnorb", "download_smallnorb", "downsample",
           "crop32", "viewpoint_split", "smallnorb_dir"]

#: magic number -> numpy element type (little-endian)
NORB_MAGIC: dict[int, np.dtype] = {
    0x1E3D4C51: np.dtype("<f4"),   # single precision
    0x1E3D4C53: np.dtype("<f8"),   # double precision
    0x1E3D4C54: np.dtype("<i4"),   # integer
    0x1E3D4C55: np.dtype("u1"),    # byte
    0x1E3D4C56: np.dtype("<i2"),   # short
}
_MAGIC_OF = {v: k for k, v in NORB_MAGIC.items()}

NORB_CLASSES = ("animal", "human", "airplane", "truck", "car")

_BASE_URL = "https://cs.nyu.edu/~ylclab/data/norb-v1.0-small/"
_TRAIN = "smallnorb-5x46789x9x18x6x2x96x96-training"
_TEST = "smallnorb-5x01235x9x18x6x2x96x96-testing"
#: official gzip file -> (size in bytes, sha256), as published in tensorflow_datasets' url checksums
SMALLNORB_FILES: dict[str, tuple[int, str]] = {
    f"{_TRAIN}-dat.mat.gz": (131896188, "5ffd6272a07d32695ee1082a26a41a93a37aab8c28da047f8c34ed348d214873"),
    f"{_TRAIN}-cat.mat.gz": (348, "2784e542c1922060691090952b6cd6278879a216c90f81476f0f00256d42cdaa"),
    f"{_TRAIN}-info.mat.gz": (71052, "de7eb932ebe7a4ee16217fead60660d0eb3d23632c2f4d1c51f88c501c17bf32"),
    f"{_TEST}-dat.mat.gz": (130799817, "cf7104eed3e51174d2f65b66d1e5878b9da233b886f161b0d88f4510ba2c7474"),
    f"{_TEST}-cat.mat.gz": (347, "ecaf6d5bb8c3bc5eab9cf0258f6d2198dd474e016e374836fc097f2e5ff509ff"),
    f"{_TEST}-info.mat.gz": (10428, "16adf314226327ee006d1a44db8cfef52773c06c829951d5653a9f6f310248a2"),
}
#: split -> file stem (the ``-dat``, ``-cat``, ``-info`` files follow it)
SMALLNORB_SPLITS = {"train": _TRAIN, "test": _TEST}

#: the paper's familiar azimuths (degrees); the novel ones are 60..280
TRAIN_AZIMUTHS = (300, 320, 340, 0, 20, 40)
#: smallNORB's nine elevations (degrees); the paper trains on the 3 lowest and tests on the 6 highest
ELEVATIONS = tuple(range(30, 75, 5))


@dataclass
class NorbSet(TensorRecord):
    """Images with viewpoint metadata (the real smallNORB or the synthetic stand-in): ``images`` uint8
    ``(N, 48, 48)`` (downsampled as the paper does), ``labels`` int64 ``(N,)`` classes 0..4, ``instance``,
    ``lighting`` int64 ``(N,)``, ``azimuth``, ``elevation`` int64 ``(N,)`` in degrees (0..340 step 20; 30..70 step 5).
    """

    images: torch.Tensor
    labels: torch.Tensor
    instance: torch.Tensor
    azimuth: torch.Tensor
    elevation: torch.Tensor
    lighting: torch.Tensor


def read_norb_matrix(path: str | os.PathLike) -> np.ndarray:
    """Read a smallNORB binary matrix file (gzip or raw, detected from the content) into a numpy array.  A
    DataError, one line naming the file, for a missing file, bad gzip, unknown magic number, truncated header or a
    payload shorter or longer than the header's dimensions say."""
    path = Path(path)
    data = read_maybe_gzipped(path)
    if len(data) < 8:
        raise DataError(f"{path}: truncated: {len(data)} bytes, too short for a smallNORB header")
    magic, ndim = struct.unpack("<ii", data[:8])
    magic &= 0xFFFFFFFF
    if magic not in NORB_MAGIC:
        known = ", ".join(f"0x{m:08X}" for m in NORB_MAGIC)
        raise DataError(f"{path}: bad magic number 0x{magic:08X}; not a smallNORB matrix file (expected one of "
                        f"{known})")
    if not 0 < ndim <= 16:
        raise DataError(f"{path}: implausible number of dimensions {ndim} in the header")
    header = 8 + 4 * max(3, ndim)
    if len(data) < header:
        raise DataError(f"{path}: truncated: the header needs {header} bytes, found {len(data)}")
    shape = struct.unpack(f"<{ndim}i", data[8:8 + 4 * ndim])
    if any(d < 0 for d in shape):
        raise DataError(f"{path}: negative dimension in the header {shape}")
    return array_after_header(path, data, header, shape, NORB_MAGIC[magic])


def write_norb_matrix(path: str | os.PathLike, array, gzip_file: bool = False) -> Path:
    """Write ``array`` (uint8, int32, int16, float32 or float64) as a smallNORB binary matrix file, atomically."""
    arr = np.asarray(array)
    dtype = arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
    if dtype not in _MAGIC_OF:
        raise ValueError(f"write_norb_matrix: {path}: unsupported dtype {arr.dtype}")
    dims = list(arr.shape) + [1] * max(0, 3 - arr.ndim)
    payload = struct.pack(f"<ii{len(dims)}i", _MAGIC_OF[dtype], arr.ndim, *dims)
    payload += np.ascontiguousarray(arr, dtype=dtype).tobytes()
    if gzip_file:
        payload = gzip.compress(payload, mtime=0)
    return atomic_write(path, lambda f: f.write(payload))


def smallnorb_dir(root: str | os.PathLike | None = None) -> Path:
    """``<data root>/smallnorb`` (the root resolved as in :func:`~probcaps.data.mnist.resolve_data_root`)."""
    return resolve_data_root(root) / "smallnorb"


def _find(folder: Path, name: str) -> Path:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    raise DataError(f"{folder / name}[.gz]: smallNORB file not found; pass --data-dir DIR (holding smallnorb/) or "
                    f"run probcaps.data.smallnorb.download_smallnorb() where a network is available")


def downsample(images: torch.Tensor, size: int = 48) -> torch.Tensor:
    """uint8 ``(N, H, W)`` -> uint8 ``(N, size, size)`` by area averaging (96 -> 48 is a 2x2 mean)."""
    x = F.adaptive_avg_pool2d(images[:, None].float(), size)[:, 0]
    return x.round().clamp(0, 255).to(torch.uint8)


def load_smallnorb(split: str, data_dir: str | os.PathLike | None = None, size: int = 48) -> NorbSet:
    """Load a smallNORB split (``"train"`` or ``"test"``): the left-camera images downsampled to ``size``.  A
    DataError for missing or malformed files, or files whose example counts or shapes disagree."""
    if split not in SMALLNORB_SPLITS:
        raise ValueError(f"load_smallnorb: split must be one of {sorted(SMALLNORB_SPLITS)}, got {split!r}")
    folder = smallnorb_dir(data_dir)
    stem = SMALLNORB_SPLITS[split]
    dat_path, cat_path, info_path = (_find(folder, f"{stem}-{kind}.mat") for kind in ("dat", "cat", "info"))
    dat, cat, info = read_norb_matrix(dat_path), read_norb_matrix(cat_path), read_norb_matrix(info_path)
    if dat.ndim != 4 or dat.dtype != np.uint8 or dat.shape[1] != 2:
        raise DataError(f"{dat_path}: expected uint8 stereo images (N, 2, H, W), found {dat.dtype} {dat.shape}")
    if cat.ndim != 1 or cat.shape[0] != dat.shape[0]:
        raise DataError(f"{cat_path}: expected {dat.shape[0]} labels, found shape {cat.shape}")
    if info.ndim != 2 or info.shape != (dat.shape[0], 4):
        raise DataError(f"{info_path}: expected info of shape ({dat.shape[0]}, 4), found {info.shape}")
    if cat.size and not (0 <= cat.min() and cat.max() <= 4):
        raise DataError(f"{cat_path}: labels outside 0..4")
    info = torch.from_numpy(info.astype(np.int64))
    return NorbSet(images=downsample(torch.from_numpy(dat[:, 0]), size), labels=torch.from_numpy(cat.astype(np.int64)),
                   instance=info[:, 0], elevation=30 + 5 * info[:, 1], azimuth=10 * info[:, 2], lighting=info[:, 3])


def crop32(images: torch.Tensor, train: bool, generator: torch.Generator | None = None,
           size: int = 32) -> torch.Tensor:
    """The paper's crops of ``(B, 1, 48, 48)`` images: a random ``size x size`` crop per image when ``train``, the
    centre crop otherwise.  Vectorised with one gather (no loop over images)."""
    B, C, H, W = images.shape
    if not train:
        top, left = (H - size) // 2, (W - size) // 2
        return images[:, :, top:top + size, left:left + size]
    top = torch.randint(0, H - size + 1, (B,), generator=generator).to(images.device)
    left = torch.randint(0, W - size + 1, (B,), generator=generator).to(images.device)
    r = torch.arange(size, device=images.device)
    rows = (top[:, None] + r)[:, None, :, None].expand(B, C, size, W)
    out = images.gather(2, rows)
    cols = (left[:, None] + r)[:, None, None, :].expand(B, C, size, size)
    return out.gather(3, cols)


def viewpoint_split(data: NorbSet, kind: str = "azimuth") -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks ``(familiar, novel)`` of the paper's novel-viewpoint experiments.

    - ``"azimuth"``: familiar azimuths {300, 320, 340, 0, 20, 40}, novel 60..280;
    - ``"elevation"``: familiar = the 3 lowest elevations (30, 35, 40), novel = the 6 highest (45..70).
    """
    if kind == "azimuth":
        familiar = torch.isin(data.azimuth, torch.tensor(TRAIN_AZIMUTHS))
    elif kind == "elevation":
        familiar = torch.isin(data.elevation, torch.tensor(ELEVATIONS[:3]))
    else:
        raise ValueError(f"viewpoint_split: kind must be 'azimuth' or 'elevation', got {kind!r}")
    return familiar, ~familiar


def download_smallnorb(root: str | os.PathLike | None = None, base_url: str = _BASE_URL, timeout: float = 120.0,
                       force: bool = False, log=print) -> Path:
    """Download the six official gzip files into ``<root>/smallnorb`` (about 260 MB), each checked by size and
    sha256 (:func:`~probcaps.data.mnist.download_checked`); returns the folder."""
    return download_checked(smallnorb_dir(root), SMALLNORB_FILES, [base_url], "sha256", timeout, force, log)
