"""The generative capsule model: its enumerated Pyro loss against a brute-force sum over every assignment of ``s``,
against the plain-torch ``log_joint``, numerical safety at the presence clamps, enumeration set-up, and SVI.

Each test says in a comment which bug it would catch.
"""

from __future__ import annotations

import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import TraceEnum_ELBO
from pyro.ops.indexing import Vindex

from probcaps.data import synthetic_digits, to_float
from probcaps.distributions import RELAXED_CLAMP, ClampedRelaxedBernoulli
from probcaps.inference.guides import CapsuleEncoder, DeltaGuide, EncoderConfig
from probcaps.models.capsule_model import CapsuleModel, CapsuleModelConfig, object_information, select_parent

K, M, T, S = 2, 3, 5, 12
DT = torch.float64

# hyperparameters away from the defaults (and from each other), so that a swapped or ignored one shows up
HYPER = dict(temperature=0.6, pixel_std=0.3, parent_pose_std=0.9, part_pose_std_init=0.15, part_pose_std_min=0.03,
             off_pose_std=0.7, clutter_pose_std=1.3, dummy_affinity=0.07, dummy_presence=0.15, expected_parents=0.8,
             init_offset_std=0.4)


def _model(dtype=DT, seed=0, **config) -> CapsuleModel:
    model = CapsuleModel(CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S, seed=seed,
                                            **{**HYPER, **config})).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # move every table away from its (symmetric) initial value
        model.log_affinity.copy_(torch.randn(K, M, generator=g))
        model.presence_logits.copy_(torch.randn(K, M, generator=g))
        model.offsets.add_(0.2 * torch.randn(K, M, 6, generator=g))
        model.pose_std_raw.add_(0.5 * torch.randn(K, M, 6, generator=g))
    return model


def _latents(B=2, dtype=DT, seed=3, codes=0):
    g = torch.Generator().manual_seed(seed)
    z1 = 0.05 + 0.9 * torch.rand(B, K, generator=g)
    y1 = 0.3 * torch.randn(B, K, 6, generator=g)
    if codes:  # each object's code after its pose, of the prior's scale
        y1 = torch.cat([y1, torch.randn(B, K, codes, generator=g)], -1)
    z0 = 0.05 + 0.9 * torch.rand(B, M, generator=g)
    y0 = 0.3 * torch.randn(B, M, 6, generator=g)
    return tuple(v.to(dtype) for v in (z1, y1, z0, y0))


def _images(model, z0, y0, seed=4):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        image, _ = model.render(z0, y0)
    noise = 0.2 * torch.randn(image.shape, generator=g).to(image.dtype)
    return (image + noise).clamp(0, 1)


class FixedGuide:
    """Delta guide at given values, with the model's plates: data at dim -2, parents/children at dim -1."""

    def __init__(self, z1, y1, z0, y0):
        self.values = z1, y1, z0, y0

    def __call__(self, x, expected_parents=None):
        z1, y1, z0, y0 = self.values
        data = pyro.plate("data", x.shape[0], dim=-2)
        with data, pyro.plate("parents", z1.shape[-1], dim=-1):
            pyro.sample("z1", dist.Delta(z1))
            pyro.sample("y1", dist.Delta(y1).to_event(1))
        with data, pyro.plate("children", z0.shape[-1], dim=-1):
            pyro.sample("z0", dist.Delta(z0))
            pyro.sample("y0", dist.Delta(y0).to_event(1))


@pytest.fixture(autouse=True)
def _setup(pyro_clean, seed):
    yield


# --------------------------------------------------------------------------------------------- brute force

def _relaxed_bernoulli_log_density(y, p, tau):
    """First principles: logit(Y) ~ Logistic(logit(p) / τ, 1 / τ), then the sigmoid's Jacobian.

    log p(y) = log τ + (l − τ u) − 2 log(1 + exp(l − τ u)) − log y − log(1 − y),
    with u = logit(y), l = 6 tanh(logit(p) / 6) (the package bounds every presence logit to ±6, see
    probcaps.distributions.MAX_LOGIT).
    """
    y, p = torch.as_tensor(y, dtype=DT), torch.as_tensor(p, dtype=DT)
    u = torch.log(y) - torch.log1p(-y)
    l = 6.0 * torch.tanh((torch.log(p) - torch.log1p(-p)) / 6.0)
    a = l - tau * u
    return math.log(tau) + a - 2 * F.softplus(a) - torch.log(y) - torch.log1p(-y)


def _normal_log_density(x, mean, var):
    return -0.5 * (math.log(2 * math.pi) + torch.log(var) + (x - mean) ** 2 / var)


