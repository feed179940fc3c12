"""Forward + backward of the capsule model's rendering and compositing: footprint windows against the full canvas.

SCAE's sizes: batch 128, 40 parts, 11x11 templates, a 40x40 canvas.  The part poses are a trained model's: the
part encoder of ``--checkpoint`` (the recommended MNIST recipe) on MNIST test digits, 40 poses per image drawn
from the pool of all its parts' poses (how far a part reaches is what decides the footprint renderer's cost, and a
trained model has a few large parts among many small ones).  ``--poses encoder`` takes them from an untrained
part encoder at SCAE's sizes instead (every part at its initial scale).  The variants are timed interleaved in
one run; the median of ``--repeats`` calls is reported, with the ratios.

    python benchmarks/bench_render.py --threads 2 --json results/speed/bench_render.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from probcaps import render
from probcaps.geometry import pose6_to_matrix
from probcaps.io import write_json
from probcaps.provenance import device_description
from probcaps.render import footprints, render_over, window_sides
from probcaps.report import write_table


def trained_poses(checkpoint: str, batch: int, parts: int, generator: torch.Generator) -> torch.Tensor:
    """``(batch, parts, 6)`` part poses drawn from a trained part encoder's poses on MNIST test digits."""
    from probcaps.inference.capsule_svi import load_images, load_trained

    cfg, system = load_trained(checkpoint, overrides=["encoder.bf16=false"])
    images, _ = load_images(cfg["data"], "test", limit=4 * batch)
    with torch.no_grad():
        _, poses = system.encoder.encode_parts(images.float().div(255).unsqueeze(1))
    pool = poses.reshape(-1, 6)
    return pool[torch.randint(len(pool), (batch * parts,), generator=generator)].view(batch, parts, 6)


def encoder_poses(batch: int, parts: int, canvas: int) -> torch.Tensor:
    """``(batch, parts, 6)`` poses of an untrained part encoder (SCAE's sizes) on uniform noise images."""
    from probcaps.inference.guides import CapsuleEncoder, EncoderConfig

    encoder = CapsuleEncoder(parts, 32, EncoderConfig())
    with torch.no_grad():
        return encoder.encode_parts(torch.rand(batch, 1, canvas, canvas))[1]


def readme_table(results_dir, name: str = "bench_render") -> str | None:
    """The README table of ``results_dir/<name>.json`` (None when there is none)."""
    path = Path(results_dir) / f"{name}.json"
    return table(json.loads(path.read_text())) if path.is_file() else None


def table(r: dict) -> str:
    """The README table of one ``bench_render.py`` result."""
    lines = ["| renderer | forward + backward (ms) | footprint speed-up |", "| --- | --- | --- |"]
    for name, ms in r["ms"].items():
        lines.append(f"| {name} | {ms:.1f} | {r['ms'][name] / r['ms']['footprint']:.2f}× |")
    sides = ", ".join(f"{n} parts in {s}×{s}" for s, n in r["parts_per_window_side"].items())
    lines += ["", f"Batch {r['batch']}, {r['parts']} parts, {r['template_size']}×{r['template_size']} templates, "
              f"{r['canvas']}×{r['canvas']} canvas; part poses: {r['poses']}"
              f"{' (' + r['checkpoint'] + ')' if r.get('checkpoint') else ''}; windows: {sides} "
              f"({100 * r['window_pixel_share']:.0f}% of the full layers' pixels); median of {r['repeats']}, "
              f"interleaved; {r['device_description']}, load average {r['load_average'][0]:.1f}; "
              f"command: `{r['command']}`."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--parts", type=int, default=40)
    p.add_argument("--template-size", type=int, default=11)
    p.add_argument("--canvas", type=int, default=40)
    p.add_argument("--poses", choices=["trained", "encoder"], default="trained")
    p.add_argument("--checkpoint", default="checkpoints/mnist.pt", help="the trained model whose poses are used")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    B, M, t, S = args.batch, args.parts, args.template_size, args.canvas
    if args.poses == "trained":
        y0 = trained_poses(args.checkpoint, B, M, gen)
    else:
        y0 = encoder_poses(B, M, S)
    poses = pose6_to_matrix(y0).requires_grad_()
    template_logits = torch.randn(M, 2, t, t, generator=gen).requires_grad_()
    presence = torch.rand(B, M, generator=gen).requires_grad_()
    box = footprints(poses.detach().view(-1, 3, 3), (t, t), (S, S))
    extents = torch.maximum(box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]) + 1
    sides = window_sides(extents, (S, S))
    tier = torch.searchsorted(torch.tensor(sides), extents)
    parts_per_side = {side: int((tier == i).sum()) for i, side in enumerate(sides)}
    window_share = render._window_cost(extents, sides, (S, S)) / (extents.numel() * S * S)
    print(f"batch {B}, {M} parts, {t}x{t} templates, {S}x{S} canvas, {args.poses} poses: window sides "
          f"{parts_per_side} (side: parts), {100 * window_share:.0f}% of the full layers' pixels, median footprint "
          f"side {extents.float().median():.0f}")

    def step(footprint: bool, compiled: bool):
        # the model's render: presences scale the alpha templates, then warp and composite (capsule_model.render)
        templates = torch.sigmoid(template_logits)
        scale = torch.stack([torch.ones_like(presence), presence], -1)[..., None, None]
        image, _ = render_over(templates * scale, poses, S, footprint=footprint, compiled=compiled)
        image.square().mean().backward()
        return image

    variants = {"footprint": (True, False), "full canvas": (False, False), "full canvas, compiled": (False, True)}
    images = {name: step(*flags).detach() for name, flags in variants.items()}  # also the warm-up and compile
    for name in variants:
        step(*variants[name])
    agree = all(torch.allclose(images[name], images["full canvas"], atol=1e-5) for name in variants)
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, flags in variants.items():
            t0 = time.perf_counter()
            step(*flags)
            times[name].append(time.perf_counter() - t0)
    med = {name: 1000 * statistics.median(v) for name, v in times.items()}
    result = {
        "batch": B, "parts": M, "template_size": t, "canvas": S, "poses": args.poses,
        "checkpoint": args.checkpoint if args.poses == "trained" else None, "parts_per_window_side": parts_per_side,
        "window_pixel_share": window_share, "repeats": args.repeats, "threads": torch.get_num_threads(),
        "ms": med, "speedup_over_full_canvas": med["full canvas"] / med["footprint"],
        "speedup_over_full_canvas_compiled": med["full canvas, compiled"] / med["footprint"],
        "images_agree": agree, "device_description": device_description("cpu"),
        "load_average": list(os.getloadavg()), "command": " ".join(["python", *sys.argv]),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    print(f"  rendering + compositing, forward + backward, median of {args.repeats}:")
    for name, ms in med.items():
        print(f"    {name:24s} {ms:7.1f} ms")
    print(f"  footprint speed-up: {result['speedup_over_full_canvas']:.2f}x over the full canvas, "
          f"{result['speedup_over_full_canvas_compiled']:.2f}x over its compiled compositing "
          f"(images {'agree' if agree else 'DISAGREE'}); load average {result['load_average'][0]:.2f}")
    if args.json:
        write_json(args.json, result)
        out = Path(args.json)
        write_table(out.parent, out.stem, readme_table(out.parent, out.stem))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
