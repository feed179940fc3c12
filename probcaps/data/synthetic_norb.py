"""A synthetic smallNORB stand-in (the real set cannot be fetched on these machines): five classes of 3-D toys,
ray-cast with shading at controlled viewpoints, as a :class:`~probcaps.data.smallnorb.NorbSet` with smallNORB's
metadata and splits.

- classes: animal, human, airplane, truck, car, each 4 to 7 axis-aligned ellipsoids (variant ``"toys"``), or 6 to 8
  with a distinct front, back and sides (``"asymmetric"``, :data:`VARIANTS`); object frame x forward, y left, z up;
- 10 instances per class (0-4 train, 5-9 test, disjoint as smallNORB's toys): part radii scaled by [0.75, 1.25] per
  axis, centres moved by N(0, 0.04^2) per axis, the object scaled by [0.85, 1.1], albedo in [0.6, 1.0];
- azimuth 0..340 step 20 (0 looks at the front), elevation 30..70 step 5, 3 lightings (:data:`LIGHTS`: a light
  fixed relative to the camera, Lambertian shading plus ambient, black background);
- orthographic 48 x 48 pixels over [-1.15, 1.15] object units, 2 x 2 supersampled; uint8.

5 x 10 x 18 x 9 x 3 = 24,300 images, cached under ``~/.cache/probcaps/synthetic_norb/`` (or ``<data
dir>/synthetic_norb/``), keyed by the generator's parameters and seed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from ..checkpoints import read_plain, save_checkpoint
from ..errors import CheckpointError, DataError
from ..geometry import degrees
from .loaders import seeded_generator
from .mnist import user_cache_dir
from .smallnorb import NORB_CLASSES, NorbSet

__all__ = ["SYNTHETIC_NORB_VERSION", "VARIANTS", "class_parts", "render_views", "synthetic_norb", "AZIMUTHS",
           "ELEVATIONS_DEG", "LIGHTS"]

SYNTHETIC_NORB_VERSION = 1
AZIMUTHS = tuple(range(0, 360, 20))
ELEVATIONS_DEG = tuple(range(30, 75, 5))
#: (light direction in camera coordinates (right, up, towards the camera), ambient)
LIGHTS = (((-0.6, 0.6, 0.55), 0.15), ((0.6, 0.5, 0.6), 0.25), ((0.0, 0.8, 0.6), 0.2))
_EXTENT = 1.15

# (centre xyz, radii xyz) of each part, per class, in the object frame (x forward, y left, z up)
_PARTS = {
    "animal": [((0.0, 0.0, 0.05), (0.6, 0.22, 0.22)), ((0.72, 0.0, 0.32), (0.2, 0.13, 0.14)),
               ((0.4, 0.15, -0.38), (0.07, 0.07, 0.3)), ((0.4, -0.15, -0.38), (0.07, 0.07, 0.3)),
               ((-0.4, 0.15, -0.38), (0.07, 0.07, 0.3)), ((-0.4, -0.15, -0.38), (0.07, 0.07, 0.3)),
               ((-0.78, 0.0, 0.2), (0.22, 0.04, 0.04))],
    "human": [((0.0, 0.0, 0.12), (0.12, 0.22, 0.33)), ((0.0, 0.0, 0.6), (0.13, 0.12, 0.15)),
              ((0.0, 0.1, -0.52), (0.08, 0.08, 0.36)), ((0.0, -0.1, -0.52), (0.08, 0.08, 0.36)),
              ((0.05, 0.31, 0.08), (0.07, 0.07, 0.32)), ((0.05, -0.31, 0.08), (0.07, 0.07, 0.32))],
    "airplane": [((0.0, 0.0, 0.0), (0.95, 0.12, 0.12)), ((0.08, 0.0, 0.0), (0.2, 0.9, 0.03)),
                 ((-0.78, 0.0, 0.2), (0.13, 0.02, 0.22)), ((-0.8, 0.0, 0.04), (0.1, 0.32, 0.02))],
    "truck": [((0.6, 0.0, 0.02), (0.24, 0.34, 0.33)), ((-0.22, 0.0, 0.12), (0.62, 0.38, 0.42)),
              ((0.6, 0.36, -0.33), (0.16, 0.07, 0.16)), ((0.6, -0.36, -0.33), (0.16, 0.07, 0.16)),
              ((-0.5, 0.36, -0.33), (0.16, 0.07, 0.16)), ((-0.5, -0.36, -0.33), (0.16, 0.07, 0.16))],
    "car": [((0.0, 0.0, -0.08), (0.85, 0.38, 0.18)), ((-0.08, 0.0, 0.14), (0.42, 0.32, 0.17)),
            ((0.52, 0.37, -0.24), (0.17, 0.06, 0.17)), ((0.52, -0.37, -0.24), (0.17, 0.06, 0.17)),
            ((-0.52, 0.37, -0.24), (0.17, 0.06, 0.17)), ((-0.52, -0.37, -0.24), (0.17, 0.06, 0.17))],
}


# "asymmetric": distinct fronts, backs and sides, as real toys have.  The "toys" are nearly symmetric front to
# back, so a view from behind looks like a familiar view and novel azimuths are barely novel.
_PARTS_ASYMMETRIC = {
    "animal": [((0.0, 0.0, 0.0), (0.5, 0.2, 0.2)), ((0.45, 0.0, 0.32), (0.1, 0.09, 0.3)),
               ((0.62, 0.0, 0.62), (0.22, 0.09, 0.1)),
               ((0.33, 0.12, -0.4), (0.07, 0.07, 0.3)), ((0.33, -0.12, -0.4), (0.07, 0.07, 0.3)),
               ((-0.33, 0.12, -0.4), (0.07, 0.07, 0.3)), ((-0.33, -0.12, -0.4), (0.07, 0.07, 0.3)),
               ((-0.62, 0.0, 0.1), (0.16, 0.03, 0.03))],
    "human": [((0.0, 0.0, 0.12), (0.12, 0.22, 0.33)), ((0.0, 0.0, 0.6), (0.13, 0.12, 0.15)),
              ((0.0, 0.1, -0.52), (0.08, 0.08, 0.36)), ((0.0, -0.1, -0.52), (0.08, 0.08, 0.36)),
              ((0.28, 0.28, 0.3), (0.3, 0.07, 0.07)), ((0.28, -0.28, 0.3), (0.3, 0.07, 0.07)),
              ((0.1, 0.1, -0.88), (0.16, 0.06, 0.04)), ((0.1, -0.1, -0.88), (0.16, 0.06, 0.04))],
    "airplane": [((0.0, 0.0, 0.0), (0.95, 0.11, 0.11)), ((0.3, 0.0, 0.0), (0.2, 0.9, 0.03)),
                 ((-0.8, 0.0, 0.05), (0.1, 0.32, 0.02)), ((-0.78, 0.0, 0.3), (0.15, 0.02, 0.3)),
                 ((0.35, 0.45, -0.12), (0.2, 0.07, 0.07)), ((0.35, -0.45, -0.12), (0.2, 0.07, 0.07))],
    "truck": [((0.6, 0.0, 0.15), (0.22, 0.34, 0.45)), ((-0.25, 0.0, -0.1), (0.62, 0.36, 0.12)),
              ((-0.45, 0.0, 0.12), (0.3, 0.3, 0.18)),
              ((0.6, 0.36, -0.33), (0.16, 0.07, 0.16)), ((0.6, -0.36, -0.33), (0.16, 0.07, 0.16)),
              ((-0.5, 0.36, -0.33), (0.16, 0.07, 0.16)), ((-0.5, -0.36, -0.33), (0.16, 0.07, 0.16))],
    "car": [((0.0, 0.0, -0.08), (0.85, 0.38, 0.18)), ((-0.25, 0.0, 0.16), (0.4, 0.32, 0.17)),
            ((-0.8, 0.0, 0.2), (0.05, 0.36, 0.03)),
            ((0.52, 0.37, -0.24), (0.17, 0.06, 0.17)), ((0.52, -0.37, -0.24), (0.17, 0.06, 0.17)),
            ((-0.52, 0.37, -0.24), (0.17, 0.06, 0.17)), ((-0.52, -0.37, -0.24), (0.17, 0.06, 0.17))],
}
VARIANTS = {"toys": _PARTS, "asymmetric": _PARTS_ASYMMETRIC}


def _parts(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"synthetic_norb: variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    return VARIANTS[variant]


def class_parts(variant: str = "toys") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Part tables of the 5 classes: centres ``(5, P, 3)``, radii ``(5, P, 3)``, mask ``(5, P)`` (``P``: the most
    parts of any class, 7 for ``"toys"``)."""
    classes = [_parts(variant)[name] for name in NORB_CLASSES]
    pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True)  # to the class with the most parts
    centres = pad([torch.tensor([p[0] for p in parts]) for parts in classes])
    radii = pad([torch.tensor([p[1] for p in parts]) for parts in classes], padding_value=1.0)  # 1 where unused
    return centres, radii, pad([torch.ones(len(parts), dtype=torch.bool) for parts in classes])


