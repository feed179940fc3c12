"""The one training loop of the package: SVI for the Pyro models, plain losses for the baselines.

``train_loop`` drives any ``loss_fn(batch) -> scalar`` over the parameters of one ``nn.Module`` with a
``torch.optim`` optimiser (for Pyro models: ``pyro.settings.set(module_local_params=True)`` and
``loss_fn = lambda x: elbo.differentiable_loss(model, guide, x)``), giving every model the same JSON-lines log,
atomic checkpoints, exact resume after any stop (a signal is honoured at the next step boundary), NaN guard, one run
per folder, scheduled callbacks and data parallelism under ``torchrun`` (:mod:`probcaps.inference.distributed`).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyro
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from probcaps.checkpoints import (
    checkpoint_step,
    first_non_finite,
    load_checkpoint,
    load_module_state,
    optimiser_tensors,
    rng_state,
    save_checkpoint,
    set_rng_state,
    to_plain,
)
from probcaps.config import COUNT, FLOAT32_MAX, Section, check_value
from probcaps.errors import CheckpointError, ConfigError, DataError, TrainingDiverged
from probcaps.inference import distributed
from probcaps.io import INTERRUPT_SIGNALS, OutputError, RunLock, append_jsonl, truncate_log

__all__ = ["TrainConfig", "TrainState", "Terminated", "train_loop", "make_optimiser", "make_elbo", "start_log",
           "check_adam_lr", "TFRMSprop"]

# keys of a log.jsonl record; schedule names and extra loss terms may not reuse them
LOG_KEYS = ("step", "epoch", "loss", "lr", "grad_norm", "items_per_s", "wall_time_s", "lr_changes", "config_changes")

# train keys a resumed run may change (how it is optimised, for how long, how often it logs and checkpoints: the
# config's values apply from the resumed step on, and the change is printed and logged); a change of any other key
# of the config or the metadata (model, data, encoder, batch size, seed, ...) would train another model from the
# checkpoint's state, and is refused.  Evaluation settings may change too.
RESUMABLE_TRAIN_KEYS = ("steps", "lr", "warmup_steps", "final_lr_fraction", "weight_decay", "grad_clip", "log_every",
                        "checkpoint_every", "validate", "jit", "compile")
RESUMABLE_METADATA = ("name", "configs.eval.*", *(f"configs.train.{k}" for k in RESUMABLE_TRAIN_KEYS))
OBJECTIVES = ("elbo", "iwae", "score_function")  # train.objective
OPTIMISERS = ("adam", "rmsprop_tf")  # train.optimiser


@dataclass
class TrainConfig(Section):
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
    # the capsule model's training objective (probcaps.inference.objectives): "elbo" (TraceEnum_ELBO), "iwae" (the
    # importance-weighted bound of Burda et al. 2016 with `particles` samples per image) or "score_function" (the
    # ELBO of `particles` samples, score-function gradients for discrete presences)
    objective: str = "elbo"
    particles: int = field(default=1, metadata={"range": COUNT})
    # "adam" (torch.optim.Adam) or "rmsprop_tf": RMSProp as TensorFlow 1 computes it, SCAE's optimiser
    # (:class:`TFRMSprop`); with its momentum of 0.9 a step is about ten times the learning rate, so it takes a
    # tenth of Adam's rate for the same step
    optimiser: str = "adam"

    def __post_init__(self):
        self.check()

    def check(self) -> "TrainConfig":
        """Refuse values the loop cannot honour by the config range rules (:data:`probcaps.config.RULES`), in one
        line naming the key (``train.steps: must be >= 1, got 0``)."""
        for f in fields(self):
            check_value(f, getattr(self, f.name), f.default_factory() if f.default is MISSING else f.default,
                        f"train.{f.name}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"train.objective: must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.optimiser not in OPTIMISERS:
            raise ConfigError(f"train.optimiser: must be one of {', '.join(OPTIMISERS)}, got {self.optimiser!r}")
        # what no single key's range says: every parameter group's rate keeps Adam's steps within float32
        check_adam_lr(self.lr * max(self.lr_multipliers.values(), default=1.0),
                      "train.lr" + (" (times its largest train.lr_multipliers)" if self.lr_multipliers else ""))
        return self


@dataclass
class TrainState:
    """Where training is.  ``summary_writer`` (not a field: never checkpointed) is the run's TensorBoard
    ``SummaryWriter`` when ``train_loop(..., tensorboard=True)``, else None, for ``on_checkpoint`` to add images."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    wall_time_s: float = 0.0

    summary_writer = None


