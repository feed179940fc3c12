"""Train, load and encode with the generative capsule model of an experiment config (``probcaps train`` /
``probcaps evaluate`` and the experiment scripts)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pyro
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from probcaps.checkpoints import load_checkpoint, load_module_state
from probcaps.config import (
    DataConfig,
    EvalConfig,
    check_file_name,
    check_sections,
    load_sections,
    parse_override,
    replace_checked,
)
from probcaps.data import iterate_batches, place_on_canvas, placed_mnist, random_offsets, synthetic_digits
from probcaps.data.loaders import seeded_generator
from probcaps.distributions import ClampedRelaxedBernoulli
from probcaps.errors import CheckpointError, ConfigError
from probcaps.inference.distributed import init_from_env
from probcaps.inference.guides import CapsuleEncoder, DeltaGuide, EncoderConfig, Latents, from_delta
from probcaps.inference.objectives import training_loss
from probcaps.inference.train import TrainConfig, TrainState, make_elbo, train_loop
from probcaps.models.capsule_model import CapsuleModel, CapsuleModelConfig, object_information

__all__ = ["SCHEMA", "REMOVED_OPTIONS", "load_experiment_config", "check_across_sections", "stored_config",
           "load_images", "prior_schedule", "CapsuleSystem", "train_capsules", "load_trained", "encode_dataset",
           "probe_features"]

SCHEMA = {"name": str, "data": DataConfig, "model": CapsuleModelConfig, "encoder": EncoderConfig, "train": TrainConfig,
          "eval": EvalConfig}

# Options that no shipped recipe uses any more, with the value that meant "off" and the last commit that had them
# (README and docs/ say what each did and which results used it).  A checkpoint that holds one at that value loads
# without it; one trained with it on names the commit to check out.
REMOVED_OPTIONS = {  # option: (its off value, the last commit that had it)
    "model": {"presence_sparsity_weight": (0.0, "e00fb33"), "parent_usage_weight": (0.0, "e00fb33"),
              "guide_usage_weight": (0.0, "e00fb33"), "guide_certainty_weight": (0.0, "e00fb33"),
              "learn_parent_prior": (False, "e00fb33"), "template_init": ("blob", "e00fb33"),
              "within_image_entropy_weight": (0.0, "a9c4f67"), "between_image_entropy_weight": (0.0, "a9c4f67"),
              "object_information_warmup_steps": (0, "4a3ce0d"), "object_within_weight": (0.0, "b14005e"),
              "presence_patterns": (0, "77ec531"), "object_split_steps": ([], "fdb571e")},
    "encoder": {"parent_pose_scale": (1.0, "e00fb33"), "object_pose_scales": (False, "a9c4f67"),
                "parts_on": (0.0, "d12edc5")},
}

# state the model no longer keeps: the annealed prior's step counter (the training loop owns the schedule) and the
# fixed prior's logits (computed from model.expected_parents)
_LEGACY_STATE = ("model.prior_step", "model.parent_prior_logits")


def load_experiment_config(path: str | Path | None, overrides: list[str] = ()) -> dict:
    cfg = load_sections(path, SCHEMA, overrides)
    label = str(path) if path else "<defaults>"
    if cfg["name"] is None:
        cfg["name"] = Path(path).stem if path else "capsules"
    check_file_name(cfg["name"], f"{label}: name")
    return check_across_sections(cfg, label)


def check_across_sections(cfg: dict, label: str) -> dict:
    """What no one section's checks can say, for a config file and a checkpoint's stored config alike: the model
    draws on the data's canvas (``label``: the file, named by the one-line error)."""
    if cfg["model"].canvas_size != cfg["data"].canvas_size:  # the data section's own checks: DataConfig.validate
        raise ConfigError(f"{label}: model.canvas_size ({cfg['model'].canvas_size}) differs from data.canvas_size "
                          f"({cfg['data'].canvas_size})")
    return cfg


