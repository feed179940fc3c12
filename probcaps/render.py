"""Template rendering and alpha compositing: the one affine warp and the one compositing rule of the package.

Coordinates follow ``grid_sample(align_corners=False)``: ``[-1, 1]`` spans an image edge to edge.  A pose
``P`` maps a source image's *placed* coordinates to canvas coordinates: at ``P = I`` a ``t x t`` template lands
in the centre of the canvas at its own pixel size, and ``P = translation(2k/W, 0)`` moves it ``k`` pixels right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .geometry import determinant, invert

__all__ = ["sampling_grid", "warp", "render_templates", "alpha_over", "composite_over", "composite_layers",
           "footprints", "window_sides", "render_over"]

_GRID_CACHE: dict = {}


def _pixel_centres(n: int, device, dtype) -> torch.Tensor:
    key = (n, device, dtype)
    if key not in _GRID_CACHE:
        _GRID_CACHE[key] = (torch.arange(n, device=device, dtype=dtype) * 2 + 1) / n - 1
    return _GRID_CACHE[key]


_COLUMN_BASIS_CACHE: dict = {}


def _column_basis(W: int, device, dtype) -> torch.Tensor:
    """``(4, 2W)`` constant with ``[gx_row, gy_row, a_x, a_y] @ basis`` = the grid row ``(W, 2)`` flattened."""
    key = (W, device, dtype)
    if key not in _COLUMN_BASIS_CACHE:
        basis = torch.zeros(4, W, 2, device=device, dtype=dtype)
        basis[0, :, 0] = 1
        basis[1, :, 1] = 1
        basis[2, :, 0] = _pixel_centres(W, device, dtype)
        basis[3, :, 1] = _pixel_centres(W, device, dtype)
        _COLUMN_BASIS_CACHE[key] = basis.view(4, 2 * W)
    return _COLUMN_BASIS_CACHE[key]


def sampling_grid(A: torch.Tensor, out_size: tuple[int, int]) -> torch.Tensor:
    """Sampling grid for ``grid_sample`` from ``(N, 2, 3)`` affine maps (canvas -> source coordinates).

    ``grid[n, h, w] = A[n] @ (x_w, y_h, 1)``.  Each row ``h`` of the grid is its start ``A[:, 1] y_h + A[:, 2]``
    plus ``x_w`` times ``A[:, 0]``: one ``(N, H, 4) @ (4, 2W)`` product writes the whole grid, and its backward is
    one product with the grid's gradient.  Far cheaper than ``F.affine_grid``'s per-map products against a full
    base grid or broadcast arithmetic over a last dimension of 2.  ``A`` must be finite (the zeros of the basis
    would turn an ``inf`` into ``NaN``; :func:`warp` keeps it finite).  Returns ``(N, H, W, 2)``.
    """
    H, W = out_size
    N = A.shape[0]
    a = A.transpose(1, 2)  # (N, 3, 2): the x, y and constant coefficients of (gx, gy)
    row_starts = torch.addcmul(a[:, 2, None, :], a[:, 1, None, :], _pixel_centres(H, A.device, A.dtype).view(1, H, 1))
    rows = torch.cat([row_starts, a[:, 0, None, :].expand(N, H, 2)], -1)  # (N, H, 4)
    return torch.matmul(rows, _column_basis(W, A.device, A.dtype)).view(N, H, W, 2)


#: Poses with ``|det| <`` this render nothing in :func:`warp`.  Such a pose shrinks its template to under a
#: millionth of its area; inverting it as it is would give ``inf`` (an exactly singular pose) and then ``NaN`` pixels.
MIN_POSE_DET = 1e-6
#: Source coordinates of every canvas pixel for those poses: beyond the source's edge, so bilinear sampling gives 0.
_OFF_SOURCE = ((0.0, 0.0, 3.0), (0.0, 0.0, 3.0))


def warp(images: torch.Tensor, P: torch.Tensor, out_size: tuple[int, int] | int) -> torch.Tensor:
    """Warp ``(N, C, h, w)`` images by poses ``(N, 3, 3)`` onto an ``out_size`` canvas: ``(N, C, H, W)``.

    Bilinear sampling with zeros outside the source.  Each source is first scaled to its native pixel size
    on the canvas (``w/W``, ``h/H``), then mapped by ``P``.  A singular pose renders nothing (see :data:`MIN_POSE_DET`).
    """
    if isinstance(out_size, int):
        out_size = (out_size, out_size)
    H, W = out_size
    if images.dim() != 4 or P.shape != (images.shape[0], 3, 3):
        raise ValueError(f"warp: expected images (N, C, h, w) and poses (N, 3, 3); got {tuple(images.shape)} and "
                         f"{tuple(P.shape)}")
    grid = sampling_grid(_canvas_to_source(P, images.shape[-2:], out_size), (H, W))
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _canvas_to_source(P: torch.Tensor, source_size, out_size) -> torch.Tensor:
    """``(N, 2, 3)`` maps from canvas to source coordinates for poses ``P`` ``(N, 3, 3)`` (see :func:`warp`)."""
    (h, w), (H, W) = source_size, out_size
    # source coords v = S^-1 P^-1 u with S = diag(w/W, h/H): scale the two rows of P^-1.
    # the floor keeps the inverse finite (a zero-weighted inf would still make NaN gradients through the where)
    Pinv = invert(P, min_abs_det=MIN_POSE_DET)[:, :2, :]
    flat = determinant(P).abs() < MIN_POSE_DET
    Pinv = torch.where(flat.view(-1, 1, 1), Pinv.new_tensor(_OFF_SOURCE), Pinv)
    return Pinv * Pinv.new_tensor([W / w, H / h]).view(1, 2, 1)


def render_templates(templates: torch.Tensor, poses: torch.Tensor, out_size: tuple[int, int] | int) -> torch.Tensor:
    """Render ``M`` templates at per-image poses in one call.

    Args:
        templates: ``(M, C, t, t)`` shared by the batch, or ``(B, M, C, t, t)`` per image.
        poses: ``(B, M, 3, 3)`` template -> canvas maps.
        out_size: canvas ``H`` (square) or ``(H, W)``.
    Returns:
        ``(B, M, C, H, W)``.
    """
    B, M = poses.shape[:2]
    if templates.dim() == 4:
        templates = templates.unsqueeze(0).expand(B, *templates.shape)
    if templates.shape[:2] != (B, M):
        raise ValueError(f"render_templates: templates {tuple(templates.shape)} do not match poses {tuple(poses.shape)}")
    C, t1, t2 = templates.shape[2:]
    out = warp(templates.reshape(B * M, C, t1, t2), poses.reshape(B * M, 3, 3), out_size)
    return out.view(B, M, C, *out.shape[-2:])


def alpha_over(a: torch.Tensor, alpha_a: torch.Tensor, b: torch.Tensor, alpha_b: torch.Tensor, eps: float = 1e-8):
    """Porter-Duff "over": layer ``a`` (front) over ``b`` (back), straight (non-premultiplied) colours.

    ``colour = (a α_a + b α_b (1 − α_a)) / (α_a + α_b (1 − α_a))``, ``alpha = α_a + α_b (1 − α_a)``.
    Returns ``(colour, alpha)``; where both alphas are zero the colour is 0.
    """
    alpha = alpha_a + alpha_b * (1 - alpha_a)
    colour = (a * alpha_a + b * alpha_b * (1 - alpha_a)) / alpha.clamp_min(eps)
    return colour, alpha


#: Alphas are clamped below 1 in the log-space products, so an opaque layer keeps a finite log.
ALPHA_CLAMP = 1 - 1e-6


class _OverComposite(torch.autograd.Function):
    """``composite_over`` with a hand-written backward.

    Autograd's backward of the log-space closed form makes about twice as many passes over the
    ``(B, M, C, H, W)`` layers as the forward does. This backward makes about as many passes as the forward.
    The image is ``Σ_m w_m c_m`` with ``w_m = α_m T_m`` and ``T_m = ∏_{j>m}(1 − α_j)``. Given
    ``q_m = g c_m + ḡ_m`` (``g`` is the image's gradient and ``ḡ`` the weights'), the gradients are
    ``∂/∂c_m = g w_m`` and ``∂/∂α_m = T_m q_m − Σ_{i<m} w_i q_i / (1 − α_m)``. The background is one more layer
    at the bottom of the sum.
    """

    @staticmethod
    def forward(ctx, colours, alphas, dim: int, background: float):
        log_clear = torch.log1p(-alphas.clamp(max=ALPHA_CLAMP))   # log(1 − α_m)
        through_to = torch.cumsum(log_clear, dim)                 # Σ_{j<=m}
        total = through_to.narrow(dim, through_to.shape[dim] - 1, 1)
        transmit = torch.exp(total - through_to)                  # T_m = ∏_{j>m} (1 − α_j)
        weights = alphas * transmit
        image = (weights * colours).sum(dim)
        background_share = torch.exp(total.squeeze(dim))
        if background != 0.0:
            image = image + background * background_share
        ctx.save_for_backward(colours, alphas, transmit, weights, background_share)
        ctx.dim, ctx.background = dim, background
        return image, weights

    @staticmethod
    def backward(ctx, grad_image, grad_weights):
        colours, alphas, transmit, weights, background_share = ctx.saved_tensors
        dim = ctx.dim
        if grad_image is None:
            grad_image = torch.zeros_like(background_share)
        g = grad_image.unsqueeze(dim)
        q = g * colours
        if grad_weights is not None:
            q = q + grad_weights
        wq = weights * q
        below = wq.cumsum(dim) - wq                               # Σ_{i<m} w_i q_i
        if ctx.background != 0.0:
            below = below + (ctx.background * background_share * grad_image).unsqueeze(dim)
        # the clamp stops the gradient through log(1 − α) where α is at the clamp
        grad_alphas = transmit * q - torch.where(alphas < ALPHA_CLAMP, below / (1 - alphas), 0.0)
        grad_colours = g * weights if ctx.needs_input_grad[0] else None
        return grad_colours, grad_alphas, None, None


def composite_over(colours: torch.Tensor, alphas: torch.Tensor, dim: int = 1, background: float = 0.0,
                   compiled: bool = False):
    """Fold :func:`alpha_over` over layers along ``dim`` (index 0 at the back), onto an opaque background.

    This is the closed form of the fold. Layer ``m`` contributes ``α_m ∏_{j>m} (1 − α_j)`` and the background
    gets what is left. The products are taken in log space as one cumulative sum
    (``∏_{j>m} = exp(Σ_all − Σ_{j<=m})``), so there is no loop over layers. The backward is written by hand
    (:class:`_OverComposite`). Alphas are clamped to ``1 − 1e-6`` so an opaque layer keeps a finite log. What
    shows through it is then ``1e-6`` of the layers behind it, not exactly 0.

    Args:
        colours: ``(..., M, C, H, W)`` layer colours (``dim`` indexes the layers).
        alphas: alphas broadcastable to ``colours``.
        compiled: run through ``torch.compile``, which fuses the ten or so passes that the forward and the backward
            make over the layers into a few (the first call with a new shape pays for the compile).
    Returns:
        ``(image, weights)``: the composite with ``dim`` reduced, and the per-layer weights. The weights sum to 1
        together with the background's share.
    """
    if compiled:
        return _compiled("over")(colours, alphas, dim, float(background))
    return _composite_over(colours, alphas, dim, float(background))


def composite_layers(layers: torch.Tensor, dim: int = 1, background: float = 0.0, compiled: bool = False):
    """:func:`composite_over` of rendered layers whose colour and alpha are channels 0 and 1 of one tensor.

    Args:
        layers: ``(..., M, 2, H, W)`` (``dim`` indexes the layers; the channel axis follows it), e.g. the output of
            :func:`render_templates` for templates stacked with their alphas.
    Returns:
        ``(image (..., 1, H, W), weights (..., M, 1, H, W))`` as :func:`composite_over`.  Compiled, the split into
        colour and alpha is inside the compiled graph, so the backward writes the layers' gradient in one pass.
    """
    if layers.shape[dim + 1 if dim >= 0 else dim + layers.dim() + 1] != 2:
        raise ValueError(f"composite_layers: expected 2 channels (colour, alpha) after the layer axis, got "
                         f"{tuple(layers.shape)}")
    if compiled:
        return _compiled("layers")(layers, dim, float(background))
    return _composite_layers(layers, dim, float(background))


def _composite_over(colours, alphas, dim: int, background: float):
    dim = dim % max(colours.dim(), alphas.dim())
    colours, alphas = torch.broadcast_tensors(colours, alphas)
    return _OverComposite.apply(colours, alphas, dim, background)


def _composite_layers(layers, dim: int, background: float):
    dim = dim % layers.dim()
    # split, not two slices: eager, its backward writes the layers' gradient in one pass (a cat)
    colours, alphas = layers.split(1, dim=dim + 1)
    return _OverComposite.apply(colours, alphas, dim, background)


_COMPILED: dict = {}


def _compiled(kind: str):
    """The compiled form of :func:`_composite_over` (``"over"``) or :func:`_composite_layers` (``"layers"``),
    built on first use: a cache of compiled functions, used only by calls that ask for them."""
    if kind not in _COMPILED:
        fn = {"over": _composite_over, "layers": _composite_layers}[kind]
        _COMPILED[kind] = torch.compile(fn, dynamic=False)
    return _COMPILED[kind]


# ----------------------------------------------------------------------------------------- footprint rendering

def footprints(poses: torch.Tensor, template_size: tuple[int, int], out_size: tuple[int, int]) -> torch.Tensor:
    """The canvas pixels each template rendered at ``poses`` can touch: ``(..., 4)`` int64 ``(x0, y0, x1, y1)``.

    Inclusive pixel ranges, clamped to the canvas (``x1 < x0`` where the template lies wholly off it).  Bilinear
    sampling reads a source pixel up to one source pixel past its centre, so the template's support is the square
    ``[-(1 + 1/t), 1 + 1/t]²`` of its own coordinates; its image under ``P S`` lies in ``centre ± |P S| e``.
    Every canvas pixel whose centre lies in that box, edges included, is in the range (a pixel exactly on the
    support's edge has the value 0 but a non-zero gradient w.r.t. the pose).

    Args:
        poses: ``(..., 3, 3)`` template -> canvas maps.
    """
    (t_h, t_w), (H, W) = template_size, out_size
    with torch.no_grad():
        half_source = poses.new_tensor([(1 + 1 / t_w) * t_w / W, (1 + 1 / t_h) * t_h / H])
        half = poses[..., :2, :2].abs() @ half_source                             # (..., 2) canvas half-extents
        centre = poses[..., :2, 2]
        size = poses.new_tensor([W, H])
        # canvas coordinate u -> pixel index ((u + 1) size - 1) / 2 (pixel centres at integers)
        low = (((centre - half) + 1) * size - 1) / 2
        high = (((centre + half) + 1) * size - 1) / 2
        # rounded outwards: a pixel within rounding error of the edge is kept (its value and gradient are ~0)
        lo = torch.floor(low).clamp(-1, max(H, W)).long()
        hi = torch.ceil(high).clamp(-1, max(H, W)).long()
        limit = torch.tensor([W - 1, H - 1], device=poses.device)
        return torch.cat([torch.minimum(lo.clamp_min(0), limit), torch.minimum(hi.clamp_min(-1), limit)], -1)


#: What one more window size costs in :func:`window_sides`, in sampled pixels (a few more kernel calls).
WINDOW_SIZE_COST = 20_000
#: :func:`render_over` takes the full renderer when the windows would hold more than this share of the full layers'
#: pixels: the footprint compositing's fixed passes over its ``(B, H W, M)`` buffer are then not paid back.
MAX_WINDOW_SHARE = 0.5


def window_sides(extents: torch.Tensor, out_size: tuple[int, int], max_sizes: int = 3) -> list[int]:
    """Up to ``max_sizes`` square window sides that minimise the pixels sampled when every part is rendered in the
    smallest of them that holds its footprint (``Σ_parts side² + WINDOW_SIZE_COST`` per size; a side as large as
    the canvas is the whole canvas).  An exact dynamic programme over the ``max(H, W)`` possible sides.

    Args:
        extents: ``(N,)`` each part's footprint side (the larger of its width and height in pixels).
    Returns:
        the sides, increasing; the last holds the largest footprint.
    """
    H, W = out_size
    S = max(H, W)
    sides = torch.arange(S + 1, dtype=torch.float64)
    area = sides.clamp(max=H) * sides.clamp(max=W)
    covered = torch.bincount(extents.clamp(1, S).cpu(), minlength=S + 1).cumsum(0).to(torch.float64)  # ext <= s
    largest = int(extents.max().clamp(1, S))
    # cost[j][s]: the least cost of rendering every part with extent <= s in j + 1 sizes, the largest s
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    best = area * covered + WINDOW_SIZE_COST
    best[0] = inf
    choices, costs = [], [best]
    below = torch.ones(S + 1, S + 1, dtype=torch.bool).triu(1)                    # [s', s]: s' < s
    for _ in range(max_sizes - 1):
        step = costs[-1][:, None] + area[None, :] * (covered[None, :] - covered[:, None]) + WINDOW_SIZE_COST
        step = torch.where(below, step, inf)
        value, previous = step.min(0)
        choices.append(previous)
        costs.append(value)
    n = int(torch.stack([c[largest] for c in costs]).argmin())
    picked = [largest]
    for j in range(n, 0, -1):
        picked.append(int(choices[j - 1][picked[-1]]))
    return sorted(picked)


def _window_cost(extents: torch.Tensor, sides: list[int], out_size: tuple[int, int]) -> float:
    """Pixels sampled by the windows :func:`render_over` renders ``extents`` into, for ``sides``."""
    H, W = out_size
    tier = torch.searchsorted(torch.tensor(sides, device=extents.device), extents)
    counts = torch.bincount(tier, minlength=len(sides)).tolist()
    return sum(c * min(s, H) * min(s, W) for c, s in zip(counts, sides))


def _layer_cumsum_(buffer: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Cumulative sum in place over the layers of a ``(B, M, HW)`` buffer, from the front (``reverse``) or the back.

    One add of two ``(B, HW)`` slices a layer: on CPU several times faster than ``torch.cumsum`` over a dimension
    that is not the last, which walks each pixel's layers ``HW`` elements apart.
    """
    M = buffer.shape[1]
    for m in range(M - 2, -1, -1) if reverse else range(1, M):
        buffer[:, m].add_(buffer[:, m + 1 if reverse else m - 1])
    return buffer


#: The footprint compositing sums over the layers ``chunk`` images at a time, in a ``(chunk, M, H W)`` buffer of
#: about this many elements: small enough to stay in cache between its passes.
CHUNK_ELEMENTS = 1 << 20


def _layer_sums(values, entries, layout, reverse: bool, base=None):
    """Each footprint pixel's sum over the layers at or in front of (``reverse``) or at or behind its own.

    ``values`` are the groups' ``(n, h, w)`` footprints, scattered chunk by chunk into a zeroed ``(chunk, M, H W)``
    buffer at their ``entries``, summed there (``base`` ``(B, H W)`` added to the back layer first) and read back.
    Returns the sums, shaped as ``values``, and ``(B, H W)``: each pixel's sum over all the layers.
    """
    B, M, HW, chunk, bounds = layout
    buffer = values[0].new_empty(min(chunk, B) * M * HW)
    sums = [torch.empty_like(v) for v in values]
    total = values[0].new_empty(B, HW)
    for c, b0 in enumerate(range(0, B, chunk)):
        nb = min(chunk, B - b0)
        flat = buffer[:nb * M * HW].zero_()
        cuts = [(bound[c] * v[0].numel(), bound[c + 1] * v[0].numel()) for bound, v in zip(bounds, values)]
        for v, entry, (lo, hi) in zip(values, entries, cuts):
            flat.index_copy_(0, entry[lo:hi], v.view(-1)[lo:hi])
        layers = flat.view(nb, M, HW)
        if base is not None:
            layers[:, 0] += base[b0:b0 + nb]
        _layer_cumsum_(layers, reverse)
        for s, entry, (lo, hi) in zip(sums, entries, cuts):
            torch.index_select(flat, 0, entry[lo:hi], out=s.view(-1)[lo:hi])
        total[b0:b0 + nb] = layers[:, 0 if reverse else M - 1]
    return sums, total


class _FootprintOver(torch.autograd.Function):
    """:class:`_OverComposite` for layers given only where they can be non-zero: their footprints.

    A layer is zero outside its footprint, so its log-clearance ``log(1 − α)`` is zero there, and the sums over
    layers that the dense form takes at each pixel are sums over the layers whose footprints cover the pixel
    (:func:`_layer_sums`): ``T_m = exp(Σ_{j>=m} log(1 − α_j) − log(1 − α_m))``.  The image is the footprints'
    weighted colours added into ``(B, H W)``.  The backward sums ``w q`` from the back layer, the background's
    ``w q`` below it (the formulas are :class:`_OverComposite`'s).

    The footprints come in groups, one per window size: ``layers`` ``(n, 2, h, w)`` (colour, alpha) with
    ``entries`` ``(n h w,)``, each pixel's index ``((b mod chunk) M + m) H W + pixel`` in its chunk's buffer, and
    ``pixels`` ``(n h w,)``, its index ``b H W + pixel`` in the image.  ``layout`` is ``(B, M, H W, chunk,
    bounds)``, ``bounds`` per group the first window of each chunk of images and ``n``.  The outputs are the image
    ``(B, H W)`` and each group's weights ``w_m`` ``(n, h, w)``.
    """

    @staticmethod
    def forward(ctx, layout, background: float, *groups):
        ctx.set_materialize_grads(False)
        B, _, HW = layout[:3]
        layers, entries, pixels = groups[0::3], groups[1::3], groups[2::3]
        clears = [lay[:, 1].clamp(max=ALPHA_CLAMP).neg_().log1p_() for lay in layers]   # log(1 − α_m)
        transmits, total = _layer_sums(clears, entries, layout, reverse=True)
        image = total.new_zeros(B * HW)
        weights = []
        for lay, clear, transmit, pixel in zip(layers, clears, transmits, pixels):
            weight = lay[:, 1] * transmit.sub_(clear).exp_()                             # T_m = ∏_{j>m} (1 − α_j)
            image.index_add_(0, pixel, (weight * lay[:, 0]).view(-1))
            weights.append(weight)
        background_share = total.exp_().view(-1)
        if background != 0.0:
            image.add_(background_share, alpha=background)
        ctx.save_for_backward(background_share, *layers, *entries, *pixels, *transmits, *weights)
        ctx.layout, ctx.background, ctx.n = layout, background, len(layers)
        return (image.view(B, HW), *weights)

    @staticmethod
    def backward(ctx, grad_image, *grad_weights):
        background_share, *saved = ctx.saved_tensors
        n = ctx.n
        layers, entries, pixels, transmits, weights = (saved[i * n:(i + 1) * n] for i in range(5))
        B, _, HW = ctx.layout[:3]
        grad_image = background_share.new_zeros(B * HW) if grad_image is None else grad_image.reshape(-1)
        gs, qs, wqs = [], [], []
        for lay, pixel, weight, grad_weight in zip(layers, pixels, weights, grad_weights):
            g = grad_image.index_select(0, pixel).view_as(weight)
            q = g * lay[:, 0]
            if grad_weight is not None:
                q += grad_weight
            gs.append(g)
            qs.append(q)
            wqs.append(weight * q)
        behind = (background_share * grad_image).mul_(ctx.background).view(B, HW) if ctx.background else None
        belows, _ = _layer_sums(wqs, entries, ctx.layout, reverse=False, base=behind)
        grads = []
        for lay, transmit, weight, g, q, wq, below in zip(layers, transmits, weights, gs, qs, wqs, belows):
            alpha = lay[:, 1]
            # Σ_{i<m} w_i q_i / (1 − α_m); the clamp stops the gradient through log(1 − α) where α is at the clamp
            below = below.sub_(wq).div_(1 - alpha).masked_fill_(alpha >= ALPHA_CLAMP, 0.0)
            grad = torch.empty_like(lay)
            torch.mul(g, weight, out=grad[:, 0])
            torch.addcmul(below.neg_(), transmit, q, out=grad[:, 1])
            grads += [grad, None, None]
        return (None, None, *grads)


def render_over(templates: torch.Tensor, poses: torch.Tensor, out_size: tuple[int, int] | int,
                background: float = 0.0, footprint: bool = True, compiled: bool = False,
                contributions: bool = False):
    """Render templates with alphas at per-image poses and composite them "over" (part 0 at the back).

    ``footprint=True`` samples each template only over the canvas window it can touch (:func:`footprints`) and
    composites from those windows (:class:`_FootprintOver`); ``footprint=False`` renders every template over the
    whole canvas (:func:`render_templates`) and composites the full layers (:func:`composite_layers`).  Both give
    the same image and gradients.  The parts are grouped by the window sides :func:`window_sides` picks for the
    batch's footprints (up to three; each part with the smallest side that holds its footprint, a side as large
    as the canvas is the whole canvas), and each group's windows are as wide and as tall as its widest and tallest
    footprint; when the windows would hold more than
    :data:`MAX_WINDOW_SHARE` of the full layers' pixels the call takes the full renderer.

    Args:
        templates: ``(M, 2, t, t)`` shared by the batch or ``(B, M, 2, t, t)``: colour and alpha channels.
        poses: ``(B, M, 3, 3)`` template -> canvas maps.
        out_size: canvas ``H`` (square) or ``(H, W)``.
        background: the colour behind every layer.
        compiled: the full renderer's compositing through ``torch.compile`` (:func:`composite_layers`).
        contributions: also return each part's share of the image, ``w_m c_m``.
    Returns:
        ``(image (B, 1, H, W), contributions (B, M, 1, H, W) or None)``.
    """
    if isinstance(out_size, int):
        out_size = (out_size, out_size)
    H, W = out_size
    B, M = poses.shape[:2]
    if templates.dim() == 4:
        templates = templates.unsqueeze(0).expand(B, *templates.shape)
    if templates.shape[:3] != (B, M, 2) or poses.shape[2:] != (3, 3):
        raise ValueError(f"render_over: expected templates (B, M, 2, t, t) and poses (B, M, 3, 3); got "
                         f"{tuple(templates.shape)} and {tuple(poses.shape)}")
    t_h, t_w = templates.shape[-2:]
    N = B * M
    P = poses.reshape(N, 3, 3)
    if footprint and N:
        box = footprints(P, (t_h, t_w), out_size)                                 # (N, 4)
        extents = torch.maximum(box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]) + 1
        sides = window_sides(extents, out_size)
        footprint = _window_cost(extents, sides, out_size) <= MAX_WINDOW_SHARE * N * H * W
    if not (footprint and N):
        layers = render_templates(templates, poses, out_size)
        image, weights = composite_layers(layers, dim=1, background=background, compiled=compiled)
        return image, (weights * layers[:, :, :1] if contributions else None)

    sources = templates.reshape(N, 2, t_h, t_w)
    A = _canvas_to_source(P, (t_h, t_w), out_size)                                # (N, 2, 3)
    tier = torch.searchsorted(torch.tensor(sides, device=P.device), extents)
    chunk = max(1, CHUNK_ELEMENTS // (M * H * W))
    groups, bounds, group_parts = [], [], []
    for i, side in enumerate(sides):
        parts = (tier == i).nonzero().squeeze(1)
        if not parts.numel():
            continue
        # the window: the tier's widest and tallest footprints (at most side x side)
        win_w = int((box[parts, 2] - box[parts, 0]).max().clamp(0, W - 1)) + 1
        win_h = int((box[parts, 3] - box[parts, 1]).max().clamp(0, H - 1)) + 1
        # the window's top-left pixel, kept on the canvas: the window still covers the footprint's part on it
        x0 = box[parts, 0].clamp(max=W - win_w)
        y0 = box[parts, 1].clamp(max=H - win_h)
        # canvas x of window column c: (2 (x0 + c) + 1) / W - 1 = u_c win_w / W + (win_w + 2 x0) / W - 1, where
        # u_c is the column's coordinate in the window's own [-1, 1] frame (the one sampling_grid writes)
        A_part = A[parts]
        shift_x = ((win_w + 2 * x0).to(A.dtype) / W - 1)[:, None]
        shift_y = ((win_h + 2 * y0).to(A.dtype) / H - 1)[:, None]
        A_window = torch.stack([A_part[..., 0] * (win_w / W), A_part[..., 1] * (win_h / H),
                                torch.addcmul(torch.addcmul(A_part[..., 2], A_part[..., 0], shift_x),
                                              A_part[..., 1], shift_y)], -1)
        windows = F.grid_sample(sources.index_select(0, parts), sampling_grid(A_window, (win_h, win_w)), mode="bilinear",
                                padding_mode="zeros", align_corners=False)      # (n, 2, h, w)
        # each window pixel's index in a canvas; in the image b H W + pixel, in the layers (b M + m) H W + pixel
        window_pixel = (torch.arange(win_h, device=P.device)[:, None] * W + torch.arange(win_w, device=P.device))
        window_pixel = window_pixel.view(-1)
        start = y0 * W + x0
        group_parts.append(parts)
        bounds.append(torch.searchsorted(parts, torch.arange(0, B, chunk, device=P.device) * M).tolist()
                      + [parts.numel()])
        groups += [windows, ((parts % (chunk * M) * (H * W) + start)[:, None] + window_pixel).view(-1),
                   (((parts // M) * (H * W) + start)[:, None] + window_pixel).view(-1)]
    image, *weights = _FootprintOver.apply((B, M, H * W, chunk, bounds), float(background), *groups)
    shares = None
    if contributions:
        shares = image.new_zeros(B * M * H * W)
        for lay, pixel, weight, parts in zip(groups[0::3], groups[2::3], weights, group_parts):
            entry = pixel.view(len(parts), -1) + ((parts - parts // M) * (H * W))[:, None]   # (b M + m) H W + pixel
            shares = shares.index_put((entry.view(-1),), (weight * lay[:, 0]).reshape(-1))
        shares = shares.view(B, M, 1, H, W)
    return image.view(B, 1, H, W), shares
