"""Atomic file writes: a reader (or a crash) never sees a half-written file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["atomic_write", "atomic_torch_save", "write_json"]


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "wb") -> Path:
    """Call ``write(fileobj)`` on a temporary file next to ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600 files; give the result the permissions an ordinary open() would
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    import torch

    return atomic_write(path, lambda f: torch.save(obj, f))


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` as indented JSON (with a trailing newline)."""
    return atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n"), mode="w")
