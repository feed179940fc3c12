"""SCAE's readout in the model's terms (posterior part counts, class purity) and the classification report."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyro.poutine as poutine
import pytest
import torch

from probcaps.distributions import RELAXED_CLAMP
from probcaps.inference.evaluate import (
    LAYER_READOUTS,
    NONLINEAR_PROBES,
    READOUTS,
    REPORTED_KMEANS,
    REPORTED_PROBES,
    evaluate_checkpoint,
    information_rows,
    parent_log_posterior,
    part_pose_explained,
    parts_in_parent_frame,
    posterior_part_counts,
    posterior_presences,
    readout_features,
)
from probcaps.inference.guides import Latents
from probcaps.metrics import (
    class_purity,
    classification_summary,
    dominant_object_accuracy,
    mean_by_class,
    object_class_shares,
)
from probcaps.models.capsule_model import CapsuleModel, CapsuleModelConfig
from probcaps.plotting import plot_confusion_matrix, plot_objects_by_class

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _tiny_model_and_latents(B=2, K=2, M=3, seed=0):
    """A small model with random parameters (so that every parent has a different claim on every part) and
    latents whose parts sit near their parents' predictions, in float64."""
    gen = torch.Generator().manual_seed(seed)
    model = CapsuleModel(CapsuleModelConfig(num_parents=K, num_parts=M, template_size=5, canvas_size=12,
                                            part_pose_std_init=0.3)).double()
    with torch.no_grad():
        model.log_affinity.copy_(torch.randn(K, M, generator=gen, dtype=torch.float64))
        model.presence_logits.copy_(2 * torch.randn(K, M, generator=gen, dtype=torch.float64))
        model.offsets.add_(0.2 * torch.randn(K, M, 6, generator=gen, dtype=torch.float64))
    parent_poses = 0.3 * torch.randn(B, K, 6, generator=gen, dtype=torch.float64)
    # each part near the prediction of a random parent, so that the posterior is neither flat nor one-hot
    from probcaps.geometry import compose_pose6

    predicted = compose_pose6(parent_poses.unsqueeze(-2), model.offsets.detach())          # (B, K, M, 6)
    owner = torch.randint(K, (B, M), generator=gen)
    near = predicted.gather(1, owner[:, None, :, None].expand(B, 1, M, 6)).squeeze(1)
    part_poses = near + 0.2 * torch.randn(B, M, 6, generator=gen, dtype=torch.float64)
    latents = Latents(part_logits=2 * torch.randn(B, M, generator=gen, dtype=torch.float64), part_poses=part_poses,
                      parent_logits=torch.randn(B, K, generator=gen, dtype=torch.float64), parent_poses=parent_poses)
    return model, latents


def _brute_force_counts(model, latents):
    """Expected part counts from the Pyro model's joint: every assignment ``s`` of the parts to parents scored by
    conditioning the model on it and the latents, normalised over all ``(K+1)^M`` assignments."""
    B, M = latents.part_logits.shape
    K = latents.parent_logits.shape[1]
    clamp = lambda t: torch.sigmoid(t).clamp(RELAXED_CLAMP, 1 - RELAXED_CLAMP)
    values = {"z1": clamp(latents.parent_logits), "y1": latents.parent_poses, "z0": clamp(latents.part_logits),
              "y0": latents.part_poses}
    x = torch.zeros(B, 1, 12, 12, dtype=torch.float64)
    log_joints, assignments = [], list(itertools.product(range(K + 1), repeat=M))
    for s in assignments:
        data = {**values, "s": torch.tensor(s).expand(B, M)}
        trace = poutine.trace(poutine.condition(model, data=data)).get_trace(x)
        trace.compute_log_prob()
        log_joints.append(sum(trace.nodes[name]["log_prob"].reshape(B, -1).sum(1)
                              for name in ("z1", "y1", "s", "z0", "y0", "x")))
    posterior = torch.stack(log_joints, 1).softmax(1)                                     # (B, (K+1)^M)
    members = torch.tensor([[sum(sm == k for sm in s) for k in range(1, K + 1)] for s in assignments],
                           dtype=torch.float64)                                          # (assignments, K)
    return posterior @ members