def load_images(data: DataConfig, split: str, data_dir=None, limit: int | None = None):
    """``(images uint8 (N, H, W), labels (N,))`` of a split, placed on the canvas as ``data`` says."""
    limit = (limit if limit is not None else data.train_limit if split == "train" else data.test_limit) or None
    if data.dataset == "synthetic":
        n = limit or (2048 if split == "train" else 512)
        digits, labels = synthetic_digits(n, seed=data.seed + (0 if split == "train" else 1))
        offsets = random_offsets(n, data.max_shift, generator=seeded_generator("synthetic", data.seed, split))
        return place_on_canvas(digits, offsets, canvas=data.canvas_size), labels
    placed = placed_mnist(split, data_dir=data_dir, canvas=data.canvas_size, max_shift=data.max_shift,
                          seed=data.seed, limit=limit)
    return placed.images, placed.labels


def prior_schedule(model_cfg: CapsuleModelConfig) -> Callable[[int], float] | None:
    """The object prior's anneal as the training loop evaluates it: ``step -> expected objects per image``, linear
    from ``expected_parents_start`` at step 0 to ``expected_parents`` at ``prior_anneal_steps``, constant after
    (``None`` when ``prior_anneal_steps`` is 0: the model's fixed prior)."""
    n, start, end = model_cfg.prior_anneal_steps, model_cfg.expected_parents_start, model_cfg.expected_parents
    if not n:
        return None
    return lambda step: start + (end - start) * min(step, n) / n


class CapsuleSystem(nn.Module):
    """The generative model and its guide, as one module (one ``state_dict``, one optimiser)."""

    def __init__(self, model_cfg: CapsuleModelConfig, encoder_cfg: EncoderConfig, guide: dict | None = None,
                 compile: bool = False):
        super().__init__()
        # compile (train.compile): the model's compositing and the part CNN through torch.compile
        self.model = CapsuleModel(model_cfg, compile=compile)
        self.encoder = CapsuleEncoder(model_cfg.num_parts, model_cfg.num_parents, encoder_cfg, compile=compile,
                                      object_pose=model_cfg.object_pose, object_code_dims=model_cfg.object_code_dims)
        self.guide = DeltaGuide(self.encoder, model_cfg.temperature, model_cfg.presences)
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

    def negative_elbo(self, elbo, x: torch.Tensor, expected_parents: float | None = None, guide=None) -> torch.Tensor:
        """Negative ELBO per image (``s`` enumerated out), averaged over the batch ``x``; ``expected_parents``: the
        prior at this training step (:func:`prior_schedule`; ``None``: the config's final value); ``guide``: the
        guide to score (default: the system's)."""
        guide = guide or self.guide
        return elbo.differentiable_loss(self.model, guide, x, expected_parents=expected_parents) / x.shape[0]

    def loss(self, elbo, x: torch.Tensor, expected_parents: float | None = None):
        """The training loss: :meth:`negative_elbo`, and with ``model.object_information_weight``, that weight times
        the mutual information between an image and its objects
        (:func:`~probcaps.models.capsule_model.object_information` of the expected part counts, at the guide's
        sample this ELBO scores; its within-image entropy scaled by ``model.object_within_share``) subtracted, the
        loss then returned as ``(loss, {"within_entropy", "between_entropy"})`` for the training log.
        """
        weight = self.model.config.object_information_weight
        if not weight:
            return self.negative_elbo(elbo, x, expected_parents)
        drawn = []

        def guide(*args, **kwargs):  # keeps the latents the ELBO scores (one particle: one call)
            drawn.append(self.guide(*args, **kwargs))
            return drawn[-1]

        neg_elbo = self.negative_elbo(elbo, x, expected_parents, guide=guide)
        counts = self.model.parent_log_posterior(*drawn[-1])[..., 1:].exp().sum(-2)   # (B, K), the dummy left out
        within, between = object_information(counts)
        share = self.model.config.object_within_share
        return neg_elbo - weight * (between - share * within), {"within_entropy": within.item(),
                                                                "between_entropy": between.item()}

    def reference_loss(self, x: torch.Tensor, expected_parents: float | None = None) -> torch.Tensor:
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
        log_q = q_z0.log_prob(z0).sum(-1) + q_z1.log_prob(z1).sum(-1)
        elbo = self.model.log_joint(x, z1, y1, z0, y0, expected_parents) - log_q
        return -elbo.mean()


