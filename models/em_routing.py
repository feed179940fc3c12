"""EM routing between capsule layers (Hinton, Sabour & Frosst 2018), in log space, vectorised.

Shapes: ``N`` = batch x output positions, ``J`` output capsules per position, ``I`` input capsules voting at that
position, ``H = 16`` pose entries.

- votes ``V[n, j, i] = M_i W_ij`` (4x4 flattened to 16), input activations given as ``log a_i``;
- M-step: ``r_ij = R_ij a_i``; ``mu_j``, ``sigma2_j`` are the ``r``-weighted mean and variance of the votes (per
  pose entry, plus a floor); ``cost_j = S_j sum_h (beta_v + log sigma_jh)`` with ``S_j = sum_i r_ij`` relative to
  its mean over the ``J`` parents, then (``standardise_cost``) standardised over them;
  ``a_j = sigmoid(lambda (beta_a - cost_j))``, ``lambda`` growing linearly over the iterations;
- E-step: ``R_ij ∝ a_j N(V_ij; mu_j, sigma2_j)``, normalised over every parent an input votes for (``normalise``:
  log-softmax over ``j`` by default; convolutional layers also sum over the overlapping patches of an input).

Everything is held as logarithms (no activation or assignment underflows to an exact zero), and votes whose
squares could overflow are routed in units of a power of two per row ``n``, so the outputs stay finite for every
finite float16, bfloat16, float32 and float64 input.  The votes are stored once, centred, beside their squares
(:class:`VoteCache`): every M-step is one batched product ``w @ VV`` and every E-step one ``x @ VV^T``.  The last
E-step's assignments are constants (stop-gradient through the iterations, as most implementations of the paper do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from probcaps.models.routing import _compute_dtype, _peak

__all__ = ["EMConfig", "em_routing", "em_routing_conv", "votes_cache", "conv_votes_cache", "VoteCache",
           "log_softmax_parents", "pose_transform_matrix"]

_LOG_2PI = math.log(2 * math.pi)


@dataclass
class EMConfig:
    iterations: int = 3
    inverse_temperature: float = 1.0   # lambda of the last iteration; iteration t uses lambda (t + 1) / iterations
    var_floor: float = 1e-4            # added to every variance (the log and the 1/sigma2 stay bounded)
    log_a_floor: float = -30.0         # log activations are clamped here (a = 0 is exp(-30), not -inf)
    standardise_cost: bool = True      # standardise the cost over the J parents before the sigmoid


@dataclass
class VoteCache:
    """Centred votes and their squares, ``VV (N, J, I, 2H)``; the centre ``(N, J, H)`` (the votes' mean over ``i``)
    is added back to ``mu``.  ``grad_buffer()`` gives an ``(N, J, I, H)`` tensor laid out for the sources (the
    tensors the votes were made from), and ``backward(dV)`` maps a gradient on the votes written into it to theirs.
    """

    VV: torch.Tensor | None
    center: torch.Tensor
    sources: tuple
    grad_buffer: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], tuple]
    # when given, the final M-step frees VV after the forward pass and rebuilds it from the sources for the backward
    rebuild: Callable[[], torch.Tensor] | None = None


def _cache_from_centred(V: torch.Tensor) -> torch.Tensor:
    """``VV (N, J, I, 2H)`` from centred votes ``(N, J, I, H)`` (any strides)."""
    N, J, I, H = V.shape
    VV = V.new_empty(N, J, I, 2 * H)
    VV[..., :H] = V
    torch.mul(VV[..., :H], VV[..., :H], out=VV[..., H:])
    return VV


def votes_cache(votes: torch.Tensor) -> VoteCache:
    """Cache for votes given as a tensor ``(N, J, I, H)`` (class capsules, tests)."""
    with torch.no_grad():
        center = votes.mean(2)
        VV = _cache_from_centred(votes - center[:, :, None])
    return VoteCache(VV, center, (votes,), lambda: torch.empty_like(votes), lambda dV: (dV,))


def pose_transform_matrix(W: torch.Tensor) -> torch.Tensor:
    """``(I, J, 4, 4)`` transforms -> ``K (I, 16, 16 J)`` with ``M.flatten() @ K[i] = cat_j (M @ W[i, j]).flatten()``
    for a 4x4 pose ``M`` (``K[i, (r, k), (j, s, c)] = delta_rs W[i, j, k, c]``)."""
    I, J = W.shape[:2]
    return torch.einsum("rs,ijkc->irkjsc", torch.eye(4, dtype=W.dtype, device=W.device), W).reshape(I, 16, J * 16)


def conv_votes_cache(M: torch.Tensor, W: torch.Tensor) -> VoteCache:
    """Cache for the votes ``V[n, j, i] = M[n, i] @ W[i, j]`` (input poses ``M (N, I, 4, 4)``, unfolded patches;
    transforms ``W (I, J, 4, 4)`` shared over positions): one batched product over ``i``, ``(N, 16) @ (16, 16 J)``,
    the centre one matrix product, and the gradient ``(dM, dW)`` two batched products over ``i``."""
    (N, I), J = M.shape[:2], W.shape[1]
    with torch.no_grad():
        K = pose_transform_matrix(W)                                   # (I, 16, 16 J)
        center = (M.reshape(N, I * 16) @ K.reshape(I * 16, J * 16) / I).view(N, J, 16)
        Mi = M.reshape(N, I, 16).transpose(0, 1).contiguous()          # (I, N, 16)

    @torch.no_grad()
    def rebuild() -> torch.Tensor:
        V = torch.bmm(Mi, K).view(I, N, J, 16).permute(1, 2, 0, 3)     # (N, J, I, 16) view of an (I, N, J, 16) buffer
        return _cache_from_centred(V.sub_(center[:, :, None]))

    def grad_buffer() -> torch.Tensor:
        return M.new_empty(I, N, J, 16).permute(1, 2, 0, 3)

    def backward(dV: torch.Tensor) -> tuple:
        dV = dV.permute(2, 0, 1, 3).reshape(I, N, J * 16)            # a view: grad_buffer's own layout
        dM = torch.bmm(dV, K.transpose(1, 2)).transpose(0, 1).reshape(N, I, 4, 4)
        dK = torch.bmm(Mi.transpose(1, 2), dV).view(I, 4, 4, J, 4, 4)  # (i, r, k, j, s, c)
        dW = torch.diagonal(dK, dim1=1, dim2=4).sum(-1).permute(0, 2, 1, 3)  # sum over r = s -> (i, j, k, c)
        return dM, dW

    return VoteCache(rebuild(), center, (M, W), grad_buffer, backward, rebuild)


def _dot_h(VV: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum_h VV[n, j, i, h] x[n, j, h]`` -> ``(N, J, I)``: one batched product ``x @ VV^T``."""
    N, J, I, H2 = VV.shape
    return torch.bmm(x.reshape(N * J, 1, H2), VV.view(N * J, I, H2).transpose(1, 2)).view(N, J, I)


def _moments(wn: torch.Tensor, cache: VoteCache) -> torch.Tensor:
    """``(N, J, I)`` weights -> ``(N, J, 2H)``: ``sum_i wn VV_i`` (one batched product)."""
    N, J, I, H2 = cache.VV.shape
    return torch.bmm(wn.reshape(N * J, 1, I), cache.VV.view(N * J, I, H2)).view(N, J, H2)


class _WeightedMoments(torch.autograd.Function):
    """:func:`_moments` with a hand-written backward to ``wn`` and to the votes' sources."""

    @staticmethod
    def forward(ctx, wn, cache: VoteCache, *sources):
        ctx.cache = cache
        ctx.save_for_backward(wn)
        out = _moments(wn, cache)
        if cache.rebuild is not None and any(ctx.needs_input_grad):
            cache.VV = None                                            # the last use in the forward pass
        return out

    @staticmethod
    def backward(ctx, g):
        (wn,) = ctx.saved_tensors
        cache = ctx.cache
        VV = cache.VV if cache.VV is not None else cache.rebuild()
        H = VV.shape[-1] // 2
        g = g.contiguous()
        dwn = _dot_h(VV, g)                                            # d/dwn_i = VV_i . g
        # d/dV_i = wn_i (g_mean + 2 g_sq V_i), written in the layout the sources' backward wants
        dV = cache.grad_buffer()
        torch.addcmul(g[:, :, None, :H], VV[..., :H], 2 * g[:, :, None, H:], out=dV)
        del VV
        dV.mul_(wn[..., None])
        return (dwn, None, *cache.backward(dV))


def log_softmax_parents(logits: torch.Tensor) -> torch.Tensor:
    """``log R``: normalise ``(N, J, I)`` logits over the ``J`` parents of each input (no shared inputs)."""
    return torch.log_softmax(logits, dim=1)


def _log_gaussian(cache: VoteCache, mu: torch.Tensor, var: torch.Tensor, log_scale2=0.0) -> torch.Tensor:
    """``log N(V_i; mu, diag(var))`` for the cached centred votes, ``mu, var (N, J, H)`` -> ``(N, J, I)``, in units
    of the votes' scale, whose squared logarithm ``log_scale2`` (``(N, 1, 1)`` or 0) restores the normaliser (rows of
    different scales may share assignments); the quadratic form expanded against the cached votes and squares."""
    inv = 1.0 / var
    quad = _dot_h(cache.VV, torch.cat([-2 * mu * inv, inv], -1))  # pairs with [V, V^2]
    quad = (quad + (mu * mu * inv).sum(-1, keepdim=True)).clamp_min(0)  # >= 0 up to rounding
    return -0.5 * quad - 0.5 * (torch.log(var) + log_scale2 + _LOG_2PI).sum(-1, keepdim=True)


def _m_step(log_w: torch.Tensor, moments_fn, beta_v, beta_a, lam: float, var_floor, standardise: bool,
            log_scale2=0.0):
    """One M-step from log weights ``log r_ij = log R_ij + log a_i`` ``(N, J, I)``: centred ``mu (N, J, H)``,
    ``var (N, J, H)`` and ``log a_out (N, J)``, in units of the votes' scale (``var_floor`` in those units and
    ``log_scale2``, the logarithm of the scale squared: floats, or ``(N, 1, 1)`` for rescaled votes)."""
    wn = torch.softmax(log_w, dim=-1)                      # r_ij / S_j, stable however small the r_ij
    moments = moments_fn(wn)
    H = moments.shape[-1] // 2
    mu, second = moments[..., :H], moments[..., H:]
    # a second floor keeps 1 / var and the quadratic form (up to 64 H / var for votes scaled below 2) finite; it
    # acts only where rescaling has pushed var_floor below 2^-emax times 64 H (votes beyond ~4e15 in float32)
    var_min = 64 * H * 2.0 ** -_max_exponent(mu.dtype)
    var = ((second - mu * mu).clamp_min(0) + var_floor).clamp_min(var_min)
    log_S = torch.logsumexp(log_w, dim=-1)                 # log sum_i r_ij
    # S_j relative to its mean over the J parents: the cost's scale does not grow with the number of inputs
    S_rel = torch.exp(log_S - (torch.logsumexp(log_S, -1, keepdim=True) - math.log(log_S.shape[-1])))
    # the (N, J) cost in float64: H beta_v summed over the pose entries overflows float32 from beta_v ~ 1e37 on,
    # and the standardisation would then turn inf - inf into NaN
    wide = torch.float64
    log_var = torch.log(var).to(wide) + (log_scale2.to(wide) if torch.is_tensor(log_scale2) else log_scale2)
    cost = S_rel.to(wide) * (beta_v.to(wide) + 0.5 * log_var).sum(-1)
    if standardise:
        # the cost standardised over the J parents at each position: activations say which parents explain their
        # inputs better than the others do, whatever the cost's overall scale
        centred = cost - cost.mean(-1, keepdim=True)
        cost = centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-12).sqrt()
    log_a = F.logsigmoid(lam * (beta_a.to(wide) - cost))
    return mu, var, log_a.clamp_min(torch.finfo(log_w.dtype).min).to(log_w.dtype)


