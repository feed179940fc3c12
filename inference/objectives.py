"""Training objectives of the capsule model beside the ELBO: the same model and guide, another bound to maximise.

``train.objective`` (``probcaps train --set train.objective=iwae --set train.particles=8``) picks one:

- ``"elbo"``: ``TraceEnum_ELBO``, one sample of the guide, ``s`` enumerated out (the recipes' objective);
- ``"iwae"``: the importance-weighted bound of Burda et al. (2016) with ``K = train.particles`` samples per image,
  ``L_K = log (1/K) sum_k p(x, h_k) / q(h_k | x)`` (:func:`iwae_loss`), all ``K`` samples in one vectorised pass.
  ``L_1`` is the ELBO (the same value and gradient for the same samples); ``L_K`` is tighter, so the model is fit to
  a closer bound on ``log p(x)`` and the guide is pushed to cover the posterior rather than to sit inside it.
- ``"score_function"``: the ELBO averaged over ``K = train.particles >= 2`` samples per image, with unbiased
  gradients for a guide whose presences are discrete (``model.presences = "bernoulli"``, the model before the
  concrete relaxation): pathwise through the reparameterised poses, the score function ``(f_k − b_k) ∇ log q(z_k)``
  for the presences, with the leave-one-out baseline ``b_k`` the mean of the other samples' ``f_j = log p − log q``
  (Mnih & Rezende 2016; Kool et al. 2019) (:func:`score_function_loss`).  The enumerated ``TraceEnum_ELBO`` is
  biased for such presences: its Dice estimator weighs a cost only by the score functions of the sites in the
  cost's own plates, and an object's or a part's presence (in the ``parents`` / ``children`` plate) also moves the
  image's likelihood and the other plate's terms, outside it.

All three, and the held-out bound of :mod:`probcaps.inference.likelihood`, rest on :func:`log_weights`: the
importance log-weights of ``K`` samples of the guide, with the relaxed presences scored by the densities of their
logits (``presence_density="logit"``, exact) or at their clamped values (``"clamped"``, the training ELBO's; the
likelihood module's docstring says why the two differ).  The IWAE objective scores them as the ELBO does, so that
``K = 1`` is exactly the recipes' objective; ``iwae_loss(..., presence_density="logit")`` trains on the exact bound.
"""

from __future__ import annotations

import math
from typing import Callable

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.infer.reparam.reparam import Reparam
from pyro.poutine.util import site_is_subsample
from torch.distributions.relaxed_bernoulli import LogitRelaxedBernoulli

from probcaps.distributions import ClampedRelaxedBernoulli
from probcaps.errors import ConfigError
from probcaps.inference.train import TrainConfig
from probcaps.inference.ttvi import FreeFormGuide

__all__ = ["PRESENCE_DENSITIES", "LogitPresenceReparam", "guide_trace", "has_point_poses", "log_weights",
           "iwae_loss", "score_function_loss", "training_loss"]

# ------------------------------------------------------------------------- the importance weights of model and guide

#: how a relaxed presence is scored: ``"logit"`` the exact density of its logit, ``"clamped"`` the training ELBO's
#: density at the clamped value (:mod:`probcaps.inference.likelihood` says why they differ)
PRESENCE_DENSITIES = ("logit", "clamped")
PRESENCE_SITES = ("z1", "z0")
POSE_SITES = ("y1", "y0")


class _LogitRelaxedBernoulli(LogitRelaxedBernoulli, TorchDistributionMixin):
    """torch's logistic distribution of a relaxed Bernoulli's logit, as a Pyro distribution."""


class LogitPresenceReparam(Reparam):
    """Draws a :class:`~probcaps.distributions.ClampedRelaxedBernoulli` site ``name`` through its logit: an auxiliary
    site ``name_logit`` ``~ LogitRelaxedBernoulli(τ, logits)`` (the same draw as the site's own ``rsample``), and the
    site itself observed at ``clamp(sigmoid(logit))`` under a point mass, so that a trace's log-densities are those
    of the logits."""

    def apply(self, msg):
        fn, event_dim = self._unwrap(msg["fn"])
        if not isinstance(fn, ClampedRelaxedBernoulli):
            raise TypeError(f"LogitPresenceReparam: site {msg['name']!r} is a {type(fn).__name__}, not a "
                            f"ClampedRelaxedBernoulli")
        logit = pyro.sample(f"{msg['name']}_logit",
                            self._wrap(_LogitRelaxedBernoulli(fn.temperature, logits=fn.logits), event_dim))
        value = torch.sigmoid(logit).clamp(fn.eps, 1 - fn.eps)
        return {"fn": dist.Delta(value, event_dim=event_dim), "value": value, "is_observed": True}


