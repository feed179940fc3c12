"""MultiMNIST (Sabour, Frosst & Hinton 2017): two overlapping digits of different classes on a 36x36 canvas.

Each centred 28x28 digit is shifted by integers in ``[-max_shift, max_shift]`` per axis (as
:func:`~probcaps.data.transforms.place_on_canvas` places it), the two are combined by pixel-wise max, and a pair is
kept only if the digits' shifted ink bounding boxes have IoU >= ``min_iou`` (a numpy reproduction's reading of the
paper's "80% overlap"); a failing pair is redrawn, so the accepted pairs are the uniform draws conditioned on the rule.

Epoch ``e`` pairs every training digit with a fresh partner and shifts from a generator seeded by ``(seed, e)``
(new composites every epoch, as the paper's 60M pairs; a run resumes exactly).  The test set is one fixed set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .loaders import TensorRecord, seeded_generator
from .transforms import place_on_canvas, to_float

__all__ = ["MultiMNISTPairs", "bounding_boxes", "box_iou", "sample_pairs", "compose_pairs", "multimnist_pairs",
           "multimnist_batches"]


@dataclass
class MultiMNISTPairs(TensorRecord):
    """Pair indices and shifts (compact; images are composed per batch with :func:`compose_pairs`): ``first``,
    ``second`` int64 ``(N,)`` indices into the source digits, ``shifts`` int64 ``(N, 2, 2)`` ``[pair, digit, (dx,
    dy)]``, ``labels`` int64 ``(N, 2)`` the two (different) classes, ``iou`` float ``(N,)`` IoU of the shifted
    bounding boxes (all ``>= min_iou``)."""

    first: torch.Tensor
    second: torch.Tensor
    shifts: torch.Tensor
    labels: torch.Tensor
    iou: torch.Tensor


def bounding_boxes(images: torch.Tensor) -> torch.Tensor:
    """Ink bounding boxes of ``(N, H, W)`` images: int64 ``(N, 4)`` ``(top, bottom, left, right)``, half-open
    (``bottom``/``right`` one past the last inked row/column).  An empty image gets the empty box ``(0, 0, 0, 0)``."""
    ink = images > 0
    big = max(images.shape[1], images.shape[2]) + 1
    edges = []
    for inked in (ink.any(2), ink.any(1)):  # (N, H) rows, then (N, W) columns
        i = torch.arange(inked.shape[1], device=images.device)
        edges += [torch.where(inked, i, big).amin(1), torch.where(inked, i + 1, 0).amax(1)]
    box = torch.stack(edges, 1)
    return torch.where(ink.flatten(1).any(1)[:, None], box, torch.zeros_like(box))


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of half-open boxes ``(..., 4)`` = ``(top, bottom, left, right)``; 0 when both are empty."""
    a, b = a.float(), b.float()
    inter = (torch.minimum(a[..., 1::2], b[..., 1::2]) - torch.maximum(a[..., ::2], b[..., ::2])).clamp(min=0).prod(-1)
    union = (a[..., 1::2] - a[..., ::2]).prod(-1) + (b[..., 1::2] - b[..., ::2]).prod(-1) - inter
    return torch.where(union > 0, inter / union.clamp(min=1e-12), torch.zeros_like(union))