def test_posterior_part_counts_match_brute_force_enumeration():
    # catches: a wrong factor (presence density, pose spread, selection prior) or normalisation in q(s)
    model, latents = _tiny_model_and_latents()
    expected = _brute_force_counts(model, latents)
    counts = posterior_part_counts(model, latents, batch_size=1)  # one image per chunk: chunks concatenated in order
    assert counts.shape == (2, 2)
    torch.testing.assert_close(counts, expected, rtol=1e-7, atol=1e-9)
    # the counts are neither trivial nor the prior's: the brute force separates the objects
    assert (expected.max(1).values - expected.min(1).values > 0.05).all()
    # every part goes to exactly one parent, the dummy included
    log_q = parent_log_posterior(model, latents)
    torch.testing.assert_close(log_q.exp().sum(-1), torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(counts.sum(1) + log_q[..., 0].exp().sum(1), torch.full((2,), 3.0, dtype=torch.float64))


def test_certain_share_counts_the_parts_on_whose_posterior_parent_is_sure():
    # catches: parts that are off counted, the threshold applied to another quantity than max_k q(s_m = k), or
    # chunks that drop or repeat images
    model, latents = _tiny_model_and_latents(B=6, M=5, seed=0)
    sure = parent_log_posterior(model, latents).exp().amax(-1)                       # (B, M)
    on = torch.sigmoid(latents.part_logits) > 0.5
    threshold = float(sure.median())  # about half the parts are above it, some of them off
    expected = float(((sure > threshold) & on).sum()) / float(on.sum())
    assert 0 < expected < 1 and ((sure > threshold) & ~on).any()
    for batch_size in (1, 4, 100):
        counts, share = posterior_presences(model, latents, batch_size, certain=threshold)
        assert share == pytest.approx(expected)
        torch.testing.assert_close(counts, posterior_part_counts(model, latents))  # the same pass gives both
    off = latents._replace(part_logits=torch.full_like(latents.part_logits, -5.0))
    assert posterior_presences(model, off)[1] == 0.0


def test_posterior_part_counts_follow_the_parts_poses():
    # catches: counts that ignore the part poses (e.g. the selection prior alone)
    model, latents = _tiny_model_and_latents(B=1, K=2, M=3, seed=1)
    from probcaps.geometry import compose_pose6

    predicted = compose_pose6(latents.parent_poses.unsqueeze(-2), model.offsets.detach())  # (1, K, M, 6)
    with torch.no_grad():
        model.log_affinity.zero_()
        model.presence_logits.zero_()
    on = dict(part_logits=torch.full((1, 3), 4.0, dtype=torch.float64),
              parent_logits=torch.full((1, 2), 4.0, dtype=torch.float64), parent_poses=latents.parent_poses)
    at_first = posterior_part_counts(model, Latents(part_poses=predicted[:, 0], **on))
    at_second = posterior_part_counts(model, Latents(part_poses=predicted[:, 1], **on))
    assert at_first[0, 0] > 2.5 and at_second[0, 1] > 2.5


@pytest.mark.parametrize("object_pose,codes", [("affine", 0), ("similarity", 0), ("affine", 2)])
def test_parts_in_parent_frame_hand_placed(object_pose, codes):
    # catches: the frame of the wrong parent, an inverse composed on the wrong side, the unrestricted object pose,
    # a residual measured from another parent's prediction, or from the offsets without the object's code
    from probcaps.geometry import compose_pose6, restrict_pose6

    gen = torch.Generator().manual_seed(3)
    K, M = 2, 3
    model = CapsuleModel(CapsuleModelConfig(num_parents=K, num_parts=M, template_size=5, canvas_size=12,
                                            part_pose_std_init=0.05, object_pose=object_pose,
                                            object_code_dims=codes)).double()
    with torch.no_grad():
        model.offsets.copy_(0.3 * torch.randn(K, M, 6, generator=gen, dtype=torch.float64))
    parent_poses = 0.4 * torch.randn(1, K, 6 + codes, generator=gen, dtype=torch.float64)
    y1 = restrict_pose6(parent_poses[..., :6], object_pose)
    offsets = model.offsets.detach().clone()
    if codes:  # Δ_km + U_km c_k by hand, the basis set within its bound
        with torch.no_grad():
            model.code_basis.copy_(0.02 * torch.randn(K, M, 6, codes, generator=gen, dtype=torch.float64))
        assert (model.code_basis.norm(dim=-1) < model.config.code_deformation_std).all()
        offsets += (model.code_basis.detach() @ parent_poses[0, :, None, 6:, None]).squeeze(-1)
    # part 0 exactly where object 1 puts it, part 1 where object 0 puts it plus a known offset, part 2 far off
    part_poses = torch.stack([compose_pose6(y1[0, 1], offsets[1, 0]),
                              compose_pose6(y1[0, 0], offsets[0, 1]) + 0.01,
                              torch.tensor([0.0, 0.0, 9.0, 0.0, 0.0, -9.0], dtype=torch.float64)]).unsqueeze(0)
    latents = Latents(part_logits=torch.full((1, M), 4.0, dtype=torch.float64), part_poses=part_poses,
                      parent_logits=torch.full((1, K), 4.0, dtype=torch.float64), parent_poses=parent_poses)
    frame, residual, parent = parts_in_parent_frame(model, latents)
    assert parent.tolist() == [[2, 1, 0]]                                  # object 1, object 0, the dummy
    torch.testing.assert_close(frame[0, 0], offsets[1, 0])                 # P(y1)^-1 P(y1) P(Δ) = P(Δ)
    torch.testing.assert_close(residual[0, 0], torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(residual[0, 1], torch.full((6,), 0.01, dtype=torch.float64))
    torch.testing.assert_close(compose_pose6(y1[0, 0], frame[0, 1]), part_poses[0, 1])
    torch.testing.assert_close(frame[0, 2], part_poses[0, 2])               # the dummy's frame is the canvas
    torch.testing.assert_close(residual[0, 2], part_poses[0, 2])
    if object_pose == "similarity":  # the object's slant is not in its frame
        assert not torch.allclose(y1, parent_poses)


def test_object_drawings_rows_columns_and_code_directions():
    # catches: objects out of use drawn (or objects in use left out), a mean over the images where the object is off,
    # code directions that are not the codes' principal ones or steps of the wrong size, the example image of
    # another image or object
    from probcaps.inference.evaluate import object_drawings

    gen = torch.Generator().manual_seed(5)
    K, M, D, N = 3, 2, 2, 6
    model = CapsuleModel(CapsuleModelConfig(num_parents=K, num_parts=M, template_size=5, canvas_size=12,
                                            object_code_dims=D, code_deformation_std=0.5)).double()
    with torch.no_grad():
        model.code_basis.copy_(0.3 * torch.randn(K, M, 6, D, generator=gen, dtype=torch.float64))
    logits = torch.full((N, K), -5.0, dtype=torch.float64)
    logits[:, 0] = torch.linspace(1.0, 2.0, N).flip(0)           # object 0 on everywhere, most present in image 0
    logits[[1, 3], 2] = torch.tensor([1.0, 3.0], dtype=torch.float64)  # object 2 on in images 1 and 3; object 1 off
    poses = 0.1 * torch.randn(N, K, 6 + D, generator=gen, dtype=torch.float64)
    t = torch.tensor([-1.0, 0.0, 1.0, -1.0, 0.0, 1.0], dtype=torch.float64)
    poses[:, 0, 6:] = torch.stack([0.5 + 0.3 * t, 0.5 + 0.6 * t], -1)  # object 0's codes vary along (1, 2) alone
    poses[[0, 2, 4, 5], 2] = 50.0                                 # where object 2 is off, nothing of its latents counts
    images = torch.randint(0, 256, (N, 12, 12), generator=gen, dtype=torch.uint8)
    latents = Latents(part_logits=torch.zeros(N, M, dtype=torch.float64), part_poses=torch.zeros(N, M, 6,
                      dtype=torch.float64), parent_logits=logits, parent_poses=poses)
    grid, rows, cols = object_drawings(model, latents, images, components=1, span=2.0)
    assert rows == ["object 0", "object 2"] and cols == ["most present", "mean", "−2σ code 1", "+2σ code 1"]
    assert grid.shape == (2, 4, 12, 12)

    @torch.no_grad()
    def drawn(k, y):
        y1 = torch.zeros(1, K, 6 + D, dtype=torch.float64)
        y1[0, k] = y
        return model.draw_objects(y1)[0, k, 0].float()

    torch.testing.assert_close(grid[0, 0], images[0].float() / 255)
    torch.testing.assert_close(grid[1, 0], images[3].float() / 255)
    mean0, mean2 = poses[:, 0].mean(0), poses[[1, 3], 2].mean(0)
    torch.testing.assert_close(grid[0, 1], drawn(0, mean0))
    torch.testing.assert_close(grid[1, 1], drawn(2, mean2))
    step = torch.zeros(6 + D, dtype=torch.float64)
    step[6:] = 2.0 * t.std() * torch.tensor([0.3, 0.6], dtype=torch.float64)  # 2 std along the one direction
    pair = sorted([drawn(0, mean0 - step), drawn(0, mean0 + step)], key=lambda x: float(x.sum()))
    got = sorted([grid[0, 2], grid[0, 3]], key=lambda x: float(x.sum()))  # the direction's sign is arbitrary
    assert not torch.allclose(pair[0], pair[1], atol=1e-3)
    torch.testing.assert_close(got[0], pair[0])
    torch.testing.assert_close(got[1], pair[1])
    nothing_on = latents._replace(parent_logits=torch.full((N, K), -5.0, dtype=torch.float64))
    assert object_drawings(model, nothing_on, images) is None
    plain = CapsuleModel(CapsuleModelConfig(num_parents=K, num_parts=M, template_size=5, canvas_size=12)).double()
    _, _, cols = object_drawings(plain, latents._replace(parent_poses=poses[..., :6]), images)
    assert cols == ["most present", "mean"]                       # no code, no code directions


def test_part_pose_explained_hand_cases():
    # catches: parts that are off or with the dummy counted, or the spread taken about zero instead of each part's mean
    poses = torch.tensor([[[0.0] * 6, [1.0] * 6], [[2.0] * 6, [5.0] * 6]])            # (N=2, M=2, 6)
    latents = Latents(part_logits=torch.tensor([[4.0, 4.0], [4.0, -4.0]]), part_poses=poses,
                      parent_logits=torch.zeros(2, 1), parent_poses=torch.zeros(2, 1, 6))
    parent = torch.tensor([[1, 1], [1, 1]])
    assert part_pose_explained(latents, torch.zeros_like(poses), parent) == 1.0
    # part 0 is on in both images (mean pose 1), part 1 in the first alone (spread 0): residuals of ±1 explain none
    residual = torch.tensor([[[-1.0] * 6, [0.0] * 6], [[1.0] * 6, [7.0] * 6]])
    assert part_pose_explained(latents, residual, parent) == pytest.approx(0.0)
    assert part_pose_explained(latents, residual / 2, parent) == pytest.approx(0.75)
    # with the dummy for every parent nothing is scored
    assert np.isnan(part_pose_explained(latents, residual, torch.zeros(2, 2, dtype=torch.long)))


def test_dominant_object_accuracy_hand_cases():
    train_labels = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    # training images dominated: object 0 by three 0s and a 1 -> reads 0; object 1 by a 1 and three 2s -> reads 2;
    # object 2 by none -> reads the most common training class (0 and 2 tie at three: the first, 0)
    dominant = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    train = np.eye(3)[dominant] * 2.0 + 0.1
    test_labels = np.array([0, 1, 2, 2, 0])
    test = np.array([[3.0, 1, 0], [2, 0.5, 1],    # object 0 -> 0: right, then wrong (a 1)
                     [0, 4, 1], [0.2, 0.3, 0.1],  # object 1 -> 2: right twice
                     [0, 0, 5]])                  # object 2 -> 0: right
    assert dominant_object_accuracy(train, train_labels, test, test_labels) == pytest.approx(4 / 5)
    # objects that are digits, two per digit: the reading is exact, whatever k-means with 10 clusters does
    labels = np.repeat(np.arange(10), 6)
    split = np.eye(20)[2 * labels + np.tile([0, 1], 30)]
    assert dominant_object_accuracy(split, labels, split, labels) == 1.0
    # one object for a 4 and a 9: at most one of the two is read right
    shared = np.eye(10)[np.where(labels == 9, 4, labels)]
    assert dominant_object_accuracy(shared, labels, shared, labels) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="columns"):
        dominant_object_accuracy(train, train_labels, test[:, :2], test_labels)
    with pytest.raises(ValueError, match="non-negative"):
        dominant_object_accuracy(-train, train_labels, test, test_labels)


def test_class_purity_hand_cases():
    labels = np.repeat(np.arange(10), 5)                       # 10 balanced classes
    specialised = np.eye(10)[labels] * 3.0                     # object k explains class k's images only
    assert class_purity(specialised, labels) == pytest.approx(1.0)
    assert class_purity(np.full((50, 4), 2.5), labels) == pytest.approx(0.1)   # every object on every image alike
    # object 0: weight 3 on class 0, 1 on class 1 -> 0.75; object 1: no weight (left out); object 2: class 2 only
    weights = np.zeros((50, 3))
    weights[labels == 0, 0], weights[labels == 1, 0] = 0.6, 0.2
    weights[labels == 2, 2] = 1.0
    assert class_purity(weights, labels) == pytest.approx((0.75 + 1.0) / 2)
    shares, classes = object_class_shares(weights, labels)
    assert np.isnan(shares[1]).all() and shares[0, :2] == pytest.approx([0.75, 0.25])
    assert np.isnan(class_purity(np.zeros((50, 2)), labels))
    with pytest.raises(ValueError, match="non-negative"):
        class_purity(-specialised, labels)


def test_mean_by_class_is_objects_by_classes():
    values = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 5.0]])
    means, classes = mean_by_class(values, [7, 7, 2])
    assert classes.tolist() == [2, 7]
    assert means.tolist() == [[0.0, 2.0], [5.0, 0.0]]


