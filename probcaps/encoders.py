"""Encoders of the SCAE-style guide (Smith et al. 2020, "Capsule networks -- a probabilistic perspective").

The guide maps an image to ``M`` part capsules with a CNN and attentive pooling (:class:`PartEncoder`) and the
*set* of part capsules to ``K`` object capsules with a set transformer (:class:`SetTransformer`); there is no
direct image -> object path.

The set-transformer blocks follow Lee et al. 2019 (``MAB``, ``SAB``, ``ISAB``, ``PMA``), with one addition: every
block takes ``key_weights`` (B, N) in ``[0, 1]``, a soft presence mask on the set elements.  ``log(w)`` (``w``
clamped below at ``1e-6``) is added to the attention logits, so an element of weight ``w`` counts as ``w`` copies
of itself in the softmax; weights in ``(0, 1e-6]`` all count as ``1e-6``.  A hard ``0`` (or ``False`` in a boolean
mask) is masked *exactly*: it gets the most negative finite logit bias instead of ``log(1e-6)``, so its attention
weight underflows to 0 and the output does not depend on its values.  (With the ``log(1e-6) ~ -13.8`` bias alone a
masked key still leaks ``1e-6 * exp(logit gap)``, which for a masked key with large logits was measured up to 1e-2.)
Gradients w.r.t. ``key_weights`` are 0 below ``1e-6``, as with a plain clamp.  If every key of a row is masked the
softmax is uniform over them (finite, no NaN).

Everything is vectorised over batch, heads and capsules; nothing is device specific.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from probcaps.geometry import constrained_pose

__all__ = ["MAB", "SAB", "ISAB", "PMA", "SetTransformer", "PartEncoder", "PartOutput", "key_bias"]

#: Smallest key weight before taking the log: ``log(1e-6) ~ -13.8`` on the attention logits.
MIN_KEY_WEIGHT = 1e-6

#: Attention kernel.  Measured on a 2-core CPU (torch 2.13, 2 threads, B=128, N=40, dim 128, 4 heads): the explicit
#: batched ``softmax(QK^T/sqrt(d) + bias) V`` vs ``F.scaled_dot_product_attention`` with an additive float mask is
#: ~11 vs ~11.5 ms fwd+bwd and 1.6 vs 3.4 ms forward-only for one attention op; for the whole default SetTransformer
#: (benchmarks/bench_encoders.py) ~67 vs ~74 ms fwd+bwd and ~19 vs ~25 ms forward.  So the explicit version is the
#: default.  Set to True to use SDPA (e.g. for fused kernels on CUDA); both give the same result.
USE_SDPA = False


def key_bias(key_weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``(B, N)`` presence weights (float in [0, 1] or bool) -> additive logit bias ``(B, 1, 1, N)`` or None.

    ``log(max(w, 1e-6))`` for ``w > 0``; ``finfo(dtype).min`` (exact masking) for ``w == 0``."""
    if key_weights is None:
        return None
    w = key_weights.to(dtype)
    bias = torch.log(w.clamp_min(MIN_KEY_WEIGHT))
    # exact zeros: the most negative finite value (not -inf, so fully masked rows stay finite)
    bias = bias.masked_fill(w <= 0, torch.finfo(dtype).min)
    return bias[:, None, None, :]


