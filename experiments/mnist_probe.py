"""Train the generative capsule model on MNIST (40x40, SCAE placement) over several seeds and report the linear
probes and k-means accuracy (paper §5, Table 1; SCAE's anchors).

    probcaps run mnist_probe --seeds 0 1 2                    # the MNIST recipe (experiments/configs/mnist.toml)
    probcaps run mnist_probe --seeds 0 --resume               # continue interrupted runs
    probcaps run mnist_probe --seeds 0 --set train.steps=5 --set data.dataset="synthetic"   # smoke test

Writes ``results/mnist_probe/<name>.json`` (per-seed metrics, mean and std), the figures of the first seed that the
page shows (``PAGE_FIGURES``) and its final model without optimiser state, ``checkpoints/<name>.pt`` (for
``probcaps evaluate``); ``name`` is the config's (``mnist`` for the mnist recipe) unless ``--name``.  Runs go to
``runs/<name>/seed<S>``, each with its seed's results, ``<name>_seed<S>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial
from pathlib import Path

from probcaps.errors import ProbcapsError
from probcaps.experiments.common import (
    checkpoint_out_path,
    export_checkpoint,
    holds_model,
    plot_training_curves,
    results_without_model,
    train_run,
)
from probcaps.inference.capsule_svi import load_experiment_config
from probcaps.inference.distributed import init_from_env
from probcaps.inference.evaluate import SCAE_PUBLISHED, evaluate_checkpoint
from probcaps.io import write_json
from probcaps.provenance import provenance
from probcaps.registry import CONFIGS_DIR
from probcaps.report import (
    fmt_mean_std,
    load_result,
    load_try,
    provenance_line,
    results_table,
    write_report,
    write_table,
)
from probcaps.runner import (
    add_config_args,
    add_run_args,
    config_dicts,
    launch,
    one_line_errors,
    seed_summary,
    setup_run,
)

EXPERIMENT = Path(__file__).stem  # names its results folder, results/<experiment>/

HEADLINE = "mnist_probe"  # the package's first full run, which the ablations changed one key at a time


@results_table("mnist_probe")
def readme_table(metrics: dict, prov: dict) -> str:
    """The README table of ``results_dir/<name>.json``: probe and k-means accuracies, mean ± std over the seeds,
    against SCAE's published numbers."""
    runs = metrics["per_seed"]
    rows = [
        ("Linear probe, object presences + poses (%)", "probe_presence_pose_test_acc", "99.0 (SCAE, presences)"),
        ("Linear probe, object presences alone (%)", "probe_presence_test_acc", "99.0 (SCAE)"),
        ("k-means (10) + Hungarian on presences (%)", "kmeans_presence_test_acc", "98.7 (SCAE)"),
        ("Test reconstruction MSE per pixel (×100)", "test_recon_mse", "—"),
        ("Test ELBO per image (nats)", "test_elbo_per_image", "—"),
    ]
    lines = [f"| metric (MNIST test, 40×40) | ours: mean ± std over {len(runs)} seeds | published |",
             "| --- | --- | --- |"]
    for label, key, anchor in rows:
        scale = 1.0 if key == "test_elbo_per_image" else 100.0
        digits = 3 if key == "test_recon_mse" else 1
        lines.append(f"| {label} | {fmt_mean_std([r[key] for r in runs], scale=scale, digits=digits)} | {anchor} |")
    K = prov.get("configs", {}).get("model", {}).get("num_parents", "K")
    if all("mean_active_parents" in r for r in runs):
        lines.append(f"| Objects on per image (presence > 0.5, of {K}) | "
                     f"{fmt_mean_std([r['mean_active_parents'] for r in runs], scale=1.0, digits=2)} | — |")
    if all("parents_in_use" in r for r in runs):
        lines.append(f"| Objects in use (on in ≥ 1% of test images, of {K}), per seed | "
                     f"{', '.join(str(r['parents_in_use']) for r in runs)} | — |")
    seeds = ", ".join(str(r["seed"]) for r in runs)
    walls = ", ".join(f"{r['train_wall_time_s'] / 60:.0f}" for r in runs)
    lines.append("")
    lines.append(f"Seeds {seeds}; {runs[0]['steps']} steps of batch {prov.get('batch_size', '?')} each; "
                 f"training wall time per seed (min): {walls}; {provenance_line(prov)}")
    return "\n".join(lines)


