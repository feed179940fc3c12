"""Checkpoints: the one module that writes and reads them.

A checkpoint holds tensors and plain data only: dicts, lists and tuples of tensors, numbers, strings, booleans and
None.  Every read goes through ``torch.load(..., weights_only=True)``, whose unpickler rebuilds nothing else, so a
file crafted to run code when unpickled (an object whose ``__reduce__`` calls ``os.system``) is refused in one line
naming the file, and nothing in it runs.  What the training loop keeps that is not plain (numpy's and Python's RNG
states, config dataclasses) is converted to plain data on the way in (:func:`to_plain`, :func:`rng_state`) and back
on the way out (:func:`set_rng_state`), bit for bit, so resuming stays exact.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from probcaps.errors import CheckpointError
from probcaps.io import atomic_write

__all__ = ["save_checkpoint", "read_plain", "load_checkpoint", "checkpoint_step", "first_non_finite",
           "optimiser_tensors", "load_module_state", "run_finished", "load_final", "rng_state", "set_rng_state",
           "to_plain", "CONTENTS"]

#: What a checkpoint may contain, as error messages say it.
CONTENTS = "tensors, numbers, strings, booleans, None, and lists, tuples and dicts of them"

_SCALARS = (str, int, float, bool, type(None))


def to_plain(obj: Any, where: str = "checkpoint") -> Any:
    """``obj`` as tensors and plain data: numpy arrays become tensors, numpy scalars Python numbers, dataclasses
    (config sections) dicts, paths strings.  Anything else is a ``TypeError`` naming where it sits
    (``checkpoint['metadata']['x']``): a checkpoint that ``weights_only`` could not read back is never written."""
    if type(obj) in _SCALARS or torch.is_tensor(obj) or isinstance(obj, (torch.dtype, torch.Size)):
        return obj
    if isinstance(obj, (bool, int, float, str)):  # a subclass (an IntEnum such as a signal) would pickle its class
        return next(kind(obj) for kind in (bool, int, float, str) if isinstance(obj, kind))
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_plain(dataclasses.asdict(obj), where)
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; checkpoint keys are strings or integers")
        plain = {k: to_plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return OrderedDict(plain) if isinstance(obj, OrderedDict) else plain  # a state_dict stays an OrderedDict
    if isinstance(obj, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise TypeError(f"{where}: a {type(obj).__name__} cannot be stored in a checkpoint (only {CONTENTS})")


def save_checkpoint(obj: dict, path: str | os.PathLike) -> Path:
    """Atomically write ``obj`` (converted by :func:`to_plain`) to ``path`` with ``torch.save``; never
    half-written (:func:`probcaps.io.atomic_write`)."""
    plain = to_plain(obj)
    return atomic_write(path, lambda f: torch.save(plain, f))


def _refusal(path: Path, e: Exception) -> CheckpointError:
    """One line for a file whose pickle names a class or function beyond plain data."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    what = f" ({found.group(1)})" if found else ""
    older = (" (a checkpoint of an older probcaps, which pickled numpy's RNG state: resume it with the probcaps "
             "that wrote it, or retrain)" if found and found.group(1).startswith("numpy") else "")
    return CheckpointError(f"{path}: refused to load: it holds an object other than {CONTENTS}{what}; loading it "
                           f"could run code{older}")


