"""Experiment configs: TOML files mapped onto dataclasses, strictly.

An unknown section or key, a value of the wrong type, or a value out of its range is a one-line
:class:`~probcaps.errors.ConfigError` naming the file and the key (``x.toml: train.batch_size: must be >= 1, got 0``);
``--set section.key=value`` overrides are checked the same way.  Types come from each field's default (ints are
accepted for floats; a list's elements are checked against the type of the default's elements).  Ranges come from
one table, :data:`RULES`, keyed by key-name patterns, or from a field's own ``field(metadata={"range": Range(...)})``;
``*_limit = 0`` means "all".  What one key's range cannot say (a width divisible by a number of heads, a minimum
below a maximum) goes in the dataclass's own ``validate()``, raising ``ValueError("<section>.<key> must ...")``.

A config may start from another: a top-level ``base = "other.toml"`` (a path relative to the file) is read first,
and the file's own keys replace the base's one by one (a section is merged, not replaced whole).  Bases may chain.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from probcaps.errors import ConfigError

__all__ = ["Section", "DigitData", "DigitCanvas", "DataConfig", "EvalConfig", "Range", "RULES", "check_sections",
           "check_value", "load_sections", "parse_override", "range_of", "read_toml", "replace_checked",
           "check_file_name", "file_name_arg", "check_threads", "threads_arg", "MAX_THREADS_PER_CPU"]


class Section:
    """A config section's dataclass: ``to_dict()`` as results and checkpoints record it."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class DigitData(Section):
    """A data section of digits: ``dataset`` "mnist", or "synthetic" (generated, for tests and smoke runs)."""

    def validate(self) -> None:
        if self.dataset not in ("mnist", "synthetic"):
            raise ValueError(f"data.dataset must be 'mnist' or 'synthetic', got {self.dataset!r}")


class DigitCanvas(DigitData):
    """A data section that places 28-px digits on a ``canvas_size`` canvas, shifted by up to ``max_shift``."""

    def validate(self) -> None:
        super().validate()
        if self.canvas_size < 28 + 2 * self.max_shift:
            raise ValueError(f"data.canvas_size ({self.canvas_size}) is too small for a 28-px digit shifted by up to "
                             f"{self.max_shift} px (needs >= {28 + 2 * self.max_shift})")


@dataclass
class DataConfig(DigitCanvas):
    dataset: str = "mnist"
    canvas_size: int = 40
    max_shift: int = 6             # SCAE placement: the 28x28 digit at a random offset of up to ±6 px
    train_limit: int = 0           # use only the first N training images (0: all)
    test_limit: int = 0
    seed: int = 0                  # placement offsets
    train_rotation: float = 0.0    # max |angle| in degrees of random training rotations


@dataclass
class EvalConfig(Section):
    batch_size: int = 500
    probe_train_limit: int = 0     # fit the probe on the first N training images (0: all)
    probe_max_iter: int = 2000
    probe_C: float = 1.0
    kmeans_n_init: int = 10
    figures: bool = True
    layer_readouts: bool = False   # also probe the part layer (inference/evaluate.py, LAYER_READOUTS)
    nonlinear_probes: bool = False  # also a two-layer network's probe (inference/evaluate.py, NONLINEAR_PROBES)
    # the held-out bound on log p(x) with K of each of these samples (inference/likelihood.py), on the first
    # likelihood_images test images; models with Normal poses only (point-mass poses bound no likelihood)
    likelihood_samples: list[int] = field(default_factory=lambda: [1, 100])
    likelihood_images: int = 200   # 0: all


# ------------------------------------------------------------------------------------------------------ ranges


