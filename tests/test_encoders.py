"""Tests for probcaps.encoders: shapes, key masking, permutation symmetry, PartEncoder outputs and gradients."""

import pytest
import torch

from probcaps import encoders
from probcaps.encoders import ISAB, MAB, PMA, SAB, PartEncoder, PartOutput, SetTransformer

B, N, D = 3, 7, 8


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=[False, True], ids=["explicit", "sdpa"])
def attention_kernel(request, monkeypatch):
    monkeypatch.setattr(encoders, "USE_SDPA", request.param)
    return request.param


def _mask():
    w = torch.rand(B, N) * 0.9 + 0.1
    w[:, -3:] = 0.0  # last three elements hard-masked
    w[1, 0] = 0.0  # and one more in the middle of the set, in one batch row
    return w


def _perturb_masked(x, w):
    x2 = x.clone()
    x2[w == 0] = 3.0 * torch.randn_like(x2[w == 0])
    return x2


def _blocks():
    # name -> (module, fn(module, x, w) -> output)
    Q = torch.randn(B, 4, 5)
    return {
        "MAB": (MAB(5, D, 16, 4), lambda m, x, w: m(Q, x, w)),
        "SAB": (SAB(D, 16, 4), lambda m, x, w: m(x, w)),
        "ISAB": (ISAB(D, 16, 4, 5), lambda m, x, w: m(x, w)),
        "PMA": (PMA(D, 2, 3), lambda m, x, w: m(x, w)),
        "SetTransformer": (SetTransformer(D, 3, 10, dim_hidden=32), lambda m, x, w: m(x, w)),
    }


@pytest.mark.parametrize(
    "name, shape",
    [
        ("MAB", (B, 4, 16)),
        ("SAB", (B, N, 16)),
        ("ISAB", (B, N, 16)),
        ("PMA", (B, 3, D)),
        ("SetTransformer", (B, 3, 10)),
    ],
)
def test_shapes(name, shape, attention_kernel):
    m, f = _blocks()[name]
    x = torch.randn(B, N, D)
    assert f(m, x, None).shape == shape
    assert f(m, x, _mask()).shape == shape


def test_no_ln_and_defaults():
    st = SetTransformer(16, 5, 12, ln=False)
    assert st(torch.randn(2, 40, 16)).shape == (2, 5, 12)
    with pytest.raises(ValueError):
        MAB(4, 4, 10, 4)


@pytest.mark.parametrize("name", ["MAB", "ISAB", "PMA", "SetTransformer", "SAB"])
def test_hard_mask_ignores_masked_values(name, attention_kernel):
    m, f = _blocks()[name]
    x, w = torch.randn(B, N, D), _mask()
    x2 = _perturb_masked(x, w)
    with torch.no_grad():
        y, y2 = f(m, x, w), f(m, x2, w)
        y_nomask, y2_nomask = f(m, x, None), f(m, x2, None)
    if name in ("SAB", "ISAB"):  # equivariant: masked elements' own outputs may change; compare the others
        keep = w > 0
        y, y2, y_nomask, y2_nomask = y[keep], y2[keep], y_nomask[keep], y2_nomask[keep]
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=0)
    # the test can fail: without the mask the same perturbation does change the output
    assert (y_nomask - y2_nomask).abs().max() > 1e-2


def test_bool_mask_matches_float_mask(attention_kernel):
    st = SetTransformer(D, 2, 4, dim_hidden=16)
    x, w = torch.randn(B, N, D), _mask()
    torch.testing.assert_close(st(x, w > 0), st(x, (w > 0).float()))


def test_soft_weights_count_as_copies(attention_kernel):
    # weight w on a key is the same as w copies of it: {a:0.5, a:0.5, b:1} == {a:1, b:1}
    m = MAB(5, D, 16, 4)
    Q, a, b = torch.randn(B, 4, 5), torch.randn(B, 1, D), torch.randn(B, 1, D)
    y1 = m(Q, torch.cat([a, b], 1), torch.ones(B, 2))
    y2 = m(Q, torch.cat([a, a, b], 1), torch.tensor([0.5, 0.5, 1.0]).expand(B, 3))
    torch.testing.assert_close(y1, y2, atol=1e-5, rtol=1e-5)
    y3 = m(Q, torch.cat([a, b], 1), torch.tensor([0.2, 1.0]).expand(B, 2))
    assert (y1 - y3).abs().max() > 1e-3