def _route(cache: VoteCache, log_a_in: torch.Tensor, beta_v: torch.Tensor, beta_a: torch.Tensor, cfg: EMConfig,
           normalise: Callable[[torch.Tensor], torch.Tensor], scale_exp: torch.Tensor | None = None):
    """EM routing of cached votes in units of ``2^scale_exp`` ``(N,)`` (``None``: the votes as given): ``mu``
    (including the centre), ``var`` (both still in those units), ``log a_out`` and ``log R``."""
    N, J, I, _ = cache.VV.shape
    if log_a_in.shape != (N, I):
        raise ValueError(f"em_routing: log activations must be {(N, I)}, got {tuple(log_a_in.shape)}")
    if cfg.iterations < 1:
        raise ValueError(f"em_routing: iterations must be >= 1, got {cfg.iterations}")
    var_floor, log_scale2 = cfg.var_floor, 0.0
    if scale_exp is not None:
        e = scale_exp.to(log_a_in.dtype).view(N, 1, 1)
        var_floor = cfg.var_floor * torch.exp2(-2 * e)
        log_scale2 = (2 * math.log(2)) * e
    log_a_in = log_a_in.clamp_min(cfg.log_a_floor)
    bv, ba, T = beta_v.view(1, J, 1), beta_a.view(1, J), cfg.iterations
    with torch.no_grad():
        log_R = normalise(log_a_in.new_zeros(N, J, I))     # uniform over each input's parents
        for t in range(T - 1):
            mu, var, log_a = _m_step(log_R + log_a_in[:, None, :], lambda wn: _moments(wn, cache), bv.detach(),
                                     ba.detach(), cfg.inverse_temperature * (t + 1) / T, var_floor,
                                     cfg.standardise_cost, log_scale2)
            log_R = normalise(_log_gaussian(cache, mu, var, log_scale2) + log_a[..., None])
    # the last M-step carries the gradient (the assignments log_R are constants here)
    mu, var, log_a = _m_step(log_R + log_a_in[:, None, :], lambda wn: _WeightedMoments.apply(wn, cache, *cache.sources),
                             bv, ba, cfg.inverse_temperature, var_floor, cfg.standardise_cost, log_scale2)
    return mu + cache.center, var, log_a, log_R


