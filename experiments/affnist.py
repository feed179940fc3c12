"""Out-of-distribution classification (paper §5.2): fit the linear probe on MNIST training features only, score
it on the affNIST-recipe stand-in (Tieleman 2013) generated from the 10,000 MNIST test digits.

    probcaps run affnist                                   # the committed run (headline checkpoint)
    probcaps run affnist --ttvi-limit 1000                 # also: probe after test-time VI on 1000 images
    probcaps run affnist --affnist-mat test.mat            # the real affNIST file, for users who have it

Reported as "affNIST-recipe", never as affNIST (the real set could not be fetched here).  For scale, a supervised
CNN (``models.cnn_classifier.ConvClassifier``) is trained on the same MNIST placement (40×40, ±6 px).  Writes
``results/affnist/<name>.json`` and ``<name>_examples.png`` (affNIST-recipe inputs and the model's reconstructions).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from probcaps import plotting
from probcaps.data.affnist import AFFNIST_RECIPE, affnist_recipe_test, load_affnist_mat
from probcaps.errors import ProbcapsError
from probcaps.experiments.common import FEATURES, checkpoint_parser, reconstruct
from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained, probe_features
from probcaps.inference.supervised import accuracy, train_classifier
from probcaps.inference.train import TrainConfig
from probcaps.inference.ttvi import reencode_parents, ttvi_batches
from probcaps.metrics import LinearProbe
from probcaps.models.cnn_classifier import ConvClassifier
from probcaps.report import fmt_mean_std, load_result, provenance_line, write_report, write_tables_and_tries
from probcaps.runner import (
    add_run_args,
    launch,
    non_negative_int,
    one_line_errors,
    positive_int,
    setup_run,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/


def cnn_baseline(train_images, train_labels, tests: dict, steps: int, seeds: list[int], out: Path, device: str,
                 progress: bool) -> list[dict]:
    """Train :class:`ConvClassifier` on the MNIST placement per seed; accuracy on each test set in ``tests``."""
    runs = []
    for seed in seeds:
        torch.manual_seed(seed)
        net = ConvClassifier(train_images.shape[-1])
        cfg = TrainConfig(steps=steps, batch_size=128, lr=1e-3, warmup_steps=50, log_every=50,
                          checkpoint_every=max(steps, 1), seed=seed)
        state = train_classifier(net, train_images, train_labels, cfg, out / f"cnn_seed{seed}", device=device,
                                 progress=progress)
        runs.append({"seed": seed, "steps": state.step, "train_wall_time_s": state.wall_time_s,
                     **{f"{name}_acc": accuracy(net, x, y, device=device) for name, (x, y) in tests.items()}})
    return runs


def readme_table(results_dir: Path, name: str = "affnist") -> str | None:
    """The README table of ``results_dir/<name>.json`` (``--name``; e.g. ``affnist_ceiling`` for another checkpoint)."""
    if (loaded := load_result(results_dir, name)) is None:
        return None
    m, prov = loaded
    cnn, ood = m["cnn"], m["ood_name"]
    lines = [f"| classifier (fit on MNIST train only) | MNIST test (40×40, ±6 px) (%) | {ood} (%) | published (real "
             f"affNIST) |", "| --- | --- | --- | --- |"]
    anchors = {"presence_pose": "SCAE 92.2; sparse unsupervised capsules 90", "presence": "—"}
    for key, label in FEATURES.items():
        lines.append(f"| linear probe on object {label}, encoder | {100 * m[f'mnist_probe_{key}_acc']:.1f} | "
                     f"{100 * m[f'ood_probe_{key}_acc']:.1f} | {anchors[key]} |")
    others = [load_result(results_dir, p.stem) for p in sorted(Path(results_dir).glob(f"{name}_seed*.json"))]
    if others:  # the same run on the other seeds' checkpoints (--name <name>_seed<S>)
        everyone = [m] + [o[0] for o in others]
        for key, label in FEATURES.items():
            lines.append(f"| linear probe on object {label}, encoder, {len(everyone)} checkpoints (seeds' models; "
                         f"mean ± std) | {fmt_mean_std([e[f'mnist_probe_{key}_acc'] for e in everyone])} | "
                         f"{fmt_mean_std([e[f'ood_probe_{key}_acc'] for e in everyone])} | {anchors[key]} |")
    if m.get("ttvi"):
        t = m["ttvi"]
        for reading, how in (("reencoded", "objects re-encoded from the optimised parts"),
                             ("objects", "free-form objects")):
            for key, label in FEATURES.items():
                lines.append(f"| probe on object {label} after test-time VI, {how} (first {t['n_images']} images) "
                             f"| — | {100 * t[f'{reading}_probe_{key}_acc']:.1f} (encoder on the same images: "
                             f"{100 * t[f'encoder_probe_{key}_acc']:.1f}) | — |")
    if cnn:
        lines.append(f"| supervised CNN, {len(cnn)} seed(s) | {fmt_mean_std([r['mnist_acc'] for r in cnn])} | "
                     f"{fmt_mean_std([r['ood_acc'] for r in cnn])} | SCAE's CNN baseline 71.5 (real affNIST) |")
    seeds = [r["seed"] for r in cnn]
    lines += ["", f"{ood}: the 10,000 MNIST test digits under Tieleman's recipe (rotation ±"
              f"{AFFNIST_RECIPE['rotation_deg']:g}°, shear ±{AFFNIST_RECIPE['shear']}, scales in "
              f"[{AFFNIST_RECIPE['scale_min']}, {AFFNIST_RECIPE['scale_max']}], random translation inside the 40×40 "
              f"canvas; seed {m['recipe_seed']}) — a stand-in generated here, not the real affNIST. Probes fit on "
              f"{m['n_probe_train']} MNIST training images with the checkpoint `{prov.get('checkpoint')}`; "
              + (f"CNN seeds {seeds}, {cnn[0]['steps']} steps of batch 128; " if cnn else
                 "no CNN baseline in this run; ")
              + provenance_line(prov)]
    return "\n".join(lines)


#: the probes on other checkpoints: one record each, ``results_dir/ablations/<try>.json``
#: (:func:`probcaps.report.load_try`), laid out as ``results_dir/ablations.md``
ABLATIONS = "ablations"
#: ``(metrics key, column head, scale, digits)`` of the table of tries
ABLATION_COLUMNS = [("mnist_probe_presence_pose_acc", "MNIST test, presences + poses (%)", 100.0, 1),
                    ("ood_probe_presence_pose_acc", "affNIST-recipe, presences + poses (%)", 100.0, 1),
                    ("mnist_probe_presence_acc", "MNIST test, presences (%)", 100.0, 1),
                    ("ood_probe_presence_acc", "affNIST-recipe, presences (%)", 100.0, 1)]


def write_tables(results_dir: Path, name: str) -> list[Path | None]:
    """``results_dir/<name>.md`` and the table of tries, ``results_dir/ablations.md``
    (:func:`~probcaps.report.write_tables_and_tries`)."""
    return write_tables_and_tries(results_dir, name,
                                  readme_table, ABLATION_COLUMNS, "the `affnist_fast` run", ABLATIONS)


@one_line_errors("affnist")
def main(argv=None) -> int:
    p = checkpoint_parser(__doc__)
    p.add_argument("--affnist-mat", default=None, help="score on an original affNIST .mat file instead of the recipe")
    p.add_argument("--recipe-seed", type=non_negative_int, default=0)
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N out-of-distribution images")
    p.add_argument("--probe-train-limit", type=non_negative_int, default=None,
                   help="fit the probe on the first N MNIST training images (default: the checkpoint's eval config)")
    p.add_argument("--ttvi-limit", type=non_negative_int, default=0,
                   help="also probe after test-time VI on the first N images")
    p.add_argument("--ttvi-steps", type=positive_int, default=200)
    p.add_argument("--cnn-steps", type=positive_int, default=1500)
    p.add_argument("--cnn-seeds", type=non_negative_int, nargs="*", default=[0])
    add_run_args(p, EXPERIMENT, name="affnist", out="runs/affnist", out_help="run folder of the CNN baseline")
    args = p.parse_args(argv)
    if setup_run(args, tables := lambda results: write_tables(Path(results), args.name)):
        return 0
    t0 = time.perf_counter()
    progress = not args.quiet
    cfg, system = load_trained(args.checkpoint, device=args.device)
    if cfg["data"].canvas_size != 40:
        raise ProbcapsError(f"{args.checkpoint}: trained on {cfg['data'].canvas_size}x{cfg['data'].canvas_size} "
                            f"images; affNIST is 40x40")
    limit = args.probe_train_limit if args.probe_train_limit is not None else cfg["eval"].probe_train_limit
    train_images, train_labels = load_images(cfg["data"], "train", args.data_dir, limit=limit or None)
    mnist_images, mnist_labels = load_images(cfg["data"], "test", args.data_dir)
    ood_name = "affNIST" if args.affnist_mat else "affNIST-recipe"
    ood_images, ood_labels = (load_affnist_mat(args.affnist_mat) if args.affnist_mat else
                              affnist_recipe_test(args.data_dir, seed=args.recipe_seed,
                                                  verify=cfg["data"].dataset == "mnist"))
    if args.limit:
        ood_images, ood_labels = ood_images[:args.limit], ood_labels[:args.limit]
    enc = system.encoder
    feats = {name: probe_features(encode_dataset(enc, imgs, cfg["eval"].batch_size, args.device, progress))
             for name, imgs in (("train", train_images), ("mnist", mnist_images), ("ood", ood_images))}
    metrics: dict = {"ood_name": ood_name, "recipe": AFFNIST_RECIPE, "recipe_seed": args.recipe_seed,
                     "n_probe_train": len(train_images), "n_ood": len(ood_images)}
    probes = {key: LinearProbe(C=cfg["eval"].probe_C, max_iter=cfg["eval"].probe_max_iter).fit(
        feats["train"][key], train_labels) for key in FEATURES}
    metrics.update({f"{split}_probe_{key}_acc": probes[key].accuracy(feats[split][key], labels) for key in FEATURES
                    for split, labels in (("mnist", mnist_labels), ("ood", ood_labels))})
    if args.ttvi_limit:
        n = min(args.ttvi_limit, len(ood_images))
        res = ttvi_batches(system.model, system.guide, ood_images[:n], steps=args.ttvi_steps, device=args.device,
                           progress=progress, seed=0)
        readings = {"encoder": {key: f[:n] for key, f in feats["ood"].items()}, "objects": probe_features(res.latents),
                    "reencoded": probe_features(reencode_parents(enc, res.latents, device=args.device))}
        t = metrics["ttvi"] = {"n_images": n, "steps": args.ttvi_steps, "wall_time_s": res.wall_time_s,
                               "elbo_encoder": float(res.elbo_start.mean()), "elbo_ttvi": float(res.elbo_end.mean())}
        t.update({f"{reading}_probe_{key}_acc": probes[key].accuracy(f[key], ood_labels[:n]) for key in FEATURES
                  for reading, f in readings.items()})
    metrics["cnn"] = cnn_baseline(train_images, train_labels,
                                  {"mnist": (mnist_images, mnist_labels), "ood": (ood_images, ood_labels)},
                                  args.cnn_steps, args.cnn_seeds, Path(args.out), args.device, progress) \
        if args.cnn_seeds and args.cnn_steps > 0 else []
    results = Path(args.results_dir)
    x = ood_images[:8].float().div(255).unsqueeze(1).to(args.device)
    recon = reconstruct(system.model, system.encoder.encode(x))
    plotting.plot_image_grid(torch.stack([x[:, 0].cpu(), recon[:, 0].cpu()]), results / f"{args.name}_examples.png",
                             row_labels=[ood_name, "reconstruction"], title=f"{ood_name}: inputs and the "
                             f"model's reconstructions (encoder only)")
    write_report(results, args.name, metrics, tables, seed=args.cnn_seeds, steps=args.cnn_steps,
                 wall_time_s=time.perf_counter() - t0, device=args.device, checkpoint=str(args.checkpoint))
    print(f"{ood_name}: probe presence+pose {metrics['ood_probe_presence_pose_acc']:.4f}, presence "
          f"{metrics['ood_probe_presence_acc']:.4f} (MNIST test {metrics['mnist_probe_presence_pose_acc']:.4f}); "
          f"CNN {np.mean([r['ood_acc'] for r in metrics['cnn']]) if metrics['cnn'] else float('nan'):.4f}")
    return 0


if __name__ == "__main__":
    launch(main)
