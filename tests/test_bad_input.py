"""Bad input a user can type ends in one line and exit status 2, never a traceback, and changes nothing on disk.

The per-key cases are generated from the config dataclasses of every entry point (a wrong type and each value just
outside the range :data:`probcaps.config.RULES` gives the key), and the per-argument cases from the entry points'
own argparse parsers: a key or an option added later is covered without touching this file.  Entry points run
in-process (``main(argv)``); two subprocess cases prove the real exit status and the absence of a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import importlib
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from probcaps import cli, registry, runner
from probcaps.config import RULES, Range, check_sections, load_sections, range_of
from probcaps.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


class RefusalTooSlow(Exception):
    """A case that should be refused at once is still running: its bad value got through to the work."""


@pytest.fixture(autouse=True)
def _setup(no_reexec, pyro_clean, seed, tmp_path, monkeypatch):
    # an empty data root: a bad value that slips through fails on missing data (not the key) instead of training
    monkeypatch.setenv("PROBCAPS_DATA", str(tmp_path / "no_data"))

    def too_slow(*_):
        raise RefusalTooSlow("still running after 120 s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def snapshot(root: Path) -> dict:
    """``{relative path: (size, mtime_ns)}`` of everything under ``root``."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def one_error_line(err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


# ------------------------------------------------------------------------------------- config keys


def _module(name: str):
    return importlib.import_module(f"probcaps.experiments.{name}")


def _capsule_schema():
    from probcaps.inference.capsule_svi import SCHEMA

    return SCHEMA


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A one-step checkpoint of the tiny capsule model (the committed ones take a second each to load)."""
    from conftest import TINY_TOML

    root = tmp_path_factory.mktemp("tiny_run")
    (root / "tiny.toml").write_text(TINY_TOML)
    previous = os.environ.get("PROBCAPS_NO_REEXEC")
    os.environ["PROBCAPS_NO_REEXEC"] = "1"
    try:
        assert cli.main(["train", "--config", str(root / "tiny.toml"), "--out", str(root / "run"), "--steps", "1",
                         "--quiet"]) == 0
    finally:
        if previous is None:
            del os.environ["PROBCAPS_NO_REEXEC"]
    # without the optimiser state: a third of the tensors, so each of the many loads is quick
    import torch

    ckpt = torch.load(root / "run" / "final.pt", weights_only=True)
    torch.save({k: v for k, v in ckpt.items() if k not in ("optimiser", "scheduler", "rng")}, root / "model.pt")
    return root / "model.pt"


def _experiment_schema(name: str):
    return lambda: _module(name).SCHEMA


# entry point -> (its config schema, the keys it sets itself from its own options: a --set of these is replaced by
# the option's value, not read)
ENTRIES = {
    "train": (_capsule_schema, ()),
    "evaluate": (_capsule_schema, ()),
    "mnist_probe": (_capsule_schema, ("train.seed",)),
    "rotated_training": (_capsule_schema, ("train.seed", "data.train_rotation")),
    "multimnist": (_experiment_schema("multimnist"), ()),
    "norb_viewpoints": (_experiment_schema("norb_viewpoints"), ()),
    "rotated_mnist_cnn_vs_capsnet": (_experiment_schema("rotated_mnist_cnn_vs_capsnet"), ()),
    "transforming_autoencoder": (_experiment_schema("transforming_autoencoder"), ()),
}


def _invocation(entry: str, tmp: Path, checkpoint: Path):
    """``(main, argv before the --set items)`` of an entry point writing under ``tmp`` (the capsule-model entry
    points read the tiny config)."""
    out, res, tiny = str(tmp / "run"), str(tmp / "results"), str(tmp / "tiny.toml")
    if entry == "train":
        return cli.main, ["train", "--config", tiny, "--out", out, "--quiet"]
    if entry == "evaluate":
        return cli.main, ["evaluate", "--checkpoint", str(checkpoint), "--results-dir", res, "--quiet"]
    argv = ["--out", out, "--results-dir", res, "--quiet"]
    if _capsule_schema in ENTRIES[entry]:
        argv += ["--config", tiny]
    else:  # --config FIRST where --config takes several recipes: --out takes one
        action = next((a for a in parsers()[entry][2]._actions if "--config" in a.option_strings), None)
        if action is not None and isinstance(action.default, list):
            argv += ["--config", str(action.default[0])]
    if entry == "mnist_probe":
        argv += ["--checkpoint-out", str(tmp / "export.pt")]
    return _module(entry).main, argv


def toml(value) -> str:
    """``value`` as a TOML literal for ``--set``."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return repr(value) if isinstance(value, float) else str(value)


