"""Single-head and list-of-heads attention modules, as chapters 02–04 build them.

They are small on purpose: each adds one idea to the one before.
``SelfAttentionV1`` (raw ``nn.Parameter`` weights) → ``SelfAttentionV2``
(``nn.Linear``) → ``CausalAttention`` (mask + dropout) →
``MultiHeadAttentionWrapper`` (a list of causal heads). The batched version is
:class:`attnlib.attention.MultiHeadAttention`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib._checks import float_input, positive_int, probability
from attnlib.attention.functions import attention

__all__ = ["SelfAttentionV1", "SelfAttentionV2", "CausalAttention", "MultiHeadAttentionWrapper"]


class SelfAttentionV1(nn.Module):
    """One self-attention head with its projections as raw ``nn.Parameter`` matrices.

    ``x @ W_query`` etc., so each weight has shape ``(d_model, head_dim)``: the
    transpose of what ``nn.Linear`` stores. Not causal. Chapter 02.

    Args:
        d_model: input width.
        head_dim: width of queries, keys, values and the output.

    Shapes:
        ``(..., T, d_model)`` → ``(..., T, head_dim)``.
    """

    def __init__(self, d_model: int, head_dim: int) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("head_dim", head_dim)
        self.d_model, self.head_dim = d_model, head_dim
        bound = 1.0 / math.sqrt(d_model)  # the same range nn.Linear draws from
        self.W_query = nn.Parameter(torch.empty(d_model, head_dim).uniform_(-bound, bound))
        self.W_key = nn.Parameter(torch.empty(d_model, head_dim).uniform_(-bound, bound))
        self.W_value = nn.Parameter(torch.empty(d_model, head_dim).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        float_input(x, self.d_model)
        q, k, v = x @ self.W_query, x @ self.W_key, x @ self.W_value  # (..., T, d_model) -> (..., T, head_dim)
        return attention(q, k, v)[0]


class SelfAttentionV2(nn.Module):
    """One self-attention head with ``nn.Linear`` projections (weights ``(head_dim, d_model)``).

    Same maths as :class:`SelfAttentionV1`; ``nn.Linear`` stores the transposed
    matrix and computes ``x @ W.T``. Not causal. Chapter 02.

    Args:
        d_model: input width.
        head_dim: width of queries, keys, values and the output.
        bias: whether the projections have a bias.

    Shapes:
        ``(..., T, d_model)`` → ``(..., T, head_dim)``.
    """

    block_size: int | None = None  # no length limit; CausalAttention sets one

    def __init__(self, d_model: int, head_dim: int, bias: bool = False) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("head_dim", head_dim)
        self.d_model, self.head_dim = d_model, head_dim
        self.W_query = nn.Linear(d_model, head_dim, bias=bias)
        self.W_key = nn.Linear(d_model, head_dim, bias=bias)
        self.W_value = nn.Linear(d_model, head_dim, bias=bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values, each ``(..., T, head_dim)``."""
        float_input(x, self.d_model, self.block_size)
        return self.W_query(x), self.W_key(x), self.W_value(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(*self.project(x))[0]


class CausalAttention(SelfAttentionV2):
    """One causal self-attention head: query ``t`` sees keys ``0..t`` only; dropout on the weights.

    Chapter 03.

    Args:
        d_model: input width.
        head_dim: width of the head's output.
        block_size: the longest sequence accepted.
        dropout: dropout probability on the attention weights (training only).
        bias: whether the projections have a bias.

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, head_dim)``; raises ValueError if ``T > block_size``.
    """

    def __init__(self, d_model: int, head_dim: int, block_size: int, dropout: float = 0.0, bias: bool = False) -> None:
        super().__init__(d_model, head_dim, bias=bias)
        positive_int("block_size", block_size)
        probability("dropout", dropout)
        self.block_size = block_size
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        return attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)[0]


class MultiHeadAttentionWrapper(nn.Module):
    """``n_heads`` independent :class:`CausalAttention` heads run one after another, outputs concatenated.

    The simplest multi-head attention: no shared projection, no output
    projection. Chapter 04 then batches it into
    :class:`attnlib.attention.MultiHeadAttention`.

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, n_heads * head_dim)``.
    """

    def __init__(
        self, d_model: int, head_dim: int, block_size: int, n_heads: int, dropout: float = 0.0, bias: bool = False
    ) -> None:
        super().__init__()
        positive_int("n_heads", n_heads)
        self.heads = nn.ModuleList(
            CausalAttention(d_model, head_dim, block_size, dropout=dropout, bias=bias) for _ in range(n_heads)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([head(x) for head in self.heads], dim=-1)  # n_heads x (B, T, head_dim) -> (B, T, n_heads*head_dim)
