"""What the experiments on the generative capsule model share (not itself an experiment: it has no ``main``).

The parser of an experiment on a trained model, training a run folder once, exporting a trained model, the probes'
feature sets, rendering latents and the table of a ``probcaps ttvi`` run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from probcaps import plotting
from probcaps.checkpoints import load_checkpoint, run_finished, save_checkpoint
from probcaps.errors import ProbcapsError
from probcaps.inference.capsule_svi import train_capsules
from probcaps.inference.guides import Latents
from probcaps.inference.train import TrainConfig
from probcaps.report import provenance_line, results_table
from probcaps.runner import checkpoint_arg, config_dicts, finite_positive_float, positive_int

#: the shipped model the experiments on a trained model start from by default (``probcaps list``)
DEFAULT_CHECKPOINT = "mnist"
#: the feature sets of the linear probes (keys of ``probcaps.inference.capsule_svi.probe_features``)
FEATURES = {"presence_pose": "presences + poses", "presence": "presences"}


def checkpoint_parser(doc: str, checkpoint_help: str | None = None) -> argparse.ArgumentParser:
    """The parser of an experiment on a trained model: ``doc`` (its module docstring) as the description, and
    ``--checkpoint`` (a shipped model by name or a file; default :data:`DEFAULT_CHECKPOINT`)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=checkpoint_arg, default=DEFAULT_CHECKPOINT,
                   help=checkpoint_help or f"a shipped model by name (default: {DEFAULT_CHECKPOINT}) or a file")
    return p


def add_normal_pose_args(p: argparse.ArgumentParser) -> None:
    """The options of the full variational pose guide's training from a delta-trained model (Smith et al. 2020,
    §2.3; ``experiments/normal_guide.py``'s recipe): ``--steps``, ``--lr``, ``--init-scale``, ``--min-scale``,
    ``--scale-lr-multiplier``."""
    p.add_argument("--steps", type=positive_int, default=400)
    p.add_argument("--lr", type=finite_positive_float, default=3e-4)
    p.add_argument("--init-scale", type=finite_positive_float, default=0.02, help="starting pose scale")
    p.add_argument("--min-scale", type=finite_positive_float, default=1e-3, help="floor on the pose scales")
    p.add_argument("--scale-lr-multiplier", type=finite_positive_float, default=30.0,
                   help="learning-rate multiplier of the scales")


def normal_pose_training(system, train: TrainConfig, args, seed: int, **changes) -> TrainConfig:
    """Swap ``system``'s delta guide for Normal poses (``args.init_scale``, ``args.min_scale``) and return the
    training config that fits it (:func:`add_normal_pose_args`): ``train`` with ``args.steps``, ``args.lr`` after a
    short warm-up, ``seed``, and the pose scales at ``args.scale_lr_multiplier`` times the rate; ``changes`` on top
    (an objective, its particles, a batch size)."""
    system.use_normal_poses(init_scale=args.init_scale, min_scale=args.min_scale)
    return TrainConfig(**{**train.to_dict(), "steps": args.steps, "lr": args.lr,
                          "warmup_steps": min(50, args.steps), "seed": seed, "checkpoint_every": 100,
                          # the scales start far from where they end: Adam moves a raw parameter ~lr a step
                          "lr_multipliers": {"guide.pose_scale_raw": args.scale_lr_multiplier}, **changes})


def checkpoint_out_path(arg: str | None, name: str) -> Path | None:
    """Where ``--checkpoint-out`` exports the first seed's model: ``checkpoints/<name>.pt`` under the current folder
    unless given, so a run under another ``--name`` never overwrites the shipped model of the default name; ``""``:
    no export."""
    if arg is None:
        return Path("checkpoints") / f"{name}.pt"
    return Path(arg) if arg else None


