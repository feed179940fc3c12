"""Pose geometry: 2-D affine maps in homogeneous coordinates.

A pose is stored either as a 6-vector ``y`` or as the 3x3 matrix

    P(y) = [[1 + y1, y2,     y3],
            [y4,     1 + y5, y6],
            [0,      0,      1 ]]

so that ``y = 0`` is the identity (Smith et al. 2020, §2).  Translations ``y3, y6`` are in the canvas's normalised
coordinates: ``[-1, 1]`` spans the canvas, as in ``torch.nn.functional.grid_sample(align_corners=False)``.
All functions broadcast over leading dimensions.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "pose6_to_matrix",
    "matrix_to_pose6",
    "compose",
    "invert",
    "determinant",
    "compose_pose6",
    "affine_matrix",
    "rotation_matrix",
    "translation_matrix",
    "pixels_to_normalised",
]


def pose6_to_matrix(y: torch.Tensor) -> torch.Tensor:
    """``(..., 6) -> (..., 3, 3)``: ``P(y)`` with the identity added."""
    if y.shape[-1] != 6:
        raise ValueError(f"pose6_to_matrix: last dimension must be 6, got shape {tuple(y.shape)}")
    one = torch.ones_like(y[..., :1])
    zero = torch.zeros_like(y[..., :1])
    row0 = torch.cat([1 + y[..., 0:1], y[..., 1:3]], -1)
    row1 = torch.cat([y[..., 3:4], 1 + y[..., 4:5], y[..., 5:6]], -1)
    row2 = torch.cat([zero, zero, one], -1)
    return torch.stack([row0, row1, row2], -2)


def matrix_to_pose6(P: torch.Tensor) -> torch.Tensor:
    """``(..., 3, 3) -> (..., 6)``: the inverse of :func:`pose6_to_matrix` (the last row is ignored)."""
    if P.shape[-2:] != (3, 3):
        raise ValueError(f"matrix_to_pose6: expected (..., 3, 3), got shape {tuple(P.shape)}")
    top = P[..., :2, :].reshape(*P.shape[:-2], 6)
    eye = top.new_tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    return top - eye


def compose(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A ∘ B`` for ``(..., 3, 3)`` affine matrices: apply ``B`` first, then ``A``."""
    return A @ B