def test_all_keys_masked_is_finite(attention_kernel):
    st = SetTransformer(D, 2, 4, dim_hidden=16)
    y = st(torch.randn(B, N, D), torch.zeros(B, N))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("use_mask", [False, True])
def test_permutation_symmetry(use_mask, attention_kernel):
    blocks = _blocks()
    x = torch.randn(B, N, D)
    w = _mask() if use_mask else None
    perm = torch.randperm(N)
    while (perm == torch.arange(N)).all():
        perm = torch.randperm(N)
    xp, wp = x[:, perm], (w[:, perm] if use_mask else None)
    with torch.no_grad():
        for name in ("SetTransformer", "PMA", "MAB"):  # invariant in the key set
            m, f = blocks[name]
            torch.testing.assert_close(f(m, xp, wp), f(m, x, w), atol=1e-5, rtol=1e-5)
        for name in ("SAB", "ISAB"):  # equivariant
            m, f = blocks[name]
            torch.testing.assert_close(f(m, xp, wp), f(m, x, w)[:, perm], atol=1e-5, rtol=1e-5)
        # and the test can fail: permuting x but not the weights changes the output
        if use_mask:
            m, f = blocks["SetTransformer"]
            assert (f(m, xp, w) - f(m, x, w)).abs().max() > 1e-3


def test_set_transformer_grads():
    st = SetTransformer(D, 3, 10, dim_hidden=32)
    x = torch.randn(B, N, D, requires_grad=True)
    st(x, _mask()).square().sum().backward()
    for name, p in st.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert x.grad[_mask() > 0].abs().sum() > 0


