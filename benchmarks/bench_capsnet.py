"""Time one CapsNet training step (forward, margin + reconstruction loss of both digits, backward, Adam) at
MultiMNIST size, for the configs of the MultiMNIST experiment.

    python benchmarks/bench_capsnet.py --threads 2                       # reduced and paper-size configs
    python benchmarks/bench_capsnet.py --configs paper --set model.bf16=false --label float32 --json X --append
    python benchmarks/bench_capsnet.py --configs paper --compare \
        --variant "float32" model.bf16=false model.phase_split=false \
        --variant "bf16" model.phase_split=false --variant "bf16, phase split"     # interleaved, in one process

Prints per config: step time (median), images/s and peak memory (max RSS of the process on CPU, which is
monotone, so configs are run smallest first; CUDA: peak allocated).  Writes the rows to ``--json``.  With
``--compare`` the variants (each the config with its ``model.KEY=VALUE`` changes) are built side by side and timed
in interleaved rounds, one step of each per round, a different variant first each round; each row's speed-up is
the median over the rounds of the first variant's step time over its own (the peak memory is the process's, so
it is left out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

from probcaps.io import write_json  # noqa: E402
from probcaps.models.capsnet import CapsNet  # noqa: E402
from probcaps.provenance import device_description, has_bf16_kernels  # noqa: E402

CONFIGS = {
    "reduced": ROOT / "experiments" / "configs" / "multimnist.toml",
    "paper": ROOT / "experiments" / "configs" / "multimnist_paper.toml",
}


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_step(model: CapsNet, batch: int, repeats: int, device: str) -> list[float]:
    """Seconds per full training step, ``repeats`` times after two warm-up steps."""
    step = make_step(model, batch, device)
    step()
    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def make_step(model: CapsNet, batch: int, device: str):
    """One full training step of ``model`` on a fixed random batch, as a function (synchronised on CUDA)."""
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    shape = (batch, 2, cfg.in_channels, cfg.image_size, cfg.image_size)
    sources = (torch.rand(shape, generator=g) > 0.8).float().to(device)
    x = sources.amax(1)
    labels = torch.stack([torch.zeros(batch, dtype=torch.long), torch.ones(batch, dtype=torch.long)], 1).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        loss, _ = model.loss(x, labels, sources)
        loss.backward()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return step


def compare(args, name: str, load_config) -> list[dict]:
    """The ``--variant`` s of config ``name`` timed in interleaved rounds (module docstring) -> one row each."""
    labels = [v[0] for v in args.variant]
    steps, cfgs = [], []
    for label, *changes in args.variant:
        cfg = load_config(CONFIGS[name], args.set + changes)
        torch.manual_seed(0)
        steps.append(make_step(CapsNet(cfg["model"]).to(args.device), args.batch, args.device))
        cfgs.append(cfg["model"])
    for step in steps:  # warm-up: the allocator's and oneDNN's first calls
        step()
        step()
    times = [[] for _ in steps]
    for r in range(args.repeats):
        order = list(range(len(steps)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            t0 = time.perf_counter()
            steps[i]()
            times[i].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{labels[i]} {1000 * times[i][-1]:.0f} ms" for i in range(len(steps))),
              flush=True)
    rows = []
    for i, label in enumerate(labels):
        med = statistics.median(times[i])
        speedup = statistics.median(t0 / t for t0, t in zip(times[0], times[i]))
        rows.append({"config": f"{name}, {label}", "batch": args.batch, "step_s": med, "step_s_min": min(times[i]),
                     "images_per_s": args.batch / med, "peak_memory_mb": None, "interleaved": True,
                     "speedup_over": f"{name}, {labels[0]}", "speedup": speedup, "changes": args.variant[i][1:],
                     "threads": torch.get_num_threads(), "device": args.device,
                     "device_description": device_description(args.device), "model": cfgs[i].to_dict(),
                     "num_primary_capsules": cfgs[i].num_primary, "bf16_supported": has_bf16_kernels(args.device),
                     "malloc_env": "MALLOC_MMAP_THRESHOLD_" in os.environ, "repeats": args.repeats,
                     "load_average": os.getloadavg()[0], "command": shlex.join(["python", *sys.argv])})
        print(f"{name} {label:24s} step {1000 * med:.0f} ms (min {1000 * min(times[i]):.0f}), "
              f"{args.batch / med:.1f} images/s, x{speedup:.2f} {labels[0]}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["reduced", "paper"], choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE",
                   help="override a model key of every config")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--append", action="store_true", help="append the rows to --json instead of replacing it")
    p.add_argument("--label", default=None, help="suffix for the config names in the rows (e.g. 'float32')")
    p.add_argument("--compare", action="store_true", help="time the --variant s interleaved (module docstring)")
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar="LABEL [model.KEY=VALUE ...]",
                   help="with --compare: a label and the changes that make this variant of each config")
    args = p.parse_args(argv)
    if args.compare and len(args.variant) < 2:
        p.error("--compare needs at least two --variant")
    if args.threads:
        torch.set_num_threads(args.threads)
    from probcaps.experiments.multimnist import load_config

    rows = []
    for name in args.configs:
        if args.compare:
            rows += compare(args, name, load_config)
            continue
        cfg = load_config(CONFIGS[name], args.set)
        torch.manual_seed(0)
        model = CapsNet(cfg["model"]).to(args.device)
        times = time_step(model, args.batch, args.repeats, args.device)
        med = statistics.median(times)
        row = {"config": name + (f", {args.label}" if args.label else ""), "batch": args.batch, "step_s": med,
               "step_s_min": min(times), "images_per_s": args.batch / med,
               "peak_memory_mb": peak_memory_mb(args.device),
               "threads": torch.get_num_threads(), "device": args.device,
               "device_description": device_description(args.device), "model": cfg["model"].to_dict(),
               "num_primary_capsules": cfg["model"].num_primary,
               "parameters": sum(p.numel() for p in model.parameters()),
               "malloc_env": "MALLOC_MMAP_THRESHOLD_" in os.environ, "repeats": args.repeats,
               "load_average": os.getloadavg()[0], "command": shlex.join(["python", *sys.argv])}
        rows.append(row)
        print(f"{name:8s} conv1 {cfg['model'].conv1_channels:3d}, {cfg['model'].primary_capsules:2d}x"
              f"{cfg['model'].primary_dim}-D primary caps ({cfg['model'].num_primary} children), bf16 "
              f"{cfg['model'].bf16}: step {1000 * med:.0f} ms (min {1000 * min(times):.0f}), "
              f"{row['images_per_s']:.1f} images/s, peak memory {row['peak_memory_mb']:.0f} MB, "
              f"{row['threads']} threads, load average {row['load_average']:.1f}")
        del model
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if args.append and path.is_file() else []
        write_json(path, old + rows)
    return 0


if __name__ == "__main__":
    from probcaps.runner import reexec_with_allocator_settings

    reexec_with_allocator_settings(sys.argv)
    sys.exit(main())
