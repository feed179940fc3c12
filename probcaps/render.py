"""Template rendering and alpha compositing: the one affine warp and the one compositing rule of the package.

Coordinates follow ``grid_sample(align_corners=False)``: ``[-1, 1]`` spans an image edge to edge.  A pose
``P`` maps a source image's *placed* coordinates to canvas coordinates: at ``P = I`` a ``t x t`` template lands
in the centre of the canvas at its own pixel size, and ``P = translation(2k/W, 0)`` moves it ``k`` pixels right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .geometry import determinant, invert

__all__ = ["sampling_grid", "warp", "render_templates", "extract_glimpses", "alpha_over", "composite_over",
           "composite_layers", "use_compiled_compositing"]

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
    h, w = images.shape[-2:]
    # source coords v = S^-1 P^-1 u with S = diag(w/W, h/H): scale the two rows of P^-1.
    # the floor keeps the inverse finite (a zero-weighted inf would still make NaN gradients through the where)
    Pinv = invert(P, min_abs_det=MIN_POSE_DET)[:, :2, :]
    flat = determinant(P).abs() < MIN_POSE_DET
    Pinv = torch.where(flat.view(-1, 1, 1), Pinv.new_tensor(_OFF_SOURCE), Pinv)
    row_scale = Pinv.new_tensor([W / w, H / h]).view(1, 2, 1)
    grid = sampling_grid(Pinv * row_scale, (H, W))
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


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


def extract_glimpses(images: torch.Tensor, poses: torch.Tensor, template_size: int | tuple[int, int],
                     out_size: int | tuple[int, int]) -> torch.Tensor:
    """The image seen in each capsule's template frame: the inverse view of :func:`render_templates`.

    Glimpse ``m`` of image ``b`` samples the canvas where a ``template_size`` template rendered at ``poses[b, m]``
    would land, on an ``out_size`` grid spanning the template edge to edge: rendering a template at ``P`` and
    taking the glimpse at ``P`` gives the template back (where it is on the canvas).

    Args:
        images: ``(B, C, H, W)`` canvases.
        poses: ``(B, M, 3, 3)`` template -> canvas maps.
    Returns:
        ``(B, M, C, h, w)``.
    """
    t_h, t_w = (template_size, template_size) if isinstance(template_size, int) else template_size
    h, w = (out_size, out_size) if isinstance(out_size, int) else out_size
    if images.dim() != 4 or poses.dim() != 4 or poses.shape[0] != images.shape[0] or poses.shape[-2:] != (3, 3):
        raise ValueError(f"extract_glimpses: expected images (B, C, H, W) and poses (B, M, 3, 3); got "
                         f"{tuple(images.shape)} and {tuple(poses.shape)}")
    B, M = poses.shape[:2]
    H, W = images.shape[-2:]
    # template coords u -> canvas coords P S u, S = diag(t_w / W, t_h / H): scale the first two columns of P
    A = poses[..., :2, :] * poses.new_tensor([t_w / W, t_h / H, 1.0])
    grid = sampling_grid(A.reshape(B * M, 2, 3), (h, w)).view(B, M * h, w, 2)  # the M glimpses stacked in rows
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.view(B, images.shape[1], M, h, w).transpose(1, 2)


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


def composite_over(colours: torch.Tensor, alphas: torch.Tensor, dim: int = 1, background: float = 0.0):
    """Fold :func:`alpha_over` over layers along ``dim`` (index 0 at the back), onto an opaque background.

    This is the closed form of the fold. Layer ``m`` contributes ``α_m ∏_{j>m} (1 − α_j)`` and the background
    gets what is left. The products are taken in log space as one cumulative sum
    (``∏_{j>m} = exp(Σ_all − Σ_{j<=m})``), so there is no loop over layers. The backward is written by hand
    (:class:`_OverComposite`). Alphas are clamped to ``1 − 1e-6`` so an opaque layer keeps a finite log. What
    shows through it is then ``1e-6`` of the layers behind it, not exactly 0.

    Args:
        colours: ``(..., M, C, H, W)`` layer colours (``dim`` indexes the layers).
        alphas: alphas broadcastable to ``colours``.
    Returns:
        ``(image, weights)``: the composite with ``dim`` reduced, and the per-layer weights. The weights sum to 1
        together with the background's share.
    """
    if _COMPILED["fn"] is not None:
        return _COMPILED["fn"](colours, alphas, dim, float(background))
    return _composite_over(colours, alphas, dim, float(background))


def composite_layers(layers: torch.Tensor, dim: int = 1, background: float = 0.0):
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
    if _COMPILED["layers_fn"] is not None:
        return _COMPILED["layers_fn"](layers, dim, float(background))
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


_COMPILED: dict = {"fn": None, "layers_fn": None}


def use_compiled_compositing(enable: bool = True) -> None:
    """Run :func:`composite_over` and :func:`composite_layers` through ``torch.compile``.

    Compiling fuses the ten or so passes that the forward and the backward make over the layers into a few.
    The whole training step with and without it is in ``benchmarks/bench_step.py --compile`` (README table).
    The first call pays for the compile. It is off by default. Turn it on with ``train.compile = true`` or
    ``--compile``.
    """
    _COMPILED["fn"] = torch.compile(_composite_over, dynamic=False) if enable else None
    _COMPILED["layers_fn"] = torch.compile(_composite_layers, dynamic=False) if enable else None
