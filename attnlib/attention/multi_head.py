"""Multi-head attention: one module for MHA, GQA, MQA, cross-attention and the modern decoder's attention.

``project → attend → merge``: queries, keys and values from one fused projection;
an attention function from :data:`attnlib.attention.ATTENTION_FUNCTIONS`; the heads
concatenated through an output projection (Vaswani et al. 2017, §3.2.2; chapter 04).
``n_kv_heads < n_heads`` lets groups of query heads share key/value heads (GQA,
Ainslie et al. 2023; ``n_kv_heads = 1`` is MQA, Shazeer 2019; chapter 06); a
``context`` makes it cross-attention (§3.2.3; chapter 09). What a modern decoder adds is
injected, not subclassed (chapters 16, 17): a :class:`~attnlib.positional.RotaryEmbedding`
(RoPE on queries and keys), QK-norm, a sliding window or chunk, a score modification.
Talking heads and multi-head latent attention are subclasses that change one step each.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib._checks import divisible, finite_number, positive_int, probability
from attnlib.attention.inputs import check_layer_inputs, visible_mask
from attnlib.attention.mods import chunked, sliding_window
from attnlib.attention.registry import ATTENTION_FUNCTIONS, get_attention_function
from attnlib.attention.temperature import AttentionTemperature, qk_norms
from attnlib.cache.layer import LayerCache
from attnlib.cache.windowed import ChunkedLayerCache, RingLayerCache

__all__ = ["KV_SHARING", "MultiHeadAttention", "refuse_options"]

#: How a group of query heads reads its shared key/value head: ``"fold"`` hands the shared heads to
#: the attention function, which reads them in place (no copy); ``"repeat_interleave"`` copies each
#: K/V head once per query head of its group first (simple, but the copies cost memory). Equal outputs.
KV_SHARING = ("fold", "repeat_interleave")


def refuse_options(layer: str, options: dict, fixed: dict) -> None:
    """Raise ``ValueError`` if ``options`` sets one of ``fixed``'s names to another value than the variant of the
    layer always uses (``None``: the option is not used at all); the message names the option, the value and
    what the layer uses."""
    given = sorted(name for name in fixed if name in options and options[name] is not None
                   and options[name] != fixed[name])
    if given:
        raise ValueError(f"{layer} does not take {given}: "
                         + "; ".join(f"{n}={options[n]!r} (it uses {n}={fixed[n]!r})" for n in given))


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
        attn_fn: a name of :data:`attnlib.attention.ATTENTION_FUNCTIONS`: ``"sdpa"`` (fast), ``"eager"``
            (readable, what the book derives), ``"tiled"`` or ``"flash"`` (chapter 15).
        kv_sharing: one of :data:`KV_SHARING`.
        head_dim: width of each head; default ``d_model // n_heads`` (then ``n_heads`` must divide
            ``d_model``). Qwen3 sets it apart: 16 heads of 128 in a model of width 1024.
        sliding_window: ``None`` or ``w``: query ``i`` sees keys ``i - w < j <= i`` only (Mistral;
            :func:`attnlib.attention.mods.sliding_window`; chapter 17). Causal layers only.
        chunk_size: ``None`` or ``C``: query ``i`` sees the keys of its own chunk, ``i // C == j // C``
            (Llama 4's chunked attention; :func:`attnlib.attention.mods.chunked`). Causal layers only.
        rope: ``None`` or the :class:`~attnlib.positional.RotaryEmbedding` (``head_dim`` wide, shared by a
            model's layers) that rotates queries and keys by their positions before the cache, so that
            cached keys are stored rotated (Llama; chapter 16). Self-attention only.
        qk_norm: a norm over ``head_dim`` on queries and keys, before RoPE (Qwen3; Dehghani et al. 2023).
        norm_eps: QK-norm's epsilon.
        qk_norm_type: ``"rmsnorm"`` (a learned weight, Qwen3) or ``"l2"`` (none, Llama 4's
            ``Llama4TextL2Norm``): :data:`attnlib.attention.temperature.QK_NORMS`.
        temperature: ``None`` or an :class:`~attnlib.attention.temperature.AttentionTemperature`: queries
            scaled by their absolute positions (``positions``, else ``cache.length, …``) after QK-norm and RoPE
            (Llama 4's temperature tuning on NoPE layers; chapter 20). Causal layers only.
        score_mod: ``None`` or a FlexAttention-style ``(scores, b, h, q_idx, kv_idx) -> scores`` applied
            before the softmax (ALiBi, soft-capping: :mod:`attnlib.attention.mods`); not with ``"sdpa"``
            or ``"flash"``, which cannot modify scores.
        scale: the factor on ``q · k``, a number > 0 (default ``1/√head_dim``; Gemma 3 and 4, chapter 20).
        sinks: learned attention sinks (gpt-oss; chapter 20): one logit per query head joins the softmax's
            denominator and is dropped, so a head may attend to nothing (not StreamingLLM's sink tokens,
            :class:`~attnlib.cache.SinkLayerCache`); not with ``"sdpa"``, whose softmax cannot add it.

    Attributes:
        qkv: ``nn.Linear(d_model, (n_heads + 2 · n_kv_heads) · head_dim)``; rows ``[W_q; W_k; W_v]``
            (with ``n_kv_heads == n_heads``, ``nn.MultiheadAttention.in_proj_weight``'s layout).
        out_proj: ``nn.Linear(n_heads · head_dim, d_model)``.
        q_norm, k_norm: the QK-norm layers (``None`` without ``qk_norm``).
        sinks: ``nn.Parameter`` ``(n_heads,)`` of sink logits, initialised to 0 (transformers' name), or ``None``.
        mask_mod: the layer's rule beyond causality (its window or chunk), or ``None``.
        cache_width: numbers a KV cache keeps per token for this layer, ``2 · n_kv_heads · head_dim``.

    Raises:
        TypeError / ValueError: a size that is not a positive int, ``d_model`` not divisible by
            ``n_heads`` or ``n_heads`` by ``n_kv_heads``, ``dropout`` outside [0, 1), an unknown
            ``attn_fn`` or ``kv_sharing``, a window or chunk on a non-causal layer or both at once, a
            ``rope`` of another width, a ``score_mod`` or ``sinks`` with a function that cannot apply it; the message
            names the value.
    """

    #: Whether a mask may differ between heads (talking heads mixes heads, so it cannot honour one).
    per_head_masks = True

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
        chunk_size: int | None = None,
        rope=None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        score_mod=None,
        scale: float | None = None,
        sinks: bool = False,
        qk_norm_type: str = "rmsnorm",
        temperature: AttentionTemperature | None = None,
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
        for name, value in (("bias", bias), ("causal", causal), ("qk_norm", qk_norm), ("sinks", sinks)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {value!r}")
        get_attention_function(attn_fn)  # an unknown name fails here, naming the known ones
        if dropout and attn_fn in ("tiled", "flash"):
            raise ValueError(f"dropout={dropout} needs attn_fn='eager' or 'sdpa' ({attn_fn!r} has no dropout)")
        if not isinstance(kv_sharing, str) or kv_sharing not in KV_SHARING:
            raise ValueError(f"kv_sharing={kv_sharing!r} is not one of {KV_SHARING}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.block_size, self.dropout, self.causal = block_size, dropout, causal
        self.attn_fn, self.kv_sharing = attn_fn, kv_sharing
        self.scale = 1.0 / math.sqrt(self.head_dim) if scale is None else finite_number("scale", scale, above=0)
        self.sliding_window, self.chunk_size = sliding_window, chunk_size
        self.mask_mod = self._rule(sliding_window, chunk_size)
        if score_mod is not None and not callable(score_mod):
            raise TypeError(f"score_mod must be callable (scores, b, h, q_idx, kv_idx) -> scores; got {score_mod!r}")
        if score_mod is not None and attn_fn in ("sdpa", "flash"):
            raise ValueError(f"score_mod needs attn_fn='eager' or 'tiled' ({attn_fn!r} cannot modify scores)")
        self.score_mod = score_mod
        if sinks and attn_fn == "sdpa":
            raise ValueError("sinks=True needs attn_fn='eager', 'tiled' or 'flash' ('sdpa' cannot add a sink to "
                             "its softmax's denominator)")
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None  # exp(0): one key's worth of a zero score
        self.build_projections(bias)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)  # created last: init order as in nanoGPT
        self.resid_dropout = nn.Dropout(dropout)
        if rope is not None and getattr(rope, "head_dim", None) != self.head_dim:
            got = f"one of head_dim={rope.head_dim}" if hasattr(rope, "head_dim") else repr(rope)
            raise ValueError(f"rope must be a RotaryEmbedding of head_dim={self.head_dim}; got {got}")
        self.rope = rope
        self.q_norm, self.k_norm = qk_norms(qk_norm, qk_norm_type, self.head_dim, norm_eps)
        if temperature is not None and not isinstance(temperature, AttentionTemperature):
            raise TypeError(f"temperature must be None or an AttentionTemperature; got {temperature!r}")
        if temperature is not None and not causal:
            raise ValueError(f"temperature={temperature!r} scales queries by their positions: causal layers only")
        self.temperature = temperature

    def _rule(self, window: int | None, chunk: int | None):
        """The layer's mask modification beyond causality: its sliding window or chunk (checked), or None."""
        for name, value in (("sliding_window", window), ("chunk_size", chunk)):
            if value is not None:
                positive_int(name, value)
        if window is not None and chunk is not None:
            raise ValueError(f"sliding_window={window} and chunk_size={chunk}: a layer has one or the other")
        if (window is not None or chunk is not None) and not self.causal:
            raise ValueError(f"sliding_window={window!r} / chunk_size={chunk!r} need a causal layer (causal=True)")
        if window is not None:
            return sliding_window(window)
        return None if chunk is None else chunked(chunk)

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

    def new_cache(self, block_size: int, windows: bool = True) -> LayerCache:
        """The cache this layer needs: every position, or (``windows``) only its window or its chunk."""
        if windows and self.sliding_window is not None:
            return RingLayerCache(block_size, self.sliding_window)
        if windows and self.chunk_size is not None:
            return ChunkedLayerCache(block_size, self.chunk_size)
        return LayerCache(block_size)

    def split_heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        """``(B, T, n_heads · width)`` → ``(B, n_heads, T, width)``."""
        B, T, width = x.shape
        return x.view(B, T, n_heads, width // n_heads).transpose(1, 2)  # (B, T, n_heads*w) -> (B, n_heads, T, w)

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None, cache=None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, n_heads, T, head_dim)``; keys and values ``(B, n_kv_heads, T_k, head_dim)``.

        Keys and values come from ``context`` when given (cross-attention), else from ``x``. QK-norm,
        then RoPE at ``positions`` (``(B, T)`` per row, or by default ``cache.length, …``), then the
        cache: the new keys and values are appended and what the cache returns is attended to. A cache
        that renumbers (:class:`~attnlib.cache.SinkLayerCache`) stores keys unrotated and they are
        rotated at their places in it.
        """
        if context is not None or self.rope is None:
            q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            if context is None:
                q, k, v = self.qkv(x).split([q_width, kv_width, kv_width], dim=-1)  # (B, T, q_width + 2 kv_width)
            else:  # the same fused weight, its query rows on x and its key/value rows on the context
                w, b = self.qkv.weight, self.qkv.bias
                q = nn.functional.linear(x, w[:q_width], None if b is None else b[:q_width])
                k, v = nn.functional.linear(context, w[q_width:], None if b is None else b[q_width:]).split(kv_width, -1)
            q, k, v = self.split_heads(q, self.n_heads), self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)
            if self.q_norm is not None:  # per head, over head_dim
                q, k = self.q_norm(q), self.k_norm(k)
            return (q, *cache.update(k, v)) if cache is not None else (q, k, v)  # only the n_kv_heads shared heads
        B, T, _ = x.shape
        heads = self.qkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
        qk, v = heads.split([self.n_heads + self.n_kv_heads, self.n_kv_heads], dim=1)  # (B, heads, T, hd) views
        if self.q_norm is not None:  # per head, over head_dim (Qwen3: before RoPE)
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if cache is not None and cache.renumbers:
            if positions is not None:
                raise ValueError("positions cannot be given with a sink cache: it numbers positions within the cache")
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)  # StreamingLLM: keys cached unrotated
            k, v = cache.update(k, v)
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
            k, v = cache.update(k, v)  # keys cached rotated: never rotated again
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
        sinks = {} if self.sinks is None else {"sinks": self.sinks}  # learned sinks (gpt-oss), when the layer has them
        return fn(q, k, v, mask, is_causal=is_causal, scale=self.scale, dropout_p=dropout_p, score_mod=self.score_mod,
                  **sinks)

    def gate_output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """What reaches the output projection from the heads ``y (B, n_heads, T, width)``: ``y`` itself
        (:class:`~attnlib.attention.sparse.GatedAttention` gates it by ``x``)."""
        return y

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """``(B, n_heads, T, head_dim)`` → ``(B, T, d_model)`` through the output projection."""
        B, _, T, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # -> (B, T, d_model)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        positions: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to itself (or to ``context``).

        Args:
            x: ``(B, T, d_model)`` float, the module's dtype: the (new) positions.
            context: optional ``(B, T_k, d_model)``: keys and values come from it (cross-attention;
                the layer must be built with ``causal=False``).
            mask: optional bool ``(B|1, n_heads|1, T, T_k)``, ``True`` = may attend; combined with
                the causal mask and ``attention_mask`` by ``&``. ``T_k`` counts every position: the
                context's, or the cached ones and the new.
            attention_mask: optional bool ``(B, T_k)``, ``True`` = a real token (``transformers``'
                convention; ``nn.MultiheadAttention``'s ``key_padding_mask`` is the opposite).
            cache: a layer cache (:mod:`attnlib.cache`): the new positions are appended and attend to
                what it returns (causal mask aligned bottom-right). Chapter 08.
            positions: optional ``(B, T)`` integer positions of the new tokens, one row per sequence
                (left-padded batches, chapter 19: each row counts from its first real token); RoPE
                rotates by them. Default ``cache.length, …, cache.length + T - 1`` for every row.
            return_weights: also return the weights ``(B, n_heads, T, T_k)`` (eager function). A cache whose
                ``needs_weights`` is true gets them too (``cache.observe``; the eager function then runs).

        Returns:
            ``(B, T, d_model)``, or ``(output, weights)`` with ``return_weights``. A query with
            nothing to attend to (all keys masked) gets a zero attention output, never NaN.

        Raises:
            TypeError / ValueError: see :func:`attnlib.attention.inputs.check_layer_inputs`; a cache that
                would change this layer's attention (``cache.check_layer``); each names the argument.
        """
        T_total = check_layer_inputs(self, x, context, mask, attention_mask, cache, positions)
        past = 0 if cache is None else cache.length
        q, k, v = self.project(x, context, cache, positions)
        if self.temperature is not None:  # Llama 4: queries scaled by their absolute positions
            q = self.temperature(q, positions, past)
        mask = visible_mask(self, mask, attention_mask, cache, q.shape[-2], T_total, x.device)
        watch = getattr(cache, "needs_weights", False)  # an evicting cache (H2O, SnapKV) reads this step's weights
        y, weights = self.attend(q, k, v, mask, self.causal and context is None, return_weights or watch)
        if watch:
            cache.observe(weights)  # it keeps what they rank highest (attnlib.cache.eviction)
        y = self.resid_dropout(self.merge(self.gate_output(x, y)))
        return (y, weights) if return_weights else y
