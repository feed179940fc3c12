"""Training objectives of the capsule model beside the ELBO: the same model and guide, another bound to maximise.

``train.objective`` (``probcaps train --set train.objective=iwae --set train.particles=8``) picks one:

- ``"elbo"``: ``TraceEnum_ELBO``, one sample of the guide, ``s`` enumerated out (the recipes' objective);
- ``"iwae"``: the importance-weighted bound of Burda et al. (2016) with ``K = train.particles`` samples per image,
  ``L_K = log (1/K) sum_k p(x, h_k) / q(h_k | x)`` (:func:`iwae_loss`), all ``K`` samples in one vectorised pass.
  ``L_1`` is the ELBO (the same value and gradient for the same samples); ``L_K`` is tighter, so the model is fit to
  a closer bound on ``log p(x)`` and the guide is pushed to cover the posterior rather than to sit inside it.

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

__all__ = ["iwae_loss", "training_loss"]


def iwae_loss(model, guide, x: torch.Tensor, particles: int, expected_parents: float | None = None,
              presence_density: str = "clamped") -> torch.Tensor:
    """``−mean_b L_K(x_b)``: the negative ``particles``-sample importance-weighted bound per image of images ``x``
    ``(B, 1, H, W)`` (a scalar; differentiable through the guide's reparameterised samples)."""
    w = log_weights(model, guide, x, particles, presence_density, expected_parents)        # (K, B)
    return -(torch.logsumexp(w, 0) - math.log(particles)).mean()


def training_loss(system, tcfg: TrainConfig, elbo) -> Callable[..., torch.Tensor]:
    """``loss(x, **scheduled)`` of ``train.objective`` for a ``CapsuleSystem``: its ELBO loss (with ``elbo``, a
    ``TraceEnum_ELBO``) or :func:`iwae_loss` with ``train.particles`` samples.  Settings that the objective cannot
    honour are one-line :class:`~probcaps.errors.ConfigError` s."""
    if tcfg.objective == "elbo":
        if tcfg.particles != 1:
            raise ConfigError(f"train.particles ({tcfg.particles}) is the number of samples of train.objective = "
                              f"'iwae'; the ELBO takes one")
        return lambda x, **scheduled: system.loss(elbo, x, **scheduled)
    if tcfg.jit:
        raise ConfigError("train.jit compiles the ELBO only; set train.jit = false for train.objective = 'iwae'")
    if system.model.config.object_information_weight:
        raise ConfigError("model.object_information_weight is a term of the ELBO loss; set it to 0 for "
                          "train.objective = 'iwae'")
    return lambda x, **scheduled: iwae_loss(system.model, system.guide, x, tcfg.particles, **scheduled)
