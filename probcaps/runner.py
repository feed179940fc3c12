"""What every entry point shares: argument types and options, run-folder set-up, one-line errors, seed summaries.

The command line (:mod:`probcaps.cli`) and every experiment build their parsers and run their ``main`` with these;
nothing here imports the models, the inference code or the experiments.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path

from probcaps.config import file_name_arg, threads_arg
from probcaps.errors import ProbcapsError
from probcaps.provenance import pinned_commit

__all__ = ["MALLOC_ENV", "reexec_with_allocator_settings", "os_error_message", "one_line_errors", "launch",
           "positive_int", "non_negative_int", "finite_float", "finite_positive_float", "finite_non_negative_float",
           "threads_arg", "device_arg", "folder_arg", "file_name_arg", "output_file_arg", "config_arg",
           "checkpoint_arg", "add_common_args",
           "add_config_args", "add_run_args", "add_ttvi_args", "table_writer", "setup_run", "seed_summary",
           "config_dicts"]

# glibc hands large per-step buffers back to the OS and page-faults them in again every step; keeping them
# mapped makes a training step 25-40% faster on CPU.  These must be set before the process starts.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "1000000000"}


def reexec_with_allocator_settings(args: list[str]) -> None:
    """Restart this Python as ``python *args`` with :data:`MALLOC_ENV` set, unless it is set already (or not
    Linux, or ``PROBCAPS_NO_REEXEC`` is set).  Used by the CLI and the experiment scripts."""
    if sys.platform != "linux" or os.environ.get("PROBCAPS_NO_REEXEC") or all(k in os.environ for k in MALLOC_ENV):
        return
    env = {**os.environ, **MALLOC_ENV, "PROBCAPS_NO_REEXEC": "1"}
    os.execve(sys.executable, [sys.executable, *args], env)


def os_error_message(e: OSError) -> str:
    """``PATH: reason`` of an unreadable or unwritable path (permissions, a full disk, a file where a folder
    should be, ...); the reason alone when the error names no path."""
    reason = e.strerror or str(e)
    if e.filename is None:
        return reason
    path = str(e.filename) if e.filename2 is None else f"{e.filename} -> {e.filename2}"
    return f"{path}: {reason}"


def one_line_errors(name: str):
    """Decorate an entry point ``main(argv) -> int``: a :class:`ProbcapsError` (bad input, missing file, bad config
    key) or an ``OSError`` (a path that cannot be read or written: permissions, a full disk) prints one line
    ``NAME: error: ...`` to stderr and returns 2 instead of a traceback; Ctrl-C or SIGTERM (the training loop has
    already said where its checkpoint is) returns the shell's 130 or 143."""

    def decorate(main):
        @functools.wraps(main)
        def wrapped(argv=None) -> int:
            try:
                with pinned_commit():  # every results file of this command names the commit it started at
                    return main(argv) or 0
            except (ProbcapsError, OSError) as e:
                print(f"{name}: error: {e if isinstance(e, ProbcapsError) else os_error_message(e)}", file=sys.stderr)
                return 2
            except KeyboardInterrupt as e:  # 130 for Ctrl-C, 143 for SIGTERM (inference.train.Terminated)
                return getattr(e, "exit_code", 130)
        return wrapped
    return decorate


def launch(main) -> None:
    """Run an entry point as a script: restart with the allocator settings, then ``sys.exit(main())``."""
    reexec_with_allocator_settings(sys.argv)
    sys.exit(main())


# ------------------------------------------------------------------------------------- argument types
# argparse turns the ArgumentTypeError of a type into "usage: ..." plus one "error: argument --x: ..." line, exit 2.


def _bounded(kind: type, low: float | None, strict: bool, doc: str):
    """An argparse type reading a finite ``kind`` (int or float) that is ``> low`` (``strict``) or ``>= low``."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (value <= low if strict else value < low):
            shown = value if kind is int else f"{value:g}"
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {shown}")
        return value

    parse.__doc__ = doc
    return parse


positive_int = _bounded(int, 1, False, "An integer >= 1 (counts, steps, batch sizes, thread counts, image limits).")
non_negative_int = _bounded(int, 0, False, "An integer >= 0 (seeds; limits where 0 means all or none).")
finite_float = _bounded(float, None, False, "Any finite number (angles).")
finite_positive_float = _bounded(float, 0, True, "A finite number > 0 (learning rates, scales).")
finite_non_negative_float = _bounded(float, 0, False, "A finite number >= 0 (maximum angles).")


def device_arg(text: str) -> str:
    """A torch device this machine has: ``cpu``, ``cuda``, ``cuda:1``, ``mps``, ..."""
    if text == "cpu":
        return text
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise argparse.ArgumentTypeError(f"{text}: MPS is not available on this machine")
    elif device.type not in ("cuda", "mps", "cpu"):
        raise argparse.ArgumentTypeError(f"{text}: unsupported device type (use cpu, cuda or mps)")
    return text


def folder_arg(text: str) -> str:
    """A folder to write into: absent (it is created) or a folder, not a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a folder")
    parent = next((folder for folder in path.parents if folder.exists()), None)  # the nearest existing one
    if parent is not None and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a folder")
    return text


