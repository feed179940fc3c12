"""Transforming auto-encoder (Hinton, Krizhevsky & Wang 2011, "Transforming auto-encoders", ICANN).

Every capsule ``m`` recognises a presence ``p_m`` and a pose ``P_m`` (a 3x3 affine map, template -> canvas); the
known transformation ``T`` of the input moves every pose, ``P'_m = T ∘ P_m``, and the capsule renders its learned
template there.  The output is the presence-weighted sum of the capsules (the paper's ``combine = "sum"``) or a
mixture in which one capsule explains the whole image (not in the paper).  Recognition: ``"mlp"`` (the paper's) or
``"conv"`` (a conv trunk whose :class:`probcaps.encoders.PartEncoder` heads give ``K >= 3`` keypoints per capsule).
The decoder is exactly equivariant, so the reconstruction loss alone cannot teach the linear part of an affine
pose: :func:`pose_consistency` (not in the paper) does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from probcaps.config import Range
from probcaps.encoders import PartEncoder
from probcaps.geometry import compose, constrained_pose, invert, matrix_to_pose6, pose6_to_matrix, translation_matrix
from probcaps.render import render_templates, warp

__all__ = ["MODES", "COMBINES", "RECOGNITIONS", "TransformingAutoencoderConfig", "TransformingAutoencoder",
           "estimate_transform", "transform_components", "pose_consistency"]

MODES = ("translation", "affine")
COMBINES = ("sum", "mixture")
RECOGNITIONS = ("mlp", "conv")


@dataclass
class TransformingAutoencoderConfig:
    mode: str = "translation"        # "translation" (pose = (x, y)) or "affine" (pose = 3x3 affine matrix)
    canvas_size: int = 40            # H = W of the input and output images
    num_capsules: int = 30           # M
    recognition: str = "mlp"         # "mlp" (the paper's) or "conv" (a conv trunk, per-capsule attention heads)
    recognition_hidden: int = 32     # "mlp": recognition units per capsule
    conv_channels: list = field(default_factory=lambda: [32, 64, 64])  # "conv": trunk channels per layer
    conv_strides: list = field(default_factory=lambda: [2, 2, 1])      # "conv": trunk strides (3x3 kernels)
    keypoints: int = 3               # "conv": attention points per capsule (K >= 3)
    keypoint_radius: float = 0.3     # the canonical points lie on a circle of this radius (normalised units)
    # "conv": a keypoint is its attention centre plus an offset of at most this times max_translation (below 1 the
    # pose comes more from where the keypoints look, which is equivariant, than from regressed offsets)
    keypoint_offset_gain: float = field(default=1.0, metadata={"range": Range(0, 1)})
    template_size: int = 14          # t: each capsule's template is t x t pixels at pose scale 1
    template_init: str = "blob"      # "blob": a soft brush plus noise; "data": training images, asymmetric at once
    combine: str = "sum"             # "sum": presence-weighted sum (the paper); "mixture": one capsule explains it
    mixture_pixel_std: float = 0.1   # "mixture": pixel noise of each capsule's likelihood (sharpness of the choice)
    presence_bias_init: float = 0.0  # initial presence logit of every capsule
    min_scale: float = 0.5           # affine mode: pose scales squashed into [min_scale, max_scale]
    max_scale: float = 1.5
    max_shear: float = 0.5
    max_translation: float = 1.0     # |pose translation| bound (normalised units; 1 = the canvas edge)
    seed: int = 0                    # parameter initialisation

    def validate(self) -> None:
        """What the config layer's range rules cannot say (checked also for a config built in code)."""
        for key, choices in (("mode", MODES), ("combine", COMBINES), ("recognition", RECOGNITIONS),
                             ("template_init", ("blob", "data"))):
            if getattr(self, key) not in choices:
                raise ValueError(f"model.{key} must be one of {choices}, got {getattr(self, key)!r}")
        if not self.mixture_pixel_std > 0:
            raise ValueError(f"model.mixture_pixel_std must be > 0, got {self.mixture_pixel_std}")
        if len(self.conv_channels) != len(self.conv_strides) or not self.conv_channels:
            raise ValueError(f"model.conv_channels and model.conv_strides must be non-empty and of equal length, got "
                             f"{self.conv_channels} and {self.conv_strides}")
        if self.keypoints < 3:
            raise ValueError(f"model.keypoints must be >= 3 (an affine map needs 3 points), got {self.keypoints}")
        if not 0 < self.keypoint_radius < self.max_translation:
            raise ValueError(f"model.keypoint_radius must be in (0, max_translation), got {self.keypoint_radius}")
        if not 0 < self.min_scale < self.max_scale:
            raise ValueError(f"model.min_scale/max_scale must satisfy 0 < min < max, got {self.min_scale}, "
                             f"{self.max_scale}")