def test_classification_summary_hand_case(tmp_path):
    summary = classification_summary([0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 2, 0], classes=[0, 1, 2, 3])
    assert summary["classes"] == [0, 1, 2, 3]
    assert summary["per_class_accuracy"] == {"0": 0.5, "1": 1.0, "2": 0.5}      # class 3 has no images
    assert summary["confusion"] == [[1, 1, 0, 0], [0, 2, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]
    assert summary["accuracy"] == pytest.approx(4 / 6)
    json.dumps(summary)  # goes into the results JSON as it is
    with pytest.raises(ValueError, match="classes"):
        classification_summary([0, 5], [0, 0], classes=[0, 1])
    path = plot_confusion_matrix(summary["confusion"], tmp_path / "cm.png", class_labels=summary["classes"],
                                 title="hand case")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="square"):
        plot_confusion_matrix(np.ones((2, 3)), tmp_path / "bad.png")


def test_plot_objects_by_class(tmp_path):
    path = plot_objects_by_class({"counts": np.random.rand(4, 10) * 5, "presence": np.random.rand(4, 10)},
                                 tmp_path / "obj.png", class_labels=list("0123456789"), title="t")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="one shape"):
        plot_objects_by_class({"a": np.ones((4, 10)), "b": np.ones((3, 10))}, tmp_path / "bad.png")