#: the figures of a recipe's first seed that its page shows (``results_dir/<name>_seed<S>_<figure>.png``); the
#: rest of what an evaluation draws is `probcaps evaluate`'s
PAGE_FIGURES = ("objects_by_class", "objects_drawn", "reconstructions", "template_neighbours")
#: the tries that changed the shipped recipes: one record each, ``results_dir/ablations/<try>.json``
#: (:func:`probcaps.report.load_try`), laid out as ``results_dir/ablations.md``
ABLATIONS = "ablations"
#: ``(metrics key, column head, scale, digits)`` of the table of tries
ABLATION_COLUMNS = [
    ("kmeans_posterior_counts_test_acc", "k-means, posterior presences (%)", 100.0, 1),
    ("kmeans_presence_test_acc", "k-means, prior presences (%)", 100.0, 1),
    ("probe_presence_pose_test_acc", "probe, presences + poses (%)", 100.0, 1),
    ("probe_presence_test_acc", "probe, presences (%)", 100.0, 1),
    ("object_class_purity", "class purity", 1.0, 3),
    ("mean_active_parents", "objects on per image", 1.0, 1),
    ("test_elbo_per_image", "test ELBO per image", 1.0, 0),
    ("kmeans_posterior_counts_test_acc_init_median", "k-means, posterior presences, median of 10 starts (%)", 100.0, 1),
    ("template_distinctness_mean", "template distinctness", 1.0, 3),
    # one cluster per object: above k-means when the objects are digits that ten clusters do not group
    ("dominant_object_test_acc", "each image read as its dominant object's class (%)", 100.0, 1),
]


def changed_from_recipe(cfg: dict) -> dict:
    """``{"section.key": value}`` of the keys of ``cfg`` that differ from `mnist.toml` (the seed aside)."""
    recipe, trained = config_dicts(load_experiment_config(CONFIGS_DIR / "mnist.toml")), config_dicts(cfg)
    # as a record read back holds it (tuples as lists), so a record and a config compare equal when they agree
    return json.loads(json.dumps({f"{section}.{key}": value for section, values in trained.items()
                                  for key, value in values.items()
                                  if key != "seed" and recipe.get(section, {}).get(key) != value}))


def try_record(name: str, runs: list[dict], summary: dict, cfg: dict, prov: dict) -> dict:
    """The record of a try (:func:`probcaps.report.load_try`): the keys of ``cfg`` that differ from `mnist.toml`,
    the table of tries' metrics from ``summary`` (:func:`~probcaps.runner.seed_summary` of ``runs``: mean and sample
    std, the value alone for one seed), each seed's own readouts (``per_seed``: what a later run of more seeds
    gathers them from), its seeds and steps, and the commit, device and command of ``prov``."""
    metrics = {key: summary[f"{key}_mean"] if len(runs) == 1 else
               {"mean": summary[f"{key}_mean"], "std": summary[f"{key}_std"]}
               for key, *_ in ABLATION_COLUMNS if f"{key}_mean" in summary}
    per_seed = [{"seed": r["seed"], "steps": r["steps"], "train_wall_time_s": r["train_wall_time_s"],
                 **{key: r[key] for key, *_ in ABLATION_COLUMNS if isinstance(r.get(key), float)
                    and math.isfinite(r[key])}} for r in runs]
    commit = prov["git_commit"] or "unknown"
    record = {"name": name, "changed": changed_from_recipe(cfg), "metrics": metrics,
              "seeds": [r["seed"] for r in runs], "steps": runs[0]["steps"], "commit": commit.removesuffix("+dirty"),
              "device": prov["device"], "command": prov["command"],
              "train_wall_time_s": [r["train_wall_time_s"] for r in runs], "per_seed": per_seed}
    if commit.endswith("+dirty"):
        record["note"] = "the tree had uncommitted changes"
    return record


