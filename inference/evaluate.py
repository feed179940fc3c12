"""Evaluate a trained capsule model the way the paper does (Smith et al. 2020, §5), with SCAE's readout of the
objects (Kosiorek et al. 2019, §3.1 and Table 1) in the model's own terms.

SCAE scores its object capsules by their *posterior* presence: the evidence each object collects from the parts it
explains.  Here that is the expected number of parts coupled to each object under the exact posterior over each
part's parent ``s`` (Smith et al. 2020, §5.1, footnote), :func:`posterior_part_counts`; every probe and k-means
score is reported on the guide's (prior) presences, on the posterior ones, on both, and on presences with poses.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from probcaps import plotting
from probcaps.checkpoints import load_checkpoint
from probcaps.config import check_file_name
from probcaps.data import iterate_batches, to_float
from probcaps.distributions import RELAXED_CLAMP
from probcaps.errors import CheckpointError, ConfigError
from probcaps.geometry import compose_pose6, invert, matrix_to_pose6, pose6_to_matrix, restrict_pose6
from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained, probe_features, stored_config
from probcaps.inference.distributed import init_from_env
from probcaps.inference.guides import Latents
from probcaps.inference.likelihood import bound_summary, log_likelihood_bound
from probcaps.inference.train import make_elbo
from probcaps.io import restored_on_failure
from probcaps.metrics import (
    LinearProbe,
    MLPProbe,
    class_purity,
    classification_summary,
    dominant_object_accuracy,
    kmeans_from_class_means,
    kmeans_labels,
    kmeans_spread,
    mean_by_class,
    most_confused_pair,
    template_distinctness,
)
from probcaps.models.capsule_model import object_information
from probcaps.provenance import provenance, write_results
from probcaps.render import warp
from probcaps.report import fmt_mean_std, load_result, provenance_line, write_table

__all__ = ["evaluate_checkpoint", "compute_evaluation", "write_evaluation", "Evaluation", "save_figures", "test_elbo",
           "reconstruction_error", "parent_log_posterior",
           "posterior_presences", "posterior_part_counts", "readout_features", "readout_table", "evaluate_seeds",
           "parts_in_parent_frame", "part_pose_explained", "object_drawings", "plot_object_drawings",
           "layer_features", "part_features", "READOUTS", "FIGURES", "LAYER_READOUTS", "NONLINEAR_PROBES",
           "REPORTED_KMEANS", "SCAE_PUBLISHED", "check_figures"]

#: The feature sets every probe and k-means score is reported on (key -> what it is).
READOUTS = {"presence": "prior presences (the guide's)",
            "posterior_counts": "posterior presences: expected part counts",
            "weighted_counts": "presence × expected part counts", "presence_counts": "prior ⊕ posterior presences",
            "presence_pose": "presences + poses", "presence_counts_pose": "prior ⊕ posterior presences + poses",
            "presence_pose_code": "presences + poses + codes (a model with object codes)"}
#: Probes on the part layer beside the objects' (``eval.layer_readouts``): the class information the parts carry,
#: and how much of it lies in where the parts sit relative to their objects, which the objects' poses leave out.
LAYER_READOUTS = {"parts": "part presences + poses",
                  "parts_in_parent_frame": "part presences + poses in their parent's frame",
                  "presence_pose_parts_in_parent_frame": "object presences + poses ⊕ parts in their parent's frame",
                  "part_residuals": "parts' offsets from their parent's prediction"}
#: The feature sets probed again by a two-layer network (``eval.nonlinear_probes``,
#: :class:`~probcaps.metrics.MLPProbe`): how much class information the object layer holds against the part layer,
#: whether or not a linear readout reaches it.
NONLINEAR_PROBES = ("presence", "presence_pose", "presence_pose_code", "parts")
#: The feature sets whose probes get a per-class report and a confusion-matrix figure.
REPORTED_PROBES = ("presence", "presence_pose")
#: The feature sets whose test k-means clusters (each named by its matched class) get the same: which digits share
#: a cluster.
REPORTED_KMEANS = ("presence", "posterior_counts")
#: The figures an evaluation can draw, ``<name>_<figure>.png`` (:func:`write_evaluation`'s ``figures`` names some).
FIGURES = ("templates", "template_neighbours", "reconstructions", "presence_by_class", "objects_by_class",
           *(f"confusion_{key}" for key in REPORTED_PROBES), *(f"confusion_kmeans_{key}" for key in REPORTED_KMEANS),
           "objects_drawn")
#: SCAE's MNIST scores (Kosiorek et al. 2019, Table 1): linear classifier on the object capsules (LIN-PRED) and
#: k-means with 10 clusters matched to the classes (LIN-MATCH), test accuracy.
SCAE_PUBLISHED = {"probe_test_acc": 0.990, "kmeans_test_acc": 0.987}


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


def drawn_templates(model) -> torch.Tensor:
    """``(M, 1, t, t)``: what each template draws, its intensity times its alpha."""
    templates = model.templates().detach()
    return templates[:, :1] * templates[:, 1:]


def template_neighbours(model, steps: int = 150) -> dict:
    """:func:`~probcaps.metrics.template_distinctness` of the model's drawn templates (Smith et al. 2020, Figure 6):
    each template's nearest other template under the best affine warp, and the share of it left unexplained."""
    return template_distinctness(drawn_templates(model).cpu(), steps=steps)


