"""One decoder-only language model for every preset: GPT-2, the chapter-13 variants, Llama / Qwen3 /
Mistral, and models that mix layer types. Chapters 12, 13, 16, 17, 18.

Token embeddings (+ a learned position table for GPT-2), ``n_layers`` blocks, a final norm and
an output head (tied to the embedding or not). Each :class:`Block` is built from its parts for its
layer (:mod:`attnlib.models.layers`): a norm, the layer type's attention (with RoPE injected where the
config asks for it), a norm and a feed-forward block, pre-norm or "sandwich". GPT-2 (Radford et al.
2019) layout and initialisation; :class:`GPT` is chapter 12's name for it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib._checks import cross_entropy_loss, eval_mode, token_ids
from attnlib.attention.inputs import check_positions
from attnlib.attention.masks import check_attention_mask, mask_positions
from attnlib.cache.model import KVCache
from attnlib.cache.shared import forward_caches
from attnlib.generation.generate import generate
from attnlib.models.config import DecoderConfig
from attnlib.models.layers import build_attention, build_feedforward, build_norm
from attnlib.models.per_layer import PartialRotaryEmbedding, PerLayerInputGate, PerLayerInputs
from attnlib.positional.rotary import LeadingRotaryEmbedding, RotaryEmbedding

__all__ = ["GPT", "Block", "Decoder"]


class Block(nn.Module):
    """One layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (pre-norm); with ``norm_placement="sandwich"``
    each branch's output is normalised too (``post_attn_norm``, ``post_mlp_norm``; Gemma 2 and 3).

    Args:
        config: the model's :class:`~attnlib.models.config.DecoderConfig`.
        layer: this layer's index (its type is ``config.layer_types[layer]``).
        rope: the :class:`~attnlib.positional.RotaryEmbedding` its attention rotates with, or None.

    Shapes: ``(B, T, d_model)`` → ``(B, T, d_model)``.
    """

    def __init__(self, config: DecoderConfig, layer: int, rope: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer]
        self.ln_1 = build_norm(config)  # transformers: input_layernorm
        self.attn = build_attention(config, layer, rope)
        self.ln_2 = build_norm(config)  # post_attention_layernorm (Llama), pre_feedforward_layernorm (Gemma)
        self.mlp = build_feedforward(config)
        sandwich = config.norm_placement == "sandwich"
        self.post_attn_norm = build_norm(config) if sandwich else None
        self.post_mlp_norm = build_norm(config) if sandwich else None
        d_input = config.d_per_layer_input  # Gemma 4: the layer's own input, gated in after the feed-forward
        self.per_layer_input = None if d_input is None else PerLayerInputGate(config.d_model, d_input, config.norm_eps)
        if config.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))  # Gemma 4's, loaded with the weights

    def forward(
        self, x: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None, return_weights: bool = False, per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``(B, T, d_model)`` → ``(B, T, d_model)``; with ``return_weights`` also the attention weights
        ``(B, n_heads, T, T_k)`` (eager path). ``cache``: this layer's cache; ``attention_mask`` ``(B, T_k)``
        and ``positions`` ``(B, T)`` go to the attention (left padding, chapter 19); ``per_layer_input``
        ``(B, T, d_per_layer_input)``: this layer's input (Gemma 4)."""
        a = self.attn(self.ln_1(x), cache=cache, attention_mask=attention_mask, positions=positions,
                      return_weights=return_weights)
        a, weights = a if return_weights else (a, None)
        x = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = self.mlp(self.ln_2(x))
        x = x + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))
        if self.per_layer_input is not None:
            x = self.per_layer_input(x, per_layer_input)
        if hasattr(self, "layer_scalar"):
            x = x * self.layer_scalar
        return (x, weights) if return_weights else x


