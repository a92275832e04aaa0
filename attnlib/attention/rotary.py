"""The attention of a modern decoder (Llama, Qwen3, Mistral): GQA with RoPE inside. Chapter 16.

:class:`RotaryAttention` is :class:`~attnlib.attention.MultiHeadAttention` with three changes,
each in one step of ``project → attend → merge``:

* RoPE (Su et al. 2021) rotates queries and keys by their absolute positions after the
  projection and before the cache, so cached keys are stored already rotated (Llama);
* optional QK-norm (Qwen3; Dehghani et al. 2023): an RMSNorm over each head's query and key
  before the rotation, which keeps the logits from growing;
* and, like any :class:`~attnlib.attention.MultiHeadAttention`, an optional sliding window
  (Mistral; Jiang et al. 2023): query ``i`` sees keys ``i - window < j <= i`` only.
"""
from __future__ import annotations

import torch

from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.cache import LayerCache
from attnlib.norms import RMSNorm
from attnlib.positional import RotaryEmbedding

__all__ = ["RotaryAttention"]


class RotaryAttention(MultiHeadAttention):
    """Causal multi-head attention (MHA/GQA/MQA) with RoPE, optional QK-norm and sliding window.

    Args:
        d_model, n_heads, n_kv_heads, block_size, dropout, bias, attn_fn, head_dim: as
            :class:`~attnlib.attention.MultiHeadAttention` (always causal self-attention).
        rope: the :class:`~attnlib.positional.RotaryEmbedding` (``head_dim`` wide) shared by the
            model's layers; default: plain RoPE with base 10000.
        qk_norm: an RMSNorm over ``head_dim`` on queries and keys (Qwen3), eps ``norm_eps``.
        sliding_window: ``None`` (full attention) or the window, an int >= 1.
        rotary: rotate queries and keys (default); ``False`` for ALiBi (a ``score_mod``) or no positions.
        score_mod: as :class:`~attnlib.attention.MultiHeadAttention` (ALiBi, soft-capping).

    Attributes:
        q_norm, k_norm: the QK-norm layers (``None`` without ``qk_norm``).

    Shapes:
        ``forward(x (B, T, d_model), cache=...)`` → ``(B, T, d_model)``; queries and keys are
        rotated at positions ``cache.length, …, cache.length + T - 1``.

    Raises:
        TypeError / ValueError: as :class:`~attnlib.attention.MultiHeadAttention`; a ``rope`` of
            another width; a window that is not an int >= 1.
    """

    #: RoPE can number positions within a cache (StreamingLLM; :class:`attnlib.cache.SinkLayerCache`).
    renumbers_positions = True
    #: RoPE rotates by per-row positions when given (batched generation with left padding, chapter 19).
    takes_positions = True

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, block_size: int | None = None,
                 dropout: float = 0.0, bias: bool = False, attn_fn: str = "sdpa", head_dim: int | None = None,
                 rope: RotaryEmbedding | None = None, qk_norm: bool = False, norm_eps: float = 1e-6,
                 sliding_window: int | None = None, rotary: bool = True, score_mod=None) -> None:
        super().__init__(d_model, n_heads, n_kv_heads, block_size=block_size, dropout=dropout, bias=bias,
                         causal=True, attn_fn=attn_fn, head_dim=head_dim, sliding_window=sliding_window,
                         score_mod=score_mod)
        if not isinstance(rotary, bool):
            raise TypeError(f"rotary must be a bool; got {rotary!r}")
        rope = RotaryEmbedding(self.head_dim) if rope is None and rotary else rope
        if rotary and (not isinstance(rope, RotaryEmbedding) or rope.head_dim != self.head_dim):
            raise ValueError(f"rope must be a RotaryEmbedding of head_dim={self.head_dim}; got {rope!r}")
        self.rope = rope if rotary else None
        if not isinstance(qk_norm, bool):
            raise TypeError(f"qk_norm must be a bool; got {qk_norm!r}")
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None, cache: LayerCache | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, n_heads, T, head_dim)`` and keys normalised (QK-norm) and rotated; then cached.

        ``positions``: ``None`` (every row at ``cache.length, …``) or ``(B, T)`` per-row positions
        (checked by the caller); each row's keys are rotated, and cached, at its own positions.

        Raises:
            ValueError: ``positions`` with a sink cache (it numbers positions itself).
        """
        renumbers = getattr(cache, "renumbers", False)
        if renumbers and positions is not None and self.rope is not None:
            raise ValueError("positions cannot be given with a sink cache: it numbers positions within the cache")
        B, T, _ = x.shape
        heads = self.qkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
        qk, v = heads.split([self.n_heads + self.n_kv_heads, self.n_kv_heads], dim=1)  # (B, heads, T, hd) views
        if self.q_norm is not None:  # per head, over head_dim (Qwen3: before RoPE)
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if self.rope is None:  # no rotation (ALiBi or no position information): as MultiHeadAttention
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            return q, *(cache.update(k=k, v=v) if cache is not None else (k, v))
        if renumbers:
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)  # StreamingLLM: keys stored unrotated, rotated at cache positions
            k, v = cache.update(k=k, v=v)
            n = k.shape[-2]
            k = self.rope.rotate(k, torch.arange(n, device=x.device))
            return self.rope.rotate(q, torch.arange(n - T, n, device=x.device)), k, v
        if positions is None:
            start = 0 if cache is None else cache.length
            positions = torch.arange(start, start + T, device=x.device)  # absolute positions of the new tokens
        else:
            positions = positions[:, None, :]  # (B, T) -> (B, 1, T): the same positions in every head
        q, k = self.rope.rotate(qk, positions).split([self.n_heads, self.n_kv_heads], dim=1)  # one rotation for both
        if cache is not None:
            k, v = cache.update(k=k, v=v)  # keys cached rotated: never rotated again
        return q, k, v
