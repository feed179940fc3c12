"""A small training run that stops itself with a signal at a chosen point of a chosen step.

Used by ``tests/test_interrupts.py`` (in a forked process), or by hand::

    python tests/interrupt_target.py OUT [--resume] [--signal INT|TERM|KILL --step K --point POINT]

The loss draws random numbers (``torch.randn``) inside every step, takes a schedule value (``beta``) and returns
an extra term, so an exact resume needs the RNG state, the optimiser moments, the schedule's step and the log
window of one step boundary.  ``POINTS`` are the places a signal can land.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn as nn

from probcaps.inference import train as train_module
from probcaps.inference.train import TrainConfig, train_loop

STEPS = 8
BATCHES_PER_EPOCH = 3
# 8 steps over epochs of 3 batches; periodic checkpoints at steps 3 and 6; log records every 2 steps
CONFIG = dict(steps=STEPS, batch_size=4, lr=0.05, warmup_steps=2, log_every=2, checkpoint_every=3)
POINTS = ("startup", "batch", "before_draws", "after_draws", "backward", "checkpoint_write", "log_write",
          "backward_twice")
SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(4, 5)
        self.norm = nn.BatchNorm1d(5)  # running statistics: buffers that every forward pass updates
        self.out = nn.Linear(5, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.hidden(x))))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(4 * BATCHES_PER_EPOCH, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def run(out_dir, *, resume: bool = False, signum: int | None = None, step: int = -1, point: str | None = None):
    """Train ``Net`` for :data:`STEPS` steps into ``out_dir``; with ``signum``, send it to this process at
    ``point`` of the step of 0-based index ``step`` (``startup``: during the loop's start-up; ``checkpoint_write``
    and ``log_write``: the first such write after that step began)."""
    torch.manual_seed(0)
    module = Net()
    x_all, y_all = data()
    current = {"step": -1}
    armed = {"on": signum is not None}

    def fire(where: str) -> None:
        if armed["on"] and point.startswith(where) and current["step"] >= step:
            armed["on"] = False
            os.kill(os.getpid(), signum)
            if point.endswith("_twice"):  # an impatient user: the second signal stops the step at once
                os.kill(os.getpid(), signum)

    def batches(epoch: int, start: int):
        perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(epoch))
        for i in range(start, BATCHES_PER_EPOCH):
            current["step"] = epoch * BATCHES_PER_EPOCH + i  # every epoch has the same number of batches
            fire("batch")
            idx = perm[4 * i:4 * i + 4]
            yield x_all[idx], y_all[idx]

    def loss_fn(batch, beta: float):
        x, y = batch
        fire("before_draws")
        noise = 0.1 * torch.randn(len(x), 1)
        fire("after_draws")
        pred = module(x) + noise
        if point is not None and point.startswith("backward"):
            pred.register_hook(lambda g: (fire("backward"), g)[1])
        return beta * (pred - y).pow(2).mean(), {"noise": float(noise.mean())}

    patches = []
    if point == "startup":
        original = train_module.make_optimiser

        def make_optimiser(*args, **kwargs):
            fire("startup")
            return original(*args, **kwargs)

        current["step"] = step
        patches.append((train_module, "make_optimiser", original, make_optimiser))
    elif point == "checkpoint_write":
        original_save = torch.save

        class SignalMidWrite:
            def __init__(self, f):
                self.f, self.writes = f, 0

            def write(self, b):
                self.writes += 1
                if self.writes == 2:
                    fire("checkpoint_write")
                return self.f.write(b)

            def flush(self):
                return self.f.flush()

        def save(obj, f, *args, **kwargs):
            return original_save(obj, SignalMidWrite(f), *args, **kwargs)

        patches.append((torch, "save", original_save, save))
    elif point == "log_write":
        original_append = train_module.append_jsonl

        def append(path, record):
            if armed["on"] and current["step"] >= step:
                import json

                line = json.dumps(record)
                with open(path, "a") as f:  # half the record reaches the file, then the kill
                    f.write(line[:len(line) // 2])
                fire("log_write")
            return original_append(path, record)

        patches.append((train_module, "append_jsonl", original_append, append))

    def beta(s: int) -> float:
        current["step"] = s
        return 1.0 + 0.1 * s

    for owner, name, _, new in patches:
        setattr(owner, name, new)
    try:
        state = train_loop(module, loss_fn, batches, TrainConfig(**CONFIG), out_dir, resume=resume, progress=False,
                           schedules={"beta": beta})
    finally:
        for owner, name, old, _ in patches:
            setattr(owner, name, old)
    return module, state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--signal", choices=sorted(SIGNALS))
    p.add_argument("--step", type=int, default=-1)
    p.add_argument("--point", choices=POINTS)
    args = p.parse_args(argv)
    try:
        run(args.out, resume=args.resume, signum=SIGNALS.get(args.signal), step=args.step, point=args.point)
    except KeyboardInterrupt as e:
        return getattr(e, "exit_code", 130)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