def recorded_seed(record_path: Path, seed: int, cfg: dict, run_dir: Path, as_try: bool = True
                  ) -> tuple[dict, dict] | None:
    """Seed ``seed``'s readouts and training state (``step``, ``wall_time_s``) from the ``per_seed`` of a try's
    record ``record_path`` (``as_try``) or of a recipe's results file, for a seed whose run folder holds neither a
    model nor its results: None where it does, or where the file does not list the seed; an error where the file
    is of another config."""
    if not record_path.is_file() or holds_model(run_dir):
        return None
    if as_try:
        record = load_try(record_path)
        listed, same = record.get("per_seed", []), record["changed"] == changed_from_recipe(cfg)
    else:  # the seeds' summary records the recipe's config, the seed left at its default
        results = json.loads(record_path.read_text())
        listed = results.get("metrics", {}).get("per_seed", [])
        same = (without_seed(results.get("provenance", {}).get("configs", {}))
                == without_seed(json.loads(json.dumps(config_dicts(cfg)))))
    kept = [r for r in listed if r["seed"] == seed]
    if not kept:
        return None
    if not same or kept[0]["steps"] != cfg["train"].steps:
        raise ProbcapsError(f"{record_path}: it records seed {seed} of another config, and {run_dir} holds no model "
                            "to evaluate instead; drop --reuse-results to train the seed again")
    metrics = {k: v for k, v in kept[0].items() if k not in ("seed", "steps", "train_wall_time_s")}
    return metrics, {"step": kept[0]["steps"], "wall_time_s": kept[0]["train_wall_time_s"]}


def without_seed(configs: dict) -> dict:
    """``configs`` (section -> keys) with the training seed left out."""
    return {section: {k: v for k, v in keys.items() if not (section == "train" and k == "seed")}
            for section, keys in configs.items()}


def ablations_table(results_dir: Path) -> str | None:
    """The tries of ``results_dir/ablations/*.json``, one row each: what it changed against `mnist.toml` as it
    was at the try's commit, its seeds, steps, readouts and commit (None when there is none)."""
    from probcaps.report import tries_table  # beside the shared imports above, which another module takes over

    return tries_table(results_dir, ABLATION_COLUMNS, "`mnist.toml` at its commit", ABLATIONS)


def seed_cell(runs: list[dict], key: str, scale: float = 100.0, digits: int = 1) -> str:
    """``key`` of each of ``runs`` (a recipe's seeds, or one model), mean ± std, as a table cell; "—" where a run
    has not measured it (a readout added since its results were written)."""
    return fmt_mean_std([r.get(key, float("nan")) for r in runs], scale=scale, digits=digits)


def model_sets(results_dir: Path, listed: list[tuple[str, str]]):
    """``(name, what, runs, provenance)`` for each ``(results name, what it is)`` of ``listed`` whose results are in
    ``results_dir``; ``runs``: its seeds' metrics, or one model's alone."""
    for name, what in listed:
        if (loaded := load_result(results_dir, name)) is not None:
            yield name, what, loaded[0].get("per_seed", [loaded[0]]), loaded[1]


#: the models read out with the part layer's probes (``eval.layer_readouts``): ``(results name, what it is)``;
#: ``results_dir/mnist_layers_by_recipe.md``
LAYERS = "mnist_layers_by_recipe"
LAYER_RUNS = [
    ("mnist", "the recipe (`mnist.toml`), 10,000 steps"),
    ("mnist_regions_layers", "the first recommended recipe (regions of every digit), 2,500 steps"),
]


def layers_table(results_dir: Path) -> str | None:
    """One row per model set of :data:`LAYER_RUNS` whose results are in ``results_dir``: the linear probe on the
    objects beside the probes on their parts, mean ± std over the seeds; where the part layer knows the class better
    than the objects, the difference is in where the parts sit relative to their objects."""
    rows = []
    for name, what, runs, _ in model_sets(results_dir, LAYER_RUNS):
        cell = partial(seed_cell, runs)
        rows.append(f"| {what} | `{name}` | {len(runs)} | {cell('mean_active_parents', 1.0)} | "
                    f"{cell('probe_presence_pose_test_acc')} | {cell('probe_parts_test_acc')} | "
                    f"{cell('probe_parts_in_parent_frame_test_acc')} | "
                    f"{cell('probe_presence_pose_parts_in_parent_frame_test_acc')} | "
                    f"{cell('probe_part_residuals_test_acc')} | {cell('part_pose_explained', 1.0, 3)} | "
                    f"{cell('object_class_purity', 1.0, 3)} |")
    if not rows:
        return None
    return "\n".join([
        "| models | results | seeds | objects on per image | objects: presences + poses (%) | parts: presences + "
        "poses (%) | parts in their parent's frame (%) | objects ⊕ parts in their parent's frame (%) | parts' offsets "
        "from their parent's prediction (%) | share of the part-pose spread the objects predict | class purity |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
        "Linear probes fit on the 60,000 training images and scored on the 10,000 test images, mean ± std over the "
        "seeds; each part seen from its most probable parent under the exact posterior over its parent (the dummy's "
        "frame: the canvas); the share of the spread of the parts' poses that their objects predict, over the parts "
        "on with an object for parent, on the test images. Each row's command and commit are in its results file."])


