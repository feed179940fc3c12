"""EM routing (log space), the matrix-capsule layers and the spread loss."""

from __future__ import annotations

import math

import pytest
import torch

from probcaps.models.em_routing import (
    EMConfig,
    conv_votes_cache,
    em_routing,
    em_routing_conv,
    pose_transform_matrix,
    votes_cache,
)
from probcaps.models.matrix_capsules import (
    ClassCaps,
    ConvCaps,
    MatrixCapsConfig,
    MatrixCapsNet,
    _patch_index,
    patch_normaliser,
    spread_loss,
    spread_margin,
)


def _routing_inputs(N=3, J=2, I=5, dtype=torch.double, seed=0):
    g = torch.Generator().manual_seed(seed)
    votes = torch.randn(N, J, I, 16, generator=g, dtype=dtype)
    log_a = torch.rand(N, I, generator=g, dtype=dtype).log()
    beta_v = torch.randn(J, generator=g, dtype=dtype)
    beta_a = torch.randn(J, generator=g, dtype=dtype)
    return votes, log_a, beta_v, beta_a


def test_m_step_hand_computed():
    # two inputs with votes 0 and 2 (every entry), activations 1 and 1, one parent: mu = 1, var = 1 + floor,
    # cost = S_rel sum_h(beta_v + log sigma_h) = 16 * 0.5 log(1 + floor) (S_rel = 1), a = sigmoid(beta_a - cost)
    votes = torch.stack([torch.zeros(16), 2 * torch.ones(16)])[None, None].double()  # (1, 1, 2, 16)
    cfg = EMConfig(iterations=1, var_floor=1e-4, standardise_cost=False)
    mu, var, log_a, log_R = em_routing(votes, torch.zeros(1, 2).double(), torch.zeros(1).double(),
                                       torch.zeros(1).double(), cfg)
    assert torch.allclose(mu, torch.ones(1, 1, 16).double())
    assert torch.allclose(var, torch.full((1, 1, 16), 1 + 1e-4).double())
    expected = torch.nn.functional.logsigmoid(torch.tensor(-8 * math.log(1 + 1e-4))).double()
    assert torch.allclose(log_a, expected.view(1, 1))
    # standardised over two parents with costs c and -c: activations sigmoid(beta_a -+ 1) whatever c is
    two = torch.cat([votes, 3 * votes], 1)  # parent 1's votes spread 3x more: higher cost
    _, _, log_a, _ = em_routing(two, torch.zeros(1, 2).double(), torch.zeros(2).double(), torch.zeros(2).double(),
                                EMConfig(iterations=1))
    assert torch.allclose(log_a.exp(), torch.tensor([[1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))]]).double())
    # activations weight the mean: a = (1, 1/3) -> mu = (0 * 1 + 2 / 3) / (4 / 3) = 0.5
    mu, *_ = em_routing(votes, torch.tensor([[0.0, math.log(1 / 3)]]).double(), torch.zeros(1).double(),
                        torch.zeros(1).double(), cfg)
    assert torch.allclose(mu, torch.full((1, 1, 16), 0.5).double())


def test_e_step_assigns_votes_to_the_nearer_cluster():
    # parent j's votes cluster around j * 10 except input 0, which votes 0 for both: after routing, inputs
    # 1..4 send almost everything to the parent whose cluster they are in, and every row of R sums to 1
    g = torch.Generator().manual_seed(1)
    votes = 0.1 * torch.randn(1, 2, 5, 16, generator=g).double()
    votes[0, 1] += 10.0
    votes[0, :, 0] = 0.0
    mu, var, log_a, log_R = em_routing(votes, torch.zeros(1, 5).double(), torch.zeros(2).double(),
                                       torch.zeros(2).double(), EMConfig(iterations=3))
    R = log_R.exp()[0]
    assert torch.allclose(R.sum(0), torch.ones(5).double())
    assert R[0, 0] > 0.99  # input 0's vote (0) is at parent 0's mean, 10 standard deviations from parent 1's


