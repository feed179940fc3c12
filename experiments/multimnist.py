"""MultiMNIST with CapsNet (Sabour, Frosst & Hinton 2017): name both of two overlapping digits and reconstruct
each from its own digit capsule.

    probcaps run multimnist --seeds 0                      # reduced config (the multimnist recipe)
    probcaps run multimnist --config multimnist_paper --device cuda
    probcaps run multimnist --seeds 0 --resume             # continue an interrupted run
    probcaps run multimnist --seeds 0 --set train.steps=5 --set data.dataset="synthetic"   # smoke test
    probcaps run multimnist --seeds 0 --set model.bf16_routing=true --try NAME   # a try: one row of ablations.md

Training pairs are drawn afresh every epoch (:mod:`probcaps.data.multimnist`); the test pairs are fixed.  Writes
``results/multimnist/<name>.json`` (set accuracy, at-least-one accuracy, reconstruction error; per seed, mean and
std) and
figures of the first seed: ``<name>_reconstructions.png``, ``<name>_capsules.png``, ``<name>_training.png``.  A try
(``--try NAME``) writes only its record, ``results/multimnist/ablations/NAME.json``, and the table of tries.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probcaps import plotting
from probcaps.checkpoints import load_final, run_finished
from probcaps.config import DigitCanvas, Section, load_sections
from probcaps.data import load_digits
from probcaps.data.multimnist import bounding_boxes, multimnist_batches, multimnist_pairs
from probcaps.errors import ConfigError
from probcaps.inference.train import TrainConfig, start_log, train_loop
from probcaps.io import append_jsonl, read_jsonl, write_json
from probcaps.models.capsnet import CapsNet, CapsNetConfig, set_accuracy, top_k_classes
from probcaps.provenance import provenance
from probcaps.report import fmt_mean_std, load_result, provenance_line, tries_table, write_report, write_table
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

# anchors: a reduced numpy CapsNet reproduction and the paper (about 5% error at full scale)
NUMPY_SET_ACC = 0.486
PAPER_SET_ACC = 0.95


@dataclass
class MultiMNISTData(DigitCanvas):
    dataset: str = "mnist"
    canvas_size: int = 36
    max_shift: int = 4
    min_iou: float = 0.8
    train_limit: int = 0          # use only the first N training digits (0: all)
    test_limit: int = 0
    test_pairs: int = 10000       # fixed test set: pairs of test digits (each test digit first once per 10,000)
    seed: int = 0                 # test-set pairs (training pairs follow train.seed)


@dataclass
class MultiMNISTEval(Section):
    batch_size: int = 500
    curve_pairs: int = 2000       # test pairs scored at every checkpoint (training curve)
    figures: bool = True
    figure_pairs: int = 8         # test composites in the reconstruction figure


SCHEMA = {"name": str, "data": MultiMNISTData, "model": CapsNetConfig, "train": TrainConfig, "eval": MultiMNISTEval}


def load_config(path, overrides=()) -> dict:
    """The experiment config (strict TOML + ``--set`` overrides), checked for consistency."""
    cfg = load_sections(path, SCHEMA, list(overrides))
    cfg["name"] = cfg["name"] or (Path(path).stem if path else "multimnist")
    data, model = cfg["data"], cfg["model"]
    if model.image_size != data.canvas_size:  # the data section's own checks: DigitCanvas.validate
        raise ConfigError(f"{path}: model.image_size ({model.image_size}) differs from data.canvas_size "
                          f"({data.canvas_size})")
    return cfg


class PairSource:
    """The digits of one split (the first ``*_limit``), their ink boxes, and the pairs of an epoch (or of the
    test set)."""

    def __init__(self, data: MultiMNISTData, split: str, data_dir=None):
        self.data = data
        self.digits, self.labels = load_digits(data.dataset, split, data_dir=data_dir, synthetic_sizes=(512, 256),
                                               limit=data.train_limit if split == "train" else data.test_limit)
        self.boxes = bounding_boxes(self.digits)

    def pairs(self, seed: int, epoch, n: int | None = None):
        return multimnist_pairs(self.labels, self.boxes, seed, epoch, n=n, max_shift=self.data.max_shift,
                                min_iou=self.data.min_iou)

    def batches(self, pairs, batch_size: int, start_batch: int = 0, device="cpu", drop_last=False):
        for x, a, b, y in multimnist_batches(self.digits, pairs, batch_size, start_batch=start_batch,
                                             canvas=self.data.canvas_size, device=device, drop_last=drop_last):
            yield x, torch.stack([a, b], 1), y

    def first(self, pairs, n: int):
        """``(composites, sources, labels)`` of the first ``n`` of ``pairs``, one batch."""
        sub = pairs.subset(torch.arange(min(n, len(pairs))))
        return next(self.batches(sub, len(sub)))


@torch.no_grad()
def evaluate(model: CapsNet, source: PairSource, pairs, batch_size: int, device="cpu") -> dict:
    """Set accuracy (both top-2 capsules right), at-least-one accuracy, and the per-pixel squared error of the
    reconstructions of the two *true* classes, each from its own masked capsule."""
    set_ok, one_ok, sq_err, n = 0, 0, 0.0, 0
    for x, sources, labels in source.batches(pairs, batch_size, device=device):
        out = model(x)
        set_ok += int(set_accuracy(out.lengths, labels).sum())
        one_ok += int((top_k_classes(out.lengths, 2)[:, :, None] == labels[:, None, :]).any(-1).any(-1).sum())
        sq_err += float(((model.reconstruct_each(out.digits, labels) - sources) ** 2).mean(dim=(2, 3, 4)).sum())
        n += len(x)
    return {"set_acc": set_ok / n, "at_least_one_acc": one_ok / n, "recon_mse": sq_err / (2 * n), "n_pairs": n}


def _read_elapsed(out: Path) -> float:
    """Elapsed training time (s) recorded in ``out/elapsed.json`` (0 when absent)."""
    return json.loads((out / "elapsed.json").read_text())["elapsed_s"] if (out / "elapsed.json").is_file() else 0.0


def _read_curve(out: Path) -> list[dict]:
    """The test-set curve of a run, ``[{"step", "test_set_acc"}]`` from ``out/eval.jsonl`` (one record a
    checkpoint, on the first ``eval.curve_pairs`` test pairs)."""
    path = out / "eval.jsonl"
    return [{"step": r["step"], "test_set_acc": r["test_set_acc"]} for r in read_jsonl(path)] if path.is_file() else []


def train_seed(cfg: dict, seed: int, out: Path, *, resume: bool, device: str, data_dir, progress: bool):
    """Train one seed, or with ``resume`` continue it or load it when finished; returns ``(model, train state dict,
    test PairSource)``.  ``out/eval.jsonl`` gets the test-set curve, ``out/elapsed.json`` the elapsed time."""
    tcfg = dataclasses.replace(cfg["train"], seed=seed)
    torch.manual_seed(seed)
    model = CapsNet(cfg["model"]).to(device)
    test = PairSource(cfg["data"], "test", data_dir)
    if resume and run_finished(out, tcfg.steps):
        return model, load_final(model, out, device), test
    t_start = time.perf_counter()
    resume = start_log(out / "eval.jsonl", resume)  # the curve up to the checkpoint resumed from
    train = PairSource(cfg["data"], "train", data_dir)
    curve_pairs = test.pairs(cfg["data"].seed, "test", n=min(cfg["eval"].curve_pairs, cfg["data"].test_pairs))
    running = {"set_acc": [], "margin": [], "recon_sse": []}

    def batches(epoch: int, start: int):
        pairs = train.pairs(seed, epoch)
        return train.batches(pairs, tcfg.batch_size, start_batch=start, device=device,
                             drop_last=len(pairs) >= tcfg.batch_size)

    def loss_fn(batch):
        x, sources, labels = batch
        loss, diag = model.loss(x, labels, sources)
        for k in running:
            running[k].append(diag[k])
        return loss

    def on_checkpoint(state):
        metrics = evaluate(model, test, curve_pairs, cfg["eval"].batch_size, device)
        record = {"step": state.step, "test_set_acc": metrics["set_acc"], "wall_time_s": state.wall_time_s,
                  **{f"train_{k}": float(np.mean(v)) if v else None for k, v in running.items()}}
        for v in running.values():
            v.clear()
        append_jsonl(out / "eval.jsonl", record)

    metadata = {"name": cfg["name"], "kind": "capsnet", "configs": config_dicts(cfg)}
    state = train_loop(model, loss_fn, batches, tcfg, out, resume=resume, metadata=metadata, progress=progress,
                       on_checkpoint=on_checkpoint)
    # elapsed time including pair generation and the curve evaluations, summed over resumed parts
    elapsed = (_read_elapsed(out) if resume else 0.0) + time.perf_counter() - t_start
    write_json(out / "elapsed.json", {"elapsed_s": elapsed})
    return model, dataclasses.asdict(state), test


def plot_reconstructions(model: CapsNet, test: PairSource, pairs, path: Path, n: int = 8) -> None:
    """Rows: composite, digit A, digit B, and the reconstructions from each true and each predicted capsule alone."""
    x, sources, labels = test.first(pairs, n)
    with torch.no_grad():
        out = model(x)
        rec_true = model.reconstruct_each(out.digits, labels)
        pred = top_k_classes(out.lengths, 2)
        rec_pred = model.reconstruct_each(out.digits, pred)
    rows = {"input": x[:, 0], "digit A": sources[:, 0, 0], "digit B": sources[:, 1, 0],
            "caps A only": rec_true[:, 0, 0], "caps B only": rec_true[:, 1, 0], "pred 1 only": rec_pred[:, 0, 0],
            "pred 2 only": rec_pred[:, 1, 0]}
    cols = [f"{a}+{b} → {p}{q}" for (a, b), (p, q) in zip(labels.tolist(), pred.tolist())]
    plotting.plot_image_grid(torch.stack(list(rows.values())), path, row_labels=list(rows), col_labels=cols,
                             title="each digit reconstructed from one masked digit capsule")


def plot_capsule_lengths(model: CapsNet, test: PairSource, pairs, path: Path, n: int = 24) -> None:
    """Heat map of the 10 capsule lengths for ``n`` test composites, true classes outlined."""
    x, _, labels = test.first(pairs, n)
    with torch.no_grad():
        lengths = model(x).lengths
    pred = top_k_classes(lengths, 2).tolist()
    plotting.plot_heatmap(lengths.numpy(), path, col_labels=[str(k) for k in range(lengths.shape[1])],
                          xlabel="digit capsule (class)", ylabel="test composite",
                          title="capsule lengths ||v_k|| (red boxes: the two true digits)", vmin=0, vmax=1,
                          outlined=[(r, c) for r, pair in enumerate(labels.tolist()) for c in pair],
                          marked=[(r, c) for r, pair in enumerate(pred) for c in pair],
                          marked_label="top-2 (predicted)")


def plot_training(runs: dict[str, Path], path: Path) -> None:
    """Two panels: training loss (from ``log.jsonl``) and test-subset set accuracy (``eval.jsonl``) vs step."""
    loss = plotting.log_curves({label: out / "log.jsonl" for label, out in runs.items()}, "loss")
    acc = plotting.log_curves({label: out / "eval.jsonl" for label, out in runs.items()}, "test_set_acc", 100)
    plotting.plot_curve_panels([
        {"curves": loss, "xlabel": "step", "ylabel": "margin + 0.0005 x reconstruction loss",
         "title": "training loss", "logy": True},
        {"curves": acc, "xlabel": "step", "ylabel": "set accuracy (%)",
         "title": "test pairs (subset): both digits named"},
    ], path)


@one_line_errors("multimnist")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, "multimnist", [0])
    p.add_argument("--train-only", action="store_true", help="train and stop (a later --resume call evaluates)")
    p.add_argument("--try", dest="try_name", metavar="NAME", default=None,
                   help="record the run as a try of its recipe, RESULTS_DIR/ablations/NAME.json (one row of "
                        "ablations.md), instead of the recipe's results and figures")
    add_run_args(p, EXPERIMENT, name=False, out_help="run folders, one per seed (default runs/<name>)",
                 resume="continue each seed from its last checkpoint",
                 tables="tables (RESULTS_DIR/multimnist.md, multimnist_bench.md)", threads=1)
    args = p.parse_args(argv)
    if setup_run(args, write_tables):
        return 0
    cfg = load_config(args.config, args.set)
    name = cfg["name"]
    out_root = Path(args.out or Path("runs") / name)
    results = Path(args.results_dir)
    runs, outs = [], {}
    for seed in args.seeds:
        out = outs[f"seed {seed}"] = out_root / f"seed{seed}"
        model, state, test = train_seed(cfg, seed, out, resume=args.resume, device=args.device,
                                        data_dir=args.data_dir, progress=not args.quiet)
        if args.train_only:
            continue
        t0 = time.perf_counter()
        test_pairs = test.pairs(cfg["data"].seed, "test", n=cfg["data"].test_pairs)
        metrics = evaluate(model, test, test_pairs, cfg["eval"].batch_size, args.device)
        steps_per_s = state["step"] / max(state["wall_time_s"], 1e-9)
        runs.append({**metrics, "seed": seed, "steps": state["step"], "train_wall_time_s": state["wall_time_s"],
                     "train_elapsed_s": _read_elapsed(out) or None, "steps_per_s": steps_per_s,
                     "eval_time_s": time.perf_counter() - t0, "mean_test_iou": float(test_pairs.iou.mean()),
                     "curve_pairs": min(cfg["eval"].curve_pairs, cfg["data"].test_pairs), "curve": _read_curve(out)})
        print(f"seed {seed}: set accuracy {metrics['set_acc']:.4f}, at least one {metrics['at_least_one_acc']:.4f}"
              f", recon MSE {metrics['recon_mse']:.4f}; {state['step']} steps in {state['wall_time_s'] / 60:.1f} "
              f"min ({steps_per_s:.2f} steps/s)")
        if seed == args.seeds[0] and cfg["eval"].figures and not args.try_name:
            model.cpu()
            plot_reconstructions(model, test, test_pairs, results / f"{name}_reconstructions.png",
                                 n=cfg["eval"].figure_pairs)
            plot_capsule_lengths(model, test, test_pairs, results / f"{name}_capsules.png")
            model.to(args.device)
    if args.train_only:
        return 0
    if args.try_name:
        record = try_record(args.try_name, args.config, cfg, runs, provenance(device=args.device))
        write_json(results / ABLATIONS / f"{args.try_name}.json", record)
        write_tables(results)
        print(f"wrote {results / ABLATIONS / args.try_name}.json")
        return 0
    summary = {"per_seed": runs, "numpy_set_acc": NUMPY_SET_ACC, "paper_set_acc": PAPER_SET_ACC,
               **seed_summary(runs, ("set_acc", "at_least_one_acc", "recon_mse", "train_wall_time_s"))}
    write_report(results, name, summary, write_tables, seed=args.seeds, steps=runs[0]["steps"], device=args.device,
                 wall_time_s=sum(r["train_wall_time_s"] for r in runs), batch_size=cfg["train"].batch_size,
                 threads=torch.get_num_threads(), configs=config_dicts(cfg))
    if cfg["eval"].figures:
        plot_training(outs, results / f"{name}_training.png")
    return 0


#: the tries of other settings of a recipe: one record each, ``results_dir/ablations/<try>.json``
#: (:func:`probcaps.report.load_try`), laid out as ``results_dir/ablations.md``
ABLATIONS = "ablations"
#: ``(metrics key, column head, scale, digits)`` of the table of tries
ABLATION_COLUMNS = [("set_acc", "two-digit set accuracy (%)", 100.0, 1),
                    ("at_least_one_acc", "at least one digit (%)", 100.0, 1),
                    ("recon_mse", "recon MSE per pixel", 1.0, 4)]


def try_record(name: str, recipe_path, cfg: dict, runs: list[dict], prov: dict) -> dict:
    """The record of a try (:func:`probcaps.report.load_try`): the recipe and the keys of ``cfg`` that differ from
    it, the mean and sample std over ``runs`` (the value alone for one seed) of :data:`ABLATION_COLUMNS`' metrics,
    each seed's ``[step, test set accuracy]`` at each evaluation on the way, its seeds and steps, and ``prov``'s
    commit, device and command."""
    recipe, trained = config_dicts(load_config(recipe_path)), config_dicts(cfg)
    changed = {"--config": Path(recipe_path).stem, **{f"{section}.{key}": value
                                                      for section, values in trained.items()
                                                      for key, value in values.items()
                                                      if recipe.get(section, {}).get(key) != value}}
    keys = [key for key, *_ in ABLATION_COLUMNS]
    summary = seed_summary(runs, keys)
    commit = prov["git_commit"] or "unknown"
    record = {"name": name, "changed": json.loads(json.dumps(changed)),
              "metrics": {key: summary[f"{key}_mean"] if len(runs) == 1 else
                          {"mean": summary[f"{key}_mean"], "std": summary[f"{key}_std"]} for key in keys},
              "seeds": [r["seed"] for r in runs], "steps": runs[0]["steps"], "commit": commit.removesuffix("+dirty"),
              "device": prov["device"], "command": prov["command"],
              "train_wall_time_s": [r["train_wall_time_s"] for r in runs],
              "curves": {str(r["seed"]): [[c["step"], c["test_set_acc"]] for c in r["curve"]] for r in runs}}
    if commit.endswith("+dirty"):
        record["note"] = "the tree had uncommitted changes"
    return record


#: the tables of the reduced and paper-size runs (``results/multimnist/multimnist.md``) and of the step benchmark
TABLE, BENCH_TABLE = "multimnist", "multimnist_bench"


def write_tables(results_dir) -> list:
    """Write both tables from the results JSON in ``results_dir``; returns the files written (None: not written)."""
    return [write_table(results_dir, TABLE, readme_table(Path(results_dir))),
            write_table(results_dir, BENCH_TABLE, bench_table(Path(results_dir))),
            write_table(results_dir, ABLATIONS, tries_table(results_dir, ABLATION_COLUMNS, "the recipe of `--config`",
                                                            ABLATIONS))]


def readme_table(results_dir: Path) -> str | None:
    """Markdown table of the reduced (and, if present, paper-size) runs, from
    ``results/multimnist/multimnist*.json``."""
    results_dir = Path(results_dir)
    rows = [(label, r) for label, name in (("reduced", "multimnist"), ("paper-size", "multimnist_paper"))
            if (r := load_result(results_dir, name)) is not None]
    if not rows:
        return None
    table, notes = [], []
    for label, (m, prov) in rows:
        runs = m["per_seed"]
        model = prov.get("configs", {}).get("model", {})

        def ms(key, **kw):
            return fmt_mean_std([r[key] for r in runs], **kw)

        numpy_acc = m.get("numpy_set_acc", m.get("writeup_set_acc"))  # "writeup_set_acc": the key's earlier name

        table.append(f"| {label}: conv1 {model.get('conv1_channels')}, {model.get('primary_capsules')}×"
                     f"{model.get('primary_dim')}-D primary caps | {ms('set_acc')} | {ms('at_least_one_acc')} | "
                     f"{ms('recon_mse', scale=1.0, digits=4)} | {ms('train_wall_time_s', scale=1 / 60, digits=0)} | "
                     f"{ms('steps_per_s', scale=1.0, digits=2)} | {100 * numpy_acc:.1f} | "
                     f"about {100 * m['paper_set_acc']:.0f} |")
        elapsed = [r.get("train_elapsed_s") for r in runs]
        elapsed = (f" (elapsed, with pair generation and the curve evaluations: "
                   f"{', '.join(f'{e / 60:.0f}' for e in elapsed)} min)" if all(elapsed) else "")
        curves = "".join(f"; seed {r['seed']}'s set accuracy on the first {r['curve_pairs']} test pairs at each "
                         "evaluation (step: %): " + ", ".join(f"{c['step']:,}: {100 * c['test_set_acc']:.1f}"
                                                             for c in r["curve"])
                         for r in runs if r.get("curve"))
        notes.append(f"{label}: seeds {', '.join(str(r['seed']) for r in runs)}; {runs[0]['steps']} steps of batch "
                     f"{prov.get('batch_size')}{elapsed}; {runs[0]['n_pairs']} test pairs (mean IoU "
                     f"{runs[0]['mean_test_iou']:.2f}){curves}; {provenance_line(prov)}")
    return "\n".join(["| config | two-digit set accuracy (%) | at least one digit (%) | recon MSE per pixel | training "
                      "steps (min) | steps/s | numpy reproduction (reduced) | paper (full scale) |", "|" + " --- |" * 8,
                      *table, "", *notes])


def bench_table(results_dir: Path) -> str | None:
    """Markdown table of the CapsNet step benchmark, from ``results/speed/multimnist_bench.json``."""
    bench = results_dir / "multimnist_bench.json"
    if not bench.is_file():
        return None
    brows = json.loads(bench.read_text())
    lines = ["| benchmark: one training step, batch 128 | children | bf16 convs | phase-split PrimaryCaps | "
             "bf16 routing | step (ms) | images/s | speed-up | peak memory (MB) | threads | load average |",
             "|" + " --- |" * 11]
    lines += [f"| {r['config']} | {r['num_primary_capsules']} | {r['model']['bf16']} | "
              f"{r['model'].get('phase_split', False)} | {r['model'].get('bf16_routing', False)} | "
              f"{1000 * r['step_s']:.0f} | {r['images_per_s']:.1f} | "
              + (f"{r['speedup']:.2f}× {r['speedup_over'].split(', ', 1)[1]}" if r.get("speedup") else "—")
              + f" | {'—' if r['peak_memory_mb'] is None else format(r['peak_memory_mb'], '.0f')} | {r['threads']} | "
              f"{r['load_average']:.1f} |" for r in brows]
    notes = []
    for device in dict.fromkeys(r["device_description"].split(" (")[0] for r in brows):
        rows = [r for r in brows if r["device_description"].startswith(device)]
        kernels = ("" if "bf16_supported" not in rows[-1] else
                   f" ({'with' if rows[-1]['bf16_supported'] else 'without'} bfloat16 kernels)")
        notes.append(f"{'; '.join(r['config'] for r in rows)}: {device}{kernels}; command: `{rows[-1]['command']}`"
                     + ("; the speed-up is paired within each of the interleaved rounds, the peak memory the "
                        "process's and so not per variant" if any(r.get("interleaved") for r in rows) else "") + ".")
    return "\n".join(lines + ["", "Benchmark device and command of the rows, the load average in the table (2.0 "
                                  "would be a fully used 2-core machine):", *[f"- {n}" for n in notes]])


if __name__ == "__main__":
    launch(main)
