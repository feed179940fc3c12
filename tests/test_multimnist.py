"""MultiMNIST pairs: ink boxes and IoU by hand, and the pair rules (distinct classes, shifts, overlap, max)."""

from __future__ import annotations

import pytest
import torch

from probcaps.data import synthetic_digits
from probcaps.data.loaders import seeded_generator
from probcaps.data.multimnist import (
    bounding_boxes,
    box_iou,
    compose_pairs,
    multimnist_batches,
    multimnist_pairs,
    sample_pairs,
)
from tests.conftest import requires_real_mnist


def test_bounding_boxes_by_hand():
    img = torch.zeros(2, 6, 6, dtype=torch.uint8)
    img[0, 1:3, 2:5] = 255  # rows 1-2, columns 2-4
    img[0, 4, 1] = 7
    # image 1 stays empty
    boxes = bounding_boxes(img)
    assert boxes.tolist() == [[1, 5, 1, 5], [0, 0, 0, 0]]  # half-open (top, bottom, left, right)


def test_box_iou_by_hand():
    a = torch.tensor([[0, 10, 0, 10]])
    b = torch.tensor([[0, 10, 5, 15]])  # shifted 5 right: overlap 50, union 150
    assert box_iou(a, b).item() == pytest.approx(1 / 3)
    assert box_iou(a, a).item() == pytest.approx(1.0)
    assert box_iou(a, torch.tensor([[20, 30, 20, 30]])).item() == 0.0
    assert box_iou(torch.zeros(1, 4), torch.zeros(1, 4)).item() == 0.0  # two empty boxes: 0, not NaN


@pytest.fixture(scope="module")
def digits():
    return synthetic_digits(300, seed=3)


def check_pair_rules(images, labels, pairs, max_shift=4, min_iou=0.8, canvas=36):
    """Every rule of the data set, recomputed from the rendered images rather than trusted from ``pairs``."""
    assert (pairs.labels[:, 0] != pairs.labels[:, 1]).all()
    assert (pairs.labels[:, 0] == labels[pairs.first]).all() and (pairs.labels[:, 1] == labels[pairs.second]).all()
    assert pairs.shifts.abs().max() <= max_shift
    composite, a, b = compose_pairs(images, pairs, canvas)
    assert composite.shape[-2:] == (canvas, canvas)
    assert torch.equal(composite, torch.maximum(a, b))
    # the ink boxes of the placed digits are the digits' boxes moved by the shifts, and overlap enough
    iou = box_iou(bounding_boxes(a), bounding_boxes(b))
    assert torch.allclose(iou, pairs.iou)
    assert (iou >= min_iou - 1e-6).all()
    # each placed digit is the source digit, shifted by its (dx, dy) from the centred position
    off = (canvas - 28) // 2
    i = 0
    dx, dy = pairs.shifts[i, 0].tolist()
    assert torch.equal(a[i, off + dy:off + dy + 28, off + dx:off + dx + 28], images[pairs.first[i]])


def test_pairs_follow_the_rules(digits):
    images, labels = digits
    pairs = multimnist_pairs(labels, bounding_boxes(images), seed=0, epoch=0)
    assert len(pairs) == len(images)
    check_pair_rules(images, labels, pairs)


def test_pairs_are_seeded_and_change_every_epoch(digits):
    images, labels = digits
    boxes = bounding_boxes(images)
    p0 = multimnist_pairs(labels, boxes, seed=0, epoch=0)
    again = multimnist_pairs(labels, boxes, seed=0, epoch=0)
    p1 = multimnist_pairs(labels, boxes, seed=0, epoch=1)
    assert torch.equal(p0.second, again.second) and torch.equal(p0.shifts, again.shifts)
    assert not torch.equal(p0.second, p1.second)
    test = multimnist_pairs(labels, boxes, seed=0, epoch="test", n=700)  # more pairs than digits: cycles
    assert len(test) == 700


def test_strict_rule_is_rejected_not_relaxed(digits):
    # catches: a sampler that silently accepts failing pairs when the rule is hard to meet
    images, labels = digits
    boxes = bounding_boxes(images)
    g = seeded_generator("t", 0)
    pairs = sample_pairs(torch.arange(50), labels, boxes, g, min_iou=0.95)
    check_pair_rules(images, labels, pairs, min_iou=0.95)
    with pytest.raises(RuntimeError, match="no partner"):
        sample_pairs(torch.arange(5), torch.zeros(300, dtype=torch.long), boxes, g, max_rounds=3)


def test_batches_are_float_and_match_pairs(digits):
    images, labels = digits
    pairs = multimnist_pairs(labels, bounding_boxes(images), seed=1, epoch=0, n=10)
    batches = list(multimnist_batches(images, pairs, 4))
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    x, a, b, y = batches[0]
    assert x.shape == (4, 1, 36, 36) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert torch.equal(x, torch.maximum(a, b)) and torch.equal(y, pairs.labels[:4])
    resumed = next(multimnist_batches(images, pairs, 4, start_batch=2))
    assert torch.equal(resumed[0], batches[2][0])


@requires_real_mnist
def test_real_mnist_pairs():
    from probcaps.data import load_mnist
    from tests.conftest import REAL_DATA_ROOT

    images, labels = load_mnist("test", data_dir=REAL_DATA_ROOT)
    images, labels = torch.as_tensor(images)[:2000], torch.as_tensor(labels).long()[:2000]
    pairs = multimnist_pairs(labels, bounding_boxes(images), seed=0, epoch="test")
    check_pair_rules(images, labels, pairs)
    replaced = (pairs.first != torch.randperm(2000, generator=seeded_generator("multimnist", 0, "test"))).float()
    assert replaced.mean() < 0.1  # a first digit is swapped only when it cannot be paired (mostly thin 1s)
    share = torch.bincount(pairs.labels.flatten(), minlength=10).float() / pairs.labels.numel()
    # every class is present; thin 1s are rarer (about 4% of digits instead of 11%): few partners pass the rule
    assert share.min() > 0.02
