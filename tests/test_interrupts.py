"""Resume after any stop is exact: Ctrl-C, SIGTERM or kill -9 at any point of a step (before, during and after
its random draws, in the backward pass, in a checkpoint or log write, during start-up), then ``resume=True``,
gives the parameters, optimiser state and log of an uninterrupted run.

Each case trains ``tests/interrupt_target.py``'s small model in a forked process (a real process receiving a real
signal; forked because starting a fresh Python with torch costs seconds) and resumes it here.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import interrupt_target as target
import pytest
import torch

from probcaps.checkpoints import load_checkpoint
from probcaps.io import read_jsonl

TIMING_KEYS = ("items_per_s", "wall_time_s")
CASES = [(sig, point, 4) for sig in ("INT", "TERM", "KILL") for point in target.POINTS
         if point != "log_write" and not (sig == "KILL" and point.endswith("_twice"))]
CASES += [("KILL", "log_write", 4), ("INT", "startup", 0), ("KILL", "after_draws", 0), ("TERM", "after_draws", 7),
          ("INT", "batch", 3)]


def _child(out_dir, signum, step, point, resume=False):
    try:
        target.run(out_dir, signum=signum, step=step, point=point, resume=resume)
    except KeyboardInterrupt as e:
        os._exit(getattr(e, "exit_code", 130))
    except BaseException:
        os._exit(1)
    os._exit(0)


def _run_in_child(out_dir, signum=None, step=-1, point=None, resume=False) -> int:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_child, args=(out_dir, signum, step, point, resume))
    proc.start()
    proc.join(60)
    assert proc.exitcode is not None, "the training process hung"
    return proc.exitcode


def _without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert _run_in_child(out) == 0
    return load_checkpoint(out / "final.pt"), read_jsonl(out / "log.jsonl")


@pytest.mark.parametrize("sig,point,step", CASES, ids=[f"{s}-{p}-step{k}" for s, p, k in CASES])
def test_resume_after_a_signal_is_exact(tmp_path, reference, sig, point, step):
    # catches: a checkpoint holding the RNG state after a step's draws with the parameters before it (the resumed
    # run then draws different noise), a signal inside the zip writer crashing instead of checkpointing, a signal
    # during start-up lost, a half-written log line breaking the resume, the log window or schedule not resumed
    signum = target.SIGNALS[sig]
    code = _run_in_child(tmp_path, signum, step, point)
    assert code == {"INT": 130, "TERM": 143, "KILL": -signal.SIGKILL}[sig]
    assert not (tmp_path / "final.pt").exists()
    if sig != "KILL":
        # the signal is honoured at the boundary that follows it: the step it landed in is finished first
        expected = {"startup": 0, "checkpoint_write": 6, "backward_twice": step}.get(point, step + 1)
        assert load_checkpoint(tmp_path / "checkpoint.pt")["state"]["step"] == expected
    if point == "log_write":
        assert not (tmp_path / "log.jsonl").read_text().endswith("\n")  # the kill cut a record in half

    target.run(tmp_path, resume=True)

    ref_ckpt, ref_log = reference
    final = load_checkpoint(tmp_path / "final.pt")
    assert final["state"]["step"] == target.STEPS
    for k, v in ref_ckpt["module"].items():
        assert torch.equal(final["module"][k], v), k
    ref_opt, opt = ref_ckpt["optimiser"], final["optimiser"]
    assert ref_opt["param_groups"] == opt["param_groups"]
    for i, s in ref_opt["state"].items():
        for k, v in s.items():
            assert torch.equal(opt["state"][i][k], v), (i, k)
    assert torch.equal(final["rng"]["torch"], ref_ckpt["rng"]["torch"])
    assert _without_timing(read_jsonl(tmp_path / "log.jsonl")) == _without_timing(ref_log)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # a killed write's temporary file is gone


def test_the_log_holds_the_schedule_and_the_loss_terms(reference):
    # catches: schedule values or the loss's extra terms missing from the records the exactness checks compare
    _, ref_log = reference
    assert [r["step"] for r in ref_log] == [2, 4, 6, 8] and all("beta" in r and "noise" in r for r in ref_log)
    assert ref_log[1]["beta"] == pytest.approx(1.3)  # the value used by step index 3, the window's last


def test_resume_after_the_old_bug_would_differ(tmp_path, reference):
    # catches: a test set-up where the RNG state does not matter: restoring the wrong RNG state into an honest
    # checkpoint must change the final parameters
    assert _run_in_child(tmp_path, signal.SIGINT, 4, "after_draws") == 130
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    torch.manual_seed(99)
    ckpt["rng"]["torch"] = torch.get_rng_state()
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    target.run(tmp_path, resume=True)
    final = load_checkpoint(tmp_path / "final.pt")
    assert not torch.equal(final["module"]["out.weight"], reference[0]["module"]["out.weight"])


def test_a_signal_during_a_resumed_runs_start_up_keeps_its_step(tmp_path, reference):
    # catches: a signal during the start-up of a resumed run being lost (the run going to the end) or writing a
    # checkpoint of another step
    assert _run_in_child(tmp_path, signal.SIGINT, 4, "after_draws") == 130
    assert _run_in_child(tmp_path, signal.SIGTERM, 0, "startup", resume=True) == 143
    assert load_checkpoint(tmp_path / "checkpoint.pt")["state"]["step"] == 5
    target.run(tmp_path, resume=True)
    final = load_checkpoint(tmp_path / "final.pt")
    for k, v in reference[0]["module"].items():
        assert torch.equal(final["module"][k], v), k
