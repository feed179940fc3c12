"""Novel viewpoints on (synthetic) smallNORB: matrix capsules with EM routing against a CNN, matched on familiar
viewpoints (Hinton, Sabour & Frosst 2018, section 5.1).

    probcaps run norb_viewpoints --seeds 0 1 2                  # the azimuth split (the norb_azimuth recipe)
    probcaps run norb_viewpoints --seeds 0 --resume             # continue interrupted runs
    probcaps run norb_viewpoints --config norb_elevation --seeds 0 1 2
    probcaps run norb_viewpoints --seeds 0 --set data.dataset="smallnorb" --name norb_azimuth_smallnorb

Protocol: both models train on the training instances at the familiar viewpoints only (azimuths {300, .., 40} or
the 3 lowest elevations), are evaluated every ``train.checkpoint_every`` steps on fixed test subsets at familiar and
at novel viewpoints (``eval.jsonl`` in the run folder), and are compared at matched familiar accuracy
(:func:`matched_comparison`).  Writes ``results/norb_viewpoints/<name>.json`` and
``results/norb_viewpoints/<name>_*.png`` (``name`` from the config
unless ``--name``); runs go to ``runs/<name>/seed<S>/<model>`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from probcaps import plotting
from probcaps.checkpoints import load_final, run_finished
from probcaps.config import Section, load_sections
from probcaps.data.loaders import iterate_batches, num_batches, seeded_generator
from probcaps.data.smallnorb import NORB_CLASSES, NorbSet, crop32, load_smallnorb, viewpoint_split
from probcaps.data.synthetic_norb import VARIANTS, synthetic_norb
from probcaps.data.transforms import standardise_per_image
from probcaps.errors import ConfigError
from probcaps.inference.supervised import predict
from probcaps.inference.train import TrainConfig, start_log, train_loop
from probcaps.io import append_jsonl, read_jsonl
from probcaps.models.matrix_capsules import MatrixCapsConfig, MatrixCapsNet, spread_loss, spread_margin
from probcaps.models.norb_cnn import NorbCNN, NorbCNNConfig
from probcaps.report import fmt_mean_std, provenance_line, results_table, tries_table, write_report, write_table
from probcaps.runner import (
    add_config_args,
    add_run_args,
    config_dicts,
    launch,
    one_line_errors,
    seed_summary,
    setup_run,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/

MODELS = ("caps", "cnn")
LABELS = {"caps": "matrix capsules", "cnn": "CNN"}


@dataclass
class NorbDataConfig(Section):
    dataset: str = "synthetic"     # "synthetic" (rendered, cached under the data root) or "smallnorb" (real files)
    split: str = "azimuth"         # "azimuth" or "elevation"
    seed: int = 0                  # the synthetic set's instances
    variant: str = "toys"          # synthetic only: the part tables ("toys" or "asymmetric", see synthetic_norb)
    train_limit: int = 0           # use only N training images (0: all), for smoke runs
    instances_per_split: int = 5   # synthetic only: fewer instances (tests, smoke runs)
    elevations: int = 9            # synthetic only: render only the N lowest elevations (tests, smoke runs)
    lightings: int = 3             # synthetic only: render only the first N lighting conditions (tests, smoke runs)
    standardise_images: bool = False  # each 32x32 crop minus its mean, over its std (the released code's preprocessing)
    train_views: str = "familiar"  # "familiar" (the paper's protocol) or "all": a reference that trains on every view
    familiar_eval: int = 1200      # size of the fixed familiar-viewpoint evaluation subset (0: all)
    novel_eval: int = 2400         # size of the fixed novel-viewpoint evaluation subset (0: all)
    train_eval: int = 1200         # training images the report scores each final model on (0: all): does it fit?
    eval_batch: int = 200

    def validate(self) -> None:
        for key, choices in (("dataset", ("synthetic", "smallnorb")), ("variant", tuple(sorted(VARIANTS))),
                             ("split", ("azimuth", "elevation")), ("train_views", ("familiar", "all"))):
            if getattr(self, key) not in choices:
                raise ValueError(f"data.{key} must be one of {choices}, got {getattr(self, key)!r}")


@dataclass
class SpreadConfig(Section):
    margin_start: float = 0.2
    margin_end: float = 0.9
    ramp_fraction: float = 0.5     # the margin reaches margin_end after this fraction of the training steps


SCHEMA = {"name": str, "data": NorbDataConfig, "caps": MatrixCapsConfig, "cnn": NorbCNNConfig,
          "caps_train": TrainConfig, "cnn_train": TrainConfig, "spread": SpreadConfig}


def load_config(path, overrides=()) -> dict:
    cfg = load_sections(path, SCHEMA, overrides)
    cfg["name"] = cfg["name"] or "norb_viewpoints"
    return cfg


def load_split(data: NorbDataConfig, split: str, data_dir=None) -> NorbSet:
    """The whole ``split`` ("train" or "test") of the configured set."""
    if data.dataset != "synthetic":
        return load_smallnorb(split, data_dir=data_dir)
    return synthetic_norb(split, data_dir=data_dir, seed=data.seed, instances_per_split=data.instances_per_split,
                          elevations=data.elevations, lightings=data.lightings, variant=data.variant)


def load_sets(data: NorbDataConfig, data_dir=None) -> dict[str, NorbSet]:
    """``{"train", "familiar", "novel", "train_eval"}``: training instances at familiar views (at every view with
    ``data.train_views = "all"``), fixed subsets of the test instances at familiar and at novel views, and a fixed
    subset of the training images."""
    train, test = load_split(data, "train", data_dir), load_split(data, "test", data_dir)
    trained_on = viewpoint_split(train, data.split)[0] | (data.train_views == "all")
    familiar_test, novel_test = viewpoint_split(test, data.split)
    train = fixed_subset(train.subset(trained_on), data.train_limit, "norb_train_limit", data.seed)
    return {"train": train,
            "familiar": fixed_subset(test.subset(familiar_test), data.familiar_eval, "norb_eval", "familiar"),
            "novel": fixed_subset(test.subset(novel_test), data.novel_eval, "norb_eval", "novel"),
            "train_eval": fixed_subset(train, data.train_eval, "norb_eval", "train")}


def fixed_subset(part: NorbSet, n: int, *key) -> NorbSet:
    """``n`` images of ``part`` drawn by a generator seeded by ``key`` (the same ones on every call); all of it when
    ``n`` is 0 or not below its size."""
    if not n or n >= len(part):
        return part
    return part.subset(torch.randperm(len(part), generator=seeded_generator(*key))[:n])


def network_input(x: torch.Tensor, train: bool, standardise: bool, generator=None) -> torch.Tensor:
    """``(B, 1, 48, 48)`` images -> the networks' ``(B, 1, 32, 32)`` input: the paper's crop (random when ``train``,
    else the centre), then, with ``data.standardise_images``, per-image standardisation."""
    x = crop32(x, train=train, generator=generator)
    return standardise_per_image(x) if standardise else x


def correct_on(model: torch.nn.Module, part: NorbSet, data: NorbDataConfig, device) -> torch.Tensor:
    """``(N,)`` bool: which images of ``part`` the model classifies right (centre crops, as in evaluation)."""
    return predict(model, part.images, data.eval_batch, device,
                   transform=lambda x: network_input(x, False, data.standardise_images)) == part.labels


def accuracy_by(correct: torch.Tensor, key: torch.Tensor) -> dict[str, float]:
    """Mean of ``correct`` per value of ``key`` (e.g. azimuth): ``{"60": 0.91, ...}``."""
    return {str(int(k)): float(correct[key == k].float().mean()) for k in torch.unique(key)}


def build_model(kind: str, cfg: dict) -> torch.nn.Module:
    return MatrixCapsNet(cfg["caps"]) if kind == "caps" else NorbCNN(cfg["cnn"])


def train_one(kind: str, cfg: dict, sets: dict, out: Path, seed: int, device, resume: bool, progress: bool) -> None:
    """Train one model on one seed, evaluating at every checkpoint (``out/eval.jsonl``)."""
    torch.manual_seed(seed)
    model = build_model(kind, cfg).to(device)
    tcfg = dataclasses.replace(cfg[f"{kind}_train"], seed=seed)
    eval_log = out / "eval.jsonl"
    resume = start_log(eval_log, resume)  # the evaluations up to the checkpoint resumed from
    data_cfg = cfg["data"]

    def evaluate(state) -> None:
        record = {"step": state.step, "epoch": state.epoch, "wall_time_s": state.wall_time_s}
        for name in ("familiar", "novel"):
            correct = correct_on(model, sets[name], data_cfg, device)
            record[f"{name}_acc"] = float(correct.float().mean())
            record.update({f"{name}_by_{key}": accuracy_by(correct, getattr(sets[name], key))
                           for key in ("azimuth", "elevation")})
        append_jsonl(eval_log, record)

    train, spread = sets["train"], cfg["spread"]
    per_epoch = num_batches(len(train), tcfg.batch_size, drop_last=True)
    ramp = max(1, int(spread.ramp_fraction * tcfg.steps))

    def batches(epoch: int, start_batch: int):
        """(x (B, 1, 32, 32), y (B,), global step): random 32x32 crops of the 48x48 images, each drawn from a
        generator seeded by (seed, epoch, batch) (exact resume)."""
        it = iterate_batches(train.images, train.labels, tcfg.batch_size, shuffle=True, seed=seed, epoch=epoch,
                             start_batch=start_batch, drop_last=True, device=device)
        for b, (x, y) in enumerate(it, start=start_batch):
            crop = seeded_generator("norb_crop", seed, epoch, b)
            yield network_input(x, True, data_cfg.standardise_images, crop), y, epoch * per_epoch + b

    def loss_fn(batch):
        x, y, step = batch
        if kind == "caps":
            return spread_loss(model(x), y, spread_margin(step, ramp, spread.margin_start, spread.margin_end))
        return F.cross_entropy(model(x), y)

    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        evaluate(type("S", (), {"step": 0, "epoch": 0, "wall_time_s": 0.0})())
    meta = {"kind": kind, "model_config": cfg[kind].to_dict(), "data": data_cfg.to_dict()}
    train_loop(model, loss_fn, batches, tcfg, out, resume=resume, metadata=meta, progress=progress,
               on_checkpoint=evaluate)


def novel_at_target(log: list[dict], target: float) -> float:
    """Novel-view accuracy at exactly the ``target`` familiar accuracy: linear between the last evaluation below the
    target and the first reaching it (a model scored coarsely would otherwise be read past the target)."""
    i = next(i for i, r in enumerate(log) if r["familiar_acc"] >= target)
    if i == 0 or log[i]["familiar_acc"] == target:
        return log[i]["novel_acc"]
    lo, hi = log[i - 1], log[i]
    w = (target - lo["familiar_acc"]) / (hi["familiar_acc"] - lo["familiar_acc"])
    return lo["novel_acc"] + w * (hi["novel_acc"] - lo["novel_acc"])


def matched_comparison(logs: dict[str, list[dict]]) -> dict:
    """Per seed: target = the lower of the two models' best familiar accuracies; each model is read at its first
    evaluation reaching the target.  Returns the two records and the novel-error reduction, and the same reduction
    with each model's novel accuracy interpolated to exactly the target (:func:`novel_at_target`)."""
    target = min(max(r["familiar_acc"] for r in logs[k]) for k in MODELS)
    at = {k: next(r for r in logs[k] if r["familiar_acc"] >= target) for k in MODELS}
    interpolated = {k: novel_at_target(logs[k], target) for k in MODELS}

    def error_reduction(novel: dict) -> float:  # 1 - (capsules' novel error) / (CNN's)
        return 1.0 - (1.0 - novel["caps"]) / (1.0 - novel["cnn"]) if novel["cnn"] < 1.0 else 0.0

    return {
        "target_familiar_acc": target,
        **{f"{k}_{m}": at[k][m] for k in MODELS for m in ("step", "familiar_acc", "novel_acc")},
        **{f"{k}_{view}_by_{key}": at[k][f"{view}_by_{key}"] for key in ("azimuth", "elevation")
           for view in ("novel", "familiar") for k in MODELS},
        "novel_error_reduction": error_reduction({k: at[k]["novel_acc"] for k in MODELS}),
        **{f"{k}_novel_acc_interpolated": interpolated[k] for k in MODELS},
        "novel_error_reduction_interpolated": error_reduction(interpolated),
        **{f"{k}_final_{view}_acc": logs[k][-1][f"{view}_acc"] for view in ("familiar", "novel") for k in MODELS},
    }