def bad_values(field: dataclasses.Field, default) -> list[tuple[str, str]]:
    """``[(what, TOML literal)]``: a wrong type (and a wrong element type for lists and tables), then every value
    just outside the field's range."""
    rule = range_of(field)
    if isinstance(default, bool):
        return [("type", "1")]
    if isinstance(default, str):
        return [("type", "1")]
    if isinstance(default, int):
        return [("type", '"abc"'), ("type", "1.5")] + [("range", toml(v)) for v in rule.outside(integer=True)]
    if isinstance(default, float):
        return [("type", '"abc"')] + [("range", toml(v)) for v in rule.outside(integer=False)]
    if isinstance(default, list):
        element = rule.element or (type(default[0]) if default else None)
        cases = [("type", "1")]
        if element in (int, float):
            cases.append(("element type", '["a"]'))
            cases += [("range", f"[{toml(v)}]") for v in rule.outside(integer=element is int)]
        elif element is str:
            cases.append(("element type", "[1]"))
        return cases
    if isinstance(default, dict):
        return [("type", "1"), ("element type", '{ a = "x" }')] + \
            [("range", f"{{ a = {toml(v)} }}") for v in rule.outside(integer=False)]
    raise AssertionError(f"{field.name}: no bad values for a default of type {type(default).__name__}")


def key_cases(schema: dict) -> list[tuple[str, str, str]]:
    """``[(section.key, what, literal)]`` over every field of every section of ``schema``."""
    cases = []
    for section, cls in schema.items():
        if cls is str:
            continue
        defaults = cls()
        for f in dataclasses.fields(cls):
            cases += [(f"{section}.{f.name}", what, value) for what, value in bad_values(f, getattr(defaults, f.name))]
    return cases


def _sections():
    """One case per (entry point, config section): its keys' bad values are tried in turn within the test (one
    pytest case per value would spend most of its time in pytest)."""
    return [pytest.param(entry, section, id=f"{entry}-{section}")
            for entry, (schema, _) in ENTRIES.items() for section, cls in schema().items() if cls is not str]


@pytest.mark.parametrize("entry, section", _sections())
def test_every_config_key_refuses_a_bad_value(entry, section, tiny_toml, tiny_checkpoint, tmp_path, capsys):
    # catches: a config key whose wrong type or out-of-range value (zero batch size, NaN learning rate, a string in
    # a list of channels, ...) gets through to the work (a traceback, or minutes of training), is printed on more
    # than one line, or is refused only after something was written into the run folder
    schema, skipped = ENTRIES[entry]
    main, argv = _invocation(entry, tmp_path, tiny_checkpoint)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "kept.txt").write_text("an earlier run\n")
    before = snapshot(tmp_path)
    cases = [c for c in key_cases({section: schema()[section]}) if c[0] not in skipped]
    assert cases
    failures = []
    for key, what, value in cases:
        try:
            code = main([*argv, "--set", f"{key}={value}"])
        except SystemExit as e:  # argparse's exit, not a config refusal
            code = f"SystemExit({e.code})"
        err = capsys.readouterr().err.strip()
        lines = err.splitlines()
        if code != 2 or len(lines) != 1 or key not in lines[0] or "Traceback" in err:
            failures.append(f"--set {key}={value} ({what}): exit {code}, stderr {err!r}")
        elif snapshot(tmp_path) != before:
            failures.append(f"--set {key}={value} ({what}): changed {sorted(set(snapshot(tmp_path)) ^ set(before))}")
    assert not failures, "\n".join(failures)