#: the models read out by a two-layer network's probes beside the linear ones (``eval.nonlinear_probes``):
#: ``(results name, what it is)``; ``results_dir/mnist_nonlinear_by_recipe.md``
NONLINEAR = "mnist_nonlinear_by_recipe"
NONLINEAR_RUNS = [
    ("mnist", "the recipe (`mnist.toml`), 10,000 steps"),
    ("mnist_regions_readout", "the first recommended recipe (regions of every digit), 2,500 steps"),
]
#: ``(metrics key without its probe's prefix, column head)`` of :func:`nonlinear_table`: each with the linear probe
#: and the network
NONLINEAR_COLUMNS = [("presence", "objects: prior presences"), ("presence_pose", "objects: presences + poses"),
                     ("presence_pose_code", "objects: presences + poses + codes"),
                     ("parts", "parts: presences + poses")]


def nonlinear_table(results_dir: Path) -> str | None:
    """One row per model set of :data:`NONLINEAR_RUNS` whose results are in ``results_dir``: on each feature set of
    :data:`NONLINEAR_COLUMNS`, the linear probe and the two-layer network, mean ± std over the seeds ("—": not
    measured, or no such features); how much class information the objects hold against their parts, linear or
    not."""
    rows = []
    for name, what, runs, _ in model_sets(results_dir, NONLINEAR_RUNS):
        cell = partial(seed_cell, runs)
        rows.append(f"| {what} | `{name}` | {len(runs)} | {cell('mean_active_parents', 1.0)} | " + " | ".join(
            f"{cell(f'probe_{key}_test_acc')} | {cell(f'mlp_{key}_test_acc')}" for key, _ in NONLINEAR_COLUMNS)
            + " |")
    if not rows:
        return None
    return "\n".join([
        "| models | results | seeds | objects on per image | " + " | ".join(
            f"{head}, linear (%) | {head}, network (%)" for _, head in NONLINEAR_COLUMNS) + " |",
        "| --- |" + " --- |" * (3 + 2 * len(NONLINEAR_COLUMNS)), *rows, "",
        "Test accuracy of the linear probe and of a two-layer network (two hidden ReLU layers of 256, Adam, 30 "
        "epochs: `MLPProbe`) on the same features, both fit on the 60,000 training images and scored on the 10,000 "
        "test images, mean ± std over the seeds. Each row's command and commit are in its results file."])


#: the shipped MNIST recipes, side by side on the readouts the capsule premise is judged by: ``(results name,
#: column head)``; ``results_dir/mnist_recipes.md``
RECIPES = "mnist_recipes"
RECIPE_RUNS = [("mnist", "`mnist.toml`"), ("mnist_regions_readout", "the first recommended recipe")]
#: ``(metrics key, row head, scale, digits, target, SCAE's number)`` of :func:`recipes_table`
RECIPE_ROWS = [
    ("probe_presence_pose_test_acc", "linear probe, object presences + poses (%)", 100.0, 1, "≥ 99.0", ""),
    ("mlp_presence_pose_test_acc", "two-layer network, object presences + poses (%)", 100.0, 1, "", ""),
    ("mlp_parts_test_acc", "two-layer network, part presences + poses (%)", 100.0, 1, "", ""),
    ("probe_presence_test_acc", "linear probe, prior presences (%)", 100.0, 1, "≥ 99.0",
     f"{100 * SCAE_PUBLISHED['probe_test_acc']:.1f}"),
    ("kmeans_posterior_counts_test_acc", "k-means (10) + Hungarian, posterior presences (%)", 100.0, 1, "≥ 98.7",
     f"{100 * SCAE_PUBLISHED['kmeans_test_acc']:.1f}"),
    ("kmeans_presence_test_acc", "k-means (10) + Hungarian, prior presences (%)", 100.0, 1, "", ""),
    ("object_class_purity", "objects' class purity (0.1: none)", 1.0, 3, "≥ 0.95", ""),
    ("mean_active_parents", "objects on per image (of 16)", 1.0, 1, "", ""),
]


