"""Evaluate a trained capsule model the way the paper does (SPEC §1 "Evaluation")."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained, probe_features
from probcaps.inference.train import make_elbo
from probcaps import plotting
from probcaps.inference.guides import Latents
from probcaps.data import iterate_batches, to_float
from probcaps.metrics import LinearProbe, kmeans_accuracy
from probcaps.provenance import provenance, write_results

__all__ = ["evaluate_checkpoint", "save_figures", "test_elbo", "reconstruction_error"]


@torch.no_grad()
def test_elbo(system, images: torch.Tensor, batch_size: int = 250, device: str = "cpu") -> float:
    """Mean ELBO per image (one sample of the guide), ``s`` enumerated out."""
    elbo = make_elbo()
    labels = torch.zeros(len(images), dtype=torch.long)
    total = sum(-elbo.loss(system.model, system.guide, x)
                for x, _ in iterate_batches(images, labels, batch_size, shuffle=False, device=device))
    return total / len(images)


@torch.no_grad()
def reconstruction_error(model, images: torch.Tensor, latents: Latents, batch_size: int = 250,
                         device: str = "cpu") -> float:
    """Mean squared error per pixel of ``images`` (uint8 or floats in [0, 1]) rendered back from ``latents``
    (part presences at ``sigmoid`` of their logits, part poses as given), in the images' order."""
    labels = torch.zeros(len(images), dtype=torch.long)
    total = 0.0
    for i, (x, _) in enumerate(iterate_batches(images, labels, batch_size, shuffle=False, device=device)):
        sl = slice(i * batch_size, i * batch_size + len(x))
        recon, _ = model.render(torch.sigmoid(latents.part_logits[sl].to(device)), latents.part_poses[sl].to(device))
        total += ((recon - x) ** 2).mean((1, 2, 3)).sum().item()
    return total / len(images)


@torch.no_grad()
def save_figures(system, images: torch.Tensor, out_prefix: Path, n: int = 8, device: str = "cpu") -> list[str]:
    """Learned templates, and inputs vs reconstructions with each template's contribution coloured."""
    templates = system.model.templates().cpu()
    paths = [plotting.plot_templates(templates[:, 0], f"{out_prefix}_templates.png", alphas=templates[:, 1],
                                     title="learned templates (top) and alphas (bottom)")]
    x = to_float(images[:n]).to(device).unsqueeze(1)
    lat = system.encoder.encode(x)
    recon, contributions = system.model.render(torch.sigmoid(lat.part_logits), lat.part_poses)
    colours = plotting.colour_parts(contributions[:, :, 0].cpu())
    paths.append(plotting.plot_reconstructions(x[:, 0].cpu(), recon[:, 0].cpu(), f"{out_prefix}_reconstructions.png",
                                               part_colours=colours))
    return [str(p) for p in paths]


def plot_presence_by_class(presences: torch.Tensor, labels: torch.Tensor, path: Path) -> Path:
    """Heatmap of the mean object presence ``(N, K)`` per class: class-specific objects show as a scattered
    pattern, objects that are on whatever the digit as full columns."""
    classes = torch.unique(labels)
    means = torch.stack([presences[labels == c].mean(0) for c in classes])
    return plotting.plot_heatmap(means, path, row_labels=[str(int(c)) for c in classes], xlabel="object capsule",
                                 ylabel="digit class", title="mean object presence per class (test set)",
                                 vmin=0, vmax=1, colorbar_label="presence")


def evaluate_checkpoint(checkpoint: str | Path, name: str | None = None, results_dir: str | Path = "results",
                        data_dir=None, device: str = "cpu", overrides: list[str] = (), progress: bool = True,
                        figures: bool | None = None) -> dict:
    """Probe accuracies, k-means accuracy, test ELBO and reconstruction error of a checkpoint.

    Writes ``results_dir/<name>.json`` (metrics + provenance) and ``<name>_*.png`` figures; returns the metrics.
    """
    t0 = time.perf_counter()
    cfg, system = load_trained(checkpoint, device=device, overrides=overrides)
    name = name or cfg["name"]
    ecfg = cfg["eval"]
    # the probe is fit on the first probe_train_limit training images (0: the training set the model saw)
    train_images, train_labels = load_images(cfg["data"], "train", data_dir, limit=ecfg.probe_train_limit or None)
    test_images, test_labels = load_images(cfg["data"], "test", data_dir)
    train_lat = encode_dataset(system.encoder, train_images, ecfg.batch_size, device, progress=progress)
    test_lat = encode_dataset(system.encoder, test_images, ecfg.batch_size, device, progress=progress)
    train_feats, test_feats = probe_features(train_lat), probe_features(test_lat)
    metrics: dict = {}
    for key in train_feats:
        probe = LinearProbe(C=ecfg.probe_C, max_iter=ecfg.probe_max_iter).fit(train_feats[key], train_labels)
        metrics[f"probe_{key}_test_acc"] = probe.accuracy(test_feats[key], test_labels)
        metrics[f"probe_{key}_train_acc"] = probe.accuracy(train_feats[key], train_labels)
    metrics["kmeans_presence_test_acc"] = kmeans_accuracy(torch.sigmoid(test_feats["presence"]), test_labels,
                                                          n_clusters=10, n_init=ecfg.kmeans_n_init)
    metrics["test_elbo_per_image"] = test_elbo(system, test_images[:2000], device=device)
    metrics["test_recon_mse"] = reconstruction_error(system.model, test_images[:2000], test_lat, device=device)
    parent_on = torch.sigmoid(test_lat.parent_logits) > 0.5
    metrics["mean_active_parents"] = float(parent_on.float().sum(1).mean())
    # objects on in at least 1% of the test images: the model's working vocabulary of objects
    metrics["parents_in_use"] = int((parent_on.float().mean(0) >= 0.01).sum())
    metrics["mean_active_parts"] = float((torch.sigmoid(test_lat.part_logits) > 0.5).float().sum(1).mean())
    metrics["n_train"], metrics["n_test"] = len(train_images), len(test_images)
    results_dir = Path(results_dir)
    do_figures = ecfg.figures if figures is None else figures
    figure_paths = save_figures(system, test_images, results_dir / name, device=device) if do_figures else []
    if do_figures:
        figure_paths.append(str(plot_presence_by_class(torch.sigmoid(test_lat.parent_logits), test_labels,
                                                       results_dir / f"{name}_presence_by_class.png")))
    state = cfg.get("train_state", {})
    prov = provenance(seed=cfg["train"].seed, steps=state.get("step"), wall_time_s=state.get("wall_time_s"),
                      device=device, checkpoint=str(checkpoint), eval_wall_time_s=time.perf_counter() - t0,
                      configs={k: v.to_dict() for k, v in cfg.items() if hasattr(v, "to_dict")}, figures=figure_paths)
    write_results(results_dir / f"{name}.json", metrics, prov)
    return metrics
