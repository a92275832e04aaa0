"""Batched multi-head attention, and the causal self-attention the GPT uses (registry name ``"mha"``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import divisible, float_input, positive_int, probability
from attnlib.config import GPTConfig
from attnlib.functional import attention, causal_mask

__all__ = ["MultiHeadAttention", "CausalSelfAttention", "BACKENDS"]

BACKENDS = ("eager", "sdpa")


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention with all heads in one batched matmul.

    One fused projection makes queries, keys and values for every head; the heads
    run side by side as the ``n_heads`` dimension; an output projection mixes them.
    Vaswani et al. 2017, §3.2.2; built in chapter 04.

    Args:
        d_model: width of input and output; ``head_dim = d_model // n_heads``.
        n_heads: number of heads.
        block_size: longest sequence accepted (``None``: no limit).
        dropout: dropout on the attention weights and on the output (training only).
        bias: whether ``qkv`` and ``out_proj`` have biases.
        causal: whether query ``t`` may only see keys ``<= t``.
        backend: ``"eager"`` (:func:`attnlib.functional.attention`, readable, returns
            weights) or ``"sdpa"`` (:func:`torch.nn.functional.scaled_dot_product_attention`, fast).

    Attributes:
        qkv: ``nn.Linear(d_model, 3 * d_model)``; its weight rows are
            ``[W_q; W_k; W_v]``, the layout of ``nn.MultiheadAttention.in_proj_weight``.
        out_proj: ``nn.Linear(d_model, d_model)``.

    Shapes:
        ``forward(x)``: ``(B, T, d_model)`` → ``(B, T, d_model)``.

    Raises:
        ValueError: ``d_model`` not divisible by ``n_heads``, an unknown backend,
            a bad size, or an input of the wrong shape / longer than ``block_size``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        block_size: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = True,
        backend: str = "sdpa",
    ) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("n_heads", n_heads)
        divisible("d_model", d_model, "n_heads", n_heads)
        if block_size is not None:
            positive_int("block_size", block_size)
        probability("dropout", dropout)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.block_size, self.dropout, self.causal, self.backend = block_size, dropout, causal, backend
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, d_model)`` → ``(B, n_heads, T, head_dim)``."""
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, T, d) -> (B, n_heads, T, head_dim)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, return_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend.

        Args:
            x: ``(B, T, d_model)`` float.
            mask: optional boolean mask broadcastable to ``(B, n_heads, T, T)``,
                ``True`` = may attend; combined with the causal mask by ``&``.
            return_weights: also return the weights ``(B, n_heads, T, T)``
                (always computed on the eager path).

        Returns:
            ``(B, T, d_model)``, or ``(output, weights)`` when ``return_weights``.
        """
        float_input(x, self.d_model, self.block_size)
        if x.dim() != 3:
            raise ValueError(f"expected input of shape (B, T, d_model={self.d_model}); got {tuple(x.shape)}")
        B, T, _ = x.shape
        q, k, v = (self.split_heads(t) for t in self.qkv(x).split(self.d_model, dim=-1))
        dropout_p = self.dropout if self.training else 0.0

        if self.backend == "eager" or return_weights:
            if self.causal:
                causal = causal_mask(T, device=x.device)
                mask = causal if mask is None else mask & causal
            y, weights = attention(q, k, v, mask=mask, dropout_p=dropout_p)
        else:
            if mask is not None and mask.dtype != torch.bool:
                raise TypeError(f"mask must be a boolean tensor (True = may attend); got dtype {mask.dtype}")
            if self.causal and mask is not None:
                mask = mask & causal_mask(T, device=x.device)
            is_causal = self.causal and mask is None  # SDPA's is_causal is top-left aligned: right for T_q == T_k
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
            weights = None

        y = y.transpose(1, 2).reshape(B, T, self.d_model)  # (B, n_heads, T, head_dim) -> (B, T, d_model)
        y = self.resid_dropout(self.out_proj(y))
        return (y, weights) if return_weights else y


class CausalSelfAttention(MultiHeadAttention):
    """The GPT's attention layer (registry name ``"mha"``): causal :class:`MultiHeadAttention` on SDPA.

    Built from a :class:`attnlib.GPTConfig` (uses ``d_model, n_heads,
    block_size, dropout, bias``). Chapter 12.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(
            config.d_model,
            config.n_heads,
            block_size=config.block_size,
            dropout=config.dropout,
            bias=config.bias,
            causal=True,
            backend="sdpa",
        )
