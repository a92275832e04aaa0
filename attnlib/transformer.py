"""The encoder–decoder Transformer of Vaswani et al. 2017, built from attnlib's pieces. Chapter 10.

- :class:`FeedForward`: the position-wise two-layer network with GELU (Hendrycks & Gimpel 2016).
- :class:`EncoderLayer`: self-attention (no causal mask, source padding masked) + feed-forward.
- :class:`DecoderLayer`: causal self-attention + cross-attention to the encoder output + feed-forward.
- :class:`Transformer`: embeddings + sinusoidal positions, ``n_layers`` encoder layers **chained**
  (each reads the previous one's output), ``n_layers`` decoder layers chained, a linear head.
  ``forward`` is teacher-forced and returns logits and a loss (it never samples);
  :meth:`Transformer.greedy_decode` and :meth:`Transformer.beam_decode` generate.

Every residual block is either pre-LN (``norm_first=True``: ``x + f(norm(x))``, with a final
norm after the last layer) or post-LN (``norm_first=False``: ``norm(x + f(x))``, the 2017 paper).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import divisible, positive_int, probability
from attnlib.attention.cross import CrossAttention
from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.generate import beam_search
from attnlib.norms import LayerNorm
from attnlib.positional import SinusoidalPositionalEncoding

__all__ = ["DecoderLayer", "EncoderLayer", "FeedForward", "Transformer"]

GELU_APPROXIMATIONS = ("none", "tanh")


class FeedForward(nn.Module):
    """``dropout(W_2 · GELU(W_1 x + b_1) + b_2)``, applied to every position alone (Vaswani et al. 2017, §3.3).

    Args:
        d_model: input and output width.
        d_ff: hidden width (usually ``4 * d_model``).
        dropout: dropout on the output (training only).
        gelu_approximate: ``"none"`` (exact, ``x Φ(x)``) or ``"tanh"`` (the tanh approximation of GPT-2),
            as in ``nn.GELU(approximate=...)``.
        bias: biases on both linear layers.

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, d_model)``.

    Raises:
        ValueError / TypeError: bad sizes, dropout outside [0, 1), an unknown approximation.
    """

    def __init__(
        self, d_model: int, d_ff: int, dropout: float = 0.0, gelu_approximate: str = "none", bias: bool = True
    ) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("d_ff", d_ff)
        probability("dropout", dropout)
        if gelu_approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"gelu_approximate={gelu_approximate!r} is not one of {GELU_APPROXIMATIONS}")
        self.fc_in = nn.Linear(d_model, d_ff, bias=bias)
        self.act = nn.GELU(approximate=gelu_approximate)
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))  # (B, T, d_model) -> (B, T, d_ff) -> (B, T, d_model)


def _key_mask(src_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``(B, T_k)`` real-position mask → ``(B, 1, 1, T_k)``, broadcast over heads and queries."""
    return None if src_mask is None else src_mask[:, None, None, :]


