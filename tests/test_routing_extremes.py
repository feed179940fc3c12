"""Routing over the whole float range: squash, dynamic routing (reference and fused) and EM routing in float16,
bfloat16, float32 and float64, at magnitudes from each dtype's smallest normal number to a tenth of its largest
(log-spaced, random signs and directions, seeded); and the stable forms against the plain formulas in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probcaps.errors import ConfigError
from probcaps.models.em_routing import EMConfig, em_routing, em_routing_conv
from probcaps.models.routing import capsule_predictions, dynamic_routing, linear_dynamic_routing, squash

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
IDS = ["float16", "bfloat16", "float32", "float64"]


def _magnitudes(dtype: torch.dtype, count: int = 24) -> torch.Tensor:
    """``(count,)`` float64, log-spaced from ``finfo.tiny`` to ``finfo.max / 10``."""
    f = torch.finfo(dtype)
    return torch.logspace(math.log10(f.tiny), math.log10(f.max / 10), count, dtype=torch.float64)


def _vectors(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """``(M, *shape)`` in ``dtype``: row ``m`` has random signs and direction and largest entry about the m-th
    magnitude (entries of a random direction scaled so that the largest is the magnitude)."""
    g = torch.Generator().manual_seed(seed)
    mags = _magnitudes(dtype)
    x = torch.randn(len(mags), *shape, generator=g, dtype=torch.float64)
    x = x / x.flatten(1).abs().amax(1).view(-1, *[1] * len(shape))
    return (x * mags.view(-1, *[1] * len(shape))).to(dtype)


def _tol(dtype: torch.dtype) -> float:
    """Rounding tolerance of a sum of a few terms in ``dtype``."""
    return 8 * torch.finfo(dtype).eps


def _norm_exact(v: torch.Tensor, dim: int = -1) -> np.ndarray:
    """Norm of the stored values in extended precision (numpy long double), free of the check's own rounding
    at the 1 - eps level."""
    a = v.detach().to(torch.float64).numpy().astype(np.longdouble)
    return np.sqrt((a * a).sum(axis=dim))


# --------------------------------------------------------------------------- squash


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("dim_size", [1, 8, 16])
def test_squash_is_finite_with_norm_below_one_and_finite_gradient(dtype, dim_size):
    s = _vectors(dtype, (5, dim_size), seed=dim_size).requires_grad_(True)
    v = squash(s)
    assert v.dtype == dtype and torch.isfinite(v).all()
    norms = _norm_exact(v)
    assert (norms >= 0).all() and (norms < 1).all()
    weights = torch.randn(v.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (v * weights).sum().backward()
    assert torch.isfinite(s.grad).all()
    # zero maps to zero with gradient zero
    z = torch.zeros(2, dim_size, dtype=dtype, requires_grad=True)
    out = squash(z)
    out.sum().backward()
    assert (out == 0).all() and (z.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_squash_plain_and_scaled_paths_agree(dtype):
    # a tensor with one row whose |s|^2 overflows takes the scaled path for every row; the other rows alone take
    # the plain formula: values and gradients agree to rounding (compared where the outputs, about |s|^2, are
    # normal numbers: below, both are rounded to the subnormals' fewer digits)
    f = torch.finfo(dtype)
    s = _vectors(dtype, (3, 8), seed=20)
    n2 = (s.double() ** 2).sum(-1)
    plain_rows = (n2 < f.max / 4).all(1)
    assert 0 < plain_rows.sum() < len(s)
    a = s.clone().requires_grad_(True)
    b = s[plain_rows].clone().requires_grad_(True)
    va, vb = squash(a), squash(b)
    w = torch.randn(va.shape, generator=torch.Generator().manual_seed(21), dtype=dtype)
    (va * w).sum().backward()
    (vb * w[plain_rows]).sum().backward()
    normal = (n2[plain_rows] > 16 * f.tiny / f.eps).all(1)
    assert normal.sum() >= 4
    va, vb, ga, gb = va.detach()[plain_rows][normal], vb.detach()[normal], a.grad[plain_rows][normal], b.grad[normal]
    assert torch.allclose(va, vb, rtol=4 * f.eps, atol=0)
    scale = gb.abs().amax((1, 2), keepdim=True)
    assert torch.allclose(ga / scale, gb / scale, rtol=0, atol=8 * f.eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_squash_of_a_huge_vector_is_a_unit_vector_in_its_direction(dtype):
    f = torch.finfo(dtype)
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(6, 16, generator=g, dtype=torch.float64)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    for length in (1e4 if dtype == torch.float16 else 1e13, f.max / 10):
        s = (length / 4 * direction).to(dtype)  # largest entry below length / 4 * 1: finite in dtype
        v = squash(s)
        norms = _norm_exact(v)
        # below 1 by the margin for the direction's rounding ((D + 6) units of float32/float64, plus the cast)
        assert (norms < 1).all() and (norms > 1 - 32 * f.eps).all(), (length, norms)
        d = s.double() / s.double().abs().amax(-1, keepdim=True)  # (the check's own norm must not overflow)
        cos = (v.double() * d).sum(-1) / (v.double().norm(dim=-1) * d.norm(dim=-1))
        assert (cos > 1 - 4 * f.eps).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_squash_of_a_tiny_vector_has_length_norm_squared(dtype):
    # |s| small: v = s |s| / (1 + |s|^2) to within rounding, direction kept (no eps in the norm to distort it)
    s = torch.tensor([[3.0, 4.0]], dtype=torch.float64) * (0.01 if dtype == torch.float16 else 1e-6)
    v = squash(s.to(dtype)).double()
    n = s.norm()
    assert torch.allclose(v, s * n / (1 + n * n), rtol=_tol(dtype), atol=0)


def test_stable_squash_equals_the_plain_formula_in_float64():
    # where |s|^2 does not overflow or underflow, the scaled computation is the paper's formula to rounding,
    # values and gradients (plain: v = s |s| / (1 + |s|^2))
    g = torch.Generator().manual_seed(4)
    mags = torch.logspace(-100, 100, 41, dtype=torch.float64)
    s = torch.randn(41, 3, 16, generator=g, dtype=torch.float64) * mags.view(-1, 1, 1)
    s.requires_grad_(True)
    n = s.norm(dim=-1, keepdim=True)
    plain = s * (n / (1 + n * n))
    stable = squash(s)
    # the length is capped (D + 6) units below 1 (lengths within that of 1 differ by at most the cap)
    assert torch.allclose(stable, plain, rtol=1e-13, atol=0)
    w = torch.randn(plain.shape, generator=g, dtype=torch.float64)
    g_plain = torch.autograd.grad((plain * w).sum(), s)[0]
    g_stable = torch.autograd.grad((stable * w).sum(), s)[0]
    # where the length is capped its gradient is 0 instead of 2 / |s|^3, below 1e-13 of the direction's |s|^-1
    scale = g_plain.abs().amax((1, 2), keepdim=True)
    assert torch.allclose(g_stable / scale, g_plain / scale, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- dynamic routing


def _plain_dynamic_routing(u_hat: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Procedure 1 of Sabour et al. (2017) written as in the paper (no scaling)."""
    B, J, I, D = u_hat.shape
    b = u_hat.new_zeros(B, J, I)
    for r in range(iterations):
        c = torch.softmax(b, dim=1)
        s = (c.unsqueeze(-1) * u_hat).sum(2)
        n = s.norm(dim=-1, keepdim=True)
        v = s * (n / (1 + n * n))
        if r < iterations - 1:
            b = b + (u_hat * v.unsqueeze(2)).sum(-1)
    return v, c


