"""affNIST: the original ``.mat`` files, and the "affNIST-recipe" stand-in generated from MNIST test digits.

The real affNIST (Tieleman 2013) cannot be fetched on the machines this package is developed on, so the
experiments use a stand-in built with its recipe: each MNIST test digit on a 40×40 canvas under a random affine map
(rotation within ±20°, shear within ±0.2, x and y scales within [0.8, 1.2]), then a random translation that keeps
the digit inside the canvas.  Results on it are reported as "affNIST-recipe", never as affNIST.  Users with the
real files load them with :func:`load_affnist_mat`.

The original files (``test.mat``, ``training_and_validation.mat``, or the batches ``1.mat`` …) are MATLAB v5 files
holding one struct ``affNISTdata`` whose field ``image`` is ``1600 × N`` uint8 (column ``n`` is image ``n``, its 40×40
pixels in row-major order) and ``label_int`` is ``N`` labels in 0..9.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..geometry import affine_matrix, degrees, pixels_to_normalised, translation_matrix
from ..io import atomic_write
from ..render import warp
from .loaders import seeded_generator
from .mnist import load_mnist, user_cache_dir
from .multimnist import bounding_boxes

__all__ = ["AFFNIST_RECIPE", "load_affnist_mat", "write_affnist_mat", "affnist_recipe_transform",
           "affnist_recipe", "affnist_recipe_test", "user_cache_dir"]

AFFNIST_SIDE = 40
#: Tieleman's recipe (the ranges of the random affine map applied to each digit)
AFFNIST_RECIPE = {"rotation_deg": 20.0, "shear": 0.2, "scale_min": 0.8, "scale_max": 1.2, "canvas": AFFNIST_SIDE}


def load_affnist_mat(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """Read an original affNIST ``.mat`` file: ``(images uint8 (N, 40, 40), labels int64 (N,))``.

    Raises :class:`DataError` naming the file when it is missing, not a MATLAB file, or not laid out as affNIST.
    """
    import scipy.io

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: affNIST file not found")
    try:
        mat = scipy.io.loadmat(path, squeeze_me=True, struct_as_record=True)
    except Exception as e:  # scipy raises several types for a corrupt or non-MATLAB file
        raise DataError(f"{path}: not a readable MATLAB .mat file ({type(e).__name__}: {e})") from None
    if "affNISTdata" not in mat:
        keys = sorted(k for k in mat if not k.startswith("__"))
        raise DataError(f"{path}: no 'affNISTdata' struct (variables: {keys})")
    data = mat["affNISTdata"]
    fields = data.dtype.names or ()
    for field in ("image", "label_int"):
        if field not in fields:
            raise DataError(f"{path}: affNISTdata has no field '{field}' (fields: {list(fields)})")
    image, labels = (np.asarray(data[k].item() if data.shape == () else data[k]) for k in ("image", "label_int"))
    labels = labels.reshape(-1)
    if image.ndim == 1:  # squeeze_me turns a single image into a vector
        image = image[:, None]
    if image.ndim != 2 or image.shape[0] != AFFNIST_SIDE**2:
        raise DataError(f"{path}: affNISTdata.image must be 1600 x N (40x40 images as columns), got shape "
                        f"{image.shape}")
    if labels.shape[0] != image.shape[1]:
        raise DataError(f"{path}: {image.shape[1]} images but {labels.shape[0]} labels")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path}: labels outside 0..9 (min {labels.min()}, max {labels.max()})")
    images = np.ascontiguousarray(image.T.reshape(-1, AFFNIST_SIDE, AFFNIST_SIDE)).astype(np.uint8, copy=False)
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def write_affnist_mat(path: str | os.PathLike, images, labels) -> Path:
    """Write ``images (N, 40, 40)`` uint8 and ``labels (N,)`` in the original affNIST layout (for tests and users)."""
    import scipy.io

    images = np.asarray(images, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.uint8).reshape(-1)
    n = images.shape[0]
    one_of_n = np.zeros((10, n), np.uint8)
    one_of_n[labels, np.arange(n)] = 1
    struct = {"image": images.reshape(n, -1).T, "label_int": labels, "label_one_of_n": one_of_n}
    return atomic_write(path, lambda f: scipy.io.savemat(f, {"affNISTdata": struct}))


def affnist_recipe_transform(digits: torch.Tensor, generator: torch.Generator, recipe: dict = AFFNIST_RECIPE):
    """Random affNIST-recipe maps for ``digits (N, h, w)``: ``(P (N, 3, 3) digit -> canvas, params (N, 6))``.

    The affine part (scales, rotation, shear) is drawn first; the translation is then uniform over the range that
    keeps the digit's transformed ink bounding box inside the canvas (0 if the box does not fit).  ``params`` are
    ``(scale_x, scale_y, rotation_rad, shear, tx, ty)``, translations in normalised canvas units.
    """
    n, h, w = digits.shape
    C = recipe["canvas"]
    u = torch.rand(n, 6, generator=generator, dtype=torch.float64).float()
    lo, hi = recipe["scale_min"], recipe["scale_max"]
    sx, sy = lo + (hi - lo) * u[:, 0], lo + (hi - lo) * u[:, 1]
    theta = degrees((2 * u[:, 2] - 1) * recipe["rotation_deg"])
    shear = (2 * u[:, 3] - 1) * recipe["shear"]
    zero = torch.zeros(n)
    A = affine_matrix(sx, sy, theta, shear, zero, zero)                     # about the canvas centre
    # the ink's bounding box, as pixel edges around the digit's centre, in canvas units (warp: native pixel size)
    box = bounding_boxes(digits)
    box = torch.where(box[:, 1:2] == 0, torch.tensor([h // 2, h // 2, w // 2, w // 2]), box)  # empty: the centre
    r0, r1, c0, c1 = box.unbind(1)
    xs = pixels_to_normalised(torch.stack([c0, c1, c0, c1], 1).float() - w / 2, C)  # (N, 4) corners
    ys = pixels_to_normalised(torch.stack([r0, r0, r1, r1], 1).float() - h / 2, C)
    corners = torch.stack([A[:, i, :1] * xs + A[:, i, 1:2] * ys for i in (0, 1)], -1)  # (N, 4, (x, y))
    # translations keeping [min, max] of the corners inside [-1, 1]
    lo, hi = -1 - corners.amin(1), 1 - corners.amax(1)  # (N, 2)
    tx, ty = torch.where(hi > lo, lo + (hi - lo) * u[:, 4:], 0.0).unbind(1)
    P = translation_matrix(tx, ty) @ A
    return P, torch.stack([sx, sy, theta, shear, tx, ty], 1)


def affnist_recipe(digits: torch.Tensor, seed: int = 0, recipe: dict = AFFNIST_RECIPE,
                   batch_size: int = 2000) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the affNIST recipe to uint8 ``digits (N, 28, 28)``: ``(images uint8 (N, 40, 40), params (N, 6))``.

    Deterministic in ``seed``.  Rendering uses the package's one warp (bilinear), in chunks of ``batch_size``.
    """
    if digits.dim() != 3 or digits.dtype != torch.uint8:
        raise ValueError(f"affnist_recipe: digits must be uint8 (N, h, w), got {digits.dtype} {tuple(digits.shape)}")
    P, params = affnist_recipe_transform(digits, seeded_generator("affnist_recipe", seed), recipe)
    C = recipe["canvas"]
    out = torch.empty(len(digits), C, C, dtype=torch.uint8)
    for i in range(0, len(digits), batch_size):
        sl = slice(i, i + batch_size)
        x = digits[sl].float().div(255).unsqueeze(1)
        out[sl] = warp(x, P[sl], C)[:, 0].clamp(0, 1).mul(255).round().to(torch.uint8)
    return out, params


