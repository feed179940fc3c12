"""Dynamic routing between capsules (Sabour, Frosst & Hinton 2017): squash, predictions, routing-by-agreement.

:func:`dynamic_routing` routes given predictions ``u_hat`` ``(B, J, I, D)`` (batch, parent, child, pose dim) and
is the reference.  :func:`linear_dynamic_routing` is the fast path for CapsNet's linear predictions
``u_hat_j|i = W_ij u_i``: it never builds ``u_hat``; the first iteration's uniform coupling makes every parent's sum
one GEMM ``(B, I*P) @ (I*P, J*D)``, and with ``P``-dimensional children each later iteration is two GEMMs,

    s_j  = sum_i c_ij W_ij u_i = W_j^T (c_j * u)          (J, B, I*P) @ (J, I*P, D)
    a_ij = (W_ij u_i) . v_j   = u_i . (W_ij^T v_j)       (J, B, D) @ (J, D, I*P), then a sum over P

instead of memory-bound passes over ``(B, J, I, D)`` (several times faster on CPU: ``benchmarks/bench_capsnet.py``).

Both stay finite for every finite float16, bfloat16, float32 and float64 input: where squared norms or agreements
would overflow, :func:`squash` normalises by the largest entry and routing works in units of a power of two
(exact); half precision is routed in float32.  Inputs of ordinary size take the plain path (one check per call).
"""

from __future__ import annotations

import math

import torch

from probcaps.errors import ConfigError

__all__ = ["squash", "capsule_predictions", "dynamic_routing", "linear_dynamic_routing"]


def _compute_dtype(dtype: torch.dtype, where: str) -> torch.dtype:
    """float32 for half precision (its squared norms overflow near ``|x| ~ 256``), float32 and float64 as they
    are; any other dtype is refused."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise ConfigError(f"{where}: dtype {dtype} is not supported (float16, bfloat16, float32 or float64)")
    return dtype


def _peak(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """``max |x|`` over ``dim`` (all of ``x`` for ``None``), detached (``aminmax``: faster on CPU than
    ``vector_norm(ord=inf)``)."""
    lo, hi = torch.aminmax(x.detach(), dim=dim, keepdim=keepdim)
    return torch.maximum(-lo, hi)


def _squash(s: torch.Tensor, dim: int = -1, scale: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`squash` of ``scale * s`` (``scale``: a constant, e.g. the power of two routing divided its votes by)
    in the compute dtype of ``s``, with lengths short enough for a later cast to ``out_dtype``."""
    out_dtype = out_dtype or s.dtype
    s = s.to(_compute_dtype(s.dtype, "squash"))
    # the largest length returned: 1 less the rounding of the direction (about D + 6 ulps) and of the cast to
    # out_dtype, so that even the stored output has a norm below 1
    rounding = torch.finfo(out_dtype).eps if out_dtype != s.dtype else 0.0
    max_length = 1.0 - ((s.shape[dim] + 6) * torch.finfo(s.dtype).eps / 2 + rounding)
    if scale is None:
        n2 = (s * s).sum(dim, keepdim=True)
        # the plain formula while no |s|^2 overflows (checked once for the whole tensor)
        if bool(torch.isfinite(n2.detach()).all()):
            positive = n2 > 0
            n = torch.where(positive, torch.sqrt(torch.where(positive, n2, torch.ones_like(n2))), torch.zeros_like(n2))
            # v = s |s| / (1 + |s|^2), its length n^2 / (1 + n^2) capped below 1 (f <= max_length / n)
            f = torch.minimum(n / (1 + n2), max_length / torch.where(positive, n, torch.ones_like(n)))
            return s * f
    # |s| from s / max|s_d|, whose norm lies in [1, sqrt(D)]: its square neither overflows nor underflows
    peak = _peak(s, dim, keepdim=True)
    peak = torch.where(peak > 0, peak, torch.ones_like(peak))  # s = 0 -> t = 0
    t = s / peak
    t_norm = torch.linalg.vector_norm(t, dim=dim, keepdim=True)  # gradient 0 (not NaN) at t = 0
    # |s| = peak * |t|, capped where |s|^2 / (1 + |s|^2) rounds to 1 anyway, so that |s|^2 stays finite
    big = math.sqrt(torch.finfo(s.dtype).max) / 2
    factor = peak if scale is None else (peak * scale.to(s.dtype)).clamp(max=big)
    n = (factor * t_norm).clamp(max=big)
    n2 = n * n
    length = (n2 / (1 + n2)).clamp(max=max_length)
    return t * (length / torch.where(t_norm > 0, t_norm, torch.ones_like(t_norm)))


