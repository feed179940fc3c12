import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from probcaps.metrics import (
    LinearProbe,
    MLPProbe,
    hungarian_accuracy,
    hungarian_labels,
    kmeans_accuracy,
    kmeans_labels,
    probe_accuracy,
    r2_score,
    r2_scores,
    reconstruction_mse,
)
from probcaps.provenance import device_description, git_commit, provenance, write_results

# --------------------------------------------------------------------------- linear probe


def _separable(n, seed, W):
    X = np.random.default_rng(seed).normal(size=(n, 5))
    return X, np.argmax(X @ W, axis=1)  # linear decision regions -> linearly separable


def test_probe_separable_three_class_torch_inputs():
    W = np.random.default_rng(0).normal(size=(5, 3))
    Xtr, ytr = _separable(600, 1, W)
    Xte, yte = _separable(300, 2, W)
    probe = LinearProbe(C=100.0, max_iter=2000).fit(torch.as_tensor(Xtr, dtype=torch.float32), torch.as_tensor(ytr))
    assert set(probe.classes_.tolist()) == {0, 1, 2}
    acc = probe.accuracy(torch.as_tensor(Xte), torch.as_tensor(yte))
    assert isinstance(acc, float)
    assert acc > 0.95
    assert probe.predict(Xte).shape == (300,)
    assert probe_accuracy(Xtr, ytr, Xte, yte, C=100.0) > 0.95


def test_probe_shuffled_labels_is_chance():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(900, 20))
    y = rng.permutation(np.repeat(np.arange(3), 300))  # shuffled labels carry no signal
    acc = probe_accuracy(X[:600], y[:600], X[600:], y[600:])
    assert 0.2 < acc < 0.47


def test_probe_rejects_bad_inputs():
    X = np.zeros((10, 3))
    y = np.arange(10) % 2
    with pytest.raises(ValueError, match="labels"):
        LinearProbe().fit(X, y[:9])
    Xbad = X.copy()
    Xbad[2, 1] = np.nan
    with pytest.raises(ValueError, match="features.*NaN"):
        LinearProbe().fit(Xbad, y)
    Xbad[2, 1] = np.inf
    with pytest.raises(ValueError, match="features"):
        LinearProbe().fit(Xbad, y)
    with pytest.raises(ValueError, match="test_features"):
        probe_accuracy(X, y, np.full((4, 3), np.nan), y[:4])
    with pytest.raises(ValueError, match="test_labels"):
        probe_accuracy(X, y, X, y[:4])
    with pytest.raises(RuntimeError, match="not fitted"):
        LinearProbe().predict(X)


