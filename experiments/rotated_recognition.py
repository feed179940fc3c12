"""Recognising rotated digits by inference: the encoder restarted in rotated frames, the frame kept by the ELBO.

    probcaps run rotated_recognition                              # the MNIST recipe's model, 500 digits, 0°-180°
    probcaps run rotated_recognition --checkpoints mnist_regions mnist --ttvi-steps 40   # the committed run
    probcaps run rotated_recognition --angles 45 --n-test 100     # quicker

A rotated digit is one the model can explain with its objects turned; the amortised encoder, trained on upright
digits, cannot turn them.  So the posterior is searched over a global rotation: each test image is counter-rotated
by every candidate angle (a restart of the encoder in that frame), each restart is scored by its ELBO (the guide
sampled with common random numbers across the restarts), and the frame with the highest ELBO is kept.  Linear probes
fit on upright training digits then read the kept frame's capsules.  No label and no rotation angle is used at test
time.  With ``--ttvi-steps N``, free-form test-time VI (Smith et al. 2020, §4) then refines the kept frame's capsules
by N steps on the ELBO of the counter-rotated image, started at the encoder's restart: local steps polish a frame
the search has found, and the probes read the refined capsules too.  Writes
``results/rotated_recognition/<name>.json`` and its table, beside LeNet-5's and CapsNet's accuracies at the same
angles (``results/rotated_mnist_cnn_vs_capsnet/rotated_mnist_full_capsnet.json``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from probcaps.data import place_on_canvas, placed_mnist, rotate, to_float
from probcaps.data.mnist import load_mnist
from probcaps.experiments.common import FEATURES
from probcaps.inference.api import load
from probcaps.metrics import LinearProbe
from probcaps.report import fmt_mean_std, provenance_line, results_table, write_report
from probcaps.runner import (
    add_run_args,
    checkpoint_arg,
    finite_float,
    finite_positive_float,
    launch,
    non_negative_int,
    one_line_errors,
    positive_int,
    setup_run,
    table_writer,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/
#: the curve of the supervised baselines trained on upright digits (beside this experiment's results folder), read
#: for the same angles
BASELINES = Path("rotated_mnist_cnn_vs_capsnet") / "rotated_mnist_full_capsnet.json"
#: where the probes read the capsules: the encoder on the rotated image, the kept frame's restart, and that restart
#: refined by test-time VI (--ttvi-steps)
STAGES = {"encoder": "encoder", "search": "search", "ttvi": "search + test-time VI"}


def counter_rotated(images: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``(N, 1, H, W)`` images turned back by ``angles`` ``(N,)`` degrees about the canvas centre, in [0, 1]."""
    return rotate(images[:, 0], -angles).clamp(0, 1).unsqueeze(1)


@torch.no_grad()
def search_rotation(model, images: torch.Tensor, candidates: torch.Tensor, batch_size: int = 250,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept angle (N,), ELBO of every restart (C, N))``: each of ``images`` ``(N, 1, H, W)`` counter-rotated by
    each of ``candidates`` ``(C,)`` degrees and scored by its ELBO
    (:meth:`~probcaps.inference.api.TrainedCapsuleModel.log_likelihood_bound`, one sample of the guide, the same
    random numbers for every restart of an image); the kept angle is the restart with the highest ELBO."""
    elbo = torch.stack([torch.cat([model.log_likelihood_bound(counter_rotated(x, c.expand(len(x))), seed=seed)
                                   for x in images.split(batch_size)]) for c in candidates])
    return candidates[elbo.argmax(0)], elbo


def recognise(name: str, args, angles: list[float]) -> dict:
    """One model's probe accuracies per angle, from the encoder and after the rotation search."""
    t0 = time.perf_counter()
    model = load(name, device=args.device)
    train_x, train_y = model.load_images("train", limit=args.probe_train_limit or None, data_dir=args.data_dir)
    probes = {kind: LinearProbe().fit(model.features(train_x, kind=kind), train_y) for kind in FEATURES}
    digits, labels = load_mnist("test", data_dir=args.data_dir)
    digits, labels = digits[:args.n_test], labels[:args.n_test]
    data = model.config["data"]  # each test digit at its own SCAE offset, as the baselines' curve places it
    offsets = placed_mnist("test", data_dir=args.data_dir, canvas=data.canvas_size, max_shift=data.max_shift,
                           seed=data.seed, limit=args.n_test).offsets
    candidates = torch.arange(0.0, 360.0, args.candidate_step)
    rows = []
    for angle in angles:
        placed = place_on_canvas(rotate(to_float(digits), angle).clamp(0, 1), offsets, canvas=data.canvas_size)
        x = placed.unsqueeze(1)
        kept, _ = search_rotation(model, x, candidates, args.batch_size, args.seed)
        upright = counter_rotated(x, kept)
        error = ((kept - angle + 180) % 360 - 180).abs()
        row = {"angle": angle, "frame_within_step": float((error <= args.candidate_step).float().mean())}
        read = {"encoder": x, "search": upright}
        if args.ttvi_steps:
            read["ttvi"] = refined = model.ttvi(upright, args.ttvi_steps, lr=args.ttvi_lr, seed=args.seed,
                                                batch_size=args.batch_size)
            row["ttvi_elbo_gain"] = float((refined.ttvi.elbo_end - refined.ttvi.elbo_start).mean())
        for where, inputs in read.items():
            for kind in FEATURES:
                row[f"{where}_{kind}_acc"] = probes[kind].accuracy(model.features(inputs, kind=kind), labels)
        rows.append(row)
        if not args.quiet:
            print(f"{name} {angle:5.1f}°: encoder {row['encoder_presence_pose_acc']:.3f}, search "
                  f"{row['search_presence_pose_acc']:.3f} (frame within {args.candidate_step:g}°: "
                  f"{row['frame_within_step']:.2f})", flush=True)
    return {"checkpoint": name, "per_angle": rows, "n_probe_train": len(train_x),
            "wall_time_s": time.perf_counter() - t0}


