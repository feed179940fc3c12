"""Figures: templates, reconstructions with coloured parts, curves, heat maps and generic image grids.

Uses ``matplotlib.figure.Figure`` with an explicit ``FigureCanvasAgg``, so no global backend is selected (a caller's
``matplotlib.use(...)`` stands) and nothing needs a display.  Every function writes a PNG atomically
(``probcaps.io.atomic_write``) and returns its path; inputs may be numpy arrays or torch tensors.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import is_color_like
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .io import atomic_write, read_jsonl
from .metrics import _to_numpy as _array

__all__ = ["PART_PALETTE", "plot_templates", "colour_parts", "plot_reconstructions", "plot_curves", "log_curves",
           "plot_curve_panels", "plot_predicted_vs_true", "plot_heatmap", "plot_confusion_matrix",
           "plot_objects_by_class", "plot_image_grid"]

#: a fixed qualitative palette, RGB in [0, 1]: matplotlib's tab10 followed by its light tab20 companions
PART_PALETTE = np.array(colormaps["tab20"].colors[0::2] + colormaps["tab20"].colors[1::2], dtype=np.float64)

_DPI = 100
_CELL_IN = 1.1  # inches per image cell
_MAX_FIG_IN = 40.0  # cap on either figure dimension


def _to_numpy(x: Any, name: str) -> np.ndarray:
    """``x`` (an array-like or a torch tensor) as a float64 numpy array."""
    arr = _array(x, name)
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"{name} must be numeric, got dtype={arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _images(x: Any, name: str, lead_dims: int) -> np.ndarray:
    """Array of ``lead_dims`` leading dims, then (H, W) or (H, W, 3); a singleton channel (..., 1, H, W) is dropped."""
    arr = _to_numpy(x, name)
    if arr.ndim == lead_dims + 3 and arr.shape[lead_dims] == 1:
        arr = arr.reshape(arr.shape[:lead_dims] + arr.shape[lead_dims + 1 :])
    ok = arr.ndim == lead_dims + 2 or (arr.ndim == lead_dims + 3 and arr.shape[-1] in (3, 4))
    if not ok:
        lead = "N" if lead_dims == 1 else "R, C"
        raise ValueError(f"{name} must have shape ({lead}, H, W), ({lead}, 1, H, W) or ({lead}, H, W, 3); "
                         f"got {arr.shape}")
    if any(s == 0 for s in arr.shape):
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    return arr


def _check_len(items: Sequence | None, n: int, name: str, other: str) -> None:
    """``items`` (None: nothing to check) must hold ``n`` entries, as ``other`` says (e.g. "values has 6 rows")."""
    if items is not None and len(items) != n:
        raise ValueError(f"{name} has {len(items)} entries but {other}")


def _new_figure(width_in: float, height_in: float) -> Figure:
    scale = min(1.0, _MAX_FIG_IN / max(width_in, height_in, 1e-9))
    fig = Figure(figsize=(max(width_in * scale, 1.0), max(height_in * scale, 1.0)), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | os.PathLike, title: str | None = None, fontsize=None, rect=None) -> Path:
    """Lay ``fig`` out (under the suptitle ``title``, if any; within ``rect``) and write it to ``path`` as PNG."""
    if title:
        fig.suptitle(title, **({} if fontsize is None else {"fontsize": fontsize}))
    fig.tight_layout(rect=rect)
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=_DPI), mode="wb")


def _show(ax, img: np.ndarray) -> None:
    """An image without ticks: RGB clipped to [0, 1]; greyscale on [0, 1] when in range, else its finite range."""
    if img.ndim == 3:
        ax.imshow(np.clip(img, 0.0, 1.0), interpolation="nearest")
    else:
        finite = img[np.isfinite(img)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if lo >= 0.0 and hi <= 1.0:  # the usual case: intensities / alphas in [0, 1]
            lo, hi = 0.0, 1.0
        elif hi <= lo:
            hi = lo + 1.0
        ax.imshow(img, cmap="gray", vmin=lo, vmax=hi, interpolation="nearest")
    ax.set(xticks=[], yticks=[])
    ax.spines[:].set_visible(False)


def plot_templates(templates: Any, path: str | os.PathLike, alphas: Any = None, ncols: int | None = None,
                   title: str | None = None) -> Path:
    """Grid of ``(M, t, t)`` or ``(M, 1, t, t)`` templates; ``alphas`` (same shape) as a second row block."""
    T = _images(templates, "templates", 1)
    M = T.shape[0]
    A = None if alphas is None else _images(alphas, "alphas", 1)
    _check_len(A, M, "alphas", f"templates has {M}")
    ncols = int(min(M, 10) if ncols is None else ncols)
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
                ax.set_axis_off()
    return _save(fig, path, title)


def colour_parts(weights: Any, colours: Any = None) -> np.ndarray:
    """Colour each part's contribution: ``(N, M, H, W)`` weights -> ``(N, H, W, 3)`` RGB in [0, 1].

    Part ``m``'s contribution to image ``n``, ``weights[n, m]``, gets ``colours[m % len(colours)]`` (default
    :data:`PART_PALETTE`); the sum is clipped to [0, 1]."""
    W = _to_numpy(weights, "weights")
    if W.ndim != 4:
        raise ValueError(f"weights must have shape (N, M, H, W), got {W.shape}")
    if not np.all(np.isfinite(W)):
        raise ValueError("weights contains NaN/Inf")
    C = PART_PALETTE if colours is None else _to_numpy(colours, "colours")
    if C.ndim != 2 or C.shape[1] != 3 or C.shape[0] == 0:
        raise ValueError(f"colours must have shape (K, 3), got {C.shape}")
    C = C[np.arange(W.shape[1]) % C.shape[0]]  # (M, 3), cycled
    return np.clip(np.einsum("nmhw,mc->nhwc", W, C), 0.0, 1.0)


def plot_reconstructions(inputs: Any, recons: Any, path: str | os.PathLike, part_colours: Any = None,
                         titles: Sequence[str] = ("input", "reconstruction", "parts", "objects"),
                         title: str | None = None, object_colours: Any = None) -> Path:
    """Rows: inputs / reconstructions / (coloured parts, if given) / (coloured objects, if given); one column per
    image (Smith et al. 2020, Figure 7).

    ``inputs`` and ``recons`` are ``(N, H, W)`` (or ``(N, 1, H, W)``); ``part_colours`` and ``object_colours`` are
    ``(N, H, W, 3)``, e.g. from :func:`colour_parts` of the parts' or the objects' contributions. ``titles`` label
    the rows."""
    X = _images(inputs, "inputs", 1)
    R = _images(recons, "recons", 1)
    _check_len(R, len(X), "recons", f"inputs has {len(X)}")
    rows = [X, R]
    if part_colours is not None:
        P = _to_numpy(part_colours, "part_colours")
        if P.ndim != 4 or P.shape[-1] != 3:
            raise ValueError(f"part_colours must have shape (N, H, W, 3), got {P.shape}")
        _check_len(P, len(X), "part_colours", f"inputs has {len(X)}")
        rows.append(P)
    if object_colours is not None:
        objects_rgb = _to_numpy(object_colours, "object_colours")
        if objects_rgb.ndim != 4 or objects_rgb.shape[-1] != 3 or part_colours is None:
            raise ValueError(f"object_colours must have shape (N, H, W, 3) and come with part_colours, got "
                             f"{objects_rgb.shape}")
        _check_len(objects_rgb, len(X), "object_colours", f"inputs has {len(X)}")
        rows.append(objects_rgb)
    # inputs and reconstructions share the fixed [0, 1] grey scale of _show when in range: comparable intensities
    return _image_rows(rows, path, list(titles or [])[:len(rows)], None, title)


_PANEL_KEYS = ("curves", "xlabel", "ylabel", "title", "logy", "ylim", "references", "vlines", "colours")


def _points(spec: Any, name: str, allow_err: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(x, y)`` or (when ``allow_err``) ``(x, y, yerr)`` -> flat x, flat y and yerr (``None`` if absent)."""
    sizes = (2, 3) if allow_err else (2,)
    if not isinstance(spec, (tuple, list)) or len(spec) not in sizes:
        raise ValueError(f"{name} must be (x, y)" + (" or (x, y, yerr)" if allow_err else ""))
    x = _to_numpy(spec[0], f"{name} x").reshape(-1)
    y = _to_numpy(spec[1], f"{name} y").reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"{name}: x has {x.size} points but y has {y.size}")
    if len(spec) < 3 or spec[2] is None:
        return x, y, None
    yerr = _to_numpy(spec[2], f"{name} yerr")
    if yerr.shape not in (y.shape, (2, y.size)):
        raise ValueError(f"{name}: yerr must have shape ({y.size},) or (2, {y.size}), got {yerr.shape}")
    return x, y, yerr


