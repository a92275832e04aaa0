"""The modern decoder: a Llama / Qwen3 / Mistral-style language model from attnlib's pieces. Chapter 16.

What changed since GPT-2 (chapter 12), each a piece of attnlib:

* no position embedding: RoPE inside attention (:class:`~attnlib.attention.RotaryAttention`);
* RMSNorm (Zhang & Sennrich 2019) instead of LayerNorm, before each sub-layer and at the end;
* a SwiGLU feed-forward block (:class:`~attnlib.feedforward.SwiGLU`; Shazeer 2020);
* grouped-query attention (``n_kv_heads``), optional QK-norm (Qwen3) and sliding window (Mistral);
* no biases, and an output head that is tied to the embedding or not (``tie_embeddings``).

:class:`ModernDecoder` is a :class:`~attnlib.GPT` in everything else (the forward pass and its
checks, the KV cache, generation), so chapter 08's cache and decoding work unchanged.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from attnlib._checks import divisible, finite_number, positive_int, probability
from attnlib.attention.functions import get_attention_function
from attnlib.attention.rotary import RotaryAttention
from attnlib.feedforward import SwiGLU
from attnlib.model import GPT, Block
from attnlib.mods import alibi, softcap
from attnlib.norms import RMSNorm
from attnlib.positional import RotaryEmbedding

__all__ = ["POSITIONS", "ModernConfig", "ModernDecoder"]

#: How a :class:`ModernDecoder` tells positions apart (``ModernConfig.position``).
POSITIONS = ("rope", "alibi", "learned", "nope")


@dataclass(frozen=True)
class ModernConfig:
    """Sizes of a :class:`ModernDecoder`. Frozen: change one with :meth:`replace`.

    Attributes:
        vocab_size, block_size, n_layers, n_heads, d_model, dropout: as :class:`~attnlib.GPTConfig`
            (``block_size``: the longest context, ``max_position_embeddings``).
        n_kv_heads: key/value heads (GQA), dividing ``n_heads``; default ``n_heads``.
        head_dim: width of a head; default ``d_model // n_heads`` (Qwen3 sets it apart).
        d_ff: SwiGLU hidden width; default ``8/3 · d_model`` rounded up to a multiple of 8.
        rope_base: RoPE's ``rope_theta``. rope_scaling: ``transformers``-format dict or None
            (:func:`attnlib.positional.rope_frequencies`).
        norm_eps: RMSNorm's epsilon (Llama 1e-5, Qwen3 1e-6).
        qk_norm: RMSNorm on each head's queries and keys (Qwen3).
        tie_embeddings: the output head shares the token embedding's weight.
        bias: biases on the attention's projections (Qwen2: on q, k, v; never on the MLP).
        sliding_window: None (full attention) or the window of every layer.
        attn_fn: the attention function, ``"sdpa"``, ``"eager"`` or ``"tiled"``. SDPA cannot modify
            scores: with ALiBi or soft-capping the layers use ``"eager"`` unless ``"tiled"`` is asked.
        position: how positions enter: ``"rope"`` (default), ``"alibi"`` (Press et al. 2022: a linear
            distance penalty per head), ``"learned"`` (GPT-2's added table; not past ``block_size``) or
            ``"nope"`` (none: the causal mask alone; Haviv et al. 2022). Chapter 17 compares them.
        attn_softcap: None or Gemma 2's cap on attention scores, ``cap · tanh(s / cap)`` (50.0 in Gemma 2).

    Raises:
        TypeError / ValueError: a size that is not a positive int, ``n_heads`` not divisible by
            ``n_kv_heads``, a bad RoPE setting (``rope_base`` not a finite number > 1, a ``rope_scaling``
            that :func:`~attnlib.rope.rope_frequencies` refuses, or one given with another ``position``),
            ``norm_eps`` not a finite number > 0, ``attn_softcap`` not a finite number > 0, ``dropout``
            outside [0, 1); named in the message. An odd head width is refused only with RoPE.
    """

    vocab_size: int = 65
    block_size: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 64
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    norm_eps: float = 1e-6
    qk_norm: bool = False
    tie_embeddings: bool = False
    bias: bool = False
    dropout: float = 0.0
    sliding_window: int | None = None
    attn_fn: str = "sdpa"
    position: str = "rope"
    attn_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model"):
            positive_int(name, getattr(self, name))
        for name in ("n_kv_heads", "head_dim", "d_ff", "sliding_window"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.head_dim is None:
            divisible("d_model", self.d_model, "n_heads", self.n_heads)
        divisible("n_heads", self.n_heads, "n_kv_heads", self.kv_heads)
        probability("dropout", self.dropout)
        for name in ("qk_norm", "tie_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}")
        if finite_number("norm_eps", self.norm_eps) <= 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0 (it keeps RMSNorm's division away from 0)")
        if finite_number("rope_base", self.rope_base) <= 1:
            raise ValueError(f"rope_base={self.rope_base!r} must be a finite number > 1")
        get_attention_function(self.attn_fn)
        if not isinstance(self.position, str) or self.position not in POSITIONS:
            raise ValueError(f"position={self.position!r} is not one of {POSITIONS}")
        if self.attn_softcap is not None:
            finite_number("attn_softcap", self.attn_softcap)
            if self.attn_softcap <= 0:
                raise ValueError(f"attn_softcap must be a finite number > 0, got {self.attn_softcap!r}")
        if self.rope_scaling is not None:
            if self.position != "rope":
                raise ValueError(f"rope_scaling={self.rope_scaling!r} is given but position={self.position!r} "
                                 "does not use RoPE")
            if isinstance(self.rope_scaling, Mapping):  # a copy: later edits of the caller's dict cannot reach it
                object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if self.position == "rope":
            RotaryEmbedding(self.head_size, self.rope_base, self.rope_scaling, self.block_size)  # checks RoPE's settings

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        """The head width used: ``head_dim``, or ``d_model // n_heads``."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def ff_width(self) -> int:
        """The SwiGLU hidden width used: ``d_ff``, or ``8/3 · d_model`` rounded up to a multiple of 8."""
        return self.d_ff if self.d_ff is not None else 8 * math.ceil(8 * self.d_model / 3 / 8)

    def score_mod(self):
        """The layers' score modification: ALiBi and/or soft-capping composed, or None."""
        mods = ([alibi(self.n_heads)] if self.position == "alibi" else [])
        mods += [softcap(self.attn_softcap)] if self.attn_softcap is not None else []
        if not mods:
            return None
        if len(mods) == 1:
            return mods[0]
        return lambda s, b, h, q, kv: mods[1](mods[0](s, b, h, q, kv), b, h, q, kv)  # ALiBi, then the cap

    @property
    def layer_attn_fn(self) -> str:
        """The attention function the layers use (``"eager"`` instead of SDPA when scores are modified)."""
        return "eager" if self.attn_fn == "sdpa" and self.score_mod() is not None else self.attn_fn

    def replace(self, **changes) -> ModernConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


class ModernBlock(Block):
    """Pre-norm block: ``x + attn(RMSNorm(x))``, then ``x + SwiGLU(RMSNorm(x))`` (:class:`~attnlib.model.Block`'s forward)."""

    def __init__(self, config: ModernConfig, rope: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        self.ln_1 = RMSNorm(config.d_model, config.norm_eps)  # transformers: input_layernorm
        self.attn = RotaryAttention(config.d_model, config.n_heads, config.kv_heads, block_size=config.block_size,
                                    dropout=config.dropout, bias=config.bias, attn_fn=config.layer_attn_fn,
                                    head_dim=config.head_size, rope=rope, qk_norm=config.qk_norm,
                                    norm_eps=config.norm_eps, sliding_window=config.sliding_window,
                                    rotary=config.position == "rope", score_mod=config.score_mod())
        self.ln_2 = RMSNorm(config.d_model, config.norm_eps)  # post_attention_layernorm
        self.mlp = SwiGLU(config.d_model, config.ff_width, bias=False, dropout=config.dropout)


class ModernDecoder(GPT):
    """A Llama / Qwen3-style decoder-only language model.

    Args:
        config: a :class:`ModernConfig`.

    Shapes and methods: as :class:`~attnlib.GPT`: ``forward(idx (B, T), targets=None, cache=None)``
    → ``(logits (B, T, vocab_size), loss)``; ``generate``, ``new_cache``, ``attention_weights``.

    Raises:
        TypeError: ``config`` is not a ModernConfig.
    """

    residual_projections = ("attn.out_proj.weight", "mlp.down.weight")

    def __init__(self, config: ModernConfig) -> None:
        nn.Module.__init__(self)
        if not isinstance(config, ModernConfig):
            raise TypeError(f"config must be an attnlib.ModernConfig; got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.position == "learned":
            self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.rope = (RotaryEmbedding(config.head_size, config.rope_base, config.rope_scaling, config.block_size)
                     if config.position == "rope" else None)  # other positions: none (any head width)
        self.blocks = nn.ModuleList(ModernBlock(config, self.rope) for _ in range(config.n_layers))
        self.ln_f = RMSNorm(config.d_model, config.norm_eps)  # transformers: model.norm
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied head counted once); ``exclude_embeddings`` leaves out the embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= sum(e.weight.numel() for e in (self.tok_emb, getattr(self, "pos_emb", None)) if e is not None)
        return n

    def embed(self, idx: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings (+ the learned position table with ``position="learned"``, at ``start, …`` or at
        per-row ``positions`` ``(B, T)``): ``(B, T, d_model)``. Other positions enter inside attention."""
        x = self.tok_emb(idx)
        if self.config.position == "learned":
            pos = torch.arange(start, start + idx.shape[1], device=idx.device) if positions is None else positions
            x = x + self.pos_emb(pos)
        return self.drop(x)
