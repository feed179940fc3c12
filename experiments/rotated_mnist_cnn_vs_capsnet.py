"""Rotated MNIST: LeNet-5 vs CapsNet vs the probabilistic capsule model's probe.

LeNet-5 and a (reduced) CapsNet train on MNIST digits shifted by up to ±2 px (the numpy reproduction's
``RandomAffine(translate=0.0714)``) and are tested on the test digits rotated by each angle (0° to 180°); with
``--probcaps-checkpoint``, so is the probabilistic capsule model's linear probe.

    probcaps run rotated_mnist_cnn_vs_capsnet --seeds 0 --probcaps-checkpoint mnist_probe
    probcaps run rotated_mnist_cnn_vs_capsnet --seeds 0 --set data.dataset="synthetic" \\
        --set lenet_train.steps=5 --set capsnet_train.steps=5          # smoke test

Writes ``results/rotated_mnist_cnn_vs_capsnet/<name>.json`` (accuracy per angle, model and seed),
``<name>_accuracy.png``, ``<name>_examples.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from probcaps import plotting
from probcaps.checkpoints import load_final, run_finished
from probcaps.config import DigitData, Section, load_sections
from probcaps.data import iterate_batches, load_digits, place_on_canvas, random_offsets, rotate, to_float
from probcaps.data.loaders import seeded_generator
from probcaps.errors import ConfigError
from probcaps.inference.supervised import predict
from probcaps.inference.train import TrainConfig, train_loop
from probcaps.models.capsnet import CapsNet, CapsNetConfig
from probcaps.models.lenet import LeNet5
from probcaps.report import fmt_mean_std, provenance_line, results_table, write_report
from probcaps.runner import (
    add_config_args,
    add_run_args,
    checkpoint_arg,
    config_dicts,
    launch,
    one_line_errors,
    seed_summary,
    setup_run,
    table_writer,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/

NAME = "rotated_mnist_cnn_vs_capsnet"
# the numpy reproduction's numbers: accuracy on the 10,000 test digits, unrotated and rotated by 35 degrees
NUMPY_REFERENCE = {"lenet": {0: 0.9868, 35: 0.7605}, "capsnet": {0: 0.9937, 35: 0.8409}}
MODELS = {"lenet": "LeNet-5", "capsnet": "CapsNet"}


@dataclass
class RotatedData(DigitData):
    dataset: str = "mnist"        # "mnist" or "synthetic" (tests)
    train_shift: int = 2          # training digits shifted by up to ±2 px (0.0714 x 28)
    train_limit: int = 0
    test_limit: int = 0           # rotated test digits (0: all 10,000)
    angles: list = field(default_factory=lambda: [0, 15, 30, 35, 45, 60, 75, 90, 105, 120, 135, 150, 165, 180])


@dataclass
class ProbeEval(Section):
    train_limit: int = 10000      # unrotated training digits the probe is fit on (0: all)
    test_limit: int = 2000        # rotated test digits per angle (0: all)
    batch_size: int = 500
    max_iter: int = 2000


SCHEMA = {"name": str, "data": RotatedData, "lenet_train": TrainConfig, "capsnet": CapsNetConfig,
          "capsnet_train": TrainConfig, "probe": ProbeEval}


def load_config(path, overrides=()) -> dict:
    cfg = load_sections(path, SCHEMA, list(overrides))
    cfg["name"] = cfg["name"] or NAME
    if cfg["capsnet"].image_size != 28:
        raise ConfigError(f"{path}: capsnet.image_size must be 28 (the digits are 28x28), got "
                          f"{cfg['capsnet'].image_size}")
    return cfg


def shift_digits(digits: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Shift ``(N, 28, 28)`` digits by integer ``(dx, dy)`` offsets, keeping 28x28 (ink leaving the frame is cut)."""
    pad, size = int(offsets.abs().max()) if offsets.numel() else 0, digits.shape[-1]
    return place_on_canvas(digits, offsets, canvas=size + 2 * pad)[:, pad:pad + size, pad:pad + size]