def _named_specs(specs: Any, name: str, required: bool) -> Mapping[str, Any]:
    if specs is None and not required:
        return {}
    if not isinstance(specs, Mapping) or (required and len(specs) == 0):
        kind = "non-empty " if required else ""
        raise ValueError(f"{name} must be a {kind}dict of name -> (x, y)" + (" or (x, y, yerr)" if required else ""))
    return specs


def _draw_curve_panel(ax, panel: Any, prefix: str) -> None:
    """Draw one panel (see :func:`plot_curve_panels`) on ``ax``; errors name its keys after ``prefix``
    (``panels[i]``; empty for :func:`plot_curves`, whose errors name its arguments)."""

    def where(key: str | None) -> str:
        return prefix if key is None else f"{prefix}[{key!r}]" if prefix else key

    if not isinstance(panel, Mapping):
        raise ValueError(f"{where(None)} must be a dict with keys curves, xlabel, ylabel, ...")
    unknown = sorted(set(panel) - set(_PANEL_KEYS))
    if unknown:
        raise ValueError(f"{where(None)} has unknown keys {unknown}; allowed: {list(_PANEL_KEYS)}")
    for key in ("xlabel", "ylabel"):
        if key not in panel:
            raise ValueError(f"{where(key)} is required")
    curves = _named_specs(panel.get("curves"), where("curves"), required=True)
    references = _named_specs(panel.get("references"), where("references"), required=False)
    colours = panel.get("colours") or {}
    if not isinstance(colours, Mapping):
        raise ValueError(f"{where('colours')} must be a dict of name -> colour, got {type(colours).__name__}")
    for name, colour in colours.items():
        if not is_color_like(colour):
            raise ValueError(f"{where('colours')}[{name!r}] is not a colour: {colour!r}")

    def colour_of(name: str, i: int):
        return colours[name] if name in colours else PART_PALETTE[i % 10]

    handles = []
    for i, (name, spec) in enumerate(curves.items()):
        x, y, yerr = _points(spec, f"{where('curves')}[{name!r}]", allow_err=True)
        style = dict(label=str(name), color=colour_of(name, i), marker="o" if x.size <= 30 else None, markersize=3)
        handles.append(ax.errorbar(x, y, yerr=yerr, capsize=3, **style) if yerr is not None
                       else ax.plot(x, y, **style)[0])
    for j, (name, spec) in enumerate(references.items()):
        x, y, _ = _points(spec, f"{where('references')}[{name!r}]", allow_err=False)
        handles += ax.plot(x, y, linestyle="none", marker="*", markersize=11, markeredgecolor="k",
                           color=colour_of(name, len(curves) + j), label=str(name))
    if panel.get("vlines") is not None:
        for v in _to_numpy(panel["vlines"], where("vlines")).reshape(-1):
            ax.axvline(v, color="grey", linestyle="--", linewidth=0.8)
    if panel.get("logy", False):
        ax.set_yscale("log")
    if panel.get("ylim") is not None:
        ylim = _to_numpy(panel["ylim"], where("ylim"))
        if ylim.shape != (2,) or not np.all(np.isfinite(ylim)) or ylim[0] >= ylim[1]:
            raise ValueError(f"{where('ylim')} must be (low, high) with low < high, got {panel['ylim']!r}")
        ax.set_ylim(float(ylim[0]), float(ylim[1]))
    _label_axes(ax, xlabel=panel["xlabel"], ylabel=panel["ylabel"], title=panel.get("title"), title_size=None)
    ax.grid(True, alpha=0.3)
    ax.legend(handles=handles, fontsize=8)  # in the dicts' order, curves then references