class MAB(nn.Module):
    """Multihead attention block ``MAB(Q, K)`` (Lee et al. 2019).

    ``O = LN(Q' + Attn(Q', K', V'))``, ``MAB = LN(O + ReLU(fc_o(O)))`` with ``Q' = fc_q(Q)``, ``K' = fc_k(K)``,
    ``V' = fc_v(K)``, heads split along the feature axis.  (Logits scaled by ``1/sqrt(head_dim)``; the reference
    code uses ``1/sqrt(dim_v)``.)

    ``forward(Q (B, Nq, dim_q), K (B, Nk, dim_k), key_weights (B, Nk) | None) -> (B, Nq, dim_v)``; ``Q`` may have
    batch size 1 (learned seeds or inducing points, shared by the batch: projected once, then broadcast).
    """

    def __init__(self, dim_q: int, dim_k: int, dim_v: int, num_heads: int, ln: bool = True):
        super().__init__()
        if dim_v % num_heads:
            raise ValueError(f"MAB: dim_v={dim_v} must be divisible by num_heads={num_heads}")
        self.dim_v, self.num_heads = dim_v, num_heads
        self.fc_q = nn.Linear(dim_q, dim_v)
        self.fc_k = nn.Linear(dim_k, dim_v)
        self.fc_v = nn.Linear(dim_k, dim_v)
        self.fc_o = nn.Linear(dim_v, dim_v)
        self.ln0 = nn.LayerNorm(dim_v) if ln else nn.Identity()
        self.ln1 = nn.LayerNorm(dim_v) if ln else nn.Identity()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, dim_v) -> (B, H, N, dim_v / H)
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def forward(self, Q: torch.Tensor, K: torch.Tensor, key_weights: torch.Tensor | None = None) -> torch.Tensor:
        q = self.fc_q(Q)
        qh, kh, vh = self._heads(q), self._heads(self.fc_k(K)), self._heads(self.fc_v(K))
        bias = key_bias(key_weights, q.dtype)
        if USE_SDPA:
            a = F.scaled_dot_product_attention(qh.expand(kh.shape[0], -1, -1, -1), kh, vh, attn_mask=bias)
        else:
            logits = qh @ kh.transpose(-1, -2) * (1.0 / math.sqrt(qh.shape[-1]))
            a = torch.softmax(logits if bias is None else logits + bias, -1) @ vh
        a = a.transpose(1, 2).flatten(-2)  # (B, Nq, dim_v)
        O = self.ln0(q.expand_as(a) + a)
        return self.ln1(O + F.relu(self.fc_o(O)))


