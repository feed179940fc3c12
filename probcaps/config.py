"""Experiment configs: TOML files mapped onto dataclasses, strictly.

An unknown section or key, or a value of the wrong type, is a one-line :class:`~probcaps.errors.ConfigError`
naming the file and the key.  ``--set section.key=value`` overrides are checked the same way.

A config may start from another: a top-level ``base = "other.toml"`` (a path relative to the file) is read first,
and the file's own keys replace the base's one by one (a section is merged, not replaced whole).  Bases may chain.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probcaps.errors import ConfigError

__all__ = ["DataConfig", "EvalConfig", "load_sections", "parse_override", "read_toml"]


@dataclass
class DataConfig:
    dataset: str = "mnist"         # "mnist" (real files) or "synthetic" (generated, for tests and smoke runs)
    canvas_size: int = 40
    max_shift: int = 6             # SCAE placement: the 28x28 digit at a random offset of up to ±6 px
    train_limit: int = 0           # use only the first N training images (0: all)
    test_limit: int = 0
    seed: int = 0                  # placement offsets
    train_rotation: float = 0.0    # max |angle| in degrees of random training rotations

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class EvalConfig:
    batch_size: int = 500
    probe_train_limit: int = 0     # fit the probe on the first N training images (0: all)
    probe_max_iter: int = 2000
    probe_C: float = 1.0
    kmeans_n_init: int = 10
    figures: bool = True

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value: Any, target: Any, where: str) -> Any:
    """Check ``value`` against the type of the default ``target``; ints are accepted for floats."""
    if isinstance(target, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
    elif isinstance(target, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
    elif isinstance(target, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        value = float(value)
    elif isinstance(target, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
    elif isinstance(target, list):
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
    elif isinstance(target, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
    return value


def _build(cls, values: dict, where: str):
    defaults = cls()
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(known))})")
    kwargs = {k: _coerce(v, getattr(defaults, k), f"{where}.{k}") for k, v in values.items()}
    return dataclasses.replace(defaults, **kwargs)


def load_sections(path: str | Path | None, schema: dict[str, type], overrides: list[str] = ()) -> dict:
    """Read a TOML config into one dataclass per section of ``schema`` (``{"model": ModelConfig, ...}``).

    Top-level scalar keys listed in ``schema`` with type ``str`` (e.g. ``name``) are returned as is.
    """
    raw: dict = {}
    label = "<defaults>"
    if path is not None:
        label = str(path)
        raw = read_toml(path)
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"--set {item}: '{section}' is not a section")
        raw[section][key] = value
    out = {}
    for key in raw:
        if key not in schema:
            raise ConfigError(f"{label}: unknown section or key '{key}' (known: {', '.join(sorted(schema))})")
    for name, cls in schema.items():
        value = raw.get(name)
        if cls is str:
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{label}: '{name}' must be a string")
            out[name] = value
            continue
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{label}: '{name}' must be a [section]")
        out[name] = _build(cls, value or {}, f"{label}: {name}")
    return out


def read_toml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The TOML file at ``path`` as a dict, on top of its ``base`` file (and that file's base, ...) when it names
    one: section by section, key by key, the file's values win."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{_chain[-1]}: base config {path} does not exist" if _chain
                          else f"{path}: no such config file")
    if path.resolve() in _chain:
        raise ConfigError(f"{path}: its base configs form a cycle ({' -> '.join(str(p) for p in _chain + (path,))})")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a path to another config, got {base!r}")
    merged = read_toml(path.parent / base, _chain + (path.resolve(),))
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def parse_override(item: str) -> tuple[str, str, Any]:
    """``"train.steps=10"`` -> ``("train", "steps", 10)``; the value is parsed as a TOML value (bare words as
    strings)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"--set {item}: expected section.key=value")
    lhs, rhs = item.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return section, key, value
