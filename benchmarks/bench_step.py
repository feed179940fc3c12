"""Time one training step of the Pyro model against the same ELBO written directly in torch.

Both steps use the same parameters and the same latents (same RNG state), and the script checks that the two
losses agree before timing.  The two variants are timed interleaved in one run, so the printed ratio does not
depend on how busy the machine is.  Also reports images/s of the full training step and peak memory.

    python benchmarks/bench_step.py                       # SCAE's MNIST sizes: 40 parts, 32 objects, batch 128
    python benchmarks/bench_step.py --parts 24 --parents 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch

from probcaps.inference.capsule_svi import CapsuleSystem, load_experiment_config
from probcaps.inference.train import make_elbo, make_optimiser
from probcaps.io import write_json
from probcaps.provenance import device_description, has_bf16_kernels
from probcaps.report import write_table


def readme_table(results_dir: Path, name: str = "bench_step") -> str | None:
    """The README table of the rows in ``results_dir/<name>.json`` (one per ``make bench`` variant)."""
    path = Path(results_dir) / f"{name}.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text())
    rows = rows if isinstance(rows, list) else [rows]
    lines = ["| setting | parts × objects | batch | Pyro step (ms) | torch step (ms) | ratio | images/s | "
             "peak memory (MB) | load average |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        enc = r.get("encoder", {})
        setting = (f"{r.get('label') or ''} (conv {enc.get('channels')}, strides {enc.get('strides')}, set "
                   f"transformer {enc.get('set_hidden')} wide × {enc.get('set_heads')} heads"
                   f"{', bf16 convolutions' if enc.get('bf16') else ''}"
                   f"{', compiled compositing and part CNN' if r.get('compiled_compositing') else ''})")
        load = r.get("load_average")
        lines.append(f"| {setting} | {r['parts']} × {r['parents']} | {r['batch']} | {r['pyro_step_ms']:.0f} | "
                     f"{r['torch_step_ms']:.0f} | {r['ratio_pyro_over_torch']:.3f} | {r['pyro_images_per_s']:.0f} | "
                     f"{r['peak_memory_mb']:.0f} | {f'{load[0]:.1f}' if load else '–'} |")
    lines.append("")
    lines.append(f"Device: {rows[0].get('device_description', rows[0].get('device'))}, "
                 f"{rows[0]['threads']} threads, glibc allocator thresholds set: {rows[0].get('malloc_env')}; "
                 f"step times are the median of {rows[0].get('repeats', 10)} timed steps of each variant; "
                 f"command: `make bench`. The ratio is what the benchmark is for (interleaved in one run); images/s "
                 f"depends on the machine.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="experiment TOML for the model/encoder sizes")
    p.add_argument("--parts", type=int, default=40)
    p.add_argument("--parents", type=int, default=32)
    p.add_argument("--template-size", type=int, default=11)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=30, help="timed steps of each variant (the median is reported)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--jit", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the alpha compositing and the part CNN")
    p.add_argument("--full-canvas", action="store_true",
                   help="render every part over the whole canvas (the reference renderer) instead of its footprint")
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--append", action="store_true", help="append a row to --json instead of replacing it")
    p.add_argument("--label", default=None, help="name of this row in the JSON file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("note: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ unset; `make bench` sets them (25-40% faster)")
    pyro.settings.set(module_local_params=True)
    pyro.enable_validation(False)
    cfg = load_experiment_config(args.config, [f"model.num_parts={args.parts}", f"model.num_parents={args.parents}",
                                               f"model.template_size={args.template_size}", *args.set])
    system = CapsuleSystem(cfg["model"], cfg["encoder"], compile=args.compile).to(args.device)
    system.model.footprint = not args.full_canvas
    opt = make_optimiser(system, cfg["train"])  # the training loop's optimiser (param groups, fused Adam)
    elbo = make_elbo(args.jit)
    x = torch.rand(args.batch, 1, cfg["model"].canvas_size, cfg["model"].canvas_size, device=args.device)

    def pyro_elbo(x):  # the ELBO alone: the information term the recipe adds to it in training has no torch twin
        return system.negative_elbo(elbo, x)

    torch.manual_seed(1)
    pyro_loss = pyro_elbo(x).item()
    torch.manual_seed(1)
    torch_loss = system.reference_loss(x).item()
    agree = abs(pyro_loss - torch_loss) <= 1e-4 * abs(torch_loss)
    print(f"loss per image: pyro {pyro_loss:.4f}  torch {torch_loss:.4f}  ({'agree' if agree else 'DISAGREE'})")

    def step(loss_fn):
        opt.zero_grad(set_to_none=True)
        loss_fn(x).backward()
        opt.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    variants = {"pyro": pyro_elbo, "torch": system.reference_loss}
    for fn in variants.values():  # warm-up
        step(fn)
        step(fn)
    times = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            step(fn)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device.startswith("cuda"):
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    result = {
        "batch": args.batch, "parts": args.parts, "parents": args.parents, "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "pyro_step_ms": 1000 * med["pyro"], "torch_step_ms": 1000 * med["torch"],
        "ratio_pyro_over_torch": med["pyro"] / med["torch"], "pyro_images_per_s": args.batch / med["pyro"],
        "peak_memory_mb": peak_mb, "losses_agree": agree, "device": args.device,
        "device_description": device_description(args.device), "label": args.label,
        "encoder": cfg["encoder"].to_dict(), "command": " ".join(["python", *sys.argv]),
        "malloc_env": "MALLOC_MMAP_THRESHOLD_" in os.environ, "compiled_compositing": args.compile,
        "compiled_part_cnn": args.compile, "renderer": "full canvas" if args.full_canvas else "footprint",
        "bf16_supported": has_bf16_kernels(args.device), "load_average": list(os.getloadavg()),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    print(f"batch {args.batch}, {args.parts} parts, {args.parents} objects, {torch.get_num_threads()} threads, "
          f"{args.device}")
    print(f"  full training step (encoder + model + guide + optimiser), median of {args.repeats}:")
    print(f"    pyro TraceEnum_ELBO  {result['pyro_step_ms']:.1f} ms  ({result['pyro_images_per_s']:.0f} images/s)")
    print(f"    plain torch ELBO     {result['torch_step_ms']:.1f} ms")
    print(f"    ratio pyro / torch   {result['ratio_pyro_over_torch']:.3f}")
    measured = "CUDA allocated" if args.device.startswith("cuda") else "max RSS"
    print(f"  peak memory            {peak_mb:.0f} MB ({measured})")
    if args.json:
        path = Path(args.json)
        rows = json.loads(path.read_text()) if args.append and path.is_file() else []
        rows = rows if isinstance(rows, list) else [rows]
        write_json(path, rows + [result])
        write_table(path.parent, path.stem, readme_table(path.parent, path.stem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