class Terminated(KeyboardInterrupt):
    """SIGTERM during training: handled as Ctrl-C (checkpoint, then stop); entry points exit with 143."""

    exit_code = 128 + 15


def _interrupt(signum: int) -> KeyboardInterrupt:
    return Terminated(f"signal {signum}") if signum == signal.SIGTERM else KeyboardInterrupt(f"signal {signum}")


class _StopSignals:
    """SIGINT / SIGTERM handlers (main thread only) that record the signal, for the loop to stop at the next step
    boundary.  A signal raises at once while ``interruptible`` (a single-process ``on_checkpoint`` callback), and
    so does a second one while ``abortable`` (a single-process step before its update)."""

    def __init__(self):
        self.signum: int | None = None
        self.interruptible = self.abortable = False
        self._previous: dict = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in INTERRUPT_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        stopped_by_signal = self.signum is not None
        for s, handler in self._previous.items():
            previous = signal.SIG_DFL if handler is None else handler
            # a repeat of the signal that stopped the run, arriving while the entry point prints its line and the
            # interpreter shuts down (two Ctrl-C a few ms apart), would raise inside whatever runs then (tqdm's or
            # threading's shutdown: "Exception ignored ... KeyboardInterrupt"): it is dropped for a moment instead
            signal.signal(s, _RepeatGrace(previous, REPEAT_GRACE_S) if stopped_by_signal else previous)

    def _handle(self, signum, frame) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if self.interruptible or (self.abortable and not first):
            self.interruptible = self.abortable = False
            raise _interrupt(signum)
        if first and self.abortable:
            sys.stderr.write(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
                             f"(send it again to stop at once)\n")


#: Seconds after a signal stopped a run during which a repeat of it is dropped (:class:`_RepeatGrace`).
REPEAT_GRACE_S = 1.0


class _RepeatGrace:
    """A signal handler that drops the signal until ``seconds`` from now, then puts ``previous`` back (and hands
    it any signal after that)."""

    def __init__(self, previous, seconds: float):
        self.previous, self.deadline = previous, time.monotonic() + seconds

    def __call__(self, signum, frame) -> None:
        if time.monotonic() < self.deadline:
            return
        signal.signal(signum, self.previous)
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action (SIGTERM: end the process)


def make_elbo(jit: bool = False, max_plate_nesting: int = 2):
    """``TraceEnum_ELBO`` (or its JIT version) with an explicit plate nesting, as the enumerated models need."""
    if jit:
        return pyro.infer.JitTraceEnum_ELBO(max_plate_nesting=max_plate_nesting, ignore_jit_warnings=True)
    return pyro.infer.TraceEnum_ELBO(max_plate_nesting=max_plate_nesting)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)