def _brute_force_neg_log_marginal(model, x, z1, y1, z0, y0):
    """−Σ_b log Σ_s p(x_b, z_b, y_b, s) by explicit loops over all (K+1)^M assignments, from the raw parameters.

    Written without ``child_tables`` / ``child_pose_std`` / ``log_joint``; only the rendering (``model.render``) is
    shared with the model.  Differentiable w.r.t. the model's parameters.
    """
    cfg = model.config
    tau = cfg.temperature
    rho = torch.cat([torch.full((1, M), cfg.dummy_affinity, dtype=DT), model.log_affinity.exp()], 0)   # (K+1, M)
    gamma = torch.cat([torch.full((1, M), cfg.dummy_presence, dtype=DT), torch.sigmoid(model.presence_logits)], 0)
    sigma = cfg.part_pose_std_min + F.softplus(model.pose_std_raw)                                      # (K, M, 6)
    pi = cfg.expected_parents / K
    total = 0.0
    for b in range(x.shape[0]):
        lp_parents = sum(_relaxed_bernoulli_log_density(z1[b, k], pi, tau) for k in range(K))
        var_parent = torch.tensor(cfg.parent_pose_std ** 2, dtype=DT)
        lp_parents = lp_parents + _normal_log_density(y1[b, :, :6], 0.0, var_parent).sum()
        lp_parents = lp_parents + _normal_log_density(y1[b, :, 6:], 0.0, torch.tensor(1.0, dtype=DT)).sum()
        image, _ = model.render(z0[b:b + 1], y0[b:b + 1])
        lp_pixels = _normal_log_density(x[b], image[0], torch.tensor(cfg.pixel_std ** 2, dtype=DT)).sum()
        z1_full = torch.cat([torch.ones(1, dtype=DT), z1[b]])
        terms = []
        for s in itertools.product(range(K + 1), repeat=M):
            lp = lp_parents + lp_pixels
            for m, k in enumerate(s):
                weights = [rho[j, m] * z1_full[j] for j in range(K + 1)]
                lp = lp + torch.log(weights[k] / sum(weights))
                lp = lp + _relaxed_bernoulli_log_density(z0[b, m], gamma[k, m], tau)
                if k == 0:  # clutter: a wide zero-mean Normal
                    mean = torch.zeros(6, dtype=DT)
                    var_on = torch.full((6,), cfg.clutter_pose_std ** 2, dtype=DT)
                else:
                    offset = model.offsets[k - 1, m]
                    for p in range(6 if cfg.object_code_dims else 0):  # Δ_km + U_km c_k, U's rows shortened
                        u = model.code_basis[k - 1, m, p]
                        u = u * min(1.0, cfg.code_deformation_std / u.norm())
                        offset = offset + torch.eye(6, dtype=DT)[p] * (u @ y1[b, k - 1, 6:])
                    P = _pose_matrix(y1[b, k - 1, :6]) @ _pose_matrix(offset)
                    mean = torch.stack([P[0, 0] - 1, P[0, 1], P[0, 2], P[1, 0], P[1, 1] - 1, P[1, 2]])
                    var_on = sigma[k - 1, m] ** 2
                var = z0[b, m] * var_on + (1 - z0[b, m]) * cfg.off_pose_std ** 2
                lp = lp + _normal_log_density(y0[b, m], mean, var).sum()
            terms.append(lp)
        total = total - torch.logsumexp(torch.stack(terms), 0)
    return total


def _pose_matrix(y):
    """P(y) built entry by entry (differentiable, independent of probcaps.geometry)."""
    one, zero = torch.ones((), dtype=y.dtype), torch.zeros((), dtype=y.dtype)
    return torch.stack([torch.stack([1 + y[0], y[1], y[2]]), torch.stack([y[3], 1 + y[4], y[5]]),
                        torch.stack([zero, zero, one])])


def _enum_loss(model, guide, x, **kwargs):
    return TraceEnum_ELBO(max_plate_nesting=2).differentiable_loss(model, guide, x, **kwargs)


def test_relaxed_bernoulli_first_principles_matches_pyro():
    # catches: a mistake in the brute force's own density (so the comparison below tests the model, not this file)
    y = torch.tensor([0.01, 0.3, 0.5, 0.97], dtype=DT)
    p = torch.tensor([0.2, 0.5, 0.9, 0.4], dtype=DT)
    bounded = 6.0 * torch.tanh(torch.logit(p) / 6.0)
    ref = dist.RelaxedBernoulli(torch.tensor(0.6, dtype=DT), logits=bounded).log_prob(y)
    assert torch.allclose(_relaxed_bernoulli_log_density(y, p, 0.6), ref, rtol=1e-10)
    # and it integrates to one
    grid = torch.linspace(1e-6, 1 - 1e-6, 200001, dtype=DT)
    dens = _relaxed_bernoulli_log_density(grid, torch.tensor(0.3, dtype=DT), 0.6).exp()
    assert abs(torch.trapezoid(dens, grid).item() - 1) < 2e-3


