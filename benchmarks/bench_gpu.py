"""The one prepared run for a GPU machine (``make gpu``): what a GPU is for here, inside ``--budget-minutes``.

    python benchmarks/bench_gpu.py --device cuda --budget-minutes 9 --copy-to "$OUT"
    python benchmarks/bench_gpu.py --tiny          # the same stages at smoke sizes, on any machine (about 2 minutes)

In order, each a fresh process (so peak memory is its own):

1. each model's training step: the capsule model at SCAE's sizes (``bench_step.py``, 40 parts, 32 objects, batch
   128, the recommended encoder), CapsNet at the paper's size on 36×36 MultiMNIST (``bench_capsnet.py --configs
   paper``), the paper's smallNORB matrix-capsule network (``bench_matrix_capsules.py``, A, B, C, D = 32, 32, 32, 32),
   and ``probcaps train`` of the recommended MNIST recipe for ``--train-steps`` steps (images/s from its log), into
   ``results/speed/bench_gpu.json``;
2. with ``--peer-path`` (a checkout of torch-scae carried to the machine), torch-scae's training step beside ours on
   the same device, interleaved (``bench_vs_torch_scae.py --device``), into ``results/speed/bench_vs_torch_scae_<device
   kind>.json``;
3. the paper-size CapsNet on MultiMNIST (``probcaps run multimnist --config multimnist_paper``) for as many steps as
   the budget left allows at the step rate of stage 1, then scored on the 10,000 test pairs; its run folder
   (``--runs``) resumes, and the step count, chosen once, is kept in ``--runs/plan.json`` so that a rerun continues
   the same run;
4. if time is left, the recommended MNIST recipe trained longer and read out (``probcaps evaluate``).

``--copy-to`` copies every results JSON written to a folder (the device machine's ``$OUT``); the tables are rebuilt
from them here by ``probcaps report``.  The trained models stay on the machine: the paper-size CapsNet with its
optimiser state is larger than what comes back from it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from probcaps.io import read_jsonl, write_json
from probcaps.provenance import command_line, device_description
from probcaps.report import write_table
from probcaps.runner import add_common_args, finite_positive_float, launch, one_line_errors, positive_int

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _steps(args, tmp: Path) -> list[tuple[str, list[str], Path]]:
    """``(model, command, JSON it writes)`` of each step benchmark."""
    dev = ["--device", args.device] + (["--threads", str(args.threads)] if args.threads else [])
    tiny = args.tiny
    return [
        ("capsule model, SCAE sizes (40 parts, 32 objects), recommended encoder",
         [str(BENCH / "bench_step.py"), "--config", str(ROOT / "experiments/configs/mnist.toml"),
          "--parts", "4" if tiny else "40", "--parents", "3" if tiny else "32", "--batch", "4" if tiny else "128",
          "--repeats", "2" if tiny else "20", "--set", f"encoder.bf16={'false' if tiny else 'true'}", *dev,
          "--json", str(tmp / "step.json")], tmp / "step.json"),
        ("CapsNet, paper size (36×36 MultiMNIST)",
         [str(BENCH / "bench_capsnet.py"), "--configs", "reduced" if tiny else "paper", "--batch",
          "2" if tiny else "128", "--repeats", "2" if tiny else "20", *dev, "--json", str(tmp / "capsnet.json")],
         tmp / "capsnet.json"),
        ("matrix capsules, the paper's smallNORB network (32, 32, 32, 32)",
         [str(BENCH / "bench_matrix_capsules.py"), *(["--A", "8", "--B", "2", "--C", "2", "--D", "2"] if tiny else
                                                    ["--A", "32", "--B", "32", "--C", "32", "--D", "32"]),
          "--batch", "2" if tiny else "32", "--repeats", "1" if tiny else "10", *dev,
          "--json", str(tmp / "matrix.json")], tmp / "matrix.json"),
    ]


def _row(model: str, data) -> dict:
    """The images/s and peak memory of a benchmark's JSON (the last row where it writes several)."""
    if isinstance(data, list):
        data = data[-1]
    if "rows" in data:
        data = data["rows"][-1]
    ips = next(data[k] for k in ("images_per_s", "train_images_per_s", "pyro_images_per_s") if k in data)
    return {"model": model, "images_per_s": ips, "peak_memory_mb": data.get("peak_memory_mb")}


