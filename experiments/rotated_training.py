"""Paper Figure 4: train the generative capsule model on MNIST with random rotations up to ``theta_max`` and probe
it on test digits rotated the same way; probe accuracy against ``theta_max`` (paper §5.3).

The paper's finding: the more rotation in training, the less the parents specialise to one class and the lower the
probe accuracy; ``finding`` in the JSON tests it (the slope of accuracy against ``theta_max``, and its sign).

    probcaps run rotated_training --thetas 0 45 90 180 --seeds 0 1 2        # the committed run
    probcaps run rotated_training --resume                                   # continue interrupted runs
    probcaps run rotated_training --thetas 0 90 --seeds 0 --set train.steps=5 --set data.dataset="synthetic"

Each (theta_max, seed) trains in ``<out>/theta<T>_seed<S>/`` and leaves its ``metrics.json`` there (``--resume``
picks up where a sweep stopped).  Writes ``results/rotated_training/<name>.json`` and ``<name>.png`` (accuracy
against theta_max).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from probcaps import plotting
from probcaps.experiments.common import FEATURES, train_run
from probcaps.inference.capsule_svi import (
    encode_dataset,
    load_experiment_config,
    load_images,
    load_trained,
    probe_features,
)
from probcaps.inference.evaluate import posterior_part_counts
from probcaps.io import write_json
from probcaps.metrics import LinearProbe, class_purity, kmeans_accuracy
from probcaps.report import fmt_mean_std, provenance_line, results_table, write_report, write_tables_and_tries
from probcaps.runner import (
    add_config_args,
    add_run_args,
    config_dicts,
    finite_non_negative_float,
    launch,
    one_line_errors,
    seed_summary,
    setup_run,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/



def probe_rotated(checkpoint: Path, theta_max: float, data_dir=None, device: str = "cpu",
                  progress: bool = False) -> dict:
    """Fit the probes on training digits and score them on test digits, both rotated uniformly in ±theta_max."""
    cfg, system = load_trained(checkpoint, device=device)
    ecfg = cfg["eval"]
    train_images, train_labels = load_images(cfg["data"], "train", data_dir, limit=ecfg.probe_train_limit or None)
    test_images, test_labels = load_images(cfg["data"], "test", data_dir)
    rotation = float(theta_max) or None
    # the test angles come from another seed than the training ones: no image pairs share an angle by construction
    train_lat = encode_dataset(system.encoder, train_images, ecfg.batch_size, device, progress, rotation, seed=101)
    test_lat = encode_dataset(system.encoder, test_images, ecfg.batch_size, device, progress, rotation, seed=202)
    train_feats, test_feats = probe_features(train_lat), probe_features(test_lat)
    metrics = {"theta_max": float(theta_max), "n_train": len(train_images), "n_test": len(test_images)}
    metrics.update({f"probe_{key}_test_acc": LinearProbe(C=ecfg.probe_C, max_iter=ecfg.probe_max_iter).fit(
        train_feats[key], train_labels).accuracy(test_feats[key], test_labels) for key in FEATURES})
    # the paper's "specialise less" made measurable: how class-specific the parents are (1: each fires for one
    # class only), by presence and weighted by each parent's expected part count (SCAE's posterior presence)
    present = (torch.sigmoid(test_lat.parent_logits) > 0.5).float()  # (N, K)
    metrics["parent_class_purity"] = class_purity(present, test_labels)
    counts = posterior_part_counts(system.model, test_lat, ecfg.batch_size)
    metrics["parent_class_purity_posterior"] = class_purity(counts, test_labels)
    # SCAE's unsupervised score on the posterior presences: how far the objects alone sort the digits
    metrics["kmeans_posterior_counts_test_acc"] = kmeans_accuracy(counts, test_labels, n_init=ecfg.kmeans_n_init)
    metrics["mean_active_parents"] = float(present.sum(1).mean())
    return metrics


#: how far the objects specialise to one class; the runs of an older sweep lack the last two
SPECIALISATION = ["parent_class_purity", "parent_class_purity_posterior", "kmeans_posterior_counts_test_acc"]


def finding(thetas: list[float], accs: list[float]) -> dict:
    """Least-squares slope of accuracy against theta_max (points per 90 degrees) and the paper's claim tested."""
    slope = float(np.polyfit(np.asarray(thetas, float), np.asarray(accs, float), 1)[0]) * 90 * 100
    return {"slope_points_per_90deg": slope, "accuracy_decreases_with_rotation": bool(slope < 0),
            "drop_first_to_last_points": 100 * (accs[0] - accs[-1])}