def affnist_recipe_test(data_dir: str | os.PathLike | None = None, seed: int = 0, cache_dir=None,
                        limit: int | None = None, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The affNIST-recipe stand-in of the 10,000 MNIST test digits: ``(images uint8 (N, 40, 40), labels (N,))``.

    Generated once per ``seed`` and cached in ``cache_dir`` (default: the user cache, ``~/.cache/probcaps/
    affnist_recipe/``, not the data root, which may be shared or read-only); a cached file is checked against its
    recorded sha1 and regenerated if it does not match.
    """
    digits, labels = load_mnist("test", data_dir, verify=verify)
    cache = Path(cache_dir) if cache_dir is not None else user_cache_dir() / "affnist_recipe"
    key = hashlib.sha1(repr((seed, sorted(AFFNIST_RECIPE.items()), "v1")).encode()).hexdigest()[:10]
    path = cache / f"affnist_recipe_test_{key}.npz"
    images = None
    with contextlib.suppress(Exception):  # no cache yet, or an unreadable one: generate below
        with np.load(path, allow_pickle=False) as f:  # an object array in it is refused, never unpickled
            arr, digest = f["images"], str(f["sha1"])
        if hashlib.sha1(arr.tobytes()).hexdigest() == digest and arr.shape == (len(digits), 40, 40):
            images = torch.from_numpy(arr)
    if images is None:
        images, _ = affnist_recipe(digits, seed)
        arr, digest = images.numpy(), hashlib.sha1(images.numpy().tobytes()).hexdigest()
        with contextlib.suppress(OSError):  # a read-only cache folder: use the images without caching them
            atomic_write(path, lambda f: np.savez_compressed(f, images=arr, sha1=digest))
    return images[:limit or None], labels[:limit or None]