def test_enumerated_loss_equals_brute_force_sum_over_assignments():
    # catches: any error in the selection probabilities (ρ z1 / Σ ρ z1 with the dummy first), γ or the dummy's
    # presence, the pose means pose6(P(y1) P(Δ)) (e.g. composed in the wrong order), the interpolated variance,
    # the clutter Normal, a mis-indexed Vindex gather, enumeration summing over the wrong dim, or ``s`` being
    # enumerated per image instead of per child; and gradients of the same.
    model = _model()
    z1, y1, z0, y0 = _latents()
    x = _images(model, z0, y0)
    loss = _enum_loss(model, FixedGuide(z1, y1, z0, y0), x)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    brute = _brute_force_neg_log_marginal(model, x, z1, y1, z0, y0)
    brute_grads = torch.autograd.grad(brute, params, allow_unused=True)
    assert loss.dtype == DT
    assert math.isclose(loss.item(), brute.item(), rel_tol=1e-9), (loss.item(), brute.item())
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, g, gb in zip(names, grads, brute_grads):
        g = torch.zeros_like(gb) if g is None else g
        gb = torch.zeros_like(g) if gb is None else gb
        assert torch.allclose(g, gb, rtol=1e-7, atol=1e-9), name
    # the pose and selection terms matter here (not swamped by the pixels): changing Δ changes the loss
    with torch.no_grad():
        model.offsets.add_(0.1)
    assert abs(_enum_loss(model, FixedGuide(z1, y1, z0, y0), x).item() - loss.item()) > 1e-3