@torch.no_grad()
def parts_by_template(model, latents: Latents) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The parts of ``latents`` rendered at their presence probabilities: ``(recon (N, 1, H, W), contributions
    (N, M, 1, H, W), colours (N, H, W, 3))``, each template's contribution in its own colour
    (:func:`~probcaps.plotting.colour_parts`; Smith et al. 2020, Figures 5 and 7)."""
    recon, contributions = model.render(torch.sigmoid(latents.part_logits), latents.part_poses)
    return recon, contributions, plotting.colour_parts(contributions[:, :, 0].cpu())


@torch.no_grad()
def save_figures(system, images: torch.Tensor, out_prefix: Path, n: int = 8, device: str = "cpu",
                 neighbours: dict | None = None, only: Collection[str] | None = None) -> list[str]:
    """Learned templates (``<out_prefix>_templates.png``; with each one's nearest other template under the best
    affine warp, ``_template_neighbours.png``, when ``neighbours`` from :func:`template_neighbours` is given), and
    inputs vs reconstructions, coloured by template and by object (each part's contribution given to its parents by
    the exact posterior over them; the clutter parent grey; ``_reconstructions.png``).  ``only``: of these figures,
    the ones so named alone (default: all)."""
    paths = []
    if only is None or "templates" in only:
        templates = system.model.templates().cpu()
        paths.append(plotting.plot_templates(templates[:, 0], f"{out_prefix}_templates.png", alphas=templates[:, 1],
                                             title="learned templates (top) and alphas (bottom)"))
    if neighbours is not None and (only is None or "template_neighbours" in only):
        drawn = drawn_templates(system.model).cpu()
        t = drawn.shape[-1]
        warped = warp(drawn[neighbours["nearest"]], neighbours["warp"], t)
        paths.append(plotting.plot_image_grid(
            torch.stack([drawn[:, 0], warped[:, 0]]), f"{out_prefix}_template_neighbours.png",
            row_labels=["template", "nearest, warped"],
            col_labels=[f"{m}←{int(j)}: {d:.2f}" for m, (j, d) in
                        enumerate(zip(neighbours["nearest"], neighbours["distance"].tolist()))],
            title=f"each template and its nearest other template under the best affine warp (share left "
                  f"unexplained; mean {neighbours['mean']:.3f})"))
    if only is not None and "reconstructions" not in only:
        return [str(p) for p in paths]
    x = to_float(images[:n]).to(device).unsqueeze(1)
    lat = system.encoder.encode(x)
    recon, contributions, by_template = parts_by_template(system.model, lat)
    posterior = parent_log_posterior(system.model, lat).exp()                       # (n, M, K+1), clutter first
    by_object = torch.einsum("nmk,nmhw->nkhw", posterior, contributions[:, :, 0]).cpu()
    object_colours = np.vstack([[0.5, 0.5, 0.5], plotting.PART_PALETTE])         # the clutter parent grey
    paths.append(plotting.plot_reconstructions(x[:, 0].cpu(), recon[:, 0].cpu(), f"{out_prefix}_reconstructions.png",
                                               part_colours=by_template,
                                               object_colours=plotting.colour_parts(by_object, object_colours)))
    return [str(p) for p in paths]


@torch.no_grad()
def object_drawings(model, latents: Latents, images: torch.Tensor, components: int = 2, span: float = 2.0,
                    min_share: float = 0.01) -> tuple[torch.Tensor, list[str], list[str]] | None:
    """What each object in use draws (:meth:`CapsuleModel.draw_objects`): ``(grid (R, C, H, W), row labels, column
    labels)``, ``None`` if no object is in use.

    ``images`` ``(N, H, W)`` uint8 are those ``latents`` encode.  One row per object on (presence > 0.5) in at least
    ``min_share`` of them (and in one at least): the image where the object is most present, then the object drawn
    alone at its mean latents over the images where it is on and, for a model with object codes, with its code moved
    ``±span`` standard deviations along each of the first ``components`` principal directions of its codes over
    those images: the ways an object's parts move together from one image to the next."""
    presence = torch.sigmoid(latents.parent_logits.float())
    on = presence > 0.5                                                                # (N, K)
    share = on.float().mean(0)
    used = ((share >= min_share) & (share > 0)).nonzero().flatten()
    if not len(used):
        return None
    D = model.config.object_code_dims
    components = min(components, D)
    ref = model.offsets
    weight = on.T.to(ref).unsqueeze(-1)                                               # (K, N, 1)
    y1 = latents.parent_poses.to(ref).transpose(0, 1)                                 # (K, N, 6 + D)
    count = weight.sum(1).clamp_min(1)                                                # (K, 1)
    mean = (y1 * weight).sum(1) / count                                               # (K, 6 + D)
    variants = [mean]
    if components:  # the codes' principal directions per object; the images where it is off are zero rows
        _, sv, vh = torch.linalg.svd((y1[..., 6:] - mean[:, None, 6:]) * weight, full_matrices=False)
        std = sv / (count - 1).clamp_min(1).sqrt()                                    # (K, D)
        for j in range(components):
            step = F.pad(span * std[:, j, None] * vh[:, j], (6, 0))                   # (K, 6 + D)
            variants += [mean - step, mean + step]
    drawn = model.draw_objects(torch.stack(variants))[:, used, 0].float().cpu()      # (V, R, H, W), all at once
    example = to_float(images[presence[:, used].argmax(0)]).reshape(len(used), *drawn.shape[2:]).to(drawn)
    grid = torch.cat([example[:, None], drawn.transpose(0, 1)], 1)                   # (R, 1 + V, H, W)
    cols = ["most present", "mean"] + [f"{sign}{span:g}σ code {j + 1}" for j in range(components) for sign in "−+"]
    return grid, [f"object {k}" for k in used.tolist()], cols


def plot_object_drawings(drawings: tuple[torch.Tensor, list[str], list[str]], path: str | Path, title: str) -> Path:
    """The figure of :func:`object_drawings`: an object a row, or, without code directions, an object a column
    (the example image above the drawing)."""
    grid, objects, columns = drawings
    if grid.shape[1] <= 2:
        return plotting.plot_image_grid(grid.transpose(0, 1), path, row_labels=columns, col_labels=objects, title=title)
    return plotting.plot_image_grid(grid, path, row_labels=objects, col_labels=columns, title=title)


