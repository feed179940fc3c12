"""A trained generative capsule model behind one object: load it, encode images into named capsules, render them
back, score them, refine them by test-time VI, draw its objects and read features for probes.

    import probcaps

    model = probcaps.load("mnist")                   # a shipped model by name, or the path of a checkpoint
    x, labels = model.load_images("test", limit=8)   # (8, 1, 40, 40) floats in [0, 1], placed as in training
    capsules = model.encode(x)                       # Capsules: presences, poses, codes, parent posterior
    recon = model.reconstruct(x)                     # (8, 1, 40, 40)
    elbo = model.log_likelihood_bound(x, seed=0)     # (8,) the ELBO of each image
    refined = model.ttvi(x, steps=50, seed=0)        # Capsules after test-time VI
    features = model.features(capsules)              # (8, 7K) object presences and poses, for a probe

Every method takes a batch of images ``(N, 1, H, W)``, floats in ``[0, 1]`` with ``H = W`` the model's canvas
(:attr:`TrainedCapsuleModel.canvas_size`), on any device (they are moved to the model's); every tensor it returns is
on the CPU and detached.  Each method is a thin layer over the functions that training, evaluation and the
experiments use (:mod:`probcaps.inference.capsule_svi`, :mod:`probcaps.inference.evaluate`,
:mod:`probcaps.inference.ttvi`): the numbers it gives are theirs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from probcaps.data import to_float
from probcaps.inference.capsule_svi import CapsuleSystem, encode_dataset, load_images, load_trained, probe_features
from probcaps.inference.evaluate import object_drawings, parent_log_posterior, plot_object_drawings
from probcaps.inference.guides import Latents
from probcaps.inference.objectives import log_weights
from probcaps.inference.ttvi import POSE_FAMILIES, TTVIResult, frozen_and_seeded, ttvi_batches
from probcaps.registry import resolve_checkpoint

__all__ = ["load", "TrainedCapsuleModel", "Capsules", "ObjectDrawings"]


@dataclass
class Capsules:
    """The capsules of ``N`` images under a model with ``K`` objects (each with a code of ``D`` coordinates, 0 for the
    paper's model) and ``M`` parts.  All tensors are on the CPU.

    Attributes:
        object_presence: ``(N, K)`` each object's presence probability, ``sigmoid`` of the guide's logit.
        object_pose: ``(N, K, 6)`` each object's pose ``y1`` (the deviation of its affine map from the identity,
            in the model's object-pose group).
        object_code: ``(N, K, D)`` each object's code, which deforms its parts' offsets (``D = 0``: none).
        part_presence: ``(N, M)`` each part's presence probability.
        part_pose: ``(N, M, 6)`` each part's pose ``y0``.
        parent_posterior: ``(N, M, K + 1)`` the exact posterior ``q(s_m = k)`` over each part's parent given the
            capsules above; column 0 is the dummy (clutter) parent, column ``k`` is object ``k - 1``.  Each row sums
            to 1.
        latents: the same capsules as the guide's raw :class:`~probcaps.inference.guides.Latents` (presence logits
            and poses), as the probes and test-time VI take them.
        ttvi: for capsules refined by :meth:`TrainedCapsuleModel.ttvi`, the run's
            :class:`~probcaps.inference.ttvi.TTVIResult` (its ELBO trace and each image's ELBO before and after);
            ``None`` otherwise.
    """

    object_presence: torch.Tensor
    object_pose: torch.Tensor
    object_code: torch.Tensor
    part_presence: torch.Tensor
    part_pose: torch.Tensor
    parent_posterior: torch.Tensor
    latents: Latents
    ttvi: TTVIResult | None = None

    def __len__(self) -> int:
        return self.object_presence.shape[0]


@dataclass
class ObjectDrawings:
    """What :meth:`TrainedCapsuleModel.draw_objects` returns: ``grid`` ``(R, C, H, W)``, one row per object drawn
    (``objects``: its row labels, e.g. ``"object 3"``) and one column per way of drawing it (``columns``)."""

    grid: torch.Tensor
    objects: list[str]
    columns: list[str]

    def plot(self, path: str | os.PathLike, title: str = "objects drawn alone") -> Path:
        """Write the figure (:func:`~probcaps.inference.evaluate.plot_object_drawings`) to ``path``; returns it."""
        return plot_object_drawings((self.grid, self.objects, self.columns), path, title)


def load(name_or_path: str | os.PathLike, device: str | torch.device = "cpu") -> "TrainedCapsuleModel":
    """A trained capsule model: ``name_or_path`` is a shipped model's name (``"mnist"``: ``checkpoints/mnist.pt``)
    or the path of a checkpoint written by ``probcaps train``
    (:func:`~probcaps.registry.resolve_checkpoint`); ``device``: where it computes (``"cpu"``, ``"cuda"``).

    A missing, unreadable or foreign checkpoint is a :class:`~probcaps.errors.CheckpointError` naming it.
    """
    checkpoint = resolve_checkpoint(name_or_path)
    config, system = load_trained(checkpoint, device=str(device))
    return TrainedCapsuleModel(system, config, checkpoint)


class TrainedCapsuleModel:
    """A trained generative capsule model and its guide (:class:`~probcaps.inference.capsule_svi.CapsuleSystem`),
    with the questions a researcher asks of it.  Build one with :func:`load`.

    Attributes:
        system: the :class:`~probcaps.inference.capsule_svi.CapsuleSystem` (``system.model``: the Pyro model,
            ``system.guide``: its guide, ``system.encoder``: the amortised encoder), in eval mode.
        config: the experiment config it was trained with (``{"data": DataConfig, "model": CapsuleModelConfig,
            ...}``, as :func:`~probcaps.inference.capsule_svi.load_trained` rebuilds it).
        checkpoint: the checkpoint file it was loaded from.
    """

    def __init__(self, system: CapsuleSystem, config: dict, checkpoint: str | os.PathLike | None = None):
        self.system, self.config = system.eval(), config
        self.checkpoint = None if checkpoint is None else Path(checkpoint)

    def __repr__(self) -> str:
        return (f"TrainedCapsuleModel({self.name!r}: {self.num_objects} objects, {self.num_parts} parts, "
                f"{self.canvas_size}x{self.canvas_size} canvas, {self.system.guide_spec['family']} guide, "
                f"on {self.device})")

    # ------------------------------------------------------------------------------------------ what it is
    @property
    def model(self):
        """The generative model, a :class:`~probcaps.models.capsule_model.CapsuleModel` (a Pyro model)."""
        return self.system.model

    @property
    def guide(self):
        """The guide, a :class:`~probcaps.inference.guides.DeltaGuide` or ``NormalPoseGuide``."""
        return self.system.guide

    @property
    def name(self) -> str:
        """The name it was trained under."""
        return self.config["name"]

    @property
    def num_objects(self) -> int:
        """``K``, the object capsules (the dummy clutter parent not counted)."""
        return self.model.config.num_parents

    @property
    def num_parts(self) -> int:
        """``M``, the part capsules (one template each)."""
        return self.model.config.num_parts

    @property
    def canvas_size(self) -> int:
        """``H = W`` of the images it takes."""
        return self.model.config.canvas_size

    @property
    def device(self) -> torch.device:
        """Where it computes."""
        return self.model.offsets.device

    def to(self, device: str | torch.device) -> "TrainedCapsuleModel":
        """Move the model and its guide to ``device``; returns ``self``."""
        self.system.to(device)
        return self

    # ------------------------------------------------------------------------------------------ its data
    def load_images(self, split: str = "test", limit: int | None = None,
                    data_dir: str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images (N, 1, H, W) float32 in [0, 1], labels (N,))``: the first ``limit`` images of ``split``
        (``"train"`` / ``"test"``) of the dataset it was trained on, placed on the canvas as in training
        (:func:`~probcaps.inference.capsule_svi.load_images`).  ``data_dir``: the data root (default:
        ``PROBCAPS_DATA``)."""
        images, labels = load_images(self.config["data"], split, data_dir, limit=limit)
        return to_float(images).unsqueeze(1), labels

    def _images(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` checked (``(N, 1, H, W)`` floats in ``[0, 1]``, ``N >= 1``) and moved to the model's device
        and dtype; anything else is a one-line ``ValueError`` naming the argument."""
        H = self.canvas_size
        expected = f"images: expected a float tensor of shape (N, 1, {H}, {H}) with values in [0, 1]"
        if not isinstance(images, torch.Tensor):
            raise ValueError(f"{expected}, got {type(images).__name__}")
        if not images.is_floating_point():
            hint = " (uint8 images: probcaps.data.to_float(images))" if images.dtype == torch.uint8 else ""
            raise ValueError(f"{expected}, got dtype {images.dtype}{hint}")
        if images.dim() != 4 or images.shape[1:] != (1, H, H) or not len(images):
            missing_channel = images.shape[-2:] == (H, H) and images.dim() == 3
            hint = " (add the channel: images.unsqueeze(1))" if missing_channel else ""
            raise ValueError(f"{expected}, got shape {tuple(images.shape)}{hint}")
        low, high = images.aminmax()
        if not (low >= 0 and high <= 1):  # NaN fails both
            raise ValueError(f"{expected}, got values in [{low.item():g}, {high.item():g}]")
        return images.to(device=self.device, dtype=self.model.offsets.dtype)

    def _latents(self, images: torch.Tensor | Capsules) -> Latents:
        """The raw latents of given :class:`Capsules`, or of ``images`` encoded."""
        return images.latents if isinstance(images, Capsules) else self.encode(images).latents

    # ------------------------------------------------------------------------------------------ the questions
    def encode(self, images: torch.Tensor, batch_size: int = 500) -> Capsules:
        """The amortised encoder's capsules of ``images`` ``(N, 1, H, W)``, presences at their means
        (:func:`~probcaps.inference.capsule_svi.encode_dataset`), with the exact posterior over each part's parent
        (:func:`~probcaps.inference.evaluate.parent_log_posterior`); ``batch_size`` images at a time."""
        x = self._images(images)
        latents = encode_dataset(self.system.encoder, x, batch_size, self.device)
        return self.capsules(latents, batch_size)

    @torch.no_grad()
    def capsules(self, latents: Latents, batch_size: int = 500) -> Capsules:
        """:class:`Capsules` of the guide's raw ``latents`` (of the encoder or of test-time VI): presences as
        probabilities, poses split from codes, and the exact posterior over each part's parent."""
        posterior = torch.cat([parent_log_posterior(self.model, Latents(*(t[i:i + batch_size] for t in latents)))
                               .exp().cpu() for i in range(0, len(latents.part_logits), batch_size)])
        return Capsules(object_presence=torch.sigmoid(latents.parent_logits), object_pose=latents.parent_poses[..., :6],
                        object_code=latents.parent_poses[..., 6:], part_presence=torch.sigmoid(latents.part_logits),
                        part_pose=latents.part_poses, parent_posterior=posterior, latents=latents)

    @torch.no_grad()
    def reconstruct(self, images: torch.Tensor | Capsules, batch_size: int = 500) -> torch.Tensor:
        """``(N, 1, H, W)``: the model's rendering of the parts of ``images`` (encoded first) or of given
        :class:`Capsules` (e.g. after :meth:`ttvi`): each template warped by its part's pose and composited at its
        part's presence probability (:meth:`~probcaps.models.capsule_model.CapsuleModel.render`), the mean of the
        model's pixel distribution."""
        latents = self._latents(images)
        return torch.cat([self.model.render(torch.sigmoid(logits.to(self.device)), poses.to(self.device),
                                            contributions=False)[0].cpu()
                          for logits, poses in zip(latents.part_logits.split(batch_size),
                                                   latents.part_poses.split(batch_size))])

    def log_likelihood_bound(self, images: torch.Tensor, *, seed: int | None = None,
                             expected_parents: float | None = None) -> torch.Tensor:
        """``(N,)`` the evidence lower bound of each image, ``log p(x, z, y) − log q(z, y)`` at one sample of the
        guide, each part's parent ``s`` summed out exactly: the value whose negative mean over a batch is the
        training loss (:meth:`~probcaps.inference.capsule_svi.CapsuleSystem.loss`, ``TraceEnum_ELBO``) on it.

        The guide is sampled once, for the whole batch, as the training loss samples it: under the same torch RNG
        state the two agree to rounding.  ``seed``: sample from the torch RNG seeded with it (the caller's RNG is
        left untouched); ``None``: from the global RNG.  ``expected_parents``: the object prior at a point of the
        training anneal (``None``: the trained prior).  A model trained with ``model.object_information_weight``
        adds a term to its loss that is not part of the bound.
        """
        x = self._images(images)
        with frozen_and_seeded((self.model, self.guide), seed, x.device), torch.no_grad():
            # the training ELBO's scoring of the relaxed presences: one importance weight of the guide
            return log_weights(self.model, self.guide, x, 1, presence_density="clamped",
                               expected_parents=expected_parents)[0].cpu()

    def ttvi(self, images: torch.Tensor, steps: int = 200, *, lr: float | None = None, pose_family: str = "delta",
             seed: int | None = 0, batch_size: int = 250, progress: bool = False) -> Capsules:
        """The capsules of ``images`` ``(N, 1, H, W)`` refined by free-form test-time VI
        (:func:`~probcaps.inference.ttvi.ttvi_batches`): each image's own variational parameters, started at the
        encoder's output, optimised on the ELBO for ``steps`` Adam steps of learning rate ``lr`` (``None``:
        :func:`~probcaps.inference.ttvi.run_ttvi`'s) with the model frozen, ``batch_size`` images at a time.
        ``pose_family``: ``"delta"`` (point poses) or ``"normal"``;
        ``seed``: the optimisation's samples (``None``: the global RNG).  The returned capsules carry the run in
        :attr:`Capsules.ttvi` (``ttvi.elbo_start`` / ``ttvi.elbo_end``: each image's ELBO before and after)."""
        x = self._images(images)
        if pose_family not in POSE_FAMILIES:
            raise ValueError(f"pose_family: must be one of {', '.join(POSE_FAMILIES)}, got {pose_family!r}")
        if steps < 0:
            raise ValueError(f"steps: must be >= 0, got {steps}")
        result = ttvi_batches(self.model, self.guide, x, batch_size=batch_size, steps=steps, device=self.device,
                              progress=progress, seed=seed, pose_family=pose_family,
                              **({} if lr is None else {"lr": lr}))
        capsules = self.capsules(result.latents)
        capsules.ttvi = result
        return capsules

    @torch.no_grad()
    def draw_objects(self, images: torch.Tensor | None = None, *, min_share: float = 0.01, components: int = 2,
                     span: float = 2.0) -> ObjectDrawings:
        """What each object draws alone (:meth:`~probcaps.models.capsule_model.CapsuleModel.draw_objects`): each
        part at the pose the object predicts for it, at the probability that the part is on and the object's.

        Without ``images``: every object, at the identity pose with a zero code (its parts at their learned
        offsets from the canvas centre), one column.  With ``images`` ``(N, 1, H, W)``
        (:func:`~probcaps.inference.evaluate.object_drawings`): the objects on (presence > 0.5) in at least
        ``min_share`` of them, each beside the image where it is most present, drawn at its mean latents over the
        images where it is on and, for a model with object codes, with its code moved ``±span`` standard
        deviations along each of its first ``components`` principal directions.  No object on that often is a
        ``ValueError``.
        """
        if images is None:
            y1 = self.model.offsets.new_zeros(self.num_objects, self.model.config.object_dims)
            grid = self.model.draw_objects(y1).cpu()                                      # (K, 1, H, W)
            return ObjectDrawings(grid, [f"object {k}" for k in range(self.num_objects)], ["identity pose"])
        capsules = self.encode(images)
        # object_drawings shows the example images as uint8 (N, H, W), as the dataset holds them
        as_uint8 = (images.detach().cpu().float() * 255).round().to(torch.uint8)[:, 0]
        drawn = object_drawings(self.model, capsules.latents, as_uint8, components=components, span=span,
                                min_share=min_share)
        if drawn is None:
            raise ValueError(f"images: no object is on (presence > 0.5) in a share {min_share:g} of the "
                             f"{len(images)} images (lower min_share)")
        return ObjectDrawings(*drawn)

    def features(self, images: torch.Tensor | Capsules, kind: str = "presence_pose") -> torch.Tensor:
        """``(N, F)`` the features the paper's probes read (:func:`~probcaps.inference.capsule_svi.probe_features`)
        of ``images`` (encoded first) or of given :class:`Capsules`: ``kind`` ``"presence"`` (object presence
        logits, ``F = K``), ``"presence_pose"`` (with the object poses, ``F = 7K``) or, for a model with object
        codes, ``"presence_pose_code"`` (``F = K (7 + D)``)."""
        features = probe_features(self._latents(images))
        if kind not in features:
            raise ValueError(f"kind: must be one of {', '.join(features)} for this model, got {kind!r}")
        return features[kind]
