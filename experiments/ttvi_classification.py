"""Classification after test-time VI (paper §2.4: "a modest improvement"): the linear probe, fit on the encoder's
features of MNIST training images, scored on test latents from the encoder and after test-time VI, read as the
free-form objects and as the objects re-encoded from the optimised parts (re-encoding keeps the objects in the
distribution the probe was fit on).  Writes ``results/ttvi_classification/<name>.json`` and ``<name>_elbo.png``
(the ELBO trace).

    probcaps run ttvi_classification                        # the committed run (1000 test digits)
    probcaps run ttvi_classification --rotate 45            # on rotated test digits
    probcaps run ttvi_classification --checkpoint mnist \
        --name ttvi_classification_fair --threads 1                 # the fair protocol's committed run
    probcaps run ttvi_classification --seeds 0 1 2          # mean ± std over test-time VI seeds

**The fair protocol** (``--n-train-ttvi N``, default 500; 0: off): the same test-time VI also runs on the first
``N`` training images and the probes are refit on them (VI → VI), so that probe and test features share one
distribution.  A third reading is test-time VI of the parts alone, the objects inferred from them by the encoder at
every step (:class:`PartsGuide`).  Every reading is also scored on its posterior presences
(:func:`probcaps.inference.evaluate.posterior_part_counts`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn

from probcaps import plotting
from probcaps.data import rotate, to_float
from probcaps.experiments.common import checkpoint_parser
from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained
from probcaps.inference.evaluate import posterior_part_counts, readout_features
from probcaps.inference.guides import Latents
from probcaps.inference.ttvi import (
    FreeFormGuide,
    fit_guide,
    frozen_and_seeded,
    reencode_parents,
    run_chunks,
    ttvi_batches,
)
from probcaps.metrics import LinearProbe
from probcaps.report import fmt_mean_std, provenance_line, results_table, write_report, write_tables_and_tries
from probcaps.runner import (
    add_run_args,
    add_ttvi_args,
    finite_float,
    launch,
    non_negative_int,
    one_line_errors,
    positive_int,
    seed_summary,
    setup_run,
)

LATENTS = {"encoder": "encoder", "ttvi_objects": "test-time VI, free-form objects",
           "ttvi_reencoded": "test-time VI parts, objects re-encoded"}

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/
#: the readings of the fair protocol: LATENTS and the test-time VI of the parts alone
READINGS = {**LATENTS, "ttvi_parts": "test-time VI of the parts, objects from the encoder at every step"}
#: the feature sets of the fair protocol (keys of ``probcaps.inference.evaluate.READOUTS``)
FAIR_FEATURES = {"presence_pose": "presences + poses", "presence": "presences",
                 "posterior_counts": "posterior presences", "presence_counts": "presences ⊕ posterior presences"}


@results_table("ttvi_classification")
def readme_table(m: dict, prov: dict) -> str:
    """The README table of ``results_dir/<name>.json`` (``--name``, e.g. for another checkpoint)."""
    lines = ["| latents of the test digits | probe, presences + poses (%) | probe, presences (%) |",
             "| --- | --- | --- |"]
    lines += [f"| {label} | {100 * m[f'{key}_presence_pose_acc']:.1f} | {100 * m[f'{key}_presence_acc']:.1f} |"
              for key, label in LATENTS.items()]
    lines += ["", f"{m['n_test']} MNIST test digits (rotated {m['rotation_deg']:g}°), {m['steps']} steps of test-time "
              f"VI (ELBO per image {m['elbo_encoder']:.0f} → {m['elbo_ttvi']:.0f}); probes fit on the encoder's "
              f"features of {m['n_train']} training digits; checkpoint `{prov.get('checkpoint')}`; "
              f"{provenance_line(prov)}"]
    return "\n".join(lines)


@results_table("ttvi_classification_fair")
def fair_table(m: dict, prov: dict) -> str | None:
    """The table of the fair protocol from ``results_dir/<name>.json`` (a run with ``--n-train-ttvi`` > 0; None
    otherwise): probe test accuracy per reading (rows) and feature set (columns), fit on the encoder's features
    (encoder → ·) or on the same reading of the training images (VI → VI)."""
    if not m.get("n_train_ttvi"):
        return None
    cols = " | ".join(f"probe, {label} (%)" for label in FAIR_FEATURES.values())
    lines = [f"| latents of the test digits | probe fit on | {cols} |", "| --- | --- |" + " --- |" * len(FAIR_FEATURES)]

    def acc(key: str) -> str:  # over --seeds: mean ± std
        return fmt_mean_std([r[key] for r in m["per_seed"]]) if "per_seed" in m else f"{100 * m[key]:.1f}"

    def row(label: str, fit: str, prefix: str) -> str:
        return f"| {label} | {fit} | " + " | ".join(acc(f"{prefix}_{k}_acc") for k in FAIR_FEATURES) + " |"

    n, n_all = m["n_train_ttvi"], m["n_train"]
    readings = {k: v for k, v in READINGS.items() if k != "encoder" and f"fair_{k}_presence_acc" in m}
    lines += [row("encoder", f"encoder, {n_all} training digits", "encoder"),
              row("encoder", f"encoder, first {n} training digits", "fair_encoder")]
    lines += [row(label, f"encoder, {n_all} training digits", key) for key, label in readings.items()]
    lines += [row(f"**fair**: {label}", f"the same, first {n} training digits", f"fair_{key}")
              for key, label in readings.items()]
    parts = (f", one-sample estimate {m['elbo_trace_parts_start']:.0f} → {m['elbo_trace_parts_end']:.0f} for the "
             f"parts alone" if "elbo_trace_parts_start" in m else "")
    seeds = f"test-time VI seeds {', '.join(str(r['seed']) for r in m['per_seed'])} (mean ± std); " if (
        "per_seed" in m) else ""
    lines += ["", f"{seeds}{m['n_test']} MNIST test digits and the first {n} training digits (rotated "
              f"{m['rotation_deg']:g}°), {m['steps']} steps of test-time VI (lr {m['lr']:g}; ELBO per test image "
              f"{m['elbo_encoder']:.0f} → {m['elbo_ttvi']:.0f} free-form{parts}); posterior presences: the expected "
              f"number of parts each object explains under the exact posterior over the parts' parents; checkpoint "
              f"`{prov.get('checkpoint')}`; {provenance_line(prov)}"]
    return "\n".join(lines)


def table_text(results_dir: Path, name: str) -> str | None:
    """The table of ``results_dir/<name>.json``: :func:`fair_table` for a run of the fair protocol, else
    :func:`readme_table`."""
    return fair_table(results_dir, name) or readme_table(results_dir, name)


#: the other checkpoints, protocols and settings tried: one record each, ``results_dir/ablations/<try>.json``
#: (:func:`probcaps.report.load_try`), laid out as ``results_dir/ablations.md``
ABLATIONS = "ablations"
#: ``(metrics key, column head, scale, digits)`` of the table of tries: probe accuracies on presences + poses
ABLATION_COLUMNS = [("encoder_presence_pose_acc", "encoder (%)", 100.0, 1),
                    ("ttvi_objects_presence_pose_acc", "test-time VI, free-form (%)", 100.0, 1),
                    ("ttvi_reencoded_presence_pose_acc", "test-time VI, re-encoded (%)", 100.0, 1),
                    ("fair_ttvi_objects_presence_pose_acc", "fair: free-form (%)", 100.0, 1),
                    ("fair_ttvi_reencoded_presence_pose_acc", "fair: re-encoded (%)", 100.0, 1),
                    ("fair_ttvi_parts_presence_pose_acc", "fair: parts (%)", 100.0, 1),
                    ("encoder_presence_acc", "encoder, presences alone (%)", 100.0, 1),
                    ("ttvi_objects_presence_acc", "test-time VI, free-form, presences alone (%)", 100.0, 1)]


def write_tables(results_dir: Path, name: str) -> list[Path | None]:
    """``results_dir/<name>.md`` and the table of tries, ``results_dir/ablations.md``
    (:func:`~probcaps.report.write_tables_and_tries`)."""
    return write_tables_and_tries(results_dir, name,
                                  table_text, ABLATION_COLUMNS, "the fair protocol's run (`ttvi_classification_fair`)",
                                  ABLATIONS)


class PartsGuide(FreeFormGuide):
    """Test-time VI of the parts alone: free-form part presence logits ``(B, M)`` and pose locations ``(B, M, 6)``
    for each of ``B`` images; the objects are inferred from the sampled parts by the amortised encoder's set
    transformer, exactly as :class:`probcaps.inference.guides.DeltaGuide` infers them, so they keep the meaning the
    model was trained with.  Poses are point masses (the delta guide's)."""

    def __init__(self, encoder, init: Latents, temperature: float):
        nn.Module.__init__(self)
        self.encoder, self.temperature, self.pose_family = encoder, float(temperature), "delta"
        self.part_logits = nn.Parameter(init.part_logits.detach().clone())
        self.part_locs = nn.Parameter(init.part_poses.detach().clone())

    def parents(self, z0: torch.Tensor, y0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder.encode_parents(y0, z0)

    @torch.no_grad()
    def latents(self) -> Latents:
        """The optimised parts with their objects encoded at the parts' mean presences (as ``encoder.encode``)."""
        parent_logits, parent_poses = self.encoder.encode_parents(self.part_locs, torch.sigmoid(self.part_logits))
        return Latents(self.part_logits.detach().clone(), self.part_locs.detach().clone(), parent_logits, parent_poses)


def ttvi_parts_batches(model, encoder, images: torch.Tensor, batch_size: int = 250, steps: int = 200,
                       lr: float = 0.03, device: str = "cpu", progress: bool = True, seed: int = 0):
    """Test-time VI of the parts alone (:class:`PartsGuide`), ``batch_size`` images at a time
    (:func:`~probcaps.inference.ttvi.run_chunks`), each chunk ``i`` under the torch seed ``seed + i``; the model and
    the encoder are frozen.  Returns ``(latents (on the CPU), elbo_trace, wall_time_s)``."""
    t0 = time.perf_counter()

    def chunk(i, x, bar):
        with frozen_and_seeded((model, encoder), seed + i, x.device):
            guide = PartsGuide(encoder, encoder.encode(x), temperature=model.config.temperature)
            trace = fit_guide(model, guide, [guide.part_logits, guide.part_locs], x, steps, lr, bar,
                              what="test-time VI of the parts")
            return [t.cpu() for t in guide.latents()], trace

    chunks, trace = run_chunks(chunk, images, batch_size, steps, device, progress, desc="ttvi parts")
    return Latents(*(torch.cat(parts) for parts in zip(*chunks))), trace, time.perf_counter() - t0


def reading_features(model, latents: Latents, batch_size: int = 500) -> dict[str, torch.Tensor]:
    """The probe features of :data:`FAIR_FEATURES` for ``latents`` (posterior presences computed from them)."""
    feats = readout_features(latents, posterior_part_counts(model, latents, batch_size))
    return {key: feats[key][0] for key in FAIR_FEATURES}


@one_line_errors("ttvi_classification")
def main(argv=None) -> int:
    p = checkpoint_parser(__doc__)
    p.add_argument("--n-test", type=positive_int, default=1000, help="the first N test digits")
    p.add_argument("--probe-train-limit", type=non_negative_int, default=None,
                   help="fit the probe on the first N training images (default: the checkpoint's eval config)")
    p.add_argument("--rotate", type=finite_float, default=0.0, help="rotate the test digits by this many degrees")
    add_ttvi_args(p, pose_family=False)
    p.add_argument("--seeds", type=non_negative_int, nargs="+", default=[0],
                   help="test-time VI seeds; several: the fair protocol's table gives mean ± std over them")
    p.add_argument("--n-train-ttvi", type=non_negative_int, default=500, help="the fair protocol: test-time VI "
                   "on the first N training images too, probes refit on them (0: off)")
    p.add_argument("--parts-ttvi", action=argparse.BooleanOptionalAction, default=True, help="with the fair "
                   "protocol, also the test-time VI of the parts alone (about as long again as the free-form one)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a key of the checkpoint's config, e.g. encoder.bf16=false on a CPU without bfloat16")
    add_run_args(p, EXPERIMENT, name="ttvi_classification", out=False)
    args = p.parse_args(argv)
    if setup_run(args, tables := lambda results: write_tables(Path(results), args.name)):
        return 0
    progress = not args.quiet
    cfg, system = load_trained(args.checkpoint, device=args.device, overrides=args.set)
    ecfg = cfg["eval"]
    limit = args.probe_train_limit if args.probe_train_limit is not None else ecfg.probe_train_limit
    train_images, train_labels = load_images(cfg["data"], "train", args.data_dir, limit=limit or None)
    test_images, test_labels = load_images(cfg["data"], "test", args.data_dir, limit=args.n_test)
    n_fair = min(args.n_train_ttvi, len(train_images))

    def readings(images: torch.Tensor, seed: int, parts: bool):
        """``(latents per reading, the free-form run's TTVIResult, (elbo_trace, wall_time_s) of the parts-only run
        or None)`` of ``images`` rotated by ``--rotate``; test-time VI chunk ``i`` under the seed ``seed + i``."""
        x = rotate(to_float(images), args.rotate).clamp(0, 1) if args.rotate else to_float(images)
        run = ttvi_batches(system.model, system.guide, x, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                           device=args.device, progress=progress, seed=seed)
        latents = {"encoder": encode_dataset(system.encoder, x, ecfg.batch_size, args.device),
                   "ttvi_objects": run.latents,
                   "ttvi_reencoded": reencode_parents(system.encoder, run.latents, ecfg.batch_size, args.device)}
        if not parts:
            return latents, run, None
        latents["ttvi_parts"], *parts_run = ttvi_parts_batches(system.model, system.encoder, x, args.batch_size,
                                                               args.steps, args.lr, args.device, progress, seed)
        return latents, run, parts_run

    def run_seed(seed: int):
        """``(metrics, the free-form run's TTVIResult)`` of the test-time VI readings under ``seed``."""
        latents, result, parts = readings(test_images, seed, args.parts_ttvi and n_fair > 0)
        metrics = {"n_train": len(train_images), "n_test": len(test_images), "rotation_deg": args.rotate,
                   "steps": args.steps, "lr": args.lr, "elbo_encoder": float(result.elbo_start.mean()),
                   "elbo_ttvi": float(result.elbo_end.mean()), "ttvi_wall_time_s": result.wall_time_s,
                   "n_train_ttvi": n_fair}
        fair_train = {}
        if n_fair:
            # the fair protocol: the probe's training images go through the same inference as the test images, under
            # chunk seeds of their own
            fair_train, train_result, train_parts = readings(train_images[:n_fair], seed + 10_000, args.parts_ttvi)
            metrics.update(elbo_ttvi_train=float(train_result.elbo_end.mean()),
                           elbo_encoder_train=float(train_result.elbo_start.mean()),
                           elbo_trace_objects_start=result.elbo_trace[0], elbo_trace_objects_end=result.elbo_trace[-1],
                           ttvi_train_wall_time_s=train_result.wall_time_s)
            if parts:
                metrics.update(elbo_trace_parts_start=parts[0][0], elbo_trace_parts_end=parts[0][-1],
                               ttvi_parts_wall_time_s=parts[1] + train_parts[1])
        test_feats = {name: reading_features(system.model, lat, ecfg.batch_size) for name, lat in latents.items()}
        fair_feats = {name: reading_features(system.model, lat, ecfg.batch_size) for name, lat in fair_train.items()}
        fair_labels = train_labels[:n_fair]
        for key in FAIR_FEATURES:
            for name, feats in test_feats.items():  # encoder -> each reading
                metrics[f"{name}_{key}_acc"] = encoder_probes[key].accuracy(feats[key], test_labels)
            for name, feats in fair_feats.items():  # the same reading -> the same reading
                fair_probe = LinearProbe(C=ecfg.probe_C, max_iter=ecfg.probe_max_iter).fit(feats[key], fair_labels)
                metrics[f"fair_{name}_{key}_acc"] = fair_probe.accuracy(test_feats[name][key], test_labels)
        return metrics, result

    train_lat = encode_dataset(system.encoder, train_images, ecfg.batch_size, args.device, progress)
    train_feats = reading_features(system.model, train_lat, ecfg.batch_size)
    # the probes on the encoder's features of the training images: the same for every seed
    encoder_probes = {key: LinearProbe(C=ecfg.probe_C, max_iter=ecfg.probe_max_iter).fit(train_feats[key], train_labels)
                      for key in FAIR_FEATURES}
    runs = [run_seed(seed) for seed in args.seeds]
    metrics, result = runs[0]
    if len(runs) > 1:
        per_seed = [{**m, "seed": seed} for (m, _), seed in zip(runs, args.seeds)]
        accuracies = [k for k in metrics if k.endswith("_acc")]
        metrics = {**metrics, "per_seed": per_seed, **seed_summary(per_seed, accuracies)}
    results = Path(args.results_dir)
    plotting.plot_curves({"test-time VI": (list(range(len(result.elbo_trace))), result.elbo_trace)},
                         results / f"{args.name}_elbo.png", xlabel="step", ylabel="ELBO per image (nats)",
                         title=f"test-time VI on {len(test_images)} MNIST test digits")
    write_report(results, args.name, metrics, tables, seed=args.seeds, steps=args.steps, device=args.device,
                 wall_time_s=sum(m["ttvi_wall_time_s"] for m, _ in runs), checkpoint=str(args.checkpoint))
    print(table_text(results, args.name))
    return 0


if __name__ == "__main__":
    launch(main)
