"""Data-parallel training with ``torch.distributed`` (2 ``gloo`` processes on the CPU, as ``torchrun`` would start
them): the same parameters as one process with the same global batch, rank 0 alone writing, and an exact resume
after kill -9 or a SIGTERM that reaches only one process; encoding, test-time VI and the ``evaluate`` and ``ttvi``
commands sharded over the processes, with the results of one process."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from test_guides_ttvi import _images, _system

from probcaps.checkpoints import load_checkpoint
from probcaps.cli import main
from probcaps.errors import CheckpointError
from probcaps.inference.capsule_svi import encode_dataset
from probcaps.inference.distributed import World, init_from_env
from probcaps.inference.train import TrainConfig, train_loop
from probcaps.inference.ttvi import ttvi_batches
from probcaps.io import read_jsonl

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


def _infer(out_dir):
    """Encode 7 images one at a time, rotated (4 and 3 per process), and test-time VI on 5 in chunks of 2 (2 chunks and
    1 per process) and of 8 (rank 1 has none); saves what this process returns as ``out_dir/rank<RANK>.pt``."""
    model, guide = _system()
    digits, _ = _images(7)
    out = {"world": init_from_env().size, "encoded": encode_dataset(guide.encoder, digits, 1, rotation=40.0, seed=3)}
    for b in (2, 8):
        r = ttvi_batches(model, guide, digits[:5], batch_size=b, steps=3, progress=False, seed=7)
        out[f"ttvi{b}"] = [r.latents, r.elbo_start, r.elbo_end, r.elbo_trace]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save(out, Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.pt")


def _cli(out_dir, argv):
    assert main(argv) == 0


def _worker(rank, world, port, out_dir, fn, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    code = 0
    try:
        fn(out_dir, **kwargs)
    except KeyboardInterrupt as e:
        code = getattr(e, "exit_code", 130)
    except CheckpointError as e:
        print(e)
        code = 2
    except BaseException:
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


def _run(out_dir, world=2, fn=_train, **kwargs) -> list[int]:
    """Run ``fn`` (``_train``) in ``world`` forked processes joined by a gloo process group; their exit codes."""
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, out_dir, fn, kwargs)) for r in range(world)]
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


def test_shards_are_contiguous_and_cover_the_items():
    # catches: items lost or repeated at the shard boundaries of an odd count, or a process left out
    assert [World(2, r).shard(7) for r in range(2)] == [slice(0, 4), slice(4, 7)]
    assert [World(3, r).shard(2) for r in range(3)] == [slice(0, 1), slice(1, 2), slice(2, 2)]
    assert World().shard(5) == slice(0, 5) and World().gather([1, 2]) == [1, 2]


def test_two_processes_encode_and_run_ttvi_as_one(tmp_path, pyro_clean):
    # catches: a process returning only its own share, the shares joined out of order, rotations or TTVI seeds that
    # follow the position in a process's share instead of the image's index, a process with no chunk failing
    assert _run(tmp_path / "two", fn=_infer) == [0, 0]
    _infer(tmp_path / "one")
    one = torch.load(tmp_path / "one" / "rank0.pt", weights_only=False)
    assert one.pop("world") == 1 and one["encoded"].part_logits.shape[0] == 7
    for rank in range(2):
        two = torch.load(tmp_path / "two" / f"rank{rank}.pt", weights_only=False)
        assert two.pop("world") == 2
        torch.testing.assert_close(two, one, rtol=0, atol=1e-5)


@pytest.mark.parametrize("command", ["ttvi", "evaluate"])
def test_two_processes_run_the_commands_as_one_with_rank_0_writing(tiny_toml, tmp_path, no_reexec, pyro_clean, capfd,
                                                                   command):
    # catches: a command that only rank 0 runs (the other waits in a collective), both processes printing, the
    # results of a process's share written instead of the whole
    assert main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"), "--steps", "2", "--quiet"]) == 0
    argv = [command, "--checkpoint", str(tmp_path / "run" / "final.pt"), "--quiet",
            *(["--limit", "5", "--steps", "3", "--batch-size", "2"] if command == "ttvi" else ["--no-figures"])]
    results = {}
    for n in (1, 2):
        out = tmp_path / f"{n}.json" if command == "ttvi" else tmp_path / f"{n}" / "tiny_seed0.json"
        args = argv + (["--out", str(out)] if command == "ttvi" else ["--results-dir", str(out.parent)])
        capfd.readouterr()
        assert (main(args) == 0) if n == 1 else (_run(tmp_path, fn=_cli, argv=args) == [0, 0])
        assert capfd.readouterr().out.count("n_test" if command == "evaluate" else "written to") == 1
        results[n] = json.loads(out.read_text())["metrics"]
    keys = (["elbo_encoder_mean", "elbo_ttvi_mean", "recon_mse_encoder", "recon_mse_ttvi", "elbo_trace"]
            if command == "ttvi" else ["test_recon_mse", "probe_presence_pose_test_acc", "object_class_purity"])
    torch.testing.assert_close(*([r[k] for k in keys] for r in (results[2], results[1])), rtol=0, atol=1e-5)


def _mnist_probe(out_dir, argv):
    from probcaps.experiments import mnist_probe

    assert mnist_probe.main(argv) == 0


def test_two_processes_run_the_mnist_experiment_with_rank_0_writing(tiny_toml, tmp_path, no_reexec, pyro_clean, capfd):
    # catches: the seed summary and its printed line written by every process instead of rank 0 alone
    results = tmp_path / "results"
    argv = ["--config", str(tiny_toml), "--seeds", "0", "--out", str(tmp_path / "runs"), "--results-dir", str(results),
            "--checkpoint-out", "", "--quiet", "--set", "train.steps=2", "--set", "eval.figures=false"]
    assert _run(tmp_path, fn=_mnist_probe, argv=argv) == [0, 0]
    out = capfd.readouterr().out
    assert out.count("seed 0: probe") == 1 and out.count("tiny.json") == 1, out
    assert json.loads((results / "tiny.json").read_text())["metrics"]["per_seed"][0]["seed"] == 0

