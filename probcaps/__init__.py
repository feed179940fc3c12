"""Probabilistic capsule networks in Pyro.

    import probcaps
    model = probcaps.load("mnist")          # a trained capsule model: probcaps.inference.api

The names below are imported on first use, so that ``import probcaps`` (and the command line's start) stays fast and
loads neither torch nor Pyro.
"""

from __future__ import annotations

__all__ = ["load", "TrainedCapsuleModel", "Capsules", "ObjectDrawings"]


def __getattr__(name: str):
    # the public facade: the one module of probcaps/ besides the CLI that reaches the layers above it, and only
    # here, on first use; the API's own imports of probcaps.* then find this package already initialised
    if name in __all__:
        from probcaps.inference import api

        value = getattr(api, name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'probcaps' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
