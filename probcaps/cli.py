"""The ``probcaps`` command line.

    probcaps train --config experiments/configs/mnist.toml --out runs/mnist [--resume] [--set train.steps=100]
    probcaps evaluate --checkpoint runs/mnist/final.pt [--name mnist] [--results-dir results]
    probcaps evaluate --checkpoint runs/a/final.pt runs/b/final.pt --name mnist_readout   # one per seed: mean ± std
    probcaps ttvi --checkpoint runs/mnist/final.pt [--limit 1000] [--out results/ttvi_mnist.json]
    probcaps draw-objects --checkpoint checkpoints/mnist.pt [--out results/mnist_objects_drawn.png]
    probcaps run <experiment> [its arguments]   # any experiment script, e.g. probcaps run mnist_probe --seeds 0
    probcaps demo                      # a few minutes of training on real MNIST, then the probe report
    probcaps download [--data-dir D]   # fetch MNIST (needs a network)
    probcaps report                    # splice results/<name>.md into the README's and docs' results markers

Errors in input (files, configs, checkpoints, arguments, unreadable or unwritable paths) are printed as one line,
exit status 2; nothing is written by a command refused for its input.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import math
import os
import re
import sys
from pathlib import Path

from probcaps.errors import ProbcapsError
from probcaps.provenance import pinned_commit

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
    p.add_argument("--threads", type=positive_int, default=threads,
                   help=f"torch CPU threads (default: {threads or 'torch' + chr(39) + 's choice'})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    if results_dir is not None:
        p.add_argument("--results-dir", type=folder_arg, default=str(results_dir),
                       help="where the results JSON and figures go")


REPO = Path(__file__).resolve().parent.parent


def add_config_args(p: argparse.ArgumentParser, config, seeds: list[int], config_help: str | None = None) -> None:
    """``--config`` (default ``config``; a list of recipes: one or more), ``--seeds`` (default ``seeds``) and the
    repeatable ``--set SECTION.KEY=VALUE`` overrides of the config."""
    many = isinstance(config, list)
    p.add_argument("--config", nargs="+" if many else None, default=[str(c) for c in config] if many else str(config),
                   help=config_help)
    p.add_argument("--seeds", type=non_negative_int, nargs="+", default=seeds)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")


def add_run_args(p: argparse.ArgumentParser, *, name: str | bool | None = None, out: str | bool | None = None,
                 out_help: str = "run folders (default: runs/<name>)", resume: str | bool = False,
                 checkpoint_out: str | None = None, tables: str = "table (RESULTS_DIR/<name>.md)",
                 threads: int | None = None) -> None:
    """An experiment's output options, then :func:`add_common_args` with ``--results-dir`` the repository's
    ``results/``: ``--out`` (default ``out``; False: no option), ``--checkpoint-out`` (when its help
    ``checkpoint_out`` is given), ``--name`` (default ``name``, None: the config's name; False: no option),
    ``--resume`` (when ``resume``, its help or True, is given) and ``--tables-only`` (rewriting the README
    ``tables``)."""
    if out is not False:
        p.add_argument("--out", type=folder_arg, default=out, help=out_help)
    if checkpoint_out:
        p.add_argument("--checkpoint-out", default=None, help=checkpoint_out)
    if name is not False:
        p.add_argument("--name", default=name, help="names the results files" + (
            " (default: the config's name)" if name is None else ""))
    if resume:
        p.add_argument("--resume", action="store_true",
                       help=resume if isinstance(resume, str) else "continue an interrupted run; reuse a finished one")
    p.add_argument("--tables-only", action="store_true",
                   help=f"rewrite the README {tables} from the results JSON already there, then stop")
    add_common_args(p, results_dir=REPO / "results", threads=threads)


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


# ------------------------------------------------------------------------------------------- experiments


@functools.lru_cache(maxsize=None)
def experiments() -> dict[str, str]:
    """``{name: first line of its docstring}`` of the modules of ``probcaps.experiments`` that define
    ``main(argv)``, read from their source text (importing, or even parsing, every experiment takes seconds)."""
    import probcaps.experiments

    found = {}
    for path in (p for folder in probcaps.experiments.__path__ for p in Path(folder).glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if re.search(r"^def main\(", source, re.MULTILINE):
            docstring = re.match(r'\s*r?("""|\'\'\')\s*(.*)', source)
            found[path.stem] = docstring.group(2).rstrip('"\'') if docstring else ""
    return dict(sorted(found.items()))


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


