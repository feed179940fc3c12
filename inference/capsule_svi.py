"""Train, load and evaluate the generative capsule model from an experiment config.

This is what the ``probcaps train`` / ``probcaps evaluate`` commands and the experiment scripts call.
"""

from __future__ import annotations

from pathlib import Path

import pyro
import torch
import torch.nn as nn

from probcaps.inference.guides import CapsuleEncoder, DeltaGuide, EncoderConfig, Latents, from_delta
from probcaps.inference.train import TrainConfig, TrainState, load_checkpoint, load_module_state, make_elbo, train_loop
from probcaps.models.capsule_model import CapsuleModel, CapsuleModelConfig, parent_usage_penalty, presence_entropy
from probcaps.distributions import ClampedRelaxedBernoulli, bound_logits
from probcaps.config import DataConfig, EvalConfig, load_sections
from probcaps.data import iterate_batches, placed_mnist, place_on_canvas, random_offsets, synthetic_digits
from probcaps.data.loaders import seeded_generator
from probcaps.errors import CheckpointError, ConfigError

__all__ = [
    "SCHEMA", "load_experiment_config", "load_images", "CapsuleSystem", "train_capsules", "load_trained",
    "encode_dataset", "probe_features",
]

SCHEMA = {
    "name": str,
    "data": DataConfig,
    "model": CapsuleModelConfig,
    "encoder": EncoderConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
}


def load_experiment_config(path: str | Path | None, overrides: list[str] = ()) -> dict:
    cfg = load_sections(path, SCHEMA, overrides)
    if cfg["name"] is None:
        cfg["name"] = Path(path).stem if path else "capsules"
    if cfg["data"].dataset not in ("mnist", "synthetic"):
        raise ConfigError(f"{path}: data.dataset must be 'mnist' or 'synthetic', got {cfg['data'].dataset!r}")
    if cfg["model"].canvas_size != cfg["data"].canvas_size:
        raise ConfigError(f"{path}: model.canvas_size ({cfg['model'].canvas_size}) differs from data.canvas_size "
                          f"({cfg['data'].canvas_size})")
    enc = cfg["encoder"]
    if len(enc.channels) != len(enc.strides):
        raise ConfigError(f"{path}: encoder.channels has {len(enc.channels)} layers but encoder.strides "
                          f"{len(enc.strides)}")
    data = cfg["data"]
    if data.canvas_size < 28 + 2 * data.max_shift:
        raise ConfigError(f"{path}: data.canvas_size ({data.canvas_size}) is too small for a 28-px digit shifted by "
                          f"up to {data.max_shift} px (needs >= {28 + 2 * data.max_shift})")
    return cfg


def load_images(data: DataConfig, split: str, data_dir=None, limit: int | None = None):
    """``(images uint8 (N, H, W), labels (N,))`` of a split, placed on the canvas as ``data`` says."""
    limit = limit if limit is not None else (data.train_limit if split == "train" else data.test_limit)
    limit = limit or None
    if data.dataset == "synthetic":
        n = limit or (2048 if split == "train" else 512)
        digits, labels = synthetic_digits(n, seed=data.seed + (0 if split == "train" else 1))
        offsets = random_offsets(n, data.max_shift, generator=seeded_generator("synthetic", data.seed, split))
        return place_on_canvas(digits, offsets, canvas=data.canvas_size), labels
    placed = placed_mnist(split, data_dir=data_dir, canvas=data.canvas_size, max_shift=data.max_shift,
                          seed=data.seed, limit=limit)
    return placed.images, placed.labels