def rotated(digits: torch.Tensor, angle: float) -> torch.Tensor:
    """Float ``(N, 28, 28)`` digits rotated by ``angle`` degrees (counter-clockwise on screen), clamped to [0, 1]."""
    return rotate(to_float(digits), float(angle)).clamp_(0.0, 1.0)


def train_model(kind: str, cfg: dict, seed: int, out: Path, images, labels, *, resume: bool, device, progress):
    """Train LeNet-5 (cross-entropy) or CapsNet (margin + reconstruction) on digits shifted afresh every epoch;
    returns the model and its training state.  A finished run (``final.pt``) is loaded when resuming."""
    torch.manual_seed(seed)
    model = (LeNet5() if kind == "lenet" else CapsNet(cfg["capsnet"])).to(device)
    tcfg = dataclasses.replace(cfg[f"{kind}_train"], seed=seed)
    if resume and run_finished(out, tcfg.steps):
        return model, load_final(model, out, device)

    def batches(epoch: int, start: int):
        gen = seeded_generator("shift", tcfg.seed, epoch)
        offsets = random_offsets(len(images), cfg["data"].train_shift, generator=gen)
        yield from iterate_batches(shift_digits(images, offsets), labels, tcfg.batch_size, shuffle=True, seed=tcfg.seed,
                                   epoch=epoch, start_batch=start, drop_last=len(images) >= tcfg.batch_size,
                                   device=device)

    def loss_fn(batch):
        x, y = batch
        return F.cross_entropy(model(x), y) if kind == "lenet" else model.loss(x, y[:, None], x[:, None])[0]

    state = train_loop(model, loss_fn, batches, tcfg, out, resume=resume and (out / "checkpoint.pt").is_file(),
                       progress=progress, metadata={"kind": kind, "configs": config_dicts(cfg)})
    return model, dataclasses.asdict(state)


def probe_curve(checkpoint: Path, test_digits: torch.Tensor, test_labels: torch.Tensor, angles, probe: ProbeEval,
                data_dir, device, progress) -> dict:
    """Linear-probe accuracy of the probabilistic capsule model on the rotated digits, per angle: the probes (object
    presences + poses, and presences alone) are fit on unrotated training digits placed as the model was trained;
    each rotated test digit is placed at its own SCAE offset on the model's canvas."""
    from probcaps.data import placed_mnist
    from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained, probe_features
    from probcaps.metrics import LinearProbe

    pcfg, system = load_trained(checkpoint, device=device)
    data = pcfg["data"]
    train_images, train_labels = load_images(data, "train", data_dir, limit=probe.train_limit or None)
    feats = probe_features(encode_dataset(system.encoder, train_images, probe.batch_size, device))
    probes = {k: LinearProbe(max_iter=probe.max_iter).fit(v, train_labels) for k, v in feats.items()}
    n = probe.test_limit or len(test_digits)
    digits, labels = test_digits[:n], test_labels[:n]
    offsets = placed_mnist("test", data_dir=data_dir, canvas=data.canvas_size, max_shift=data.max_shift,
                           seed=data.seed, limit=n).offsets
    acc = {k: [] for k in probes}
    for angle in angles:
        placed = place_on_canvas(rotated(digits, angle), offsets, canvas=data.canvas_size)
        test_feats = probe_features(encode_dataset(system.encoder, placed, probe.batch_size, device))
        for k, p in probes.items():
            acc[k].append(p.accuracy(test_feats[k], labels))
        if progress:
            print(f"  probe {angle:5.1f}°: presence+pose {acc['presence_pose'][-1]:.4f}")
    return {"probe_presence_pose_acc": acc["presence_pose"], "probe_presence_acc": acc["presence"],
            "probe_train_digits": len(train_images), "probe_test_digits": n, "probe_checkpoint": str(checkpoint)}


