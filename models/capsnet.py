"""CapsNet with dynamic routing (Sabour, Frosst & Hinton 2017): Conv1 -> PrimaryCaps -> DigitCaps, margin loss,
and masked reconstruction of each named digit.

``CapsNetConfig()`` is the paper's MultiMNIST network (36x36 input, Conv1 of 256 9x9 kernels, 32 types of 8-D
primary capsules on a 10x10 grid = 3200 children, 10 16-D digit capsules, 3 routing iterations, decoder
512-1024-1296).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from probcaps.config import Section
from probcaps.decoders import MaskedCapsuleDecoder
from probcaps.encoders import PhaseSplitConv2d
from probcaps.models.routing import linear_dynamic_routing, squash

__all__ = ["CapsNetConfig", "CapsNetOutput", "CapsNet", "margin_loss", "top_k_classes", "set_accuracy"]


@dataclass
class CapsNetConfig(Section):
    image_size: int = 36
    in_channels: int = 1
    conv1_channels: int = 256
    conv1_kernel: int = 9
    primary_capsules: int = 32        # capsule types; Conv2 has primary_capsules * primary_dim channels
    primary_dim: int = 8
    primary_kernel: int = 9
    primary_stride: int = 2
    num_classes: int = 10
    digit_dim: int = 16
    routing_iterations: int = 3
    detach_routing: bool = False      # stop-gradient variant: gradients only through the last iteration
    weight_init_std: float = 0.01     # DigitCaps transformation matrices
    decoder_hidden: list = field(default_factory=lambda: [512, 1024])
    m_plus: float = 0.9
    m_minus: float = 0.1
    margin_lambda: float = 0.5
    recon_weight: float = 0.0005      # per-image sum of squared errors, times this (paper)
    bf16: bool = False                # the two convolutions in bfloat16 autocast (routing, losses stay float32)
    bf16_routing: bool = False        # routing's matrix and elementwise products in bfloat16, summed in float32
    phase_split: bool = False         # PrimaryCaps' strided convolution as stride-1 phases (PhaseSplitConv2d)

    def validate(self) -> None:
        if self.primary_grid < 1:
            raise ValueError(f"image_size {self.image_size} is too small for the two convolutions")

    @property
    def conv1_size(self) -> int:
        return self.image_size - self.conv1_kernel + 1

    @property
    def primary_grid(self) -> int:
        return (self.conv1_size - self.primary_kernel) // self.primary_stride + 1

    @property
    def num_primary(self) -> int:
        """Number of child capsules ``I``."""
        return self.primary_capsules * self.primary_grid ** 2


class CapsNetOutput(NamedTuple):
    digits: torch.Tensor     # (B, J, D) squashed digit capsules
    lengths: torch.Tensor    # (B, J) capsule lengths = class presence
    coupling: torch.Tensor   # (B, J, I) final routing coefficients
    primary: torch.Tensor    # (B, I, P) squashed primary capsules


def margin_loss(lengths: torch.Tensor, targets: torch.Tensor, m_plus: float = 0.9, m_minus: float = 0.1,
                lam: float = 0.5) -> torch.Tensor:
    """Paper eq. 4, summed over classes: ``T_k max(0, m+ - |v_k|)^2 + lam (1 - T_k) max(0, |v_k| - m-)^2``, of
    capsule lengths ``(B, K)`` and 0/1 ``targets`` ``(B, K)`` (several ones for several digits) -> ``(B,)``."""
    targets = targets.to(lengths.dtype)
    present = targets * F.relu(m_plus - lengths) ** 2
    absent = lam * (1 - targets) * F.relu(lengths - m_minus) ** 2
    return (present + absent).sum(-1)


def top_k_classes(lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, k)`` the classes of the ``k`` longest capsules, sorted by class index."""
    return lengths.topk(k, dim=-1).indices.sort(-1).values