class EncoderLayer(nn.Module):
    """One encoder layer: bidirectional self-attention, then feed-forward, each in a residual block.

    Args:
        d_model, n_heads, d_ff, dropout: sizes and dropout of the sublayers.
        norm_first: ``True`` = pre-LN ``x + f(LN(x))``; ``False`` = post-LN ``LN(x + f(x))``.
        gelu_approximate: passed to :class:`FeedForward`.

    Shapes:
        ``forward(x (B, T_src, d_model), src_mask (B, T_src) bool, True = real token)`` → ``(B, T_src, d_model)``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        norm_first: bool = True,
        gelu_approximate: str = "none",
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, causal=False)
        self.ff = FeedForward(d_model, d_ff, dropout, gelu_approximate)
        self.norm_1, self.norm_2 = LayerNorm(d_model), LayerNorm(d_model)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = _key_mask(src_mask)  # padding keys hidden from every query
        if self.norm_first:
            x = x + self.self_attn(self.norm_1(x), mask=mask)
            return x + self.ff(self.norm_2(x))
        x = self.norm_1(x + self.self_attn(x, mask=mask))
        return self.norm_2(x + self.ff(x))


class DecoderLayer(nn.Module):
    """One decoder layer: causal self-attention, cross-attention to the encoder output, feed-forward.

    Args: as :class:`EncoderLayer`.

    Shapes:
        ``forward(x (B, T_tgt, d_model), memory (B, T_src, d_model), src_mask (B, T_src))`` → ``(B, T_tgt, d_model)``.
        Target position ``t`` sees target positions ``<= t`` and every real source position.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        norm_first: bool = True,
        gelu_approximate: str = "none",
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, causal=True)
        self.cross_attn = CrossAttention(d_model, n_heads, dropout=dropout)
        self.ff = FeedForward(d_model, d_ff, dropout, gelu_approximate)
        self.norm_1, self.norm_2, self.norm_3 = LayerNorm(d_model), LayerNorm(d_model), LayerNorm(d_model)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_first:
            x = x + self.self_attn(self.norm_1(x))
            x = x + self.cross_attn(self.norm_2(x), memory, key_padding_mask=src_mask)
            return x + self.ff(self.norm_3(x))
        x = self.norm_1(x + self.self_attn(x))
        x = self.norm_2(x + self.cross_attn(x, memory, key_padding_mask=src_mask))
        return self.norm_3(x + self.ff(x))


class _BoundDecoder:
    """The decoder with one encoded source bound: the interface :func:`attnlib.generate.beam_search` needs.

    ``next_token_logits(tokens (n_beams, T), cache, n_new)`` reruns the decoder on the whole
    target prefix (no cache: ``new_cache()`` returns ``None``) against the source memory
    repeated for every beam.
    """

    def __init__(self, model: Transformer, memory: torch.Tensor, src_mask: torch.Tensor) -> None:
        self.model, self.memory, self.src_mask = model, memory, src_mask

    @property
    def training(self) -> bool:
        return self.model.training

    def eval(self) -> _BoundDecoder:
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> _BoundDecoder:
        self.model.train(mode)
        return self

    def new_cache(self) -> None:
        return None

    def next_token_logits(self, tokens: torch.Tensor, cache: None, n_new: int) -> tuple[torch.Tensor, None]:
        n_beams = tokens.shape[0]
        memory = self.memory.expand(n_beams, -1, -1)  # (1, T_src, d_model) -> (n_beams, T_src, d_model)
        src_mask = self.src_mask.expand(n_beams, -1)  # (1, T_src) -> (n_beams, T_src)
        return self.model.decode(tokens, memory, src_mask)[:, -1], None  # (n_beams, tgt_vocab_size)


