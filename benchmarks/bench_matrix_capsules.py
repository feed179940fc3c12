"""Time the paper's smallNORB matrix-capsule network: training steps (forward, backward, Adam) and inference.

Default: the benchmark network, ``A, B, C, D = 64, 8, 16, 16``, 3x3 ConvCaps kernels, 32x32 input, 3 EM iterations,
batch 64 (the paper's is 32, 32, 32, 32: ``--A 32 --B 32 --C 32 --D 32``).  Prints images/s and the peak
resident memory of the process (max RSS, which includes the Python interpreter and torch).

    python benchmarks/bench_matrix_capsules.py --threads 2
    python benchmarks/bench_matrix_capsules.py --threads 2 --json results/speed/bench_matrix_capsules.json
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

from probcaps.io import write_json
from probcaps.models.matrix_capsules import MatrixCapsConfig, MatrixCapsNet, spread_loss
from probcaps.provenance import device_description
from probcaps.runner import positive_int


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for option, default in (("--A", 64), ("--B", 8), ("--C", 16), ("--D", 16), ("--iterations", 3),
                            ("--input-size", 32), ("--batch", 64), ("--repeats", 5), ("--threads", 2)):
        p.add_argument(option, type=positive_int, default=default)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("note: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ unset (the Makefile sets them)")
    torch.manual_seed(0)
    cfg = MatrixCapsConfig(A=args.A, B=args.B, C=args.C, D=args.D, iterations=args.iterations,
                           input_size=args.input_size)
    net = MatrixCapsNet(cfg).to(args.device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.rand(args.batch, 1, args.input_size, args.input_size, device=args.device)
    y = torch.randint(0, cfg.num_classes, (args.batch,), device=args.device)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = spread_loss(net(x), y, 0.2)
        loss.backward()
        opt.step()
        sync()
        return loss

    @torch.no_grad()
    def eval_step():
        net(x)
        sync()

    def timed(fn) -> tuple[list[float], list[float]]:
        """Wall-clock and CPU (process) seconds of each repeat.  On a shared machine the wall time includes
        waiting for a core; the CPU time is the work done, summed over threads."""
        fn()  # warm-up (allocator, caches)
        wall, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return wall, cpu

    loss = train_step()
    if not torch.isfinite(loss):
        raise SystemExit(f"bench_matrix_capsules: non-finite loss {loss.item()}")
    (train_times, train_cpu), (eval_times, eval_cpu) = timed(train_step), timed(eval_step)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device.startswith("cuda"):
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    med_train, med_eval = statistics.median(train_times), statistics.median(eval_times)
    result = {
        "network": {"A": args.A, "B": args.B, "C": args.C, "D": args.D, "kernel": cfg.kernel,
                    "iterations": args.iterations, "input_size": args.input_size},
        "parameters": sum(p.numel() for p in net.parameters()),
        "batch": args.batch, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "train_step_ms": 1000 * med_train, "train_images_per_s": args.batch / med_train,
        "train_step_ms_all": [1000 * t for t in train_times],
        # images per second if every thread had its own core the whole time: batch / (CPU seconds / threads)
        "train_images_per_cpu_s": args.batch / statistics.median(train_cpu),
        "train_images_per_s_uncontended_estimate": args.batch * torch.get_num_threads() / statistics.median(train_cpu),
        "inference_images_per_s_uncontended_estimate": args.batch * torch.get_num_threads()
        / statistics.median(eval_cpu),
        "inference_ms": 1000 * med_eval, "inference_images_per_s": args.batch / med_eval,
        "peak_memory_mb": peak_mb, "device": args.device, "device_description": device_description(args.device),
        "load_average": os.getloadavg(), "command": " ".join(["python", *sys.argv]),
        "malloc_env": "MALLOC_MMAP_THRESHOLD_" in os.environ,
    }
    print(f"matrix capsules A,B,C,D = {args.A},{args.B},{args.C},{args.D}, {args.iterations} EM iterations, "
          f"{args.input_size}x{args.input_size}, batch {args.batch}, {result['threads']} threads, {args.device} "
          f"({result['parameters']:,} parameters)")
    print(f"  training step (forward + backward + Adam), median of {args.repeats}: {result['train_step_ms']:.0f} ms "
          f"= {result['train_images_per_s']:.0f} images/s")
    print(f"  inference: {result['inference_ms']:.0f} ms = {result['inference_images_per_s']:.0f} images/s")
    print(f"  CPU time: {result['train_images_per_cpu_s']:.0f} training images per CPU-second, i.e. about "
          f"{result['train_images_per_s_uncontended_estimate']:.0f} images/s with {result['threads']} free cores")
    print(f"  peak memory {peak_mb:.0f} MB ({'CUDA allocated' if args.device.startswith('cuda') else 'max RSS'}); "
          f"load average {result['load_average'][0]:.1f} (the machine is shared)")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