def _scale_exponent(x: torch.Tensor, above: float) -> torch.Tensor:
    """``(N,)`` per row of ``x`` ``(N, ...)``: the ``e`` with ``2^e <= max |x_n| < 2^(e + 1)`` where that maximum
    exceeds ``2^above``, else 0 (rows of ordinary magnitude are left exactly as they are)."""
    e = torch.frexp(_peak(x.flatten(1), dim=1))[1] - 1
    return torch.where(e >= above, e, torch.zeros_like(e))


def _max_exponent(dtype: torch.dtype) -> int:
    """``emax`` with ``finfo(dtype).max < 2^emax`` (128 for float32, 1024 for float64)."""
    return math.frexp(torch.finfo(dtype).max)[1]


def _times_pow2(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``x * 2^e`` for ``0 <= e <= 2 emax`` (``e`` ``(N,)`` per row), saturated at the dtype's largest values:
    two factors, each a representable power of two."""
    big = torch.finfo(x.dtype).max
    e = e.view(-1, *([1] * (x.dim() - 1)))
    half = torch.div(e, 2, rounding_mode="floor")
    return (x * torch.exp2(half.to(x.dtype)) * torch.exp2((e - half).to(x.dtype))).clamp(-big, big)


def _unscaled(outputs, scale_exp: torch.Tensor | None, out_dtype: torch.dtype):
    """``mu``, ``var`` back from units of ``2^scale_exp`` and every output cast to ``out_dtype``, saturated at its
    largest finite values (``var`` of votes spread beyond the dtype's range, log activations of half inputs)."""
    mu, var, log_a, log_R = outputs
    if scale_exp is not None:
        mu, var = _times_pow2(mu, scale_exp), _times_pow2(_times_pow2(var, scale_exp), scale_exp)
    if out_dtype == mu.dtype:
        return mu, var, log_a, log_R
    finfo = torch.finfo(out_dtype)
    return tuple(t.clamp(finfo.min, finfo.max).to(out_dtype) for t in (mu, var, log_a, log_R))


class _WideBackward(torch.autograd.Function):
    """``fn(*inputs)`` as it is in the forward pass; its gradient taken again in float64 in the backward pass and
    saturated at the inputs' dtype's largest values.  For float32 routing of rescaled votes: the gradient of the
    variances, ``2^(2e)`` times that of the rescaled ones, overflows float32 inside the backward pass (votes from
    about 4e18 on) although the gradient reaching the votes (``2^-e`` times that again) is finite."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            wide = [x.detach().double().requires_grad_(need) for x, need in zip(inputs, needs)]
            outs = ctx.fn(*wide)
            pairs = [(o, g.double()) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            asked = [w for w in wide if w.requires_grad]
            found = torch.autograd.grad([o for o, _ in pairs], asked, [g for _, g in pairs], allow_unused=True)
        found = iter(found)
        result = []
        for x, need in zip(inputs, needs):
            g = next(found) if need else None
            if g is not None:
                big = torch.finfo(x.dtype).max
                g = g.clamp(-big, big).to(x.dtype)
            result.append(g)
        return (None, *result)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _em_routing(votes, log_a_in, beta_v, beta_a, cfg: EMConfig, normalise, scale_exp=None):
    """:func:`em_routing` in the inputs' dtype (float32 or float64), rescaling ``votes`` by ``scale_exp`` (as
    :func:`_scale_exponent` gives it for them; None: computed here)."""
    if scale_exp is None:
        scale_exp = _scale_exponent(votes, _max_exponent(votes.dtype) / 4)
    if bool((scale_exp != 0).any()):
        votes = votes / torch.exp2(scale_exp.to(votes.dtype)).view(-1, 1, 1, 1)
    else:
        scale_exp = None
    return _unscaled(_route(votes_cache(votes), log_a_in, beta_v, beta_a, cfg, normalise, scale_exp),
                     scale_exp, votes.dtype)


def em_routing(votes: torch.Tensor, log_a_in: torch.Tensor, beta_v: torch.Tensor, beta_a: torch.Tensor,
               cfg: EMConfig = EMConfig(), normalise: Callable[[torch.Tensor], torch.Tensor] = log_softmax_parents):
    """EM routing of votes ``(N, J, I, H)`` (``H = 16`` for 4x4 poses) given as a tensor, with the inputs' log
    activations ``log_a_in (N, I)`` (``-inf`` allowed: clamped at ``cfg.log_a_floor``) and ``beta_v, beta_a (J,)``;
    ``normalise`` maps E-step logits ``(N, J, I)`` to ``log R`` (default: log-softmax over ``J``).  Returns ``mu (N, J,
    H)``, ``var (N, J, H)``, ``log a_out (N, J)`` and the last ``log R (N, J, I)``, in ``votes``' dtype (computed in
    float32 for half precision).  ``N`` may be 0."""
    out_dtype, dtype = votes.dtype, _compute_dtype(votes.dtype, "em_routing")
    votes, log_a_in, beta_v, beta_a = (t.to(dtype) for t in (votes, log_a_in, beta_v, beta_a))
    scale_exp = _scale_exponent(votes, _max_exponent(votes.dtype) / 4)
    if dtype == torch.float32 and bool((scale_exp != 0).any()) and _needs_grad(votes, log_a_in, beta_v, beta_a):
        outputs = _WideBackward.apply(lambda *xs: _em_routing(*xs, cfg, normalise), votes, log_a_in, beta_v, beta_a)
    else:
        outputs = _em_routing(votes, log_a_in, beta_v, beta_a, cfg, normalise, scale_exp)
    return _unscaled(outputs, None, out_dtype)


def _em_routing_conv(M, W, log_a_in, beta_v, beta_a, cfg: EMConfig, normalise):
    """:func:`em_routing_conv` in the inputs' dtype (float32 or float64)."""
    dtype = M.dtype
    above = _max_exponent(dtype) / 8
    e_M = _scale_exponent(M, above)                                     # (N,)
    e_W = _scale_exponent(W.reshape(1, -1), above)                      # (1,)
    scale_exp = None
    if bool((e_M != 0).any() or (e_W != 0).any()):
        M = M / torch.exp2(e_M.to(dtype)).view(-1, 1, 1, 1)
        W = W / torch.exp2(e_W.to(dtype))
        scale_exp = e_M + e_W
    return _unscaled(_route(conv_votes_cache(M, W), log_a_in, beta_v, beta_a, cfg, normalise, scale_exp),
                     scale_exp, dtype)