def test_enumerated_loss_with_object_codes_equals_brute_force():
    # catches: a code that deforms another object's offsets or the wrong parts', U_km's rows left unbounded or
    # shortened when already within the bound, the code's prior missing or at the pose prior's scale
    model = _model(object_code_dims=2, code_deformation_std=0.3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # rows on both sides of the bound
        model.code_basis.copy_(0.4 * torch.randn(K, M, 6, 2, generator=g, dtype=DT))
    lengths = model.code_basis.norm(dim=-1)
    assert (lengths > 0.3).any() and (lengths < 0.3).any()
    z1, y1, z0, y0 = _latents(codes=2)
    x = _images(model, z0, y0)
    loss = _enum_loss(model, FixedGuide(z1, y1, z0, y0), x)
    brute = _brute_force_neg_log_marginal(model, x, z1, y1, z0, y0)
    assert math.isclose(loss.item(), brute.item(), rel_tol=1e-9), (loss.item(), brute.item())
    grad, = torch.autograd.grad(loss, model.code_basis)
    brute_grad, = torch.autograd.grad(brute, model.code_basis)
    assert torch.allclose(grad, brute_grad, rtol=1e-7, atol=1e-9)
    # the codes matter: other codes, another loss; a model without codes has no basis to load
    y1_other = torch.cat([y1[..., :6], y1[..., 6:] + 1], -1)
    assert abs(_enum_loss(model, FixedGuide(z1, y1_other, z0, y0), x).item() - loss.item()) > 1e-3
    assert "code_basis" not in _model().state_dict()


def test_enumerated_loss_float32_close_to_brute_force():
    # catches: float32-only problems (e.g. a log of a clamped zero) in the path training actually uses
    model64 = _model()
    model32 = _model(dtype=torch.float32)
    z1, y1, z0, y0 = _latents()
    x = _images(model64, z0, y0)
    loss32 = _enum_loss(model32, FixedGuide(*(v.float() for v in (z1, y1, z0, y0))), x.float())
    brute = _brute_force_neg_log_marginal(model64, x, z1, y1, z0, y0)
    assert math.isclose(loss32.item(), brute.item(), rel_tol=1e-4)


def test_enumerated_loss_equals_negative_log_joint():
    # catches: the Pyro model and the plain-torch reference (used by benchmarks) drifting apart
    model = _model()
    z1, y1, z0, y0 = _latents(B=3, seed=7)
    x = _images(model, z0, y0, seed=8)
    loss = _enum_loss(model, FixedGuide(z1, y1, z0, y0), x)
    log_joint = model.log_joint(x, z1, y1, z0, y0)
    assert log_joint.shape == (3,)
    assert math.isclose(loss.item(), -log_joint.sum().item(), rel_tol=1e-10)
    # images given as (B, H, W) are accepted too
    assert torch.allclose(model.log_joint(x[:, 0], z1, y1, z0, y0), log_joint)


def test_selection_ignores_absent_parent():
    # catches: a parent that is off (z1 -> 0) still being selectable: with z1_k tiny, the children's marginal
    # must not depend on that parent's offsets at all
    model = _model()
    z1, y1, z0, y0 = _latents()
    z1 = z1.clone()
    z1[:, 1] = 1e-30
    x = _images(model, z0, y0)
    before = model.log_joint(x, z1, y1, z0, y0)
    with torch.no_grad():
        model.offsets[1].add_(5.0)
    assert torch.allclose(model.log_joint(x, z1, y1, z0, y0), before, rtol=1e-12, atol=1e-10)


# --------------------------------------------------------------------------------------------- clamp boundaries

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clamped_relaxed_bernoulli_log_prob_finite_at_boundaries(dtype):
    # catches: infinite/NaN log-density or gradients at presences of exactly 0 or 1 (the unclamped concrete
    # density has log y and log(1 − y) terms)
    values = torch.tensor([0.0, 1e-12, 1 - 1e-12, 1.0, 0.5], dtype=dtype)
    logits = torch.tensor([-3.0, 0.0, 2.0, 50.0, -50.0], dtype=dtype, requires_grad=True)
    d = ClampedRelaxedBernoulli(torch.tensor(0.5, dtype=dtype), logits=logits)
    lp = d.log_prob(values)
    assert torch.isfinite(lp).all()
    (g,) = torch.autograd.grad(lp.sum(), logits)
    assert torch.isfinite(g).all()
    # values beyond the clamp score exactly as the clamp itself
    eps = RELAXED_CLAMP
    assert torch.equal(d.log_prob(torch.zeros(5, dtype=dtype)), d.log_prob(torch.full((5,), eps, dtype=dtype)))
    assert torch.equal(d.log_prob(torch.ones(5, dtype=dtype)), d.log_prob(torch.full((5,), 1 - eps, dtype=dtype)))


def test_clamped_relaxed_bernoulli_rsample_never_hits_zero_or_one():
    # catches: float32 concrete samples saturating to exactly 0/1 with extreme logits (infinite log-Jacobian)
    logits = torch.tensor([-50.0, 50.0, -20.0, 20.0])
    d = ClampedRelaxedBernoulli(torch.tensor(0.1), logits=logits)
    z = d.rsample((2000,))
    assert (z > 0).all() and (z < 1).all()
    eps = torch.tensor(RELAXED_CLAMP, dtype=z.dtype)
    assert (z >= eps).all() and (z <= 1 - eps).all()
    assert torch.isfinite(d.log_prob(z)).all()
    # the sampler still reaches the clamp (i.e. it is the clamp that stops it, not luck)
    assert z[:, 0].min().item() == pytest.approx(RELAXED_CLAMP, rel=1e-3)
    assert z[:, 1].max().item() == pytest.approx(1 - RELAXED_CLAMP, rel=1e-3)


@pytest.mark.parametrize("extreme", [0.0, 1e-12, RELAXED_CLAMP, "mixed"])
def test_model_loss_and_gradients_finite_at_extreme_presences(extreme):
    # catches: NaN/inf in the enumerated loss or in any parameter's gradient when presences sit at (or beyond)
    # the clamp: log(z1 = 0) in the selection, variance interpolation at z0 in {0, 1}, alpha weighting
    model = _model(dtype=torch.float32)
    z1, y1, z0, y0 = (v.float() for v in _latents())
    if extreme == "mixed":
        z1 = torch.tensor([[0.0, 1.0], [1 - 1e-12, 1e-12]])
        z0 = torch.tensor([[0.0, 1.0, 1e-12], [1.0, 1 - 1e-12, 0.0]])
    else:
        z1 = torch.stack([torch.full((2,), float(extreme)), torch.full((2,), 1 - float(extreme))], 1).T.contiguous()
        z0 = torch.full((2, M), float(extreme))
        z0[1] = 1 - float(extreme)
    x = _images(model, z0, y0).float()
    loss = _enum_loss(model, FixedGuide(z1, y1, z0, y0), x)
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_gradients_wrt_latents_finite_at_clamp():
    # catches: NaN gradients flowing back to the guide when its presence samples sit at the clamp values the
    # guide's own rsample can return (1e-4 and 1 − 1e-4)
    model = _model(dtype=torch.float32)
    _, y1, _, y0 = (v.float() for v in _latents())
    eps = RELAXED_CLAMP
    z1 = torch.tensor([[eps, 1 - eps], [1 - eps, eps]], requires_grad=True)
    z0 = torch.tensor([[eps, 1 - eps, eps], [1 - eps, eps, 1 - eps]], requires_grad=True)
    y1, y0 = y1.requires_grad_(), y0.requires_grad_()
    x = _images(model, z0.detach(), y0.detach()).float()
    loss = _enum_loss(model, FixedGuide(z1, y1, z0, y0), x)
    grads = torch.autograd.grad(loss, [z1, y1, z0, y0])
    assert all(torch.isfinite(g).all() for g in grads)


# --------------------------------------------------------------------------------------------- enumeration set-up

def test_s_is_enumerated_in_parallel():
    # catches: ``s`` not marked for enumeration (TraceEnum would then sample it and the loss would be noisy),
    # or enumerated into a dim that collides with the plates
    model = _model(dtype=torch.float32)
    z1, y1, z0, y0 = (v.float() for v in _latents())
    x = _images(model, z0, y0).float()
    guide = FixedGuide(z1, y1, z0, y0)
    guide_tr = poutine.trace(guide).get_trace(x)
    model_tr = poutine.trace(poutine.enum(poutine.replay(model, trace=guide_tr), first_available_dim=-3)).get_trace(x)
    node = model_tr.nodes["s"]
    assert node["infer"].get("enumerate") == "parallel"
    assert node["value"].shape == (K + 1, 1, 1)
    assert torch.equal(node["value"].flatten(), torch.arange(K + 1))
    model_tr.compute_log_prob()
    assert model_tr.nodes["s"]["log_prob"].shape == (K + 1, 2, M)
    assert model_tr.nodes["z0"]["log_prob"].shape == (K + 1, 2, M)
    assert model_tr.nodes["y0"]["log_prob"].shape == (K + 1, 2, M)
    # the image does not depend on s
    assert model_tr.nodes["x"]["log_prob"].shape == (2, 1)
    # without enumeration, s is one sample per (image, child)
    plain = poutine.trace(poutine.replay(model, trace=guide_tr)).get_trace(x)
    assert plain.nodes["s"]["value"].shape == (2, M)
    # the loss is deterministic for a fixed guide: enumeration, not sampling
    assert _enum_loss(model, guide, x).item() == _enum_loss(model, guide, x).item()


@pytest.mark.parametrize("B, M_, event", [(2, 3, 0), (2, 3, 1), (3, 1, 0), (3, 1, 1), (4, 2, 1)])
def test_select_parent_equals_vindex(B, M_, event):
    # catches: the enumeration fast path (a view instead of a gather) disagreeing with Vindex, either for the
    # enumerated s = arange(K+1) laid along dim -3, or for a *sampled* s that merely looks like it: with M = 1 and
    # B = K + 1 a sampled (B, 1) s can equal arange(K+1) and must still be gathered per image
    ev = (6,) * event
    for table in (torch.randn(M_, K + 1, *ev), torch.randn(B, M_, K + 1, *ev)):
        index = lambda s: (Ellipsis, s) + (slice(None),) * event
        enum_s = torch.arange(K + 1).view(K + 1, 1, 1)
        assert torch.equal(select_parent(table, enum_s, event), Vindex(table)[index(enum_s)])
        for sampled in (torch.randint(0, K + 1, (B, M_)), torch.arange(B).remainder(K + 1).view(B, 1).expand(B, M_)):
            assert torch.equal(select_parent(table, sampled, event), Vindex(table)[index(sampled)])


def test_model_traces_with_a_sampled_s_that_looks_enumerated():
    # catches: the same fast-path confusion inside the model (M = 1, B = K + 1, s conditioned to 0..K)
    model = CapsuleModel(CapsuleModelConfig(num_parents=K, num_parts=1, template_size=T, canvas_size=S))
    s = torch.arange(K + 1).view(K + 1, 1)
    tr = poutine.trace(poutine.condition(model, data={"s": s})).get_trace(torch.rand(K + 1, 1, S, S))
    assert tr.nodes["y0"]["value"].shape == (K + 1, 1, 6)


@pytest.mark.parametrize("shape", [(2, 1, S + 1, S + 1), (2, 3, S, S), (2, S, S + 2), (S, S)])
def test_model_rejects_wrongly_shaped_images(shape):
    # catches: images of the wrong size being broadcast against the rendered canvas instead of rejected
    model = _model(dtype=torch.float32)
    with pytest.raises(ValueError, match="expected images"):
        model(torch.zeros(shape))
    with pytest.raises(ValueError):
        model.log_joint(torch.zeros(shape), *(v.float() for v in _latents()))


def test_model_forward_samples_have_the_documented_shapes():
    # catches: a plate on the wrong dim (sites would get (K, B) or (B, 1, K) shapes)
    model = _model(dtype=torch.float32)
    x = torch.rand(3, 1, S, S)
    tr = poutine.trace(model).get_trace(x)
    assert tr.nodes["z1"]["value"].shape == (3, K)
    assert tr.nodes["y1"]["value"].shape == (3, K, 6)
    assert tr.nodes["z0"]["value"].shape == (3, M)
    assert tr.nodes["y0"]["value"].shape == (3, M, 6)
    assert tr.nodes["_RETURN"]["value"].shape == (3, 1, S, S)


# --------------------------------------------------------------------------------------------- SVI smoke

def test_svi_with_delta_guide_decreases_loss():
    # catches: a model/guide pair that does not train (detached parameters, wrong sign, guide/model plate mismatch
    # that validation would flag)
    cfg = CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S, temperature=0.5)
    model = CapsuleModel(cfg)
    enc_cfg = EncoderConfig(channels=[8, 8], strides=[2, 2], set_hidden=16, set_heads=2, set_inducing=4,
                            set_blocks=1, parent_code=8, head_hidden=8, part_embedding=4)
    guide = DeltaGuide(CapsuleEncoder(M, K, enc_cfg), cfg.temperature)
    digits, _ = synthetic_digits(4, size=S, seed=0)
    x = to_float(digits).unsqueeze(1)
    elbo = TraceEnum_ELBO(max_plate_nesting=2)
    params = list(model.parameters()) + list(guide.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = elbo.differentiable_loss(model, guide, x) / x.shape[0]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.05 * abs(first), losses


@pytest.mark.parametrize("logit", [-1e3, -90.0, 90.0, 1e3])
def test_relaxed_log_prob_finite_for_huge_logits(logit):
    # catches: torch's log τ + d − 2 log(1 + e^d), which is −inf once d > 88 — the −inf loss that stopped the first
    # headline run at step ~1000 (an encoder's presence logits grow that large)
    from probcaps.distributions import ClampedRelaxedBernoulli

    logits = torch.tensor(logit, requires_grad=True)
    d = ClampedRelaxedBernoulli(torch.tensor(0.5), logits=logits)
    values = torch.tensor([0.0, 1e-4, 0.5, 1 - 1e-4, 1.0])
    lp = d.log_prob(values)
    assert torch.isfinite(lp).all()
    lp.sum().backward()
    assert torch.isfinite(logits.grad)
    # and it is the same density as torch's where torch's formula is still finite
    bounded = 6.0 * torch.tanh(torch.tensor(2.0) / 6.0)
    ref = torch.distributions.RelaxedBernoulli(torch.tensor(0.5), logits=bounded).log_prob(values[1:4])
    ours = ClampedRelaxedBernoulli(torch.tensor(0.5), logits=torch.tensor(2.0)).log_prob(values[1:4])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_logits_are_soft_bounded_so_clamped_samples_cannot_fake_entropy():
    # catches: the fake-entropy exploit: with unbounded logits a guide can put its mass far beyond the clamp, where
    # the density it is scored by (at the clamp) is tiny, and so raise its ELBO by hundreds of nats per presence
    from probcaps.distributions import MAX_LOGIT, ClampedRelaxedBernoulli

    torch.manual_seed(0)
    tau = torch.tensor(0.5)
    bounded = ClampedRelaxedBernoulli(tau, logits=torch.tensor(1e3))
    assert bounded.logits.item() == pytest.approx(MAX_LOGIT)
    z = bounded.rsample((4000,))
    # −log q of its own samples stays a few nats, not the ~1000 an unbounded logit would give at the clamp
    assert (-bounded.log_prob(z)).mean() < 10
    unbounded = torch.distributions.RelaxedBernoulli(tau, logits=torch.tensor(1e3))
    assert -unbounded.log_prob(z.clamp(1e-4, 1 - 1e-4)).mean() > 500  # the exploit the bound removes


def test_prior_anneal_is_the_loops_schedule_passed_in_and_the_model_keeps_no_step():
    # catches: a schedule off the linear formula or not constant after its end, a model that counts steps itself
    # (state a resumed run would have to restore), or an expected_parents argument the Pyro model ignores
    from probcaps.inference.capsule_svi import prior_schedule

    cfg = CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S, expected_parents=0.5,
                             expected_parents_start=1.5, prior_anneal_steps=4)
    schedule = prior_schedule(cfg)
    for step in [0, 1, 3, 4, 10]:
        assert schedule(step) == pytest.approx(1.5 + (0.5 - 1.5) * min(step, 4) / 4)
    assert prior_schedule(CapsuleModelConfig()) is None
    model = CapsuleModel(cfg).to(DT)
    assert list(model.buffers()) == []
    z1, y1, z0, y0 = _latents(B=2, seed=3)
    x = _images(model, z0, y0, seed=4)
    guide = FixedGuide(z1, y1, z0, y0)
    assert torch.allclose(model.parent_prior_probs(schedule(0)), torch.full((K,), 0.75, dtype=DT))
    assert torch.allclose(model.parent_prior_probs(), torch.full((K,), 0.25, dtype=DT))   # None: the final value
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for step in [0, 2]:
        loss = _enum_loss(model, guide, x, expected_parents=schedule(step))
        # the Pyro loss and the torch reference agree at every point of the schedule
        reference = -model.log_joint(x, z1, y1, z0, y0, schedule(step)).sum()
        assert math.isclose(loss.item(), reference.item(), rel_tol=1e-10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())      # no step state moved
    assert _enum_loss(model, guide, x, expected_parents=schedule(0)).item() != pytest.approx(
        _enum_loss(model, guide, x).item(), rel=1e-6)
    with pytest.raises(ValueError, match="prior_anneal_steps"):
        CapsuleModel(CapsuleModelConfig(prior_anneal_steps=10))