class Decoder(nn.Module):
    """A decoder-only Transformer language model, its layers as ``config.layer_types`` says.

    Args:
        config: a :class:`~attnlib.models.config.DecoderConfig`.

    Raises:
        TypeError: ``config`` is not a DecoderConfig.
    """

    # Linear layers that write into the residual stream: GPT-2 scales their init by 1/sqrt(2 * n_layers).
    residual_projections = ("attn.out_proj.weight", "mlp.proj.weight", "mlp.down.weight")

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be an attnlib.DecoderConfig; got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.position == "learned":
            self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        if config.position == "rope":  # one table per base, shared by the layers that use it
            if config.partial_rotary_factor is None:
                self.rope = RotaryEmbedding(config.head_dim, config.rope_base, config.rope_scaling, config.block_size)
            else:  # Qwen3.5: the leading part of each head turned (chapter 21)
                self.rope = LeadingRotaryEmbedding(config.head_dim, config.rope_base, config.partial_rotary_factor,
                                                   config.rope_scaling, config.block_size)
            if config.rope_local_base is not None:  # sliding layers' own base (Gemma 3), unscaled
                self.rope_local = RotaryEmbedding(config.head_dim, config.rope_local_base, None, config.block_size)
            wide, fraction = config.global_head_dim or config.head_dim, config.global_partial_rotary_factor
            if fraction is not None:  # full layers' own table (Gemma 4): wider, part of each head turned
                self.rope_global = PartialRotaryEmbedding(wide, config.rope_base, fraction, config.block_size)
            elif wide != config.head_dim:
                self.rope_global = RotaryEmbedding(wide, config.rope_base, config.rope_scaling, config.block_size)
        if config.d_per_layer_input is not None:
            self.per_layer = PerLayerInputs(config.vocab_size, config.d_model, config.n_layers,
                                            config.d_per_layer_input, config.norm_eps)
        self.blocks = nn.ModuleList(Block(config, i, self.rope_of(i)) for i in range(config.n_layers))
        self.ln_f = build_norm(config)  # transformers: model.norm
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # weight tying (Press & Wolf 2017), as in GPT-2
        self.reset_parameters()

    def rope_of(self, layer: int) -> RotaryEmbedding | None:
        """The RoPE table layer ``layer`` rotates with: the local one on sliding layers when there is one, the
        global one on full layers when they have their own (Gemma 4); None for a NoPE or linear layer, or without
        RoPE."""
        if not self.config.uses_rope(layer):
            return None
        if self.config.layer_types[layer] == "full_attention" and hasattr(self, "rope_global"):
            return self.rope_global
        local = self.config.layer_types[layer] == "sliding_attention" and self.config.rope_local_base is not None
        return self.rope_local if local else self.rope

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
        """Number of parameters, a tied head counted once.

        Args:
            exclude_embeddings: leave out the token embedding and the position table (a tied ``lm_head``
                then counts as the token embedding, also left out).
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if exclude_embeddings:
            n -= sum(e.weight.numel() for e in (self.tok_emb, getattr(self, "pos_emb", None)) if e is not None)
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
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits, and the cross-entropy loss when targets are given.

        Args:
            idx: ``(B, T)`` integer token ids, ``T <= block_size``.
            targets: optional ``(B, T)`` integer ids of the next tokens (``-100`` = ignored).
            cache: a :class:`attnlib.cache.KVCache` (chapter 08): ``idx`` holds the tokens after the
                ``cache.length`` already cached, at positions ``cache.length, …``; each layer's cache keeps
                what its layer needs.
            last_only: compute the logits of the last position only, ``(B, 1, vocab_size)``
                (generation needs no more; the output head is a large share of a step).
            attention_mask: optional ``(B, cached + T)`` bool, ``True`` = a real token (``transformers``'
                convention), covering the cached tokens and ``idx`` (chapter 19): padding is never attended
                to, and each row's positions count its real tokens only
                (:func:`attnlib.attention.masks.mask_positions`). A pad's own output is finite but meaningless.
            positions: optional ``(B, T)`` integer positions of ``idx`` (default: from ``attention_mask``, or
                ``cache.length, …``): what the position table and RoPE use.

        Returns:
            ``(logits, loss)``: logits ``(B, T, vocab_size)`` float; loss a scalar
            (mean cross-entropy in nats per token) or ``None``.

        Raises:
            TypeError: ``idx`` / ``targets`` not an integer tensor; ``cache`` not a KVCache.
            ValueError: wrong shape, ``T > block_size`` (cached tokens included, unless every layer's cache
                renumbers positions), an id outside the vocabulary; an ``attention_mask`` of another shape or
                with a row of padding only, or with linear layers (they would fold the padding into their
                state); a cache of another number of layers (named).
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
        start = 0 if cache is None else self.check_cache(cache)
        if start + T > self.config.block_size and not (cache is not None and cache.renumbers):
            raise ValueError(f"the cache holds {start} tokens; {T} more exceed block_size={self.config.block_size}")
        if attention_mask is not None:
            check_attention_mask(attention_mask, (B, start + T), idx.device)
            linear = [i for i, kind in enumerate(self.config.layer_types) if kind == "linear_attention"]
            if linear:
                raise ValueError(f"attention_mask cannot be honoured by the linear layers {linear}: a recurrent "
                                 "state would fold the padding in (left-padded batches need softmax layers)")
            positions = mask_positions(attention_mask)[:, -T:] if positions is None else positions
        if positions is not None:
            check_positions(positions, idx)
        x = self.embed(idx, start, positions)
        inputs = self.per_layer(idx, x) if self.config.d_per_layer_input is not None else None  # (B, T, n_layers, d)
        caches = forward_caches(self) if cache is None else cache.layers  # shared K/V pass between layers (Gemma 4)
        for i, block in enumerate(self.blocks):
            x = block(x, caches[i], attention_mask, positions, per_layer_input=None if inputs is None else inputs[:, :, i])
        if last_only:
            x = x[:, -1:, :]  # (B, T, d_model) -> (B, 1, d_model)
        logits = self.lm_head(self.ln_f(x))  # (B, T, d_model) -> (B, T, vocab_size)
        if self.config.logit_softcap is not None:  # Gemma 2: cap · tanh(z / cap)
            logits = torch.tanh(logits / self.config.logit_softcap) * self.config.logit_softcap
        loss = None if targets is None else cross_entropy_loss(logits, targets)  # -100 = ignored; never NaN
        return logits, loss

    def check_cache(self, cache: object) -> int:
        """Raise unless ``cache`` is a model cache with one layer cache per block, in step; return its length."""
        layers = getattr(cache, "layers", None)
        if not isinstance(layers, list) or not hasattr(cache, "reorder"):
            raise TypeError(f"cache must be an attnlib.cache.KVCache (model.new_cache()); got {type(cache).__name__}")
        if len(layers) != self.config.n_layers:
            raise ValueError(f"cache has {len(layers)} layers; this model has n_layers={self.config.n_layers}")
        return cache.length  # raises if the layers fell out of step

    def kv_cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes a KV cache keeps per token of one sequence, all layers: each layer's own ``cache_width``
        (0 for a linear layer, whose state does not grow). ``dtype`` defaults to the parameters'."""
        return sum(block.attn.cache_bytes_per_token(dtype) for block in self.blocks)

    def embed(self, idx: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings (+ the learned position table at ``start, …`` or at per-row ``positions``
        ``(B, T)``), then dropout: ``(B, T, d_model)``. ``idx`` is not checked here; RoPE and ALiBi enter
        inside attention."""
        x = self.tok_emb(idx)
        if self.config.scale_embeddings:  # Gemma: x √d_model, the factor rounded to the embedding's dtype
            x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype, device=x.device)
        if self.config.position == "learned":
            pos = torch.arange(start, start + idx.shape[1], device=idx.device) if positions is None else positions
            x = x + self.pos_emb(pos)  # (B, T, d) + ((T, d) or (B, T, d))
        return self.drop(x)

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
            TypeError / ValueError: as :meth:`forward` for a bad ``idx``; a linear layer (it has no weights).
        """
        idx = self.check_idx(idx)
        x = self.embed(idx)
        inputs = self.per_layer(idx, x) if self.config.d_per_layer_input is not None else None
        weights = []
        for i, (block, cache) in enumerate(zip(self.blocks, forward_caches(self))):
            x, w = block(x, cache, return_weights=True, per_layer_input=None if inputs is None else inputs[:, :, i])
            weights.append(w)
        return torch.stack(weights)  # n_layers x (B, n_heads, T, T) -> (n_layers, B, n_heads, T, T)

    def new_cache(self, windows: bool = True) -> KVCache:
        """An empty :class:`attnlib.cache.KVCache` for this model: what each layer asks for.

        ``windows=False``: every softmax layer a full cache, also the windowed and chunked ones (whose rule then
        applies as a mask): the same tokens, without the memory saving.
        """
        return KVCache.for_model(self, windows)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, **settings) -> torch.Tensor:
        """Extend ``idx`` ``(B, T)`` by up to ``max_new_tokens`` tokens, one at a time (chapters 08, 12).

        The loop is :func:`attnlib.generation.generate`, shared with every decoder of the library; see it
        for the settings (``temperature``, ``top_k``, ``top_p``, ``generator``, ``use_cache``,
        ``stop_tokens``, ``attention_mask``), the returns and the errors. Runs in eval mode; the modes
        are restored afterwards.
        """
        with eval_mode(self):
            return generate(self, idx, max_new_tokens, **settings)


#: Chapter 12's name for the decoder: a :class:`Decoder` (with :data:`~attnlib.models.config.GPTConfig`'s
#: defaults, GPT-2's layout).
GPT = Decoder