@torch.no_grad()
def parent_log_posterior(model, latents: Latents) -> torch.Tensor:
    """``(B, M, K+1)`` log q(s_m = k) of :meth:`CapsuleModel.parent_log_posterior` at the guide's point values:
    presences at ``sigmoid`` of their logits, clamped into the relaxed Bernoulli's support, poses as given."""
    ref = model.offsets
    z1 = torch.sigmoid(latents.parent_logits.to(ref)).clamp(RELAXED_CLAMP, 1 - RELAXED_CLAMP)
    z0 = torch.sigmoid(latents.part_logits.to(ref)).clamp(RELAXED_CLAMP, 1 - RELAXED_CLAMP)
    return model.parent_log_posterior(z1, latents.parent_poses.to(ref), z0, latents.part_poses.to(ref))


@torch.no_grad()
def posterior_presences(model, latents: Latents, batch_size: int = 1000,
                        certain: float = 0.99) -> tuple[torch.Tensor, float]:
    """One pass over the exact posterior over the parts' parents (:func:`parent_log_posterior`), ``batch_size``
    images at a time: ``(counts, certain share)``.

    ``counts`` ``(N, K)`` on the CPU: the posterior presences, each object's expected number of parts
    ``Σ_m q(s_m = k)`` (the dummy left out).  ``certain share``: of the parts that are on (presence > 0.5), the share
    whose parent is all but certain, ``max_k q(s_m = k) > certain`` (the dummy included); where it is near 1, terms
    on the posterior coupling (SCAE's entropies of the part counts) get almost no gradient.
    """
    chunks, certain_on, on = [], 0, 0
    for i in range(0, len(latents.part_logits), batch_size):
        chunk = Latents(*(t[i:i + batch_size] for t in latents))
        q = parent_log_posterior(model, chunk).exp()                               # (B, M, K+1)
        chunks.append(q[..., 1:].sum(-2).cpu())
        part_on = torch.sigmoid(chunk.part_logits) > 0.5
        certain_on += int(((q.amax(-1) > certain) & part_on).sum())
        on += int(part_on.sum())
    counts = torch.cat(chunks) if chunks else torch.zeros(0, model.config.num_parents)
    return counts, certain_on / max(on, 1)


def posterior_part_counts(model, latents: Latents, batch_size: int = 1000) -> torch.Tensor:
    """``(N, K)`` posterior presences of :func:`posterior_presences`."""
    return posterior_presences(model, latents, batch_size)[0]


@torch.no_grad()
def parts_in_parent_frame(model, latents: Latents, batch_size: int = 1000) -> tuple[torch.Tensor, ...]:
    """Each part seen from its most probable parent under the exact posterior over ``s``
    (:func:`parent_log_posterior`), ``batch_size`` images at a time; all on the CPU:

    - ``frame`` ``(N, M, 6)``: the part's pose in the parent's frame, ``pose6(P(y1_k)^-1 P(y0_m))`` with the object
      pose in the model's group (``model.config.object_pose``); the dummy's frame is the canvas, ``y0_m`` itself;
    - ``residual`` ``(N, M, 6)``: the part's offset from the parent's prediction, ``y0_m − pose6(P(y1_k) P(Δ_km))``
      (``Δ_km`` deformed by the object's code in a model with codes; the dummy predicts the origin), the deviation
      the model's part-pose density scores;
    - ``parent`` ``(N, M)``: that parent, ``0`` for the dummy, ``k`` for object ``k − 1``.
    """
    frames, residuals, parents = [], [], []
    for i in range(0, len(latents.part_logits), batch_size):
        chunk = Latents(*(t[i:i + batch_size].to(model.offsets) for t in latents))
        parent = parent_log_posterior(model, chunk).argmax(-1)                                # (B, M)
        y1 = restrict_pose6(chunk.parent_poses[..., :6], model.config.object_pose)
        y1 = torch.cat([torch.zeros_like(y1[:, :1]), y1], 1)                                  # (B, K+1, 6)
        offsets = model.part_offsets(chunk.parent_poses)                                      # (B, K, M, 6)
        offsets = torch.cat([torch.zeros_like(offsets[:, :1]), offsets], 1)                   # (B, K+1, M, 6)
        y1_own = y1.gather(1, parent.unsqueeze(-1).expand(-1, -1, 6))                         # (B, M, 6)
        offset_own = offsets.gather(1, parent[:, None, :, None].expand(-1, 1, -1, 6))[:, 0]   # (B, M, 6)
        predicted = torch.where((parent > 0).unsqueeze(-1), compose_pose6(y1_own, offset_own), 0.0)
        frames.append(matrix_to_pose6(invert(pose6_to_matrix(y1_own)) @ pose6_to_matrix(chunk.part_poses)).cpu())
        residuals.append((chunk.part_poses - predicted).cpu())
        parents.append(parent.cpu())
    if not frames:
        M = model.config.num_parts
        return torch.zeros(0, M, 6), torch.zeros(0, M, 6), torch.zeros(0, M, dtype=torch.long)
    return torch.cat(frames), torch.cat(residuals), torch.cat(parents)


def part_pose_explained(latents: Latents, residual: torch.Tensor, parent: torch.Tensor) -> float:
    """The share of the spread of the parts' poses that their objects predict: ``1 − Σ residual² / Σ (y0 − ȳ0_m)²``
    over the parts that are on (presence > 0.5) with an object for their most probable parent, ``ȳ0_m`` each part's
    mean pose over those images (1: the objects place their parts exactly; 0: no better than each part's mean)."""
    poses = latents.part_poses.to(residual)
    used = ((torch.sigmoid(latents.part_logits.to(residual)) > 0.5) & (parent > 0)).unsqueeze(-1).to(residual)
    mean = (poses * used).sum(0) / used.sum(0).clamp_min(1)                                 # (M, 6)
    spread = (((poses - mean) ** 2) * used).sum()
    return float(1 - ((residual ** 2) * used).sum() / spread) if spread > 0 else float("nan")


