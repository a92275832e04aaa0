"""Multi-head attention: one module for MHA, GQA, MQA and cross-attention.

``project → attend → merge``: queries, keys and values from one fused projection;
an attention function from :data:`attnlib.attention.ATTENTION_FUNCTIONS`; the heads
concatenated through an output projection (Vaswani et al. 2017, §3.2.2; chapter 04).
``n_kv_heads < n_heads`` lets groups of query heads share key/value heads (GQA,
Ainslie et al. 2023; ``n_kv_heads = 1`` is MQA, Shazeer 2019; chapter 06); a
``context`` makes it cross-attention (§3.2.3; chapter 09). Talking heads and
multi-head latent attention are subclasses that change one step each.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib._checks import divisible, positive_int, probability
from attnlib.attention.functions import ATTENTION_FUNCTIONS, get_attention_function
from attnlib.cache import LayerCache, RingLayerCache, SinkLayerCache
from attnlib.masks import mask_from_mod
from attnlib.mods import sliding_window as window_mod

__all__ = ["KV_SHARING", "MultiHeadAttention"]

#: How a group of query heads reads its shared key/value head: ``"fold"`` hands the shared heads to
#: the attention function, which reads them in place (no copy); ``"repeat_interleave"`` copies each
#: K/V head once per query head of its group first (simple, but the copies cost memory). Equal outputs.
KV_SHARING = ("fold", "repeat_interleave")


def check_positions(positions: object, x: torch.Tensor) -> None:
    """Raise unless ``positions`` is a ``(B, T)`` integer tensor on ``x``'s device, every entry >= 0."""
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor (B, T); got {getattr(positions, 'dtype', type(positions).__name__)}")
    if tuple(positions.shape) != tuple(x.shape[:2]):
        raise ValueError(f"positions must have shape (B, T) = {tuple(x.shape[:2])}; got {tuple(positions.shape)}")
    if positions.device != x.device:
        raise ValueError(f"positions is on {positions.device} but x is on {x.device}")
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0; got a minimum of {int(positions.min())}")


