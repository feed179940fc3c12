"""The public API (``probcaps.load`` and ``TrainedCapsuleModel``) on the shipped MNIST model and 8 real test digits:
each answer against the package's own code path for the same question (the encoder, the Pyro model's rendering,
the training loss, test-time VI, the probes' features), its input checks, and the lazy facade of ``import
probcaps``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REAL_DATA_ROOT, requires_real_mnist
from pyro import poutine

import probcaps
from probcaps.data import placed_mnist, to_float
from probcaps.errors import CheckpointError
from probcaps.inference.capsule_svi import probe_features
from probcaps.inference.train import make_elbo
from probcaps.inference.ttvi import ttvi_batches
from probcaps.registry import resolve_checkpoint, shipped_model_dir

N = 8


@pytest.fixture(scope="module")
def mnist():
    """``(model, images (8, 1, 40, 40), labels)``: the shipped model and the first 8 test digits as it was trained
    on them."""
    torch.set_num_threads(1)
    model = probcaps.load("mnist")
    images, labels = model.load_images("test", limit=N, data_dir=REAL_DATA_ROOT)
    return model, images, labels


pytestmark = requires_real_mnist


def test_load_images_places_the_digits_as_the_model_was_trained():
    # catches: the API's images on another canvas, offset or scale than the training data's
    model = probcaps.load("mnist")
    data = model.config["data"]
    images, labels = model.load_images("test", limit=N, data_dir=REAL_DATA_ROOT)
    placed = placed_mnist("test", data_dir=REAL_DATA_ROOT, canvas=data.canvas_size, max_shift=data.max_shift,
                          seed=data.seed, limit=N)
    assert images.shape == (N, 1, 40, 40) and images.dtype == torch.float32
    assert torch.equal(images[:, 0], to_float(placed.images)) and torch.equal(labels, placed.labels)


def test_encode_gives_the_encoders_capsules_by_name_and_an_exact_parent_posterior(mnist):
    model, x, _ = mnist
    K, M = model.num_objects, model.num_parts
    caps = model.encode(x)
    assert (K, M) == (16, 24) and len(caps) == N
    shapes = {"object_presence": (N, K), "object_pose": (N, K, 6), "object_code": (N, K, 8),
              "part_presence": (N, M), "part_pose": (N, M, 6), "parent_posterior": (N, M, K + 1)}
    assert {k: tuple(getattr(caps, k).shape) for k in shapes} == shapes
    # catches: named fields that are not the encoder's (swapped, logits for probabilities, codes cut wrong)
    direct = model.system.encoder.encode(x)
    assert torch.allclose(caps.part_presence, torch.sigmoid(direct.part_logits), atol=1e-6)
    assert torch.allclose(caps.object_presence, torch.sigmoid(direct.parent_logits), atol=1e-6)
    assert torch.allclose(caps.part_pose, direct.part_poses, atol=1e-6)
    assert torch.allclose(caps.object_pose, direct.parent_poses[..., :6], atol=1e-6)
    assert torch.allclose(caps.object_code, direct.parent_poses[..., 6:], atol=1e-6)
    # catches: a posterior not normalised over each part's candidates (the dummy included), or over the wrong dim
    q = caps.parent_posterior
    assert (q >= 0).all()
    assert torch.allclose(q.sum(-1), torch.ones(N, M), atol=1e-5)
    # the digits' parts that are on are mostly explained by objects, not by the clutter parent
    on = caps.part_presence > 0.5
    assert q[..., 1:].sum(-1)[on].mean() > 0.5


def test_reconstruct_is_the_pyro_models_rendering_of_the_encoders_parts(mnist):
    # catches: a reconstruction at other presences (logits, samples) or poses than the model renders from them
    model, x, _ = mnist
    lat = model.system.encoder.encode(x)
    values = {"z1": torch.sigmoid(lat.parent_logits), "y1": lat.parent_poses,
              "z0": torch.sigmoid(lat.part_logits), "y0": lat.part_poses}
    with torch.no_grad():
        rendered = poutine.condition(model.model, data=values)(x)      # the model's forward returns its rendering
    recon = model.reconstruct(x)
    assert recon.shape == (N, 1, 40, 40)
    assert torch.allclose(recon, rendered, atol=1e-6)
    assert torch.allclose(model.reconstruct(model.encode(x)), recon)
    assert ((recon - x) ** 2).mean() < 0.02  # and it is a reconstruction: the digits, not a blank canvas


def test_log_likelihood_bound_is_the_elbo_the_training_loss_holds_per_image(mnist):
    # catches: a bound that is not the ELBO of training (another density, log q left out or counted twice, the
    # parents not summed out, a mean for a sum), per batch and image by image; the recipe's training loss also
    # subtracts the information term, which is no part of the bound
    model, x, _ = mnist
    system = model.system

    def neg_elbo(images):  # computed by Pyro's TraceEnum_ELBO, as training computes it
        return system.negative_elbo(make_elbo(), images)

    bound = model.log_likelihood_bound(x, seed=3)
    assert bound.shape == (N,) and torch.isfinite(bound).all()
    torch.manual_seed(3)
    assert torch.allclose(-bound.mean(), neg_elbo(x).detach(), rtol=1e-5)
    torch.manual_seed(3)
    loss, _ = system.loss(make_elbo(), x)
    assert model.model.config.object_information_weight > 0 and loss.item() < -bound.mean().item()
    for i in range(3):
        torch.manual_seed(10 + i)
        alone = neg_elbo(x[i:i + 1]).item()
        assert model.log_likelihood_bound(x[i:i + 1], seed=10 + i).item() == pytest.approx(-alone, rel=1e-5)
    # the seed fixes the sample, and leaves the caller's RNG where it was
    state = torch.get_rng_state()
    assert torch.equal(model.log_likelihood_bound(x, seed=3), bound)
    assert torch.equal(torch.get_rng_state(), state)


def test_log_likelihood_bound_counts_the_entropy_of_normal_pose_posteriors(mnist):
    # catches: log q of the poses left out (a delta guide's is 0, a Normal guide's is not), or its samples drawn in
    # another order than the training loss draws them
    _, x, _ = mnist
    model = probcaps.load("normal_guide")
    assert model.system.guide_spec["family"] == "normal"
    bound = model.log_likelihood_bound(x[:4], seed=2)
    torch.manual_seed(2)
    assert torch.allclose(-bound.mean(), model.system.loss(make_elbo(), x[:4]).detach(), rtol=1e-5)


def test_ttvi_returns_the_refined_capsules_of_test_time_vi(mnist):
    # catches: refined capsules that are not test-time VI's (the encoder's, another seed's, another run's)
    model, x, _ = mnist
    refined = model.ttvi(x, steps=3, lr=0.01, seed=1)
    direct = ttvi_batches(model.model, model.guide, x, steps=3, lr=0.01, seed=1, progress=False)
    assert torch.allclose(refined.latents.part_poses, direct.latents.part_poses, atol=1e-6)
    assert torch.allclose(refined.latents.parent_logits, direct.latents.parent_logits, atol=1e-6)
    assert refined.ttvi.steps == 3 and refined.ttvi.elbo_end.shape == (N,)
    assert not torch.allclose(refined.part_pose, model.encode(x).part_pose)
    assert torch.allclose(refined.parent_posterior.sum(-1), torch.ones(N, model.num_parts), atol=1e-5)


def test_features_are_the_probes_and_draw_objects_the_models(mnist):
    model, x, _ = mnist
    lat = model.system.encoder.encode(x)
    for kind in ("presence", "presence_pose"):
        assert torch.allclose(model.features(x, kind=kind), probe_features(lat)[kind], atol=1e-6)
    assert model.features(x).shape == (N, 7 * model.num_objects)
    D = model.model.config.object_code_dims
    assert D == 8 and model.features(x, kind="presence_pose_code").shape == (N, (7 + D) * model.num_objects)
    with pytest.raises(ValueError, match="kind: must be one of presence, presence_pose, presence_pose_code"):
        model.features(x, kind="pose")
    alone = model.draw_objects()
    assert alone.grid.shape == (model.num_objects, 1, 40, 40) and alone.columns == ["identity pose"]
    assert torch.allclose(alone.grid, model.model.draw_objects(torch.zeros(model.num_objects, 6 + D)))
    in_use = model.draw_objects(x)
    on = (model.encode(x).object_presence > 0.5).float().mean(0) >= 0.01
    assert in_use.objects == [f"object {k}" for k in on.nonzero().flatten().tolist()]
    # the image where each is most present, its mean latents, and its code ±2σ along two principal directions
    assert in_use.grid.shape == (int(on.sum()), 2 + 2 * 2, 40, 40)
    assert in_use.columns == ["most present", "mean", "−2σ code 1", "+2σ code 1", "−2σ code 2", "+2σ code 2"]


@pytest.mark.parametrize("bad, says", [
    (lambda x: (x * 255).to(torch.uint8), "dtype torch.uint8"),
    (lambda x: x[:, 0], "shape (8, 40, 40)"),
    (lambda x: x[..., :28, :28], "shape (8, 1, 28, 28)"),
    (lambda x: x * 2, "values in [0, 2]"),
    (lambda x: x.masked_fill(x > 0.5, float("nan")), "values in"),
    (lambda x: x[:0], "shape (0, 1, 40, 40)"),
    (lambda x: x.tolist(), "got list"),
])
def test_bad_images_are_one_line_naming_the_argument(mnist, bad, says):
    model, x, _ = mnist
    for method in (model.encode, model.reconstruct, model.log_likelihood_bound, model.ttvi, model.features):
        with pytest.raises(ValueError) as err:
            method(bad(x))
        message = str(err.value)
        assert message.startswith("images: expected a float tensor of shape (N, 1, 40, 40)") and says in message
        assert "\n" not in message


def test_a_model_runs_on_either_device_and_takes_images_from_any():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = probcaps.load("mnist", device=device)
    x, _ = model.load_images("test", limit=N, data_dir=REAL_DATA_ROOT)
    assert model.device.type == device
    on_device = model.encode(x.to(device))
    assert on_device.part_pose.device.type == "cpu"  # results come back on the CPU
    cpu = model.to("cpu")
    assert cpu is model and model.device.type == "cpu"
    # bf16 convolutions round differently on each device
    assert torch.allclose(model.encode(x).part_pose, on_device.part_pose, atol=0.05)


def test_names_resolve_to_shipped_checkpoints_and_a_missing_one_says_where_to_put_it(tmp_path):
    shipped = shipped_model_dir()
    assert resolve_checkpoint("mnist") == shipped / "mnist.pt"
    assert resolve_checkpoint(shipped / "mnist.pt") == shipped / "mnist.pt"
    with pytest.raises(CheckpointError, match=r"no_such_model: no such file, and no shipped model of that name"):
        probcaps.load("no_such_model")
    foreign = tmp_path / "foreign.pt"
    foreign.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="foreign.pt: not a readable checkpoint"):
        probcaps.load(foreign)


def test_import_probcaps_loads_neither_torch_nor_pyro_and_lists_the_api():
    # catches: an eager import of the API in probcaps/__init__.py (slow start, and a cycle with the building blocks)
    code = ("import sys, probcaps; assert 'torch' not in sys.modules and 'pyro' not in sys.modules, 'eager';"
            "print(sorted(set(probcaps.__all__) & set(dir(probcaps))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(probcaps.__all__))
    from probcaps.inference import api

    assert probcaps.load is api.load and probcaps.TrainedCapsuleModel is api.TrainedCapsuleModel
    assert set(probcaps.__all__) == set(api.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        probcaps.nope
