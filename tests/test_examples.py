"""Every entry point runs: one parametrised smoke test over the command line (``probcaps train``, ``evaluate``,
``ttvi``, ``demo``, ``report``, ``run``), every experiment and every benchmark, each for a few steps on tiny
synthetic data (in the spirit of Pyro's ``tests/test_examples.py``).

Each example must exit 0 and write its results; an experiment's README table (``results/<name>.md``) must be exactly
what ``--tables-only`` rebuilds from its results JSON, so a table never holds a number its JSON lacks.  The tests of
what the experiments compute stay beside the code they test (test_experiments.py, test_ood_experiments.py, ...).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from conftest import TINY40 as TINY40_COMMON
from conftest import train_tiny40

ROOT = Path(__file__).resolve().parent.parent

TINY40 = [*TINY40_COMMON, "encoder.bf16=false", "train.steps=2", "train.warmup_steps=1", "train.checkpoint_every=2",
          "train.compile=false", "eval.figures=false"]
TINY_CAPS = dict(conv1_channels=8, primary_capsules=4, primary_dim=4, digit_dim=6, decoder_hidden=[16, 16],
                 weight_init_std=0.1)
TINY_NORB = ["data.instances_per_split=1", "data.elevations=1", "data.lightings=1", "data.familiar_eval=30",
             "data.novel_eval=40", "caps.A=8", "caps.B=2", "caps.C=2", "caps.D=2", "cnn.channels=[4, 4]",
             "cnn.hidden=8", "caps_train.steps=2", "cnn_train.steps=2", "caps_train.batch_size=8",
             "cnn_train.batch_size=8", "caps_train.checkpoint_every=2", "cnn_train.checkpoint_every=2",
             "caps_train.warmup_steps=1", "cnn_train.warmup_steps=1"]
TINY_TAE = ["data.dataset=synthetic", "data.train_limit=32", "data.test_limit=16", "model.canvas_size=32",
            "model.num_capsules=3", "model.recognition_hidden=4", "model.template_size=5",
            "model.template_init=data", "train.steps=2", "train.batch_size=8", "train.warmup_steps=1",
            "train.log_every=1", "train.checkpoint_every=2", "eval.pairs=24", "eval.readout_pairs=24",
            "eval.batch_size=10", "eval.curve_pairs=8", "range.translation_px=1.0", "range.jitter_translation_px=1.0",
            "eval.figures=false"]


def sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


@dataclass
class Context:
    """What an example's command line may refer to."""
    tmp: Path
    results: Path
    checkpoint: Path  # a 2-step 40x40 capsule model on synthetic digits
    toml: Path        # the tiny 28x28 config of conftest.TINY_TOML


@dataclass
class Example:
    """One entry point with a tiny command line.

    ``target``: ``"probcaps"`` (the CLI), ``"experiments.<name>"`` or ``"benchmarks/<name>.py"``; ``argv`` builds
    its arguments; ``writes``: files it must write under the results folder; ``tables``: README tables it writes
    there (``<name>.md``), each checked against ``--tables-only`` (``tables_argv``) or the ``table`` function given.
    """
    id: str
    target: str
    argv: Callable[[Context], list[str]]
    writes: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    tables_argv: Callable[[Context], list[str]] | None = None
    check: Callable[[Context], None] | None = None


