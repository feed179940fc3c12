"""Transforming auto-encoders (Hinton, Krizhevsky & Wang 2011) on MNIST pairs: translation and full affine.

    probcaps run transforming_autoencoder                          # both recipes, seeds 0 1 2
    probcaps run transforming_autoencoder --seeds 0 \\
        --config transforming_autoencoder_translation  # one recipe, one seed
    probcaps run transforming_autoencoder --resume                 # continue / re-evaluate finished runs
    probcaps run transforming_autoencoder --set train.steps=5 --set data.dataset=synthetic   # smoke test

A pair is one MNIST digit warped onto the canvas by a random jitter ``A`` (the input) and by ``T ∘ A`` (the
target), ``T`` a known transformation from the config's ``[range]``: the network sees the input and ``T`` and must
output the target.  On held-out pairs (MNIST *test* digits) ``T`` is read back from the capsules of the two images
alone (:func:`models.transforming_autoencoder.estimate_transform`) and scored by R² per component.  Each config is
one recipe (mode: ``model.mode``).  Writes ``results/transforming_autoencoder/<name>.json`` (``name`` from the
config unless ``--name``) and the first seed's figures ``results/transforming_autoencoder/<name>_*.png`` (scatter,
reconstructions, presence, templates, training, r2_curve);
runs go to ``runs/<name>/seed<S>`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probcaps import plotting
from probcaps.checkpoints import load_final, run_finished
from probcaps.config import DigitData, load_sections
from probcaps.data import iterate_batches, seeded_generator
from probcaps.data import load_digits as data_digits
from probcaps.errors import ConfigError
from probcaps.geometry import affine_matrix, compose, degrees, invert, pixels_to_normalised
from probcaps.inference.train import TrainConfig, start_log, train_loop
from probcaps.io import append_jsonl, write_json
from probcaps.metrics import r2_scores
from probcaps.models.transforming_autoencoder import (
    MODES,
    TransformingAutoencoder,
    TransformingAutoencoderConfig,
    estimate_transform,
    pose_consistency,
    transform_components,
)
from probcaps.registry import resolve_config
from probcaps.render import warp
from probcaps.report import fmt_mean_std, load_result, provenance_line, tries_table, write_report, write_table
from probcaps.runner import add_config_args, add_run_args, launch, one_line_errors, seed_summary, setup_run

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/

NAME = "transforming_autoencoder"  # the experiment, and the tag of its random streams
RECIPES = [resolve_config(f"{NAME}_{mode}") for mode in MODES]  # the packaged recipes, one per mode
DIGIT_WINDOW = 22  # the numpy reproduction scores its MSE on a 22x22 crop: the same window, centred on the target digit

# anchors from a numpy reproduction (translation only, 28x28 canvas)
NUMPY_REFERENCE = {"r2_dx": 0.78, "r2_dy": 0.67, "recon_mse": 0.063, "active_median": 9, "wall_s": 100}


@dataclass
class PairDataConfig(DigitData):
    dataset: str = "mnist"        # "mnist" (real digits) or "synthetic" (stroke digits, for tests)
    train_limit: int = 0          # use only the first N training digits (0: all 60,000)
    test_limit: int = 0           # held-out pairs come from the first N test digits (0: all 10,000)
    seed: int = 0                 # seeds the held-out pairs' jitters and transformations
    swap_pairs: bool = True       # train on each pair in a random direction (x1 -> x2 by T, or x2 -> x1 by T⁻¹)


@dataclass
class TransformRange:
    """The input jitter ``A`` and the known transformation ``T``: every number is drawn uniformly from ``[-v, v]``
    (scales from ``[1 - v, 1 + v]``), independently per pair."""

    jitter_translation_px: float = 5.0
    jitter_rotation_deg: float = 0.0
    jitter_scale: float = 0.0
    jitter_shear: float = 0.0
    translation_px: float = 5.0
    rotation_deg: float = 0.0
    scale: float = 0.0
    shear: float = 0.0


@dataclass
class TAEEvalConfig:
    pairs: int = 5000             # held-out pairs (MNIST test digits)
    readout_pairs: int = 5000     # training pairs for the optional linear readout
    batch_size: int = 500
    presence_threshold: float = 0.1  # "active" capsule (the numpy reproduction's threshold)
    curve_pairs: int = 500        # held-out pairs scored at every checkpoint (the R² training curve)
    figures: bool = True
    test_time_warps: int = 0      # > 0: recognition averaged over this many known warps (recognise_averaged)


@dataclass
class TAELossConfig:
    """The training loss: MSE of the reconstructed target, plus ``consistency_weight`` times
    :func:`models.transforming_autoencoder.pose_consistency` of the two images' poses, capsules weighted by
    ``p1 · p2`` held fixed (0: the paper's loss)."""

    consistency_weight: float = 0.0
    consistency_cap: float = 0.0  # > 0: each capsule's mismatch c counts as cap·c/(cap + c) (see pose_consistency)


SCHEMA = {"name": str, "data": PairDataConfig, "model": TransformingAutoencoderConfig, "loss": TAELossConfig,
          "train": TrainConfig, "eval": TAEEvalConfig, "range": TransformRange}


def config_record(cfg: dict) -> dict:
    """``{section: its fields}`` of the config sections, as checkpoints and results record them."""
    return {k: dataclasses.asdict(cfg[k]) for k in SCHEMA if k != "name"}


def load_config(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """The config of one recipe, then the ``--set`` items: ``{"name", "mode" (``model.mode``), "data", "model",
    "loss", "train", "eval", "range"}``."""
    cfg = load_sections(path, SCHEMA, overrides)  # types, ranges and each section's validate() (data.dataset)
    label, mode = path or "<defaults>", cfg["model"].mode
    if mode == "translation" and any(getattr(cfg["range"], f"{jitter}{k}") for jitter in ("jitter_", "")
                                     for k in ("rotation_deg", "scale", "shear")):
        raise ConfigError(f"{label}: model.mode = 'translation' takes translations only ([range] rotation, scale "
                          f"and shear must be 0)")
    return {**cfg, "name": cfg["name"] or (Path(path).stem if path else f"{NAME}_{mode}"), "mode": mode}


def load_digits(data: PairDataConfig, split: str, data_dir=None) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 digits ``(N, 28, 28)`` and labels ``(N,)`` of a split (real MNIST, or synthetic strokes)."""
    return data_digits(data.dataset, split, limit=data.train_limit if split == "train" else data.test_limit,
                       data_dir=data_dir, synthetic_sizes=(2048, 512), synthetic_seed=1)


def sample_transforms(n: int, rng: TransformRange, canvas: int, generator: torch.Generator, jitter: bool
                      ) -> torch.Tensor:
    """``(n, 3, 3)`` random affine maps ``T(tx, ty) R(θ) Sh(shear) S(sx, sy)`` from the jitter or transform range.

    Six uniforms per map are always drawn (in a fixed order), so the stream does not depend on which are used.
    """
    prefix = "jitter_" if jitter else ""
    u = torch.rand(n, 6, generator=generator, dtype=torch.float64) * 2 - 1
    scale, rot, shear, trans = (getattr(rng, prefix + k) for k in ("scale", "rotation_deg", "shear", "translation_px"))
    T = affine_matrix(1 + scale * u[:, 0], 1 + scale * u[:, 1], degrees(rot * u[:, 2]), shear * u[:, 3],
                      pixels_to_normalised(trans * u[:, 4], canvas), pixels_to_normalised(trans * u[:, 5], canvas))
    return T.float()


def make_pairs(digits: torch.Tensor, rng: TransformRange, canvas: int, generator: torch.Generator,
               swap: bool = False) -> dict:
    """Pairs of each digit of ``digits`` (float ``(B, 1, 28, 28)`` in ``[0, 1]``) under the jitter ``A`` and under
    ``T ∘ A`` (:func:`probcaps.render.warp`): ``{"input" (B, 1, C, C), "transform" (B, 3, 3), "target" (B, 1, C, C),
    "placement"}``, the last the target digit's pose ``(B, 3, 3)``.  ``swap``: each pair becomes ``(x2, T⁻¹, x1)``
    instead of ``(x1, T, x2)`` with probability 1/2."""
    B, device = digits.shape[0], digits.device
    A = sample_transforms(B, rng, canvas, generator, jitter=True).to(device)
    T = sample_transforms(B, rng, canvas, generator, jitter=False).to(device)
    placement = compose(T, A)
    x1, x2 = warp(digits, A, canvas), warp(digits, placement, canvas)
    if swap:
        flip = (torch.rand(B, generator=generator) < 0.5).to(device).view(B, 1, 1, 1)
        x1, x2 = torch.where(flip, x2, x1), torch.where(flip, x1, x2)
        T, placement = torch.where(flip[..., 0], invert(T), T), torch.where(flip[..., 0], A, placement)
    return {"input": x1, "transform": T, "target": x2, "placement": placement}


def heldout_pairs(digits: torch.Tensor, n: int, rng: TransformRange, canvas: int, seed, tag: str, device="cpu"
                  ) -> dict:
    """``n`` pairs from the first digits of ``digits`` (uint8 ``(N, 28, 28)``, cycled if ``n > N``), deterministic
    in ``(seed, tag)``; ``"index"`` holds each pair's digit index."""
    idx = torch.arange(n) % digits.shape[0]
    x = digits[idx].to(device=device, dtype=torch.float32).div_(255.0).unsqueeze(1)
    return {**make_pairs(x, rng, canvas, seeded_generator(NAME, tag, seed), swap=False), "index": idx}


def window_mask(placement: torch.Tensor, canvas: int, size: int = DIGIT_WINDOW) -> torch.Tensor:
    """``(B, 1, C, C)`` boolean: the ``size x size`` pixel box centred on each target digit's centre."""
    centre_px = (placement[:, :2, 2] + 1) * canvas / 2 - 0.5          # normalised -> pixel index (x, y)
    pix = torch.arange(canvas, device=placement.device, dtype=placement.dtype)
    near = (pix - centre_px[..., None]).abs() < size / 2                          # (B, 2, C): x, then y
    return (near[:, 1, :, None] & near[:, 0, None, :]).unsqueeze(1)


def build_model(cfg: dict, device="cpu", digits: torch.Tensor | None = None) -> TransformingAutoencoder:
    """The model of ``cfg``, initialised by the training seed; with ``template_init = "data"`` the templates start
    from ``M`` training digits drawn by that seed (``digits``: uint8 ``(N, 28, 28)``, no labels used)."""
    model_cfg = dataclasses.replace(cfg["model"], seed=cfg["train"].seed)  # each seed its own initialisation
    model = TransformingAutoencoder(model_cfg)
    if model_cfg.template_init == "data" and digits is not None:
        g = seeded_generator(NAME, "template_init", cfg["train"].seed)
        pick = torch.randperm(digits.shape[0], generator=g)[:model_cfg.num_capsules]
        if pick.numel() < model_cfg.num_capsules:
            raise ConfigError(f"model.template_init = 'data' needs {model_cfg.num_capsules} training digits, "
                              f"got {digits.shape[0]}")
        model.init_templates_from(digits[pick].float().div(255).unsqueeze(1))
    return model.to(device)


def train_mode(cfg: dict, out_dir: Path, *, resume: bool = False, device="cpu", data_dir=None, progress=True
               ) -> tuple[TransformingAutoencoder, dict]:
    """Train one mode and seed into ``out_dir`` (``resume``: from its checkpoint, if any); returns the model and
    ``{"steps", "train_wall_time_s", ...}``, the latter the whole training call (pair generation and checkpoints
    included) less the R² curve's scoring."""
    tcfg: TrainConfig = cfg["train"]
    canvas, rng, swap = cfg["model"].canvas_size, cfg["range"], cfg["data"].swap_pairs
    torch.manual_seed(tcfg.seed)
    digits, labels = load_digits(cfg["data"], "train", data_dir)
    model = build_model(cfg, device, digits)
    test_digits, _ = load_digits(cfg["data"], "test", data_dir)
    curve_set = heldout_pairs(test_digits, cfg["eval"].curve_pairs, rng, canvas, cfg["data"].seed, "curve", device)

    def batches(epoch: int, start: int):
        for b, (x, _) in enumerate(iterate_batches(digits, labels, tcfg.batch_size, shuffle=True, seed=tcfg.seed,
                                                   epoch=epoch, start_batch=start, device=device,
                                                   drop_last=len(digits) >= tcfg.batch_size), start):
            batch = make_pairs(x, rng, canvas, seeded_generator(NAME, "pairs", tcfg.seed, epoch, b), swap=swap)
            yield batch["input"], batch["transform"], batch["target"]

    def loss_fn(batch):
        return transforming_loss(model, *batch, cfg["loss"].consistency_weight, cfg["loss"].consistency_cap)

    curve_path = out_dir / "r2_curve.jsonl"
    curve_time = [0.0]
    names = transform_components(curve_set["transform"][:1], cfg["mode"], canvas)[1]

    def score_curve(state) -> None:  # R² per component of the raw estimate, and the reconstruction MSE
        t0 = time.perf_counter()
        model.eval()
        res = run_pairs(model, curve_set, cfg["eval"].batch_size)
        model.train()
        append_jsonl(curve_path, {"step": state.step, **{f"r2_{k}": float(v) for k, v in
                                                         zip(names, r2_scores(res["pred"], res["true"]))},
                                  "recon_mse": float(res["sq_err"].mean())})
        curve_time[0] += time.perf_counter() - t0

    resume = start_log(curve_path, resume)
    metadata = {"name": cfg["name"], "kind": NAME, "mode": cfg["mode"], "configs": config_record(cfg)}
    model.train()
    t0 = time.perf_counter()
    state = train_loop(model, loss_fn, batches, tcfg, out_dir, resume=resume, metadata=metadata, progress=progress,
                       on_checkpoint=score_curve)
    wall = time.perf_counter() - t0 - curve_time[0]
    timing = {"steps": state.step, "train_wall_time_s": wall, "train_step_time_s": state.wall_time_s,
              "threads": torch.get_num_threads(), "resumed": resume}
    write_json(out_dir / "timing.json", timing)
    return model, timing


def transforming_loss(model: TransformingAutoencoder, images: torch.Tensor, transforms: torch.Tensor,
                      targets: torch.Tensor, consistency_weight: float = 0.0, cap: float = 0.0) -> torch.Tensor:
    """The reconstruction loss of the target from the input's capsules moved by ``T``
    (:meth:`TransformingAutoencoder.reconstruction_loss`), plus ``consistency_weight`` times the pose consistency of
    input and target (both recognised in one batched call), capsules weighted by ``p1 · p2`` held fixed."""
    B = images.shape[0]
    presence, poses = model.recognise(torch.cat([images, targets]) if consistency_weight > 0 else images)
    recon_loss = model.reconstruction_loss(presence[:B], model.apply_transform(poses[:B], transforms), targets)
    if consistency_weight <= 0:
        return recon_loss
    weights = (presence[:B] * presence[B:]).detach()
    return recon_loss + consistency_weight * pose_consistency(poses[:B], poses[B:], transforms, weights, cap)


@torch.no_grad()
def run_pairs(model: TransformingAutoencoder, pairs: dict, batch_size: int, warps: torch.Tensor | None = None
              ) -> dict:
    """Recognise both images of every pair (averaged over ``warps (K, 3, 3)`` if given), read ``T`` back
    (capsules weighted by ``p1 · p2``, present in both), reconstruct the target: CPU tensors."""
    mode, canvas = model.config.mode, model.config.canvas_size
    recognise = model.recognise if warps is None else (lambda x: model.recognise_averaged(x, warps))
    rows = []
    for s in range(0, pairs["input"].shape[0], batch_size):
        x1, T, x2, placement = (pairs[k][s:s + batch_size] for k in ("input", "transform", "target", "placement"))
        (p1, P1), (p2, P2) = recognise(x1), recognise(x2)
        recon, contributions = model.render(p1, model.apply_transform(P1, T))
        mask, err = window_mask(placement, canvas).float(), (recon - x2) ** 2
        area = mask.sum((1, 2, 3))
        rows.append({"pred": transform_components(estimate_transform(P1, P2, p1 * p2, mode), mode, canvas)[0],
                     "true": transform_components(T, mode, canvas)[0], "p1": p1, "sq_err": err.mean((1, 2, 3)),
                     "win_err": (err * mask).sum((1, 2, 3)) / area, "win_zero": (x2 ** 2 * mask).sum((1, 2, 3)) / area})
        if s == 0:
            first = {"recon": recon, "contrib": contributions}
    return {**{k: torch.cat([r[k].cpu() for r in rows]) for k in rows[0]}, **{k: v.cpu() for k, v in first.items()}}


def error_breakdown(pred: torch.Tensor, true: torch.Tensor, labels: torch.Tensor, names: list[str],
                    worst_fraction: float = 0.02) -> dict:
    """Where the estimate's error sits, from ``pred, true (N, K)`` and digit classes ``labels (N,)``:
    ``{"r2_by_digit": {class: {name: 1 − MSE_class / Var_all}}, "worst_error_share": {name: share}}``, each class's
    error divided by the variance over *all* pairs (so classes compare), and the share that of the
    ``worst_fraction`` largest squared errors of the component in its sum."""
    sq = (pred.double() - true.double()) ** 2                                           # (N, K)
    var = true.double().var(0, unbiased=False).clamp_min(1e-12)
    k = max(1, int(round(worst_fraction * sq.shape[0])))
    share = sq.topk(k, 0).values.sum(0) / sq.sum(0).clamp_min(1e-300)
    return {"r2_by_digit": {str(int(c)): dict(zip(names, (1 - sq[labels == c].mean(0) / var).tolist()))
                            for c in labels.unique()},
            "worst_error_share": dict(zip(names, share.tolist())), "worst_fraction": worst_fraction}


def evaluate(model: TransformingAutoencoder, cfg: dict, data_dir=None, device="cpu") -> tuple[dict, dict]:
    """Disentanglement and reconstruction on held-out pairs; returns ``(metrics, arrays for the figures)``."""
    from sklearn.linear_model import LinearRegression

    ecfg: TAEEvalConfig = cfg["eval"]
    canvas, rng, mode, seed = model.config.canvas_size, cfg["range"], model.config.mode, cfg["data"].seed
    model.eval()
    test_digits, test_labels = load_digits(cfg["data"], "test", data_dir)
    train_digits, _ = load_digits(cfg["data"], "train", data_dir)
    pairs = heldout_pairs(test_digits, ecfg.pairs, rng, canvas, seed, "heldout", device)
    warps = None
    if ecfg.test_time_warps:  # for recognise_averaged: the identity, then draws from the input-jitter range
        draws = sample_transforms(ecfg.test_time_warps - 1, rng, canvas,
                                  seeded_generator(NAME, "test_time_warps", seed), jitter=True)
        warps = torch.cat([torch.eye(3)[None], draws]).to(device)
    res = run_pairs(model, pairs, ecfg.batch_size, warps)
    fit = run_pairs(model, heldout_pairs(train_digits, ecfg.readout_pairs, rng, canvas, seed, "readout", device),
                    ecfg.batch_size, warps)
    # the linear readout: a least-squares map (with intercept) from the raw estimate's components to the true ones
    readout = LinearRegression().fit(fit["pred"].double().numpy(), fit["true"].double().numpy())
    r2_raw = r2_scores(res["pred"], res["true"])
    r2_lin = r2_scores(torch.from_numpy(readout.predict(res["pred"].double().numpy())), res["true"])
    names = transform_components(pairs["transform"][:1], mode, canvas)[1]
    active = (res["p1"] > ecfg.presence_threshold).sum(1).double()
    keypoints = {}
    if model.config.recognition == "conv":
        px = canvas / 2.0  # normalised units -> pixels
        spreads = [model.keypoint_spread(pairs["input"][s:s + ecfg.batch_size])
                   for s in range(0, ecfg.pairs, ecfg.batch_size)]
        keypoints = {"keypoint_spread_px": float(torch.cat([k for k, _ in spreads]).mean()) * px,
                     "attention_centre_spread_px": float(torch.cat([c for _, c in spreads]).mean()) * px}
    metrics = {
        "components": names, **{f"r2_{k}": float(v) for k, v in zip(names, r2_raw)},
        **{f"r2_linear_{k}": float(v) for k, v in zip(names, r2_lin)},
        "r2_min": float(r2_raw.min()), "r2_linear_min": float(r2_lin.min()),
        "recon_mse": float(res["sq_err"].mean()), "recon_mse_window": float(res["win_err"].mean()),
        "zero_image_mse_window": float(res["win_zero"].mean()),
        "active_capsules_mean": float(active.mean()), "active_capsules_median": float(active.median()),
        "heldout_pairs": int(ecfg.pairs), "test_time_warps": int(ecfg.test_time_warps), **keypoints,
        "error_breakdown": error_breakdown(res["pred"], res["true"], test_labels[pairs["index"]], names),
    }
    return metrics, {"pairs": pairs, "res": res, "names": names}


def write_figures(model: TransformingAutoencoder, arrays: dict, results_dir: Path, prefix: str, runs: list[Path]
                  ) -> None:
    """Scatter, reconstructions, presence heatmap, templates, and the training curves of every seed."""
    mode = model.config.mode
    res, pairs, names = arrays["res"], arrays["pairs"], arrays["names"]
    plotting.plot_predicted_vs_true(res["pred"], res["true"], names, results_dir / f"{prefix}_scatter.png",
                                    f"{mode}: transformation read from the two images' capsules (held-out pairs)",
                                    scores=[float(v) for v in r2_scores(res["pred"], res["true"])])
    n = min(10, res["recon"].shape[0])
    grey = lambda x: x[:n, 0, ..., None].expand(-1, -1, -1, 3).numpy()
    grid = np.stack([grey(pairs["input"].cpu()), grey(pairs["target"].cpu()), grey(res["recon"].clamp(0, 1)),
                     plotting.colour_parts(res["contrib"][:n, :, 0])])
    plotting.plot_image_grid(grid, results_dir / f"{prefix}_reconstructions.png",
                             row_labels=["input", "target", "output", "capsules"],
                             title=f"{mode}: input, transformed target, reconstruction, capsule contributions")
    plotting.plot_heatmap(res["p1"][:24], results_dir / f"{prefix}_presence.png", xlabel="capsule",
                          ylabel="held-out image", title=f"{mode}: capsule presences", vmin=0, vmax=1,
                          colorbar_label="presence p")
    plotting.plot_templates(model.templates().detach().cpu(), results_dir / f"{prefix}_templates.png",
                            title=f"{mode}: learned templates")
    r2s = {f"{run} {c}": xy for c in names
           for run, xy in plotting.log_curves({run.name: run / "r2_curve.jsonl" for run in runs}, f"r2_{c}").items()}
    if losses := plotting.log_curves({run.name: run / "log.jsonl" for run in runs}, "loss"):
        plotting.plot_curves(losses, results_dir / f"{prefix}_training.png", xlabel="step",
                             ylabel="training MSE per pixel", title=f"{mode}: training loss", logy=True)
    if r2s:
        plotting.plot_curves(r2s, results_dir / f"{prefix}_r2_curve.png", xlabel="step", ylabel="held-out R²",
                             title=f"{mode}: R² of the raw estimate during training")


def run_recipe(config: str | Path, args) -> Path:
    """Train (or resume / reuse) every seed of one config, evaluate, write the results JSON, tables and figures."""
    results_dir = Path(args.results_dir)
    runs, run_dirs, first = [], [], None
    name = args.name or load_config(config, args.set)["name"]
    for seed in args.seeds:
        cfg = load_config(config, [*args.set, f"train.seed={seed}"])
        out = Path(args.out or Path("runs") / name) / f"seed{seed}"
        run_dirs.append(out)
        if args.resume and run_finished(out, cfg["train"].steps):
            load_final(model := build_model(cfg, args.device), out, args.device)  # the final model, its timing
            timing = json.loads((out / "timing.json").read_text()) if (out / "timing.json").is_file() else {}
        else:
            model, timing = train_mode(cfg, out, resume=args.resume, device=args.device, data_dir=args.data_dir,
                                       progress=not args.quiet)
        metrics, arrays = evaluate(model, cfg, args.data_dir, args.device)
        runs.append({"seed": seed, **metrics,
                     **{k: timing.get(k) for k in ("steps", "train_wall_time_s", "train_step_time_s", "threads")}})
        first = first or (model, arrays)
        r2_text = ", ".join(f"{k} {metrics[f'r2_{k}']:.3f}" for k in metrics["components"])
        wall = timing.get("train_wall_time_s")
        print(f"{cfg['mode']} seed {seed}: R² {r2_text}; recon MSE {metrics['recon_mse']:.4f} "
              f"(22x22 window {metrics['recon_mse_window']:.4f}); active capsules "
              f"{metrics['active_capsules_mean']:.1f}; training {wall if wall is None else round(wall)} s")
    summary = {"per_seed": runs, **seed_summary(runs, [
        key for key, value in runs[0].items() if key not in ("seed", "steps", "threads", "heldout_pairs")
        and not isinstance(value, (bool, str, list, dict)) and value is not None]), "components": runs[0]["components"],
        "mode": cfg["mode"]}
    path = write_report(results_dir, name, summary, write_tables, seed=args.seeds, steps=runs[0]["steps"],
                        device=args.device, wall_time_s=sum(r["train_wall_time_s"] or 0.0 for r in runs),
                        batch_size=cfg["train"].batch_size, threads=torch.get_num_threads(), configs=config_record(cfg))
    if cfg["eval"].figures:
        write_figures(*first, results_dir, name, run_dirs)
    return path


def readme_table(results_dir: Path) -> str | None:
    """Ours (mean ± std over seeds) against the numpy reproduction's numbers, built only from the shipped recipes'
    results, ``results/transforming_autoencoder_<mode>.json`` (and ``..._<mode>_tta.json``, the same models
    re-scored with ``eval.test_time_warps > 0``, when present)."""
    loaded = {mode: r for mode in MODES if (r := load_result(results_dir, f"{NAME}_{mode}"))}
    if not loaded:
        return None
    n_seeds = max(len(metrics["per_seed"]) for metrics, _ in loaded.values())
    lines = [f"| mode | metric (held-out MNIST-test pairs) | ours: mean ± std over {n_seeds} seeds | target | "
             "numpy reproduction (28×28) |", "| --- | --- | --- | --- | --- |"]
    footer = []
    for mode, (metrics, prov) in loaded.items():
        runs = metrics["per_seed"]
        rng = prov.get("configs", {}).get("range", {})
        r2_target = "≥ 0.95" if mode == "translation" else "≥ 0.9"
        rows = [(f"R²({c}), from the capsule poses alone", f"r2_{c}", 3, r2_target,
                 NUMPY_REFERENCE.get(f"r2_{c}", "—")) for c in runs[0]["components"]]
        rows += [("min R² over components, linear readout fit on training pairs", "r2_linear_min", 3, "—", "—"),
                 ("reconstruction MSE per pixel, 22×22 window on the target digit", "recon_mse_window", 4,
                  f"< {NUMPY_REFERENCE['recon_mse']}", f"{NUMPY_REFERENCE['recon_mse']} (22×22 crop)"),
                 ("same window, all-black output (reference)", "zero_image_mse_window", 4, "—", "—"),
                 ("reconstruction MSE per pixel, whole 40×40 canvas", "recon_mse", 4, "—", "—"),
                 ("active capsules per image (p > 0.1), mean", "active_capsules_mean", 1, "—",
                  f"{NUMPY_REFERENCE['active_median']} (median)"),
                 # the 5-minute budget is set for the translation mode only
                 ("training wall time (s), shared 2-core CPU, 1 thread", "train_wall_time_s", 0,
                  "≤ 300" if mode == "translation" else "—",
                  f"~{NUMPY_REFERENCE['wall_s']} (M-series Mac)")]
        lines += [f"| {mode} | {label} | {fmt_mean_std([r[key] for r in runs], 1.0, digits)} | {target} | {anchor} |"
                  for label, key, digits, target, anchor in rows]
        # the same models re-scored with eval.test_time_warps > 0 (--resume --name <name>_tta), if that was run
        tta_note = []
        if tta_result := load_result(results_dir, f"{NAME}_{mode}_tta"):
            tta = tta_result[0]["per_seed"]
            lines += [f"| {mode} | R²({c}), recognition averaged over {tta[0]['test_time_warps']} known warps of each "
                      f"image | {fmt_mean_std([r[f'r2_{c}'] for r in tta], 1.0, 3)} | {r2_target} | — |"
                      for c in tta[0]["components"]]
            from probcaps.report import command_text  # the launch form the docs show

            tta_note = [f"{mode}, averaged over warps: seeds {', '.join(str(r['seed']) for r in tta)}; command: "
                        f"`{command_text(tta_result[1].get('command', '?'))}`."]
        maps = {p: f"rotation ±{rng.get(p + 'rotation_deg')}°, scales 1 ± {rng.get(p + 'scale')}, shear "
                   f"±{rng.get(p + 'shear')}, translation ±{rng.get(p + 'translation_px')} px"
                for p in ("", "jitter_")}
        ranges = (f"jitter ±{rng.get('jitter_translation_px')} px, shift ±{rng.get('translation_px')} px"
                  if mode == "translation" else f"T: {maps['']}; input jitter: {maps['jitter_']}")
        model_cfg, loss_cfg = (prov.get("configs", {}).get(k, {}) for k in ("model", "loss"))
        recognition, weight = model_cfg.get("recognition", "mlp"), loss_cfg.get("consistency_weight", 0.0)
        keypoints = f" ({model_cfg.get('keypoints')} keypoint(s) per capsule)" if recognition == "conv" else ""
        cap = f", capped at {loss_cfg['consistency_cap']}" if loss_cfg.get("consistency_cap") else ""
        setup = (f"recognition: {recognition}{keypoints}, {model_cfg.get('num_capsules')} capsules, combine "
                 f"{model_cfg.get('combine', 'sum')!r}, pose-consistency weight {weight}"
                 + (f" (template frame{cap})" if weight else ""))
        footer += [f"{mode}: {ranges}; {setup}; seeds {', '.join(str(r['seed']) for r in runs)}; {runs[0]['steps']} "
                   f"steps of batch {prov.get('batch_size', '?')}; {runs[0].get('threads')} torch thread(s); "
                   f"{provenance_line(prov)}", *tta_note, *_error_note(mode, runs)]
    return "\n".join(lines + [""] + footer)


#: the tries of the affine mode: one record each, ``results_dir/ablations/<try>.json``
#: (:func:`probcaps.report.load_try`), laid out as ``results_dir/ablations.md``
ABLATIONS = TAE_ABLATIONS = "ablations"  # (the second name: the one the --tables-only help reads)
#: ``(metrics key, column head, scale, digits)`` of the table of tries
ABLATION_COLUMNS = [*((f"r2_{n}", f"R² {n}", 1.0, 2) for n in ("m11", "m12", "tx", "m21", "m22", "ty")),
                    ("active_capsules_mean", "active capsules", 1.0, 1),
                    ("recon_mse_window", "reconstruction MSE, 22×22 window", 1.0, 4)]


def ablations_table(results_dir: Path) -> str | None:
    """The tries of ``results_dir/ablations/*.json``, one row each against
    `transforming_autoencoder_affine.toml` (None: none)."""
    return tries_table(results_dir, ABLATION_COLUMNS, "`transforming_autoencoder_affine.toml`", ABLATIONS)


def write_tables(results_dir: Path) -> list[Path | None]:
    """Write the table of the shipped recipes (``results_dir/transforming_autoencoder.md``) and of the tries
    (``results_dir/ablations.md``) from the results JSON there; returns the files written (None: not written)."""
    return [write_table(results_dir, NAME, readme_table(results_dir)),
            write_table(results_dir, ABLATIONS, ablations_table(results_dir))]


def _error_note(mode: str, runs: list[dict]) -> list[str]:
    """A sentence on where the weakest component's error sits (from ``error_breakdown``), if it was recorded."""
    if not all("error_breakdown" in r for r in runs):
        return []
    weakest = min(runs[0]["components"], key=lambda c: np.mean([r[f"r2_{c}"] for r in runs]))
    share = np.mean([r["error_breakdown"]["worst_error_share"][weakest] for r in runs])
    by_digit = {d: np.mean([r["error_breakdown"]["r2_by_digit"][d][weakest] for r in runs])
                for d in runs[0]["error_breakdown"]["r2_by_digit"]}
    worst = sorted(by_digit, key=by_digit.get)[:3]
    fraction = runs[0]["error_breakdown"]["worst_fraction"]
    return [f"{mode}, where the error of R²({weakest}) sits (mean over seeds): the worst {fraction:.0%} of held-out "
            f"pairs hold {share:.0%} of its squared error; weakest digit classes "
            + ", ".join(f"{d} (R² {by_digit[d]:.2f})" for d in worst) + "."]


@one_line_errors("transforming_autoencoder")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, list(RECIPES), [0, 1, 2], "one or more recipes (default: the translation and the affine one)")
    add_run_args(p, EXPERIMENT, out_help="run folders (<out>/seed<S>; default: runs/<name>)", threads=1,
                 resume="continue unfinished runs, re-evaluate finished ones",
                 tables=f"tables (RESULTS_DIR/{NAME}.md, RESULTS_DIR/{TAE_ABLATIONS}.md)")
    args = p.parse_args(argv)
    if setup_run(args, write_tables):
        return 0
    if len(args.config) > 1 and (args.name or args.out):
        raise ConfigError("--name and --out take one --config (each recipe writes its own files)")
    for config in args.config:
        run_recipe(config, args)
    return 0


if __name__ == "__main__":
    launch(main)
