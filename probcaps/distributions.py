"""Distributions shared by the Pyro models."""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch.distributions.utils import probs_to_logits

__all__ = ["ClampedRelaxedBernoulli", "RELAXED_CLAMP", "MAX_LOGIT", "bound_logits", "inverse_softplus"]

#: Relaxed samples are kept in ``[RELAXED_CLAMP, 1 - RELAXED_CLAMP]``.  Float32 concrete samples otherwise reach
#: exactly 0 or 1, where the density's log-Jacobian is infinite and gradients become NaN.
RELAXED_CLAMP = 1e-4

#: Logits are soft-bounded to ``±MAX_LOGIT`` (probabilities within ``[0.0025, 0.9975]``) because a clamped sample is
#: scored by the density *at the clamp*: with unbounded logits a guide can put its mass far beyond the clamp, where
#: that density is tiny, and collect a fake entropy bonus (measured: part logits ~130, 98% of samples at the clamp,
#: +2,900 nats per image of ELBO that no image earned).  With ``|logit| <= 6`` and ``τ = 0.5`` the clamp (logit
#: ±9.2) stays in the tail, where the density is the samples' density.
MAX_LOGIT = 6.0


def bound_logits(logits: torch.Tensor) -> torch.Tensor:
    """``MAX_LOGIT * tanh(logits / MAX_LOGIT)``: the logits a :class:`ClampedRelaxedBernoulli` really uses."""
    return MAX_LOGIT * torch.tanh(logits / MAX_LOGIT)


class ClampedRelaxedBernoulli(dist.RelaxedBernoulli):
    """Concrete (relaxed Bernoulli) distribution with soft-bounded logits (:data:`MAX_LOGIT`) whose samples and
    log-density arguments are clamped away from 0 and 1 by :data:`RELAXED_CLAMP`: the log-density at the clamp
    is large but finite, and so are its gradients.
    """

    eps = RELAXED_CLAMP

    def __init__(self, temperature, probs=None, logits=None, validate_args=None):
        if (probs is None) == (logits is None):
            raise ValueError("ClampedRelaxedBernoulli: give exactly one of probs or logits")
        logits = probs_to_logits(probs, is_binary=True) if logits is None else logits
        super().__init__(temperature, logits=bound_logits(logits), validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(ClampedRelaxedBernoulli, _instance)
        return super().expand(batch_shape, _instance=new)

    def rsample(self, sample_shape=torch.Size()):
        return super().rsample(sample_shape).clamp(self.eps, 1 - self.eps)

    def log_prob(self, value):
        # torch's formula, log τ + d − 2 log(1 + exp d) with d = logits − τ logit(y), overflows to −inf once d > 88
        # (an encoder's presence logits get there in training); softplus keeps it finite.  Then the sigmoid's
        # Jacobian: −log(y (1 − y)).
        if self._validate_args:
            self._validate_sample(value)
        y = value.clamp(self.eps, 1 - self.eps)
        log_y, log_1my = torch.log(y), torch.log1p(-y)
        diff = self.logits - self.temperature * (log_y - log_1my)
        return torch.log(self.temperature) + diff - 2 * F.softplus(diff) - log_y - log_1my


def inverse_softplus(value):
    """``y`` with ``softplus(y) = value`` (``value > 0``; a float or a tensor), stable for tiny and large values."""
    if isinstance(value, torch.Tensor):
        return value + torch.log(-torch.expm1(-value))
    if value <= 0:
        raise ValueError(f"inverse_softplus: value must be > 0, got {value}")
    return value + math.log(-math.expm1(-value))