@dataclass(frozen=True)
class Range:
    """The values a numeric key (or each element of a numeric list) may take: ``low <= v <= high`` (``low < v``
    when ``low_open``), always finite, and for a float within float32's range (the models compute in float32).
    ``element``: the type of a list's elements where the default cannot say (an empty default) or says too little
    (integer angles that may be fractional)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    note: str = ""
    element: type | None = None

    def describe(self) -> str:
        if self.low > -math.inf and self.high < math.inf:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        elif self.low > -math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.high < math.inf:
            text = f"<= {self.high:g}"
        else:
            text = "finite"
        return text + (f" ({self.note})" if self.note else "")

    def problem(self, value) -> str | None:
        """Why ``value`` (a number) is out of range, or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if isinstance(value, float) and abs(value) > FLOAT32_MAX:  # the models compute in float32
            return f"must be a number float32 can hold (|value| <= {FLOAT32_MAX:.4g}), got {value!r}"
        if value < self.low or (self.low_open and value == self.low) or value > self.high:
            return f"must be {self.describe()}, got {value!r}"
        return None

    def outside(self, integer: bool) -> list:
        """Values just outside the range (for tests): below ``low``, above ``high``, and NaN for floats."""
        values = []
        if self.low > -math.inf:
            values.append(int(math.ceil(self.low)) - (0 if self.low_open and float(self.low).is_integer() else 1)
                          if integer else float(self.low) - (0.0 if self.low_open else 0.5))
        if self.high < math.inf:
            values.append(int(math.floor(self.high)) + 1 if integer else float(self.high) + 0.5)
        if not integer:
            values.append(math.nan)
            if self.high == math.inf:
                values.append(1e308)  # finite, but beyond float32
        return values


#: The largest float32: a float key beyond it would overflow in the models (they compute in float32).
FLOAT32_MAX = 3.4028234663852886e38

COUNT = Range(1)                                          # sizes, widths, steps, iterations
COUNT_OR_ALL = Range(0, note="0: all")                    # limits and subset sizes
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, low_open=True)                        # finite and > 0
PROBABILITY = Range(0, 1)
FINITE = Range()
# a standard deviation: > 0, and its square (the models work with variances) far from float32's overflow
STD = Range(0, 1e15, low_open=True)

# First match wins: a key's name (the field name, whatever its section) against each pattern in turn.  Integers that
# match nothing must be >= 0, floats that match nothing finite.
RULES: list[tuple[tuple[str, ...], Range]] = [
    (("*_limit", "familiar_eval", "novel_eval", "train_eval", "likelihood_images"), COUNT_OR_ALL),
    (("part_pose_std_max",), Range(0, note="0: no ceiling")),
    (("max_affinity",), Range(0, note="0: unbounded")),
    (("expected_parents_start",), Range(0, note="0: no annealing")),
    (("steps", "*batch_size", "eval_batch", "*_every", "num_*", "*_size", "iterations", "*_iterations", "*max_iter",
      "*_n_init", "kernel", "*_kernel", "*_stride", "*strides", "*channels", "*hidden", "*_capsules", "*_dim",
      "set_heads", "set_inducing", "set_blocks", "likelihood_samples", "parent_code", "part_embedding", "keypoints",
      "elevations",
      "lightings", "instances_per_split", "pairs", "*_pairs", "A", "B", "C", "D"), COUNT),
    (("*_std", "*_std_*"), STD),
    (("lr", "*temperature", "probe_C", "var_floor", "min_scale", "max_scale", "expected_parents",
      "dummy_affinity", "keypoint_radius", "grad_clip"), POSITIVE),
    (("dropout", "dummy_presence", "min_iou", "*_threshold", "m_plus", "m_minus", "margin_start", "margin_end",
      "*_fraction", "*_share"), PROBABILITY),
    (("*_weight", "weight_decay", "*_cap", "train_rotation", "jitter_*", "translation_px", "rotation_deg", "scale",
      "shear", "max_translation", "max_shear", "keypoint_offset_gain", "margin_lambda"), NON_NEGATIVE),
    (("angles",), Range(element=float)),
    (("lr_multipliers",), POSITIVE),  # the multipliers, by parameter-name prefix
]