def test_part_pose_std_ceiling_bounds_sigma_on_both_sides():
    # catches: the ceiling ignored (σ growing past it) or the initial σ off its configured value
    model = CapsuleModel(CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S,
                                            part_pose_std_min=0.03, part_pose_std_init=0.1, part_pose_std_max=0.15))
    assert torch.allclose(model.part_pose_std(), torch.full((K, M, 6), 0.1), atol=1e-6)
    with torch.no_grad():
        model.pose_std_raw.copy_(torch.linspace(-50, 50, K * M * 6).view(K, M, 6))
    sigma = model.part_pose_std()
    assert sigma.min().item() == pytest.approx(0.03) and sigma.max().item() == pytest.approx(0.15)
    with pytest.raises(ValueError, match="part_pose_std_max"):
        CapsuleModel(CapsuleModelConfig(part_pose_std_init=0.5, part_pose_std_max=0.15))


def test_object_pose_group_limits_what_an_object_pose_does_to_its_parts():
    # catches: the option ignored in child_tables, or a group that lets an object's shear reach its parts
    cfg = dict(num_parents=K, num_parts=M, template_size=T, canvas_size=S)
    z1 = torch.rand(4, K)
    y1 = 0.3 * torch.randn(4, K, 6)
    shear = torch.zeros(4, K, 6)
    shear[..., 1] = 0.4
    shear[..., 3] = 0.4                       # a symmetric shear: nothing of it is a rotation or a scale
    for group, moves in [("affine", True), ("similarity", False)]:
        model = CapsuleModel(CapsuleModelConfig(object_pose=group, **cfg))
        mean = model.child_tables(z1, y1)[2]
        assert torch.allclose(mean, model.child_tables(z1, y1 + shear)[2]) != moves
    turn = torch.zeros(4, K, 6)
    turn[..., 1], turn[..., 3] = -0.2, 0.2
    similarity = CapsuleModel(CapsuleModelConfig(object_pose="similarity", **cfg))
    assert not torch.allclose(similarity.child_tables(z1, y1)[2], similarity.child_tables(z1, y1 + turn)[2])
    with pytest.raises(ValueError, match="object_pose"):
        CapsuleModel(CapsuleModelConfig(object_pose="translation", **cfg))