def _instances(seed: int, per_class: int = 10, variant: str = "toys"):
    """Per (class, instance): part centres, radii ``(5, I, P, 3)``, mask ``(5, I, P)``, albedo ``(5, I)``."""
    g = seeded_generator("synthetic_norb_instances", seed)
    centres, radii, mask = class_parts(variant)
    P = mask.shape[1]
    shape = (5, per_class, P, 3)
    scale = 0.85 + 0.25 * torch.rand(5, per_class, 1, 1, generator=g)
    radii = radii[:, None] * (0.75 + 0.5 * torch.rand(shape, generator=g)) * scale
    centres = (centres[:, None] + 0.04 * torch.randn(shape, generator=g)) * scale
    albedo = 0.6 + 0.4 * torch.rand(5, per_class, generator=g)
    return centres, radii, mask[:, None].expand(5, per_class, P), albedo


def _camera(azimuth_deg: torch.Tensor, elevation_deg: torch.Tensor):
    """Orthonormal camera axes in the object frame, each ``(B, 3)``: right, up, and the direction towards the
    camera."""
    phi, theta = degrees(azimuth_deg.float()), degrees(elevation_deg.float())
    towards = torch.stack([theta.cos() * phi.cos(), theta.cos() * phi.sin(), theta.sin()], -1)
    right = torch.stack([-phi.sin(), phi.cos(), torch.zeros_like(phi)], -1)
    up = torch.cross(towards, right, dim=-1)
    return right, up, towards