def test_information_rows_rank_the_seeds_and_correlate_by_hand():
    # catches: seeds not ranked by their information, or a rank correlation that is not Spearman's
    runs = [{"seed": s, "object_information": i, "kmeans_posterior_counts_test_acc": k}
            for s, i, k in ((0, 0.5, 0.70), (1, 0.9, 0.80), (2, 0.7, 0.90), (3, 0.1, 0.60))]
    rows = information_rows(runs)
    assert [row.split(" | ")[0] for row in rows if row[:3] in ("| 0", "| 1", "| 2", "| 3")] == \
        ["| 1", "| 2", "| 0", "| 3"]
    # ranks of the information 2, 4, 3, 1 and of k-means 2, 3, 4, 1: Σd² = 2, ρ = 1 - 6·2 / (4·15) = 0.8
    assert rows[-1] == "Rank correlation (Spearman) of the two over the 4 seeds: +0.80."
    assert "Rank correlation" not in information_rows(runs[:2])[-1]   # two seeds: no correlation to speak of


def test_evaluate_checkpoint_draws_the_figures_it_is_asked_for(tiny_toml, tmp_path, pyro_clean, monkeypatch):
    # catches: a figure drawn that was not asked for, one asked for missing or written beside the results instead of
    # where told, or an unknown figure name found only after the model has been read out
    from probcaps.errors import ConfigError
    from probcaps.inference import evaluate
    from probcaps.inference.capsule_svi import load_experiment_config, train_capsules

    train_capsules(load_experiment_config(tiny_toml, ["train.steps=2"]), tmp_path / "run", progress=False)
    results, figures = tmp_path / "results", tmp_path / "figures"
    asked = ["reconstructions", "confusion_kmeans_presence"]
    evaluate_checkpoint(tmp_path / "run" / "final.pt", name="tiny", results_dir=results, progress=False,
                        figures=asked, figures_dir=figures)
    drawn = [str(figures / f"tiny_{figure}.png") for figure in asked]
    assert sorted(str(p) for p in figures.iterdir()) == sorted(drawn)
    assert sorted(p.name for p in results.iterdir()) == ["tiny.json", "tiny.md"]
    assert json.loads((results / "tiny.json").read_text())["provenance"]["figures"] == drawn

    def read_out(*args, **kwargs):
        raise AssertionError("the model was read out before its figures were checked")

    monkeypatch.setattr(evaluate, "compute_evaluation", read_out)
    with pytest.raises(ConfigError, match="no figure named templatez"):
        evaluate_checkpoint(tmp_path / "run" / "final.pt", name="tiny", results_dir=results, progress=False,
                            figures=["templates", "templatez"])