def compose_pose6(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``pose6(P(a) P(b))`` for 6-vectors, without building matrices: ``(..., 6), (..., 6) -> (..., 6)``."""
    a11, a12, a13, a21, a22, a23 = (a[..., i] for i in range(6))
    b11, b12, b13, b21, b22, b23 = (b[..., i] for i in range(6))
    a11, a22, b11, b22 = a11 + 1, a22 + 1, b11 + 1, b22 + 1
    return torch.stack(
        [
            a11 * b11 + a12 * b21 - 1,
            a11 * b12 + a12 * b22,
            a11 * b13 + a12 * b23 + a13,
            a21 * b11 + a22 * b21,
            a21 * b12 + a22 * b22 - 1,
            a21 * b13 + a22 * b23 + a23,
        ],
        -1,
    )


def determinant(P: torch.Tensor) -> torch.Tensor:
    """Determinant of the linear part of ``(..., 3, 3)`` affine matrices: ``(...)`` (the area scale of the map)."""
    return P[..., 0, 0] * P[..., 1, 1] - P[..., 0, 1] * P[..., 1, 0]


def invert(P: torch.Tensor, min_abs_det: float = 0.0) -> torch.Tensor:
    """Inverse of ``(..., 3, 3)`` affine matrices (closed form for the 2x2 block; no general solve).

    ``min_abs_det > 0`` keeps the determinant at least that far from zero (sign kept, zero counts as positive), so
    a singular or nearly singular map inverts to large finite entries instead of ``inf``/``NaN``.
    """
    a, b, c = P[..., 0, 0], P[..., 0, 1], P[..., 0, 2]
    d, e, f = P[..., 1, 0], P[..., 1, 1], P[..., 1, 2]
    det = determinant(P)
    if min_abs_det > 0:
        det = torch.where(det < 0, det.clamp_max(-min_abs_det), det.clamp_min(min_abs_det))
    ia, ib, id_, ie = e / det, -b / det, -d / det, a / det
    ic = -(ia * c + ib * f)
    if_ = -(id_ * c + ie * f)
    zero, one = torch.zeros_like(a), torch.ones_like(a)
    return torch.stack(
        [torch.stack([ia, ib, ic], -1), torch.stack([id_, ie, if_], -1), torch.stack([zero, zero, one], -1)], -2
    )


def affine_matrix(
    scale_x: torch.Tensor,
    scale_y: torch.Tensor,
    theta: torch.Tensor,
    shear: torch.Tensor,
    tx: torch.Tensor,
    ty: torch.Tensor,
) -> torch.Tensor:
    """Matrix ``T(tx, ty) R(theta) Sh(shear) S(scale_x, scale_y)`` (each argument ``(...)``) -> ``(..., 3, 3)``.

    The same factorisation SCAE uses to constrain part poses.
    """
    c, s = torch.cos(theta), torch.sin(theta)
    # R @ Sh @ S with Sh = [[1, shear], [0, 1]]
    m00 = c * scale_x
    m01 = (c * shear - s) * scale_y
    m10 = s * scale_x
    m11 = (s * shear + c) * scale_y
    zero, one = torch.zeros_like(m00), torch.ones_like(m00)
    return torch.stack(
        [torch.stack([m00, m01, tx], -1), torch.stack([m10, m11, ty], -1), torch.stack([zero, zero, one], -1)], -2
    )


def _as_float_tensor(x) -> torch.Tensor:
    """Floating tensors keep their dtype and device; numbers become tensors of the default dtype."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x
    return torch.as_tensor(x, dtype=torch.get_default_dtype())


def rotation_matrix(theta: torch.Tensor) -> torch.Tensor:
    """Rotation by ``theta`` radians about the canvas centre: ``(...) -> (..., 3, 3)``."""
    theta = _as_float_tensor(theta)
    one, zero = torch.ones_like(theta), torch.zeros_like(theta)
    return affine_matrix(one, one, theta, zero, zero, zero)


def translation_matrix(tx: torch.Tensor, ty: torch.Tensor) -> torch.Tensor:
    """Translation by ``(tx, ty)`` in normalised coordinates: ``(...) -> (..., 3, 3)``."""
    tx = _as_float_tensor(tx)
    ty = torch.as_tensor(ty, dtype=tx.dtype, device=tx.device)
    tx, ty = torch.broadcast_tensors(tx, ty)
    one, zero = torch.ones_like(tx), torch.zeros_like(tx)
    return affine_matrix(one, one, zero, zero, tx, ty)


def pixels_to_normalised(pixels: float | torch.Tensor, size: int):
    """A length in pixels on a canvas of ``size`` pixels, in normalised units (``[-1, 1]`` spans the canvas)."""
    return pixels * (2.0 / size)


def degrees(angle_deg) -> torch.Tensor:
    """Degrees to radians as a tensor."""
    return _as_float_tensor(angle_deg) * (math.pi / 180.0)


def constrained_pose(
    raw: torch.Tensor,
    min_scale: float = 0.3,
    max_scale: float = 2.0,
    max_shear: float = 0.5,
    max_translation: float = 1.0,
) -> torch.Tensor:
    """Squash unconstrained ``(..., 6)`` network outputs into a plausible pose, returned as a pose 6-vector.

    SCAE's recipe: scales through a sigmoid into ``[min_scale, max_scale]``, shear and translation through
    ``tanh``, rotation unconstrained.  ``raw = (sx, sy, theta, shear, tx, ty)``.
    """
    sx = min_scale + (max_scale - min_scale) * torch.sigmoid(raw[..., 0])
    sy = min_scale + (max_scale - min_scale) * torch.sigmoid(raw[..., 1])
    theta = raw[..., 2]
    shear = max_shear * torch.tanh(raw[..., 3])
    tx = max_translation * torch.tanh(raw[..., 4])
    ty = max_translation * torch.tanh(raw[..., 5])
    return matrix_to_pose6(affine_matrix(sx, sy, theta, shear, tx, ty))
