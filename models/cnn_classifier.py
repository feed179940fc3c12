"""A plain supervised CNN classifier, the baseline of the out-of-distribution experiments: two 5×5 conv + max-pool
stages and a two-layer head, for square greyscale images of side ``image_size``."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["ConvClassifier"]


class ConvClassifier(nn.Module):
    """``(B, 1, H, W)`` images -> ``(B, num_classes)`` logits."""

    def __init__(self, image_size: int = 40, channels: tuple[int, int] = (32, 64), hidden: int = 128,
                 num_classes: int = 10, dropout: float = 0.25):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(c2 * side * side, hidden),
                                        nn.ReLU(), nn.Linear(hidden, num_classes))
        self.image_size = image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.unsqueeze(1)
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"ConvClassifier: built for {self.image_size}x{self.image_size} images, got "
                             f"{tuple(x.shape[-2:])}")
        return self.classifier(self.features(x))
