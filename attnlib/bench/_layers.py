"""The reference implementations that ``bench mha`` times beside :class:`attnlib.attention.MultiHeadAttention`.

Each takes the weights of a source ``MultiHeadAttention`` (fused ``qkv`` with rows
``[W_q; W_k; W_v]`` and ``out_proj``, both with biases) so that every row computes the
same function; shapes ``(B, T, d_model) → (B, T, d_model)``, causal.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlib.attention import MultiHeadAttention, MultiHeadAttentionWrapper, causal_mask

__all__ = ["EinsumAttention", "ProjectedCore", "ScratchMultiHeadAttention", "TorchMultiheadAttention", "einsum_core",
           "merge_heads", "split_heads", "wrapper_with_out_proj"]


def split_heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    B, T, width = t.shape
    return t.view(B, T, n_heads, width // n_heads).transpose(1, 2)  # (B, T, d_model) -> (B, n_heads, T, head_dim)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, n_heads, T, head_dim = y.shape
    return y.transpose(1, 2).reshape(B, T, n_heads * head_dim)  # (B, n_heads, T, hd) -> (B, T, d_model)


def _separate_projections(source: MultiHeadAttention) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    """``W_q, W_k, W_v`` as three ``nn.Linear(d_model, d_model)`` holding ``source.qkv``'s rows."""
    d_model = source.d_model
    projections = tuple(nn.Linear(d_model, d_model).to(source.qkv.weight) for _ in range(3))
    with torch.no_grad():
        for i, proj in enumerate(projections):
            proj.weight.copy_(source.qkv.weight[i * d_model : (i + 1) * d_model])
            proj.bias.copy_(source.qkv.bias[i * d_model : (i + 1) * d_model])
    return projections


class ScratchMultiHeadAttention(nn.Module):
    """The design of *Build a Large Language Model (From Scratch)* (Raschka 2024), chapter 3.5, in our words.

    Three separate Linear layers for queries, keys and values; a causal mask registered
    as a buffer once (``torch.triu(ones, diagonal=1)``, bool, ``True`` = the future);
    ``masked_fill_`` in place on the scores; ``softmax(scores / sqrt(head_dim))``;
    dropout on the weights; the product with the values; an output projection.
    The fast baseline that the readable eager path of ``MultiHeadAttention`` is held to.
    """

    def __init__(self, source: MultiHeadAttention, block_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.d_model = source.n_heads, source.head_dim, source.d_model
        self.W_query, self.W_key, self.W_value = _separate_projections(source)
        self.out_proj = source.out_proj
        self.dropout = nn.Dropout(dropout)
        future = torch.triu(torch.ones(block_size, block_size, device=source.qkv.weight.device), diagonal=1).bool()
        self.register_buffer("mask", future, persistent=False)  # (block_size, block_size), True above the diagonal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        queries = self.W_query(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        keys = self.W_key(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)  # (B, nh, T, hd) @ (B, nh, hd, T) -> (B, nh, T, T)
        attn_scores.masked_fill_(self.mask[:T, :T], -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context = (attn_weights @ values).transpose(1, 2).contiguous().view(B, T, self.d_model)  # (B, T, d_model)
        return self.out_proj(context)


def einsum_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Causal attention with every product written as an einsum (chapter 04's form)."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # (B, nh, T, hd) x2 -> (B, nh, T, T)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v)  # (B, nh, T, T), (B, nh, T, hd) -> (B, nh, T, hd)


class EinsumAttention(nn.Module):
    """Multi-head attention in einsum: the heads are split in the weights, never in the activations."""

    def __init__(self, source: MultiHeadAttention) -> None:
        super().__init__()
        self.n_heads, self.head_dim = source.n_heads, source.head_dim
        self.qkv, self.out_proj = source.qkv, source.out_proj  # the same weights as the source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d_model = x.shape
        w = self.qkv.weight.view(3, self.n_heads, self.head_dim, d_model)  # rows [W_q; W_k; W_v], per head
        q, k, v = (torch.einsum("btm,hdm->bhtd", x, w[i]) for i in range(3))  # (B, T, d_model) -> (B, nh, T, hd)
        if self.qkv.bias is not None:
            b = self.qkv.bias.view(3, self.n_heads, 1, self.head_dim)
            q, k, v = q + b[0], k + b[1], v + b[2]
        y = einsum_core(q, k, v, causal_mask(T, device=x.device))
        w_o = self.out_proj.weight.view(d_model, self.n_heads, self.head_dim)
        out = torch.einsum("bhtd,mhd->btm", y, w_o)  # (B, nh, T, hd) -> (B, T, d_model)
        return out if self.out_proj.bias is None else out + self.out_proj.bias


class ProjectedCore(nn.Module):
    """``out_proj(core(split(qkv(x))))`` with the Linear layers of ``source`` and any attention core."""

    def __init__(self, source: MultiHeadAttention, core, separate: bool = False) -> None:
        super().__init__()
        self.n_heads, self.core = source.n_heads, core
        self.out_proj = source.out_proj
        if separate:  # three Linear layers instead of one fused: the same numbers, three matmuls
            self.q_proj, self.k_proj, self.v_proj = _separate_projections(source)
            self.qkv = None
        else:
            self.qkv = source.qkv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv is not None:
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, 3 * d_model) -> 3 x (B, T, d_model)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (split_heads(t, self.n_heads) for t in (q, k, v))
        return self.out_proj(merge_heads(self.core(q, k, v)))


class TorchMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with the weights of ``source``, causal, ``need_weights=False``."""

    def __init__(self, source: MultiHeadAttention) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(source.d_model, source.n_heads, batch_first=True).to(source.qkv.weight)
        with torch.no_grad():
            self.mha.in_proj_weight.copy_(source.qkv.weight)  # the same [W_q; W_k; W_v] layout
            self.mha.in_proj_bias.copy_(source.qkv.bias)
            self.mha.out_proj.weight.copy_(source.out_proj.weight)
            self.mha.out_proj.bias.copy_(source.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        not_allowed = ~causal_mask(x.shape[1], device=x.device)  # nn.MultiheadAttention: True = may NOT attend
        return self.mha(x, x, x, attn_mask=not_allowed, need_weights=False, is_causal=True)[0]


def wrapper_with_out_proj(source: MultiHeadAttention, block_size: int) -> nn.Module:
    """Chapter 04's list of heads (12 × head_dim 64 for GPT-2) with ``source``'s weights, plus its out_proj."""
    d_model, n_heads, head_dim = source.d_model, source.n_heads, source.head_dim
    wrapper = MultiHeadAttentionWrapper(d_model, head_dim, block_size, n_heads, bias=True).to(source.qkv.weight)
    with torch.no_grad():
        for h, head in enumerate(wrapper.heads):
            for i, proj in enumerate((head.W_query, head.W_key, head.W_value)):
                rows = slice(i * d_model + h * head_dim, i * d_model + (h + 1) * head_dim)
                proj.weight.copy_(source.qkv.weight[rows])
                proj.bias.copy_(source.qkv.bias[rows])
    return nn.Sequential(wrapper, source.out_proj)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bare ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``: the reference."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
