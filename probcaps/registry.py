"""Where a trained model is found by name: the shipped checkpoints in ``checkpoints/`` of the repository."""

from __future__ import annotations

import os
from pathlib import Path

from probcaps.errors import CheckpointError

__all__ = ["CHECKPOINTS", "resolve_checkpoint"]

#: The shipped checkpoints: ``checkpoints/<name>.pt`` at the top of the repository.
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"


def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """The checkpoint file of ``name_or_path``: the path itself if it is a file, else the shipped
    ``checkpoints/<name>.pt``; neither is a :class:`~probcaps.errors.CheckpointError` saying where to put it."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = CHECKPOINTS / f"{name_or_path}.pt"
    if shipped.is_file():
        return shipped
    raise CheckpointError(f"{name_or_path}: no such checkpoint file, and no shipped model of that name "
                          f"(put its checkpoint at {shipped})")
