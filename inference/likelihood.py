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
from probcaps.inference.objectives import (PRESENCE_DENSITIES, LogitPresenceReparam, guide_trace, has_point_poses,
                                           log_weights)
from probcaps.inference.ttvi import FreeFormGuide, frozen_and_seeded
from probcaps.report import provenance_line
from probcaps.runner import launch, one_line_errors

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


# ------------------------------------------------------------------------------------------------ the command

def _table(m: dict, prov: dict) -> str:
    """The markdown table of a results JSON written by :func:`main`."""
    lines = ["| guide | presences scored by | " + " | ".join(f"K = {k}" for k in m["samples"]) + " |",
             "| --- | --- | " + " | ".join("---" for _ in m["samples"]) + " |"]
    labels = {"encoder": "amortised (encoder)", "ttvi": f"test-time VI, {m['ttvi_steps']} steps"}
    densities = {"logit": "logits' densities (a bound)", "clamped": "clamped densities (the training ELBO's)"}
    for guide, by_density in m["bounds"].items():
        for density, by_k in by_density.items():
            cells = [f"{by_k[str(k)]['mean']:.1f} ± {by_k[str(k)]['stderr']:.1f}" + (
                f" ({by_k[str(k)]['gain']['mean']:+.1f} ± {by_k[str(k)]['gain']['stderr']:.1f})" if i else "")
                for i, k in enumerate(m["samples"])]
            lines.append(f"| {labels[guide]} | {densities[density]} | " + " | ".join(cells) + " |")
    lines += ["", f"Mean importance bound L_K per image (nats) ± its standard error over the first {m['n_images']} "
              f"test images; in brackets the gain over K = {m['samples'][0]} image by image ± its standard error. "
              f"{provenance_line(prov)}"]
    return "\n".join(lines)


@one_line_errors("likelihood")
def main(argv=None) -> int:
    """``python -m probcaps.inference.likelihood --checkpoint checkpoints/normal_guide.pt --samples 1 10 100``."""
    import argparse
    import time
    from pathlib import Path

    from probcaps.errors import CheckpointError
    from probcaps.inference.capsule_svi import load_images, load_trained
    from probcaps.inference.ttvi import run_ttvi
    from probcaps.provenance import provenance, write_results
    from probcaps.report import write_table
    from probcaps.runner import (add_common_args, checkpoint_arg, file_name_arg, finite_positive_float,
                                 non_negative_int, positive_int)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=checkpoint_arg, required=True, help="a model with Normal poses")
    p.add_argument("--samples", type=positive_int, nargs="+", default=[1, 10, 100], help="the K of each bound")
    p.add_argument("--limit", type=positive_int, default=200, help="the first N test images")
    p.add_argument("--presence-density", nargs="+", choices=PRESENCE_DENSITIES, default=list(PRESENCE_DENSITIES))
    p.add_argument("--ttvi-steps", type=non_negative_int, default=0,
                   help="also the bounds of a Normal-pose free-form guide fitted by this many test-time VI steps")
    p.add_argument("--ttvi-lr", type=finite_positive_float, default=0.01)
    p.add_argument("--batch-size", type=positive_int, default=100)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--name", type=file_name_arg, default=None, help="names the results files (default: "
                                                                    "likelihood_<checkpoint stem>)")
    add_common_args(p, results_dir=Path("results") / "inference", threads=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cfg, system = load_trained(args.checkpoint, device=args.device)
    if system.guide_spec["family"] != "normal":
        raise CheckpointError(f"{args.checkpoint}: the guide has point-mass poses, so no bound on log p(x) exists "
                              f"for it; use a model with Normal poses (e.g. checkpoints/normal_guide.pt)")
    images, _ = load_images(cfg["data"], "test", args.data_dir, limit=args.limit)
    x = to_float(images).unsqueeze(1)
    guides = {"encoder": system.guide}
    if args.ttvi_steps:
        fitted = run_ttvi(system.model, system.guide, x.to(args.device), steps=args.ttvi_steps, lr=args.ttvi_lr,
                          progress=not args.quiet, pose_family="normal", seed=args.seed)
        guides["ttvi"] = FreeFormGuide(fitted.latents, system.guide.temperature, "normal", fitted.part_pose_scales,
                                       fitted.parent_pose_scales, min_scale=system.guide.min_scale,
                                       object_pose=system.model.config.object_pose).to(args.device)
    bounds = {}
    for guide_name, guide in guides.items():
        for density in args.presence_density:
            per_image = {k: log_likelihood_bound(system.model, guide, images, k, batch_size=args.batch_size,
                                                 presence_density=density, seed=args.seed, device=args.device)
                         for k in args.samples}
            # the gain over the smallest K, image by image: far less spread than the bounds across images
            first = per_image[args.samples[0]]
            bounds.setdefault(guide_name, {})[density] = {
                str(k): {**bound_summary(b), "gain": bound_summary(b - first)} for k, b in per_image.items()}
    metrics = {"bounds": bounds, "samples": args.samples, "n_images": len(images), "ttvi_steps": args.ttvi_steps,
               "ttvi_lr": args.ttvi_lr if args.ttvi_steps else None}
    name = args.name or f"likelihood_{Path(args.checkpoint).stem}"
    prov = provenance(seed=args.seed, device=args.device, checkpoint=str(args.checkpoint),
                      wall_time_s=time.perf_counter() - t0, threads=args.threads)
    path = write_results(Path(args.results_dir) / f"{name}.json", metrics, prov)
    write_table(args.results_dir, name, _table(metrics, prov))
    print(_table(metrics, prov))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    launch(main)