def test_key_cases_cover_every_rule_and_kind():
    # catches: the generator silently producing no out-of-range cases (a test that cannot fail)
    cases = key_cases(_capsule_schema())
    kinds = {what for _, what, _ in cases}
    assert {"type", "range", "element type"} <= kinds
    keys = {key for key, what, _ in cases if what == "range"}
    for key in ("train.batch_size", "train.steps", "train.checkpoint_every", "train.log_every", "model.num_parts",
                "model.num_parents", "train.lr", "model.temperature", "model.pixel_std", "data.train_limit",
                "encoder.channels", "train.lr_multipliers"):
        assert key in keys, key
    assert ("train.lr", "range", "nan") in cases and ("train.batch_size", "range", "0") in cases
    assert ("data.train_limit", "range", "-1") in cases and ("data.train_limit", "range", "0") not in cases


# ---------------------------------------------------------------------------------- the rule table


@pytest.mark.parametrize("key, value, message", [
    ("train.batch_size", 0, "train.batch_size: must be >= 1, got 0"),
    ("train.checkpoint_every", 0, "train.checkpoint_every: must be >= 1, got 0"),
    ("train.log_every", -3, "train.log_every: must be >= 1, got -3"),
    ("model.num_parts", 0, "model.num_parts: must be >= 1, got 0"),
    ("model.num_parents", 0, "model.num_parents: must be >= 1, got 0"),
    ("train.steps", 0, "train.steps: must be >= 1, got 0"),
    ("train.lr", math.nan, "train.lr: must be a finite number, got nan"),
    ("train.lr", 0.0, "train.lr: must be > 0, got 0.0"),
    ("model.temperature", -1.0, "model.temperature: must be > 0"),
    ("model.pixel_std", math.inf, "model.pixel_std: must be a finite number"),
    ("model.dummy_presence", 1.5, "model.dummy_presence: must be in [0, 1], got 1.5"),
    ("model.object_pose", "shear", "model.object_pose must be one of affine, similarity, got 'shear'"),
    ("data.test_limit", -1, "data.test_limit: must be >= 0 (0: all), got -1"),
    ("encoder.channels", [64, "a"], "encoder.channels[1]: expected an integer, got 'a'"),
    ("encoder.strides", [2, 0, 1, 1], "encoder.strides[1]: must be >= 1, got 0"),
    ("train.lr_multipliers", {"model.template": -2.0}, "train.lr_multipliers.model.template: must be > 0"),
])
def test_rule_messages_name_the_file_and_key(key, value, message, tmp_path):
    # catches: a range rule missing, or a message that does not say which file, key and value are at fault
    section, name = key.split(".")
    path = tmp_path / "x.toml"
    literal = {list: lambda v: "[" + ", ".join(f'"{e}"' if isinstance(e, str) else str(e) for e in v) + "]",
               dict: lambda v: "{ " + ", ".join(f'"{k}" = {toml(e)}' for k, e in v.items()) + " }",
               str: lambda v: f'"{v}"'}
    path.write_text(f"[{section}]\n{name} = {literal.get(type(value), toml)(value)}\n")
    with pytest.raises(ConfigError) as e:
        load_sections(path, _capsule_schema())
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_limits_of_zero_mean_all_and_are_accepted(tmp_path):
    # catches: the "0: all" convention of *_limit keys being broken by the >= 1 rule of counts
    cfg = load_sections(None, _capsule_schema(), ["data.train_limit=0", "eval.probe_train_limit=0"])
    assert cfg["data"].train_limit == 0 and cfg["eval"].probe_train_limit == 0


def test_integer_angles_stay_integers():
    # catches: list elements checked against a float rule being converted (0 -> 0.0 changes result keys)
    schema = _module("rotated_mnist_cnn_vs_capsnet").SCHEMA
    cfg = load_sections(None, schema, ["data.angles=[0, 22.5, 90]"])
    assert cfg["data"].angles == [0, 22.5, 90] and isinstance(cfg["data"].angles[0], int)


def test_field_metadata_overrides_the_table():
    # catches: a field's own rule (metadata["range"]) being ignored in favour of the name patterns
    @dataclasses.dataclass
    class Section:
        batch_size: int = dataclasses.field(default=4, metadata={"range": Range(2, 8)})
        other_size: int = 3

    assert range_of(dataclasses.fields(Section)[0]) == Range(2, 8)
    assert range_of(dataclasses.fields(Section)[1]) is next(r for p, r in RULES if "*_size" in p)
    with pytest.raises(ConfigError, match=r"s.batch_size: must be in \[2, 8\], got 9"):
        load_sections(None, {"s": Section}, ["s.batch_size=9"])


