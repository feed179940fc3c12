"""Data-parallel training with ``torch.distributed``, launched by ``torchrun`` (no launcher of our own)::

    torchrun --nproc_per_node=2 -m probcaps train --config experiments/configs/mnist.toml --out runs/mnist2

Every process computes the loss of its contiguous share of the global batch inside ``DistributedDataParallel``,
weighed so that the update is one process's on the whole batch (exactly, for a mean of per-item terms drawing no
random numbers).  Rank 0 alone writes the log and the checkpoints, which hold every process's RNG state and resume
only under the same number of processes.  Test-time work (encoding, test-time VI) splits its batches with
:meth:`World.shard` and joins them with :meth:`World.gather`: the same result as one process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from probcaps.data import iterate_batches
from probcaps.errors import ProbcapsError

__all__ = ["World", "PeerLost", "init_from_env"]


class PeerLost(ProbcapsError):
    """Another process of a ``torchrun`` run stopped (killed, or failed) while this one waited on it."""


def _peer_failure(e: BaseException) -> bool:
    """Whether ``e``, raised by a collective, says a peer process is gone (gloo's and NCCL's transport errors)."""
    dist_error = getattr(dist, "DistError", None)
    text = str(e)
    return (dist_error is not None and isinstance(e, dist_error)) or any(
        word in text for word in ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "Broken pipe",
                                  "connection refused", "Socket Timeout", "timed out"))


class World:
    """The processes working together (``size == 1``: a plain single-process run; every method is then free)."""

    def __init__(self, size: int = 1, rank: int = 0):
        self.size, self.rank = size, rank

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Around code that waits on the other processes (a collective, DDP's gradient all-reduce): a peer that
        died (``kill -9`` of one rank) becomes one line, :class:`PeerLost`, instead of the backend's traceback."""
        if self.size == 1:
            yield
            return
        try:
            yield
        except RuntimeError as e:
            if not _peer_failure(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerLost(f"process {self.rank} of {self.size}: another process of the run stopped ({first[:160]}); "
                           f"its last checkpoint is kept: restart the run with --resume") from None

    def barrier(self) -> None:
        if self.size > 1:
            with self.collective():
                dist.barrier()

    def seed(self, seed: int) -> int:
        """This process's seed: ``seed`` itself on rank 0 (a one-process run is unchanged), a stream derived from
        ``(seed, rank)`` elsewhere."""
        return seed if self.rank == 0 else int(np.random.SeedSequence([seed, self.rank]).generate_state(1)[0])

    def wrap(self, loss_module: nn.Module) -> nn.Module:
        """``DistributedDataParallel`` around the module whose forward computes the loss."""
        device = next(loss_module.parameters()).device
        return nn.parallel.DistributedDataParallel(loss_module,
                                                   device_ids=[device.index] if device.type == "cuda" else None)

    def shard(self, n: int) -> slice:
        """This process's contiguous block of ``n`` items (the first ``n % size`` processes take one more)."""
        q, r = divmod(n, self.size)
        start = self.rank * q + min(self.rank, r)
        return slice(start, start + q + (self.rank < r))

    def gather(self, items: list) -> list:
        """Every process's list ``items`` (picklable; tensors on the CPU), concatenated in rank order."""
        return items if self.size == 1 else [item for part in self.gather_objects(items) for item in part]

    def batches(self, images: torch.Tensor, batch_size: int, **kwargs) -> tuple[range, zip]:
        """This process's batch indices ``i`` and ``(i, x)`` of its share of the batches of ``images`` that
        :func:`~probcaps.data.iterate_batches` (``shuffle=False``, ``kwargs``) yields: every batch, and any rotation
        drawn for its images, the same under any number of processes."""
        mine = self.shard(-(-len(images) // batch_size))
        labels = torch.zeros(len(images), dtype=torch.long)
        batches = iterate_batches(images, labels, batch_size, shuffle=False, start_batch=mine.start, **kwargs)
        return range(mine.start, mine.stop), zip(range(mine.start, mine.stop), (x for x, _ in batches))

    def gather_objects(self, obj) -> list:
        """``obj`` of every process, in rank order (on every process)."""
        out = [None] * self.size
        with self.collective():
            dist.all_gather_object(out, obj)
        return out

    def agree_stop(self, signum: int | None) -> int | None:
        """The stop signal any process received (SIGTERM over SIGINT), the same on every process."""
        if self.size == 1:
            return signum
        return _signal_of(self._all_sum(torch.tensor(_one_hot(signum), dtype=torch.float64)))

    def reduce_step(self, loss_share: torch.Tensor, terms: dict, share: float, signum: int | None):
        """One collective a step: the global mean loss (the sum of the processes' ``loss_share``), the global means
        of the extra loss terms (weighed by each process's ``share`` of the items) and the agreed stop signal."""
        keys = sorted(terms)
        vec = self._all_sum(torch.cat([loss_share.reshape(1).to(torch.float64),
                                       torch.tensor([terms[k] * share for k in keys] + _one_hot(signum),
                                                    dtype=torch.float64, device=loss_share.device)]))
        return vec[0], {k: float(v) for k, v in zip(keys, vec[1:1 + len(keys)])}, _signal_of(vec[1 + len(keys):])

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if dist.get_backend() == "nccl" and not t.is_cuda:
            t = t.cuda()
        with self.collective():
            dist.all_reduce(t)
        return t.cpu()


def _one_hot(signum: int | None) -> list[float]:
    return [float(signum == signal.SIGINT), float(signum == signal.SIGTERM)]


def _signal_of(flags: torch.Tensor) -> int | None:  # flags on the CPU (from _all_sum)
    return signal.SIGTERM if flags[1] > 0 else signal.SIGINT if flags[0] > 0 else None


def init_from_env() -> World:
    """The :class:`World` of this process: the initialised process group's, else the one ``torchrun``'s
    environment describes (``WORLD_SIZE > 1``: joins it, ``nccl`` on CUDA with this process on GPU ``LOCAL_RANK``,
    else ``gloo``), else one process.  Call it before moving a model to ``cuda``."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_world_size(), dist.get_rank())
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    atexit.register(_destroy)
    return World(dist.get_world_size(), dist.get_rank())


def _destroy() -> None:
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):  # a peer already gone: nothing left to tear down with it
            dist.destroy_process_group()
