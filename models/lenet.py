"""LeNet-5 as the rotated-MNIST numpy reproduction defines it: two 5x5 convolutions (6 and 16 channels) with
ReLU and 2x2 average pooling, then fully connected 256 -> 120 -> 84 -> 10, on 28x28 digits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LeNet5"]


class LeNet5(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28):
        super().__init__()
        self.conv0 = nn.Conv2d(in_channels, 6, 5)
        self.conv1 = nn.Conv2d(6, 16, 5)
        self.pool = nn.AvgPool2d(2, 2)
        side = ((image_size - 4) // 2 - 4) // 2  # 28 -> 24 -> 12 -> 8 -> 4
        self.fc2 = nn.Linear(16 * side * side, 120)
        self.fc3 = nn.Linear(120, 84)
        self.fc4 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> class logits ``(B, num_classes)``."""
        x = self.pool(F.relu(self.conv1(self.pool(F.relu(self.conv0(x))))))
        return self.fc4(F.relu(self.fc3(F.relu(self.fc2(x.flatten(1))))))