@pytest.mark.parametrize("codes", [0, 2])
def test_evaluate_checkpoint_reports_every_readout(tiny_toml, tmp_path, pyro_clean, seed, codes):
    # catches: a readout, split or per-class report missing from the results, or figures not written; with object
    # codes, a "presences + poses" readout that reads the codes too
    from probcaps.inference.capsule_svi import (
        encode_dataset,
        load_experiment_config,
        load_images,
        load_trained,
        train_capsules,
    )

    cfg = load_experiment_config(tiny_toml, ["train.steps=2", f"model.object_code_dims={codes}"])
    train_capsules(cfg, tmp_path / "run", progress=False)
    results = tmp_path / "results"
    metrics = evaluate_checkpoint(tmp_path / "run" / "final.pt", name="tiny", results_dir=results, progress=False,
                                  figures=True, overrides=["eval.layer_readouts=true", "eval.nonlinear_probes=true"])
    table = (results / "tiny.md").read_text()
    for key, label in LAYER_READOUTS.items():  # the part layer's probes, on request
        assert 0.0 <= metrics[f"probe_{key}_test_acc"] <= 1.0 and f"| {label} |" in table, key
    for key in NONLINEAR_PROBES:  # the two-layer network's, on request; codes only in a model with codes
        for split in ("train", "test"):
            assert (0.0 <= metrics[f"mlp_{key}_{split}_acc"] <= 1.0 if codes or key != "presence_pose_code"
                    else f"mlp_{key}_{split}_acc" not in metrics), (key, split)
        label = f"| {READOUTS.get(key, LAYER_READOUTS.get(key))}, two-layer network |"
        assert (label in table) == (codes > 0 or key != "presence_pose_code"), key
    assert ("| presences + poses + codes" in table) == bool(codes)
    for key in (key for key in READOUTS if codes or key != "presence_pose_code"):
        for kind in ("probe", "kmeans"):
            for split in ("train", "test"):
                assert 0.0 <= metrics[f"{kind}_{key}_{split}_acc"] <= 1.0, (kind, key, split)
    for key in REPORTED_PROBES:
        report = metrics[f"probe_{key}_test_report"]
        assert report["accuracy"] == pytest.approx(metrics[f"probe_{key}_test_acc"])
        assert sum(map(sum, report["confusion"])) == metrics["n_test"]
        assert (results / f"tiny_confusion_{key}.png").read_bytes()[:8] == PNG_SIGNATURE
    for key in REPORTED_KMEANS:  # the clusters, each named by its matched class, score the reported accuracy
        report = metrics[f"kmeans_{key}_test_report"]
        assert report["accuracy"] == pytest.approx(metrics[f"kmeans_{key}_test_acc"])
        assert sum(map(sum, report["confusion"])) == metrics["n_test"]
        assert (results / f"tiny_confusion_kmeans_{key}.png").read_bytes()[:8] == PNG_SIGNATURE
    assert 0.0 < metrics["object_class_purity"] <= 1.0
    assert 0.0 < metrics["mean_posterior_part_count"] <= cfg["model"].num_parts
    # the object information, by hand from the training images' posterior part counts: H(pooled) - mean H(image)
    _, system = load_trained(tmp_path / "run" / "final.pt")
    images, _ = load_images(cfg["data"], "train", None, limit=cfg["eval"].probe_train_limit or None)
    counts = posterior_part_counts(system.model, encode_dataset(system.encoder, images)).double().numpy()

    def entropy(c):
        p = c / c.sum(-1, keepdims=True)
        return -(p * np.log(p)).sum(-1)
    information = entropy(counts.sum(0)) - entropy(counts).mean()
    assert information > 1e-7  # after 2 steps the objects barely differ, but the sign and the split still show
    assert metrics["object_information"] == pytest.approx(information, abs=1e-8)
    test_images, test_labels = load_images(cfg["data"], "test", None)
    test_latents = encode_dataset(system.encoder, test_images)
    test_counts = posterior_part_counts(system.model, test_latents)
    # the explained share of the part-pose spread is the test images', from their own parents' frames
    _, test_residual, test_parent = parts_in_parent_frame(system.model, test_latents)
    np.testing.assert_allclose(metrics["part_pose_explained"],
                               part_pose_explained(test_latents, test_residual, test_parent), rtol=1e-6)
    train_labels = load_images(cfg["data"], "train", None, limit=cfg["eval"].probe_train_limit or None)[1]
    assert metrics["dominant_object_test_acc"] == \
        dominant_object_accuracy(counts, train_labels, test_counts, test_labels)
    assert "dominant object" in (results / "tiny.md").read_text()
    assert metrics["published_scae"] == {"probe_test_acc": 0.990, "kmeans_test_acc": 0.987}
    assert (results / "tiny_objects_by_class.png").is_file()
    drawn_on = (torch.sigmoid(test_latents.parent_logits) > 0.5).float().mean(0) >= 0.01
    assert (results / "tiny_objects_drawn.png").is_file() == bool(drawn_on.any())
    if codes:  # the probe on presences + poses reads the six pose coordinates alone
        features, K = readout_features(test_latents, test_counts), cfg["model"].num_parents
        assert test_latents.parent_poses.shape[-1] == 6 + codes
        assert features["presence_pose"][0].shape[1] == K * (1 + 6)
        assert features["presence_pose_code"][0].shape[1] == K * (1 + 6 + codes)
    record = json.loads((results / "tiny.json").read_text())
    assert record["metrics"]["probe_presence_test_report"]["per_class_accuracy"] == \
        metrics["probe_presence_test_report"]["per_class_accuracy"]
    for key in REPORTED_KMEANS:  # the clustering's stability over single starts, and its worst pair of classes
        low, mid, high = (metrics[f"kmeans_{key}_test_acc_init_{q}"] for q in ("min", "median", "max"))
        assert 0.0 <= low <= mid <= high <= 1.0
        pair = metrics[f"kmeans_{key}_test_confused_pair"]
        assert len(set(pair["classes"])) == 2 and 0.0 <= pair["share"] <= 1.0
        start = metrics.get(f"kmeans_{key}_test_class_start")  # only where the test split has all ten digits
        assert (start is not None) == (len(torch.unique(test_labels)) == 10)
        if start:  # its best fit is the one the tables report
            assert start["best_accuracy"] == pytest.approx(metrics[f"kmeans_{key}_test_acc"])
    M = cfg["model"].num_parts  # each template's nearest other one (Figure 6), and the figures of it and Figure 7
    assert len(metrics["template_nearest"]) == M and all(j != m for m, j in enumerate(metrics["template_nearest"]))
    assert metrics["template_distinctness_min"] == pytest.approx(min(metrics["template_distinctness"]))
    assert (results / "tiny_template_neighbours.png").read_bytes()[:8] == PNG_SIGNATURE


