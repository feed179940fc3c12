"""The CNN baseline of Hinton, Sabour & Frosst (2018) for smallNORB.

Paper: two convolutional layers of 32 and 64 channels (5x5, stride 1, ReLU, each followed by 2x2 max pooling),
a fully connected layer of 1024 ReLU units with dropout, and a 5-way softmax; 4.2M parameters at 32x32 input
("same" padding).  Channels, hidden units and dropout are configurable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from probcaps.config import Section

__all__ = ["NorbCNNConfig", "NorbCNN"]


@dataclass
class NorbCNNConfig(Section):
    in_channels: int = 1
    input_size: int = 32
    channels: list = field(default_factory=lambda: [32, 64])
    kernel: int = 5
    hidden: int = 1024
    dropout: float = 0.5
    num_classes: int = 5

class NorbCNN(nn.Module):
    """``(batch, C, 32, 32)`` -> class logits ``(batch, num_classes)``."""

    def __init__(self, cfg: NorbCNNConfig = NorbCNNConfig()):
        super().__init__()
        self.cfg = cfg
        widths = [cfg.in_channels, *cfg.channels]
        self.convs = nn.ModuleList(nn.Conv2d(c_in, c_out, cfg.kernel, padding=cfg.kernel // 2)
                                   for c_in, c_out in zip(widths, widths[1:]))
        size = cfg.input_size // 2 ** len(cfg.channels)  # each conv is followed by a 2x2 max pooling
        self.hidden = nn.Linear(widths[-1] * size * size, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = F.max_pool2d(F.relu(conv(x)), 2)
        x = F.dropout(F.relu(self.hidden(x.flatten(1))), self.cfg.dropout, self.training)
        return self.out(x)