def final_reading(logs: dict[str, list[dict]]) -> dict:
    """Each model's last evaluation: the all-views reference (``data.train_views = "all"``) has no matched
    comparison, since both models have seen the novel views of the training instances."""
    return {**{f"{k}_final_{view}_acc": logs[k][-1][f"{view}_acc"] for k in MODELS for view in ("familiar", "novel")},
            **{f"{k}_{view}_by_{key}": logs[k][-1][f"{view}_by_{key}"] for k in MODELS
               for view in ("familiar", "novel") for key in ("azimuth", "elevation")}}


def trained_model(kind: str, cfg: dict, out: Path, device) -> tuple[torch.nn.Module, dict]:
    """The final model of ``kind`` in the run folder ``out``, and its training state."""
    model = build_model(kind, cfg).to(device)
    return model, load_final(model, out, device)


def plot_by_viewpoint(runs: list[dict], key: str, path: Path, xlabel: str, ylabel: str) -> None:
    """Accuracy per azimuth (or elevation) at the matched checkpoints (or the runs' ends), mean ± std over seeds,
    both models."""
    curves = {}
    for kind, label in LABELS.items():
        merged = [{**r[f"{kind}_familiar_by_{key}"], **r[f"{kind}_novel_by_{key}"]} for r in runs]
        xs = sorted(int(k) for k in merged[0])
        vals = np.array([[m[str(x)] for x in xs] for m in merged])
        curves[label] = (xs, vals.mean(0).tolist(), vals.std(0).tolist())
    plotting.plot_curves(curves, path, xlabel=xlabel, ylabel=ylabel,
                         title=f"accuracy by {key}: familiar and novel viewpoints")


