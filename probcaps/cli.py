"""The ``probcaps`` command line: the package's one front door (nothing imports it but ``probcaps/__main__.py``).

    probcaps train --config mnist --out runs/mnist [--resume] [--set train.steps=100]
    probcaps evaluate --checkpoint mnist [--name mnist] [--results-dir results]
    probcaps evaluate --checkpoint runs/a/final.pt runs/b/final.pt --name mnist_readout   # one per seed: mean ± std
    probcaps ttvi --checkpoint mnist [--limit 1000] [--out results/ttvi_mnist.json]
    probcaps draw-objects --checkpoint mnist [--out results/mnist_objects_drawn.png]
    probcaps run <experiment> [its arguments]   # any experiment, e.g. probcaps run mnist_probe --seeds 0
    probcaps list                      # the recipes, experiments and shipped models
    probcaps demo                      # a few minutes of training on real MNIST, then the probe report
    probcaps download [--data-dir D]   # fetch MNIST (needs a network)
    probcaps report                    # splice results/<experiment>/<name>.md into the README's and docs' markers

A recipe (``--config``) or a shipped model (``--checkpoint``) may be named by its bare name (``probcaps list``).
Errors in input (files, configs, checkpoints, arguments, unreadable or unwritable paths) are printed as one line,
exit status 2; nothing is written by a command refused for its input.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import textwrap
from pathlib import Path

from probcaps.errors import ProbcapsError
from probcaps.registry import experiments
from probcaps.runner import (
    add_common_args,
    add_ttvi_args,
    checkpoint_arg,
    config_arg,
    file_name_arg,
    finite_float,
    finite_non_negative_float,
    finite_positive_float,
    folder_arg,
    non_negative_int,
    one_line_errors,
    output_file_arg,
    positive_int,
    reexec_with_allocator_settings,
    setup_run,
)


def version() -> str:
    """The installed package's version (``probcaps --version``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("probcaps")
    except PackageNotFoundError:
        return "unknown (not installed)"


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
    parser = argparse.ArgumentParser(prog="probcaps", description="Probabilistic capsule networks in Pyro.")
    parser.add_argument("--version", action="version", version=f"probcaps {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train the generative capsule model with SVI")
    p.add_argument("--config", type=config_arg, default=None,
                   help="a recipe by name (probcaps list) or a TOML file (default: built-in defaults)")
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
    p.add_argument("--verbose", action="store_true", help="with --evaluate: print every metric, not only the table")
    add_common_args(p, results_dir="results")

    p = sub.add_parser("evaluate", help="probe accuracies, k-means accuracy and figures of a checkpoint")
    p.add_argument("--checkpoint", type=checkpoint_arg, required=True, nargs="+",
                   help="a trained model (a shipped one by name, or a file); several (one per seed): each is "
                        "evaluated, then mean ± std (needs --name)")
    p.add_argument("--name", type=file_name_arg, default=None,
                   help="results/<name>.json (default: <the run's config name>_seed<its training seed>)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    drawn = p.add_mutually_exclusive_group()
    drawn.add_argument("--no-figures", action="store_true")
    drawn.add_argument("--figures", nargs="+", metavar="FIGURE",
                       help="draw these figures alone, each <name>_<FIGURE>.png (default: all of them; an unknown "
                       "name is refused with the list)")
    add_common_args(p, results_dir="results")

    p = sub.add_parser("ttvi", help="free-form test-time VI on test images with a trained checkpoint")
    p.add_argument("--checkpoint", type=checkpoint_arg, required=True, help="a shipped model by name, or a file")
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
    p.add_argument("--checkpoint", type=checkpoint_arg, required=True, help="a shipped model by name, or a file")
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
    p.add_argument("--verbose", action="store_true", help="also print every metric (they are all in the JSON)")
    p.add_argument("--steps", type=positive_int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    add_common_args(p, results_dir="runs/demo/results")
    # `train` with the demo recipe (a package file), then `evaluate`; running it again replaces its run folder
    p.set_defaults(config=config_arg("demo"), resume=False,
                   force=True, tensorboard=False, evaluate=True, seed=None, jit=False, compile=False, validate=False)

    found = experiments()
    width = max(map(len, found), default=0)
    p = sub.add_parser("run", help="run an experiment script (probcaps run <experiment> --help for its options)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run an experiment as `python -m probcaps.experiments.<experiment>` would.",
                       epilog="experiments:\n" + "\n".join(f"  {n:{width}s}  {doc}" for n, doc in found.items()))
    p.add_argument("experiment", choices=list(found), metavar="experiment", help="one of: " + ", ".join(found))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the experiment's own arguments")

    sub.add_parser("list", help="the recipes, experiments and shipped models, one line each")

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
        if getattr(args, "verbose", False):
            _print_metrics(metrics)
        print(summary_table(metrics, f"{state.step:,} steps"))
        results = Path(args.results_dir)
        print(f"all metrics: {results / (cfg['name'] + '.json')}")
        figures = sorted(f.name for f in results.glob(f"{cfg['name']}_*.png"))
        listed = ", ".join(figures) if figures else "none (eval.figures = false)"
        print(textwrap.fill(f"figures in {results}/: {listed}", width=120, subsequent_indent="  "))


#: the readouts of the short table after a demo or a training with --evaluate: (results key, what it is, scale)
SUMMARY_ROWS = [("probe_presence_pose_test_acc", "linear probe, object presences + poses (%)", 100),
                ("probe_presence_test_acc", "linear probe, object presences (%)", 100),
                ("kmeans_posterior_counts_test_acc", "k-means (10), posterior presences (%)", 100),
                ("mean_active_parents", "objects on per image", 1)]
#: SCAE's (Kosiorek et al. 2019) published MNIST numbers for the rows that have one
SCAE_ROWS = {"probe_presence_test_acc": 99.0, "kmeans_posterior_counts_test_acc": 98.7}


def summary_table(metrics: dict, run: str, shipped: str = "mnist") -> str:
    """The few readouts a reader wants, as a text table: this run's, the shipped recipe's ``shipped`` model card's
    (mean ± std over its seeds), and SCAE's."""
    from probcaps.registry import model_cards

    card = model_cards().get(shipped, {})
    card = card.get("recipe_readouts") or card.get("readouts", {})  # mean ± std over the recipe's seeds

    def cell(values: dict, key: str, scale: float) -> str:
        if f"{key}_mean" in values:
            return f"{scale * values[key + '_mean']:.1f} ± {scale * values[key + '_std']:.1f}"
        return f"{scale * values[key]:.1f}" if isinstance(values.get(key), (int, float)) else "—"

    header = ("readout (MNIST test)", f"this run ({run})", f"`{shipped}` recipe, its seeds", "SCAE")
    rows = [(label, cell(metrics, key, scale), cell(card, key, scale),
             f"{SCAE_ROWS[key]:.1f}" if key in SCAE_ROWS else "—") for key, label, scale in SUMMARY_ROWS]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [header, *rows])


def _evaluate_path(checkpoint, args, name=None, overrides=()):
    from probcaps.inference.evaluate import evaluate_checkpoint

    return evaluate_checkpoint(checkpoint, name=name, results_dir=args.results_dir, data_dir=args.data_dir,
                               device=args.device, overrides=list(overrides), progress=not args.quiet,
                               figures=_figures(args))


def _figures(args) -> bool | list[str]:
    """What ``probcaps evaluate`` draws: the figures ``--figures`` names, none with ``--no-figures``, else all."""
    return getattr(args, "figures", None) or not getattr(args, "no_figures", False)


def _evaluate(args) -> None:
    if len(args.checkpoint) == 1:
        return _print_metrics(_evaluate_path(args.checkpoint[0], args, name=args.name, overrides=args.set))
    from probcaps.inference.evaluate import evaluate_seeds

    summary = evaluate_seeds(args.checkpoint, args.name, results_dir=args.results_dir, data_dir=args.data_dir,
                             device=args.device, overrides=list(args.set), progress=not args.quiet,
                             figures=_figures(args))
    _print_metrics({k: v for k, v in summary.items() if k.endswith("_mean")})


def _print_metrics(metrics: dict) -> None:
    """The scalar metrics, one a line (per-class reports and confusion matrices stay in the results JSON)."""
    for key, value in metrics.items():
        if not isinstance(value, (dict, list)):
            print(f"  {key:34s} {value:.4f}" if isinstance(value, float) else f"  {key:34s} {value}")


def _load_model(args):
    """The trained model of ``--checkpoint`` through the Python API (:func:`probcaps.load`)."""
    from probcaps.inference.api import load

    return load(args.checkpoint, device=args.device)


def _ttvi(args) -> None:
    import torch

    from probcaps.data import rotate
    from probcaps.experiments.common import throughput_table
    from probcaps.inference.evaluate import reconstruction_error
    from probcaps.provenance import provenance, write_results
    from probcaps.report import write_table

    model = _load_model(args)
    out = Path(args.out or Path("results") / f"ttvi_{model.name}.json")
    if out.is_dir():  # refused before the optimisation, not after it
        raise ProbcapsError(f"--out {out}: is a folder (name the results JSON file)")
    x, _ = model.load_images(args.split, limit=args.limit, data_dir=args.data_dir)
    x = rotate(x[:, 0], args.rotate).clamp(0, 1).unsqueeze(1) if args.rotate else x
    refined = model.ttvi(x, steps=args.steps, lr=args.lr, pose_family=args.pose_family, seed=args.seed,
                         batch_size=args.batch_size, progress=not args.quiet)
    result, before = refined.ttvi, model.encode(x, batch_size=args.batch_size)
    recon_mse = [reconstruction_error(model.model, x[:, 0], capsules.latents, args.batch_size, args.device)
                 for capsules in (before, refined)]
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
    model = _load_model(args)
    out = Path(args.out or Path("results") / f"{model.name}_objects_drawn.png")
    images, _ = model.load_images("test", limit=args.limit, data_dir=args.data_dir)
    try:
        drawings = model.draw_objects(images, min_share=args.min_share, components=args.components, span=args.span)
    except ValueError:
        raise ProbcapsError(f"--min-share {args.min_share:g}: no object of {args.checkpoint} is on in that share of "
                            f"the {len(images)} images") from None
    if args.rank > 0:
        return
    drawings.plot(out, f"{model.name}: objects drawn alone at their mean latents")
    print(f"{len(drawings.objects)} objects drawn to {out}")


def print_list() -> None:
    """``probcaps list``: each recipe, experiment and shipped model with one line."""
    from probcaps.registry import model_cards, recipes

    sections = [("recipes (--config NAME)", recipes()), ("experiments (probcaps run NAME)", experiments()),
                ("shipped models (--checkpoint NAME)", {name: card.get("summary", "") for name, card in
                                                        model_cards().items()})]
    for title, rows in sections:
        print(f"{title}:")
        width = max(map(len, rows), default=0)
        print("\n".join(f"  {name:{width}s}  {line}" for name, line in rows.items()) or "  (none)")


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
    if args.command == "list":
        print_list()
    elif args.command == "download":
        from probcaps.data import download_mnist, resolve_data_root

        download_mnist(resolve_data_root(args.data_dir))
    elif args.command == "report":
        from probcaps.registry import CARDS_FILE, cards_table, model_cards, write_model_cards
        from probcaps.report import update_readme, write_table

        checkpoints = Path(args.readme).parent / "checkpoints"
        if checkpoints.is_dir() and CARDS_FILE.parent.parent == checkpoints.parent.resolve():  # in a clone
            write_model_cards(checkpoints, results_dir=args.results_dir)
            write_table(Path(args.results_dir) / "models", "cards", cards_table(model_cards()))
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