def _blob_logits(M: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """``(M, 1, t, t)`` initial template logits: a soft round brush (every pose gets a gradient from the first
    step) plus noise that breaks the capsules' symmetry."""
    r = torch.linspace(-1, 1, t)
    blob = 4.0 * torch.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * 0.4 ** 2)) - 3.0
    return blob + 0.5 * torch.randn(M, 1, t, t, generator=gen)


class TransformingAutoencoder(nn.Module):
    """``model(images (B, 1, H, W), transforms (B, 3, 3)) -> reconstruction of the transformed images (B, 1, H, W)``."""

    def __init__(self, config: TransformingAutoencoderConfig | None = None):
        super().__init__()
        cfg = self.config = config or TransformingAutoencoderConfig()
        cfg.validate()
        M, Hd, t, D = cfg.num_capsules, cfg.recognition_hidden, cfg.template_size, cfg.canvas_size ** 2
        out_dim = 1 + (2 if cfg.mode == "translation" else 6)  # presence logit, then the pose numbers
        gen = torch.Generator().manual_seed(cfg.seed)
        if cfg.recognition == "conv":
            self._init_conv_recognition()
        else:
            # capsule m's hidden units are columns [m*Hd, (m+1)*Hd) of one (D, M*Hd) matrix, so the hidden layer of
            # all capsules is a single matmul; each capsule's output layer is its own (Hd, out_dim) block
            self.hidden_weight = nn.Parameter(torch.randn(D, M * Hd, generator=gen) / math.sqrt(D))
            self.hidden_bias = nn.Parameter(torch.zeros(M * Hd))
            self.output_weight = nn.Parameter(torch.randn(M, Hd, out_dim, generator=gen) / math.sqrt(Hd))
            self.output_bias = nn.Parameter(torch.cat([torch.full((M, 1), cfg.presence_bias_init),
                                                       torch.zeros(M, out_dim - 1)], 1))
        # generative side: one learned template per capsule (intensities through a sigmoid, so in [0, 1])
        self.template_logits = nn.Parameter(_blob_logits(M, t, gen))

    def _init_conv_recognition(self) -> None:
        """:class:`PartEncoder` with ``M·K`` "parts": keypoint ``k`` of capsule ``m`` sits where its own attention
        map looks plus a bounded offset, starting at ``keypoint_offset_gain`` times the canonical point ``u_k`` (at
        gain 1 a capsule's first pose maps the template onto the canvas at its native size)."""
        cfg = self.config
        M, K = cfg.num_capsules, cfg.keypoints
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            pose_kwargs = self._pose_kwargs()
            # only the keypoints' translations are used: the gain bounds their regressed offsets
            pose_kwargs["max_translation"] *= cfg.keypoint_offset_gain
            self.encoder = PartEncoder(M * K, channels=tuple(cfg.conv_channels), strides=tuple(cfg.conv_strides),
                                       feature_dim=0, pose_kwargs=pose_kwargs)
        # canonical template points u_k (K, 2) on a circle, the first straight up (mean 0: the pose's translation is
        # the keypoints' mean), and the least-squares map U⁺ with P = Q U⁺
        angle = 2 * math.pi * torch.arange(K, dtype=torch.float64) / K - math.pi / 2
        points = (cfg.keypoint_radius * torch.stack([angle.cos(), angle.sin()], -1)).float()
        self.register_buffer("canonical_points", points, persistent=False)
        U = torch.cat([points.T, torch.ones(1, K)])                                      # (3, K)
        self.register_buffer("canonical_pinv", U.T @ torch.linalg.inv(U @ U.T), persistent=False)  # (K, 3)
        bias = self.encoder.head.bias.view(M, K, -1)  # per keypoint: 6 pose, presence logit, attention logit
        with torch.no_grad():  # offsets (tanh-squashed translations, entries 4 and 5 of the raw pose) at the u_k
            bias[..., 6] = cfg.presence_bias_init
            bias[..., 4:6] = torch.atanh(points / cfg.max_translation)

    @torch.no_grad()
    def init_templates_from(self, images: torch.Tensor, scale: float = 1.0, contrast: float = 0.9) -> None:
        """Start the templates from ``M`` images ``(M, 1, h, w)`` in ``[0, 1]`` (e.g. training digits, which unlike a
        round blob have no rotation symmetry), rendered at ``scale`` times their pixel size and squeezed into
        ``[(1 - contrast)/2, (1 + contrast)/2]`` (the sigmoid's logit stays finite)."""
        M, t = self.config.num_capsules, self.config.template_size
        if images.dim() != 4 or images.shape[0] != M:
            raise ValueError(f"init_templates_from: expected ({M}, 1, h, w) images, got {tuple(images.shape)}")
        S = torch.diag(images.new_tensor([scale, scale, 1.0])).expand(M, 3, 3)
        small = warp(images.to(self.template_logits), S, t).clamp(0, 1)
        self.template_logits.copy_(torch.logit(0.5 + contrast * (small - 0.5)))

    def templates(self) -> torch.Tensor:
        """``(M, 1, t, t)`` template intensities in ``[0, 1]``."""
        return torch.sigmoid(self.template_logits)

    def recognise(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Presences ``(B, M)`` in ``(0, 1)`` and poses ``(B, M, 3, 3)`` of every capsule, from ``(B, 1, H, W)``."""
        cfg, B = self.config, images.shape[0]
        if cfg.recognition == "conv":
            logits, points, _ = self._keypoint_outputs(images)
            pose = self.pose_from_points(points)
            if cfg.mode == "translation":  # keep only where the capsule is
                pose = translation_matrix(pose[..., 0, 2], pose[..., 1, 2])
            return self.presence(logits.mean(-1)), pose  # a capsule's presence logit: its keypoints' mean
        x = images.reshape(B, -1)
        if x.shape[1] != self.hidden_weight.shape[0]:
            raise ValueError(f"recognise: expected images of {cfg.canvas_size}x{cfg.canvas_size} pixels, got "
                             f"{tuple(images.shape)}")
        pre = torch.addmm(self.hidden_bias, x, self.hidden_weight).view(B, cfg.num_capsules, cfg.recognition_hidden)
        out = torch.einsum("bmh,mho->bmo", torch.sigmoid(pre), self.output_weight) + self.output_bias  # (B, M, 1+pose)
        return self.presence(out[..., 0]), self.pose_matrix(out[..., 1:])

    def recognise_averaged(self, images: torch.Tensor, warps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recognition averaged over known warps of each image (test-time augmentation): presences ``(B, M)`` and
        poses ``(B, M, 3, 3)`` from ``images (B, 1, H, W)`` and ``warps (K, 3, 3)``.  The pose seen in the image
        warped by ``A_k`` is mapped back by ``A_k⁻¹``; presences are the mean, poses the presence-weighted mean."""
        B, K = images.shape[0], warps.shape[0]
        A = warps.to(images).repeat_interleave(B, 0)                                   # (K·B, 3, 3), warp-major
        presence, poses = self.recognise(warp(images.repeat(K, 1, 1, 1), A, self.config.canvas_size))
        presence = presence.view(K, B, -1)
        poses = compose(invert(A).unsqueeze(1), poses).view(K, B, -1, 3, 3)
        w = presence[..., None, None]
        return presence.mean(0), (w * poses).sum(0) / w.sum(0).clamp_min(1e-12)

    def presence(self, logits: torch.Tensor) -> torch.Tensor:
        """Presence logits ``(B, M)`` -> presences: independent sigmoids, or for ``combine = "mixture"`` a softmax
        over the capsules (the mixture weights, which sum to 1)."""
        return logits.softmax(-1) if self.config.combine == "mixture" else torch.sigmoid(logits)

    def _keypoint_outputs(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """"conv" recognition per capsule and keypoint: presence logits ``(B, M, K)``, keypoints ``(B, M, K, 2)``
        (the translations of the heads' poses) and attention centres ``(B, M, K, 2)``."""
        B, M, K = images.shape[0], self.config.num_capsules, self.config.keypoints
        out = self.encoder(images)
        return out.presence_logit.view(B, M, K), out.pose.view(B, M, K, 6)[..., [2, 5]], out.centre.view(B, M, K, 2)

    @torch.no_grad()
    def keypoint_spread(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean distance from their mean of the keypoints of each image's most present capsule, and of the places
        they look at (attention centres): ``(B,)`` and ``(B,)`` in normalised units ("conv" recognition).  Centres much
        closer together than the keypoints: the pose's linear part comes from the regressed offsets."""
        if self.config.recognition != "conv":
            raise ValueError("keypoint_spread needs recognition = 'conv'")
        logits, points, centres = self._keypoint_outputs(images)
        top = logits.mean(-1).argmax(1)                                                  # (B,)
        rows = torch.arange(images.shape[0], device=images.device)
        picked = (p[rows, top] for p in (points, centres))                                # (B, K, 2) each
        return tuple((p - p.mean(1, keepdim=True)).norm(dim=-1).mean(1) for p in picked)

    def pose_from_points(self, points: torch.Tensor) -> torch.Tensor:
        """``(..., K, 2)`` keypoints on the canvas -> the least-squares affine pose ``(..., 3, 3)`` taking the
        canonical template points ``u_k`` to them (exact for ``K = 3``).  Linear in the points, so a pose moves
        exactly with its keypoints: ``T`` applied to every keypoint is ``T ∘ P``."""
        Q = torch.cat([points, torch.ones_like(points[..., :1])], -1).transpose(-1, -2)  # (..., 3, K)
        P = Q @ self.canonical_pinv                                                      # (..., 3, 3)
        return torch.cat([P[..., :2, :], P.new_tensor([0.0, 0.0, 1.0]).expand(*P.shape[:-2], 1, 3)], -2)

    def pose_matrix(self, raw: torch.Tensor) -> torch.Tensor:
        """Recognition outputs ``(..., 2)`` (translation: ``max_translation · tanh(raw)``, bounded so that a capsule
        cannot park its template off the canvas) or ``(..., 6)`` (affine: SCAE's :func:`constrained_pose`) -> poses
        ``(..., 3, 3)``."""
        cfg = self.config
        if cfg.mode == "translation":
            xy = cfg.max_translation * torch.tanh(raw)
            return translation_matrix(xy[..., 0], xy[..., 1])
        return pose6_to_matrix(constrained_pose(raw, **self._pose_kwargs()))

    def _pose_kwargs(self) -> dict:
        return {k: getattr(self.config, k) for k in ("min_scale", "max_scale", "max_shear", "max_translation")}

    def render(self, presence: torch.Tensor, poses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every capsule's template rendered at its pose ``(B, M, 3, 3)`` (template -> canvas) and weighted by its
        presence ``(B, M)``: ``(image (B, 1, H, W), contributions (B, M, 1, H, W))``, the image their sum (for
        ``"mixture"``: the mixture's mean image)."""
        layers = render_templates(self.templates(), poses, self.config.canvas_size)  # (B, M, 1, H, W)
        contributions = presence[..., None, None, None] * layers
        return contributions.sum(1), contributions

    def reconstruction_loss(self, presence: torch.Tensor, poses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of capsules ``presence (B, M)`` at ``poses (B, M, 3, 3)`` for ``targets (B, 1, H, W)``.

        ``"sum"``: the MSE of the combined image (the paper's loss).  ``"mixture"``: ``-(2σ²/D) log Σ_m π_m
        exp(-SSE_m / 2σ²)`` (``D`` pixels, ``σ = mixture_pixel_std``), the negative log-likelihood of a mixture in
        which capsule ``m`` (weight ``π_m``) renders the whole image, scaled to tend to the best capsule's error.
        """
        if self.config.combine != "mixture":
            return F.mse_loss(self.render(presence, poses)[0], targets)
        layers = render_templates(self.templates(), poses, self.config.canvas_size)      # (B, M, 1, H, W)
        sse = (layers - targets.unsqueeze(1)).square().flatten(2).sum(-1)                # (B, M)
        two_var = 2 * self.config.mixture_pixel_std ** 2
        log_lik = torch.logsumexp(presence.clamp_min(1e-30).log() - sse / two_var, -1)   # (B,)
        return -(two_var / layers[0, 0].numel()) * log_lik.mean()

    def forward(self, images: torch.Tensor, transforms: torch.Tensor) -> torch.Tensor:
        """Reconstruction ``(B, 1, H, W)`` of ``images`` transformed by the known ``transforms`` ``(B, 3, 3)``."""
        return self.reconstruct(images, transforms)[0]

    def reconstruct(self, images: torch.Tensor, transforms: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Like ``forward``, also returning ``{"presence", "pose", "transformed_pose", "contributions"}``."""
        presence, poses = self.recognise(images)
        image, contributions = self.render(presence, moved := self.apply_transform(poses, transforms))
        return image, {"presence": presence, "pose": poses, "transformed_pose": moved, "contributions": contributions}

    @staticmethod
    def apply_transform(poses: torch.Tensor, transforms: torch.Tensor) -> torch.Tensor:
        """``T ∘ P_m`` for every capsule: poses ``(B, M, 3, 3)``, transforms ``(B, 3, 3)`` -> ``(B, M, 3, 3)``.  ``T``
        acts on canvas coordinates, after the pose (for translations: ``(dx, dy)`` added to ``(x, y)``)."""
        return compose(transforms.unsqueeze(1), poses)


def estimate_transform(pose1: torch.Tensor, pose2: torch.Tensor, weights: torch.Tensor, mode: str,
                       ridge: float = 1e-4) -> torch.Tensor:
    """The transformation ``(B, 3, 3)`` between two images from their capsules' poses ``pose1, pose2 (B, M, 3, 3)``
    alone: weighted least squares over capsules (``weights (B, M)``, e.g. ``p1 * p2``, present in both),
    ``T = argmin Σ_m w_m ||T P1_m − P2_m||²``.  ``"translation"``: the weighted mean of ``t2_m − t1_m`` (the numpy
    reproduction's "presence-weighted average of pose2 − pose1"); ``"affine"``: ``T = (Σ w P2 P1ᵀ)(Σ w P1 P1ᵀ)⁻¹``
    (three capsules at distinct places fix it), ``ridge · I`` added to both sums (an ill-posed fit shrinks to the
    identity)."""
    if mode not in MODES:
        raise ValueError(f"estimate_transform: mode must be one of {MODES}, got {mode!r}")
    w = weights.clamp_min(0)
    if mode == "translation":
        shift = pose2[..., :2, 2] - pose1[..., :2, 2]                                   # (B, M, 2)
        mean = (w.unsqueeze(-1) * shift).sum(1) / w.sum(1, keepdim=True).clamp_min(1e-12)
        return translation_matrix(mean[:, 0], mean[:, 1])
    wm = w[..., None, None]
    eye = torch.eye(3, dtype=pose1.dtype, device=pose1.device)
    cross = (wm * pose2 @ pose1.transpose(-1, -2)).sum(1) + ridge * eye                # Σ w P2 P1ᵀ
    gram = (wm * pose1 @ pose1.transpose(-1, -2)).sum(1) + ridge * eye                 # Σ w P1 P1ᵀ
    T = torch.linalg.solve(gram, cross, left=False)                                     # cross · gram⁻¹
    # the last row is (0, 0, 1) in exact arithmetic (every pose's is); set it exactly
    return torch.cat([T[:, :2], eye[2:].expand(T.shape[0], 1, 3)], 1)


def transform_components(T: torch.Tensor, mode: str, canvas_size: int) -> tuple[torch.Tensor, list[str]]:
    """The numbers the disentanglement is scored on, ``(B, K)``, and their names: ``(dx, dy)`` in pixels, or the six
    free entries of ``T`` (``m11, m12, tx, m21, m22, ty``: the 2x2 block and the translation in pixels)."""
    px = canvas_size / 2.0  # normalised units -> pixels
    if mode == "translation":
        return torch.stack([T[:, 0, 2] * px, T[:, 1, 2] * px], -1), ["dx", "dy"]
    y = matrix_to_pose6(T)
    comps = torch.stack([y[:, 0] + 1, y[:, 1], y[:, 2] * px, y[:, 3], y[:, 4] + 1, y[:, 5] * px], -1)
    return comps, ["m11", "m12", "tx", "m21", "m22", "ty"]


def pose_consistency(pose1: torch.Tensor, pose2: torch.Tensor, transforms: torch.Tensor, weights: torch.Tensor,
                     cap: float = 0.0) -> torch.Tensor:
    """How far the poses of two images are from being related by their known transformation: a scalar.

    With ``E_bm = P2_bm⁻¹ T_b P1_bm`` (the identity when ``P2 = T P1``), ``mean_b [Σ_m w_bm (‖E_bm − I‖² +
    ‖E_bm⁻¹ − I‖²)] / Σ_m w_bm``: the mismatch in each capsule's template frame, both ways (on the canvas a pose
    shrunk to a point would be a trivial minimum).  ``pose1, pose2 (B, M, 3, 3)``, the second image the first
    transformed by ``transforms (B, 3, 3)``; ``weights (B, M)``, e.g. ``p1 * p2``, detached.  ``cap > 0``: each
    mismatch ``c`` counts as ``cap · c / (cap + c)``, so a collapsing keypoint triangle does not swamp the others.
    """
    if not cap >= 0:
        raise ValueError(f"pose_consistency: cap must be >= 0, got {cap}")
    eye = torch.eye(3, dtype=pose1.dtype, device=pose1.device)
    E = compose(invert(pose2), compose(transforms.unsqueeze(1), pose1))      # (B, M, 3, 3)
    mismatch = (E - eye).square().sum((-1, -2)) + (invert(E) - eye).square().sum((-1, -2))  # (B, M)
    if cap > 0:
        mismatch = cap * mismatch / (cap + mismatch)
    w = weights.clamp_min(0)
    return ((w * mismatch).sum(1) / w.sum(1).clamp_min(1e-8)).mean()