def plot_examples(full: NorbSet, path: Path) -> None:
    """One test instance per class (rows) at every other azimuth (columns), lowest elevation, first lighting."""
    sel = (full.elevation == full.elevation.min()) & (full.lighting == full.lighting.min()) & (full.azimuth % 40 == 0)
    sel &= full.instance == full.instance[sel].min()
    part = full.subset(sel)
    order = torch.argsort(part.labels * 1000 + part.azimuth)
    imgs = part.images[order].view(5, -1, *part.images.shape[1:]).float() / 255
    azs = part.azimuth[order][: imgs.shape[1]].tolist()
    plotting.plot_image_grid(imgs, path, row_labels=list(NORB_CLASSES),
                             col_labels=[f"{a}°" + ("*" if a in (300, 320, 340, 0, 20, 40) else "") for a in azs],
                             title="test instances by azimuth (* = familiar azimuths)")


@torch.no_grad()
def plot_class_poses(model: MatrixCapsNet, sets: dict, path: Path, device, standardise: bool = False) -> None:
    """For one novel-view test image per class (rows): the 5 class capsules' 4x4 pose matrices (columns)."""
    data = sets["novel"]
    idx = torch.stack([torch.nonzero(data.labels == c)[0, 0] for c in range(5)])
    x = network_input(data.images[idx][:, None].float().div(255).to(device), False, standardise)
    model.eval()
    poses, log_a = model.capsules(x)
    a = log_a.exp().cpu()
    rows = [f"{NORB_CLASSES[c]}\n(a = {a[c, c]:.2f},\nmax {NORB_CLASSES[int(a[c].argmax())]})" for c in range(5)]
    plotting.plot_image_grid(poses.cpu(), path, row_labels=rows,
                             col_labels=[f"{NORB_CLASSES[j]} capsule" for j in range(5)],
                             title="class-capsule 4x4 poses, one novel-view image per class")