def test_bounded_affinity_stops_an_absent_object_winning_parts_from_the_dummy():
    # catches: the bound not applied in child_tables, a bound that can be exceeded, or one that changes the default
    cfg = dict(num_parents=K, num_parts=M, template_size=T, canvas_size=S)
    z1 = torch.full((1, K), 1e-4)  # every object's presence at the relaxation's clamp: off
    y1 = torch.zeros(1, K, 6)
    for max_affinity, dummy_wins in [(0.0, False), (1.0, True)]:
        model = CapsuleModel(CapsuleModelConfig(max_affinity=max_affinity, **cfg))
        with torch.no_grad():
            model.log_affinity.fill_(20.0)
        selection_logits = model.child_tables(z1, y1)[0]  # (1, M, K + 1), the dummy first
        probs = torch.softmax(selection_logits, -1)
        assert bool((probs[..., 0] > 0.5).all()) is dummy_wins
    raw = torch.tensor([-50.0, 0.0, 50.0])
    model.log_affinity.data[0, :3] = raw
    by_hand = math.log(1.0) - F.softplus(-raw)
    assert torch.allclose(model.log_rho()[0, :3], by_hand) and model.log_rho().max().item() <= 0.0


@pytest.mark.parametrize("object_pose", ["affine", "similarity"])
def test_draw_objects_puts_each_part_where_its_object_predicts_it_at_its_expected_presence(object_pose):
    # catches: parts drawn at the offsets without the object's pose or code, the presence without the share of the
    # affinity the dummy leaves (or with the dummy's), objects' drawings swapped, or another part's offsets
    W, px = 9, 2.0 / 9  # a 3x3 template at the identity covers pixels 3..5; one pixel is 2/9 in normalised units
    model = CapsuleModel(CapsuleModelConfig(num_parents=2, num_parts=2, template_size=3, canvas_size=W,
                                            dummy_affinity=0.5, object_pose=object_pose, object_code_dims=1,
                                            code_deformation_std=0.5)).to(DT)
    dot = torch.full((2, 1, 3, 3), -40.0, dtype=DT)
    dot[:, :, 1, 1] = 40.0                               # every part an opaque white dot at its template's centre
    with torch.no_grad():
        model.template_logits.copy_(dot)
        model.alpha_logits.copy_(dot)
        model.offsets.zero_()
        model.offsets[0, 0, 5] = px                      # object 0 puts part 0 a pixel below its origin
        model.offsets[1, 1, 2] = -2 * px                 # object 1 puts part 1 two pixels left of its origin
        model.offsets[0, 1, 2] = model.offsets[1, 0, 2] = 9.0  # and the other parts far off the canvas
        model.code_basis.zero_()
        model.code_basis[0, 0, 2, 0] = px                # object 0's code moves part 0 right, a pixel per unit
        model.log_affinity.copy_(torch.tensor([[math.log(1.5), 0.0], [0.0, math.log(0.5)]], dtype=DT))
        model.presence_logits.copy_(torch.tensor([[math.log(4.0), 0.0], [0.0, 0.0]], dtype=DT))  # γ = 0.8, 0.5
    y1 = torch.zeros(2, 7, dtype=DT)
    y1[0, 2], y1[0, 6] = px, 2.0                         # object 0 a pixel right, its code at 2
    y1[1, 5] = -px                                       # object 1 a pixel up
    drawn = model.draw_objects(y1.unsqueeze(0))
    assert drawn.shape == (1, 2, 1, W, W)
    expected = torch.zeros(2, W, W, dtype=DT)
    expected[0, 4 + 1, 4 + 1 + 2] = 0.8 * 1.5 / (1.5 + 0.5)  # γ ρ / (ρ + ρ_0) at pose + offset + code
    expected[1, 4 - 1, 4 - 2] = 0.5 * 0.5 / (0.5 + 0.5)
    torch.testing.assert_close(drawn[0, :, 0], expected, atol=1e-9, rtol=0)


