"""Data: IDX files, MNIST loading/downloading, digit placement and rotation, deterministic batches."""

from . import idx, loaders, mnist, transforms
from .idx import *  # noqa: F403
from .loaders import *  # noqa: F403
from .mnist import *  # noqa: F403
from .transforms import *  # noqa: F403

__all__ = idx.__all__ + loaders.__all__ + mnist.__all__ + transforms.__all__
