"""Free-form test-time variational inference (Smith et al. 2020, §2.4).

Each image gets its own variational parameters (:class:`FreeFormGuide`), initialised at the amortised encoder's
output and optimised on the same enumerated ELBO (``s`` summed out) with the generative model frozen.  It repairs
amortisation failures, e.g. on rotated digits the encoder never saw.  The guide is mean-field across layers: the
encoder's parent path is used once, at initialisation.

    result = run_ttvi(system.model, system.guide, x, steps=200)           # x (B, 1, H, W) floats in [0, 1]
    result.latents.parent_logits                                           # features for the probes
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from probcaps.distributions import RELAXED_CLAMP, ClampedRelaxedBernoulli, inverse_softplus
from probcaps.errors import TrainingDiverged
from probcaps.geometry import restrict_pose6
from probcaps.inference.distributed import init_from_env
from probcaps.inference.guides import DeltaGuide, Latents, NormalPoseGuide
from probcaps.inference.train import check_adam_lr, make_elbo

__all__ = ["POSE_FAMILIES", "TTVIResult", "FreeFormGuide", "per_image_elbo", "fit_guide", "run_ttvi",
           "frozen_and_seeded", "run_chunks", "ttvi_batches", "reencode_parents"]

POSE_FAMILIES = ("delta", "normal")
DEFAULT_INIT_SCALE = 0.02
DEFAULT_MIN_SCALE = 1e-3


@dataclass
class TTVIResult:
    """What :func:`run_ttvi` / :func:`ttvi_batches` return (tensors on the CPU, detached).

    Attributes:
        latents: the final variational parameters, as the encoder's :class:`Latents` (logits and pose locations).
        elbo_trace: per optimisation step, the mean ELBO per image of that step's one-sample ``TraceEnum_ELBO``
            estimate, taken *before* the step's update (so ``elbo_trace[0]`` is at the encoder's output).
        elbo_start, elbo_end: ``(B,)`` per-image ELBO at the initialisation and at the end, estimated by
            :func:`per_image_elbo` with the same fixed noise for both (common random numbers), so that
            ``elbo_end - elbo_start`` is the improvement of each image and not sampling noise.
        part_pose_scales, parent_pose_scales: ``(B, M, 6)``, ``(B, K, 6)`` final pose scales for
            ``pose_family="normal"``; ``None`` for ``"delta"``.
    """

    latents: Latents
    elbo_trace: list
    elbo_start: torch.Tensor
    elbo_end: torch.Tensor
    pose_family: str
    steps: int
    part_pose_scales: torch.Tensor | None = None
    parent_pose_scales: torch.Tensor | None = None
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0  # this process's CPU time: with one thread, the wall time on an otherwise idle core

    def __len__(self) -> int:
        return self.elbo_start.shape[0]


class FreeFormGuide(nn.Module):
    """A guide with its own variational parameters for each of ``B`` images (free-form, not amortised): part presence
    logits ``(B, M)`` and pose locations ``(B, M, 6)``, parent presence logits ``(B, K)`` and pose locations
    ``(B, K, 6 + D)`` (poses and codes), and for ``pose_family="normal"`` pose scales of the same shapes, each
    ``min_scale + softplus(raw)``.  The object poses the guide emits lie in the model's group ``object_pose`` (as
    the encoder's do): with Normal poses, noise in the coordinates the model ignores would otherwise move them.

    Sites and plates match :class:`CapsuleModel` (``data`` at dim -2, ``children`` / ``parents`` at dim -1).  A plain
    ``nn.Module`` rather than a ``PyroModule``: under Pyro's global parameter store a ``PyroModule`` would register
    its parameters by name, and the next batch (another ``B``) would collide with them.
    """

    def __init__(self, latents: Latents, temperature: float, pose_family: str = "delta",
                 part_scales: torch.Tensor | None = None, parent_scales: torch.Tensor | None = None,
                 min_scale: float = DEFAULT_MIN_SCALE, object_pose: str = "affine"):
        super().__init__()
        self.object_pose = object_pose
        if pose_family not in POSE_FAMILIES:
            raise ValueError(f"FreeFormGuide: pose_family must be one of {POSE_FAMILIES}, got {pose_family!r}")
        self.pose_family, self.temperature, self.min_scale = pose_family, float(temperature), float(min_scale)
        for name, t in zip(("part_logits", "part_locs", "parent_logits", "parent_locs"), latents):
            setattr(self, name, nn.Parameter(t.detach().clone()))
        if pose_family == "normal":
            if part_scales is None or parent_scales is None:
                raise ValueError("FreeFormGuide: pose_family='normal' needs part_scales and parent_scales")
            for which, s in (("part", part_scales), ("parent", parent_scales)):
                if not (s > min_scale).all():
                    raise ValueError(f"FreeFormGuide: {which}_scales must exceed min_scale={min_scale}")
                loc = getattr(self, f"{which}_locs")
                raw = inverse_softplus(s.detach().to(loc) - min_scale).expand_as(loc).clone()
                setattr(self, f"{which}_scale_raw", nn.Parameter(raw))

    def pose_scales(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """``(B, M, 6)`` and ``(B, K, 6)`` pose scales (``(None, None)`` for delta poses)."""
        if self.pose_family != "normal":
            return None, None
        return self.min_scale + F.softplus(self.part_scale_raw), self.min_scale + F.softplus(self.parent_scale_raw)

    def latents(self) -> Latents:
        """The current variational parameters as detached :class:`Latents`."""
        return Latents(*(t.detach().clone() for t in (self.part_logits, self.part_locs, *self.parent_params())))

    def _pose(self, loc: torch.Tensor, scale: torch.Tensor | None):
        return dist.Delta(loc).to_event(1) if scale is None else dist.Normal(loc, scale).to_event(1)

    def parent_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The parents' own presence logits ``(B, K)`` and pose locations ``(B, K, 6)``, in the model's group."""
        return self.parent_logits, restrict_pose6(self.parent_locs, self.object_pose)

    def parents(self, z0: torch.Tensor, y0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The parents' presence logits ``(B, K)`` and pose locations ``(B, K, 6)`` given the sampled parts (free-form:
        :meth:`parent_params`, whatever the parts)."""
        return self.parent_params()

    def forward(self, x: torch.Tensor, *args, **kwargs):
        B, M = self.part_logits.shape
        if x.shape[0] != B:
            raise ValueError(f"{type(self).__name__}: built for {B} images, called with {x.shape[0]}")
        tau = self.part_logits.new_tensor(self.temperature)
        part_scale, parent_scale = self.pose_scales()
        data = pyro.plate("data", B, dim=-2)
        with data, pyro.plate("children", M, dim=-1):
            z0 = pyro.sample("z0", ClampedRelaxedBernoulli(tau, logits=self.part_logits))
            y0 = pyro.sample("y0", self._pose(self.part_locs, part_scale))
        parent_logits, parent_locs = self.parents(z0, y0)
        with data, pyro.plate("parents", parent_logits.shape[-1], dim=-1):
            z1 = pyro.sample("z1", ClampedRelaxedBernoulli(tau, logits=parent_logits))
            y1 = pyro.sample("y1", self._pose(parent_locs, parent_scale))
        return z1, y1, z0, y0


def _concrete_sample(logits: torch.Tensor, tau: float, gen: torch.Generator) -> torch.Tensor:
    """A :class:`ClampedRelaxedBernoulli` sample with uniforms from ``gen`` (what ``RelaxedBernoulli.rsample`` does)."""
    tiny = torch.finfo(logits.dtype).eps
    u = torch.rand(logits.shape, generator=gen, dtype=logits.dtype).clamp(tiny, 1 - tiny).to(logits.device)
    z = torch.sigmoid((logits + u.log() - (-u).log1p()) / tau)
    return z.clamp(RELAXED_CLAMP, 1 - RELAXED_CLAMP)


@torch.no_grad()
def per_image_elbo(model, guide: FreeFormGuide, x: torch.Tensor, num_samples: int = 4, seed: int = 0) -> torch.Tensor:
    """Monte Carlo ELBO of each image ``(B,)``: ``mean_s [log p(x, z1, y1, z0, y0) − log q(z1, y1, z0, y0)]``.

    Written in plain torch with the model's :meth:`CapsuleModel.log_joint` (``s`` summed out exactly by
    ``logsumexp``, the same density the enumerated Pyro ELBO scores).  The ``num_samples`` reparameterised samples
    of the presences (concrete) and, for Normal poses, of the poses use noise drawn from a generator seeded by
    ``seed``: a fixed sample, so two calls with different variational parameters are compared under common random
    numbers.  Delta poses contribute ``log q = 0`` (as in ``CapsuleSystem.reference_loss`` and Pyro's ``Delta``).
    """
    x = model._check_images(x)
    gen = torch.Generator().manual_seed(seed)
    tau = guide.temperature
    lp, ll = guide.part_logits, guide.part_locs
    pp, pl = guide.parent_params()
    part_scale, parent_scale = guide.pose_scales()
    q_z0 = ClampedRelaxedBernoulli(lp.new_tensor(tau), logits=lp)
    q_z1 = ClampedRelaxedBernoulli(pp.new_tensor(tau), logits=pp)
    total = torch.zeros(lp.shape[0], dtype=lp.dtype, device=lp.device)

    def pose(loc, scale):
        eps = torch.randn(loc.shape, generator=gen, dtype=loc.dtype).to(loc.device)  # drawn for delta too
        if scale is None:
            return loc, loc.new_zeros(loc.shape[0])
        y = loc + scale * eps
        return y, dist.Normal(loc, scale).log_prob(y).sum((-1, -2))

    for _ in range(num_samples):
        z0 = _concrete_sample(q_z0.logits, tau, gen)  # the distribution's (bounded) logits
        y0, lq_y0 = pose(ll, part_scale)
        z1 = _concrete_sample(q_z1.logits, tau, gen)
        y1, lq_y1 = pose(pl, parent_scale)
        log_q = q_z0.log_prob(z0).sum(-1) + q_z1.log_prob(z1).sum(-1) + lq_y0 + lq_y1
        total += model.log_joint(x, z1, y1, z0, y0) - log_q
    return total / num_samples


def _initial_scales(guide, pose_family: str, init_scale: float | None, min_scale: float | None):
    """Starting pose scales ``(M, 6)``, ``(K, 6)`` (None for delta poses) and floor, as :func:`run_ttvi` says."""
    own_floor = guide.min_scale if isinstance(guide, NormalPoseGuide) else DEFAULT_MIN_SCALE
    floor = own_floor if min_scale is None else float(min_scale)
    if pose_family != "normal":
        return None, None, floor
    if isinstance(guide, NormalPoseGuide) and init_scale is None:
        with torch.no_grad():
            parts, parents = guide.pose_scales("y0"), guide.pose_scales("y1")
        lowest = floor * (1 + 1e-3) + 1e-8  # strictly above a caller's floor, if it is higher than the guide's
        return parts.clamp_min(lowest), parents.clamp_min(lowest), floor
    scale = torch.tensor(DEFAULT_INIT_SCALE if init_scale is None else float(init_scale))
    encoder = guide.encoder
    return scale.expand(encoder.num_parts, 6), scale.expand(encoder.num_parents, encoder.object_dims), floor


def fit_guide(model, guide, params, x: torch.Tensor, steps: int, lr: float, bar=None, what: str = "test-time VI",
              show_elbo: bool = False) -> list[float]:
    """Adam on ``params`` (the guide's per-image variational parameters) for ``steps`` steps of the enumerated ELBO
    of ``model`` on images ``x`` ``(B, 1, H, W)``; returns the ELBO per image after each step.  A non-finite loss is
    a one-line :class:`~probcaps.errors.TrainingDiverged` naming ``what`` and the step."""
    check_adam_lr(lr, "--lr")
    elbo, opt, trace = make_elbo(max_plate_nesting=2), torch.optim.Adam(params, lr=lr), []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = elbo.differentiable_loss(model, guide, x)
        if not torch.isfinite(loss):
            raise TrainingDiverged(f"{what}, step {step}: the loss is {loss.item()} (lr {lr}); try a smaller lr")
        loss.backward()
        opt.step()
        trace.append(-loss.item() / len(x))
        if bar is not None:
            bar.update(1)
            if show_elbo and (step % 10 == 0 or step == steps - 1):
                bar.set_postfix(elbo=f"{trace[-1]:.1f}")
    return trace


def run_ttvi(model, guide: DeltaGuide, x: torch.Tensor, steps: int = 200, lr: float = 0.03, progress: bool = True,
             pose_family: str = "delta", *, init_scale: float | None = None, min_scale: float | None = None,
             elbo_samples: int = 4, elbo_seed: int = 0, seed: int | None = None, _bar=None) -> TTVIResult:
    """Free-form test-time VI on a batch of images, all at once.  A non-finite loss raises
    :class:`~probcaps.errors.TrainingDiverged` (the model restored first).

    Args:
        model: a :class:`CapsuleModel`; its parameters and the guide's are frozen during the run, never changed.
        guide: a :class:`DeltaGuide` (or :class:`NormalPoseGuide`) whose ``encoder`` gives the initialisation:
            ``encoder.encode(x)`` (part presences at ``sigmoid(logits)`` when encoding the parents).
        x: images ``(B, 1, H, W)`` or ``(B, H, W)``, floats in ``[0, 1]``, on the model's device.
        steps: Adam steps on ``TraceEnum_ELBO(max_plate_nesting=2)`` (one sample per step; the loss is summed over
            the batch, so each image's parameters get their own image's gradient).
        lr: Adam learning rate (0.03: on a 600-step MNIST checkpoint, 40 steps on 8 test digits, upright and
            rotated by 90 degrees, raised the ELBO more than 0.01 or 0.1).
        progress: show a tqdm bar.
        pose_family: ``"delta"`` (MAP poses) or ``"normal"`` (per-image Normal poses).
        init_scale, min_scale: ``"normal"`` only: starting scale (default: a :class:`NormalPoseGuide`'s own
            scales, otherwise 0.02) and floor (default: the guide's, otherwise 1e-3).
        elbo_samples, elbo_seed: the fixed-noise estimate of ``elbo_start`` / ``elbo_end`` (see :func:`per_image_elbo`).
        seed: if given, the optimisation's samples come from the torch RNG seeded with it (:func:`frozen_and_seeded`);
            otherwise from the global RNG.
    """
    if steps < 0:
        raise ValueError(f"run_ttvi: steps must be >= 0, got {steps}")
    t0, c0 = time.perf_counter(), time.process_time()
    x = model._check_images(x)
    with frozen_and_seeded((model, guide), seed, x.device):
        part_scales, parent_scales, floor = _initial_scales(guide, pose_family, init_scale, min_scale)
        init = guide.encoder.encode(x)
        ff = FreeFormGuide(init, guide.temperature, pose_family, part_scales, parent_scales, floor,
                           object_pose=model.config.object_pose)
        elbo_start = per_image_elbo(model, ff, x, elbo_samples, elbo_seed)
        with (contextlib.nullcontext(_bar) if _bar is not None else
              tqdm(total=steps, disable=not progress, desc="ttvi", unit="step", dynamic_ncols=True)) as bar:
            trace = fit_guide(model, ff, list(ff.parameters()), x, steps, lr, bar, show_elbo=True)
        elbo_end = per_image_elbo(model, ff, x, elbo_samples, elbo_seed)
    part_s, parent_s = (None if s is None else s.detach().cpu() for s in ff.pose_scales())
    return TTVIResult(latents=Latents(*(t.cpu() for t in ff.latents())), elbo_trace=trace,
                      elbo_start=elbo_start.cpu(), elbo_end=elbo_end.cpu(), pose_family=pose_family, steps=steps,
                      part_pose_scales=part_s, parent_pose_scales=parent_s, wall_time_s=time.perf_counter() - t0,
                      cpu_time_s=time.process_time() - c0)


@contextlib.contextmanager
def frozen_and_seeded(modules, seed: int | None, device: torch.device):
    """The parameters of ``modules`` frozen (``requires_grad`` restored on leaving), Pyro's parameters module-local,
    and with ``seed`` the torch RNG seeded inside ``fork_rng`` (the caller's RNG state is left as it was)."""
    frozen = [(p, p.requires_grad) for m in modules for p in m.parameters()]
    rng = (torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
           if seed is not None else contextlib.nullcontext())
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        with rng, pyro.settings.context(module_local_params=True):
            if seed is not None:
                torch.manual_seed(seed)
            yield
    finally:
        for p, requires_grad in frozen:
            p.requires_grad_(requires_grad)


def run_chunks(run, images: torch.Tensor, batch_size: int, steps: int, device: str | torch.device = "cpu",
               progress: bool = True, desc: str = "ttvi") -> tuple[list, list[float]]:
    """``run(i, x, bar) -> (result, elbo_trace)`` on chunk ``i`` of ``images``: ``batch_size`` of them, in order, moved
    to ``device`` (uint8 ``(N, H, W)`` or ``(N, 1, H, W)``, or floats in ``[0, 1]``), with one tqdm ``bar`` of
    ``steps`` per chunk.  Returns the results and, per step, the mean ELBO per image over all ``N`` images (the
    chunks' traces weighted by their sizes).  Under ``torchrun`` each process runs its share of the chunks, and each
    returns them all."""
    n_chunks = -(-images.shape[0] // batch_size)
    if not n_chunks:
        raise ValueError(f"{desc}: no images")
    world = init_from_env()
    mine, batches = world.batches(images, batch_size, device=device)
    done = []
    with tqdm(total=steps * len(mine), disable=not progress or world.rank > 0, desc=desc, unit="step",
              dynamic_ncols=True) as bar:
        for i, x in batches:
            bar.set_description(f"{desc} {i + 1}/{n_chunks}")
            done.append((*run(i, x, bar), len(x)))
    results, traces, sizes = zip(*world.gather(done))
    weights = torch.tensor(sizes, dtype=torch.float64)
    traces = torch.tensor(traces, dtype=torch.float64).reshape(n_chunks, steps)
    return list(results), ((traces * weights[:, None]).sum(0) / weights.sum()).tolist()


def ttvi_batches(model, guide: DeltaGuide, images: torch.Tensor, batch_size: int = 250, steps: int = 200, *,
                 device: str | torch.device = "cpu", progress: bool = True, seed: int | None = None,
                 **kwargs) -> TTVIResult:
    """:func:`run_ttvi` over many images, ``batch_size`` at a time (:func:`run_chunks`), the results concatenated.
    With ``seed``, chunk ``i`` is run with seed ``seed + i``.  Other keyword arguments go to :func:`run_ttvi`."""
    t0, c0 = time.perf_counter(), time.process_time()

    def chunk(i, x, bar):
        r = run_ttvi(model, guide, x, steps=steps, progress=progress, seed=None if seed is None else seed + i,
                     _bar=bar, **kwargs)
        return r, r.elbo_trace

    results, trace = run_chunks(chunk, images, batch_size, steps, device, progress)

    def cat(parts):
        return None if parts[0] is None else torch.cat(parts)

    cats = {f: cat([getattr(r, f) for r in results]) for f in ("elbo_start", "elbo_end", "part_pose_scales",
                                                                "parent_pose_scales")}
    return TTVIResult(latents=Latents(*map(cat, zip(*(r.latents for r in results)))), elbo_trace=trace,
                      pose_family=results[0].pose_family, steps=steps, wall_time_s=time.perf_counter() - t0,
                      cpu_time_s=time.process_time() - c0, **cats)


@torch.no_grad()
def reencode_parents(encoder, latents: Latents, batch_size: int = 500, device: str = "cpu") -> Latents:
    """Object capsules recomputed by the encoder's set transformer from (optimised) part capsules.

    The free-form object latents of test-time VI are only tied to the image through the parts, and drift out of the
    distribution a probe fit on encoder features has seen; re-encoding the optimised parts keeps them in it.
    """
    chunks = [[t.cpu() for t in encoder.encode_parents(poses.to(device), torch.sigmoid(logits).to(device))]
              for poses, logits in zip(latents.part_poses.split(batch_size), latents.part_logits.split(batch_size))]
    return Latents(latents.part_logits, latents.part_poses, *(torch.cat(parts) for parts in zip(*chunks)))