def read_plain(path: str | os.PathLike, map_location="cpu", mmap: bool = False) -> Any:
    """The contents of a file written by ``torch.save``, read with ``weights_only=True`` (tensors and plain data
    only).  A missing, unreadable or code-carrying file is a one-line :class:`CheckpointError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "GLOBAL" in str(e) or "unsupported global" in str(e).lower():  # a class or function: could run code
            raise _refusal(path, e) from None
        raise CheckpointError(f"{path}: not a readable checkpoint (damaged, or not written by torch.save)") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: {first})") from None


def first_non_finite(tensors: dict) -> str | None:
    """The name of the first floating tensor of ``{name: tensor}`` holding a NaN or Inf, or None (one sync)."""
    named = [(k, t) for k, t in tensors.items() if torch.is_tensor(t) and t.is_floating_point() and t.numel()]
    finite = torch.stack([torch.isfinite(t).all().to(named[0][1].device) for _, t in named]) if named else None
    return None if finite is None or bool(finite.all()) else named[int((~finite).nonzero()[0])][0]


def optimiser_tensors(optimiser_state: dict) -> dict:
    """``{"optimiser.state.<i>.<key>": tensor}`` of an optimiser's ``state_dict()``."""
    return {f"optimiser.state.{i}.{k}": v for i, s in optimiser_state["state"].items() for k, v in s.items()}


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Read a checkpoint written by :func:`save_checkpoint`; a missing, unreadable, code-carrying or non-finite
    one, or one whose ``module`` is not a ``{name: tensor}`` dict, is a one-line error naming the file."""
    path = Path(path)
    ckpt = read_plain(path, map_location=map_location)
    if not isinstance(ckpt, dict) or "module" not in ckpt:
        raise CheckpointError(f"{path}: not a probcaps checkpoint (no 'module' state)")
    module = ckpt["module"]
    if not isinstance(module, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in module.items()):
        raise CheckpointError(f"{path}: 'module' must be a dict of named tensors, got a {type(module).__name__}"
                              + (" with other values" if isinstance(module, dict) else ""))
    for key in ("state", "metadata", "train_config"):
        if key in ckpt and not isinstance(ckpt[key], dict):
            raise CheckpointError(f"{path}: '{key}' must be a dict, got {type(ckpt[key]).__name__}")
    step = ckpt.get("state", {}).get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: 'state.step' must be an integer >= 0, got {step!r}")
    if (bad := first_non_finite(module)) is not None:
        raise CheckpointError(f"{path}: '{bad}' holds NaN or Inf values; the model in this checkpoint diverged and "
                              f"cannot be used")
    return ckpt


def checkpoint_step(path: str | os.PathLike) -> str:
    """The training step of the checkpoint at ``path`` as text, or ``"unknown"`` (for messages only)."""
    try:
        step = read_plain(path, mmap=True)["state"]["step"]
        return str(int(step))
    except Exception:
        return "unknown"


def load_module_state(module: nn.Module, state: dict, path: str | os.PathLike) -> None:
    """``load_state_dict`` that names the checkpoint and the first mismatching tensor instead of a torch dump."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{path}: checkpoint does not fit the model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise CheckpointError(f"{path}: '{k}' has shape {tuple(v.shape)} in the checkpoint but "
                                  f"{tuple(own[k].shape)} in the model (different config?)")
    module.load_state_dict(state)


def run_finished(out_dir: str | os.PathLike, steps: int) -> bool:
    """Whether ``out_dir`` holds a final model (``final.pt``) trained for at least ``steps`` steps: ``--resume``
    entry points reuse such a run as it is, and train a shorter one on from its last checkpoint."""
    final = Path(out_dir) / "final.pt"
    return final.is_file() and int(load_checkpoint(final)["state"]["step"]) >= steps


def load_final(module: nn.Module, out_dir: str | os.PathLike, map_location="cpu") -> dict:
    """Load the final model of the run in ``out_dir`` (``final.pt``) into ``module``; returns its training state."""
    path = Path(out_dir) / "final.pt"
    ckpt = load_checkpoint(path, map_location=map_location)
    load_module_state(module, ckpt["module"], path)
    return ckpt["state"]


# ------------------------------------------------------------------------------------------------------ RNG states


def rng_state() -> dict:
    """Every RNG the training loop draws from, as plain data: torch's (and CUDA's) byte tensors, numpy's Mersenne
    Twister as its key tensor and counters, Python's as its version, key tuple and cached Gaussian."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"bit_generator": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the RNGs from :func:`rng_state`'s dict."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["bit_generator"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, keys, gauss_next = state["python"]
    random.setstate((version, tuple(keys), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