# --------------------------------------------------------------------------- test-time VI under the fair protocol


@pytest.fixture
def tiny_run(tiny_toml, tmp_path, pyro_clean, seed):
    from probcaps.inference.capsule_svi import load_experiment_config, train_capsules

    cfg = load_experiment_config(tiny_toml, ["train.steps=2"])
    train_capsules(cfg, tmp_path / "run", progress=False)
    return tmp_path / "run" / "final.pt"


def test_ttvi_of_the_parts_keeps_the_encoders_objects(tiny_run):
    # catches: objects of the parts-only test-time VI that are not the encoder's reading of the optimised parts,
    # or a run that changes (or unfreezes) the model or the encoder
    from probcaps.experiments.ttvi_classification import ttvi_parts_batches
    from probcaps.inference.capsule_svi import load_images, load_trained

    cfg, system = load_trained(tiny_run)
    images, _ = load_images(cfg["data"], "test", limit=6)
    before = {k: v.clone() for k, v in system.state_dict().items()}
    x = images.float().div(255).unsqueeze(1)
    same, trace0, _ = ttvi_parts_batches(system.model, system.encoder, images, batch_size=4, steps=0, progress=False)
    for got, want in zip(same, system.encoder.encode(x)):
        torch.testing.assert_close(got, want)
    moved, trace, _ = ttvi_parts_batches(system.model, system.encoder, images, batch_size=4, steps=5, lr=0.1,
                                         progress=False)
    assert trace0 == [] and len(trace) == 5
    assert not torch.allclose(moved.part_poses, same.part_poses)
    logits, poses = system.encoder.encode_parents(moved.part_poses, torch.sigmoid(moved.part_logits))
    torch.testing.assert_close(moved.parent_logits, logits)
    torch.testing.assert_close(moved.parent_poses, poses)
    for k, v in system.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.requires_grad for p in system.parameters())


