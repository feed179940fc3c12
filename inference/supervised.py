"""Supervised classifiers (the CNN baselines): training through the package's one loop, and scoring.

    net = ConvClassifier(40)
    train_classifier(net, images, labels, TrainConfig(steps=1500, lr=1e-3), "runs/cnn")
    accuracy(net, test_images, test_labels)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from probcaps.data import iterate_batches
from probcaps.inference.train import TrainConfig, TrainState, train_loop

__all__ = ["train_classifier", "predict", "accuracy"]


def train_classifier(net: nn.Module, images: torch.Tensor, labels: torch.Tensor, cfg: TrainConfig,
                     out_dir: str | Path, *, resume: bool = False, device: str = "cpu", rotation: float | None = None,
                     progress: bool = True, metadata: dict | None = None) -> TrainState:
    """Cross-entropy training of ``net`` on uint8 ``images (N, H, W)`` with :func:`inference.train.train_loop`
    (progress bar, JSON-lines log, atomic checkpoints, exact resume, NaN guard).  ``rotation``: random training
    rotations up to that many degrees."""
    net.to(device).train()

    def batches(epoch: int, start: int):
        yield from iterate_batches(images, labels, cfg.batch_size, shuffle=True, seed=cfg.seed, epoch=epoch,
                                   start_batch=start, drop_last=len(images) >= cfg.batch_size, device=device,
                                   rotation=rotation)

    def loss_fn(batch):
        return F.cross_entropy(net(batch[0]), batch[1])

    state = train_loop(net, loss_fn, batches, cfg, out_dir, resume=resume, progress=progress,
                       metadata={"kind": "classifier", **(metadata or {})})
    net.eval()
    return state


@torch.no_grad()
def predict(net, images: torch.Tensor, batch_size: int = 1000, device: str = "cpu", transform=None) -> torch.Tensor:
    """Predicted classes ``(N,)`` of uint8 (or float in [0, 1]) ``images (N, H, W)``, in batches.

    ``net``: a module or any callable mapping ``(B, 1, H, W)`` to class scores ``(B, C)`` (e.g. CapsNet's capsule
    lengths); a module is put in eval mode and restored.  ``transform``: applied to each batch first (e.g. a crop).
    """
    module = net if isinstance(net, nn.Module) else nn.Module()  # a plain callable: no mode to switch
    was_training = module.training
    module.eval()
    labels = torch.zeros(len(images), dtype=torch.long)
    out = [net(transform(x) if transform is not None else x).argmax(-1).cpu()
           for x, _ in iterate_batches(images, labels, batch_size, shuffle=False, device=device)]
    module.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def accuracy(net: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000,
             device: str = "cpu") -> float:
    """Fraction of ``images`` classified as ``labels``."""
    return float((predict(net, images, batch_size, device) == labels.cpu()).float().mean())