def _curve_figure(panels: Sequence[Mapping[str, Any]], path: str | os.PathLike, prefix: str = "panels") -> Path:
    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    fig = _new_figure(6.0 * ncols, 4.0 * nrows)
    for i, panel in enumerate(panels):
        _draw_curve_panel(fig.add_subplot(nrows, ncols, i + 1), panel, prefix and f"{prefix}[{i}]")
    return _save(fig, path)


def plot_curve_panels(panels: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Side-by-side line plots (up to 3 per row), one per dict in ``panels``.

    Each panel has ``curves`` (``{name: (x, y)}`` or ``{name: (x, y, yerr)}``, as in :func:`plot_curves`),
    ``xlabel`` and ``ylabel``, and optionally ``title``, ``logy`` (bool), ``ylim`` ``(low, high)``,
    ``references`` (``{name: (x, y)}`` drawn as star markers with a black edge and no line), ``vlines``
    (x positions, dashed grey) and ``colours`` (``{name: colour}`` for curves or references; others take
    :data:`PART_PALETTE` by position, references after the curves)."""
    if isinstance(panels, Mapping) or not isinstance(panels, Sequence) or len(panels) == 0:
        raise ValueError("panels must be a non-empty list of dicts (one per panel)")
    return _curve_figure(panels, path)


def plot_curves(curves: Mapping[str, Sequence[Any]], path: str | os.PathLike, xlabel: str, ylabel: str,
                title: str | None = None, logy: bool = False) -> Path:
    """Line plot of ``{name: (x, y)}`` or ``{name: (x, y, yerr)}`` (error bars), one line per name: one panel of
    :func:`plot_curve_panels`, whose errors name this function's arguments (``curves[...]``)."""
    panel = {"curves": curves, "xlabel": xlabel, "ylabel": ylabel, "title": title, "logy": logy}
    return _curve_figure([panel], path, prefix="")


def log_curves(logs: Mapping[str, str | os.PathLike], key: str, scale: float = 1.0) -> dict[str, tuple[list, list]]:
    """``{label: (steps, scale x key)}`` of the JSON-lines logs ``{label: path}`` (a run's ``log.jsonl``, an
    evaluation log), for :func:`plot_curves`: the last record of a step wins (a run resumed by an older version
    appended after its stale records); a missing or empty log is left out."""
    curves = {}
    for label, log in logs.items():
        if by_step := {r["step"]: scale * r[key] for r in read_jsonl(log)}:
            curves[label] = (sorted(by_step), [by_step[s] for s in sorted(by_step)])
    return curves


def _cells(cells: Any, name: str, shape: tuple[int, int]) -> np.ndarray:
    """``(K, 2)`` integer (row, col) cell indices inside ``shape`` (none for ``None``)."""
    arr = np.zeros(0) if cells is None else _to_numpy(cells, name)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=int)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{name} must be a list of (row, col) pairs, got shape {arr.shape}")
    if not np.all(arr == np.round(arr)):
        raise ValueError(f"{name} must hold integer (row, col) indices")
    idx = arr.astype(int)
    if idx.min() < 0 or np.any(idx[:, 0] >= shape[0]) or np.any(idx[:, 1] >= shape[1]):
        raise ValueError(f"{name} has a cell outside the {shape[0]} x {shape[1]} values")
    return idx