def _load_main(target: str):
    if target == "probcaps":
        from probcaps.cli import main

        return main
    if target.startswith("experiments."):
        return importlib.import_module(f"probcaps.{target}").main
    path = ROOT / target
    spec = importlib.util.spec_from_file_location(f"_example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _json(ctx: Context, name: str) -> dict:
    return json.loads((ctx.results / name).read_text())


def _check_bench_step(ctx):
    (row,) = _json(ctx, "bench_step.json")
    assert row["losses_agree"] is True and row["ratio_pyro_over_torch"] > 0  # the two ELBOs are the same objective


def _check_bench_gpu(ctx):
    # every stage ran: four step rows, the MultiMNIST training scored on its test pairs, the MNIST recipe read out,
    # each results JSON copied out, and the step counts planned once for a rerun to continue
    assert len(_json(ctx, "speed/bench_gpu.json")["rows"]) == 4
    assert sorted(p.name for p in (ctx.tmp / "gpu_out").iterdir()) == ["bench_gpu.json", "mnist_gpu_steps3.json",
                                                                       "multimnist.json"]
    assert json.loads((ctx.tmp / "gpu_runs" / "plan.json").read_text()) == {"multimnist_paper": 4, "mnist": 3}
    assert _json(ctx, "multimnist/multimnist.json")["metrics"]["per_seed"][0]["steps"] == 4


def _check_multimnist(ctx):
    # the test-set curve (one evaluation a checkpoint) is in the results and in the table's note
    (run,) = _json(ctx, "multimnist.json")["metrics"]["per_seed"]
    assert [c["step"] for c in run["curve"]] == [2] and run["curve_pairs"] == 8
    assert "set accuracy on the first 8 test pairs at each evaluation (step: %): 2: " in (
        ctx.results / "multimnist.md").read_text()


def _check_bench_capsnet(ctx):
    (row,) = _json(ctx, "bench_capsnet.json")
    assert row["images_per_s"] > 0 and row["num_primary_capsules"] == 400 and math.isfinite(row["peak_memory_mb"])


def _check_bench_capsnet_compare(ctx):
    rows = _json(ctx, "bench_capsnet_compare.json")
    assert [r["config"] for r in rows] == ["reduced, float32", "reduced, phase split"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] > 0 and rows[1]["interleaved"]
    assert [r["model"]["phase_split"] for r in rows] == [False, True] and rows[1]["peak_memory_mb"] is None


def _check_bench_matrix_capsules(ctx):
    row = _json(ctx, "bench_matrix_capsules.json")
    assert row["train_images_per_s"] > 0 and row["peak_memory_mb"] > 0
    assert row["network"] == {"A": 8, "B": 2, "C": 2, "D": 2, "kernel": 3, "iterations": 3, "input_size": 32}


def _check_affnist(ctx):
    m = _json(ctx, "affnist.json")["metrics"]
    assert m["ood_name"] == "affNIST-recipe" and m["n_ood"] == 16 and len(m["cnn"]) == 1  # --limit 16, one CNN seed


def _check_rotated_mnist(ctx):
    m = _json(ctx, "rotated_mnist_cnn_vs_capsnet.json")["metrics"]
    assert m["angles"] == [0, 90]
    assert len(m["per_seed"][0]["lenet_acc"]) == 2 and len(m["per_seed"][0]["capsnet_acc"]) == 2


def _check_ttvi_table(ctx):
    from probcaps.experiments.common import throughput_table

    assert (ctx.results / "ttvi_tiny.md").read_text() == throughput_table(ctx.results, "ttvi_tiny") + "\n"


def _check_list(ctx):
    import contextlib
    import io

    from probcaps.cli import print_list
    from probcaps.registry import experiments, model_cards, recipes

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_list()
    names = {line.split()[0] for line in out.getvalue().splitlines() if line.startswith("  ")}
    assert {"mnist", "demo", "mnist_probe", "rotated_digits"} <= names
    assert names == set(recipes()) | set(experiments()) | set(model_cards())


def _report_argv(ctx):
    (ctx.results / "example.md").write_text("| a | table |\n")
    (ctx.tmp / "README.md").write_text("x\n<!-- results:example -->\nold\n<!-- /results:example -->\ny\n")
    return ["report", "--results-dir", str(ctx.results), "--readme", str(ctx.tmp / "README.md")]


def _check_report(ctx):
    expected = "x\n<!-- results:example -->\n| a | table |\n<!-- /results:example -->\ny\n"
    assert (ctx.tmp / "README.md").read_text() == expected


def _tae_recipe() -> str:
    return str(ROOT / "experiments" / "configs" / "transforming_autoencoder_translation.toml")


EXAMPLES = [
    # the command line
    Example("probcaps-train", "probcaps", lambda c: ["train", "--config", str(c.toml), "--out", str(c.tmp / "run"),
                                                     "--steps", "2", "--quiet"],
            check=lambda c: (c.tmp / "run" / "final.pt").is_file() or pytest.fail("no final.pt")),
    Example("probcaps-evaluate", "probcaps", lambda c: ["evaluate", "--checkpoint", str(c.checkpoint), "--name", "ev",
                                                        "--results-dir", str(c.results), "--no-figures", "--quiet"],
            writes=["ev.json"]),
    Example("probcaps-ttvi", "probcaps", lambda c: ["ttvi", "--checkpoint", str(c.checkpoint), "--limit", "4",
                                                    "--steps", "2", "--batch-size", "4", "--quiet",
                                                    "--out", str(c.results / "ttvi_tiny.json")],
            writes=["ttvi_tiny.json", "ttvi_tiny.md"], check=_check_ttvi_table),
    Example("probcaps-draw-objects", "probcaps", lambda c: ["draw-objects", "--checkpoint", str(c.checkpoint),
                                                            "--limit", "8", "--min-share", "0", "--quiet",
                                                            "--out", str(c.results / "drawn.png")],
            writes=["drawn.png"]),
    Example("probcaps-demo", "probcaps", lambda c: ["demo", "--out", str(c.tmp / "demo"), "--results-dir",
                                                    str(c.results), "--steps", "2", "--quiet", *sets(TINY40)],
            writes=["demo.json"]),
    Example("probcaps-report", "probcaps", _report_argv, check=_check_report),
    Example("probcaps-list", "probcaps", lambda c: ["list"], check=_check_list),
    Example("probcaps-run", "probcaps", lambda c: ["run", "rotated_digits", "--checkpoint", str(c.checkpoint),
                                                   "--n-images", "2", "--steps", "2", "--angles", "0", "90",
                                                   "--results-dir", str(c.results), "--quiet"],
            writes=["rotated_digits.json"], tables=["rotated_digits"],
            tables_argv=lambda c: ["run", "rotated_digits", "--tables-only", "--results-dir", str(c.results)]),
    # the experiments
    Example("mnist_probe", "experiments.mnist_probe",
            lambda c: ["--config", str(c.toml), "--seeds", "0", "--out", str(c.tmp / "runs"), "--results-dir",
                       str(c.results), "--checkpoint-out", "", "--quiet", "--set", "train.steps=2",
                       "--set", "eval.figures=false"],
            writes=["tiny.json"], tables=["tiny"],
            tables_argv=lambda c: ["--config", str(c.toml), "--tables-only", "--results-dir", str(c.results)]),
    Example("affnist", "experiments.affnist",
            lambda c: ["--checkpoint", str(c.checkpoint), "--limit", "16", "--cnn-steps", "2", "--ttvi-limit", "4",
                       "--ttvi-steps", "2", "--out", str(c.tmp / "runs"), "--results-dir", str(c.results), "--quiet"],
            writes=["affnist.json", "affnist_examples.png"], tables=["affnist"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)], check=_check_affnist),
    Example("rotated_digits", "experiments.rotated_digits",
            lambda c: ["--checkpoint", str(c.checkpoint), "--n-images", "2", "--steps", "2", "--angles", "0", "90",
                       "--results-dir", str(c.results), "--quiet"],
            writes=["rotated_digits.json"], tables=["rotated_digits"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)]),
    Example("ttvi_classification", "experiments.ttvi_classification",
            lambda c: ["--checkpoint", str(c.checkpoint), "--n-test", "8", "--steps", "2", "--n-train-ttvi", "0",
                       "--results-dir", str(c.results), "--quiet"],
            writes=["ttvi_classification.json"], tables=["ttvi_classification"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)]),
    Example("normal_guide", "experiments.normal_guide",
            lambda c: ["--checkpoint", str(c.checkpoint), "--steps", "2", "--n-elbo-images", "8", "--elbo-samples",
                       "1", "--probe-train-limit", "16", "--out", str(c.tmp / "run"), "--results-dir", str(c.results),
                       "--checkpoint-out", str(c.tmp / "normal.pt"), "--quiet"],
            writes=["normal_guide.json"], tables=["normal_guide"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)]),
    # needs a Normal-pose model: its tiny run is tests/test_likelihood.py's command test
    Example("heldout_likelihood", "experiments.heldout_likelihood", lambda c: ["--help"]),
    # reads real MNIST and the shipped models: its tiny run is tests/test_rotated_recognition.py's command test
    Example("rotated_recognition", "experiments.rotated_recognition", lambda c: ["--help"]),
    Example("rotated_training", "experiments.rotated_training",
            lambda c: ["--thetas", "0", "90", "--seeds", "0", "--out", str(c.tmp / "runs"), "--results-dir",
                       str(c.results), "--quiet", *sets(TINY40)],
            writes=["rotated_training.json"], tables=["rotated_training"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)]),
    Example("multimnist", "experiments.multimnist",
            lambda c: ["--seeds", "0", "--out", str(c.tmp / "runs"), "--results-dir", str(c.results), "--quiet",
                       *sets(['data.dataset="synthetic"', "data.test_pairs=20", "train.steps=2", "data.train_limit=64",
                              "data.test_limit=64", "train.batch_size=8", "train.checkpoint_every=2",
                              "train.warmup_steps=1", "eval.curve_pairs=8", "eval.batch_size=16",
                              "eval.figures=false",
                              *[f"model.{k}={json.dumps(v)}" for k, v in TINY_CAPS.items()]])],
            writes=["multimnist.json"], tables=["multimnist"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)], check=_check_multimnist),
    Example("rotated_mnist_cnn_vs_capsnet", "experiments.rotated_mnist_cnn_vs_capsnet",
            lambda c: ["--seeds", "0", "--out", str(c.tmp / "runs"), "--results-dir", str(c.results), "--quiet",
                       *sets(['data.dataset="synthetic"', "data.angles=[0, 90]", "lenet_train.steps=2",
                              "capsnet_train.steps=2", "lenet_train.batch_size=8", "capsnet_train.batch_size=8",
                              *[f"capsnet.{k}={json.dumps(v)}" for k, v in TINY_CAPS.items()]])],
            writes=["rotated_mnist_cnn_vs_capsnet.json"], tables=["rotated_mnist_cnn_vs_capsnet"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)], check=_check_rotated_mnist),
    Example("norb_viewpoints", "experiments.norb_viewpoints",
            lambda c: ["--seeds", "0", "--out", str(c.tmp / "runs"), "--results-dir", str(c.results), "--data-dir",
                       str(c.tmp), "--no-figures", "--quiet", *sets(TINY_NORB)],
            writes=["norb_azimuth.json"], tables=["norb_azimuth"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)]),
    Example("transforming_autoencoder", "experiments.transforming_autoencoder",
            lambda c: ["--config", _tae_recipe(), "--seeds", "0", "--out", str(c.tmp / "runs"), "--results-dir",
                       str(c.results), "--quiet", *sets(TINY_TAE)],
            writes=["transforming_autoencoder_translation.json"], tables=["transforming_autoencoder"],
            tables_argv=lambda c: ["--tables-only", "--results-dir", str(c.results)]),
    # the benchmarks
    Example("bench_step", "benchmarks/bench_step.py",
            lambda c: ["--parts", "4", "--parents", "3", "--batch", "4", "--repeats", "1", "--threads", "1",
                       "--json", str(c.results / "bench_step.json"), "--set", "encoder.channels=[8,8]",
                       "--set", "encoder.strides=[2,2]"],
            writes=["bench_step.json", "bench_step.md"], check=_check_bench_step),
    Example("bench_capsnet", "benchmarks/bench_capsnet.py",
            lambda c: ["--configs", "reduced", "--batch", "4", "--repeats", "1", "--threads", "1",
                       "--json", str(c.results / "bench_capsnet.json"),
                       *sets([f"model.{k}={json.dumps(v)}" for k, v in TINY_CAPS.items()])],
            writes=["bench_capsnet.json"], check=_check_bench_capsnet),
    Example("bench_capsnet_compare", "benchmarks/bench_capsnet.py",
            lambda c: ["--configs", "reduced", "--batch", "4", "--repeats", "1", "--threads", "1", "--compare",
                       "--variant", "float32", "model.bf16=false", "--variant", "phase split", "model.bf16=false",
                       "model.phase_split=true", "--json", str(c.results / "bench_capsnet_compare.json"),
                       *sets([f"model.{k}={json.dumps(v)}" for k, v in TINY_CAPS.items()])],
            writes=["bench_capsnet_compare.json"], check=_check_bench_capsnet_compare),
    Example("bench_matrix_capsules", "benchmarks/bench_matrix_capsules.py",
            lambda c: ["--A", "8", "--B", "2", "--C", "2", "--D", "2", "--batch", "4", "--repeats", "1",
                       "--threads", "1", "--json", str(c.results / "bench_matrix_capsules.json")],
            writes=["bench_matrix_capsules.json"], check=_check_bench_matrix_capsules),
    Example("bench_encoders", "benchmarks/bench_encoders.py",
            lambda c: ["--threads", "1", "--repeats", "1", "--batch", "2"]),
    # these two only parse their arguments: one always compiles a variant (about 40 s on a CPU), the other times
    # a checkout of another repository
    Example("bench_render", "benchmarks/bench_render.py", lambda c: ["--help"]),
    Example("bench_vs_torch_scae", "benchmarks/bench_vs_torch_scae.py", lambda c: ["--help"]),
    # a GPU machine's prepared run (make gpu), every stage at smoke sizes: about a minute and a half
    Example("bench_gpu", "benchmarks/bench_gpu.py",
            lambda c: ["--tiny", "--train-steps", "2", "--budget-minutes", "5", "--threads", "1", "--json",
                       str(c.results / "speed" / "bench_gpu.json"), "--runs", str(c.tmp / "gpu_runs"),
                       "--copy-to", str(c.tmp / "gpu_out")],
            writes=["speed/bench_gpu.json", "multimnist/multimnist.json", "mnist_probe/mnist_gpu_steps3.json"],
            check=_check_bench_gpu),
]