def _baselines(results_dir: Path, angles: list[float]) -> dict[str, list[str]]:
    """LeNet-5's and CapsNet's accuracy (mean ± std over their seeds) at ``angles``, from their results file beside
    ``results_dir``; none where it is absent."""
    path = results_dir.parent / BASELINES
    if not path.is_file():
        return {}
    m = json.loads(path.read_text(encoding="utf-8"))["metrics"]
    at = {float(a): i for i, a in enumerate(m["angles"])}
    cell = {model: [fmt_mean_std([s[f"{model}_acc"][at[a]] for s in m["per_seed"]]) if a in at else "—"
                    for a in angles] for model in ("lenet", "capsnet")}
    return {"LeNet-5": cell["lenet"], "CapsNet": cell["capsnet"]}


@results_table("rotated_recognition")
def readme_table(m: dict, prov: dict) -> str:
    """Probe accuracy (%) per rotation: each model's encoder and its rotation search, beside the baselines'."""
    angles = [r["angle"] for r in m["models"][0]["per_angle"]]
    head = ["rotation", *m.get("baselines", {})]
    stages = [w for w in STAGES if f"{w}_presence_acc" in m["models"][0]["per_angle"][0]]
    for run in m["models"]:
        head += [f"`{Path(run['checkpoint']).stem}`, {STAGES[where]}, {FEATURES[kind]}" for where in stages
                 for kind in FEATURES]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, angle in enumerate(angles):
        cells = [f"{angle:g}°", *(values[i] for values in m.get("baselines", {}).values())]
        for run in m["models"]:
            r = run["per_angle"][i]
            cells += [f"{100 * r[f'{where}_{kind}_acc']:.1f}" for where in stages for kind in FEATURES]
        lines.append("| " + " | ".join(cells) + " |")
    frames = "; ".join(f"`{Path(run['checkpoint']).stem}` " + ", ".join(f"{100 * r['frame_within_step']:.0f}%"
                                                           for r in run["per_angle"]) for run in m["models"])
    lines += ["", f"Linear probes fit on {m['models'][0]['n_probe_train']} upright training digits; {m['n_test']} "
              f"rotated test digits per angle, each at its SCAE offset on the canvas. Search: {m['n_candidates']} "
              f"restarts {m['candidate_step']:g}° apart, the frame with the highest ELBO kept; the kept frame is "
              f"within {m['candidate_step']:g}° of the digit's true rotation for {frames} of the digits (per angle). "
              + (f"Search + test-time VI: {m['ttvi_steps']} steps of free-form test-time VI (lr {m['ttvi_lr']:g}) "
                 f"from the kept frame's restart, raising its ELBO per image on average by "
                 + "; ".join(f"`{Path(run['checkpoint']).stem}` " + ", ".join(
                     f"{r['ttvi_elbo_gain']:.0f}" for r in run["per_angle"]) for run in m["models"])
                 + " nats (per angle). " if "ttvi" in stages else "")
              +
              f"LeNet-5 and CapsNet: trained on upright digits, mean ± std over their seeds "
              f"(`results/{BASELINES}`). {provenance_line(prov)}"]
    return "\n".join(lines)


@one_line_errors("rotated_recognition")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=checkpoint_arg, nargs="+", default=["mnist"],
                   help="trained models, shipped ones by name (default: mnist)")
    p.add_argument("--angles", type=finite_float, nargs="+", default=[0, 35, 45, 90, 135, 180])
    p.add_argument("--candidate-step", type=finite_float, default=15.0, help="degrees between restarts")
    p.add_argument("--n-test", type=positive_int, default=500, help="the first N test digits")
    p.add_argument("--probe-train-limit", type=non_negative_int, default=10000, help="upright training digits "
                                                                                    "the probes are fit on")
    p.add_argument("--batch-size", type=positive_int, default=250)
    p.add_argument("--seed", type=non_negative_int, default=0, help="the guide's samples in the ELBO of a restart")
    p.add_argument("--ttvi-steps", type=non_negative_int, default=0,
                   help="steps of test-time VI on the kept frame's capsules (0: none)")
    p.add_argument("--ttvi-lr", type=finite_positive_float, default=0.01)
    add_run_args(p, EXPERIMENT, name="rotated_recognition", out=False, threads=2)
    args = p.parse_args(argv)
    if setup_run(args, table_writer(readme_table, args.name)):
        return 0
    if not 0 < args.candidate_step <= 180:
        p.error(f"argument --candidate-step: must be in (0, 180], got {args.candidate_step:g}")
    angles = [float(a) for a in args.angles]
    runs = [recognise(name, args, angles) for name in args.checkpoints]
    metrics = {"models": runs, "baselines": _baselines(Path(args.results_dir), angles), "n_test": args.n_test,
               "candidate_step": args.candidate_step, "ttvi_steps": args.ttvi_steps, "ttvi_lr": args.ttvi_lr,
               "n_candidates": len(torch.arange(0.0, 360.0,
                                                                                      args.candidate_step))}
    write_report(args.results_dir, args.name, metrics, table_writer(readme_table, args.name), seed=args.seed,
                 device=args.device, checkpoints=[str(c) for c in args.checkpoints],
                 wall_time_s=sum(r["wall_time_s"] for r in runs))
    return 0


if __name__ == "__main__":
    launch(main)
