"""README tables generated from the JSON files under ``results/`` (``probcaps report``).

Each table sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` in the README; the text between
the markers is replaced, everything else is left alone.  Numbers are never typed into the README by hand.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Callable

from probcaps.io import atomic_write

__all__ = ["update_readme", "TABLES", "fmt_mean_std", "load_result", "provenance_line"]


def load_result(results_dir: str | Path, name: str) -> tuple[dict, dict] | None:
    """``(metrics, provenance)`` of ``results_dir/<name>.json``, or None when it has not been written yet."""
    path = Path(results_dir) / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data["metrics"], data["provenance"]


def provenance_line(prov: dict) -> str:
    """The closing words of every results paragraph: device, command and commit of the run."""
    return f"device: {prov.get('device')}; command: `{prov.get('command')}`; commit {prov.get('git_commit')}."


def fmt_mean_std(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    import numpy as np

    a = np.asarray(values, dtype=float) * scale
    if len(a) == 1:
        return f"{a[0]:.{digits}f}"
    return f"{a.mean():.{digits}f} ± {a.std(ddof=1):.{digits}f}"


def _mnist_probe_table(results_dir: Path, name: str = "mnist_probe") -> str | None:
    path = results_dir / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    runs = data["metrics"]["per_seed"]
    prov = data["provenance"]
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
                 f"training wall time per seed (min): {walls}; device: {prov.get('device', '?')}; "
                 f"command: `{prov.get('command', '?')}`; commit {prov.get('git_commit', '?')}.")
    return "\n".join(lines)


def _benchmark_table(results_dir: Path) -> str | None:
    path = results_dir / "bench_step.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text())
    rows = rows if isinstance(rows, list) else [rows]
    lines = ["| setting | parts × objects | batch | Pyro step (ms) | torch step (ms) | ratio | images/s | "
             "peak memory (MB) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        enc = r.get("encoder", {})
        setting = (f"{r.get('label') or ''} (conv {enc.get('channels')}, strides {enc.get('strides')}, set "
                   f"transformer {enc.get('set_hidden')} wide × {enc.get('set_heads')} heads"
                   f"{', compiled compositing and part CNN' if r.get('compiled_compositing') else ''})")
        lines.append(f"| {setting} | {r['parts']} × {r['parents']} | {r['batch']} | {r['pyro_step_ms']:.0f} | "
                     f"{r['torch_step_ms']:.0f} | {r['ratio_pyro_over_torch']:.3f} | {r['pyro_images_per_s']:.0f} | "
                     f"{r['peak_memory_mb']:.0f} |")
    lines.append("")
    lines.append(f"Device: {rows[0].get('device_description', rows[0].get('device'))}, "
                 f"{rows[0]['threads']} threads, glibc allocator thresholds set: {rows[0].get('malloc_env')}; "
                 f"step times are the median of {rows[0].get('repeats', 10)} timed steps of each variant; "
                 f"command: `make bench`. The ratio is what the benchmark is for (interleaved in one run); images/s "
                 f"depends on the machine.")
    return "\n".join(lines)


def _results_in(results_dir: Path, folder: str) -> list[tuple[Path, dict]]:
    """``(path, parsed JSON)`` of every results file in ``results_dir/folder``, sorted by name."""
    return [(path, json.loads(path.read_text())) for path in sorted((results_dir / folder).glob("*.json"))]


def _pilots_table(results_dir: Path) -> str | None:
    """Short runs of the headline config with one change each (``results/pilots/*.json``)."""
    results = _results_in(results_dir, "pilots")
    if not results:
        return None
    from probcaps.inference.capsule_svi import load_experiment_config

    headline = load_experiment_config(Path(__file__).resolve().parent.parent / "experiments" / "configs" /
                                      "mnist_probe.toml")
    lines = ["| change from the headline config | training steps | training wall time (s) | test ELBO per image | "
             "probe: presences + poses | probe: presences | k-means on presences | objects in use | probe images: fit / scored |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = []
    for path, data in results:
        m, prov = data["metrics"], data["provenance"]
        changes = [f"{section}.{key} = {value}" for section in ("model", "encoder")
                   for key, value in prov["configs"][section].items()
                   if key != "seed" and value != getattr(headline[section], key, None)]
        rows.append((m["probe_presence_pose_test_acc"], f"| {'; '.join(changes) or 'none'} | {prov['steps']} | "
                     f"{prov['wall_time_s']:.0f} | {m['test_elbo_per_image']:.0f} | "
                     f"{100 * m['probe_presence_pose_test_acc']:.1f}% | {100 * m['probe_presence_test_acc']:.1f}% | "
                     f"{100 * m['kmeans_presence_test_acc']:.1f}% | {m.get('parents_in_use', '—')} | "
                     f"{m['n_train']:,} / {m['n_test']:,} |"))
    lines += [row for _, row in sorted(rows, reverse=True)]
    lines += ["", "Probe fitted on the first training images and scored on the first test images (the last column: "
              "how many); one seed each, seed 0 (the headline's seed-to-seed spread is in its table above); the runs "
              f"trained two or three at a time, one thread each. Objects in use: objects on (presence > 0.5) in at least 1% "
              f"of the test images, out of `model.num_parents` (— where the run was scored before this column "
              f"existed)."]
    return "\n".join(lines)


def _ttvi_throughput_table(results_dir: Path) -> str | None:
    path = results_dir / "ttvi_throughput.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    m, prov = data["metrics"], data["provenance"]
    work = m["n_images"] * m["steps"]
    return "\n".join([
        "| images × steps | threads | wall time (min) | CPU time of the process (min) | image-steps/s (wall) | "
        "ELBO per image, encoder → after | recon MSE ×100, encoder → after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {m['n_images']:,} × {m['steps']} | {m['threads']} | {m['wall_time_s'] / 60:.1f} | "
        f"{m['cpu_time_s'] / 60:.1f} | {work / m['wall_time_s']:.0f} | {m['elbo_encoder_mean']:.0f} → "
        f"{m['elbo_ttvi_mean']:.0f} | {100 * m['recon_mse_encoder']:.3f} → {100 * m['recon_mse_ttvi']:.3f} |",
        "",
        f"CPU time is the process's, summed over its threads (with one thread: the wall time on an otherwise idle "
        f"core); measured with nothing else running. " + provenance_line(prov)[0].upper() + provenance_line(prov)[1:],
    ])


def _norb_pilots_table(results_dir: Path) -> str | None:
    """One-seed tries of the novel-viewpoint experiment with other settings (``results/norb_pilots/*.json``)."""
    results = _results_in(results_dir, "norb_pilots")
    if not results:
        return None
    from probcaps.experiments.norb_viewpoints import dataset_label

    lines = ["| data | capsules A, B, C, D | capsule steps | CNN steps | seed | matched familiar acc. | "
             "novel acc.: capsules | novel acc.: CNN | novel error reduction | capsule training (min) | command |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for _, data in results:
        prov, caps = data["provenance"], data["provenance"]["configs"]["caps"]
        for r in data["metrics"]["per_seed"]:
            lines.append(f"| {dataset_label(prov['configs']['data'])} | {caps['A']}, {caps['B']}, {caps['C']}, "
                         f"{caps['D']} | {r['caps_steps']} | "
                         f"{r['cnn_steps']} | {r['seed']} | {r['target_familiar_acc']:.3f} | {r['caps_novel_acc']:.3f} | "
                         f"{r['cnn_novel_acc']:.3f} | {100 * r['novel_error_reduction']:+.1f}% | "
                         f"{r['caps_train_wall_time_s'] / 60:.0f} | `{prov.get('command', '?')}` |")
    return "\n".join(lines)


def _tae_pilots_table(results_dir: Path) -> str | None:
    """One-seed tries of the affine transforming auto-encoder (``results/tae_pilots/*.json``)."""
    results = _results_in(results_dir, "tae_pilots")
    if not results:
        return None
    names = ["m11", "m12", "tx", "m21", "m22", "ty"]
    lines = ["| try | seed | steps | " + " | ".join(f"R² {n}" for n in names)
             + " | active capsules | keypoint spread (px): keypoints / attention centres | command |",
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- | --- |"]
    for path, data in results:
        for r in data["metrics"]["per_seed"]:
            spread = (f"{r['keypoint_spread_px']:.1f} / {r['attention_centre_spread_px']:.1f}"
                      if "keypoint_spread_px" in r else "—")
            lines.append(f"| {path.stem} | {r['seed']} | {r['steps']} | "
                         + " | ".join(f"{r[f'r2_{n}']:.2f}" for n in names)
                         + f" | {r['active_capsules_mean']:.1f} | {spread} | "
                         f"`{data['provenance'].get('command', '?')}` |")
    lines += ["", "Keypoint spread: for each held-out input image's most present capsule, the mean distance of its "
              "keypoints from their mean, and the same for the places its keypoints look at (attention centres); "
              "averaged over the images (— where the try was scored before this was measured)."]
    return "\n".join(lines)


def _experiment_table(module: str, results_dir: Path, **kwargs) -> str | None:
    """``experiments.<module>.readme_table`` for a results file of another name (the same experiment, another run)."""
    import importlib

    return importlib.import_module(f"probcaps.experiments.{module}").readme_table(results_dir, **kwargs)


#: name -> function building the table's markdown from the results folder (None when its JSON is missing)
TABLES: dict[str, Callable[[Path], str | None]] = {
    "mnist_probe": _mnist_probe_table,
    "mnist_probe_ceiling": functools.partial(_mnist_probe_table, name="mnist_probe_ceiling"),
    "mnist_probe_prior4": functools.partial(_mnist_probe_table, name="mnist_probe_prior4"),
    "mnist_probe_tau1": functools.partial(_mnist_probe_table, name="mnist_probe_tau1"),
    "mnist_probe_rho1": functools.partial(_mnist_probe_table, name="mnist_probe_rho1"),
    "mnist_probe_fast": functools.partial(_mnist_probe_table, name="mnist_probe_fast"),
    "affnist_ceiling": lambda results_dir: _experiment_table("affnist", results_dir, name="affnist_ceiling"),
    "affnist_fast": lambda results_dir: _experiment_table("affnist", results_dir, name="affnist_fast"),
    "rotated_digits_fast": lambda results_dir: _experiment_table("rotated_digits", results_dir,
                                                                 name="rotated_digits_fast"),
    "ttvi_classification_ceiling": lambda results_dir: _experiment_table("ttvi_classification", results_dir,
                                                                         name="ttvi_classification_ceiling"),
    "ttvi_classification_fast": lambda results_dir: _experiment_table("ttvi_classification", results_dir,
                                                                      name="ttvi_classification_fast"),
    "bench_step": _benchmark_table,
    "ttvi_throughput": _ttvi_throughput_table,
    "pilots": _pilots_table,
    "norb_pilots": _norb_pilots_table,
    **{name: functools.partial(_experiment_table, "norb_viewpoints", name=name, with_benchmark=False)
       for name in ("norb_viewpoints_asymmetric", "norb_viewpoints_asymmetric_large",
                    "norb_viewpoints_asymmetric_large_bn", "norb_viewpoints_asymmetric_large_bn_std",
                    "norb_viewpoints_asymmetric_elevation",
                    "norb_viewpoints_asymmetric_large_bn_std_elevation",
                    "norb_viewpoints_asymmetric_large_bn_std_all_views")},
    "tae_pilots": _tae_pilots_table,
}


def table_builder(name: str) -> Callable[[Path], str | None] | None:
    """The function building table ``name``: from ``TABLES``, else ``experiments.<name>.readme_table``.

    Each experiment module owns its table (``def readme_table(results_dir: Path) -> str | None``), so adding an
    experiment never touches this file.
    """
    if name in TABLES:
        return TABLES[name]
    import importlib

    try:
        module = importlib.import_module(f"probcaps.experiments.{name}")
    except ModuleNotFoundError:
        return None
    return getattr(module, "readme_table", None)


def update_readme(results_dir: str | Path = "results", readme: str | Path = "README.md") -> list[str]:
    """Rewrite every marked table of ``readme`` from ``results_dir``; returns the names updated."""
    results_dir, readme = Path(results_dir), Path(readme)
    text = readme.read_text()
    updated = []
    names = list(dict.fromkeys(re.findall(r"<!-- results:([\w.]+) -->", text)))
    for name in names:
        build = table_builder(name)
        if build is None:
            raise KeyError(f"{readme}: no table builder for marker 'results:{name}' (TABLES or "
                           f"experiments/{name}.py: readme_table)")
        pattern = re.compile(rf"(<!-- results:{name} -->\n)(.*?)(<!-- /results:{name} -->)", re.S)
        if not pattern.search(text):
            continue
        table = build(results_dir)
        if table is None:
            table = f"_No results yet: run the command above to create `{results_dir}/{name}.json`._"
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(3), text)
        updated.append(name)
    atomic_write(readme, lambda f: f.write(text), mode="w")
    return updated
