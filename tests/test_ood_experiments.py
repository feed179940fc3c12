"""The Normal-pose system, affNIST loading and the recipe stand-in, and the out-of-distribution experiments on tiny
synthetic data (rotated digits, test-time VI re-encoding, affNIST files, rotated-MNIST training and its resume,
the Normal guide)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY40 as TINY40_COMMON
from conftest import train_tiny40

ROOT = Path(__file__).resolve().parent.parent

from probcaps.errors import DataError  # noqa: E402

TINY40 = [*TINY40_COMMON, "train.steps=3", "train.checkpoint_every=3"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 3-step delta-trained 40x40 model on synthetic digits: ``final.pt``."""
    return train_tiny40(tmp_path_factory.mktemp("tiny40"), TINY40)


@pytest.fixture(autouse=True)
def _setup(pyro_clean, seed):
    yield


# ------------------------------------------------------------------------------------------- affNIST files
def _digits(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = (torch.rand(n, 40, 40, generator=g) * 255).to(torch.uint8)
    return images, torch.arange(n) % 10


def test_affnist_mat_round_trip_and_layout(tmp_path):
    # catches: transposed images (MATLAB column-major) or labels out of step with the images
    from probcaps.data.affnist import load_affnist_mat, write_affnist_mat

    images, labels = _digits()
    path = write_affnist_mat(tmp_path / "test.mat", images, labels)
    got_images, got_labels = load_affnist_mat(path)
    assert torch.equal(got_images, images) and torch.equal(got_labels, labels)
    # the layout of the original files: column n of the 1600 x N matrix is image n in row-major order
    import scipy.io

    raw = scipy.io.loadmat(path)["affNISTdata"]["image"][0, 0]
    assert raw.shape == (1600, 6)
    assert np.array_equal(raw[:, 2].reshape(40, 40), images[2].numpy())
    assert raw[1, 0] == images[0, 0, 1]  # second entry: row 0, column 1


@pytest.mark.parametrize("case", ["garbage", "no_struct", "no_label", "wrong_rows", "label_count", "missing"])
def test_affnist_mat_rejects_malformed_files_naming_them(tmp_path, case):
    import scipy.io

    from probcaps.data.affnist import load_affnist_mat

    path = tmp_path / f"{case}.mat"
    images, labels = _digits(3)
    flat = images.numpy().reshape(3, -1).T
    if case == "garbage":
        path.write_bytes(b"MATLAB 5.0 MAT-file, this is not one" + bytes(200))
    elif case == "no_struct":
        scipy.io.savemat(path, {"images": flat})
    elif case == "no_label":
        scipy.io.savemat(path, {"affNISTdata": {"image": flat}})
    elif case == "wrong_rows":
        scipy.io.savemat(path, {"affNISTdata": {"image": flat[:784], "label_int": labels.numpy()}})
    elif case == "label_count":
        scipy.io.savemat(path, {"affNISTdata": {"image": flat, "label_int": labels.numpy()[:2]}})
    with pytest.raises(DataError) as err:
        load_affnist_mat(path)
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg


def test_affnist_recipe_is_seeded_keeps_the_ink_and_stays_in_range(tmp_path):
    # catches: unseeded transforms, digits pushed off the canvas, parameters outside the recipe's ranges
    from probcaps.data import synthetic_digits
    from probcaps.data.affnist import AFFNIST_RECIPE, affnist_recipe

    digits, _ = synthetic_digits(64, seed=3)
    a, pa = affnist_recipe(digits, seed=1)
    b, _ = affnist_recipe(digits, seed=1)
    c, _ = affnist_recipe(digits, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (64, 40, 40) and a.dtype == torch.uint8
    sx, sy, theta, shear = pa[:, 0], pa[:, 1], pa[:, 2], pa[:, 3]
    assert ((sx >= 0.8) & (sx <= 1.2) & (sy >= 0.8) & (sy <= 1.2)).all()
    assert (theta.abs() <= math.radians(AFFNIST_RECIPE["rotation_deg"]) + 1e-6).all()
    assert (shear.abs() <= 0.2 + 1e-6).all()
    # an affine map scales areas by |det| = sx * sy: the ink's total is kept up to that factor (nothing clipped)
    ratio = a.float().sum((1, 2)) / (digits.float().sum((1, 2)) * sx * sy)
    assert ratio.sub(1).abs().max() < 0.06


def test_affnist_recipe_test_set_is_cached_and_checked(fake_mnist_root, tmp_path):
    from probcaps.data.affnist import affnist_recipe_test

    cache = tmp_path / "cache"
    first, labels = affnist_recipe_test(seed=0, cache_dir=cache, verify=False)
    (cached,) = cache.glob("*.npz")
    again, _ = affnist_recipe_test(seed=0, cache_dir=cache, verify=False)
    assert torch.equal(first, again) and first.shape == (32, 40, 40) and labels.shape == (32,)
    # a corrupted cache is regenerated, not trusted
    cached.write_bytes(b"not an npz")
    fixed, _ = affnist_recipe_test(seed=0, cache_dir=cache, verify=False)
    assert torch.equal(fixed, first)


# ------------------------------------------------------------------------------------------- Normal-pose system
def test_normal_pose_system_trains_saves_and_reloads(tiny_checkpoint, tmp_path):
    # catches: a Normal-guide checkpoint that reloads as a delta guide (losing its scales)
    from probcaps.inference.capsule_svi import load_trained, train_capsules
    from probcaps.inference.guides import NormalPoseGuide

    cfg, system = load_trained(tiny_checkpoint)
    system.use_normal_poses(init_scale=0.05)
    train_capsules(cfg, tmp_path / "normal", progress=False, system=system)
    _, again = load_trained(tmp_path / "normal" / "final.pt")
    assert isinstance(again.guide, NormalPoseGuide) and again.guide_spec["family"] == "normal"
    assert torch.equal(again.guide.pose_scale_raw_parts, system.guide.pose_scale_raw_parts)
    with pytest.raises(NotImplementedError):
        again.reference_loss(torch.rand(2, 1, 40, 40))


# ------------------------------------------------------------------------------------------- entry points
def test_rotated_digits_entry_point(tiny_checkpoint, tmp_path):
    from probcaps.experiments import rotated_digits

    rc = rotated_digits.main(["--checkpoint", str(tiny_checkpoint), "--n-images", "3", "--steps", "3",
                              "--angles", "0", "90", "45", "--results-dir", str(tmp_path), "--quiet"])
    assert rc == 0
    m = json.loads((tmp_path / "rotated_digits.json").read_text())["metrics"]
    assert [r["angle"] for r in m["per_angle"]] == [0, 45, 90]
    assert m["n_images_total"] == 9 and "mse_reduction_at_90" in m["checks"]
    for name in ("elbo", "mse", "example"):
        assert (tmp_path / f"rotated_digits_{name}.png").is_file()
    assert "| 90° |" in rotated_digits.readme_table(tmp_path)


def test_rotated_digits_checks_follow_the_acceptance_criteria():
    from probcaps.experiments.rotated_digits import checks

    rows = [{"angle": 0, "elbo_encoder": 10, "elbo_ttvi": 11, "mse_encoder": 1.0, "mse_ttvi": 0.9},
            {"angle": 45, "elbo_encoder": 5, "elbo_ttvi": 9, "mse_encoder": 2.0, "mse_ttvi": 1.0},
            {"angle": 90, "elbo_encoder": 1, "elbo_ttvi": 0, "mse_encoder": 2.0, "mse_ttvi": 1.5}]
    c = checks(rows)
    assert c["ttvi_improves_elbo_at_every_angle_ge_45"] is False       # 90° got worse
    assert c["mse_reduction_at_90"] == pytest.approx(0.25) and c["mse_reduction_at_90_at_least_30pct"] is False
    assert c["elbo_not_worse_at_0"] is True


def test_reencoding_unchanged_parts_gives_the_encoders_objects(tiny_checkpoint):
    # catches: re-encoded objects that differ from the encoder's when the parts did not move
    from probcaps.inference.capsule_svi import load_trained
    from probcaps.inference.ttvi import reencode_parents

    _, system = load_trained(tiny_checkpoint)
    x = torch.rand(5, 1, 40, 40)
    lat = system.encoder.encode(x)
    again = reencode_parents(system.encoder, lat, batch_size=2)
    assert torch.allclose(again.parent_logits, lat.parent_logits, atol=1e-5)
    assert torch.allclose(again.parent_poses, lat.parent_poses, atol=1e-5)


def test_affnist_entry_point_reads_a_real_format_file(tiny_checkpoint, fake_mnist_root, tmp_path):
    from probcaps.data.affnist import write_affnist_mat
    from probcaps.experiments import affnist

    images, labels = _digits(12)
    mat = write_affnist_mat(tmp_path / "test.mat", images, labels)
    rc = affnist.main(["--checkpoint", str(tiny_checkpoint), "--affnist-mat", str(mat), "--cnn-seeds",
                       "--results-dir", str(tmp_path), "--name", "affnist_ceiling", "--quiet"])
    assert rc == 0
    m = json.loads((tmp_path / "affnist_ceiling.json").read_text())["metrics"]
    assert m["ood_name"] == "affNIST" and m["n_ood"] == 12 and m["cnn"] == []
    # the README table of a run under another name, written beside its JSON; no CNN row without a CNN
    table = (tmp_path / "affnist_ceiling.md").read_text()
    assert table == affnist.readme_table(tmp_path, name="affnist_ceiling") + "\n"
    assert "no CNN baseline in this run" in table and "supervised CNN" not in table
    assert affnist.readme_table(tmp_path) is None  # affnist.json itself was not written
    # the other seeds' checkpoints scored under <name>_seed<S> add mean ± std rows over every checkpoint
    (tmp_path / "affnist_ceiling_seed1.json").write_text((tmp_path / "affnist_ceiling.json").read_text())
    table = affnist.readme_table(tmp_path, name="affnist_ceiling")
    assert "2 checkpoints" in table and "± 0.0" in table


def test_affnist_bad_mat_is_one_line_error(tiny_checkpoint, tmp_path, capsys):
    from probcaps.experiments import affnist

    bad = tmp_path / "bad.mat"
    bad.write_bytes(b"\x00" * 64)
    assert affnist.main(["--checkpoint", str(tiny_checkpoint), "--affnist-mat", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.mat" in err[0]


def test_rotated_training_entry_point_and_resume(tmp_path):
    from probcaps.experiments import rotated_training

    args = ["--thetas", "90", "0", "--seeds", "0", "--out", str(tmp_path / "runs"), "--results-dir", str(tmp_path),
            "--quiet", *sum((["--set", s] for s in TINY40), [])]
    assert rotated_training.main(args) == 0
    m = json.loads((tmp_path / "rotated_training.json").read_text())["metrics"]
    assert [p["theta_max"] for p in m["per_theta"]] == [0, 90]
    assert m["finding"] is not None and (tmp_path / "rotated_training.png").is_file()
    # --resume reuses finished runs (their metrics files) instead of training again
    metrics_file = tmp_path / "runs" / "theta0_seed0" / "metrics.json"
    stamp = metrics_file.stat().st_mtime_ns
    assert rotated_training.main(args + ["--resume"]) == 0
    assert metrics_file.stat().st_mtime_ns == stamp
    assert "θmax" in rotated_training.readme_table(tmp_path)


def test_rotated_training_finding_reads_the_slope():
    from probcaps.experiments.rotated_training import finding

    down = finding([0, 45, 90, 180], [0.95, 0.93, 0.90, 0.85])
    assert down["accuracy_decreases_with_rotation"] and down["slope_points_per_90deg"] < 0
    assert down["drop_first_to_last_points"] == pytest.approx(10.0)
    assert not finding([0, 180], [0.8, 0.9])["accuracy_decreases_with_rotation"]


def test_normal_guide_entry_point(tiny_checkpoint, tmp_path):
    from probcaps.experiments import normal_guide

    rc = normal_guide.main(["--checkpoint", str(tiny_checkpoint), "--steps", "2", "--n-elbo-images", "8",
                            "--elbo-samples", "1", "--probe-train-limit", "16", "--out", str(tmp_path / "run"),
                            "--results-dir", str(tmp_path), "--checkpoint-out", str(tmp_path / "n.pt"), "--quiet"])
    assert rc == 0
    m = json.loads((tmp_path / "normal_guide.json").read_text())["metrics"]
    assert math.isfinite(m["delta"]["test_elbo_per_image"]) and math.isfinite(m["normal"]["test_elbo_per_image"])
    assert m["mean_part_pose_scale"] > 1e-3
    # the exported Normal-guide checkpoint runs test-time VI with per-image Normal poses
    from probcaps.inference.capsule_svi import load_trained
    from probcaps.inference.ttvi import run_ttvi

    _, system = load_trained(tmp_path / "n.pt")
    res = run_ttvi(system.model, system.guide, torch.rand(2, 1, 40, 40), steps=2, progress=False,
                   pose_family="normal")
    assert res.part_pose_scales.shape == (2, 3, 6)