def summarise(runs: list[dict], thetas: list[float]) -> dict:
    summary: dict = {"per_run": runs, "per_theta": []}
    for theta in thetas:
        rows = [r for r in runs if r["theta_max"] == theta]
        summary["per_theta"].append({"theta_max": theta, "seeds": [r["seed"] for r in rows], **seed_summary(
            rows, [*(f"probe_{k}_test_acc" for k in FEATURES), *(k for k in SPECIALISATION if k in rows[0]),
                   "train_wall_time_s"])})
    means = [e["probe_presence_pose_test_acc_mean"] for e in summary["per_theta"]]
    summary["finding"] = finding(thetas, means) if len(thetas) > 1 else None
    return summary


def plot(summary: dict, path: Path) -> Path:
    """Accuracy against θmax and, beside it, how class-specific the objects are (mean ± std over the seeds)."""
    pts = summary["per_theta"]
    x = [p["theta_max"] for p in pts]

    def curve(key: str, scale: float = 100.0):
        return x, [scale * p[f"{key}_mean"] for p in pts], [scale * p[f"{key}_std"] for p in pts]
    accuracy = {f"probe on {label}": curve(f"probe_{k}_test_acc") for k, label in FEATURES.items()}
    xlabel, n = "maximum training rotation θmax (degrees)", len(pts[0]["seeds"])
    panels = [{"curves": accuracy, "xlabel": xlabel, "ylabel": "test accuracy (%)",
               "title": f"rotated MNIST (test rotated within ±θmax); {n} seed{'s' if n > 1 else ''}"}]
    if "kmeans_posterior_counts_test_acc_mean" in pts[0]:
        accuracy["k-means on posterior presences"] = curve("kmeans_posterior_counts_test_acc")
        panels.append({"curves": {"by expected part counts": curve("parent_class_purity_posterior", 1.0),
                                  "where on (presence > 0.5)": curve("parent_class_purity", 1.0)},
                       "xlabel": xlabel, "ylabel": "objects' class purity (0.1: none)", "ylim": (0.0, 1.0),
                       "title": "how class-specific the objects are"})
    return plotting.plot_curve_panels(panels, path)