def _schemas() -> dict[str, dict]:
    """Every config schema: the capsule model's and each experiment's own."""
    found = {"capsule model": _capsule_schema()}
    found.update({n: _module(n).SCHEMA for n in registry.experiments() if hasattr(_module(n), "SCHEMA")})
    return found


def test_every_committed_config_passes_the_rules():
    # catches: a range rule that rejects a value a shipped recipe uses.  A config is read with every schema whose
    # sections it fits; one of them must accept it.
    from probcaps.config import read_toml

    paths = sorted((REPO / "experiments" / "configs").glob("*.toml"))
    assert len(paths) >= 5
    schemas = _schemas()
    for path in paths:
        sections = set(read_toml(path)) - {"name"}
        errors = []
        for name, schema in schemas.items():
            if sections <= set(schema):
                try:
                    load_sections(path, schema)
                    break
                except ConfigError as e:
                    errors.append(f"{name}: {e}")
        else:
            raise AssertionError(f"{path.name}: no schema accepts it: {errors or 'none fits its sections'}")


def test_every_committed_checkpoint_config_passes_the_rules():
    # catches: a range rule that rejects a value stored in a shipped checkpoint (it could no longer be evaluated
    # with an override, nor retrained from its config)
    from probcaps.checkpoints import load_checkpoint

    paths = sorted((REPO / "checkpoints").glob("*.pt"))
    assert paths
    for path in paths:
        meta = load_checkpoint(path, map_location="cpu")["metadata"]
        sections = check_sections(meta["configs"], _capsule_schema(), str(path))
        assert sections["train"].batch_size >= 1


def test_stored_configs_are_checked_too():
    # catches: check_sections accepting what a config file may not hold
    with pytest.raises(ConfigError, match=r"ckpt.pt: train.batch_size: must be >= 1, got 0"):
        check_sections({"train": {"batch_size": 0}}, _capsule_schema(), "ckpt.pt")