@pytest.mark.parametrize("hw", [(40, 40), (28, 28), (33, 21)])
def test_part_encoder_shapes_finite_and_grads(hw):
    M, F_ = 10, 5
    enc = PartEncoder(M, channels=(16, 16, 16, 16), feature_dim=F_)
    x = torch.rand(2, 1, *hw)
    out = enc(x)
    assert isinstance(out, PartOutput)
    assert out.presence_logit.shape == (2, M)
    assert out.pose.shape == out.pose_raw.shape == (2, M, 6)
    assert out.features.shape == (2, M, F_)
    for t in out:
        assert torch.isfinite(t).all()
    (out.presence_logit.sum() + out.pose.square().sum() + out.features.square().sum()).backward()
    convs = [m for m in enc.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 5
    for c in convs:
        assert c.weight.grad is not None and torch.isfinite(c.weight.grad).all()
        assert c.weight.grad.abs().sum() > 0
    # the attention logits (last of each part's head channels) are trained too
    att_grad = enc.head.weight.grad.view(M, 6 + 1 + F_ + 1, -1)[:, -1]
    assert (att_grad.abs().sum(-1) > 0).all()


def test_part_encoder_initialisation():
    enc = PartEncoder(40, channels=(32, 32, 32, 32))
    out = enc(torch.rand(8, 1, 40, 40))
    assert out.presence_logit.abs().max() < 0.5  # presence probabilities start near 1/2
    t = out.pose[..., [2, 5]]  # translations, (B, M, 2)
    assert t.std(dim=1).min() > 0.15  # parts start spread over the canvas...
    assert t.abs().max() < 0.75  # ...within its central part
    # distinct starting positions for (nearly) all parts
    d = torch.cdist(t[0], t[0]) + torch.eye(40) * 10
    assert d.min() > 0.05
    # and the pose still depends on the image
    out2 = enc(torch.rand(8, 1, 40, 40))
    assert (out.pose_raw - out2.pose_raw).abs().max() > 1e-4


@pytest.mark.parametrize("kw", [dict(max_translation=0.4), dict(min_scale=0.5, max_scale=1.2, max_translation=0.7)])
def test_part_encoder_pose_ranges(kw):
    enc = PartEncoder(12, channels=(8, 8), strides=(2, 1), feature_dim=3, pose_kwargs=kw, attention_translation=False)
    with torch.no_grad():  # blow up the head so the squashing saturates and the range limits are exercised
        enc.head.weight.mul_(300.0)
        enc.head.bias.mul_(30.0)
    out = enc(torch.rand(16, 1, 28, 28) * 4 - 2)
    max_t = kw["max_translation"]
    t = out.pose[..., [2, 5]]
    assert t.abs().max() <= max_t + 1e-6
    assert t.abs().max() > 0.9 * max_t  # the bound is reached, so the check above is not vacuous
    # scales: the columns of the linear part A = R Sh S have norms sx (first column) ...
    A = out.pose[..., [0, 1, 3, 4]].reshape(16, 12, 2, 2) + torch.eye(2)
    sx = A[..., :, 0].norm(dim=-1)
    lo, hi = kw.get("min_scale", 0.3), kw.get("max_scale", 2.0)
    assert sx.min() >= lo - 1e-5 and sx.max() <= hi + 1e-5
    torch.testing.assert_close(out.pose, encoders.constrained_pose(out.pose_raw, **kw))


def test_part_encoder_bad_config():
    with pytest.raises(ValueError):
        PartEncoder(4, channels=(8, 8), strides=(2,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_matches_cpu():
    st, enc = SetTransformer(D, 3, 10, dim_hidden=32), PartEncoder(6, channels=(8, 8, 8, 8))
    x, w, img = torch.randn(B, N, D), _mask(), torch.rand(2, 1, 28, 28)
    y = st(x, w)
    p = enc(img)
    y_cuda = st.cuda()(x.cuda(), w.cuda()).cpu()
    p_cuda = enc.cuda()(img.cuda())
    torch.testing.assert_close(y_cuda, y, atol=1e-4, rtol=1e-4)
    for a, b in zip(p_cuda, p):
        torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4)


def test_position_grid_hand_values():
    # catches: cell centres off by half a cell or with x/y swapped (parts would be placed off target)
    g = encoders._position_grid(2, 3, "cpu", torch.float32)
    expected = torch.tensor([[-2 / 3, -0.5], [0.0, -0.5], [2 / 3, -0.5], [-2 / 3, 0.5], [0.0, 0.5], [2 / 3, 0.5]])
    torch.testing.assert_close(g, expected)


def test_attention_translation_places_part_where_it_looks():
    # catches: translation not following the attention (the part would not move with the feature it attends to)
    enc = PartEncoder(3, channels=(4,), strides=(1,), feature_dim=2, pose_kwargs={"max_translation": 0.5})
    x = torch.rand(2, 1, 6, 6)
    with torch.no_grad():
        enc.head.weight.zero_()
        enc.head.bias.zero_()
        P = enc.n_param + 1
        # part 0 attends only to feature-map cell (row 1, col 4): a large attention logit there via the bias is not
        # spatial, so drive it through the input instead: a single bright pixel and a positive weight
        x = torch.zeros(2, 1, 6, 6)
        x[:, 0, 1, 4] = 1.0
        enc.cnn[0].weight.zero_()
        enc.cnn[0].weight[:, 0, 1, 1] = 1.0  # identity-like 3x3 kernel centre
        enc.cnn[0].bias.zero_()
        enc.head.weight.view(3, P, -1)[0, -1, :] = 200.0  # attention logit of part 0 = 200 * (ELU of the pixel)
    out = enc(x)
    expected_centre = torch.tensor([(2 * 4 + 1) / 6 - 1, (2 * 1 + 1) / 6 - 1])
    offset = encoders.constrained_pose(out.pose_raw, max_translation=0.5)[..., [2, 5]]
    torch.testing.assert_close(out.pose[:, 0, [2, 5]] - offset[:, 0], expected_centre.expand(2, 2), atol=1e-4,
                               rtol=0)


def test_part_encoder_bf16_close_to_float32_and_outputs_float32():
    # the bf16 trunk (EncoderConfig.bf16) is an approximation of the same function: same weights, outputs in float32
    # and close to the float32 encoder's; a wrong cast (outputs left in bf16) or a broken trunk fails here
    torch.manual_seed(0)
    ref = PartEncoder(6, channels=(16, 16), strides=(2, 2), feature_dim=3)
    enc = PartEncoder(6, channels=(16, 16), strides=(2, 2), feature_dim=3, bf16=True)
    enc.load_state_dict(ref.state_dict())
    x = torch.rand(3, 1, 20, 20)
    a, b = ref(x), enc(x)
    for ta, tb in zip(a, b):
        assert tb.dtype == torch.float32
        torch.testing.assert_close(tb, ta, atol=2e-2, rtol=2e-2)
    assert not torch.equal(a.pose, b.pose)  # the autocast really ran in lower precision
    b.pose.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in enc.parameters() if p.grad is not None)
    assert enc.cnn[0].weight.grad.dtype == torch.float32


def test_part_encoder_pools_before_the_head_exactly():
    # the encoder applies the 1x1 head after pooling (pooling commutes with a linear map); the reference here is the
    # explicit form: the head conv over the whole feature map, softmax of each part's attention row over positions,
    # attention-weighted sum of the other rows.  A wrong row for the attention, a missing bias or pooling over the
    # wrong axis fails here.
    torch.manual_seed(0)
    M = 5
    enc = PartEncoder(M, channels=(8, 8), strides=(2, 1), feature_dim=3, attention_translation=False).double()
    with torch.no_grad():
        enc.head.weight.normal_()
        enc.head.bias.normal_()
    x = torch.rand(2, 1, 12, 12, dtype=torch.float64)
    out = enc(x)
    h = enc.head(enc.cnn(x))  # (B, M * (P + 1), 6, 6)
    h = h.reshape(2, M, enc.n_param + 1, -1)
    att = torch.softmax(h[:, :, -1], -1)
    params = (h[:, :, :-1] * att[:, :, None]).sum(-1)  # (B, M, P)
    torch.testing.assert_close(out.pose_raw, params[..., :6])
    torch.testing.assert_close(out.presence_logit, params[..., 6])
    torch.testing.assert_close(out.features, params[..., 7:])


def test_compiled_part_cnn_matches_eager():
    # catches: the torch.compile path of the part encoder's CNN (train.compile / --compile) computing something else,
    # or compiling a module (its state dict keys would gain a prefix)
    torch.manual_seed(0)
    ref = PartEncoder(4, channels=(8, 8), strides=(2, 1), feature_dim=2)
    enc = PartEncoder(4, channels=(8, 8), strides=(2, 1), feature_dim=2, compile=True)
    enc.load_state_dict(ref.state_dict())  # the flag is no state: the same keys load both ways
    assert list(enc.state_dict()) == list(ref.state_dict())
    x = torch.rand(2, 1, 12, 12)
    eager = ref(x)
    (eager_grad,) = torch.autograd.grad(eager.pose.square().sum(), ref.cnn[0].weight)
    compiled = enc(x)
    (compiled_grad,) = torch.autograd.grad(compiled.pose.square().sum(), enc.cnn[0].weight)
    assert "_trunk_compiled" in enc.__dict__  # the compiled path really ran
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_grad, eager_grad, atol=1e-5, rtol=1e-5)
    # compiling one encoder leaves every other one eager: no switch outlives the module that asked for it
    other = PartEncoder(4, channels=(8, 8), strides=(2, 1), feature_dim=2)
    other(x)
    ref(x)
    assert "_trunk_compiled" not in other.__dict__ and "_trunk_compiled" not in ref.__dict__