@pytest.fixture(scope="module")
def tiny40_checkpoint(tmp_path_factory):
    """``final.pt`` of a 2-step delta-trained 40x40 capsule model on synthetic digits."""
    return train_tiny40(tmp_path_factory.mktemp("tiny40"), TINY40)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_example_runs(example, tmp_path, tiny_toml, tiny40_checkpoint, fake_mnist_root, no_reexec, pyro_clean):
    # catches: an entry point that no longer runs end to end, writes no results, or writes a README table that its
    # results JSON cannot reproduce
    ctx = Context(tmp=tmp_path, results=tmp_path / "results", checkpoint=tiny40_checkpoint, toml=tiny_toml)
    ctx.results.mkdir()
    main = _load_main(example.target)
    argv = example.argv(ctx)
    if argv == ["--help"]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        return
    assert main(argv) == 0
    for name in example.writes:
        assert (ctx.results / name).is_file(), f"{example.id}: {name} not written"
    for name in example.tables:
        table = ctx.results / f"{name}.md"
        written = table.read_text()
        assert "|" in written, f"{example.id}: {table} holds no table"
        table.unlink()
        assert main(example.tables_argv(ctx)) == 0
        assert table.read_text() == written, f"{example.id}: --tables-only rebuilds another {name}.md"
    if example.check is not None:
        example.check(ctx)