def _rings(n, seed):
    """Two classes on concentric rings (radius 1 and 2, labels 3 and 7): no line separates them, a circle does."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    angle = rng.uniform(0, 2 * np.pi, n)
    r = 1.0 + y + rng.normal(0, 0.1, n)
    return np.stack([r * np.cos(angle), r * np.sin(angle)], 1), np.where(y == 1, 7, 3)


def test_mlp_probe_reads_what_a_linear_probe_cannot():
    # catches: a network that is linear after all (no hidden non-linearity), labels returned as indices instead of the
    # caller's values, or a fit that depends on the global random state
    Xtr, ytr = _rings(2000, 0)
    Xte, yte = _rings(500, 1)
    assert probe_accuracy(Xtr, ytr, Xte, yte) < 0.7
    probe = MLPProbe(hidden=32, epochs=20, batch_size=64, lr=1e-2, seed=5).fit(torch.as_tensor(Xtr), ytr)
    assert probe.accuracy(Xte, yte) > 0.97
    assert set(np.unique(probe.predict(Xte))) == {3, 7}
    torch.manual_seed(123)
    again = MLPProbe(hidden=32, epochs=20, batch_size=64, lr=1e-2, seed=5).fit(Xtr, ytr)
    assert np.array_equal(again.predict(Xte), probe.predict(Xte))


def test_mlp_probe_rejects_bad_inputs():
    X, y = _rings(40, 2)
    with pytest.raises(RuntimeError, match="not fitted"):
        MLPProbe().predict(X)
    with pytest.raises(ValueError, match="features.*NaN"):
        MLPProbe().fit(np.where(np.arange(80).reshape(40, 2) == 5, np.nan, X), y)
    with pytest.raises(ValueError, match="2 distinct classes"):
        MLPProbe().fit(X, np.zeros(40))
    with pytest.raises(ValueError, match="hidden"):
        MLPProbe(hidden=0)
    with pytest.raises(ValueError, match="fitted on 2"):
        MLPProbe(epochs=1).fit(X, y).predict(np.zeros((3, 4)))


# --------------------------------------------------------------------------- clustering


def test_hungarian_permuted_labelling_is_perfect():
    labels = np.repeat(np.arange(4), 5)
    perm = np.array([2, 0, 3, 1])
    assert hungarian_accuracy(perm[labels], labels) == 1.0
    assert hungarian_accuracy(torch.as_tensor(perm[labels] + 10), torch.as_tensor(labels)) == 1.0


def test_hungarian_hand_values():
    clusters = [0, 0, 0, 0, 1, 1, 1, 1]
    labels = [0, 0, 0, 1, 1, 1, 1, 0]
    assert hungarian_accuracy(clusters, labels) == pytest.approx(0.75)
    # More clusters than labels: one-to-one, so the third cluster gets no label
    # (majority-vote mapping would give 1.0 here).
    assert hungarian_accuracy([0, 0, 1, 1, 2, 2], [5, 5, 7, 7, 5, 5]) == pytest.approx(4 / 6)
    # Fewer clusters than labels.
    assert hungarian_accuracy([0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 2]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="labels"):
        hungarian_accuracy([0, 1], [0, 1, 2])


def test_hungarian_labels_name_each_cluster_by_its_matched_label():
    # catches: a majority vote instead of a one-to-one match, clusters and labels matched out of order, or a
    # surplus cluster given a real label
    out = hungarian_labels([0, 0, 0, 1, 1, 2], [5, 5, 7, 7, 7, 5])  # cluster 2 is surplus: below every label
    np.testing.assert_array_equal(out, [5, 5, 5, 7, 7, 4])
    np.testing.assert_array_equal(hungarian_labels([3, 3, 1, 1, 2], [0, 0, 2, 2, 1]), [0, 0, 2, 2, 1])
    # unsigned labels (MNIST's uint8): the surplus cluster still gets a value below them, not one wrapped to 255
    np.testing.assert_array_equal(hungarian_labels([0, 0, 1, 2], torch.tensor([0, 0, 1, 1], dtype=torch.uint8)),
                                  [0, 0, 1, -1])


def test_kmeans_accuracy_on_separated_blobs():
    rng = np.random.default_rng(0)
    centres = rng.normal(scale=20.0, size=(4, 6))
    labels = np.repeat(np.arange(4), 50)
    X = centres[labels] + rng.normal(size=(200, 6))
    assert kmeans_accuracy(X, labels, n_clusters=4, seed=0, n_init=4) > 0.99
    np.testing.assert_array_equal(kmeans_labels(X, labels, n_clusters=4, seed=0, n_init=4), labels)
    with pytest.raises(ValueError, match="features"):
        kmeans_accuracy(X[:10], labels)


# --------------------------------------------------------------------------- regression / reconstruction


def test_r2_values():
    true = np.array([1.0, 2.0, 3.0, 4.0])
    assert r2_score(true, true) == 1.0
    assert r2_score(np.full(4, true.mean()), true) == pytest.approx(0.0)
    assert r2_score(np.array([1.0, 2.0, 3.0, 5.0]), true) == pytest.approx(0.8)  # 1 - 1/5
    pred2 = np.stack([true, np.full(4, 2.5)], 1)
    true2 = np.stack([true, true], 1)
    np.testing.assert_allclose(r2_scores(pred2, true2), [1.0, 0.0])
    np.testing.assert_allclose(r2_scores(torch.as_tensor(pred2), torch.as_tensor(true2)), [1.0, 0.0])
    # constant target: defined, no NaN
    np.testing.assert_allclose(r2_scores(np.ones((3, 1)), np.ones((3, 1))), [1.0])
    with pytest.raises(ValueError, match="pred"):
        r2_scores(np.zeros((4, 2)), np.zeros((4, 3)))
    with pytest.raises(ValueError, match="true"):
        r2_score(np.zeros(3), np.array([0.0, np.nan, 1.0]))


def test_reconstruction_mse():
    a = torch.zeros(2, 3, 3)
    b = torch.ones(2, 3, 3) * 0.5
    assert reconstruction_mse(a, b) == pytest.approx(0.25)
    assert reconstruction_mse(b, b) == 0.0
    with pytest.raises(ValueError, match="target"):
        reconstruction_mse(a, b[:1])


# --------------------------------------------------------------------------- provenance


def test_provenance_keys_and_write_results_round_trip(tmp_path):
    prov = provenance(command="probcaps train x", seed=3, steps=100, wall_time_s=1.5, device="cpu", note="hi")
    for key in (
        "command", "git_commit", "seed", "steps", "wall_time_s", "device",
        "torch_version", "pyro_version", "python_version", "timestamp",
    ):
        assert key in prov
    assert prov["command"] == "probcaps train x" and prov["seed"] == 3 and prov["note"] == "hi"
    assert prov["torch_version"] == torch.__version__
    assert prov["timestamp"].endswith("+00:00")
    assert "cpu" in prov["device"] and str(os.cpu_count()) in prov["device"]
    assert provenance()["command"]  # defaults to sys.argv

    metrics = {"acc": np.float32(0.5), "n": np.int64(7), "curve": np.arange(3), "t": torch.tensor(2.0)}
    path = write_results(tmp_path / "sub" / "results.json", metrics, prov)
    data = json.loads(path.read_text())
    assert data["metrics"] == {"acc": 0.5, "n": 7, "curve": [0, 1, 2], "t": 2.0}
    assert data["provenance"]["seed"] == 3 and data["provenance"]["command"] == "probcaps train x"
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]  # no temp files left


def test_git_commit_outside_and_inside_a_checkout(tmp_path):
    assert git_commit(tmp_path) is None
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")

    def git(*args):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)

    git("init", "-q")
    assert git_commit(repo) is None  # no commits yet
    (repo / "f.txt").write_text("a")
    git("add", "f.txt")
    git("commit", "-q", "-m", "init")
    clean = git_commit(repo)
    assert clean and "+dirty" not in clean
    (repo / "untracked.txt").write_text("u")
    assert git_commit(repo) == clean  # untracked files do not count
    (repo / "f.txt").write_text("b")
    assert git_commit(repo) == clean + "+dirty"


def test_device_description_cpu():
    d = device_description("cpu")
    assert d.startswith("cpu") and "cores" in d
    assert device_description(torch.device("cpu")) == d


def test_fmt_mean_std_sample_std_one_value_and_undefined():
    # catches: a population std, a lone value printed as "x ± nan", or a NaN (no object ever on) printed as "nan"
    from probcaps.report import fmt_mean_std
    assert fmt_mean_std([0.9, 0.92, 0.94]) == "92.0 ± 2.0"
    assert fmt_mean_std([0.123], scale=1.0, digits=2) == "0.12"
    assert fmt_mean_std([0.5, float("nan")]) == "—"


def test_a_command_names_the_commit_it_started_at_though_its_own_outputs_dirty_the_tree(monkeypatch):
    # catches: the second seed's results of one command stamped "+dirty" because the first seed's results file, a
    # committed one, was rewritten in between
    import probcaps.provenance as prov_module
    from probcaps.runner import one_line_errors

    states = iter(["abc1234", "abc1234+dirty", "abc1234+dirty", "abc1234+dirty"])
    monkeypatch.setattr(prov_module, "git_commit", lambda repo_dir=None: next(states))
    seen = []

    @one_line_errors("fake")
    def main(argv):
        seen.extend(provenance()["git_commit"] for _ in range(2))

    assert main([]) == 0
    assert seen == ["abc1234", "abc1234"]
    assert provenance()["git_commit"] == "abc1234+dirty"  # outside a command: the tree as it is now


def test_kmeans_spread_covers_single_initialisations():
    # catches: the spread computed from one initialisation repeated (min = max on data where starts matter), or a
    # median that is not the middle of the runs
    from probcaps.metrics import kmeans_accuracy, kmeans_spread

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 30)
    centres = rng.normal(size=(4, 2)) * 0.6  # overlapping clusters: where k-means starts matters
    features = centres[labels] + rng.normal(scale=0.5, size=(120, 2))
    spread = kmeans_spread(features, labels, n_clusters=4, inits=7)
    runs = [kmeans_accuracy(features, labels, 4, seed=s, n_init=1) for s in range(7)]
    assert spread["accuracies"] == runs and spread["median"] == float(np.median(runs))
    assert spread["min"] == min(runs) <= spread["median"] <= spread["max"] == max(runs)
    assert spread["min"] < spread["max"]
    separated = np.repeat(np.eye(4) * 10, 30, axis=0)  # four far-apart points: every start finds them
    assert kmeans_spread(separated, labels, n_clusters=4, inits=3)["min"] == 1.0


def test_kmeans_from_class_means_tells_the_objective_from_its_starts():
    # catches: the fit from the class means replaced by a random start, the inertias swapped, or a class inertia that
    # is not each point to its own class mean
    from probcaps.metrics import kmeans_from_class_means

    rng = np.random.default_rng(0)
    # class 0 spread wide on a line, classes 1 and 2 tight and close: k-means' best 3 clusters split class 0 and
    # merge 1 with 2, while the class partition, a fixed point of Lloyd's algorithm, costs more inertia
    wide = np.stack([np.linspace(0.0, 6.0, 60), np.zeros(60)], 1)
    tight = [np.array([10.0, 0.0]), np.array([10.5, 0.0])]
    features = np.concatenate([wide, *(c + rng.normal(scale=0.02, size=(30, 2)) for c in tight)])
    labels = np.repeat([0, 1, 2], [60, 30, 30])
    out = kmeans_from_class_means(features, labels, n_clusters=3)
    own = sum(((features[labels == c] - features[labels == c].mean(0)) ** 2).sum() for c in range(3))
    assert out["class_inertia"] == pytest.approx(own)
    assert out["accuracy"] == 1.0 and out["inertia"] == pytest.approx(own)
    assert out["best_inertia"] < out["inertia"] and out["best_accuracy"] <= 0.75
    separated = np.repeat(np.eye(3) * 10, 20, axis=0)  # the objective and the classes agree
    same = kmeans_from_class_means(separated, np.repeat(np.arange(3), 20), n_clusters=3)
    assert same["accuracy"] == same["best_accuracy"] == 1.0 and same["inertia"] == pytest.approx(same["best_inertia"])
    with pytest.raises(ValueError, match="one centre per class"):
        kmeans_from_class_means(features, labels, n_clusters=4)


def test_most_confused_pair_sums_both_directions():
    # catches: only one direction of the confusion counted (4 given as 9 but not 9 as 4), or the diagonal counted
    from probcaps.metrics import most_confused_pair

    m = np.diag([50, 50, 50, 50])
    m[1, 3], m[3, 1], m[0, 2] = 4, 5, 8  # 1 <-> 3: 9 images both ways; 0 -> 2: 8 one way
    pair = most_confused_pair(m, classes=[4, 9, 2, 7])
    assert pair["classes"] == [9, 7] and pair["count"] == 9
    assert pair["share"] == pytest.approx(9 / (m[1].sum() + m[3].sum()))
    with pytest.raises(ValueError, match="square"):
        most_confused_pair(np.zeros((2, 3)))


def test_template_distinctness_finds_a_warped_copy_and_sets_apart_a_new_shape():
    # catches: a distance that ignores the warp (a rotated copy counted as distinct), one that compares a template
    # with itself (every distance 0), or the nearest index off by the skipped diagonal
    from probcaps.geometry import affine_matrix
    from probcaps.metrics import template_distinctness
    from probcaps.render import warp

    t = 11
    bar = torch.zeros(1, 1, t, t)
    bar[0, 0, 2:9, 4:7] = 1.0                                     # an upright bar
    one = torch.ones(1)
    turned = warp(bar, affine_matrix(one * 0.9, one * 0.9, one * 1.2, one * 0, one * 0.05, one * 0), t)
    ring = torch.zeros(1, 1, t, t)
    yy, xx = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    ring[0, 0] = (((yy - 5) ** 2 + (xx - 5) ** 2 - 12).abs() < 5).float()  # a ring: no warp of a bar makes it
    found = template_distinctness(torch.cat([ring, bar, turned]), steps=200)
    assert found["nearest"][1] == 2 and found["nearest"][2] == 1
    assert found["distance"][1] < 0.15 and found["distance"][2] < 0.15
    assert found["distance"][0] > 0.4
    # the fitted warp of the nearest template reproduces the template it was fitted to
    again = warp(torch.cat([ring, bar, turned])[found["nearest"][1:2]], found["warp"][1:2], t)
    assert ((again - bar) ** 2).sum() / (bar ** 2).sum() == pytest.approx(float(found["distance"][1]), abs=1e-4)
