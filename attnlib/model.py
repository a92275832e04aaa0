"""A decoder-only GPT assembled from attnlib's pieces (chapter 12).

Token + learned position embeddings, ``n_layers`` pre-LN blocks (attention from
:data:`attnlib.attention.ATTENTION_REGISTRY`, then a GELU MLP), a final
LayerNorm, and an output head tied to the token embedding. GPT-2 (Radford et al.
2019) layout and initialisation.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from attnlib._checks import cross_entropy_loss, eval_mode, token_ids
from attnlib.attention.registry import build_attention
from attnlib.cache import KVCache, LayerCache, SinkLayerCache
from attnlib.config import GPTConfig
from attnlib.feedforward import FeedForward
from attnlib.generate import decode
from attnlib.serving.padding import check_attention_mask, mask_positions

__all__ = ["GPT", "Block", "MLP"]


class MLP(FeedForward):
    """GPT's feed-forward block: the shared :class:`attnlib.feedforward.FeedForward`,
    ``d_model → 4·d_model → GELU → d_model``, sized from a config (parameters ``fc``, ``proj``).

    Shapes: ``(B, T, d_model)`` → ``(B, T, d_model)``. Vaswani et al. 2017, §3.3.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.d_model, 4 * config.d_model, config.dropout, config.gelu_approximate, config.bias)


class Block(nn.Module):
    """Pre-LN Transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    Shapes: ``(B, T, d_model)`` → ``(B, T, d_model)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = build_attention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, return_weights: bool = False,
        key_padding_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``(B, T, d_model)`` → ``(B, T, d_model)``; with ``return_weights`` also the attention
        weights ``(B, n_heads, T, T_k)`` (computed on the eager path). ``key_padding_mask``
        ``(B, T_k)`` and ``positions`` ``(B, T)`` go to the attention (left padding, chapter 19)."""
        padding = {} if key_padding_mask is None else {"key_padding_mask": key_padding_mask, "positions": positions}
        a = self.attn(self.ln_1(x), cache=cache, return_weights=return_weights, **padding)
        a, weights = a if return_weights else (a, None)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return (x, weights) if return_weights else x