def recipes_table(results_dir: Path) -> str | None:
    """The shipped recipes of :data:`RECIPE_RUNS` whose results are in ``results_dir``, one column each, on the
    readouts of :data:`RECIPE_ROWS` (mean ± std over the seeds, MNIST test) beside the targets and SCAE's numbers;
    None when none has results."""
    loaded = [(head, *found) for name, head in RECIPE_RUNS if (found := load_result(results_dir, name)) is not None]
    if not loaded:
        return None
    seeds = [metrics["per_seed"] for _, metrics, _ in loaded]
    lines = ["| readout (MNIST test, 40×40) | " + " | ".join(head for head, _, _ in loaded) + " | target | SCAE |",
             "| --- |" + " --- |" * (len(loaded) + 2)]
    for key, what, scale, digits, target, scae in RECIPE_ROWS:
        cells = [seed_cell(runs, key, scale, digits) for runs in seeds]
        lines.append(f"| {what} | " + " | ".join(cells) + f" | {target} | {scae} |")
    lines.append("| steps; training minutes per seed | " + " | ".join(
        f"{runs[0]['steps']:,}; " + ", ".join(f"{r['train_wall_time_s'] / 60:.0f}" for r in runs) for runs in seeds)
        + " | | |")
    lines.append("| device of the readout | " + " | ".join(prov.get("device") or "—" for _, _, prov in loaded)
                 + " | | |")
    lines += ["", "Seeds " + "; ".join(f"{head}: " + ", ".join(str(r["seed"]) for r in runs)
                                      for (head, _, _), runs in zip(loaded, seeds))
              + f"; probes fit on the {seeds[0][0]['n_train']:,} training images, probes and k-means scored on the "
              f"{seeds[0][0]['n_test']:,} test images; the targets are for the mean over three seeds; each column's "
              "command and commit are in its results file "
              "(`results/mnist_probe/<name>.json`: " + ", ".join(f"`{name}`" for name, _ in RECIPE_RUNS) + ")."]
    return "\n".join(lines)


#: the model sets read out for how stable their clustering is and how distinct their templates are (Smith et al.
#: 2020, Figure 6), one row per seed: ``(results name, what it is, its first seed's shipped model)``;
#: ``results_dir/mnist_clustering.md``
CLUSTERING = "mnist_clustering"
CLUSTERING_RUNS = [("mnist", "`mnist.toml`", "checkpoints/mnist.pt")]


