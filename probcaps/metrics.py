"""Evaluation metrics: linear and two-layer probes, cluster accuracy, per-class reports, class purity, R^2 and
reconstruction error.

Every function accepts numpy arrays or torch tensors (on any device, with gradients) and returns plain Python floats
or numpy arrays; bad input raises a ``ValueError`` naming the offending argument.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["LinearProbe", "MLPProbe", "probe_accuracy", "hungarian_labels", "hungarian_accuracy", "kmeans_labels",
           "kmeans_spread", "most_confused_pair", "template_distinctness", "kmeans_accuracy",
           "kmeans_from_class_means", "classification_summary", "mean_by_class", "object_class_shares",
           "class_purity", "dominant_object_accuracy", "r2_scores", "r2_score", "reconstruction_mse"]


def _to_numpy(x: Any, name: str) -> np.ndarray:
    """Convert a torch tensor / array-like to a numpy array (detached, on CPU)."""
    if x is None:
        raise ValueError(f"{name} must not be None")
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype == object:
        raise ValueError(f"{name} could not be converted to a numeric array (got dtype=object)")
    return arr


def _features(x: Any, name: str) -> np.ndarray:
    """``x`` as float64 features ``(N, D)``: a 1-D input is one column, more dims are flattened into ``D``."""
    arr = _to_numpy(x, name)
    if arr.ndim == 0:
        raise ValueError(f"{name} must be a 2-D (N, D) array, got a scalar")
    if not np.issubdtype(arr.dtype, np.number) and arr.dtype != np.bool_:
        raise ValueError(f"{name} must be numeric, got dtype={arr.dtype}")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty (0 rows)")
    arr = arr.reshape(len(arr), int(np.prod(arr.shape[1:]))).astype(np.float64, copy=False)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains {int((~np.isfinite(arr)).sum())} NaN/Inf value(s)")
    return arr


def _labels(y: Any, name: str) -> np.ndarray:
    arr = _to_numpy(y, name)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of labels, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty")
    if np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{name} contains NaN/Inf")
        if not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must contain integer class labels, got non-integer floats")
        arr = arr.astype(np.int64)
    return arr


def _rows(x: Any, x_name: str, y: Any, y_name: str, x_as=_features) -> tuple[np.ndarray, np.ndarray]:
    """``x`` through ``x_as`` (features; or :func:`_labels`) and ``y`` as labels, with as many rows as each other."""
    a, b = x_as(x, x_name), _labels(y, y_name)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{x_name} has {a.shape[0]} rows but {y_name} has {b.shape[0]}; they must match")
    return a, b


class _Probe:
    """What every probe shares: its accuracy, from its ``predict``."""

    def predict(self, features: Any) -> np.ndarray:
        raise NotImplementedError

    def accuracy(self, features: Any, labels: Any) -> float:
        X, y = _rows(features, "features", labels, "labels")
        return float(np.mean(self.predict(X) == y))


class LinearProbe(_Probe):
    """Multinomial logistic regression on standardised features: ``StandardScaler`` followed by
    ``LogisticRegression(solver="lbfgs")`` in a scikit-learn ``Pipeline``; ``C`` is the inverse L2 strength
    (scikit-learn refuses ``C <= 0`` and ``max_iter < 1`` when fitting)."""

    def __init__(self, C: float = 1.0, max_iter: int = 1000, tol: float = 1e-4, seed: int = 0):
        self.C, self.max_iter, self.tol, self.seed = float(C), int(max_iter), float(tol), seed
        self.pipeline_ = None

    def fit(self, features: Any, labels: Any) -> "LinearProbe":
        import warnings

        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import Pipeline
        from sklearn.preprocessing import StandardScaler

        X, y = _rows(features, "features", labels, "labels")
        if np.unique(y).size < 2:
            raise ValueError("labels must contain at least 2 distinct classes to fit a probe")
        logreg = LogisticRegression(C=self.C, solver="lbfgs", max_iter=self.max_iter, tol=self.tol,
                                    random_state=self.seed)
        self.pipeline_ = Pipeline([("scaler", StandardScaler()), ("logreg", logreg)])
        with warnings.catch_warnings():
            # Non-convergence at max_iter is an accepted budget choice for a probe.
            warnings.simplefilter("ignore", ConvergenceWarning)
            self.pipeline_.fit(X, y)
        return self

    @property
    def classes_(self) -> np.ndarray:
        self._check_fitted()
        return self.pipeline_.classes_

    def _check_fitted(self) -> None:
        if self.pipeline_ is None:
            raise RuntimeError("LinearProbe is not fitted; call fit(features, labels) first")

    def predict(self, features: Any) -> np.ndarray:
        self._check_fitted()
        X = _features(features, "features")
        n_in = self.pipeline_.named_steps["scaler"].n_features_in_
        if X.shape[1] != n_in:
            raise ValueError(f"features has {X.shape[1]} columns but the probe was fitted on {n_in}")
        return self.pipeline_.predict(X)


class MLPProbe(_Probe):
    """A two-hidden-layer ReLU network on standardised features, trained by Adam on the cross-entropy (cosine-decayed
    learning rate, weight decay, a fixed number of epochs, deterministic for a given ``seed``): how much class
    information a set of features holds when the readout need not be linear.  The same interface as
    :class:`LinearProbe`; labels may be any integers (the network's outputs are their sorted unique values)."""

    def __init__(self, hidden: int = 256, epochs: int = 30, batch_size: int = 256, lr: float = 1e-3,
                 weight_decay: float = 1e-4, seed: int = 0):
        for name, value in (("hidden", hidden), ("epochs", epochs), ("batch_size", batch_size)):
            if int(value) < 1:
                raise ValueError(f"MLPProbe: {name} must be >= 1, got {value}")
        if not lr > 0:
            raise ValueError(f"MLPProbe: lr must be > 0, got {lr}")
        self.hidden, self.epochs, self.batch_size = int(hidden), int(epochs), int(batch_size)
        self.lr, self.weight_decay, self.seed = float(lr), float(weight_decay), seed
        self.net_ = None

    def fit(self, features: Any, labels: Any) -> "MLPProbe":
        import torch

        X, y = _rows(features, "features", labels, "labels")
        classes, y_index = np.unique(y, return_inverse=True)
        if classes.size < 2:
            raise ValueError("labels must contain at least 2 distinct classes to fit a probe")
        self.classes_, self.mean_, self.scale_ = classes, X.mean(0), X.std(0) + 1e-6
        g = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
            torch.manual_seed(self.seed)
            net = torch.nn.Sequential(torch.nn.Linear(X.shape[1], self.hidden), torch.nn.ReLU(),
                                      torch.nn.Linear(self.hidden, self.hidden), torch.nn.ReLU(),
                                      torch.nn.Linear(self.hidden, classes.size))
        inputs = torch.as_tensor((X - self.mean_) / self.scale_, dtype=torch.float32)
        targets = torch.as_tensor(y_index)
        batches = max(1, len(X) // self.batch_size)  # a ragged last batch is dropped; each epoch reshuffles
        opt = torch.optim.Adam(net.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, self.epochs * batches)
        for _ in range(self.epochs):
            order = torch.randperm(len(X), generator=g)
            for b in range(batches):
                idx = order[b * self.batch_size:(b + 1) * self.batch_size]
                loss = torch.nn.functional.cross_entropy(net(inputs[idx]), targets[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        self.net_ = net.eval()
        return self

    def predict(self, features: Any) -> np.ndarray:
        import torch

        if self.net_ is None:
            raise RuntimeError("MLPProbe is not fitted; call fit(features, labels) first")
        X = _features(features, "features")
        if X.shape[1] != self.mean_.size:
            raise ValueError(f"features has {X.shape[1]} columns but the probe was fitted on {self.mean_.size}")
        with torch.no_grad():
            logits = self.net_(torch.as_tensor((X - self.mean_) / self.scale_, dtype=torch.float32))
        return self.classes_[logits.argmax(1).numpy()]


def probe_accuracy(train_features: Any, train_labels: Any, test_features: Any, test_labels: Any, **kw: Any) -> float:
    """Fit a :class:`LinearProbe` (``**kw`` go to its constructor) on train, return test accuracy."""
    Xtr, ytr = _rows(train_features, "train_features", train_labels, "train_labels")
    Xte, yte = _rows(test_features, "test_features", test_labels, "test_labels")
    return LinearProbe(**kw).fit(Xtr, ytr).accuracy(Xte, yte)


def hungarian_labels(cluster_ids: Any, labels: Any) -> np.ndarray:
    """``(N,)`` the label each point's cluster stands for under the best one-to-one assignment of clusters to labels
    (``linear_sum_assignment`` on the contingency matrix); the points of surplus clusters, unmatched, get a value
    below every label (``min(labels) - 1``)."""
    from scipy.optimize import linear_sum_assignment
    from sklearn.metrics.cluster import contingency_matrix

    c, y = _rows(cluster_ids, "cluster_ids", labels, "labels", x_as=_labels)
    clusters, cluster_index = np.unique(c, return_inverse=True)
    classes = np.unique(y).astype(np.int64)  # signed: below the smallest label of unsigned labels (uint8) too
    rows, cols = linear_sum_assignment(contingency_matrix(c, y), maximize=True)  # (n_clusters, n_labels)
    stands_for = np.full(len(clusters), classes.min() - 1, dtype=np.int64)
    stands_for[rows] = classes[cols]
    return stands_for[cluster_index]


def hungarian_accuracy(cluster_ids: Any, labels: Any) -> float:
    """Accuracy of :func:`hungarian_labels`: the points of surplus clusters count as errors."""
    return float(np.mean(hungarian_labels(cluster_ids, labels) == _labels(labels, "labels")))


def kmeans_labels(features: Any, labels: Any, n_clusters: int = 10, seed: int = 0, n_init: int = 10) -> np.ndarray:
    """``(N,)`` k-means on ``features``, each point labelled by :func:`hungarian_labels` of its cluster."""
    from sklearn.cluster import KMeans

    X, y = _rows(features, "features", labels, "labels")
    if int(n_clusters) > X.shape[0]:
        raise ValueError(f"n_clusters={n_clusters} exceeds the number of samples in features ({X.shape[0]})")
    ids = KMeans(n_clusters=int(n_clusters), random_state=seed, n_init=int(n_init)).fit_predict(X)
    return hungarian_labels(ids, y)


def kmeans_accuracy(features: Any, labels: Any, n_clusters: int = 10, seed: int = 0, n_init: int = 10) -> float:
    """Accuracy of :func:`kmeans_labels` against ``labels`` (SCAE's score)."""
    return float(np.mean(kmeans_labels(features, labels, n_clusters, seed, n_init) == _labels(labels, "labels")))


def kmeans_spread(features: Any, labels: Any, n_clusters: int = 10, inits: int = 10) -> dict:
    """How much :func:`kmeans_accuracy` depends on where k-means starts: the accuracy of each of ``inits`` single
    initialisations (seeds ``0 .. inits − 1``), ``{"min", "median", "max": float, "accuracies": [float]}``."""
    accuracies = [kmeans_accuracy(features, labels, n_clusters, seed=seed, n_init=1) for seed in range(int(inits))]
    return {"min": float(np.min(accuracies)), "median": float(np.median(accuracies)),
            "max": float(np.max(accuracies)), "accuracies": accuracies}


def kmeans_from_class_means(features: Any, labels: Any, n_clusters: int = 10, n_init: int = 10) -> dict:
    """Whether k-means' objective agrees with the classes: Lloyd's algorithm started at the class means of
    ``features`` (one centre per label value, ``n_clusters`` of them) against the fit every table reports (the best of
    ``n_init`` starts by inertia, seed 0). ``{"accuracy": float, "inertia": float, "best_accuracy": float,
    "best_inertia": float, "class_inertia": float}``: the accuracy (by :func:`hungarian_labels`) and inertia of the
    fit from the class means and of the best fit, and the inertia of the class partition itself (each point to its
    class mean). A fit from the class means that is more accurate than the best fit but at a higher inertia says
    the shortfall is k-means' objective on these features, not where it starts. Uses the labels: a diagnostic,
    not a clustering."""
    from sklearn.cluster import KMeans

    X, y = _rows(features, "features", labels, "labels")
    classes, idx = np.unique(y, return_inverse=True)
    if classes.size != int(n_clusters):
        raise ValueError(f"labels have {classes.size} classes, n_clusters is {n_clusters}: one centre per class")
    means = np.stack([X[idx == c].mean(0) for c in range(classes.size)])  # (C, D)
    class_inertia = float(((X - means[idx]) ** 2).sum())
    from_means = KMeans(n_clusters=int(n_clusters), init=means, n_init=1).fit(X)
    best = KMeans(n_clusters=int(n_clusters), random_state=0, n_init=int(n_init)).fit(X)
    return {"accuracy": hungarian_accuracy(from_means.labels_, y), "inertia": float(from_means.inertia_),
            "best_accuracy": hungarian_accuracy(best.labels_, y), "best_inertia": float(best.inertia_),
            "class_inertia": class_inertia}


def most_confused_pair(confusion: Any, classes: Any = None) -> dict:
    """The two classes a classifier (or clustering) mixes up most: the pair ``(a, b)`` with the most images of
    either given as the other in ``confusion`` ``(C, C)`` (rows true, columns predicted), ``{"classes": [a, b],
    "count": int, "share": float}``, ``share`` of the images of the two classes."""
    m = np.asarray(confusion, dtype=np.int64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 2:
        raise ValueError(f"confusion must be a square matrix of at least 2 classes, got shape {m.shape}")
    classes = list(range(m.shape[0])) if classes is None else list(classes)
    mixed = np.triu(m + m.T, 1)
    a, b = np.unravel_index(np.argmax(mixed), mixed.shape)
    total = m[a].sum() + m[b].sum()
    return {"classes": [classes[a], classes[b]], "count": int(mixed[a, b]),
            "share": float(mixed[a, b] / total) if total else 0.0}


def classification_summary(true_labels: Any, predicted: Any, classes: Any = None) -> dict:
    """Per-class accuracy and the confusion matrix of a classifier's predictions: ``{"classes": [...], "accuracy":
    float, "per_class_accuracy": {str(c): float}, "confusion": [[int]]}``.

    ``classes``: the label values in the matrix's order (default: every value in ``true_labels`` or ``predicted``,
    sorted); ``confusion[i][j]`` counts the images of class ``classes[i]`` predicted as ``classes[j]``; the accuracy
    of a class is its recall, given only for classes with images in ``true_labels``.
    """
    from sklearn.metrics import classification_report, confusion_matrix

    y, p = _rows(true_labels, "true_labels", predicted, "predicted", x_as=_labels)
    values = np.union1d(y, p) if classes is None else _labels(classes, "classes")
    if classes is not None and not np.isin(np.union1d(y, p), values).all():
        raise ValueError("classes must hold every value of true_labels and predicted")
    matrix = confusion_matrix(y, p, labels=values)
    report = classification_report(y, p, labels=values, output_dict=True, zero_division=0)
    recall = {str(v.item()): float(report[str(v.item())]["recall"]) for v, n in zip(values, matrix.sum(1)) if n > 0}
    return {"classes": [v.item() for v in values], "accuracy": float(np.mean(y == p)), "per_class_accuracy": recall,
            "confusion": matrix.tolist()}


def _class_sums(weights: Any, labels: Any):
    """``(weights (N, D), sums (D, C), counts (C,), classes (C,))``: each column summed over each class's images."""
    W, y = _rows(weights, "weights", labels, "labels")
    classes, idx = np.unique(y, return_inverse=True)
    sums = np.zeros((W.shape[1], classes.size))
    np.add.at(sums.T, idx.ravel(), W)
    return W, sums, np.bincount(idx.ravel(), minlength=classes.size), classes


def mean_by_class(values: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(means (D, C), classes (C,))``: the mean of each column of ``values (N, D)`` over the images of each class,
    columns in the order of ``classes`` (the sorted label values): an object-by-class table."""
    _, sums, counts, classes = _class_sums(values, labels)
    return sums / counts, classes


def object_class_shares(weights: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(shares (K, C), classes (C,))``: for each object (a column of the non-negative ``weights (N, K)``, e.g.
    its expected part count per image), the share of its total weight that falls on the images of each class.
    An object with no weight at all gets a row of NaNs."""
    W, totals, _, classes = _class_sums(weights, labels)
    if (W < 0).any():
        raise ValueError("weights must be non-negative")
    mass = totals.sum(1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mass > 0, totals / mass, np.nan), classes


def class_purity(weights: Any, labels: Any) -> float:
    """Mean over objects of the largest class share of each object's weight (:func:`object_class_shares`).

    1.0: every object explains the images of one class only; ``1 / C`` for objects spread evenly over ``C``
    balanced classes (0.1 on MNIST: no specialisation).  Objects with no weight are left out; NaN if all are."""
    shares, _ = object_class_shares(weights, labels)
    used = ~np.isnan(shares[:, 0])
    return float(shares[used].max(1).mean()) if used.any() else float("nan")


def dominant_object_accuracy(train_weights: Any, train_labels: Any, test_weights: Any, test_labels: Any) -> float:
    """Test accuracy of reading each image as its dominant object (the column of the non-negative ``weights (N, K)``
    largest in its row, e.g. the object expected to explain the most of its parts) and each object as the class
    most common among the training images it dominates; objects that dominate no training image read as the most
    common training class.

    What the objects alone say of the class, one cluster per object and no grouping to find: where it is well
    above k-means (10 clusters, matched one-to-one), the objects are digits that the clustering does not group;
    where it is not, objects are shared between digits."""
    W, y = _rows(train_weights, "train_weights", train_labels, "train_labels")
    V, t = _rows(test_weights, "test_weights", test_labels, "test_labels")
    if W.shape[1] != V.shape[1]:
        raise ValueError(f"train_weights has {W.shape[1]} columns but test_weights has {V.shape[1]}")
    if (W < 0).any() or (V < 0).any():
        raise ValueError("weights must be non-negative")
    dominated = np.eye(W.shape[1])[W.argmax(1)]                # each training image on its dominant object alone
    _, table, class_counts, classes = _class_sums(dominated, y)  # images dominated, object by class
    read_as = np.where(table.sum(1) > 0, table.argmax(1), class_counts.argmax())
    return float((classes[read_as[V.argmax(1)]] == t.ravel()).mean())


def _pair(pred: Any, true: Any, pred_name: str = "pred", true_name: str = "true"):
    p = _to_numpy(pred, pred_name).astype(np.float64)
    t = _to_numpy(true, true_name).astype(np.float64)
    if p.shape != t.shape:
        raise ValueError(f"{pred_name} has shape {p.shape} but {true_name} has shape {t.shape}")
    if p.size == 0:
        raise ValueError(f"{pred_name} is empty")
    for a, name in ((p, pred_name), (t, true_name)):
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} contains NaN/Inf")
    return p, t


def r2_scores(pred: Any, true: Any) -> np.ndarray:
    """Per-column coefficient of determination ``1 - SS_res / SS_tot`` for (N, K) inputs.

    A 1-D input is treated as a single column; >2-D inputs are flattened to (N, -1).  A column whose target is
    constant (SS_tot = 0) gets 1.0 if predicted exactly and 0.0 otherwise (scikit-learn's convention), never NaN."""
    p, t = _pair(pred, true)
    p, t = p.reshape(p.shape[0], -1), t.reshape(t.shape[0], -1)
    ss_res = ((t - p) ** 2).sum(axis=0)
    ss_tot = ((t - t.mean(axis=0)) ** 2).sum(axis=0)
    const = ss_tot == 0
    return np.where(const, (ss_res == 0).astype(np.float64), 1.0 - ss_res / np.where(const, 1.0, ss_tot))


def r2_score(pred: Any, true: Any) -> float:
    """R^2 of a 1-D prediction (a single column)."""
    p, t = _to_numpy(pred, "pred"), _to_numpy(true, "true")
    for a, name in ((p, "pred"), (t, "true")):
        if a.ndim != 1 and not (a.ndim == 2 and a.shape[1] == 1):
            raise ValueError(f"{name} must be 1-D for r2_score (use r2_scores for (N, K)), got shape {a.shape}")
    return float(r2_scores(p.reshape(-1), t.reshape(-1))[0])


def reconstruction_mse(recon: Any, target: Any) -> float:
    """Mean squared error over all elements of ``recon`` and ``target`` (same shape)."""
    r, t = _pair(recon, target, "recon", "target")
    return float(np.mean((r - t) ** 2))


def template_distinctness(templates: torch.Tensor, steps: int = 150, lr: float = 0.05, rotations: int = 4,
                          seed: int = 0) -> dict:
    """How distinct learned templates are (Smith et al. 2020, Figure 6): for each template ``T_i`` of ``templates``
    ``(M, C, t, t)``, its nearest other template under the best affine warp,

        d_i = min_{j != i} min_A ||T_i − warp(T_j, A)||² / ||T_i||²,

    the share of ``T_i``'s energy that no other template, warped, explains (0: a warped copy of another; 1: nothing
    alike).  ``A`` is fitted by ``steps`` Adam steps (``lr``) from ``rotations`` starts (rotations by multiples of
    ``2π / rotations``) for every ordered pair at once.  Returns ``{"nearest": (M,) int64, "distance": (M,),
    "warp": (M, 3, 3), "mean": float, "min": float}``; ``warp[i]`` maps the nearest template onto ``T_i``.
    """
    import torch

    from probcaps.geometry import compose, pose6_to_matrix, rotation_matrix
    from probcaps.render import warp

    T = templates.detach().to(torch.float32)
    M, C, t, _ = T.shape
    if M < 2:
        raise ValueError(f"template_distinctness: needs at least 2 templates, got {M}")
    i, j = (~torch.eye(M, dtype=torch.bool)).nonzero().unbind(1)                 # every ordered pair, i != j
    pairs = len(i)
    starts = rotation_matrix(torch.arange(rotations) * (2 * math.pi / rotations))  # (R, 3, 3)
    start = starts.repeat_interleave(pairs, 0)                                     # (R P, 3, 3)
    target, source = T[i].repeat(rotations, 1, 1, 1), T[j].repeat(rotations, 1, 1, 1)
    energy = target.pow(2).sum((1, 2, 3)).clamp_min(1e-12)
    generator = torch.Generator().manual_seed(seed)
    y = (1e-3 * torch.randn(len(start), 6, generator=generator)).requires_grad_()
    optimiser = torch.optim.Adam([y], lr=lr)

    def residual() -> torch.Tensor:
        A = compose(start, pose6_to_matrix(y))
        return (target - warp(source, A, t)).pow(2).sum((1, 2, 3)) / energy

    with torch.enable_grad():
        for _ in range(int(steps)):
            optimiser.zero_grad()
            residual().sum().backward()
            optimiser.step()
    with torch.no_grad():
        share = residual().view(rotations, pairs)
        best, restart = share.min(0)                                               # (P,)
        A = compose(start, pose6_to_matrix(y)).view(rotations, pairs, 3, 3)[restart, torch.arange(pairs)]
        table = torch.full((M, M), float("inf"))
        table[i, j] = best
        distance, nearest = table.min(1)
        rows = torch.arange(M)
        index = rows * (M - 1) + nearest - (nearest > rows).long()                 # the pair (i, nearest_i)
    return {"nearest": nearest, "distance": distance, "warp": A[index], "mean": float(distance.mean()),
            "min": float(distance.min())}