def train_capsules(cfg: dict, out_dir: str | Path, *, resume: bool = False, device: str = "cpu", data_dir=None,
                   progress: bool = True, system: CapsuleSystem | None = None, **loop_options) -> TrainState:
    """Train the model of ``cfg`` (a :func:`load_experiment_config` dict), checkpointing into ``out_dir``.

    ``system``: continue training this (e.g. a delta-trained system switched to Normal poses with
    :meth:`CapsuleSystem.use_normal_poses`) instead of a fresh one built from ``cfg``.
    ``loop_options``: passed on to :func:`~probcaps.inference.train.train_loop` (e.g. ``force``, ``tensorboard``).
    """
    pyro.settings.set(module_local_params=True)
    pyro.clear_param_store()
    tcfg: TrainConfig = cfg["train"]
    pyro.enable_validation(tcfg.validate)
    torch.manual_seed(tcfg.seed)
    if system is None:
        system = CapsuleSystem(cfg["model"], cfg["encoder"], compile=tcfg.compile)
    system = system.to(device).train()
    images, labels = load_images(cfg["data"], "train", data_dir)
    if tcfg.jit and cfg["model"].object_information_weight:
        raise ConfigError("train.jit: the JIT ELBO never calls the guide in Python, so it cannot add "
                          "model.object_information_weight's term; set one or the other")
    loss_fn = training_loss(system, tcfg, make_elbo(tcfg.jit))  # train.objective
    rotation = cfg["data"].train_rotation or None

    def batches(epoch: int, start: int):
        return (x for x, _ in iterate_batches(images, labels, tcfg.batch_size, shuffle=True, seed=tcfg.seed,
                                              epoch=epoch, start_batch=start, drop_last=len(images) >= tcfg.batch_size,
                                              device=device, rotation=rotation))

    metadata = {"name": cfg["name"], "configs": {k: v.to_dict() for k, v in cfg.items() if hasattr(v, "to_dict")},
                "kind": "capsule_model", "guide": system.guide_spec}
    schedule = prior_schedule(cfg["model"])
    return train_loop(system, loss_fn, batches, tcfg, out_dir,
                      resume=resume, metadata=metadata, progress=progress,
                      schedules={"expected_parents": schedule} if schedule else None, **loop_options)


def load_trained(checkpoint: str | Path, device: str = "cpu", overrides: list[str] = (), eval_config=None):
    """Rebuild ``(cfg, system)`` from a checkpoint written by :func:`train_capsules`; ``eval_config`` (an
    ``EvalConfig``) replaces the evaluation settings it was trained with, ``overrides`` (``section.key=value``) go
    on top."""
    pyro.settings.set(module_local_params=True)
    ckpt = load_checkpoint(checkpoint, map_location=device)
    cfg = stored_config(ckpt, checkpoint)
    meta = ckpt.get("metadata", {})
    if eval_config is not None:
        cfg["eval"] = eval_config
    for item in overrides:
        section, key, value = parse_override(item)
        if section not in cfg or not hasattr(cfg[section], key):
            raise ConfigError(f"--set {item}: unknown key '{section}.{key}'")
        cfg[section] = replace_checked(cfg[section], {key: value}, f"--set {item}: {section}")
    if overrides:
        check_across_sections(cfg, f"{checkpoint} with --set {' '.join(overrides)}")
    system = CapsuleSystem(cfg["model"], cfg["encoder"], guide=meta.get("guide")).to(device)
    load_module_state(system, {k: v for k, v in ckpt["module"].items() if k not in _LEGACY_STATE}, checkpoint)
    system.eval()
    cfg["train_state"] = ckpt.get("state", {})
    return cfg, system