def readme_table(results_dir: Path, name: str = "bench_gpu") -> str | None:
    path = Path(results_dir) / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    lines = ["| measurement | images/s | peak memory (MB) |", "| --- | --- | --- |"]
    for r in data["rows"]:
        memory = "—" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
        lines.append(f"| {r['model']} | {r['images_per_s']:.0f} | {memory} |")
    return "\n".join(lines + ["", f"Device: {data['device']}; command: `{data['command']}`."])


#: smoke sizes of the trainings for --tiny: synthetic digits, a few steps, small test sets
TINY_MULTIMNIST = ["--config", "multimnist", "--set", "data.dataset=synthetic", "--set", "data.test_pairs=20",
                   "--set", "eval.curve_pairs=10", "--set", "train.batch_size=4", "--set", "train.checkpoint_every=2"]
TINY_MNIST = ["--set", "data.dataset=synthetic", "--set", "data.train_limit=64", "--set", "train.batch_size=8",
              "--set", "encoder.bf16=false", "--set", "train.compile=false"]


def probcaps(*words: str, data_dir=None) -> list[str]:
    """The command line of ``probcaps <words>`` in this interpreter."""
    return [sys.executable, "-m", "probcaps", *words, *(["--data-dir", str(data_dir)] if data_dir else [])]


def planned_steps(runs: Path, key: str, propose) -> int:
    """The step count of ``key`` chosen by the first run (``runs/plan.json``), else ``propose()``, recorded."""
    plan_path = runs / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.is_file() else {}
    if key not in plan:
        plan[key] = int(propose())
        write_json(plan_path, plan)
    return plan[key]


def train_multimnist_paper(args, capsnet_ips: float, seconds: float, results: Path) -> Path | None:
    """Stage 3: the paper-size CapsNet for the steps ``seconds`` of training allow at ``capsnet_ips``, resumable,
    scored on the test pairs; its results JSON (None when the budget allows no step)."""
    batch = 4 if args.tiny else 128
    steps = planned_steps(args.runs, "multimnist_paper", lambda: 4 if args.tiny else seconds * capsnet_ips / batch)
    if steps < 1:
        return None
    words = ["run", "multimnist", *(TINY_MULTIMNIST if args.tiny else ["--config", "multimnist_paper"]),
             "--set", f"train.steps={steps}", "--seeds", "0", "--out", str(args.runs / "multimnist_paper"),
             "--results-dir", str(results / "multimnist"), "--device", args.device, "--resume", "--quiet"]
    subprocess.run(probcaps(*words, data_dir=args.data_dir), check=True, stdout=subprocess.DEVNULL)
    return results / "multimnist" / ("multimnist.json" if args.tiny else "multimnist_paper.json")


def train_mnist_longer(args, mnist_ips: float, seconds: float, results: Path) -> Path | None:
    """Stage 4: the recommended MNIST recipe for the steps ``seconds`` allow at ``mnist_ips``, then read out."""
    steps = planned_steps(args.runs, "mnist", lambda: 3 if args.tiny else seconds * mnist_ips / 128)
    if steps < 1:
        return None
    run = args.runs / "mnist"
    train = ["train", "--config", str(ROOT / "experiments/configs/mnist.toml"), "--out", str(run), "--steps",
             str(steps), "--device", args.device, "--quiet", *(TINY_MNIST if args.tiny else [])]
    if (run / "checkpoint.pt").is_file():
        train.append("--resume")
    subprocess.run(probcaps(*train, data_dir=args.data_dir), check=True, stdout=subprocess.DEVNULL)
    name = f"mnist_gpu_steps{steps}"
    evaluate = ["evaluate", "--checkpoint", str(run / "final.pt"), "--name", name, "--results-dir",
                str(results / "mnist_probe"), "--device", args.device, "--no-figures", "--quiet",
                *(["--set", "eval.probe_train_limit=32", "--set", "eval.kmeans_n_init=1"] if args.tiny else [])]
    subprocess.run(probcaps(*evaluate, data_dir=args.data_dir), check=True, stdout=subprocess.DEVNULL)
    return results / "mnist_probe" / f"{name}.json"