def clustering_table(results_dir: Path) -> str | None:
    """For each seed of each model set of :data:`CLUSTERING_RUNS` with results in ``results_dir``: k-means on the
    posterior presences as the tables report it (the best of 10 starts by inertia) and over 10 single starts (min,
    median, max), the two classes it mixes up most, the fit from the class means, and the template distinctness
    (mean and least over the templates); None when none has results."""
    rows, runs_from = [], []
    shipped = {name: model for name, _, model in CLUSTERING_RUNS}
    for name, what, runs, prov in model_sets(results_dir, [(n, w) for n, w, _ in CLUSTERING_RUNS]):
        key = "kmeans_posterior_counts_test"
        for i, m in enumerate(runs):
            pair = m[f"{key}_confused_pair"]
            model = f" (`{shipped[name]}`)" if i == 0 else ""
            rows.append(f"| {what}, seed {m.get('seed', 0)}{model} | {100 * m[f'{key}_acc']:.1f} | " + " / ".join(
                f"{100 * m[f'{key}_acc_init_{q}']:.1f}" for q in ("min", "median", "max"))
                + f" | {pair['classes'][0]} and {pair['classes'][1]}: {100 * pair['share']:.1f}% of their images | "
                f"{m['template_distinctness_mean']:.3f} ({m['template_distinctness_min']:.3f}) | "
                + class_start_cell(m.get(f"{key}_class_start")) + " |")
        runs_from.append(f"`{name}`: {provenance_line(prov)}")
    if not rows:
        return None
    return "\n".join(["| model | k-means (10) + Hungarian, posterior presences (%) | single starts: min / median / "
                      "max (%) | the most-confused pair of classes | template distinctness: mean (least) | started "
                      "at the class means: accuracy (%); inertia against the best fit's |",
                      "| --- | --- | --- | --- | --- | --- |", *rows, "",
                      "MNIST test; k-means as every table here runs it keeps the best of 10 starts by inertia, the "
                      "single starts are seeds 0–9 alone; the most-confused pair has the most images of either "
                      "clustered as the other; template distinctness is, for each template, the share of its energy "
                      "that its nearest other template under the best affine warp leaves unexplained (0: a warped "
                      "copy, 1: nothing alike); started at the class means: Lloyd's algorithm from the test images' "
                      "class means (it uses the labels: a diagnostic), its accuracy and its inertia over the best "
                      "fit's (above 1 with a higher accuracy: the objective, not the starts, parts the clusters from "
                      "the classes). "
                      + "; ".join(runs_from)])


def class_start_cell(start: dict | None) -> str:
    """The clustering table's cell for :func:`probcaps.metrics.kmeans_from_class_means` (— where not measured)."""
    if not start:
        return "—"
    return f"{100 * start['accuracy']:.1f}; {start['inertia'] / start['best_inertia']:.3f}×"


def write_tables(results_dir: Path, name: str) -> list[Path | None]:
    """Write ``results_dir/<name>.md`` and, from the results there, ``results_dir/ablations.md`` when
    ``results_dir/ablations/`` holds tries, ``results_dir/mnist_layers_by_recipe.md`` when a model set of
    :data:`LAYER_RUNS` has results, ``results_dir/mnist_nonlinear_by_recipe.md`` when one of :data:`NONLINEAR_RUNS`
    has, ``results_dir/mnist_recipes.md`` when a recipe of :data:`RECIPE_RUNS` has and
    ``results_dir/mnist_clustering.md`` when a model of :data:`CLUSTERING_RUNS` has; returns the files written (None:
    not written)."""
    return [write_table(results_dir, name, readme_table(results_dir, name)),
            write_table(results_dir, ABLATIONS, ablations_table(results_dir)),
            write_table(results_dir, LAYERS, layers_table(results_dir)),
            write_table(results_dir, NONLINEAR, nonlinear_table(results_dir)),
            write_table(results_dir, RECIPES, recipes_table(results_dir)),
            write_table(results_dir, CLUSTERING, clustering_table(results_dir))]



