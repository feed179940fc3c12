"""A user's pip install: the wheel, installed without ``-e`` into a fresh virtual environment, works from an empty
folder and writes nothing inside the installed package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REAL_DATA_ROOT, requires_real_mnist

ROOT = Path(__file__).resolve().parent.parent


def _files(folder: Path) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``folder`` but Python's byte-code caches."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(bin folder, installed package folder)`` of a fresh virtual environment holding the project's wheel; its
    dependencies (torch, pyro, ...) are this environment's, on the path without the editable install's hook."""
    tmp = tmp_path_factory.mktemp("install")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp / "wheel"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next((tmp / "wheel").glob("probcaps-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=300)
    venv_python = tmp / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies as a plain path entry: the .pth files there (the editable install's finder) are not run
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([str(venv_python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return tmp / "venv" / "bin", site / "probcaps"


def _run(installed, cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    bin_dir, _ = installed
    env = {**os.environ, "PROBCAPS_DATA": str(REAL_DATA_ROOT), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    env.pop("PYTHONPATH", None)
    return subprocess.run([str(bin_dir / "probcaps"), *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=600)


def test_the_wheel_installs_the_package_not_the_clone(installed):
    # catches: the installed command importing the clone (an editable hook or a path leaking in) instead of the wheel
    bin_dir, package = installed
    where = subprocess.run([str(bin_dir / "python"), "-c", "import probcaps.cli, probcaps.experiments.mnist_probe as m;"
                            " print(probcaps.cli.__file__); print(m.__file__)"], capture_output=True, text=True,
                           cwd="/", check=True).stdout.split()
    assert all(Path(w).is_relative_to(package) for w in where), where
    assert (package / "experiments" / "configs" / "demo.toml").is_file() and (package / "model_cards.json").is_file()


@pytest.mark.slow
@requires_real_mnist
def test_an_installed_package_trains_evaluates_and_lists_from_an_empty_folder(installed, tmp_path):
    # catches: a recipe or model that only a clone can name, an experiment that only runs from the repository root,
    # or a command writing into the installed package instead of the current folder
    _, package = installed
    before = _files(package)
    work = tmp_path / "empty"
    work.mkdir()
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    train = _run(installed, work, "train", "--config", "demo", "--steps", "2", "--quiet", env=cache)
    assert train.returncode == 0, train.stderr
    assert (work / "runs" / "demo" / "final.pt").is_file()
    evaluate = _run(installed, work, "evaluate", "--checkpoint", "runs/demo/final.pt", "--no-figures", "--quiet",
                    "--set", "eval.probe_train_limit=200", "--set", "data.test_limit=100", env=cache)
    assert evaluate.returncode == 0, evaluate.stderr
    assert list((work / "results").glob("demo*.json"))
    helped = _run(installed, work, "run", "rotated_digits", "--help", env=cache)
    assert helped.returncode == 0 and "--checkpoint" in helped.stdout, helped.stderr
    listed = _run(installed, work, "list", env=cache)
    assert listed.returncode == 0 and "mnist_probe" in listed.stdout and "demo" in listed.stdout
    # a shipped model by name: not in the user cache yet (one line saying where to put it), then found and checked
    missing = _run(installed, work, "draw-objects", "--checkpoint", "mnist", "--limit", "8", env=cache)
    last = missing.stderr.strip().splitlines()[-1]  # argparse's usage, then its one error line
    assert missing.returncode == 2 and "error: argument --checkpoint" in last, missing.stderr
    assert str(tmp_path / "cache" / "probcaps" / "checkpoints" / "mnist.pt") in last
    assert "Traceback" not in missing.stderr
    (tmp_path / "cache" / "probcaps" / "checkpoints").mkdir(parents=True)
    shutil.copy(ROOT / "checkpoints" / "mnist.pt", tmp_path / "cache" / "probcaps" / "checkpoints" / "mnist.pt")
    drawn = _run(installed, work, "draw-objects", "--checkpoint", "mnist", "--limit", "64", "--quiet",
                 "--out", "drawn.png", env=cache)
    assert drawn.returncode == 0, drawn.stderr
    assert (work / "drawn.png").is_file()
    assert _files(package) == before, sorted(set(_files(package)) ^ set(before))