def shared_steps(logs: list[list[dict]], kind: str) -> list[int]:
    """The evaluation steps every seed's log has (a run cut inside an evaluation by an older version of the training
    loop lacks that one); fewer than two shared steps is an error, not a one-point curve."""
    per_seed = [[r["step"] for r in log] for log in logs]
    steps = sorted(set.intersection(*map(set, per_seed)))
    if len(steps) < 2:
        raise ConfigError(f"{kind}: the seeds share fewer than two evaluation steps; cannot average them")
    dropped = sorted(set().union(*map(set, per_seed)) - set(steps))
    if dropped:
        print(f"{kind}: evaluations at step(s) {', '.join(map(str, dropped))} are missing from some seeds; the "
              f"training figure averages the {len(steps)} steps all seeds share", file=sys.stderr)
    return steps


def plot_training(logs_by_seed: dict, path: Path) -> None:
    """Familiar (left) and novel (right) accuracy during training, mean ± std over the seeds, both models (a line
    per seed and model would be 4 x seeds lines in one legend)."""
    steps = {kind: shared_steps([logs[kind] for logs in logs_by_seed.values()], kind) for kind in MODELS}
    panels = []
    for view in ("familiar", "novel"):
        curves = {}
        for kind, label in LABELS.items():
            acc = np.array([[r[f"{view}_acc"] for r in logs[kind] if r["step"] in steps[kind]]
                            for logs in logs_by_seed.values()])
            curves[label] = (steps[kind], acc.mean(0), acc.std(0))
        panels.append({"curves": curves, "xlabel": "training step", "ylabel": "test accuracy", "ylim": (0.0, 1.0),
                       "title": f"{view} viewpoints, mean ± std over {len(logs_by_seed)} seed(s)"})
    plotting.plot_curve_panels(panels, path)


