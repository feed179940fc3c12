"""Values that pass a key's range and still could crash: huge finite learning rates, poses, rotations and standard
deviations, part counts beyond the template grid; and the write paths under failure (no ``.tmp`` left, a results
JSON never without its table), repeated Ctrl-C and a lost peer process.  Each ends in one line or a clean run."""

from __future__ import annotations

import errno
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from probcaps import cli
from probcaps.errors import ConfigError, ProbcapsError
from probcaps.io import atomic_write, restored_on_failure, sweep_temporaries


@pytest.fixture(autouse=True)
def _setup(no_reexec, pyro_clean, seed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PROBCAPS_DATA", str(tmp_path / "no_data"))


@pytest.fixture
def tiny(tmp_path) -> Path:
    from conftest import TINY_TOML

    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    return tmp_path / "tiny.toml"


def one_line_or_clean(code, err: str, *needles) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    if code != 0:
        assert code == 2 and len(lines) == 1, (code, err)
        for needle in needles:
            assert needle in lines[0], err


# ------------------------------------------------------------------------------------------- training values


@pytest.mark.parametrize("lr", ["1e20", "1e30"])
def test_a_huge_finite_learning_rate_ends_in_one_line(lr, tiny, tmp_path, capsys):
    # catches: the update sending every pose far off the canvas, and the renderer's footprints turning the NaN
    # poses into a negative index (IndexError at step 1) instead of the NaN guard's one line
    code = cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--steps", "3", "--quiet",
                     "--set", f"train.lr={lr}", "--set", "train.warmup_steps=0"])
    err = capsys.readouterr().err
    one_line_or_clean(code, err, "step")
    assert code == 2 and ("NaN" in err or "nan" in err)


def test_a_learning_rate_adam_cannot_step_in_float32_is_refused(tiny, tmp_path, capsys):
    # catches: Adam's first step (ten times the rate) overflowing float32: "value cannot be converted to type
    # float without overflow" from inside the optimiser, in training and in test-time VI
    assert cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--quiet",
                     "--set", "train.lr=3e38"]) == 2
    one_line_or_clean(2, capsys.readouterr().err, str(tiny), "train.lr")
    assert cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--quiet", "--set",
                     "train.lr=1e37", "--set", 'train.lr_multipliers={"model.template"=10.0}']) == 2
    one_line_or_clean(2, capsys.readouterr().err, "train.lr_multipliers")
    assert cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--steps", "1", "--quiet"]) == 0
    assert cli.main(["ttvi", "--checkpoint", str(tmp_path / "run" / "final.pt"), "--limit", "2", "--steps", "2",
                     "--lr", "3e38", "--out", str(tmp_path / "t.json"), "--quiet"]) == 2
    one_line_or_clean(2, capsys.readouterr().err, "--lr")
    assert not (tmp_path / "t.json").exists()


def test_stds_beyond_float32_are_refused_and_large_ones_train(tiny, tmp_path, capsys):
    # catches: model.parent_pose_std = 1e308 passing the range table and overflowing float32 inside the model
    code = cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--quiet",
                     "--set", "model.parent_pose_std=1e308"])
    one_line_or_clean(code, capsys.readouterr().err, "model.parent_pose_std")
    assert code == 2
    for key in ("model.parent_pose_std", "model.pixel_std", "model.clutter_pose_std"):
        code = cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run2"), "--quiet", "--force",
                         "--steps", "1", "--set", f"{key}=1e15"])
        one_line_or_clean(code, capsys.readouterr().err, "step")


def test_more_parts_than_template_pixels_names_both_keys(tiny, tmp_path, capsys):
    # catches: a RuntimeError from the orthogonal template initialisation (t² dimensions hold at most t² templates)
    assert cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--quiet",
                     "--set", "model.num_parts=26"]) == 2
    err = capsys.readouterr().err
    one_line_or_clean(2, err, "model.num_parts", "model.template_size")
    assert not (tmp_path / "run").exists()


def test_as_many_parts_as_template_pixels_is_fine():
    from probcaps.models.capsule_model import CapsuleModel, CapsuleModelConfig

    model = CapsuleModel(CapsuleModelConfig(num_parts=25, template_size=5, num_parents=2, canvas_size=28))
    assert sum(p.numel() for p in model.parameters()) > 0


# ------------------------------------------------------------------------------------------- poses and angles


