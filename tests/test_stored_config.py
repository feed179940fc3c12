"""The config stored in a checkpoint is checked like a config file: every key of every section, missing, of the wrong
type or out of range, ends ``evaluate``, ``ttvi`` and ``draw-objects`` in one line naming the checkpoint and the
key (exit status 2), before any data is read or anything written.

One tiny model is trained per module (two steps on synthetic digits); each case edits a copy of its stored config.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from pathlib import Path

import pytest
import torch
from test_bad_input import bad_values

from probcaps import cli
from probcaps.inference.capsule_svi import SCHEMA, load_trained

COMMANDS = ("evaluate", "ttvi", "draw-objects")


@pytest.fixture(autouse=True)
def _setup(no_reexec, pyro_clean, tmp_path, monkeypatch):
    # an empty data root: a bad value that slips through fails on missing data, not on the key
    monkeypatch.setenv("PROBCAPS_DATA", str(tmp_path / "no_data"))
    monkeypatch.chdir(tmp_path)  # default outputs (results/...) land in the test's folder


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> dict:
    """The contents of a two-step checkpoint of the tiny capsule model, without its optimiser state."""
    from conftest import TINY_TOML

    from probcaps.checkpoints import load_checkpoint
    from probcaps.inference.capsule_svi import load_experiment_config, train_capsules

    root = tmp_path_factory.mktemp("stored_config")
    (root / "tiny.toml").write_text(TINY_TOML)
    torch.manual_seed(0)
    train_capsules(load_experiment_config(root / "tiny.toml", ["train.steps=2"]), root / "run", progress=False)
    ckpt = load_checkpoint(root / "run" / "final.pt")
    return {k: v for k, v in ckpt.items() if k in ("module", "state", "train_config", "metadata")}


def argv(command: str, checkpoint: Path, tmp: Path) -> list[str]:
    out = {"evaluate": ["--results-dir", str(tmp / "results")], "ttvi": ["--limit", "2", "--out", str(tmp / "t.json")],
           "draw-objects": ["--limit", "2", "--out", str(tmp / "d.png")]}[command]
    return [command, "--checkpoint", str(checkpoint), *out, "--quiet"]


def refused(command: str, ckpt: dict, tmp: Path, capsys, *needles: str) -> str:
    """Run ``command`` on ``ckpt`` written to a file; assert exit 2, one line naming the file and ``needles``, and
    nothing written; return the line."""
    path = tmp / "edited.pt"
    torch.save(ckpt, path)
    before = sorted(p.name for p in tmp.iterdir())
    code = cli.main(argv(command, path, tmp))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (code, err)
    for needle in (str(path), *needles):
        assert needle in err, err
    assert sorted(p.name for p in tmp.iterdir()) == before
    return err


def stored_key_cases() -> list:
    """``(section.key, [bad Python values])`` for every key of every stored section: a wrong type and each value
    just outside the key's range (the generator of the config-file table, tests/test_bad_input.py)."""
    cases = []
    for section, cls in SCHEMA.items():
        if cls is str:
            continue
        defaults = cls()
        for f in dataclasses.fields(cls):
            values = [tomllib.loads(f"v = {literal}")["v"] for _, literal in bad_values(f, getattr(defaults, f.name))]
            cases.append(pytest.param(section, f.name, values, id=f"{section}.{f.name}"))
    return cases


@pytest.mark.parametrize("section, key, values", stored_key_cases())
def test_every_stored_key_refuses_a_bad_value(section, key, values, stored, tmp_path, capsys):
    # catches: a checkpoint's stored config trusted blindly (a zero batch size, a NaN temperature, a string where a
    # number belongs reaching the model as a traceback, or a bad value silently replaced)
    assert values
    # the stored config is checked before any tensor is used: each case carries one tensor of the model (quick to
    # write and read), and a value that slipped through would still fail, on the missing tensors, without the key
    first = next(iter(stored["module"]))
    light = {**stored, "module": {first: stored["module"][first]}}
    for command in COMMANDS:
        for value in values:
            ckpt = copy.deepcopy(light)
            ckpt["metadata"]["configs"][section][key] = value
            refused(command, ckpt, tmp_path, capsys, f"{section}.{key}")