def sample_pairs(first: torch.Tensor, labels: torch.Tensor, boxes: torch.Tensor, generator: torch.Generator,
                 max_shift: int = 4, min_iou: float = 0.8, draws_per_round: int = 1 << 18,
                 patience: int = 2000, max_rounds: int = 1000) -> MultiMNISTPairs:
    """Pair each digit index in ``first`` (int64 ``(N,)``) with a partner of another class, both shifted, passing
    the IoU rule; ``labels`` ``(M,)`` and ``boxes`` ``(M, 4)`` (:func:`bounding_boxes`) are those of all source
    digits, ``generator`` the only source of randomness.

    Each round draws ``draws_per_round`` candidates, shared out over the failing pairs (8 to 4096 each), and keeps
    the first that passes (as drawing one at a time would).  A first digit with no partner after about ``patience``
    draws (mostly thin 1s) is replaced by a new uniform draw; the returned ``first`` says which digits were used
    (about 5% of the MNIST training digits are replaced, so 1s make up about 6% of the paired digits, not 11%).
    """
    n, m = first.shape[0], labels.shape[0]
    labels, first = labels.long(), first.clone().long()
    second, shifts, iou = torch.zeros(n, dtype=torch.long), torch.zeros(n, 2, 2, dtype=torch.long), torch.zeros(n)
    todo = torch.arange(n)
    tried = torch.zeros(n, dtype=torch.long)  # draws spent on each pair's current first digit
    for _ in range(max_rounds):  # rejection rounds over the still-failing pairs (vectorised within a round)
        if todo.numel() == 0:
            break
        stale = todo[tried[todo] >= patience]
        first[stale] = torch.randint(0, m, (stale.numel(),), generator=generator)
        tried[stale] = 0
        t = todo.numel()
        k = min(4096, max(8, draws_per_round // t))
        tried[todo] += k
        cand = torch.randint(0, m, (t, k), generator=generator)
        sh = torch.randint(-max_shift, max_shift + 1, (t, k, 2, 2), generator=generator)
        f = first[todo][:, None].expand(t, k)
        moved = boxes[torch.stack([f, cand], -1)] + sh[..., [1, 1, 0, 0]]  # (t, k, 2, 4), shifted by (dy, dy, dx, dx)
        value = box_iou(moved[..., 0, :], moved[..., 1, :])
        ok = (labels[cand] != labels[f]) & (value >= min_iou)  # (t, k)
        found = ok.any(1)
        pick = ok.float().argmax(1)  # first passing draw
        hit, done = (torch.arange(t)[found], pick[found]), todo[found]
        second[done], shifts[done], iou[done] = cand[hit], sh[hit], value[hit]
        todo = todo[~found]
    if todo.numel():
        raise RuntimeError(f"sample_pairs: {todo.numel()} pairs found no partner with IoU >= {min_iou} in "
                           f"{max_rounds} rounds (is the dataset a single class?)")
    return MultiMNISTPairs(first, second, shifts, torch.stack([labels[first], labels[second]], 1), iou)


def compose_pairs(digits: torch.Tensor, pairs: MultiMNISTPairs, canvas: int = 36
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Render pairs: ``(composite, first, second)``, each ``(N, canvas, canvas)`` of ``digits``' dtype; the
    composite is the pixel-wise max of the two placed digits."""
    a = place_on_canvas(digits[pairs.first], pairs.shifts[:, 0], canvas=canvas)
    b = place_on_canvas(digits[pairs.second], pairs.shifts[:, 1], canvas=canvas)
    return torch.maximum(a, b), a, b


def multimnist_pairs(labels: torch.Tensor, boxes: torch.Tensor, seed: int, epoch: int | str, n: int | None = None,
                     max_shift: int = 4, min_iou: float = 0.8) -> MultiMNISTPairs:
    """The pairs of one epoch (or of the fixed test set, ``epoch="test"``): every digit once as the first
    digit, in a permutation (cycled when ``n`` is larger than the source), all a pure function of
    ``(seed, epoch)``."""
    g, m = seeded_generator("multimnist", seed, epoch), labels.shape[0]
    n = m if n is None else n
    first = torch.cat([torch.randperm(m, generator=g) for _ in range(-(-n // m))])[:n]  # ceil(n / m) permutations
    return sample_pairs(first, torch.as_tensor(labels), boxes, g, max_shift=max_shift, min_iou=min_iou)


def multimnist_batches(digits: torch.Tensor, pairs: MultiMNISTPairs, batch_size: int, *, start_batch: int = 0,
                       canvas: int = 36, device="cpu", drop_last: bool = False
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield ``(x, first, second, labels)`` batches in the order of ``pairs``: float32 ``(B, 1, canvas, canvas)``
    images in ``[0, 1]`` (composite, and each placed digit alone) and int64 ``(B, 2)`` labels."""
    n = len(pairs)
    stop = n - n % batch_size if drop_last else n
    for s in range(start_batch * batch_size, stop, batch_size):
        part = pairs.subset(torch.arange(s, min(s + batch_size, n)))
        x, a, b = (to_float(t).unsqueeze(1).to(device) for t in compose_pairs(digits, part, canvas))
        yield x, a, b, part.labels.to(device)
