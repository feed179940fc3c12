"""Checkpoints cannot run code, resume cannot lose a finished model nor continue a different one, and names cannot
leave their folder.

A checkpoint crafted to run code when unpickled (``__reduce__`` calling ``os.system``) is refused in one line naming
the file, exit status 2, and the code never runs: it would create a marker file.  Everything the training loop
stores is tensors and plain data, so ``weights_only=True`` reads it back, and resuming stays exact (the exact-resume
tests of tests/test_training.py, tests/test_interrupts.py and tests/test_distributed.py).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from probcaps import cli
from probcaps.checkpoints import load_checkpoint, read_plain, rng_state, save_checkpoint, set_rng_state, to_plain
from probcaps.config import check_file_name, check_threads, file_name_arg, threads_arg
from probcaps.errors import ConfigError
from probcaps.io import read_jsonl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _setup(no_reexec, pyro_clean, seed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


class RunsCode:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run folder of the tiny capsule model trained for 2 steps (checkpoint.pt, final.pt, log.jsonl)."""
    from conftest import TINY_TOML

    root = tmp_path_factory.mktemp("safety")
    (root / "tiny.toml").write_text(TINY_TOML)
    os.environ["PROBCAPS_NO_REEXEC"] = "1"
    assert cli.main(["train", "--config", str(root / "tiny.toml"), "--out", str(root / "run"), "--steps", "2",
                     "--quiet"]) == 0
    return root


def one_line(capsys, *needles) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert str(needle) in err, err
    return err


def _evil(ckpt: dict, where: str, marker: Path) -> dict:
    ckpt = dict(ckpt)
    if where == "top level":
        ckpt["extra"] = RunsCode(marker)
    elif where == "optimiser state":
        ckpt["optimiser"] = {**ckpt["optimiser"], "state": {0: {"exp_avg": RunsCode(marker)}}}
    elif where == "metadata":
        ckpt["metadata"] = {**ckpt["metadata"], "name": RunsCode(marker)}
    elif where == "whole file":
        ckpt = RunsCode(marker)
    return ckpt


WHERE = ("top level", "optimiser state", "metadata", "whole file")


@pytest.mark.parametrize("where", WHERE)
def test_evaluating_a_checkpoint_that_carries_code_runs_nothing(where, trained, tmp_path, capsys):
    # catches: torch.load(weights_only=False) unpickling an object whose __reduce__ runs a shell command
    marker = tmp_path / "ran"
    torch.save(_evil(torch.load(trained / "run" / "final.pt", weights_only=True), where, marker), tmp_path / "evil.pt")
    assert cli.main(["evaluate", "--checkpoint", str(tmp_path / "evil.pt"), "--results-dir", str(tmp_path / "r"),
                     "--quiet"]) == 2
    one_line(capsys, tmp_path / "evil.pt", "refused", "posix.system")
    assert not marker.exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("where", WHERE)
def test_resuming_from_a_checkpoint_that_carries_code_runs_nothing(where, trained, tmp_path, capsys):
    # catches: train --resume unpickling checkpoint.pt (or reading its step for a message) with weights_only=False
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    marker = tmp_path / "ran"
    torch.save(_evil(torch.load(run / "checkpoint.pt", weights_only=True), where, marker), run / "checkpoint.pt")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert cli.main(["train", "--config", str(trained / "tiny.toml"), "--out", str(run), "--steps", "4", "--resume",
                     "--quiet"]) == 2
    one_line(capsys, run / "checkpoint.pt", "refused")
    assert not marker.exists()
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == \
        {k: v for k, v in before.items() if k != ".lock"}