def plot_accuracy(angles, curves: dict[str, np.ndarray], path: Path) -> None:
    """Accuracy (%) against rotation angle, one line per model (mean ± std over seeds), the numpy reproduction's
    numbers as separate markers, and the 35° point marked."""
    model_colours = {"LeNet-5": plotting.PART_PALETTE[0], "CapsNet": plotting.PART_PALETTE[1]}
    lines, colours, references = {}, {}, {}
    for label, acc in curves.items():
        acc = 100 * np.asarray(acc)
        name = label + (f" ({len(acc)} seeds)" if len(acc) > 1 else "")
        lines[name] = (angles, acc.mean(0), acc.std(0, ddof=1) if len(acc) > 1 else None)
        if label in model_colours:
            colours[name] = model_colours[label]
    for kind, label in MODELS.items():
        name, reference = f"numpy reproduction, {label}", NUMPY_REFERENCE[kind]
        references[name] = (sorted(reference), [100 * reference[a] for a in sorted(reference)])
        colours[name] = model_colours[label]
    plotting.plot_curve_panels([{
        "curves": lines, "references": references, "colours": colours, "vlines": [35], "ylim": (0, 101),
        "xlabel": "rotation of the test digits (degrees)", "ylabel": "test accuracy (%)",
        "title": "trained on ±2 px shifted MNIST, tested on rotated digits",
    }], path)


@one_line_errors("rotated_mnist_cnn_vs_capsnet")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, NAME, [0])
    p.add_argument("--probcaps-checkpoint", type=checkpoint_arg, default=None,
                   help="also score this probabilistic capsule model (a shipped one by name, e.g. mnist, or a file)")
    add_run_args(p, EXPERIMENT, name=False, out_help="run folders, one per model and seed (default: runs/<name>)",
                 resume="continue (or reuse) each model's run", threads=1)
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    name = cfg["name"]  # names the results, tables and runs, so that another config cannot overwrite them
    if setup_run(args, table_writer(readme_table, name)):
        return 0
    args.out = args.out or str(Path("runs") / name)
    if args.probcaps_checkpoint and not Path(args.probcaps_checkpoint).is_file():
        raise ConfigError(f"--probcaps-checkpoint {args.probcaps_checkpoint}: no such file")
    data = cfg["data"]
    angles = [float(a) for a in data.angles]
    (train_images, train_labels), (test_images, test_labels) = (
        load_digits(data.dataset, split, limit=getattr(data, f"{split}_limit"), data_dir=args.data_dir,
                    synthetic_sizes=(256, 64)) for split in ("train", "test"))
    rotated_tests = {a: rotated(test_images, a) for a in angles}
    runs = []
    for seed in args.seeds:
        run = {"seed": seed}
        for kind in MODELS:
            model, state = train_model(kind, cfg, seed, Path(args.out) / f"{kind}_seed{seed}", train_images,
                                       train_labels, resume=args.resume, device=args.device, progress=not args.quiet)
            model.eval()
            scores = model if kind == "lenet" else (lambda x, m=model: m(x).lengths)
            t0 = time.perf_counter()
            run[f"{kind}_acc"] = [float((predict(scores, rotated_tests[a], 500, args.device)
                                         == test_labels).float().mean()) for a in angles]
            run.update({f"{kind}_train_wall_time_s": state["wall_time_s"], f"{kind}_steps": state["step"],
                        f"{kind}_eval_time_s": time.perf_counter() - t0})
            print(f"seed {seed} {kind}: " + ", ".join(f"{a:.0f}°: {100 * v:.1f}" for a, v in
                                                     zip(angles, run[f"{kind}_acc"])))
        runs.append(run)
    summary = {"angles": angles, "per_seed": runs, "numpy_reference": NUMPY_REFERENCE, "n_test": len(test_labels)}
    curves = {label: np.array([r[f"{kind}_acc"] for r in runs]) for kind, label in MODELS.items()}
    if args.probcaps_checkpoint:
        t0 = time.perf_counter()
        probe = probe_curve(Path(args.probcaps_checkpoint), test_images, test_labels, angles, cfg["probe"],
                            args.data_dir, args.device, not args.quiet)
        summary["probcaps"] = {**probe, "eval_time_s": time.perf_counter() - t0}
        curves["probabilistic capsules, linear probe"] = np.array([probe["probe_presence_pose_acc"]])
    summary.update(seed_summary(runs, ("lenet_acc", "capsnet_acc")))
    results = Path(args.results_dir)
    write_report(results, name, summary, table_writer(readme_table, name), seed=args.seeds,
                 steps={kind: runs[0][f"{kind}_steps"] for kind in MODELS}, device=args.device,
                 threads=torch.get_num_threads(), configs=config_dicts(cfg),
                 wall_time_s=sum(r[f"{kind}_train_wall_time_s"] for r in runs for kind in MODELS))
    plot_accuracy(angles, curves, results / f"{name}_accuracy.png")
    show = [a for a in (0, 35, 90, 180) if a in angles] or angles[:1]
    grid = torch.stack([rotated_tests[a][:8] for a in show])
    plotting.plot_image_grid(grid, results / f"{name}_examples.png", row_labels=[f"{a:.0f}°" for a in show],
                             title="test digits as rotated for all three models")
    return 0


