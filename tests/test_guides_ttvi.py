"""The Normal-pose guide and free-form test-time VI (Smith et al. 2020, §2.3-2.4), on tiny models.

Each test says in a comment which bug it would catch.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import pytest
import torch
from conftest import TINY_ENCODER as ENC
from conftest import K, M, S, T
from pyro import poutine
from pyro.infer import TraceEnum_ELBO

from probcaps.data import synthetic_digits, to_float
from probcaps.geometry import restrict_pose6
from probcaps.inference.guides import CapsuleEncoder, DeltaGuide, EncoderConfig, NormalPoseGuide, from_delta
from probcaps.inference.ttvi import FreeFormGuide, _concrete_sample, per_image_elbo, run_ttvi, ttvi_batches
from probcaps.models.capsule_model import CapsuleModel, CapsuleModelConfig

pytestmark = pytest.mark.usefixtures("pyro_clean", "seed", "one_thread")


def _system(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S, seed=seed)
    model = CapsuleModel(cfg).to(dtype)
    guide = DeltaGuide(CapsuleEncoder(M, K, EncoderConfig(**ENC)).to(dtype), cfg.temperature)
    return model, guide


def _images(n=4, dtype=torch.float32, seed=0):
    digits, _ = synthetic_digits(n, size=S, seed=seed)
    return digits, to_float(digits).unsqueeze(1).to(dtype)


def _snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same(before: dict, module):
    after = module.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


# --------------------------------------------------------------------------------------------- NormalPoseGuide

@pytest.mark.parametrize("copy_encoder", [False, True])
def test_from_delta_keeps_the_encoder_and_gives_a_finite_elbo(copy_encoder):
    # catches: from_delta re-initialising (or not sharing / not copying) the delta-trained encoder, the scale
    # parameters leaking into the encoder's state_dict (delta checkpoints would no longer load), scales that start
    # elsewhere than init_scale, and a Normal-pose loss that is non-finite or gives the scales no gradient
    model, delta = _system()
    enc_before = _snapshot(delta.encoder)
    normal = from_delta(delta, init_scale=0.05, copy_encoder=copy_encoder)
    assert isinstance(normal, NormalPoseGuide) and normal.temperature == delta.temperature
    assert (normal.encoder is delta.encoder) == (not copy_encoder)
    _assert_same(enc_before, normal.encoder)
    assert set(normal.state_dict()) == {f"encoder.{k}" for k in enc_before} | {"pose_scale_raw_parts",
                                                                               "pose_scale_raw_parents"}
    assert torch.allclose(normal.pose_scales("y0"), torch.full((M, 6), 0.05))
    assert torch.allclose(normal.pose_scales("y1"), torch.full((K, 6), 0.05))
    _, x = _images()
    loss = TraceEnum_ELBO(max_plate_nesting=2).differentiable_loss(model, normal, x)
    assert torch.isfinite(loss)
    loss.backward()
    for p in (normal.pose_scale_raw_parts, normal.pose_scale_raw_parents):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    _assert_same(enc_before, delta.encoder)  # building the guide and one backward pass change nothing


def test_normal_pose_guide_samples_have_the_guides_shapes_and_scales():
    # catches: scales broadcast over the wrong dims (e.g. (M, 6) against (B, K, 6)), or y0/y1 scales swapped
    _, delta = _system()
    normal = NormalPoseGuide(delta.encoder, delta.temperature, init_scale=0.3)
    with torch.no_grad():
        normal.pose_scale_raw_parents.fill_(5.0)  # parents' scales ~5, parts' 0.3
    _, x = _images(3)
    tr = poutine.trace(normal).get_trace(x)
    assert tr.nodes["y0"]["value"].shape == (3, M, 6) and tr.nodes["y1"]["value"].shape == (3, K, 6)
    assert torch.allclose(tr.nodes["y0"]["fn"].base_dist.scale, torch.full((3, M, 6), 0.3))
    assert torch.allclose(tr.nodes["y1"]["fn"].base_dist.scale, torch.full((3, K, 6), normal.min_scale + 5.0067),
                          atol=1e-3)


def test_tiny_scales_give_the_delta_loss_plus_the_pose_log_density():
    # catches: a Normal-pose guide that is not the delta guide plus pose noise (a different sampling order, other
    # locations or presences), the scales not reaching the ELBO, or the entropy term missing / counted twice.
    # With scales 1e-4 the poses are loc + 1e-4 ε, so
    #   loss_normal = loss_delta + log q(y0, y1) + O(1e-4 · ∂ log p / ∂y);
    # the presences are shared by replaying the Normal guide's z0, z1 into the delta guide (the Normal guide draws
    # pose noise between them, so a shared seed alone would give different z1).
    model, delta = _system(dtype=torch.float64)
    normal = from_delta(delta, init_scale=1e-4, min_scale=0.0)
    _, x = _images(dtype=torch.float64)
    elbo = TraceEnum_ELBO(max_plate_nesting=2)
    tr = poutine.trace(normal).get_trace(x)
    loss_normal = elbo.differentiable_loss(model, poutine.replay(normal, trace=tr), x)
    log_q_poses = sum(tr.nodes[n]["fn"].log_prob(tr.nodes[n]["value"]).sum() for n in ("y0", "y1"))
    presences_only = tr.copy()
    presences_only.remove_node("y0")
    presences_only.remove_node("y1")
    dtr = poutine.trace(poutine.replay(delta, trace=presences_only)).get_trace(x)
    assert torch.equal(dtr.nodes["z0"]["value"], tr.nodes["z0"]["value"])
    assert torch.equal(dtr.nodes["z1"]["value"], tr.nodes["z1"]["value"])
    loss_delta = elbo.differentiable_loss(model, poutine.replay(delta, trace=presences_only), x)
    # the entropy part is large (≈ 7.8 nats per pose dimension) and must be accounted for exactly
    assert log_q_poses.item() > 0.9 * x.shape[0] * (M + K) * 6 * (-math.log(1e-4) - 0.5 * math.log(2 * math.pi)) - 50
    assert abs((loss_normal - log_q_poses - loss_delta).item()) < 1e-3 * abs(loss_delta.item()) + 0.5, (
        loss_normal.item(), log_q_poses.item(), loss_delta.item())
    # and with the same seed, the Normal guide's first draw (z0) is the delta guide's
    torch.manual_seed(1)
    z0_delta = poutine.trace(delta).get_trace(x).nodes["z0"]["value"]
    torch.manual_seed(1)
    z0_normal = poutine.trace(normal).get_trace(x).nodes["z0"]["value"]
    assert torch.equal(z0_delta, z0_normal)


def test_normal_pose_guide_rejects_a_scale_below_its_floor():
    # catches: a softplus inverse of a negative number silently giving NaN parameters
    _, delta = _system()
    with pytest.raises(ValueError, match="init_scale"):
        from_delta(delta, init_scale=1e-4, min_scale=1e-3)


# --------------------------------------------------------------------------------------------- test-time VI

@pytest.mark.parametrize("pose_family", ["delta", "normal"])
def test_ttvi_never_changes_the_model_or_the_guide_and_restores_requires_grad(pose_family, monkeypatch):
    # catches: the generative parameters (or the encoder) being optimised, their gradients accumulated, or their
    # requires_grad flags left off (or switched on) after the run, also when the run fails
    model, guide = _system()
    model.offsets.requires_grad_(False)  # a mixed state must come back exactly as it was
    flags = {n: p.requires_grad for n, p in list(model.named_parameters()) + list(guide.named_parameters())}
    model_before, guide_before = _snapshot(model), _snapshot(guide)
    _, x = _images(3)
    run_ttvi(model, guide, x, steps=5, lr=0.1, progress=False, pose_family=pose_family)
    _assert_same(model_before, model)
    _assert_same(guide_before, guide)
    assert {n: p.requires_grad for n, p in list(model.named_parameters()) + list(guide.named_parameters())} == flags
    assert all(p.grad is None for p in model.parameters())
    import probcaps.inference.ttvi as ttvi

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(ttvi, "per_image_elbo", broken)  # a failure inside the run restores them too
    with pytest.raises(RuntimeError, match="boom"):
        run_ttvi(model, guide, x, steps=2, progress=False, pose_family=pose_family)
    assert {n: p.requires_grad for n, p in list(model.named_parameters()) + list(guide.named_parameters())} == flags


def test_ttvi_raises_the_elbo_of_each_image():
    # catches: a sign error (TTVI descending the ELBO), variational parameters that are not optimised (not leaves,
    # detached, or missing from the optimiser), or an ELBO estimate that does not follow them
    model, guide = _system()
    _, x = _images(4)
    result = run_ttvi(model, guide, x, steps=60, lr=0.05, progress=False, seed=0)
    assert len(result.elbo_trace) == 60 and all(math.isfinite(v) for v in result.elbo_trace)
    assert result.elbo_end.mean() > result.elbo_start.mean() + 10
    assert (result.elbo_end > result.elbo_start).all(), (result.elbo_start, result.elbo_end)
    assert sum(result.elbo_trace[-5:]) / 5 > sum(result.elbo_trace[:5]) / 5
    # the starting point is the encoder's output
    init = guide.encoder.encode(x)
    ff = FreeFormGuide(init, guide.temperature)
    assert torch.allclose(result.elbo_start, per_image_elbo(model, ff, x))
    assert not torch.allclose(result.latents.part_poses, init.part_poses)


def test_ttvi_normal_poses_raise_the_elbo_and_start_from_a_normal_guides_scales():
    # catches: Normal-pose TTVI ignoring the NormalPoseGuide's learned scales, or its scales not being optimised
    model, delta = _system()
    normal = from_delta(delta, init_scale=0.05)
    with torch.no_grad():
        normal.pose_scale_raw_parts[0, 0] = 1.0
    _, x = _images(3)
    result = run_ttvi(model, normal, x, steps=0, progress=False, pose_family="normal")
    assert torch.allclose(result.part_pose_scales, normal.pose_scales("y0").expand(3, M, 6).detach())
    assert torch.allclose(result.parent_pose_scales, torch.full((3, K, 6), 0.05))
    assert torch.equal(result.elbo_start, result.elbo_end) and result.elbo_trace == []
    result = run_ttvi(model, normal, x, steps=40, lr=0.05, progress=False, pose_family="normal", seed=0)
    assert result.elbo_end.mean() > result.elbo_start.mean()
    assert not torch.allclose(result.part_pose_scales, normal.pose_scales("y0").expand(3, M, 6).detach())
    assert (result.part_pose_scales > normal.min_scale).all()


def test_ttvi_normal_poses_keep_the_object_poses_inside_the_models_group():
    # catches: free-form object poses leaving the similarity group through the coordinates the model ignores (the
    # Normal poses' noise moves them; MAP poses keep them by symmetry), so that the readouts of test-time VI carry
    # shear the model never used
    torch.manual_seed(0)
    cfg = CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S, object_pose="similarity")
    model = CapsuleModel(cfg)
    guide = DeltaGuide(CapsuleEncoder(M, K, EncoderConfig(**ENC), object_pose="similarity"), cfg.temperature)
    _, x = _images(3)
    r = run_ttvi(model, guide, x, steps=10, lr=0.1, progress=False, pose_family="normal", init_scale=0.3, seed=0)
    poses = r.latents.parent_poses
    assert not torch.allclose(poses, guide.encoder.encode(x).parent_poses)  # the poses did move
    assert torch.allclose(restrict_pose6(poses, "similarity"), poses, atol=1e-6)


def test_object_codes_ride_with_the_object_poses_through_the_guides_and_ttvi():
    # catches: codes cut off or projected by the object-pose group, scales of the Normal guides that leave the codes
    # out (a shape error) or the codes kept frozen by test-time VI
    torch.manual_seed(0)
    cfg = CapsuleModelConfig(num_parents=K, num_parts=M, template_size=T, canvas_size=S, object_pose="similarity",
                             object_code_dims=3)
    model = CapsuleModel(cfg)
    delta = DeltaGuide(CapsuleEncoder(M, K, EncoderConfig(**ENC), object_pose="similarity", object_code_dims=3),
                       cfg.temperature)
    _, x = _images(3)
    encoded = delta.encoder.encode(x).parent_poses
    assert encoded.shape == (3, K, 9) and encoded[..., 6:].abs().sum() > 0
    normal = from_delta(delta, init_scale=0.05)
    assert normal.pose_scales("y1").shape == (K, 9)
    tr = poutine.trace(normal).get_trace(x)
    assert tr.nodes["y1"]["value"].shape == (3, K, 9)
    assert torch.isfinite(TraceEnum_ELBO(max_plate_nesting=2).differentiable_loss(model, normal, x))
    r = run_ttvi(model, normal, x, steps=10, lr=0.1, progress=False, pose_family="normal", seed=0)
    assert r.parent_pose_scales.shape == (3, K, 9) and r.elbo_end.mean() > r.elbo_start.mean()
    poses = r.latents.parent_poses
    assert not torch.allclose(poses[..., 6:], encoded[..., 6:])            # the codes moved
    assert torch.allclose(restrict_pose6(poses, "similarity"), poses, atol=1e-6)


@pytest.mark.parametrize("pose_family", ["delta", "normal"])
def test_ttvi_result_shapes(pose_family):
    # catches: per-image parameters that are shared across the batch, or results of the wrong shape / device
    model, guide = _system()
    _, x = _images(3)
    r = run_ttvi(model, guide, x[:, 0], steps=3, progress=False, pose_family=pose_family)  # (B, H, W) accepted
    assert r.latents.part_logits.shape == (3, M) and r.latents.part_poses.shape == (3, M, 6)
    assert r.latents.parent_logits.shape == (3, K) and r.latents.parent_poses.shape == (3, K, 6)
    assert r.elbo_start.shape == r.elbo_end.shape == (3,) and len(r.elbo_trace) == 3 and len(r) == 3
    assert all(not t.requires_grad for t in r.latents)
    if pose_family == "normal":
        assert r.part_pose_scales.shape == (3, M, 6) and r.parent_pose_scales.shape == (3, K, 6)
    else:
        assert r.part_pose_scales is None and r.parent_pose_scales is None
    with pytest.raises(ValueError, match="pose_family"):
        run_ttvi(model, guide, x, steps=1, progress=False, pose_family="laplace")


def test_ttvi_batches_concatenates_the_chunks_runs():
    # catches: chunks processed out of order or dropped (a last partial chunk), images not scaled from uint8, or a
    # trace that is not the size-weighted mean of the chunks' traces
    model, guide = _system()
    digits, x = _images(5)
    whole = ttvi_batches(model, guide, digits, batch_size=2, steps=3, progress=False, seed=7)
    assert whole.latents.parent_poses.shape == (5, K, 6) and whole.elbo_end.shape == (5,)
    chunks = [run_ttvi(model, guide, x[i:i + 2], steps=3, progress=False, seed=7 + j)
              for j, i in enumerate(range(0, 5, 2))]
    for field in range(4):
        assert torch.allclose(whole.latents[field], torch.cat([c.latents[field] for c in chunks]))
    assert torch.allclose(whole.elbo_end, torch.cat([c.elbo_end for c in chunks]))
    expected = [(2 * a + 2 * b + c) / 5 for a, b, c in zip(*(c.elbo_trace for c in chunks))]
    assert whole.elbo_trace == pytest.approx(expected)


def test_ttvi_with_a_seed_leaves_the_callers_rng_alone_and_repeats():
    # catches: a seeded run that is not reproducible, or that resets the caller's global RNG stream
    model, guide = _system()
    _, x = _images(2)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = run_ttvi(model, guide, x, steps=4, progress=False, seed=5)
    assert torch.equal(torch.rand(3), expected_next)
    b = run_ttvi(model, guide, x, steps=4, progress=False, seed=5)
    assert a.elbo_trace == b.elbo_trace and torch.equal(a.latents.part_poses, b.latents.part_poses)


def test_fixed_noise_concrete_samples_follow_the_relaxed_bernoulli():
    # catches: the per-image ELBO estimate drawing presences from another distribution than the guide's (e.g. the
    # logistic noise with the wrong sign, or the temperature applied twice)
    logits = torch.tensor([-2.0, 0.0, 1.5]).expand(20000, 3)
    gen = torch.Generator().manual_seed(0)
    ours = _concrete_sample(logits, 0.5, gen)
    ref = dist.RelaxedBernoulli(torch.tensor(0.5), logits=logits).sample()
    assert torch.allclose(ours.mean(0), ref.mean(0), atol=0.02)
    assert torch.allclose((ours < 0.2).float().mean(0), (ref < 0.2).float().mean(0), atol=0.02)