def test_non_utf8_and_unreadable_config_files_are_one_line(tmp_path, capsys):
    # catches: UnicodeDecodeError / IsADirectoryError tracebacks from reading a config
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"name = \"caf\xe9\"\n")
    assert cli.main(["train", "--config", str(binary), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    one_error_line(capsys.readouterr().err, str(binary), "UTF-8")
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    assert cli.main(["train", "--config", str(folder), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    one_error_line(capsys.readouterr().err, str(folder))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------- arguments

SHARED_TYPES = {
    runner.positive_int: ["0", "-1", "x"],
    runner.non_negative_int: ["-1", "1.5"],
    runner.finite_float: ["nan", "inf", "x"],
    runner.finite_positive_float: ["0", "-1e-3", "nan", "-inf"],
    runner.finite_non_negative_float: ["-1", "nan"],
    runner.device_arg: ["foo", "cuda:99"],
}


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


@functools.lru_cache(maxsize=None)
def parsers() -> dict[str, tuple[callable, list[str], argparse.ArgumentParser]]:
    """``{entry: (main, argv prefix, parser)}`` for the probcaps commands and every experiment (an experiment's
    parser is caught at its ``parse_args``: it is built inside ``main``)."""
    root = cli.build_parser()
    commands = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction)).choices
    found = {f"probcaps {c}": (cli.main, [c], commands[c]) for c in ("train", "evaluate", "ttvi", "demo")}
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        for name in registry.experiments():
            module = _module(name)
            try:
                module.main.__wrapped__([])
            except _Parsed as e:
                found[name] = (module.main, [], e.parser)
    finally:
        argparse.ArgumentParser.parse_args = original
    return found


def _required_options(parser: argparse.ArgumentParser, tmp_path: Path) -> list[str]:
    """A (missing) path for each required option, so that the option under test is what the parser refuses."""
    return [x for a in parser._actions if a.required and a.option_strings
            for x in (a.option_strings[-1], str(tmp_path / "missing"))]


def _argument_cases():
    cases = []
    for entry, (_, _, parser) in parsers().items():
        for action in parser._actions:
            for value in SHARED_TYPES.get(action.type, []):
                cases.append(pytest.param(entry, action.option_strings[-1], value, id=f"{entry}-{action.dest}-{value}"))
    return cases


def test_numeric_options_use_the_shared_types():
    # catches: a numeric option added later with a bare type=int/float (no range check: --steps 0, --lr nan)
    found = parsers()
    assert set(registry.experiments()) <= set(found)
    for entry, (_, _, parser) in found.items():
        for action in parser._actions:
            assert action.type not in (int, float), f"{entry} {action.option_strings}: use a probcaps.cli type"


@pytest.mark.parametrize("entry, option, value", _argument_cases())
def test_every_numeric_option_refuses_a_bad_value(entry, option, value, tmp_path, capsys):
    # catches: zero or negative counts, steps, batch sizes, threads; NaN rates; unknown devices reaching the work
    main, prefix, parser = parsers()[entry]
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([*prefix, *_required_options(parser, tmp_path), option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"argument {option}" in err.strip().splitlines()[-1], err
    assert snapshot(tmp_path) == before


def test_every_output_folder_option_refuses_a_file(tmp_path, capsys):
    # catches: --out / --results-dir naming an existing file ending in a FileExistsError traceback, or the file being
    # written over, in any command or experiment
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    checked = 0
    for entry, (main, prefix, parser) in parsers().items():
        for action in parser._actions:
            if action.type is runner.folder_arg:
                with pytest.raises(SystemExit) as e:
                    main([*prefix, *_required_options(parser, tmp_path), action.option_strings[-1], str(taken)])
                assert e.value.code == 2, (entry, action.option_strings)
                assert f"{taken}: exists and is not a folder" in capsys.readouterr().err.splitlines()[-1]
                checked += 1
    assert checked >= 10 and taken.read_text() == "a file\n"


# ------------------------------------------------------------------------------------- paths


def test_train_out_naming_a_file_is_refused(tmp_path, tiny_toml, capsys):
    # catches: a FileExistsError / NotADirectoryError traceback from mkdir, or the file being replaced
    taken = tmp_path / "taken"
    taken.write_text("not a folder\n")
    for out in (taken, taken / "run"):
        with pytest.raises(SystemExit) as e:
            cli.main(["train", "--config", str(tiny_toml), "--out", str(out), "--quiet"])
        assert e.value.code == 2
        assert str(taken) in capsys.readouterr().err.strip().splitlines()[-1]
    assert taken.read_text() == "not a folder\n"


def test_ttvi_out_naming_a_folder_is_refused(tmp_path, capsys):
    # catches: ttvi optimising for minutes, then dying with IsADirectoryError when it writes the results
    with pytest.raises(SystemExit) as e:
        cli.main(["ttvi", "--checkpoint", str(tmp_path / "run" / "final.pt"), "--out", str(tmp_path), "--limit", "2",
                  "--quiet"])
    assert e.value.code == 2
    assert f"argument --out: {tmp_path}: is a folder" in capsys.readouterr().err


def test_unreadable_data_file_is_one_line(tmp_path, monkeypatch, capsys):
    # catches: a PermissionError traceback when a data file cannot be read (simulated: tests may run as root, who
    # reads everything), or a run folder created before the data are read
    import probcaps.data.mnist as mnist_module
    from probcaps.data import clear_mnist_cache, write_fake_mnist

    root = tmp_path / "data"
    write_fake_mnist(root, n_train=8, n_test=8)
    real_open = open

    def open_denied(path, *args, **kwargs):
        if str(path).startswith(str(root)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(mnist_module, "open", open_denied, raising=False)
    monkeypatch.setattr(Path, "read_bytes", lambda self: open_denied(self, "rb").read())
    clear_mnist_cache()
    try:
        code = cli.main(["train", "--out", str(tmp_path / "run"), "--quiet", "--set", "train.steps=1",
                         "--data-dir", str(root)])
    finally:
        clear_mnist_cache()
    assert code == 2
    one_error_line(capsys.readouterr().err, "probcaps train: error:", str(root / "mnist"), "Permission denied")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("error", [
    PermissionError(errno.EACCES, "Permission denied", "/data/mnist"),
    OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoint.pt"),
    IsADirectoryError(errno.EISDIR, "Is a directory", "/results/x.json"),
    NotADirectoryError(errno.ENOTDIR, "Not a directory", "/results/file/x.json"),
    FileExistsError(errno.EEXIST, "File exists", "/runs/x"),
])
def test_os_errors_are_one_line_naming_the_path(error, capsys):
    # catches: any OSError escaping an entry point as a traceback (or without the path at fault)
    @runner.one_line_errors("experiment")
    def failing(argv=None):
        raise error

    assert failing([]) == 2
    one_error_line(capsys.readouterr().err, "experiment: error:", error.filename, error.strerror)


def test_os_error_in_a_command_is_one_line(tmp_path, monkeypatch, tiny_toml, capsys):
    # catches: main() letting an OSError through (its own handler, not one_line_errors)
    import probcaps.inference.capsule_svi as capsule_svi

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "checkpoint.pt"))

    monkeypatch.setattr(capsule_svi, "train_capsules", full_disk)
    assert cli.main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    one_error_line(capsys.readouterr().err, "probcaps train: error:", "checkpoint.pt", "No space left")


def test_full_disk_during_training_is_one_line(tmp_path, monkeypatch, tiny_toml, capsys):
    # catches: a full disk while writing a checkpoint ending in a traceback (simulated: fsync fails with ENOSPC)
    import probcaps.io as io_module

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io_module.os, "fsync", no_space)
    code = cli.main(["train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"), "--steps", "3", "--quiet"])
    assert code == 2
    line = one_error_line(capsys.readouterr().err, "probcaps train: error:")
    assert "space" in line.lower(), line


# ------------------------------------------------------------------------------------- subprocesses


def _run(args, cwd, **env):
    env = {**os.environ, "PROBCAPS_NO_REEXEC": "1", **env}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_subprocess_config_key_exit_status_and_no_traceback(tmp_path, tiny_toml):
    # catches: the installed command exiting 1 with a traceback (the in-process tests call main directly)
    proc = _run(["probcaps", "train", "--config", str(tiny_toml), "--out", str(tmp_path / "run"),
                 "--set", "train.batch_size=0"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"probcaps train: error: {tiny_toml}: train.batch_size: must be >= 1, got 0"
    assert not (tmp_path / "run").exists()


def test_subprocess_experiment_argument_exit_status(tmp_path):
    # catches: `python -m probcaps.experiments.rotated_digits --batch-size 0` reaching the optimisation
    proc = _run(["probcaps.experiments.rotated_digits", "--batch-size", "0", "--results-dir", str(tmp_path / "r")],
                tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("error: argument --batch-size: must be >= 1, got 0")
    assert not (tmp_path / "r").exists()


def test_a_sections_own_validate_runs_as_a_one_line_error():
    # catches: cross-key checks (a dataclass's validate()) not running when sections are built, or escaping as a
    # ValueError traceback instead of naming the file
    @dataclasses.dataclass
    class Section:
        low: float = 1.0
        high: float = 2.0

        def validate(self):
            if not self.low < self.high:
                raise ValueError(f"s.low must be below s.high, got {self.low} and {self.high}")

    with pytest.raises(ConfigError, match=r"^<defaults>: s.low must be below s.high, got 3.0 and 2.0$"):
        load_sections(None, {"s": Section}, ["s.low=3"])
    with pytest.raises(ConfigError, match=r"^ckpt.pt: s.low must be below s.high"):
        check_sections({"s": {"low": 5.0}}, {"s": Section}, "ckpt.pt")
    from probcaps.config import replace_checked

    stored = Section(low=0.0, high=0.5)
    assert replace_checked(stored, {"low": 0.25}, "--set s.low=0.25: s") == Section(0.25, 0.5)
    with pytest.raises(ConfigError, match=r"^--set s.low=1: s.low must be below s.high, got 1.0 and 0.5$"):
        replace_checked(stored, {"low": 1}, "--set s.low=1: s")
