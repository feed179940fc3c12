"""Datasets and batch iteration: placed MNIST, deterministic (resumable) batches, synthetic digits.

Every random choice here comes from a ``torch.Generator`` seeded by a pure function of the arguments
(:func:`derive_seed`), never from global RNG state, so a run can be resumed mid-epoch exactly.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

import torch

from .idx import write_idx
from .mnist import MNIST_SPLITS, load_mnist, mnist_dir
from .transforms import place_on_canvas, random_offsets, rotate, to_float

__all__ = ["derive_seed", "seeded_generator", "TensorRecord", "PlacedMNIST", "placed_mnist", "num_batches",
           "iterate_batches", "synthetic_digits", "load_digits", "write_fake_mnist"]


def derive_seed(*parts) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (e.g. ``(seed, "train")``), stable across runs (SHA-256
    of the ``repr``: Python's ``hash`` is salted per process for strings)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def seeded_generator(*parts) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` of ``parts``."""
    return torch.Generator().manual_seed(derive_seed(*parts))


class TensorRecord:
    """Base of a dataclass whose tensor fields hold one row per example, along dim 0 (the first field's length)."""

    def __len__(self) -> int:
        return getattr(self, fields(self)[0].name).shape[0]

    def subset(self, index: torch.Tensor):
        """The examples at ``index`` (int indices or an ``(N,)`` boolean mask), every field indexed alike."""
        return type(self)(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass
class PlacedMNIST(TensorRecord):
    """MNIST digits placed on a larger canvas at random integer offsets: ``images`` uint8 ``(N, canvas, canvas)``,
    ``labels`` int64 ``(N,)``, ``offsets`` int64 ``(N, 2)`` ``(dx, dy)`` in pixels from the centred position (dx
    right, dy down)."""

    images: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor
    split: str
    canvas: int
    max_shift: int
    seed: int


def placed_mnist(split: str, data_dir: str | os.PathLike | None = None, canvas: int = 40, max_shift: int = 6,
                 seed: int = 0, limit: int | None = None, verify: bool = True) -> PlacedMNIST:
    """Load an MNIST split and place every digit on a ``canvas x canvas`` image (SCAE's 40x40 setup).

    Offsets are drawn for the whole split from a generator seeded by ``(seed, split)`` and *then* cut to the
    first ``limit`` images, so image ``i`` gets the same offset whatever ``limit`` is.
    """
    images, labels = load_mnist(split, data_dir=data_dir, verify=verify)
    offsets = random_offsets(images.shape[0], max_shift, generator=seeded_generator("placed_mnist", seed, split))
    images, labels, offsets = images[:limit], labels[:limit], offsets[:limit]
    return PlacedMNIST(place_on_canvas(images, offsets, canvas=canvas), labels, offsets, split, canvas, max_shift, seed)


def num_batches(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Number of batches in an epoch of ``n`` examples."""
    return n // batch_size if drop_last else math.ceil(n / batch_size)


def iterate_batches(images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, shuffle: bool, seed: int = 0,
                    epoch: int = 0, start_batch: int = 0, drop_last: bool = False, device="cpu",
                    rotation: float | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(x, y)`` batches of one epoch: ``x`` float32 ``(B, 1, H, W)`` in ``[0, 1]``, ``y`` int64 ``(B,)``.

    ``images``: uint8 ``(N, H, W)`` or ``(N, 1, H, W)`` (scaled by 1/255), or float already in ``[0, 1]``;
    ``labels``: ``(N,)``.  ``shuffle`` visits the examples in a permutation that is a pure function of ``(seed,
    epoch)``; ``start_batch`` skips the first batches (resume mid-epoch: the rest are exactly those of a full epoch);
    the data are indexed on their own device, then each batch is moved to ``device``.  ``rotation``: None, or a
    maximum angle in degrees: image ``i`` is rotated by an angle uniform in ``[-rotation, rotation]`` (positive =
    counter-clockwise on screen, see :func:`rotate`), drawn per example from a generator seeded by ``(seed, epoch)``.
    """
    n = images.shape[0]
    if labels.shape[0] != n:
        raise ValueError(f"iterate_batches: {n} images but {labels.shape[0]} labels")
    if images.dim() == 4 and images.shape[1] != 1 or images.dim() not in (3, 4):
        raise ValueError(f"iterate_batches: images must be (N, H, W) or (N, 1, H, W), got {tuple(images.shape)}")
    if start_batch < 0:
        raise ValueError(f"iterate_batches: start_batch must be >= 0, got {start_batch}")
    total = num_batches(n, batch_size, drop_last)
    order = torch.randperm(n, generator=seeded_generator("epoch_order", seed, epoch)) if shuffle else torch.arange(n)
    angles = None
    if rotation is not None:
        # one angle per example (indexed by example, not by position), so resuming cannot shift them
        u = torch.rand(n, generator=seeded_generator("rotation", seed, epoch), dtype=torch.float64)
        angles = (u * 2 - 1) * float(rotation)
    for b in range(start_batch, total):
        idx = order[b * batch_size:(b + 1) * batch_size]
        x = images[idx.to(images.device)].to(device)
        x = to_float(x) if x.dtype == torch.uint8 else x.to(torch.float32)
        x = x.unsqueeze(1) if x.dim() == 3 else x
        if angles is not None:
            x = rotate(x, angles[idx].to(device=device, dtype=torch.float32)).clamp_(0.0, 1.0)
        y = labels[idx.to(labels.device)].to(device=device, dtype=torch.int64)
        yield x, y


# --- synthetic digits -------------------------------------------------------------------------------------------

def _stroke_table() -> tuple[torch.Tensor, torch.Tensor]:
    """Ten classes of simple stroke shapes: segments ``(10, 4, 2, 2)`` [class, stroke, end, (x, y)] in a unit
    square (y down), and a ``(10, 4)`` mask of the strokes each class uses."""
    lo, mid, hi = 0.25, 0.5, 0.75
    shapes = [
        [((lo, lo), (hi, lo)), ((hi, lo), (hi, hi)), ((hi, hi), (lo, hi)), ((lo, hi), (lo, lo))],  # 0 box
        [((mid, lo), (mid, hi))],  # 1 vertical bar
        [((lo, mid), (hi, mid))],  # 2 horizontal bar
        [((mid, lo), (mid, hi)), ((lo, mid), (hi, mid))],  # 3 plus
        [((lo, lo), (hi, hi)), ((hi, lo), (lo, hi))],  # 4 diagonal cross
        [((lo, lo), (lo, hi)), ((lo, hi), (hi, hi))],  # 5 L
        [((lo, lo), (hi, lo)), ((mid, lo), (mid, hi))],  # 6 T
        [((lo, lo), (hi, lo)), ((hi, lo), (lo + 0.1, hi))],  # 7 seven
        [((lo, 0.38), (hi, 0.38)), ((lo, 0.62), (hi, 0.62))],  # 8 equals sign
        [((mid, lo), (hi, hi)), ((hi, hi), (lo, hi)), ((lo, hi), (mid, lo))],  # 9 triangle
    ]
    pad = torch.nn.utils.rnn.pad_sequence  # zeros after the strokes of classes with fewer than 4
    segments = pad([torch.tensor(s) for s in shapes], batch_first=True)
    return segments, pad([torch.ones(len(s)) for s in shapes], batch_first=True)


def synthetic_digits(n: int, size: int = 28, seed: int = 0,
                     chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiny stand-in "digits" for tests and smoke runs that must not need MNIST: uint8 ``(n, size, size)`` and
    int64 labels ``(n,)``, balanced (``i % 10``, shuffled).  Ten classes of stroke shapes (:func:`_stroke_table`),
    each drawn with random jitter (endpoints, scale, position) as anti-aliased strokes about 2.5 pixels wide (at
    size 28), rendered as pixel-to-segment distances, ``chunk`` images at a time to bound memory."""
    g = seeded_generator("synthetic_digits", seed, size)
    labels = (torch.arange(n) % 10)[torch.randperm(n, generator=g)]
    segments, mask = _stroke_table()
    seg = segments[labels]  # (n, S, 2, 2)
    seg = seg + 0.025 * torch.randn(seg.shape, generator=g)  # wobble each endpoint
    scale = 0.85 + 0.3 * torch.rand(n, 1, 1, 1, generator=g)
    shift = 0.08 * (2 * torch.rand(n, 1, 1, 2, generator=g) - 1)
    seg = ((seg - 0.5) * scale + 0.5 + shift) * size  # to pixel units
    stroke_mask = mask[labels]  # (n, S)
    half_width = 1.25 * size / 28
    centres = torch.arange(size, dtype=torch.float32) + 0.5
    pix = torch.stack(torch.meshgrid(centres, centres, indexing="xy"), -1)  # (size, size, 2) as (x, y)
    out = torch.empty(n, size, size, dtype=torch.uint8)
    for start in range(0, n, chunk):  # chunks of images (bounded memory), vectorised within each
        a = seg[start:start + chunk, :, 0, None, None, :]  # (B, S, 1, 1, 2)
        ab = seg[start:start + chunk, :, 1, None, None, :] - a
        t = (((pix - a) * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-6)).clamp(0, 1)  # (B, S, size, size)
        dist = (pix - (a + t[..., None] * ab)).norm(dim=-1)
        ink = (half_width + 0.5 - dist).clamp(0, 1) * stroke_mask[start:start + chunk, :, None, None]
        out[start:start + chunk] = (ink.amax(1) * 255).round().to(torch.uint8)
    return out, labels


def load_digits(dataset: str, split: str, *, limit: int | None = None, data_dir=None,
                synthetic_sizes: tuple[int, int] = (2048, 512), synthetic_seed: int = 0):
    """uint8 digits ``(N, 28, 28)`` and int64 labels ``(N,)`` of a split, the first ``limit`` of them.

    ``dataset``: ``"mnist"`` (read from ``data_dir``), or ``"synthetic"`` (stroke digits: ``synthetic_sizes``
    (train, test) of them when ``limit`` is not given, seeded ``synthetic_seed`` for train and ``+ 1`` for test).
    """
    if split not in MNIST_SPLITS:
        raise ValueError(f"load_digits: split must be one of {sorted(MNIST_SPLITS)}, got {split!r}")
    limit = limit or None
    if dataset == "synthetic":
        n = limit or synthetic_sizes[0 if split == "train" else 1]
        return synthetic_digits(n, seed=synthetic_seed + (0 if split == "train" else 1))
    if dataset != "mnist":
        raise ValueError(f"load_digits: dataset must be 'mnist' or 'synthetic', got {dataset!r}")
    images, labels = load_mnist(split, data_dir=data_dir)
    return torch.as_tensor(images)[:limit], torch.as_tensor(labels).long()[:limit]


def write_fake_mnist(root: str | os.PathLike, n_train: int = 64, n_test: int = 32, seed: int = 0) -> Path:
    """Write :func:`synthetic_digits` as the four gzip IDX files, with the official names, under ``root/mnist``
    (returned), for tests and smoke runs without real MNIST; load them with ``load_mnist(split, root, verify=False)``
    (their md5s are not the official ones)."""
    folder = mnist_dir(root)
    for split, n in (("train", n_train), ("test", n_test)):
        images_name, labels_name, _ = MNIST_SPLITS[split]
        images, labels = synthetic_digits(n, size=28, seed=derive_seed(seed, split))
        write_idx(folder / images_name, images.numpy())
        write_idx(folder / labels_name, labels.to(torch.uint8).numpy())
    return folder
