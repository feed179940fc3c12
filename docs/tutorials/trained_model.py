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
# # Questioning a trained model
#
# `probcaps.load` gives a trained generative capsule model as one object, `TrainedCapsuleModel`, with its guide.
# This tutorial asks the shipped MNIST model (`checkpoints/mnist.pt`, 16 objects, 24 parts, 40×40 canvas) what
# each of its objects draws, which objects each digit class uses, and what test-time variational inference does to
# a rotated digit the encoder never saw. It needs MNIST under `PROBCAPS_DATA` (`probcaps download` fetches it).

# %%
import os

import matplotlib.pyplot as plt
import torch

import probcaps
from probcaps.data import rotate
from probcaps.metrics import LinearProbe, mean_by_class

# the test suite runs every tutorial in a tiny mode: fewer images, fewer steps
TINY = os.environ.get("PROBCAPS_TUTORIAL_TINY") == "1"
torch.manual_seed(0)


def show(images, titles=(), rows=1, size=1.3, title=None):
    """A row (or grid) of ``(N, 1, H, W)`` or ``(N, H, W)`` images in [0, 1]."""
    images = images.reshape(-1, *images.shape[-2:])
    cols = -(-len(images) // rows)
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows + (0.4 if title else 0)), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < len(images):
            ax.imshow(images[i], cmap="gray", vmin=0, vmax=1)
            ax.set_title(titles[i] if i < len(titles) else "", fontsize=8)
    if title:
        fig.suptitle(title)


# %% [markdown]
# ## The model and its images
#
# `load_images` reads a split of the dataset the model was trained on, placed on the canvas as in training:
# `(N, 1, 40, 40)` floats in `[0, 1]`, the input every method takes (on any device: `probcaps.load("mnist",
# device="cuda")` or `model.to("cuda")`).

# %%
model = probcaps.load("mnist")
x_test, y_test = model.load_images("test", limit=64 if TINY else 2000)
print(model)
x_test.shape

# %% [markdown]
# ## Capsules
#
# `encode` runs the amortised encoder and returns named capsules: object presences, poses and codes, part presences
# and poses, and the exact posterior over each part's parent (`parent_posterior`, the dummy clutter parent first).

# %%
capsules = model.encode(x_test)
for name in ("object_presence", "object_pose", "object_code", "part_presence", "part_pose", "parent_posterior"):
    print(f"{name:17s} {tuple(getattr(capsules, name).shape)}")
print("each part's parent posterior sums to 1:", torch.allclose(capsules.parent_posterior.sum(-1), torch.ones(1)))

# %% [markdown]
# The model's reconstruction renders the parts at their presences and poses:

# %%
show(torch.cat([x_test[:8], model.reconstruct(x_test[:8])]), rows=2, title="digits (top), reconstructions (bottom)")

# %% [markdown]
# ## What each object draws
#
# `draw_objects()` draws every object alone at the identity pose: its parts at their learned offsets, each at the
# probability that it is on and the object's. Given images, it draws the objects those images use at their mean
# pose over the images where each is on, beside the image where it is most present.

# %%
alone = model.draw_objects()
show(alone.grid, alone.objects, rows=2, title="each object at the identity pose")
in_use = model.draw_objects(x_test)
show(in_use.grid.transpose(0, 1), in_use.objects, rows=2,
     title="objects in use: the image where each is most present (top), drawn at its mean pose (bottom)")

# %% [markdown]
# ## Presences by class
#
# Which objects each digit class switches on: the mean presence of each object over the test digits of each class.
# An object on for every class shows as a full column, a class-specific one as a scattered pattern.

# %%
presence_by_class, classes = mean_by_class(capsules.object_presence, y_test)
fig, ax = plt.subplots(figsize=(6, 3))
image = ax.imshow(presence_by_class.T, vmin=0, vmax=1, cmap="viridis")
ax.set(xlabel="object capsule", ylabel="digit class", yticks=range(len(classes)), yticklabels=classes)
fig.colorbar(image, label="mean presence");

# %% [markdown]
# The paper reads the classes off the objects with a linear probe on their presences and poses (`features`); fit on
# training digits, scored on test digits:

# %%
x_train, y_train = model.load_images("train", limit=256 if TINY else 10000)
probe = LinearProbe(max_iter=200 if TINY else 2000).fit(model.features(x_train), y_train)
print(f"linear probe on object presences and poses: test accuracy {probe.accuracy(model.features(capsules), y_test):.3f}"
      f" ({len(x_train)} training digits)")

# %% [markdown]
# ## A rotated digit before and after test-time VI
#
# The encoder saw upright digits only. Rotated by 90°, a digit is encoded poorly; test-time VI (`ttvi`) gives each
# image its own variational parameters, started at the encoder's output and optimised on the ELBO with the model
# frozen. The ELBO of each image rises, and the reconstruction follows the digit.

# %%
x_rotated = rotate(x_test[:4], 90.0).clamp(0, 1)
before = model.encode(x_rotated)
after = model.ttvi(x_rotated, steps=10 if TINY else 200, lr=0.01, seed=0)
print("ELBO per image, encoder:      ", after.ttvi.elbo_start.round().tolist())
print("ELBO per image, test-time VI: ", after.ttvi.elbo_end.round().tolist())
show(torch.cat([x_rotated, model.reconstruct(before), model.reconstruct(after)]), rows=3,
     title="rotated digits (top), encoder's reconstruction, after test-time VI (bottom)")

# %% [markdown]
# Which objects explain the rotated digit, before and after: the expected number of parts each object explains,
# from the exact parent posterior (the dummy's column left out).

# %%
counts = torch.stack([c.parent_posterior[0, :, 1:].sum(0) for c in (before, after)])
fig, ax = plt.subplots(figsize=(6, 1.6))
ax.imshow(counts, cmap="viridis")
ax.set(yticks=[0, 1], yticklabels=["encoder", "test-time VI"], xlabel="object capsule",
       title="parts each object explains (first rotated digit)");
