"""The ``probcaps`` command line, run in-process on tiny synthetic data (no re-exec, no real MNIST).

Each test says in a comment which bug it would catch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probcaps.inference.train import load_checkpoint
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
    assert pngs == [f"tiny_seed0_{name}.png" for name in ("confusion_presence", "confusion_presence_pose",
                                                          "objects_by_class", "presence_by_class", "reconstructions",
                                                          "templates")]
    assert all((results / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "probe_presence_test_acc" in capsys.readouterr().out


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
    assert readme.read_text() == "# x\nkeep me\n<!-- results:mnist -->\n| new | table |\n<!-- /results:mnist -->\ntail\n"


def test_python_m_probcaps_help():
    # catches: `python -m probcaps` not being runnable (broken __main__ or import-time errors)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PROBCAPS_NO_REEXEC": "1"}
    proc = subprocess.run([sys.executable, "-m", "probcaps", "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "evaluate", "demo", "download", "report"):
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


@pytest.mark.parametrize("signal_name, code", [("ctrl_c", 130), ("sigterm", 143)])
def test_interrupted_entry_point_exits_with_the_shells_code_not_a_traceback(signal_name, code, capsys):
    # catches: Ctrl-C or a SIGTERM in an experiment script ending in a traceback after the training loop's
    # "checkpoint written ...; continue with --resume" line, or with an exit status a scheduler reads as a crash
    from probcaps.inference.train import Terminated
    from probcaps.cli import one_line_errors

    @one_line_errors("experiment")
    def interrupted(argv=None):
        raise KeyboardInterrupt if signal_name == "ctrl_c" else Terminated("signal 15")

    assert interrupted([]) == code
    assert capsys.readouterr().err == ""
