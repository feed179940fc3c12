"""Tests for probcaps.data: IDX I/O, MNIST loading checks, placement, rotation, batches, synthetic digits."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from probcaps.data import (
    MNIST_FILES,
    PlacedMNIST,
    iterate_batches,
    load_mnist,
    md5_file,
    mnist_dir,
    num_batches,
    place_on_canvas,
    placed_mnist,
    random_offsets,
    read_idx,
    resolve_data_root,
    rotate,
    synthetic_digits,
    to_float,
    write_fake_mnist,
    write_idx,
)
from probcaps.errors import DataError


def _idx_header(shape, magic_type=0x08):
    return bytes([0, 0, magic_type, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)


# --- IDX ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", [True, False])
def test_idx_round_trip(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=(5,), dtype=np.uint8)
    write_idx(tmp_path / "images", images, gzip=compress)
    write_idx(tmp_path / "labels", labels, gzip=compress)
    assert ((tmp_path / "images").read_bytes()[:2] == b"\x1f\x8b") == compress
    got_images = read_idx(tmp_path / "images", ndim=3)
    got_labels = read_idx(tmp_path / "labels", ndim=1)
    assert got_images.dtype == np.uint8 and got_images.shape == (5, 7, 3)
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


def test_idx_gzip_detected_by_magic_not_name(tmp_path):
    arr = np.arange(12, dtype=np.uint8).reshape(1, 3, 4)
    raw_named_gz = tmp_path / "raw.gz"
    gz_named_raw = tmp_path / "compressed.idx"
    raw_named_gz.write_bytes(_idx_header(arr.shape) + arr.tobytes())
    gz_named_raw.write_bytes(gzip.compress(_idx_header(arr.shape) + arr.tobytes()))
    np.testing.assert_array_equal(read_idx(raw_named_gz), arr)
    np.testing.assert_array_equal(read_idx(gz_named_raw), arr)


@pytest.mark.parametrize("compress", [True, False])
def test_idx_truncated(tmp_path, compress):
    data = _idx_header((10, 28, 28)) + bytes(1000)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(data) if compress else data)
    with pytest.raises(DataError) as err:
        read_idx(path)
    msg = str(err.value)
    assert str(path) in msg and "truncated" in msg and "7840" in msg and "1000" in msg
    assert "\n" not in msg


def test_idx_truncated_header(tmp_path):
    path = tmp_path / "short.idx"
    path.write_bytes(_idx_header((10, 28, 28))[:9])
    with pytest.raises(DataError, match="truncated") as err:
        read_idx(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("compress", [True, False])
def test_idx_trailing_bytes(tmp_path, compress):
    data = _idx_header((2, 2, 2)) + bytes(8) + b"garbage"
    path = tmp_path / "labels-with-tail"
    path.write_bytes(gzip.compress(data) if compress else data)
    with pytest.raises(DataError, match="7 trailing bytes") as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_idx_garbage_after_gzip_stream(tmp_path):
    data = _idx_header((3,)) + bytes([1, 2, 3])
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(data) + b"not gzip at all")
    with pytest.raises(DataError) as err:
        read_idx(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("magic", [b"\x00\x00\x08\x02", b"\x12\x34\x08\x03", b"PK\x03\x04", b"\x00\x00\x08\x00"])
def test_idx_wrong_magic(tmp_path, magic):
    path = tmp_path / "bad-magic.idx"
    path.write_bytes(magic + bytes(64))
    with pytest.raises(DataError, match="bad magic") as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_idx_wrong_type_and_ndim(tmp_path):
    path = tmp_path / "float.idx"
    path.write_bytes(_idx_header((2,), magic_type=0x0D) + bytes(8))
    with pytest.raises(DataError, match="data type 0x0d"):
        read_idx(path)
    labels = tmp_path / "labels.idx"
    write_idx(labels, np.zeros(4, np.uint8), gzip=False)
    with pytest.raises(DataError, match="expected a 3-dimensional") as err:
        read_idx(labels, ndim=3)
    assert str(labels) in str(err.value)


@pytest.mark.parametrize("how", ["flip", "cut"])
def test_idx_corrupt_gzip(tmp_path, how):
    rng = np.random.default_rng(1)
    blob = gzip.compress(_idx_header((4, 28, 28)) + rng.integers(0, 256, 4 * 784, dtype=np.uint8).tobytes())
    if how == "flip":
        corrupt = bytearray(blob)
        corrupt[len(blob) // 2] ^= 0xFF
        corrupt[len(blob) // 2 + 1] ^= 0xFF
        blob = bytes(corrupt)
    else:
        blob = blob[: len(blob) // 2]
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(blob)
    with pytest.raises(DataError, match="gzip") as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_idx_missing_file(tmp_path):
    with pytest.raises(DataError) as err:
        read_idx(tmp_path / "nothing-here.gz")
    assert "nothing-here.gz" in str(err.value)


# --- MNIST loading -----------------------------------------------------------------------------------------------

def test_resolve_data_root(tmp_path, monkeypatch):
    monkeypatch.delenv("PROBCAPS_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_data_root() == tmp_path / "xdg" / "probcaps"
    monkeypatch.setenv("PROBCAPS_DATA", str(tmp_path / "env"))
    assert resolve_data_root() == tmp_path / "env"
    assert resolve_data_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("PROBCAPS_DATA")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_data_root() == tmp_path / "home" / ".cache" / "probcaps"
    assert mnist_dir(tmp_path) == tmp_path / "mnist"


def test_fake_mnist_loads_without_verify(tmp_path):
    write_fake_mnist(tmp_path, n_train=30, n_test=20, seed=3)
    images, labels = load_mnist("train", data_dir=tmp_path, verify=False)
    assert images.dtype == torch.uint8 and images.shape == (30, 28, 28)
    assert labels.dtype == torch.int64 and labels.shape == (30,)
    assert labels.min() >= 0 and labels.max() <= 9 and images.max() == 255
    expected_images, expected_labels = synthetic_digits(30, seed=_split_seed(3, "train"))
    assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    test_images, _ = load_mnist("test", data_dir=tmp_path, verify=False)
    assert test_images.shape == (20, 28, 28)
    # the in-process cache hands out copies: modifying one result must not change the next
    images.zero_()
    again, _ = load_mnist("train", data_dir=tmp_path, verify=False)
    assert torch.equal(again, expected_images)


def _split_seed(seed, split):
    from probcaps.data import derive_seed

    return derive_seed(seed, split)


def test_md5_mismatch(tmp_path):
    folder = write_fake_mnist(tmp_path, n_train=10, n_test=10)
    with pytest.raises(DataError, match="md5 mismatch") as err:
        load_mnist("test", data_dir=tmp_path)
    msg = str(err.value)
    assert str(folder / "t10k-images-idx3-ubyte.gz") in msg
    assert MNIST_FILES["t10k-images-idx3-ubyte.gz"][1] in msg
    assert md5_file(folder / "t10k-images-idx3-ubyte.gz") in msg


def test_missing_folder_and_file(tmp_path):
    with pytest.raises(DataError) as err:
        load_mnist("train", data_dir=tmp_path / "nowhere", verify=False)
    msg = str(err.value)
    assert str(tmp_path / "nowhere" / "mnist") in msg
    assert "--data-dir" in msg and "PROBCAPS_DATA" in msg and "probcaps download" in msg

    folder = write_fake_mnist(tmp_path / "root", n_train=10, n_test=10)
    (folder / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz") as err:
        load_mnist("train", data_dir=tmp_path / "root", verify=False)
    assert "--data-dir" in str(err.value)


def test_label_count_mismatch(tmp_path):
    folder = write_fake_mnist(tmp_path, n_train=10, n_test=10)
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.zeros(9, np.uint8))
    with pytest.raises(DataError, match="9 labels but") as err:
        load_mnist("test", data_dir=tmp_path, verify=False)
    assert "t10k-labels-idx1-ubyte.gz" in str(err.value)


def test_rewritten_file_is_reread(tmp_path):
    folder = write_fake_mnist(tmp_path, n_train=10, n_test=10)
    load_mnist("test", data_dir=tmp_path, verify=False)
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.full(10, 7, np.uint8))
    _, labels = load_mnist("test", data_dir=tmp_path, verify=False)
    assert labels.tolist() == [7] * 10


def _real_mnist_present() -> bool:
    folder = mnist_dir(resolve_data_root())
    return all((folder / name).is_file() for name in MNIST_FILES)


@pytest.mark.skipif(not _real_mnist_present(), reason="real MNIST not found under resolve_data_root()/mnist")
def test_real_mnist():
    folder = mnist_dir(resolve_data_root())
    for name, (size, md5) in MNIST_FILES.items():
        assert (folder / name).stat().st_size == size
        assert md5_file(folder / name) == md5
    train_x, train_y = load_mnist("train", verify=True)
    test_x, test_y = load_mnist("test", verify=True)
    assert train_x.shape == (60000, 28, 28) and train_x.dtype == torch.uint8
    assert test_x.shape == (10000, 28, 28) and test_y.shape == (10000,)
    assert train_y.dtype == torch.int64
    assert train_y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert test_y[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert torch.bincount(train_y, minlength=10).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265,
                                                              5851, 5949]
    assert int(train_x.max()) == 255 and int(train_x.min()) == 0


# --- transforms --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_place_on_canvas_single_pixel(dtype):
    digits = torch.zeros(2, 28, 28, dtype=dtype)
    digits[0, 3, 5] = 200
    digits[1, 27, 0] = 9
    offsets = torch.tensor([[2, -4], [-6, 6]])  # (dx, dy)
    out = place_on_canvas(digits, offsets, canvas=40)
    assert out.shape == (2, 40, 40) and out.dtype == dtype
    # centred 28 on 40 -> top-left (6, 6); row = 6 + dy + r, col = 6 + dx + c
    assert out[0, 5, 13] == 200 and out[0].sum() == 200
    assert out[1, 39, 0] == 9 and out[1].sum() == 9


def test_place_on_canvas_rejects_leaving_canvas():
    digits = torch.ones(3, 28, 28, dtype=torch.uint8)
    with pytest.raises(ValueError, match="digit 2"):
        place_on_canvas(digits, torch.tensor([[0, 0], [6, -6], [7, 0]]), canvas=40)


def test_random_offsets_range_and_determinism():
    a = random_offsets(5000, max_shift=6, generator=torch.Generator().manual_seed(1))
    b = random_offsets(5000, max_shift=6, generator=torch.Generator().manual_seed(1))
    c = random_offsets(5000, max_shift=6, generator=torch.Generator().manual_seed(2))
    assert a.shape == (5000, 2) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() == -6 and a.max() == 6
    assert set(a[:, 0].tolist()) == set(range(-6, 7)) and set(a[:, 1].tolist()) == set(range(-6, 7))


def test_rotate_single_pixel_odd_size():
    img = torch.zeros(4, 5, 5)
    img[:, 2, 3] = 1.0  # one pixel right of the centre pixel (2, 2)
    out = rotate(img, torch.tensor([90.0, 180.0, -90.0, 0.0]))
    assert out.shape == (4, 5, 5)
    # counter-clockwise on screen: +90 -> above centre, 180 -> left, -90 -> below
    for k, (r, c) in enumerate([(1, 2), (2, 1), (3, 2), (2, 3)]):
        assert out[k, r, c].item() == pytest.approx(1.0, abs=1e-4)
        assert out[k].sum().item() == pytest.approx(1.0, abs=1e-4)


def test_rotate_single_pixel_even_size_keeps_rank():
    img = torch.zeros(2, 1, 28, 28)
    img[:, 0, 13, 20] = 1.0  # centre is the corner between pixels 13 and 14; this pixel is 6.5 px right, 0.5 up
    out = rotate(img, 90.0)
    assert out.shape == (2, 1, 28, 28)
    assert out[0, 0, 7, 13].item() == pytest.approx(1.0, abs=1e-4)  # 6.5 px up, 0.5 px left of centre
    out180 = rotate(img[:, 0], 180.0)
    assert out180.shape == (2, 28, 28)
    assert out180[1, 14, 7].item() == pytest.approx(1.0, abs=1e-4)
    assert out180[1].sum().item() == pytest.approx(1.0, abs=1e-4)


def test_rotate_onto_larger_canvas_matches_placement():
    digits, _ = synthetic_digits(3, seed=5)
    rotated = rotate(to_float(digits), 0.0, canvas=40)
    placed = to_float(place_on_canvas(digits, torch.zeros(3, 2, dtype=torch.int64), canvas=40))
    torch.testing.assert_close(rotated, placed, atol=1e-5, rtol=0)


def test_to_float():
    x = torch.tensor([[0, 51, 255]], dtype=torch.uint8)
    y = to_float(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.tensor([[0.0, 0.2, 1.0]]))
    with pytest.raises(TypeError):
        to_float(y)


# --- batches -----------------------------------------------------------------------------------------------------

def _indexed_data(n=23, size=4):
    images = (torch.arange(n, dtype=torch.uint8)[:, None, None] * 10).expand(n, size, size).contiguous()
    labels = torch.arange(n)  # label = example index, to track order
    return images, labels


def test_num_batches():
    assert num_batches(23, 5) == 5 and num_batches(23, 5, drop_last=True) == 4
    assert num_batches(20, 5) == 4 and num_batches(20, 5, drop_last=True) == 4


def test_iterate_batches_shapes_and_coverage():
    images, labels = _indexed_data()
    batches = list(iterate_batches(images, labels, 5, shuffle=True, seed=1, epoch=0))
    assert len(batches) == 5 and [len(y) for _, y in batches] == [5, 5, 5, 5, 3]
    x0, y0 = batches[0]
    assert x0.shape == (5, 1, 4, 4) and x0.dtype == torch.float32 and y0.dtype == torch.int64
    seen = torch.cat([y for _, y in batches])
    assert sorted(seen.tolist()) == list(range(23))  # every example exactly once
    assert seen.tolist() != list(range(23))  # and actually shuffled
    for x, y in batches:  # images follow their labels
        torch.testing.assert_close(x[:, 0, 0, 0], y.float() * 10 / 255)
    dropped = list(iterate_batches(images, labels, 5, shuffle=True, seed=1, epoch=0, drop_last=True))
    assert len(dropped) == 4 and all(len(y) == 5 for _, y in dropped)
    plain = torch.cat([y for _, y in iterate_batches(images, labels, 5, shuffle=False)])
    assert plain.tolist() == list(range(23))


def test_iterate_batches_deterministic_and_resumable():
    images, labels = _indexed_data()
    run = lambda **kw: [y.tolist() for _, y in iterate_batches(images, labels, 4, shuffle=True, **kw)]
    first = run(seed=7, epoch=3)
    assert first == run(seed=7, epoch=3)
    assert first != run(seed=7, epoch=4) and first != run(seed=8, epoch=3)
    assert run(seed=7, epoch=3, start_batch=2) == first[2:]
    assert run(seed=7, epoch=3, start_batch=len(first)) == []


def test_iterate_batches_rotation():
    digits, labels = synthetic_digits(12, seed=2)
    kw = dict(shuffle=True, seed=4, epoch=1)
    a = [x for x, _ in iterate_batches(digits, labels, 5, rotation=30.0, **kw)]
    b = [x for x, _ in iterate_batches(digits, labels, 5, rotation=30.0, **kw)]
    resumed = [x for x, _ in iterate_batches(digits, labels, 5, rotation=30.0, start_batch=1, **kw)]
    plain = [x for x, _ in iterate_batches(digits, labels, 5, **kw)]
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    for u, v in zip(a[1:], resumed):
        assert torch.equal(u, v)
    assert all(float(x.min()) >= 0 and float(x.max()) <= 1 for x in a)
    assert not torch.allclose(a[0], plain[0], atol=1e-3)  # rotation really changed the images
    # zero maximum angle is the identity (up to bilinear rounding)
    zero = [x for x, _ in iterate_batches(digits, labels, 5, rotation=0.0, **kw)]
    torch.testing.assert_close(zero[0], plain[0], atol=1e-5, rtol=0)


# --- datasets ----------------------------------------------------------------------------------------------------

def test_placed_mnist_on_fake_data(tmp_path):
    write_fake_mnist(tmp_path, n_train=40, n_test=16)
    full = placed_mnist("train", data_dir=tmp_path, seed=0, verify=False)
    assert isinstance(full, PlacedMNIST) and len(full) == 40
    assert full.images.shape == (40, 40, 40) and full.images.dtype == torch.uint8
    assert full.offsets.dtype == torch.int64 and full.offsets.abs().max() <= 6
    digits, labels = load_mnist("train", data_dir=tmp_path, verify=False)
    assert torch.equal(full.labels, labels)
    assert torch.equal(full.images, place_on_canvas(digits, full.offsets, 40))
    assert full.images.sum(dtype=torch.int64) == digits.sum(dtype=torch.int64)  # nothing cropped
    limited = placed_mnist("train", data_dir=tmp_path, seed=0, limit=10, verify=False)
    assert len(limited) == 10 and torch.equal(limited.offsets, full.offsets[:10])
    assert torch.equal(placed_mnist("train", data_dir=tmp_path, seed=0, verify=False).offsets, full.offsets)
    assert not torch.equal(placed_mnist("train", data_dir=tmp_path, seed=1, verify=False).offsets, full.offsets)
    test = placed_mnist("test", data_dir=tmp_path, seed=0, verify=False)
    assert not torch.equal(test.offsets, full.offsets[:16])  # seeded by split too


def test_synthetic_digits():
    x, y = synthetic_digits(200, size=28, seed=0)
    assert x.shape == (200, 28, 28) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.bincount(y, minlength=10).tolist() == [20] * 10
    x2, y2 = synthetic_digits(200, size=28, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, synthetic_digits(200, size=28, seed=1)[0])
    ink = (x > 0).flatten(1).sum(1)
    assert ink.min() > 20 and (x == 255).flatten(1).any(1).all()  # every digit has a solid stroke
    # class means are distinct: nearest-class-mean classifies held-out synthetic digits well
    means = torch.stack([x[y == c].float().mean(0) for c in range(10)])
    xt, yt = synthetic_digits(100, seed=9)
    pred = torch.cdist(xt.flatten(1).float(), means.flatten(1)).argmin(1)
    assert (pred == yt).float().mean() > 0.8
    assert synthetic_digits(3, size=40)[0].shape == (3, 40, 40)


def test_load_digits_synthetic_and_mnist(tmp_path):
    # catches: the experiments' shared digit loader ignoring the limit, the split's seed or the data folder, or
    # accepting an unknown dataset / split silently
    from probcaps.data import load_digits, write_fake_mnist

    train, train_labels = load_digits("synthetic", "train", synthetic_sizes=(12, 5))
    test, _ = load_digits("synthetic", "test", synthetic_sizes=(12, 5))
    assert train.shape == (12, 28, 28) and train.dtype == torch.uint8 and test.shape == (5, 28, 28)
    assert train_labels.dtype == torch.int64
    assert not torch.equal(load_digits("synthetic", "train", limit=5)[0], test)  # train and test seeds differ
    assert load_digits("synthetic", "test", limit=3)[0].shape[0] == 3
    # the MNIST branch reads the data folder and verifies the files: the fake ones are not the official files
    write_fake_mnist(tmp_path, n_train=10, n_test=6)
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte.gz: md5 mismatch"):
        load_digits("mnist", "test", limit=4, data_dir=tmp_path)
    with pytest.raises(ValueError, match="dataset"):
        load_digits("svhn", "train")
    with pytest.raises(ValueError, match="split"):
        load_digits("synthetic", "validation")


def test_download_checked_writes_only_intact_files_and_tries_every_mirror(tmp_path):
    # catches: a file written before its size and digest are checked, a bad mirror ending the download although a
    # later mirror has the file, or a present intact file fetched again
    import hashlib

    from probcaps.data.mnist import download_checked

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    (good / "a.bin").write_bytes(b"payload")
    (bad / "a.bin").write_bytes(b"corrupt")
    files = {"a.bin": (7, hashlib.sha256(b"payload").hexdigest())}
    mirrors = [(bad.as_uri() + "/"), (tmp_path / "missing").as_uri() + "/", good.as_uri() + "/"]
    log = []
    out = download_checked(tmp_path / "data", files, mirrors, "sha256", timeout=5, log=log.append)
    assert (out / "a.bin").read_bytes() == b"payload" and log == [f"{out / 'a.bin'}: downloaded from {mirrors[2]}a.bin"]
    download_checked(out, files, mirrors[:1], "sha256", timeout=5, log=log.append)
    assert log[-1].endswith("present, sha256 ok")
    with pytest.raises(DataError, match="could not download from any mirror.*sha256"):
        download_checked(tmp_path / "other", files, mirrors[:2], "sha256", timeout=5, log=log.append)
    assert not (tmp_path / "other" / "a.bin").exists()
