"""Batched multi-head attention, the template every attention variant fills in, and the GPT's ``"mha"``.

:class:`AttentionBase` fixes the pipeline ``project → attend → merge`` (labml's
hook pattern): a variant overrides the step it changes and nothing else. Talking
heads changes ``attend``; grouped-query attention changes ``project`` and
``attend``; latent attention changes ``project`` (and ``merge`` when absorbed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import divisible, float_input, positive_int, probability
from attnlib.cache import LayerCache
from attnlib.config import GPTConfig
from attnlib.functional import attention, causal_mask

__all__ = ["BACKENDS", "AttentionBase", "CausalSelfAttention", "MultiHeadAttention"]

BACKENDS = ("eager", "sdpa")


class AttentionBase(nn.Module):
    """Self-attention as three steps a variant can override: ``project``, ``attend``, ``merge``.

    Args:
        d_model: width of input and output; ``head_dim = d_model // n_heads``.
        n_heads: number of query heads.
        block_size: longest sequence accepted (``None``: no limit).
        dropout: dropout on the attention weights and on the output (training only).
        bias: whether the output projection (and the variant's projections) have biases.
        causal: whether query ``t`` may only see keys ``<= t``.
        backend: ``"eager"`` (:func:`attnlib.functional.attention`: readable, returns the
            weights) or ``"sdpa"`` (:func:`torch.nn.functional.scaled_dot_product_attention`: fast).

    Raises:
        ValueError / TypeError: a bad size, ``d_model`` not divisible by ``n_heads``, an unknown backend.
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
        self.resid_dropout = nn.Dropout(dropout)
        # Subclasses create their input projections, then ``self.out_proj`` (d_model -> d_model), in that
        # order, so that parameters are registered (and randomly initialised) input first, as in nanoGPT.

    def split_heads(self, x: torch.Tensor, n_heads: int | None = None) -> torch.Tensor:
        """``(B, T, n_heads * head_dim)`` → ``(B, n_heads, T, head_dim)``."""
        B, T, _ = x.shape
        n_heads = n_heads or self.n_heads
        return x.view(B, T, n_heads, -1).transpose(1, 2)  # (B, T, n_heads*hd) -> (B, n_heads, T, hd)

    def project(
        self, x: torch.Tensor, cache: LayerCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, n_heads, T_new, width)``; keys and values ``(B, heads, T_k, width)``.

        With a ``cache``, the variant stores what it needs of the new positions and
        returns keys and values for every cached position (``T_k = cache.length``).
        """
        raise NotImplementedError

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, need_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weighted values ``(B, n_heads, T, head_dim)`` and, if asked or eager, the weights.

        ``mask`` is the caller's mask only; the causal part is added here, as SDPA's
        ``is_causal`` when there is no other mask (so a fused kernel can be used).
        """
        dropout_p = self.dropout if self.training else 0.0
        if self.backend == "eager" or need_weights:
            return attention(q, k, v, mask=self.full_mask(mask, q.shape[-2], k.shape[-2], q.device), dropout_p=dropout_p)
        mask, is_causal = self.sdpa_mask(mask, q.shape[-2], k.shape[-2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal), None

    def sdpa_mask(
        self, mask: torch.Tensor | None, T_q: int, T_k: int, device: torch.device
    ) -> tuple[torch.Tensor | None, bool]:
        """``(attn_mask, is_causal)`` for SDPA: ``is_causal`` (which allows fused kernels) only where it is right.

        SDPA's ``is_causal`` is aligned top-left: right for ``T_q == T_k`` without another
        mask; in every other case (a caller's mask, decoding with ``T_q < T_k``) the
        bottom-right :func:`causal_mask` is passed explicitly.
        """
        if self.causal and mask is None and T_q == T_k:
            return None, True
        return self.full_mask(mask, T_q, T_k, device), False

    def full_mask(self, mask: torch.Tensor | None, T_q: int, T_k: int, device: torch.device) -> torch.Tensor | None:
        """The caller's boolean mask ``&`` the causal mask (when causal); ``None`` if neither."""
        if mask is not None and mask.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean tensor (True = may attend); got dtype {mask.dtype}")
        if not self.causal:
            return mask
        causal = causal_mask(T_q, T_k, device=device)
        return causal if mask is None else mask & causal

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """``(B, n_heads, T, head_dim)`` → ``(B, T, d_model)`` through the output projection."""
        B, _, T, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, self.d_model))  # (B, nh, T, hd) -> (B, T, d_model)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        return_weights: bool = False,
        cache: LayerCache | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend.

        Args:
            x: ``(B, T, d_model)`` float: the new positions.
            mask: optional boolean mask broadcastable to ``(B, n_heads, T, T_k)``,
                ``True`` = may attend; combined with the causal mask by ``&``.
            return_weights: also return the weights ``(B, n_heads, T, T_k)``
                (always computed on the eager path).
            cache: a :class:`attnlib.cache.LayerCache`: the new positions are appended to
                it and attend to everything cached (``T_k`` = cached length, the causal
                mask aligned bottom-right). Chapter 08.

        Returns:
            ``(B, T, d_model)``, or ``(output, weights)`` when ``return_weights``.

        Raises:
            TypeError / ValueError: ``x`` not a float tensor of shape ``(B, T, d_model)``,
                ``T > block_size``, a full cache, or a mask that is not boolean.
        """
        float_input(x, self.d_model, self.block_size)
        if x.dim() != 3:
            raise ValueError(f"expected input of shape (B, T, d_model={self.d_model}); got {tuple(x.shape)}")
        q, k, v = self.project(x, cache)
        y, weights = self.attend(q, k, v, mask, return_weights)
        y = self.resid_dropout(self.merge(y))
        return (y, weights) if return_weights else y


class MultiHeadAttention(AttentionBase):
    """Multi-head self-attention with all heads in one batched matmul.

    One fused projection makes queries, keys and values for every head; the heads
    run side by side as the ``n_heads`` dimension; an output projection mixes them.
    Vaswani et al. 2017, §3.2.2; built in chapter 04. Arguments as :class:`AttentionBase`.

    Attributes:
        qkv: ``nn.Linear(d_model, 3 * d_model)``; its weight rows are
            ``[W_q; W_k; W_v]``, the layout of ``nn.MultiheadAttention.in_proj_weight``.
        out_proj: ``nn.Linear(d_model, d_model)``.

    Shapes:
        ``forward(x)``: ``(B, T, d_model)`` → ``(B, T, d_model)``.
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
        super().__init__(d_model, n_heads, block_size, dropout, bias, causal, backend)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def project(self, x: torch.Tensor, cache: LayerCache | None = None):
        q, k, v = self.qkv(x).split(self.d_model, dim=-1)  # (B, T, 3*d_model) -> 3 x (B, T, d_model)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        if cache is not None:
            k, v = cache.update(k=k, v=v)  # every head's keys and values: 2 * n_heads * head_dim per token
        return q, k, v

    @staticmethod
    def kv_cache_size(config: GPTConfig) -> int:
        """Numbers cached per token per layer: a key and a value for every head, ``2 · n_heads · head_dim``."""
        return 2 * config.n_heads * config.head_dim


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
