"""Pose geometry, the affine warp and alpha compositing, checked against hand-computed values.

Each test says in a comment which bug it would catch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from probcaps import render
from probcaps.geometry import (
    affine_matrix,
    compose,
    compose_pose6,
    determinant,
    invert,
    matrix_to_pose6,
    pixels_to_normalised,
    pose6_to_matrix,
    restrict_pose6,
    rotation_matrix,
    translation_matrix,
)
from probcaps.render import (
    alpha_over,
    composite_over,
    footprints,
    render_over,
    render_templates,
    sampling_grid,
    warp,
    window_sides,
)

DT = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _random_poses(*shape, scale=0.3):
    return scale * torch.randn(*shape, 6, dtype=DT)


# --------------------------------------------------------------------------------------------- pose geometry

def test_pose6_identity_and_layout():
    # catches: the identity not being added (y = 0 must be the identity map), or entries in the wrong slots
    assert torch.equal(pose6_to_matrix(torch.zeros(6, dtype=DT)), torch.eye(3, dtype=DT))
    y = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=DT)
    expected = torch.tensor([[2.0, 2.0, 3.0], [4.0, 6.0, 6.0], [0.0, 0.0, 1.0]], dtype=DT)
    assert torch.equal(pose6_to_matrix(y), expected)


def test_pose6_matrix_round_trip_batched():
    # catches: matrix_to_pose6 not being the inverse of pose6_to_matrix, or broadcasting over leading dims broken
    y = _random_poses(4, 3)
    P = pose6_to_matrix(y)
    assert P.shape == (4, 3, 3, 3)
    assert torch.allclose(P[..., 2, :], torch.tensor([0.0, 0.0, 1.0], dtype=DT).expand(4, 3, 3))
    assert torch.allclose(matrix_to_pose6(P), y, atol=1e-15)


def test_pose6_shape_errors():
    # catches: silently accepting a 5-vector or a 2x3 matrix (would mis-slice poses)
    with pytest.raises(ValueError):
        pose6_to_matrix(torch.zeros(5))
    with pytest.raises(ValueError):
        matrix_to_pose6(torch.zeros(2, 3))


def test_restrict_pose6_keeps_its_group_and_projects_the_rest():
    # catches: a sign slip in the rotation part, a projection that is not idempotent or not orthogonal
    theta, scale = torch.tensor(0.3), torch.tensor(1.4)
    similar = matrix_to_pose6(affine_matrix(scale, scale, theta, torch.tensor(0.0), torch.tensor(0.2),
                                            torch.tensor(-0.1)))
    assert torch.allclose(restrict_pose6(similar, "similarity"), similar, atol=1e-6)
    # a shear and an anisotropic scale by hand: [[1.5, 0.4], [0.0, 0.5]] -> a = 1.0, b = -0.2
    y = torch.tensor([0.5, 0.4, 0.3, 0.0, -0.5, -0.7])
    assert torch.allclose(restrict_pose6(y, "similarity"), torch.tensor([0.0, 0.2, 0.3, -0.2, 0.0, -0.7]))
    assert restrict_pose6(y, "affine") is y
    # an object's code after its pose passes through
    coded = torch.cat([y, torch.tensor([2.0, -3.0])])
    assert torch.equal(restrict_pose6(coded, "similarity"), torch.cat([restrict_pose6(y, "similarity"), coded[6:]]))
    ys = torch.randn(7, 3, 6)
    once = restrict_pose6(ys, "similarity")
    assert torch.allclose(restrict_pose6(once, "similarity"), once, atol=1e-6)
    # an orthogonal projection: what it removes is orthogonal to what it keeps (here in the matrix entries)
    assert torch.allclose(((ys - once) * once)[..., [0, 1, 3, 4]].sum(-1), torch.zeros(7, 3), atol=1e-5)
    with pytest.raises(ValueError, match="group"):
        restrict_pose6(y, "translation")


def test_compose_pose6_equals_matrix_product():
    # catches: a wrong entry in the closed-form product, or composing in the wrong order (P(b) P(a))
    a, b = _random_poses(5, 2), _random_poses(5, 2)
    expected = matrix_to_pose6(pose6_to_matrix(a) @ pose6_to_matrix(b))
    assert torch.allclose(compose_pose6(a, b), expected, atol=1e-12)
    # the order matters for these random maps, so a swapped product would fail above
    assert not torch.allclose(compose_pose6(b, a), expected, atol=1e-6)
    # and broadcasting (K, 1, 6) against (M, 6) as the model uses it
    y1, offsets = _random_poses(3, 1), _random_poses(3, 4)
    assert torch.allclose(compose_pose6(y1, offsets),
                          matrix_to_pose6(pose6_to_matrix(y1) @ pose6_to_matrix(offsets)), atol=1e-12)
    A, B = pose6_to_matrix(a), pose6_to_matrix(b)
    assert torch.allclose(compose(A, B), A @ B)


def test_invert_is_inverse():
    # catches: sign or cofactor errors in the closed-form inverse (incl. the translation column)
    P = pose6_to_matrix(_random_poses(6))
    eye = torch.eye(3, dtype=DT).expand(6, 3, 3)
    assert torch.allclose(invert(P) @ P, eye, atol=1e-12)
    assert torch.allclose(P @ invert(P), eye, atol=1e-12)
    assert torch.allclose(invert(P), torch.linalg.inv(P), atol=1e-12)


def test_determinant_equals_linalg_det():
    # catches: a sign or index slip in the area scale that warp uses to find singular poses
    P = pose6_to_matrix(_random_poses(6))
    assert torch.allclose(determinant(P), torch.linalg.det(P), atol=1e-12)


def test_invert_min_abs_det_keeps_singular_maps_finite_and_regular_ones_exact():
    # catches: a singular pose inverting to inf (then NaN pixels), the floor flipping the determinant's sign, or the
    # floor touching maps whose determinant is above it
    P = pose6_to_matrix(_random_poses(6))
    assert torch.equal(invert(P, min_abs_det=1e-6), invert(P))
    flat = torch.tensor([[[0.0, 0.0, 0.1], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]],   # det exactly 0
                         [[1e-20, 0.0, 0.0], [0.0, -1e-20, 0.0], [0.0, 0.0, 1.0]]], dtype=DT)  # det = -1e-40
    assert not torch.isfinite(invert(flat)).all()
    safe = invert(flat, min_abs_det=1e-6)
    assert torch.isfinite(safe).all()
    # the floored determinant keeps its sign (-1e-6): entries e / det and a / det
    assert torch.isclose(safe[1, 0, 0], torch.tensor(1e-14, dtype=DT))
    assert torch.isclose(safe[1, 1, 1], torch.tensor(-1e-14, dtype=DT))
    assert safe[0, 0, 2] == 0 and safe[0, 1, 2] == 0


def test_warp_of_a_singular_pose_is_blank_with_finite_gradients():
    # catches: inf in the inverse pose reaching the sampling grid (the grid's matmul turns inf * 0 into NaN)
    template = torch.rand(2, 1, 5, 5, dtype=torch.float32)
    P = torch.eye(3).repeat(2, 1, 1)
    P[0, :2, :2] = 0.0  # collapsed to a point
    P[1, 0] = P[1, 1]   # rank 1: both rows equal
    P.requires_grad_(True)
    out = warp(template, P, 12)
    assert torch.isfinite(out).all()
    assert out.abs().max() == 0  # both poses render nothing
    out.sum().backward()
    assert torch.isfinite(P.grad).all()


def test_affine_matrix_known_values():
    # catches: cos/sin swapped, rotation direction flipped, scales applied to rows instead of columns, shear misplaced
    t = lambda v: torch.tensor(v, dtype=DT)
    R = affine_matrix(t(1.0), t(1.0), t(math.pi / 2), t(0.0), t(0.0), t(0.0))
    assert torch.allclose(R, t([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]), atol=1e-15)
    # S(2, 3) first, then R(90°): x-axis -> (0, 2), y-axis -> (-3, 0); translation in the last column
    M = affine_matrix(t(2.0), t(3.0), t(math.pi / 2), t(0.0), t(0.5), t(-0.25))
    assert torch.allclose(M, t([[0.0, -3.0, 0.5], [2.0, 0.0, -0.25], [0.0, 0.0, 1.0]]), atol=1e-15)
    Sh = affine_matrix(t(1.0), t(1.0), t(0.0), t(0.5), t(0.0), t(0.0))
    assert torch.allclose(Sh, t([[1.0, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    # the general case equals the explicit product T R Sh S
    sx, sy, th, sh, tx, ty = (t(v) for v in (1.3, 0.7, 0.4, -0.2, 0.1, 0.3))
    c, s = math.cos(0.4), math.sin(0.4)
    T_ = t([[1, 0, 0.1], [0, 1, 0.3], [0, 0, 1]])
    R_ = t([[c, -s, 0], [s, c, 0], [0, 0, 1]])
    Sh_ = t([[1, -0.2, 0], [0, 1, 0], [0, 0, 1]])
    S_ = t([[1.3, 0, 0], [0, 0.7, 0], [0, 0, 1]])
    assert torch.allclose(affine_matrix(sx, sy, th, sh, tx, ty), T_ @ R_ @ Sh_ @ S_, atol=1e-14)
    # (rotation_matrix / translation_matrix build float32 matrices, see test_matrix_helpers_keep_float64)
    assert torch.allclose(rotation_matrix(t(0.4)).to(DT), R_, atol=1e-7)
    assert torch.allclose(translation_matrix(0.1, 0.3).to(DT), T_, atol=1e-7)
    assert pixels_to_normalised(3, 12) == 0.5


# --------------------------------------------------------------------------------------------- the warp

def _dot_template(t=3, value=1.0, where=None):
    """``(1, 1, t, t)`` template, zero except one pixel (the centre by default)."""
    img = torch.zeros(1, 1, t, t, dtype=DT)
    r, c = where if where is not None else (t // 2, t // 2)
    img[0, 0, r, c] = value
    return img


def test_warp_identity_places_template_centred():
    # catches: the template being stretched to the canvas (missing S^-1), or an off-by-one/half-pixel shift
    tmpl = torch.arange(9, dtype=DT).view(1, 1, 3, 3) + 1
    out = warp(tmpl, torch.eye(3, dtype=DT)[None], 9)
    expected = torch.zeros(1, 1, 9, 9, dtype=DT)
    expected[0, 0, 3:6, 3:6] = tmpl[0, 0]
    assert torch.allclose(out, expected, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, -3])
def test_warp_translation_moves_k_pixels(k):
    # catches: translations in the wrong units (pixels vs normalised), wrong sign, or x/y swapped
    W = 9
    tmpl = _dot_template(3)
    P = translation_matrix(pixels_to_normalised(k, W), 0.0).to(DT)[None]
    out = warp(tmpl, P, W)[0, 0]
    expected = torch.zeros(W, W, dtype=DT)
    expected[4, 4 + k] = 1.0  # the centre pixel, k columns to the right
    assert torch.allclose(out, expected, atol=1e-6)  # translation_matrix is float32
    # vertical: +k moves it k rows down (image y axis points down)
    P = translation_matrix(0.0, pixels_to_normalised(k, W)).to(DT)[None]
    out = warp(tmpl, P, W)[0, 0]
    expected = torch.zeros(W, W, dtype=DT)
    expected[4 + k, 4] = 1.0
    assert torch.allclose(out, expected, atol=1e-6)


def test_warp_translation_on_rectangular_canvas():
    # catches: using H where W belongs (or vice versa) when converting translations / scaling the source
    H, W = 9, 11
    tmpl = _dot_template(3)
    P = translation_matrix(pixels_to_normalised(2, W), pixels_to_normalised(-1, H)).to(DT)[None]
    out = warp(tmpl, P, (H, W))[0, 0]
    expected = torch.zeros(H, W, dtype=DT)
    expected[4 - 1, 5 + 2] = 1.0
    assert torch.allclose(out, expected, atol=1e-6)


def test_warp_scale_two_doubles_footprint():
    # catches: scale inverted (P applied canvas->source instead of source->canvas), i.e. a halved footprint
    W = 9
    P = torch.diag(torch.tensor([2.0, 2.0, 1.0], dtype=DT))[None]
    # one bright pixel at scale 2: bilinear tent sampled at half-pixel steps -> outer([.5, 1, .5]) at the centre
    out = warp(_dot_template(3), P, W)[0, 0]
    expected = torch.zeros(W, W, dtype=DT)
    profile = torch.tensor([0.5, 1.0, 0.5], dtype=DT)
    expected[3:6, 3:6] = torch.outer(profile, profile)
    assert torch.allclose(out, expected, atol=1e-12)
    # an all-ones 3x3 template covers 6x6 "pixels" of mass: 1-D profile [0, .5, 1, 1, 1, 1, 1, .5, 0] (sum 6 = 2 * 3)
    out = warp(torch.ones(1, 1, 3, 3, dtype=DT), P, W)[0, 0]
    profile = torch.tensor([0, 0.5, 1, 1, 1, 1, 1, 0.5, 0], dtype=DT)
    assert torch.allclose(out, torch.outer(profile, profile), atol=1e-12)
    assert math.isclose(out.sum().item(), 4 * 9, rel_tol=1e-12)


def test_warp_rotation_90_degrees():
    # catches: rotating the wrong way. P maps template coords to canvas coords, with y down: R(90°) takes the
    # point above the centre, (0, -1), to (1, 0), right of the centre.
    W = 9
    tmpl = _dot_template(3, where=(0, 1))  # top-middle pixel
    out = warp(tmpl, rotation_matrix(torch.tensor(math.pi / 2)).to(DT)[None], W)[0, 0]
    expected = torch.zeros(W, W, dtype=DT)
    expected[4, 5] = 1.0  # middle row, one right of centre
    assert torch.allclose(out, expected, atol=1e-6)  # cos(pi/2) in float32 is -4e-8


def test_matrix_helpers_keep_float64():
    # catches: silent loss of precision for float64 poses (as_tensor(..., dtype=get_default_dtype()) downcasts)
    assert rotation_matrix(torch.tensor(0.4, dtype=DT)).dtype == DT
    assert translation_matrix(torch.tensor(0.1, dtype=DT), torch.tensor(0.3, dtype=DT)).dtype == DT


def test_warp_rejects_bad_shapes():
    # catches: silent broadcasting of a pose batch that does not match the image batch
    with pytest.raises(ValueError):
        warp(torch.zeros(2, 1, 3, 3), torch.eye(3).expand(3, 3, 3), 9)
    with pytest.raises(ValueError):
        warp(torch.zeros(1, 3, 3), torch.eye(3)[None], 9)


def test_sampling_grid_equals_affine_grid():
    # catches: x/y rows swapped or the pixel-centre convention differing from align_corners=False
    A = torch.randn(4, 2, 3, dtype=DT)
    for H, W in ((7, 7), (5, 8)):
        ref = F.affine_grid(A, (4, 1, H, W), align_corners=False)
        assert torch.allclose(sampling_grid(A, (H, W)), ref, atol=1e-12)


def test_warp_equals_affine_grid_reference():
    # catches: a wrong source rescaling S^-1 = diag(W/w, H/h) (e.g. applied to columns, or h/w swapped) or an
    # inverse that differs from the true one; the reference uses torch.linalg.inv and F.affine_grid directly
    N, C, h, w, H, W = 3, 2, 5, 4, 10, 13
    images = torch.rand(N, C, h, w, dtype=DT)
    P = pose6_to_matrix(_random_poses(N, scale=0.2))
    S_inv = torch.diag(torch.tensor([W / w, H / h, 1.0], dtype=DT))
    theta = (S_inv @ torch.linalg.inv(P))[:, :2, :]
    grid = F.affine_grid(theta, (N, C, H, W), align_corners=False)
    ref = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    assert torch.allclose(warp(images, P, (H, W)), ref, atol=1e-12)


def test_render_templates_shapes_and_per_image_warp():
    # catches: templates and poses paired up wrongly after the (B*M) reshape, or the per-image form ignored
    B, M, C, t, S = 2, 3, 2, 5, 12
    templates = torch.rand(M, C, t, t, dtype=DT)
    poses = pose6_to_matrix(_random_poses(B, M, scale=0.2))
    out = render_templates(templates, poses, S)
    assert out.shape == (B, M, C, S, S)
    for b in range(B):
        for m in range(M):
            assert torch.allclose(out[b, m], warp(templates[m:m + 1], poses[b, m:m + 1], S)[0], atol=1e-12)
    per_image = torch.rand(B, M, C, t, t, dtype=DT)
    out = render_templates(per_image, poses, (S, S + 2))
    assert out.shape == (B, M, C, S, S + 2)
    for b in range(B):
        for m in range(M):
            assert torch.allclose(out[b, m], warp(per_image[b, m:m + 1], poses[b, m:m + 1], (S, S + 2))[0])
    with pytest.raises(ValueError):
        render_templates(torch.rand(B, M + 1, C, t, t), poses, S)


# --------------------------------------------------------------------------------------------- compositing

def test_alpha_over_hand_computed():
    # catches: the wrong over formula (premultiplied vs straight colours, missing normalisation by alpha)
    a, alpha_a, b, alpha_b = (torch.tensor(v, dtype=DT) for v in (0.8, 0.5, 0.2, 0.6))
    colour, alpha = alpha_over(a, alpha_a, b, alpha_b)
    # alpha = 0.5 + 0.6 * 0.5 = 0.8; colour = (0.8 * 0.5 + 0.2 * 0.6 * 0.5) / 0.8 = 0.46 / 0.8 = 0.575
    assert math.isclose(alpha.item(), 0.8, rel_tol=1e-12)
    assert math.isclose(colour.item(), 0.575, rel_tol=1e-12)
    # an opaque front layer hides the back; a transparent one shows it
    c, al = alpha_over(torch.tensor(0.3), torch.tensor(1.0), torch.tensor(0.9), torch.tensor(0.7))
    assert math.isclose(c.item(), 0.3, rel_tol=1e-6) and math.isclose(al.item(), 1.0)
    c, al = alpha_over(torch.tensor(0.3), torch.tensor(0.0), torch.tensor(0.9), torch.tensor(0.7))
    assert math.isclose(c.item(), 0.9, rel_tol=1e-6) and math.isclose(al.item(), 0.7, rel_tol=1e-6)
    # both transparent: colour 0, no NaN
    c, al = alpha_over(torch.tensor(0.3), torch.tensor(0.0), torch.tensor(0.9), torch.tensor(0.0))
    assert c.item() == 0.0 and al.item() == 0.0


def test_composite_over_two_layers_hand_computed():
    # catches: layer order reversed (index 0 must be the back), weights not α_m ∏_{j>m}(1 − α_j),
    # background ignored
    colours = torch.tensor([0.2, 0.8], dtype=DT).view(1, 2, 1, 1, 1)  # back b = 0.2, front a = 0.8
    alphas = torch.tensor([0.6, 0.5], dtype=DT).view(1, 2, 1, 1, 1)
    image, weights = composite_over(colours, alphas, dim=1)
    # front 0.8 * 0.5 + back 0.2 * 0.6 * (1 - 0.5) = 0.4 + 0.06 = 0.46 (black background)
    assert math.isclose(image.item(), 0.46, rel_tol=1e-12)
    assert torch.allclose(weights.flatten(), torch.tensor([0.3, 0.5], dtype=DT))
    # background 0.3 shows through (1 - 0.5)(1 - 0.6) = 0.2 of the pixel: 0.46 + 0.06 = 0.52
    image, _ = composite_over(colours, alphas, dim=1, background=0.3)
    assert math.isclose(image.item(), 0.52, rel_tol=1e-12)
    # swapping the layers changes the answer: 0.2 * 0.6 + 0.8 * 0.5 * 0.4 = 0.28
    image, _ = composite_over(colours.flip(1), alphas.flip(1), dim=1)
    assert math.isclose(image.item(), 0.28, rel_tol=1e-12)


@pytest.mark.parametrize("background", [0.0, 0.3])
def test_composite_over_equals_alpha_over_fold(background):
    # catches: the vectorised reversed-cumprod closed form disagreeing with the literal back-to-front fold
    B, M, C, H, W = 2, 3, 1, 4, 5
    colours, alphas = torch.rand(B, M, C, H, W, dtype=DT), torch.rand(B, M, C, H, W, dtype=DT)
    image, weights = composite_over(colours, alphas, dim=1, background=background)
    colour, alpha = torch.full((B, C, H, W), background, dtype=DT), torch.ones(B, C, H, W, dtype=DT)
    for m in range(M):  # back to front, over an opaque background
        colour, alpha = alpha_over(colours[:, m], alphas[:, m], colour, alpha)
    assert torch.allclose(alpha, torch.ones_like(alpha))
    assert torch.allclose(image, colour, atol=1e-12)
    # per-layer weights plus the background's share sum to one
    background_share = (1 - alphas).prod(1)
    assert torch.allclose(weights.sum(1) + background_share, torch.ones_like(background_share), atol=1e-12)
    # and ``dim`` other than 1 gives the same answer
    image2, _ = composite_over(colours.movedim(1, 0), alphas.movedim(1, 0), dim=0, background=background)
    assert torch.allclose(image2, image, atol=1e-12)


@pytest.mark.parametrize("background", [0.0, 0.3])
def test_composite_over_hand_backward_matches_autograd_of_the_fold(background):
    # catches: a wrong hand-written backward of composite_over (the layers' order in the prefix sum, the
    # background's share, the weights' own gradient, the broadcast alphas' reduction)
    torch.manual_seed(0)
    B, M, H, W = 2, 4, 3, 3
    colours = torch.rand(B, M, 1, H, W, dtype=DT, requires_grad=True)
    alphas = torch.rand(B, M, 1, H, W, dtype=DT).requires_grad_()
    presence = torch.rand(B, M, 1, 1, 1, dtype=DT, requires_grad=True)
    image, weights = composite_over(colours, alphas * presence, dim=1, background=background)
    g_image, g_weights = torch.randn_like(image), torch.randn_like(weights)
    grads = torch.autograd.grad((image * g_image).sum() + (weights * g_weights).sum(), (colours, alphas, presence))
    # the literal fold, differentiated by autograd
    a = alphas * presence
    colour = torch.full((B, 1, H, W), background, dtype=DT)
    for m in range(M):
        colour = a[:, m] * colours[:, m] + (1 - a[:, m]) * colour
    ref_weights = torch.stack([a[:, m] * (1 - a[:, m + 1:]).prod(1) for m in range(M)], 1)
    ref = torch.autograd.grad((colour * g_image).sum() + (ref_weights * g_weights).sum(), (colours, alphas, presence))
    for got, want in zip(grads, ref):
        assert torch.allclose(got, want, atol=1e-10)


def test_composite_over_gradients_finite_at_opaque_and_clear_layers():
    # catches: 0/0 or inf in the hand backward where an alpha is exactly 0 or 1 (the clamp boundary)
    alphas = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5], dtype=DT).view(1, 5, 1, 1, 1).requires_grad_()
    colours = torch.rand(1, 5, 1, 1, 1, dtype=DT, requires_grad=True)
    image, _ = composite_over(colours, alphas, dim=1, background=0.2)
    image.sum().backward()
    assert torch.isfinite(alphas.grad).all() and torch.isfinite(colours.grad).all()
    # the front opaque layer (index 2) decides the pixel: only the layers from it forwards have a say
    assert colours.grad.flatten()[:2].abs().max() < 1e-5


def test_compiled_compositing_matches_eager():
    # catches: the torch.compile path of composite_over (train.compile / --compile) computing something else, or
    # a compiled call leaving the compiled path on for later calls that did not ask for it
    from probcaps import render

    torch.manual_seed(0)
    colours = torch.rand(2, 5, 1, 6, 7, requires_grad=True)
    alphas = torch.rand(2, 5, 1, 6, 7, requires_grad=True)

    def image_and_grads(compiled=False):
        image, weights = composite_over(colours, alphas, dim=1, background=0.2, compiled=compiled)
        loss = (image * torch.linspace(0, 1, 7)).sum() + weights[:, 2].sum()
        return (image.detach(), *torch.autograd.grad(loss, (colours, alphas)))

    layers = torch.cat([colours, alphas], 2).detach().requires_grad_()

    def image_and_grads_of_layers(compiled=False):
        # composite_layers: colour and alpha as channels 0 and 1 of one tensor; the same image and gradients
        image, weights = render.composite_layers(layers, dim=1, background=0.2, compiled=compiled)
        loss = (image * torch.linspace(0, 1, 7)).sum() + weights[:, 2].sum()
        (grad,) = torch.autograd.grad(loss, layers)
        return (image.detach(), grad[:, :, :1], grad[:, :, 1:])

    eager = image_and_grads()
    assert all(torch.allclose(got, want, atol=1e-6) for got, want in zip(image_and_grads_of_layers(), eager))
    compiled = image_and_grads(compiled=True)
    compiled_layers = image_and_grads_of_layers(compiled=True)
    assert {render._composite_over, render._composite_layers} <= set(render._COMPILED)  # the compiled path ran
    for got, want in zip(compiled, eager):
        assert torch.allclose(got, want, atol=1e-5)
    for got, want in zip(compiled_layers, eager):
        assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="2 channels"):
        render.composite_layers(torch.rand(2, 5, 3, 6, 7))


# ------------------------------------------------------------------------------------------ footprint rendering

def _mixed_poses(B, M, dtype, generator, speck=0.05):
    """Poses of every kind the footprint renderer must handle: ordinary, partly and wholly off the canvas, far
    larger than the canvas, tiny (``speck`` times an ordinary scale), and singular."""
    raw = torch.randn(B, M, 6, generator=generator, dtype=dtype)
    scale = 0.4 + 1.2 * torch.rand(B, M, 2, generator=generator, dtype=dtype)
    kind = torch.arange(B * M).view(B, M) % 8
    scale[kind == 3] *= 6.0                                       # window bigger than the canvas
    scale[kind == 4] *= speck                                     # a speck
    theta = raw[..., 2]
    shift = 0.6 * torch.tanh(raw[..., 4:6])
    shift[kind == 1] = torch.sign(raw[kind == 1][:, 4:6]) * 0.95  # partly off the canvas
    shift[kind == 2] = torch.sign(raw[kind == 2][:, 4:6]) * 2.5   # wholly off the canvas
    P = affine_matrix(scale[..., 0], scale[..., 1], theta, 0.3 * torch.tanh(raw[..., 3]), shift[..., 0], shift[..., 1])
    P[kind == 5, :2, :2] = 0.0                                    # singular: renders nothing
    return P


def _render_and_grads(templates, presences, poses, size, footprint, background=0.0, contributions=False):
    templates = templates.detach().requires_grad_()
    presences = presences.detach().requires_grad_()
    poses = poses.detach().requires_grad_()
    scale = torch.stack([torch.ones_like(presences), presences], -1)[..., None, None]
    image, shares = render_over(templates * scale, poses, size, background=background, footprint=footprint,
                                contributions=contributions)
    torch.manual_seed(5)
    loss = (image * torch.rand_like(image)).sum()
    if contributions:
        loss = loss + (shares * torch.rand_like(shares)).sum()
    grads = torch.autograd.grad(loss, (templates, presences, poses))
    return (image.detach(), None if shares is None else shares.detach(), *grads)


# the window's sampling grid is the same map as the full canvas' with other roundings; a speck's pose gradients are
# those roundings amplified by its inverse scale, so in float32 the specks are 5x larger than in float64 (where
# everything agrees to ~1e-13)
@pytest.mark.parametrize("dtype, atol, rtol, speck", [(torch.float32, 1e-5, 1e-5, 0.25),
                                                      (torch.float64, 1e-10, 1e-10, 0.05)])
@pytest.mark.parametrize("background", [0.0, 0.3])
def test_footprint_rendering_equals_full_canvas(dtype, atol, rtol, speck, background, monkeypatch):
    # catches: a window that misses part of a template's support (a clipped edge, the bilinear half pixel, a
    # template partly or wholly off the canvas), a window placed at the wrong offset, parts mixed up between
    # images, a wrong prefix sum over the layers in the footprint compositing or its hand-written backward, and
    # the parts too large for a window (rendered over the whole canvas) composited out of order
    monkeypatch.setattr(render, "WINDOW_SIZE_COST", 0)  # several window sizes even for these few parts
    gen = torch.Generator().manual_seed(0)
    B, M, t, size = 3, 16, 7, (24, 28)
    monkeypatch.setattr(render, "CHUNK_ELEMENTS", 2 * M * size[0] * size[1])  # chunks of 2 images and 1
    templates = torch.rand(M, 2, t, t, generator=gen, dtype=dtype)
    presences = torch.rand(B, M, generator=gen, dtype=dtype)
    poses = _mixed_poses(B, M, dtype, gen, speck)
    box = footprints(poses.view(-1, 3, 3), (t, t), size)
    extents = torch.maximum(box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]) + 1
    sides = window_sides(extents, size)
    # windows of several sizes, the whole canvas among them, and the footprint path taken
    assert len(sides) >= 2 and sides[-1] >= max(size)
    assert render._window_cost(extents, sides, size) <= render.MAX_WINDOW_SHARE * extents.numel() * size[0] * size[1]
    footprint = _render_and_grads(templates, presences, poses, size, True, background, contributions=True)
    full = _render_and_grads(templates, presences, poses, size, False, background, contributions=True)
    for name, got, want in zip(["image", "contributions", "templates", "presences", "poses"], footprint, full):
        # relative to the largest entry: a gradient summed over many pixels with cancellation has small entries
        # that carry the larger ones' rounding
        error, scale = (got - want).abs().max(), want.abs().max()
        assert error <= atol + rtol * scale, (name, error, scale)
    assert full[0].abs().max() > 0.1 and full[4].abs().max() > 0.1  # the comparison is not between zeros
    assert torch.all(full[4][(torch.arange(B * M).view(B, M) % 8) == 2] == 0)  # off the canvas: no gradient


def test_window_sides_minimise_the_pixels_sampled(monkeypatch):
    # catches: a wrong dynamic programme (a side that does not hold its parts, a worse choice than another set of
    # sides, or the per-size cost ignored)
    from itertools import combinations

    extents = torch.tensor([3] * 100 + [9] * 30 + [20] * 2)
    # one size: 132 * 400 + 20000; [9, 20]: 130 * 81 + 2 * 400 + 40000; [3, 9, 20]: 900 + 2430 + 800 + 60000
    assert window_sides(extents, (40, 40)) == [9, 20]
    assert window_sides(extents, (40, 40), max_sizes=1) == [20]
    monkeypatch.setattr(render, "WINDOW_SIZE_COST", 0)
    assert window_sides(extents, (40, 40)) == [3, 9, 20]
    monkeypatch.setattr(render, "WINDOW_SIZE_COST", 50)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        extents = torch.randint(1, 13, (60,), generator=gen)
        best = window_sides(extents, (12, 10))
        assert best[-1] == int(extents.max())
        cost = render._window_cost(extents, best, (12, 10)) + render.WINDOW_SIZE_COST * len(best)
        for n in (1, 2, 3):
            for sides in combinations(range(1, int(extents.max()) + 1), n):
                if sides[-1] == int(extents.max()):
                    other = render._window_cost(extents, list(sides), (12, 10)) + render.WINDOW_SIZE_COST * n
                    assert cost <= other


def test_footprint_rendering_all_parts_too_large_falls_back_to_full_canvas():
    # catches: the window path taken with no part fitting a window (an empty window group) or a window side
    # larger than the canvas
    gen = torch.Generator().manual_seed(1)
    templates = torch.rand(4, 2, 5, 5, generator=gen)
    presences = torch.rand(2, 4, generator=gen)
    poses = affine_matrix(torch.full((2, 4), 4.0), torch.full((2, 4), 4.0), torch.rand(2, 4, generator=gen),
                          torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4))
    for got, want in zip(_render_and_grads(templates, presences, poses, 12, True),
                         _render_and_grads(templates, presences, poses, 12, False)):
        assert (got is None and want is None) or torch.equal(got, want)


def test_footprint_rendering_of_opaque_layers_equals_full_canvas():
    # catches: the footprint compositing's backward missing the clamp's stopped gradient where α reaches 1
    gen = torch.Generator().manual_seed(2)
    B, M, t, size = 2, 6, 5, 24
    templates = torch.rand(M, 2, t, t, generator=gen, dtype=torch.float64)
    templates[:, 1, 1:4, 1:4] = 1.0                                   # opaque centres
    presences = torch.ones(B, M, dtype=torch.float64)
    scale = 0.8 + 0.4 * torch.rand(B, M, generator=gen, dtype=torch.float64)
    poses = affine_matrix(scale, scale, torch.rand(B, M, generator=gen, dtype=torch.float64), torch.zeros(B, M),
                          *(0.5 * torch.rand(2, B, M, generator=gen, dtype=torch.float64) - 0.25))
    box = footprints(poses.view(-1, 3, 3), (t, t), (size, size))
    extents = torch.maximum(box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]) + 1
    cost = render._window_cost(extents, window_sides(extents, (size, size)), (size, size))
    assert cost <= render.MAX_WINDOW_SHARE * B * M * size * size  # the footprint path is taken
    footprint = _render_and_grads(templates, presences, poses, size, True)
    full = _render_and_grads(templates, presences, poses, size, False)
    assert render_templates(templates, poses, size)[:, :, 1].max() >= render.ALPHA_CLAMP  # α at the clamp
    for name, got, want in zip(["image", "contributions", "templates", "presences", "poses"], footprint, full):
        assert (got is None and want is None) or torch.allclose(got, want, atol=1e-10, rtol=1e-10), name


def test_footprint_of_a_template_hand_computed():
    # catches: the reach of bilinear sampling past the template's edge pixels left out, or the box rounded inwards
    # a 2x2 template at the identity on an 8x8 canvas puts its pixels on canvas pixels 3..4; bilinear sampling
    # reaches one source pixel (here one canvas pixel) past their centres, to pixels 2 and 5 (value 0 there, but
    # pixel 2's gradient w.r.t. the pose is not 0)
    P = torch.eye(3).view(1, 3, 3)
    assert footprints(P, (2, 2), (8, 8)).tolist() == [[2, 2, 5, 5]]
    # one pixel right (2/8 in canvas units), and far off the left edge: an empty range (x1 < x0)
    assert footprints(translation_matrix(torch.tensor([0.25]), torch.tensor([0.0])), (2, 2), (8, 8)).tolist() \
        == [[3, 2, 6, 5]]
    off = footprints(translation_matrix(torch.tensor([-3.0]), torch.tensor([0.0])), (2, 2), (8, 8))[0]
    assert off[2] < off[0]


def test_footprint_rendering_two_parts_hand_computed():
    # catches: the over rule applied in the wrong order or to the wrong pixels by the footprint compositing
    # a 2x2 template at the identity lands exactly on pixels 3..4 of an 8x8 canvas (no interpolation); part 1 one
    # pixel right, in front of part 0.  Pixel (row 3, col 4): part 0's template pixel (0, 1), part 1's (0, 0).
    colour = torch.tensor([[0.2, 0.4], [0.6, 0.8]])
    alpha = torch.tensor([[0.5, 0.25], [1.0, 0.75]])
    templates = torch.stack([colour, alpha]).expand(2, 2, 2, 2)
    poses = torch.stack([torch.eye(3), translation_matrix(torch.tensor(0.25), torch.tensor(0.0))]).unsqueeze(0)
    image, _ = render_over(templates, poses, 8, background=0.1)
    front = 0.2 * 0.5 + (1 - 0.5) * (0.4 * 0.25 + (1 - 0.25) * 0.1)
    assert image[0, 0, 3, 4].item() == pytest.approx(front, abs=1e-6)
    assert image[0, 0, 3, 3].item() == pytest.approx(0.2 * 0.5 + 0.5 * 0.1, abs=1e-6)   # part 0 only
    assert image[0, 0, 3, 5].item() == pytest.approx(0.4 * 0.25 + 0.75 * 0.1, abs=1e-6)  # part 1 only
    assert image[0, 0, 0, 0].item() == pytest.approx(0.1, abs=1e-7)                      # background
    full, _ = render_over(templates, poses, 8, background=0.1, footprint=False)
    assert torch.allclose(image, full, atol=1e-6)


def test_capsule_model_renderer_is_an_argument_and_no_state():
    # catches: the footprint and full-canvas renderers of the capsule model giving different images or gradients,
    # a renderer or compile flag stored in the state dict (old checkpoints would not load), or a compiled model
    # switching compiled compositing on for another model
    from probcaps import render
    from probcaps.models.capsule_model import CapsuleModel, CapsuleModelConfig

    cfg = CapsuleModelConfig(num_parents=3, num_parts=6, template_size=5, canvas_size=16)
    full = CapsuleModel(cfg, footprint=False)
    footprint = CapsuleModel(cfg)
    compiled = CapsuleModel(cfg, footprint=False, compile=True)
    assert footprint.footprint and not footprint.compile
    assert list(footprint.state_dict()) == list(full.state_dict()) == list(compiled.state_dict())
    footprint.load_state_dict(full.state_dict())
    gen = torch.Generator().manual_seed(2)
    z0 = torch.rand(4, 6, generator=gen)
    y0 = 0.3 * torch.randn(4, 6, 6, generator=gen)
    y0[0, 0, 4] = 0.9  # partly off the canvas
    images = []
    for model in (full, footprint):
        image, shares = model.render(z0, y0.requires_grad_())
        (grad,) = torch.autograd.grad(image.square().sum() + shares.sum(), y0)
        images.append((image.detach(), shares.detach(), grad))
    for got, want in zip(*images):
        assert torch.allclose(got, want, atol=1e-5)
    compiled.render(z0, y0)
    cached = dict(render._COMPILED)
    render._COMPILED.clear()
    try:
        full.render(z0, y0)  # an eager model after a compiled one: the compiled path is not taken
        assert not render._COMPILED
    finally:
        render._COMPILED.update(cached)