def range_of(field: dataclasses.Field) -> Range:
    """The rule of a config field: its own ``metadata["range"]``, else the first matching :data:`RULES` entry."""
    if "range" in field.metadata:
        return field.metadata["range"]
    for patterns, rule in RULES:
        if any(fnmatchcase(field.name, p) for p in patterns):
            return rule
    return NON_NEGATIVE if field.type in (int, "int") else FINITE


# ------------------------------------------------------------------------------------------------------ checking


def _coerce(value: Any, target: Any, where: str) -> Any:
    """Check ``value`` against the type of the default ``target``; ints are accepted for floats."""
    kind = target if isinstance(target, type) else type(target)
    if kind in (int, float):
        ok = not isinstance(value, bool) and isinstance(value, int if kind is int else (int, float))
    else:
        ok = isinstance(value, kind)
    if not ok:
        name = {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list",
                dict: "a table"}.get(kind, kind.__name__)
        raise ConfigError(f"{where}: expected {name}, got {value!r}")
    return float(value) if kind is float else value


def check_value(field: dataclasses.Field, value: Any, default: Any, where: str) -> Any:
    """``value`` for ``field`` (default ``default``), type- and range-checked; raises a one-line ConfigError."""
    value = _coerce(value, default, where)
    rule = range_of(field)
    if isinstance(value, list):
        element = rule.element or (type(default[0]) if default else None)
        items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        for at, v in items if element is not None else ():  # checked, not converted: integer angles stay integers
            _coerce(v, element, at)
    elif isinstance(value, dict):
        value = {k: _coerce(v, float, f"{where}.{k}") for k, v in value.items()}
        items = [(f"{where}.{k}", v) for k, v in value.items()]
    else:
        items = [(where, value)]
    for at, v in items:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (problem := rule.problem(v)):
            raise ConfigError(f"{at}: {problem}")
    return value


def _build(cls, values: dict, where: str):
    defaults = cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in fields:
            raise ConfigError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
    kwargs = {k: check_value(fields[k], v, getattr(defaults, k), f"{where}.{k}") for k, v in values.items()}
    try:
        return dataclasses.replace(defaults, **kwargs)
    except ConfigError as e:  # a section's own check across its keys (``__post_init__``): name the file too
        label = where.rpartition(": ")[0]
        raise ConfigError(f"{label}: {e}" if label else str(e)) from None


def _validated(section, where: str):
    """``section`` after its own ``validate()``, if it has one: its ``ValueError("<section>.<key> must ...")``
    becomes a one-line ConfigError naming the file."""
    validate = getattr(section, "validate", None)
    try:
        if callable(validate):  # a method, not a flag such as train.validate
            validate()
    except ValueError as e:
        label, _, name = where.rpartition(": ")
        message = str(e)
        raise ConfigError(f"{label}: {message}" if label and message.startswith(f"{name}.")
                          else f"{where}: {message}") from None
    return section


def replace_checked(section, values: dict, where: str):
    """A copy of the config dataclass ``section`` with ``values`` replaced, each checked as a config file's would
    be (``where``: the prefix of an error, e.g. ``"--set eval.batch_size=0: eval"``)."""
    checked = _build(type(section), values, where)
    return _validated(dataclasses.replace(section, **{k: getattr(checked, k) for k in values}), where)


def check_sections(configs: dict, schema: dict[str, type], label: str) -> dict:
    """Check stored configs (e.g. a checkpoint's ``{"model": {...}, ...}``) through the same rules; returns one
    dataclass per section.  Keys the schema no longer has are dropped: a checkpoint may predate a removed key."""
    out = {}
    for name, cls in schema.items():
        if cls is not str:
            known, where = {f.name for f in dataclasses.fields(cls)}, f"{label}: {name}"
            out[name] = _validated(_build(cls, {k: v for k, v in (configs.get(name) or {}).items() if k in known},
                                          where), where)
    return out