# --------------------------------------------------------------------------- the phase-split strided convolution


@pytest.mark.parametrize("kernel,stride,padding,size", [(9, 2, 0, 28), (9, 2, 0, 27), (3, 2, 1, 13), (4, 3, 0, 17),
                                                        (1, 2, 0, 9), (5, 2, 2, 12), (2, 3, 0, 10)])
def test_phase_split_conv_equals_the_strided_conv_with_gradients(kernel, stride, padding, size):
    from probcaps.encoders import PhaseSplitConv2d

    torch.manual_seed(0)
    ref = torch.nn.Conv2d(3, 5, kernel, stride=stride, padding=padding).double()
    split = PhaseSplitConv2d(3, 5, kernel, stride=stride, padding=padding).double()
    split.load_state_dict(ref.state_dict())  # the same parameters under the same names
    x = torch.randn(2, 3, size, size, dtype=torch.double, requires_grad=True)
    y_ref, y = ref(x), split(x)
    assert y.shape == y_ref.shape
    assert torch.allclose(y, y_ref, atol=1e-12, rtol=0)
    g = torch.randn_like(y)
    grads_ref = torch.autograd.grad(y_ref, [x, ref.weight, ref.bias], g)
    grads = torch.autograd.grad(y, [x, split.weight, split.bias], g)
    for a, b in zip(grads, grads_ref):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_phase_split_conv_runs_stride_one_and_grouped_layers_as_the_plain_conv():
    from probcaps.encoders import PhaseSplitConv2d

    x = torch.randn(1, 4, 9, 9, dtype=torch.double)
    for kw in (dict(stride=1), dict(stride=2, groups=2), dict(stride=2, dilation=2)):
        torch.manual_seed(0)
        ref = torch.nn.Conv2d(4, 4, 3, **kw).double()
        split = PhaseSplitConv2d(4, 4, 3, **kw).double()
        split.load_state_dict(ref.state_dict())
        assert torch.equal(split(x), ref(x))