@results_table("rotated_training")
def readme_table(m: dict, prov: dict) -> str:
    """The table of ``results_dir/<name>.json``: probe accuracy, the objects' class purity and k-means on their
    posterior presences per θmax."""
    lines = ["| θmax (train and test) | probe, presences + poses (%) | probe, presences (%) | class purity: by part "
             "counts / where on | k-means on part counts (%) | training (min per run) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for p in m["per_theta"]:
        rows = [r for r in m["per_run"] if r["theta_max"] == p["theta_max"]]

        def ms(key, scale=100.0):
            return fmt_mean_std([r[key] for r in rows], scale=scale, digits=1 if scale == 100.0 else 2) \
                if key in rows[0] else "—"
        lines.append(f"| {p['theta_max']:g}° | {ms('probe_presence_pose_test_acc')} | {ms('probe_presence_test_acc')} "
                     f"| {ms('parent_class_purity_posterior', 1.0)} / {ms('parent_class_purity', 1.0)} "
                     f"| {ms('kmeans_posterior_counts_test_acc')} | {p['train_wall_time_s_mean'] / 60:.0f} |")
    lines.append("")
    if f := m.get("finding"):
        verdict = "reproduced" if f["accuracy_decreases_with_rotation"] else "not reproduced"
        lines.append(f"Paper's finding (accuracy falls as θmax grows): **{verdict}** here — least-squares slope "
                     f"{f['slope_points_per_90deg']:+.1f} points per 90°, {f['drop_first_to_last_points']:+.1f} "
                     f"points from the smallest to the largest θmax (presences + poses).")
    lines.append(f"Seeds {prov.get('seed')}; {prov.get('steps')} steps of batch {prov.get('batch_size')} per run; "
                 "class purity: the mean over objects of the largest class share among the test images, each "
                 "weighted by the object's expected part count, or counted where the object is on (presence > 0.5) "
                 "(0.1: none; —: no object on in any test image); "
                 f"probe fit on {m['per_run'][0]['n_train']} training and scored on "
                 f"{m['per_run'][0]['n_test']} test digits; {provenance_line(prov)}")
    return "\n".join(lines)


#: the tries for objects that specialise (the recipe with one change): one record each,
#: ``results_dir/ablations/<try>.json`` (:func:`probcaps.report.load_try`), laid out as ``results_dir/ablations.md``
ABLATIONS = "ablations"
#: ``(metrics key, column head, scale, digits)`` of the table of tries
ABLATION_COLUMNS = [("probe_presence_pose_test_acc", "probe, presences + poses (%)", 100.0, 1),
                    ("probe_presence_test_acc", "probe, presences (%)", 100.0, 1),
                    ("kmeans_posterior_counts_test_acc", "k-means on part counts (%)", 100.0, 1),
                    ("parent_class_purity", "class purity, where on", 1.0, 2),
                    ("mean_active_parents", "objects on per image", 1.0, 1)]


def write_tables(results_dir: Path, name: str) -> list[Path | None]:
    """``results_dir/<name>.md`` and the table of tries, ``results_dir/ablations.md``
    (:func:`~probcaps.report.write_tables_and_tries`)."""
    return write_tables_and_tries(results_dir, name,
                                  readme_table, ABLATION_COLUMNS, "`rotated_training.toml`", ABLATIONS)


@one_line_errors("rotated_training")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, "rotated_training", [0, 1])
    p.add_argument("--thetas", type=finite_non_negative_float, nargs="+", default=[0, 45, 90, 180])
    p.add_argument("--jit", action="store_true")
    p.add_argument("--train-only", action="store_true", help="train (and probe) the runs, skip the summary")
    add_run_args(p, EXPERIMENT, resume="continue interrupted runs; reuse finished ones")
    args = p.parse_args(argv)
    args.name = args.name or load_experiment_config(args.config)["name"]
    args.out = args.out or str(Path("runs") / args.name)
    if setup_run(args, tables := lambda results: write_tables(Path(results), args.name)):
        return 0
    t0 = time.perf_counter()
    thetas = sorted(args.thetas)
    runs = []
    for theta in thetas:
        for seed in args.seeds:
            cfg = load_experiment_config(args.config, [*args.set, f"train.seed={seed}", f"data.train_rotation={theta}",
                                                       *(["train.jit=true"] if args.jit else [])])
            out = Path(args.out) / f"theta{theta:g}_seed{seed}"
            (final, state), metrics_path = train_run(cfg, out, args), out / "metrics.json"
            if args.resume and metrics_path.is_file() and metrics_path.stat().st_mtime > final.stat().st_mtime:
                runs.append(json.loads(metrics_path.read_text()))  # a finished run's metrics, newer than its model
                continue
            metrics = probe_rotated(final, theta, args.data_dir, args.device, progress=not args.quiet)
            metrics.update(seed=seed, steps=state["step"], train_wall_time_s=state["wall_time_s"])
            write_json(metrics_path, metrics)
            runs.append(metrics)
            print(f"theta_max {theta:g}, seed {seed}: probe presence+pose "
                  f"{metrics['probe_presence_pose_test_acc']:.4f}, presence {metrics['probe_presence_test_acc']:.4f}, "
                  f"purity {metrics['parent_class_purity']:.3f}")
    if args.train_only:
        return 0
    summary = summarise(runs, thetas)
    cfg = load_experiment_config(args.config, args.set)
    write_report(args.results_dir, args.name, summary, tables, seed=args.seeds, steps=runs[0]["steps"],
                 device=args.device, wall_time_s=sum(r["train_wall_time_s"] for r in runs),
                 batch_size=cfg["train"].batch_size, thetas=thetas, sweep_wall_time_s=time.perf_counter() - t0,
                 configs=config_dicts(cfg))
    print(f"wrote {plot(summary, Path(args.results_dir) / f'{args.name}.png')}")
    return 0


if __name__ == "__main__":
    launch(main)