def _edit(stored: dict, edit) -> dict:
    ckpt = copy.deepcopy(stored)
    edit(ckpt)
    return ckpt


# (what, edit of the checkpoint, text the one line must hold)
WHOLE_CASES = [
    ("no configs", lambda c: c["metadata"].pop("configs"), "metadata.configs"),
    ("configs not a dict", lambda c: c["metadata"].update(configs=[1, 2]), "metadata.configs"),
    *[(f"no {s} section", lambda c, s=s: c["metadata"]["configs"].pop(s), f"configs.{s}")
      for s, cls in SCHEMA.items() if cls is not str],
    ("a section not a dict", lambda c: c["metadata"]["configs"].update(model=3), "configs.model"),
    ("module not a dict", lambda c: c.update(module=[1, 2]), "'module'"),
    ("module of non-tensors", lambda c: c.update(module={"a": 1}), "'module'"),
    ("metadata not a dict", lambda c: c.update(metadata="x"), "'metadata'"),
    ("no kind", lambda c: c["metadata"].pop("kind"), "metadata.kind"),
    ("name leaving its folder", lambda c: c["metadata"].update(name="../../../x"), "name"),
    ("name not a string", lambda c: c["metadata"].update(name=3), "name"),
    ("an empty name", lambda c: c["metadata"].update(name=""), "name"),
    ("a guide of another family", lambda c: c["metadata"].update(guide={"family": "flow"}), "metadata.guide"),
    ("a guide scale of NaN", lambda c: c["metadata"].update(guide={"family": "normal", "init_scale": float("nan")}),
     "metadata.guide.init_scale"),
    ("a negative step", lambda c: c["state"].update(step=-1), "state.step"),
    ("cifar", lambda c: c["metadata"]["configs"]["data"].update(dataset="cifar"), "data.dataset"),
    ("a canvas too small", lambda c: (c["metadata"]["configs"]["data"].update(canvas_size=20),
                                      c["metadata"]["configs"]["model"].update(canvas_size=20)), "data.canvas_size"),
    ("canvases that differ", lambda c: c["metadata"]["configs"]["model"].update(canvas_size=40), "model.canvas_size"),
    ("a learning rate Adam cannot step in float32", lambda c: c["metadata"]["configs"]["train"].update(lr=3e38),
     "train.lr"),
    ("more parts than template pixels", lambda c: c["metadata"]["configs"]["model"].update(num_parts=26),
     "model.template_size"),
]


@pytest.mark.parametrize("what, edit, needle", [pytest.param(*case, id=case[0]) for case in WHOLE_CASES])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_damaged_checkpoint_is_one_line(command, what, edit, needle, stored, tmp_path, capsys):
    # catches: a missing or mistyped part of the checkpoint reaching the model as a KeyError/TypeError traceback,
    # a stored dataset the package does not know evaluated on MNIST, a stored name writing outside its folder
    refused(command, _edit(stored, edit), tmp_path, capsys, needle)


def test_a_key_the_checkpoint_predates_takes_its_default(stored, tmp_path):
    # catches: refusing checkpoints written before a key was added (the committed ones lack several)
    ckpt = _edit(stored, lambda c: c["metadata"]["configs"]["eval"].pop("nonlinear_probes"))
    torch.save(ckpt, tmp_path / "old.pt")
    cfg, _ = load_trained(tmp_path / "old.pt")
    assert cfg["eval"].nonlinear_probes is False and cfg["model"].num_parts == 3


def test_the_intact_checkpoint_loads(stored, tmp_path):
    # catches: a table above that passes because every checkpoint is refused
    torch.save(stored, tmp_path / "ok.pt")
    cfg, system = load_trained(tmp_path / "ok.pt")
    assert cfg["name"] == "tiny" and cfg["train"].batch_size == 4
    state = system.state_dict()
    assert state.keys() == stored["module"].keys()
    assert all(torch.equal(state[k], v) for k, v in stored["module"].items())
