"""The importance-sampled bound on log p(x) (inference/likelihood.py), on tiny models.

Each test says in a comment which bug it would catch.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TINY_ENCODER as ENC
from conftest import K, M, S, T
from pyro.infer import TraceEnum_ELBO

from probcaps.data import synthetic_digits, to_float
from probcaps.distributions import bound_logits
from probcaps.inference.guides import CapsuleEncoder, DeltaGuide, EncoderConfig, Latents, NormalPoseGuide
from probcaps.inference.likelihood import bound_summary, guide_trace, log_likelihood_bound, log_weights
from probcaps.inference.objectives import _repeated
from probcaps.inference.ttvi import FreeFormGuide
from probcaps.models.capsule_model import CapsuleModel, CapsuleModelConfig

pytestmark = pytest.mark.usefixtures("pyro_clean", "seed", "one_thread")


def _system(temperature=0.5, seed=0):
    torch.manual_seed(seed)
    cfg = CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S, temperature=temperature,
                             seed=seed)
    model = CapsuleModel(cfg)
    guide = NormalPoseGuide(CapsuleEncoder(M, K, EncoderConfig(**ENC)), cfg.temperature, init_scale=0.05)
    return model, guide


def _images(n=4, seed=0):
    digits, _ = synthetic_digits(n, size=S, seed=seed)
    return digits, to_float(digits).unsqueeze(1)


def _free_form(model, n, part_logit=0.0, parent_logit=0.0, scale=0.05, seed=0):
    """A Normal-pose free-form guide of ``n`` images at fixed, slightly wrong latents (a gap to the posterior)."""
    g = torch.Generator().manual_seed(seed)
    latents = Latents(torch.full((n, M), part_logit), 0.3 * torch.randn(n, M, 6, generator=g) + torch.tensor(
        [1.0, 0, 0, 0, 1.0, 0]), torch.full((n, K), parent_logit), 0.3 * torch.randn(n, K, 6, generator=g))
    return FreeFormGuide(latents, model.config.temperature, "normal", torch.full((M, 6), scale),
                         torch.full((K, 6), scale))


def test_one_sample_bound_is_the_enumerated_elbo():
    # catches log_weights scoring another density than the one Pyro's enumerated ELBO scores (a missed site, s not
    # summed out, a wrong sign of log q), or drawing the guide's samples in another order
    model, guide = _system()
    _, x = _images()
    torch.manual_seed(3)
    elbo = -TraceEnum_ELBO(max_plate_nesting=2).loss(model, guide, x)
    torch.manual_seed(3)
    w = log_weights(model, guide, x, 1, presence_density="clamped")
    assert w.shape == (1, 4)
    assert w.sum().item() == pytest.approx(elbo, rel=1e-5, abs=1e-3)
    # and the public function at K = 1 is that one sample
    bound = log_likelihood_bound(model, guide, x, 1, presence_density="clamped", seed=3)
    torch.testing.assert_close(bound, w[0], rtol=1e-5, atol=1e-3)


def test_logit_and_clamped_densities_agree_unless_a_sample_is_clamped():
    # catches the logits' densities missing a term: on unclamped samples the sigmoid's Jacobian cancels between p and
    # q, so the two conventions must agree there; at τ = 0.5 with confident presences many samples sit at the clamp,
    # where the densities at the clamp differ from those of the logits
    model, _ = _system(temperature=3.0)
    _, x = _images()
    guide = _free_form(model, 4)
    torch.manual_seed(0)
    logit = log_weights(model, guide, x, 8, presence_density="logit")
    torch.manual_seed(0)
    clamped = log_weights(model, guide, x, 8, presence_density="clamped")
    torch.testing.assert_close(logit, clamped, rtol=1e-5, atol=1e-3)
    model, _ = _system(temperature=0.5)
    guide = _free_form(model, 4, part_logit=5.0, parent_logit=5.0)
    torch.manual_seed(0)
    logit = log_weights(model, guide, x, 8, presence_density="logit")
    torch.manual_seed(0)
    clamped = log_weights(model, guide, x, 8, presence_density="clamped")
    assert (logit - clamped).abs().max() > 1.0


def test_bound_grows_with_the_number_of_samples():
    # catches an average taken in the wrong place (a mean of log-weights instead of a log of mean weights, or a
    # logsumexp over the images): E[L_1] < E[L_8] < E[L_64] when q is not the posterior
    model, _ = _system()
    _, x = _images(4)
    guide = _free_form(model, 4, part_logit=1.0, parent_logit=-1.0, scale=0.1)
    means = {}
    for k in (1, 8, 64):
        runs = torch.stack([log_likelihood_bound(model, guide, x, k, seed=s) for s in range(24)])  # (runs, images)
        means[k] = (runs.mean(0), runs.std(0) / math.sqrt(len(runs)))
    for lo, hi in ((1, 8), (8, 64)):
        gain = means[hi][0] - means[lo][0]
        err = (means[hi][1] ** 2 + means[lo][1] ** 2).sqrt()
        assert (gain > 3 * err).all(), (lo, hi, gain, err)


def _one_part_model():
    cfg = CapsuleModelConfig(num_parents=1, num_parts=1, template_size=5, canvas_size=10, expected_parents=0.5,
                             pixel_std=0.2, seed=0)
    return CapsuleModel(cfg)


@torch.no_grad()
def _integrated_log_likelihood(model, x, y1, y0, half_width=30.0, step=0.15):
    """log ∫∫ p(x, l1, y1, l0, y0) dl1 dl0 by a Riemann sum over the presences' logits (the poses fixed)."""
    grid = torch.arange(-half_width, half_width + step / 2, step)
    l1, l0 = (t.reshape(-1, 1) for t in torch.meshgrid(grid, grid, indexing="ij"))
    eps = 1e-4
    z1, z0 = torch.sigmoid(l1).clamp(eps, 1 - eps), torch.sigmoid(l0).clamp(eps, 1 - eps)
    n = len(l1)
    lj = torch.cat([model.log_joint(x.expand(len(c), -1, -1, -1), z1[c], y1.expand(len(c), -1, -1), z0[c],
                                    y0.expand(len(c), -1, -1), presence_logits=(l1[c], l0[c]))
                    for c in torch.arange(n).split(20000)])
    return (torch.logsumexp(lj, 0) + 2 * math.log(step)).item()


