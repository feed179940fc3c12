"""Errors raised for bad input. Each message names the file, argument or key at fault."""


class ProbcapsError(Exception):
    """Base class: the command line prints these as one line, without a traceback."""


class DataError(ProbcapsError):
    """A data file or folder is missing, truncated, corrupt or of the wrong format."""


class ConfigError(ProbcapsError):
    """A config file or argument is malformed or has an unknown key."""


class CheckpointError(ProbcapsError):
    """A checkpoint is missing, unreadable or does not fit the model."""


class TrainingDiverged(ProbcapsError):
    """The loss or a parameter became NaN/Inf; nothing was written from the broken state."""
