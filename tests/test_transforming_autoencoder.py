"""Transforming auto-encoder: batched recognition, the shared rendering path, equivariance of the decoder,
reading the transformation back from poses, the pair generator, configs, and the entry point on tiny data."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

import probcaps.render  # noqa: E402
from probcaps.checkpoints import run_finished  # noqa: E402
from probcaps.errors import ConfigError  # noqa: E402
from probcaps.geometry import affine_matrix, compose, invert, rotation_matrix, translation_matrix  # noqa: E402
from probcaps.models import transforming_autoencoder as tae_module  # noqa: E402
from probcaps.models.transforming_autoencoder import (  # noqa: E402
    TransformingAutoencoder,
    TransformingAutoencoderConfig,
    estimate_transform,
    pose_consistency,
    transform_components,
)
from probcaps.render import render_templates, warp  # noqa: E402


def _model(mode="translation", canvas=16, M=3, hidden=4, t=5, combine="sum") -> TransformingAutoencoder:
    return TransformingAutoencoder(TransformingAutoencoderConfig(mode=mode, canvas_size=canvas, num_capsules=M,
                                                                 recognition_hidden=hidden, template_size=t,
                                                                 combine=combine))


def _set_templates(model: TransformingAutoencoder, templates: torch.Tensor) -> None:
    """Make ``model.templates()`` return ``templates`` (values in (0, 1))."""
    with torch.no_grad():
        model.template_logits.copy_(torch.logit(templates.clamp(1e-6, 1 - 1e-6)))


def _gaussian(t: int, sigma: float) -> torch.Tensor:
    r = torch.arange(t, dtype=torch.float32) - (t - 1) / 2
    return torch.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * sigma ** 2))


# ------------------------------------------------------------------------------------------ recognition


def test_batched_recognition_equals_each_capsule_on_its_own():
    # catches: capsules sharing or mixing weights in the batched matmul / einsum (a reshape in the wrong order)
    torch.manual_seed(0)
    for mode in ("translation", "affine"):
        model = _model(mode, canvas=6, M=3, hidden=4)
        x = torch.rand(2, 1, 6, 6)
        presence, poses = model.recognise(x)
        flat = x.reshape(2, -1)
        for m in range(3):  # the reference loops over capsules on purpose
            cols = slice(4 * m, 4 * (m + 1))
            hidden = torch.sigmoid(flat @ model.hidden_weight[:, cols] + model.hidden_bias[cols])
            out = hidden @ model.output_weight[m] + model.output_bias[m]
            assert torch.allclose(presence[:, m], torch.sigmoid(out[:, 0]), atol=1e-6)
            assert torch.allclose(poses[:, m], model.pose_matrix(out[:, 1:]), atol=1e-6)


def _conv_model(mode="affine", canvas=16, M=3, t=5, **kwargs) -> TransformingAutoencoder:
    return TransformingAutoencoder(TransformingAutoencoderConfig(mode=mode, canvas_size=canvas, num_capsules=M,
                                                                 template_size=t, recognition="conv",
                                                                 conv_channels=[4, 8], conv_strides=[2, 2],
                                                                 presence_bias_init=-1.5, **kwargs))


def test_conv_recognition_heads_are_per_capsule_and_translation_mode_keeps_only_xy():
    # catches: capsules sharing head weights (the 1x1 head's output channels grouped in the wrong order)
    torch.manual_seed(0)
    model = _conv_model("affine", M=3)
    x = torch.rand(2, 1, 16, 16)
    presence, poses = model.recognise(x)
    assert presence.shape == (2, 3) and poses.shape == (2, 3, 3, 3)
    assert torch.allclose(poses[..., 2, :], torch.tensor([0.0, 0.0, 1.0]).expand(2, 3, 3))
    head = model.encoder.head
    with torch.no_grad():  # change capsule 1's head only: capsules 0 and 2 must not notice
        head.weight.view(3, -1, *head.weight.shape[1:])[1].add_(1.0)
        head.bias.view(3, -1)[1].add_(1.0)
    presence2, poses2 = model.recognise(x)
    for m, same in ((0, True), (1, False), (2, True)):
        assert torch.allclose(presence2[:, m], presence[:, m]) == same
        assert torch.allclose(poses2[:, m], poses[:, m]) == same
    fresh = _conv_model("affine", M=3)  # presence_bias_init sets the presence logits' bias
    assert torch.allclose(fresh.encoder.head.bias.view(3, -1)[:, 6], torch.full((3,), -1.5))
    translation = _conv_model("translation", M=3)
    _, P = translation.recognise(x)
    assert torch.allclose(P[..., :2, :2], torch.eye(2).expand(2, 3, 2, 2))


@pytest.mark.parametrize("gain", [0.0, 0.5])
def test_keypoint_offset_gain_scales_the_regressed_offset_around_the_attention_centre(gain):
    # catches: the gain applied to the whole keypoint (centre included) or to the wrong pose entries
    torch.manual_seed(0)
    x = torch.rand(2, 1, 16, 16)
    full = _conv_model("affine", M=2)
    scaled = _conv_model("affine", M=2, keypoint_offset_gain=gain)
    scaled.load_state_dict(full.state_dict())
    out = full.encoder(x)
    B, M, K = 2, 2, full.config.keypoints
    points = out.pose.view(B, M, K, 6)[..., [2, 5]]
    offset = full.config.max_translation * torch.tanh(out.pose_raw.view(B, M, K, 6)[..., 4:6])
    expected = full.pose_from_points(points - offset + gain * offset)
    _, P = scaled.recognise(x)
    assert torch.allclose(P, expected, atol=1e-6)
    _, P_full = full.recognise(x)
    assert not torch.allclose(P, P_full, atol=1e-3)  # the offsets are not negligible at initialisation
    if gain == 0.0:  # then the offsets' head rows do not matter at all
        with torch.no_grad():
            scaled.encoder.head.bias.view(M, K, -1)[..., 4:6].add_(0.7)
        assert torch.allclose(scaled.recognise(x)[1], P, atol=1e-5)


def test_keypoint_spread_is_that_of_the_most_present_capsule_and_of_its_attention_centres():
    # catches: the spread taken over the wrong capsule, or over offsets instead of where the keypoints look
    torch.manual_seed(0)
    x = torch.rand(4, 1, 16, 16)
    model = _conv_model("affine", M=3)
    with torch.no_grad():  # capsule 2 the most present in every image
        model.encoder.head.bias.view(3, model.config.keypoints, -1)[2, :, 6] += 5.0
    points_spread, centre_spread = model.keypoint_spread(x)
    _, P = model.recognise(x)
    points = P[:, 2] @ torch.cat([model.canonical_points.T, torch.ones(1, 3)])  # the keypoints P u_k, (B, 3, 3)
    pts = points[:, :2].transpose(1, 2)                                          # (B, K, 2)
    by_hand = (pts - pts.mean(1, keepdim=True)).norm(dim=-1).mean(1)
    assert torch.allclose(points_spread, by_hand, atol=1e-5)
    assert (centre_spread < points_spread).all()  # at initialisation the triangle is the offsets'
    at_centres = _conv_model("affine", M=3, keypoint_offset_gain=0.0)
    at_centres.load_state_dict(model.state_dict())
    p0, c0 = at_centres.keypoint_spread(x)
    assert torch.allclose(p0, c0, atol=1e-6) and torch.allclose(c0, centre_spread, atol=1e-6)


def test_translation_pose_is_the_bounded_xy_and_affine_pose_starts_at_identity():
    model = _model("translation")
    P = model.pose_matrix(torch.tensor([[0.25, -0.5]]))  # max_translation · tanh(raw), max_translation = 1
    assert torch.allclose(P[0], torch.tensor([[1.0, 0, math.tanh(0.25)], [0, 1, math.tanh(-0.5)], [0, 0, 1]]))
    affine = _model("affine")  # min_scale + max_scale = 2: raw 0 is the identity
    assert torch.allclose(affine.pose_matrix(torch.zeros(1, 6))[0], torch.eye(3), atol=1e-6)


def test_templates_initialised_from_images_keep_them_at_their_pixel_size():
    # at scale 1 on a template of the images' own size the warp is the identity: template = 0.05 + 0.9 · image
    model = _model("affine", M=2, t=6)
    images = torch.rand(2, 1, 6, 6)
    model.init_templates_from(images)
    assert torch.allclose(model.templates(), 0.05 + 0.9 * images, atol=1e-5)
    with pytest.raises(ValueError, match="expected"):
        model.init_templates_from(torch.rand(3, 1, 6, 6))


def test_known_translation_adds_dx_dy_to_every_capsule_pose():
    # the paper's translation rule: (x, y) -> (x + dx, y + dy), the same shift for every capsule
    poses = translation_matrix(torch.tensor([[0.1, -0.2]]), torch.tensor([[0.3, 0.0]]))  # (1, 2, 3, 3)
    T = translation_matrix(torch.tensor([0.05]), torch.tensor([-0.1]))
    moved = TransformingAutoencoder.apply_transform(poses, T)
    assert torch.allclose(moved[0, :, 0, 2], torch.tensor([0.15, -0.15]))
    assert torch.allclose(moved[0, :, 1, 2], torch.tensor([0.2, -0.1]))
    assert torch.allclose(moved[..., :2, :2], torch.eye(2).expand(1, 2, 2, 2))


# ------------------------------------------------------------------------------------------ rendering


def test_rendering_goes_through_the_shared_warp(monkeypatch):
    # catches: a second warp implementation sneaking into the model (one rendering path for every model)
    calls = []
    real_warp = probcaps.render.warp

    def spy(images, P, out_size):
        calls.append((tuple(images.shape), tuple(P.shape), out_size))
        return real_warp(images, P, out_size)

    monkeypatch.setattr(probcaps.render, "warp", spy)
    torch.manual_seed(0)
    model = _model("affine", canvas=12, M=3, t=5)
    x, T = torch.rand(2, 1, 12, 12), rotation_matrix(torch.tensor([0.3, -0.2]))
    out, parts = model.reconstruct(x, T)
    assert calls == [((2 * 3, 1, 5, 5), (2 * 3, 3, 3), 12)]  # one call for every capsule of every image
    expected = render_templates(model.templates(), parts["transformed_pose"], 12)
    assert torch.allclose(out, (parts["presence"][..., None, None, None] * expected).sum(1), atol=1e-6)
    source = inspect.getsource(tae_module)
    assert "grid_sample" not in source and "affine_grid" not in source


def test_rendered_capsule_moves_by_whole_pixels_exactly():
    # hand-computed: translation by 2 px on a 16-pixel canvas is 2 * 2/16 = 0.25 normalised units, and moving a
    # rendered template by whole pixels is an exact shift of the image (no interpolation)
    model = _model("translation", canvas=16, M=1, t=5)
    _set_templates(model, torch.rand(1, 1, 5, 5) * 0.9 + 0.05)
    P = translation_matrix(torch.tensor([[-0.125]]), torch.tensor([[0.0]]))
    T = translation_matrix(torch.tensor([0.25]), torch.tensor([-0.125]))  # (+2 px right, 1 px up)
    p = torch.ones(1, 1)
    before, _ = model.render(p, P)
    after, _ = model.render(p, model.apply_transform(P, T))
    assert torch.allclose(after, torch.roll(before, shifts=(-1, 2), dims=(2, 3)), atol=1e-6)
    assert before.sum() > 1.0


@pytest.mark.parametrize("combine", ["sum", "mixture"])
def test_rendering_at_T_compose_P_is_the_image_transformed_by_T(combine):
    # the equivariance the whole method rests on: template at T∘P = (template at P) warped by T, for a rotation,
    # scaling and shear as well as a translation (bilinear sampling twice vs once: a small tolerance)
    # smooth templates (Gaussians a few pixels wide, ~0 at their borders): bilinear error ~ f''/8 stays small
    model = _model("affine", canvas=48, M=2, t=21, combine=combine)
    _set_templates(model, torch.stack([_gaussian(21, 3.0), 0.8 * _gaussian(21, 2.5)]).unsqueeze(1))
    P = torch.stack([affine_matrix(*map(torch.tensor, (1.1, 0.9, 0.3, 0.1, -0.2, 0.1))),
                     affine_matrix(*map(torch.tensor, (0.8, 1.0, -0.5, 0.0, 0.25, -0.15)))]).unsqueeze(0)
    T = affine_matrix(*map(torch.tensor, (1.15, 0.9, 0.35, -0.1, 0.1, 0.05))).unsqueeze(0)
    p = torch.tensor([[0.9, 0.6]])
    image_at_P, _ = model.render(p, P)
    image_at_TP, _ = model.render(p, model.apply_transform(P, T))
    warped = warp(image_at_P, T, 48)
    assert image_at_P.amax() > 0.3
    assert (image_at_TP - warped).abs().max() < 0.04  # measured 0.024; P∘T instead of T∘P gives 0.51
    assert (image_at_TP - image_at_P).abs().max() > 0.3  # the transform did move things


def test_combine_rule_by_hand():
    # the image is the presence-weighted sum p1 t1 + p2 t2 (for "mixture": the mixture's mean image), and each
    # capsule's contribution its own weighted layer
    ones = torch.ones(2, 1, 16, 16)
    for combine in ("sum", "mixture"):
        model = _model("translation", canvas=16, M=2, t=16, combine=combine)
        _set_templates(model, ones * torch.tensor([0.4, 0.3]).view(2, 1, 1, 1))
        image, contributions = model.render(torch.tensor([[0.5, 1.0]]), torch.eye(3).expand(1, 2, 3, 3))
        assert torch.allclose(image[0, 0, 8, 8], torch.tensor(0.5 * 0.4 + 1.0 * 0.3), atol=1e-5)
        assert torch.allclose(contributions[0, :, 0, 8, 8], torch.tensor([0.5 * 0.4, 1.0 * 0.3]), atol=1e-5)


def test_mixture_loss_by_hand():
    # two flat templates 0.4 and 0.3 filling a 4x4 canvas, target 0.35 + 0.05·checkerboard, weights 0.25 / 0.75:
    # loss = -(2σ²/D) log Σ π_m exp(-SSE_m / 2σ²) with SSE_m summed over the D = 16 pixels
    model = TransformingAutoencoder(TransformingAutoencoderConfig(
        mode="translation", canvas_size=4, num_capsules=2, recognition_hidden=2, template_size=4,
        combine="mixture", mixture_pixel_std=0.2))
    _set_templates(model, torch.ones(2, 1, 4, 4) * torch.tensor([0.4, 0.3]).view(2, 1, 1, 1))
    checker = (torch.arange(4).view(4, 1) + torch.arange(4).view(1, 4)) % 2
    target = (0.35 + 0.05 * checker).view(1, 1, 4, 4).float()
    pi = torch.tensor([[0.25, 0.75]])
    loss = model.reconstruction_loss(pi, torch.eye(3).expand(1, 2, 3, 3), target)
    # half the pixels are 0.35, half 0.40: template 0.4 misses by 0.05 / 0, template 0.3 by 0.05 / 0.1
    sse = torch.tensor([8 * 0.05 ** 2, 8 * 0.05 ** 2 + 8 * 0.1 ** 2])
    two_var = 2 * 0.2 ** 2
    expected = -(two_var / 16) * torch.log((pi[0] * torch.exp(-sse / two_var)).sum())
    assert torch.allclose(loss, expected, atol=1e-6)
    # a capsule with all the weight: the loss is its squared error per pixel
    one_hot = model.reconstruction_loss(torch.tensor([[1.0, 0.0]]), torch.eye(3).expand(1, 2, 3, 3), target)
    assert torch.allclose(one_hot, sse[0] / 16, atol=1e-6)
    # the presences of a mixture are a softmax over the capsules
    assert torch.allclose(model.presence(torch.tensor([[0.0, math.log(3.0)]])), pi)
    with pytest.raises(ValueError, match="mixture_pixel_std"):
        TransformingAutoencoderConfig(combine="mixture", mixture_pixel_std=0.0).validate()


# ------------------------------------------------------------------------------------------ reading T back


def test_translation_estimate_is_the_weighted_mean_shift():
    # capsule shifts (0.1, 0) and (0.3, 0.2) with weights 1 and 3, a third with weight 0: (0.25, 0.15)
    t1 = translation_matrix(torch.tensor([[0.0, 0.5, -0.3]]), torch.tensor([[0.0, 0.1, 0.9]]))
    t2 = translation_matrix(torch.tensor([[0.1, 0.8, 5.0]]), torch.tensor([[0.0, 0.3, -7.0]]))
    T = estimate_transform(t1, t2, torch.tensor([[1.0, 3.0, 0.0]]), "translation")
    assert torch.allclose(T[0], translation_matrix(torch.tensor(0.25), torch.tensor(0.15)), atol=1e-6)
    comps, names = transform_components(T, "translation", canvas_size=40)
    assert names == ["dx", "dy"] and torch.allclose(comps, torch.tensor([[5.0, 3.0]]), atol=1e-5)  # × 40/2 px


def test_affine_estimate_recovers_T_from_poses_and_ignores_absent_capsules():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n, M = 4, 5
    P1 = affine_matrix(*(torch.rand(6, n, M, generator=g) * torch.tensor([0.4, 0.4, 2, 0.4, 1, 1]).view(6, 1, 1)
                         + torch.tensor([0.8, 0.8, -1, -0.2, -0.5, -0.5]).view(6, 1, 1)))
    T = affine_matrix(torch.tensor([1.1, 0.9, 1.0, 1.2]), torch.tensor([0.95, 1.05, 1.0, 0.8]),
                      torch.tensor([0.2, -0.3, 0.0, 0.1]), torch.tensor([0.1, 0.0, -0.1, 0.0]),
                      torch.tensor([0.1, -0.2, 0.0, 0.05]), torch.tensor([0.0, 0.1, -0.1, 0.2]))
    P2 = compose(T[:, None], P1)
    P2[:, 0] = torch.eye(3) * 7  # a garbage capsule in the second image ...
    P2[:, 0, 2, 2] = 1
    w = torch.ones(n, M)
    w[:, 0] = 0                  # ... that is absent, so it must not count
    T_hat = estimate_transform(P1, P2, w, "affine", ridge=0.0)
    assert torch.allclose(T_hat, T, atol=1e-4)
    comps, names = transform_components(T, "affine", canvas_size=40)
    assert names == ["m11", "m12", "tx", "m21", "m22", "ty"]
    assert torch.allclose(comps[:, 2], T[:, 0, 2] * 20) and torch.allclose(comps[:, 0], T[:, 0, 0])


def test_a_trained_model_pipeline_reads_its_own_transform_exactly_when_poses_are_equivariant():
    # if recognition were perfectly equivariant (P2 = T P1), the estimator returns T: a consistency check of the
    # evaluation's conventions (T acts after the pose, in canvas coordinates)
    P1 = rotation_matrix(torch.tensor([[0.1, 0.7, -0.4]])) @ translation_matrix(torch.tensor([[0.2, -0.3, 0.1]]),
                                                                              torch.tensor([[0.0, 0.2, -0.2]]))
    T = compose(translation_matrix(torch.tensor([0.1]), torch.tensor([-0.05])), rotation_matrix(torch.tensor([0.2])))
    P2 = TransformingAutoencoder.apply_transform(P1, T)
    assert torch.allclose(estimate_transform(P1, P2, torch.ones(1, 3), "affine", ridge=0.0), T, atol=1e-5)


def test_pose_consistency_by_hand():
    # exactly equivariant poses (P2 = T P1): zero, whatever T and the weights
    P1 = rotation_matrix(torch.tensor([[0.1, 0.7]])) @ translation_matrix(torch.tensor([[0.2, -0.3]]),
                                                                           torch.tensor([[0.0, 0.2]]))
    T = compose(translation_matrix(torch.tensor([0.1]), torch.tensor([-0.05])), rotation_matrix(torch.tensor([0.2])))
    P2 = TransformingAutoencoder.apply_transform(P1, T)
    assert pose_consistency(P1, P2, T, torch.tensor([[1.0, 0.5]])) < 1e-10
    # a capsule that did not move (P2 = P1 = I) under a 0.1 shift: ‖I − T‖² = 0.01 each way, 0.02 in all; a second
    # capsule with weight 0 is ignored however wrong it is; a second image with zero error halves the batch mean
    I = torch.eye(3).expand(2, 2, 3, 3).clone()
    shift = translation_matrix(torch.tensor([0.1, 0.0]), torch.tensor([0.0, 0.0]))
    P2 = I.clone()
    P2[0, 1] = 5 * torch.eye(3)
    P2[1] = compose(shift[1], I[1])
    value = pose_consistency(I, P2, shift, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert value.item() == pytest.approx(0.02 / 2, abs=1e-7)
    # measured in the template frame: P1 = I, P2 = diag(2, 2, 1), T = I -> E = P2⁻¹ = diag(.5, .5, 1):
    # ‖E − I‖² = 0.25 + 0.25 and ‖E⁻¹ − I‖² = 1 + 1, so 2.5 in all
    doubled = torch.diag(torch.tensor([2.0, 2.0, 1.0])).expand(1, 1, 3, 3)
    assert pose_consistency(torch.eye(3).expand(1, 1, 3, 3), doubled, torch.eye(3).expand(1, 3, 3),
                            torch.ones(1, 1)).item() == pytest.approx(2.5)
    # a pose shrunk by s that ignores a 0.1 shift costs 2 (0.1 / s)²: shrinking poses cannot hide a mismatch
    for s_ in (1.0, 0.1):
        P = torch.diag(torch.tensor([s_, s_, 1.0])).expand(1, 1, 3, 3)
        cost = pose_consistency(P, P, shift[:1], torch.ones(1, 1)).item()
        assert cost == pytest.approx(2 * (0.1 / s_) ** 2, rel=1e-4)


def test_recognition_averaged_over_warps_by_hand():
    # catches: mapping a warped image's poses back by A instead of A⁻¹, or averaging without the presences.
    # An encoder that ignores the image (every image: presence p, pose P0) seen through warps I and a shift
    # A = (0.2, 0): its poses mapped back are P0 and A⁻¹ P0 (x shifted by -0.2); presences 1 and 3 weight them
    # 1/4 and 3/4, so the averaged pose is P0 shifted by -0.15 and the averaged presence is 2.
    model = TransformingAutoencoder(TransformingAutoencoderConfig(mode="affine", canvas_size=16, num_capsules=2,
                                                                  recognition_hidden=4, template_size=5))
    P0 = translation_matrix(torch.tensor([0.1, -0.3]), torch.tensor([0.0, 0.2]))         # (2 capsules, 3, 3)
    calls = []

    def fake_recognise(images):
        calls.append(images.shape[0])
        n = images.shape[0]
        presence = torch.cat([torch.ones(n // 2, 2), 3 * torch.ones(n // 2, 2)])  # warp-major: I first, then A
        return presence, P0.expand(n, 2, 3, 3)

    model.recognise = fake_recognise
    warps = torch.stack([torch.eye(3), translation_matrix(torch.tensor(0.2), torch.tensor(0.0))])
    presence, poses = model.recognise_averaged(torch.rand(3, 1, 16, 16), warps)
    assert calls == [6]  # every warp of every image in one batched call
    assert torch.allclose(presence, torch.full((3, 2), 2.0))
    expected = compose(translation_matrix(torch.tensor(-0.15), torch.tensor(0.0)), P0).expand(3, 2, 3, 3)
    assert torch.allclose(poses, expected, atol=1e-6)
    # catches: the image warped one way and its poses mapped back the other.  An exactly equivariant encoder (pose:
    # a shift to the image's centre of mass) seen through whole-pixel shifts gives back its unwarped pose.
    centres = (torch.arange(16) * 2 + 1) / 16 - 1                                          # pixel centres

    def centroid_recognise(images):
        mass = images[:, 0].sum((1, 2))
        cx = (images[:, 0].sum(1) * centres).sum(1) / mass
        cy = (images[:, 0].sum(2) * centres).sum(1) / mass
        return torch.ones(len(images), 1), translation_matrix(cx, cy).unsqueeze(1)

    model.recognise = centroid_recognise
    image = torch.zeros(1, 1, 16, 16)
    image[0, 0, 5:8, 6:10] = torch.rand(3, 4) + 0.5                                       # well inside the canvas
    shifts = torch.stack([torch.eye(3), translation_matrix(torch.tensor(0.25), torch.tensor(-0.125)),
                          translation_matrix(torch.tensor(-0.125), torch.tensor(0.25))])  # 2 and 1 pixel steps
    assert torch.allclose(model.recognise_averaged(image, shifts)[1], centroid_recognise(image)[1], atol=1e-5)


def test_capped_consistency_by_hand_and_bounded_at_a_collapsing_pose():
    # P1 = I, P2 = diag(2, 2, 1), T = I: plain mismatch 2.5 (above); with cap 1 it counts 1 · 2.5 / 3.5
    I1 = torch.eye(3).expand(1, 1, 3, 3)
    P2 = torch.diag(torch.tensor([2.0, 2.0, 1.0])).expand(1, 1, 3, 3)
    T = torch.eye(3).expand(1, 3, 3)
    assert pose_consistency(I1, P2, T, torch.ones(1, 1), cap=1.0).item() == pytest.approx(2.5 / 3.5)
    # small mismatches are nearly unchanged: 0.02 -> 0.02 / 1.02 at cap 1
    shift = translation_matrix(torch.tensor([0.1]), torch.tensor([0.0]))
    assert pose_consistency(I1, I1, shift, torch.ones(1, 1), cap=1.0).item() == pytest.approx(0.02 / 1.02, rel=1e-4)
    # a capsule whose pose collapses (det -> 0): the plain term's gradient explodes, the capped one's vanishes
    grads = {}
    for cap in (0.0, 1.0):
        eps = torch.tensor(1e-3, requires_grad=True)
        Pc = torch.diag(torch.stack([eps, torch.tensor(1.0), torch.tensor(1.0)])).expand(1, 1, 3, 3)
        pose_consistency(I1, Pc, T, torch.ones(1, 1), cap=cap).backward()
        grads[cap] = eps.grad.abs().item()
    assert grads[0.0] > 1e8 and grads[1.0] < 1e-2
    with pytest.raises(ValueError, match="cap"):
        pose_consistency(I1, P2, T, torch.ones(1, 1), cap=-1.0)


def test_transforming_loss_is_the_mse_plus_weighted_consistency():
    exp = _experiment()
    torch.manual_seed(0)
    model = _conv_model("affine", M=3)
    x1, x2 = torch.rand(2, 1, 16, 16), torch.rand(2, 1, 16, 16)
    T = rotation_matrix(torch.tensor([0.3, -0.2]))
    mse = torch.nn.functional.mse_loss(model(x1, T), x2)
    assert torch.allclose(exp.transforming_loss(model, x1, T, x2, 0.0), mse)
    p1, P1 = model.recognise(x1)
    p2, P2 = model.recognise(x2)
    expected = mse + 2.5 * pose_consistency(P1, P2, T, p1 * p2)
    assert torch.allclose(exp.transforming_loss(model, x1, T, x2, 2.5), expected, atol=1e-6)
    with torch.no_grad():  # capsules of unequal presence, so that weighting them by p1 · p2 matters
        model.encoder.head.bias.view(3, model.config.keypoints, -1)[..., 6] = torch.tensor([-3.0, 0.0, 3.0])[:, None]
    mse = torch.nn.functional.mse_loss(model(x1, T), x2)
    (p1, P1), (p2, P2) = model.recognise(x1), model.recognise(x2)
    expected = mse + 2.5 * pose_consistency(P1, P2, T, p1 * p2)
    uniform = mse + 2.5 * pose_consistency(P1, P2, T, torch.ones_like(p1))
    assert torch.allclose(exp.transforming_loss(model, x1, T, x2, 2.5), expected, atol=1e-6)
    assert not torch.allclose(uniform, expected)
    # "mixture": the reconstruction term is the mixture's, presences a softmax
    model.config.combine = "mixture"
    (p1, P1), (p2, P2) = model.recognise(x1), model.recognise(x2)
    assert torch.allclose(p1.sum(1), torch.ones(2))
    recon = model.reconstruction_loss(p1, model.apply_transform(P1, T), x2)
    assert not torch.allclose(recon, torch.nn.functional.mse_loss(model(x1, T), x2))
    expected = recon + 2.5 * pose_consistency(P1, P2, T, p1 * p2)
    assert torch.allclose(exp.transforming_loss(model, x1, T, x2, 2.5), expected, atol=1e-6)
    assert torch.allclose(exp.transforming_loss(model, x1, T, x2, 0.0), recon, atol=1e-6)


# ------------------------------------------------------------------------------------------ data and config


def _experiment():
    from probcaps.experiments import transforming_autoencoder as exp

    return exp


def test_sampled_transforms_stay_in_their_range_and_translation_mode_only_translates():
    exp = _experiment()
    rng = exp.TransformRange(jitter_translation_px=3.0, translation_px=5.0)
    g = torch.Generator().manual_seed(0)
    T = exp.sample_transforms(500, rng, 40, g, jitter=False)
    assert torch.allclose(T[:, :2, :2], torch.eye(2).expand(500, 2, 2))
    px = T[:, :2, 2] * 20  # normalised -> pixels on a 40-pixel canvas
    assert px.abs().max() <= 5.0 + 1e-5 and px.abs().max() > 4.5
    A = exp.sample_transforms(500, rng, 40, g, jitter=True)
    assert (A[:, :2, 2] * 20).abs().max() <= 3.0 + 1e-5
    full = exp.TransformRange(rotation_deg=30, scale=0.2, shear=0.0, translation_px=0)
    R = exp.sample_transforms(500, full, 40, g, jitter=False)
    det = torch.linalg.det(R[:, :2, :2])
    sx, sy = R[:, :2, 0].norm(dim=1), R[:, :2, 1].norm(dim=1)  # no shear: columns are the scaled rotation
    assert torch.allclose(det, sx * sy, atol=1e-5) and sx.min() >= 0.8 - 1e-5 and sx.max() <= 1.2 + 1e-5


def test_pairs_are_the_digit_at_A_and_at_T_compose_A_and_swapping_reverses_them():
    exp = _experiment()
    rng = exp.TransformRange(jitter_translation_px=2.0, translation_px=3.0, rotation_deg=0.0)
    digits = torch.rand(6, 1, 28, 28)
    plain = exp.make_pairs(digits, rng, 36, torch.Generator().manual_seed(3), swap=False)
    A = exp.sample_transforms(6, rng, 36, torch.Generator().manual_seed(3), jitter=True)
    assert torch.allclose(plain["input"], warp(digits, A, 36))
    assert torch.allclose(plain["target"], warp(digits, compose(plain["transform"], A), 36), atol=1e-6)
    swapped = exp.make_pairs(digits, rng, 36, torch.Generator().manual_seed(3), swap=True)
    flipped = ~torch.isclose(swapped["input"], plain["input"]).flatten(1).all(1)
    assert 0 < int(flipped.sum()) < 6  # this seed flips some pairs and keeps others
    for i in range(6):
        if flipped[i]:
            assert torch.allclose(swapped["input"][i], plain["target"][i])
            assert torch.allclose(swapped["target"][i], plain["input"][i])
            assert torch.allclose(swapped["transform"][i], invert(plain["transform"][i:i + 1])[0], atol=1e-6)
        else:
            assert torch.allclose(swapped["transform"][i], plain["transform"][i])


def test_window_mask_is_22_by_22_around_the_digit_centre():
    exp = _experiment()
    mask = exp.window_mask(torch.eye(3).unsqueeze(0), 40)  # centre at pixel 19.5: rows/columns 9..30
    assert mask.sum() == 22 * 22
    assert bool(mask[0, 0, 9, 9]) and bool(mask[0, 0, 30, 30]) and not bool(mask[0, 0, 8, 20])
    shifted = exp.window_mask(translation_matrix(torch.tensor([0.1]), torch.tensor([0.0])), 40)  # +2 px right
    assert torch.equal(shifted, torch.roll(mask, 2, dims=3))


def test_shipped_recipes_name_their_files_and_the_affine_one_is_a_diff_on_the_translation_one():
    # catches: a recipe whose name is not its file stem (two configs writing one results file), or the affine
    # recipe losing a key of its base
    exp = _experiment()
    translation, affine = (exp.load_config(path) for path in exp.RECIPES)
    assert [c["name"] for c in (translation, affine)] == [p.stem for p in exp.RECIPES]
    assert (translation["mode"], affine["mode"]) == ("translation", "affine")
    assert affine["model"].num_capsules == translation["model"].num_capsules == 12
    assert affine["train"].lr == translation["train"].lr and affine["train"].steps == 12000
    assert affine["model"].combine == "mixture" and affine["loss"].consistency_cap == 1.0


def test_config_errors(tmp_path):
    exp = _experiment()
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 50\n[model]\nmode = "affine"\n[range]\nrotation_deg = 10.0\n')
    cfg = exp.load_config(path)
    assert cfg["mode"] == "affine" and cfg["range"].rotation_deg == 10.0 and cfg["name"] == "c"
    assert exp.load_config(path, ["train.steps=3"])["train"].steps == 3
    with pytest.raises(ConfigError, match="translations only"):
        exp.load_config(path, ["model.mode=translation"])
    with pytest.raises(ConfigError, match="combine"):
        exp.load_config(path, ["model.combine=over"])
    with pytest.raises(ConfigError, match="unknown key"):
        exp.load_config(path, ["model.refine_steps=2"])
    with pytest.raises(ConfigError, match="recognition"):
        exp.load_config(path, ["model.recognition=cnn"])
    with pytest.raises(ConfigError, match="keypoints must be >= 3"):
        exp.load_config(path, ["model.keypoints=1"])
    with pytest.raises(ConfigError, match="consistency_weight"):
        exp.load_config(path, ["loss.consistency_weight=-1"])
    with pytest.raises(ConfigError, match="consistency_cap"):
        exp.load_config(path, ["loss.consistency_cap=-1"])
    with pytest.raises(ConfigError, match="test_time_warps"):
        exp.load_config(path, ["eval.test_time_warps=-2"])


# ------------------------------------------------------------------------------------------ entry point


TINY = ["--set", "data.dataset=synthetic", "--set", "data.train_limit=32", "--set", "data.test_limit=16",
        "--set", "model.canvas_size=32", "--set", "model.num_capsules=3", "--set", "model.recognition_hidden=4",
        "--set", "model.template_size=5", "--set", "model.template_init=data", "--set", "train.steps=4",
        "--set", "train.batch_size=8", "--set", "train.warmup_steps=1", "--set", "train.log_every=1",
        "--set", "train.checkpoint_every=2", "--set", "eval.pairs=24", "--set", "eval.readout_pairs=24",
        "--set", "eval.batch_size=10", "--set", "eval.curve_pairs=8", "--set", "range.translation_px=1.0",
        "--set", "range.jitter_translation_px=1.0"]
# the affine recipe as shipped (conv recognition, mixture, capped pose consistency) with a tiny trunk
TINY_CONV = ["--set", "model.conv_channels=[4, 4]", "--set", "model.conv_strides=[2, 2]"]


def test_entry_point_runs_both_recipes_on_tiny_data_and_resumes(tmp_path):
    exp = _experiment()
    translation, affine = (str(path) for path in exp.RECIPES)
    results, runs = tmp_path / "results", tmp_path / "runs"
    common = ["--seeds", "0", "1", "--results-dir", str(results), "--quiet"]
    for config, extra in ((translation, []), (affine, TINY_CONV)):
        out = runs / Path(config).stem
        assert exp.main(["--config", config, "--out", str(out), *common, *TINY, *extra]) == 0
    for mode, comps in (("translation", ["dx", "dy"]), ("affine", ["m11", "m12", "tx", "m21", "m22", "ty"])):
        data = json.loads((results / f"transforming_autoencoder_{mode}.json").read_text())
        m = data["metrics"]
        assert [r["seed"] for r in m["per_seed"]] == [0, 1] and m["components"] == comps
        assert m["per_seed"][0]["steps"] == 4 and data["provenance"]["seed"] == [0, 1]
        r2 = [r[f"r2_{comps[0]}"] for r in m["per_seed"]]
        assert m[f"r2_{comps[0]}_mean"] == pytest.approx(sum(r2) / 2)
        assert all(math.isfinite(r["recon_mse"]) for r in m["per_seed"])
        for fig in ("scatter", "reconstructions", "presence", "templates", "training", "r2_curve"):
            assert (results / f"transforming_autoencoder_{mode}_{fig}.png").is_file(), fig
        assert (runs / f"transforming_autoencoder_{mode}" / "seed1" / "final.pt").is_file()
        assert m["per_seed"][0]["test_time_warps"] == 0
        breakdown = m["per_seed"][0]["error_breakdown"]
        assert set(breakdown["worst_error_share"]) == set(comps) and breakdown["r2_by_digit"]
    table = exp.readme_table(results)
    assert "R²(dx)" in table and "R²(m12)" in table and "0.78" in table
    assert "the worst 2% of held-out pairs hold" in table
    # the affine models re-scored with recognition averaged over 3 warps: their own rows in the table
    affine_out, tta_name = str(runs / "transforming_autoencoder_affine"), "transforming_autoencoder_affine_tta"
    assert exp.main(["--config", affine, "--out", affine_out, "--resume", "--name", tta_name, *common, *TINY,
                     *TINY_CONV, "--set", "eval.figures=false", "--set", "eval.test_time_warps=3"]) == 0
    tta = json.loads((results / "transforming_autoencoder_affine_tta.json").read_text())["metrics"]["per_seed"]
    assert tta[0]["test_time_warps"] == 3 and tta[0]["steps"] == 4
    assert "R²(m11), recognition averaged over 3 known warps" in exp.readme_table(results)
    # --resume on finished runs re-evaluates without training: identical metrics
    translation_out = str(runs / "transforming_autoencoder_translation")
    before = json.loads((results / "transforming_autoencoder_translation.json").read_text())["metrics"]
    assert exp.main(["--config", translation, "--out", translation_out, "--resume", *common, *TINY,
                     "--set", "eval.figures=false"]) == 0
    after = json.loads((results / "transforming_autoencoder_translation.json").read_text())["metrics"]
    assert after["per_seed"][1]["r2_dx"] == pytest.approx(before["per_seed"][1]["r2_dx"])
    # --resume with more steps than a finished run has trains on from its last checkpoint
    more = tmp_path / "more"
    assert exp.main(["--config", translation, "--seeds", "1", "--out", translation_out, "--results-dir", str(more),
                     "--quiet", "--resume", *TINY, "--set", "eval.figures=false", "--set", "train.steps=6"]) == 0
    assert json.loads((more / "transforming_autoencoder_translation.json").read_text())["metrics"]["per_seed"][0][
        "steps"] == 6
    seed1 = runs / "transforming_autoencoder_translation" / "seed1"
    assert run_finished(seed1, 6) and not run_finished(seed1, 7)
    # --name / --out with several recipes would send both to one place
    assert exp.main(["--config", translation, affine, "--name", "x", "--quiet"]) == 2


def test_entry_point_bad_config_is_one_line(tmp_path, capsys):
    exp = _experiment()
    assert exp.main(["--config", str(tmp_path / "nope.toml"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.toml" in err[0]
    assert exp.readme_table(tmp_path) is None


def test_error_breakdown_by_hand():
    from probcaps.experiments import transforming_autoencoder as exp

    true = torch.tensor([[0.0, 1.0], [2.0, 1.0], [4.0, 3.0], [6.0, 3.0]])  # variances 5 and 1
    pred = true.clone()
    pred[2, 0] += 1.0   # class 1: squared error 1 on the first component
    pred[0, 1] += 0.5   # class 0: 0.25 and 1.0 on the second
    pred[1, 1] -= 1.0
    out = exp.error_breakdown(pred, true, torch.tensor([0, 0, 1, 1]), ["a", "b"], worst_fraction=0.25)
    assert out["r2_by_digit"]["0"] == pytest.approx({"a": 1.0, "b": 1 - (0.25 + 1.0) / 2 / 1.0})
    assert out["r2_by_digit"]["1"] == pytest.approx({"a": 1 - 0.5 / 5.0, "b": 1.0})
    # the worst quarter (one pair) holds all of a's error and 1.0 of b's 1.25
    assert out["worst_error_share"] == pytest.approx({"a": 1.0, "b": 0.8})


def test_heldout_pairs_record_which_digit_each_pair_came_from():
    from probcaps.experiments import transforming_autoencoder as exp

    digits = torch.arange(3, dtype=torch.uint8).view(3, 1, 1).expand(3, 28, 28) * 100  # digit i is all 100·i
    rng = exp.TransformRange(jitter_translation_px=0.0, translation_px=0.0, rotation_deg=0.0)
    pairs = exp.heldout_pairs(digits, 5, rng, 28, 0, "heldout")
    assert pairs["index"].tolist() == [0, 1, 2, 0, 1]  # cycled
    # identity warps: the input is the digit itself, so its centre pixel names the digit
    centre = (pairs["input"][:, 0, 14, 14] * 255).round().long().tolist()
    assert centre == [100 * i for i in pairs["index"].tolist()]