def test_final_m_step_gradient_is_exact():
    # with one iteration there is no stop-gradient: the hand-written backward must match finite differences
    votes, log_a, beta_v, beta_a = _routing_inputs()
    args = [t.requires_grad_() for t in (votes, log_a, beta_v, beta_a)]
    cfg = EMConfig(iterations=1)
    assert torch.autograd.gradcheck(lambda v, la, bv, ba: em_routing(v, la, bv, ba, cfg)[:3], args)
    M = torch.randn(3, 5, 4, 4, dtype=torch.double, requires_grad=True)
    W = torch.randn(5, 2, 4, 4, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda M, W, la: em_routing_conv(M, W, la, beta_v, beta_a, cfg)[:3],
                                    (M, W, log_a))


def test_conv_votes_are_pose_times_transform():
    M = torch.randn(3, 5, 4, 4, dtype=torch.double)
    W = torch.randn(5, 2, 4, 4, dtype=torch.double)
    explicit = torch.einsum("nirk,ijkc->njirc", M, W).reshape(3, 2, 5, 16)
    fused, plain = conv_votes_cache(M, W), votes_cache(explicit)
    assert torch.allclose(fused.VV, plain.VV) and torch.allclose(fused.center, plain.center)
    # K applies W[i, j] to every row of a flattened pose: identity pose -> the transform itself
    K = pose_transform_matrix(W)
    assert torch.allclose((torch.eye(4, dtype=torch.double).reshape(16) @ K[0]).view(2, 4, 4), W[0])
    la = torch.rand(3, 5, dtype=torch.double).log()
    out_fused = em_routing_conv(M, W, la, torch.zeros(2).double(), torch.zeros(2).double())
    out_plain = em_routing(explicit, la, torch.zeros(2).double(), torch.zeros(2).double())
    for a, b in zip(out_fused, out_plain):
        assert torch.allclose(a, b)


@pytest.mark.parametrize("case", ["huge", "tiny", "identical", "zero_activations", "mixed"])
def test_routing_never_produces_nan_or_inf(case):
    g = torch.Generator().manual_seed(2)
    votes = torch.randn(4, 3, 6, 16, generator=g)
    log_a = torch.rand(4, 6, generator=g).log()
    if case == "huge":
        votes = votes * 1e6
    elif case == "tiny":
        votes = votes * 1e-6
    elif case == "identical":          # zero variance: the floor keeps log sigma and 1/sigma^2 finite
        votes = torch.ones(4, 3, 6, 16)
    elif case == "zero_activations":   # log 0 = -inf everywhere
        log_a = torch.full((4, 6), -math.inf)
    else:                              # huge and tiny votes, saturated and dead activations together
        votes[0] *= 1e7
        votes[1] *= 1e-7
        log_a[0] = 0.0
        log_a[1] = -math.inf
    votes.requires_grad_()
    beta_v = torch.zeros(3, requires_grad=True)
    beta_a = torch.zeros(3, requires_grad=True)
    mu, var, log_a_out, log_R = em_routing(votes, log_a, beta_v, beta_a, EMConfig(iterations=3))
    for t in (mu, var, log_a_out, log_R):
        assert torch.isfinite(t).all()
    assert torch.allclose(log_R.exp().sum(1), torch.ones(4, 6), atol=1e-5)
    (mu.sum() + log_a_out.sum()).backward()
    assert torch.isfinite(votes.grad).all() and torch.isfinite(beta_v.grad).all()


def test_patch_normaliser_sums_over_overlapping_patches():
    # 5x5 input, 3x3 kernel, stride 1: an input capsule sits in up to 9 patches; its assignments over every
    # (patch, parent) pair must sum to 1 (checked by brute force over positions)
    b, t, J, size, k, s = 2, 2, 3, 5, 3, 1
    out = (size - k) // s + 1
    P, KK = out * out, k * k
    index = _patch_index(size, k, s)
    logits = torch.randn(b * P, J, KK * t, dtype=torch.double)
    log_R = patch_normaliser(index, b, P, KK, t, size * size)(logits)
    R = log_R.exp().view(b, P, J, KK, t)
    totals = torch.zeros(b, t, size * size, dtype=torch.double)
    for p in range(P):                 # brute force (a test may loop)
        for kk in range(KK):
            totals[:, :, index[p * KK + kk]] += R[:, p, :, kk, :].sum(1)
    covered = torch.zeros(size * size, dtype=torch.bool)
    covered[index] = True
    assert torch.allclose(totals[:, :, covered], torch.ones_like(totals[:, :, covered]))
    # the centre location is in all 9 patches; a corner in one
    assert int((index == 12).sum()) == 9 and int((index == 0).sum()) == 1


