"""Forward + backward of the capsule model's rendering and compositing: footprint windows against the full canvas.

SCAE's sizes: batch 128, 40 parts, 11x11 templates, a 40x40 canvas.  The part poses are a trained model's: the
part encoder of ``--checkpoint`` (the recommended MNIST recipe) on MNIST test digits, 40 poses per image drawn
from the pool of all its parts' poses (how far a part reaches is what decides the footprint renderer's cost, and a
trained model has a few large parts among many small ones).  ``--poses encoder`` takes them from an untrained
part encoder at SCAE's sizes instead (every part at its initial scale).  The variants are timed interleaved in
one run; the median of ``--repeats`` calls is reported, with the ratios.

Two more variants put another bilinear sampler in the footprint renderer's place of ``F.grid_sample``: a gather of
each output pixel's four source neighbours with a hand-written backward (:func:`gather_grid_sample`), and the same
gather in plain tensor operations through ``torch.compile`` (dynamic shapes: the windows' sizes change from call to
call).  Both are checked exact against ``F.grid_sample`` in float64, values and gradients, before timing.

    python benchmarks/bench_render.py --threads 2 --json results/speed/bench_render.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

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


def _corners(input: torch.Tensor, grid: torch.Tensor):
    """The four source neighbours of each grid point: ``(index (n, 1, P, 1) into the padded source's quadruples,
    fractions (n, 2, P), inside (n, 2, P))`` for ``input`` ``(n, C, h, w)`` and ``grid`` ``(n, H, W, 2)``.

    Source pixel coordinates (``align_corners=False``: ``((g + 1) size − 1) / 2``) are clamped to ``[−1, size]``;
    the source is padded with one zero row and column before and two after, so every neighbour, clamped or not,
    is a real entry and a clamped coordinate reads only zeros (as ``grid_sample``'s zero padding)."""
    n, _, h, w = input.shape
    size = grid.new_tensor([w, h])
    coords = ((grid + 1) * size - 1) / 2                                          # (n, H, W, 2)
    inside = (coords > -1) & (coords < size)
    coords = torch.maximum(torch.minimum(coords, size), coords.new_tensor(-1.0))
    corner = coords.floor()
    fractions = (coords - corner).view(n, -1, 2).transpose(1, 2)                  # (n, 2, P)
    corner = corner.long() + 1
    index = (corner[..., 1] * (w + 3) + corner[..., 0]).view(n, 1, -1, 1)
    return index, fractions, inside.view(n, -1, 2).transpose(1, 2)


def _quadruples(padded: torch.Tensor, row: int) -> torch.Tensor:
    """``(n, C, P', 4)``: each padded source pixel with its right, lower and lower-right neighbours."""
    flat = padded.flatten(2)
    return torch.stack([flat, flat.roll(-1, -1), flat.roll(-row, -1), flat.roll(-row - 1, -1)], -1)


def _bilinear_weights(fractions: torch.Tensor) -> torch.Tensor:
    """``(n, 1, P, 4)`` weights of the four neighbours from the fractions ``(n, 2, P)``."""
    fx, fy = fractions.unbind(1)
    return torch.stack([(1 - fx) * (1 - fy), fx * (1 - fy), (1 - fx) * fy, fx * fy], -1).unsqueeze(1)


class _GatherSample(torch.autograd.Function):
    """Bilinear sampling as a gather of four neighbours, with its backward written out: the source's gradient
    scattered back through the same indices, the grid's from the differences of the neighbours."""

    @staticmethod
    def forward(ctx, input, grid):
        n, C, h, w = input.shape
        index, fractions, inside = _corners(input, grid)
        weights = _bilinear_weights(fractions)
        index = index.expand(n, C, index.shape[2], 4)
        values = _quadruples(F.pad(input, (1, 2, 1, 2)), w + 3).gather(2, index)  # (n, C, P, 4)
        ctx.save_for_backward(values, weights, index, fractions, inside)
        ctx.sizes, ctx.grid_shape = (h, w), grid.shape[1:]
        return (values * weights).sum(-1).view(n, C, *grid.shape[1:3])

    @staticmethod
    def backward(ctx, grad):
        values, weights, index, fractions, inside = ctx.saved_tensors
        (h, w), (n, C, P, _) = ctx.sizes, values.shape
        grad = grad.reshape(n, C, P, 1)
        grad_input = grad_grid = None
        if ctx.needs_input_grad[0]:
            quads = grad.new_zeros(n, C, (h + 3) * (w + 3), 4).scatter_add_(2, index, grad * weights)
            row = w + 3
            flat = quads[..., 0] + quads[..., 1].roll(1, -1) + quads[..., 2].roll(row, -1) + quads[..., 3].roll(
                row + 1, -1)
            grad_input = flat.view(n, C, h + 3, w + 3)[:, :, 1:h + 1, 1:w + 1]
        if ctx.needs_input_grad[1]:
            g = (grad * values).sum(1)                                            # (n, P, 4)
            fx, fy = fractions.unbind(1)
            d_fx = (g[..., 1] - g[..., 0]) * (1 - fy) + (g[..., 3] - g[..., 2]) * fy
            d_fy = (g[..., 2] - g[..., 0]) * (1 - fx) + (g[..., 3] - g[..., 1]) * fx
            scale = values.new_tensor([w / 2, h / 2]).view(1, 2, 1)
            grad_grid = (torch.stack([d_fx, d_fy], 1) * inside * scale).transpose(1, 2).reshape(n, -1, 2)
        return grad_input, grad_grid.view(n, *ctx.grid_shape) if grad_grid is not None else None


def gather_grid_sample(input: torch.Tensor, grid: torch.Tensor, align_corners: bool = False) -> torch.Tensor:
    """``F.grid_sample(input, grid, "bilinear", "zeros", align_corners=False)`` as a four-neighbour gather with a
    hand-written backward: ``(n, C, h, w)``, ``(n, H, W, 2)`` -> ``(n, C, H, W)``."""
    assert not align_corners
    return _GatherSample.apply(input, grid)


def _gather_sample_plain(input: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """:func:`gather_grid_sample`'s forward in plain tensor operations (its backward left to autograd)."""
    n, C, _, w = input.shape
    index, fractions, _ = _corners(input, grid)
    values = _quadruples(F.pad(input, (1, 2, 1, 2)), w + 3).gather(2, index.expand(n, C, index.shape[2], 4))
    return (values * _bilinear_weights(fractions)).sum(-1).view(n, C, *grid.shape[1:3])


def compiled_gather_grid_sample(input: torch.Tensor, grid: torch.Tensor, align_corners: bool = False):
    """:func:`_gather_sample_plain` through ``torch.compile`` with dynamic shapes."""
    assert not align_corners
    return _compiled_plain()(input, grid)


@functools.cache
def _compiled_plain():
    return torch.compile(_gather_sample_plain, dynamic=True)


def sampler_error(sampler, generator: torch.Generator) -> float:
    """The largest difference between ``sampler`` and ``F.grid_sample`` in float64 on random sources and grids
    reaching past the source's edges: values, the source's and the grid's gradients."""
    source = torch.rand(5, 2, 11, 11, dtype=torch.float64, generator=generator, requires_grad=True)
    grid = (torch.rand(5, 13, 9, 2, dtype=torch.float64, generator=generator) * 2.6 - 1.3).requires_grad_()
    outputs = [fn(source, grid, align_corners=False) for fn in (sampler, F.grid_sample)]
    weight = torch.randn(outputs[0].shape, dtype=torch.float64, generator=generator)
    grads = [torch.autograd.grad((out * weight).sum(), (source, grid)) for out in outputs]
    return max(float((a - b).detach().abs().max()) for a, b in [outputs, *zip(*grads)])


@contextlib.contextmanager
def sampling_with(sampler):
    """The footprint renderer with ``sampler`` in place of ``F.grid_sample`` (the full renderer's warp keeps it)."""
    if sampler is None:
        yield
        return
    original = render.F
    render.F = types.SimpleNamespace(grid_sample=sampler)
    try:
        yield
    finally:
        render.F = original


def readme_table(results_dir, name: str = "bench_render") -> str | None:
    """The README table of ``results_dir/<name>.json`` (None when there is none)."""
    path = Path(results_dir) / f"{name}.json"
    return table(json.loads(path.read_text())) if path.is_file() else None


def _sampler_clause(r: dict) -> str:
    errors = r.get("sampler_errors_float64")
    if not errors:
        return ""
    return (f"the gather samplers differ from `F.grid_sample` by at most {max(errors.values()):.0e} in float64 "
            "(values and gradients); ")


def table(r: dict) -> str:
    """The README table of one ``bench_render.py`` result."""
    lines = ["| renderer | forward + backward (ms) | footprint speed-up |", "| --- | --- | --- |"]
    for name, ms in r["ms"].items():
        lines.append(f"| {name} | {ms:.1f} | {r['ms'][name] / r['ms']['footprint']:.2f}× |")
    sides = ", ".join(f"{n} parts in {s}×{s}" for s, n in r["parts_per_window_side"].items())
    lines += ["", f"Batch {r['batch']}, {r['parts']} parts, {r['template_size']}×{r['template_size']} templates, "
              f"{r['canvas']}×{r['canvas']} canvas; part poses: {r['poses']}"
              f"{' (' + r['checkpoint'] + ')' if r.get('checkpoint') else ''}; windows: {sides} "
              f"({100 * r['window_pixel_share']:.0f}% of the full layers' pixels); {_sampler_clause(r)}median of "
              f"{r['repeats']}, "
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

    def step(footprint: bool, compiled: bool, sampler=None):
        # the model's render: presences scale the alpha templates, then warp and composite (capsule_model.render)
        templates = torch.sigmoid(template_logits)
        scale = torch.stack([torch.ones_like(presence), presence], -1)[..., None, None]
        with sampling_with(sampler):
            image, _ = render_over(templates * scale, poses, S, footprint=footprint, compiled=compiled)
        image.square().mean().backward()
        return image

    samplers = {"footprint, four-neighbour gather": gather_grid_sample,
                "footprint, four-neighbour gather, compiled": compiled_gather_grid_sample}
    sampler_errors = {name: sampler_error(fn, torch.Generator().manual_seed(1)) for name, fn in samplers.items()}
    for name, error in sampler_errors.items():
        print(f"  {name}: largest difference from F.grid_sample in float64 (values, gradients) {error:.1e}")
    variants = {"footprint": (True, False), "full canvas": (False, False), "full canvas, compiled": (False, True),
                **{name: (True, False, fn) for name, fn in samplers.items()}}
    images = {name: step(*flags).detach() for name, flags in variants.items()}  # also the warm-up and compile
    for name in variants:
        step(*variants[name])
    agree = all(torch.allclose(images[name], images["full canvas"], atol=1e-5) for name in variants) and all(
        error < 1e-10 for error in sampler_errors.values())
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
        "images_agree": agree, "sampler_errors_float64": sampler_errors,
        "device_description": device_description("cpu"),
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
