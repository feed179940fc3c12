"""Dynamic routing between capsules (Sabour, Frosst & Hinton 2017): squash, predictions, routing-by-agreement.

Everything is vectorised over the batch and over child and parent capsules; the only Python loop is over the
routing iterations.  Two implementations of the same procedure:

- :func:`dynamic_routing` routes given predictions ``u_hat`` ``(B, J, I, D)`` (batch, parent, child, pose dim);
  any layer that produces predictions can use it.  It is the reference.
- :func:`linear_dynamic_routing` is the fast path for CapsNet's linear predictions ``u_hat_j|i = W_ij u_i``: it
  never builds ``u_hat``.  With ``P``-dimensional children, each iteration's two contractions become GEMMs with
  inner dimension ``I * P`` and ``D``:

      s_j  = sum_i c_ij W_ij u_i = W_j^T (c_j * u)          (J, B, I*P) @ (J, I*P, D)
      a_ij = (W_ij u_i) . v_j   = u_i . (W_ij^T v_j)       (J, B, D) @ (J, D, I*P), then a sum over P

  so the work is dense matrix products instead of memory-bound passes over a ``(B, J, I, D)`` tensor (on the
  2-core CPU this made the paper-size training step several times faster; see ``benchmarks/bench_capsnet.py``).
"""

from __future__ import annotations

import torch

__all__ = ["squash", "capsule_predictions", "dynamic_routing", "linear_dynamic_routing"]


def squash(s: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """``v = |s|^2 / (1 + |s|^2) * s / |s|`` along ``dim`` (paper eq. 1): norms in ``[0, 1)``, direction kept.

    Written as ``s * n2 / ((1 + n2) sqrt(n2 + eps))`` so that ``s = 0`` maps to 0 with a finite gradient.
    """
    n2 = (s * s).sum(dim, keepdim=True)
    return s * (n2 / ((1.0 + n2) * torch.sqrt(n2 + eps)))


def capsule_predictions(u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each child's prediction of each parent's pose: ``u_hat[b, j, i] = W[i, j] @ u[b, i]``.

    Args:
        u: ``(B, I, P)`` child capsules.
        weight: ``(I, J, D, P)`` one transformation matrix per (child, parent) pair.
    Returns:
        ``(B, J, I, D)`` (parent-major, ready for :func:`dynamic_routing`).
    """
    I, J, D, P = weight.shape
    # one batched matmul over the children: (I, B, P) @ (I, P, J*D) -> (I, B, J*D)
    out = torch.bmm(u.transpose(0, 1), weight.reshape(I, J * D, P).transpose(1, 2))
    return out.view(I, u.shape[0], J, D).permute(1, 2, 0, 3).contiguous()


def dynamic_routing(u_hat: torch.Tensor, iterations: int = 3, detach: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing-by-agreement (paper, Procedure 1).

    Args:
        u_hat: ``(B, J, I, D)`` predictions of ``J`` parents by ``I`` children.
        iterations: routing iterations ``r >= 1`` (1 = uniform coupling, no agreement step).
        detach: the stop-gradient variant (as in the authors' TensorFlow code): the iterations before the last
            see ``u_hat`` detached, so gradients reach ``u_hat`` only through the final weighted sum. Default:
            gradients flow through every iteration.
    Returns:
        ``v`` ``(B, J, D)`` squashed parent capsules, and ``c`` ``(B, J, I)`` the final coupling coefficients
        (softmax over the parents ``J``: ``c.sum(1) == 1`` for every child).
    """
    if iterations < 1:
        raise ValueError(f"dynamic_routing: iterations must be >= 1, got {iterations}")
    B, J, I, D = u_hat.shape
    logits = u_hat.new_zeros(B, J, I)
    u_inner = u_hat.detach() if detach else u_hat
    for r in range(iterations):
        c = torch.softmax(logits, dim=1)  # (B, J, I): each child splits its vote over the parents
        u = u_hat if r == iterations - 1 else u_inner
        s = torch.matmul(c.unsqueeze(2), u).squeeze(2)  # (B, J, D)
        v = squash(s)
        if r < iterations - 1:
            logits = logits + torch.matmul(u, v.unsqueeze(-1)).squeeze(-1)  # agreement (B, J, I)
    return v, c


def linear_dynamic_routing(u: torch.Tensor, weight: torch.Tensor, iterations: int = 3, detach: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dynamic_routing` of the predictions ``u_hat_j|i = W_ij u_i`` without materialising them.

    Args:
        u: ``(B, I, P)`` child capsules.
        weight: ``(J, I, P, D)``: ``weight[j, i]`` is the transpose of the paper's ``W_ij`` (``D x P``); this
            layout makes every contraction a plain batched matrix product.
        iterations, detach: as in :func:`dynamic_routing` (``detach`` stops the gradient through ``u`` and
            ``weight`` in every iteration but the last).
    Returns:
        ``v`` ``(B, J, D)`` and the coupling coefficients ``c`` ``(B, J, I)`` (sum to 1 over ``J``).
    """
    if iterations < 1:
        raise ValueError(f"linear_dynamic_routing: iterations must be >= 1, got {iterations}")
    B, I, P = u.shape
    J, I2, P2, D = weight.shape
    if (I2, P2) != (I, P):
        raise ValueError(f"linear_dynamic_routing: weight {tuple(weight.shape)} does not fit children {tuple(u.shape)}")
    # children-last layouts: every elementwise product below then runs over a contiguous innermost axis of
    # length I (with P innermost, the broadcasts over 8-element rows were several times slower)
    u_t = u.transpose(1, 2).contiguous()  # (B, P, I)
    w_flat = weight.permute(0, 2, 1, 3).reshape(J, P * I, D)  # rows ordered (p, i)
    u_in, w_in = (u_t.detach(), w_flat.detach()) if detach else (u_t, w_flat)
    logits = u.new_zeros(J, B, 1, I)
    for r in range(iterations):
        last = r == iterations - 1
        uu, ww = (u_t, w_flat) if last else (u_in, w_in)
        c = torch.softmax(logits, dim=0)  # (J, B, 1, I)
        weighted = (c * uu).reshape(J, B, P * I)  # c_ij u_i
        s = torch.bmm(weighted, ww)  # (J, B, D)
        v = squash(s)
        if not last:
            q = torch.bmm(v, ww.transpose(1, 2)).view(J, B, P, I)  # W_ij^T v_j
            logits = logits + (q * uu).sum(2, keepdim=True)
    c = c.squeeze(2)
    return v.transpose(0, 1), c.transpose(0, 1)