def test_object_information_by_hand():
    # catches: normalising over the batch instead of the objects, or the between term taken per image
    counts = torch.tensor([[2.0, 0.0], [1.0, 1.0]], dtype=DT)
    within, between = object_information(counts)
    torch.testing.assert_close(within, torch.tensor(math.log(2) / 2, dtype=DT))  # 0 for [1, 0], log 2 for [.5, .5]
    torch.testing.assert_close(between, torch.tensor(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), dtype=DT))
    # one object per image, each object in half the images: the information is log 2
    within, between = object_information(torch.tensor([[4.0, 0.0], [0.0, 4.0]], dtype=DT))
    assert within.item() < 1e-6 and abs(between.item() - math.log(2)) < 1e-6


@pytest.mark.parametrize("weight,share", [(0.0, 1.0), (7.0, 1.0), (7.0, 0.25)])
def test_training_loss_subtracts_the_object_information_of_the_elbos_own_sample(weight, share):
    # catches: the within share left out, the term computed on another draw of the guide than the ELBO's, the dummy
    # counted as an object, a sign flipped, or a term added when the weight is 0
    from probcaps.inference.capsule_svi import CapsuleSystem
    from probcaps.inference.train import make_elbo
    cfg = CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S, seed=0, **HYPER,
                             object_information_weight=weight, object_within_share=share)
    system = CapsuleSystem(cfg, EncoderConfig(channels=[8], strides=[2], set_hidden=8, set_heads=1, set_inducing=2,
                                              parent_code=4, head_hidden=8, part_embedding=2, part_features=0))
    system = system.to(DT)
    x = torch.rand(3, 1, S, S, dtype=DT)
    elbo = make_elbo()
    pyro.set_rng_seed(5)
    out = system.loss(elbo, x)
    pyro.set_rng_seed(5)
    neg_elbo = elbo.differentiable_loss(system.model, system.guide, x) / 3
    if not weight:
        assert torch.is_tensor(out)
        torch.testing.assert_close(out, neg_elbo)
        return
    pyro.set_rng_seed(5)
    z1, y1, z0, y0 = system.guide(x)  # the ELBO draws the guide first: the same sample
    counts = system.model.parent_log_posterior(z1, y1, z0, y0).exp()[..., 1:].sum(-2)  # (3, K)
    p = counts / counts.sum(-1, keepdim=True)
    within = -(p * p.log()).sum(-1).mean()
    total = counts.sum(0) / counts.sum()
    between = -(total * total.log()).sum()
    loss, terms = out
    torch.testing.assert_close(loss, neg_elbo - weight * (between - share * within))
    assert terms == pytest.approx({"within_entropy": within.item(), "between_entropy": between.item()})
    assert 0 < terms["within_entropy"] < math.log(K) and 0 < terms["between_entropy"] <= math.log(K) + 1e-9
