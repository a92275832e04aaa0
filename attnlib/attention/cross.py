"""Cross-attention: queries from one sequence, keys and values from another (Vaswani et al. 2017, §3.2.3).

The decoder of an encoder–decoder Transformer reads the encoder's output this way.
No causal mask: every query may see every (non-padding) encoder position, the
whole source being known. Chapters 09 and 10.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import float_input
from attnlib.attention.multi_head import AttentionBase

__all__ = ["CrossAttention"]


class CrossAttention(AttentionBase):
    """Multi-head attention of ``x`` (queries) over ``context`` (keys and values).

    Args:
        d_model: width of both sequences; ``head_dim = d_model // n_heads``.
        n_heads: number of heads.
        dropout: dropout on the weights and the output (training only).
        bias: biases on the projections.
        backend: ``"sdpa"`` or ``"eager"``.

    Attributes:
        q_proj: ``nn.Linear(d_model, d_model)`` on ``x``.
        kv_proj: ``nn.Linear(d_model, 2 * d_model)`` on ``context``; rows ``[W_k; W_v]``.
        out_proj: ``nn.Linear(d_model, d_model)``.

    Shapes:
        ``forward(x (B, T_q, d_model), context (B, T_k, d_model))`` → ``(B, T_q, d_model)``.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, bias: bool = True, backend: str = "sdpa"):
        super().__init__(d_model, n_heads, None, dropout, bias, causal=False, backend=backend)
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to ``context``.

        Args:
            x: ``(B, T_q, d_model)`` float.
            context: ``(B, T_k, d_model)`` float, e.g. the encoder's output.
            key_padding_mask: optional ``(B, T_k)`` bool, ``True`` = a real context position
                (the same convention as :func:`attnlib.functional.padding_mask`).
            return_weights: also return the weights ``(B, n_heads, T_q, T_k)``.

        Raises:
            TypeError / ValueError: bad shapes or dtypes, a batch mismatch, a non-boolean mask.
        """
        float_input(x, self.d_model)
        float_input(context, self.d_model)
        if x.dim() != 3 or context.dim() != 3 or x.shape[0] != context.shape[0]:
            raise ValueError(
                f"expected x (B, T_q, d_model) and context (B, T_k, d_model) with the same B; "
                f"got {tuple(x.shape)} and {tuple(context.shape)}"
            )
        mask = None
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool:
                raise TypeError(f"key_padding_mask must be boolean (True = real position); got {key_padding_mask.dtype}")
            if tuple(key_padding_mask.shape) != (context.shape[0], context.shape[1]):
                raise ValueError(
                    f"key_padding_mask must have shape (B, T_k) = {tuple(context.shape[:2])}; "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            mask = key_padding_mask[:, None, None, :]  # (B, T_k) -> (B, 1, 1, T_k): every head, every query
        q = self.split_heads(self.q_proj(x))  # (B, n_heads, T_q, head_dim)
        k, v = (self.split_heads(t) for t in self.kv_proj(context).split(self.d_model, dim=-1))  # (B, n_heads, T_k, hd)
        y, weights = self.attend(q, k, v, mask, return_weights)
        y = self.resid_dropout(self.merge(y))
        return (y, weights) if return_weights else y
