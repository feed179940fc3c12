"""Template rendering and alpha compositing: the one affine warp and the one compositing rule of the package.

Coordinates follow ``grid_sample(align_corners=False)``: ``[-1, 1]`` spans an image edge to edge.  A pose
``P`` maps a source image's *placed* coordinates to canvas coordinates: at ``P = I`` a ``t x t`` template lands
in the centre of the canvas at its own pixel size, and ``P = translation(2k/W, 0)`` moves it ``k`` pixels right.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .geometry import determinant, invert

__all__ = ["sampling_grid", "warp", "render_templates", "alpha_over", "composite_over", "composite_layers",
           "footprints", "window_sides", "render_over"]

@functools.cache
def _pixel_centres(n: int, device, dtype) -> torch.Tensor:
    return (torch.arange(n, device=device, dtype=dtype) * 2 + 1) / n - 1


@functools.cache
def _column_basis(W: int, device, dtype) -> torch.Tensor:
    """``(4, 2W)`` constant with ``[gx_row, gy_row, a_x, a_y] @ basis`` = the grid row ``(W, 2)`` flattened."""
    eye = torch.eye(2, device=device, dtype=dtype)[:, None]                       # (2, 1, 2)
    return torch.cat([eye.expand(2, W, 2), eye * _pixel_centres(W, device, dtype)[:, None]]).view(4, 2 * W)


def sampling_grid(A: torch.Tensor, out_size: tuple[int, int]) -> torch.Tensor:
    """Sampling grid for ``grid_sample`` from ``(N, 2, 3)`` affine maps (canvas -> source coordinates).

    ``grid[n, h, w] = A[n] @ (x_w, y_h, 1)``: row ``h`` is ``A[:, 1] y_h + A[:, 2]`` plus ``x_w A[:, 0]``, so one
    ``(N, H, 4) @ (4, 2W)`` product writes the grid (and one product is its backward), far cheaper than
    ``F.affine_grid``.  ``A`` must be finite (the basis' zeros would turn ``inf`` into ``NaN``).  Returns
    ``(N, H, W, 2)``.
    """
    (H, W), N = out_size, A.shape[0]
    a = A.transpose(1, 2)  # (N, 3, 2): the x, y and constant coefficients of (gx, gy)
    row_starts = torch.addcmul(a[:, 2, None, :], a[:, 1, None, :], _pixel_centres(H, A.device, A.dtype).view(1, H, 1))
    rows = torch.cat([row_starts, a[:, 0, None, :].expand(N, H, 2)], -1)  # (N, H, 4)
    return torch.matmul(rows, _column_basis(W, A.device, A.dtype)).view(N, H, W, 2)


#: Poses with ``|det| <`` this render nothing in :func:`warp`.  Such a pose shrinks its template to under a
#: millionth of its area; inverting it as it is would give ``inf`` (an exactly singular pose) and then ``NaN`` pixels.
MIN_POSE_DET = 1e-6
#: Source coordinates of every canvas pixel for those poses: beyond the source's edge, so bilinear sampling gives 0.
_OFF_SOURCE = ((0.0, 0.0, 3.0), (0.0, 0.0, 3.0))
#: The largest magnitude of a canvas-to-source coefficient: far beyond any source (``[-1, 1]``), and small enough
#: that a grid coordinate (three such terms) stays finite in float32.
MAX_SOURCE_COORD = 1e30


def warp(images: torch.Tensor, P: torch.Tensor, out_size: tuple[int, int] | int) -> torch.Tensor:
    """Warp ``(N, C, h, w)`` images by poses ``(N, 3, 3)`` onto an ``out_size`` canvas: ``(N, C, H, W)``.

    Bilinear sampling with zeros outside the source.  Each source is first scaled to its native pixel size
    on the canvas (``w/W``, ``h/H``), then mapped by ``P``.  A singular pose renders nothing (see :data:`MIN_POSE_DET`).
    """
    out_size = (out_size, out_size) if isinstance(out_size, int) else out_size
    if images.dim() != 4 or P.shape != (images.shape[0], 3, 3):
        raise ValueError(f"warp: expected images (N, C, h, w) and poses (N, 3, 3); got {tuple(images.shape)} and "
                         f"{tuple(P.shape)}")
    grid = sampling_grid(_canvas_to_source(P, images.shape[-2:], out_size), out_size)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _canvas_to_source(P: torch.Tensor, source_size, out_size) -> torch.Tensor:
    """``(N, 2, 3)`` maps from canvas to source coordinates for poses ``P`` ``(N, 3, 3)`` (see :func:`warp`).

    Finite, with finite gradients, for every finite pose: the closed-form inverse is taken in float64 (a float32
    determinant of poses near float32's largest value overflows), and every entry is kept within
    ``±MAX_SOURCE_COORD`` (such a map sends the whole canvas off its source, or onto one point of it)."""
    (h, w), (H, W) = source_size, out_size
    wide = P.double()
    # source coords v = S^-1 P^-1 u with S = diag(w/W, h/H): scale the two rows of P^-1.
    # the floor keeps the inverse finite (a zero-weighted inf would still make NaN gradients through the where)
    Pinv = invert(wide, min_abs_det=MIN_POSE_DET)[:, :2, :]
    Pinv = torch.where((determinant(wide).abs() < MIN_POSE_DET).view(-1, 1, 1), Pinv.new_tensor(_OFF_SOURCE), Pinv)
    Pinv = Pinv * Pinv.new_tensor([W / w, H / h]).view(1, 2, 1)
    return Pinv.clamp(-MAX_SOURCE_COORD, MAX_SOURCE_COORD).to(P.dtype)


def render_templates(templates: torch.Tensor, poses: torch.Tensor, out_size: tuple[int, int] | int) -> torch.Tensor:
    """Render ``M`` templates, ``(M, C, t, t)`` shared by the batch or ``(B, M, C, t, t)`` per image, at poses
    ``(B, M, 3, 3)`` (template -> canvas) on a canvas ``out_size`` (``H`` or ``(H, W)``): ``(B, M, C, H, W)``."""
    B, M = poses.shape[:2]
    if templates.dim() == 4:
        templates = templates.unsqueeze(0).expand(B, *templates.shape)
    if templates.shape[:2] != (B, M):
        raise ValueError(f"render_templates: templates {tuple(templates.shape)} do not match poses "
                         f"{tuple(poses.shape)}")
    C, t1, t2 = templates.shape[2:]
    out = warp(templates.reshape(B * M, C, t1, t2), poses.reshape(B * M, 3, 3), out_size)
    return out.view(B, M, C, *out.shape[-2:])


def alpha_over(a: torch.Tensor, alpha_a: torch.Tensor, b: torch.Tensor, alpha_b: torch.Tensor, eps: float = 1e-8):
    """Porter-Duff "over": layer ``a`` (front) over ``b`` (back), straight (non-premultiplied) colours.

    ``colour = (a α_a + b α_b (1 − α_a)) / (α_a + α_b (1 − α_a))``, ``alpha = α_a + α_b (1 − α_a)``.
    Returns ``(colour, alpha)``; where both alphas are zero the colour is 0.
    """
    alpha = alpha_a + alpha_b * (1 - alpha_a)
    return (a * alpha_a + b * alpha_b * (1 - alpha_a)) / alpha.clamp_min(eps), alpha


#: Alphas are clamped below 1 in the log-space products, so an opaque layer keeps a finite log.
ALPHA_CLAMP = 1 - 1e-6


class _OverComposite(torch.autograd.Function):
    """``composite_over`` with a hand-written backward, which makes about as many passes over the layers as the
    forward (autograd's makes about twice as many).

    The image is ``Σ_m w_m c_m`` with ``w_m = α_m T_m`` and ``T_m = ∏_{j>m}(1 − α_j)``. Given ``q_m = g c_m + ḡ_m``
    (``g`` the image's gradient, ``ḡ`` the weights'), ``∂/∂c_m = g w_m`` and ``∂/∂α_m = T_m q_m − Σ_{i<m} w_i q_i /
    (1 − α_m)``. The background is one more layer at the bottom of the sum.
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
        grad_image = torch.zeros_like(background_share) if grad_image is None else grad_image
        g = grad_image.unsqueeze(dim)
        q = g * colours if grad_weights is None else torch.addcmul(grad_weights, g, colours)
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
    """Fold :func:`alpha_over` over the layers ``(..., M, C, H, W)`` of ``colours`` along ``dim`` (index 0 at the
    back), onto an opaque background; ``alphas`` broadcast to ``colours``.

    The closed form of the fold: layer ``m`` contributes ``α_m ∏_{j>m} (1 − α_j)``, the background what is left.
    The products are one cumulative sum in log space (``∏_{j>m} = exp(Σ_all − Σ_{j<=m})``), with a hand-written
    backward (:class:`_OverComposite`); alphas are clamped at :data:`ALPHA_CLAMP`.  ``compiled``: through
    ``torch.compile``, which fuses the ten or so passes over the layers into a few (a new shape pays for a compile).
    Returns ``(image, weights)``: the composite with ``dim`` reduced, and the per-layer weights (which sum to 1 with
    the background's share).
    """
    return (_compiled(_composite_over) if compiled else _composite_over)(colours, alphas, dim, float(background))


def composite_layers(layers: torch.Tensor, dim: int = 1, background: float = 0.0, compiled: bool = False):
    """:func:`composite_over` of ``layers`` ``(..., M, 2, H, W)`` whose colour and alpha are channels 0 and 1 (``dim``
    indexes the layers, the channel axis follows it), e.g. :func:`render_templates` of templates with alphas.

    Returns ``(image (..., 1, H, W), weights (..., M, 1, H, W))`` as :func:`composite_over`.  Compiled, the split into
    colour and alpha is inside the compiled graph, so the backward writes the layers' gradient in one pass.
    """
    if layers.shape[dim % layers.dim() + 1] != 2:
        raise ValueError(f"composite_layers: expected 2 channels (colour, alpha) after the layer axis, got "
                         f"{tuple(layers.shape)}")
    return (_compiled(_composite_layers) if compiled else _composite_layers)(layers, dim, float(background))


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


def _compiled(fn):
    """``fn`` through ``torch.compile``, built on first use (only by the calls that ask for it)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


# ----------------------------------------------------------------------------------------- footprint rendering

def footprints(poses: torch.Tensor, template_size: tuple[int, int], out_size: tuple[int, int]) -> torch.Tensor:
    """The canvas pixels each template rendered at ``poses`` can touch: ``(..., 4)`` int64 ``(x0, y0, x1, y1)``.

    Inclusive pixel ranges of ``poses`` ``(..., 3, 3)``, clamped to the canvas (``x1 < x0`` where the template lies
    wholly off it).  Bilinear sampling reads a source pixel up to one pixel past its centre, so the support is the
    square ``[-(1 + 1/t), 1 + 1/t]²`` of the template's coordinates, and its image under ``P S`` lies in ``centre ±
    |P S| e``.  Every pixel whose centre lies in that box, edges included, is in the range (on the edge a pixel has
    the value 0 but a non-zero gradient w.r.t. the pose).
    """
    (t_h, t_w), (H, W) = template_size, out_size
    with torch.no_grad():
        half_source = poses.new_tensor([(1 + 1 / t_w) * t_w / W, (1 + 1 / t_h) * t_h / H])
        half = poses[..., :2, :2].abs() @ half_source                             # (..., 2) canvas half-extents
        centre, size = poses[..., :2, 2], poses.new_tensor([W, H])
        # canvas coordinate u -> pixel index ((u + 1) size - 1) / 2 (pixel centres at integers), rounded outwards:
        # a pixel within rounding error of the edge is kept (its value and gradient are ~0)
        # a pose whose box is undefined (inf - inf from a non-finite pose) touches no pixel: an empty range
        lo = torch.floor((((centre - half) + 1) * size - 1) / 2).nan_to_num(nan=max(H, W)).clamp(0, max(H, W)).long()
        hi = torch.ceil((((centre + half) + 1) * size - 1) / 2).nan_to_num(nan=-1).clamp(-1, max(H, W)).long()
        return torch.minimum(torch.cat([lo, hi], -1), torch.tensor([W - 1, H - 1] * 2, device=poses.device))


#: What one more window size costs in :func:`window_sides`, in sampled pixels (a few more kernel calls).
WINDOW_SIZE_COST = 20_000
#: :func:`render_over` takes the full renderer when the windows would hold more than this share of the full layers'
#: pixels: the footprint compositing's fixed passes over its ``(chunk, M, H W)`` buffers are then not paid back.
MAX_WINDOW_SHARE = 0.5


def window_sides(extents: torch.Tensor, out_size: tuple[int, int], max_sizes: int = 3) -> list[int]:
    """Up to ``max_sizes`` square window sides, increasing, that minimise the pixels sampled when each part, of
    footprint side ``extents`` ``(N,)`` (the larger of its width and height), is rendered in the smallest that holds
    it (``Σ_parts side² + WINDOW_SIZE_COST`` per size; a side as large as the canvas is the whole canvas).  An exact
    dynamic programme over the ``max(H, W)`` possible sides; the last side holds the largest footprint.
    """
    H, W = out_size
    S = max(H, W)
    sides = torch.arange(S + 1, dtype=torch.float64)
    area = sides.clamp(max=H) * sides.clamp(max=W)
    covered = torch.bincount(extents.clamp(1, S).cpu(), minlength=S + 1).cumsum(0).to(torch.float64)  # ext <= s
    largest = int(extents.max().clamp(1, S))
    # cost[j][s]: the least cost of rendering every part with extent <= s in j + 1 sizes, the largest s
    best = area * covered + WINDOW_SIZE_COST
    best[0] = float("inf")
    choices, costs = [], [best]
    not_below = torch.ones(S + 1, S + 1, dtype=torch.bool).tril()                # [s', s]: s' >= s
    for _ in range(max_sizes - 1):
        step = costs[-1][:, None] + area[None, :] * (covered[None, :] - covered[:, None]) + WINDOW_SIZE_COST
        value, previous = step.masked_fill(not_below, float("inf")).min(0)
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


#: The footprint compositing sums over the layers ``chunk`` images at a time, in a ``(chunk, M, H W)`` buffer of
#: about this many elements: small enough to stay in cache between its passes.
CHUNK_ELEMENTS = 1 << 20


def _layer_sums(values, entries, layout, reverse: bool, base=None):
    """Each footprint pixel's sum over the layers at or in front of (``reverse``) or at or behind its own: the
    groups' ``values`` ``(n, h, w)`` copied chunk by chunk into a zeroed ``(chunk, M, H W)`` buffer at their
    ``entries``, summed there (``base`` ``(B, H W)`` added to the back layer first) and read back.  Returns the sums,
    shaped as ``values``, and ``(B, H W)``: each pixel's sum over all the layers.
    """
    B, M, HW, chunk, bounds = layout
    chunk = min(chunk, B)
    flat = values[0].new_empty(chunk * M * HW)
    buffer = flat.view(chunk, M, HW)
    sums = [torch.empty_like(v) for v in values]
    total = values[0].new_empty(B, HW)
    for c, b0 in enumerate(range(0, B, chunk)):
        nb = min(chunk, B - b0)
        flat.zero_()
        cuts = [(bound[c] * v[0].numel(), bound[c + 1] * v[0].numel()) for bound, v in zip(bounds, values)]
        for v, entry, (lo, hi) in zip(values, entries, cuts):
            flat.index_copy_(0, entry[lo:hi], v.view(-1)[lo:hi])
        if base is not None:
            buffer[:nb, 0] += base[b0:b0 + nb]
        if reverse:  # Σ_{j>=m} = x_m − Σ_{j<=m} + Σ_all, as the dense form takes its products in log space
            forward = buffer.cumsum(1)
            buffer.sub_(forward).add_(forward[:, -1:])
        else:
            buffer.cumsum_(1)
        for s, entry, (lo, hi) in zip(sums, entries, cuts):
            torch.index_select(flat, 0, entry[lo:hi], out=s.view(-1)[lo:hi])
        total[b0:b0 + nb] = buffer[:nb, 0 if reverse else M - 1]
    return sums, total


class _FootprintOver(torch.autograd.Function):
    """:class:`_OverComposite` for layers given only where they can be non-zero: their footprints.

    A layer's log-clearance ``log(1 − α)`` is zero outside its footprint, so the dense form's sums over layers
    are sums over the footprints covering a pixel (:func:`_layer_sums`): ``T_m = exp(Σ_{j>=m} log(1 − α_j) −
    log(1 − α_m))``.  The backward sums ``w q`` from the back, the background's below (as :class:`_OverComposite`).

    The footprints come in groups, one per window size: ``layers`` ``(n, 2, h, w)`` (colour, alpha), ``entries``
    ``(n h w,)`` (each pixel's index ``((b mod chunk) M + m) H W + pixel`` in its chunk's buffer) and ``pixels``
    ``(n h w,)`` (``b H W + pixel`` in the image).  ``layout``: ``(B, M, H W, chunk, bounds)``, ``bounds`` per group
    the first window of each chunk and ``n``.  Outputs: the image ``(B, H W)``, each group's weights ``(n, h, w)``.
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
        image.add_(background_share, alpha=background)
        ctx.save_for_backward(background_share, *layers, *entries, *pixels, *transmits, *weights)
        ctx.layout, ctx.background, ctx.n = layout, background, len(layers)
        return (image.view(B, HW), *weights)

    @staticmethod
    def backward(ctx, grad_image, *grad_weights):
        background_share, *saved = ctx.saved_tensors
        layers, entries, pixels, transmits, weights = (saved[i * ctx.n:(i + 1) * ctx.n] for i in range(5))
        B, _, HW = ctx.layout[:3]
        grad_image = background_share.new_zeros(B * HW) if grad_image is None else grad_image.reshape(-1)
        gs = [grad_image.index_select(0, pixel).view_as(weight) for pixel, weight in zip(pixels, weights)]
        qs = [g * lay[:, 0] if gw is None else torch.addcmul(gw, g, lay[:, 0])
              for g, lay, gw in zip(gs, layers, grad_weights)]
        wqs = [weight * q for weight, q in zip(weights, qs)]
        behind = (background_share * grad_image).mul_(ctx.background).view(B, HW) if ctx.background else None
        belows, _ = _layer_sums(wqs, entries, ctx.layout, reverse=False, base=behind)
        grads = []
        for lay, transmit, weight, g, q, wq, below in zip(layers, transmits, weights, gs, qs, wqs, belows):
            alpha = lay[:, 1]
            # Σ_{i<m} w_i q_i / (1 − α_m); the clamp stops the gradient through log(1 − α) where α is at the clamp
            below = below.sub_(wq).div_(1 - alpha)
            if alpha.max() >= ALPHA_CLAMP:
                below.masked_fill_(alpha >= ALPHA_CLAMP, 0.0)
            grad = torch.empty_like(lay)
            torch.mul(g, weight, out=grad[:, 0])
            torch.addcmul(below.neg_(), transmit, q, out=grad[:, 1])
            grads += [grad, None, None]
        return (None, None, *grads)


def render_over(templates: torch.Tensor, poses: torch.Tensor, out_size: tuple[int, int] | int, background: float = 0.0,
                footprint: bool = True, compiled: bool = False, contributions: bool = False):
    """Render templates with alphas at per-image poses and composite them "over" (part 0 at the back).

    ``footprint=True`` samples each template only over the canvas window it can touch (:func:`footprints`) and
    composites from those windows (:class:`_FootprintOver`); ``footprint=False`` renders every template over the
    whole canvas (:func:`render_templates`) and composites the full layers (:func:`composite_layers`): the same
    image and gradients.  Each part goes to the smallest of the window sides :func:`window_sides` picks that holds
    its footprint, each such group's windows as wide and as tall as its widest and tallest footprint.  Windows
    holding more than :data:`MAX_WINDOW_SHARE` of the full layers' pixels take the full renderer.

    ``templates``, ``poses``, ``out_size`` as :func:`render_templates`, with two channels: colour and alpha;
    ``background``: the colour behind every layer; ``compiled``: the full renderer's compositing through
    ``torch.compile``; ``contributions``: also return each part's share of the image, ``w_m c_m``.  Returns
    ``(image (B, 1, H, W), contributions (B, M, 1, H, W) or None)``.
    """
    H, W = out_size = (out_size, out_size) if isinstance(out_size, int) else out_size
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
    canvas = torch.tensor([W, H], device=P.device)
    groups, bounds, group_parts = [], [], []
    for i in range(len(sides)):
        parts = (tier == i).nonzero().squeeze(1)
        if not parts.numel():
            continue
        # the window: the group's widest and tallest footprints; its top-left pixel (x0, y0) kept on the canvas, where
        # the window still covers the footprint's part on the canvas
        win = torch.minimum((box[parts, 2:] - box[parts, :2]).amax(0).clamp_min(0) + 1, canvas)
        corner = torch.minimum(box[parts, :2], canvas - win)                       # (n, 2)
        # canvas x of window column c: (2 (x0 + c) + 1) / W - 1 = u_c win_w / W + (win_w + 2 x0) / W - 1, where
        # u_c is the column's coordinate in the window's own [-1, 1] frame (the one sampling_grid writes)
        A_part, shift = A[parts], ((win + 2 * corner).to(A.dtype) / canvas - 1)[..., None]
        A_window = torch.cat([A_part[..., :2] * (win.to(A.dtype) / canvas),
                              torch.baddbmm(A_part[..., 2:], A_part[..., :2], shift)], -1)
        win_w, win_h = win.tolist()
        windows = F.grid_sample(sources.index_select(0, parts), sampling_grid(A_window, (win_h, win_w)),
                                align_corners=False)                              # (n, 2, h, w)
        # each window pixel's index in a canvas; in the image b H W + pixel, in the layers (b M + m) H W + pixel
        rows, cols = torch.arange(win_h, device=P.device), torch.arange(win_w, device=P.device)
        window_pixel, start = (rows[:, None] * W + cols).view(-1), corner[:, 1] * W + corner[:, 0]
        group_parts.append(parts)
        bounds.append(torch.searchsorted(parts, torch.arange(0, B, chunk, device=P.device) * M).tolist()
                      + [parts.numel()])
        groups += [windows, ((parts % (chunk * M) * (H * W) + start)[:, None] + window_pixel).view(-1),
                   ((parts // M * (H * W) + start)[:, None] + window_pixel).view(-1)]
    image, *weights = _FootprintOver.apply((B, M, H * W, chunk, bounds), float(background), *groups)
    if not contributions:
        return image.view(B, 1, H, W), None
    shares = image.new_zeros(B * M * H * W)
    for lay, pixel, weight, parts in zip(groups[0::3], groups[2::3], weights, group_parts):
        entry = pixel.view(len(parts), -1) + ((parts - parts // M) * (H * W))[:, None]   # (b M + m) H W + pixel
        shares = shares.index_put((entry.view(-1),), (weight * lay[:, 0]).reshape(-1))
    return image.view(B, 1, H, W), shares.view(B, M, 1, H, W)
