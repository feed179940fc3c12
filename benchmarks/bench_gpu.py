"""One short prepared run for a GPU machine: each model's training step at paper size, and a short MNIST training.

    python benchmarks/bench_gpu.py --device cuda    # writes results/speed/bench_gpu.json and results/speed/bench_gpu.md

Each measurement is a fresh process (so peak memory is its own): the capsule model's step at SCAE's sizes
(``bench_step.py``, 40 parts, 32 objects, batch 128, the recommended encoder), CapsNet at the paper's size on
36×36 MultiMNIST (``bench_capsnet.py --configs paper``), the paper's smallNORB matrix-capsule network
(``bench_matrix_capsules.py``, A, B, C, D = 32, 32, 32, 32), and ``probcaps train`` of the recommended MNIST recipe
for ``--train-steps`` steps (images/s from its log).  ``--tiny`` shrinks every size for a smoke test on a CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from probcaps.io import read_jsonl, write_json
from probcaps.provenance import command_line, device_description
from probcaps.report import write_table
from probcaps.runner import add_common_args, launch, one_line_errors, positive_int

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


@one_line_errors("bench_gpu")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-steps", type=positive_int, default=200, help="steps of the short MNIST training")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and synthetic data: a smoke test on any machine")
    p.add_argument("--json", default=str(ROOT / "results" / "speed" / "bench_gpu.json"))
    add_common_args(p)
    args = p.parse_args(argv)
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
    return 0


if __name__ == "__main__":
    launch(main)
