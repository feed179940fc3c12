# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The generative capsule model in Pyro
#
# The model of Smith, Schut, Gal & van der Wilk (2020) is an ordinary Pyro model,
# `probcaps.models.capsule_model.CapsuleModel`. Per image it draws
#
# - `z1` `(B, K)`: object presences (relaxed Bernoulli) and `y1` `(B, K, 6)`: object poses (Normal);
# - `s` `(B, M)`: each part's parent, the dummy clutter parent `0` or one of the `K` objects, enumerated and summed
#   out exactly by `TraceEnum_ELBO`;
# - `z0` `(B, M)`, `y0` `(B, M, 6)`: part presences and poses, distributed around what their parent predicts;
# - `x` `(B, H, W)`: the image, Normal around the parts' templates rendered at their poses.
#
# This tutorial samples from the prior, takes one SVI step, and checks the enumerated ELBO against a brute-force sum
# over every assignment of parents on a tiny model. Run it with `jupytext --to notebook` or as a script.

# %%
import itertools
import os

import matplotlib.pyplot as plt
import pyro
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample

from probcaps.data import synthetic_digits, to_float
from probcaps.inference.capsule_svi import CapsuleSystem
from probcaps.inference.guides import EncoderConfig
from probcaps.inference.train import make_elbo
from probcaps.models.capsule_model import CapsuleModelConfig

# the test suite runs every tutorial in a tiny mode: fewer images, no waiting
TINY = os.environ.get("PROBCAPS_TUTORIAL_TINY") == "1"
pyro.settings.set(module_local_params=True)  # each module keeps its own parameters (no global parameter store)
torch.manual_seed(0)

# %% [markdown]
# ## A model and its guide
#
# `CapsuleSystem` holds the generative model (`system.model`) and the amortised guide (`system.guide`, a CNN for the
# parts and a set transformer for the objects) as one `nn.Module`. A small one, on 28×28 synthetic digits:

# %%
model_config = CapsuleModelConfig(num_parents=4, num_parts=8, template_size=9, canvas_size=28, parent_pose_std=0.3)
encoder_config = EncoderConfig(channels=[16, 16], strides=[2, 2], set_hidden=16, set_heads=2, set_inducing=4,
                               set_blocks=1, parent_code=8, head_hidden=16, part_embedding=4)
system = CapsuleSystem(model_config, encoder_config)
digits, labels = synthetic_digits(16 if TINY else 256)
x = to_float(digits).unsqueeze(1)                   # (N, 1, 28, 28) floats in [0, 1]
x.shape

# %% [markdown]
# ## Sampling from the prior
#
# The model observes `x`; `poutine.uncondition` turns the observation into a sample, so one trace of the model is
# one draw of every latent and of the image. (The images it is given only set the batch size.)

# %%
prior = poutine.trace(poutine.uncondition(system.model)).get_trace(torch.zeros(6, 1, 28, 28))
for name, site in prior.nodes.items():
    if site["type"] == "sample" and not site_is_subsample(site):
        print(f"{name:3s} {tuple(site['value'].shape)}")

fig, axes = plt.subplots(2, 6, figsize=(9, 3))
rendered = prior.nodes["_RETURN"]["value"][:, 0]          # the composite of the parts, before the pixel noise
noisy = prior.nodes["x"]["value"].reshape(6, 28, 28)      # the image drawn from Normal(composite, σ_x)
for ax, image in zip(axes.flat, torch.cat([rendered, noisy])):
    ax.imshow(image.detach(), cmap="gray", vmin=0, vmax=1)
    ax.axis("off")
fig.suptitle("prior samples: rendered parts (top), with pixel noise (bottom)");

# %% [markdown]
# ## One SVI step
#
# The training loss is Pyro's `TraceEnum_ELBO` with two nested plates (`make_elbo`), divided by the batch size
# (`CapsuleSystem.loss`). The modules keep their parameters themselves, so a step is the ELBO's
# `differentiable_loss` and a torch optimiser (Pyro's `SVI` class reads the global parameter store instead); the
# training loop (`probcaps train`) takes exactly this step, with a schedule, checkpoints and logs around it.

# %%
elbo = make_elbo()
optimiser = torch.optim.Adam(system.parameters(), lr=1e-3)
losses = []
for step in range(2 if TINY else 20):
    optimiser.zero_grad()
    loss = system.loss(elbo, x)          # negative ELBO per image
    loss.backward()
    optimiser.step()
    losses.append(loss.item())
print(f"negative ELBO per image: {losses[0]:.1f} at the first step, {losses[-1]:.1f} at the last")

# %% [markdown]
# ## The enumerated ELBO against a brute-force sum over the parents
#
# `TraceEnum_ELBO` sums each part's parent `s_m` out exactly, in parallel over the parts. On a model small enough
# to list every assignment of parents to parts — 2 objects (and the dummy) and 3 parts: 3³ = 27 assignments — the
# same number follows from the definition,
#
# $$\mathrm{ELBO} = \sum_b \Big[\log \sum_{s} p(x_b, z_b, y_b, s) - \log q(z_b, y_b \mid x_b)\Big],$$
#
# scoring the model once per assignment with `s` fixed by `poutine.condition`, at the same sample of the guide.
# (In float64, so the two agree to rounding.)

# %%
tiny = CapsuleSystem(CapsuleModelConfig(num_parents=2, num_parts=3, template_size=5, canvas_size=28),
                     encoder_config).double()
x_tiny = x[:4].double()
K, M, B = 2, 3, len(x_tiny)

torch.manual_seed(1)
enumerated = -make_elbo().loss(tiny.model, tiny.guide, x_tiny)

torch.manual_seed(1)  # the same guide sample: the guide draws first, in the same order
guide_trace = poutine.trace(tiny.guide).get_trace(x_tiny)


def per_image_log_prob(trace):
    """``(B,)`` the sum of a trace's log densities over the sites of each image (the plates left out)."""
    trace.compute_log_prob()
    return sum(site["log_prob"].reshape(B, -1).sum(-1) for site in trace.nodes.values()
               if site["type"] == "sample" and not site_is_subsample(site))


log_q = per_image_log_prob(guide_trace)
log_joint = []  # (assignments, B): log p(x, z, y, s) with s fixed
for assignment in itertools.product(range(K + 1), repeat=M):
    s = torch.tensor(assignment).expand(B, M)
    scored = poutine.trace(poutine.replay(poutine.condition(tiny.model, data={"s": s}), trace=guide_trace))
    log_joint.append(per_image_log_prob(scored.get_trace(x_tiny)))
brute_force = (torch.logsumexp(torch.stack(log_joint), 0) - log_q).sum()

print(f"enumerated ELBO {enumerated:.10f}\nbrute force     {brute_force.item():.10f}")
assert abs(enumerated - brute_force.item()) < 1e-8 * abs(enumerated)

# %% [markdown]
# The model's plain-torch density `CapsuleModel.log_joint` (parents summed out by `logsumexp`, used by the
# benchmarks) scores the same sample to the same value:

# %%
z1, y1, z0, y0 = guide_trace.nodes["_RETURN"]["value"]
plain = (tiny.model.log_joint(x_tiny, z1, y1, z0, y0) - log_q).sum()
assert torch.allclose(plain, brute_force, rtol=1e-10)
plain.item()

# %% [markdown]
# Next: [questioning a trained model](trained_model.py) and [training at scale](training.py).
