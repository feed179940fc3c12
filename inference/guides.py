"""Guides for :class:`models.capsule_model.CapsuleModel` (Smith et al. 2020, §2.3-2.4).

The amortised encoder maps an image to the part capsules (a CNN with attentive pooling, one per template) and
their set to the object capsules (a set transformer), with no direct path from the image to the objects.
:class:`DeltaGuide` (point-mass poses) trains the model from scratch; :class:`NormalPoseGuide` starts from it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.nn import PyroModule

from probcaps.config import Section
from probcaps.distributions import ClampedRelaxedBernoulli, inverse_softplus
from probcaps.encoders import PartEncoder, SetTransformer
from probcaps.geometry import restrict_pose6
from probcaps.models.capsule_model import PRESENCE_FAMILIES

__all__ = ["EncoderConfig", "CapsuleEncoder", "Latents", "DeltaGuide", "NormalPoseGuide", "from_delta"]


@dataclass
class EncoderConfig(Section):
    channels: list = field(default_factory=lambda: [128, 128, 128, 128])
    strides: list = field(default_factory=lambda: [2, 2, 1, 1])
    set_hidden: int = 128          # ISAB / PMA width
    set_heads: int = 4
    set_inducing: int = 16
    set_blocks: int = 2            # ISAB blocks before the PMA
    parent_code: int = 32          # per-object encoding fed to the heads
    head_hidden: int = 64          # the one-hidden-layer MLP heads
    part_embedding: int = 16       # learned identity of each part (which template it is)
    part_features: int = 16        # per-part CNN features (unused by the object encoder; 16 for old checkpoints)
    min_scale: float = 0.3
    max_scale: float = 2.0
    max_translation: float = 0.5   # of the offset from where each part's attention looks
    bf16: bool = False             # part encoder convolutions in bfloat16 (~1.8x faster on AMX CPUs and GPUs)

    def validate(self) -> None:
        """What no single key's range says (``probcaps.config`` runs this on every encoder section it builds)."""
        if self.set_hidden % self.set_heads:
            raise ValueError(f"encoder.set_hidden ({self.set_hidden}) must be a multiple of encoder.set_heads "
                             f"({self.set_heads}): each attention head takes an equal share")
        if not self.min_scale < self.max_scale:
            raise ValueError(f"encoder.min_scale ({self.min_scale}) must be below encoder.max_scale ({self.max_scale})")
        if len(self.channels) != len(self.strides):
            raise ValueError(f"encoder.channels has {len(self.channels)} layers but encoder.strides "
                             f"{len(self.strides)}")


class Latents(NamedTuple):
    """Encoder outputs (all ``B`` first): part presence logits ``(B, M)``, part poses ``(B, M, 6)``,
    object presence logits ``(B, K)``, object poses ``(B, K, 6)`` (``(B, K, 6 + D)``: each followed by its code, for
    a model with ``object_code_dims`` D)."""

    part_logits: torch.Tensor
    part_poses: torch.Tensor
    parent_logits: torch.Tensor
    parent_poses: torch.Tensor


def _head(dim_in: int, hidden: int, dim_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim_in, hidden), nn.ELU(), nn.Linear(hidden, dim_out))


class CapsuleEncoder(nn.Module):
    """Image -> part capsules -> object capsules."""

    def __init__(self, num_parts: int, num_parents: int, config: EncoderConfig | None = None, compile: bool = False,
                 object_pose: str = "affine", object_code_dims: int = 0):
        super().__init__()
        cfg = self.config = config or EncoderConfig()
        self.num_parts, self.num_parents = num_parts, num_parents  # plain ints: not in the state_dict
        # the model's object-pose group: object poses are emitted inside it, so a coordinate the model ignores never
        # reaches a readout of the latents (a projection of the head's output; the state_dict is unchanged)
        self.object_pose = object_pose
        self.object_dims = 6 + object_code_dims  # y1's coordinates per object: its pose and its code
        self.parts = PartEncoder(
            num_parts, channels=tuple(cfg.channels), strides=tuple(cfg.strides), feature_dim=cfg.part_features,
            pose_kwargs=dict(min_scale=cfg.min_scale, max_scale=cfg.max_scale, max_translation=cfg.max_translation),
            bf16=cfg.bf16, compile=compile)
        self.part_embedding = nn.Parameter(0.1 * torch.randn(num_parts, cfg.part_embedding))
        self.set_transformer = SetTransformer(7 + cfg.part_embedding, num_parents, cfg.parent_code,
                                              dim_hidden=cfg.set_hidden, num_heads=cfg.set_heads,
                                              num_inds=cfg.set_inducing, num_isab=cfg.set_blocks)
        self.presence_head = _head(cfg.parent_code, cfg.head_hidden, 1)
        self.pose_head = _head(cfg.parent_code, cfg.head_hidden, self.object_dims)

    def encode_parts(self, x: torch.Tensor):
        """``x (B, 1, H, W)`` -> ``(presence logits (B, M), poses (B, M, 6))``."""
        out = self.parts(x)
        return out.presence_logit, out.pose

    def encode_parents(self, part_poses: torch.Tensor, part_presences: torch.Tensor):
        """Part poses ``(B, M, 6)`` and presences ``(B, M)`` -> ``(logits (B, K), poses (B, K, 6 + D))``.

        Absent parts are masked out of the attention by their presence; the poses lie in the group ``object_pose``.
        """
        emb = self.part_embedding.expand(part_poses.shape[0], *self.part_embedding.shape)
        tokens = torch.cat([part_poses, part_presences.unsqueeze(-1), emb], -1)
        code = self.set_transformer(tokens, key_weights=part_presences)
        return self.presence_head(code).squeeze(-1), restrict_pose6(self.pose_head(code), self.object_pose)

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> Latents:
        """Deterministic encoding for evaluation: presences at their means instead of samples."""
        part_logits, part_poses = self.encode_parts(x)
        parent_logits, parent_poses = self.encode_parents(part_poses, torch.sigmoid(part_logits))
        return Latents(part_logits, part_poses, parent_logits, parent_poses)