class CapsuleSystem(nn.Module):
    """The generative model and its guide, as one module (one ``state_dict``, one optimiser)."""

    def __init__(self, model_cfg: CapsuleModelConfig, encoder_cfg: EncoderConfig, guide: dict | None = None):
        super().__init__()
        self.model = CapsuleModel(model_cfg)
        self.encoder = CapsuleEncoder(model_cfg.num_parts, model_cfg.num_parents, encoder_cfg)
        self.guide = DeltaGuide(self.encoder, model_cfg.temperature)
        self.guide_spec = {"family": "delta"}
        if guide and guide.get("family", "delta") != "delta":
            self.use_normal_poses(**{k: v for k, v in guide.items() if k != "family"})

    def use_normal_poses(self, init_scale: float = 0.02, min_scale: float = 1e-3) -> "CapsuleSystem":
        """Swap the delta guide for the full variational pose guide on the same encoder (paper §2.3)."""
        if self.guide_spec["family"] == "normal":
            raise ValueError("CapsuleSystem: the guide already has Normal poses")
        ref = next(self.encoder.parameters())
        self.guide = from_delta(self.guide, init_scale=init_scale, min_scale=min_scale).to(ref.device)
        self.guide_spec = {"family": "normal", "init_scale": init_scale, "min_scale": min_scale}
        return self

    def loss(self, elbo, x: torch.Tensor) -> torch.Tensor:
        """Negative ELBO per image (``s`` enumerated out), plus the regularisers on the guide's object presence
        probabilities if set: ``model.guide_usage_weight`` times their usage balance
        (:func:`models.capsule_model.parent_usage_penalty`) and ``model.guide_certainty_weight`` times their binary
        entropy summed over objects, averaged over images (:func:`models.capsule_model.presence_entropy`)."""
        loss = elbo.differentiable_loss(self.model, self.guide, x) / x.shape[0]
        cfg = self.model.config
        if cfg.guide_usage_weight > 0 or cfg.guide_certainty_weight > 0:
            logits = bound_logits(self.guide.last_parent_logits)  # the guide's presence logits, (B, K)
            if cfg.guide_usage_weight > 0:
                loss = loss + cfg.guide_usage_weight * parent_usage_penalty(torch.sigmoid(logits),
                                                                            self.model.usage_target())
            if cfg.guide_certainty_weight > 0:
                loss = loss + cfg.guide_certainty_weight * presence_entropy(logits).sum(-1).mean()
        return loss

    def reference_loss(self, x: torch.Tensor) -> torch.Tensor:
        """The same negative ELBO per image written directly in torch (``s`` summed by ``logsumexp``).

        Draws the guide's latents in the same order as :class:`DeltaGuide`, so under the same RNG state it returns
        the same value as :meth:`loss`.  The reference for the tests and the Pyro-overhead benchmark.
        """
        if self.guide_spec["family"] != "delta":
            raise NotImplementedError("CapsuleSystem.reference_loss: written for the delta guide only")
        tau = x.new_tensor(self.model.config.temperature)
        part_logits, y0 = self.encoder.encode_parts(x)
        q_z0 = ClampedRelaxedBernoulli(tau, logits=part_logits)
        z0 = q_z0.rsample()
        parent_logits, y1 = self.encoder.encode_parents(y0, z0)
        q_z1 = ClampedRelaxedBernoulli(tau, logits=parent_logits)
        z1 = q_z1.rsample()
        elbo = self.model.log_joint(x, z1, y1, z0, y0) - q_z0.log_prob(z0).sum(-1) - q_z1.log_prob(z1).sum(-1)
        return -elbo.mean()