class SAB(nn.Module):
    """Set attention block ``MAB(X, X)``: permutation equivariant, ``(B, N, dim_in) -> (B, N, dim_out)``."""

    def __init__(self, dim_in: int, dim_out: int, num_heads: int, ln: bool = True):
        super().__init__()
        self.mab = MAB(dim_in, dim_in, dim_out, num_heads, ln)

    def forward(self, X: torch.Tensor, key_weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.mab(X, X, key_weights)


class ISAB(nn.Module):
    """Induced set attention block: ``H = MAB(I, X)`` (learned inducing points attend to the masked set), then
    ``MAB(X, H)`` (each element attends to the inducing summaries).  Equivariant, ``O(N * num_inds)``."""

    def __init__(self, dim_in: int, dim_out: int, num_heads: int, num_inds: int, ln: bool = True):
        super().__init__()
        self.I = nn.Parameter(torch.empty(1, num_inds, dim_out))
        nn.init.xavier_uniform_(self.I)
        self.mab0 = MAB(dim_out, dim_in, dim_out, num_heads, ln)
        self.mab1 = MAB(dim_in, dim_out, dim_out, num_heads, ln)

    def forward(self, X: torch.Tensor, key_weights: torch.Tensor | None = None) -> torch.Tensor:
        H = self.mab0(self.I, X, key_weights)  # the inducing points are shared: projected once, not per image
        return self.mab1(X, H)


class PMA(nn.Module):
    """Pooling by multihead attention: ``num_seeds`` learned seeds attend to the masked set.
    Invariant, ``(B, N, dim) -> (B, num_seeds, dim)``."""

    def __init__(self, dim: int, num_heads: int, num_seeds: int, ln: bool = True):
        super().__init__()
        self.S = nn.Parameter(torch.empty(1, num_seeds, dim))
        nn.init.xavier_uniform_(self.S)
        self.mab = MAB(dim, dim, dim, num_heads, ln)

    def forward(self, X: torch.Tensor, key_weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.mab(self.S, X, key_weights)  # the seeds are shared: projected once, not per image


class SetTransformer(nn.Module):
    """``ISAB x num_isab -> PMA(num_outputs seeds) -> Linear``; the set -> object-capsule encoder.

    ``forward(x (B, N, dim_in), key_weights (B, N) | None) -> (B, num_outputs, dim_out)``, invariant to joint
    permutations of ``x`` and ``key_weights`` along ``N``.  ``key_weights`` masks the set at every layer.
    """

    def __init__(
        self,
        dim_in: int,
        num_outputs: int,
        dim_out: int,
        dim_hidden: int = 128,
        num_heads: int = 4,
        num_inds: int = 16,
        num_isab: int = 2,
        ln: bool = True,
    ):
        super().__init__()
        dims = [dim_in] + [dim_hidden] * num_isab
        self.enc = nn.ModuleList(ISAB(a, b, num_heads, num_inds, ln) for a, b in zip(dims[:-1], dims[1:]))
        self.pool = PMA(dims[-1], num_heads, num_outputs, ln)
        self.out = nn.Linear(dims[-1], dim_out)

    def forward(self, x: torch.Tensor, key_weights: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.enc:
            x = block(x, key_weights)
        return self.out(self.pool(x, key_weights))


def _position_grid(h: int, w: int, device, dtype) -> torch.Tensor:
    """``(h*w, 2)`` centres of an ``h x w`` feature map's cells in normalised canvas coordinates (x, y)."""
    ys = (torch.arange(h, device=device, dtype=dtype) * 2 + 1) / h - 1
    xs = (torch.arange(w, device=device, dtype=dtype) * 2 + 1) / w - 1
    return torch.stack(torch.meshgrid(xs, ys, indexing="xy"), -1).reshape(-1, 2)


class PartOutput(NamedTuple):
    """Part capsules from :class:`PartEncoder`."""

    presence_logit: torch.Tensor  # (B, M)
    pose: torch.Tensor  # (B, M, 6): pose 6-vector, constrained_pose(pose_raw)
    pose_raw: torch.Tensor  # (B, M, 6): (sx, sy, theta, shear, tx, ty) before squashing
    features: torch.Tensor  # (B, M, feature_dim)
    centre: torch.Tensor | None = None  # (B, M, 2): where each part's attention looks (attention_translation only)


class PartEncoder(nn.Module):
    """Image -> ``num_parts`` part capsules: CNN, then attentive pooling (SCAE's primary-capsule encoder).

    A 1x1 conv maps the CNN feature map to, per part, ``6`` raw pose parameters, ``1`` presence logit,
    ``feature_dim`` features and ``1`` attention logit.  The attention logits are softmaxed over spatial positions
    and each part's parameters are the attention-weighted sum over positions.  Padding ``kernel_size // 2``, so a
    stride-2 layer halves the size (40x40 -> 10x10 and 28x28 -> 7x7 with the default strides); any ``H, W`` works.

    ``forward(x (B, in_channels, H, W)) -> PartOutput``.  ``pose_kwargs`` are passed to
    :func:`probcaps.geometry.constrained_pose` (``min_scale``, ``max_scale``, ``max_shear``, ``max_translation``).
    ``compile``: run the CNN through ``torch.compile`` (fuses each convolution with its activation; the first call
    pays for the compile, and each new input shape compiles again).  A plain attribute, not in the state dict.
    """

    def __init__(
        self,
        num_parts: int,
        in_channels: int = 1,
        channels: tuple[int, ...] = (128, 128, 128, 128),
        kernel_size: int = 3,
        strides: tuple[int, ...] = (2, 2, 1, 1),
        feature_dim: int = 16,
        activation: type[nn.Module] = nn.ELU,
        pose_kwargs: dict | None = None,
        attention_translation: bool = True,
        bf16: bool = False,
        compile: bool = False,
    ):
        super().__init__()
        self.attention_translation = attention_translation
        self.bf16 = bf16
        self.compile = compile
        if len(channels) != len(strides):
            raise ValueError(f"PartEncoder: {len(channels)} channels but {len(strides)} strides")
        self.num_parts, self.feature_dim = num_parts, feature_dim
        self.pose_kwargs = dict(pose_kwargs or {})
        layers, c_in = [], in_channels
        for c, s in zip(channels, strides):
            layers += [nn.Conv2d(c_in, c, kernel_size, stride=s, padding=kernel_size // 2), activation()]
            c_in = c
        self.cnn = nn.Sequential(*layers)
        self.n_param = 6 + 1 + feature_dim  # per part: pose_raw, presence logit, features (+1 attention logit)
        self.head = nn.Conv2d(c_in, num_parts * (self.n_param + 1), 1)
        self._init_head()

    @torch.no_grad()
    def _init_head(self) -> None:
        # Head weights viewed as (M, n_param + 1, C); bias as (M, n_param + 1).
        # * Presence: weights x0.01 and bias 0, so presence logits start near 0 (presence prob ~1/2: every part is
        #   used and gets gradient), yet are not exactly constant.
        # * Pose: the raw pose is (spatial average of a small image-dependent term) + bias.  Pooling over positions
        #   averages the conv output, so with a zero bias every part would start at nearly the same pose (centre of
        #   the canvas), a symmetric start the parts would have to break themselves.  We give each part its own
        #   translation bias on a grid spanning the central half of the canvas in *squashed* coordinates
        #   (raw = atanh(u), so tx = max_translation * u for u in [-0.5, 0.5]), and shrink the pose weights x0.1 so the
        #   spread is not swamped at start.  Scale/rotation/shear biases stay 0 (mid-range scale, no rotation/shear).
        M, P = self.num_parts, self.n_param + 1
        w = self.head.weight.view(M, P, -1)
        b = self.head.bias.view(M, P)
        w[:, 6].mul_(0.01)
        b[:, 6].zero_()
        w[:, :6].mul_(0.1)
        b[:, :6].zero_()
        g = math.ceil(math.sqrt(M))
        ticks = torch.linspace(-0.5, 0.5, g) if g > 1 else torch.zeros(1)
        grid = torch.stack(torch.meshgrid(ticks, ticks, indexing="xy"), -1).reshape(-1, 2)  # (g*g, 2): (x, y)
        idx = torch.linspace(0, g * g - 1, M).round().long()  # M cells spread evenly over the grid
        b[:, 4:6] = torch.atanh(grid[idx])

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """The CNN: ``(B, in_channels, H, W) -> (B, C, H', W')`` feature map (bfloat16 if ``bf16``)."""
        # bf16: the convolutions (most of the encoder's time) in bfloat16 autocast, everything after them in float32
        # channels-last: oneDNN's convolutions (CPU) and cuDNN's tensor-core paths are faster in NHWC
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.cnn(x.contiguous(memory_format=torch.channels_last))

    def _compiled_trunk(self):
        # a compiled function, not a compiled module: the state dict keeps its keys
        if "_trunk_compiled" not in self.__dict__:
            self.__dict__["_trunk_compiled"] = torch.compile(self.trunk, dynamic=False)
        return self.__dict__["_trunk_compiled"]

    def forward(self, x: torch.Tensor) -> PartOutput:
        features = self._compiled_trunk()(x) if self.compile else self.trunk(x)
        fh, fw = features.shape[-2:]
        f = features.to(x.dtype).permute(0, 2, 3, 1).reshape(x.shape[0], fh * fw, -1)  # (B, N, C), N = H'W'
        # The head is a 1x1 conv, linear in the features, so pooling commutes with it: each part's attention
        # logits come from the head's last row, the features are pooled per part, and the head's other rows are
        # applied to the pooled (B, M, C) features.  The same function as conv -> softmax -> weighted sum, without
        # the (B, M * (n_param + 1), H', W') map: about 10x fewer multiply-adds at SCAE's sizes (40 parts, 16
        # features, a 10x10 map).
        w = self.head.weight.view(self.num_parts, self.n_param + 1, -1)  # (M, P + 1, C)
        b = self.head.bias.view(self.num_parts, self.n_param + 1)
        att = torch.softmax(torch.matmul(f, w[:, -1].T).transpose(1, 2) + b[:, -1, None], -1)  # (B, M, N)
        pooled = torch.matmul(att, f)  # (B, M, C)
        params = torch.einsum("mpc,bmc->bmp", w[:, :-1], pooled) + b[:, :-1]  # (B, M, P)
        pose_raw = params[..., :6]
        pose = constrained_pose(pose_raw, **self.pose_kwargs)
        centre = None
        if self.attention_translation:
            # the part sits where its attention looks (plus the squashed offset): placing a part is then a matter
            # of where to look, learned far faster than regressing coordinates from pooled features
            centre = torch.einsum("bmn,nd->bmd", att, _position_grid(fh, fw, f.device, f.dtype))  # (B, M, 2)
            pose = pose + F.pad(centre.unsqueeze(-1), (2, 0)).flatten(-2)  # adds (0,0,cx,0,0,cy): translations
        return PartOutput(
            presence_logit=params[..., 6],
            pose=pose,
            pose_raw=pose_raw,
            features=params[..., 7:],
            centre=centre,
        )