def test_conv_caps_shapes_and_gradients():
    torch.manual_seed(0)
    layer = ConvCaps(in_types=2, out_types=3, kernel=3, stride=2, em=EMConfig())
    pose = torch.randn(2, 2, 16, 7, 7, requires_grad=True)
    log_a = torch.nn.functional.logsigmoid(torch.randn(2, 2, 7, 7))
    out_pose, out_log_a = layer(pose, log_a)
    assert out_pose.shape == (2, 3, 16, 3, 3) and out_log_a.shape == (2, 3, 3, 3)
    assert (out_log_a <= 0).all()
    (out_pose.sum() + out_log_a.sum()).backward()
    assert pose.grad.abs().sum() > 0 and layer.W.grad.abs().sum() > 0 and layer.beta_a.grad.abs().sum() > 0


def test_class_caps_coordinate_addition():
    # zero input poses and identity transforms: every vote is just the position's scaled (x, y), added to
    # entries (0, 3) and (1, 3); with equal activations the class pose there is the mean coordinate, 0.5
    caps = ClassCaps(in_types=1, classes=2, em=EMConfig(iterations=1), init_std=0.0)
    pose = torch.zeros(1, 1, 16, 4, 4)
    mu, log_a, _ = caps(pose, torch.zeros(1, 1, 4, 4))
    mu = mu.view(1, 2, 4, 4)
    half = torch.full((2,), 0.5)
    assert torch.allclose(mu[0, :, 0, 3], half) and torch.allclose(mu[0, :, 1, 3], half)
    assert torch.allclose(mu[0, :, 2:, :], torch.zeros(2, 2, 4))
    assert torch.allclose(mu[0, :, :, :3], torch.zeros(2, 4, 3))
    caps_off = ClassCaps(in_types=1, classes=2, em=EMConfig(iterations=1), coordinate_addition=False, init_std=0.0)
    assert torch.allclose(caps_off(pose, torch.zeros(1, 1, 4, 4))[0], torch.zeros(1, 2, 16))


def test_network_forward_shapes():
    net = MatrixCapsNet(MatrixCapsConfig(A=8, B=2, C=2, D=2))
    poses, log_a = net.capsules(torch.rand(2, 1, 32, 32))
    assert poses.shape == (2, 5, 4, 4) and log_a.shape == (2, 5) and torch.isfinite(log_a).all()


def test_conv1_batchnorm_removes_the_inputs_scale_and_old_checkpoints_still_load():
    # in training mode batch normalisation divides each channel by its batch std, so the network's output for a
    # batch and for that batch times 7 agree (conv1's bias is removed with the mean); without it they differ
    torch.manual_seed(0)
    x = torch.rand(4, 1, 32, 32)
    with_bn = MatrixCapsNet(MatrixCapsConfig(A=8, B=2, C=2, D=2, conv1_batchnorm=True)).train()
    assert torch.allclose(with_bn(x), with_bn(7 * x), atol=5e-3)  # up to the eps in the normaliser
    plain = MatrixCapsNet(MatrixCapsConfig(A=8, B=2, C=2, D=2))
    assert (plain(x) - plain(7 * x)).abs().max() > 0.05
    # the option off adds no parameters: checkpoints written before it existed load unchanged
    assert set(plain.state_dict()) == {k for k in with_bn.state_dict() if not k.startswith("conv1_norm.")}


def test_spread_loss_hand_computed():
    # a = (0.9, 0.5, 0.1), target 0, m = 0.5: (0.5 - 0.4)^2 + max(0, 0.5 - 0.8)^2 = 0.01
    log_a = torch.tensor([[0.9, 0.5, 0.1]]).log()
    assert spread_loss(log_a, torch.tensor([0]), 0.5).item() == pytest.approx(0.01)
    # target 2: (0.5 + 0.8)^2 + (0.5 + 0.4)^2 = 1.69 + 0.81
    assert spread_loss(log_a, torch.tensor([2]), 0.5).item() == pytest.approx(2.5)
    assert spread_margin(0, 100) == pytest.approx(0.2)
    assert spread_margin(50, 100) == pytest.approx(0.55)
    assert spread_margin(500, 100) == pytest.approx(0.9)