class MultiHeadAttention(nn.Module):
    """Multi-head attention with ``n_kv_heads`` key/value heads, optionally over a ``context``.

    Args:
        d_model: width of the input and output.
        n_heads: query heads.
        n_kv_heads: key/value heads, dividing ``n_heads`` (default ``n_heads``: MHA; 1: MQA).
        block_size: the longest sequence (cached positions included) accepted; ``None``: no limit.
        dropout: dropout on the attention weights and the output (training only), in [0, 1).
        bias: biases on the projections.
        causal: query ``t`` sees only keys ``<= t`` (self-attention only).
        attn_fn: ``"sdpa"`` (fast), ``"eager"`` (readable, what the book derives) or ``"tiled"``.
        kv_sharing: one of :data:`KV_SHARING`.
        head_dim: width of each head; default ``d_model // n_heads`` (then ``n_heads`` must divide
            ``d_model``). Qwen3 sets it apart: 16 heads of 128 in a model of width 1024.
        sliding_window: ``None`` (full attention) or ``w``: query ``i`` sees keys ``i - w < j <= i``
            only (Mistral; :func:`attnlib.mods.sliding_window`; chapter 17). Causal layers only.
        score_mod: ``None`` or a FlexAttention-style ``(scores, b, h, q_idx, kv_idx) -> scores`` applied
            before the softmax (ALiBi, soft-capping: :mod:`attnlib.mods`); needs ``attn_fn`` "eager" or "tiled".

    Attributes:
        qkv: ``nn.Linear(d_model, (n_heads + 2 · n_kv_heads) · head_dim)``; rows ``[W_q; W_k; W_v]``
            (with ``n_kv_heads == n_heads``, ``nn.MultiheadAttention.in_proj_weight``'s layout).
        out_proj: ``nn.Linear(n_heads · head_dim, d_model)``.
        cache_width: numbers a KV cache keeps per token for this layer, ``2 · n_kv_heads · head_dim``.

    Raises:
        TypeError / ValueError: a size that is not a positive int, ``d_model`` not divisible by
            ``n_heads`` or ``n_heads`` by ``n_kv_heads``, ``dropout`` outside [0, 1), an unknown
            ``attn_fn`` or ``kv_sharing``; the message names the value.
    """

    #: Whether a mask may differ between heads (talking heads mixes heads, so it cannot honour one).
    per_head_masks = True
    #: Whether :meth:`project` takes per-row ``positions`` (RoPE does; a layer without position
    #: information, or with only relative ones -- ALiBi, the window -- has no use for them).
    takes_positions = False

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        block_size: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = True,
        attn_fn: str = "sdpa",
        kv_sharing: str = "fold",
        head_dim: int | None = None,
        sliding_window: int | None = None,
        score_mod=None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            positive_int(name, value)
        if head_dim is None:
            divisible("d_model", d_model, "n_heads", n_heads)
        else:
            positive_int("head_dim", head_dim)
        divisible("n_heads", n_heads, "n_kv_heads", n_kv_heads)
        if block_size is not None:
            positive_int("block_size", block_size)
        probability("dropout", dropout)
        for name, value in (("bias", bias), ("causal", causal)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {value!r}")
        get_attention_function(attn_fn)  # an unknown name fails here, naming the known ones
        if not isinstance(kv_sharing, str) or kv_sharing not in KV_SHARING:
            raise ValueError(f"kv_sharing={kv_sharing!r} is not one of {KV_SHARING}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.block_size, self.dropout, self.causal = block_size, dropout, causal
        self.attn_fn, self.kv_sharing = attn_fn, kv_sharing
        self.scale = 1.0 / math.sqrt(self.head_dim)
        if sliding_window is not None and not causal:
            raise ValueError(f"sliding_window={sliding_window!r} needs a causal layer (causal=True)")
        self.sliding_window = sliding_window
        if score_mod is not None and not callable(score_mod):
            raise TypeError(f"score_mod must be callable (scores, b, h, q_idx, kv_idx) -> scores; got {score_mod!r}")
        if score_mod is not None and attn_fn == "sdpa":
            raise ValueError("score_mod needs attn_fn='eager' or 'tiled' (SDPA cannot modify scores)")
        self.score_mod = score_mod
        self.window_mod = None if sliding_window is None else window_mod(sliding_window)  # checks the window
        self.build_projections(bias)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)  # created last: init order as in nanoGPT
        self.resid_dropout = nn.Dropout(dropout)

    def build_projections(self, bias: bool) -> None:
        """Create the input projections (a subclass that projects differently overrides this and :meth:`project`)."""
        self.qkv = nn.Linear(self.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=bias)

    @property
    def cache_width(self) -> int:
        """Numbers cached per token: a key and a value for each of the ``n_kv_heads`` heads."""
        return 2 * self.n_kv_heads * self.head_dim

    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes a KV cache keeps per token for this layer, in ``dtype`` (default: the parameters')."""
        dtype = dtype or self.out_proj.weight.dtype
        return self.cache_width * torch.empty((), dtype=dtype).element_size()

    def split_heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        """``(B, T, n_heads · width)`` → ``(B, n_heads, T, width)``."""
        B, T, width = x.shape
        return x.view(B, T, n_heads, width // n_heads).transpose(1, 2)  # (B, T, n_heads*w) -> (B, n_heads, T, w)

    def project(
        self, x: torch.Tensor, context: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, n_heads, T, head_dim)``; keys and values ``(B, n_kv_heads, T_k, head_dim)``.

        Keys and values come from ``context`` when given (cross-attention), else from ``x``.
        With a ``cache`` the new keys and values are appended and every cached one returned.
        """
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if context is None:
            q, k, v = self.qkv(x).split([q_width, kv_width, kv_width], dim=-1)  # (B, T, q_width + 2 kv_width)
        else:  # the same fused weight, its query rows on x and its key/value rows on the context
            w, b = self.qkv.weight, self.qkv.bias
            q = nn.functional.linear(x, w[:q_width], None if b is None else b[:q_width])
            k, v = nn.functional.linear(context, w[q_width:], None if b is None else b[q_width:]).split(kv_width, -1)
        q, k, v = self.split_heads(q, self.n_heads), self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)
        if cache is not None:
            k, v = cache.update(k=k, v=v)  # only the n_kv_heads shared heads: cache_width numbers per token
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weighted values ``(B, n_heads, T_q, width)`` and the weights (when asked: the eager function)."""
        if self.kv_sharing == "repeat_interleave" and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)  # (B, n_kv, T, hd) -> (B, n_heads, T, hd): copies
            v = v.repeat_interleave(group, dim=1)
        fn = ATTENTION_FUNCTIONS["eager" if need_weights else self.attn_fn]
        dropout_p = self.dropout if self.training else 0.0
        return fn(q, k, v, mask, is_causal=is_causal, scale=self.scale, dropout_p=dropout_p, score_mod=self.score_mod)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """``(B, n_heads, T, head_dim)`` → ``(B, T, d_model)`` through the output projection."""
        B, _, T, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # -> (B, T, d_model)

    def check_inputs(self, x, context, mask, key_padding_mask, cache) -> torch.Tensor | None:
        """Validate every argument of :meth:`forward` before any kernel runs; return the combined mask."""
        weight = self.out_proj.weight
        for name, t in (("x", x), ("context", context)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor of shape (B, T, d_model); got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating point tensor; got dtype {t.dtype}")
            if t.dim() != 3 or t.shape[-1] != self.d_model:
                raise ValueError(f"{name} must have shape (B, T, d_model={self.d_model}); got {tuple(t.shape)}")
            if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
                raise TypeError(f"{name} is {t.dtype} but the module's weights are {weight.dtype}; convert one of them")
            if t.device != weight.device and weight.device.type != "meta":
                raise ValueError(f"{name} is on {t.device} but the module's weights are on {weight.device}")
        B, T_q = x.shape[0], x.shape[1]
        if context is not None:
            if self.causal:
                raise ValueError("a causal layer attends over its own sequence; build it with causal=False for a context")
            if cache is not None:
                raise ValueError("cache is for self-attention; a context's keys and values are not cached here")
            if context.shape[0] != B:
                raise ValueError(f"x and context must have the same batch size; got {tuple(x.shape)} and {tuple(context.shape)}")
            if context.shape[1] == 0 and T_q:
                raise ValueError(f"context holds no positions; got shape {tuple(context.shape)}")
        past = 0 if cache is None else cache.next_position
        if cache is not None and not isinstance(cache, LayerCache):
            raise TypeError(f"cache must be an attnlib.cache.LayerCache; got {type(cache).__name__}")
        if isinstance(cache, SinkLayerCache):
            if not getattr(self, "renumbers_positions", False):
                raise ValueError(f"a sink cache renumbers positions; {type(self).__name__} cannot (use RotaryAttention)")
            if self.sliding_window is not None and self.sliding_window < cache.window:
                raise ValueError(f"a sink cache of window={cache.window} shows keys this layer "
                                 f"(sliding_window={self.sliding_window}) must not see")
            if mask is not None or key_padding_mask is not None:
                raise ValueError("masks are not supported with a sink cache (it holds only some keys)")
        elif isinstance(cache, RingLayerCache):
            if self.sliding_window is None or cache.window < self.sliding_window:
                raise ValueError(f"a ring cache of window={cache.window} drops keys this layer "
                                 f"(sliding_window={self.sliding_window}) still attends to")
            if mask is not None or key_padding_mask is not None:
                raise ValueError("masks are not supported with a ring cache (it holds only the window's keys)")
        if self.block_size is not None and past + T_q > self.block_size:
            raise ValueError(f"sequence length T={past + T_q} (cached {past} + new {T_q}) exceeds block_size={self.block_size}")
        T_k = context.shape[1] if context is not None else past + T_q
        if T_k == 0:
            raise ValueError(f"x holds no positions and nothing is cached; got shape {tuple(x.shape)}")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError(f"mask must be a boolean tensor (True = may attend); got {getattr(mask, 'dtype', type(mask).__name__)}")
            target = (B, self.n_heads, T_q, T_k)
            if mask.dim() != 4 or any(m not in (1, s) for m, s in zip(mask.shape, target)):
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} must be 4-D and broadcast to (B, n_heads, T_q, T_k) = {target} "
                    f"with each dim 1 or equal (a key padding mask goes in key_padding_mask=(B, T_k))"
                )
            if mask.device != x.device:
                raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
            if mask.shape[1] != 1 and not self.per_head_masks:
                raise ValueError(f"{type(self).__name__} mixes heads and cannot honour a per-head mask; got {tuple(mask.shape)}")
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError(
                    "key_padding_mask must be a boolean tensor, True = a real token (nn.MultiheadAttention's "
                    f"is the opposite); got {getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}"
                )
            if key_padding_mask.device != x.device:
                raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but x is on {x.device}")
            if tuple(key_padding_mask.shape) != (B, T_k):
                raise ValueError(f"key_padding_mask must have shape (B, T_k) = {(B, T_k)}; got {tuple(key_padding_mask.shape)}")
            keys = key_padding_mask[:, None, None, :]  # (B, T_k) -> (B, 1, 1, T_k): every head, every query
            mask = keys if mask is None else mask & keys
        return mask

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        return_weights: bool = False,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to itself (or to ``context``).

        Args:
            x: ``(B, T, d_model)`` float, the module's dtype: the (new) positions.
            context: optional ``(B, T_k, d_model)``: keys and values come from it (cross-attention;
                the layer must be built with ``causal=False``).
            mask: optional bool ``(B|1, n_heads|1, T, T_k)``, ``True`` = may attend; combined with
                the causal mask and ``key_padding_mask`` by ``&``.
            key_padding_mask: optional bool ``(B, T_k)``, ``True`` = a real token (the opposite of
                ``nn.MultiheadAttention``'s convention).
            cache: a :class:`attnlib.cache.LayerCache`: the new positions are appended and attend to
                every cached one (``T_k`` = cached length; causal mask aligned bottom-right). Chapter 08.
            return_weights: also return the weights ``(B, n_heads, T, T_k)`` (eager function).
            positions: optional ``(B, T)`` integer positions of the new tokens, one row per sequence
                (batched generation with left padding, chapter 19: each row counts from its first real
                token). Only a layer with :attr:`takes_positions` (RoPE) uses them; default
                ``cache.length, …, cache.length + T - 1`` for every row.

        Returns:
            ``(B, T, d_model)``, or ``(output, weights)`` with ``return_weights``. A query with
            nothing to attend to (all keys masked) gets a zero attention output, never NaN.

        Raises:
            TypeError / ValueError: see :meth:`check_inputs`; each names the argument and value.
        """
        mask = self.check_inputs(x, context, mask, key_padding_mask, cache)
        if positions is not None:
            check_positions(positions, x)
        use = positions is not None and self.takes_positions
        q, k, v = self.project(x, context, cache, positions=positions) if use else self.project(x, context, cache)
        visible = None if cache is None else cache.visible(q.shape[-2])  # a sink cache's keys are not contiguous
        if visible is None and self.window_mod is not None:  # the window, aligned to the newest keys
            visible = mask_from_mod(self.window_mod, (1, 1, q.shape[-2], k.shape[-2]), x.device)[0, 0]
        if visible is not None:
            visible = visible.to(x.device)[None, None]  # (T_q, T_k) -> (1, 1, T_q, T_k)
            mask = visible if mask is None else mask & visible
        y, weights = self.attend(q, k, v, mask, self.causal and context is None, return_weights)
        y = self.resid_dropout(self.merge(y))
        return (y, weights) if return_weights else y
