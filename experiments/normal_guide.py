"""The full variational pose guide (Smith et al. 2020, §2.3): Normal posteriors over the part and object
poses with learned scales, trained starting from a delta-trained checkpoint, against the delta model it started
from, on the same test images.

    probcaps run normal_guide                                   # the committed run
    probcaps run normal_guide --resume                          # continue an interrupted run
    probcaps ttvi --checkpoint normal_guide --pose-family normal   # test-time VI with it

Writes ``results/normal_guide/<name>.json`` (test ELBO and probe accuracies of both, the learned pose scales),
``<name>_training.png`` and the trained model, ``checkpoints/<name>.pt``.  The delta model's "ELBO" gives its poses
point masses (``log q = 0``): the MAP objective, not a bound on ``log p(x)`` as the Normal guide's is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from probcaps.errors import ProbcapsError
from probcaps.experiments.common import (
    add_normal_pose_args,
    checkpoint_out_path,
    checkpoint_parser,
    export_checkpoint,
    normal_pose_training,
    plot_training_curves,
    train_run,
)
from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained, probe_features
from probcaps.inference.evaluate import test_elbo
from probcaps.metrics import LinearProbe
from probcaps.report import provenance_line, results_table, write_report
from probcaps.runner import (
    add_run_args,
    launch,
    non_negative_int,
    one_line_errors,
    positive_int,
    setup_run,
    table_writer,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/


def evaluate(system, cfg: dict, train, test, elbo_images: torch.Tensor, elbo_samples: int, device: str,
             seed: int = 0) -> dict:
    """Test ELBO (mean over ``elbo_samples`` guide samples, fixed RNG) and probe accuracies of one system."""
    torch.manual_seed(seed)
    elbo = sum(test_elbo(system, elbo_images, device=device) for _ in range(elbo_samples)) / elbo_samples
    out = {"test_elbo_per_image": float(elbo)}
    ecfg = cfg["eval"]
    tr, te = (probe_features(encode_dataset(system.encoder, x, ecfg.batch_size, device)) for x, _ in (train, test))
    out.update({f"probe_{key}_test_acc": LinearProbe(C=ecfg.probe_C, max_iter=ecfg.probe_max_iter).fit(
        tr[key], train[1]).accuracy(te[key], test[1]) for key in tr})
    return out


@results_table("normal_guide")
def readme_table(m: dict, prov: dict) -> str:
    """The README table of ``results_dir/<name>.json``: the delta and the Normal pose guide side by side."""
    lines = ["| guide | test ELBO per image (nats) | probe, presences + poses (%) | probe, presences (%) |",
             "| --- | --- | --- | --- |"]
    for key, label in (("delta", "delta poses (MAP), the starting checkpoint"),
                       ("normal", f"Normal poses, +{m['steps']} steps from it")):
        r = m[key]
        lines.append(f"| {label} | {r['test_elbo_per_image']:.0f} | {100 * r['probe_presence_pose_test_acc']:.1f} | "
                     f"{100 * r['probe_presence_test_acc']:.1f} |")
    lines += ["", f"ELBO on the first {m['n_elbo_images']} MNIST test images, averaged over {m['elbo_samples']} guide "
              f"samples; the delta guide's value is its MAP objective (point-mass poses, no entropy), the Normal "
              f"guide's a bound on log p(x). Learned pose scales (mean): parts {m['mean_part_pose_scale']:.3f}, "
              f"objects {m['mean_object_pose_scale']:.3f}. Probes fit on {m['n_probe_train']} training images. "
              f"Training {m['train_wall_time_s'] / 60:.0f} min; {provenance_line(prov)}"]
    return "\n".join(lines)


@one_line_errors("normal_guide")
def main(argv=None) -> int:
    p = checkpoint_parser(__doc__, "the delta-trained starting point")
    add_normal_pose_args(p)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--n-elbo-images", type=positive_int, default=2000)
    p.add_argument("--elbo-samples", type=positive_int, default=3)
    p.add_argument("--probe-train-limit", type=non_negative_int, default=10000, help="0: all")
    add_run_args(p, EXPERIMENT, name="normal_guide", out="runs/normal_guide", out_help="run folder", resume=True,
                 checkpoint_out="export the trained model here (default: checkpoints/<name>.pt; '' for none)")
    args = p.parse_args(argv)
    if setup_run(args, tables := table_writer(readme_table, args.name)):
        return 0
    cfg, delta = load_trained(args.checkpoint, device=args.device)
    if delta.guide_spec["family"] != "delta":
        raise ProbcapsError(f"{args.checkpoint}: expected a delta-trained checkpoint, found "
                            f"{delta.guide_spec['family']} poses")
    train = load_images(cfg["data"], "train", args.data_dir, limit=args.probe_train_limit or None)
    test = load_images(cfg["data"], "test", args.data_dir)
    elbo_images = test[0][:args.n_elbo_images]
    metrics = {"delta": evaluate(delta, cfg, train, test, elbo_images, args.elbo_samples, args.device)}
    _, system = load_trained(args.checkpoint, device=args.device)
    cfg["train"] = normal_pose_training(system, cfg["train"], args, args.seed)
    final, state = train_run(cfg, Path(args.out), args, system=system)
    _, system = load_trained(final, device=args.device)
    metrics["normal"] = evaluate(system, cfg, train, test, elbo_images, args.elbo_samples, args.device)
    with torch.no_grad():
        metrics["mean_part_pose_scale"] = float(system.guide.pose_scales("y0").mean())
        metrics["mean_object_pose_scale"] = float(system.guide.pose_scales("y1").mean())
    metrics.update(steps=state["step"], train_wall_time_s=state["wall_time_s"], n_elbo_images=len(elbo_images),
                   elbo_samples=args.elbo_samples, n_probe_train=len(train[0]))
    write_report(args.results_dir, args.name, metrics, tables, seed=args.seed, steps=state["step"],
                 wall_time_s=state["wall_time_s"], device=args.device, checkpoint=str(args.checkpoint), lr=args.lr,
                 init_scale=args.init_scale, min_scale=args.min_scale)
    plot_training_curves({"Normal poses": final.parent / "log.jsonl"},
                         Path(args.results_dir) / f"{args.name}_training.png")
    if (checkpoint_out := checkpoint_out_path(args.checkpoint_out, args.name)) is not None:
        export_checkpoint(final, checkpoint_out)
    print(f"test ELBO per image: delta {metrics['delta']['test_elbo_per_image']:.1f}, Normal "
          f"{metrics['normal']['test_elbo_per_image']:.1f}; probe presence+pose delta "
          f"{metrics['delta']['probe_presence_pose_test_acc']:.4f}, Normal "
          f"{metrics['normal']['probe_presence_pose_test_acc']:.4f}")
    return 0


if __name__ == "__main__":
    launch(main)
