"""Distributions shared by the Pyro models."""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
import torch.nn.functional as F

__all__ = ["ClampedRelaxedBernoulli", "RELAXED_CLAMP", "inverse_softplus"]

#: Relaxed samples are kept in ``[RELAXED_CLAMP, 1 - RELAXED_CLAMP]``.  Float32 concrete samples otherwise reach
#: exactly 0 or 1, where the density's log-Jacobian is infinite and gradients become NaN.
RELAXED_CLAMP = 1e-4


class ClampedRelaxedBernoulli(dist.RelaxedBernoulli):
    """Concrete (relaxed Bernoulli) distribution whose samples and log-density arguments are clamped away from
    0 and 1 by :data:`RELAXED_CLAMP`: the log-density at the clamp is large but finite, and so are its gradients.
    """

    eps = RELAXED_CLAMP

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
