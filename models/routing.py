"""Dynamic routing between capsules (Sabour, Frosst & Hinton 2017): squash, predictions, routing-by-agreement.

Everything is vectorised over the batch and over child and parent capsules; the only Python loop is over the
routing iterations.  Two implementations of the same procedure:

- :func:`dynamic_routing` routes given predictions ``u_hat`` ``(B, J, I, D)`` (batch, parent, child, pose dim);
  any layer that produces predictions can use it.  It is the reference.
- :func:`linear_dynamic_routing` is the fast path for CapsNet's linear predictions ``u_hat_j|i = W_ij u_i``: it
  never builds ``u_hat``.  With ``P``-dimensional children, each iteration's two contractions become GEMMs with
  inner dimension ``I * P`` and ``D``:

      s_j  = sum_i c_ij W_ij u_i = W_j^T (c_j * u)          (J, B, I*P) @ (J, I*P, D)
      a_ij = (W_ij u_i) . v_j   = u_i . (W_ij^T v_j)       (J, B, D) @ (J, D, I*P), then a sum over P

  so the work is dense matrix products instead of memory-bound passes over a ``(B, J, I, D)`` tensor (on the
  2-core CPU this made the paper-size training step several times faster; see ``benchmarks/bench_capsnet.py``).

Range: both stay finite for every finite input of float16, bfloat16, float32 and float64.  Squared norms and
agreements are what overflow (``|s|^2`` beyond ``|s| ~ 1e19`` in float32, near 256 in float16), so :func:`squash`
takes the norm of ``s`` divided by its largest entry where ``|s|^2`` would overflow, and the routing divides the
votes of an example whose largest vote lies outside ``[2^-emax/4, 2^emax/4]`` by a power of two (exact: no
rounding changes) and keeps its agreement logits in those units, shifting them to a maximum of 0 before scaling
them back for the softmax; half precision is routed in float32 and cast back.  Inputs of ordinary size take the
plain path (one check per call), so the fast path costs what it did.
"""

from __future__ import annotations

import math

import torch

from probcaps.errors import ConfigError

__all__ = ["squash", "capsule_predictions", "dynamic_routing", "linear_dynamic_routing"]

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype, where: str) -> torch.dtype:
    """Half-precision tensors are routed in float32 (their squared norms and agreements leave float16's range
    near ``|x| ~ 256``) and the results cast back; float32 and float64 are routed in their own dtype; any other
    dtype is refused."""
    if dtype in _HALF:
        return torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise ConfigError(f"{where}: dtype {dtype} is not supported (float16, bfloat16, float32 or float64)")
    return dtype


def _max_length(dim_size: int, compute: torch.dtype, out: torch.dtype) -> float:
    """The largest capsule length :func:`squash` returns: ``1`` less a margin that covers the rounding of the
    direction (a norm, a division and a product in ``compute``, about ``(D + 6)`` units in the last place) and
    of the cast to ``out``, so that even the stored, rounded output has a norm below 1."""
    margin = (dim_size + 6) * torch.finfo(compute).eps / 2
    if out != compute:
        margin += torch.finfo(out).eps
    return 1.0 - margin