def part_features(latents: Latents) -> torch.Tensor:
    """``(N, M * 7)``: the parts' presence logits and poses."""
    return torch.cat([latents.part_logits, latents.part_poses.flatten(1)], 1)


def layer_features(latents: Latents, frame: torch.Tensor, residual: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per :data:`LAYER_READOUTS` key, the probe's features ``(N, D)``, from :func:`parts_in_parent_frame`."""
    objects = probe_features(latents)["presence_pose"]
    in_frame = torch.cat([latents.part_logits, frame.flatten(1)], 1)
    return {"parts": part_features(latents),
            "parts_in_parent_frame": in_frame,
            "presence_pose_parts_in_parent_frame": torch.cat([objects, in_frame], 1),
            "part_residuals": residual.flatten(1)}


def readout_features(latents: Latents, counts: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per :data:`READOUTS` key, ``(probe features, k-means features)``, each ``(N, D)``, from ``counts``, the
    :func:`posterior_part_counts` of ``latents``.  Presences alone: logits for the probe (it standardises them),
    probabilities (SCAE's scale) for k-means."""
    logits = latents.parent_logits
    presence = torch.sigmoid(logits)
    both = torch.cat([logits, counts], 1)
    objects = probe_features(latents)
    with_poses = objects["presence_pose"]
    both_with_poses = torch.cat([both, latents.parent_poses[..., :6].flatten(1)], 1)
    features = {"presence": (logits, presence), "posterior_counts": (counts, counts),
                "weighted_counts": (presence * counts, presence * counts), "presence_counts": (both, both),
                "presence_pose": (with_poses, with_poses), "presence_counts_pose": (both_with_poses, both_with_poses)}
    if "presence_pose_code" in objects:
        features["presence_pose_code"] = (objects["presence_pose_code"],) * 2
    return features


@dataclass
class Evaluation:
    """What :func:`compute_evaluation` measured of one trained model, and what :func:`write_evaluation` needs to
    draw its figures: the metrics, the run (``seed``, ``steps``, ``train_wall_time_s``) and the test set's latents."""

    name: str
    checkpoint: str
    metrics: dict
    run: dict
    cfg: dict
    system: object
    test_images: torch.Tensor
    test_labels: torch.Tensor
    test_latents: Latents
    test_counts: torch.Tensor
    test_presence: torch.Tensor
    reports: dict
    neighbours: dict
    device: str
    started: float


def compute_evaluation(checkpoint: str | Path, name: str | None = None, data_dir=None, device: str = "cpu",
                       overrides: list[str] = (), progress: bool = True, seed_suffix: bool = False,
                       eval_config=None) -> Evaluation:
    """Every readout of a checkpoint (see :func:`evaluate_checkpoint`), measured and returned, nothing written."""
    t0 = time.perf_counter()
    if name is not None:
        check_file_name(name, "--name")
    cfg, system = load_trained(checkpoint, device=device, overrides=overrides, eval_config=eval_config)
    # the name the recipe's own evaluation of this seed has (experiments/mnist_probe.py): never its seeds' summary
    seed = cfg["train"].seed
    name = f"{name}_seed{seed}" if name and seed_suffix else name or f"{cfg['name']}_seed{seed}"
    ecfg = cfg["eval"]
    # the probe is fit on the first probe_train_limit training images (0: the training set the model saw)
    train_images, train_labels = load_images(cfg["data"], "train", data_dir, limit=ecfg.probe_train_limit or None)
    test_images, test_labels = load_images(cfg["data"], "test", data_dir)
    train_lat, test_lat = (encode_dataset(system.encoder, images, ecfg.batch_size, device, progress=progress)
                           for images in (train_images, test_images))
    train_counts = posterior_part_counts(system.model, train_lat, ecfg.batch_size)
    test_counts, certain_share = posterior_presences(system.model, test_lat, ecfg.batch_size)
    train_feats, test_feats = readout_features(train_lat, train_counts), readout_features(test_lat, test_counts)
    metrics, reports = {}, {}
    for key in (key for key in READOUTS if key in train_feats):
        probe = LinearProbe(C=ecfg.probe_C, max_iter=ecfg.probe_max_iter).fit(train_feats[key][0], train_labels)
        metrics[f"probe_{key}_test_acc"] = probe.accuracy(test_feats[key][0], test_labels)
        metrics[f"probe_{key}_train_acc"] = probe.accuracy(train_feats[key][0], train_labels)
        for split, feats, labels in (("test", test_feats, test_labels), ("train", train_feats, train_labels)):
            clustered = kmeans_labels(feats[key][1], labels, n_clusters=10, n_init=ecfg.kmeans_n_init)
            metrics[f"kmeans_{key}_{split}_acc"] = float((clustered == labels.numpy()).mean())
            if split == "test" and key in REPORTED_KMEANS:
                reports["kmeans", key] = classification_summary(test_labels, clustered)
                # how stable the clustering is, and where it fails: over single initialisations, and its worst pair
                spread = kmeans_spread(feats[key][1], labels, n_clusters=10, inits=ecfg.kmeans_n_init)
                metrics.update({f"kmeans_{key}_test_acc_init_{q}": spread[q] for q in ("min", "median", "max")})
                metrics[f"kmeans_{key}_test_confused_pair"] = most_confused_pair(
                    reports["kmeans", key]["confusion"], reports["kmeans", key]["classes"])
                # whether the shortfall is the objective's: the fit from the class means, its accuracy and inertia
                if len(torch.unique(labels)) == 10:  # one centre per class (a small test split may lack some)
                    metrics[f"kmeans_{key}_test_class_start"] = kmeans_from_class_means(
                        feats[key][1], labels, n_clusters=10, n_init=ecfg.kmeans_n_init)
        if key in REPORTED_PROBES:
            reports["probe", key] = classification_summary(test_labels, probe.predict(test_feats[key][0]),
                                                           classes=torch.unique(torch.cat([train_labels, test_labels])))
    metrics.update({f"{kind}_{key}_test_report": report for (kind, key), report in reports.items()})
    if ecfg.layer_readouts:  # the part layer's probes (no k-means: the parts are not the capsules SCAE clusters)
        (train_frame, train_residual, _), (test_frame, test_residual, test_parent) = (
            parts_in_parent_frame(system.model, lat, ecfg.batch_size) for lat in (train_lat, test_lat))
        train_layers = layer_features(train_lat, train_frame, train_residual)
        test_layers = layer_features(test_lat, test_frame, test_residual)
        for key in LAYER_READOUTS:
            probe = LinearProbe(C=ecfg.probe_C, max_iter=ecfg.probe_max_iter).fit(train_layers[key], train_labels)
            metrics[f"probe_{key}_test_acc"] = probe.accuracy(test_layers[key], test_labels)
            metrics[f"probe_{key}_train_acc"] = probe.accuracy(train_layers[key], train_labels)
        metrics["part_pose_explained"] = part_pose_explained(test_lat, test_residual, test_parent)
    if ecfg.nonlinear_probes:
        train_feats["parts"], test_feats["parts"] = ((part_features(lat),) for lat in (train_lat, test_lat))
        for key in (key for key in NONLINEAR_PROBES if key in train_feats):
            probe = MLPProbe(seed=seed).fit(train_feats[key][0], train_labels)
            metrics[f"mlp_{key}_test_acc"] = probe.accuracy(test_feats[key][0], test_labels)
            metrics[f"mlp_{key}_train_acc"] = probe.accuracy(train_feats[key][0], train_labels)
    test_presence = torch.sigmoid(test_lat.parent_logits)
    metrics["object_class_purity"] = class_purity(test_counts, test_labels)
    metrics["object_class_purity_presence"] = class_purity(test_presence, test_labels)
    metrics["dominant_object_test_acc"] = dominant_object_accuracy(train_counts, train_labels, test_counts, test_labels)
    metrics["mean_posterior_part_count"] = float(test_counts.sum(1).mean())  # parts explained by objects, not dummy
    # what the information term maximises, on the images the model was fit to; it needs no label
    within, between = object_information(train_counts.double())
    metrics["object_information"] = float(between - within)
    metrics["certain_parent_share"] = certain_share
    metrics["published_scae"] = dict(SCAE_PUBLISHED)
    neighbours = template_neighbours(system.model)
    metrics["template_distinctness_mean"], metrics["template_distinctness_min"] = neighbours["mean"], neighbours["min"]
    metrics["template_nearest"] = neighbours["nearest"].tolist()
    metrics["template_distinctness"] = neighbours["distance"].tolist()
    metrics["test_elbo_per_image"] = test_elbo(system, test_images[:2000], device=device)
    metrics["heldout_bound"] = heldout_bound(system, test_images, ecfg, device, progress)
    for k, b in (metrics["heldout_bound"] or {"samples": {}})["samples"].items():  # the numbers a seeds' mean takes
        metrics[f"heldout_bound_k{k}"] = b["mean"]
    metrics["test_recon_mse"] = reconstruction_error(system.model, test_images[:2000], test_lat, device=device)
    parent_on = test_presence > 0.5
    metrics["mean_active_parents"] = float(parent_on.float().sum(1).mean())
    # objects on in at least 1% of the test images: the model's working vocabulary of objects
    metrics["parents_in_use"] = int((parent_on.float().mean(0) >= 0.01).sum())
    metrics["mean_active_parts"] = float((torch.sigmoid(test_lat.part_logits) > 0.5).float().sum(1).mean())
    metrics["n_train"], metrics["n_test"] = len(train_images), len(test_images)
    state = cfg.get("train_state", {})
    run = {"seed": seed, "steps": state.get("step"), "train_wall_time_s": state.get("wall_time_s")}
    return Evaluation(name, str(checkpoint), metrics, run, cfg, system, test_images, test_labels, test_lat, test_counts,
                      test_presence, reports, neighbours, device, t0)


def heldout_bound(system, images: torch.Tensor, ecfg, device: str = "cpu", progress: bool = False) -> dict | None:
    """The K-sample importance bound on ``log p(x)`` (:func:`~probcaps.inference.likelihood.log_likelihood_bound`,
    presences scored by their logits' densities) for each K of ``eval.likelihood_samples``, on the first
    ``eval.likelihood_images`` of ``images``: ``{"n_images", "samples": {K: {mean, stderr, n, gain}}}`` with the gain
    over the smallest K image by image; None for a guide with point-mass poses (its bound: ``log p(x, poses)``)."""
    if system.guide_spec["family"] != "normal" or not ecfg.likelihood_samples:
        return None
    images = images[:ecfg.likelihood_images or None]
    samples = sorted(set(ecfg.likelihood_samples))
    per_k = {}
    for k in samples:
        per_k[k] = log_likelihood_bound(system.model, system.guide, images, k, device=device)
        if progress:
            print(f"held-out bound, K = {k}: {float(per_k[k].mean()):.1f} nats per image", flush=True)
    return {"n_images": len(images),
            "samples": {str(k): {**bound_summary(b), "gain": bound_summary(b - per_k[samples[0]])}
                        for k, b in per_k.items()}}


def check_figures(figures: bool | Collection[str]) -> bool | Collection[str]:
    """``figures`` as given, where it is a bool or names figures of :data:`FIGURES` alone (else ConfigError)."""
    if not isinstance(figures, bool) and (unknown := sorted(set(figures) - set(FIGURES))):
        raise ConfigError(f"--figures: no figure named {', '.join(unknown)} (the figures: {', '.join(FIGURES)})")
    return figures


def write_evaluation(ev: Evaluation, results_dir: str | Path = "results", figures: bool | Collection[str] | None = None,
                     figures_dir: str | Path | None = None) -> dict:
    """Write what :func:`compute_evaluation` measured: ``results_dir/<name>.json`` (metrics + provenance) and its
    table, both or neither, and with ``figures`` (default: the eval config's) ``figures_dir/<name>_<figure>.png``
    (default: in ``results_dir``): every figure of :data:`FIGURES` when ``figures`` is true, those it names when it
    is a collection of names; under ``torchrun`` rank 0 alone writes.  Returns the metrics and the run."""
    name, metrics, run, cfg, system, device = ev.name, ev.metrics, ev.run, ev.cfg, ev.system, ev.device
    test_images, test_labels, test_lat, test_counts = ev.test_images, ev.test_labels, ev.test_latents, ev.test_counts
    test_presence, reports, neighbours, ecfg = ev.test_presence, ev.reports, ev.neighbours, cfg["eval"]
    seed, state, checkpoint, t0 = run["seed"], cfg.get("train_state", {}), ev.checkpoint, ev.started
    if init_from_env().rank > 0:  # under torchrun: every process computes, rank 0 alone writes
        return metrics | run
    results_dir = Path(results_dir)
    prefix = Path(results_dir if figures_dir is None else figures_dir) / name
    figures = check_figures(ecfg.figures if figures is None else figures)
    only = None if isinstance(figures, bool) else set(figures)

    def wanted(figure: str) -> bool:
        return only is None or figure in only

    figure_paths = []
    if figures:
        counts_by_class, classes = mean_by_class(test_counts, test_labels)
        presence_by_class, _ = mean_by_class(test_presence, test_labels)
        figure_paths = save_figures(system, test_images, prefix, device=device, neighbours=neighbours, only=only)
        if wanted("presence_by_class"):
            figure_paths.append(str(plotting.plot_heatmap(
                presence_by_class.T, f"{prefix}_presence_by_class.png", row_labels=classes, xlabel="object capsule",
                ylabel="digit class", title="mean object presence per class (test set)", vmin=0, vmax=1,
                colorbar_label="presence")))
        if wanted("objects_by_class"):
            # objects on whatever the digit show as full columns, class-specific ones as a scattered pattern
            figure_paths.append(str(plotting.plot_objects_by_class(
                {"mean expected part count": counts_by_class, "mean presence": presence_by_class},
                f"{prefix}_objects_by_class.png", class_labels=classes,
                title=f"objects by class (test set): class purity {metrics['object_class_purity']:.2f} by part "
                      f"counts, {metrics['object_class_purity_presence']:.2f} by presences")))
        for (kind, key), report in reports.items():
            if wanted(figure := f"confusion_{key if kind == 'probe' else f'kmeans_{key}'}"):
                figure_paths.append(str(plotting.plot_confusion_matrix(
                    report["confusion"], f"{prefix}_{figure}.png", class_labels=report["classes"],
                    xlabel="predicted class" if kind == "probe" else "class its k-means cluster is matched to",
                    title=f"{'linear probe' if kind == 'probe' else 'k-means (10)'} on {READOUTS[key]}: test "
                          f"accuracy {100 * report['accuracy']:.1f}%")))
        if wanted("objects_drawn") and (drawings := object_drawings(system.model, test_lat, test_images)) is not None:
            figure_paths.append(str(plot_object_drawings(drawings, f"{prefix}_objects_drawn.png",
                                                         "objects drawn alone at their mean latents (test set)")))
    prov = provenance(seed=seed, steps=state.get("step"), wall_time_s=state.get("wall_time_s"),
                      device=device, checkpoint=str(checkpoint), eval_wall_time_s=time.perf_counter() - t0,
                      configs={k: v.to_dict() for k, v in cfg.items() if hasattr(v, "to_dict")}, figures=figure_paths)
    with restored_on_failure(results_dir / f"{name}.json"):  # the JSON and its table, or neither
        write_results(results_dir / f"{name}.json", metrics, prov)
        write_table(results_dir, name, readout_table(results_dir, name))
    return metrics | run



def evaluate_checkpoint(checkpoint: str | Path, name: str | None = None, results_dir: str | Path = "results",
                        data_dir=None, device: str = "cpu", overrides: list[str] = (), progress: bool = True,
                        figures: bool | Collection[str] | None = None, seed_suffix: bool = False, eval_config=None,
                        figures_dir: str | Path | None = None) -> dict:
    """Probe and k-means accuracies on every readout of :data:`READOUTS`, the objects' class purity, per-class
    accuracies of the probes of :data:`REPORTED_PROBES`, test ELBO and reconstruction error of a checkpoint.

    Probes are fit on the training features and scored on both splits; k-means (10 clusters, matched by the
    Hungarian algorithm) is fit on each split.  :func:`compute_evaluation` measures, then :func:`write_evaluation`
    writes ``results_dir/<name>.json`` (metrics + provenance) and, with ``figures`` (true: all of :data:`FIGURES`,
    or the ones it names), ``figures_dir/<name>_*.png`` (default: in ``results_dir``; under ``torchrun``: rank 0
    alone); returns the metrics (``probe_<readout>_<split>_acc``,
    ``kmeans_<readout>_<split>_acc``, ``probe_<readout>_test_report`` for :data:`REPORTED_PROBES`,
    ``kmeans_<readout>_test_report`` for :data:`REPORTED_KMEANS`, ``object_class_purity[_presence]``,
    ``dominant_object_test_acc`` (:func:`~probcaps.metrics.dominant_object_accuracy` of the posterior part counts),
    ``object_information``: the mutual information (nats) between a training image and the object that explains
    one of its parts, of the posterior part counts of all the training images, which uses no label, ...)
    and the run's ``seed``, ``steps`` and ``train_wall_time_s``.  ``seed_suffix``: the files are
    ``<name>_seed<the training seed>``.  ``eval_config``: the evaluation's settings (an ``EvalConfig``, before
    ``overrides``) in place of those the model was trained with: a recipe's readouts, changed since, apply to its
    trained models.
    """
    if figures is not None:
        check_figures(figures)  # before the model is read out, not after
    return write_evaluation(compute_evaluation(checkpoint, name, data_dir, device, overrides, progress, seed_suffix,
                                               eval_config), results_dir, figures, figures_dir)


def evaluate_seeds(checkpoints: list, name: str, results_dir: str | Path = "results", device: str = "cpu",
                   figures: bool | Collection[str] = True, **kwargs) -> dict:
    """:func:`evaluate_checkpoint` of each of ``checkpoints`` (one per training seed) into
    ``results_dir/<name>_seed<S>.json`` and its table (the ``figures`` of the first seed alone), then ``<name>.json``:
    the seeds' metrics (``per_seed``), the mean and standard deviation of each number over them, and its table."""
    from probcaps.runner import seed_summary

    t0 = time.perf_counter()
    check_file_name(name, "--name")
    check_figures(figures)
    seen = {}  # every checkpoint read before anything is written; one file per seed
    for path in checkpoints:
        seed = stored_config(load_checkpoint(path), path)["train"].seed
        if seed in seen:
            raise CheckpointError(f"{path}: trained with seed {seed}, like {seen[seed]}; give one checkpoint per seed")
        seen[seed] = path
    runs = [evaluate_checkpoint(path, name, results_dir, device=device, figures=figures if i == 0 else False,
                                seed_suffix=True, **kwargs) for i, path in enumerate(checkpoints)]
    runs = [{k: v for k, v in run.items() if not isinstance(v, dict)} for run in runs]  # the per-class reports stay
    summary = {"per_seed": runs, **seed_summary(runs, [k for k, v in runs[0].items()
                                                       if isinstance(v, float) and k != "train_wall_time_s"])}
    summary["published_scae"] = dict(SCAE_PUBLISHED)
    if init_from_env().rank > 0:
        return summary
    prov = provenance(seed=[r["seed"] for r in runs], steps=runs[0]["steps"], device=device,
                      wall_time_s=[r["train_wall_time_s"] for r in runs], checkpoints=[str(c) for c in checkpoints],
                      eval_wall_time_s=time.perf_counter() - t0)
    with restored_on_failure(Path(results_dir) / f"{name}.json"):  # the JSON and its table, or neither
        write_results(Path(results_dir) / f"{name}.json", summary, prov)
        write_table(results_dir, name, readout_table(results_dir, name))
    return summary


def nonlinear_label(key: str) -> str:
    """The row head of a :data:`NONLINEAR_PROBES` readout in the tables, whose probe column it shares."""
    return f"{READOUTS.get(key) or LAYER_READOUTS[key]}, two-layer network"


def readout_table(results_dir: str | Path, name: str) -> str | None:
    """The table of ``results_dir/<name>.json`` written by :func:`evaluate_checkpoint`: probe and k-means on every
    readout (train / test), beside SCAE's; None when the file does not exist."""
    loaded = load_result(results_dir, name)
    if loaded is not None and "probe_posterior_counts_test_acc_mean" in loaded[0]:
        return seeds_readout_table(*loaded)
    if loaded is None or "probe_posterior_counts_test_acc" not in loaded[0]:
        return None
    m, prov = loaded

    def pct(key: str) -> str:
        return f"{100 * m[f'{key}_train_acc']:.1f} / {100 * m[f'{key}_test_acc']:.1f}"

    lines = ["| object features (MNIST, 40×40) | linear probe, train / test (%) | k-means (10) + Hungarian, "
             "train / test (%) |", "| --- | --- | --- |"]
    # a readout added since the file was written has no row
    lines += [f"| {label} | {pct(f'probe_{key}')} | {pct(f'kmeans_{key}')} |" for key, label in READOUTS.items()
              if f"probe_{key}_test_acc" in m]
    lines += [f"| {label} | {pct(f'probe_{key}')} | — |" for key, label in LAYER_READOUTS.items()
              if f"probe_{key}_test_acc" in m]
    lines += [f"| {nonlinear_label(key)} | {pct(f'mlp_{key}')} | — |" for key in NONLINEAR_PROBES
              if f"mlp_{key}_test_acc" in m]
    lines.append(f"| SCAE (Kosiorek et al. 2019, Table 1) | {100 * SCAE_PUBLISHED['probe_test_acc']:.1f} (test) | "
                 f"{100 * SCAE_PUBLISHED['kmeans_test_acc']:.1f} (test) |")
    return "\n".join(lines + [
        "",
        f"Objects' class purity {m['object_class_purity']:.3f} by expected part counts, "
        f"{m['object_class_purity_presence']:.3f} by presences (0.1: no class preference); "
        f"{m['mean_active_parents']:.1f} objects on per image, {m['parents_in_use']} in use; "
        + (f"each image read as the class its dominant object explains most in training "
           f"{100 * m['dominant_object_test_acc']:.1f}% (one cluster per object); "
           if "dominant_object_test_acc" in m else "")
        + (f"{100 * m['certain_parent_share']:.0f}% of the parts on have a certain parent (posterior > 0.99); "
           if "certain_parent_share" in m else "")
        + (f"object information on the training images {m['object_information']:.3f} nats; "
           if "object_information" in m else "")
        + (f"share of the part-pose spread the objects predict {m['part_pose_explained']:.3f}; "
           if "part_pose_explained" in m else "")
        + bound_text(m.get("heldout_bound"), "heldout_bound" in m)
        + f"probes fit on "
        f"{m['n_train']} training images, scored on {m['n_test']} test images; checkpoint `{prov.get('checkpoint')}`; "
        + provenance_line(prov)])


def bound_text(bound: dict | None, measured: bool = True) -> str:
    """The held-out bound of :func:`heldout_bound` as a clause of a table's footer ("" where it was not measured)."""
    if not measured:
        return ""
    if bound is None:
        return "no held-out bound on log p(x) (point-mass poses bound log p(x, poses) instead); "
    cells = ", ".join(f"K = {k}: {b['mean']:.1f} ± {b['stderr']:.1f}" for k, b in bound["samples"].items())
    return (f"held-out bound on log p(x), nats per image ± s.e. over the first {bound['n_images']} test images: "
            f"{cells}; ")


def seeds_readout_table(m: dict, prov: dict) -> str:
    """The table of an :func:`evaluate_seeds` summary: test accuracy of the probe and of k-means on every readout,
    mean ± std over the seeds, beside SCAE's."""
    runs = m["per_seed"]

    def ms(key: str, scale: float = 100.0, digits: int = 1) -> str:
        return fmt_mean_std([r[key] for r in runs], scale=scale, digits=digits)

    lines = [f"| object features (MNIST test, 40×40) | linear probe (%), mean ± std over {len(runs)} seeds | "
             "k-means (10) + Hungarian (%) |", "| --- | --- | --- |"]
    lines += [f"| {label} | {ms(f'probe_{key}_test_acc')} | {ms(f'kmeans_{key}_test_acc')} |"
              for key, label in READOUTS.items() if all(f"probe_{key}_test_acc" in r for r in runs)]
    lines += [f"| {label} | {ms(f'probe_{key}_test_acc')} | — |"
              for key, label in LAYER_READOUTS.items() if all(f"probe_{key}_test_acc" in r for r in runs)]
    lines += [f"| {nonlinear_label(key)} | {ms(f'mlp_{key}_test_acc')} | — |"
              for key in NONLINEAR_PROBES if all(f"mlp_{key}_test_acc" in r for r in runs)]
    lines.append(f"| SCAE (Kosiorek et al. 2019, Table 1) | {100 * SCAE_PUBLISHED['probe_test_acc']:.1f} | "
                 f"{100 * SCAE_PUBLISHED['kmeans_test_acc']:.1f} |")
    minutes = ", ".join(f"{w / 60:.0f}" if w is not None else "—" for w in prov.get("wall_time_s") or [])
    return "\n".join(lines + [
        "",
        f"Objects' class purity {ms('object_class_purity', 1.0, 3)} by expected part counts, "
        f"{ms('object_class_purity_presence', 1.0, 3)} by presences (0.1: no class preference); "
        f"{ms('mean_active_parents', 1.0)} objects on per image; objects in use per seed: "
        f"{', '.join(str(r['parents_in_use']) for r in runs)}; "
        + (f"each image read as the class its dominant object explains most in training "
           f"{ms('dominant_object_test_acc')}% (one cluster per object); "
           if all("dominant_object_test_acc" in r for r in runs) else "")
        + (f"{ms('certain_parent_share', 100.0, 0)}% of the parts on have a certain parent (posterior > 0.99); "
           if "certain_parent_share" in runs[0] else "")
        + (f"share of the part-pose spread the objects predict {ms('part_pose_explained', 1.0, 3)}; "
           if all("part_pose_explained" in r for r in runs) else "")
        + "".join(f"held-out bound on log p(x), K = {key.removeprefix('heldout_bound_k')}: {ms(key, 1.0)} nats per "
                  f"image; " for key in runs[0] if key.startswith("heldout_bound_k") and all(key in r for r in runs))
        + f"probes fit on {runs[0]['n_train']} training images, "
        f"scored on {runs[0]['n_test']} test images; seeds {', '.join(str(r['seed']) for r in runs)}; "
        f"{runs[0]['steps']} steps each; training wall time per seed (min): {minutes}; checkpoints "
        + ", ".join(f"`{c}`" for c in prov.get("checkpoints", [])) + "; " + provenance_line(prov)]
        + ([] if not all("object_information" in r for r in runs) else information_rows(runs)))


def information_rows(runs: list[dict]) -> list[str]:
    """Each seed's label-free object information beside its k-means accuracy on the posterior presences, the most
    informative seed first, and their rank correlation over the seeds: how well the information, which needs no
    label, picks the seed whose objects cluster by class."""
    from scipy.stats import spearmanr

    pairs = [(r["object_information"], r["kmeans_posterior_counts_test_acc"]) for r in runs]
    rows = ["", "| seed | object information, training images (nats) | k-means on the posterior presences, test (%) |",
            "| --- | --- | --- |",
            *(f"| {r['seed']} | {r['object_information']:.3f} | {100 * r['kmeans_posterior_counts_test_acc']:.1f} |"
              for r in sorted(runs, key=lambda r: -r["object_information"]))]
    if len(runs) < 3 or any(len(set(column)) == 1 for column in zip(*pairs)):
        return rows  # a correlation of two points, or of a constant, says nothing
    rho = spearmanr(*zip(*pairs))[0]
    return rows + ["", f"Rank correlation (Spearman) of the two over the {len(runs)} seeds: {rho:+.2f}."]
