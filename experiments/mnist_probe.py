"""Train the generative capsule model on MNIST (40x40, SCAE placement) over several seeds and report the linear
probes and k-means accuracy (paper §5, Table 1; SCAE's anchors).

    python experiments/mnist_probe.py --seeds 0 1 2                    # the recommended recipe (configs/mnist.toml)
    python experiments/mnist_probe.py --seeds 0 --resume               # continue interrupted runs
    python experiments/mnist_probe.py --seeds 0 --set train.steps=5 --set data.dataset="synthetic"   # smoke test

With the config's ``name`` (``mnist`` for configs/mnist.toml; ``--name`` to run it under another), writes
``results/<name>_seed<S>.json`` per seed, ``results/<name>.json`` (per-seed metrics, mean and std), the figures of
the first seed, and ``checkpoints/<name>.pt`` (the first seed's final model, without optimiser state) so the
result can be evaluated without training: ``probcaps evaluate --checkpoint checkpoints/mnist.pt``.  Runs go to
``runs/<name>/seed<S>``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402
import torch  # noqa: E402

from probcaps.inference.capsule_svi import load_experiment_config, train_capsules  # noqa: E402
from probcaps.inference.evaluate import evaluate_checkpoint  # noqa: E402
from probcaps.inference.train import load_checkpoint, run_finished  # noqa: E402
from probcaps import plotting  # noqa: E402
from probcaps.cli import (  # noqa: E402
    add_common_args, non_negative_int, launch, one_line_errors,
)
from probcaps.io import atomic_torch_save  # noqa: E402
from probcaps.provenance import device_description, provenance, write_results  # noqa: E402

DEFAULT_CONFIG = ROOT / "experiments" / "configs" / "mnist.toml"


def checkpoint_out_path(arg: str | None, name: str) -> Path | None:
    """Where ``--checkpoint-out`` exports the first seed's model: ``checkpoints/<name>.pt`` unless given, so a run
    under another ``--name`` never overwrites the committed checkpoint of the default name; ``""``: no export."""
    if arg is None:
        return ROOT / "checkpoints" / f"{name}.pt"
    return Path(arg) if arg else None


def export_checkpoint(src: Path, dst: Path) -> Path:
    """The model and its config without optimiser state: what a user needs to evaluate (a few MB)."""
    ckpt = load_checkpoint(src)
    slim = {k: ckpt[k] for k in ("module", "state", "train_config", "metadata")}
    return atomic_torch_save(slim, dst)


def plot_training_curves(logs: dict[str, Path], path: Path) -> None:
    """Negative ELBO per image against step, one line per run (from the runs' ``log.jsonl``)."""
    curves = {}
    for label, log in logs.items():
        if log.is_file():
            # last record per step wins: a run resumed by an older version appended after its stale records
            by_step = {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, log.read_text().splitlines()))}
            steps = sorted(by_step)
            curves[label] = (steps, [by_step[s] for s in steps])
    if curves:
        plotting.plot_curves(curves, path, xlabel="step", ylabel="negative ELBO per image (nats)",
                             title="training (SVI, TraceEnum_ELBO)")


@one_line_errors("mnist_probe")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--seeds", type=non_negative_int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=None, help="run folders, <out>/seed<S> (default: runs/<name>)")
    p.add_argument("--checkpoint-out", default=None,
                   help="export the first seed's model here (default: checkpoints/<name>.pt; '' for none)")
    p.add_argument("--name", default=None, help="names the results, runs and checkpoint (default: the config's name)")
    p.add_argument("--resume", action="store_true", help="continue each seed from its last checkpoint")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--jit", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the alpha compositing and the part CNN (faster steps)")
    p.add_argument("--reuse-results", action="store_true",
                   help="take a seed's metrics from its results JSON when that is newer than its final checkpoint")
    p.add_argument("--train-only", action="store_true",
                   help="train and stop (to run seeds as parallel processes; a later --resume call evaluates)")
    add_common_args(p, results_dir=ROOT / "results")
    args = p.parse_args(argv)
    args.name = args.name or load_experiment_config(args.config)["name"]
    args.out = args.out or str(ROOT / "runs" / args.name)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    for seed in args.seeds:
        overrides = [*args.set, f"train.seed={seed}"] + (["train.jit=true"] if args.jit else []) \
            + (["train.compile=true"] if args.compile else [])
        cfg = load_experiment_config(args.config, overrides)
        out = Path(args.out) / f"seed{seed}"
        final = out / "final.pt"
        if not (args.resume and run_finished(out, cfg["train"].steps)):
            resume = args.resume and (out / "checkpoint.pt").is_file()
            train_capsules(cfg, out, resume=resume, device=args.device, data_dir=args.data_dir,
                           progress=not args.quiet)
        if args.train_only:
            continue
        state = load_checkpoint(final)["state"]
        seed_json = Path(args.results_dir) / f"{args.name}_seed{seed}.json"
        if args.reuse_results and seed_json.is_file() and seed_json.stat().st_mtime > final.stat().st_mtime:
            metrics = json.loads(seed_json.read_text())["metrics"]
        else:
            metrics = evaluate_checkpoint(final, name=f"{args.name}_seed{seed}", results_dir=args.results_dir,
                                          data_dir=args.data_dir, device=args.device, progress=not args.quiet,
                                          figures=seed == args.seeds[0])
        runs.append({**metrics, "seed": seed, "steps": state["step"], "train_wall_time_s": state["wall_time_s"]})
        print(f"seed {seed}: probe presence+pose {metrics['probe_presence_pose_test_acc']:.4f}, presence "
              f"{metrics['probe_presence_test_acc']:.4f}, k-means {metrics['kmeans_presence_test_acc']:.4f}, "
              f"training {state['wall_time_s'] / 60:.1f} min")
    if args.train_only:
        return 0
    summary = {"per_seed": runs}
    for key in runs[0]:
        if key in ("seed", "steps") or not isinstance(runs[0][key], float):
            continue
        values = np.array([r[key] for r in runs])
        summary[f"{key}_mean"] = float(values.mean())
        summary[f"{key}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    cfg = load_experiment_config(args.config, args.set)
    prov = provenance(seed=args.seeds, steps=runs[0]["steps"], device=args.device,
                      wall_time_s=sum(r["train_wall_time_s"] for r in runs), batch_size=cfg["train"].batch_size,
                      configs={k: v.to_dict() for k, v in cfg.items() if hasattr(v, "to_dict")})
    prov["device"] = device_description(args.device)
    write_results(Path(args.results_dir) / f"{args.name}.json", summary, prov)
    plot_training_curves({f"seed {s}": Path(args.out) / f"seed{s}" / "log.jsonl" for s in args.seeds},
                         Path(args.results_dir) / f"{args.name}_training.png")
    if (checkpoint_out := checkpoint_out_path(args.checkpoint_out, args.name)) is not None:
        export_checkpoint(Path(args.out) / f"seed{args.seeds[0]}" / "final.pt", checkpoint_out)
    print(f"wrote {Path(args.results_dir) / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    launch(main)
