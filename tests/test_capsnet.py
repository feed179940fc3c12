"""CapsNet: squash, routing (both implementations), margin loss, decoder masking, LeNet-5, and the MultiMNIST
entry point on tiny synthetic data (evaluation curve, resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

from probcaps.decoders import MaskedCapsuleDecoder  # noqa: E402
from probcaps.models.capsnet import CapsNet, CapsNetConfig, margin_loss, set_accuracy, top_k_classes  # noqa: E402
from probcaps.models.lenet import LeNet5  # noqa: E402
from probcaps.models.routing import capsule_predictions, dynamic_routing, linear_dynamic_routing, squash  # noqa: E402

TINY_CAPS = dict(conv1_channels=8, primary_capsules=4, primary_dim=4, digit_dim=6, decoder_hidden=[16, 16],
                 weight_init_std=0.1)


# --------------------------------------------------------------------------- squash


def test_squash_by_hand():
    v = squash(torch.tensor([3.0, 4.0]))  # |s| = 5: length 25/26, direction (0.6, 0.8)
    assert torch.allclose(v, 25 / 26 * torch.tensor([0.6, 0.8]), atol=1e-6)


def test_squash_norms_in_unit_interval_and_finite_at_zero():
    s = torch.cat([torch.zeros(1, 8), 1e-4 * torch.randn(5, 8), torch.randn(5, 8), 20 * torch.randn(5, 8)])
    s.requires_grad_(True)
    v = squash(s)
    norms = v.norm(dim=-1)
    assert (norms >= 0).all() and (norms < 1).all()
    # |s|^2 / (1 + |s|^2) rounds to 1 in float32 here: the length is capped just below 1 instead
    big = squash(torch.full((1, 8), 1e4))
    assert torch.isfinite(big).all() and 1 - 1e-5 < big.norm() < 1
    assert torch.allclose(big / big.norm(), torch.full((1, 8), 8 ** -0.5))
    assert v[0].abs().max() == 0
    v.sum().backward()
    assert torch.isfinite(s.grad).all() and (s.grad[0] == 0).all()
    # the norm is |s|^2 / (1 + |s|^2), small norms included (no eps inside the norm to distort them)
    n = s.detach().norm(dim=-1)
    assert torch.allclose(norms, n ** 2 / (1 + n ** 2), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------- routing


def _children(B=3, I=7, P=4, J=5, D=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = squash(torch.randn(B, I, P, generator=g))
    w = 0.5 * torch.randn(J, I, P, D, generator=g)
    return u, w


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_coupling_coefficients_sum_to_one_over_parents(iterations):
    u, w = _children()
    u_hat = capsule_predictions(u, w.permute(1, 0, 3, 2))
    for v, c in (dynamic_routing(u_hat, iterations), linear_dynamic_routing(u, w, iterations)):
        assert c.shape == (3, 5, 7) and v.shape == (3, 5, 6)
        assert torch.allclose(c.sum(1), torch.ones(3, 7), atol=1e-6)
        assert (c > 0).all()


def test_one_iteration_is_uniform_coupling():
    u, w = _children()
    u_hat = capsule_predictions(u, w.permute(1, 0, 3, 2))
    v, c = dynamic_routing(u_hat, 1)
    assert torch.allclose(c, torch.full_like(c, 1 / 5))
    assert torch.allclose(v, squash(u_hat.sum(2) / 5), atol=1e-6)  # s_j = sum_i c_ij u_hat, c = 1/J


def test_predictions_by_hand():
    u = torch.tensor([[[1.0, 2.0]]])  # B=1, I=1, P=2
    W = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])  # (I=1, J=1, D=3, P=2)
    assert capsule_predictions(u, W).tolist() == [[[[1.0, 2.0, 3.0]]]]


def test_agreement_moves_coupling_towards_the_agreeing_parent():
    # two children that predict the same pose for parent 0 and opposite poses for parent 1
    u_hat = torch.zeros(1, 2, 2, 3)
    u_hat[0, 0, :, 0] = 2.0
    u_hat[0, 1, 0, 1], u_hat[0, 1, 1, 1] = 2.0, -2.0
    _, c = dynamic_routing(u_hat, 3)
    assert (c[0, 0] > 0.5).all()


@pytest.mark.parametrize("iterations,detach", [(1, False), (2, False), (3, False), (3, True)])
def test_fused_routing_equals_reference_with_gradients(iterations, detach):
    # catches: the fast path that never builds u_hat drifting from the paper's procedure (values or gradients),
    # its first, uniform iteration (one GEMM over all parents) included
    u, w = _children()
    u.requires_grad_(True)
    w.requires_grad_(True)
    v1, c1 = linear_dynamic_routing(u, w, iterations, detach=detach)
    v2, c2 = dynamic_routing(capsule_predictions(u, w.permute(1, 0, 3, 2)), iterations, detach=detach)
    assert torch.allclose(v1, v2, atol=1e-6) and torch.allclose(c1, c2, atol=1e-6)
    g1 = torch.autograd.grad((v1 ** 2).sum(), (u, w))
    g2 = torch.autograd.grad((v2 ** 2).sum(), (u, w))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("detach", [False, True])
def test_bfloat16_products_route_as_float64_does_to_their_rounding(detach):
    # catches: the bf16 products dropping back to float32 (the error would be float32's, below 1e-5), an error
    # past bf16's rounding (0.6% here), or the couplings and capsules leaving float32
    u, w = _children(B=4, I=160, P=4, J=5, D=6, seed=3)
    u.requires_grad_(True)
    w.requires_grad_(True)
    v16, c16 = linear_dynamic_routing(u, w, 3, detach=detach, product_dtype=torch.bfloat16)
    v32, _ = linear_dynamic_routing(u, w, 3, detach=detach)
    v64, c64 = linear_dynamic_routing(u.double(), w.double(), 3, detach=detach)
    assert v16.dtype == c16.dtype == torch.float32
    assert torch.allclose(c16.double().sum(1), torch.ones(4, 160, dtype=torch.float64), atol=1e-6, rtol=0)
    v16, v32, v64 = v16.detach().double(), v32.detach().double(), v64.detach()
    err16 = float((v16 - v64).norm(dim=-1).max() / v64.norm(dim=-1).min())
    err32 = float((v32 - v64).norm(dim=-1).max() / v64.norm(dim=-1).min())
    assert err16 < 1e-2 and err32 < 1e-5 < err16
    assert float((c16.detach().double() - c64.detach()).abs().max()) < 1e-2
    g16 = torch.autograd.grad((linear_dynamic_routing(u, w, 3, detach=detach, product_dtype=torch.bfloat16)[0] ** 2
                               ).sum(), (u, w))
    g64 = torch.autograd.grad((linear_dynamic_routing(u.double(), w.double(), 3, detach=detach)[0] ** 2).sum(),
                              (u, w))
    for a, b in zip(g16, g64):
        cosine = float((a.double() * b).sum() / (a.double().norm() * b.norm()))
        assert cosine > 0.999


def test_stop_gradient_variant_changes_the_gradient():
    u, w = _children()
    w.requires_grad_(True)
    full = torch.autograd.grad((linear_dynamic_routing(u, w, 3)[0] ** 2).sum(), w)[0]
    stopped = torch.autograd.grad((linear_dynamic_routing(u, w, 3, detach=True)[0] ** 2).sum(), w)[0]
    assert not torch.allclose(full, stopped, atol=1e-6)
    # with one iteration there is nothing to stop
    one = torch.autograd.grad((linear_dynamic_routing(u, w, 1)[0] ** 2).sum(), w)[0]
    one_stopped = torch.autograd.grad((linear_dynamic_routing(u, w, 1, detach=True)[0] ** 2).sum(), w)[0]
    assert torch.allclose(one, one_stopped)


# --------------------------------------------------------------------------- losses and accuracy


def test_margin_loss_by_hand():
    lengths = torch.tensor([[0.95, 0.5, 0.05, 0.3]])
    targets = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    # present: max(0, .9-.95)^2 = 0, (.9-.5)^2 = .16; absent: .05 < .1 -> 0, .5 * (.3-.1)^2 = .02
    assert margin_loss(lengths, targets).item() == pytest.approx(0.18)
    assert margin_loss(lengths, targets, m_plus=1.0, m_minus=0.0, lam=1.0).item() == pytest.approx(
        0.05 ** 2 + 0.5 ** 2 + 0.05 ** 2 + 0.3 ** 2)


def test_set_accuracy_needs_both_digits():
    lengths = torch.tensor([[0.9, 0.1, 0.8, 0.0], [0.9, 0.7, 0.1, 0.0], [0.1, 0.2, 0.3, 0.4]])
    labels = torch.tensor([[2, 0], [0, 2], [3, 2]])
    assert set_accuracy(lengths, labels).tolist() == [True, False, True]
    assert top_k_classes(lengths, 2).tolist() == [[0, 2], [0, 1], [2, 3]]


# --------------------------------------------------------------------------- decoder and model


def test_decoder_sees_only_the_selected_capsule():
    torch.manual_seed(0)
    dec = MaskedCapsuleDecoder(4, 3, [8], (1, 5, 5))
    caps = torch.randn(2, 4, 3)
    out = dec(caps, torch.tensor([1, 1]))
    assert out.shape == (2, 1, 5, 5) and (out > 0).all() and (out < 1).all()
    other = caps.clone()
    other[:, [0, 2, 3]] = torch.randn(2, 3, 3)  # change every capsule but the selected one
    assert torch.allclose(dec(other, torch.tensor([1, 1])), out)
    assert not torch.allclose(dec(caps, torch.tensor([2, 2])), out)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0]])
    assert torch.allclose(dec(caps, mask), out)


def test_paper_config_sizes():
    cfg = CapsNetConfig()  # MultiMNIST paper network
    assert (cfg.conv1_size, cfg.primary_grid, cfg.num_primary) == (28, 10, 3200)
    mnist = CapsNetConfig(image_size=28)
    assert mnist.num_primary == 1152  # 32 x 6 x 6, the paper's MNIST network


def test_capsnet_loss_and_reconstructions():
    torch.manual_seed(0)
    model = CapsNet(CapsNetConfig(**TINY_CAPS))
    x = torch.rand(3, 1, 36, 36)
    out = model(x)
    assert out.digits.shape == (3, 10, 6) and out.lengths.shape == (3, 10) and out.coupling.shape == (3, 10, 400)
    assert torch.allclose(out.coupling.sum(1), torch.ones(3, 400), atol=1e-5)
    labels = torch.tensor([[1, 2], [3, 4], [5, 6]])
    sources = torch.rand(3, 2, 1, 36, 36)
    loss, diag = model.loss(x, labels, sources)
    rec = model.reconstruct_each(out.digits, labels)
    assert rec.shape == (3, 2, 1, 36, 36)
    assert torch.allclose(rec[:, 1], model.reconstruct(out.digits, labels[:, 1]))
    targets = torch.zeros(3, 10).scatter_(1, labels, 1.0)
    expected = (margin_loss(out.lengths, targets) + 0.0005 * ((rec - sources) ** 2).flatten(1).sum(1)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("option,rtol", [("bf16", 0.05), ("bf16_routing", 0.02)])
def test_bf16_options_are_the_same_network_to_bfloat16_rounding(option, rtol):
    # catches: an option that changes nothing (the lengths equal float32's) or leaves float32 in its outputs
    torch.manual_seed(0)
    model = CapsNet(CapsNetConfig(**TINY_CAPS))
    x = torch.rand(2, 1, 36, 36)
    ref = model(x).lengths
    setattr(model.config, option, True)
    lengths = model(x).lengths
    assert lengths.dtype == torch.float32 and not torch.equal(lengths, ref)
    assert torch.allclose(lengths, ref, rtol=rtol, atol=1e-3)


def test_phase_split_primary_capsules_are_the_same_network():
    """``phase_split`` changes how PrimaryCaps' strided convolution is computed, not the network: the same state
    dict gives the same loss and the same gradients, to float32 rounding (the network computes in float32)."""
    torch.manual_seed(0)
    plain = CapsNet(CapsNetConfig(**TINY_CAPS))
    split = CapsNet(CapsNetConfig(**TINY_CAPS, phase_split=True))
    split.load_state_dict(plain.state_dict())
    x = torch.rand(2, 1, 36, 36)
    labels = torch.tensor([[0, 3], [1, 2]])
    sources = torch.rand(2, 2, 1, 36, 36)
    losses = [m.loss(x, labels, sources)[0] for m in (plain, split)]
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=0)
    for a, b in zip(torch.autograd.grad(losses[0], list(plain.parameters())),
                    torch.autograd.grad(losses[1], list(split.parameters()))):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()))


def test_lenet_shapes():
    assert LeNet5()(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    assert sum(p.numel() for p in LeNet5().parameters()) == 156 + 2416 + 30840 + 10164 + 850


# --------------------------------------------------------------------------- entry points


#: a MultiMNIST run of four steps on synthetic digits with the tiny network
TINY_MULTIMNIST = ["--set", "data.dataset=\"synthetic\"", "--set", "data.test_pairs=40", "--set", "train.steps=4",
                   "--set", "data.train_limit=64", "--set", "data.test_limit=64",
                   "--set", "train.batch_size=8", "--set", "train.checkpoint_every=2", "--set", "train.warmup_steps=1",
                   "--set", "eval.curve_pairs=16", "--set", "eval.batch_size=16", "--set", "eval.figure_pairs=2",
                   *[f"--set=model.{k}={json.dumps(v)}" for k, v in TINY_CAPS.items()]]


def test_multimnist_entry_point(tmp_path):
    from probcaps.experiments import multimnist

    results = tmp_path / "results"
    tiny = TINY_MULTIMNIST
    args = ["--seeds", "0", "1", "--out", str(tmp_path / "runs"), "--results-dir", str(results), "--quiet", *tiny]
    assert multimnist.main(args) == 0
    data = json.loads((results / "multimnist.json").read_text())
    runs = data["metrics"]["per_seed"]
    assert [r["seed"] for r in runs] == [0, 1] and all(0 <= r["set_acc"] <= 1 for r in runs)
    assert runs[0]["n_pairs"] == 40 and data["provenance"]["steps"] == 4
    for fig in ("reconstructions", "capsules", "training"):
        assert (results / f"multimnist_{fig}.png").is_file()
    curve = [json.loads(line) for line in (tmp_path / "runs" / "seed0" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve] == [2, 4]
    table = multimnist.readme_table(results)
    assert "| reduced" in table and "48.6" in table
    # resuming a finished run re-evaluates the same model
    assert multimnist.main(args[:2] + ["--resume", "--set", "eval.figures=false"] + args[3:]) == 0
    again = json.loads((results / "multimnist.json").read_text())["metrics"]["per_seed"][0]
    assert again["set_acc"] == runs[0]["set_acc"]


def test_multimnist_try_is_one_record_and_one_row(tmp_path):
    # catches: a try written as the recipe's results (overwriting them) or with its figures, or a record that
    # does not name what it changed against the recipe
    from probcaps.experiments import multimnist
    from probcaps.report import load_try

    results = tmp_path / "results"
    args = ["--seeds", "0", "--out", str(tmp_path / "runs"), "--results-dir", str(results), "--quiet",
            *TINY_MULTIMNIST, "--set", "model.bf16_routing=true", "--try", "tiny_bf16_routing"]
    assert multimnist.main(args) == 0
    assert sorted(p.name for p in results.iterdir()) == ["ablations", "ablations.md"]
    record = load_try(results / "ablations" / "tiny_bf16_routing.json")
    assert record["changed"]["--config"] == "multimnist" and record["changed"]["model.bf16_routing"] is True
    assert record["changed"]["train.steps"] == 4 and "model.image_size" not in record["changed"]
    assert record["seeds"] == [0] and record["steps"] == 4 and 0 <= record["metrics"]["set_acc"] <= 1
    assert [step for step, _ in record["curves"]["0"]] == [2, 4]
    row = [line for line in (results / "ablations.md").read_text().splitlines() if "tiny_bf16_routing" in line]
    assert len(row) == 1 and "model.bf16_routing = true" in row[0]


def test_multimnist_bad_config_is_one_line(tmp_path, capsys):
    from probcaps.experiments import multimnist

    assert multimnist.main(["--config", str(tmp_path / "nope.toml"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.toml" in err[0]
    assert multimnist.main(["--set", "model.image_size=28", "--quiet"]) == 2