def stored_config(ckpt: dict, checkpoint: str | Path) -> dict:
    """The experiment config stored in a checkpoint of :func:`train_capsules` (``{"name": ..., section: dataclass}``),
    through the checks a config file gets (:func:`probcaps.config.check_sections`, :func:`check_across_sections`);
    anything missing, of the wrong type or out of range is a one-line error naming the checkpoint and the key.
    Keys a section no longer has are dropped, and keys it has gained since take their defaults: a checkpoint may
    predate either."""
    meta = ckpt.get("metadata", {})
    if meta.get("kind") != "capsule_model":
        raise CheckpointError(f"{checkpoint}: not a capsule-model checkpoint (metadata.kind {meta.get('kind')!r})")
    configs = meta.get("configs")
    if not isinstance(configs, dict):
        raise CheckpointError(f"{checkpoint}: metadata.configs: missing or not a dict (got {type(configs).__name__}); "
                              f"the checkpoint cannot say which model it holds")
    for key, cls in SCHEMA.items():
        if cls is str:
            continue
        if not isinstance(section := configs.get(key), dict):
            raise CheckpointError(f"{checkpoint}: configs.{key}: " + ("missing" if section is None else
                                  f"must be a dict, got {type(section).__name__}"))
        for option, (off, commit) in REMOVED_OPTIONS.get(key, {}).items():
            if option in section and section[option] != off:
                raise CheckpointError(f"{checkpoint}: trained with {key}.{option} = {section[option]!r}, an "
                                      f"option removed after commit {commit} (git checkout {commit} to use it)")
    cfg = {"name": check_file_name(meta.get("name", Path(checkpoint).parent.name), f"{checkpoint}: name"),
           **check_sections(configs, SCHEMA, str(checkpoint))}
    guide = meta.get("guide", {"family": "delta"})
    if not isinstance(guide, dict) or guide.get("family", "delta") not in ("delta", "normal"):
        raise CheckpointError(f"{checkpoint}: metadata.guide: must be {{'family': 'delta'}} or {{'family': 'normal', "
                              f"...}}, got {guide!r}")
    for key, value in guide.items():
        if key != "family" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not 0 < value < float("inf")):
            raise CheckpointError(f"{checkpoint}: metadata.guide.{key}: must be a finite number > 0, got {value!r}")
    return check_across_sections(cfg, str(checkpoint))


@torch.no_grad()
def encode_dataset(encoder: CapsuleEncoder, images: torch.Tensor, batch_size: int = 500, device: str = "cpu",
                   progress: bool = False, rotation: float | None = None, seed: int = 0) -> Latents:
    """Encode uint8 ``(N, H, W)`` images (or floats in [0, 1]) in batches; returns :class:`Latents` on the CPU.

    ``rotation``: rotate image ``i`` by an angle uniform in ``[-rotation, rotation]`` degrees first, the angles a
    pure function of ``seed`` (as :func:`probcaps.data.iterate_batches` draws them).  Under ``torchrun`` each process
    encodes its share of the batches, and each returns the whole.
    """
    world = init_from_env()
    mine, batches = world.batches(images, batch_size, device=device, rotation=rotation, seed=seed)
    chunks = [[t.cpu() for t in encoder.encode(x)]
              for _, x in tqdm(batches, total=len(mine), disable=not progress or world.rank > 0, desc="encode")]
    return Latents(*(torch.cat(parts) for parts in zip(*world.gather(chunks))))


def probe_features(latents: Latents) -> dict[str, torch.Tensor]:
    """The feature sets of the paper's probes: object presence logits alone, and presences with object poses; for a
    model with object codes also ``presence_pose_code``, presences with poses and codes."""
    presence, objects = latents.parent_logits, latents.parent_poses
    features = {"presence": presence, "presence_pose": torch.cat([presence, objects[..., :6].flatten(1)], 1)}
    if objects.shape[-1] > 6:
        features["presence_pose_code"] = torch.cat([presence, objects.flatten(1)], 1)
    return features