def load_sections(path: str | Path | None, schema: dict[str, type], overrides: list[str] = ()) -> dict:
    """Read a TOML config into one dataclass per section of ``schema`` (``{"model": ModelConfig, ...}``).

    Top-level scalar keys listed in ``schema`` with type ``str`` (e.g. ``name``) are returned as is.
    """
    label = "<defaults>" if path is None else str(path)
    raw = {} if path is None else read_toml(path)
    for item in overrides:
        section, key, value = parse_override(item)
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ConfigError(f"--set {item}: '{section}' is not a section")
        raw[section][key] = value
    for key in raw:
        if key not in schema:
            raise ConfigError(f"{label}: unknown section or key '{key}' (known: {', '.join(sorted(schema))})")
    out = {}
    for name, cls in schema.items():
        value, where = raw.get(name), f"{label}: {name}"
        if value is not None and not isinstance(value, str if cls is str else dict):
            raise ConfigError(f"{label}: '{name}' must be a string" if cls is str
                              else f"{label}: '{name}' must be a [section]")
        out[name] = value if cls is str else _validated(_build(cls, value or {}, where), where)
    if isinstance(out.get("name"), str):  # a recipe's name names its results files and run folder
        check_file_name(out["name"], f"{label}: name")
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
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start}: {e.object[e.start:e.start + 1]!r})") \
            from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a path to another config, got {base!r}")
    merged = read_toml(path.parent / base, _chain + (path.resolve(),))
    for key, value in raw.items():  # a section merged key by key, anything else replaced
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = {**merged[key], **value} if both else value
    return merged


def parse_override(item: str) -> tuple[str, str, Any]:
    """``"train.steps=10"`` -> ``("train", "steps", 10)``; the value is parsed as a TOML value (bare words as
    strings)."""
    lhs, equals, rhs = item.partition("=")
    if not equals or "." not in lhs:
        raise ConfigError(f"--set {item}: expected section.key=value")
    section, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return section, key, value


# ------------------------------------------------------------------------------------------- names and threads


def check_file_name(name: Any, where: str) -> str:
    """``name`` if it can name a file inside its folder (a run's results, a checkpoint's name): a non-empty string
    without path separators or NUL, not ``.`` or ``..``.  Else a one-line ConfigError naming ``where`` (the file and
    key, or the option, it came from): a name such as ``../../x`` would write outside the results folder."""
    if not isinstance(name, str):
        raise ConfigError(f"{where}: expected a string, got {name!r}")
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if not name or name in (".", "..") or "\0" in name or any(sep in name for sep in separators):
        raise ConfigError(f"{where}: {name!r} is not a file name (a name, not a path: no '/', not '.' or '..', "
                          f"not empty)")
    return name


def file_name_arg(text: str) -> str:
    """``argparse`` type of an option naming a results file (``--name``): :func:`check_file_name`'s rule, refused by
    argparse in one line."""
    try:
        return check_file_name(text, "name")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).partition(": ")[2]) from None


#: ``--threads`` may ask for at most this many threads per CPU core of the machine: far more starve the machine of
#: memory for thread stacks (and crash OpenMP) without making anything faster.
MAX_THREADS_PER_CPU = 4


def check_threads(n: Any, where: str = "--threads") -> int:
    """``n`` torch CPU threads if the machine can take them: an integer from 1 to ``MAX_THREADS_PER_CPU`` times its
    CPU cores; else a one-line ConfigError naming ``where``."""
    cpus = os.cpu_count() or 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise ConfigError(f"{where}: expected an integer, got {n!r}")
    if not 1 <= n <= MAX_THREADS_PER_CPU * cpus:
        raise ConfigError(f"{where}: must be in [1, {MAX_THREADS_PER_CPU * cpus}] ({MAX_THREADS_PER_CPU} per CPU core "
                          f"of this machine's {cpus}), got {n}")
    return n


def threads_arg(text: str) -> int:
    """``argparse`` type of ``--threads``: :func:`check_threads`'s rule."""
    try:
        return check_threads(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).partition(": ")[2]) from None
