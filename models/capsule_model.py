"""The generative capsule model of Smith, Schut, Gal & van der Wilk (2020) as a Pyro model (Smith et al. 2020, §2).

Sites, per image (plates: ``data`` at dim -2; ``parents`` / ``children`` at dim -1):

- ``z1`` (B, K)     parent presences, relaxed Bernoulli(τ, π)
- ``y1`` (B, K, 6+D) parent poses, Normal(0, σ_p²), and with ``object_code_dims`` D > 0 each object's code
                    ``c_k``, Normal(0, 1), that deforms its parts' offsets: ``Δ_km + U_km c_k``
- ``s``  (B, M)     each child's parent in {0 = dummy, 1..K}; enumerated in parallel, summed out exactly
- ``z0`` (B, M)     child presences, relaxed Bernoulli(τ, γ[s])
- ``y0`` (B, M, 6)  child poses, Normal(pose6(P(y1[s]) P(Δ[s])), z0 σ[s]² + (1 − z0) σ_off²), ``y1``
                    restricted to the group of ``object_pose`` (the paper's: all affine maps), ``Δ`` deformed by
                    the parent's code
- ``x``  (B, H, W)  the image, Normal(composite of the rendered templates, σ_x²)

The quantities that define these distributions are computed once, by :meth:`CapsuleModel.child_tables` and
:meth:`CapsuleModel.render`; the Pyro model and the plain-torch :meth:`CapsuleModel.log_joint` (used by the
benchmark and the tests) only differ in how ``s`` is summed out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.nn import PyroModule
from pyro.ops.indexing import Vindex
from torch.distributions.relaxed_bernoulli import LogitRelaxedBernoulli

from probcaps.config import Section
from probcaps.distributions import ClampedRelaxedBernoulli, inverse_softplus
from probcaps.geometry import POSE_GROUPS, compose_pose6, pose6_to_matrix, restrict_pose6
from probcaps.render import render_over

__all__ = ["CapsuleModelConfig", "CapsuleModel", "select_parent", "object_information", "PRESENCE_FAMILIES"]

PRESENCE_FAMILIES = ("relaxed", "bernoulli")  # model.presences


@dataclass
class CapsuleModelConfig(Section):
    num_parents: int = 16          # K object capsules (plus the dummy clutter parent)
    num_parts: int = 24            # M part capsules, one template each
    template_size: int = 11        # t
    canvas_size: int = 40          # H = W
    temperature: float = 0.5       # τ of every relaxed presence
    pixel_std: float = 0.1         # σ_x
    parent_pose_std: float = 1.0   # σ_p
    # the maps an object's pose applies to its parts' offsets: "affine" (the paper's six degrees of freedom) or
    # "similarity" (rotation, scale, translation; y1's shear and unequal scale are drawn from the prior and unused):
    # with four degrees of freedom an object cannot fit one part's pose exactly, so fragments of a digit pay less
    object_pose: str = "affine"
    part_pose_std_init: float = 0.1
    part_pose_std_min: float = 0.02  # σ_min: the floor on the learned σ_km
    part_pose_std_max: float = 0.0   # σ_max (0: none): one object cannot explain every digit's parts loosely
    off_pose_std: float = 1.0      # σ_off: pose spread of an absent child
    clutter_pose_std: float = 1.0  # pose spread of a child of the dummy parent
    dummy_affinity: float = 0.05   # ρ_0m
    dummy_presence: float = 0.1    # γ_0m
    expected_parents: float = 2.0  # π_k = expected_parents / K: one or two objects per digit
    # the prior anneals from expected_parents_start objects per image down to expected_parents over the first
    # prior_anneal_steps steps (0: none; ``inference.capsule_svi.prior_schedule``): every object gets children to
    # explain and a shape of its own before the prior asks each image to keep only a few
    expected_parents_start: float = 0.0
    prior_anneal_steps: int = 0
    init_offset_std: float = 0.5   # spread of the initial Δ_km translations
    # upper bound on the affinities ρ_km (0: unbounded): an unbounded ρ_km lets an object whose presence is sampled
    # near 0 still win its parts from the dummy, so presence has no absolute effect
    max_affinity: float = 0.0
    # SCAE's posterior sparsity (Kosiorek et al. 2019, §2.4) as one term: the training loss subtracts this weight
    # times the mutual information between an image and the objects that explain its parts (``object_information``
    # of the expected part counts under the exact posterior over the parts' parents): few objects within an image,
    # different ones in different images; 0: the plain negative ELBO
    object_information_weight: float = 0.0
    # the share of that term's within-image entropy (1: the mutual information; 0: the between-image entropy alone).
    # The within-image entropy is least when one object explains all of an image's parts, so it pulls the posterior
    # towards one object per image whatever the prior asks
    object_within_share: float = 1.0
    # D: each object also carries a code c_k ~ Normal(0, I_D) (y1's last D coordinates) that moves its parts'
    # offsets, Δ_km + U_km c_k, with each row of the learned U_km (6, D) at most code_deformation_std long: an
    # object can hold the layout of its parts within its class (SCAE's per-capsule deformations, Kosiorek et al.
    # 2019, §2.2) at a prior cost; 0: fixed offsets (the paper's model)
    object_code_dims: int = 0
    code_deformation_std: float = 0.1  # the largest prior std of a deformation coordinate, U_km's row lengths
    # the presences' distribution: "relaxed" (concrete at `temperature`, reparameterised: the paper's) or "bernoulli"
    # (discrete, the model before the relaxation; its ELBO's guide gradients are score-function ones, docs/inference.md)
    presences: str = "relaxed"
    seed: int = 0                  # parameter initialisation

    def validate(self) -> None:
        if self.presences not in PRESENCE_FAMILIES:
            raise ValueError(f"model.presences must be one of {', '.join(PRESENCE_FAMILIES)}, got {self.presences!r}")
        if self.object_pose not in POSE_GROUPS:
            raise ValueError(f"model.object_pose must be one of {', '.join(POSE_GROUPS)}, got {self.object_pose!r}")
        if self.object_code_dims < 0 or self.code_deformation_std <= 0:
            raise ValueError("model.object_code_dims must be >= 0 and model.code_deformation_std > 0, got "
                             f"{self.object_code_dims} and {self.code_deformation_std}")
        if self.num_parts > self.template_size ** 2:  # the templates start orthogonal: at most t² of them
            raise ValueError(f"model.num_parts ({self.num_parts}) must be at most model.template_size² "
                             f"({self.template_size}² = {self.template_size ** 2}): the templates start mutually "
                             f"orthogonal, and a {self.template_size}x{self.template_size} template has only "
                             f"{self.template_size ** 2} dimensions")

    @property
    def object_dims(self) -> int:
        """Coordinates of ``y1`` per object: the pose's 6 and the code's ``object_code_dims``."""
        return 6 + self.object_code_dims


def _orthogonal_logits(n: int, size: int, gen: torch.Generator) -> torch.Tensor:
    # SCAE: templates start mutually orthogonal, so that each part starts with its own shape.
    a = torch.randn(max(n, size * size), size * size, generator=gen)
    q, _ = torch.linalg.qr(a.T)  # (t², ·) orthonormal columns
    return (q.T[:n] * size).reshape(n, 1, size, size)


def select_parent(table: torch.Tensor, s: torch.Tensor, event_dims: int = 0) -> torch.Tensor:
    """``table[..., m, s_m, *event]`` for a per-candidate table ``(..., M, K+1, *event)``.

    A sampled ``s`` ``(B, M)`` is gathered with ``Vindex``.  Under parallel enumeration ``s`` is ``arange(K+1)``
    laid along a new left dimension, and the selection is the table itself with its candidate dimension moved
    there: a view instead of a gather (whose backward would be a scatter), the same values.
    """
    cand = table.dim() - 1 - event_dims
    if s.dim() - 1 >= cand and s.numel() == table.shape[cand] == s.shape[0] and all(d == 1 for d in s.shape[1:]):
        if torch.equal(s.reshape(-1), torch.arange(s.shape[0], device=s.device)):
            moved = table.movedim(cand, 0)
            pad = s.dim() - 1 - cand  # the enumeration's dims left of the table's batch dims (M included)
            return moved.reshape(moved.shape[:1] + (1,) * pad + moved.shape[1:])
    index = (Ellipsis, s) + (slice(None),) * event_dims
    return Vindex(table)[index]


class CapsuleModel(PyroModule):
    """Pyro generative model of Smith et al. 2020, §2: ``model(x)`` with ``x`` ``(B, 1, H, W)`` or ``(B, H, W)``.

    ``footprint``: render each template only over the canvas window it can touch (the same images and gradients
    as ``footprint=False``, :func:`probcaps.render.render_over`); ``compile``: ``torch.compile`` the whole-canvas
    compositing.  Both are plain attributes, not part of the state dict.
    """

    def __init__(self, config: CapsuleModelConfig | None = None, *, footprint: bool = True, compile: bool = False):
        super().__init__()
        self.footprint, self.compile = footprint, compile
        cfg = self.config = config or CapsuleModelConfig()
        K, M, t = cfg.num_parents, cfg.num_parts, cfg.template_size
        gen = torch.Generator().manual_seed(cfg.seed)
        # every part starts as a soft round brush that can paint a stroke wherever the encoder puts it, so poses get
        # a useful gradient from the first step; orthogonal noise (SCAE's template init) breaks the parts' symmetry
        r = torch.linspace(-1, 1, t)
        blob = 6.0 * torch.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * 0.35**2)) - 3.0
        self.template_logits = nn.Parameter(blob + 0.5 * _orthogonal_logits(M, t, gen))
        self.alpha_logits = nn.Parameter(blob + 0.5 * _orthogonal_logits(M, t, gen))
        self.log_affinity = nn.Parameter(torch.zeros(K, M))                  # log ρ_km
        self.presence_logits = nn.Parameter(torch.zeros(K, M))               # logit γ_km
        offsets = torch.zeros(K, M, 6)
        offsets[..., [2, 5]] = cfg.init_offset_std * torch.randn(K, M, 2, generator=gen)
        self.offsets = nn.Parameter(offsets)                                 # Δ_km (pose 6-vectors)
        if cfg.part_pose_std_max:
            if not cfg.part_pose_std_min < cfg.part_pose_std_init < cfg.part_pose_std_max:
                raise ValueError("CapsuleModelConfig: need part_pose_std_min < part_pose_std_init < part_pose_std_max, "
                                 f"got {cfg.part_pose_std_min}, {cfg.part_pose_std_init}, {cfg.part_pose_std_max}")
            frac = (cfg.part_pose_std_init - cfg.part_pose_std_min) / (cfg.part_pose_std_max - cfg.part_pose_std_min)
            raw = math.log(frac / (1 - frac))  # σ_km = σ_min + (σ_max − σ_min) sigmoid(·)
        else:
            raw = inverse_softplus(max(cfg.part_pose_std_init - cfg.part_pose_std_min, 1e-4))  # σ_min + softplus(·)
        self.pose_std_raw = nn.Parameter(torch.full((K, M, 6), float(raw)))
        cfg.validate()
        if cfg.object_code_dims:  # small, so that the codes start near the fixed offsets of the paper's model
            self.code_basis = nn.Parameter(0.01 * torch.randn(K, M, 6, cfg.object_code_dims, generator=gen))
        if cfg.prior_anneal_steps < 0 or (cfg.prior_anneal_steps and cfg.expected_parents_start <= 0):
            raise ValueError("CapsuleModelConfig: prior_anneal_steps must be >= 0 and needs expected_parents_start > 0,"
                             f" got {cfg.prior_anneal_steps} and {cfg.expected_parents_start}")

    def presence_distribution(self, probs: torch.Tensor):
        """The distribution of a presence of probability ``probs`` (``model.presences``): a
        :class:`ClampedRelaxedBernoulli` at the config's temperature, or a Bernoulli with the same bounded logits."""
        relaxed = ClampedRelaxedBernoulli(probs.new_tensor(self.config.temperature), probs=probs)
        return relaxed if self.config.presences == "relaxed" else dist.Bernoulli(logits=relaxed.logits)

    # ---------------------------------------------------------------- parameters in their natural units
    def templates(self) -> torch.Tensor:
        """``(M, 2, t, t)``: channel 0 the template intensity, channel 1 its alpha, both in (0, 1)."""
        return torch.sigmoid(torch.cat([self.template_logits, self.alpha_logits], 1))

    def log_rho(self) -> torch.Tensor:
        """``(K, M)`` log affinities log ρ_km, at most ``log(max_affinity)`` if that is set."""
        if self.config.max_affinity > 0:
            return math.log(self.config.max_affinity) - F.softplus(-self.log_affinity)
        return self.log_affinity

    def part_pose_std(self) -> torch.Tensor:
        """``(K, M, 6)`` learned σ_km, floored at ``part_pose_std_min`` (capped at ``part_pose_std_max`` if set)."""
        lo, hi = self.config.part_pose_std_min, self.config.part_pose_std_max
        return lo + ((hi - lo) * torch.sigmoid(self.pose_std_raw) if hi else F.softplus(self.pose_std_raw))

    def deformation_basis(self) -> torch.Tensor:
        """``(K, M, 6, D)`` U_km, each row at most ``code_deformation_std`` long (a code coordinate of prior std 1
        moves an offset coordinate by a prior std of at most that)."""
        norm = self.code_basis.norm(dim=-1, keepdim=True)
        return self.code_basis * (self.config.code_deformation_std / norm.clamp_min(self.config.code_deformation_std))

    def part_offsets(self, y1: torch.Tensor) -> torch.Tensor:
        """``(..., K, M, 6)`` each object's offsets to its parts ``Δ_km + U_km c_k`` for object latents ``y1``
        ``(..., K, 6 + D)`` (the paper's fixed ``Δ_km``, broadcast, when D = 0)."""
        if not self.config.object_code_dims:
            return self.offsets.expand(*y1.shape[:-2], *self.offsets.shape)
        return self.offsets + torch.einsum("kmpd,...kd->...kmp", self.deformation_basis(), y1[..., 6:])

    # ---------------------------------------------------------------- the shared computations
    def predicted_part_poses(self, y1: torch.Tensor) -> torch.Tensor:
        """``(..., K, M, 6)`` the pose each object predicts for each part, ``pose6(P(y1_k) P(Δ_km + U_km c_k))``, with
        ``y1`` ``(..., K, 6 + D)`` restricted to the object-pose group."""
        pose = restrict_pose6(y1[..., :6], self.config.object_pose).unsqueeze(-2)
        return compose_pose6(pose, self.part_offsets(y1))

    def child_tables(self, z1: torch.Tensor, y1: torch.Tensor):
        """Everything that defines ``p(s, z0, y0 | z1, y1)``, for every candidate parent (the dummy first).

        Args: ``z1`` ``(..., K)``, ``y1`` ``(..., K, 6 + D)``.
        Returns: ``selection_logits (..., M, K+1)`` (unnormalised log P(s_m = k)), ``presence_probs (M, K+1)``
        (γ), ``pose_mean (..., M, K+1, 6)``, ``pose_var_on (M, K+1, 6)`` (σ² of a present child).
        """
        cfg = self.config
        M = cfg.num_parts
        dummy_rho = self.log_affinity.new_full((1, M), math.log(cfg.dummy_affinity))
        log_rho = torch.cat([dummy_rho, self.log_rho()], 0).T                     # (M, K+1)
        z1_full = torch.cat([torch.ones_like(z1[..., :1]), z1], -1)                # dummy is always present
        selection_logits = log_rho + torch.log(z1_full).unsqueeze(-2)             # (..., M, K+1)
        dummy_gamma = self.presence_logits.new_full((1, M), cfg.dummy_presence)
        presence_probs = torch.cat([dummy_gamma, torch.sigmoid(self.presence_logits)], 0).T  # (M, K+1)
        parent_mean = self.predicted_part_poses(y1)                                # (..., K, M, 6)
        pose_mean = torch.cat([torch.zeros_like(parent_mean[..., :1, :, :]), parent_mean], -3).transpose(-3, -2)
        dummy_var = self.offsets.new_full((1, M, 6), cfg.clutter_pose_std**2)
        pose_var_on = torch.cat([dummy_var, self.part_pose_std() ** 2], 0).transpose(0, 1)  # (M, K+1, 6)
        return selection_logits, presence_probs, pose_mean, pose_var_on

    def child_pose_std(self, z0: torch.Tensor, pose_var_on: torch.Tensor) -> torch.Tensor:
        """Std of ``y0`` interpolated by the relaxed presence: ``sqrt(z0 σ² + (1 − z0) σ_off²)``."""
        z = z0.unsqueeze(-1)
        return (z * pose_var_on + (1 - z) * self.config.off_pose_std**2).sqrt()

    def render(self, z0: torch.Tensor, y0: torch.Tensor, contributions: bool = True):
        """Composite image ``(B, 1, H, W)`` and each part's contribution to it ``(B, M, 1, H, W)``.

        Templates are warped by ``P(y0)``, their alphas weighted by ``z0``, and composited back to front (part 0 at
        the back) over a black background.  ``contributions=False`` returns ``(image, None)`` (the training path).
        """
        templates = self.templates()                                              # (M, 2, t, t)
        # warping is linear in the template, so z0 scales the small alpha templates before the warp instead of the
        # (B, M, H, W) rendered alphas after it: the same image, two fewer passes over the layers
        channel_scale = torch.stack([torch.ones_like(z0), z0], -1)[..., None, None]  # (B, M, 2, 1, 1)
        return render_over(templates * channel_scale, pose6_to_matrix(y0), self.config.canvas_size,
                           footprint=self.footprint, compiled=self.compile, contributions=contributions)

    def draw_objects(self, y1: torch.Tensor) -> torch.Tensor:
        """``(..., K, 1, H, W)``: each object drawn alone from its latents ``y1`` ``(..., K, 6 + D)``: every part at
        the pose the object predicts for it, ``pose6(P(y1_k) P(Δ_km + U_km c_k))``, at the probability that the part
        is on and the object's child when the object is the only one present, ``γ_km ρ_km / (ρ_km + ρ_0m)``: what
        the model expects the object to put on the canvas (the dummy's clutter left out)."""
        cfg = self.config
        M, H = cfg.num_parts, cfg.canvas_size
        part_poses = self.predicted_part_poses(y1)                                 # (..., K, M, 6)
        own = torch.sigmoid(self.log_rho() - math.log(cfg.dummy_affinity))         # ρ / (ρ + ρ_0), (K, M)
        presence = (torch.sigmoid(self.presence_logits) * own).expand(part_poses.shape[:-1])
        image, _ = self.render(presence.reshape(-1, M), part_poses.reshape(-1, M, 6), contributions=False)
        return image.reshape(*part_poses.shape[:-2], 1, H, H)

    def parent_prior_probs(self, expected_parents: float | None = None) -> torch.Tensor:
        """``(K,)`` prior presence probabilities π_k = ``expected_parents / K`` (at most 0.99); ``None``: the
        config's ``expected_parents`` (the end of the training loop's anneal)."""
        cfg = self.config
        expected = cfg.expected_parents if expected_parents is None else float(expected_parents)
        return self.offsets.new_full((cfg.num_parents,), min(expected / cfg.num_parents, 0.99))

    def object_prior_std(self) -> torch.Tensor:
        """``(6 + D,)`` the prior std of ``y1``'s coordinates: ``σ_p`` for the pose, 1 for the code."""
        cfg = self.config
        return torch.cat([self.offsets.new_full((6,), cfg.parent_pose_std),
                          self.offsets.new_ones(cfg.object_code_dims)])

    # ---------------------------------------------------------------- the Pyro model
    def forward(self, x: torch.Tensor, expected_parents: float | None = None):
        """``x (B, 1, H, W)``; ``expected_parents``: the prior's objects per image at this training step (the loop's
        anneal, as Pyro's ``examples/dmm.py`` passes its annealing factor), ``None`` for the config's final value.
        Returns the rendered image ``(B, 1, H, W)``."""
        cfg = self.config
        x = self._check_images(x)
        B, K, M = x.shape[0], cfg.num_parents, cfg.num_parts
        data = pyro.plate("data", B, dim=-2)
        prior_probs = self.parent_prior_probs(expected_parents).expand(B, K)
        with data, pyro.plate("parents", K, dim=-1):
            z1 = pyro.sample("z1", self.presence_distribution(prior_probs))
            y1 = pyro.sample("y1", dist.Normal(x.new_zeros(()), self.object_prior_std()).expand([B, K, cfg.object_dims])
                             .to_event(1))
        selection_logits, gamma, pose_mean, pose_var_on = self.child_tables(z1, y1)
        with data, pyro.plate("children", M, dim=-1):
            s = pyro.sample("s", dist.Categorical(logits=selection_logits), infer={"enumerate": "parallel"})
            z0 = pyro.sample("z0", self.presence_distribution(select_parent(gamma, s)))
            std = self.child_pose_std(z0, select_parent(pose_var_on, s, event_dims=1))
            y0 = pyro.sample("y0", dist.Normal(select_parent(pose_mean, s, event_dims=1), std).to_event(1))
        image, _ = self.render(z0, y0, contributions=False)
        with data:
            pyro.sample("x", dist.Normal(image.flatten(1).unsqueeze(1), cfg.pixel_std).to_event(1),
                        obs=x.flatten(1).unsqueeze(1))
        return image

    def child_log_joint(self, z1, y1, z0, y0, z0_logit: torch.Tensor | None = None) -> torch.Tensor:
        """``(..., M, K+1)`` log P(s_m = k | z1) + log p(z0_m, y0_m | s_m = k, y1) for every candidate parent ``k``
        (the dummy ``k = 0`` first): what the enumeration of ``s`` sums over.  ``z1 (..., K)``, ``y1 (..., K, 6 + D)``,
        ``z0 (..., M)``, ``y0 (..., M, 6)``; differentiable in all of them.  ``z0_logit (..., M)``: score each child's
        presence by the density of its logit (``z0`` must then be its clamped sigmoid), see :meth:`log_joint`."""
        selection_logits, gamma, pose_mean, pose_var_on = self.child_tables(z1, y1)
        tau = z0.new_tensor(self.config.temperature)
        presence = self.presence_distribution(gamma)
        log_z0 = (presence.log_prob(z0.unsqueeze(-1)) if z0_logit is None else
                  LogitRelaxedBernoulli(tau, logits=presence.logits).log_prob(z0_logit.unsqueeze(-1)))
        std = self.child_pose_std(z0.unsqueeze(-1), pose_var_on)                  # (..., M, K+1, 6)
        log_y0 = dist.Normal(pose_mean, std).log_prob(y0.unsqueeze(-2)).sum(-1)
        return selection_logits.log_softmax(-1) + log_z0 + log_y0

    def parent_log_posterior(self, z1, y1, z0, y0) -> torch.Tensor:
        """``(..., M, K+1)`` log q(s_m = k): the exact posterior over each part's parent given the latents,
        :meth:`child_log_joint` normalised over the candidates."""
        return self.child_log_joint(z1, y1, z0, y0).log_softmax(-1)

    # ---------------------------------------------------------------- plain-torch reference
    def log_joint(self, x, z1, y1, z0, y0, expected_parents: float | None = None,
                  presence_logits: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``log p(x, z1, y1, z0, y0)`` per image ``(B,)``, with ``s`` summed out by ``logsumexp`` in plain torch: the
        density the Pyro model's enumerated ELBO scores, the reference in tests and benchmarks.

        ``presence_logits``: ``(l1 (B, K), l0 (B, M))``, the relaxed presences before the sigmoid, with ``z1``,
        ``z0`` their clamped sigmoids: the presences are then scored by the (logistic) densities of their logits,
        the exact density of what the model samples even where the clamp holds a sample at ``RELAXED_CLAMP``
        (:mod:`probcaps.inference.likelihood`)."""
        cfg = self.config
        x = self._check_images(x)
        tau = x.new_tensor(cfg.temperature)
        prior = self.presence_distribution(self.parent_prior_probs(expected_parents))
        l1, l0 = (None, None) if presence_logits is None else presence_logits
        lp = (prior.log_prob(z1) if l1 is None else
              LogitRelaxedBernoulli(tau, logits=prior.logits).log_prob(l1)).sum(-1)
        lp = lp + dist.Normal(y1.new_zeros(()), self.object_prior_std()).log_prob(y1).sum((-1, -2))
        lp = lp + torch.logsumexp(self.child_log_joint(z1, y1, z0, y0, l0), -1).sum(-1)  # s summed out
        image, _ = self.render(z0, y0, contributions=False)
        return lp + dist.Normal(image, cfg.pixel_std).log_prob(x).flatten(1).sum(-1)

    def _check_images(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.unsqueeze(1)
        H = self.config.canvas_size
        if x.dim() != 4 or x.shape[1:] != (1, H, H):
            raise ValueError(f"CapsuleModel: expected images of shape (B, 1, {H}, {H}), got {tuple(x.shape)}")
        return x


def object_information(counts: torch.Tensor, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(within, between)`` entropies (nats, each in ``[0, log K]``) of per-image object part counts ``(B, K)``:
    the mean over images of the entropy of each image's counts normalised over the objects, and the entropy of the
    batch's summed counts normalised over the objects.  ``between - within`` is the mutual information between an
    image of the batch and the object that explains one of its parts (SCAE's two posterior sparsity terms)."""
    def entropy(p):
        p = p / (p.sum(-1, keepdim=True) + eps)
        return -(p * (p + eps).log()).sum(-1)
    return entropy(counts).mean(), entropy(counts.sum(0))
