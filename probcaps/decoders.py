"""CapsNet's reconstruction network (Sabour et al. 2017, Fig. 2): all capsules but the selected ones zeroed, then
an MLP with ReLU hidden layers and a sigmoid output.  It knows nothing about routing: any model with ``K`` capsules
of ``D`` dimensions can reuse it."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn

__all__ = ["capsule_mask", "MaskedCapsuleDecoder"]


def capsule_mask(selected: torch.Tensor, num_capsules: int) -> torch.Tensor:
    """A float ``(B, K)`` mask from ``(B,)`` capsule indices (one-hot) or a ``(B, K)`` 0/1 mask (returned as
    float)."""
    if selected.dim() == 1:
        return torch.nn.functional.one_hot(selected.long(), num_capsules).float()
    if selected.dim() != 2 or selected.shape[1] != num_capsules:
        raise ValueError(f"capsule_mask: expected (B,) indices or a (B, {num_capsules}) mask, "
                         f"got {tuple(selected.shape)}")
    return selected.float()


class MaskedCapsuleDecoder(nn.Module):
    """MLP decoder from masked capsules ``(B, K, D)`` (``num_capsules`` ``K``, ``capsule_dim`` ``D``) to images
    ``(B, C, H, W)`` in ``[0, 1]`` (``image_shape``); ``hidden``: the hidden layer widths (paper: ``(512, 1024)``)."""

    def __init__(self, num_capsules: int, capsule_dim: int, hidden: Sequence[int], image_shape: Sequence[int]):
        super().__init__()
        self.num_capsules, self.capsule_dim = num_capsules, capsule_dim
        self.image_shape = tuple(int(s) for s in image_shape)
        sizes = [num_capsules * capsule_dim, *hidden]
        hidden_layers = [m for a, b in zip(sizes[:-1], sizes[1:]) for m in (nn.Linear(a, b), nn.ReLU(inplace=True))]
        self.net = nn.Sequential(*hidden_layers, nn.Linear(sizes[-1], math.prod(self.image_shape)))

    def forward(self, capsules: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` in ``[0, 1]`` from the capsules ``(B, K, D)`` that ``selected`` (``(B,)`` indices or a
        ``(B, K)`` mask) names, alone."""
        mask = capsule_mask(selected, self.num_capsules).to(capsules.dtype)
        flat = (capsules * mask.unsqueeze(-1)).flatten(1)
        return torch.sigmoid(self.net(flat)).view(capsules.shape[0], *self.image_shape)