def test_ttvi_classification_fair_protocol(tiny_run, tmp_path):
    # catches: the fair probes missing a reading or feature set, or the table not naming the fair rows
    from probcaps.experiments import ttvi_classification as tc

    rc = tc.main(["--checkpoint", str(tiny_run), "--n-test", "8", "--n-train-ttvi", "12", "--steps", "2",
                  "--batch-size", "8", "--name", "fair", "--results-dir", str(tmp_path), "--quiet"])
    assert rc == 0
    m = json.loads((tmp_path / "fair.json").read_text())["metrics"]
    assert m["n_train_ttvi"] == 12
    for reading in tc.READINGS:
        for key in tc.FAIR_FEATURES:
            assert 0.0 <= m[f"fair_{reading}_{key}_acc"] <= 1.0, (reading, key)
            assert 0.0 <= m[f"{reading}_{key}_acc"] <= 1.0, (reading, key)
    table = (tmp_path / "fair.md").read_text()
    assert table.count("**fair**") == len(tc.READINGS) - 1 and "posterior presences" in table
    assert tc.fair_table(tmp_path, "fair") is not None
    # without the test-time VI of the parts, its rows are left out; over two seeds, each accuracy is their mean
    rc = tc.main(["--checkpoint", str(tiny_run), "--n-test", "8", "--n-train-ttvi", "12", "--steps", "1",
                  "--no-parts-ttvi", "--name", "noparts", "--results-dir", str(tmp_path), "--quiet",
                  "--seeds", "0", "1"])
    m = json.loads((tmp_path / "noparts.json").read_text())["metrics"]
    assert rc == 0 and "fair_ttvi_parts_presence_acc" not in m and "fair_ttvi_reencoded_presence_acc" in m
    assert [r["seed"] for r in m["per_seed"]] == [0, 1]
    key = "fair_ttvi_objects_presence_pose_acc"
    assert m[f"{key}_mean"] == pytest.approx(sum(r[key] for r in m["per_seed"]) / 2)
    assert tc.fair_table(tmp_path, "noparts").count("**fair**") == len(tc.READINGS) - 2
    assert "±" in tc.fair_table(tmp_path, "noparts") and "seeds 0, 1" in tc.fair_table(tmp_path, "noparts")
    # without the fair protocol the run writes the encoder-fit table alone
    rc = tc.main(["--checkpoint", str(tiny_run), "--n-test", "8", "--n-train-ttvi", "0", "--steps", "2",
                  "--name", "plain", "--results-dir", str(tmp_path), "--quiet"])
    assert rc == 0 and tc.fair_table(tmp_path, "plain") is None
    assert "re-encoded" in (tmp_path / "plain.md").read_text()