def train_capsules(cfg: dict, out_dir: str | Path, *, resume: bool = False, device: str = "cpu", data_dir=None,
                   progress: bool = True, system: CapsuleSystem | None = None) -> TrainState:
    """Train the model of ``cfg`` (a :func:`load_experiment_config` dict), checkpointing into ``out_dir``.

    ``system``: continue training this (e.g. a delta-trained system switched to Normal poses with
    :meth:`CapsuleSystem.use_normal_poses`) instead of a fresh one built from ``cfg``.
    """
    pyro.settings.set(module_local_params=True)
    pyro.clear_param_store()
    pyro.enable_validation(cfg["train"].validate)
    torch.manual_seed(cfg["train"].seed)
    if system is None:
        system = CapsuleSystem(cfg["model"], cfg["encoder"])
    system = system.to(device).train()
    images, labels = load_images(cfg["data"], "train", data_dir)
    elbo = make_elbo(cfg["train"].jit)
    tcfg: TrainConfig = cfg["train"]
    rotation = cfg["data"].train_rotation or None

    def batches(epoch: int, start: int):
        for x, _ in iterate_batches(images, labels, tcfg.batch_size, shuffle=True, seed=tcfg.seed, epoch=epoch,
                                    start_batch=start, drop_last=len(images) >= tcfg.batch_size, device=device,
                                    rotation=rotation):
            yield x

    metadata = {"name": cfg["name"], "configs": {k: v.to_dict() for k, v in cfg.items() if hasattr(v, "to_dict")},
                "kind": "capsule_model", "guide": system.guide_spec}
    return train_loop(system, lambda x: system.loss(elbo, x), batches, tcfg, out_dir, resume=resume,
                      metadata=metadata, progress=progress)


def load_trained(checkpoint: str | Path, device: str = "cpu", overrides: list[str] = ()):
    """Rebuild ``(cfg, system)`` from a checkpoint written by :func:`train_capsules`."""
    pyro.settings.set(module_local_params=True)
    ckpt = load_checkpoint(checkpoint, map_location=device)
    meta = ckpt.get("metadata", {})
    if meta.get("kind") != "capsule_model":
        raise CheckpointError(f"{checkpoint}: not a capsule-model checkpoint (kind {meta.get('kind')!r})")
    raw = dict(meta["configs"])
    cfg = {"name": meta.get("name", Path(checkpoint).parent.name)}
    for key, cls in SCHEMA.items():
        if cls is not str:
            known = {k: v for k, v in raw.get(key, {}).items() if k in cls.__dataclass_fields__}
            cfg[key] = cls(**known)
    if overrides:
        from probcaps.config import parse_override

        for item in overrides:
            section, key, value = parse_override(item)
            if section not in cfg or not hasattr(cfg[section], key):
                raise ConfigError(f"--set {item}: unknown key '{section}.{key}'")
            setattr(cfg[section], key, value)
    system = CapsuleSystem(cfg["model"], cfg["encoder"], guide=meta.get("guide")).to(device)
    load_module_state(system, ckpt["module"], checkpoint)
    system.eval()
    cfg["train_state"] = ckpt.get("state", {})
    return cfg, system


@torch.no_grad()
def encode_dataset(encoder: CapsuleEncoder, images: torch.Tensor, batch_size: int = 500, device: str = "cpu",
                   progress: bool = False, rotation: float | None = None, seed: int = 0) -> Latents:
    """Encode uint8 ``(N, H, W)`` images (or floats in [0, 1]) in batches; returns :class:`Latents` on the CPU.

    ``rotation``: rotate image ``i`` by an angle uniform in ``[-rotation, rotation]`` degrees first, the angles a
    pure function of ``seed`` (as :func:`probcaps.data.iterate_batches` draws them).
    """
    from tqdm.auto import tqdm

    labels = torch.zeros(len(images), dtype=torch.long)
    chunks = []
    batches = iterate_batches(images, labels, batch_size, shuffle=False, device=device, rotation=rotation, seed=seed)
    for x, _ in tqdm(batches, total=-(-len(images) // batch_size), disable=not progress, desc="encode"):
        chunks.append([t.cpu() for t in encoder.encode(x)])
    return Latents(*(torch.cat(parts) for parts in zip(*chunks)))


def probe_features(latents: Latents) -> dict[str, torch.Tensor]:
    """The feature sets of the paper's probes: object presence logits alone, and presences with object poses."""
    presence = latents.parent_logits
    return {
        "presence": presence,
        "presence_pose": torch.cat([presence, latents.parent_poses.flatten(1)], 1),
    }