def run_experiment(name: str, argv: list[str]) -> int:
    """``probcaps.experiments.<name>.main(argv)``: the experiment as its own script would run it (its errors as one
    line even where its ``main`` lacks :func:`one_line_errors`)."""
    module = importlib.import_module(f"probcaps.experiments.{name}")
    program = sys.argv[0]
    sys.argv[0] = f"probcaps run {name}"  # the experiment's argparse names itself after sys.argv[0]
    try:
        return one_line_errors(name)(module.main)(argv)
    finally:
        sys.argv[0] = program


# ------------------------------------------------------------------------------------------- the commands


def build_parser() -> argparse.ArgumentParser:
    import probcaps.experiments

    parser = argparse.ArgumentParser(prog="probcaps", description="Probabilistic capsule networks in Pyro.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train the generative capsule model with SVI")
    p.add_argument("--config", default=None, help="experiment TOML (default: built-in defaults)")
    p.add_argument("--out", type=folder_arg, default=None,
                   help="run folder for checkpoints and the log (default: runs/<the config's name>)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--force", action="store_true", help="start afresh in a run folder that holds an earlier run")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files into OUT")
    p.add_argument("--seed", type=non_negative_int, default=None, help="training seed (overrides train.seed)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps (overrides train.steps)")
    p.add_argument("--jit", action="store_true", help="use JitTraceEnum_ELBO")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the alpha compositing and the part CNN (faster steps)")
    p.add_argument("--validate", action="store_true", help="turn on Pyro's validation checks")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--evaluate", action="store_true", help="evaluate the final checkpoint afterwards")
    add_common_args(p, results_dir="results")

    p = sub.add_parser("evaluate", help="probe accuracies, k-means accuracy and figures of a checkpoint")
    p.add_argument("--checkpoint", required=True, nargs="+",
                   help="a trained model; several (one per seed): each is evaluated, then mean ± std (needs --name)")
    p.add_argument("--name", default=None,
                   help="results/<name>.json (default: <the run's config name>_seed<its training seed>)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--no-figures", action="store_true")
    add_common_args(p, results_dir="results")

    p = sub.add_parser("ttvi", help="free-form test-time VI on test images with a trained checkpoint")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--split", default="test", choices=["train", "test"])
    p.add_argument("--limit", type=positive_int, default=1000, help="number of images (the first N of the split)")
    p.add_argument("--rotate", type=finite_float, default=0.0, help="rotate every image by this many degrees first")
    add_ttvi_args(p)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", type=output_file_arg, default=None,
                   help="results JSON file (default: results/ttvi_<run name>.json)")
    add_common_args(p)

    p = sub.add_parser("draw-objects", help="draw each object of a checkpoint alone, and the main ways its parts "
                                            "move together (a model with object codes)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--limit", type=positive_int, default=10000,
                   help="test images (the first N) that give each object its mean latents and code directions")
    p.add_argument("--components", type=non_negative_int, default=2, help="principal directions of the codes drawn")
    p.add_argument("--span", type=finite_positive_float, default=2.0, help="how far along each: standard deviations")
    p.add_argument("--min-share", type=finite_non_negative_float, default=0.01,
                   help="draw the objects on (presence > 0.5) in at least this share of the images")
    p.add_argument("--out", type=output_file_arg, default=None,
                   help="PNG file (default: results/<the run's name>_objects_drawn.png)")
    add_common_args(p)

    p = sub.add_parser("demo", help="train a small model on real MNIST for a few minutes and report the probes")
    p.add_argument("--out", type=folder_arg, default="runs/demo")
    p.add_argument("--steps", type=positive_int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    add_common_args(p, results_dir="runs/demo/results")
    # `train` with the demo recipe (a package file), then `evaluate`; running it again replaces its run folder
    p.set_defaults(config=str(Path(probcaps.experiments.__path__[0]) / "configs" / "demo.toml"), resume=False,
                   force=True, tensorboard=False, evaluate=True, seed=None, jit=False, compile=False, validate=False)

    found = experiments()
    width = max(map(len, found), default=0)
    p = sub.add_parser("run", help="run an experiment script (probcaps run <experiment> --help for its options)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run an experiment as `python -m probcaps.experiments.<experiment>` would.",
                       epilog="experiments:\n" + "\n".join(f"  {n:{width}s}  {doc}" for n, doc in found.items()))
    p.add_argument("experiment", choices=list(found), metavar="experiment", help="one of: " + ", ".join(found))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the experiment's own arguments")

    p = sub.add_parser("download", help="download MNIST into the data root (needs a network)")
    p.add_argument("--data-dir", default=None)

    p = sub.add_parser("report", help="put each results/<name>.md (written by the experiment that wrote "
                                      "results/<name>.json) between the README's and docs/*.md's results markers")
    p.add_argument("--results-dir", default="results", help="where the table files are")
    p.add_argument("--readme", default="README.md", help="the README (its docs/ folder is spliced too)")
    return parser


def _train(args) -> None:
    from probcaps.inference.capsule_svi import load_experiment_config, train_capsules

    overrides = [*args.set, *(f"train.{key}={getattr(args, key)}" for key in ("seed", "steps")
                              if getattr(args, key) is not None),
                 *(f"train.{key}=true" for key in ("jit", "compile", "validate") if getattr(args, key))]
    cfg = load_experiment_config(args.config, overrides)
    args.out = args.out or Path("runs") / cfg["name"]
    # only the options asked for: the training loop's defaults stand otherwise
    loop_options = {key: True for key in ("force", "tensorboard") if getattr(args, key)}
    state = train_capsules(cfg, args.out, resume=args.resume, device=args.device, data_dir=args.data_dir,
                           progress=not args.quiet and args.rank == 0, **loop_options)
    print(f"trained {state.step} steps in {state.wall_time_s:.0f} s on {args.device}; checkpoint: "
          f"{Path(args.out) / 'final.pt'}")
    if args.evaluate:
        metrics = _evaluate_path(Path(args.out) / "final.pt", args, name=cfg["name"])
        print("linear probe on the test images (fit on the training features):")
        _print_metrics(metrics)
        print(f"metrics and figures written under {args.results_dir}/ ({cfg['name']}.json, "
              f"{cfg['name']}_templates.png, {cfg['name']}_reconstructions.png)")


def _evaluate_path(checkpoint, args, name=None, overrides=()):
    from probcaps.inference.evaluate import evaluate_checkpoint

    return evaluate_checkpoint(checkpoint, name=name, results_dir=args.results_dir, data_dir=args.data_dir,
                               device=args.device, overrides=list(overrides), progress=not args.quiet,
                               figures=not getattr(args, "no_figures", False))


def _evaluate(args) -> None:
    if len(args.checkpoint) == 1:
        return _print_metrics(_evaluate_path(args.checkpoint[0], args, name=args.name, overrides=args.set))
    from probcaps.inference.evaluate import evaluate_seeds

    summary = evaluate_seeds(args.checkpoint, args.name, results_dir=args.results_dir, data_dir=args.data_dir,
                             device=args.device, overrides=list(args.set), progress=not args.quiet,
                             figures=not args.no_figures)
    _print_metrics({k: v for k, v in summary.items() if k.endswith("_mean")})


def _print_metrics(metrics: dict) -> None:
    """The scalar metrics, one a line (per-class reports and confusion matrices stay in the results JSON)."""
    for key, value in metrics.items():
        if not isinstance(value, (dict, list)):
            print(f"  {key:34s} {value:.4f}" if isinstance(value, float) else f"  {key:34s} {value}")


def _ttvi(args) -> None:
    import torch

    from probcaps.data import rotate, to_float
    from probcaps.experiments.ttvi_classification import throughput_table
    from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained
    from probcaps.inference.evaluate import reconstruction_error
    from probcaps.inference.ttvi import ttvi_batches
    from probcaps.provenance import provenance, write_results
    from probcaps.report import write_table

    cfg, system = load_trained(args.checkpoint, device=args.device)
    out = Path(args.out or Path("results") / f"ttvi_{cfg['name']}.json")
    if out.is_dir():  # refused before the optimisation, not after it
        raise ProbcapsError(f"--out {out}: is a folder (name the results JSON file)")
    images, _ = load_images(cfg["data"], args.split, args.data_dir, limit=args.limit)
    x = rotate(to_float(images), args.rotate).clamp(0, 1) if args.rotate else to_float(images)
    result = ttvi_batches(system.model, system.guide, x, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                          device=args.device, progress=not args.quiet, seed=args.seed, pose_family=args.pose_family)
    before = encode_dataset(system.encoder, x, args.batch_size, args.device)
    recon_mse = [reconstruction_error(system.model, x, latents, args.batch_size, args.device)
                 for latents in (before, result.latents)]
    metrics = {
        "n_images": len(x), "rotation_deg": args.rotate, "steps": args.steps, "lr": args.lr,
        "elbo_encoder_mean": float(result.elbo_start.mean()), "elbo_ttvi_mean": float(result.elbo_end.mean()),
        "recon_mse_encoder": recon_mse[0], "recon_mse_ttvi": recon_mse[1],
        "wall_time_s": result.wall_time_s, "image_steps_per_s": len(x) * args.steps / result.wall_time_s,
        "cpu_time_s": result.cpu_time_s, "threads": torch.get_num_threads(), "elbo_trace": result.elbo_trace,
    }
    if args.rank > 0:
        return
    write_results(out, metrics, provenance(seed=args.seed, steps=args.steps, wall_time_s=result.wall_time_s,
                                           device=args.device, checkpoint=str(args.checkpoint)))
    write_table(out.parent, out.stem, throughput_table(out.parent, out.stem))
    _print_metrics({k: v for k, v in metrics.items() if k != "elbo_trace"})
    print(f"written to {out}")


def _draw_objects(args) -> None:
    from probcaps.inference.capsule_svi import encode_dataset, load_images, load_trained
    from probcaps.inference.evaluate import object_drawings, plot_object_drawings

    cfg, system = load_trained(args.checkpoint, device=args.device)
    out = Path(args.out or Path("results") / f"{cfg['name']}_objects_drawn.png")
    images, _ = load_images(cfg["data"], "test", args.data_dir, limit=args.limit)
    latents = encode_dataset(system.encoder, images, cfg["eval"].batch_size, args.device, progress=not args.quiet)
    drawings = object_drawings(system.model, latents, images, components=args.components, span=args.span,
                               min_share=args.min_share)
    if drawings is None:
        raise ProbcapsError(f"--min-share {args.min_share:g}: no object of {args.checkpoint} is on in that share of "
                            f"the {len(images)} images")
    if args.rank > 0:
        return
    plot_object_drawings(drawings, out, f"{cfg['name']}: objects drawn alone at their mean latents")
    print(f"{len(drawings[1])} objects drawn to {out}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "evaluate" and len(args.checkpoint) > 1 and not args.name:
        parser.error("argument --name: needed with several --checkpoint (their summary is results/<name>.json)")
    if args.command in ("train", "demo", "evaluate", "ttvi", "draw-objects", "run"):
        reexec_with_allocator_settings(["-m", "probcaps", *argv])
    if args.command == "run":  # the experiment prints its own one-line errors
        return run_experiment(args.experiment, args.args)
    return one_line_errors(f"probcaps {args.command}")(_command)(args)


def _command(args) -> None:
    if args.command == "download":
        from probcaps.data import download_mnist, resolve_data_root

        download_mnist(resolve_data_root(args.data_dir))
    elif args.command == "report":
        from probcaps.report import update_readme

        update_readme(args.results_dir, args.readme)
    elif not setup_run(args, None):
        from probcaps.inference.distributed import init_from_env

        # under torchrun: join the process group before a model is built, so each process takes its own GPU; every
        # process computes, rank 0 alone writes and prints
        args.rank = init_from_env().rank
        with contextlib.redirect_stdout(sys.stdout if args.rank == 0 else io.StringIO()):
            {"train": _train, "evaluate": _evaluate, "demo": _train, "ttvi": _ttvi,
             "draw-objects": _draw_objects}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