def test_evaluate_adds_the_heldout_bound_for_normal_poses_and_says_why_not_for_point_masses(tiny_toml, tmp_path,
                                                                                           pyro_clean, seed):
    # catches: a bound reported for a delta guide (it bounds log p(x, poses), not log p(x)); a bound that is not
    # log_likelihood_bound's on the first eval.likelihood_images test images; a K missing from the table
    from probcaps.inference.capsule_svi import (
        CapsuleSystem,
        load_experiment_config,
        load_images,
        load_trained,
        train_capsules,
    )
    from probcaps.inference.likelihood import log_likelihood_bound

    cfg = load_experiment_config(tiny_toml, ["train.steps=1"])
    settings = ["eval.likelihood_samples=[1, 3]", "eval.likelihood_images=5"]
    train_capsules(cfg, tmp_path / "delta", progress=False)
    delta = evaluate_checkpoint(tmp_path / "delta" / "final.pt", name="delta", results_dir=tmp_path, progress=False,
                                figures=False, overrides=settings)
    assert delta["heldout_bound"] is None and "heldout_bound_k1" not in delta
    assert "no held-out bound on log p(x) (point-mass poses" in (tmp_path / "delta.md").read_text()
    system = CapsuleSystem(cfg["model"], cfg["encoder"]).use_normal_poses()
    train_capsules(cfg, tmp_path / "normal", progress=False, system=system)
    m = evaluate_checkpoint(tmp_path / "normal" / "final.pt", name="normal", results_dir=tmp_path, progress=False,
                            figures=False, overrides=settings)
    bound = m["heldout_bound"]
    assert bound["n_images"] == 5 and set(bound["samples"]) == {"1", "3"}
    _, trained = load_trained(tmp_path / "normal" / "final.pt")
    images = load_images(cfg["data"], "test", None)[0][:5]
    for k in (1, 3):
        expected = log_likelihood_bound(trained.model, trained.guide, images, k)
        assert bound["samples"][str(k)]["mean"] == pytest.approx(float(expected.double().mean()), rel=1e-5)
        assert m[f"heldout_bound_k{k}"] == bound["samples"][str(k)]["mean"]
    assert bound["samples"]["1"]["gain"]["mean"] == 0.0
    table = (tmp_path / "normal.md").read_text()
    assert "held-out bound on log p(x)" in table and "over the first 5 test images: K = 1: " in table
    assert "K = 3: " in table
