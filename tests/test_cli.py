"""The ``probcaps`` command line, run in-process on tiny synthetic data (no re-exec, no real MNIST).

Each test says in a comment which bug it would catch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from probcaps.checkpoints import load_checkpoint
from probcaps.cli import main

REPO = Path(__file__).resolve().parent.parent

TINY_SETS = [
    "data.dataset=\"synthetic\"", "data.canvas_size=28", "data.max_shift=0", "data.train_limit=16",
    "data.test_limit=16", "model.canvas_size=28", "model.num_parents=2", "model.num_parts=3",
    "model.template_size=5", "encoder.channels=[8, 8]", "encoder.strides=[2, 2]", "encoder.set_hidden=16",
    "encoder.set_heads=2", "encoder.set_inducing=4", "encoder.set_blocks=1", "encoder.parent_code=8",
    "encoder.head_hidden=8", "encoder.part_embedding=4", "train.batch_size=4", "train.warmup_steps=1",
    "eval.batch_size=8", "eval.probe_train_limit=16", "eval.probe_max_iter=50", "eval.kmeans_n_init=1",
]

METRIC_KEYS = {
    "probe_presence_test_acc", "probe_presence_train_acc", "probe_presence_pose_test_acc",
    "probe_presence_pose_train_acc", "kmeans_presence_test_acc", "test_elbo_per_image", "test_recon_mse",
    "mean_active_parents", "parents_in_use", "mean_active_parts", "n_train", "n_test",
}


@pytest.fixture(autouse=True)
def _setup(no_reexec, pyro_clean, seed):
    yield


def _sets(items):
    return [a for item in items for a in ("--set", item)]


def _one_error_line(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_train_resume_evaluate(tiny_toml, tmp_path, capsys):
    # catches: the train / --resume / evaluate commands not wiring config, steps, checkpoints and results together
    out = tmp_path / "run"
    assert main(["train", "--config", str(tiny_toml), "--out", str(out), "--steps", "3", "--quiet"]) == 0
    assert load_checkpoint(out / "final.pt")["state"]["step"] == 3
    assert "trained 3 steps" in capsys.readouterr().out
    assert main(["train", "--config", str(tiny_toml), "--out", str(out), "--resume", "--steps", "5", "--quiet"]) == 0
    final = load_checkpoint(out / "final.pt")
    assert final["state"]["step"] == 5 and final["train_config"]["steps"] == 5
    assert final["metadata"]["name"] == "tiny"

    results = tmp_path / "results"
    assert main(["evaluate", "--checkpoint", str(out / "final.pt"), "--results-dir", str(results), "--quiet"]) == 0
    record = json.loads((results / "tiny_seed0.json").read_text())  # the seed's name: not the seeds' summary
    assert METRIC_KEYS <= set(record["metrics"]), set(record["metrics"])
    assert record["metrics"]["n_train"] == 16 and record["metrics"]["n_test"] == 16
    for key in ("probe_presence_test_acc", "kmeans_presence_test_acc"):
        assert 0.0 <= record["metrics"][key] <= 1.0
    assert 0 <= record["metrics"]["parents_in_use"] <= 2  # of the tiny config's 2 objects
    prov = record["provenance"]
    for key in ("git_commit", "seed", "steps", "device", "checkpoint", "torch_version", "pyro_version", "configs"):
        assert key in prov, key
    assert prov["steps"] == 5 and prov["checkpoint"] == str(out / "final.pt")
    pngs = sorted(p.name for p in results.glob("*.png"))
    assert pngs == [f"tiny_seed0_{name}.png" for name in ("confusion_kmeans_posterior_counts",
                                                          "confusion_kmeans_presence", "confusion_presence",
                                                          "confusion_presence_pose", "objects_by_class",
                                                          "objects_drawn", "presence_by_class", "reconstructions",
                                                          "template_neighbours", "templates")]
    assert all((results / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "probe_presence_test_acc" in capsys.readouterr().out


def test_evaluate_draws_the_figures_named(tiny_toml, tmp_path, capsys):
    # catches: --figures ignored (every figure drawn) or drawn for every seed, or an unknown figure name ending in a
    # traceback, or refused only after the model has been read out and the results written
    runs = [tmp_path / f"run{s}" for s in (0, 1)]
    for seed, out in enumerate(runs):
        assert main(["train", "--config", str(tiny_toml), "--out", str(out), "--steps", "2", "--seed", str(seed),
                     "--quiet"]) == 0
    results = tmp_path / "results"
    args = ["evaluate", "--checkpoint", *(str(out / "final.pt") for out in runs), "--name", "pair", "--results-dir",
            str(results), "--quiet"]
    assert main([*args, "--figures", "objects_by_class", "nope"]) == 2
    _one_error_line(capsys, "--figures", "nope", "objects_by_class")
    assert not results.exists()
    assert main([*args, "--figures", "objects_by_class", "templates"]) == 0
    assert sorted(p.name for p in results.glob("*.png")) == ["pair_seed0_objects_by_class.png",
                                                             "pair_seed0_templates.png"]


def test_evaluate_several_seeds_gives_mean_and_std(tiny_toml, tmp_path, capsys):
    # catches: several checkpoints not each evaluated under its own seed, a summary that is not their mean and
    # sample std, figures of every seed, or a missing --name not refused in one line
    runs = [tmp_path / f"run{s}" for s in (0, 1)]
    for seed, out in enumerate(runs):
        assert main(["train", "--config", str(tiny_toml), "--out", str(out), "--steps", "2", "--seed", str(seed),
                     "--quiet"]) == 0
    checkpoints = [str(out / "final.pt") for out in runs]
    results = tmp_path / "results"
    with pytest.raises(SystemExit) as refused:
        main(["evaluate", "--checkpoint", *checkpoints, "--results-dir", str(results), "--quiet"])
    assert refused.value.code == 2 and "--name" in capsys.readouterr().err and not results.exists()
    for bad, needle in ((tmp_path / "missing.pt", "missing.pt"), (checkpoints[0], "seed 0")):
        assert main(["evaluate", "--checkpoint", *checkpoints, str(bad), "--name", "pair", "--results-dir",
                     str(results), "--quiet"]) == 2
        _one_error_line(capsys, needle, "probcaps evaluate: error:")
        assert not results.exists()  # refused before the first seed was evaluated
    assert main(["evaluate", "--checkpoint", *checkpoints, "--name", "pair", "--results-dir", str(results),
                 "--quiet"]) == 0
    seeds = [json.loads((results / f"pair_seed{s}.json").read_text())["metrics"] for s in (0, 1)]
    summary = json.loads((results / "pair.json").read_text())
    m, prov = summary["metrics"], summary["provenance"]
    assert [r["seed"] for r in m["per_seed"]] == prov["seed"] == [0, 1]
    for key in ("probe_presence_test_acc", "kmeans_posterior_counts_test_acc", "object_class_purity"):
        values = [r[key] for r in seeds]
        assert m[f"{key}_mean"] == pytest.approx(np.mean(values))
        assert m[f"{key}_std"] == pytest.approx(np.std(values, ddof=1))
    assert prov["checkpoints"] == checkpoints and prov["steps"] == 2
    assert {p.name.split("_", 2)[1] for p in results.glob("*.png")} == {"seed0"}  # the first seed's figures alone
    assert all((results / f"pair_seed{s}.md").is_file() for s in (0, 1))  # each seed's train / test table
    table = (results / "pair.md").read_text()
    assert "over 2 seeds" in table and "seeds 0, 1" in table and " ± " in table
    # each seed's label-free object information beside its k-means, the most informative seed first
    ranked = sorted(m["per_seed"], key=lambda r: -r["object_information"])
    rows = [f"| {r['seed']} | {r['object_information']:.3f} | {100 * r['kmeans_posterior_counts_test_acc']:.1f} |"
            for r in ranked]
    assert table.index(rows[0]) < table.index(rows[1])


def test_train_with_evaluate_flag_and_no_figures(tiny_toml, tmp_path):
    # catches: `train --evaluate` and `evaluate --no-figures` paths being broken
    out, results = tmp_path / "run", tmp_path / "res"
    assert main(["train", "--config", str(tiny_toml), "--out", str(out), "--steps", "1", "--quiet", "--evaluate",
                 "--results-dir", str(results)]) == 0
    assert (results / "tiny.json").is_file()
    results2 = tmp_path / "res2"
    assert main(["evaluate", "--checkpoint", str(out / "final.pt"), "--results-dir", str(results2), "--name", "x",
                 "--no-figures", "--quiet"]) == 0
    assert (results2 / "x.json").is_file() and not list(results2.glob("*.png"))


def test_demo_on_synthetic_data(tmp_path, capsys):
    # catches: the demo command failing end to end (train + evaluate + report) when its config is overridden
    out, results = tmp_path / "demo", tmp_path / "demo" / "results"
    code = main(["demo", "--out", str(out), "--results-dir", str(results), "--steps", "2", "--quiet",
                 *_sets(TINY_SETS)])
    assert code == 0, capsys.readouterr().err
    assert load_checkpoint(out / "final.pt")["state"]["step"] == 2
    assert METRIC_KEYS <= set(json.loads((results / "demo.json").read_text())["metrics"])
    assert (results / "demo_templates.png").is_file() and (results / "demo_reconstructions.png").is_file()
    assert "linear probe" in capsys.readouterr().out
    # catches: `make demo` a second time refused because the run folder already holds a run
    code = main(["demo", "--out", str(out), "--results-dir", str(results), "--steps", "3", "--quiet",
                 *_sets(TINY_SETS)])
    assert code == 0, capsys.readouterr().err
    assert load_checkpoint(out / "final.pt")["state"]["step"] == 3


def test_train_missing_config_is_one_line_error(tmp_path, capsys):
    # catches: a traceback (or exit status 1) instead of one line naming the missing file, status 2
    missing = tmp_path / "missing.toml"
    assert main(["train", "--config", str(missing), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    _one_error_line(capsys, str(missing), "probcaps train: error:")
    assert not (tmp_path / "run").exists()


def test_evaluate_missing_checkpoint_is_one_line_error(tmp_path, capsys):
    # catches: torch.load's FileNotFoundError traceback leaking to the user
    missing = tmp_path / "missing.pt"
    assert main(["evaluate", "--checkpoint", str(missing), "--results-dir", str(tmp_path / "r"), "--quiet"]) == 2
    _one_error_line(capsys, str(missing), "probcaps evaluate: error:")


def test_unknown_override_names_the_key(tiny_toml, tmp_path, capsys):
    # catches: an unknown --set key being ignored (a typo would silently train the default)
    assert main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"), "--set", "model.bogus=1",
                 "--quiet"]) == 2
    _one_error_line(capsys, "bogus")
    assert main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"), "--set", "nodot=1",
                 "--quiet"]) == 2
    _one_error_line(capsys, "nodot")


def test_resume_without_checkpoint_is_one_line_error(tiny_toml, tmp_path, capsys):
    # catches: --resume on an empty run folder crashing with a traceback
    assert main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "empty"), "--resume", "--quiet"]) == 2
    _one_error_line(capsys, "checkpoint.pt")


def test_report_command(tmp_path, capsys):
    # catches: the `report` entry point being unimportable, rewriting text outside its markers, or a marker
    # without its table file passing silently
    readme = tmp_path / "README.md"
    original = "# x\nkeep me\n<!-- results:mnist -->\nold table\n<!-- /results:mnist -->\ntail\n"
    readme.write_text(original)
    assert main(["report", "--results-dir", str(tmp_path / "results"), "--readme", str(readme)]) == 2
    _one_error_line(capsys, "results:mnist")
    assert readme.read_text() == original
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "mnist.md").write_text("| new | table |\n")
    assert main(["report", "--results-dir", str(tmp_path / "results"), "--readme", str(readme)]) == 0
    assert readme.read_text() == ("# x\nkeep me\n<!-- results:mnist -->\n| new | table |\n<!-- /results:mnist -->"
                                  "\ntail\n")


def test_python_m_probcaps_help():
    # catches: `python -m probcaps` not being runnable (broken __main__ or import-time errors)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PROBCAPS_NO_REEXEC": "1"}
    proc = subprocess.run([sys.executable, "-m", "probcaps", "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "evaluate", "ttvi", "draw-objects", "run", "demo", "download", "report"):
        assert command in proc.stdout


def test_ttvi_command_runs_and_writes_results(tiny_toml, tmp_path, no_reexec, pyro_clean):
    # catches: the ttvi command failing to load a checkpoint, optimise or write its JSON
    from probcaps.cli import main

    assert main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"), "--steps", "2", "--quiet"]) == 0
    out = tmp_path / "ttvi.json"
    rc = main(["ttvi", "--checkpoint", str(tmp_path / "run" / "final.pt"), "--limit", "6", "--steps", "5",
               "--batch-size", "4", "--rotate", "90", "--out", str(out), "--quiet"])
    assert rc == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["n_images"] == 6 and len(metrics["elbo_trace"]) == 5
    assert metrics["elbo_ttvi_mean"] > metrics["elbo_encoder_mean"]


def test_draw_objects_command_draws_the_objects_in_use(tiny_toml, tmp_path, no_reexec, pyro_clean, capsys):
    # catches: the command not loading a model with codes, not writing its figure, or a share no object reaches
    # ending in a traceback (or an empty figure) instead of one line
    from probcaps.cli import main

    assert main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"), "--steps", "2", "--quiet",
                 "--set", "model.object_code_dims=2"]) == 0
    out = tmp_path / "drawn.png"
    base = ["draw-objects", "--checkpoint", str(tmp_path / "run" / "final.pt"), "--limit", "20", "--quiet"]
    assert main([*base, "--min-share", "0", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "objects drawn to" in capsys.readouterr().out
    assert main([*base, "--min-share", "1.5", "--out", str(tmp_path / "none.png")]) == 2
    _one_error_line(capsys, "--min-share 1.5", "probcaps draw-objects: error:")
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("signal_name, code", [("ctrl_c", 130), ("sigterm", 143)])
def test_interrupted_entry_point_exits_with_the_shells_code_not_a_traceback(signal_name, code, capsys):
    # catches: Ctrl-C or a SIGTERM in an experiment script ending in a traceback after the training loop's
    # "checkpoint written ...; continue with --resume" line, or with an exit status a scheduler reads as a crash
    from probcaps.inference.train import Terminated
    from probcaps.runner import one_line_errors

    @one_line_errors("experiment")
    def interrupted(argv=None):
        raise KeyboardInterrupt if signal_name == "ctrl_c" else Terminated("signal 15")

    assert interrupted([]) == code
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------- probcaps run


def _experiment_modules() -> dict:
    """``{name: module}`` of every module of probcaps.experiments with a callable ``main``, by importing them."""
    import importlib
    import pkgutil

    import probcaps.experiments

    found = {}
    for info in pkgutil.iter_modules(probcaps.experiments.__path__):
        module = importlib.import_module(f"probcaps.experiments.{info.name}")
        if callable(getattr(module, "main", None)):
            found[info.name] = module
    return found


def test_run_lists_every_experiment_with_its_first_docstring_line(capsys):
    # catches: `probcaps run` missing an experiment (or offering a module without main), or help text that does not
    # say what each experiment is
    from probcaps.registry import experiments, first_sentence

    modules = _experiment_modules()
    assert set(experiments()) == set(modules) and len(modules) >= 5
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name, module in modules.items():
        first_line = first_sentence(module.__doc__)
        assert experiments()[name] == first_line and first_line and len(first_line) <= 110
        assert any(line.split() and line.split()[0] == name and first_line in line for line in out.splitlines()), name


def test_run_calls_the_experiments_main_with_its_arguments(monkeypatch, capsys):
    # catches: `probcaps run X args` not reaching X.main(args), dropping or reordering them, or losing its exit code
    import probcaps.experiments.rotated_digits as rotated_digits

    calls = []

    def fake_main(argv=None):
        calls.append((list(argv), sys.argv[0]))
        return 3

    monkeypatch.setattr(rotated_digits, "main", fake_main)
    assert main(["run", "rotated_digits", "--steps", "5", "--set", "a.b=1", "--help"]) == 3
    assert calls == [(["--steps", "5", "--set", "a.b=1", "--help"], "probcaps run rotated_digits")]
    assert sys.argv[0] != "probcaps run rotated_digits"  # restored


def test_run_refuses_an_unknown_experiment_and_a_bad_argument(capsys):
    # catches: an unknown name ending in an ImportError traceback; an experiment's argument errors being lost
    with pytest.raises(SystemExit) as e:
        main(["run", "no_such_experiment"])
    assert e.value.code == 2
    assert "invalid choice: 'no_such_experiment'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["run", "rotated_digits", "--batch-size", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: probcaps run rotated_digits")
    assert err[-1] == "probcaps run rotated_digits: error: argument --batch-size: must be >= 1, got 0"


def test_run_passes_an_experiments_one_line_error_through(tmp_path, capsys):
    # catches: `probcaps run` turning an experiment's refusal (exit 2, one line) into something else
    missing = tmp_path / "missing.pt"
    assert main(["run", "rotated_digits", "--checkpoint", str(missing), "--results-dir", str(tmp_path / "r")]) == 2
    _one_error_line(capsys, "rotated_digits: error:", str(missing))


def test_python_m_probcaps_run_help():
    # catches: the installed entry point failing to list the experiments (a subprocess, as a user runs it)
    env = {**os.environ, "PROBCAPS_NO_REEXEC": "1"}
    proc = subprocess.run([sys.executable, "-m", "probcaps", "run", "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "mnist_probe" in proc.stdout and "transforming_autoencoder" in proc.stdout


# ------------------------------------------------------------------------------------- train --force, --tensorboard


@pytest.mark.parametrize("flags, expected", [
    ([], {}), (["--force"], {"force": True}), (["--tensorboard"], {"tensorboard": True}),
    (["--force", "--tensorboard"], {"force": True, "tensorboard": True}),
])
def test_train_passes_force_and_tensorboard_to_the_training_loop(flags, expected, tiny_toml, tmp_path, monkeypatch):
    # catches: --force or --tensorboard accepted but not handed to the training loop (or handed when not asked)
    import probcaps.inference.capsule_svi as capsule_svi
    from probcaps.inference.train import TrainState

    seen = {}

    def fake_train_capsules(cfg, out, **kwargs):
        seen.update(kwargs)
        return TrainState(step=cfg["train"].steps)

    monkeypatch.setattr(capsule_svi, "train_capsules", fake_train_capsules)
    assert main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"), "--quiet", *flags]) == 0
    assert {k: seen[k] for k in ("force", "tensorboard") if k in seen} == expected


def test_train_capsules_hands_loop_options_to_train_loop(tiny_toml, tmp_path, monkeypatch):
    # catches: train_capsules dropping the options on the way to train_loop
    import probcaps.inference.capsule_svi as capsule_svi
    from probcaps.inference.train import TrainState

    seen = {}

    def fake_train_loop(*args, **kwargs):
        seen.update(kwargs)
        return TrainState()

    monkeypatch.setattr(capsule_svi, "train_loop", fake_train_loop)
    cfg = capsule_svi.load_experiment_config(tiny_toml)
    capsule_svi.train_capsules(cfg, tmp_path / "run", progress=False, force=True, tensorboard=True)
    assert seen["force"] is True and seen["tensorboard"] is True


def test_train_force_starts_afresh_in_a_used_run_folder(tiny_toml, tmp_path, capsys):
    # catches: --force not reaching the training loop's refusal of a run folder that holds an earlier run
    out = tmp_path / "run"
    assert main(["train", "--config", str(tiny_toml), "--out", str(out), "--steps", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(tiny_toml), "--out", str(out), "--steps", "2", "--quiet"]) == 2
    _one_error_line(capsys, "probcaps train: error:", str(out))
    assert load_checkpoint(out / "final.pt")["state"]["step"] == 1
    assert main(["train", "--config", str(tiny_toml), "--out", str(out), "--steps", "2", "--quiet", "--force"]) == 0
    assert load_checkpoint(out / "final.pt")["state"]["step"] == 2


def test_run_turns_an_undecorated_experiments_errors_into_one_line(monkeypatch, capsys):
    # catches: an experiment whose main lacks one_line_errors leaking a traceback through `probcaps run`
    import probcaps.experiments.rotated_digits as rotated_digits
    from probcaps.errors import DataError

    def bare_main(argv=None):
        raise DataError("/data/x.mat: truncated")

    monkeypatch.setattr(rotated_digits, "main", bare_main)
    assert main(["run", "rotated_digits"]) == 2
    _one_error_line(capsys, "rotated_digits: error: /data/x.mat: truncated")


def test_seed_summary_is_the_mean_and_sample_std_over_seeds():
    # catches: the population std (ddof=0) reported as the seed-to-seed spread, a per-angle curve averaged over its
    # angles instead of over seeds, or a NaN std for a single seed
    from probcaps.runner import seed_summary

    runs = [{"acc": 0.5, "curve": [1.0, 4.0]}, {"acc": 0.7, "curve": [3.0, 8.0]}, {"acc": 0.9, "curve": [5.0, 0.0]}]
    summary = seed_summary(runs, ("acc", "curve"))
    assert summary["acc_mean"] == pytest.approx(0.7) and summary["acc_std"] == pytest.approx(0.2)
    assert summary["curve_mean"] == pytest.approx([3.0, 4.0]) and summary["curve_std"] == pytest.approx([2.0, 4.0])
    single = seed_summary(runs[:1], ("acc", "curve"))
    assert single == {"acc_mean": 0.5, "acc_std": 0.0, "curve_mean": [1.0, 4.0], "curve_std": [0.0, 0.0]}


def test_numeric_argument_types_keep_their_bounds():
    # catches: the factory giving every type the same bound (0 accepted as a step count, 0 refused as a seed,
    # 0 accepted as a learning rate) or letting a non-finite number through
    import argparse

    from probcaps import runner as cli

    accepted = {cli.positive_int: ("1", 1), cli.non_negative_int: ("0", 0), cli.finite_float: ("-2.5", -2.5),
                cli.finite_positive_float: ("1e-9", 1e-9), cli.finite_non_negative_float: ("0", 0.0)}
    refused = {cli.positive_int: "0", cli.non_negative_int: "-1", cli.finite_float: "inf",
               cli.finite_positive_float: "0", cli.finite_non_negative_float: "-1e-9"}
    for parse, (text, value) in accepted.items():
        assert parse(text) == value and type(parse(text)) is type(value)
        with pytest.raises(argparse.ArgumentTypeError):
            parse(refused[parse])