def test_a_subprocess_evaluate_of_a_code_carrying_checkpoint_exits_2(trained, tmp_path):
    # catches: the refusal only holding in-process (the real entry point re-executing, or printing a traceback)
    marker = tmp_path / "ran"
    torch.save(_evil(torch.load(trained / "run" / "final.pt", weights_only=True), "top level", marker),
               tmp_path / "evil.pt")
    out = subprocess.run([sys.executable, "-m", "probcaps", "evaluate", "--checkpoint", str(tmp_path / "evil.pt"),
                          "--results-dir", str(tmp_path / "r")], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "evil.pt" in out.stderr and "Traceback" not in out.stderr
    assert not marker.exists()


def test_everything_a_run_stores_loads_with_weights_only(trained):
    # catches: a non-plain object (numpy's RNG state, a config dataclass) stored by the training loop, which
    # weights_only=True would refuse on resume
    for name in ("checkpoint.pt", "final.pt"):
        ckpt = torch.load(trained / "run" / name, weights_only=True)
        assert {"module", "optimiser", "scheduler", "rng", "metadata", "train_config"} <= ckpt.keys()
        assert torch.is_tensor(ckpt["rng"]["numpy"]["keys"])


def test_rng_states_survive_the_plain_format_bit_for_bit(tmp_path):
    # catches: numpy's key array or position, Python's Gaussian cache or torch's state changing on the way through
    # the plain format (a resumed run would draw different numbers)
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.gauss(0, 1), np.random.standard_normal()  # a cached Gaussian in numpy's state
    save_checkpoint({"module": {}, "rng": rng_state()}, tmp_path / "rng.pt")
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(3), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(read_plain(tmp_path / "rng.pt")["rng"])
    again = (random.random(), random.gauss(0, 1), np.random.standard_normal(3), torch.rand(3))
    assert expected[:2] == again[:2]
    assert np.array_equal(expected[2], again[2]) and torch.equal(expected[3], again[3])


def test_saving_converts_or_refuses_what_weights_only_cannot_read(tmp_path):
    # catches: a checkpoint written that the loader would then refuse (the run's own files unloadable)
    from probcaps.inference.train import TrainConfig

    plain = to_plain({"cfg": TrainConfig(steps=3), "x": np.float32(1.5), "a": np.arange(3), "p": Path("a/b")})
    assert plain == {"cfg": TrainConfig(steps=3).to_dict(), "x": 1.5, "a": plain["a"], "p": "a/b"}
    assert torch.equal(plain["a"], torch.arange(3))
    with pytest.raises(TypeError, match=r"checkpoint\['metadata'\]\['f'\]: a function"):
        save_checkpoint({"module": {}, "metadata": {"f": lambda: 0}}, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_the_committed_checkpoints_load_and_keep_their_tensors():
    # catches: a committed model the weights-only loader refuses, or one whose tensors load differently
    from probcaps.inference.capsule_svi import load_trained

    path = REPO / "checkpoints" / "mnist.pt"
    if not path.is_file():
        pytest.skip("checkpoints/mnist.pt is not in this checkout")
    raw = torch.load(path, weights_only=True)
    cfg, system = load_trained(path)
    state = system.state_dict()
    assert all(torch.equal(state[k], v) for k, v in raw["module"].items() if k in state)
    assert cfg["name"] == raw["metadata"]["name"]
    for other in sorted((REPO / "checkpoints").glob("*.pt")):
        load_checkpoint(other)


# --------------------------------------------------------------------------------------------- resume


def _copy_run(trained: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "run"


def test_resume_never_deletes_a_finished_model(trained, tmp_path, capsys):
    # catches: --resume with final.pt present and checkpoint.pt gone saying "stopped before its first checkpoint",
    # deleting final.pt and retraining from step 0
    run = _copy_run(trained, tmp_path)
    (run / "checkpoint.pt").unlink()
    final = (run / "final.pt").read_bytes()
    code = cli.main(["train", "--config", str(trained / "tiny.toml"), "--out", str(run), "--steps", "4", "--resume",
                     "--quiet"])
    assert code == 2
    one_line(capsys, run, "final.pt", "step 2")
    assert (run / "final.pt").read_bytes() == final and not (run / "checkpoint.pt").exists()


@pytest.mark.parametrize("overrides, keys", [
    (["model.temperature=2.0", "data.seed=3"], ["model.temperature", "data.seed"]),
    (["train.batch_size=2"], ["train.batch_size"]),
    (["train.seed=7"], ["train.seed"]),
    (["encoder.set_hidden=32"], ["encoder.set_hidden"]),
])
def test_resume_refuses_a_config_that_trains_another_model(overrides, keys, trained, tmp_path, capsys):
    # catches: --resume --set model.temperature=2.0 (or a new batch size or seed) continuing silently
    run = _copy_run(trained, tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    sets = [a for o in overrides for a in ("--set", o)]
    assert cli.main(["train", "--config", str(trained / "tiny.toml"), "--out", str(run), "--steps", "4",
                     "--resume", "--quiet", *sets]) == 2
    one_line(capsys, run / "checkpoint.pt", *keys)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == before


def test_resume_applies_and_logs_a_changed_learning_rate_and_step_count(trained, tmp_path, capsys):
    # catches: keys that may change on resume (learning rate, steps, logging, checkpoint interval) being refused,
    # or applied without a word
    run = _copy_run(trained, tmp_path)
    assert cli.main(["train", "--config", str(trained / "tiny.toml"), "--out", str(run), "--steps", "3",
                     "--resume", "--quiet", "--set", "train.lr=0.001", "--set", "train.log_every=2"]) == 0
    err = capsys.readouterr().err
    assert "learning rate changed" in err and "train.log_every changed from 1 to 2" in err
    assert "train.steps changed from 2 to 3" in err
    assert load_checkpoint(run / "final.pt")["state"]["step"] == 3
    logged = [r for r in read_jsonl(run / "log.jsonl") if "config_changes" in r]
    assert logged and {c["key"] for c in logged[0]["config_changes"]} == {"train.log_every", "train.steps"}
    assert [r for r in read_jsonl(run / "log.jsonl") if "lr_changes" in r][0]["lr_changes"][0]["step"] == 2


# --------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["../../x", "..", ".", "", "a/b", "/etc/x", "a\0b", "a\\b"])
def test_a_name_cannot_leave_its_folder(name):
    # catches: a stored or typed name that is a path writing results outside the results folder
    with pytest.raises(ConfigError, match=r"^ckpt.pt: name: .* is not a file name"):
        check_file_name(name, "ckpt.pt: name")
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        file_name_arg(name)


def test_plain_names_pass():
    assert check_file_name("mnist_seed1.v2", "x") == "mnist_seed1.v2" == file_name_arg("mnist_seed1.v2")


def test_evaluate_refuses_a_name_that_leaves_the_results_folder(trained, tmp_path, capsys):
    # catches: evaluate --name ../../x writing its JSON two folders up
    with pytest.raises(SystemExit) as refused:  # argparse: its usage, then one error line
        cli.main(["evaluate", "--checkpoint", str(trained / "run" / "final.pt"), "--name", "../../x",
                  "--results-dir", str(tmp_path / "r" / "s"), "--quiet"])
    assert refused.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --name" in last and "../../x" in last and "not a file name" in last
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "r").exists()


def test_a_stored_name_that_leaves_the_folder_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "c.toml").write_text('name = "../../escaped"\n')
    from probcaps.inference.capsule_svi import load_experiment_config

    with pytest.raises(ConfigError, match=r"c.toml: name: '../../escaped' is not a file name"):
        load_experiment_config(tmp_path / "c.toml")


def test_thread_counts_beyond_the_machine_are_one_line():
    # catches: --threads 10000 reaching torch.set_num_threads (a segfault in OpenMP)
    import argparse

    cpus = os.cpu_count() or 1
    assert check_threads(1) == 1 and check_threads(4 * cpus) == 4 * cpus
    for n in (0, -1, 4 * cpus + 1, 10000):
        with pytest.raises(ConfigError, match=r"^--threads: must be in \[1, "):
            check_threads(n)
    with pytest.raises(argparse.ArgumentTypeError, match="must be in"):
        threads_arg("10000")
    with pytest.raises(argparse.ArgumentTypeError, match="integer"):
        threads_arg("many")


def test_a_checkpoint_in_the_old_pickled_format_is_refused_with_a_hint(trained, tmp_path, capsys):
    # catches: a checkpoint whose numpy RNG state is a pickled array (the format before weights-only loading)
    # failing with the unpickler's multi-line message, or being read with weights_only=False
    run = _copy_run(trained, tmp_path)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    ckpt["rng"]["numpy"] = np.random.get_state()
    torch.save(ckpt, run / "checkpoint.pt")
    assert cli.main(["train", "--config", str(trained / "tiny.toml"), "--out", str(run), "--steps", "4", "--resume",
                     "--quiet"]) == 2
    one_line(capsys, run / "checkpoint.pt", "numpy", "older probcaps")


@pytest.mark.parametrize("damage", ["no optimiser", "optimiser of the wrong kind", "rng of the wrong kind"])
def test_resuming_from_a_damaged_checkpoint_is_one_line(damage, trained, tmp_path, capsys):
    # catches: a checkpoint.pt without the training state (an exported model copied there) or with a damaged one
    # failing with a KeyError or TypeError traceback
    run = _copy_run(trained, tmp_path)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    if damage == "no optimiser":
        del ckpt["optimiser"]
    elif damage == "optimiser of the wrong kind":
        ckpt["optimiser"] = {"state": {0: {"exp_avg": 3}}, "param_groups": "x"}
    else:
        ckpt["rng"] = {"torch": "not a state"}
    torch.save(ckpt, run / "checkpoint.pt")
    assert cli.main(["train", "--config", str(trained / "tiny.toml"), "--out", str(run), "--steps", "4", "--resume",
                     "--quiet"]) == 2
    one_line(capsys, run / "checkpoint.pt")
    assert (run / "final.pt").is_file()
