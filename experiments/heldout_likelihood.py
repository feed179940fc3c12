"""The held-out log-likelihood of a trained capsule model (Smith et al. 2020, §6): the K-sample importance bound
on log p(x) per test image, with the amortised guide and after test-time VI as proposals; and the same generative
model trained under other inference, side by side.

    probcaps run heldout_likelihood --checkpoint normal_guide --samples 1 10 100 --limit 200 --ttvi-steps 50
    probcaps run heldout_likelihood --objectives elbo iwae score_function --samples 1 10 100 1000 --limit 200

The bound needs a guide with a density over every latent: a model with Normal poses (``normal_guide``).  Writes
``results/heldout_likelihood/<name>.json`` and its table; the maths is :mod:`probcaps.inference.likelihood`.

With ``--objectives``, each of the first recommended MNIST recipe's trained models (``--start``, one per seed) gets
Normal poses and is trained on from there, as ``normal_guide`` trains its model, once under each objective
(:mod:`probcaps.inference.objectives`): the relaxed ELBO, the importance-weighted bound, and score-function
gradients for Bernoulli presences, the model before the concrete relaxation.  Every objective draws the same number
of samples a step (``--particles`` K per image on a batch K times smaller), so a step costs about the same.  Each
trained model is then read out as ``probcaps evaluate`` reads one (its held-out bound, probes, k-means on the
posterior presences, class purity), the starting models too, into ``<name>.json`` (default ``inferences``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from probcaps.checkpoints import load_checkpoint
from probcaps.data import to_float
from probcaps.errors import CheckpointError
from probcaps.experiments.common import add_normal_pose_args, normal_pose_training, train_run
from probcaps.inference.capsule_svi import load_images, load_trained, stored_config
from probcaps.inference.evaluate import compute_evaluation
from probcaps.inference.likelihood import PRESENCE_DENSITIES, bound_summary, log_likelihood_bound
from probcaps.inference.ttvi import FreeFormGuide, run_ttvi
from probcaps.io import write_json
from probcaps.provenance import provenance, write_results
from probcaps.report import fmt_mean_std, provenance_line, results_table, write_table
from probcaps.runner import (
    add_common_args,
    checkpoint_arg,
    file_name_arg,
    finite_positive_float,
    folder_arg,
    launch,
    non_negative_int,
    one_line_errors,
    positive_int,
    setup_run,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/

#: the inferences compared on one generative model: the presences' distribution, the training objective, a label
INFERENCES = {
    "elbo": ("relaxed", "elbo", "relaxed ELBO (concrete presences, one sample)"),
    "iwae": ("relaxed", "iwae", "importance-weighted bound (concrete presences, K samples)"),
    "score_function": ("bernoulli", "score_function", "Bernoulli presences, score-function gradients (K samples)"),
}
#: the first recommended MNIST recipe's trained models (regions of every digit), one per seed: where each comparison
#: starts
START = ["mnist_regions", "mnist_regions_seed1", "mnist_regions_seed2"]
#: the readouts of each trained model kept in the comparison (``compute_evaluation``'s numbers)
KEPT = ("probe_presence_pose_test_acc", "probe_presence_test_acc", "kmeans_posterior_counts_test_acc",
        "kmeans_posterior_counts_test_acc_init_median", "object_class_purity", "mean_active_parents",
        "test_elbo_per_image", "test_recon_mse")


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


def pm(values: list, scale: float = 1.0, digits: int = 1) -> str:
    """:func:`~probcaps.report.fmt_mean_std` of one number per seed (None where not measured); ``—`` for none."""
    return fmt_mean_std([float("nan") if v is None else v for v in values], scale, digits) if values else "—"


@results_table("inferences")
def inferences_table(m: dict, prov: dict) -> str:
    """The table of a comparison written by :func:`compare_inferences`: one row per inference, mean ± std over the
    seeds."""
    ks = [str(k) for k in m["samples"]]
    top = ks[-1]
    lines = [f"| inference | seeds | held-out bound, K = {top} (nats) | minus the relaxed ELBO's, same seed | gain "
             f"over K = {ks[0]} | probe, presences + poses (%) | probe, presences (%) | k-means, posterior presences "
             f"(%) | k-means, median of 10 starts (%) | class purity | objects on | seconds per step |",
             "| --- " * 12 + "|"]

    def bound_at_top(runs: list[dict]) -> list[float | None]:
        return [r["heldout_bound"]["samples"][top]["mean"] if r.get("heldout_bound") else None for r in runs]
    reference = bound_at_top(m["inferences"].get("elbo", []))
    for key in (k for k in ("start", *INFERENCES) if k in m["inferences"]):  # the starting models first
        runs = m["inferences"][key]
        bounds = [r.get("heldout_bound") for r in runs]
        top_k = bound_at_top(runs)
        # the rows start from the same models, seed by seed: their difference is far less spread than each row
        paired = [a - b for a, b in zip(top_k, reference) if a is not None and b is not None] if key != "elbo" else []
        gain = [b["samples"][top]["gain"]["mean"] if b else None for b in bounds]
        per_step = [r["train_wall_time_s"] / r["steps"] if r.get("steps") and key != "start" else None for r in runs]
        lines.append(f"| {m['labels'][key]} | {', '.join(str(r['seed']) for r in runs)} | {pm(top_k)} | {pm(paired)} | "
                     f"{pm(gain)} | "
                     + " | ".join(pm([r[k] for r in runs], 100.0) for k in KEPT[:4])
                     + f" | {pm([r['object_class_purity'] for r in runs], 1.0, 3)} | "
                       f"{pm([r['mean_active_parents'] for r in runs])} | {pm(per_step, 1.0, 2)} |")
    lines += ["", "Mean ± std over the seeds; each seed starts from its own model of the first recommended MNIST "
              f"recipe ({', '.join(f'`{c}`' for c in m['start'])}), gets Normal poses and trains {m['steps']} more "
              f"steps under the inference of its row, {m['samples_per_step']} samples a step (K = {m['particles']} "
              f"samples per image on {m['samples_per_step'] // m['particles']} images for the K-sample objectives). "
              f"Held-out bound: "
              f"presences scored by their logits' densities, on the first {m['n_bound_images']} test images; the gain "
              f"is image by image. Probes fit on {m['n_train']} training images, probes and k-means scored on the "
              f"{m['n_test']} test images. The delta row is the starting models themselves (point-mass poses: no bound "
              f"on log p(x)). {provenance_line(prov)}"]
    return "\n".join(lines)


def _readout(checkpoint: Path, cache: Path, overrides: list[str], args) -> dict:
    """The kept readouts (:data:`KEPT`) and the held-out bound of ``checkpoint``, measured once: with ``--resume``
    read back from ``cache`` when it is of this checkpoint and these settings."""
    key = {"checkpoint": str(checkpoint), "overrides": overrides,
           "mtime": checkpoint.stat().st_mtime_ns}
    if args.resume and cache.is_file():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return stored["readout"]
    ev = compute_evaluation(checkpoint, data_dir=args.data_dir, device=args.device, overrides=overrides,
                            progress=not args.quiet)
    m = ev.metrics
    readout = {**{k: m[k] for k in KEPT}, "heldout_bound": m["heldout_bound"], "n_train": m["n_train"],
               "n_test": m["n_test"], **ev.run}
    write_json(cache, {"key": key, "readout": readout})
    return readout


def compare_inferences(args) -> dict:
    """Train each of ``args.start``'s models on under each of ``args.objectives`` and read every model out (see the
    module docstring); returns the metrics of the comparison."""
    samples_per_step = None
    evaluation = [f"eval.likelihood_samples={json.dumps(args.samples)}", f"eval.likelihood_images={args.limit}",
                  f"eval.probe_train_limit={args.probe_train_limit}", "eval.figures=false",
                  "eval.layer_readouts=false", "eval.nonlinear_probes=false"]
    inferences = {"start": []}
    for start in args.start:
        cfg = stored_config(load_checkpoint(start), start)
        seed = cfg["train"].seed
        if cfg["train"].objective != "elbo" or cfg["model"].presences != "relaxed":
            raise CheckpointError(f"{start}: expected a model trained under the relaxed ELBO")
        samples_per_step = samples_per_step or cfg["train"].batch_size
        # float32 everywhere and no compiled graphs: the seconds per step compare the objectives, not the kernels;
        # the prior at its final value (the recipe's anneal is behind these models)
        float32 = ["encoder.bf16=false"]
        common = [*float32, "train.compile=false", "model.expected_parents_start=0", "model.prior_anneal_steps=0"]
        inferences["start"].append(_readout(Path(start), Path(args.out) / f"start_seed{seed}" / "readout.json",
                                            evaluation + float32, args))
        for objective in args.objectives:
            presences, loss, _ = INFERENCES[objective]
            run_cfg, system = load_trained(start, device=args.device,
                                           overrides=common + [f"model.presences={presences}"])
            k = 1 if loss == "elbo" else args.particles
            run_cfg["train"] = normal_pose_training(system, run_cfg["train"], args, seed, objective=loss,
                                                    particles=k, batch_size=samples_per_step // k)
            out = Path(args.out) / f"{objective}_seed{seed}"
            # the trained model names itself by its inference (train_run names it by args.name)
            named = argparse.Namespace(**{**vars(args), "name": f"{args.name or 'inferences'}_{objective}"})
            final, _ = train_run(run_cfg, out, named, system=system)
            inferences.setdefault(objective, []).append(_readout(final, out / "readout.json", evaluation, args))
    labels = {"start": "delta poses: the starting models", **{k: v[2] for k, v in INFERENCES.items()}}
    first = inferences["start"][0]
    return {"inferences": inferences, "labels": labels, "samples": sorted(set(args.samples)), "steps": args.steps,
            "particles": args.particles, "samples_per_step": samples_per_step, "start": args.start,
            "n_bound_images": args.limit, "n_train": first["n_train"], "n_test": first["n_test"]}


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
                                                                    "likelihood_<checkpoint stem>; inferences)")
    g = p.add_argument_group("inference compared on one model (--objectives)")
    g.add_argument("--objectives", nargs="+", choices=list(INFERENCES), default=None,
                   help="train the --start models on under each of these and compare (instead of --checkpoint)")
    g.add_argument("--start", type=checkpoint_arg, nargs="+", default=None,
                   help="delta-trained models of the relaxed ELBO, one per seed (default: the first recommended MNIST "
                        "recipe's, "
                        f"{' '.join(START)})")
    g.add_argument("--particles", type=positive_int, default=4, help="K of the K-sample objectives")
    g.add_argument("--probe-train-limit", type=non_negative_int, default=10000, help="0: all")
    g.add_argument("--out", type=folder_arg, default=Path("runs") / EXPERIMENT, help="run folders")
    g.add_argument("--resume", action="store_true", help="continue interrupted runs; reuse finished ones")
    add_normal_pose_args(g)
    add_common_args(p, results_dir=Path("results") / EXPERIMENT, threads=1)
    args = p.parse_args(argv)
    if setup_run(args, lambda results: [write_table(results, path.stem, (
            inferences_table if "inferences" in json.loads(path.read_text())["metrics"] else readme_table)(
            results, path.stem)) for path in sorted(Path(results).glob("*.json"))]):
        return 0
    if args.checkpoint is None and args.objectives is None:
        p.error("the following arguments are required: --checkpoint (or --objectives)")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.objectives is not None:
        args.start = args.start or [checkpoint_arg(name) for name in START]
        metrics = compare_inferences(args)
        name = args.name or "inferences"
        prov = provenance(seed=[r["seed"] for r in metrics["inferences"]["start"]], device=args.device,
                          wall_time_s=time.perf_counter() - t0, threads=args.threads, steps=args.steps,
                          checkpoints=[str(c) for c in args.start])
        path = write_results(Path(args.results_dir) / f"{name}.json", metrics, prov)
        print(write_table(args.results_dir, name, inferences_table.__wrapped__(metrics, prov)).read_text())
        print(f"wrote {path}")
        return 0
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