def test_bound_approaches_the_numerically_integrated_likelihood():
    # one object, one part, the poses fixed (a point-mass guide): the bound is then on log p(x, poses) with both
    # presences integrated out, which a grid over their logits computes.  Catches a bound that is not one (the
    # clamped densities of the training ELBO converge to another number: checked below) or a missing density
    model = _one_part_model()
    y1 = torch.tensor([[[1.0, 0, 0.1, 0, 1.0, -0.1]]])
    y0 = model.predicted_part_poses(y1)[:, 0]                                    # (1, 1, 6): where the object puts it
    with torch.no_grad():
        clean, _ = model.render(torch.ones(1, 1), y0)
    x = (clean + 0.2 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    exact = _integrated_log_likelihood(model, x, y1, y0)
    guide = FreeFormGuide(Latents(torch.tensor([[5.0]]), y0, torch.tensor([[1.0]]), y1), model.config.temperature)
    runs = torch.stack([log_likelihood_bound(model, guide, x, 2000, allow_point_poses=True, seed=s)[0]
                        for s in range(8)])
    mean, err = runs.mean().item(), runs.std().item() / math.sqrt(len(runs))
    assert abs(mean - exact) < 3 * err + 0.01, (mean, exact, err)
    # the training ELBO's densities at the clamp (60% of the part's samples sit there) overshoot log p(x, poses):
    # not a bound
    clamped = torch.stack([log_likelihood_bound(model, guide, x, 2000, allow_point_poses=True, seed=s,
                                                presence_density="clamped")[0] for s in range(8)])
    assert clamped.mean().item() - exact > 5 * (err + clamped.std().item() / math.sqrt(8))


def test_point_mass_poses_are_refused_without_asking():
    # catches a delta-pose guide silently reported as a bound on log p(x) (it bounds the joint density of x and the
    # poses instead)
    model, _ = _system()
    _, x = _images(2)
    delta = DeltaGuide(CapsuleEncoder(M, K, EncoderConfig(**ENC)), model.config.temperature)
    with pytest.raises(ValueError, match="point-mass poses"):
        log_likelihood_bound(model, delta, x, 2)
    assert torch.isfinite(log_likelihood_bound(model, delta, x, 2, allow_point_poses=True)).all()
    with pytest.raises(ValueError, match="presence_density"):
        log_likelihood_bound(model, _system()[1], x, 2, presence_density="exact")


def test_free_form_guide_is_repeated_image_by_image():
    # catches the K copies of a per-image guide being stacked in another order than the images' copies (sample k of
    # image b scored against another image's parameters)
    model, _ = _system()
    _, x = _images(3)
    guide = _free_form(model, 3, seed=1)
    guide.part_logits.data = torch.arange(9.0).reshape(3, 3) / 3
    trace = guide_trace(_repeated(guide, 4), x.repeat(4, 1, 1, 1))
    expected = bound_logits(guide.part_logits.detach()).repeat(4, 1)
    torch.testing.assert_close(trace.nodes["z0_logit"]["fn"].logits, expected)
    bounds = log_likelihood_bound(model, guide, x, 5, max_copies=4)  # chunks of one sample
    assert bounds.shape == (3,) and torch.isfinite(bounds).all()


def test_uint8_images_and_batches_give_the_same_bounds_as_floats():
    # catches the images' scaling or the batching of the amortised guide changing the result
    model, guide = _system()
    digits, x = _images(4)
    a = log_likelihood_bound(model, guide, digits, 3, batch_size=4, seed=0)
    b = log_likelihood_bound(model, guide, x, 3, batch_size=4, seed=0)
    torch.testing.assert_close(a, b)
    summary = bound_summary(a)
    assert summary["n"] == 4 and summary["mean"] == pytest.approx(a.double().mean().item())
    assert summary["stderr"] == pytest.approx(a.double().std().item() / 2)


def test_the_command_writes_the_bounds_of_a_normal_pose_checkpoint(tiny_toml, tmp_path, capsys):
    # catches the command writing numbers it did not measure (every K and density in the JSON, gains paired image
    # by image) and a delta-pose checkpoint reported as if it had a bound on log p(x)
    import json

    from probcaps.experiments import heldout_likelihood as likelihood
    from probcaps.inference.capsule_svi import CapsuleSystem, load_experiment_config, train_capsules

    cfg = load_experiment_config(tiny_toml, ["train.steps=1"])
    train_capsules(cfg, tmp_path / "delta", progress=False)
    assert likelihood.main(["--checkpoint", str(tmp_path / "delta" / "final.pt"), "--results-dir",
                            str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("heldout_likelihood: error:") and "point-mass poses" in err and "\n" not in err
    system = CapsuleSystem(cfg["model"], cfg["encoder"]).use_normal_poses()
    train_capsules(cfg, tmp_path / "normal", progress=False, system=system)
    assert likelihood.main(["--checkpoint", str(tmp_path / "normal" / "final.pt"), "--samples", "1", "3",
                            "--limit", "4", "--ttvi-steps", "2", "--results-dir", str(tmp_path / "res"),
                            "--name", "tiny", "--quiet"]) == 0
    m = json.loads((tmp_path / "res" / "tiny.json").read_text())["metrics"]
    assert set(m["bounds"]) == {"encoder", "ttvi"} and m["n_images"] == 4
    for by_density in m["bounds"].values():
        assert set(by_density) == {"logit", "clamped"}
        for by_k in by_density.values():
            assert set(by_k) == {"1", "3"} and by_k["1"]["gain"]["mean"] == 0.0
            assert math.isfinite(by_k["3"]["mean"]) and by_k["3"]["n"] == 4
    assert (tmp_path / "res" / "tiny.md").read_text().startswith("| guide |")


def test_inferences_compared_on_one_model_train_resume_and_tabulate(tiny_toml, tmp_path, capsys, pyro_clean):
    # catches: an objective's row trained under another objective or presence family, the K-sample objectives drawing
    # more samples a step than the ELBO, a --resume that trains or reads out again, a row missing from the table
    from probcaps.checkpoints import load_checkpoint
    from probcaps.experiments import heldout_likelihood as likelihood
    from probcaps.inference.capsule_svi import load_experiment_config, stored_config, train_capsules

    cfg = load_experiment_config(tiny_toml, ["train.steps=1", "train.batch_size=8"])
    train_capsules(cfg, tmp_path / "delta", progress=False)
    argv = ["--objectives", "elbo", "iwae", "score_function", "--start", str(tmp_path / "delta" / "final.pt"),
            "--steps", "2", "--particles", "2", "--samples", "1", "3", "--limit", "4", "--probe-train-limit", "40",
            "--out", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res"), "--quiet"]
    assert likelihood.main(argv) == 0
    for objective, (presences, loss, _) in likelihood.INFERENCES.items():
        trained = stored_config(load_checkpoint(tmp_path / "runs" / f"{objective}_seed0" / "final.pt"), "x")
        k = 1 if loss == "elbo" else 2
        assert (trained["model"].presences, trained["train"].objective, trained["train"].particles,
                trained["train"].batch_size) == (presences, loss, k, 8 // k), objective
    m = json.loads((tmp_path / "res" / "inferences.json").read_text())["metrics"]
    assert set(m["inferences"]) == {"start", *likelihood.INFERENCES}
    assert m["inferences"]["start"][0]["heldout_bound"] is None  # point-mass poses
    for objective in likelihood.INFERENCES:
        bound = m["inferences"][objective][0]["heldout_bound"]
        assert bound["n_images"] == 4 and math.isfinite(bound["samples"]["3"]["mean"])
    table = (tmp_path / "res" / "inferences.md").read_text()
    assert all(f"| {label} | 0 |" in table for label in m["labels"].values())
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("*.pt")}
    capsys.readouterr()
    assert likelihood.main(argv + ["--resume"]) == 0  # nothing trained or read out again, the same numbers
    assert stamps == {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("*.pt")}
    assert json.loads((tmp_path / "res" / "inferences.json").read_text())["metrics"] == m
