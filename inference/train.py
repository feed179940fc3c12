"""The one training loop of the package: SVI for the Pyro models, plain losses for the baselines.

``train_loop`` drives any ``loss_fn(batch) -> scalar`` over the parameters of one ``nn.Module`` with a
``torch.optim`` optimiser (for Pyro models: ``pyro.settings.set(module_local_params=True)`` and
``loss_fn = lambda x: elbo.differentiable_loss(model, guide, x)``).  It gives every model the same guarantees:

- a progress bar and a JSON-lines log (``log.jsonl``);
- periodic and final checkpoints written atomically (a crash never leaves a half-written file);
- exact resume: the data order is a pure function of (seed, epoch), and the RNG states are checkpointed;
- a NaN guard: a non-finite loss or gradient stops training with a message, and nothing from the broken state
  is written;
- Ctrl-C, or a SIGTERM (a job scheduler's or `kill`'s), writes a checkpoint of the last completed step before
  stopping;
- ``on_checkpoint(state)`` (evaluations, curves) runs exactly once at each scheduled checkpoint, however the run
  is cut and resumed: it runs before the checkpoint is written, so a checkpoint of step N means N's callback
  finished, and a Ctrl-C during the callback marks the checkpoint so that the resumed run finishes it first.
"""

from __future__ import annotations

import json
import math
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyro
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from probcaps.errors import CheckpointError, TrainingDiverged
from probcaps.io import atomic_torch_save, atomic_write
from probcaps.encoders import use_compiled_part_cnn
from probcaps.render import use_compiled_compositing

__all__ = ["TrainConfig", "TrainState", "train_loop", "make_optimiser", "load_checkpoint", "make_elbo", "read_jsonl",
           "truncate_log"]


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 128
    lr: float = 1e-3
    warmup_steps: int = 100        # linear warm-up, then cosine decay to ``final_lr_fraction * lr``
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 100.0       # max global gradient norm
    log_every: int = 25
    checkpoint_every: int = 500
    seed: int = 0
    jit: bool = False              # JitTraceEnum_ELBO (rests on the deprecated torch.jit.trace)
    validate: bool = False         # Pyro's validation checks (a few ms a step)
    compile: bool = False          # torch.compile the alpha compositing and the part encoder's CNN
    # learning-rate multipliers by parameter-name prefix, e.g. {"model.template" = 10.0}: the templates need to
    # travel much further from their initial values than the network weights
    lr_multipliers: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    wall_time_s: float = 0.0


