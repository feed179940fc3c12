"""Figures: templates, reconstructions with coloured parts, curves and generic image grids.

Uses ``matplotlib.figure.Figure`` with an explicit ``FigureCanvasAgg`` so no global backend is
selected (callers' ``matplotlib.use(...)`` / pyplot state is untouched) and nothing needs a display.
Every plotting function writes a PNG atomically (``probcaps.io.atomic_write``) and returns its path.
Inputs may be numpy arrays or torch tensors.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .io import atomic_write

__all__ = [
    "PART_PALETTE",
    "plot_templates",
    "colour_parts",
    "plot_reconstructions",
    "plot_curves",
    "plot_image_grid",
]

# A fixed qualitative palette (matplotlib's tab10 followed by its light tab20 companions), RGB in [0, 1].
PART_PALETTE = np.array(
    [
        (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C), (0xD6, 0x27, 0x28),
        (0x94, 0x67, 0xBD), (0x8C, 0x56, 0x4B), (0xE3, 0x77, 0xC2), (0x7F, 0x7F, 0x7F),
        (0xBC, 0xBD, 0x22), (0x17, 0xBE, 0xCF), (0xAE, 0xC7, 0xE8), (0xFF, 0xBB, 0x78),
        (0x98, 0xDF, 0x8A), (0xFF, 0x98, 0x96), (0xC5, 0xB0, 0xD5), (0xC4, 0x9C, 0x94),
        (0xF7, 0xB6, 0xD2), (0xC7, 0xC7, 0xC7), (0xDB, 0xDB, 0x8D), (0x9E, 0xDA, 0xE5),
    ],
    dtype=np.float64,
) / 255.0

_DPI = 100
_CELL_IN = 1.1  # inches per image cell
_MAX_FIG_IN = 40.0  # cap on either figure dimension


# --------------------------------------------------------------------------- helpers


def _to_numpy(x: Any, name: str) -> np.ndarray:
    if x is None:
        raise ValueError(f"{name} must not be None")
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"{name} must be numeric, got dtype={arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _images(x: Any, name: str, lead_dims: int) -> np.ndarray:
    """Array of ``lead_dims`` leading dims followed by (H, W) or (H, W, 3); a singleton channel
    dim right after the leading dims, (..., 1, H, W), is squeezed away."""
    arr = _to_numpy(x, name)
    if arr.ndim == lead_dims + 3 and arr.shape[lead_dims] == 1:
        arr = arr.reshape(arr.shape[:lead_dims] + arr.shape[lead_dims + 1 :])
    ok = arr.ndim == lead_dims + 2 or (arr.ndim == lead_dims + 3 and arr.shape[-1] in (3, 4))
    if not ok:
        lead = "N" if lead_dims == 1 else "R, C"
        raise ValueError(
            f"{name} must have shape ({lead}, H, W), ({lead}, 1, H, W) or ({lead}, H, W, 3); got {arr.shape}"
        )
    if any(s == 0 for s in arr.shape):
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    return arr


def _new_figure(width_in: float, height_in: float) -> Figure:
    scale = min(1.0, _MAX_FIG_IN / max(width_in, height_in, 1e-9))
    fig = Figure(figsize=(max(width_in * scale, 1.0), max(height_in * scale, 1.0)), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | os.PathLike) -> Path:
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=_DPI), mode="wb")


def _show(ax, img: np.ndarray, vmin: float | None = None, vmax: float | None = None) -> None:
    if img.ndim == 3:  # colour image
        ax.imshow(np.clip(img, 0.0, 1.0), interpolation="nearest")
    else:
        if vmin is None or vmax is None:
            finite = img[np.isfinite(img)]
            lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
            if lo >= 0.0 and hi <= 1.0:  # the usual case: intensities / alphas in [0, 1]
                lo, hi = 0.0, 1.0
            elif hi <= lo:
                hi = lo + 1.0
            vmin, vmax = lo, hi
        ax.imshow(img, cmap="gray", vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


def _blank(ax) -> None:
    ax.set_axis_off()


# --------------------------------------------------------------------------- templates


def plot_templates(
    templates: Any,
    path: str | os.PathLike,
    alphas: Any = None,
    ncols: int | None = None,
    title: str | None = None,
) -> Path:
    """Grid of ``(M, t, t)`` or ``(M, 1, t, t)`` templates; ``alphas`` (same shape) as a second row block."""
    T = _images(templates, "templates", 1)
    M = T.shape[0]
    A = None
    if alphas is not None:
        A = _images(alphas, "alphas", 1)
        if A.shape[0] != M:
            raise ValueError(f"alphas has {A.shape[0]} entries but templates has {M}")
    if ncols is None:
        ncols = min(M, 10)
    ncols = int(ncols)
    if ncols < 1:
        raise ValueError(f"ncols must be >= 1, got {ncols}")
    ncols = min(ncols, M)
    nrows_block = math.ceil(M / ncols)
    blocks = [("template", T)] + ([("alpha", A)] if A is not None else [])
    nrows = nrows_block * len(blocks)

    fig = _new_figure(ncols * _CELL_IN, nrows * _CELL_IN + (0.4 if title else 0.0))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for b, (label, data) in enumerate(blocks):
        for k in range(nrows_block * ncols):
            r, c = b * nrows_block + k // ncols, k % ncols
            ax = axes[r][c]
            if k < M:
                _show(ax, data[k])
                ax.set_title(f"{label} {k}", fontsize=7)
            else:
                _blank(ax)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- coloured parts


def colour_parts(weights: Any, colours: Any = None) -> np.ndarray:
    """Colour each part's contribution: ``(N, M, H, W)`` weights -> ``(N, H, W, 3)`` RGB in [0, 1].

    ``weights[n, m]`` is part ``m``'s contribution to image ``n`` (compositing weight times template
    intensity). Part ``m`` gets ``colours[m % len(colours)]`` (default :data:`PART_PALETTE`); the
    coloured contributions are summed and clipped to [0, 1].
    """
    W = _to_numpy(weights, "weights")
    if W.ndim != 4:
        raise ValueError(f"weights must have shape (N, M, H, W), got {W.shape}")
    if not np.all(np.isfinite(W)):
        raise ValueError("weights contains NaN/Inf")
    if colours is None:
        C = PART_PALETTE
    else:
        C = _to_numpy(colours, "colours")
        if C.ndim != 2 or C.shape[1] != 3 or C.shape[0] == 0:
            raise ValueError(f"colours must have shape (K, 3), got {C.shape}")
    M = W.shape[1]
    C = C[np.arange(M) % C.shape[0]]  # (M, 3), cycled
    rgb = np.einsum("nmhw,mc->nhwc", W, C)
    return np.clip(rgb, 0.0, 1.0)


# --------------------------------------------------------------------------- reconstructions


def plot_reconstructions(
    inputs: Any,
    recons: Any,
    path: str | os.PathLike,
    part_colours: Any = None,
    titles: Sequence[str] = ("input", "reconstruction", "parts"),
    title: str | None = None,
) -> Path:
    """Rows: inputs / reconstructions / (coloured parts, if given); one column per image.

    ``inputs`` and ``recons`` are ``(N, H, W)`` (or ``(N, 1, H, W)``); ``part_colours`` is
    ``(N, H, W, 3)``, e.g. from :func:`colour_parts`. ``titles`` label the rows.
    """
    X = _images(inputs, "inputs", 1)
    R = _images(recons, "recons", 1)
    if X.shape[0] != R.shape[0]:
        raise ValueError(f"recons has {R.shape[0]} images but inputs has {X.shape[0]}")
    rows = [X, R]
    if part_colours is not None:
        P = _to_numpy(part_colours, "part_colours")
        if P.ndim != 4 or P.shape[-1] != 3:
            raise ValueError(f"part_colours must have shape (N, H, W, 3), got {P.shape}")
        if P.shape[0] != X.shape[0]:
            raise ValueError(f"part_colours has {P.shape[0]} images but inputs has {X.shape[0]}")
        rows.append(P)
    titles = list(titles) if titles is not None else []
    N = X.shape[0]

    fig = _new_figure(N * _CELL_IN + 0.6, len(rows) * _CELL_IN + (0.4 if title else 0.0))
    axes = fig.subplots(len(rows), N, squeeze=False)
    for r, data in enumerate(rows):
        for c in range(N):
            ax = axes[r][c]
            # Inputs and reconstructions share a fixed [0, 1] grey scale when in range, so
            # intensities are comparable across the two rows.
            _show(ax, data[c])
            if c == 0 and r < len(titles):
                ax.set_ylabel(titles[r], fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- curves


def plot_curves(
    curves: Mapping[str, Sequence[Any]],
    path: str | os.PathLike,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    logy: bool = False,
) -> Path:
    """Line plot of ``{name: (x, y)}`` or ``{name: (x, y, yerr)}`` (error bars), one line per name."""
    if not isinstance(curves, Mapping) or len(curves) == 0:
        raise ValueError("curves must be a non-empty dict of name -> (x, y) or (x, y, yerr)")
    fig = _new_figure(6.0, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    handles = []
    for i, (name, spec) in enumerate(curves.items()):
        if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
            raise ValueError(f"curves[{name!r}] must be (x, y) or (x, y, yerr)")
        x = _to_numpy(spec[0], f"curves[{name!r}] x").reshape(-1)
        y = _to_numpy(spec[1], f"curves[{name!r}] y").reshape(-1)
        if x.shape != y.shape:
            raise ValueError(f"curves[{name!r}]: x has {x.size} points but y has {y.size}")
        colour = PART_PALETTE[i % 10]
        marker = "o" if x.size <= 30 else None
        if len(spec) == 3 and spec[2] is not None:
            yerr = _to_numpy(spec[2], f"curves[{name!r}] yerr")
            bad = (
                (yerr.ndim == 1 and yerr.shape != y.shape)
                or (yerr.ndim == 2 and yerr.shape != (2, y.size))
                or yerr.ndim > 2
            )
            if bad:
                raise ValueError(f"curves[{name!r}]: yerr must have shape ({y.size},) or (2, {y.size}), got {yerr.shape}")
            h = ax.errorbar(x, y, yerr=yerr, label=str(name), color=colour, marker=marker, markersize=3, capsize=3)
        else:
            (h,) = ax.plot(x, y, label=str(name), color=colour, marker=marker, markersize=3)
        handles.append(h)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(handles=handles, fontsize=8)  # in the dict's order
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- generic grid


def plot_image_grid(
    images: Any,
    path: str | os.PathLike,
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Grid of ``(R, C, H, W)`` greyscale (or ``(R, C, H, W, 3)`` RGB) images with optional labels."""
    I = _images(images, "images", 2)
    R, C = I.shape[:2]
    if row_labels is not None and len(row_labels) != R:
        raise ValueError(f"row_labels has {len(row_labels)} entries but images has {R} rows")
    if col_labels is not None and len(col_labels) != C:
        raise ValueError(f"col_labels has {len(col_labels)} entries but images has {C} columns")
    fig = _new_figure(C * _CELL_IN + (0.6 if row_labels else 0.0), R * _CELL_IN + (0.4 if title else 0.0))
    axes = fig.subplots(R, C, squeeze=False)
    for r in range(R):
        for c in range(C):
            ax = axes[r][c]
            _show(ax, I[r, c])
            if r == 0 and col_labels is not None:
                ax.set_title(str(col_labels[c]), fontsize=8)
            if c == 0 and row_labels is not None:
                ax.set_ylabel(str(row_labels[r]), fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)