def _peak(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """``max |x|`` over ``dim`` (all of ``x`` for ``None``), detached: one ``aminmax`` pass, several times faster
    on CPU than ``vector_norm(ord=inf)``."""
    lo, hi = torch.aminmax(x.detach(), dim=dim, keepdim=keepdim)
    return torch.maximum(-lo, hi)


def _squash(s: torch.Tensor, dim: int = -1, scale: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`squash` of ``scale * s`` (``scale`` a constant broadcastable to ``s`` reduced over ``dim``, e.g. the
    power of two that routing divided its votes by), in the compute dtype of ``s``, with lengths short enough
    for a later cast to ``out_dtype`` (default ``s``'s dtype)."""
    out_dtype = out_dtype or s.dtype
    s = s.to(_compute_dtype(s.dtype, "squash"))
    finfo = torch.finfo(s.dtype)
    max_length = _max_length(s.shape[dim], s.dtype, out_dtype)
    if scale is None:
        n2 = (s * s).sum(dim, keepdim=True)
        # the plain formula while no |s|^2 overflows (its underflow only reaches outputs below |s|^2, which
        # underflow as much); checked once for the whole tensor
        if bool(torch.isfinite(n2.detach()).all()):
            positive = n2 > 0
            n = torch.where(positive, torch.sqrt(torch.where(positive, n2, torch.ones_like(n2))), torch.zeros_like(n2))
            # v = s |s| / (1 + |s|^2), its length n^2 / (1 + n^2) capped below 1 (f <= max_length / n)
            f = torch.minimum(n / (1 + n2), max_length / torch.where(positive, n, torch.ones_like(n)))
            return s * f
    # |s| from s / max|s_d|: the scaled vector's norm lies in [1, sqrt(D)], so neither its square overflows
    # (|s| >~ 1e19 in float32) nor underflows; the scale is a constant, so the gradient is exact
    peak = _peak(s, dim, keepdim=True)
    peak = torch.where(peak > 0, peak, torch.ones_like(peak))  # s = 0 -> t = 0
    t = s / peak
    t_norm = torch.linalg.vector_norm(t, dim=dim, keepdim=True)  # gradient 0 (not NaN) at t = 0
    # |s| = peak * |t|, capped where |s|^2 / (1 + |s|^2) rounds to 1 anyway, so that |s|^2 stays finite
    big = math.sqrt(finfo.max) / 2
    factor = peak if scale is None else (peak * scale.to(s.dtype)).clamp(max=big)
    n = (factor * t_norm).clamp(max=big)
    n2 = n * n
    length = (n2 / (1 + n2)).clamp(max=max_length)
    return t * (length / torch.where(t_norm > 0, t_norm, torch.ones_like(t_norm)))


def squash(s: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``v = |s|^2 / (1 + |s|^2) * s / |s|`` along ``dim`` (paper eq. 1): norms in ``[0, 1)``, direction kept.

    Stable for every finite input of float16, bfloat16, float32 and float64 (half precision is computed in
    float32 and cast back): where some ``|s|^2`` would overflow, the norm is taken of ``s`` divided by its
    largest component; ``s = 0`` maps to 0 with gradient 0.  Very long inputs map to unit vectors shortened by a
    few units in the last place (see :func:`_max_length`), so that every returned norm is below 1.
    """
    return _squash(s, dim).to(s.dtype)


def _routing_exponent(peak: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power of two ``e`` to route in units of, from the largest vote ``peak`` (any shape): the ``e`` with
    ``2^e <= peak < 2^(e + 1)`` where ``peak`` is outside ``[2^-emax/4, 2^emax/4]`` (about ``[2e-10, 4e9]`` in
    float32), else 0, since votes inside that window cannot overflow a sum, a squared norm or an agreement.
    Dividing by ``2^e`` is exact, so routing in those units changes no rounding."""
    e = torch.frexp(peak)[1] - 1
    window = math.frexp(torch.finfo(dtype).max)[1] // 4
    return torch.where((e.abs() > window) & (peak > 0), e, torch.zeros_like(e))


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2^e`` in ``dtype`` (exact; 0 below its range)."""
    return torch.exp2(e.to(dtype))


def _coupling(logits: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor:
    """Softmax over the parents ``dim`` of ``scale * logits`` (``logits`` in units of the votes' scale, which is
    1 for ``None``).

    The logits are shifted to a maximum of 0 before scaling: the scaled ones are then in ``[-inf, 0]``, never
    ``+inf``, and the softmax neither overflows nor produces NaN however large the votes are.  (The shift is a
    constant for autograd: the softmax does not depend on it.)
    """
    if scale is None:
        return torch.softmax(logits, dim=dim)
    return torch.softmax(scale * (logits - logits.detach().amax(dim, keepdim=True)), dim=dim)


def capsule_predictions(u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each child's prediction of each parent's pose: ``u_hat[b, j, i] = W[i, j] @ u[b, i]``.

    Args:
        u: ``(B, I, P)`` child capsules.
        weight: ``(I, J, D, P)`` one transformation matrix per (child, parent) pair.
    Returns:
        ``(B, J, I, D)`` (parent-major, ready for :func:`dynamic_routing`).
    """
    I, J, D, P = weight.shape
    # one batched matmul over the children: (I, B, P) @ (I, P, J*D) -> (I, B, J*D)
    out = torch.bmm(u.transpose(0, 1), weight.reshape(I, J * D, P).transpose(1, 2))
    return out.view(I, u.shape[0], J, D).permute(1, 2, 0, 3).contiguous()


def dynamic_routing(u_hat: torch.Tensor, iterations: int = 3, detach: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing-by-agreement (paper, Procedure 1).

    Args:
        u_hat: ``(B, J, I, D)`` predictions of ``J`` parents by ``I`` children.
        iterations: routing iterations ``r >= 1`` (1 = uniform coupling, no agreement step).
        detach: the stop-gradient variant (as in the authors' TensorFlow code): the iterations before the last
            see ``u_hat`` detached, so gradients reach ``u_hat`` only through the final weighted sum. Default:
            gradients flow through every iteration.
    Returns:
        ``v`` ``(B, J, D)`` squashed parent capsules, and ``c`` ``(B, J, I)`` the final coupling coefficients
        (softmax over the parents ``J``: ``c.sum(1) == 1`` for every child).

    Finite for every finite ``u_hat`` of float16, bfloat16, float32 or float64 (half precision is routed in
    float32): where an example's largest vote is far from 1 (see :func:`_routing_exponent`), its votes are
    divided by the power of two ``2^e <= max |u_hat|`` (exact), so the weighted sums and agreements cannot
    overflow, and the logits are kept in those units (see :func:`_coupling`).  Votes of ordinary size are routed
    as given.
    """
    if iterations < 1:
        raise ValueError(f"dynamic_routing: iterations must be >= 1, got {iterations}")
    out_dtype = u_hat.dtype
    u_hat = u_hat.to(_compute_dtype(out_dtype, "dynamic_routing"))
    B, J, I, D = u_hat.shape
    e = _routing_exponent(_peak(u_hat.reshape(B, -1), dim=1), u_hat.dtype)  # (B,)
    scale = None
    if bool((e != 0).any()):
        scale = _pow2(e, u_hat.dtype).view(B, 1, 1)  # a constant for autograd
        u_hat = u_hat / scale.unsqueeze(-1)
    logits = u_hat.new_zeros(B, J, I)  # agreement in units of the scale
    u_inner = u_hat.detach() if detach else u_hat
    for r in range(iterations):
        c = _coupling(logits, scale, dim=1)  # (B, J, I): each child splits its vote over the parents
        u = u_hat if r == iterations - 1 else u_inner
        s = torch.matmul(c.unsqueeze(2), u).squeeze(2)  # (B, J, D), in units of the scale
        v = _squash(s, scale=scale, out_dtype=out_dtype)
        if r < iterations - 1:
            logits = logits + torch.matmul(u, v.unsqueeze(-1)).squeeze(-1)  # agreement (B, J, I)
    return v.to(out_dtype), c.to(out_dtype)


def linear_dynamic_routing(u: torch.Tensor, weight: torch.Tensor, iterations: int = 3, detach: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dynamic_routing` of the predictions ``u_hat_j|i = W_ij u_i`` without materialising them.

    Args:
        u: ``(B, I, P)`` child capsules.
        weight: ``(J, I, P, D)``: ``weight[j, i]`` is the transpose of the paper's ``W_ij`` (``D x P``); this
            layout makes every contraction a plain batched matrix product.
        iterations, detach: as in :func:`dynamic_routing` (``detach`` stops the gradient through ``u`` and
            ``weight`` in every iteration but the last).
    Returns:
        ``v`` ``(B, J, D)`` and the coupling coefficients ``c`` ``(B, J, I)`` (sum to 1 over ``J``).

    Scaled like :func:`dynamic_routing`: ``u`` by a power of two per example and ``weight`` by one power of two,
    the votes' scale being their product.  Where that product exceeds the dtype's range (predictions that could
    not be stored either) it is capped at the largest power of two, which keeps every output finite.
    """
    if iterations < 1:
        raise ValueError(f"linear_dynamic_routing: iterations must be >= 1, got {iterations}")
    B, I, P = u.shape
    J, I2, P2, D = weight.shape
    if (I2, P2) != (I, P):
        raise ValueError(f"linear_dynamic_routing: weight {tuple(weight.shape)} does not fit children {tuple(u.shape)}")
    out_dtype = u.dtype
    dtype = _compute_dtype(out_dtype, "linear_dynamic_routing")
    u, weight = u.to(dtype), weight.to(dtype)
    e_u = _routing_exponent(_peak(u.reshape(B, -1), dim=1), dtype)  # (B,)
    e_w = _routing_exponent(_peak(weight), dtype)
    scale = None
    if bool((e_u != 0).any() or e_w != 0):
        e_max = math.frexp(torch.finfo(dtype).max)[1] - 1
        scale = _pow2((e_u + e_w).clamp(max=e_max), dtype).view(1, B, 1, 1)  # the votes' scale, per example
        u = u / _pow2(e_u, dtype).view(B, 1, 1)
        weight = weight / _pow2(e_w, dtype)
    # children-last layouts: every elementwise product below then runs over a contiguous innermost axis of
    # length I (with P innermost, the broadcasts over 8-element rows were several times slower)
    u_t = u.transpose(1, 2).contiguous()  # (B, P, I)
    w_flat = weight.permute(0, 2, 1, 3).reshape(J, P * I, D)  # rows ordered (p, i)
    u_in, w_in = (u_t.detach(), w_flat.detach()) if detach else (u_t, w_flat)
    logits = u.new_zeros(J, B, 1, I)  # agreement in units of the scale
    for r in range(iterations):
        last = r == iterations - 1
        uu, ww = (u_t, w_flat) if last else (u_in, w_in)
        c = _coupling(logits, scale, dim=0)  # (J, B, 1, I)
        weighted = (c * uu).reshape(J, B, P * I)  # c_ij u_i
        s = torch.bmm(weighted, ww)  # (J, B, D)
        v = _squash(s, scale=None if scale is None else scale.view(1, B, 1), out_dtype=out_dtype)
        if not last:
            q = torch.bmm(v, ww.transpose(1, 2)).view(J, B, P, I)  # W_ij^T v_j
            logits = logits + (q * uu).sum(2, keepdim=True)
    c = c.squeeze(2)
    return v.transpose(0, 1).to(out_dtype), c.transpose(0, 1).to(out_dtype)