def _innermost(fn):
    """The distribution inside ``.to_event`` wrappers."""
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return fn


def guide_trace(guide, x: torch.Tensor, presence_density: str = "logit", expected_parents: float | None = None):
    """The guide's trace on images ``x`` ``(N, 1, H, W)``: ``poutine.trace`` of one draw of every latent
    (reparameterised where the distribution has ``rsample``), with the relaxed presence sites drawn through their
    logits for ``presence_density="logit"``."""
    if presence_density not in PRESENCE_DENSITIES:
        raise ValueError(f"presence_density must be one of {', '.join(PRESENCE_DENSITIES)}, got {presence_density!r}")
    if presence_density == "logit":  # the relaxed presence sites (Bernoulli ones have a mass function already)
        guide = poutine.reparam(guide, config=lambda msg: LogitPresenceReparam() if msg["name"] in PRESENCE_SITES
                                and isinstance(_innermost(msg["fn"]), ClampedRelaxedBernoulli) else None)
    return poutine.trace(guide).get_trace(x, expected_parents=expected_parents)


def has_point_poses(trace) -> bool:
    """Whether a guide trace draws the poses from point masses (no density over them)."""
    return any(isinstance(_innermost(trace.nodes[name]["fn"]), dist.Delta) for name in POSE_SITES)


def _repeated(guide, n: int):
    """The guide for ``n`` copies of its batch stacked sample-major (``x.repeat(n, 1, 1, 1)``): an amortised guide
    as it is; a per-image ``FreeFormGuide`` with its parameters repeated the same way."""
    if not isinstance(guide, FreeFormGuide) or n == 1:
        return guide
    scales = [None if s is None else s.detach().repeat(n, *(1,) * (s.dim() - 1)) for s in guide.pose_scales()]
    latents = type(guide.latents())(*(t.repeat(n, *(1,) * (t.dim() - 1)) for t in guide.latents()))
    return FreeFormGuide(latents, guide.temperature, guide.pose_family, *scales, min_scale=guide.min_scale,
                         object_pose=guide.object_pose)


def log_weights(model, guide, x: torch.Tensor, num_samples: int = 1, presence_density: str = "logit",
                expected_parents: float | None = None, allow_point_poses: bool = True, discrete_log_q: bool = False):
    """``(num_samples, B)`` importance log-weights ``log p(x, h_k) − log q(h_k | x)`` of images ``x`` ``(B, 1, H, W)``
    (floats), all samples in one pass of the guide and the model over ``num_samples * B`` copies; differentiable
    through the reparameterised samples.  ``s`` is summed out exactly; a point-mass pose contributes ``log q = 0``.
    ``allow_point_poses=False``: refuse a guide with point-mass poses (one line naming the reason).
    ``discrete_log_q``: also return ``(num_samples, B)`` the log-probabilities of the samples that are not
    reparameterised (Bernoulli presences), whose gradient a score-function estimator needs."""
    x = model._check_images(x)
    B = x.shape[0]
    copies = x.repeat(num_samples, 1, 1, 1)
    trace = guide_trace(_repeated(guide, num_samples), copies, presence_density, expected_parents)
    if not allow_point_poses and has_point_poses(trace):
        raise ValueError(f"{type(guide).__name__} has point-mass poses, so q has no density over them and the bound "
                         f"would be on log p(x, poses), not log p(x); use a NormalPoseGuide (or pass "
                         f"allow_point_poses=True for that joint bound)")
    trace.compute_log_prob()
    # the latent sites: the presences' logits (or the presences), the poses; the clamped presences observed under
    # a point mass and the plates' subsample sites carry no density
    latent = [trace.nodes[name] for name in trace.stochastic_nodes if not site_is_subsample(trace.nodes[name])]
    log_q = sum(site["log_prob"].reshape(len(copies), -1).sum(-1) for site in latent)
    z1, y1, z0, y0 = (trace.nodes[name]["value"] for name in ("z1", "y1", "z0", "y0"))
    logits = ((trace.nodes["z1_logit"]["value"], trace.nodes["z0_logit"]["value"])
              if "z1_logit" in trace.nodes else None)
    log_p = model.log_joint(copies, z1, y1, z0, y0, expected_parents, presence_logits=logits)
    w = (log_p - log_q).reshape(num_samples, B)
    if not discrete_log_q:
        return w
    scored = [site["log_prob"].reshape(len(copies), -1).sum(-1) for site in latent if not site["fn"].has_rsample]
    return w, sum(scored, torch.zeros_like(log_q)).reshape(num_samples, B)


