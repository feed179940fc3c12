"""smallNORB's binary matrix format, the paper's preprocessing and splits, and the synthetic stand-in."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from probcaps.data.smallnorb import (
    ELEVATIONS,
    SMALLNORB_SPLITS,
    TRAIN_AZIMUTHS,
    NorbSet,
    crop32,
    downsample,
    load_smallnorb,
    read_norb_matrix,
    viewpoint_split,
    write_norb_matrix,
)
from probcaps.data.synthetic_norb import AZIMUTHS, ELEVATIONS_DEG, _cache_key, class_parts, render_views, synthetic_norb
from probcaps.data.transforms import standardise_per_image
from probcaps.errors import DataError


def test_reads_hand_written_byte_and_int_files(tmp_path):
    # uint8 matrix: magic 0x1E3D4C55, 3 dims (2, 2, 3), then 12 bytes
    raw = struct.pack("<iiiii", 0x1E3D4C55, 3, 2, 2, 3) + bytes(range(12))
    (tmp_path / "b.mat").write_bytes(raw)
    arr = read_norb_matrix(tmp_path / "b.mat")
    assert arr.dtype == np.uint8 and arr.shape == (2, 2, 3) and arr[1, 0, 2] == 8
    # int32 vector: magic 0x1E3D4C54, 1 dim, header padded to 3 dims (3, 1, 1)
    raw = struct.pack("<iiiii", 0x1E3D4C54, 1, 3, 1, 1) + struct.pack("<3i", 7, -1, 4)
    (tmp_path / "i.mat.gz").write_bytes(gzip.compress(raw))
    assert read_norb_matrix(tmp_path / "i.mat.gz").tolist() == [7, -1, 4]  # gzip detected from the content
    # a 4-d file has 4 dims in the header, no padding
    raw = struct.pack("<iiiiii", 0x1E3D4C55, 4, 1, 2, 1, 1) + bytes([5, 6])
    (tmp_path / "d4.mat").write_bytes(raw)
    assert read_norb_matrix(tmp_path / "d4.mat").shape == (1, 2, 1, 1)


def test_wrong_magic_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.mat"
    path.write_bytes(struct.pack("<iiiii", 0x00000803, 3, 1, 1, 1) + b"\x00")
    with pytest.raises(DataError, match=r"bad\.mat: bad magic number 0x00000803"):
        read_norb_matrix(path)


@pytest.mark.parametrize("payload, message", [
    (struct.pack("<iiiii", 0x1E3D4C55, 3, 2, 2, 2) + bytes(7), "truncated"),
    (struct.pack("<iiiii", 0x1E3D4C55, 3, 1, 1, 1) + bytes(2), "trailing bytes"),
    (b"\x55\x4c", "too short"),
    (b"\x1f\x8b\x08garbage", "corrupt gzip"),
])
def test_malformed_files_are_errors(tmp_path, payload, message):
    path = tmp_path / "x.mat"
    path.write_bytes(payload)
    with pytest.raises(DataError, match=message):
        read_norb_matrix(path)


def test_write_read_roundtrip(tmp_path):
    for arr in (np.arange(24, dtype=np.uint8).reshape(2, 3, 4), np.array([3, 1], dtype=np.int32),
                np.random.default_rng(0).standard_normal((2, 2)).astype(np.float32)):
        for gz in (False, True):
            write_norb_matrix(tmp_path / "r.mat", arr, gzip_file=gz)
            back = read_norb_matrix(tmp_path / "r.mat")
            assert back.dtype == arr.dtype.newbyteorder("<") and np.array_equal(back, arr)


def _write_fake_smallnorb(root, n=4):
    folder = root / "smallnorb"
    stem = SMALLNORB_SPLITS["test"]
    dat = np.zeros((n, 2, 96, 96), dtype=np.uint8)
    dat[:, 0, :2, :2] = [[0, 10], [20, 30]]     # left image: its first 2x2 block averages to 15
    dat[:, 1] = 255                              # right image: ignored
    write_norb_matrix(folder / f"{stem}-dat.mat.gz", dat, gzip_file=True)
    write_norb_matrix(folder / f"{stem}-cat.mat", np.arange(n, dtype=np.int32) % 5)
    info = np.array([[i, i % 9, 2 * i, i % 6] for i in range(n)], dtype=np.int32)  # instance, elev, azimuth/10*?, light
    write_norb_matrix(folder / f"{stem}-info.mat.gz", info, gzip_file=True)
    return folder


def test_load_smallnorb_converts_metadata_and_downsamples(tmp_path):
    _write_fake_smallnorb(tmp_path)
    data = load_smallnorb("test", data_dir=tmp_path)
    assert data.images.shape == (4, 48, 48) and data.images.dtype == torch.uint8
    assert int(data.images[0, 0, 0]) == 15 and int(data.images[0, 5, 5]) == 0
    assert data.elevation.tolist() == [30, 35, 40, 45]           # index * 5 + 30
    assert data.azimuth.tolist() == [0, 20, 40, 60]              # the file stores 0, 2, 4, ..: times 10
    assert data.labels.tolist() == [0, 1, 2, 3]
    with pytest.raises(DataError, match="smallNORB file not found"):
        load_smallnorb("train", data_dir=tmp_path)


def _all_views() -> NorbSet:
    az, el = torch.meshgrid(torch.tensor(AZIMUTHS), torch.tensor(ELEVATIONS_DEG), indexing="ij")
    n = az.numel()
    zeros = torch.zeros(n, dtype=torch.int64)
    return NorbSet(torch.zeros(n, 48, 48, dtype=torch.uint8), zeros, zeros, az.reshape(-1), el.reshape(-1), zeros)


def test_splits_contain_exactly_the_stated_viewpoints():
    data = _all_views()
    familiar, novel = viewpoint_split(data, "azimuth")
    assert set(data.azimuth[familiar].tolist()) == {300, 320, 340, 0, 20, 40} == set(TRAIN_AZIMUTHS)
    assert set(data.azimuth[novel].tolist()) == set(range(60, 281, 20))
    assert not (familiar & novel).any() and (familiar | novel).all()
    familiar, novel = viewpoint_split(data, "elevation")
    assert set(data.elevation[familiar].tolist()) == {30, 35, 40}
    assert set(data.elevation[novel].tolist()) == {45, 50, 55, 60, 65, 70} == set(ELEVATIONS[3:])
    with pytest.raises(ValueError):
        viewpoint_split(data, "lighting")


def test_downsample_and_crops():
    img = torch.arange(16, dtype=torch.uint8).view(1, 4, 4)
    assert downsample(img, 2).tolist() == [[[2, 4], [10, 12]]]   # 2x2 means, rounded half to even
    x = torch.arange(48 * 48, dtype=torch.float32).view(1, 1, 48, 48).repeat(3, 1, 1, 1)
    assert torch.equal(crop32(x, train=False), x[:, :, 8:40, 8:40])
    g = torch.Generator().manual_seed(0)
    out = crop32(x, train=True, generator=g)
    g = torch.Generator().manual_seed(0)
    top, left = torch.randint(0, 17, (3,), generator=g), torch.randint(0, 17, (3,), generator=g)
    for i in range(3):
        assert torch.equal(out[i], x[i, :, top[i]:top[i] + 32, left[i]:left[i] + 32])


def test_standardise_per_image_hand_computed():
    x = torch.tensor([[[0.0, 2.0], [0.0, 2.0]], [[1.0, 1.0], [1.0, 1.0]]])   # mean 1 std 1; a blank image
    out = standardise_per_image(x)
    assert out[0].tolist() == [[-1.0, 1.0], [-1.0, 1.0]]
    assert out[1].tolist() == [[0.0, 0.0], [0.0, 0.0]]                       # finite: the std has a floor
    # brightness and contrast changes (the paper's augmentations) leave the result unchanged
    y = torch.rand(3, 1, 8, 8)
    assert torch.allclose(standardise_per_image(0.4 * y + 0.3), standardise_per_image(y), atol=1e-5)


def test_synthetic_norb_metadata_and_determinism(tmp_path):
    small = dict(data_dir=tmp_path, instances_per_split=1, elevations=1, lightings=1, cache=False)
    a = synthetic_norb("train", **small)
    assert len(a) == 5 * 18 and a.images.shape[1:] == (48, 48)
    assert torch.bincount(a.labels).tolist() == [18] * 5
    assert set(a.azimuth.tolist()) == set(range(0, 360, 20)) and set(a.elevation.tolist()) == {30}
    assert set(a.instance.tolist()) == {0}
    assert (a.images.float().mean((1, 2)) > 3).all()            # every view shows the object
    b = synthetic_norb("train", **small)
    assert torch.equal(a.images, b.images)
    test = synthetic_norb("test", **small)
    assert set(test.instance.tolist()) == {5}                    # disjoint toys, as smallNORB
    assert not list(tmp_path.iterdir())                          # small sets are never cached


def test_render_a_sphere_hand_computed():
    # one unit-radius sphere at the origin seen from the front: covers the pixels whose centre lies within
    # radius 1 of the image centre (extent 1.15 -> 48 px span 2.3 units); at the centre the normal points at the
    # camera, so with light 2 (direction (0, 0.8, 0.6) in camera coordinates, ambient 0.2) the shade is 0.6 + 0.2
    img = render_views(torch.zeros(1, 1, 3), torch.ones(1, 1, 3), torch.ones(1, 1, dtype=torch.bool),
                       torch.ones(1), torch.zeros(1), torch.zeros(1), torch.tensor([2]), size=48, supersample=1)[0]
    c = (torch.arange(48) + 0.5) / 48 * 2 - 1
    inside = (c[None, :] ** 2 + c[:, None] ** 2) * 1.15 ** 2 < 1
    assert torch.equal(img > 0, inside)
    assert img[23:25, 23:25].mean().item() == pytest.approx(0.8, abs=0.03) and img.max() <= 1


def _front_and_back(variant: str) -> torch.Tensor:
    """Mean |view from azimuth 0 - view from azimuth 180| per class of the variant's prototype toys (no instance
    noise), at elevation 30 under the frontal light: ``(5,)``."""
    centres, radii, mask = class_parts(variant)
    views = [render_views(centres, radii, mask, torch.ones(5), torch.full((5,), float(az)), torch.full((5,), 30.0),
                          torch.full((5,), 2), size=48) for az in (0, 180)]
    return (views[0] - views[1]).abs().mean((1, 2))


def test_asymmetric_toys_look_different_from_behind():
    # A toy symmetric under (x, y) -> (-x, -y) looks the same from azimuth 0 and 180 (the light is fixed to the
    # camera), so the back views would be familiar views; the "asymmetric" variant's front and back differ for
    # every class by more than the nearly symmetric "toys" do.
    toys, asym = _front_and_back("toys"), _front_and_back("asymmetric")
    assert (asym > toys).all(), (toys, asym)
    assert asym.mean() > 2 * toys.mean(), (toys, asym)


def test_synthetic_norb_variant_is_checked_and_keys_the_cache(tmp_path):
    with pytest.raises(ValueError, match="variant"):
        synthetic_norb("train", data_dir=tmp_path, variant="cubes")
    small = dict(data_dir=tmp_path, instances_per_split=1, elevations=1, lightings=1, cache=False)
    a, b = synthetic_norb("train", **small), synthetic_norb("train", variant="asymmetric", **small)
    assert torch.equal(a.labels, b.labels) and not torch.equal(a.images, b.images)
    assert _cache_key(0, 48) != _cache_key(0, 48, "asymmetric")