@pytest.mark.parametrize("footprint", [True, False], ids=["footprints", "full"])
@pytest.mark.parametrize("scale", [1e10, 1e20, 1e30, 1e37])
def test_the_renderer_copes_with_any_finite_pose(footprint, scale):
    # catches: a pose far off the canvas (or with a huge linear part, whose float32 determinant overflows)
    # rendering NaN or failing, or its gradient turning NaN
    from probcaps.render import render_over

    g = torch.Generator().manual_seed(0)
    templates = torch.rand(3, 2, 5, 5, generator=g)
    for part in ("translation", "linear", "both"):
        poses = torch.eye(3).repeat(2, 3, 1, 1)
        noise = torch.randn(2, 3, 2, 3, generator=g) * scale
        if part == "translation":
            poses[..., :2, 2] = noise[..., 2]
        elif part == "linear":
            poses[..., :2, :2] = noise[..., :2]
        else:
            poses[..., :2, :] = noise
        poses.requires_grad_(True)
        image, _ = render_over(templates, poses, 28, footprint=footprint)
        image.sum().backward()
        assert torch.isfinite(image).all() and torch.isfinite(poses.grad).all(), part
        assert (image >= 0).all()


def test_the_renderer_refuses_nothing_for_non_finite_poses():
    # catches: NaN poses (a diverging model's) becoming a negative footprint index instead of NaN pixels, which
    # the training loop's NaN guard reports in one line
    from probcaps.render import render_over

    poses = torch.eye(3).repeat(2, 3, 1, 1)
    poses[0, 0, 0, 0], poses[1, 2, 0, 2] = math.nan, math.inf
    image, _ = render_over(torch.rand(3, 2, 5, 5), poses, 28)
    assert image.shape == (2, 1, 28, 28)


def test_rotation_by_a_huge_angle_is_a_rotation_by_its_remainder():
    # catches: 1e300 degrees overflowing float32 to inf and the rotation's sine to NaN
    from probcaps.data import rotate

    x = torch.rand(3, 28, 28, generator=torch.Generator().manual_seed(1))
    for angle in (1e300, -1e300, 1e20, 725.0):
        out = rotate(x, angle)
        assert torch.isfinite(out).all()
        assert torch.equal(out, rotate(x, math.fmod(angle, 360.0)))
    assert torch.equal(rotate(x, 30.0), rotate(x, 390.0))
    with pytest.raises(ValueError, match="finite"):
        rotate(x, math.inf)


def test_ttvi_with_a_huge_rotation_runs(tiny, tmp_path, capsys):
    # catches: ttvi --rotate 1e300 failing inside the rotation
    assert cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--steps", "1", "--quiet"]) == 0
    code = cli.main(["ttvi", "--checkpoint", str(tmp_path / "run" / "final.pt"), "--limit", "2", "--steps", "1",
                     "--rotate", "1e300", "--out", str(tmp_path / "t.json"), "--quiet"])
    one_line_or_clean(code, capsys.readouterr().err)
    assert code == 0 and (tmp_path / "t.json").is_file()


# ------------------------------------------------------------------------------------------- writes


def test_no_temporary_file_is_left_after_a_write_fails(tmp_path):
    # catches: an exception inside the writer (not only an OSError) leaving .<name>.*.tmp behind
    path = tmp_path / "out.json"
    for error in (ValueError("bad"), KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")):
        def write(f, error=error):
            f.write(b"half")
            raise error
        with pytest.raises((ValueError, KeyboardInterrupt, OSError)):
            atomic_write(path, write)
        assert os.listdir(tmp_path) == []


def test_a_later_write_sweeps_the_temporary_files_a_killed_writer_left(tmp_path):
    # catches: .tmp files of a writer killed with kill -9 staying forever
    path = tmp_path / "out.json"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)  # a process that has exited
    stale = tmp_path / f".out.json.{dead}.abcd.tmp"
    alive = tmp_path / f".out.json.{os.getppid()}.efgh.tmp"  # a writer still running: kept
    other = tmp_path / f".other.json.{dead}.ijkl.tmp"  # another file's: not this write's to sweep
    for p in (stale, alive, other):
        p.write_text("half")
    atomic_write(path, lambda f: f.write(b"{}"))
    assert not stale.exists() and alive.exists() and other.exists() and path.read_bytes() == b"{}"
    sweep_temporaries(tmp_path / "other.json")
    assert not other.exists()


