"""Provenance records written next to every result: what ran, from which commit, on what hardware."""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["git_commit", "pinned_commit", "device_description", "provenance", "write_results", "repo_relative",
           "command_line", "REPO_ROOT"]

#: the checkout holding this package: recorded paths under it are written relative to it
REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_relative(value: Any, root: str | os.PathLike | None = None) -> Any:
    """``value`` with every absolute path under ``root`` (default: :data:`REPO_ROOT`) made relative to it.

    Works on strings (a path, or a command line holding paths) and recursively on dicts, lists and tuples; other
    values come back unchanged.  Results files and tables then read the same on every machine.
    """
    prefix = os.fspath(Path(root).resolve() if root is not None else REPO_ROOT) + os.sep
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value).replace(prefix, "")
    if isinstance(value, dict):
        return {k: repo_relative(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(repo_relative(v, root) for v in value)
    return value


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a user would type it again from the repository root.

    ``argv`` defaults to ``sys.argv``.  The CLI (``.../probcaps/__main__.py`` or the ``probcaps`` script) reads
    ``probcaps``; a script under the repository reads as its relative path; arguments are shell-quoted.
    """
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    program = Path(argv[0])
    # `probcaps run X` names the experiment's own parser "probcaps run X"; its arguments still begin "run X"
    cli = program.name == "probcaps" or (program.name == "__main__.py" and program.parent.name == "probcaps") \
        or argv[0].startswith("probcaps run ")
    head = "probcaps" if cli else repo_relative(argv[0])
    return " ".join([head, *(shlex.quote(repo_relative(a)) for a in argv[1:])])


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(repo_dir: str | os.PathLike | None = None) -> str | None:
    """Short commit hash of the checkout at ``repo_dir`` (default: the one holding this package), with ``"+dirty"``
    when tracked files have uncommitted changes; None without a checkout, git or a commit."""
    start = Path(repo_dir).resolve() if repo_dir is not None else REPO_ROOT
    commit = _git(["rev-parse", "--short", "HEAD"], start) if start.is_dir() else None
    if commit and _git(["status", "--porcelain", "--untracked-files=no"], start):  # None: status failed, not dirty
        commit += "+dirty"
    return commit


#: the commits of the commands now running, outermost first (:func:`pinned_commit`)
_PINNED_COMMITS: list = []


@contextlib.contextmanager
def pinned_commit():
    """Within it, :func:`provenance` names the commit the checkout had on entry: a command's results files name the
    code that ran, not a tree that the command's own first outputs have made dirty (a committed results file it
    rewrites before writing the next).  Every entry point runs inside one (``probcaps.runner.one_line_errors``)."""
    _PINNED_COMMITS.append(git_commit())
    try:
        yield
    finally:
        _PINNED_COMMITS.pop()


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("model name", "hardware", "processor name", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_description(device: Any = "cpu") -> str:
    """Human-readable description of a torch device, e.g. ``"cpu: Intel Xeon ... (2 cores, 2 torch threads)"``."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return f"{dev} (CUDA unavailable)"
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        return f"cuda:{idx}: {props.name} ({props.total_memory / 2**30:.0f} GiB)"
    if dev.type == "cpu":
        return f"cpu: {_cpu_model_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    return str(dev)


def has_bf16_kernels(device: Any = "cpu") -> bool:
    """Whether ``device`` runs bfloat16 convolutions and matrix products natively: a GPU, or a CPU with AVX-512 BF16
    or AMX (oneDNN's check); elsewhere they are emulated, several times slower than float32."""
    import torch

    return torch.device(device).type == "cuda" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _version(module_name: str) -> str | None:
    try:
        return getattr(__import__(module_name), "__version__", None)
    except Exception:
        return None


def provenance(command: str | None = None, seed: int | None = None, steps: int | None = None,
               wall_time_s: float | None = None, device: Any = "cpu", **extra: Any) -> dict:
    """Provenance record for a result file. ``extra`` keys are added verbatim (and may override).

    ``command`` defaults to :func:`command_line`; paths under the repository are recorded relative to it."""
    record = {
        "command": command if command is not None else command_line(),
        "git_commit": _PINNED_COMMITS[0] if _PINNED_COMMITS else git_commit(),
        "seed": seed,
        "steps": steps,
        "wall_time_s": wall_time_s,
        "device": device_description(device),
        "torch_version": _version("torch"),
        "pyro_version": _version("pyro"),
        "python_version": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    record.update(extra)
    return repo_relative(record)


def _jsonable(obj: Any) -> Any:
    """Convert numpy / torch scalars and arrays, paths and tuples to plain JSON types; non-finite floats become
    None so the output is strict JSON."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "detach") and hasattr(obj, "cpu"):  # torch.Tensor
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, (np.ndarray, np.generic)):  # arrays and numpy scalars
        return _jsonable(obj.tolist())
    return str(obj)


def write_results(path: str | os.PathLike, metrics: dict, provenance: dict) -> Path:
    """Atomically write ``{"metrics": ..., "provenance": ...}`` as JSON to ``path``.

    Absolute paths under the repository (figures, checkpoints, commands) are recorded relative to it.  The README
    table of the result is written beside it by the experiment (:func:`probcaps.report.write_table`)."""
    from .io import write_json

    for what, value in (("metrics", metrics), ("provenance", provenance)):
        if not isinstance(value, dict):
            raise ValueError(f"{what} must be a dict, got {type(value).__name__}")
    return write_json(path, repo_relative({"metrics": _jsonable(metrics), "provenance": _jsonable(provenance)}))