def squash(s: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``v = |s|^2 / (1 + |s|^2) * s / |s|`` along ``dim`` (paper eq. 1): norms in ``[0, 1)``, direction kept.

    Finite for every finite input (see the module docstring); ``s = 0`` maps to 0 with gradient 0, and very long
    inputs to unit vectors shortened by a few ulps.
    """
    return _squash(s, dim).to(s.dtype)


def _routing_exponent(peak: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power of two ``e`` to route in units of: ``2^e <= peak < 2^(e + 1)`` where the largest vote ``peak`` is
    outside ``[2^-emax/4, 2^emax/4]`` (about ``[2e-10, 4e9]`` in float32), else 0 (votes inside cannot overflow
    a sum, a squared norm or an agreement).  Dividing by ``2^e`` is exact."""
    e = torch.frexp(peak)[1] - 1
    window = math.frexp(torch.finfo(dtype).max)[1] // 4
    return torch.where((e.abs() > window) & (peak > 0), e, torch.zeros_like(e))


def _coupling(logits: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor:
    """Softmax over the parents ``dim`` of ``scale * logits`` (``scale`` None: 1).  The logits are shifted to a
    maximum of 0 before scaling, so the scaled ones are never ``+inf`` and the softmax never NaN."""
    if scale is None:
        return torch.softmax(logits, dim=dim)
    return torch.softmax(scale * (logits - logits.detach().amax(dim, keepdim=True)), dim=dim)


def capsule_predictions(u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each child's prediction of each parent's pose, ``u_hat[b, j, i] = W[i, j] @ u[b, i]``: child capsules ``u``
    ``(B, I, P)`` and one matrix per (child, parent) pair, ``weight`` ``(I, J, D, P)`` -> ``(B, J, I, D)``."""
    I, J, D, P = weight.shape
    # one batched matmul over the children: (I, B, P) @ (I, P, J*D) -> (I, B, J*D)
    out = torch.bmm(u.transpose(0, 1), weight.reshape(I, J * D, P).transpose(1, 2))
    return out.view(I, u.shape[0], J, D).permute(1, 2, 0, 3).contiguous()


def dynamic_routing(u_hat: torch.Tensor, iterations: int = 3, detach: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing-by-agreement (paper, Procedure 1) of the predictions ``u_hat (B, J, I, D)`` of ``J`` parents by ``I``
    children, ``iterations >= 1`` times (1: uniform coupling, no agreement step).  ``detach``: the stop-gradient
    variant (as in the authors' TensorFlow code), gradients reaching ``u_hat`` only through the last iteration's
    weighted sum.  Returns ``v (B, J, D)``, the squashed parent capsules, and ``c (B, J, I)``, the final coupling
    coefficients (softmax over the parents: ``c.sum(1) == 1`` for every child).
    """
    if iterations < 1:
        raise ValueError(f"dynamic_routing: iterations must be >= 1, got {iterations}")
    out_dtype = u_hat.dtype
    u_hat = u_hat.to(_compute_dtype(out_dtype, "dynamic_routing"))
    B, J, I, D = u_hat.shape
    e = _routing_exponent(_peak(u_hat.flatten(1), dim=1), u_hat.dtype)  # (B,)
    scale = None
    if bool((e != 0).any()):
        scale = torch.exp2(e.to(u_hat.dtype)).view(B, 1, 1)  # a constant for autograd
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


def linear_dynamic_routing(u: torch.Tensor, weight: torch.Tensor, iterations: int = 3, detach: bool = False,
                           product_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dynamic_routing` of the predictions ``u_hat_j|i = W_ij u_i`` without materialising them.

    ``u (B, I, P)`` child capsules; ``weight (J, I, P, D)``, ``weight[j, i]`` the transpose of the paper's ``W_ij``
    (every contraction is then a plain batched matrix product); ``iterations``, ``detach`` and the returned ``v (B, J,
    D)`` and ``c (B, J, I)`` as in :func:`dynamic_routing`.  ``u`` is scaled by a power of two per example and
    ``weight`` by one, the votes' scale being their product, capped at the dtype's largest power of two.

    ``product_dtype``: the dtype the children and weights enter the matrix products and the elementwise products
    of couplings and children in (``None``: the compute dtype).  ``torch.bfloat16`` halves the memory those passes
    over ``(J, B, P, I)`` move, which bounds them on CPU; each sum is still accumulated in float32 (oneDNN's bf16
    GEMMs accumulate in float32, the agreement's sum over ``P`` is taken in float32), and the couplings, logits
    and squash stay in the compute dtype.  bfloat16 has float32's exponent range, so the scaling above keeps
    every value finite as in float32; what it costs is the products' 8-bit mantissa (about 0.4% per product).
    """
    if iterations < 1:
        raise ValueError(f"linear_dynamic_routing: iterations must be >= 1, got {iterations}")
    B, I, P = u.shape
    J, I2, P2, D = weight.shape
    if (I2, P2) != (I, P):
        raise ValueError(f"linear_dynamic_routing: weight {tuple(weight.shape)} does not fit children {tuple(u.shape)}")
    out_dtype = u.dtype
    dtype = _compute_dtype(out_dtype, "linear_dynamic_routing")
    low = product_dtype or dtype
    if low not in (torch.bfloat16, torch.float32, torch.float64):
        # float16's range is what the scaling cannot protect: its products of unit-size votes overflow past 65504
        raise ConfigError(f"linear_dynamic_routing: product_dtype {low} is not supported (bfloat16, float32 or "
                          "float64)")
    u, weight = u.to(dtype), weight.to(dtype)
    # votes are brought inside the window of the narrower of the compute and product dtypes
    window = low if torch.finfo(low).max < torch.finfo(dtype).max else dtype
    e_u = _routing_exponent(_peak(u.flatten(1), dim=1), window)  # (B,)
    e_w = _routing_exponent(_peak(weight), window)
    scale = None
    if bool((e_u != 0).any() or e_w != 0):
        e_max = math.frexp(torch.finfo(dtype).max)[1] - 1
        scale = torch.exp2((e_u + e_w).clamp(max=e_max).to(dtype)).view(1, B, 1, 1)  # the votes' scale, per example
        u = u / torch.exp2(e_u.to(dtype)).view(B, 1, 1)
        weight = weight / torch.exp2(e_w.to(dtype))
    # children-last layouts: the elementwise products run over a contiguous axis of length I (with P innermost,
    # the broadcasts over 8-element rows were several times slower)
    u_t = u.transpose(1, 2).contiguous().to(low)  # (B, P, I)
    w_flat = weight.permute(0, 2, 1, 3).reshape(J, P * I, D).to(low)  # rows ordered (p, i)
    u_in, w_in = (u_t.detach(), w_flat.detach()) if detach else (u_t, w_flat)
    logits = c = None  # agreement in units of the scale
    for r in range(iterations):
        last = r == iterations - 1
        uu, ww = (u_t, w_flat) if last else (u_in, w_in)
        if r == 0:
            # uniform coupling 1/J: all parents' sums in one GEMM, (B, I*P) @ (I*P, J*D), with no (J, B, P, I)
            # product of couplings and children
            s = (uu.reshape(B, P * I) @ ww.transpose(0, 1).reshape(P * I, J * D)).view(B, J, D).transpose(0, 1)
            s = s.to(dtype) / J
        else:
            c = _coupling(logits, scale, dim=0)  # (J, B, 1, I)
            s = torch.bmm((c.to(low) * uu).reshape(J, B, P * I), ww).to(dtype)  # (J, B, D): sum_i W_ij (c_ij u_i)
        v = _squash(s, scale=None if scale is None else scale.view(1, B, 1), out_dtype=out_dtype)
        if not last:
            q = torch.bmm(v.to(low), ww.transpose(1, 2)).view(J, B, P, I)  # W_ij^T v_j
            agreement = (q * uu).sum(2, keepdim=True, dtype=dtype)
            logits = agreement if logits is None else logits + agreement
    if c is None:
        c = u.new_full((J, B, 1, I), 1.0 / J)
    return v.transpose(0, 1).to(out_dtype), c.squeeze(2).transpose(0, 1).to(out_dtype)