def set_accuracy(lengths: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: the ``k`` longest capsules are exactly the ``k`` true classes ``labels`` ``(B, k)``."""
    return (top_k_classes(lengths, labels.shape[1]) == labels.sort(-1).values).all(-1)


class CapsNet(nn.Module):
    """Conv1 (ReLU) -> PrimaryCaps (conv, squash) -> DigitCaps (dynamic routing) + masked decoder."""

    def __init__(self, config: CapsNetConfig | None = None):
        super().__init__()
        cfg = self.config = config or CapsNetConfig()
        cfg.validate()
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.conv1_channels, cfg.conv1_kernel)
        conv = PhaseSplitConv2d if cfg.phase_split else nn.Conv2d
        self.primary = conv(cfg.conv1_channels, cfg.primary_capsules * cfg.primary_dim, cfg.primary_kernel,
                            stride=cfg.primary_stride)
        # (J, I, P, D): digit_weight[j, i] is the transpose of the paper's W_ij (see linear_dynamic_routing)
        self.digit_weight = nn.Parameter(cfg.weight_init_std * torch.randn(
            cfg.num_classes, cfg.num_primary, cfg.primary_dim, cfg.digit_dim))
        self.decoder = MaskedCapsuleDecoder(cfg.num_classes, cfg.digit_dim, cfg.decoder_hidden,
                                            (cfg.in_channels, cfg.image_size, cfg.image_size))

    def primary_capsules(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` images -> ``(B, I, P)`` squashed primary capsules (type-major: type, row, column)."""
        cfg = self.config
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            h = self.primary(F.relu(self.conv1(x)))
        B, _, g, _ = h.shape
        u = h.float().view(B, cfg.primary_capsules, cfg.primary_dim, g, g).permute(0, 1, 3, 4, 2)
        return squash(u.reshape(B, -1, cfg.primary_dim))

    def forward(self, x: torch.Tensor) -> CapsNetOutput:
        u = self.primary_capsules(x)
        v, c = linear_dynamic_routing(u, self.digit_weight, self.config.routing_iterations,
                                      detach=self.config.detach_routing,
                                      product_dtype=torch.bfloat16 if self.config.bf16_routing else None)
        return CapsNetOutput(v, v.norm(dim=-1), c, u)

    def reconstruct(self, digits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """Decode ``(B, C, H, W)`` from the digit capsules ``selected`` (``(B,)`` indices or ``(B, J)`` mask)."""
        return self.decoder(digits, selected)

    def reconstruct_each(self, digits: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """One reconstruction per listed class, each from that capsule alone: ``classes`` ``(B, K)`` ->
        ``(B, K, C, H, W)`` (one decoder call on ``B * K`` rows)."""
        B, K = classes.shape
        rec = self.decoder(digits.repeat_interleave(K, 0), classes.reshape(-1))
        return rec.view(B, K, *rec.shape[1:])

    def loss(self, x: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Margin loss on the named classes + ``recon_weight`` x squared error of each digit's reconstruction, as
        ``(batch mean, dict of float diagnostics)``.  ``x`` ``(B, C, H, W)``; ``labels`` int64 ``(B, K)``, the ``K``
        digit classes (1 for MNIST, 2 for MultiMNIST); ``sources`` ``(B, K, C, H, W)``, each digit alone."""
        cfg = self.config
        out = self(x)
        targets = torch.zeros_like(out.lengths).scatter_(1, labels, 1.0)
        margin = margin_loss(out.lengths, targets, cfg.m_plus, cfg.m_minus, cfg.margin_lambda)
        rec = self.reconstruct_each(out.digits, labels)
        sse = ((rec - sources) ** 2).flatten(1).sum(1)
        loss = (margin + cfg.recon_weight * sse).mean()
        return loss, {"margin": float(margin.detach().mean()), "recon_sse": float(sse.detach().mean()),
                      "set_acc": float(set_accuracy(out.lengths.detach(), labels).float().mean())}