@one_line_errors("bench_gpu")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-steps", type=positive_int, default=200, help="steps of the short MNIST training")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and synthetic data: a smoke test on any machine")
    p.add_argument("--json", default=str(ROOT / "results" / "speed" / "bench_gpu.json"))
    p.add_argument("--budget-minutes", type=finite_positive_float, default=None,
                   help="the whole run's time: stages 3 and 4 take what stages 1 and 2 leave (default: stages 1-2 "
                        "alone)")
    p.add_argument("--peer-path", default=None, help="a torch-scae checkout: stage 2 (bench_vs_torch_scae.py)")
    p.add_argument("--peer-site", default=None, help="a folder with torch-scae's dependencies (monty, pyyaml)")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "gpu", help="the trainings' run folders")
    p.add_argument("--copy-to", type=Path, default=None, help="copy every results JSON written here (e.g. $OUT)")
    add_common_args(p)
    args = p.parse_args(argv)
    started = time.monotonic()
    results = Path(args.json).resolve().parent.parent  # results/ (its speed/ holds --json)
    written = [Path(args.json)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model, cmd, out in _steps(args, tmp):
            subprocess.run([sys.executable, *cmd], check=True, stdout=subprocess.DEVNULL)
            rows.append(_row(("smoke sizes, not " if args.tiny else "") + model, json.loads(out.read_text())))
        run = tmp / "mnist"
        train = [sys.executable, "-m", "probcaps", "train", "--config", str(ROOT / "experiments/configs/mnist.toml"),
                 "--out", str(run), "--steps", str(args.train_steps), "--device", args.device, "--quiet"]
        if args.tiny:
            train += ["--set", "data.dataset=synthetic", "--set", "data.train_limit=64", "--set", "train.batch_size=8",
                      "--set", "encoder.bf16=false", "--set", "train.compile=false"]
        if args.data_dir:
            train += ["--data-dir", args.data_dir]
        subprocess.run(train, check=True, stdout=subprocess.DEVNULL)
        log = read_jsonl(run / "log.jsonl")
        rows.append({"model": f"MNIST training, recommended recipe, {args.train_steps} steps (probcaps train)",
                     "images_per_s": log[-1]["items_per_s"], "peak_memory_mb": None})
    result = {"device": device_description(args.device), "rows": rows, "command": command_line()}
    write_json(args.json, result)
    out = Path(args.json)
    write_table(out.parent, out.stem, readme_table(out.parent, out.stem))
    for r in rows:
        print(f"  {r['model']:80s} {r['images_per_s']:8.1f} images/s  peak memory {r['peak_memory_mb'] or '—'} MB")
    if args.peer_path:
        kind = "cpu" if args.device == "cpu" else "gpu"
        peer_json = out.parent / f"bench_vs_torch_scae_{kind}.json"
        cmd = [str(BENCH / "bench_vs_torch_scae.py"), "--peer-path", args.peer_path, "--device", args.device,
               "--rounds", "1" if args.tiny else "3", "--json", str(peer_json),
               *(["--peer-site", args.peer_site] if args.peer_site else []),
               *(["--batch", "4", "--parts", "4", "--parents", "3", "--steps", "1", "--warmup", "1"] if args.tiny
                 else [])]
        subprocess.run([sys.executable, *cmd], check=True)
        written.append(peer_json)
    if args.budget_minutes is not None:
        # each stage takes its share of what is left, less a margin for the test-set evaluations and the copies
        # (stage, the step rate stage 1 measured for it, its share of the time left)
        for stage, ips, share in ((train_multimnist_paper, rows[1]["images_per_s"], 0.7),
                                  (train_mnist_longer, rows[-1]["images_per_s"], 1.0)):
            seconds = share * (args.budget_minutes * 60 - (time.monotonic() - started) - 90)
            if seconds > 0 or args.tiny:
                path = stage(args, ips, seconds, results)
                written += [path] if path else []
    if args.copy_to:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copy2(path, args.copy_to / path.name)
        print(f"copied {', '.join(p.name for p in written)} to {args.copy_to}")
    return 0


if __name__ == "__main__":
    launch(main)