def _label_axes(ax, xticks: Sequence | None = None, yticks: Sequence | None = None, xlabel: str | None = None,
                ylabel: str | None = None, title: str | None = None, title_size: float | None = 9) -> None:
    """Label every column / row of a table drawn on ``ax`` with ``xticks`` / ``yticks``; axis labels and title."""
    if xticks is not None:
        ax.set_xticks(range(len(xticks)), [str(s) for s in xticks], fontsize=7)
    if yticks is not None:
        ax.set_yticks(range(len(yticks)), [str(s) for s in yticks], fontsize=7)
    ax.set(xlabel=xlabel or "", ylabel=ylabel or "")
    if title:
        ax.set_title(title, fontsize=title_size)


def plot_heatmap(values: Any, path: str | os.PathLike, row_labels: Sequence[str] | None = None,
                 col_labels: Sequence[str] | None = None, xlabel: str | None = None, ylabel: str | None = None,
                 title: str | None = None, vmin: float | None = None, vmax: float | None = None, cmap: str = "viridis",
                 colorbar_label: str | None = None, outlined: Any = None, marked: Any = None,
                 marked_label: str | None = None) -> Path:
    """Heat map of ``(R, C)`` ``values`` (row 0 at the top) with a colour bar, ``row_labels`` / ``col_labels`` on
    every row / column; ``outlined`` and ``marked`` ``(K, 2)`` (row, col) cells are outlined in red and dotted in
    white (``marked_label`` names the dots in a legend)."""
    V = _to_numpy(values, "values")
    if V.ndim != 2 or V.size == 0:
        raise ValueError(f"values must be a non-empty 2-D array (rows, cols), got shape {V.shape}")
    R, C = V.shape
    _check_len(row_labels, R, "row_labels", f"values has {R} rows")
    _check_len(col_labels, C, "col_labels", f"values has {C} columns")
    if vmin is not None and vmax is not None and not vmin < vmax:
        raise ValueError(f"vmin must be below vmax, got vmin={vmin}, vmax={vmax}")
    if cmap not in colormaps:
        raise ValueError(f"cmap {cmap!r} is not a matplotlib colour map")
    boxes, dots = _cells(outlined, "outlined", (R, C)), _cells(marked, "marked", (R, C))
    legend_in = 0.3 if marked_label and len(dots) else 0.0  # strip below for the legend
    height_in = max(3.0, 0.25 * R + 1.2) + legend_in
    fig = _new_figure(max(4.5, 0.22 * C + 3.0), height_in)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(V, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto", interpolation="nearest")
    _label_axes(ax, col_labels, row_labels, xlabel, ylabel, title, title_size=10)
    for r, c in boxes:
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    if len(dots):
        h = ax.scatter(dots[:, 1], dots[:, 0], s=10, c="white", edgecolors="black", linewidths=0.4)
        if legend_in:
            fig.legend([h], [marked_label], loc="lower center", fontsize=7, frameon=False)
    fig.colorbar(im, ax=ax, fraction=0.05, label=colorbar_label)
    return _save(fig, path, rect=(0.0, legend_in / height_in, 1.0, 1.0))


def plot_confusion_matrix(confusion: Any, path: str | os.PathLike, class_labels: Sequence[str] | None = None,
                          title: str | None = None, xlabel: str = "predicted class") -> Path:
    """Confusion matrix ``(C, C)`` (row: true class, column: predicted class, as scikit-learn's; ``xlabel`` names
    the columns), coloured by each row's share (the true class's recall on the diagonal) and annotated with the
    counts."""
    M = _to_numpy(confusion, "confusion")
    if M.ndim != 2 or M.shape[0] != M.shape[1] or M.size == 0:
        raise ValueError(f"confusion must be a non-empty square (C, C) array, got shape {M.shape}")
    if (M < 0).any():
        raise ValueError("confusion must hold non-negative counts")
    C = M.shape[0]
    _check_len(class_labels, C, "class_labels", f"confusion has {C} classes")
    labels = class_labels if class_labels is not None else range(C)
    rows = M.sum(1, keepdims=True)
    shares = np.divide(M, rows, out=np.zeros_like(M), where=rows > 0)
    side = max(3.5, 0.45 * C + 1.8)
    fig = _new_figure(side + 0.8, side)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(shares, vmin=0.0, vmax=1.0, cmap="Blues", interpolation="nearest")
    for i in range(C):
        for j in range(C):
            if M[i, j]:
                ax.text(j, i, f"{M[i, j]:g}", ha="center", va="center", fontsize=6,
                        color="white" if shares[i, j] > 0.5 else "black")
    _label_axes(ax, labels, labels, xlabel, "true class", title)
    fig.colorbar(im, ax=ax, fraction=0.05, label="share of the true class")
    return _save(fig, path)


def plot_objects_by_class(panels: Mapping[str, Any], path: str | os.PathLike, class_labels: Sequence[str] | None = None,
                          title: str | None = None) -> Path:
    """Side-by-side heat maps with their own colour bars, one per entry of ``panels`` (its title -> an ``(K, C)``
    table, rows objects, columns classes): a class-specific object shows as a row with one bright cell."""
    if not panels:
        raise ValueError("panels must hold at least one table")
    tables = {str(k): _to_numpy(v, f"panels[{k!r}]") for k, v in panels.items()}
    shapes = {t.shape for t in tables.values()}
    if len(shapes) != 1 or any(t.ndim != 2 or t.size == 0 for t in tables.values()):
        raise ValueError(f"panels must be non-empty 2-D tables of one shape (objects, classes), got {sorted(shapes)}")
    K, C = shapes.pop()
    _check_len(class_labels, C, "class_labels", f"the tables have {C} columns")
    labels = class_labels if class_labels is not None else range(C)
    n = len(tables)
    fig = _new_figure(n * max(3.2, 0.3 * C + 1.8), max(3.0, 0.25 * K + 1.4))
    for i, (name, table) in enumerate(tables.items()):
        ax = fig.add_subplot(1, n, i + 1)
        im = ax.imshow(table, vmin=0.0, cmap="viridis", aspect="auto", interpolation="nearest")
        _label_axes(ax, labels, range(K), "class", "object capsule", name)
        fig.colorbar(im, ax=ax, fraction=0.06)
    return _save(fig, path, title, fontsize=10)


def plot_predicted_vs_true(pred: Any, true: Any, names: Sequence[str], path: str | os.PathLike,
                           title: str | None = None, scores: Sequence[float] | None = None, score_name: str = "R²",
                           max_points: int = 2000) -> Path:
    """One scatter panel per component of ``pred`` against ``true`` (both ``(N, K)``), with the diagonal.

    ``scores``: one number per component shown in its panel title (e.g. R²)."""
    P = _to_numpy(pred, "pred")
    T = _to_numpy(true, "true")
    if P.ndim != 2 or P.shape != T.shape:
        raise ValueError(f"pred and true must both be (N, K); got {P.shape} and {T.shape}")
    K = P.shape[1]
    _check_len(names, K, "names", f"pred has {K} components")
    _check_len(scores, K, "scores", f"pred has {K} components")
    cols = min(K, 3)
    rows = -(-K // cols)
    fig = _new_figure(3.2 * cols, 3.0 * rows + (0.4 if title else 0.0))
    n = min(P.shape[0], max_points)
    for k in range(K):
        ax = fig.add_subplot(rows, cols, k + 1)
        t, p = T[:n, k], P[:n, k]
        ax.scatter(t, p, s=3, alpha=0.4)
        lo, hi = float(min(t.min(), p.min())), float(max(t.max(), p.max()))
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        label = str(names[k]) if scores is None else f"{names[k]}: {score_name} = {scores[k]:.3f}"
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("true", fontsize=8)
        ax.set_ylabel("predicted", fontsize=8)
    return _save(fig, path, title, fontsize=10)


def plot_image_grid(images: Any, path: str | os.PathLike, row_labels: Sequence[str] | None = None,
                    col_labels: Sequence[str] | None = None, title: str | None = None) -> Path:
    """Grid of ``(R, C, H, W)`` greyscale (or ``(R, C, H, W, 3)`` RGB) images with optional labels."""
    I = _images(images, "images", 2)
    R, C = I.shape[:2]
    _check_len(row_labels, R, "row_labels", f"images has {R} rows")
    _check_len(col_labels, C, "col_labels", f"images has {C} columns")
    return _image_rows(I, path, row_labels, col_labels, title)


def _image_rows(rows: Sequence[Sequence[np.ndarray]], path: str | os.PathLike, row_labels: Sequence[str] | None,
                col_labels: Sequence[str] | None, title: str | None) -> Path:
    """A grid with one row per entry of ``rows`` (each ``C`` images ``(H, W)`` or ``(H, W, 3)``), labelled."""
    R, C = len(rows), len(rows[0])
    width = C * _CELL_IN + (0.6 if row_labels else 0.0)
    # a title wider than the grid is wrapped (about 9 characters an inch), each line given its own 0.22 inch
    lines = textwrap.wrap(title, max(20, int(width * 9))) if title else []
    fig = _new_figure(width, R * _CELL_IN + 0.1 + 0.22 * len(lines))
    axes = fig.subplots(R, C, squeeze=False)
    for r, row in enumerate(rows):
        for c, img in enumerate(row):
            _show(axes[r][c], img)
            if r == 0 and col_labels is not None:
                axes[r][c].set_title(str(col_labels[c]), fontsize=8)
            if c == 0 and row_labels:
                axes[r][c].set_ylabel(str(row_labels[r]), fontsize=8)
    top = 1 - (0.1 + 0.22 * len(lines)) / fig.get_figheight() if lines else 1  # the title above the column labels
    return _save(fig, path, "\n".join(lines) or None, rect=(0, 0, 1, top))
