"""The training loop's guarantees: exact resume, the NaN guard, atomic checkpoints; checkpoint and config errors.

Each test says in a comment which bug it would catch.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import REAL_DATA_ROOT, requires_real_mnist

from probcaps.checkpoints import load_checkpoint, run_finished, save_checkpoint
from probcaps.data import placed_mnist
from probcaps.errors import CheckpointError, ConfigError, TrainingDiverged
from probcaps.geometry import restrict_pose6
from probcaps.inference.capsule_svi import (
    CapsuleSystem,
    load_experiment_config,
    load_images,
    load_trained,
    train_capsules,
)
from probcaps.inference.guides import EncoderConfig
from probcaps.inference.train import TrainConfig, make_elbo, train_loop
from probcaps.io import atomic_write, read_jsonl
from probcaps.models.capsule_model import CapsuleModelConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _setup(pyro_clean, seed):
    yield


def _cfg(tiny_toml, *overrides):
    return load_experiment_config(tiny_toml, list(overrides))


def _final_module_state(run_dir):
    return load_checkpoint(run_dir / "final.pt")["module"]


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------------------------- exact resume

class _Interrupt(Exception):
    pass


@pytest.mark.parametrize("how,optimiser", [("ctrl_c_at_step_5", "adam"), ("crash_at_step_4", "adam"),
                                          ("crash_at_step_4", "rmsprop_tf")])
def test_resume_gives_the_same_parameters_as_an_uninterrupted_run(tiny_toml, tmp_path, monkeypatch, how, optimiser):
    # catches: RNG states, optimiser moments, the lr schedule or the data position (epoch / batch) not being
    # checkpointed and restored exactly.  16 images in batches of 4: one run crosses an epoch boundary mid-resume
    # (crash after the step-3 checkpoint), the other is interrupted in the second epoch (Ctrl-C writes step 5).
    option = f"train.optimiser={optimiser}"
    cfg = _cfg(tiny_toml, option)  # steps = 6, checkpoint_every = 3
    state_a = train_capsules(cfg, tmp_path / "a", progress=False)
    assert state_a.step == 6

    stop_at = 5 if how == "ctrl_c_at_step_5" else 4
    error = KeyboardInterrupt if how == "ctrl_c_at_step_5" else _Interrupt
    original_loss = CapsuleSystem.loss
    calls = {"n": 0}

    def interrupted_loss(self, elbo, x):
        if calls["n"] == stop_at:  # the (stop_at + 1)-th step, before it draws any random number
            raise error()
        calls["n"] += 1
        return original_loss(self, elbo, x)

    monkeypatch.setattr(CapsuleSystem, "loss", interrupted_loss)
    with pytest.raises(error):
        train_capsules(_cfg(tiny_toml, option), tmp_path / "b", progress=False)
    monkeypatch.setattr(CapsuleSystem, "loss", original_loss)
    assert not (tmp_path / "b" / "final.pt").exists()
    saved = load_checkpoint(tmp_path / "b" / "checkpoint.pt")
    assert saved["state"]["step"] == (5 if how == "ctrl_c_at_step_5" else 3)

    state_b = train_capsules(_cfg(tiny_toml, option), tmp_path / "b", resume=True, progress=False)
    assert state_b.step == 6 and state_b.epoch == state_a.epoch
    final_a, final_b = _final_module_state(tmp_path / "a"), _final_module_state(tmp_path / "b")
    _assert_same_state(final_a, final_b)
    # the comparison is not vacuous: training moved the parameters after the checkpoint
    assert not torch.equal(saved["module"]["model.template_logits"], final_b["model.template_logits"])
    # and the log is one history: one record per step, in order (records past the checkpoint were dropped)
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))


def test_tf_rmsprop_takes_tensorflows_steps_computed_by_hand():
    # catches: the mean square started at zero (torch's RMSprop) or epsilon outside the square root, the momentum
    # not carried between steps, weight decay left out of the gradient, or groups' learning rates ignored
    from probcaps.inference.train import TFRMSprop
    p, q = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64)), nn.Parameter(torch.tensor([0.5],
                                                                                                  dtype=torch.float64))
    opt = TFRMSprop([{"params": [p], "lr": 0.1}, {"params": [q], "lr": 1.0}], weight_decay=0.5, eps=1e-2)
    c = torch.tensor([3.0, -0.25], dtype=torch.float64)
    want_p, want_q = [1.0, -2.0], [0.5]
    ms = {"p": [1.0, 1.0], "q": [1.0]}
    mom = {"p": [0.0, 0.0], "q": [0.0]}
    for _ in range(3):
        opt.zero_grad()
        ((c * p).sum() + q.sum() ** 2).backward()
        # by hand: g = dloss/dp + 0.5 p; ms <- 0.9 ms + 0.1 g^2; mom <- 0.9 mom + lr g / sqrt(ms + 0.01); p -= mom
        for name, values, grads, lr in (("p", want_p, [3.0, -0.25], 0.1), ("q", want_q, [2 * want_q[0]], 1.0)):
            for i, v in enumerate(values):
                g = grads[i] + 0.5 * v
                ms[name][i] = 0.9 * ms[name][i] + 0.1 * g * g
                mom[name][i] = 0.9 * mom[name][i] + lr * g / math.sqrt(ms[name][i] + 1e-2)
                values[i] = v - mom[name][i]
        opt.step()
        assert p.tolist() == pytest.approx(want_p, rel=1e-12) and q.tolist() == pytest.approx(want_q, rel=1e-12)
    # torch's own RMSprop (mean square from zero, epsilon outside the root) takes other steps from the same start
    r = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    other = torch.optim.RMSprop([r], lr=0.1, alpha=0.9, momentum=0.9, eps=1e-2, weight_decay=0.5)
    for _ in range(3):
        other.zero_grad()
        (c * r).sum().backward()
        other.step()
    assert not torch.allclose(r, p)


def test_unknown_optimiser_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^train.optimiser: must be one of adam, rmsprop_tf, got 'sgd'$"):
        TrainConfig(optimiser="sgd")


def test_different_seed_gives_different_parameters(tiny_toml, tmp_path):
    # catches: the exact-resume test passing only because training ignores its randomness altogether
    train_capsules(_cfg(tiny_toml, "train.steps=2"), tmp_path / "a", progress=False)
    train_capsules(_cfg(tiny_toml, "train.steps=2", "train.seed=1"), tmp_path / "b", progress=False)
    a, b = _final_module_state(tmp_path / "a"), _final_module_state(tmp_path / "b")
    assert not torch.equal(a["model.template_logits"], b["model.template_logits"])


# --------------------------------------------------------------------------------------------- NaN guard

def _toy(tmp_path, loss_fn, steps=5, checkpoint_every=1):
    module = nn.Linear(3, 1)
    cfg = TrainConfig(steps=steps, batch_size=2, lr=0.01, warmup_steps=1, log_every=1,
                      checkpoint_every=checkpoint_every)

    def batches(epoch, start):
        for i in range(start, 4):
            yield torch.full((2, 3), float(i + epoch))

    return module, lambda: train_loop(module, lambda x: loss_fn(module, x), batches, cfg, tmp_path, progress=False)


def test_run_finished_needs_a_final_model_of_at_least_the_asked_steps(tmp_path):
    # catches: --resume reusing a finished run when train.steps was raised (it then silently re-evaluated the
    # shorter run), or treating a run with only a periodic checkpoint as finished
    assert not run_finished(tmp_path, 1)  # nothing there
    _, run = _toy(tmp_path, lambda module, x: module(x).pow(2).mean(), steps=5, checkpoint_every=2)
    run()
    assert run_finished(tmp_path, 5) and run_finished(tmp_path, 3)
    assert not run_finished(tmp_path, 6)
    (tmp_path / "final.pt").unlink()
    assert (tmp_path / "checkpoint.pt").is_file() and not run_finished(tmp_path, 1)


@pytest.mark.parametrize("cut", ["killed_in_callback", "ctrl_c_in_callback", "ctrl_c_off_schedule", "none"])
def test_on_checkpoint_runs_once_per_scheduled_step_across_cuts_and_resumes(tmp_path, cut):
    # catches: a run killed inside an evaluation callback resuming from the checkpoint already written for that
    # step and never evaluating it (the seeds' evaluation grids then differ); a Ctrl-C evaluating at an
    # off-schedule step; a resumed finished run calling the callback for its last step a second time
    done, calls = [], {"n": 0}
    raise_at = {"killed_in_callback": (4, _Interrupt), "ctrl_c_in_callback": (4, KeyboardInterrupt)}.get(cut)

    def on_checkpoint(state):
        calls["n"] += 1
        if raise_at and state.step == raise_at[0] and calls["n"] == 2:  # the first call at step 4
            raise raise_at[1]()
        done.append(state.step)

    def loss_fn(module, x):
        calls["losses"] = calls.get("losses", 0) + 1
        if cut == "ctrl_c_off_schedule" and calls["losses"] == 6:  # after 5 completed steps
            raise KeyboardInterrupt
        return module(x).pow(2).mean()

    module = nn.Linear(3, 1)
    cfg = TrainConfig(steps=6, batch_size=2, lr=0.01, warmup_steps=1, log_every=1, checkpoint_every=2)

    def batches(epoch, start):
        for i in range(start, 4):
            yield torch.full((2, 3), float(i + epoch))

    def run(resume):
        return train_loop(module, lambda x: loss_fn(module, x), batches, cfg, tmp_path, progress=False,
                          resume=resume, on_checkpoint=on_checkpoint)

    if cut == "none":
        run(False)
    else:
        with pytest.raises((_Interrupt, KeyboardInterrupt)):
            run(False)
        ckpt_step = load_checkpoint(tmp_path / "checkpoint.pt")["state"]["step"]
        assert ckpt_step == {"killed_in_callback": 2, "ctrl_c_in_callback": 4, "ctrl_c_off_schedule": 5}[cut]
        run(True)
    run(True)  # a finished run, resumed again
    assert done == [2, 4, 6]


def test_nan_loss_stops_training_without_writing_the_broken_model(tmp_path):
    # catches: a NaN loss being stepped on (parameters become NaN) or written to final.pt / checkpoint.pt
    calls = {"n": 0}

    def loss_fn(module, x):
        calls["n"] += 1
        loss = module(x).pow(2).mean()
        return loss * float("nan") if calls["n"] == 3 else loss  # step index 2

    module, run = _toy(tmp_path, loss_fn)
    with pytest.raises(TrainingDiverged, match=r"step 2\b") as exc:
        run()
    assert "loss is nan" in str(exc.value).lower()  # the loss check, not only the gradient check, fired
    assert not (tmp_path / "final.pt").exists()
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["state"]["step"] == 2  # the last good step
    assert all(torch.isfinite(v).all() for v in ckpt["module"].values())
    assert all(torch.isfinite(p).all() for p in module.parameters())


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


def test_nan_gradient_stops_training(tmp_path):
    # catches: a finite loss with NaN gradients slipping through (the optimiser would NaN every parameter)
    calls = {"n": 0}

    def loss_fn(module, x):
        calls["n"] += 1
        out = module(x)
        if calls["n"] == 2:
            out = _NaNGrad.apply(out)
        return out.pow(2).mean()

    module, run = _toy(tmp_path, loss_fn)
    with pytest.raises(TrainingDiverged, match=r"step 1\b.*gradient"):
        run()
    assert not (tmp_path / "final.pt").exists()
    assert all(torch.isfinite(p).all() for p in module.parameters())


# --------------------------------------------------------------------------------------------- atomic writes

def _failing_save(monkeypatch, fail_on_call: int):
    real_save = torch.save
    calls = {"n": 0}

    def save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            f.write(b"PK\x03\x04 half a checkpoint")  # a partial write, then the crash
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_save_checkpoint_leaves_old_file_intact(tmp_path, monkeypatch):
    # catches: writing the checkpoint in place (a crash mid-write would leave a truncated, unloadable file)
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"module": {"w": torch.arange(3)}}, path)
    _failing_save(monkeypatch, 1)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint({"module": {"w": torch.zeros(3)}}, path)
    assert torch.equal(torch.load(path)["module"]["w"], torch.arange(3))
    assert os.listdir(tmp_path) == ["checkpoint.pt"]  # no temporary file left behind


def test_a_ctrl_c_inside_an_atomic_write_waits_for_the_file(tmp_path):
    # catches: a Ctrl-C landing inside the zip writer aborting the write (RuntimeError from the writer, or a
    # missing file) instead of stopping after it
    import signal

    path = tmp_path / "checkpoint.pt"

    def write(f):
        torch.save({"w": torch.arange(3)}, f)
        signal.raise_signal(signal.SIGINT)  # to this thread: delivered now, in the middle of the write
        f.write(b"")

    # Python's own Ctrl-C handler, whatever the launcher left: a job started in the background ignores SIGINT
    launched_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            atomic_write(path, write)
        assert torch.equal(torch.load(path)["w"], torch.arange(3))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, launched_with)


def test_train_loop_checkpoint_survives_a_failed_save(tmp_path, monkeypatch):
    # catches: the training loop writing checkpoints non-atomically (saves: step 2, then final checkpoint.pt fails)
    module, run = _toy(tmp_path, lambda m, x: m(x).pow(2).mean(), steps=4, checkpoint_every=2)
    _failing_save(monkeypatch, 2)
    with pytest.raises(OSError, match="simulated"):
        run()
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["state"]["step"] == 2
    assert not (tmp_path / "final.pt").exists()
    assert sorted(os.listdir(tmp_path)) == [".lock", "checkpoint.pt", "log.jsonl"]  # no temporary file


# --------------------------------------------------------------------------------------------- checkpoint errors

@pytest.fixture
def trained_run(tiny_toml, tmp_path):
    train_capsules(_cfg(tiny_toml, "train.steps=1"), tmp_path / "run", progress=False)
    return tmp_path / "run" / "final.pt"


def test_train_capsules_passes_the_prior_anneal_of_each_step_across_a_resume(tiny_toml, tmp_path, monkeypatch):
    # catches: the object prior's anneal not reaching the model, evaluated at the wrong step, or restarted by a
    # resume (the model keeps no step of its own)
    seen = []
    loss = CapsuleSystem.loss

    def recording_loss(self, elbo, x, expected_parents=None):
        seen.append(expected_parents)
        return loss(self, elbo, x, expected_parents)

    monkeypatch.setattr(CapsuleSystem, "loss", recording_loss)
    anneal = ["model.expected_parents=0.5", "model.expected_parents_start=1.5", "model.prior_anneal_steps=2"]
    train_capsules(_cfg(tiny_toml, "train.steps=2", "train.checkpoint_every=1", *anneal), tmp_path, progress=False)
    train_capsules(_cfg(tiny_toml, "train.steps=4", *anneal), tmp_path, resume=True, progress=False)
    assert seen == [1.5, 1.0, 0.5, 0.5]  # start + (end − start) · min(step, 2) / 2 at steps 0, 1 | 2, 3
    seen.clear()
    train_capsules(_cfg(tiny_toml, "train.steps=1"), tmp_path / "fixed", progress=False)
    assert seen == [None]  # no anneal: the model's own expected_parents


def test_load_trained_round_trip(trained_run):
    # catches: load_trained rebuilding a different config or not loading the saved weights
    cfg, system = load_trained(trained_run)
    assert cfg["model"].num_parts == 3 and cfg["model"].num_parents == 2 and cfg["name"] == "tiny"
    assert cfg["encoder"].channels == [8, 8]
    _assert_same_state(system.state_dict(), load_checkpoint(trained_run)["module"])
    assert cfg["train_state"]["step"] == 1


def test_the_guide_emits_object_poses_inside_the_models_group(trained_run):
    # catches: an encoder whose object poses keep coordinates the model ignores (read by every pose readout)
    configs = torch.load(trained_run, weights_only=True)["metadata"]["configs"]
    x = torch.rand(3, 1, configs["model"]["canvas_size"], configs["model"]["canvas_size"])
    for group in ("affine", "similarity"):
        torch.manual_seed(0)
        system = CapsuleSystem(CapsuleModelConfig(**{**configs["model"], "object_pose": group}),
                               EncoderConfig(**configs["encoder"]))
        poses = system.encoder.encode(x).parent_poses
        in_group = torch.allclose(restrict_pose6(poses, "similarity"), poses, atol=1e-6)
        assert in_group == (group == "similarity")


def test_checkpoint_of_another_shape_names_file_and_key(trained_run, tmp_path):
    # catches: a raw torch size-mismatch dump (or, worse, silent partial loading) for a config change
    ckpt = torch.load(trained_run, weights_only=True)
    ckpt["metadata"]["configs"]["model"]["num_parts"] = 4
    other = tmp_path / "m4.pt"
    torch.save(ckpt, other)
    with pytest.raises(CheckpointError) as exc:
        load_trained(other)
    msg = str(exc.value)
    assert str(other) in msg and "\n" not in msg
    key = msg.split("'")[1]
    assert key in ckpt["module"], msg
    configs = ckpt["metadata"]["configs"]
    system4 = CapsuleSystem(CapsuleModelConfig(**configs["model"]), EncoderConfig(**configs["encoder"]))
    assert system4.state_dict()[key].shape != ckpt["module"][key].shape


def test_checkpoint_missing_corrupt_or_foreign(tmp_path, trained_run):
    # catches: tracebacks instead of one-line CheckpointErrors naming the file
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_trained(tmp_path / "missing.pt")
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt.pt"):
        load_trained(bad)
    foreign = tmp_path / "foreign.pt"
    ckpt = torch.load(trained_run, weights_only=True)
    ckpt["metadata"]["kind"] = "lenet"
    torch.save(ckpt, foreign)
    with pytest.raises(CheckpointError, match="foreign.pt.*not a capsule-model"):
        load_trained(foreign)
    with pytest.raises(ConfigError, match="model.bogus"):
        load_trained(trained_run, overrides=["model.bogus=1"])


@pytest.mark.parametrize("path", sorted((ROOT / "checkpoints").glob("*.pt")), ids=lambda p: p.name)
def test_every_committed_checkpoint_loads_and_scores_images(path):
    # catches: a removed option, or state the model no longer keeps, that leaves a committed checkpoint unloadable
    cfg, system = load_trained(path)
    # named after its recipe (what its evaluation and exports are named after), or its recipe and seed
    assert path.stem in (cfg["name"], f"{cfg['name']}_seed{cfg['train'].seed}")
    x = torch.rand(2, 1, cfg["model"].canvas_size, cfg["model"].canvas_size)
    latents = system.encoder.encode(x)
    assert torch.isfinite(latents.parent_logits).all() and torch.isfinite(latents.part_poses).all()
    loss = make_elbo().loss(system.model, system.guide, x)
    assert math.isfinite(loss)


def test_removed_options_load_when_off_and_fail_in_one_line_when_on(trained_run, tmp_path):
    # catches: an old checkpoint refused for carrying a removed option at its off value (or its old step counter),
    # or one trained with the option on silently rebuilt without it
    from probcaps.inference.capsule_svi import REMOVED_OPTIONS

    ckpt = torch.load(trained_run, weights_only=True)
    for section, options in REMOVED_OPTIONS.items():
        ckpt["metadata"]["configs"][section].update({option: off for option, (off, _) in options.items()})
    ckpt["module"]["model.prior_step"] = torch.tensor(7)
    old = tmp_path / "old.pt"
    torch.save(ckpt, old)
    _, system = load_trained(old)
    _assert_same_state(system.state_dict(), load_checkpoint(trained_run)["module"])
    ckpt["metadata"]["configs"]["model"]["guide_usage_weight"] = 100.0
    torch.save(ckpt, old)
    with pytest.raises(CheckpointError) as exc:
        load_trained(old)
    msg = str(exc.value)
    assert "\n" not in msg and "model.guide_usage_weight" in msg and "e00fb33" in msg and "old.pt" in msg
    ckpt["metadata"]["configs"]["model"]["guide_usage_weight"] = 0.0
    ckpt["metadata"]["configs"]["encoder"]["object_pose_scales"] = True  # removed later: its own commit is named
    torch.save(ckpt, old)
    with pytest.raises(CheckpointError, match="encoder.object_pose_scales.*removed after commit a9c4f67"):
        load_trained(old)


# --------------------------------------------------------------------------------------------- config errors

def test_the_mnist_recipe_is_named_after_its_file_and_the_demo_is_a_diff_on_it():
    # catches: a recipe writing another recipe's results (name != file stem), or the demo drifting from mnist.toml in
    # a key it does not mean to change
    configs = ROOT / "experiments" / "configs"
    mnist, demo = (load_experiment_config(configs / f"{name}.toml") for name in ("mnist", "demo"))
    assert (mnist["name"], demo["name"]) == ("mnist", "demo")
    changed = {f"{section}.{key}" for section in ("data", "model", "encoder", "train", "eval")
               for key, value in demo[section].to_dict().items() if value != getattr(mnist[section], key)}
    assert changed == {"data.test_limit", "model.prior_anneal_steps", "train.steps", "train.warmup_steps",
                       "train.compile", "eval.probe_train_limit", "eval.layer_readouts", "eval.nonlinear_probes"}


def test_the_mnist_recipe_is_the_config_its_models_were_trained_and_read_with():
    # catches: mnist.toml (or rotated_training.toml, which stands on it) drifting from the models behind
    # results/mnist_probe/mnist.json and results/rotated_training/rotated_training.json
    configs = ROOT / "experiments" / "configs"
    for config, results in (("mnist", "mnist_probe/mnist.json"),
                            ("rotated_training", "rotated_training/rotated_training.json")):
        cfg = load_experiment_config(configs / f"{config}.toml")
        assert cfg["name"] == config
        stored = json.loads((ROOT / "results" / results).read_text())["provenance"]["configs"]
        for section in ("data", "model", "encoder", "train", "eval"):
            recipe, default = cfg[section].to_dict(), type(cfg[section])().to_dict()
            # an option added since the results were written is in the recipe at its default (its off value)
            assert {k: v for k, v in recipe.items() if k not in stored[section]} == \
                {k: default[k] for k in recipe if k not in stored[section]}, (config, section)
            assert {k: recipe[k] for k in stored[section]} == stored[section], (config, section)


def test_unknown_config_key_names_key_and_file(tmp_path, tiny_toml):
    # catches: a typo in a config silently falling back to the default
    path = tmp_path / "typo.toml"
    path.write_text(tiny_toml.read_text().replace("num_parts = 3", "num_part = 3"))
    with pytest.raises(ConfigError) as exc:
        load_experiment_config(path)
    assert "'num_part'" in str(exc.value) and str(path) in str(exc.value)
    path.write_text(tiny_toml.read_text() + "\n[optimiser]\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"typo\.toml.*'optimiser'"):
        load_experiment_config(path)


def test_invalid_toml_names_file(tmp_path):
    # catches: a tomllib traceback instead of a one-line error naming the file
    path = tmp_path / "broken.toml"
    path.write_text("[model\nnum_parts = 3\n")
    with pytest.raises(ConfigError, match=r"broken\.toml.*not valid TOML"):
        load_experiment_config(path)
    with pytest.raises(ConfigError, match="nowhere.toml"):
        load_experiment_config(tmp_path / "nowhere.toml")


def test_config_types_and_consistency_checked(tmp_path, tiny_toml):
    # catches: wrong value types accepted, or a data canvas that differs from the model's
    with pytest.raises(ConfigError, match="model.num_parts"):
        load_experiment_config(tiny_toml, ['model.num_parts="three"'])
    with pytest.raises(ConfigError, match="canvas_size"):
        load_experiment_config(tiny_toml, ["model.canvas_size=30"])
    with pytest.raises(ConfigError, match="dataset"):
        load_experiment_config(tiny_toml, ["data.dataset=cifar"])
    cfg = load_experiment_config(tiny_toml, ["train.lr=1"])  # an int where a float is expected is fine
    assert cfg["train"].lr == 1.0 and isinstance(cfg["train"].lr, float)


def test_config_base_is_merged_key_by_key(tmp_path, tiny_toml):
    # catches: a child config replacing a whole section of its base, or its own keys losing to the base's
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.toml").write_text(tiny_toml.read_text())
    mid = tmp_path / "sub" / "mid.toml"
    mid.write_text('base = "../base.toml"\n[train]\nlr = 0.5\n')
    child = tmp_path / "sub" / "child.toml"
    child.write_text('base = "mid.toml"\nname = "child"\n[train]\nsteps = 7\n')
    plain, cfg = load_experiment_config(tiny_toml), load_experiment_config(child, ["train.batch_size=3"])
    assert cfg["name"] == "child" and cfg["train"].steps == 7 and cfg["train"].lr == 0.5
    assert cfg["train"].batch_size == 3  # --set still wins over every file
    assert cfg["model"] == plain["model"] and cfg["train"].warmup_steps == plain["train"].warmup_steps


def test_config_base_errors_name_the_files(tmp_path, tiny_toml):
    # catches: a missing base, a cycle of bases (endless recursion) or a non-string base giving a raw traceback
    child = tmp_path / "child.toml"
    child.write_text('base = "missing.toml"\n')
    with pytest.raises(ConfigError, match=r"child\.toml: base config .*missing\.toml does not exist"):
        load_experiment_config(child)
    (tmp_path / "a.toml").write_text('base = "b.toml"\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_experiment_config(tmp_path / "a.toml")
    child.write_text("base = 3\n")
    with pytest.raises(ConfigError, match=r"child\.toml: 'base' must be a path"):
        load_experiment_config(child)


# --------------------------------------------------------------------------------------------- data for training

def test_fake_mnist_root_is_used_by_placed_mnist(fake_mnist_root):
    # catches: PROBCAPS_DATA not being honoured when no data_dir is given
    placed = placed_mnist("test", canvas=40, verify=False, limit=5)
    assert placed.images.shape == (5, 40, 40) and placed.images.dtype == torch.uint8


def test_synthetic_load_images_respects_limits(tiny_toml):
    # catches: the experiment's data limits or canvas being ignored
    cfg = _cfg(tiny_toml)
    images, labels = load_images(cfg["data"], "train")
    assert images.shape == (16, 28, 28) and labels.shape == (16,)
    test_images, _ = load_images(cfg["data"], "test")
    assert not torch.equal(images, test_images)


@requires_real_mnist
def test_real_mnist_load_images():
    # catches: the real-data path (verified md5s, placement on the 40x40 canvas) breaking
    cfg = load_experiment_config(None, ["data.train_limit=8"])
    images, labels = load_images(cfg["data"], "train", data_dir=REAL_DATA_ROOT)
    assert images.shape == (8, 40, 40) and labels.shape == (8,)
    assert images.dtype == torch.uint8 and int(images.max()) > 200


def test_sigterm_writes_a_checkpoint_and_stops(tiny_toml, tmp_path, monkeypatch, pyro_clean):
    # catches: a scheduler's or `kill`'s SIGTERM losing the steps since the last periodic checkpoint
    import signal

    from probcaps.inference.train import Terminated, _RepeatGrace

    original_loss = CapsuleSystem.loss
    calls = {"n": 0}

    def loss_then_sigterm(self, elbo, x):
        if calls["n"] == 4:
            signal.raise_signal(signal.SIGTERM)  # to this thread, inside the 5th step: honoured at its end
        calls["n"] += 1
        return original_loss(self, elbo, x)

    monkeypatch.setattr(CapsuleSystem, "loss", loss_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        train_capsules(_cfg(tiny_toml), tmp_path / "run", progress=False)
    # the caller's handler is back, behind a moment's grace that drops a repeat of the signal
    handler = signal.getsignal(signal.SIGTERM)
    assert isinstance(handler, _RepeatGrace) and handler.previous is before
    signal.signal(signal.SIGTERM, before)
    saved = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert saved["state"]["step"] == 5 and not (tmp_path / "run" / "final.pt").exists()


# --------------------------------------------------------------------------------------------- faults refused

def _linear_run(tmp_path, steps=4, lr=0.01, stop_at_call=None, final_lr_fraction=0.1, **loop):
    """A deterministic 1-layer regression trained into ``tmp_path`` (returns the module and the final state);
    ``stop_at_call``: Ctrl-C inside that call of the loss (1-based)."""
    torch.manual_seed(0)
    module = nn.Linear(3, 1)
    cfg = TrainConfig(steps=steps, batch_size=2, lr=lr, warmup_steps=1, log_every=1, checkpoint_every=2,
                      final_lr_fraction=final_lr_fraction)
    calls = {"n": 0}

    def batches(epoch, start):
        for i in range(start, 4):
            yield torch.full((2, 3), float(i + epoch + 1))

    def loss_fn(x):
        calls["n"] += 1
        if calls["n"] == stop_at_call:
            raise KeyboardInterrupt
        return (module(x) - 1).pow(2).mean()

    state = train_loop(module, loss_fn, batches, cfg, tmp_path, progress=False, **loop)
    return module, state


def test_an_update_that_makes_parameters_non_finite_stops_and_is_never_checkpointed(tmp_path, monkeypatch):
    # catches: the guard checking only the loss and gradients (a huge learning rate makes every parameter inf
    # while both stay finite), and a checkpoint written with those parameters.  The config refuses such a rate
    # (train.lr above ADAM_MAX_LR); the guard is the last line of defence, so that check is lifted here
    from probcaps.inference import train as train_module

    monkeypatch.setattr(train_module, "adam_lr_problem", lambda lr: None)
    with pytest.raises(TrainingDiverged, match=r"step \d+: the update made '(weight|bias)' NaN or Inf"):
        _linear_run(tmp_path, lr=1e38, steps=6)
    for name in ("checkpoint.pt", "final.pt"):
        if (tmp_path / name).exists():
            ckpt = load_checkpoint(tmp_path / name)
            assert all(torch.isfinite(v).all() for v in ckpt["module"].values())


def test_load_checkpoint_refuses_non_finite_parameters(tmp_path):
    # catches: `probcaps evaluate` scoring a diverged model written by an older version
    _linear_run(tmp_path)
    ckpt = torch.load(tmp_path / "final.pt", weights_only=True)
    ckpt["module"]["bias"] = torch.tensor([float("nan")])
    torch.save(ckpt, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(tmp_path / "nan.pt")
    assert "nan.pt" in str(exc.value) and "'bias'" in str(exc.value) and "\n" not in str(exc.value)


def test_a_checkpoint_with_a_non_finite_tensor_is_never_written(tmp_path, monkeypatch):
    # catches: a NaN reaching the optimiser state (or a buffer) and being saved as a resumable checkpoint
    real_step = torch.optim.Adam.step

    def poisoned_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        for state in self.state.values():
            state["exp_avg_sq"].fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.Adam, "step", poisoned_step)
    with pytest.raises(TrainingDiverged, match="exp_avg_sq.*refused to write"):
        _linear_run(tmp_path)
    assert not (tmp_path / "checkpoint.pt").exists() and not (tmp_path / "final.pt").exists()


def test_a_second_run_into_the_same_folder_is_refused(tmp_path):
    # catches: two runs writing one folder at once (one run's log and checkpoints silently lost)
    from probcaps.io import RunFolderBusy, RunLock

    with RunLock(tmp_path):
        with pytest.raises(RunFolderBusy, match=rf"{tmp_path}.*pid {os.getpid()}"):
            _linear_run(tmp_path)
    _linear_run(tmp_path)  # released with its holder
    assert load_checkpoint(tmp_path / "final.pt")["state"]["step"] == 4


def test_the_lock_of_a_killed_run_does_not_block(tmp_path):
    # catches: a lock file left by kill -9 refusing every later run (flock dies with its process)
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print(1, flush=True); "
                               "time.sleep(60)", str(tmp_path / ".lock")], stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == b"1"
    from probcaps.io import RunFolderBusy

    with pytest.raises(RunFolderBusy):
        _linear_run(tmp_path)
    holder.kill()
    holder.wait()
    _linear_run(tmp_path)


def test_a_damaged_log_line(tmp_path):
    # catches: a record half-written by a kill making --resume crash; a damaged record before the last passing
    # silently
    from probcaps.errors import DataError
    from probcaps.io import read_jsonl, truncate_log

    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_jsonl(log)] == [1, 2]
    truncate_log(log, 5)
    assert log.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(DataError, match=r"log\.jsonl, line 2"):
        read_jsonl(log)


def test_resume_applies_a_changed_learning_rate_and_logs_it(tmp_path, capsys):
    # catches: --resume --set train.lr=... training with the checkpoint's learning rate while recording the new one
    with pytest.raises(KeyboardInterrupt):
        _linear_run(tmp_path, steps=4, lr=0.01, stop_at_call=3, final_lr_fraction=1.0)  # checkpoint of step 2
    _linear_run(tmp_path, steps=4, lr=0.05, final_lr_fraction=1.0, resume=True)
    assert "learning rate changed from 0.01 to 0.05" in capsys.readouterr().err
    records = read_jsonl(tmp_path / "log.jsonl")
    assert [r["lr"] for r in records] == [0.01, 0.01, 0.05, 0.05]
    assert records[2]["lr_changes"] == [{"step": 2, "from": 0.01, "to": 0.05}] and "lr_changes" not in records[3]
    final = load_checkpoint(tmp_path / "final.pt")
    assert final["lr_changes"] == records[2]["lr_changes"] and final["scheduler"]["base_lrs"] == [0.05]
    # the update used it: the same run trained at 0.05 from the start moves the same way from step 2 on
    with pytest.raises(KeyboardInterrupt):
        _linear_run(tmp_path / "b", steps=4, lr=0.01, stop_at_call=3, final_lr_fraction=1.0)
    ckpt = load_checkpoint(tmp_path / "b" / "checkpoint.pt")
    module = nn.Linear(3, 1)
    module.load_state_dict(ckpt["module"])
    optimiser = torch.optim.Adam(module.parameters(), lr=0.05)
    optimiser.load_state_dict(ckpt["optimiser"])
    optimiser.param_groups[0]["lr"] = 0.05
    for i in (2, 3):
        optimiser.zero_grad()
        (module(torch.full((2, 3), float(i + 1))) - 1).pow(2).mean().backward()
        optimiser.step()
    assert torch.allclose(module.weight, final["module"]["weight"], rtol=0, atol=1e-7)


def test_an_unchanged_config_resumes_with_bit_identical_learning_rates(tmp_path, capsys):
    # catches: re-deriving the learning rates on resume perturbing them (the resume would no longer be exact)
    _linear_run(tmp_path / "a", steps=4)
    with pytest.raises(KeyboardInterrupt):
        _linear_run(tmp_path / "b", steps=4, stop_at_call=2)
    _linear_run(tmp_path / "b", steps=4, resume=True)
    assert "learning rate changed" not in capsys.readouterr().err
    assert read_jsonl(tmp_path / "a" / "log.jsonl")[-1]["lr"] == read_jsonl(tmp_path / "b" / "log.jsonl")[-1]["lr"]
    a, b = load_checkpoint(tmp_path / "a" / "final.pt"), load_checkpoint(tmp_path / "b" / "final.pt")
    _assert_same_state(a["module"], b["module"])
    assert b["lr_changes"] == []


@pytest.mark.parametrize("key,value", [("steps", 0), ("steps", -3), ("batch_size", 0), ("log_every", 0),
                                       ("checkpoint_every", 0), ("lr", 0.0), ("lr", float("nan")),
                                       ("grad_clip", 0.0), ("warmup_steps", -1), ("final_lr_fraction", 1.5)])
def test_training_config_ranges_are_checked(key, value):
    # catches: `--steps 0` writing an untrained final.pt, and other values the loop cannot honour
    with pytest.raises(ConfigError, match=rf"^train\.{key}: must be"):
        TrainConfig(**{key: value})


def test_steps_zero_from_a_config_file_is_one_line(tiny_toml):
    with pytest.raises(ConfigError, match="train.steps: must be >= 1, got 0"):
        _cfg(tiny_toml, "train.steps=0")


def test_the_jit_elbo_with_the_object_information_term_is_one_line_before_anything_is_written(tiny_toml, tmp_path):
    # catches: a JIT-compiled loss that never calls the guide in Python, so the term would read nothing
    cfg = _cfg(tiny_toml, "train.jit=true", "model.object_information_weight=1.0")
    with pytest.raises(ConfigError, match="train.jit.*model.object_information_weight"):
        train_capsules(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_folder_holding_a_run_is_refused_without_resume_or_force(tmp_path):
    # catches: running again into a finished run's folder silently replacing it
    _linear_run(tmp_path, steps=2)
    before = (tmp_path / "final.pt").read_bytes()
    with pytest.raises(ConfigError, match=rf"^{tmp_path} holds a run \(step 2\); pass --resume .* --force"):
        _linear_run(tmp_path, steps=4)
    assert (tmp_path / "final.pt").read_bytes() == before
    (tmp_path / "final.pt").unlink()  # a started run (checkpoint only) is refused too
    with pytest.raises(ConfigError, match=r"holds a run \(step 2\)"):
        _linear_run(tmp_path, steps=4)
    _, state = _linear_run(tmp_path, steps=3, force=True)  # --force starts over
    assert state.step == 3
    assert [r["step"] for r in read_jsonl(tmp_path / "log.jsonl")] == [1, 2, 3]


def test_write_errors_are_one_line_naming_the_path(tmp_path, monkeypatch):
    # catches: a full disk or an --out naming a file ending in a traceback (or a half-written checkpoint)
    from probcaps.io import OutputError

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(OutputError, match=rf"^{not_a_folder}: exists and is not a folder"):
        _linear_run(not_a_folder)
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OutputError, match=r"checkpoint\.pt: cannot write \(no space left on the device\)"):
        _linear_run(tmp_path / "run")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert sorted(os.listdir(tmp_path / "run")) == [".lock", "log.jsonl"]


# --------------------------------------------------------------------------------------------- schedules, TensorBoard

def test_schedules_are_passed_to_the_loss_and_logged(tmp_path):
    # catches: a schedule evaluated at the wrong step (off by one after the increment), not reaching the loss, or
    # missing from the log; extra loss terms not averaged over the log window
    module = nn.Linear(3, 1)
    cfg = TrainConfig(steps=4, batch_size=2, lr=0.01, warmup_steps=1, log_every=2, checkpoint_every=4)
    seen = []

    def batches(epoch, start):
        for i in range(start, 4):
            yield torch.full((2, 3), float(i))

    def loss_fn(x, anneal):
        seen.append(anneal)
        loss = module(x).pow(2).mean()
        return loss, {"anneal_twice": 2 * anneal}

    train_loop(module, loss_fn, batches, cfg, tmp_path, progress=False, schedules={"anneal": lambda s: 0.5 * s})
    assert seen == [0.0, 0.5, 1.0, 1.5]
    records = read_jsonl(tmp_path / "log.jsonl")
    assert [(r["step"], r["anneal"], r["anneal_twice"]) for r in records] == [(2, 0.5, 0.5), (4, 1.5, 2.5)]
    with pytest.raises(ValueError, match="clash"):
        train_loop(module, loss_fn, batches, cfg, tmp_path / "b", progress=False, schedules={"lr": lambda s: 1.0})


def test_tensorboard_mirrors_the_log(tmp_path):
    # catches: the TensorBoard option writing no event file, or scalars under other tags than documented
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = []

    def on_checkpoint(state):
        state.summary_writer.add_image("templates", torch.rand(1, 4, 4), state.step)
        images.append(state.step)

    module = nn.Linear(3, 1)
    cfg = TrainConfig(steps=4, batch_size=2, lr=0.01, warmup_steps=1, log_every=1, checkpoint_every=2)

    def batches(epoch, start):
        for i in range(start, 4):
            yield torch.full((2, 3), float(i))

    def loss_fn(x, beta):
        return module(x).pow(2).mean() * beta, {"bias_sq": float(module.bias.detach().pow(2).sum())}

    train_loop(module, loss_fn, batches, cfg, tmp_path, progress=False, tensorboard=True,
               schedules={"beta": lambda s: 1.0 + s}, on_checkpoint=on_checkpoint)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/items_per_s", "schedule/beta",
            "loss_terms/bias_sq"} <= set(tags["scalars"])
    log = read_jsonl(tmp_path / "log.jsonl")
    assert [e.step for e in events.Scalars("train/loss")] == [r["step"] for r in log]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in log])
    assert images == [2, 4] and "templates" in tags["images"]


def test_tensorboard_missing_is_one_line(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ConfigError, match=r"pip install probcaps\[tensorboard\]"):
        _linear_run(tmp_path, tensorboard=True)