def em_routing_conv(M: torch.Tensor, W: torch.Tensor, log_a_in: torch.Tensor, beta_v: torch.Tensor,
                    beta_a: torch.Tensor, cfg: EMConfig = EMConfig(),
                    normalise: Callable[[torch.Tensor], torch.Tensor] = log_softmax_parents):
    """EM routing with the votes ``M[n, i] @ W[i, j]`` computed inside (never stored by autograd): ``M (N, I, 4, 4)``
    input poses per output position, ``W (I, J, 4, 4)``; otherwise as :func:`em_routing`."""
    out_dtype, dtype = M.dtype, _compute_dtype(M.dtype, "em_routing_conv")
    M, W, log_a_in, beta_v, beta_a = (t.to(dtype) for t in (M, W, log_a_in, beta_v, beta_a))
    above = _max_exponent(dtype) / 8
    rescaled = bool((_scale_exponent(M, above) != 0).any() or (_scale_exponent(W.reshape(1, -1), above) != 0).any())
    route = lambda *xs: _em_routing_conv(*xs, cfg, normalise)
    if dtype == torch.float32 and rescaled and _needs_grad(M, W, log_a_in, beta_v, beta_a):
        outputs = _WideBackward.apply(route, M, W, log_a_in, beta_v, beta_a)
    else:
        outputs = route(M, W, log_a_in, beta_v, beta_a)
    return _unscaled(outputs, None, out_dtype)