def make_elbo(jit: bool = False, max_plate_nesting: int = 2):
    """``TraceEnum_ELBO`` (or its JIT version) with an explicit plate nesting, as the enumerated models need."""
    cls = pyro.infer.JitTraceEnum_ELBO if jit else pyro.infer.TraceEnum_ELBO
    kwargs = dict(max_plate_nesting=max_plate_nesting)
    if jit:
        kwargs["ignore_jit_warnings"] = True
    return cls(**kwargs)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.final_lr_fraction + (1 - cfg.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _param_groups(module: nn.Module, cfg: TrainConfig) -> list[dict]:
    """One Adam group per learning-rate multiplier (the schedule scales every group alike)."""
    groups: dict[float, list] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        mult = next((m for prefix, m in cfg.lr_multipliers.items() if name.startswith(prefix)), 1.0)
        groups.setdefault(float(mult), []).append(p)
    return [{"params": ps, "lr": cfg.lr * m} for m, ps in sorted(groups.items())]


def make_optimiser(module: nn.Module, cfg: TrainConfig) -> torch.optim.Adam:
    """The training loop's Adam: one group per learning-rate multiplier; fused (one kernel for every tensor) where
    torch has it for the parameters' device."""
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float64)
                for p in module.parameters())
    return torch.optim.Adam(_param_groups(module, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Read a checkpoint written by :func:`train_loop`; a missing or unreadable file is a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a corrupt file
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or "module" not in ckpt:
        raise CheckpointError(f"{path}: not a probcaps checkpoint (no 'module' state)")
    return ckpt


def run_finished(out_dir: str | Path, steps: int) -> bool:
    """Whether ``out_dir`` holds a final model (``final.pt``) trained for at least ``steps`` steps.

    ``--resume`` entry points reuse such a run as it is; a run with fewer steps (``train.steps`` raised since)
    trains on from its last checkpoint instead of being silently re-evaluated at its old length.
    """
    final = Path(out_dir) / "final.pt"
    return final.is_file() and int(load_checkpoint(final)["state"]["step"]) >= steps


def load_module_state(module: nn.Module, state: dict, path: str | Path) -> None:
    """``load_state_dict`` that names the checkpoint and the first mismatching tensor instead of a torch dump."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{path}: checkpoint does not fit the model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise CheckpointError(f"{path}: '{k}' has shape {tuple(v.shape)} in the checkpoint but "
                                  f"{tuple(own[k].shape)} in the model (different config?)")
    module.load_state_dict(state)


def train_loop(
    module: nn.Module,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    batches: Callable[[int, int], Iterator],
    cfg: TrainConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    metadata: dict | None = None,
    progress: bool = True,
    on_checkpoint: Callable[[TrainState], None] | None = None,
) -> TrainState:
    """Optimise ``module``'s parameters on ``loss_fn`` for ``cfg.steps`` steps.

    Args:
        module: holds every trainable parameter (e.g. ``nn.ModuleDict(model=..., guide=...)``).
        loss_fn: ``batch -> scalar loss`` (mean over the batch, so the learning rate does not depend on it).
        batches: ``(epoch, start_batch) -> iterator of batches``; must be deterministic in its arguments.
        out_dir: receives ``checkpoint.pt`` (latest, periodic), ``final.pt`` and ``log.jsonl``.
        resume: continue from ``out_dir/checkpoint.pt`` (exactly: same parameters as an uninterrupted run).
        metadata: stored in every checkpoint (configs, so a checkpoint can rebuild its model).
        on_checkpoint: called with the state at every ``cfg.checkpoint_every`` steps and at the end, once per step
            across interruptions and resumes; not at the off-schedule checkpoint a Ctrl-C writes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.compile:
        use_compiled_compositing()
        use_compiled_part_cnn()
    params = [p for p in module.parameters() if p.requires_grad]
    optimiser = make_optimiser(module, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, _lr_factor(cfg))
    state = TrainState()
    ckpt_path, log_path = out_dir / "checkpoint.pt", out_dir / "log.jsonl"
    callback_done_at = -1  # the last step whose on_checkpoint call returned
    callback_pending = False
    if resume:
        ckpt = load_checkpoint(ckpt_path)
        load_module_state(module, ckpt["module"], ckpt_path)
        optimiser.load_state_dict(ckpt["optimiser"])
        scheduler.load_state_dict(ckpt["scheduler"])
        state = TrainState(**ckpt["state"])
        _set_rng_state(ckpt["rng"])
        truncate_log(log_path, state.step)
        callback_pending = ckpt.get("callback_pending", False)
        if not callback_pending:
            callback_done_at = state.step
    else:
        seed_everything(cfg.seed)
        log_path.unlink(missing_ok=True)

    def snapshot(callback_pending: bool = False) -> dict:
        return {
            "module": module.state_dict(),
            "optimiser": optimiser.state_dict(),
            "scheduler": scheduler.state_dict(),
            "state": asdict(state),
            "rng": _rng_state(),
            "train_config": cfg.to_dict(),
            "metadata": metadata or {},
            "callback_pending": callback_pending,
        }

    def run_callback() -> None:
        nonlocal callback_done_at
        if on_checkpoint is not None and callback_done_at != state.step:
            on_checkpoint(state)
            callback_done_at = state.step

    def save(path: Path) -> None:
        # the callback before the checkpoint: a run killed inside it resumes from the previous checkpoint, so the
        # steps since and this callback are redone instead of lost
        run_callback()
        atomic_torch_save(snapshot(), path)

    if callback_pending:  # cut by Ctrl-C inside the callback of the step we resume from
        run_callback()

    bar = tqdm(total=cfg.steps, initial=state.step, disable=not progress, desc="train", unit="step",
               dynamic_ncols=True)
    log = open(log_path, "a")
    previous_sigterm = _interrupt_on_sigterm()
    window_loss, window_n, window_t = 0.0, 0, time.perf_counter()
    try:
        while state.step < cfg.steps:
            for batch in batches(state.epoch, state.batch_in_epoch):
                t0 = time.perf_counter()
                optimiser.zero_grad(set_to_none=True)
                loss = loss_fn(batch)
                if not torch.isfinite(loss):
                    raise TrainingDiverged(f"step {state.step}: loss is {loss.item()}; stopped without writing the "
                                           f"broken model (last good checkpoint: {ckpt_path})")
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if not torch.isfinite(grad_norm):
                    raise TrainingDiverged(f"step {state.step}: gradient norm is {grad_norm.item()}; stopped without "
                                           f"writing the broken model (last good checkpoint: {ckpt_path})")
                optimiser.step()
                scheduler.step()
                state.step += 1
                state.batch_in_epoch += 1
                state.wall_time_s += time.perf_counter() - t0
                window_loss += loss.item()
                window_n += 1
                bar.update(1)
                if state.step % cfg.log_every == 0 or state.step == cfg.steps:
                    now = time.perf_counter()
                    n_items = window_n * _batch_len(batch)
                    record = {"step": state.step, "epoch": state.epoch, "loss": window_loss / window_n,
                              "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                              "items_per_s": n_items / max(now - window_t, 1e-9), "wall_time_s": state.wall_time_s}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{record['loss']:.1f}", ips=f"{record['items_per_s']:.0f}")
                    window_loss, window_n, window_t = 0.0, 0, now
                if state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                    save(ckpt_path)
                if state.step >= cfg.steps:
                    break
            else:
                state.epoch += 1
                state.batch_in_epoch = 0
    except KeyboardInterrupt:
        scheduled = state.step > 0 and (state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps)
        atomic_torch_save(snapshot(callback_pending=scheduled and on_checkpoint is not None
                                   and callback_done_at != state.step), ckpt_path)
        bar.write(f"interrupted at step {state.step}: checkpoint written to {ckpt_path}; continue with --resume")
        raise
    finally:
        bar.close()
        log.close()
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    save(ckpt_path)
    atomic_torch_save(snapshot(), out_dir / "final.pt")
    return state


class Terminated(KeyboardInterrupt):
    """SIGTERM during training: handled as Ctrl-C (checkpoint, then stop); entry points exit with 143."""

    exit_code = 128 + 15


def _raise_terminated(signum, frame):
    raise Terminated(f"signal {signum}")


def _interrupt_on_sigterm():
    """Route SIGTERM to a checkpoint-and-stop (main thread only); returns the previous handler, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines log (``[]`` when the file does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_log(path: str | Path, step: int) -> None:
    """Drop the records of a JSON-lines log past ``step`` (written after the checkpoint a run resumes from), so the
    log is one history.  Used for the training log and for any per-step evaluation log kept beside it."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [r for r in read_jsonl(path) if r["step"] <= step]
    atomic_write(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in keep)), mode="w")


def _batch_len(batch) -> int:
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return len(batch)
