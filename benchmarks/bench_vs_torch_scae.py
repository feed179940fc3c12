"""One training step at SCAE's sizes against bdsaglam/torch-scae's own SCAE model and loss.

SCAE's MNIST sizes for both (batch 128, 40 parts, 32 objects, 11x11 templates, 40x40 canvas); the same MNIST
digits placed on the canvas as our data pipeline places them, labels included (torch-scae's loss trains its
linear probes on them).  torch-scae is imported from a checkout outside this repository (``--peer-path``), built
from its own MNIST config (``torch_scae_experiments/configs/model/mnist.yaml``) and trained with its own default
optimiser (``configs/config.yaml``: RMSprop, ``configs/optimizer/rmsprop.yaml``); its step is the body of its
``training_step`` (forward, loss, accuracy) plus backward and the optimiser step, without its per-batch
``gc.collect()``.  Ours is the training loop's step (Pyro ``TraceEnum_ELBO``, the training loop's optimiser) with
the recommended MNIST recipe's encoder and with the headline encoder (the 128-wide set transformer, float32
convolutions); the recipe's bf16 convolutions only on a CPU with bfloat16 kernels (recorded as ``bf16_supported``).

Every measurement is a fresh process; the variants run interleaved over ``--rounds`` rounds, and the speed
ratios are paired within a round (each round's images/s over torch-scae's in the same round), then the median
over rounds is reported, with each round's load average.

    git --git-dir=<mirror of bdsaglam/torch-scae> archive HEAD | tar -x -C /tmp/torch-scae
    pip install --no-deps --target /tmp/scae-deps monty pyyaml      # torch-scae's imports beyond torch
    python benchmarks/bench_vs_torch_scae.py --peer-path /tmp/torch-scae --peer-site /tmp/scae-deps \\
        --peer-commit "$(git --git-dir=<mirror> rev-parse HEAD)" --json results/speed/bench_vs_torch_scae.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RECOMMENDED = "experiments/configs/mnist.toml"
VARIANTS = {
    "ours, recommended encoder": [],
    "ours, headline encoder": ["encoder.set_hidden=128", "encoder.bf16=false"],
    "torch-scae": None,
}


def mnist_batch(batch: int, canvas: int, seed: int):
    """``(images (batch, 1, canvas, canvas) in [0, 1], labels (batch,))``: MNIST training digits as we place them."""
    from probcaps.config import DataConfig
    from probcaps.inference.capsule_svi import load_images

    images, labels = load_images(DataConfig(canvas_size=canvas, max_shift=(canvas - 28) // 2, seed=seed), "train",
                                 limit=batch)
    return images.float().div(255).unsqueeze(1), labels


def ours(overrides: list[str], parts: int, parents: int, batch: int, device: str = "cpu"):
    """The step of our training loop for ``experiments/configs/mnist.toml`` with ``overrides``."""
    import pyro

    from probcaps.inference.capsule_svi import CapsuleSystem, load_experiment_config
    from probcaps.inference.train import make_elbo, make_optimiser

    pyro.settings.set(module_local_params=True)
    pyro.enable_validation(False)
    cfg = load_experiment_config(REPO / RECOMMENDED, [f"model.num_parts={parts}", f"model.num_parents={parents}",
                                                      *overrides])
    system = CapsuleSystem(cfg["model"], cfg["encoder"], compile=cfg["train"].compile).to(device)
    optimiser = make_optimiser(system, cfg["train"])
    elbo = make_elbo(cfg["train"].jit)
    x = mnist_batch(batch, cfg["model"].canvas_size, seed=0)[0].to(device)

    def step():
        optimiser.zero_grad(set_to_none=True)
        loss = system.loss(elbo, x)  # with the recipe's information term: (loss, its entropies)
        (loss[0] if isinstance(loss, tuple) else loss).backward()
        optimiser.step()

    described = {"config": RECOMMENDED, "overrides": overrides, "encoder": cfg["encoder"].to_dict(),
                 "compile": cfg["train"].compile}
    return step, described


def torch_scae(peer: Path, batch: int, device: str = "cpu"):
    """torch-scae's training step, from its own MNIST model config and default optimiser config."""
    import yaml
    from torch_scae import cv_ops, factory

    class TorchWithCopyingSplit:
        # cv_ops.geometric_transform scales one output of torch.split in place, which autograd has refused since
        # torch 1.5 (torch-scae pins 1.4); copies of the six (B, M, 1) slices let it run unchanged
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def split(tensor, size, dim=0):
            return tuple(part.clone() for part in torch.split(tensor, size, dim))

    cv_ops.torch = TorchWithCopyingSplit()

    configs = peer / "torch_scae_experiments" / "configs"
    model_cfg = yaml.safe_load((configs / "model" / "mnist.yaml").read_text())["model"]
    default = yaml.safe_load((configs / "config.yaml").read_text())
    optimiser_name = next(d["optimizer"] for d in default["defaults"] if "optimizer" in d)
    opt_cfg = yaml.safe_load((configs / "optimizer" / f"{optimiser_name}.yaml").read_text())["optimizer"]
    scae = factory.make_scae(model_cfg).to(device)
    # BaseExperiment.configure_optimizers: eps = 1e-2 / batch_size^2
    eps = 1e-2 / float(default["data_loader"]["batch_size"]) ** 2
    if opt_cfg["type"] == "RMSprop":
        optimiser = torch.optim.RMSprop(scae.parameters(), lr=opt_cfg["learning_rate"], momentum=opt_cfg["momentum"],
                                        eps=eps, weight_decay=opt_cfg["weight_decay"])
    else:
        optimiser = torch.optim.Adam(scae.parameters(), lr=opt_cfg["learning_rate"], eps=eps,
                                     weight_decay=opt_cfg["weight_decay"])
    x, labels = (t.to(device) for t in mnist_batch(batch, model_cfg["image_shape"][-1], seed=0))

    def step():
        # BaseExperiment.training_step, then what the trainer does with its loss
        res = scae(image=x)
        loss, _ = scae.loss(res, reconstruction_target=x, label=labels)
        scae.calculate_accuracy(res, labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()

    described = {"model_config": "torch_scae_experiments/configs/model/mnist.yaml", "optimizer": opt_cfg,
                 "sizes": {"parts": model_cfg["n_part_caps"], "objects": model_cfg["n_obj_caps"],
                           "canvas": model_cfg["image_shape"][-1]}}
    return step, described


def readme_table(results_dir, name: str = "bench_vs_torch_scae") -> str | None:
    """The README table of ``results_dir/<name>.json`` (None when there is none)."""
    path = Path(results_dir) / f"{name}.json"
    return table(json.loads(path.read_text())) if path.is_file() else None


def table(r: dict) -> str:
    """The README table of one ``bench_vs_torch_scae.py`` result."""
    lines = ["| model | images/s | step (ms) | peak memory (MB) | speed vs torch-scae |",
             "| --- | --- | --- | --- | --- |"]
    for name, s in r["summary"].items():
        lines.append(f"| {name} | {s['images_per_s']:.0f} | {s['step_ms']:.0f} | {s['peak_memory_mb']:.0f} | "
                     f"{s['speedup_over_torch_scae']:.2f}× |")
    loads = [x for row in r["rounds"] for x in row["load_average"]]
    bf16 = next((row[n].get("bf16_supported") for row in r["rounds"] for n in row if isinstance(row[n], dict)
                 and "bf16_supported" in row[n]), None)
    lines += ["", f"Batch {r['batch']}, {r['parts']} parts, {r['parents']} objects; each number the median over "
              f"{len(r['rounds'])} rounds of fresh processes (each the median of {r['steps_per_process']} steps after "
              f"{r['warmup_steps']} untimed), the speed ratio paired within a round; bdsaglam/torch-scae "
              f"{(r.get('peer_commit') or '')[:7]}; bf16 convolutions {'on' if bf16 else 'off (no bfloat16 kernels)'}; "
              f"{r['device_description']}, {r['threads']} threads, load average {min(loads):.1f} to {max(loads):.1f}; "
              f"command: `{r['command']}`."]
    return "\n".join(lines)


def worker(args) -> None:
    """One measurement in this process: warm-up, then the median of ``--steps`` timed steps, as one JSON line."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cuda = args.device.startswith("cuda")
    if args.worker == "torch-scae":
        step, described = torch_scae(Path(args.peer_path), args.batch, args.device)
    else:
        # the recipe's bf16 convolutions only where the CPU has bfloat16 kernels (elsewhere they are emulated,
        # several times slower, and the recipe says to turn them off); a GPU has them
        from probcaps.provenance import has_bf16_kernels

        bf16 = has_bf16_kernels(args.device)
        overrides = VARIANTS[args.worker] + ([] if bf16 else ["encoder.bf16=false"])
        step, described = ours(overrides, args.parts, args.parents, args.batch, args.device)
        described["bf16_supported"] = bool(bf16)
    # a GPU runs its kernels behind the host: a step is timed from one synchronisation to the next
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    # the process's peak resident memory on a CPU, the device's peak allocation on a GPU
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(json.dumps({"variant": args.worker, "step_ms": 1000 * step_s, "images_per_s": args.batch / step_s,
                      "peak_memory_mb": peak / 2 ** 20, "threads": torch.get_num_threads(), **described}))


def portable_command(argv: list[str]) -> str:
    """The command line with the peer's folders, which lie outside the repository, as placeholders."""
    placeholders = {"--peer-path": "<torch-scae checkout>", "--peer-site": "<its dependencies>"}
    words = ["python", *argv]
    return " ".join(placeholders.get(words[i - 1], w) if i else w for i, w in enumerate(words))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-path", required=True, help="a checkout of bdsaglam/torch-scae (outside this repository)")
    p.add_argument("--peer-site", action="append", default=[],
                   help="a folder with torch-scae's dependencies (monty, pyyaml), put on its PYTHONPATH")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per process (the median is kept)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the compile happens here)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--parts", type=int, default=40)
    p.add_argument("--parents", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: both steps on the GPU")
    p.add_argument("--peer-commit", default=None, help="the torch-scae commit checked out (recorded in --json)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    peer = Path(args.peer_path).resolve()
    if not (peer / "torch_scae" / "factory.py").is_file():
        print(f"--peer-path {args.peer_path}: not a torch-scae checkout (no torch_scae/factory.py)", file=sys.stderr)
        return 2
    if args.worker:
        worker(args)
        return 0

    from probcaps.io import write_json
    from probcaps.provenance import device_description
    from probcaps.report import write_table

    common = ["--peer-path", str(peer), "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
              str(args.batch), "--parts", str(args.parts), "--parents", str(args.parents), "--threads",
              str(args.threads), "--device", args.device]
    names = list(VARIANTS)
    rounds = []
    for r in range(args.rounds):
        load_before = os.getloadavg()[0]
        row = {}
        for name in names[r % len(names):] + names[:r % len(names)]:  # a different variant first in each round
            env = dict(os.environ)
            if name == "torch-scae":
                env["PYTHONPATH"] = os.pathsep.join([str(peer), *args.peer_site, env.get("PYTHONPATH", "")])
            out = subprocess.run([sys.executable, __file__, "--worker", name, *common], env=env, cwd=REPO,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                print(f"bench_vs_torch_scae: the {name!r} process failed (exit status {out.returncode})",
                      file=sys.stderr)
                return 1
            row[name] = json.loads(out.stdout.strip().splitlines()[-1])
        row["load_average"] = [load_before, os.getloadavg()[0]]
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{n} {row[n]['images_per_s']:.0f} images/s" for n in names)
              + f" (load average {load_before:.2f} -> {row['load_average'][1]:.2f})", flush=True)

    summary = {}
    for name in names:
        summary[name] = {
            "images_per_s": statistics.median(r[name]["images_per_s"] for r in rounds),
            "step_ms": statistics.median(r[name]["step_ms"] for r in rounds),
            "peak_memory_mb": statistics.median(r[name]["peak_memory_mb"] for r in rounds),
            "speedup_over_torch_scae": statistics.median(r[name]["images_per_s"] / r["torch-scae"]["images_per_s"]
                                                         for r in rounds),
        }
    for name, s in summary.items():
        print(f"{name:28s} {s['images_per_s']:6.0f} images/s  {s['step_ms']:6.0f} ms/step  "
              f"{s['peak_memory_mb']:6.0f} MB peak  x{s['speedup_over_torch_scae']:.2f} torch-scae")
    if args.json:
        result = {
            "summary": summary, "rounds": rounds, "batch": args.batch, "parts": args.parts, "parents": args.parents,
            "threads": args.threads, "steps_per_process": args.steps, "warmup_steps": args.warmup,
            "peer": "bdsaglam/torch-scae", "peer_commit": args.peer_commit,
            "device_description": device_description(args.device), "malloc_env": "MALLOC_MMAP_THRESHOLD_" in os.environ,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "command": portable_command(sys.argv),
        }
        write_json(args.json, result)
        out = Path(args.json)
        write_table(out.parent, out.stem, readme_table(out.parent, out.stem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