class Transformer(nn.Module):
    """An encoder–decoder Transformer for sequence-to-sequence tasks (Vaswani et al. 2017).

    Source and target tokens are embedded (scaled by ``sqrt(d_model)``, §3.4) and get sinusoidal
    positions; the encoder's layers are applied one after the other, the decoder's likewise,
    every decoder layer reading the final encoder output (``memory``).

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes (may differ).
        d_model: width; n_heads: heads per attention layer.
        n_layers: layers in the encoder, and again in the decoder.
        d_ff: feed-forward hidden width (default ``4 * d_model``).
        max_len: longest source and longest target (including ``bos_id``) accepted.
        dropout: dropout everywhere (training only).
        norm_first: pre-LN (``True``, with a final LayerNorm on each stack) or post-LN (``False``).
        pad_id: padding id in both vocabularies: source padding is masked out of every
            attention, target padding is ignored by the loss.
        bos_id, eos_id: target ids that start and end an output.
        gelu_approximate: passed to :class:`FeedForward`.

    Raises:
        ValueError / TypeError: bad sizes, ``d_model`` not divisible by ``n_heads`` or odd,
            special ids outside the vocabularies.
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        d_ff: int | None = None,
        max_len: int = 64,
        dropout: float = 0.0,
        norm_first: bool = True,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        gelu_approximate: str = "none",
    ) -> None:
        super().__init__()
        for name, value in [("src_vocab_size", src_vocab_size), ("tgt_vocab_size", tgt_vocab_size),
                            ("d_model", d_model), ("n_heads", n_heads), ("n_layers", n_layers), ("max_len", max_len)]:
            positive_int(name, value)
        divisible("d_model", d_model, "n_heads", n_heads)
        d_ff = 4 * d_model if d_ff is None else d_ff
        positive_int("d_ff", d_ff)
        probability("dropout", dropout)
        for name, value in [("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)]:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < min(src_vocab_size, tgt_vocab_size):
                raise ValueError(f"{name}={value!r} must be an id in both vocabularies "
                                 f"(0 <= id < {min(src_vocab_size, tgt_vocab_size)})")
        self.d_model, self.max_len, self.norm_first = d_model, max_len, norm_first
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.src_emb = nn.Embedding(src_vocab_size, d_model)
        self.tgt_emb = nn.Embedding(tgt_vocab_size, d_model)
        for emb in (self.src_emb, self.tgt_emb):
            nn.init.normal_(emb.weight, std=d_model**-0.5)  # times sqrt(d_model) below: unit scale, like the positions
        self.pos = SinusoidalPositionalEncoding(d_model, max_len)
        self.dropout = nn.Dropout(dropout)
        layer_args = (d_model, n_heads, d_ff, dropout, norm_first, gelu_approximate)
        self.encoder = nn.ModuleList([EncoderLayer(*layer_args) for _ in range(n_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(*layer_args) for _ in range(n_layers)])
        self.enc_norm = LayerNorm(d_model) if norm_first else nn.Identity()
        self.dec_norm = LayerNorm(d_model) if norm_first else nn.Identity()
        self.lm_head = nn.Linear(d_model, tgt_vocab_size)

    def _tokens(self, name: str, idx: torch.Tensor, vocab_size: int) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.long, torch.int, torch.int16, torch.uint8):
            raise TypeError(f"{name} must be an integer tensor of shape (B, T)")
        if idx.dim() != 2:
            raise ValueError(f"{name} must have shape (B, T); got {tuple(idx.shape)}")
        if idx.shape[1] > self.max_len:
            raise ValueError(f"{name} has length {idx.shape[1]} > max_len={self.max_len}")
        if idx.numel() and (idx.min() < 0 or idx.max() >= vocab_size):
            raise ValueError(f"{name} has ids outside [0, {vocab_size})")

    def embed(self, idx: torch.Tensor, emb: nn.Embedding) -> torch.Tensor:
        """Token embedding · sqrt(d_model) + sinusoidal positions: ``(B, T)`` → ``(B, T, d_model)``."""
        return self.dropout(self.pos(emb(idx) * self.d_model**0.5))

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the encoder stack.

        Args:
            src: ``(B, T_src)`` source ids, padded with ``pad_id``.

        Returns:
            ``(memory (B, T_src, d_model), src_mask (B, T_src) bool)``, ``src_mask`` True at real tokens.
        """
        self._tokens("src", src, self.src_emb.num_embeddings)
        src_mask = src != self.pad_id  # (B, T_src)
        x = self.embed(src, self.src_emb)
        for layer in self.encoder:
            x = layer(x, src_mask)  # chained: each layer reads the previous layer's output
        return self.enc_norm(x), src_mask

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor | None) -> torch.Tensor:
        """Run the decoder stack and the head: ``(B, T_tgt)`` ids → logits ``(B, T_tgt, tgt_vocab_size)``."""
        self._tokens("tgt_in", tgt_in, self.tgt_emb.num_embeddings)
        y = self.embed(tgt_in, self.tgt_emb)
        for layer in self.decoder:
            y = layer(y, memory, src_mask)  # chained, every layer reading the same final encoder output
        return self.lm_head(self.dec_norm(y))

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced pass: the decoder reads the true target prefix ``tgt_in``.

        Args:
            src: ``(B, T_src)`` source ids (padded with ``pad_id``).
            tgt_in: ``(B, T_tgt)`` decoder input, usually ``[bos, y_1, …, y_{n-1}]``.
            targets: optional ``(B, T_tgt)`` next tokens ``[y_1, …, y_n]`` (usually ending in
                ``eos_id``); ``pad_id`` positions are ignored by the loss.

        Returns:
            ``(logits (B, T_tgt, tgt_vocab_size), loss)``: mean cross-entropy over the
            non-padding targets, or ``None`` without targets.
        """
        memory, src_mask = self.encode(src)
        logits = self.decode(tgt_in, memory, src_mask)
        loss = None
        if targets is not None:
            if targets.shape != tgt_in.shape:
                raise ValueError(f"targets {tuple(targets.shape)} must have the shape of tgt_in {tuple(tgt_in.shape)}")
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=self.pad_id)
        return logits, loss

    @torch.no_grad()
    def greedy_decode(self, src: torch.Tensor, max_len: int) -> torch.Tensor:
        """Decode by taking the most likely token at each step.

        Args:
            src: ``(B, T_src)`` source ids.
            max_len: most tokens to generate after ``bos_id`` (``1 + max_len <= self.max_len``).

        Returns:
            ``(B, 1 + n)`` ids starting with ``bos_id``; ``n <= max_len`` (decoding stops once
            every row has produced ``eos_id``); positions after a row's ``eos_id`` hold ``pad_id``.
        """
        positive_int("max_len", max_len)
        if max_len + 1 > self.max_len:
            raise ValueError(f"max_len={max_len} + 1 (bos) exceeds the model's max_len={self.max_len}")
        was_training = self.training
        self.eval()
        try:
            memory, src_mask = self.encode(src)
            out = torch.full((src.shape[0], 1), self.bos_id, dtype=torch.long, device=src.device)
            done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
            for _ in range(max_len):
                next_id = self.decode(out, memory, src_mask)[:, -1].argmax(dim=-1)  # (B,)
                next_id = torch.where(done, torch.full_like(next_id, self.pad_id), next_id)
                out = torch.cat([out, next_id[:, None]], dim=1)
                done |= next_id == self.eos_id
                if done.all():
                    break
        finally:
            self.train(was_training)
        return out

    @torch.no_grad()
    def beam_decode(
        self, src: torch.Tensor, beam_width: int = 4, max_len: int = 32, length_penalty: float = 0.0
    ) -> tuple[torch.Tensor, float]:
        """Decode one source with :func:`attnlib.generate.beam_search` (chapter 08).

        Args:
            src: ``(1, T_src)`` source ids (a single source).
            beam_width: beams kept; 1 gives :meth:`greedy_decode`'s output.
            max_len: most tokens to generate after ``bos_id``.
            length_penalty: see :func:`attnlib.generate.beam_search`.

        Returns:
            ``(tokens (1, 1 + n), score)`` in the format of :meth:`greedy_decode` (cut after the
            first ``eos_id``) and the total log-probability of the tokens after ``bos_id``.

        Raises:
            ValueError: more than one source, or ``max_len`` too long.
        """
        if not isinstance(src, torch.Tensor) or src.dim() != 2 or src.shape[0] != 1:
            raise ValueError("beam_decode takes one source of shape (1, T_src); loop over a batch")
        positive_int("max_len", max_len)
        if max_len + 1 > self.max_len:
            raise ValueError(f"max_len={max_len} + 1 (bos) exceeds the model's max_len={self.max_len}")
        was_training = self.training
        self.eval()
        try:
            memory, src_mask = self.encode(src)
        finally:
            self.train(was_training)
        start = torch.full((1, 1), self.bos_id, dtype=torch.long, device=src.device)
        tokens, score = beam_search(_BoundDecoder(self, memory, src_mask), start, max_len, beam_width=beam_width,
                                    stop_tokens=[self.eos_id], length_penalty=length_penalty, use_cache=False)
        eos = (tokens[0, 1:] == self.eos_id).nonzero()
        if len(eos):
            tokens = tokens[:, : int(eos[0]) + 2]  # keep bos ... eos
        return tokens, score
