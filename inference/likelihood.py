"""Held-out log-likelihood of the capsule model: an importance-sampled bound with the guide as proposal.

With ``K`` samples ``h_k = (z1, y1, z0, y0)_k ~ q(h | x)`` from the guide, and the parents ``s`` summed out exactly
(:meth:`~probcaps.models.capsule_model.CapsuleModel.log_joint`),

    log p(x) >= L_K(x) = log (1/K) sum_k p(x, h_k) / q(h_k | x),        E[L_1] = ELBO <= E[L_K] <= E[L_2K] <= log p(x)

(Burda et al. 2016); ``E[L_K] -> log p(x)`` as ``K`` grows when ``q`` covers the posterior.  Per image, in nats.

What is bounded, exactly:

- **Presences.** The model and the guide draw a relaxed presence as ``z = clamp(sigmoid(l), ε, 1 − ε)`` with the
  logit ``l`` logistic (``ε = RELAXED_CLAMP``).  The clamp puts an atom of mass at ``ε`` and ``1 − ε``, which the
  training ELBO scores by the *density* at the clamp (``presence_density="clamped"``; with the encoder's bounded
  logits and τ = 0.5, most confident presences land there).  Such a ratio of densities at an atom is not a ratio of
  probabilities, so that number is not a bound on any likelihood.  ``presence_density="logit"`` (the default) takes
  the logits ``l`` as the latents instead: both ``p`` and ``q`` have exact logistic densities over them, the clamp is
  a deterministic map applied downstream in the model, and ``L_K`` is a true lower bound on ``log p(x)`` of the
  generative process the Pyro model samples.  The two agree on every sample that the clamp does not touch (the
  sigmoid's Jacobian cancels between ``p`` and ``q``).  Bernoulli presences (``model.presences = "bernoulli"``)
  have a mass function, and the bound holds for them as it is.
- **Poses.** A :class:`~probcaps.inference.guides.NormalPoseGuide` (or a Normal-pose ``FreeFormGuide`` after
  test-time VI) has a density over every latent, and ``L_K`` bounds ``log p(x)``.  With point-mass poses
  (:class:`~probcaps.inference.guides.DeltaGuide`) ``q`` has no density over ``y``; the same estimator then bounds
  ``log p(x, y0*, y1*)`` — the joint *density* of the image and of the guide's poses, presences and parents
  integrated out — which is not a likelihood of ``x`` and not comparable to one (it is refused unless
  ``allow_point_poses=True``).

    bounds = log_likelihood_bound(system.model, system.guide, images, num_samples=100)   # (N,) nats
    summary = bound_summary(bounds)                                                       # mean, standard error
"""

from __future__ import annotations

import math

import torch

from probcaps.data import to_float

# the importance weights are shared with the training objectives, which the training loop imports
from probcaps.inference.objectives import (
    PRESENCE_DENSITIES,
    LogitPresenceReparam,
    guide_trace,
    has_point_poses,
    log_weights,
)
from probcaps.inference.ttvi import FreeFormGuide, frozen_and_seeded

__all__ = ["PRESENCE_DENSITIES", "LogitPresenceReparam", "guide_trace", "log_weights", "log_likelihood_bound",
           "bound_summary", "has_point_poses"]


@torch.no_grad()
def log_likelihood_bound(model, guide, images: torch.Tensor, num_samples: int = 100, *, batch_size: int = 100,
                         max_copies: int = 2000, presence_density: str = "logit", allow_point_poses: bool = False,
                         seed: int | None = 0, device: str | torch.device = "cpu",
                         expected_parents: float | None = None) -> torch.Tensor:
    """``(N,)`` the ``num_samples``-sample importance bound ``L_K`` on ``log p(x)`` of each image, in nats.

    Args:
        model: a :class:`~probcaps.models.capsule_model.CapsuleModel`.
        guide: the proposal: a :class:`~probcaps.inference.guides.NormalPoseGuide`, or a fitted
            :class:`~probcaps.inference.ttvi.FreeFormGuide` (Normal poses) after test-time VI, built for exactly
            ``images``; point-mass poses only with ``allow_point_poses`` (then a bound on ``log p(x, poses)``).
        images: uint8 ``(N, H, W)`` / ``(N, 1, H, W)``, or floats in ``[0, 1]``.
        batch_size: images per pass (a ``FreeFormGuide`` takes all of its images in one batch).
        max_copies: images × samples evaluated at once: the samples of a batch go in chunks of
            ``max(1, max_copies // batch)`` (memory), their log-weights are pooled before the ``logsumexp``.
        presence_density: ``"logit"`` (a true bound) or ``"clamped"`` (the training ELBO's densities; see the
            module docstring).
        seed: the samples come from the torch RNG seeded with it, the caller's RNG state untouched (None: the
            global RNG).
    """
    if num_samples < 1 or batch_size < 1 or max_copies < 1:
        raise ValueError(f"log_likelihood_bound: num_samples, batch_size and max_copies must be >= 1, got "
                         f"{num_samples}, {batch_size}, {max_copies}")
    x_all = to_float(images) if images.dtype == torch.uint8 else images.float()
    x_all = x_all.reshape(len(x_all), 1, *x_all.shape[-2:])
    if isinstance(guide, FreeFormGuide):
        batch_size = len(x_all)  # its parameters are those of these images, in this order
    bounds = []
    with frozen_and_seeded((model, guide), seed, torch.device(device)):
        for x in x_all.split(batch_size):
            x = x.to(device)
            per_pass = max(1, max_copies // len(x))
            chunks = [log_weights(model, guide, x, min(per_pass, num_samples - start), presence_density,
                                  expected_parents, allow_point_poses)
                      for start in range(0, num_samples, per_pass)]
            bounds.append((torch.logsumexp(torch.cat(chunks), 0) - math.log(num_samples)).cpu())
    return torch.cat(bounds)


def bound_summary(bounds: torch.Tensor) -> dict:
    """``{"mean", "stderr", "n"}`` of per-image bounds ``(N,)``: their mean (nats per image) and its standard error
    over the images."""
    n = len(bounds)
    b = bounds.double()
    return {"mean": float(b.mean()), "stderr": float(b.std() / math.sqrt(n)) if n > 1 else float("nan"), "n": n}