class DeltaGuide(PyroModule):
    """Amortised guide with delta (MAP) poses and concrete presences (``presences="bernoulli"``: Bernoulli ones, for
    a model with ``model.presences = "bernoulli"``)."""

    def __init__(self, encoder: CapsuleEncoder, temperature: float, presences: str = "relaxed"):
        super().__init__()
        if presences not in PRESENCE_FAMILIES:
            raise ValueError(f"DeltaGuide: presences must be one of {', '.join(PRESENCE_FAMILIES)}, got {presences!r}")
        self.encoder, self.temperature, self.presences = encoder, temperature, presences

    def presence_distribution(self, logits: torch.Tensor):
        """The variational family of the presences: concrete at ``temperature``, or Bernoulli with the same bounded
        logits."""
        relaxed = ClampedRelaxedBernoulli(logits.new_tensor(self.temperature), logits=logits)
        return relaxed if self.presences == "relaxed" else dist.Bernoulli(logits=relaxed.logits)

    def pose_distribution(self, loc: torch.Tensor, name: str):
        """The variational family of the poses ``name`` (here a point mass)."""
        return dist.Delta(loc).to_event(1)

    def forward(self, x: torch.Tensor, expected_parents: float | None = None):
        """``x (B, 1, H, W)``; ``expected_parents`` is the model's argument (the ELBO passes both the same ones),
        unused here.  Returns ``(z1 (B, K), y1 (B, K, 6 + D), z0 (B, M), y0 (B, M, 6))``."""
        if x.dim() == 3:
            x = x.unsqueeze(1)
        part_logits, part_poses = self.encoder.encode_parts(x)
        data = pyro.plate("data", x.shape[0], dim=-2)
        with data, pyro.plate("children", part_logits.shape[-1], dim=-1):
            z0 = pyro.sample("z0", self.presence_distribution(part_logits))
            y0 = pyro.sample("y0", self.pose_distribution(part_poses, "y0"))
        parent_logits, parent_poses = self.encoder.encode_parents(y0, z0)
        with data, pyro.plate("parents", parent_logits.shape[-1], dim=-1):
            z1 = pyro.sample("z1", self.presence_distribution(parent_logits))
            y1 = pyro.sample("y1", self.pose_distribution(parent_poses, "y1"))
        return z1, y1, z0, y0


class NormalPoseGuide(DeltaGuide):
    """Amortised guide with Normal posteriors on the poses ("full variational poses", Smith et al. 2020, §2.3).

    As :class:`DeltaGuide` but ``y0 ~ Normal(loc, σ_parts)``, ``y1 ~ Normal(loc, σ_parents)`` (``.to_event(1)``),
    the locations from the encoder.  The scales ``σ_parts (M, 6)``, ``σ_parents (K, 6 + D)``, each ``min_scale +
    softplus(raw)``, are shared by every image: a per-image scale head would change the encoder's ``state_dict``,
    which delta-trained checkpoints must keep loading into.  The floor keeps the entropy term bounded.
    """

    def __init__(self, encoder: CapsuleEncoder, temperature: float, init_scale: float = 0.02,
                 min_scale: float = 1e-3, presences: str = "relaxed"):
        super().__init__(encoder, temperature, presences)
        if not init_scale > min_scale >= 0:
            raise ValueError(f"NormalPoseGuide: need init_scale > min_scale >= 0, got init_scale={init_scale}, "
                             f"min_scale={min_scale}")
        self.min_scale = float(min_scale)
        ref, raw = next(encoder.parameters()), inverse_softplus(init_scale - min_scale)
        self.pose_scale_raw_parts = nn.Parameter(ref.new_full((encoder.num_parts, 6), raw))
        self.pose_scale_raw_parents = nn.Parameter(ref.new_full((encoder.num_parents, encoder.object_dims), raw))

    def pose_scales(self, name: str) -> torch.Tensor:
        """``σ`` of the poses ``name`` (``"y0"``: ``(M, 6)``; ``"y1"``: ``(K, 6 + D)``)."""
        return self.min_scale + F.softplus({"y0": self.pose_scale_raw_parts, "y1": self.pose_scale_raw_parents}[name])

    def pose_distribution(self, loc: torch.Tensor, name: str):
        return dist.Normal(loc, self.pose_scales(name).expand_as(loc)).to_event(1)


def from_delta(guide: DeltaGuide, init_scale: float = 0.02, min_scale: float = 1e-3, *,
               copy_encoder: bool = False) -> NormalPoseGuide:
    """A :class:`NormalPoseGuide` on a (delta-trained) guide's encoder (paper §2.3): only the pose scales are new
    (``init_scale`` everywhere).  The encoder module is *shared* (a ``CapsuleSystem`` whose ``encoder`` is the same
    object stays consistent), or with ``copy_encoder=True`` deep-copied, leaving ``guide`` untouched by training."""
    encoder = copy.deepcopy(guide.encoder) if copy_encoder else guide.encoder
    return NormalPoseGuide(encoder, guide.temperature, init_scale=init_scale, min_scale=min_scale,
                           presences=guide.presences)
