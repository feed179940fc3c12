"""Paper Figure 3: the encoder alone against encoder + free-form test-time VI on MNIST test digits rotated
0°, 15°, …, 180° (paper §2.4, §5.3).  The generative model is frozen; only per-image latents move.

    probcaps run rotated_digits                                    # the committed run (100 digits per angle)
    probcaps run rotated_digits --n-images 20 --steps 50           # quicker
    probcaps ttvi --checkpoint mnist_probe --rotate 90       # the same optimisation as a command

Per angle, from the encoder's latents and after test-time VI: the ELBO per image (the same fixed noise before and
after, ``inference.ttvi.per_image_elbo``) and the reconstruction error per pixel.  Writes
``results/rotated_digits/<name>.json``,
``<name>_elbo.png``, ``<name>_mse.png`` and ``<name>_example.png``: one digit across the angles, its parts as the
encoder and as test-time VI infer them, each coloured by its template (the paper's Figure 5: whether the same
templates turn with the digit, or others take over).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from probcaps import plotting
from probcaps.data import rotate, to_float
from probcaps.errors import ProbcapsError
from probcaps.experiments.common import checkpoint_parser
from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained
from probcaps.inference.evaluate import parts_by_template, reconstruction_error
from probcaps.inference.guides import Latents
from probcaps.inference.ttvi import ttvi_batches
from probcaps.report import provenance_line, results_table, write_report
from probcaps.runner import (
    add_run_args,
    add_ttvi_args,
    finite_float,
    launch,
    non_negative_int,
    one_line_errors,
    positive_int,
    setup_run,
    table_writer,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/


@torch.no_grad()
def _mean_sem(v: torch.Tensor) -> tuple[float, float]:
    return float(v.double().mean()), float(v.double().std() / len(v) ** 0.5) if len(v) > 1 else 0.0


def checks(rows: list[dict]) -> dict:
    """The acceptance criteria, evaluated on the measured rows."""
    by_angle = {r["angle"]: r for r in rows}
    out = {"ttvi_improves_elbo_at_every_angle_ge_45": all(r["elbo_ttvi"] > r["elbo_encoder"]
                                                          for r in rows if r["angle"] >= 45)}
    if 90 in by_angle:
        r = by_angle[90]
        out["mse_reduction_at_90"] = 1 - r["mse_ttvi"] / r["mse_encoder"]
        out["mse_reduction_at_90_at_least_30pct"] = out["mse_reduction_at_90"] >= 0.30
    if 0 in by_angle:
        out["elbo_not_worse_at_0"] = by_angle[0]["elbo_ttvi"] >= by_angle[0]["elbo_encoder"]
    return out


@results_table("rotated_digits")
def readme_table(m: dict, prov: dict) -> str:
    """The README table of ``results_dir/<name>.json``: ELBO and reconstruction error per angle."""
    lines = ["| rotation | ELBO, encoder | ELBO, + test-time VI | recon MSE ×100, encoder | recon MSE ×100, + TTVI | "
             "MSE reduction |", "| --- | --- | --- | --- | --- | --- |"]
    for r in m["per_angle"]:
        lines.append(f"| {r['angle']:g}° | {r['elbo_encoder']:.0f} ± {r['elbo_encoder_sem']:.0f} | "
                     f"{r['elbo_ttvi']:.0f} ± {r['elbo_ttvi_sem']:.0f} | {100 * r['mse_encoder']:.3f} | "
                     f"{100 * r['mse_ttvi']:.3f} | {100 * (1 - r['mse_ttvi'] / r['mse_encoder']):.0f}% |")
    c = m["checks"]
    lines += ["", f"ELBO per image (nats, ± standard error over {m['n_images_per_angle']} test digits per angle); "
              f"test-time VI improves the ELBO at every angle ≥ 45°: "
              f"**{c['ttvi_improves_elbo_at_every_angle_ge_45']}**; reconstruction error at 90° reduced by "
              f"**{100 * c.get('mse_reduction_at_90', float('nan')):.0f}%** (needed ≥ 30%); ELBO not worse at 0°: "
              f"**{c.get('elbo_not_worse_at_0')}**.",
              f"{m['steps']} Adam steps (lr {m['lr']}, {m['pose_family']} poses) on all "
              f"{m['n_images_total']} images, {m['batch_size']} at a time: {m['ttvi_wall_time_s'] / 60:.1f} min, "
              f"{m['image_steps_per_s']:.0f} image-steps/s, i.e. {m['seconds_per_1000x200'] / 60:.1f} min for 1,000 "
              f"images × 200 steps; checkpoint `{prov.get('checkpoint')}`; {provenance_line(prov)}"]
    return "\n".join(lines)


@one_line_errors("rotated_digits")
def main(argv=None) -> int:
    p = checkpoint_parser(__doc__)
    p.add_argument("--angles", type=finite_float, nargs="+", default=[float(a) for a in range(0, 181, 15)])
    p.add_argument("--n-images", type=positive_int, default=100,
                   help="test digits per angle (the first N of the test set)")
    add_ttvi_args(p)
    p.add_argument("--example", type=non_negative_int, default=0, help="index of the digit shown across angles")
    p.add_argument("--seed", type=non_negative_int, default=0)
    add_run_args(p, EXPERIMENT, name="rotated_digits", out=False)
    args = p.parse_args(argv)
    if setup_run(args, tables := table_writer(readme_table, args.name)):
        return 0
    if not 0 <= args.example < args.n_images:
        raise ProbcapsError(f"--example {args.example}: must be in [0, --n-images={args.n_images})")
    cfg, system = load_trained(args.checkpoint, device=args.device)
    images, _ = load_images(cfg["data"], "test", args.data_dir, limit=args.n_images)
    upright = to_float(images)
    angles = sorted(args.angles)
    # every angle's digits in one tensor: test-time VI runs over all of them, batch_size at a time
    x = torch.cat([rotate(upright, a).clamp(0, 1) if a else upright for a in angles]).unsqueeze(1)
    encoded = encode_dataset(system.encoder, x, args.batch_size, args.device)
    result = ttvi_batches(system.model, system.guide, x, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                          device=args.device, progress=not args.quiet, seed=args.seed, pose_family=args.pose_family)

    def mse(latents: Latents, sl: slice) -> float:
        return reconstruction_error(system.model, x[sl], Latents(*(t[sl] for t in latents)), args.batch_size,
                                    args.device)

    n = args.n_images
    rows = []
    for i, angle in enumerate(angles):
        sl = slice(i * n, (i + 1) * n)
        (e0, e0s), (e1, e1s) = _mean_sem(result.elbo_start[sl]), _mean_sem(result.elbo_end[sl])
        rows.append({"angle": angle, "elbo_encoder": e0, "elbo_encoder_sem": e0s, "elbo_ttvi": e1,
                     "elbo_ttvi_sem": e1s, "mse_encoder": mse(encoded, sl), "mse_ttvi": mse(result.latents, sl),
                     "frac_images_elbo_improved": float((result.elbo_end[sl] > result.elbo_start[sl]).float().mean())})
    rate = len(x) * args.steps / result.wall_time_s
    metrics = {"per_angle": rows, "checks": checks(rows), "n_images_per_angle": n, "n_images_total": len(x),
               "steps": args.steps, "lr": args.lr, "pose_family": args.pose_family, "batch_size": args.batch_size,
               "ttvi_wall_time_s": result.wall_time_s, "image_steps_per_s": rate,
               "seconds_per_1000x200": 1000 * 200 / rate, "threads": torch.get_num_threads(),
               "ttvi_cpu_time_s": result.cpu_time_s}
    results = Path(args.results_dir)
    for key, ylabel, what in (("elbo", "ELBO per image (nats)", "ELBO"),
                              ("mse", "reconstruction MSE per pixel", "reconstruction")):
        curves = {label: (np.array(angles), [r[f"{key}_{k}"] for r in rows],  # the ELBO with its standard errors
                          *([[r[f"{key}_{k}_sem"] for r in rows]] if key == "elbo" else []))
                  for label, k in (("encoder", "encoder"), ("encoder + test-time VI", "ttvi"))}
        plotting.plot_curves(curves, results / f"{args.name}_{key}.png", xlabel="rotation of the test digits (degrees)",
                             ylabel=ylabel, title=f"rotated MNIST test digits: {what}")
    idx = torch.arange(len(angles)) * n + args.example
    grid = np.stack([x[idx, 0, ..., None].expand(-1, -1, -1, 3).numpy(),
                     *(parts_by_template(system.model, Latents(*(t[idx] for t in lat)))[2] for lat in
                       (encoded, result.latents))])
    plotting.plot_image_grid(grid, results / f"{args.name}_example.png",
                             row_labels=["input", "encoder", "+ test-time VI"],
                             col_labels=[f"{a:g}°" for a in angles],
                             title="one test digit, rotated: its parts, coloured by template")
    write_report(results, args.name, metrics, tables, seed=args.seed, steps=args.steps, device=args.device,
                 wall_time_s=result.wall_time_s, checkpoint=str(args.checkpoint),
                 checkpoint_train_steps=cfg.get("train_state", {}).get("step"))
    c = metrics["checks"]
    print(f"ELBO improved at every angle >= 45: {c['ttvi_improves_elbo_at_every_angle_ge_45']}; "
          f"MSE reduction at 90: {c.get('mse_reduction_at_90', float('nan')):.2f}; "
          f"{metrics['seconds_per_1000x200'] / 60:.1f} min per 1000 images x 200 steps")
    return 0


if __name__ == "__main__":
    launch(main)