def _check_routing(v, c, dtype, B, J, I, D):
    assert v.shape == (B, J, D) and c.shape == (B, J, I) and v.dtype == dtype and c.dtype == dtype
    assert torch.isfinite(v).all() and torch.isfinite(c).all()
    assert (c >= 0).all()
    assert torch.allclose(c.double().sum(1), torch.ones(B, I, dtype=torch.float64), atol=_tol(dtype), rtol=0)
    assert (_norm_exact(v) < 1).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("detach", [False, True])
def test_dynamic_routing_is_finite_over_the_whole_range(dtype, detach):
    J, I, D = 3, 5, 4
    u_hat = _vectors(dtype, (J, I, D), seed=5).requires_grad_(True)
    B = u_hat.shape[0]
    v, c = dynamic_routing(u_hat, 3, detach=detach)
    _check_routing(v, c, dtype, B, J, I, D)
    weights = torch.randn(v.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    (v * weights).sum().backward()
    assert torch.isfinite(u_hat.grad).all()


@pytest.mark.parametrize("dtype,product", [(d, None) for d in DTYPES] + [(torch.float32, torch.bfloat16),
                                                                          (torch.float64, torch.bfloat16)],
                         ids=IDS + ["float32-bfloat16 products", "float64-bfloat16 products"])
def test_fused_routing_is_finite_over_the_whole_range(dtype, product):
    # bfloat16 products of float64 inputs: the votes must be scaled into bfloat16's window, not float64's
    J, I, P, D = 3, 5, 4, 6
    # children of every magnitude with unit-size transforms, and squashed children with transforms of every
    # magnitude (CapsNet's case: predictions as large as the weights)
    u = _vectors(dtype, (I, P), seed=6)
    w_unit = (torch.randn(J, I, P, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64) / P)
    pairs = [(u, w_unit.to(dtype))]
    squashed = squash(torch.randn(4, I, P, generator=torch.Generator().manual_seed(8))).to(dtype)
    for mag in _magnitudes(dtype, 6).tolist():
        w = torch.randn(J, I, P, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        pairs.append((squashed, (w / w.abs().max() * mag).to(dtype)))
    for u_, w_ in pairs:
        u_ = u_.clone().requires_grad_(True)
        w_ = w_.clone().requires_grad_(True)
        v, c = linear_dynamic_routing(u_, w_, 3, product_dtype=product)
        _check_routing(v, c, dtype, u_.shape[0], J, I, D)
        (v.float() ** 2).sum().backward()
        assert torch.isfinite(u_.grad).all() and torch.isfinite(w_.grad).all()


def test_stable_routing_equals_the_plain_procedure_in_float64():
    # votes from 1e-100 to 1e100: the plain procedure's squares and logits stay inside float64 there
    g = torch.Generator().manual_seed(10)
    mags = torch.logspace(-100, 100, 21, dtype=torch.float64)
    u_hat = torch.randn(21, 3, 5, 4, generator=g, dtype=torch.float64) * mags.view(-1, 1, 1, 1)
    for iterations in (1, 2, 3):
        v1, c1 = dynamic_routing(u_hat, iterations)
        v2, c2 = _plain_dynamic_routing(u_hat, iterations)
        assert torch.allclose(c1, c2, rtol=1e-12, atol=1e-300)
        assert torch.allclose(v1, v2, rtol=1e-12, atol=0)
    # the fused path routes the same predictions: children of every magnitude, weights of size one
    u = torch.randn(21, 5, 4, generator=g, dtype=torch.float64) * mags.view(-1, 1, 1)
    w = torch.randn(3, 5, 4, 6, generator=g, dtype=torch.float64)
    v1, c1 = linear_dynamic_routing(u, w, 3)
    v2, c2 = _plain_dynamic_routing(capsule_predictions(u, w.permute(1, 0, 3, 2)), 3)
    assert torch.allclose(c1, c2, rtol=1e-10, atol=1e-300) and torch.allclose(v1, v2, rtol=1e-10, atol=0)


def test_half_precision_routing_matches_float32():
    # votes around 1e3 overflowed float16's squared norms and agreements: routed in float32 and cast back, the
    # result is float32's to the half dtype's rounding
    g = torch.Generator().manual_seed(11)
    u_hat = 1e3 * torch.randn(4, 3, 5, 8, generator=g)
    for dtype in (torch.float16, torch.bfloat16):
        v, c = dynamic_routing(u_hat.to(dtype), 3)
        v32, c32 = dynamic_routing(u_hat.to(dtype).float(), 3)
        # (the half result's lengths are capped a unit of the half dtype lower, so that the cast stays below 1)
        assert torch.allclose(v.float(), v32, rtol=0, atol=2 * torch.finfo(dtype).eps)
        assert torch.allclose(c.float(), c32, rtol=0, atol=torch.finfo(dtype).eps)


# --------------------------------------------------------------------------- EM routing


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_em_routing_is_finite_over_the_whole_range(dtype):
    J, I = 2, 5
    votes = _vectors(dtype, (J, I, 16), seed=12).requires_grad_(True)
    N = votes.shape[0]
    g = torch.Generator().manual_seed(13)
    log_a = torch.rand(N, I, generator=g).log().to(dtype)
    beta_v = torch.zeros(J, dtype=dtype, requires_grad=True)
    beta_a = torch.zeros(J, dtype=dtype, requires_grad=True)
    mu, var, log_a_out, log_R = em_routing(votes, log_a, beta_v, beta_a, EMConfig(iterations=3))
    for t in (mu, var, log_a_out, log_R):
        assert t.dtype == dtype and torch.isfinite(t).all()
    a = log_a_out.double().exp()
    assert ((a >= 0) & (a <= 1)).all()
    assert torch.allclose(log_R.double().exp().sum(1), torch.ones(N, I, dtype=torch.float64), atol=_tol(dtype))
    # each parent's mean lies within the range of its votes (a weighted mean)
    lo, hi = votes.detach().double().amin(2), votes.detach().double().amax(2)
    slack = _tol(dtype) * votes.detach().double().abs().amax(2)
    assert ((mu.double() >= lo - slack) & (mu.double() <= hi + slack)).all()
    (mu.double().sum() + log_a_out.double().sum()).backward()
    assert torch.isfinite(votes.grad).all() and torch.isfinite(beta_v.grad).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_conv_em_routing_is_finite_over_the_whole_range(dtype):
    I, J = 4, 2
    g = torch.Generator().manual_seed(15)
    f = torch.finfo(dtype)
    poses = _vectors(dtype, (I, 4, 4), seed=14)
    unit = torch.randn(4, I, 4, 4, generator=g, dtype=torch.float64).clamp(-2, 2).to(dtype)
    w = torch.randn(I, J, 4, 4, generator=g, dtype=torch.float64)
    w = w / w.abs().amax()
    # poses of every size with transforms of size 1/4 and of the smallest normal size; poses of size one with
    # transforms up to a fortieth of the largest value (votes up to a tenth of it)
    for M, W in ((poses, w / 4), (poses, w * f.tiny), (unit, w * f.max / 40)):
        M = M.clone().requires_grad_(True)
        W = W.to(dtype).requires_grad_(True)
        N = M.shape[0]
        log_a = torch.rand(N, I, generator=g).log().to(dtype)
        mu, var, log_a_out, log_R = em_routing_conv(M, W, log_a, torch.zeros(J, dtype=dtype),
                                                    torch.zeros(J, dtype=dtype), EMConfig(iterations=3))
        for t in (mu, var, log_a_out, log_R):
            assert t.dtype == dtype and torch.isfinite(t).all()
        assert torch.allclose(log_R.double().exp().sum(1), torch.ones(N, I, dtype=torch.float64), atol=_tol(dtype))
        grads = torch.autograd.grad(mu.double().sum() + log_a_out.double().sum(), (M, W))
        assert all(torch.isfinite(x).all() for x in grads)


def test_em_rows_of_ordinary_size_are_routed_as_given():
    # one row of huge votes is rescaled; the others are routed bit for bit as when routed alone
    g = torch.Generator().manual_seed(16)
    votes = torch.randn(3, 2, 5, 16, generator=g)
    log_a = torch.rand(3, 5, generator=g).log()
    beta = torch.zeros(2)
    alone = em_routing(votes[:2], log_a[:2], beta, beta)
    mixed = votes.clone()
    mixed[2] *= 1e30
    together = em_routing(mixed, log_a, beta, beta)
    for a, b in zip(alone, together):
        assert torch.equal(a, b[:2])


def test_rescaled_em_routing_equals_float64_routing_of_the_votes_as_given():
    # votes beyond float32's squares (2^40, 2^50 times N(0, 1)), rescaled inside, agree with float64, which routes
    # them as given (its squares stay far inside its range): means, variances, activations and assignments to
    # float32 accuracy.  (Row 1 has a parent whose variance is the floor, 1e-4, which float32 resolves next to
    # votes up to about 2^51; larger votes raise that parent's floor.)
    g = torch.Generator().manual_seed(17)
    votes = torch.randn(2, 3, 6, 16, generator=g, dtype=torch.float64)
    log_a = torch.rand(2, 6, generator=g, dtype=torch.float64).log()
    beta = torch.zeros(3, dtype=torch.float64)
    for k in (40, 50):
        v = 2.0 ** k * votes
        ref = em_routing(v, log_a, beta, beta)
        mu, var, log_a_out, log_R = em_routing(v.float(), log_a.float(), beta.float(), beta.float())
        assert torch.allclose(mu.double() / 2.0 ** k, ref[0] / 2.0 ** k, rtol=0, atol=1e-4)
        assert torch.allclose(var.double(), ref[1], rtol=1e-3)  # (second moment less the mean squared)
        assert torch.allclose(log_a_out.double(), ref[2], atol=1e-5)
        assert torch.allclose(log_R.double().exp(), ref[3].exp(), atol=1e-4)
    # the spread squared beyond float32 (2^200): var saturates instead of overflowing, means still agree
    mu, var, *_ = em_routing((2.0 ** 100 * votes).float(), log_a.float(), beta.float(), beta.float())
    ref = em_routing(2.0 ** 100 * votes, log_a, beta, beta)
    beyond = ref[1] > torch.finfo(torch.float32).max
    assert beyond.any() and (var[beyond] == torch.finfo(torch.float32).max).all() and torch.isfinite(var).all()
    assert torch.allclose(mu.double() / 2.0 ** 100, ref[0] / 2.0 ** 100, rtol=0, atol=1e-3)


def test_rescaled_em_routing_gradient_is_exact():
    # float64 rescales votes above 2^256 (and poses above 2^128): with one iteration (no stop-gradient) the
    # gradient through the rescaled routing must match finite differences of the same function
    g = torch.Generator().manual_seed(18)
    votes = torch.randn(1, 2, 3, 16, generator=g, dtype=torch.float64, requires_grad=True)
    log_a = torch.rand(1, 3, generator=g, dtype=torch.float64).log().requires_grad_(True)
    beta_v, beta_a = torch.randn(2, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    cfg = EMConfig(iterations=1)

    def scaled(x, la, bv, ba):
        mu, var, log_a_out, _ = em_routing(2.0 ** 300 * x, la, bv, ba, cfg)
        return mu / 2.0 ** 300, var / 2.0 ** 600, log_a_out

    assert torch.autograd.gradcheck(scaled, (votes, log_a, beta_v, beta_a), fast_mode=True)
    M = torch.randn(1, 3, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)

    def scaled_conv(M, W, la):
        mu, var, log_a_out, _ = em_routing_conv(2.0 ** 140 * M, W, la, beta_v, beta_a, cfg)
        return mu / 2.0 ** 140, var / 2.0 ** 280, log_a_out

    assert torch.autograd.gradcheck(scaled_conv, (M, W, log_a), fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64] + ([torch.float8_e4m3fn]
                                                                   if hasattr(torch, "float8_e4m3fn") else []))
def test_other_dtypes_are_refused_in_one_line(dtype):
    x = torch.ones(1, 2, 3, 16).to(dtype)
    calls = [("squash", lambda: squash(x)), ("dynamic_routing", lambda: dynamic_routing(x)),
             ("linear_dynamic_routing", lambda: linear_dynamic_routing(x[0], torch.ones(2, 3, 16, 4).to(dtype))),
             ("em_routing", lambda: em_routing(x, torch.zeros(1, 3), torch.zeros(2), torch.zeros(2))),
             ("em_routing_conv", lambda: em_routing_conv(torch.ones(1, 3, 4, 4).to(dtype), torch.ones(3, 2, 4, 4),
                                                         torch.zeros(1, 3), torch.zeros(2), torch.zeros(2)))]
    for name, call in calls:
        with pytest.raises(ConfigError, match=f"^{name}: dtype {dtype} is not supported") as info:
            call()
        assert "\n" not in str(info.value)


def test_float16_products_are_refused_in_one_line():
    u, w = torch.ones(2, 3, 4), torch.ones(5, 3, 4, 6)
    with pytest.raises(ConfigError, match="^linear_dynamic_routing: product_dtype torch.float16 is not supported"):
        linear_dynamic_routing(u, w, product_dtype=torch.float16)


@pytest.mark.parametrize("mag", [1e-12, 1e30])
def test_fused_routing_equals_reference_beyond_the_window(mag):
    # weights far outside [2^-32, 2^32]: the fused path scales children and weights separately, the reference
    # scales the (representable) predictions; both give the same routing in float32
    g = torch.Generator().manual_seed(22)
    u = squash(torch.randn(3, 7, 4, generator=g))
    w = mag * torch.randn(5, 7, 4, 6, generator=g)
    v1, c1 = linear_dynamic_routing(u, w, 3)
    v2, c2 = dynamic_routing(capsule_predictions(u, w.permute(1, 0, 3, 2)), 3)
    assert torch.allclose(c1, c2, atol=1e-5)
    assert v2.abs().max() > 0 and torch.allclose(v1, v2, rtol=1e-4, atol=1e-5 * float(v2.abs().max()))


# --------------------------------------------------------------------------- gradients at the dtype's extremes


@pytest.mark.parametrize("magnitude", [4e18, 1e19, 3e19, 1e25, 1e37])
def test_em_routing_gradient_of_every_output_is_finite_for_huge_float32_votes(magnitude):
    # catches: the variances' gradient, 2^(2e) times that of the rescaled ones, overflowing float32 inside the
    # backward pass (inf gradients on votes near 1e19) although the gradient reaching the votes is finite
    g = torch.Generator().manual_seed(21)
    votes = (torch.randn(3, 4, 5, 16, generator=g) * magnitude).requires_grad_(True)
    log_a = torch.rand(3, 5, generator=g).log().requires_grad_(True)
    beta_v, beta_a = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    outputs = em_routing(votes, log_a, beta_v, beta_a)
    for out in outputs[:3]:
        grads = torch.autograd.grad(out.double().sum(), (votes, log_a, beta_v, beta_a), retain_graph=True,
                                    allow_unused=True)
        assert all(x is None or torch.isfinite(x).all() for x in grads)
    M = (torch.randn(3, 5, 4, 4, generator=g) * magnitude ** 0.5).requires_grad_(True)
    W = (torch.randn(5, 4, 4, 4, generator=g) * magnitude ** 0.5).requires_grad_(True)
    mu, var, log_a_out, _ = em_routing_conv(M, W, log_a, beta_v, beta_a)
    grads = torch.autograd.grad(var.double().sum() + mu.double().sum() + log_a_out.double().sum(), (M, W, log_a))
    assert all(torch.isfinite(x).all() for x in grads)


def test_em_routing_wide_backward_matches_the_plain_gradient_where_both_are_finite():
    # catches: the float64 backward of rescaled float32 routing computing another function's gradient
    g = torch.Generator().manual_seed(22)
    votes = torch.randn(2, 3, 4, 16, generator=g, dtype=torch.float64) * 2.0 ** 40
    log_a = torch.rand(2, 4, generator=g, dtype=torch.float64).log()
    beta = torch.zeros(3, dtype=torch.float64)
    cfg = EMConfig(iterations=1)  # no stop-gradient iterations: both differentiate one function
    v32 = votes.float().requires_grad_(True)
    mu, _, log_a_out, _ = em_routing(v32, log_a.float(), beta.float(), beta.float(), cfg)
    (grad32,) = torch.autograd.grad(mu.double().sum() / 2.0 ** 40 + log_a_out.double().sum(), v32)
    v64 = v32.detach().double().requires_grad_(True)
    mu, _, log_a_out, _ = em_routing(v64, log_a, beta, beta, cfg)
    (grad64,) = torch.autograd.grad(mu.sum() / 2.0 ** 40 + log_a_out.sum(), v64)
    assert torch.allclose(grad32.double(), grad64, rtol=1e-3, atol=1e-6 * grad64.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("beta_v", [1e30, 1e37, 0.5, -1e37])
def test_em_routing_is_finite_for_huge_beta_v(dtype, beta_v):
    # catches: H beta_v summed over the pose entries overflowing float32 (beta_v >= 1e37) and the cost's
    # standardisation turning inf - inf into NaN activations
    g = torch.Generator().manual_seed(23)
    votes = torch.randn(2, 3, 4, 16, generator=g, dtype=dtype, requires_grad=True)
    bv = torch.full((3,), beta_v, dtype=dtype, requires_grad=True)
    ba = torch.zeros(3, dtype=dtype, requires_grad=True)
    for standardise in (True, False):
        mu, var, log_a_out, log_R = em_routing(votes, torch.zeros(2, 4, dtype=dtype), bv, ba,
                                               EMConfig(standardise_cost=standardise))
        assert all(torch.isfinite(t).all() for t in (mu, var, log_a_out, log_R))
        grads = torch.autograd.grad(mu.sum() + log_a_out.sum(), (votes, bv, ba))
        assert all(torch.isfinite(x).all() for x in grads)


def test_every_routing_takes_an_empty_batch():
    # catches: reshape(0, -1) of the per-row scale search failing on a batch of 0 (the last, empty share of a
    # batch split over processes, or an empty evaluation split)
    J, I = 3, 4
    votes = torch.randn(0, J, I, 16, requires_grad=True)
    mu, var, log_a_out, log_R = em_routing(votes, torch.zeros(0, I), torch.zeros(J), torch.zeros(J))
    assert mu.shape == (0, J, 16) and log_a_out.shape == (0, J) and log_R.shape == (0, J, I)
    (mu.sum() + log_a_out.sum()).backward()
    assert votes.grad.shape == votes.shape
    mu, *_ = em_routing_conv(torch.randn(0, I, 4, 4), torch.randn(I, J, 4, 4), torch.zeros(0, I), torch.zeros(J),
                             torch.zeros(J))
    assert mu.shape == (0, J, 16)
    u_hat = torch.randn(0, J, I, 8, requires_grad=True)
    v, c = dynamic_routing(u_hat)
    assert v.shape == (0, J, 8) and c.shape == (0, J, I)
    v.sum().backward()
    v, c = linear_dynamic_routing(torch.randn(0, I, 8), torch.randn(J, I, 8, 16))
    assert v.shape == (0, J, 16) and c.shape == (0, J, I)
