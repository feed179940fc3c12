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

The IWAE objective scores the relaxed presences as the ELBO does (``presence_density="clamped"``, by the density at
the clamped value, :mod:`probcaps.inference.likelihood`), so that ``K = 1`` is exactly the recipes' objective;
``presence_density="logit"`` trains on the bound over the presences' logits instead.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from probcaps.errors import ConfigError
from probcaps.inference.likelihood import log_weights
from probcaps.inference.train import TrainConfig

__all__ = ["iwae_loss", "score_function_loss", "training_loss"]


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
