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
import torch.nn.functional as F

__all__ = ["pose6_to_matrix", "matrix_to_pose6", "compose", "invert", "determinant", "compose_pose6", "restrict_pose6",
           "POSE_GROUPS", "affine_matrix",
           "rotation_matrix", "translation_matrix", "pixels_to_normalised"]


def pose6_to_matrix(y: torch.Tensor) -> torch.Tensor:
    """``(..., 6) -> (..., 3, 3)``: ``P(y)`` with the identity added."""
    if y.shape[-1] != 6:
        raise ValueError(f"pose6_to_matrix: last dimension must be 6, got shape {tuple(y.shape)}")
    return F.pad(y, (0, 3)).unflatten(-1, (3, 3)) + torch.eye(3, dtype=y.dtype, device=y.device)


def matrix_to_pose6(P: torch.Tensor) -> torch.Tensor:
    """``(..., 3, 3) -> (..., 6)``: the inverse of :func:`pose6_to_matrix` (the last row is ignored)."""
    if P.shape[-2:] != (3, 3):
        raise ValueError(f"matrix_to_pose6: expected (..., 3, 3), got shape {tuple(P.shape)}")
    return P[..., :2, :].reshape(*P.shape[:-2], 6) - P.new_tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])


def compose(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A ∘ B`` for ``(..., 3, 3)`` affine matrices: apply ``B`` first, then ``A``."""
    return A @ B


def compose_pose6(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``pose6(P(a) P(b))`` for 6-vectors, without building matrices: ``(..., 6), (..., 6) -> (..., 6)``."""
    eye = a.new_tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    (a11, a12, a13, a21, a22, a23), (b11, b12, b13, b21, b22, b23) = (a + eye).unbind(-1), (b + eye).unbind(-1)
    return torch.stack([a11 * b11 + a12 * b21 - 1, a11 * b12 + a12 * b22, a11 * b13 + a12 * b23 + a13,
                        a21 * b11 + a22 * b21, a21 * b12 + a22 * b22 - 1, a21 * b13 + a22 * b23 + a23], -1)


POSE_GROUPS = ("affine", "similarity")


def restrict_pose6(y: torch.Tensor, group: str) -> torch.Tensor:
    """The part of pose 6-vectors ``(..., 6)`` that lies in a subgroup of the affine maps, ``(..., 6)``; coordinates
    past the sixth (an object's code, ``(..., 6 + D)``) pass through unchanged.

    ``"affine"``: ``y`` itself; ``"similarity"``: the nearest rotation-and-scale linear part (the orthogonal
    projection of ``[[1 + y1, y2], [y4, 1 + y5]]`` onto matrices ``[[a, -b], [b, a]]``) and the translation.
    A projection: applying it twice changes nothing.
    """
    if group == "affine":
        return y
    if group == "similarity":
        a11, a12, tx, a21, a22, ty = y[..., :6].unbind(-1)
        scale, turn = (a11 + a22) / 2, (a21 - a12) / 2  # a − 1 and b (pose 6-vectors hold P minus the identity)
        pose = torch.stack([scale, -turn, tx, turn, scale, ty], -1)
        return torch.cat([pose, y[..., 6:]], -1) if y.shape[-1] > 6 else pose  # no copy on the training path
    raise ValueError(f"restrict_pose6: group must be one of {', '.join(POSE_GROUPS)}, got {group!r}")


def determinant(P: torch.Tensor) -> torch.Tensor:
    """Determinant of the linear part of ``(..., 3, 3)`` affine matrices: ``(...)`` (the area scale of the map)."""
    return P[..., 0, 0] * P[..., 1, 1] - P[..., 0, 1] * P[..., 1, 0]


def invert(P: torch.Tensor, min_abs_det: float = 0.0) -> torch.Tensor:
    """Inverse of ``(..., 3, 3)`` affine matrices (closed form for the 2x2 block; no general solve).

    ``min_abs_det > 0`` keeps the determinant at least that far from zero (sign kept, zero counts as positive), so
    a singular or nearly singular map inverts to large finite entries instead of ``inf``/``NaN``.
    """
    (a, b, c), (d, e, f) = P[..., 0, :].unbind(-1), P[..., 1, :].unbind(-1)
    det = determinant(P)
    if min_abs_det > 0:
        det = torch.where(det < 0, det.clamp_max(-min_abs_det), det.clamp_min(min_abs_det))
    ia, ib, id_, ie = e / det, -b / det, -d / det, a / det
    return _affine(ia, ib, -(ia * c + ib * f), id_, ie, -(id_ * c + ie * f))


def _affine(*entries: torch.Tensor) -> torch.Tensor:
    """``(..., 3, 3)`` affine matrices from the ``(...)`` entries ``m00, m01, m02, m10, m11, m12`` of their top rows."""
    top = torch.stack(entries, -1).unflatten(-1, (2, 3))
    return torch.cat([top, top.new_tensor([0.0, 0.0, 1.0]).expand(*top.shape[:-2], 1, 3)], -2)


def affine_matrix(scale_x: torch.Tensor, scale_y: torch.Tensor, theta: torch.Tensor, shear: torch.Tensor,
                  tx: torch.Tensor, ty: torch.Tensor) -> torch.Tensor:
    """Matrix ``T(tx, ty) R(theta) Sh(shear) S(scale_x, scale_y)`` (each argument ``(...)``) -> ``(..., 3, 3)``.

    The same factorisation SCAE uses to constrain part poses.
    """
    c, s = torch.cos(theta), torch.sin(theta)
    # R @ Sh @ S with Sh = [[1, shear], [0, 1]]
    return _affine(c * scale_x, (c * shear - s) * scale_y, tx, s * scale_x, (s * shear + c) * scale_y, ty)


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
    tx, ty = torch.broadcast_tensors(tx, torch.as_tensor(ty, dtype=tx.dtype, device=tx.device))
    one, zero = torch.ones_like(tx), torch.zeros_like(tx)
    return _affine(one, zero, tx, zero, one, ty)


def pixels_to_normalised(pixels: float | torch.Tensor, size: int):
    """A length in pixels on a canvas of ``size`` pixels, in normalised units (``[-1, 1]`` spans the canvas)."""
    return pixels * (2.0 / size)


def degrees(angle_deg) -> torch.Tensor:
    """Degrees to radians as a tensor."""
    return _as_float_tensor(angle_deg) * (math.pi / 180.0)


def constrained_pose(raw: torch.Tensor, min_scale: float = 0.3, max_scale: float = 2.0, max_shear: float = 0.5,
                     max_translation: float = 1.0) -> torch.Tensor:
    """Squash unconstrained ``(..., 6)`` network outputs into a plausible pose, returned as a pose 6-vector.

    SCAE's recipe: scales through a sigmoid into ``[min_scale, max_scale]``, shear and translation through
    ``tanh``, rotation unconstrained.  ``raw = (sx, sy, theta, shear, tx, ty)``.
    """
    sx, sy = (min_scale + (max_scale - min_scale) * torch.sigmoid(raw[..., :2])).unbind(-1)
    limits = raw.new_tensor([max_shear, max_translation, max_translation])
    shear, tx, ty = (torch.tanh(raw[..., 3:]) * limits).unbind(-1)
    return matrix_to_pose6(affine_matrix(sx, sy, raw[..., 2], shear, tx, ty))
