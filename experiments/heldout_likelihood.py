"""The held-out log-likelihood of a trained capsule model (Smith et al. 2020, §6): the K-sample importance bound
on log p(x) per test image, with the amortised guide and after test-time VI as proposals.

    probcaps run heldout_likelihood --checkpoint normal_guide --samples 1 10 100 --limit 200 --ttvi-steps 50

The bound needs a guide with a density over every latent: a model with Normal poses (``normal_guide``).  Writes
``results/heldout_likelihood/<name>.json`` and its table; the maths is :mod:`probcaps.inference.likelihood`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from probcaps.data import to_float
from probcaps.errors import CheckpointError
from probcaps.inference.capsule_svi import load_images, load_trained
from probcaps.inference.likelihood import PRESENCE_DENSITIES, bound_summary, log_likelihood_bound
from probcaps.inference.ttvi import FreeFormGuide, run_ttvi
from probcaps.provenance import provenance, write_results
from probcaps.report import provenance_line, results_table, write_table
from probcaps.runner import (
    add_common_args,
    checkpoint_arg,
    file_name_arg,
    finite_positive_float,
    launch,
    non_negative_int,
    one_line_errors,
    positive_int,
    setup_run,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/


@results_table("likelihood_normal_guide")
def readme_table(m: dict, prov: dict) -> str:
    """The markdown table of a results JSON written by :func:`main`."""
    lines = ["| guide | presences scored by | " + " | ".join(f"K = {k}" for k in m["samples"]) + " |",
             "| --- | --- | " + " | ".join("---" for _ in m["samples"]) + " |"]
    labels = {"encoder": "amortised (encoder)", "ttvi": f"test-time VI, {m['ttvi_steps']} steps"}
    densities = {"logit": "logits' densities (a bound)", "clamped": "clamped densities (the training ELBO's)"}
    for guide, by_density in m["bounds"].items():
        for density, by_k in ((d, by_density[d]) for d in PRESENCE_DENSITIES if d in by_density):  # as run
            cells = [f"{by_k[str(k)]['mean']:.1f} ± {by_k[str(k)]['stderr']:.1f}" + (
                f" ({by_k[str(k)]['gain']['mean']:+.1f} ± {by_k[str(k)]['gain']['stderr']:.1f})" if i else "")
                for i, k in enumerate(m["samples"])]
            lines.append(f"| {labels[guide]} | {densities[density]} | " + " | ".join(cells) + " |")
    lines += ["", f"Mean importance bound L_K per image (nats) ± its standard error over the first {m['n_images']} "
              f"test images; in brackets the gain over K = {m['samples'][0]} image by image ± its standard error. "
              f"{provenance_line(prov)}"]
    return "\n".join(lines)


@one_line_errors("heldout_likelihood")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=checkpoint_arg, default=None,
                   help="a model with Normal poses (a shipped one by name, e.g. normal_guide, or a file)")
    p.add_argument("--samples", type=positive_int, nargs="+", default=[1, 10, 100], help="the K of each bound")
    p.add_argument("--limit", type=positive_int, default=200, help="the first N test images")
    p.add_argument("--presence-density", nargs="+", choices=PRESENCE_DENSITIES, default=list(PRESENCE_DENSITIES))
    p.add_argument("--ttvi-steps", type=non_negative_int, default=0,
                   help="also the bounds of a Normal-pose free-form guide fitted by this many test-time VI steps")
    p.add_argument("--ttvi-lr", type=finite_positive_float, default=0.01)
    p.add_argument("--batch-size", type=positive_int, default=100)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--tables-only", action="store_true",
                   help="rewrite the table of every results JSON in RESULTS_DIR from the JSON, then stop")
    p.add_argument("--name", type=file_name_arg, default=None, help="names the results files (default: "
                                                                    "likelihood_<checkpoint stem>)")
    add_common_args(p, results_dir=Path("results") / EXPERIMENT, threads=1)
    args = p.parse_args(argv)
    if setup_run(args, lambda results: [write_table(results, path.stem, readme_table(results, path.stem))
                                        for path in sorted(Path(results).glob("*.json"))]):
        return 0
    if args.checkpoint is None:
        p.error("the following arguments are required: --checkpoint")
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
    write_table(args.results_dir, name, readme_table.__wrapped__(metrics, prov))
    print(readme_table.__wrapped__(metrics, prov))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    launch(main)