class GPT(nn.Module):
    """Decoder-only Transformer language model.

    Args:
        config: a :class:`attnlib.GPTConfig`.

    Raises:
        TypeError: if ``config`` is not a GPTConfig.
    """

    # Linear layers that write into the residual stream: GPT-2 scales their init by 1/sqrt(2 * n_layers).
    residual_projections = ("attn.out_proj.weight", "mlp.proj.weight")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be an attnlib.GPTConfig; got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying (Press & Wolf 2017), as in GPT-2
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual projections N(0, 0.02/sqrt(2·n_layers))."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if name.endswith(self.residual_projections):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layers))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, the tied embedding counted once.

        Args:
            exclude_embeddings: leave out the token and position embeddings
                (the tied ``lm_head`` then counts as the token embedding, also left out).
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel() + self.pos_emb.weight.numel()
        return n

    def check_idx(self, idx: object, name: str = "idx") -> torch.Tensor:
        """Check ``idx`` and return it as int64: a ``(B, T)`` tensor of any integer dtype, ``T <= block_size``,
        every id in ``[0, vocab_size)`` (see :func:`attnlib._checks.token_ids`).

        Raises:
            TypeError: not a tensor, or a bool / floating dtype (named).
            ValueError: not 2-D, ``T > block_size``, or an id outside the vocabulary (named).
        """
        idx = token_ids(name, idx, self.config.vocab_size)
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length T={idx.shape[1]} exceeds block_size={self.config.block_size}")
        return idx

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits, and the cross-entropy loss when targets are given.

        Args:
            idx: ``(B, T)`` integer token ids, ``T <= block_size``.
            targets: optional ``(B, T)`` integer ids of the next tokens.
            cache: a :class:`attnlib.cache.KVCache` (chapter 08): ``idx`` holds the
                tokens after the ``cache.length`` already cached, at positions
                ``cache.length, …``; their keys/values are appended to the cache.
            last_only: compute the logits of the last position only, ``(B, 1, vocab_size)``
                (generation needs no more; the output head is a large share of a step).
            attention_mask: optional ``(B, cached + T)`` bool, ``True`` = a real token, covering the
                cached tokens and ``idx`` (chapter 19): padding is never attended to, and each row's
                positions count its real tokens only (:func:`attnlib.serving.mask_positions`), for
                the learned table and RoPE alike. A pad's own output is finite but meaningless.

        Returns:
            ``(logits, loss)``: logits ``(B, T, vocab_size)`` float; loss a scalar
            (mean cross-entropy in nats per token) or ``None``.

        Raises:
            TypeError: ``idx`` / ``targets`` not an integer tensor.
            ValueError: wrong shape, ``T > block_size`` (cached tokens included), or an id outside the vocabulary;
                an ``attention_mask`` of another shape or with a row of padding only (named).
        """
        idx = self.check_idx(idx)
        B, T = idx.shape
        if T == 0:
            raise ValueError(f"idx must hold at least one token per row; got shape {tuple(idx.shape)}")
        if targets is not None:  # checked before any compute, like everything else
            if last_only:
                raise ValueError("last_only=True computes no loss: it cannot take targets")
            targets = token_ids("targets", targets, self.config.vocab_size, ignore_index=-100)
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}; got {tuple(targets.shape)}")
        if cache is not None:
            self.check_cache(cache)
        start = 0 if cache is None else cache.next_position
        if start + T > self.config.block_size:
            raise ValueError(
                f"the cache holds {start} tokens; {T} more exceed block_size={self.config.block_size}"
            )
        positions = None
        if attention_mask is not None:
            check_attention_mask(attention_mask, (B, start + T), idx.device)
            positions = mask_positions(attention_mask)[:, -T:]  # (B, T): each row from its first real token
        x = self.embed(idx, start, positions)
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[i]
            x = block(x, layer_cache, key_padding_mask=attention_mask, positions=positions)
        if last_only:
            x = x[:, -1:, :]  # (B, T, d_model) -> (B, 1, d_model)
        logits = self.lm_head(self.ln_f(x))  # (B, T, d_model) -> (B, T, vocab_size)

        loss = None if targets is None else cross_entropy_loss(logits, targets)  # -100 = ignored; never NaN
        return logits, loss

    def check_cache(self, cache: object) -> None:
        """Raise unless ``cache`` is a :class:`attnlib.cache.KVCache` with one layer per block, in step, of ``block_size``."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an attnlib.cache.KVCache; got {type(cache).__name__}")
        if len(cache.layers) != self.config.n_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers; this model has n_layers={self.config.n_layers}")
        streaming = all(isinstance(layer, SinkLayerCache) for layer in cache.layers)  # may outlast block_size
        if cache.max_len < self.config.block_size or (cache.max_len != self.config.block_size and not streaming):
            raise ValueError(f"cache holds max_len={cache.max_len} positions; this model's block_size={self.config.block_size}")
        _ = cache.length  # raises if the layers fell out of step

    def kv_cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes a KV cache keeps per token of one sequence, all layers: each layer's own ``cache_width``.

        ``dtype`` defaults to the parameters' (chapter 08 measures the same number on the cache's tensors).
        """
        return sum(block.attn.cache_bytes_per_token(dtype) for block in self.blocks)

    def embed(self, idx: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token + position embeddings (then dropout) of ``idx`` ``(B, T)``: ``(B, T, d_model)``.

        Positions ``start, …, start + T - 1``, or per-row ``positions`` ``(B, T)`` (left padding,
        chapter 19). ``idx`` is not checked here.
        """
        pos = torch.arange(start, start + idx.shape[1], device=idx.device) if positions is None else positions
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, d) + ((T, d) or (B, T, d))

    @torch.no_grad()
    def attention_weights(self, idx: torch.Tensor) -> torch.Tensor:
        """Every layer's attention weights for ``idx``: what the attention explorer shows (chapter 12).

        Runs the forward pass without gradients, each block on its eager attention path.

        Args:
            idx: ``(B, T)`` integer token ids, ``T <= block_size``.

        Returns:
            ``(n_layers, B, n_heads, T, T)`` float: entry ``[l, b, h, i, j]`` is how much
            position ``i`` attends to position ``j`` in head ``h`` of layer ``l``; each row sums
            to 1 and is 0 for ``j > i`` (causal).

        Raises:
            TypeError / ValueError: as :meth:`forward` for a bad ``idx``.
        """
        idx = self.check_idx(idx)
        x = self.embed(idx)
        weights = []
        for block in self.blocks:
            x, w = block(x, return_weights=True)
            weights.append(w)
        return torch.stack(weights)  # n_layers x (B, n_heads, T, T) -> (n_layers, B, n_heads, T, T)

    def new_cache(self, windows: bool = True) -> KVCache:
        """An empty :class:`attnlib.cache.KVCache` for this model.

        ``windows=False``: every layer a full :class:`~attnlib.cache.LayerCache`, also the windowed ones
        (whose window is then applied as a mask): what batched generation with padding uses, since a
        ring buffer takes no padding mask. Same tokens; the ring buffer's memory saving is lost.
        """
        if not windows:
            return KVCache(self.config.n_layers, self.config.block_size)
        return KVCache.for_model(self)

    @torch.no_grad()
    def next_token_logits(self, idx: torch.Tensor, cache: KVCache | None, n_new: int,
                          attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache | None]:
        """Logits for the token after ``idx``, feeding only the last ``n_new`` tokens through ``cache``.

        Without a cache, the last ``block_size`` tokens are encoded from scratch. With one,
        the new tokens are appended; when they would not fit, the window slides: the cache
        is emptied and refilled with the last ``block_size`` tokens, exactly what the uncached
        path sees (learned absolute positions cannot be shifted inside a cache). ``attention_mask``
        ``(B, T)`` (left padding, chapter 19) is cropped with the tokens: each row's last ``block_size``
        real tokens are always inside the window, at the positions they have alone.

        Returns:
            ``(logits (B, vocab_size), cache)``.
        """
        block_size = self.config.block_size
        mask = attention_mask
        if cache is None:
            mask = None if mask is None else mask[:, -block_size:]
            return self(idx[:, -block_size:], last_only=True, attention_mask=mask)[0][:, -1, :], None
        if cache.next_position + n_new > block_size or cache.length == 0:
            cache.reset()  # the window slides: re-encode it from position 0, reusing the buffers
            n_new = min(idx.shape[1], block_size)
        mask = None if mask is None else mask[:, -(cache.length + n_new):]  # the cached tokens and the new ones
        return self(idx[:, -n_new:], cache=cache, last_only=True, attention_mask=mask)[0][:, -1, :], cache

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        stop_tokens: int | Iterable[int] | torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Extend ``idx`` by up to ``max_new_tokens`` tokens, one at a time (chapters 08, 12).

        The model sees at most the last ``block_size`` tokens: a longer prompt is
        cropped from the left, and once the text outgrows ``block_size`` each step sees
        the last ``block_size`` tokens (the returned tensor keeps everything). With
        ``use_cache`` (chapter 08) the prompt is encoded once (prefill) and each new token
        attends to the cached keys/values (decode); the tokens are the same as without it.
        Runs in eval mode; the modes are restored afterwards. The loop is
        :func:`attnlib.generate.decode`, shared with the other decoders.

        Args:
            idx: ``(B, T)`` prompt of any integer dtype (T >= 1; every id is checked, also beyond the window).
            max_new_tokens: how many tokens to add (>= 0).
            temperature: ``0`` = greedy; higher = more random (finite, >= 0).
            top_k, top_p: optional filters, see :func:`attnlib.sampling.sample_next_token`.
            generator: ``torch.Generator`` for reproducible samples.
            use_cache: decode with a :class:`attnlib.cache.KVCache`.
            stop_tokens: an id or ids that end a sequence; a row that has produced one is padded
                with it from then on, and generation ends early once every row has.
            attention_mask: ``(B, T)`` bool, ``True`` = a real token, for prompts of different lengths
                left-padded into one batch (:func:`attnlib.serving.left_pad`; chapter 19). Each row gets
                the tokens it gets alone: pads are never attended to and positions start at each row's
                first real token. With it, windowed layers use a full cache with the window as a mask.

        Returns:
            ``(B, T + n)`` int64 with ``n <= max_new_tokens``.

        Raises:
            TypeError / ValueError: a bad prompt, ``max_new_tokens``, sampling setting or stop token, an
            ``attention_mask`` that is not bool, not ``idx``'s shape, all padding in a row or not left
            padding (the row named); all checked before the first forward pass.
        """
        with eval_mode(self):
            return decode(self, idx, max_new_tokens, vocab_size=self.config.vocab_size, temperature=temperature,
                          top_k=top_k, top_p=top_p, generator=generator, use_cache=use_cache,
                          stop_tokens=stop_tokens, attention_mask=attention_mask)