def render_views(centres: torch.Tensor, radii: torch.Tensor, mask: torch.Tensor, albedo: torch.Tensor,
                 azimuth: torch.Tensor, elevation: torch.Tensor, lighting: torch.Tensor, size: int = 48,
                 supersample: int = 2) -> torch.Tensor:
    """Ray-cast ``B`` objects made of ellipsoids: float ``(B, size, size)`` in [0, 1].

    ``centres``, ``radii``: ``(B, P, 3)`` axis-aligned ellipsoids in the object frame; ``mask``: ``(B, P)`` parts in
    use; ``albedo``: ``(B,)``; ``azimuth``, ``elevation``: ``(B,)`` degrees; ``lighting``: ``(B,)`` index into
    :data:`LIGHTS`.  Orthographic rays along ``-towards``, the nearest hit per pixel, Lambertian shading
    ``albedo * max(0, n . l) + ambient`` with the light fixed in camera coordinates."""
    B = centres.shape[0]
    n = size * supersample
    right, up, towards = _camera(azimuth, elevation)
    coords = (torch.arange(n, dtype=torch.float32) + 0.5) / n * 2 - 1
    u = coords[None, :] * _EXTENT                    # screen x (right)
    v = -coords[:, None] * _EXTENT                   # screen y (up); image rows go down
    # ray origins (B, n*n, 3) on a plane 3 units towards the camera; direction -towards
    origin = (u[..., None, None] * right[None, None] + v[..., None, None] * up[None, None]).permute(2, 0, 1, 3)
    origin = origin.reshape(B, n * n, 3) + 3.0 * towards[:, None]
    direction = -towards                                                     # (B, 3)
    o = (origin[:, None] - centres[:, :, None]) / radii[:, :, None]          # (B, P, n*n, 3) in unit-sphere space
    d = direction[:, None, None] / radii[:, :, None]                         # (B, P, 1, 3)
    a = (d * d).sum(-1)
    b = 2 * (o * d).sum(-1)
    c = (o * o).sum(-1) - 1
    disc = b * b - 4 * a * c
    hit = (disc > 0) & mask[:, :, None]
    t = (-b - disc.clamp_min(0).sqrt()) / (2 * a)
    t = torch.where(hit, t, torch.full_like(t, float("inf")))
    t_near, part = t.min(1)                                                  # (B, n*n)
    covered = torch.isfinite(t_near)
    # normal of the hit ellipsoid at the hit point: (x - centre) / radii^2
    idx = part[..., None].expand(B, n * n, 3)
    ctr, rad = centres.gather(1, idx), radii.gather(1, idx)
    point = origin + t_near.clamp(max=10.0)[..., None] * direction[:, None]
    normal = (point - ctr) / rad ** 2
    normal = normal / normal.norm(dim=-1, keepdim=True).clamp_min(1e-9)
    light_dirs = torch.tensor([l for l, _ in LIGHTS])[lighting]             # camera coordinates
    ambient = torch.tensor([amb for _, amb in LIGHTS])[lighting]
    light = light_dirs[:, 0:1] * right + light_dirs[:, 1:2] * up + light_dirs[:, 2:3] * towards
    light = light / light.norm(dim=-1, keepdim=True)
    shade = albedo[:, None] * (normal * light[:, None]).sum(-1).clamp_min(0) + ambient[:, None]
    image = torch.where(covered, shade.clamp(0, 1), torch.zeros_like(shade)).view(B, n, n)
    if supersample > 1:
        image = torch.nn.functional.avg_pool2d(image[:, None], supersample)[:, 0]
    return image


