"""Classification after test-time VI (paper §2.4: "a modest improvement"): the linear probe, fit on the encoder's
features of MNIST training images, scored on test images with latents from the encoder and after test-time VI.

    python experiments/ttvi_classification.py                        # the committed run (1000 test digits)
    python experiments/ttvi_classification.py --rotate 45            # on rotated test digits

Two readings of "latents after test-time VI" are scored: the free-form object latents themselves, and the object
capsules re-encoded by the set transformer from the optimised part capsules (the parts are what the image
constrains; re-encoding keeps the object features in the distribution the probe was fit on).  Writes
``results/ttvi_classification.json`` and ``results/ttvi_classification_elbo.png`` (the ELBO trace).
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained, probe_features  # noqa: E402
from probcaps.inference.ttvi import reencode_parents, ttvi_batches  # noqa: E402
from probcaps import plotting  # noqa: E402
from probcaps.data import rotate, to_float  # noqa: E402
from probcaps.cli import (  # noqa: E402
    add_common_args, finite_float, finite_positive_float, non_negative_int, positive_int, launch, one_line_errors,
)
from probcaps.metrics import LinearProbe  # noqa: E402
from probcaps.provenance import provenance, write_results  # noqa: E402
from probcaps.report import load_result, provenance_line  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "mnist_probe.pt"
FEATURES = {"presence_pose": "presences + poses", "presence": "presences"}
LATENTS = {"encoder": "encoder", "ttvi_objects": "test-time VI, free-form objects",
           "ttvi_reencoded": "test-time VI parts, objects re-encoded"}


def readme_table(results_dir: Path, name: str = "ttvi_classification") -> str | None:
    """The README table of ``results_dir/<name>.json`` (``--name``, e.g. for another checkpoint)."""
    loaded = load_result(results_dir, name)
    if loaded is None:
        return None
    m, prov = loaded
    lines = ["| latents of the test digits | probe, presences + poses (%) | probe, presences (%) |",
             "| --- | --- | --- |"]
    for key, label in LATENTS.items():
        lines.append(f"| {label} | {100 * m[f'{key}_presence_pose_acc']:.1f} | {100 * m[f'{key}_presence_acc']:.1f} |")
    lines += ["", f"{m['n_test']} MNIST test digits (rotated {m['rotation_deg']:g}°), {m['steps']} steps of test-time VI "
              f"(ELBO per image {m['elbo_encoder']:.0f} → {m['elbo_ttvi']:.0f}); probes fit on the encoder's features of "
              f"{m['n_train']} training digits; checkpoint `{prov.get('checkpoint')}`; {provenance_line(prov)}"]
    return "\n".join(lines)


@one_line_errors("ttvi_classification")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    p.add_argument("--n-test", type=positive_int, default=1000, help="the first N test digits")
    p.add_argument("--probe-train-limit", type=non_negative_int, default=None,
                   help="fit the probe on the first N training images (default: the checkpoint's eval config)")
    p.add_argument("--rotate", type=finite_float, default=0.0, help="rotate the test digits by this many degrees")
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--lr", type=finite_positive_float, default=0.03)
    p.add_argument("--batch-size", type=positive_int, default=250)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--name", default="ttvi_classification")
    add_common_args(p, results_dir=ROOT / "results")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.quiet
    cfg, system = load_trained(args.checkpoint, device=args.device)
    ecfg = cfg["eval"]
    limit = args.probe_train_limit if args.probe_train_limit is not None else ecfg.probe_train_limit
    train_images, train_labels = load_images(cfg["data"], "train", args.data_dir, limit=limit or None)
    test_images, test_labels = load_images(cfg["data"], "test", args.data_dir, limit=args.n_test)
    x = to_float(test_images)
    if args.rotate:
        x = rotate(x, args.rotate).clamp(0, 1)
    train_feats = probe_features(encode_dataset(system.encoder, train_images, ecfg.batch_size, args.device,
                                                progress))
    result = ttvi_batches(system.model, system.guide, x, batch_size=args.batch_size, steps=args.steps,
                          lr=args.lr, device=args.device, progress=progress, seed=args.seed)
    latents = {"encoder": encode_dataset(system.encoder, x, ecfg.batch_size, args.device),
               "ttvi_objects": result.latents,
               "ttvi_reencoded": reencode_parents(system.encoder, result.latents, ecfg.batch_size, args.device)}
    metrics = {"n_train": len(train_images), "n_test": len(x), "rotation_deg": args.rotate, "steps": args.steps,
               "lr": args.lr, "elbo_encoder": float(result.elbo_start.mean()),
               "elbo_ttvi": float(result.elbo_end.mean()), "ttvi_wall_time_s": result.wall_time_s}
    for key in FEATURES:
        probe = LinearProbe(C=ecfg.probe_C, max_iter=ecfg.probe_max_iter).fit(train_feats[key], train_labels)
        for name, lat in latents.items():
            metrics[f"{name}_{key}_acc"] = probe.accuracy(probe_features(lat)[key], test_labels)
    results = Path(args.results_dir)
    plotting.plot_curves({"test-time VI": (list(range(len(result.elbo_trace))), result.elbo_trace)},
                         results / f"{args.name}_elbo.png", xlabel="step", ylabel="ELBO per image (nats)",
                         title=f"test-time VI on {len(x)} MNIST test digits")
    prov = provenance(seed=args.seed, steps=args.steps, wall_time_s=result.wall_time_s, device=args.device,
                      checkpoint=str(args.checkpoint))
    write_results(results / f"{args.name}.json", metrics, prov)
    for name in LATENTS:
        print(f"{name}: probe presence+pose {metrics[f'{name}_presence_pose_acc']:.4f}, presence "
              f"{metrics[f'{name}_presence_acc']:.4f}")
    print(f"wrote {results / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    launch(main)
