"""The MNIST experiment on tiny synthetic data: seeds aggregated, files named after the config, the exported
checkpoint evaluating as trained; its bad input; the training loop's parameter groups."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_mnist_probe_entry_point(tmp_path, tiny_toml, pyro_clean):
    # catches: the MNIST script failing to train, evaluate, aggregate seeds or export the checkpoint, or naming
    # its files after anything but the config's name
    from probcaps.experiments import mnist_probe

    results, ckpt = tmp_path / "results", tmp_path / "ck.pt"
    rc = mnist_probe.main(["--config", str(tiny_toml), "--seeds", "0", "1", "--out", str(tmp_path / "runs"),
                           "--results-dir", str(results), "--checkpoint-out", str(ckpt), "--quiet",
                           "--set", "train.steps=3"])
    assert rc == 0
    summary = json.loads((results / "tiny.json").read_text())
    per_seed = summary["metrics"]["per_seed"]
    assert [r["seed"] for r in per_seed] == [0, 1]
    accs = [r["probe_presence_pose_test_acc"] for r in per_seed]
    assert summary["metrics"]["probe_presence_pose_test_acc_mean"] == pytest.approx(sum(accs) / 2)
    # the results folder gets the seeds' summary and the figures the page shows; each seed's results stay in its run
    assert sorted(p.name for p in results.glob("*.png")) == sorted(
        ["tiny_training.png", *(f"tiny_seed0_{figure}.png" for figure in mnist_probe.PAGE_FIGURES)])
    assert not list(results.glob("tiny_seed*.json"))
    assert [json.loads((tmp_path / "runs" / f"seed{s}" / f"tiny_seed{s}.json").read_text())["metrics"]
            ["probe_presence_pose_test_acc"] for s in (0, 1)] == accs
    # the exported checkpoint evaluates without training and holds no optimiser state
    exported = torch.load(ckpt, weights_only=False)
    assert "optimiser" not in exported and exported["metadata"]["kind"] == "capsule_model"
    from probcaps.inference.evaluate import evaluate_checkpoint

    metrics = evaluate_checkpoint(ckpt, name="again", results_dir=results, progress=False, figures=False)
    assert metrics["probe_presence_pose_test_acc"] == pytest.approx(per_seed[0]["probe_presence_pose_test_acc"])
    # exported under another name, the model carries that name (its results files' under `probcaps evaluate`)
    from probcaps.experiments.common import export_checkpoint

    renamed = export_checkpoint(tmp_path / "runs" / "seed0" / "final.pt", tmp_path / "renamed.pt", "other")
    again = torch.load(renamed, weights_only=False)
    assert again["metadata"]["name"] == "other" and exported["metadata"]["name"] == "tiny"
    assert all(torch.equal(again["module"][k], v) for k, v in exported["module"].items())


def test_mnist_probe_aggregates_a_seed_whose_model_was_not_kept(tmp_path, tiny_toml, pyro_clean, capsys):
    # catches: --reuse-results retraining a seed whose run folder is gone though its results file records this very
    # run, taking a results file of another config, or exporting a model that is not there
    import shutil

    from probcaps.experiments import mnist_probe

    runs, results = tmp_path / "runs", tmp_path / "results"
    args = ["--config", str(tiny_toml), "--seeds", "0", "1", "--out", str(runs), "--results-dir", str(results),
            "--checkpoint-out", "", "--quiet", "--set", "train.steps=2", "--set", "eval.figures=false"]
    assert mnist_probe.main(args) == 0
    first = json.loads((results / "tiny.json").read_text())["metrics"]
    shutil.rmtree(runs / "seed0")
    assert mnist_probe.main([*args, "--resume", "--reuse-results", "--checkpoint-out", str(tmp_path / "m.pt")]) == 0
    again = json.loads((results / "tiny.json").read_text())["metrics"]
    assert not (runs / "seed0").exists() and not (tmp_path / "m.pt").exists()
    assert again["per_seed"] == first["per_seed"]
    assert "not exported" in capsys.readouterr().out
    assert mnist_probe.main([*args[:-4], "--set", "train.steps=3", "--resume", "--reuse-results"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tiny.json" in err and "config" in err
    assert not (runs / "seed0").exists()


def test_mnist_probe_reads_a_trained_model_out_with_the_runs_eval_settings(tmp_path, tiny_toml, pyro_clean):
    # catches: a finished run read out again (--resume) with the evaluation settings it was trained with instead of
    # the recipe's own now, so a readout added to a recipe after training never reaches its results
    from probcaps.experiments import mnist_probe

    runs, results = tmp_path / "runs", tmp_path / "results"
    args = ["--config", str(tiny_toml), "--seeds", "0", "--out", str(runs), "--results-dir", str(results),
            "--checkpoint-out", "", "--quiet", "--set", "train.steps=2", "--set", "eval.figures=false"]
    assert mnist_probe.main(args) == 0
    first = json.loads((runs / "seed0" / "tiny_seed0.json").read_text())
    assert "mlp_presence_pose_test_acc" not in first["metrics"]
    assert mnist_probe.main([*args, "--resume", "--set", "eval.nonlinear_probes=true"]) == 0
    again = json.loads((runs / "seed0" / "tiny_seed0.json").read_text())
    assert 0.0 <= again["metrics"]["mlp_presence_pose_test_acc"] <= 1.0
    assert again["provenance"]["configs"]["eval"]["nonlinear_probes"] is True
    assert again["metrics"]["probe_presence_pose_test_acc"] == first["metrics"]["probe_presence_pose_test_acc"]


def test_mnist_probe_records_a_try_as_one_file_of_the_table_of_tries(tmp_path, tiny_toml, pyro_clean):
    # catches: a try leaving per-seed files and figures in the results folder, a record whose changes are not the
    # run's differences from mnist.toml (or miss its --set), or whose numbers are not its seeds' mean ± std
    from probcaps.experiments import mnist_probe
    from probcaps.report import load_try

    runs, results = tmp_path / "runs", tmp_path / "results"
    assert mnist_probe.main(["--config", str(tiny_toml), "--seeds", "0", "1", "--out", str(runs), "--results-dir",
                             str(results), "--quiet", "--set", "train.steps=2", "--set", "model.temperature=0.7",
                             "--name", "a_try", "--try"]) == 0
    assert sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file()) == [
        "ablations.md", "ablations/a_try.json"]
    record = load_try(results / "ablations" / "a_try.json")
    assert record["changed"]["model.temperature"] == 0.7 and record["changed"]["train.steps"] == 2
    recipe = mnist_probe.config_dicts(mnist_probe.load_experiment_config(mnist_probe.CONFIGS_DIR / "mnist.toml"))
    assert record["changed"]["model.template_size"] == 5 and "train.seed" not in record["changed"]
    assert all(recipe[key.split(".")[0]].get(key.split(".")[1]) != value for key, value in record["changed"].items())
    per_seed = [json.loads((runs / f"seed{s}" / f"a_try_seed{s}.json").read_text())["metrics"] for s in (0, 1)]
    accs = [m["probe_presence_pose_test_acc"] for m in per_seed]
    assert record["metrics"]["probe_presence_pose_test_acc"] == pytest.approx(
        {"mean": sum(accs) / 2, "std": abs(accs[0] - accs[1]) / 2 ** 0.5})
    assert record["seeds"] == [0, 1] and record["steps"] == 2 and record["device"].startswith("cpu")
    assert "`a_try`" in (results / "ablations.md").read_text()


def test_mnist_probe_gathers_a_try_whose_seeds_ran_apart(tmp_path, tiny_toml, pyro_clean, monkeypatch):
    # catches: --reuse-results on a try looking for its seeds' results in the results folder, where a try never
    # writes them, so gathering seeds that ran as separate processes evaluates every one of them again
    from probcaps.experiments import mnist_probe
    from probcaps.report import load_try

    runs, results = tmp_path / "runs", tmp_path / "results"
    args = ["--config", str(tiny_toml), "--out", str(runs), "--quiet", "--set", "train.steps=2", "--name", "a_try",
            "--try"]
    for seed in (0, 1):  # each seed on its own, its row going elsewhere
        assert mnist_probe.main([*args, "--seeds", str(seed), "--results-dir", str(tmp_path / f"apart{seed}")]) == 0
    per_seed = [json.loads((runs / f"seed{s}" / f"a_try_seed{s}.json").read_text())["metrics"] for s in (0, 1)]

    def no_evaluation(*a, **kw):
        raise AssertionError("a seed with its results was evaluated again")

    monkeypatch.setattr(mnist_probe, "evaluate_checkpoint", no_evaluation)
    assert mnist_probe.main([*args, "--seeds", "0", "1", "--results-dir", str(results), "--resume",
                             "--reuse-results"]) == 0
    record = load_try(results / "ablations" / "a_try.json")
    accs = [m["kmeans_presence_test_acc"] for m in per_seed]
    assert record["seeds"] == [0, 1] and record["metrics"]["kmeans_presence_test_acc"]["mean"] == pytest.approx(
        sum(accs) / 2)


def test_mnist_probe_gathers_a_try_seed_from_its_record(tmp_path, tiny_toml, pyro_clean, monkeypatch, capsys):
    # catches: a try's recorded seed lost with its run folder, so adding a seed to a try trains its first seeds
    # again; or a recorded seed of another config taken into the row
    import shutil

    from probcaps.experiments import mnist_probe
    from probcaps.report import load_try

    runs, results = tmp_path / "runs", tmp_path / "results"
    args = ["--config", str(tiny_toml), "--out", str(runs), "--quiet", "--set", "train.steps=2", "--name", "a_try",
            "--try", "--results-dir", str(results)]
    assert mnist_probe.main([*args, "--seeds", "0"]) == 0
    first = load_try(results / "ablations" / "a_try.json")
    assert [r["seed"] for r in first["per_seed"]] == [0] and first["per_seed"][0]["steps"] == 2
    shutil.rmtree(runs / "seed0")  # the run folder is cleaned away; the record stays
    evaluated = []
    evaluate = mnist_probe.evaluate_checkpoint
    monkeypatch.setattr(mnist_probe, "evaluate_checkpoint", lambda *a, **kw: evaluated.append(kw["name"]) or
                        evaluate(*a, **kw))
    assert mnist_probe.main([*args, "--seeds", "0", "1", "--resume", "--reuse-results", "--set",
                             "train.steps=3"]) == 2
    assert re.search(r"a_try\.json: it records seed 0 of another config", capsys.readouterr().err)
    assert mnist_probe.main([*args, "--seeds", "0", "1", "--resume", "--reuse-results"]) == 0
    assert evaluated == ["a_try_seed1"] and not (runs / "seed0").exists()
    record = load_try(results / "ablations" / "a_try.json")
    accs = [r["probe_presence_test_acc"] for r in record["per_seed"]]
    assert record["seeds"] == [0, 1] and accs[0] == first["per_seed"][0]["probe_presence_test_acc"]
    assert record["metrics"]["probe_presence_test_acc"] == pytest.approx(
        {"mean": sum(accs) / 2, "std": abs(accs[0] - accs[1]) / 2 ** 0.5})


def test_mnist_probe_train_only_exports_where_told(tmp_path, tiny_toml, pyro_clean, monkeypatch):
    # catches: a seed trained on its own (--train-only) not exported to --checkpoint-out, exported by default
    # over the committed checkpoints/<name>.pt, or recording the config's name instead of the run's --name
    from probcaps.experiments import mnist_probe

    monkeypatch.chdir(tmp_path)  # the default export, checkpoints/<name>.pt, is under the current folder
    args = ["--config", str(tiny_toml), "--seeds", "1", "--out", str(tmp_path / "runs"), "--train-only", "--quiet",
            "--results-dir", str(tmp_path / "results"), "--set", "train.steps=2", "--name", "trial"]
    assert mnist_probe.main(args) == 0
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "results").exists()
    assert mnist_probe.main([*args, "--resume", "--checkpoint-out", str(tmp_path / "seed1.pt")]) == 0
    exported = torch.load(tmp_path / "seed1.pt", weights_only=False)
    assert "optimiser" not in exported and exported["state"]["step"] == 2
    assert exported["train_config"]["seed"] == 1 and exported["metadata"]["name"] == "trial"


def test_checkpoint_export_path_follows_the_run_name(tmp_path, monkeypatch):
    # catches: a short run under another --name silently overwriting the committed checkpoints/mnist.pt, or an
    # export written into the installed package instead of the current folder
    from probcaps.experiments.common import checkpoint_out_path

    assert checkpoint_out_path(None, "mnist") == Path("checkpoints") / "mnist.pt"
    assert checkpoint_out_path(None, "trial") == Path("checkpoints") / "trial.pt"
    assert checkpoint_out_path("elsewhere/x.pt", "trial") == Path("elsewhere/x.pt")
    assert checkpoint_out_path("", "trial") is None


def test_ablations_table_lays_out_one_row_per_try(tmp_path):
    # catches: a try's mean ± std, seeds or commit put in the wrong row or column, a metric it never measured given a
    # number, a run on a tree with uncommitted changes not marked, or a record without its keys read silently
    from probcaps.errors import DataError
    from probcaps.experiments import mnist_probe

    folder = tmp_path / "ablations"
    folder.mkdir()

    def record(name, metrics, **extra):
        return {"name": name, "changed": {"model.part_pose_std_max": 0.1, "encoder.bf16": False}, "metrics": metrics,
                "seeds": [0, 1], "steps": 2500, "commit": "abc1234", "device": "cpu", "command": "x", **extra}

    (folder / "b_try.json").write_text(json.dumps(record("b_try", {
        "probe_presence_pose_test_acc": {"mean": 0.981, "std": 0.002}, "test_elbo_per_image": 2301.4,
        "template_distinctness_mean": 0.2134, "dominant_object_test_acc": 0.9461})))
    (folder / "a_try.json").write_text(json.dumps(record("a_try", {"kmeans_posterior_counts_test_acc": 0.5},
                                                         note="uncommitted changes")))
    assert mnist_probe.ablations_table(tmp_path / "none") is None
    rows = [line for line in mnist_probe.ablations_table(tmp_path).splitlines() if line.startswith("| `")]
    assert rows == ["| `a_try` | encoder.bf16 = false; model.part_pose_std_max = 0.1 | 0, 1 | 2500 | 50.0 | — | — | "
                    "— | — | — | — | — | — | — | abc1234* |",
                    "| `b_try` | encoder.bf16 = false; model.part_pose_std_max = 0.1 | 0, 1 | 2500 | — | — | "
                    "98.1 ± 0.2 | — | — | — | 2301 | — | 0.213 | 94.6 | abc1234 |"]
    (folder / "c_try.json").write_text(json.dumps({"name": "c_try", "metrics": {}}))
    with pytest.raises(DataError, match=r"c_try\.json: a try's record lacks 'changed'"):
        mnist_probe.ablations_table(tmp_path)


def test_layers_table_reads_seed_summaries_and_single_models(tmp_path):
    # catches: a single model's results (no per_seed) dropped or misread, a column out of its place, or a row for a
    # model set with no results
    from probcaps.experiments import mnist_probe
    from probcaps.provenance import write_results

    keys = ["mean_active_parents", "probe_presence_pose_test_acc", "probe_parts_test_acc",
            "probe_parts_in_parent_frame_test_acc", "probe_presence_pose_parts_in_parent_frame_test_acc",
            "probe_part_residuals_test_acc", "part_pose_explained", "object_class_purity"]

    def run(offset):
        return {key: 0.1 * (i + 1) + offset for i, key in enumerate(keys)}

    (seeds_name, seeds_what), (single_name, single_what) = mnist_probe.LAYER_RUNS[0], mnist_probe.LAYER_RUNS[1]
    write_results(tmp_path / f"{seeds_name}.json", {"per_seed": [run(0.0), run(0.02)]}, {})
    write_results(tmp_path / f"{single_name}.json", run(0.0), {})
    assert mnist_probe.layers_table(tmp_path / "none") is None
    rows = [line for line in mnist_probe.layers_table(tmp_path).splitlines() if line.startswith("| ")][2:]
    assert rows == [f"| {seeds_what} | `{seeds_name}` | 2 | 0.1 ± 0.0 | 21.0 ± 1.4 | 31.0 ± 1.4 | 41.0 ± 1.4 | "
                    "51.0 ± 1.4 | 61.0 ± 1.4 | 0.710 ± 0.014 | 0.810 ± 0.014 |",
                    f"| {single_what} | `{single_name}` | 1 | 0.1 | 20.0 | 30.0 | 40.0 | 50.0 | 60.0 | 0.700 | 0.800 |"]


def test_nonlinear_table_pairs_each_probe_with_its_network(tmp_path):
    # catches: the network's accuracy put under the linear probe's head (or another feature set's), a model set
    # without codes given numbers for them, or a row for a model set with no results
    from probcaps.experiments import mnist_probe
    from probcaps.provenance import write_results

    def run(offset, codes=True):
        keys = [f"{kind}_{key}_test_acc" for key, _ in mnist_probe.NONLINEAR_COLUMNS for kind in ("probe", "mlp")]
        return {"mean_active_parents": 2.0, **{key: 0.1 * (i + 1) + offset for i, key in enumerate(keys)
                                               if codes or "code" not in key}}

    (seeds_name, seeds_what), (single_name, single_what) = mnist_probe.NONLINEAR_RUNS[1], mnist_probe.NONLINEAR_RUNS[0]
    write_results(tmp_path / f"{seeds_name}.json", {"per_seed": [run(0.0), run(0.02)]}, {})
    write_results(tmp_path / f"{single_name}.json", run(0.0, codes=False), {})
    assert mnist_probe.nonlinear_table(tmp_path / "none") is None
    lines = mnist_probe.nonlinear_table(tmp_path).splitlines()
    assert lines[0].split(" | ")[4:6] == ["objects: prior presences, linear (%)",
                                          "objects: prior presences, network (%)"]
    assert lines[2:4] == [
        f"| {single_what} | `{single_name}` | 1 | 2.0 | 10.0 | 20.0 | 30.0 | 40.0 | — | — | 70.0 | 80.0 |",
        f"| {seeds_what} | `{seeds_name}` | 2 | 2.0 ± 0.0 | 11.0 ± 1.4 | 21.0 ± 1.4 | 31.0 ± 1.4 | 41.0 ± 1.4 | "
        "51.0 ± 1.4 | 61.0 ± 1.4 | 71.0 ± 1.4 | 81.0 ± 1.4 |"]


def test_recipes_table_puts_each_shipped_recipe_in_its_own_column(tmp_path):
    # catches: a recipe's column filled from another recipe's seeds, a share not scaled to %, a missing recipe given a
    # column, or the training minutes not of their own seeds
    from probcaps.experiments import mnist_probe
    from probcaps.provenance import write_results

    keys = [key for key, *_ in mnist_probe.RECIPE_ROWS]

    def run(seed, level):
        return {**{key: level + seed / 100 for key in keys}, "seed": seed, "steps": 2500, "n_train": 60,
                "n_test": 20, "train_wall_time_s": 60.0 * (seed + 1)}

    (first, first_head), (second, second_head) = mnist_probe.RECIPE_RUNS
    assert mnist_probe.recipes_table(tmp_path) is None
    write_results(tmp_path / f"{second}.json", {"per_seed": [run(0, 0.9), run(2, 0.9)]}, {})
    only = mnist_probe.recipes_table(tmp_path).splitlines()
    assert only[0] == f"| readout (MNIST test, 40×40) | {second_head} | target | SCAE |"
    write_results(tmp_path / f"{first}.json", {"per_seed": [run(0, 0.5), run(1, 0.5), run(2, 0.5)]}, {})
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:3] for line in
            mnist_probe.recipes_table(tmp_path).splitlines()[2:] if line.startswith("| ")}
    # 0.50, 0.51, 0.52: 51.0 ± 1.0 in %; 0.90, 0.92: 91.0 ± 1.4
    assert rows["linear probe, object presences + poses (%)"] == ["51.0 ± 1.0", "91.0 ± 1.4"]
    assert rows["objects' class purity (0.1: none)"] == ["0.510 ± 0.010", "0.910 ± 0.014"]
    assert rows["objects on per image (of 16)"] == ["0.5 ± 0.0", "0.9 ± 0.0"]
    assert rows["steps; training minutes per seed"] == ["2,500; 1, 2, 3", "2,500; 1, 3"]
    assert "≥ 98.7 | 98.7 |" in mnist_probe.recipes_table(tmp_path)


def test_mnist_probe_bad_config_is_one_line(tmp_path, capsys):
    from probcaps.experiments import mnist_probe

    assert mnist_probe.main(["--config", str(tmp_path / "nope.toml"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.toml" in err[0]


def test_lr_multipliers_make_param_groups():
    # catches: a multiplier silently ignored (templates would learn at the network's rate)
    from probcaps.inference.train import TrainConfig, _param_groups

    module = torch.nn.ModuleDict({"model": torch.nn.Linear(2, 2), "guide": torch.nn.Linear(2, 2)})
    groups = _param_groups(module, TrainConfig(lr=0.1, lr_multipliers={"model.weight": 10.0}))
    lrs = sorted((g["lr"], len(g["params"])) for g in groups)
    assert lrs == [(pytest.approx(0.1), 3), (pytest.approx(1.0), 1)]
