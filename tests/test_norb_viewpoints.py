"""The novel-viewpoint experiment on tiny data (training, matching, resuming, the all-views reference, the shipped
recipes) and the matched comparison's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

TINY = ["--set", "data.instances_per_split=1", "--set", "data.elevations=1", "--set", "data.lightings=1",
        "--set", "data.familiar_eval=30",
        "--set", "data.novel_eval=40", "--set", "caps.A=8", "--set", "caps.B=2", "--set", "caps.C=2",
        "--set", "caps.D=2", "--set", "cnn.channels=[4, 4]", "--set", "cnn.hidden=8",
        "--set", "caps_train.steps=4", "--set", "cnn_train.steps=4", "--set", "caps_train.batch_size=8",
        "--set", "cnn_train.batch_size=8", "--set", "caps_train.checkpoint_every=2",
        "--set", "cnn_train.checkpoint_every=2", "--set", "caps_train.warmup_steps=1",
        "--set", "cnn_train.warmup_steps=1"]


def test_norb_viewpoints_entry_point(tmp_path):
    # catches: the entry point failing to train, evaluate, match, resume or plot on tiny data
    from probcaps.experiments import norb_viewpoints

    results, runs = tmp_path / "results", tmp_path / "runs"
    args = ["--seeds", "0", "--out", str(runs), "--results-dir", str(results), "--data-dir", str(tmp_path),
            "--quiet", *TINY]
    assert norb_viewpoints.main(args) == 0
    summary = json.loads((results / "norb_azimuth.json").read_text())  # the default config's name
    assert summary["provenance"]["configs"]["data"]["variant"] == "asymmetric"
    per_seed = summary["metrics"]["per_seed"]
    assert [r["seed"] for r in per_seed] == [0]
    for r in per_seed:
        assert r["caps_familiar_acc"] >= r["target_familiar_acc"] and r["cnn_familiar_acc"] >= r["target_familiar_acc"]
    evals = [json.loads(line) for line in (runs / "seed0" / "caps" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert set(evals[-1]["novel_by_azimuth"]) <= {str(a) for a in range(60, 281, 20)}
    for r in per_seed:  # tiny runs: the whole training set is scored
        assert 0.0 <= r["caps_final_train_acc"] <= 1.0 and 0.0 <= r["cnn_final_train_acc"] <= 1.0
    assert summary["metrics"]["n_train_eval"] == summary["metrics"]["n_train"]
    for name in ("by_azimuth", "training", "examples", "class_poses"):
        assert (results / f"norb_azimuth_{name}.png").is_file()
    table = norb_viewpoints.readme_table(results, name="norb_azimuth")
    assert "synthetic, asymmetric" in table.splitlines()[0]
    assert "matrix capsules" in table and "novel-view" in table and "training-image accuracy" in table
    assert "Novel-view error reduction per seed (%): " in table
    # resume with finished runs: nothing is retrained, the same numbers come out
    assert norb_viewpoints.main(args + ["--resume", "--no-figures"]) == 0
    again = json.loads((results / "norb_azimuth.json").read_text())["metrics"]["per_seed"]
    assert [r["caps_novel_acc"] for r in again] == [r["caps_novel_acc"] for r in per_seed]


def test_train_eval_subset_is_fixed_training_images(tmp_path):
    # catches: the training-image score drawn from test images, from novel views, or from a different subset per call
    from probcaps.data.smallnorb import TRAIN_AZIMUTHS
    from probcaps.experiments.norb_viewpoints import load_config, load_sets

    cfg = load_config(ROOT / "experiments" / "configs" / "norb_azimuth.toml", [
        "data.instances_per_split=1", "data.elevations=1", "data.lightings=1", "data.train_eval=12"])
    sets, again = load_sets(cfg["data"], tmp_path), load_sets(cfg["data"], tmp_path)
    part, train = sets["train_eval"], sets["train"]
    assert len(part) == 12 and len(train) == 30
    assert set(part.azimuth.tolist()) <= set(TRAIN_AZIMUTHS)
    assert torch.equal(part.images, again["train_eval"].images)
    # every scored image is one of the training images, with its own label
    flat = train.images.reshape(len(train), -1)
    for img, label in zip(part.images.reshape(len(part), -1), part.labels):
        hits = (flat == img).all(-1).nonzero().flatten()
        assert len(hits) >= 1 and (train.labels[hits] == label).any()
    cfg["data"].train_eval = 0
    assert len(load_sets(cfg["data"], tmp_path)["train_eval"]) == 30


def test_matched_comparison_arithmetic():
    from probcaps.experiments.norb_viewpoints import matched_comparison

    def rec(step, fam, nov):
        return {"step": step, "familiar_acc": fam, "novel_acc": nov, "novel_by_azimuth": {},
                "familiar_by_azimuth": {}, "novel_by_elevation": {}, "familiar_by_elevation": {}}

    logs = {"caps": [rec(0, 0.2, 0.2), rec(10, 0.9, 0.8), rec(20, 0.95, 0.85)],
            "cnn": [rec(0, 0.2, 0.2), rec(10, 0.92, 0.6), rec(20, 0.99, 0.7)]}
    m = matched_comparison(logs)
    # target = min(0.95, 0.99) = 0.95: capsules at step 20 (novel 0.85), the CNN at step 20 (0.99 >= 0.95; novel 0.7)
    assert m["target_familiar_acc"] == 0.95 and m["caps_step"] == 20 and m["cnn_step"] == 20
    assert m["novel_error_reduction"] == pytest.approx(1 - 0.15 / 0.3)
    # interpolated: the capsules between step 10 (0.9, 0.8) and 20 (0.95, 0.85) at 0.95 -> 0.85; the CNN between
    # step 10 (0.92, 0.6) and 20 (0.99, 0.7) at 0.95: 0.6 + (0.03 / 0.07) * 0.1
    cnn = 0.6 + 0.03 / 0.07 * 0.1
    assert m["caps_novel_acc_interpolated"] == pytest.approx(0.85)
    assert m["cnn_novel_acc_interpolated"] == pytest.approx(cnn)
    assert m["novel_error_reduction_interpolated"] == pytest.approx(1 - 0.15 / (1 - cnn))
    from probcaps.experiments.norb_viewpoints import novel_at_target

    assert novel_at_target(logs["cnn"], 0.2) == 0.2           # reached at the first evaluation: read as it is
    assert novel_at_target(logs["cnn"], 0.92) == 0.6          # reached exactly


def test_error_reduction_line_gives_seeds_and_standard_error():
    # catches: a per-seed list out of seed order, or the standard deviation passed off as the standard error
    from probcaps.experiments.norb_viewpoints import error_reduction_line

    runs = [{"novel_error_reduction": r, "novel_error_reduction_interpolated": r + 0.01} for r in (0.3, 0.1, 0.2)]
    # mean 20, std 10, standard error 10 / sqrt(3) = 5.77; t(0.975, 2 degrees of freedom) = 4.303, so the
    # interval is 20 ± 24.84
    assert error_reduction_line(runs) == ("Novel-view error reduction per seed (%): 30.0, 10.0, 20.0 (mean 20.0 ± "
                                          "5.8 standard error; 95% t-interval -4.8 to 44.8); interpolated 31.0, 11.0, "
                                          "21.0 (mean 21.0 ± 5.8 standard error; 95% t-interval -3.8 to 45.8).")
    older = [{"novel_error_reduction": 0.25}]  # results written before the interpolated reading; one seed
    assert error_reduction_line(older) == "Novel-view error reduction per seed (%): 25.0."


def test_norb_viewpoints_bad_config_is_one_line(tmp_path, capsys):
    from probcaps.experiments import norb_viewpoints

    assert norb_viewpoints.main(["--config", str(tmp_path / "nope.toml"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.toml" in err[0]
    assert norb_viewpoints.main(["--set", "data.split=lighting", "--quiet"]) == 2
    assert norb_viewpoints.main(["--set", 'data.variant="cubes"', "--quiet"]) == 2
    assert "data.variant" in capsys.readouterr().err
    assert norb_viewpoints.main(["--set", 'data.train_views="novel"', "--quiet"]) == 2
    assert "data.train_views" in capsys.readouterr().err


def test_all_views_reference_trains_on_every_view_and_reports_the_ends(tmp_path):
    # catches: the all-views reference still training on the familiar azimuths only, scoring other test images than
    # the matched comparison, or its table passing off a matched comparison it did not make
    from probcaps.data.smallnorb import TRAIN_AZIMUTHS
    from probcaps.experiments import norb_viewpoints

    configs = ROOT / "experiments" / "configs"
    tiny = TINY[1::2]  # the overrides without their "--set"
    familiar = norb_viewpoints.load_sets(norb_viewpoints.load_config(configs / "norb_azimuth.toml", tiny)["data"],
                                         tmp_path)
    cfg = norb_viewpoints.load_config(configs / "norb_all_views.toml", tiny)
    assert cfg["data"].train_views == "all" and cfg["data"].standardise_images and cfg["caps"].conv1_batchnorm
    every = norb_viewpoints.load_sets(cfg["data"], tmp_path)
    assert set(familiar["train"].azimuth.tolist()) == set(TRAIN_AZIMUTHS)
    assert set(every["train"].azimuth.tolist()) == set(range(0, 360, 20))
    assert len(every["train"]) == 3 * len(familiar["train"])
    for part in ("familiar", "novel"):  # the same test images as the matched comparison
        assert torch.equal(every[part].images, familiar[part].images)

    results = tmp_path / "results"
    name = "norb_all_views"
    assert norb_viewpoints.main(["--config", str(configs / f"{name}.toml"), "--seeds", "0", "--out",
                                 str(tmp_path / "runs"), "--results-dir", str(results), "--data-dir", str(tmp_path),
                                 "--quiet", "--no-figures", *TINY]) == 0
    metrics = json.loads((results / f"{name}.json").read_text())["metrics"]
    assert metrics["train_views"] == "all" and metrics["n_train"] == len(every["train"])
    run = metrics["per_seed"][0]
    assert "novel_error_reduction" not in run and "target_familiar_acc" not in run
    last = json.loads((tmp_path / "runs" / "seed0" / "cnn" / "eval.jsonl").read_text().splitlines()[-1])
    assert run["cnn_final_novel_acc"] == last["novel_acc"] and run["cnn_novel_by_azimuth"] == last["novel_by_azimuth"]
    table = norb_viewpoints.readme_table(results, name=name)
    assert table.startswith("| trained on all views (synthetic, asymmetric)") and "matched" not in table
    assert f"| {100 * run['cnn_final_novel_acc']:.1f} |" in table.splitlines()[3]


@pytest.mark.parametrize("name", ["norb_azimuth", "norb_elevation", "norb_all_views"])
def test_shipped_norb_config_is_the_config_its_results_were_trained_with(name):
    # catches: a recipe file drifting from the config recorded in the provenance of the results it names
    from probcaps.experiments import norb_viewpoints

    shipped = norb_viewpoints.load_config(ROOT / "experiments" / "configs" / f"{name}.toml")
    trained = json.loads((ROOT / "results" / "norb_viewpoints" / f"{name}.json").read_text())["provenance"]["configs"]
    for section, values in shipped.items():
        if hasattr(values, "to_dict"):  # keys added since hold their defaults
            stored = {**type(values)().to_dict(), **trained[section]}
            assert values.to_dict() == {k: v for k, v in stored.items() if k in values.to_dict()}, section


@pytest.mark.parametrize("path", sorted((ROOT / "experiments" / "configs").glob("norb_*.toml")),
                         ids=lambda p: p.stem)
def test_shipped_norb_configs_load_and_name_their_results(path):
    # catches: a shipped config with a key the schema does not know, a broken base, or a results name that
    # differs from its file name (and would overwrite another table's results)
    from probcaps.experiments import norb_viewpoints

    assert norb_viewpoints.load_config(path)["name"] == path.stem


def test_training_figure_averages_seeds_only_at_shared_steps(tmp_path, capsys, monkeypatch):
    # catches: seeds evaluated at different steps averaged point by point as if they were aligned
    from probcaps.errors import ConfigError
    from probcaps.experiments import norb_viewpoints

    def log(steps, acc=0.5):
        return [{"step": t, "familiar_acc": acc + t / 1000, "novel_acc": 0.4} for t in steps]

    aligned = {s: {"caps": log([0, 80]), "cnn": log([0, 40, 80])} for s in (0, 1)}
    norb_viewpoints.plot_training(aligned, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
    # one seed lacks the evaluation at step 80: only 0 and 160 are averaged, and pairing by step (not by position)
    # gives each shared step the same accuracy from both seeds
    gap = [log([0, 80, 160]), log([0, 160])]
    assert norb_viewpoints.shared_steps(gap, "caps") == [0, 160]
    assert "step(s) 80 are missing" in capsys.readouterr().err
    drawn = []
    monkeypatch.setattr(norb_viewpoints.plotting, "plot_curve_panels", lambda panels, path: drawn.extend(panels))
    norb_viewpoints.plot_training({0: {"caps": gap[0], "cnn": log([0, 40])}, 1: {"caps": gap[1], "cnn": log([0, 40])}},
                                  tmp_path / "g.png")
    steps, mean, std = drawn[0]["curves"]["matrix capsules"]
    assert steps == [0, 160] and np.allclose(mean, [0.5, 0.66]) and np.allclose(std, 0.0)
    misaligned = {0: aligned[0], 1: {"caps": log([0, 40]), "cnn": log([0, 40, 80])}}
    with pytest.raises(ConfigError, match="caps: the seeds share fewer than two evaluation steps"):
        norb_viewpoints.plot_training(misaligned, tmp_path / "u.png")