@one_line_errors("norb_viewpoints")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, "norb_azimuth", [0, 1, 2])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--train-only", action="store_true", help="train and stop (a later --resume call reports)")
    p.add_argument("--no-figures", action="store_true", help="write the results JSON only")
    add_run_args(p, EXPERIMENT, out_help="run folders (<out>/seed<S>/<model>; default: runs/<name>)", resume=True,
                 threads=1,
                 tables="tables (RESULTS_DIR/<name>.md, and RESULTS_DIR/ablations.md when there are tries)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    name = args.name or cfg["name"]
    args.out = args.out or str(Path("runs") / name)
    if setup_run(args, tables := lambda results: write_tables(results, name)):
        return 0
    t0 = time.perf_counter()
    sets = load_sets(cfg["data"], args.data_dir)
    for seed in args.seeds:
        for kind in args.models:
            out = Path(args.out) / f"seed{seed}" / kind
            if not (args.resume and run_finished(out, cfg[f"{kind}_train"].steps)):
                train_one(kind, cfg, sets, out, seed, args.device, args.resume, not args.quiet)
    if args.train_only:
        return 0
    runs, logs_by_seed = [], {}
    all_views = cfg["data"].train_views == "all"
    for seed in args.seeds:
        folders = {k: Path(args.out) / f"seed{seed}" / k for k in MODELS}
        logs = logs_by_seed[seed] = {k: read_jsonl(out / "eval.jsonl") for k, out in folders.items()}
        if not all(logs.values()):
            raise ConfigError(f"{args.out}/seed{seed}: evaluation logs missing (train both models first)")
        runs.append(r := {"seed": seed, **(final_reading(logs) if all_views else matched_comparison(logs))})
        finals = {k: trained_model(k, cfg, out, args.device) for k, out in folders.items()}
        # accuracy on the fixed subset of its own training images (centre crops): tells a model that underfits from
        # one that fits the familiar views but does not carry them to new instances
        r.update({f"{k}_final_train_acc": float(correct_on(model, sets["train_eval"], cfg["data"], args.device)
                                                .float().mean()) for k, (model, _) in finals.items()})
        r.update({f"{k}_train_wall_time_s": state["wall_time_s"] for k, (_, state) in finals.items()})
        r.update({f"{k}_steps": state["step"] for k, (_, state) in finals.items()})
        print(f"seed {seed} (trained on all views): novel caps {r['caps_final_novel_acc']:.3f}, CNN "
              f"{r['cnn_final_novel_acc']:.3f}" if all_views else
              f"seed {seed}: target familiar {r['target_familiar_acc']:.3f}; novel caps {r['caps_novel_acc']:.3f} "
              f"(step {r['caps_step']}), CNN {r['cnn_novel_acc']:.3f} (step {r['cnn_step']}); novel error "
              f"reduction {100 * r['novel_error_reduction']:.1f}%")
    summary = {"per_seed": runs, "split": cfg["data"].split, "dataset": cfg["data"].dataset,
               "train_views": cfg["data"].train_views, "n_train": len(sets["train"]),
               "n_familiar_eval": len(sets["familiar"]), "n_novel_eval": len(sets["novel"]),
               "n_train_eval": len(sets["train_eval"]),
               **{f"{k}_parameters": sum(p.numel() for p in build_model(k, cfg).parameters()) for k in MODELS}}
    summary.update(seed_summary(runs, [key for key in (  # the all-views reference has no matched comparison
        "target_familiar_acc", "caps_novel_acc", "cnn_novel_acc", "caps_familiar_acc", "cnn_familiar_acc",
        "novel_error_reduction", "caps_final_novel_acc", "cnn_final_novel_acc", "caps_novel_acc_interpolated",
        "cnn_novel_acc_interpolated", "novel_error_reduction_interpolated", "caps_final_train_acc",
        "cnn_final_train_acc") if key in runs[0]]))
    results = Path(args.results_dir)
    write_report(results, name, summary, tables, seed=args.seeds, steps={k: runs[0][f"{k}_steps"] for k in MODELS},
                 device=args.device, wall_time_s=sum(r[f"{k}_train_wall_time_s"] for r in runs for k in MODELS),
                 threads=args.threads, configs=config_dicts(cfg), report_wall_time_s=time.perf_counter() - t0)
    if args.no_figures:
        return 0
    key = cfg["data"].split
    plot_by_viewpoint(runs, key, results / f"{name}_by_{key}.png", f"{key} (degrees)",
                      "test accuracy (end of training on all views)" if all_views
                      else "test accuracy (matched familiar accuracy)")
    plot_training(logs_by_seed, results / f"{name}_training.png")
    plot_examples(load_split(cfg["data"], "test", args.data_dir), results / f"{name}_examples.png")
    caps = trained_model("caps", cfg, Path(args.out) / f"seed{args.seeds[0]}" / "caps", args.device)[0]
    plot_class_poses(caps, sets, results / f"{name}_class_poses.png", args.device, cfg["data"].standardise_images)
    return 0


def dataset_label(data_config: dict) -> str:
    """``"synthetic, asymmetric toys"``: the dataset, and for the synthetic set its variant (older results files
    have none: the "toys")."""
    if data_config.get("dataset", "synthetic") != "synthetic":
        return data_config["dataset"]
    return f"synthetic, {data_config.get('variant', 'toys')}"


def error_reduction_line(runs: list[dict]) -> str:
    """The matched comparison's error reduction seed by seed, with the standard error of its mean and a 95%
    t-interval: the spread between seeds is as large as the effect, so the table's mean alone can mislead."""
    from scipy.stats import t

    parts = []
    for key, label in (("novel_error_reduction", ""), ("novel_error_reduction_interpolated", "interpolated ")):
        if key not in runs[0]:  # results written before the interpolated reading
            continue
        v = 100.0 * np.array([r[key] for r in runs])
        summary = ""
        if len(v) > 1:
            sem = v.std(ddof=1) / np.sqrt(len(v))
            half = t.ppf(0.975, len(v) - 1) * sem
            summary = (f" (mean {v.mean():.1f} ± {sem:.1f} standard error; 95% t-interval {v.mean() - half:.1f} to "
                       f"{v.mean() + half:.1f})")
        parts.append(f"{label}{', '.join(f'{x:.1f}' for x in v)}{summary}")
    return f"Novel-view error reduction per seed (%): {'; '.join(parts)}."


def run_line(m: dict, prov: dict) -> str:
    """The sentence under a table that says what was trained, how long, where and by which command."""
    runs = m["per_seed"]
    walls = ", ".join(f"{r['caps_train_wall_time_s'] / 60:.0f}/{r['cnn_train_wall_time_s'] / 60:.0f}" for r in runs)
    return (f"Training images {m['n_train']}, evaluation subsets {m['n_familiar_eval']} familiar / "
            f"{m['n_novel_eval']} novel. Seeds {', '.join(str(r['seed']) for r in runs)}; steps capsules/CNN "
            f"{runs[0]['caps_steps']}/{runs[0]['cnn_steps']}; training wall time per seed capsules/CNN (min): "
            f"{walls}; {prov.get('threads', '?')} thread(s) on a shared machine; {provenance_line(prov)}")


@results_table("norb_viewpoints")
def readme_table(m: dict, prov: dict, benchmark: Path | None = None) -> str:
    """The README table of ``results_dir/<name>.json`` (and of the speed benchmark's JSON ``benchmark`` when it is
    there); for the all-views reference, each model's accuracy at the end of training on the same test subsets."""
    runs = m["per_seed"]
    col = lambda key: fmt_mean_std([r[key] for r in runs], scale=100.0)
    label = dataset_label(prov.get("configs", {}).get("data", {"dataset": m["dataset"]}))
    pair = lambda key: f"{col(f'caps_{key}')} | {col(f'cnn_{key}')}"
    if m.get("train_views") == "all":
        familiar, novel = (("azimuths 300–40", "azimuths 60–280") if m["split"] == "azimuth"
                           else ("the 3 lowest elevations", "the 6 highest elevations"))
        rows = [(f"accuracy at the paper's familiar views ({familiar})", "familiar"),
                (f"accuracy at the paper's novel views ({novel})", "novel"),
                (f"training-image accuracy ({m['n_train_eval']} training images, centre crops)", "train")]
        return "\n".join([f"| trained on all views ({label}), mean ± std over {len(runs)} seeds, end of training (%) "
                          f"| matrix capsules | CNN |", "| --- | --- | --- |",
                          *[f"| {text} | {pair(f'final_{key}_acc')} |" for text, key in rows], "", run_line(m, prov)])
    rows = [("familiar-view accuracy at the matched checkpoint (%)", pair("familiar_acc"), "matched | —"),
            ("novel-view accuracy at the matched checkpoint (%)", pair("novel_acc"),
             "about 30% less error for capsules | 72.6 vs 69.6"),
            ("novel-view error reduction, capsules vs CNN (%)", f"{col('novel_error_reduction')} | —",
             "about 30 | about 10")]
    if "novel_error_reduction_interpolated" in runs[0]:  # results written before the interpolated reading: none
        rows += [("novel-view accuracy interpolated to exactly the matched familiar accuracy (%)",
                  pair("novel_acc_interpolated"), "— | —"),
                 ("novel-view error reduction, interpolated (%)", f"{col('novel_error_reduction_interpolated')} | —",
                  "— | —")]
    rows += [("familiar-view accuracy at the end of training (%)", pair("final_familiar_acc"), "— | —"),
             ("novel-view accuracy at the end of training (%)", pair("final_novel_acc"), "— | —")]
    if "caps_final_train_acc" in runs[0]:  # results written before it: none
        rows.append((f"training-image accuracy at the end of training (%; {m['n_train_eval']} training images, "
                     "centre crops)", pair("final_train_acc"), "— | —"))
    rows.append(("parameters", f"{m['caps_parameters']:,} | {m['cnn_parameters']:,}", "310K / 4.2M | —"))
    lines = [f"| {m['split']} split ({label}), mean ± std over {len(runs)} seeds | matrix capsules | CNN | "
             f"paper (smallNORB) | numpy reproduction (synthetic) |", "| --- | --- | --- | --- | --- |",
             *[f"| {text} | {ours} | {others} |" for text, ours, others in rows]]
    targets = ", ".join(f"{100 * r['target_familiar_acc']:.1f}" for r in runs)
    lines += ["", error_reduction_line(runs), "", f"Matched familiar accuracy (per seed, the lower of the two "
              f"models' best): {targets}%. " + run_line(m, prov)]
    if benchmark and benchmark.is_file():  # the speed of the paper's network, from benchmarks/bench_matrix_capsules.py
        net = (b := json.loads(benchmark.read_text()))["network"]
        lines += ["", "| speed (`benchmarks/bench_matrix_capsules.py`) | training images/s | inference images/s | "
                      "training images/s from CPU time | peak memory (MB) |", "| --- | --- | --- | --- | --- |",
                  f"| A, B, C, D = {net['A']}, {net['B']}, {net['C']}, {net['D']}; {net['input_size']}x"
                  f"{net['input_size']}; {net['iterations']} EM iterations; batch {b['batch']}; {b['threads']} threads "
                  f"| {b['train_images_per_s']:.0f} | {b['inference_images_per_s']:.0f} | "
                  f"{b['train_images_per_s_uncontended_estimate']:.0f} | {b['peak_memory_mb']:.0f} |",
                  "", f"Device: {b['device_description']}; load average {b['load_average'][0]:.1f} while it ran (the "
                      f"machine is shared: the wall-clock rates are pessimistic; the CPU-time rate is batch x threads "
                      f"/ CPU seconds of the step); command: `{b['command']}`."]
    return "\n".join(lines)


#: the tries that changed the shipped recipe: one record each, ``results_dir/ablations/<try>.json``
#: (:func:`probcaps.report.load_try`), laid out as ``results_dir/ablations.md``
ABLATIONS = "ablations"
#: ``(metrics key, column head, scale, digits)`` of the table of tries
ABLATION_COLUMNS = [("target_familiar_acc", "matched familiar acc. (%)", 100.0, 1),
                    ("caps_novel_acc", "novel acc.: capsules (%)", 100.0, 1),
                    ("cnn_novel_acc", "novel acc.: CNN (%)", 100.0, 1),
                    ("novel_error_reduction", "novel error reduction (%)", 100.0, 1),
                    ("novel_error_reduction_interpolated", "the same, interpolated (%)", 100.0, 1)]


def ablations_table(results_dir: Path) -> str | None:
    """The tries of ``results_dir/ablations/*.json``, one row each against `norb_azimuth.toml` (None: none)."""
    return tries_table(results_dir, ABLATION_COLUMNS, "`norb_azimuth.toml`", ABLATIONS)


def write_tables(results_dir: Path, name: str) -> list[Path | None]:
    """Write ``results_dir/<name>.md`` (with the matrix-capsule speed table, ``bench_matrix_capsules.json`` beside
    it, where there is one) and the table of tries, ``results_dir/ablations.md``, when ``results_dir/ablations/``
    holds tries; returns the files written (None: not written)."""
    results_dir = Path(results_dir)
    bench = results_dir / "bench_matrix_capsules.json" if name == "norb_viewpoints" else None
    return [write_table(results_dir, name, readme_table(results_dir, name, benchmark=bench)),
            write_table(results_dir, ABLATIONS, ablations_table(results_dir))]


if __name__ == "__main__":
    launch(main)