def test_every_entry_point_is_an_example():
    # catches: a new experiment or benchmark script without a smoke test here
    listed = {e.target for e in EXAMPLES}
    experiments = {f"experiments.{p.stem}" for p in (ROOT / "experiments").glob("*.py")
                   if "\ndef main(" in p.read_text()}
    benchmarks = {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")}
    assert experiments | benchmarks <= listed, sorted((experiments | benchmarks) - listed)
    from probcaps.cli import build_parser

    # every subcommand but `download` (it needs a network) has its example, named probcaps-<subcommand>
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    missing = sorted(set(subcommands) - {"download"} - {e.id.removeprefix("probcaps-") for e in EXAMPLES})
    assert not missing, missing


def test_experiments_run_as_modules_both_ways():
    # catches: `python -m experiments.<name>` or `python -m probcaps.experiments.<name>` failing (a missing
    # `if __name__ == "__main__"` block, an import that only works one way); one process for all of them
    names = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if "\ndef main(" in p.read_text())
    script = ("import runpy, sys\n"
              "for module in sys.argv[1:]:\n"
              "    sys.argv = [module, '--help']\n"
              "    try:\n"
              "        runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
              "        print(module, 'returned without exiting')\n"
              "    except SystemExit as e:\n"
              "        print(module, e.code)\n")
    modules = [f"{prefix}{name}" for name in names for prefix in ("experiments.", "probcaps.experiments.")]
    proc = subprocess.run([sys.executable, "-c", script, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PROBCAPS_NO_REEXEC": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcome = dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in modules)
    assert outcome == {m: "0" for m in modules}, outcome


def test_demo_ends_with_a_short_table_beside_the_shipped_recipe_and_scae(tmp_path, capsys, monkeypatch):
    # catches: the demo ending in a wall of raw metric keys instead of the few readouts a reader compares, or a table
    # without the shipped recipe's and SCAE's numbers beside this run's
    from probcaps.cli import SUMMARY_ROWS, main
    from probcaps.registry import model_cards

    monkeypatch.setenv("PROBCAPS_NO_REEXEC", "1")
    assert main(["demo", "--out", str(tmp_path / "demo"), "--results-dir", str(tmp_path / "res"), "--steps", "2",
                 "--quiet", *sets(TINY40)]) == 0
    out = capsys.readouterr().out.splitlines()
    after = out[next(i for i, line in enumerate(out) if line.startswith("trained ")) + 1:]
    assert len(after) <= 25, after
    assert after[0].split()[:3] == ["readout", "(MNIST", "test)"] and "SCAE" in after[0]
    rows = {label: line for _, label, _ in SUMMARY_ROWS for line in after if line.startswith(label)}
    assert len(rows) == len(SUMMARY_ROWS), after
    assert "99.0" in rows["linear probe, object presences (%)"]  # SCAE's
    assert "98.7" in rows["k-means (10), posterior presences (%)"]
    if "readouts" in model_cards().get("mnist", {}):  # the shipped recipe's mean ± std
        assert all("±" in line for line in rows.values()), rows
    assert any(line.startswith("all metrics: ") and line.endswith("demo.json") for line in after)