def train_run(cfg: dict, out: Path, args, **kw) -> tuple[Path, dict]:
    """Train ``cfg`` into the run folder ``out`` (with ``--resume``: from its checkpoint, and not at all once
    finished); returns its ``final.pt`` and training state.  ``kw`` go to :func:`train_capsules`."""
    # the checkpoint names the run (--name), not the config it started from: a model trained with --set changes, or
    # fine-tuned from another checkpoint, says what it is
    cfg = {**cfg, "name": args.name}
    if not (args.resume and run_finished(out, cfg["train"].steps)):
        train_capsules(cfg, out, resume=args.resume and (out / "checkpoint.pt").is_file(), device=args.device,
                       data_dir=args.data_dir, progress=not args.quiet, **kw)
    return out / "final.pt", load_checkpoint(out / "final.pt")["state"]


def holds_model(run_dir: Path) -> bool:
    """Whether the run folder ``run_dir`` holds a model to resume or evaluate (``final.pt`` or ``checkpoint.pt``)."""
    return any((run_dir / f).is_file() for f in ("final.pt", "checkpoint.pt"))


def results_without_model(seed_json: Path, run_dir: Path, cfg: dict) -> tuple[dict, dict] | None:
    """A seed's metrics and training state (``step``, ``wall_time_s``) from its results file, for a run whose model
    was not kept (its run folder cleaned or moved away): None while ``run_dir`` holds a checkpoint to resume or
    evaluate, or where there is no results file; an error where the file records another config."""
    if not seed_json.is_file() or holds_model(run_dir):
        return None
    results = json.loads(seed_json.read_text())
    prov = results.get("provenance", {})
    if prov.get("configs") != json.loads(json.dumps(config_dicts(cfg))):
        raise ProbcapsError(f"{seed_json}: its config is not this run's, and {run_dir} holds no model to evaluate "
                            "instead; drop --reuse-results to train the seed again")
    return results["metrics"], {"step": prov["steps"], "wall_time_s": prov["wall_time_s"]}


def export_checkpoint(src: Path, dst: Path, name: str | None = None) -> Path:
    """The model and its config without optimiser state: what a user needs to evaluate (a few MB); ``name``: the
    name it carries (its results files' under ``probcaps evaluate``), the run's own by default."""
    ckpt = load_checkpoint(src)
    if name:
        ckpt["metadata"] = {**ckpt["metadata"], "name": name}
    return save_checkpoint({k: ckpt[k] for k in ("module", "state", "train_config", "metadata")}, dst)


def plot_training_curves(logs: dict[str, Path], path: Path) -> None:
    """Negative ELBO per image against step, one line per run (from the runs' ``log.jsonl``)."""
    if curves := plotting.log_curves(logs, "loss"):
        plotting.plot_curves(curves, path, xlabel="step", ylabel="negative ELBO per image (nats)",
                             title="training (SVI, TraceEnum_ELBO)")


def reconstruct(model, latents: Latents) -> torch.Tensor:
    """``(N, 1, H, W)`` images rendered from ``latents``."""
    return model.render(torch.sigmoid(latents.part_logits), latents.part_poses)[0]


@results_table("ttvi_throughput")
def throughput_table(m: dict, prov: dict) -> str:
    """The table of a ``probcaps ttvi`` run (``results_dir/<name>.json``): how fast free-form test-time VI runs and
    how much it improves the ELBO and the reconstructions."""
    work = m["n_images"] * m["steps"]
    line = provenance_line(prov)
    return "\n".join([
        "| images × steps | threads | wall time (min) | CPU time of the process (min) | image-steps/s (wall) | "
        "ELBO per image, encoder → after | recon MSE ×100, encoder → after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {m['n_images']:,} × {m['steps']} | {m['threads']} | {m['wall_time_s'] / 60:.1f} | "
        f"{m['cpu_time_s'] / 60:.1f} | {work / m['wall_time_s']:.0f} | {m['elbo_encoder_mean']:.0f} → "
        f"{m['elbo_ttvi_mean']:.0f} | {100 * m['recon_mse_encoder']:.3f} → {100 * m['recon_mse_ttvi']:.3f} |",
        "",
        "CPU time is the process's, summed over its threads (with one thread: the wall time on an otherwise idle "
        "core); measured with nothing else running. " + line[0].upper() + line[1:],
    ])
