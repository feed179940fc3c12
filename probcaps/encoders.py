"""Encoders of the SCAE-style guide (Smith et al. 2020, "Capsule networks -- a probabilistic perspective").

An image goes to ``M`` part capsules through a CNN and attentive pooling (:class:`PartEncoder`), the *set* of part
capsules to ``K`` object capsules through a set transformer (:class:`SetTransformer`, blocks after Lee et al. 2019).

Every block takes ``key_weights`` (B, N) in ``[0, 1]``, a soft presence mask: ``log(max(w, 1e-6))`` is added to the
attention logits, so an element of weight ``w`` counts as ``w`` copies of itself.  A hard ``0`` (or ``False``) gets
the most negative finite bias instead, so its weight underflows to 0 exactly (``log(1e-6)`` alone leaks up to
1e-2); a row with every key masked attends uniformly (no NaN).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from probcaps.geometry import constrained_pose

__all__ = ["MAB", "SAB", "ISAB", "PMA", "SetTransformer", "PartEncoder", "PartOutput", "key_bias",
           "PhaseSplitConv2d"]

#: Smallest key weight before taking the log: ``log(1e-6) ~ -13.8`` on the attention logits.
MIN_KEY_WEIGHT = 1e-6

#: ``F.scaled_dot_product_attention`` instead of the explicit ``softmax(QK^T/sqrt(d) + bias) V`` (the same result).
#: Off: on a 2-core CPU the explicit form is faster, for the default SetTransformer ~67 vs ~74 ms forward + backward
#: and ~19 vs ~25 ms forward (benchmarks/bench_encoders.py); SDPA may pay on CUDA (fused kernels).
USE_SDPA = False


class PhaseSplitConv2d(nn.Conv2d):
    """A strided ``nn.Conv2d`` computed as ``stride**2`` stride-1 convolutions, one per phase of the input grid.

    Output pixel ``(y, x)`` of a stride-``s`` convolution reads input ``(s y + u, s x + v)`` with kernel tap ``(u,
    v)``; grouping the taps by ``(u mod s, v mod s)`` gives, for each phase ``(a, b)``, the stride-1 convolution of
    ``input[..., a::s, b::s]`` with ``weight[..., a::s, b::s]``, and the layer's output is their sum (cropped to the
    strided output's size).  The same function and parameters as ``nn.Conv2d`` (a checkpoint of either loads into
    the other), the same multiply-adds; it exists because oneDNN's stride-1 kernels are much faster than its strided
    ones in the backward pass on CPUs with AMX (``benchmarks/bench_capsnet.py``).  ``groups``, ``dilation`` and
    string ``padding`` are not split: such a layer runs as ``nn.Conv2d``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sh, sw = self.stride
        if (sh, sw) == (1, 1) or self.groups != 1 or self.dilation != (1, 1) or isinstance(self.padding, str):
            return super().forward(x)
        ph, pw = self.padding
        if ph or pw:
            x = F.pad(x, (pw, pw, ph, ph), mode="constant" if self.padding_mode == "zeros" else self.padding_mode)
        kh, kw = self.kernel_size
        oh, ow = (x.shape[-2] - kh) // sh + 1, (x.shape[-1] - kw) // sw + 1
        # the input regrouped once into its phases, (sh * sw, B, C, H / sh, W / sw), each a contiguous block:
        # strided slices of x instead would cost, in the backward pass, a zero-filled input-sized tensor per phase
        H, W = -(-x.shape[-2] // sh) * sh, -(-x.shape[-1] // sw) * sw
        if (H, W) != tuple(x.shape[-2:]):
            x = F.pad(x, (0, W - x.shape[-1], 0, H - x.shape[-2]))
        phases = x.unflatten(-1, (W // sw, sw)).unflatten(-3, (H // sh, sh)).permute(3, 5, 0, 1, 2, 4)
        phases = phases.contiguous().flatten(0, 1).unbind(0)
        out = None
        for a in range(min(sh, kh)):
            for b in range(min(sw, kw)):
                w = self.weight[..., a::sh, b::sw]
                # the rows and columns of this phase that its taps reach for the oh x ow outputs
                xp = phases[a * sw + b][..., :oh + w.shape[-2] - 1, :ow + w.shape[-1] - 1]
                y = F.conv2d(xp, w, self.bias if out is None else None)
                out = y if out is None else out + y
        return out


def key_bias(key_weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``(B, N)`` presence weights (float in [0, 1] or bool) -> the additive logit bias ``(B, 1, 1, N)`` of the
    module docstring, or None."""
    if key_weights is None:
        return None
    w = key_weights.to(dtype)
    return torch.log(w.clamp_min(MIN_KEY_WEIGHT)).masked_fill(w <= 0, torch.finfo(dtype).min)[:, None, None, :]


class MAB(nn.Module):
    """Multihead attention block ``MAB(Q, K)`` (Lee et al. 2019).

    ``O = LN(Q' + Attn(Q', K', V'))``, ``MAB = LN(O + ReLU(fc_o(O)))`` with ``Q' = fc_q(Q)``, ``K' = fc_k(K)``,
    ``V' = fc_v(K)``, heads split along the features, logits scaled by ``1/sqrt(head_dim)`` (the reference code's
    ``1/sqrt(dim_v)``).  ``forward(Q (B, Nq, dim_q), K (B, Nk, dim_k), key_weights (B, Nk) | None) -> (B, Nq,
    dim_v)``; ``Q`` may have batch size 1 (learned seeds or inducing points: projected once, then broadcast).
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
        self.ln0, self.ln1 = (nn.LayerNorm(dim_v) if ln else nn.Identity() for _ in range(2))

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

    def __init__(self, dim_in: int, num_outputs: int, dim_out: int, dim_hidden: int = 128, num_heads: int = 4,
                 num_inds: int = 16, num_isab: int = 2, ln: bool = True):
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
    ys, xs = ((torch.arange(n, device=device, dtype=dtype) * 2 + 1) / n - 1 for n in (h, w))
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

    A 1x1 conv maps the feature map to, per part, ``6`` raw pose parameters, ``1`` presence logit, ``feature_dim``
    features and ``1`` attention logit; each part's parameters are pooled by the softmax of its attention logits.
    ``forward(x (B, in_channels, H, W)) -> PartOutput``; ``pose_kwargs`` go to
    :func:`probcaps.geometry.constrained_pose`; ``compile``: the CNN through ``torch.compile`` (a plain attribute).
    """

    def __init__(self, num_parts: int, in_channels: int = 1, channels: tuple[int, ...] = (128, 128, 128, 128),
                 kernel_size: int = 3, strides: tuple[int, ...] = (2, 2, 1, 1), feature_dim: int = 16,
                 activation: type[nn.Module] = nn.ELU, pose_kwargs: dict | None = None,
                 attention_translation: bool = True, bf16: bool = False, compile: bool = False):
        super().__init__()
        self.attention_translation, self.bf16, self.compile = attention_translation, bf16, compile
        if len(channels) != len(strides):
            raise ValueError(f"PartEncoder: {len(channels)} channels but {len(strides)} strides")
        self.num_parts, self.feature_dim = num_parts, feature_dim
        self.pose_kwargs = dict(pose_kwargs or {})
        self.cnn = nn.Sequential(*[layer for c_in, c, s in zip((in_channels, *channels), channels, strides) for layer in
                                   (nn.Conv2d(c_in, c, kernel_size, stride=s, padding=kernel_size // 2), activation())])
        self.n_param = 6 + 1 + feature_dim  # per part: pose_raw, presence logit, features (+1 attention logit)
        self.head = nn.Conv2d(channels[-1] if channels else in_channels, num_parts * (self.n_param + 1), 1)
        self._init_head()

    @torch.no_grad()
    def _init_head(self) -> None:
        # Presence: weights x0.01, bias 0: logits near 0 (every part used and given gradient), not exactly constant.
        # Pose: with zero biases every part would start at nearly the same pose (pooling averages), a symmetry to
        # break.  Each part gets its own translation bias on a grid over the central half of the canvas (raw =
        # atanh(u), tx = max_translation u, u in [-0.5, 0.5]), pose weights x0.1; scale, rotation, shear biases 0.
        M, P = self.num_parts, self.n_param + 1
        w, b = self.head.weight.view(M, P, -1), self.head.bias.view(M, P)  # (M, n_param + 1, C), (M, n_param + 1)
        w[:, 6].mul_(0.01)
        w[:, :6].mul_(0.1)
        b[:, :7].zero_()
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

    @functools.cached_property
    def _trunk_compiled(self):  # a compiled function, not a compiled module: the state dict keeps its keys
        return torch.compile(self.trunk, dynamic=False)

    def forward(self, x: torch.Tensor) -> PartOutput:
        features = self._trunk_compiled(x) if self.compile else self.trunk(x)
        fh, fw = features.shape[-2:]
        f = features.to(x.dtype).permute(0, 2, 3, 1).reshape(x.shape[0], fh * fw, -1)  # (B, N, C), N = H'W'
        # The head (a 1x1 conv) is linear, so pooling commutes with it: the attention logits come from its last row
        # and its other rows are applied to the pooled (B, M, C) features.  The same function as conv -> softmax ->
        # weighted sum without the (B, M (n_param + 1), H', W') map: ~10x fewer multiply-adds at SCAE's sizes.
        w, b = self.head.weight.view(self.num_parts, self.n_param + 1, -1), self.head.bias.view(self.num_parts, -1)
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
        return PartOutput(params[..., 6], pose, pose_raw, params[..., 7:], centre)