@one_line_errors("mnist_probe")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, "mnist", [0, 1, 2])
    p.add_argument("--jit", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the alpha compositing and the part CNN (faster steps)")
    p.add_argument("--reuse-results", action="store_true",
                   help="take a seed's metrics from its results JSON in its run folder when that is newer than its "
                   "final checkpoint, or when its run folder holds no model and the JSON records the same config; a "
                   "seed with neither, from the seeds' summary (RESULTS_DIR/<name>.json; a try's record, "
                   "RESULTS_DIR/ablations/<name>.json) when that lists it with the same config")
    p.add_argument("--train-only", action="store_true",
                   help="train and stop (to run seeds as parallel processes; a later --resume call evaluates)")
    p.add_argument("--try", dest="as_try", action="store_true",
                   help="record the run as a try of the table of tries, RESULTS_DIR/ablations/<name>.json (its changes "
                   "against mnist.toml, readouts, seeds, commit, device and command), no figures and no model")
    add_run_args(p, EXPERIMENT, out_help="run folders, <out>/seed<S> (default: runs/<name>)",
                 resume="continue each seed from its last checkpoint", tables="tables (RESULTS_DIR/<name>.md, "
                 "RESULTS_DIR/ablations.md)", checkpoint_out="export the first seed's model here (default: "
                 "checkpoints/<name>.pt, not with --train-only; '' for none)")
    args = p.parse_args(argv)
    args.name = args.name or load_experiment_config(args.config)["name"]
    args.out = args.out or str(Path("runs") / args.name)
    if setup_run(args, tables := lambda results: write_tables(results, args.name)):
        return 0
    runs = []
    for seed in args.seeds:
        flags = [f"train.{key}=true" for key in ("jit", "compile") if getattr(args, key)]
        overrides = [*args.set, f"train.seed={seed}", *flags]
        cfg = load_experiment_config(args.config, overrides)
        run_dir = Path(args.out) / f"seed{seed}"
        # each seed's results stay in its run folder; the results folder gets the seeds' summary (a try's record)
        seed_json = run_dir / f"{args.name}_seed{seed}.json"
        kept = results_without_model(seed_json, run_dir, cfg) if args.reuse_results else None
        if args.reuse_results and kept is None and not seed_json.is_file():
            summary_json = Path(args.results_dir) / (f"{ABLATIONS}/{args.name}.json" if args.as_try
                                                     else f"{args.name}.json")
            kept = recorded_seed(summary_json, seed, cfg, run_dir, args.as_try)
        final, state = (None, kept[1]) if kept else train_run(cfg, run_dir, args)
        if args.train_only:
            continue
        if kept:
            metrics = kept[0]
        elif args.reuse_results and seed_json.is_file() and seed_json.stat().st_mtime > final.stat().st_mtime:
            metrics = json.loads(seed_json.read_text())["metrics"]
        else:
            shown = seed == args.seeds[0] and not args.as_try and cfg["eval"].figures
            metrics = evaluate_checkpoint(final, name=f"{args.name}_seed{seed}", results_dir=run_dir,
                                          data_dir=args.data_dir, device=args.device, progress=not args.quiet,
                                          figures=PAGE_FIGURES if shown else False, figures_dir=args.results_dir,
                                          eval_config=cfg["eval"])
        runs.append({**metrics, "seed": seed, "steps": state["step"], "train_wall_time_s": state["wall_time_s"]})
        if init_from_env().rank == 0:
            print(f"seed {seed}: probe presence+pose {metrics['probe_presence_pose_test_acc']:.4f}, presence "
                  f"{metrics['probe_presence_test_acc']:.4f}, k-means {metrics['kmeans_presence_test_acc']:.4f}, "
                  f"training {state['wall_time_s'] / 60:.1f} min")
    first = Path(args.out) / f"seed{args.seeds[0]}" / "final.pt"

    def export_first(dst: Path) -> None:
        if first.is_file():
            export_checkpoint(first, dst, args.name)
        else:  # its metrics came from its results file
            print(f"not exported: {first} is not kept")

    if args.train_only and args.checkpoint_out and init_from_env().rank == 0:  # exported only when told where
        export_first(Path(args.checkpoint_out))
    if args.train_only or init_from_env().rank > 0:  # under torchrun every process evaluates, rank 0 alone writes
        return 0
    # a seed gathered from a try's record has its table's readouts alone: the summary is of what every seed has
    summary = {"per_seed": runs, **seed_summary(runs, [k for k, v in runs[0].items() if isinstance(v, float)
                                                       and all(isinstance(r.get(k), float) for r in runs)])}
    cfg = load_experiment_config(args.config, args.set)
    if args.as_try:
        path = write_json(Path(args.results_dir) / ABLATIONS / f"{args.name}.json",
                          try_record(args.name, runs, summary, cfg, provenance(device=args.device)))
        write_table(args.results_dir, ABLATIONS, ablations_table(Path(args.results_dir)))
        print(f"wrote {path}")
        return 0
    write_report(args.results_dir, args.name, summary, tables,
                 seed=args.seeds, steps=runs[0]["steps"], device=args.device, configs=config_dicts(cfg),
                 wall_time_s=sum(r["train_wall_time_s"] for r in runs), batch_size=cfg["train"].batch_size)
    plot_training_curves({f"seed {s}": Path(args.out) / f"seed{s}" / "log.jsonl" for s in args.seeds},
                         Path(args.results_dir) / f"{args.name}_training.png")
    if (checkpoint_out := checkpoint_out_path(args.checkpoint_out, args.name)) is not None:
        export_first(checkpoint_out)
    return 0


if __name__ == "__main__":
    launch(main)
