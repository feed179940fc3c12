"""Data-parallel training with ``torch.distributed`` (2 ``gloo`` processes on the CPU, as ``torchrun`` would start
them): the same parameters as one process with the same global batch, rank 0 alone writing, and an exact resume
after kill -9 or a SIGTERM that reaches only one process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket

import pytest
import torch
import torch.nn as nn

from probcaps.errors import CheckpointError
from probcaps.inference.train import TrainConfig, load_checkpoint, read_jsonl, train_loop

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")

CONFIG = dict(steps=8, batch_size=5, lr=0.05, warmup_steps=2, log_every=2, checkpoint_every=3)


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(18, 4, generator=g)
    return x, torch.sin(x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


def _train(out_dir, *, noisy=False, resume=False, stop=None):
    """A small regression net for ``CONFIG`` on 3 global batches of 5 per epoch; ``noisy``: the loss draws random
    numbers; ``stop = (rank, step index, signal)``: that process sends itself the signal inside that step."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x_all, y_all = _data()
    rank = int(os.environ.get("RANK", "0"))

    def batches(epoch, start):
        perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(epoch))
        for i in range(start, 3):
            idx = perm[5 * i:5 * i + 5]  # 5 rows: unequal shares (3 and 2) under 2 processes
            yield x_all[idx], y_all[idx]

    def loss_fn(batch, step_index):
        if stop and stop[0] == rank and int(step_index) == stop[1]:
            os.kill(os.getpid(), stop[2])
        x, y = batch
        pred = module(x)
        if noisy:
            pred = pred + 0.1 * torch.randn_like(pred)
        return (pred - y).pow(2).mean()

    return train_loop(module, loss_fn, batches, TrainConfig(**CONFIG), out_dir, resume=resume, progress=False,
                      schedules={"step_index": float})


def _worker(rank, world, port, out_dir, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    code = 0
    try:
        _train(out_dir, **kwargs)
    except KeyboardInterrupt as e:
        code = getattr(e, "exit_code", 130)
    except CheckpointError as e:
        print(e)
        code = 2
    except BaseException:  # noqa: BLE001 - reported through the exit code
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    os._exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(out_dir, world=2, **kwargs) -> list[int]:
    """Run ``_train`` in ``world`` forked processes joined by a gloo process group; their exit codes."""
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, out_dir, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    return codes


def _module(path):
    return load_checkpoint(path)["module"]


def test_two_processes_train_as_one_with_the_global_batch(tmp_path):
    # catches: shares not weighed into the global mean (twice the gradient), a process training on the whole batch
    # or on the other's rows, more than one process writing, the world size missing from the checkpoint
    assert _run(tmp_path / "two") == [0, 0]
    _train(tmp_path / "one")
    two, one = load_checkpoint(tmp_path / "two" / "final.pt"), load_checkpoint(tmp_path / "one" / "final.pt")
    for k, v in one["module"].items():
        assert torch.allclose(two["module"][k], v, rtol=0, atol=1e-5), k
    torch.manual_seed(0)
    initial = nn.Linear(4, 8).weight  # the first layer as _train builds it
    assert (two["module"]["0.weight"] - initial).abs().max() > 1e-3  # training moved it: the check is not vacuous
    assert two["world_size"] == 2 and len(two["rng_per_rank"]) == 2
    log_two, log_one = read_jsonl(tmp_path / "two" / "log.jsonl"), read_jsonl(tmp_path / "one" / "log.jsonl")
    assert [r["step"] for r in log_two] == [2, 4, 6, 8]  # one writer: no duplicated records
    assert [r["loss"] for r in log_two] == pytest.approx([r["loss"] for r in log_one], abs=1e-5)


@pytest.mark.parametrize("stop", [(0, 4, signal.SIGKILL), (1, 4, signal.SIGTERM)], ids=["kill-9", "sigterm-rank1"])
def test_two_processes_resume_exactly(tmp_path, stop):
    # catches: the processes' RNG states not all checkpointed (rank 1 would draw rank 0's noise after a resume),
    # the processes disagreeing on where to stop (one waits forever in a collective), a resume under another
    # number of processes accepted
    assert _run(tmp_path / "whole", noisy=True) == [0, 0]
    codes = _run(tmp_path / "cut", noisy=True, stop=stop)
    if stop[2] == signal.SIGKILL:
        assert codes[0] == -signal.SIGKILL  # rank 1 then fails in its next collective (torchrun stops it)
        assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["state"]["step"] == 3
    else:
        assert codes == [143, 143]  # both stop at the boundary after the step that one received SIGTERM in
        assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["state"]["step"] == 5
    assert _run(tmp_path / "cut", world=1, noisy=True, resume=True) == [2]  # another world size: refused
    assert _run(tmp_path / "cut", noisy=True, resume=True) == [0, 0]
    whole, cut = _module(tmp_path / "whole" / "final.pt"), _module(tmp_path / "cut" / "final.pt")
    for k, v in whole.items():
        assert torch.equal(cut[k], v), k
    strip = [{k: v for k, v in r.items() if k not in ("items_per_s", "wall_time_s")}
             for r in read_jsonl(tmp_path / "whole" / "log.jsonl")]
    assert strip == [{k: v for k, v in r.items() if k not in ("items_per_s", "wall_time_s")}
                     for r in read_jsonl(tmp_path / "cut" / "log.jsonl")]