# ------------------------------------------------------------------------------------------------ the objectives

def iwae_loss(model, guide, x: torch.Tensor, particles: int, expected_parents: float | None = None,
              presence_density: str = "clamped") -> torch.Tensor:
    """``−mean_b L_K(x_b)``: the negative ``particles``-sample importance-weighted bound per image of images ``x``
    ``(B, 1, H, W)`` (a scalar; differentiable through the guide's reparameterised samples)."""
    w = log_weights(model, guide, x, particles, presence_density, expected_parents)        # (K, B)
    return -(torch.logsumexp(w, 0) - math.log(particles)).mean()


def score_function_loss(model, guide, x: torch.Tensor, particles: int,
                        expected_parents: float | None = None) -> torch.Tensor:
    """The negative ELBO per image of images ``x`` ``(B, 1, H, W)``, a mean over ``particles`` samples (``>= 2``),
    whose gradient is unbiased for discrete presences too: a surrogate whose value is the ELBO and whose gradient
    adds ``(f_k − b_k) ∇ log q(z_k)`` (leave-one-out baseline ``b_k``) to the pathwise gradient."""
    if particles < 2:
        raise ValueError(f"score_function_loss: the leave-one-out baseline needs particles >= 2, got {particles}")
    f, log_q_discrete = log_weights(model, guide, x, particles, expected_parents=expected_parents,
                                    discrete_log_q=True)                                       # (K, B) each
    baseline = (f.sum(0, keepdim=True) - f) / (particles - 1)        # independent of sample k: no bias
    score = (f - baseline).detach() * (log_q_discrete - log_q_discrete.detach())  # value 0, the gradient's term
    return -(f + score).mean()


def training_loss(system, tcfg: TrainConfig, elbo) -> Callable[..., torch.Tensor]:
    """``loss(x, **scheduled)`` of ``train.objective`` for a ``CapsuleSystem``: its ELBO loss (with ``elbo``, a
    ``TraceEnum_ELBO``), :func:`iwae_loss` or :func:`score_function_loss` with ``train.particles`` samples.
    Settings that the objective cannot honour are one-line :class:`~probcaps.errors.ConfigError` s."""
    discrete = system.model.config.presences != "relaxed"
    if tcfg.objective == "elbo" and discrete:
        raise ConfigError("model.presences = 'bernoulli': TraceEnum_ELBO's gradient is biased for discrete "
                          "presences (docs/inference.md); use train.objective = 'score_function'")
    if tcfg.objective == "elbo":
        if tcfg.particles != 1:
            raise ConfigError(f"train.particles ({tcfg.particles}) is the number of samples of train.objective = "
                              f"'iwae' or 'score_function'; the ELBO takes one")
        return lambda x, **scheduled: system.loss(elbo, x, **scheduled)
    what = f"train.objective = {tcfg.objective!r}"
    if tcfg.jit:
        raise ConfigError(f"train.jit compiles the ELBO only; set train.jit = false for {what}")
    if system.model.config.object_information_weight:
        raise ConfigError(f"model.object_information_weight is a term of the ELBO loss; set it to 0 for {what}")
    if tcfg.objective == "iwae":
        if discrete:
            raise ConfigError("train.objective = 'iwae' differentiates through reparameterised samples; "
                              "model.presences = 'bernoulli' needs train.objective = 'score_function'")
        return lambda x, **scheduled: iwae_loss(system.model, system.guide, x, tcfg.particles, **scheduled)
    if tcfg.particles < 2:
        raise ConfigError(f"train.particles: {what} needs >= 2 (its baseline is the other samples' mean), got "
                          f"{tcfg.particles}")
    return lambda x, **scheduled: score_function_loss(system.model, system.guide, x, tcfg.particles, **scheduled)