def output_file_arg(text: str) -> str:
    """A file to write: absent or a file (it is replaced), not a folder, and not under a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder (name a file, e.g. {path / 'results.json'})")
    folder_arg(str(path.parent))
    return text


def add_common_args(p: argparse.ArgumentParser, results_dir=None, threads: int | None = None) -> None:
    """The options every command and experiment shares: ``--device``, ``--data-dir``, ``--threads``, ``--quiet``
    (and ``--results-dir`` when ``results_dir`` is given)."""
    p.add_argument("--device", type=device_arg, default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--data-dir", default=None, help="data root holding mnist/ (default: $PROBCAPS_DATA, else the "
                                                    "user cache)")
    p.add_argument("--threads", type=threads_arg, default=threads,
                   help=f"torch CPU threads (default: {threads or 'torch' + chr(39) + 's choice'})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    if results_dir is not None:
        p.add_argument("--results-dir", type=folder_arg, default=str(results_dir),
                       help="where the results JSON and figures go")


def config_arg(text: str) -> str:
    """A recipe: a packaged one by bare name (``mnist``), or a path to a TOML file."""
    from probcaps.errors import ConfigError
    from probcaps.registry import resolve_config

    try:
        return str(resolve_config(text))
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).replace(f"--config {text}: ", f"{text}: ", 1)) from None


def checkpoint_arg(text: str) -> str:
    """A trained model: a shipped one by bare name (``mnist``, its sha256 checked), or a path to a checkpoint."""
    from probcaps.errors import CheckpointError
    from probcaps.registry import resolve_checkpoint

    try:
        return str(resolve_checkpoint(text))
    except CheckpointError as e:
        raise argparse.ArgumentTypeError(str(e).replace(f"--checkpoint {text}: ", f"{text}: ", 1)) from None


def add_config_args(p: argparse.ArgumentParser, config, seeds: list[int], config_help: str | None = None) -> None:
    """``--config`` (default ``config``, a recipe's bare name or path; a list of recipes: one or more), ``--seeds``
    (default ``seeds``) and the repeatable ``--set SECTION.KEY=VALUE`` overrides of the config."""
    many = isinstance(config, list)
    default = [config_arg(str(c)) for c in config] if many else config_arg(str(config))
    p.add_argument("--config", type=config_arg, nargs="+" if many else None, default=default,
                   help=config_help or "a recipe by name (probcaps list) or a TOML file")
    p.add_argument("--seeds", type=non_negative_int, nargs="+", default=seeds)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")


def add_run_args(p: argparse.ArgumentParser, experiment: str, *, name: str | bool | None = None,
                 out: str | bool | None = None, out_help: str = "run folders (default: runs/<name>)",
                 resume: str | bool = False, checkpoint_out: str | None = None,
                 tables: str = "table (RESULTS_DIR/<name>.md)", threads: int | None = None) -> None:
    """An experiment's output options, then :func:`add_common_args` with ``--results-dir`` defaulting to
    ``results/<experiment>`` under the current folder: ``--out`` (default ``out``; False: no option),
    ``--checkpoint-out`` (when its help ``checkpoint_out`` is given), ``--name`` (default ``name``, None: the
    config's name; False: no option), ``--resume`` (when ``resume``, its help or True, is given) and
    ``--tables-only`` (rewriting the README ``tables``)."""
    if out is not False:
        p.add_argument("--out", type=folder_arg, default=out, help=out_help)
    if checkpoint_out:
        p.add_argument("--checkpoint-out", default=None, help=checkpoint_out)
    if name is not False:
        p.add_argument("--name", type=file_name_arg, default=name, help="names the results files" + (
            " (default: the config's name)" if name is None else ""))
    if resume:
        p.add_argument("--resume", action="store_true",
                       help=resume if isinstance(resume, str) else "continue an interrupted run; reuse a finished one")
    p.add_argument("--tables-only", action="store_true",
                   help=f"rewrite the README {tables} from the results JSON already there, then stop")
    add_common_args(p, results_dir=Path("results") / experiment, threads=threads)


def add_ttvi_args(p: argparse.ArgumentParser, pose_family: bool = True) -> None:
    """The test-time VI options: ``--steps``, ``--lr``, ``--batch-size`` (and ``--pose-family``)."""
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--lr", type=finite_positive_float, default=0.03)
    p.add_argument("--batch-size", type=positive_int, default=250, help="images optimised together")
    if pose_family:
        p.add_argument("--pose-family", default="delta", choices=["delta", "normal"])


def table_writer(readme_table, name: str):
    """``results_dir -> write_table(results_dir, name, readme_table(results_dir, name))``: an experiment's README
    table file (None while there are no results)."""
    from probcaps.report import write_table

    return lambda results_dir: write_table(results_dir, name, readme_table(Path(results_dir), name))


def setup_run(args, write_tables) -> bool:
    """With ``--tables-only``: ``write_tables(results_dir)`` (the table file or files it wrote, None for none), print
    each, True (the experiment stops there).  Otherwise set torch's CPU threads from ``--threads``; False."""
    if getattr(args, "tables_only", False):
        written = write_tables(Path(args.results_dir))
        written = written if isinstance(written, list) else [written]
        print("\n".join(f"wrote {path}" for path in written if path is not None))
        return True
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return False


def seed_summary(runs: list[dict], keys) -> dict:
    """``{<key>_mean, <key>_std}`` of each of ``keys`` over ``runs`` (one dict per seed; a number or a list of
    numbers per key): the mean and the sample standard deviation (zero for one run)."""
    import numpy as np

    summary = {}
    for key in keys:
        values = np.array([r[key] for r in runs], dtype=float)
        summary[f"{key}_mean"] = values.mean(0).tolist()
        summary[f"{key}_std"] = (values.std(0, ddof=1) if len(values) > 1 else np.zeros(values.shape[1:])).tolist()
    return summary


def config_dicts(cfg: dict) -> dict:
    """``{section: its to_dict()}`` of the config sections of ``cfg``, as results and checkpoints record them."""
    return {k: v.to_dict() for k, v in cfg.items() if hasattr(v, "to_dict")}