@results_table(NAME)
def readme_table(m: dict, prov: dict) -> str:
    """Accuracy per angle for LeNet-5, CapsNet and the probe, with the numpy reproduction's 0° and 35° numbers
    (``results_dir/<name>.json``)."""
    runs, probe, steps = m["per_seed"], m.get("probcaps"), prov.get("steps", {})
    head = "| rotation | LeNet-5 (%) | CapsNet (%) |" + (" probabilistic capsules, probe (%) |" if probe else "") + \
        " numpy reproduction, LeNet-5 | numpy reproduction, CapsNet |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    ref = m.get("numpy_reference") or m["writeup"]  # "writeup": the earlier name of the key
    for i, a in enumerate(m["angles"]):
        key = str(int(a)) if float(a).is_integer() else str(a)
        wl, wc = ref["lenet"].get(key), ref["capsnet"].get(key)
        label = f"**{a:.0f}°** (reference point)" if a == 35 else f"{a:.0f}°"
        probe_cell = f" {100 * probe['probe_presence_pose_acc'][i]:.1f} |" if probe else ""
        lines.append(f"| {label} | {fmt_mean_std([r['lenet_acc'][i] for r in runs])} | "
                     f"{fmt_mean_std([r['capsnet_acc'][i] for r in runs])} |{probe_cell} "
                     f"{f'{100 * wl:.2f}' if wl else '—'} | {f'{100 * wc:.2f}' if wc else '—'} |")
    walls = ", ".join(f"LeNet-5 {r['lenet_train_wall_time_s'] / 60:.1f} min, CapsNet "
                      f"{r['capsnet_train_wall_time_s'] / 60:.1f} min" for r in runs)
    lines += ["", f"Seeds {', '.join(str(r['seed']) for r in runs)}; {m['n_test']} rotated test digits per angle; "
              f"training steps LeNet-5 {steps.get('lenet')}, CapsNet {steps.get('capsnet')} (training wall time: "
              f"{walls}); {provenance_line(prov)}"]
    if probe:
        lines.append(f"Probe: linear classifier on object presences + poses of `{probe['probe_checkpoint']}`, fit on "
                     f"{probe['probe_train_digits']} unrotated training digits, scored on the first "
                     f"{probe['probe_test_digits']} rotated test digits per angle (each placed at its SCAE offset on "
                     f"the 40×40 canvas).")
    return "\n".join(lines)


if __name__ == "__main__":
    launch(main)