def _lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.final_lr_fraction + (1 - cfg.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _param_groups(module: nn.Module, cfg: TrainConfig) -> list[dict]:
    """One optimiser group per learning-rate multiplier (the schedule scales every group alike)."""
    groups: dict[float, list] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            mult = next((m for prefix, m in cfg.lr_multipliers.items() if name.startswith(prefix)), 1.0)
            groups.setdefault(float(mult), []).append(p)
    return [{"params": ps, "lr": cfg.lr * m} for m, ps in sorted(groups.items())]


#: Adam's first step is ``lr / (1 - beta1)``, ten times the learning rate: larger rates overflow float32 inside it.
ADAM_MAX_LR = FLOAT32_MAX / 10


def adam_lr_problem(lr: float) -> str | None:
    """Why Adam cannot take steps at the learning rate ``lr`` in float32, or None."""
    return None if lr <= ADAM_MAX_LR else f"must be at most {ADAM_MAX_LR:.4g} (Adam's first step, ten times it, " \
                                          f"must fit float32), got {lr:g}"


def check_adam_lr(lr: float, where: str) -> float:
    """``lr``, or a one-line ConfigError naming ``where`` when :func:`adam_lr_problem` finds one."""
    if problem := adam_lr_problem(lr):
        raise ConfigError(f"{where}: {problem}")
    return lr


class TFRMSprop(torch.optim.Optimizer):
    """RMSProp with momentum as TensorFlow 1's ``tf.train.RMSPropOptimizer`` computes it, the optimiser SCAE trains
    with (Kosiorek et al. 2019): its mean square starts at one, not zero, and its epsilon is inside the square root.
    Per parameter ``p`` with gradient ``g`` (plus ``weight_decay * p``)::

        ms  <- decay * ms + (1 - decay) * g**2          (ms starts at 1)
        mom <- momentum * mom + lr * g / sqrt(ms + eps)  (mom starts at 0)
        p   <- p - mom

    torch's ``RMSprop`` starts ``ms`` at zero and adds ``eps`` outside the root, which makes its first steps about
    ``lr / sqrt(1 - decay)`` whatever the gradient's size; here the first steps are small while ``ms`` forgets its
    start.  Updates are batched over tensors (``torch._foreach_*``).
    """

    def __init__(self, params, lr: float = 1e-4, decay: float = 0.9, momentum: float = 0.9, eps: float = 1e-6,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, decay=decay, momentum=momentum, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            for p in params:
                if not self.state[p]:
                    self.state[p]["mean_square"] = torch.ones_like(p)
                    self.state[p]["momentum"] = torch.zeros_like(p)
            ms = [self.state[p]["mean_square"] for p in params]
            mom = [self.state[p]["momentum"] for p in params]
            torch._foreach_mul_(ms, group["decay"])
            torch._foreach_addcmul_(ms, grads, grads, value=1 - group["decay"])
            root = torch._foreach_sqrt(torch._foreach_add(ms, group["eps"]))
            torch._foreach_mul_(mom, group["momentum"])
            torch._foreach_addcdiv_(mom, grads, root, value=group["lr"])
            torch._foreach_sub_(params, mom)
        return loss


def make_optimiser(module: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The training loop's optimiser (``train.optimiser``), one group per learning-rate multiplier: Adam, fused
    (one kernel for every tensor) where torch has it for the parameters' device, or :class:`TFRMSprop`."""
    if cfg.optimiser == "rmsprop_tf":
        return TFRMSprop(_param_groups(module, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay)
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float64)
                for p in module.parameters())
    return torch.optim.Adam(_param_groups(module, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)


def start_log(path: Path, resume: bool) -> bool:
    """Ready the JSON-lines log ``path`` an ``on_checkpoint`` callback appends to, in a run folder: when ``resume``
    and the folder holds a checkpoint, keep its records up to the checkpoint's step, else delete it.  Returns
    whether the run resumes (``resume`` and a checkpoint)."""
    checkpoint = path.parent / "checkpoint.pt"
    if resume and checkpoint.is_file():
        truncate_log(path, load_checkpoint(checkpoint)["state"]["step"])
        return True
    path.unlink(missing_ok=True)
    return False


def _run_folder(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{out_dir}: exists and is not a folder (--out must name a run folder)") from None
    except OSError as e:
        raise OutputError(f"{out_dir}: cannot create the run folder ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise OutputError(f"{out_dir}: the run folder is not writable")
    return out_dir


def _flat(tree: dict, prefix: str = "") -> dict:
    """``{"a.b.c": leaf}`` of nested dicts (lists and tensors are leaves)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN equals NaN here


class _LossModule(nn.Module):
    """``module`` with ``loss_fn`` as its forward, so that ``DistributedDataParallel`` sees the loss computed inside
    the wrapped module's forward (its gradient hooks are on ``module``'s parameters)."""

    def __init__(self, module: nn.Module, loss_fn: Callable):
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, batch, **schedule_values):
        return self.loss_fn(batch, **schedule_values)


def train_loop(module: nn.Module, loss_fn: Callable[..., torch.Tensor | tuple[torch.Tensor, dict]],
               batches: Callable[[int, int], Iterator], cfg: TrainConfig, out_dir: str | Path, *,
               resume: bool = False, force: bool = False, metadata: dict | None = None, progress: bool = True,
               on_checkpoint: Callable[[TrainState], None] | None = None,
               schedules: dict[str, Callable[[int], float]] | None = None, tensorboard: bool = False) -> TrainState:
    """Optimise ``module``'s parameters on ``loss_fn`` for ``cfg.steps`` steps.

    Args:
        module: holds every trainable parameter (e.g. ``nn.ModuleDict(model=..., guide=...)``).
        loss_fn: ``batch -> scalar loss`` (a mean over the batch), or ``batch -> (loss, {name: float})`` whose
            terms are logged (window means) beside the loss; called as ``loss_fn(batch, **{name: schedule(step)})``.
        batches: ``(epoch, start_batch) -> iterator of batches`` (a tensor, or a tuple/list of tensors, batch
            first), deterministic in its arguments; under ``torch.distributed`` each process takes its contiguous
            share of every global batch.
        out_dir: receives ``checkpoint.pt`` (latest, periodic), ``final.pt``, ``log.jsonl`` and ``.lock``.
        resume: continue exactly from ``out_dir/checkpoint.pt``, with this config's learning rate and schedule
            from the resumed step on (a change is printed and logged).
        force: start over in a folder holding a run (deleting its checkpoints, log and TensorBoard events); without
            it or ``resume`` such a folder is refused.
        metadata: stored in every checkpoint (configs, so a checkpoint can rebuild its model).
        on_checkpoint: called (on rank 0) with the state every ``cfg.checkpoint_every`` steps and at the end, once
            per step across interruptions and resumes (not at the off-schedule checkpoint of a Ctrl-C).
        schedules: ``{name: step -> float}`` of each 0-based step, passed to ``loss_fn``; logged at each record.
        tensorboard: mirror the log to ``out_dir/tensorboard``; the writer is ``state.summary_writer``.

    Raises:
        KeyboardInterrupt: Ctrl-C (``Terminated`` for SIGTERM), after writing a checkpoint of the step boundary.
        TrainingDiverged: a non-finite loss, gradient or parameter; nothing non-finite is ever written.
        ConfigError, CheckpointError, OutputError, RunFolderBusy: one-line errors about the input or the folder.
    """
    with _StopSignals() as stop, warnings.catch_warnings():  # first: a signal during the start-up is honoured
        # a NaN loss ends the run with one line of its own (TrainingDiverged): Pyro's warning would repeat it
        warnings.filterwarnings("ignore", message="Encountered NaN", category=UserWarning)
        cfg.check()
        schedules = dict(schedules or {})
        if clash := sorted(set(schedules) & set(LOG_KEYS)):
            raise ValueError(f"train_loop: schedule names {clash} clash with the log's own keys")
        world = distributed.init_from_env()
        out_dir = _run_folder(out_dir) if world.rank == 0 else Path(out_dir)
        # a run stopped by kill -9 before its first checkpoint leaves its (maybe empty) log: resuming it is
        # starting at step 0
        started = (out_dir / "log.jsonl").exists()
        world.barrier()
        with RunLock(out_dir) if world.rank == 0 else contextlib.nullcontext():
            run = _Run(module, loss_fn, batches, cfg, out_dir, world, stop, metadata, progress, on_checkpoint,
                       schedules)
            return run.train(resume, force, tensorboard, started)


class _Run:
    """One call of :func:`train_loop`: the optimiser, scheduler, state and files of a run."""

    def __init__(self, module, loss_fn, batches, cfg, out_dir, world, stop, metadata, progress, on_checkpoint,
                 schedules):
        self.module, self.loss_fn, self.batches, self.cfg = module, loss_fn, batches, cfg
        self.out_dir, self.world, self.stop = out_dir, world, stop
        self.metadata, self.progress, self.on_checkpoint, self.schedules = metadata, progress, on_checkpoint, schedules
        self.ckpt_path, self.final_path = out_dir / "checkpoint.pt", out_dir / "final.pt"
        self.log_path, self.tb_dir = out_dir / "log.jsonl", out_dir / "tensorboard"
        self.state = TrainState()
        self.window = {"steps": 0, "sums": {}}  # steps since the last log record and the sums of loss and terms
        self.lr_changes: list[dict] = []  # {"step", "from", "to"}: learning rates changed by resumes
        self.config_changes: list[dict] = []  # {"step", "key", "from", "to"}: train keys changed by resumes
        self.callback_done_at = -1  # the last step whose on_checkpoint call returned
        self.writer = None
        self.is_main = world.rank == 0
        self.schedule_values: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------ start-up

    def _start(self, resume: bool, force: bool, started: bool) -> bool:
        """Resume, start afresh or refuse (before any slow work: a kill during the rest leaves a folder that
        ``resume`` continues); returns whether the checkpoint resumed from still owes its ``on_checkpoint`` call."""
        cfg = self.cfg
        files = (self.ckpt_path, self.final_path, self.log_path)
        for path in files if self.is_main else ():  # temporary files of writes a kill -9 cut short (we hold the lock)
            for tmp in self.out_dir.glob(f".{path.name}.*.tmp"):
                tmp.unlink(missing_ok=True)
        if resume and not self.ckpt_path.is_file() and self.final_path.is_file():
            raise CheckpointError(f"{self.out_dir}: holds a finished model (final.pt, step "
                                  f"{checkpoint_step(self.final_path)}) but no checkpoint.pt to continue from; "
                                  f"nothing was changed (train into another folder, or --force to start over)")
        if resume and not self.ckpt_path.is_file() and started:
            if self.is_main:
                print(f"{self.out_dir}: the run stopped before its first checkpoint; starting it at step 0",
                      file=sys.stderr)
            resume, force = False, True
        if not resume:
            if (self.ckpt_path.is_file() or self.final_path.is_file()) and not force:
                step = checkpoint_step(self.final_path if self.final_path.is_file() else self.ckpt_path)
                raise ConfigError(f"{self.out_dir} holds a run (step {step}); pass --resume to continue or --force "
                                  f"to start over")
            self.world.barrier()  # every process has looked before rank 0 deletes
            if self.is_main:
                for path in files:
                    path.unlink(missing_ok=True)
                shutil.rmtree(self.tb_dir, ignore_errors=True)
                try:
                    self.log_path.touch()  # marks the folder as holding a started run
                except OSError as e:
                    raise OutputError(f"{self.log_path}: cannot write ({e.strerror or e})") from None
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimiser = make_optimiser(self.module, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimiser, _lr_factor(cfg))
        self.forward = (self.world.wrap(_LossModule(self.module, self.loss_fn)) if self.world.size > 1
                        else self.loss_fn)
        if resume:
            return self._resume()
        seed_everything(self.world.seed(cfg.seed))
        return False

    def _resume(self) -> bool:
        ckpt = load_checkpoint(self.ckpt_path)
        if missing := [k for k in ("optimiser", "scheduler", "state", "rng") if k not in ckpt]:
            raise CheckpointError(f"{self.ckpt_path}: not a checkpoint a run can continue from (no {missing[0]!r}: "
                                  f"an exported model?); nothing was changed")
        try:
            return self._restore(ckpt)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # a damaged or foreign file
            raise CheckpointError(f"{self.ckpt_path}: its training state cannot be restored ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None

    def _restore(self, ckpt: dict) -> bool:
        """Resume from the checkpoint ``ckpt``; returns whether it still owes its ``on_checkpoint`` call."""
        world_size = int(ckpt.get("world_size", 1))
        if world_size != self.world.size:
            raise CheckpointError(f"{self.ckpt_path}: written by a run of {world_size} process(es); resume it with "
                                  f"{world_size} (torchrun --nproc_per_node={world_size}), not {self.world.size}, "
                                  f"or the random draws would differ")
        self.config_changes = list(ckpt.get("config_changes", []))
        notes = self._check_config_unchanged(ckpt)
        load_module_state(self.module, ckpt["module"], self.ckpt_path)
        if (bad := first_non_finite(optimiser_tensors(ckpt["optimiser"]))) is not None:
            raise CheckpointError(f"{self.ckpt_path}: '{bad}' holds NaN or Inf values")
        new_base = list(self.scheduler.base_lrs)
        try:
            self.optimiser.load_state_dict(ckpt["optimiser"])
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{self.ckpt_path}: the optimiser state does not fit (train.lr_multipliers "
                                  f"changed?): {e}") from None
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.state = TrainState(**{k: v for k, v in ckpt["state"].items() if k in TrainState.__dataclass_fields__})
        set_rng_state((ckpt.get("rng_per_rank") or [ckpt["rng"]])[self.world.rank])
        self.window = ckpt.get("log_window", {"steps": 0, "sums": {}})
        self.lr_changes = list(ckpt.get("lr_changes", []))
        self._apply_config_lr(new_base)
        if self.is_main:
            truncate_log(self.log_path, self.state.step)
            for note in notes:
                print(note, file=sys.stderr)
        pending = ckpt.get("callback_pending", False)
        self.callback_done_at = -1 if pending else self.state.step
        return pending

    def _check_config_unchanged(self, ckpt: dict) -> list[str]:
        """Refuse a resume whose config would train another model than the checkpoint's (one line naming every
        changed key); record the train keys that may change (:data:`RESUMABLE_TRAIN_KEYS`), and return a line
        for each to print once the run has resumed.  A key the checkpoint lacks (one added to the package since)
        counts as unchanged."""
        stored = {**{f"train.{k}": v for k, v in _flat(ckpt.get("train_config", {})).items()},
                  **{f"metadata.{k}": v for k, v in _flat(ckpt.get("metadata", {})).items()}}
        current = {**{f"train.{k}": v for k, v in _flat(self.cfg.to_dict()).items()},
                   **{f"metadata.{k}": v for k, v in _flat(to_plain(self.metadata or {})).items()}}
        changed = sorted(k for k in stored.keys() & current.keys() if not _same(stored[k], current[k]))
        changed += sorted(k for k in current.keys() - stored.keys()
                          if any(s.startswith(k + ".") for s in stored))  # a section replaced by a value
        allowed = [f"train.{k}" for k in RESUMABLE_TRAIN_KEYS] + [f"metadata.{p}" for p in RESUMABLE_METADATA]
        refused = [k for k in changed if not any(fnmatchcase(k, p) for p in allowed)]
        if refused:
            shown = [k.removeprefix("metadata.").removeprefix("configs.") for k in refused]
            detail = ", ".join(f"{k} ({stored.get(r)!r} -> {current.get(r)!r})" for k, r in zip(shown, refused))
            raise ConfigError(f"{self.ckpt_path}: cannot resume with a changed {detail}: it would train another "
                              f"model from this checkpoint's state (resume with the run's own config, or train "
                              f"into a new folder)")
        step = int(ckpt["state"]["step"])
        notes = []
        for key in (k for k in changed if k.startswith("train.") and k != "train.lr"):  # lr: _apply_config_lr
            self.config_changes.append({"step": step, "key": key, "from": stored[key], "to": current[key]})
            notes.append(f"resuming at step {step}: {key} changed from {stored[key]!r} to {current[key]!r}")
        return notes

    def _apply_config_lr(self, new_base: list[float]) -> None:
        """Learning rates from this run's config (``train.lr``, the schedule, weight decay), not the checkpoint's:
        an unchanged config gives bit-identical rates, a changed one takes effect from the resumed step on."""
        sched, groups = self.scheduler, self.optimiser.param_groups
        old = [g["lr"] for g in groups]
        sched.base_lrs = new_base
        factor = sched.lr_lambdas[0]
        for g, base in zip(groups, new_base):
            g.update(initial_lr=base, lr=base * factor(sched.last_epoch), weight_decay=self.cfg.weight_decay)
        new = sched._last_lr = [g["lr"] for g in groups]
        if old != new:
            self.lr_changes.append({"step": self.state.step, "from": old[0], "to": new[0]})
            if self.is_main:
                print(f"resuming at step {self.state.step}: learning rate changed from {old[0]:.6g} to {new[0]:.6g} "
                      f"(train.lr = {self.cfg.lr:g} and its schedule apply from here on)", file=sys.stderr)

    def _open_tensorboard(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard needs the tensorboard package: pip install probcaps[tensorboard]") \
                from None
        # purge_step: events a killed run wrote past the checkpoint we resume from are dropped by TensorBoard
        self.writer = SummaryWriter(str(self.tb_dir), purge_step=self.state.step if self.state.step else None)
        self.state.summary_writer = self.writer

    # ------------------------------------------------------------------------------------------ checkpoints

    def _write(self, path: Path, callback_pending: bool = False, rng: dict | None = None) -> None:
        """Checkpoint the run into ``path`` (``rng``: the RNG state to store, by default the current one)."""
        rng = rng or rng_state()
        rngs = self.world.gather_objects(rng) if self.world.size > 1 else None
        if not self.is_main:
            return
        snap = {"module": self.module.state_dict(), "optimiser": self.optimiser.state_dict(),
                "scheduler": self.scheduler.state_dict(), "state": asdict(self.state), "rng": rng,
                "train_config": self.cfg.to_dict(), "metadata": self.metadata or {},
                "callback_pending": callback_pending,
                "log_window": {"steps": self.window["steps"], "sums": dict(self.window["sums"])},
                "lr_changes": list(self.lr_changes), "config_changes": list(self.config_changes),
                "world_size": self.world.size, "rng_per_rank": rngs}
        if (bad := first_non_finite(snap["module"]) or first_non_finite(optimiser_tensors(snap["optimiser"]))):
            raise self._diverged(f"step {self.state.step}: '{bad}' holds NaN or Inf values; refused to write {path}")
        save_checkpoint(snap, path)
        if self.writer is not None:
            self.writer.flush()

    def _diverged(self, message: str) -> TrainingDiverged:
        """``message`` and where the last checkpoint is (every written checkpoint is finite)."""
        last = (f"last good checkpoint: {self.ckpt_path}, step {checkpoint_step(self.ckpt_path)}"
                if self.ckpt_path.is_file() else "no checkpoint was written yet")
        return TrainingDiverged(f"{message} ({last})")

    def _run_callback(self) -> None:
        if self.on_checkpoint is None or self.callback_done_at == self.state.step:
            return
        if self.is_main:
            self.stop.interruptible = self.world.size == 1
            try:
                self.on_checkpoint(self.state)
            finally:
                self.stop.interruptible = False
        self.callback_done_at = self.state.step

    def _checkpoint(self) -> None:
        """A scheduled checkpoint: the callback first, so that a run killed inside it resumes from the previous
        checkpoint and redoes the steps since and this callback instead of losing it."""
        rng = rng_state()  # the boundary's: the resumed run redoes the callback from the same RNG state
        try:
            self._run_callback()
        except KeyboardInterrupt:
            self._interrupted(callback_pending=True, rng=rng)
            raise
        self._write(self.ckpt_path)

    def _interrupted(self, callback_pending: bool = False, rng: dict | None = None) -> None:
        """Checkpoint the step boundary where an interruption stops the run, and say so."""
        self._write(self.ckpt_path, callback_pending, rng)
        if self.is_main:
            self.bar.write(f"interrupted at step {self.state.step}: checkpoint written to {self.ckpt_path}; continue "
                           f"with --resume")

    # ------------------------------------------------------------------------------------------ the loop

    def train(self, resume: bool, force: bool, tensorboard: bool, started: bool) -> TrainState:
        callback_pending = self._start(resume, force, started)
        if tensorboard and self.is_main:
            self._open_tensorboard()
        self.bar = tqdm(total=self.cfg.steps, initial=self.state.step, disable=not self.progress or not self.is_main,
                        desc="train", unit="step", dynamic_ncols=True)
        try:
            self._loop(callback_pending)
            self._checkpoint()
            self._write(self.final_path)
            if signum := self.world.agree_stop(self.stop.signum):  # during the final writes: complete, but stop
                raise _interrupt(signum)
        finally:
            self.bar.close()
            if self.writer is not None:
                self.writer.close()
        return self.state

    def _loop(self, callback_pending: bool) -> None:
        cfg, state, world = self.cfg, self.state, self.world
        iterator, window_t = None, time.perf_counter()
        signum = world.agree_stop(self.stop.signum)
        if callback_pending and not signum:  # cut by Ctrl-C inside the callback of the step we resume from
            self._checkpoint()
        while True:
            self.stop.abortable = False
            if world.size == 1:
                signum = self.stop.signum
            if signum:  # a scheduled step whose callback has not run yet marks the checkpoint as owing it
                s = state.step
                due = s > 0 and (s % cfg.checkpoint_every == 0 or s == cfg.steps) and self.on_checkpoint is not None
                self._interrupted(callback_pending=due and self.callback_done_at != s)
                raise _interrupt(signum)
            if state.step >= cfg.steps:
                return
            # the RNG state and buffers (e.g. batch-norm statistics, which a forward pass updates) before this
            # step: an interruption inside the step, before its update, checkpoints the step boundary with them
            rng_before = rng_state()
            buffers_before = {k: b.clone() for k, b in self.module.named_buffers()}
            self.stop.abortable = world.size == 1
            try:
                if iterator is None:
                    iterator = iter(self.batches(state.epoch, state.batch_in_epoch))
                try:
                    batch = next(iterator)
                except StopIteration:
                    if state.batch_in_epoch == 0:
                        raise DataError(f"train_loop: batches({state.epoch}, 0) yielded no batch") from None
                    iterator, state.epoch, state.batch_in_epoch = None, state.epoch + 1, 0
                    continue
                t0 = time.perf_counter()
                loss, grad_norm, terms, n_items, signum = self._step(batch)
            except KeyboardInterrupt:
                # a second signal, or code inside the step: raised before the update
                self.stop.abortable = False
                with torch.no_grad():
                    for k, b in self.module.named_buffers():
                        b.copy_(buffers_before[k])
                self._interrupted(rng=rng_before)
                raise
            state.wall_time_s += time.perf_counter() - t0
            self.bar.update(1)
            self._accumulate(loss, terms)
            if state.step % cfg.log_every == 0 or state.step == cfg.steps:
                now = time.perf_counter()
                self._log(grad_norm, n_items * self.window["steps"] / max(now - window_t, 1e-9))
                window_t = now
            if state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                self._checkpoint()

    def _shard(self, batch):
        """This process's contiguous share of a global batch, and the number of items in it and in the batch."""
        def split(t):
            return torch.tensor_split(t, self.world.size)[self.world.rank]

        many = isinstance(batch, (tuple, list))
        n_global = len(batch[0] if many else batch)
        if self.world.size == 1:
            return batch, n_global, n_global
        if n_global < self.world.size:
            raise ConfigError(f"train.batch_size: a batch of {n_global} items cannot be shared by "
                              f"{self.world.size} processes")
        shard = type(batch)(split(t) for t in batch) if many else split(batch)
        return shard, len(shard[0] if many else shard), n_global

    def _step(self, batch):
        """One optimisation step; returns (global mean loss, gradient norm, terms, items, agreed stop signal)."""
        state, world = self.state, self.world
        values = self.schedule_values = {name: float(fn(state.step)) for name, fn in self.schedules.items()}
        shard, n_local, n_global = self._shard(batch)
        self.optimiser.zero_grad(set_to_none=True)
        with world.collective():  # DDP's forward syncs buffers across the processes
            out = self.forward(shard, **values)
        loss, terms = out if isinstance(out, tuple) else (out, {})
        if not isinstance(terms, dict):
            raise TypeError("train_loop: loss_fn must return a scalar loss or (loss, {name: float})")
        terms = {k: float(v) for k, v in terms.items()}
        signum = None
        if world.size > 1:
            # the gradient of the global batch's mean loss: DDP averages the processes' gradients, so each
            # process weighs its share's mean by its share of the items (1 for equal shares)
            weight = n_local * world.size / n_global
            loss_value, terms, signum = world.reduce_step(loss.detach() * (n_local / n_global), terms,
                                                          n_local / n_global, self.stop.signum)
            loss = loss * weight if weight != 1 else loss
        else:
            loss_value = loss.detach()
        if not torch.isfinite(loss_value):
            raise self._diverged(f"step {state.step}: loss is {loss_value.item()}; stopped without writing the broken "
                                 f"model")
        with world.collective():  # DDP all-reduces the gradients inside the backward pass
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        if not torch.isfinite(grad_norm):
            raise self._diverged(f"step {state.step}: gradient norm is {grad_norm.item()}; stopped without writing "
                                 f"the broken model")
        # parameters, optimiser, scheduler and data position advance together: a signal only sets a flag
        self.stop.abortable = False
        self.optimiser.step()
        self.scheduler.step()
        state.step += 1
        state.batch_in_epoch += 1
        if (bad := first_non_finite(dict(self.module.named_parameters()))) is not None:
            raise self._diverged(f"step {state.step - 1}: the update made '{bad}' NaN or Inf (learning rate "
                                 f"{self.optimiser.param_groups[0]['lr']:.3g} too large?); stopped without writing it")
        return float(loss_value), float(grad_norm), terms, n_global, signum

    def _accumulate(self, loss: float, terms: dict) -> None:
        sums = self.window["sums"]
        sums["loss"] = sums.get("loss", 0.0) + loss
        for k, v in terms.items():
            if k in LOG_KEYS or k in self.schedules:
                raise ValueError(f"train_loop: the loss term '{k}' clashes with a log key or a schedule name")
            sums[k] = sums.get(k, 0.0) + v
        self.window["steps"] += 1

    def _log(self, grad_norm: float, items_per_s: float) -> None:
        state, n = self.state, self.window["steps"]
        means = {k: v / n for k, v in self.window["sums"].items()}
        record = {"step": state.step, "epoch": state.epoch, "loss": means.pop("loss"),
                  "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm, "items_per_s": items_per_s,
                  "wall_time_s": state.wall_time_s, **self.schedule_values, **means}
        for key, log in (("lr_changes", self.lr_changes), ("config_changes", self.config_changes)):
            if changes := [c for c in log if state.step - n <= c["step"] < state.step]:
                record[key] = changes
        self.window = {"steps": 0, "sums": {}}
        if not self.is_main:
            return
        append_jsonl(self.log_path, record)
        self.bar.set_postfix(loss=f"{record['loss']:.1f}", ips=f"{record['items_per_s']:.0f}")
        if self.writer is not None:
            for key, value in record.items():
                if key in ("step", "epoch", "lr_changes", "config_changes"):
                    continue
                tag = (f"schedule/{key}" if key in self.schedule_values
                       else f"train/{key}" if key in LOG_KEYS else f"loss_terms/{key}")
                self.writer.add_scalar(tag, value, state.step)

