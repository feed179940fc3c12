"""Matrix capsules with EM routing (Hinton, Sabour & Frosst 2018): the smallNORB network and the spread loss.

Every capsule has a 4x4 pose matrix ``M`` and an activation ``a`` (held as ``log a``).  Layers: ``ReLU Conv1``
(``A`` channels, 5x5, stride 2: 32x32 -> 14x14); ``PrimaryCaps`` (a 1x1 convolution to ``B`` capsule types);
``ConvCaps1`` (``C`` types, 3x3, stride 2: 14 -> 6) and ``ConvCaps2`` (``D`` types, 3x3, stride 1: 6 -> 4), whose
votes ``M_i W_ij`` (one learned 4x4 transform per kernel position, input type and output type, shared over
positions) are routed by EM (``probcaps.models.em_routing``), an input's assignments normalised over every parent
in every overlapping patch it belongs to; ``ClassCaps`` (one capsule per class, transforms shared over positions,
with *coordinate addition*: the scaled (x, y) centre of each input's receptive field added to its vote's
translation entries).

The paper's network is ``A, B, C, D = 32, 32, 32, 32``; ``MatrixCapsConfig()`` defaults to ``64, 8, 16, 16``.
Shapes: poses ``(batch, types, 16, H, W)``, log activations ``(batch, types, H, W)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from probcaps.config import Section
from probcaps.models.em_routing import EMConfig, em_routing, em_routing_conv

__all__ = ["MatrixCapsConfig", "PrimaryCaps", "ConvCaps", "ClassCaps", "MatrixCapsNet", "spread_loss",
           "spread_margin", "patch_normaliser"]


@dataclass
class MatrixCapsConfig(Section):
    in_channels: int = 1
    input_size: int = 32
    A: int = 64                      # ReLU Conv1 channels
    B: int = 8                       # primary capsule types
    C: int = 16                      # ConvCaps1 types
    D: int = 16                      # ConvCaps2 types
    num_classes: int = 5
    conv1_kernel: int = 5
    conv1_stride: int = 2
    kernel: int = 3                  # ConvCaps kernel (K)
    iterations: int = 3              # EM iterations
    inverse_temperature: float = 1.0
    var_floor: float = 1e-4
    transform_init_std: float = 0.5  # std of the learned 4x4 transforms' entries around the identity
    coordinate_addition: bool = True
    standardise_cost: bool = True    # EM cost standardised over the parents at each position (see EMConfig)
    conv1_batchnorm: bool = False    # batch normalisation before ReLU Conv1's ReLU (not in the paper)

    def em(self) -> EMConfig:
        return EMConfig(iterations=self.iterations, inverse_temperature=self.inverse_temperature,
                        var_floor=self.var_floor, standardise_cost=self.standardise_cost)


def _init_transforms(*shape: int, std: float) -> nn.Parameter:
    """``(..., 4, 4)`` transforms: identity plus Gaussian noise (votes start close to the input poses)."""
    return nn.Parameter(torch.eye(4).expand(*shape, 4, 4) + std * torch.randn(*shape, 4, 4))


class PrimaryCaps(nn.Module):
    """1x1 convolution: ``(batch, A, H, W)`` features -> poses ``(batch, B, 16, H, W)``, log a ``(batch, B, H, W)``."""

    def __init__(self, in_channels: int, types: int):
        super().__init__()
        self.types = types
        self.pose = nn.Conv2d(in_channels, types * 16, 1)
        self.activation = nn.Conv2d(in_channels, types, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, h, w = x.shape
        return self.pose(x).view(b, self.types, 16, h, w), F.logsigmoid(self.activation(x))


@functools.lru_cache(maxsize=None)
def _patch_index(size: int, kernel: int, stride: int, device=None) -> torch.Tensor:
    """``(P * K * K,)`` flat input location of each (output position, kernel offset), in ``F.unfold``'s order."""
    o, k = torch.arange((size - kernel) // stride + 1, device=device) * stride, torch.arange(kernel, device=device)
    rows = o[:, None, None, None] + k[None, None, :, None]  # (oy, ox, ky, kx) broadcast
    cols = o[None, :, None, None] + k[None, None, None, :]
    return (rows * size + cols).reshape(-1)


def patch_normaliser(index: torch.Tensor, batch: int, positions: int, kk: int, types: int, locations: int):
    """``log R`` for convolutional EM routing: normalise E-step logits ``(batch*P, J, K*K*T)`` over every parent of
    every patch that contains the same input capsule (``index``: the layer's :func:`_patch_index`), by scatter
    operations (a max for stability, then a sum of exponentials): no loop over positions."""
    idx = index.view(1, 1, -1).expand(batch, types, -1)

    def normalise(logits: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=1)                                   # (batch*P, K*K*T)
        lse = lse.view(batch, positions, kk, types).permute(0, 3, 1, 2).reshape(batch, types, positions * kk)
        peak = lse.new_full((batch, types, locations), -math.inf).scatter_reduce(2, idx, lse, "amax")
        peak_at = peak.gather(2, idx)
        total = lse.new_zeros(batch, types, locations).scatter_add(2, idx, torch.exp(lse - peak_at))
        log_norm = peak_at + torch.log(total.gather(2, idx))                  # (batch, T, P*K*K)
        log_norm = log_norm.view(batch, types, positions, kk).permute(0, 2, 3, 1).reshape(batch * positions, 1, -1)
        return logits - log_norm

    return normalise


class ConvCaps(nn.Module):
    """Convolutional capsule layer with EM routing: ``in_types`` -> ``out_types``, ``kernel x kernel``, ``stride``."""

    def __init__(self, in_types: int, out_types: int, kernel: int, stride: int, em: EMConfig,
                 init_std: float = 0.5):
        super().__init__()
        self.in_types, self.out_types, self.kernel, self.stride, self.em = in_types, out_types, kernel, stride, em
        # one transform per (kernel offset, input type) and output type; input index i = offset * in_types + type
        self.W = _init_transforms(kernel * kernel * in_types, out_types, std=init_std)
        self.beta_v, self.beta_a = (nn.Parameter(torch.zeros(out_types)) for _ in range(2))

    def forward(self, pose: torch.Tensor, log_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _, h, w = pose.shape
        if h != w:
            raise ValueError(f"ConvCaps: square inputs only, got {h}x{w}")
        k, s, J = self.kernel, self.stride, self.out_types
        out = (h - k) // s + 1
        P, KK = out * out, k * k
        # (b, t, 17, h, w) -> (b, t, 17, oy, ox, ky, kx), a view, -> (b * P, K * K * t, 17)
        patches = torch.cat([pose, log_a[:, :, None]], 2).unfold(3, k, s).unfold(4, k, s)
        patches = patches.permute(0, 3, 4, 5, 6, 1, 2).reshape(b * P, KK * t, 17)
        M = patches[..., :16].reshape(b * P, KK * t, 4, 4)
        normalise = patch_normaliser(_patch_index(h, k, s, pose.device), b, P, KK, t, h * w)
        mu, _, log_a_out, _ = em_routing_conv(M, self.W, patches[..., 16], self.beta_v, self.beta_a, self.em, normalise)
        return (mu.view(b, out, out, J, 16).permute(0, 3, 4, 1, 2),
                log_a_out.view(b, out, out, J).permute(0, 3, 1, 2))


class ClassCaps(nn.Module):
    """Class capsules: transforms shared over positions, with coordinate addition; returns poses ``(batch, E, 16)``,
    log activations ``(batch, E)`` and the routing's last log assignments ``(batch, E, positions * types)``."""

    def __init__(self, in_types: int, classes: int, em: EMConfig, coordinate_addition: bool = True,
                 init_std: float = 0.5):
        super().__init__()
        self.em, self.coordinate_addition = em, coordinate_addition
        self.W = _init_transforms(in_types, classes, std=init_std)
        self.beta_v, self.beta_a = (nn.Parameter(torch.zeros(classes)) for _ in range(2))

    def forward(self, pose: torch.Tensor, log_a: torch.Tensor):
        b, t, _, h, w = pose.shape
        M = pose.permute(0, 3, 4, 1, 2).reshape(b, h * w, t, 4, 4)
        votes = torch.einsum("bptrk,tjkc->bjptrc", M, self.W)                # (b, E, positions, types, 4, 4)
        if self.coordinate_addition:
            # scaled centre (x, y) in [0, 1] of each position, added to the right-hand column's first two entries
            ys, xs = torch.meshgrid((torch.arange(h, device=pose.device) + 0.5) / h,
                                    (torch.arange(w, device=pose.device) + 0.5) / w, indexing="ij")
            coords = pose.new_zeros(h * w, 4, 4)
            coords[:, 0, 3], coords[:, 1, 3] = xs.reshape(-1), ys.reshape(-1)
            votes = votes + coords[None, None, :, None]
        votes = votes.reshape(b, votes.shape[1], h * w * t, 16)
        log_a_in = log_a.permute(0, 2, 3, 1).reshape(b, h * w * t)
        mu, _, log_a_out, log_R = em_routing(votes, log_a_in, self.beta_v, self.beta_a, self.em)
        return mu, log_a_out, log_R


class MatrixCapsNet(nn.Module):
    """The smallNORB network: ``(batch, in_channels, 32, 32)`` -> class log activations ``(batch, E)``
    (:meth:`capsules` also returns the class poses)."""

    def __init__(self, cfg: MatrixCapsConfig = MatrixCapsConfig()):
        super().__init__()
        self.cfg = cfg
        em = cfg.em()
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.A, cfg.conv1_kernel, stride=cfg.conv1_stride)
        self.conv1_norm = nn.BatchNorm2d(cfg.A) if cfg.conv1_batchnorm else nn.Identity()
        self.primary = PrimaryCaps(cfg.A, cfg.B)
        self.conv_caps1 = ConvCaps(cfg.B, cfg.C, cfg.kernel, 2, em, cfg.transform_init_std)
        self.conv_caps2 = ConvCaps(cfg.C, cfg.D, cfg.kernel, 1, em, cfg.transform_init_std)
        self.class_caps = ClassCaps(cfg.D, cfg.num_classes, em, cfg.coordinate_addition, cfg.transform_init_std)

    def capsules(self, x: torch.Tensor):
        """``x (batch, C, H, W)`` -> class poses ``(batch, E, 4, 4)``, log activations ``(batch, E)``."""
        pose, log_a = self.primary(F.relu(self.conv1_norm(self.conv1(x))))
        pose, log_a = self.conv_caps1(pose, log_a)
        pose, log_a = self.conv_caps2(pose, log_a)
        mu, log_a, _ = self.class_caps(pose, log_a)
        return mu.view(*mu.shape[:2], 4, 4), log_a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.capsules(x)[1]


def spread_loss(log_a: torch.Tensor, target: torch.Tensor, margin: float | torch.Tensor) -> torch.Tensor:
    """Spread loss ``sum_{i != t} max(0, m - (a_t - a_i))^2`` of class log activations ``log_a (batch, E)`` for
    class indices ``target (batch,)`` and margin ``m``, averaged over the batch."""
    a = log_a.exp()
    a_t = a.gather(1, target[:, None])
    gap = F.relu(margin - (a_t - a)) ** 2
    gap = gap.scatter(1, target[:, None], 0.0)  # the target class is not its own rival
    return gap.sum(1).mean()


def spread_margin(step: int, ramp_steps: int, start: float = 0.2, end: float = 0.9) -> float:
    """The margin schedule: linear from ``start`` to ``end`` over ``ramp_steps`` steps, then ``end`` (paper: 0.2 ->
    0.9 during training)."""
    return end if ramp_steps <= 0 else start + (end - start) * min(1.0, step / ramp_steps)
