"""Image transforms for digits, vectorised over the batch (no Python loops over images or pixels).

Conventions: images are ``(N, H, W)`` (or ``(N, C, H, W)`` where noted), row 0 at the top, so the image
``y`` axis points *down*.  Offsets are ``(dx, dy)`` in pixels: ``dx > 0`` moves right, ``dy > 0`` moves down.
"""

from __future__ import annotations

import math

import torch

from ..geometry import degrees, rotation_matrix
from ..render import warp

__all__ = ["random_offsets", "place_on_canvas", "rotate", "to_float", "standardise_per_image"]


def random_offsets(n: int, max_shift: int = 6, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(n, 2)`` int64 offsets ``(dx, dy)``, each uniform over the integers ``[-max_shift, max_shift]``."""
    return torch.randint(-max_shift, max_shift + 1, (n, 2), generator=generator, dtype=torch.int64)


def place_on_canvas(digits: torch.Tensor, offsets: torch.Tensor, canvas: int = 40) -> torch.Tensor:
    """Paste each digit onto an empty ``canvas x canvas`` image, centred, then shifted by its offset (the SCAE
    placement: no interpolation, pixels copied with one advanced-indexing assignment).

    ``digits (N, h, w)`` of any dtype; ``offsets (N, 2)`` integer ``(dx, dy)``: digit pixel ``(r, c)`` lands at
    ``(top + dy + r, left + dx + c)``, ``top = (canvas - h) // 2``, ``left = (canvas - w) // 2``.  Returns ``(N, canvas,
    canvas)`` of ``digits``' dtype and device, zeros outside the digit; a ValueError if a digit would leave the canvas.
    """
    if digits.dim() != 3:
        raise ValueError(f"place_on_canvas: digits must be (N, h, w), got shape {tuple(digits.shape)}")
    n, h, w = digits.shape
    offsets = torch.as_tensor(offsets, device=digits.device)
    if offsets.shape != (n, 2) or offsets.is_floating_point():
        raise ValueError(f"place_on_canvas: offsets must be integer (N, 2) = ({n}, 2), got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    offsets = offsets.long()
    top, left = (canvas - h) // 2, (canvas - w) // 2
    row0, col0 = top + offsets[:, 1], left + offsets[:, 0]  # (N,) first canvas row and column of each digit
    outside = (row0 < 0) | (row0 + h > canvas) | (col0 < 0) | (col0 + w > canvas)
    if bool(outside.any()):
        i = int(outside.nonzero()[0, 0])
        raise ValueError(f"place_on_canvas: offset (dx, dy) = {tuple(offsets[i].tolist())} of digit {i} moves a "
                         f"{h}x{w} digit off the {canvas}x{canvas} canvas (allowed dx in [{-left}, "
                         f"{canvas - w - left}], dy in [{-top}, {canvas - h - top}])")
    out = digits.new_zeros((n, canvas, canvas))
    rows = row0[:, None, None] + torch.arange(h, device=digits.device)[:, None]  # (N, h, 1)
    cols = col0[:, None, None] + torch.arange(w, device=digits.device)  # (N, 1, w)
    out[torch.arange(n, device=digits.device)[:, None, None], rows, cols] = digits
    return out


def rotate(images: torch.Tensor, angles_deg, canvas: int | None = None) -> torch.Tensor:
    """Rotate square float images about their centre; positive angles turn **counter-clockwise on screen**.

    "On screen": displayed with row 0 at the top (``plt.imshow``), at +90 degrees a pixel right of the centre moves
    above it.  Bilinear sampling by :func:`probcaps.render.warp`; what comes from outside the source is 0.

    ``images``: float ``(N, H, W)`` or ``(N, C, H, W)`` with ``H == W``; ``angles_deg``: a scalar or ``(N,)``;
    ``canvas``: output side length (default ``H``), the image staying centred.  Returns ``(N, canvas, canvas)`` or
    ``(N, C, canvas, canvas)`` (the input's rank).
    """
    if not images.is_floating_point():
        raise TypeError(f"rotate: images must be floating point (use to_float first), got {images.dtype}")
    squeeze = images.dim() == 3
    x = images.unsqueeze(1) if squeeze else images
    if x.dim() != 4 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"rotate: images must be square (N, H, W) or (N, C, H, W), got {tuple(images.shape)}")
    n = x.shape[0]
    # whole turns removed first, in float64 (exactly): a finite angle of any size (1e300) turns the image, instead
    # of overflowing float32 to inf and its sine to NaN; an angle within one turn is left as it is
    if isinstance(angles_deg, (int, float)) and not math.isfinite(angles_deg):
        raise ValueError(f"rotate: the angle must be finite, got {angles_deg}")
    turns = torch.as_tensor(angles_deg, dtype=torch.float64, device=x.device)
    angles = degrees(torch.fmod(turns, 360.0)).to(dtype=x.dtype)
    angles = angles.expand(n) if angles.dim() == 0 else angles
    if angles.shape != (n,):
        raise ValueError(f"rotate: angles must be a scalar or ({n},), got shape {tuple(angles.shape)}")
    # warp's normalised frame has y pointing down, so a screen-counter-clockwise turn is a negative angle there
    out = warp(x, rotation_matrix(-angles).to(dtype=x.dtype), canvas if canvas is not None else x.shape[-1])
    return out.squeeze(1) if squeeze else out


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (any shape) -> float32 in ``[0, 1]``."""
    if images.dtype != torch.uint8:
        raise TypeError(f"to_float: expected uint8 images, got {images.dtype}")
    return images.to(torch.float32).div_(255.0)


def standardise_per_image(images: torch.Tensor, min_std: float = 1e-3) -> torch.Tensor:
    """``(N, ...)`` images -> each image minus its mean, divided by its std (at least ``min_std``, so a blank image
    stays finite).  The smallNORB preprocessing of Hinton et al.'s released code; it removes any brightness offset
    and contrast scale of the image."""
    flat = images.flatten(1)
    mean = flat.mean(1, keepdim=True)
    std = flat.std(1, unbiased=False, keepdim=True).clamp_min(min_std)
    return ((flat - mean) / std).view_as(images)