def test_a_failed_second_write_puts_the_first_file_back(tmp_path):
    # catches: the results JSON written and its table not (a full disk), while the error says nothing was
    # half-written
    path = tmp_path / "r.json"
    with pytest.raises(OSError):
        with restored_on_failure(path):
            path.write_text("new")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not path.exists()
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with restored_on_failure(path):
            atomic_write(path, lambda f: f.write(b"new"))
            raise KeyboardInterrupt
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]
    with restored_on_failure(path):
        atomic_write(path, lambda f: f.write(b"new"))
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["r.json"]


def test_evaluate_writes_its_json_and_table_or_neither(tiny, tmp_path, monkeypatch, capsys):
    # catches: a full disk at the table leaving a new results JSON without its table
    from probcaps.inference import evaluate
    from probcaps.io import OutputError

    assert cli.main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--steps", "1", "--quiet"]) == 0

    def full_disk(results_dir, name, text):
        raise OutputError(f"{Path(results_dir) / name}.md: cannot write (no space left on the device); nothing "
                          f"was half-written")

    monkeypatch.setattr(evaluate, "write_table", full_disk)
    code = cli.main(["evaluate", "--checkpoint", str(tmp_path / "run" / "final.pt"), "--results-dir",
                     str(tmp_path / "res"), "--no-figures", "--quiet"])
    one_line_or_clean(code, capsys.readouterr().err, "no space")
    assert code == 2 and not list((tmp_path / "res").glob("*.json"))


# ------------------------------------------------------------------------------------------- signals, peers


def test_a_repeated_signal_just_after_a_stop_is_dropped():
    # catches: a second Ctrl-C a few ms after the first raising KeyboardInterrupt inside tqdm's or the
    # interpreter's shutdown (a traceback after the one-line message)
    from probcaps.inference import train

    launched_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with train._StopSignals() as stop:
            stop.signum = signal.SIGINT  # the run stopped on a Ctrl-C
        grace = signal.getsignal(signal.SIGINT)
        assert isinstance(grace, train._RepeatGrace)
        signal.raise_signal(signal.SIGINT)  # dropped
        grace.deadline = 0.0  # the moment has passed: the handler from before is back
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with train._StopSignals():
            pass  # no signal: the previous handler comes straight back
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, launched_with)


def test_a_lost_peer_process_is_one_line(monkeypatch):
    # catches: gloo's "Connection closed by peer" traceback when one torchrun rank is killed with kill -9
    import torch.distributed as dist

    from probcaps.inference.distributed import PeerLost, World

    def dead_peer(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:29500\nmore lines of the backend")

    monkeypatch.setattr(dist, "barrier", dead_peer)
    monkeypatch.setattr(dist, "all_gather_object", dead_peer)
    world = World(size=2, rank=1)
    for call in (world.barrier, lambda: world.gather_objects({"a": 1})):
        with pytest.raises(PeerLost, match=r"^process 1 of 2: another process of the run stopped") as caught:
            call()
        assert isinstance(caught.value, ProbcapsError) and "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="not a peer"):  # other errors pass through untouched
        with world.collective():
            raise ValueError("not a peer")


def test_threads_and_names_validators_refuse_in_one_line():
    from probcaps.config import check_file_name, check_threads

    with pytest.raises(ConfigError, match="--threads"):
        check_threads(10_000)
    with pytest.raises(ConfigError, match="--name"):
        check_file_name("../x", "--name")


def _peer_worker(rank, port, out_dir, conn):
    import io
    from contextlib import redirect_stderr

    from test_distributed import _train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    err, code = io.StringIO(), 0
    try:
        with redirect_stderr(err):
            _train(out_dir, stop=(1, 4, signal.SIGKILL))  # rank 1 is killed inside step 4
    except ProbcapsError as e:
        err.write(f"error: {e}\n")
        code = 2
    except BaseException as e:
        import traceback

        err.write("Traceback\n" + "".join(traceback.format_exception(e)))
        code = 1
    conn.send((code, err.getvalue()))
    os._exit(code)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_kill_9_of_one_rank_is_one_line_on_the_other(tmp_path):
    # catches: the surviving process printing gloo's "Connection closed by peer" traceback
    import multiprocessing

    from test_distributed import _free_port

    ctx = multiprocessing.get_context("fork")
    port, (recv, send) = _free_port(), ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_peer_worker, args=(r, port, tmp_path / "run", send)) for r in range(2)]
    for p in procs:
        p.start()
    ready = recv.poll(90)
    for p in procs:
        p.join(30)
        if p.exitcode is None:
            p.kill()
    assert ready, "the surviving process hung"
    code, err = recv.recv()
    assert procs[1].exitcode == -signal.SIGKILL
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: process 0 of 2: another process of the run stopped"), err