def _cache_key(seed: int, size: int, variant: str = "toys") -> str:
    spec = {"version": SYNTHETIC_NORB_VERSION, "seed": seed, "size": size, "parts": _parts(variant),
            "lights": LIGHTS, "extent": _EXTENT}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def synthetic_norb(split: str, data_dir: str | os.PathLike | None = None, seed: int = 0, size: int = 48,
                   cache: bool = True, chunk: int = 96, instances_per_split: int = 5, elevations: int = 9,
                   lightings: int = 3, variant: str = "toys") -> NorbSet:
    """The synthetic set's ``"train"`` (instances 0-4) or ``"test"`` (instances 5-9) split: 5 classes x 5
    instances x 18 azimuths x 9 elevations x 3 lightings = 12,150 images of ``size x size`` (uint8).

    ``instances_per_split``, ``elevations`` and ``lightings`` (the first N of each) make smaller sets for tests and
    smoke runs; ``variant``: ``"toys"`` or ``"asymmetric"`` (:data:`VARIANTS`).  The full set is cached as
    ``<key>_<split>.pt`` (:func:`_cache_dirs`); every set is also kept in memory for the rest of the process
    (``cache=False`` renders afresh and stores nothing)."""
    if split not in ("train", "test"):
        raise ValueError(f"synthetic_norb: split must be 'train' or 'test', got {split!r}")
    if not (1 <= instances_per_split <= 5 and 1 <= elevations <= len(ELEVATIONS_DEG) and 1 <= lightings <= 3):
        raise ValueError(f"synthetic_norb: instances_per_split must be in 1..5, elevations in 1..9 and lightings in "
                         f"1..3, got {instances_per_split}, {elevations}, {lightings}")
    full = instances_per_split == 5 and elevations == len(ELEVATIONS_DEG) and lightings == len(LIGHTS)
    memo_key = (split, seed, size, instances_per_split, elevations, lightings, variant)
    if cache and memo_key in _MEMO:
        return _MEMO[memo_key]
    name = f"{_cache_key(seed, size, variant)}_{split}.pt"
    path = next((p / name for p in _cache_dirs(data_dir) if (p / name).is_file()), None)
    if cache and full and path is not None:
        try:
            data = NorbSet(**read_plain(path))  # tensors only: a crafted cache file runs no code
        except (CheckpointError, TypeError) as e:
            raise DataError(f"{path}: unreadable synthetic_norb cache ({e}); delete it") from None
    else:
        centres, radii, mask, albedo = _instances(seed, variant=variant)
        first = 0 if split == "train" else 5
        grid = torch.meshgrid(torch.arange(5), torch.arange(first, first + instances_per_split),
                              torch.tensor(AZIMUTHS), torch.tensor(ELEVATIONS_DEG[:elevations]),
                              torch.arange(lightings), indexing="ij")
        cls, inst, az, el, light = (g.reshape(-1) for g in grid)
        images = torch.empty(cls.shape[0], size, size, dtype=torch.uint8)
        for start in range(0, cls.shape[0], chunk):  # chunks of images (bounded memory), vectorised within
            s = slice(start, start + chunk)
            obj = (cls[s], inst[s])
            img = render_views(centres[obj], radii[obj], mask[obj], albedo[obj], az[s], el[s], light[s], size=size)
            images[s] = (img * 255).round().to(torch.uint8)
        data = NorbSet(images, cls, inst, az, el, light)
        for folder in _cache_dirs(data_dir) if cache and full else ():
            with contextlib.suppress(OSError):  # a read-only data root: try the user cache
                save_checkpoint(vars(data), folder / name)
                break
    if cache:  # the same process asking again (e.g. an experiment's report) gets the same tensors
        _MEMO[memo_key] = data
    return data


_MEMO: dict[tuple, NorbSet] = {}


def _cache_dirs(data_dir) -> list[Path]:
    """Where the rendered set is cached: an explicit ``data_dir``, else the user cache (``~/.cache/probcaps``); not
    ``$PROBCAPS_DATA``, a data root that may be shared or read-only and holds downloaded sets only."""
    folders = [Path(data_dir).expanduser()] if str(data_dir or "") else []
    return list(dict.fromkeys(folder / "synthetic_norb" for folder in folders + [user_cache_dir()]))
