"""The encoder–decoder Transformer of Vaswani et al. 2017, built from attnlib's pieces. Chapter 10.

- :class:`EncoderLayer`: self-attention (``MultiHeadAttention(causal=False)``, source padding masked)
  + the feed-forward block :class:`attnlib.layers.feedforward.FeedForward` (the GPT's too).
- :class:`DecoderLayer`: causal self-attention + cross-attention to the encoder output (the same
  ``MultiHeadAttention``, ``causal=False``, called with a context) + feed-forward.
- :class:`Transformer`: embeddings + sinusoidal positions, ``n_layers`` encoder layers **chained**
  (each reads the previous one's output), ``n_layers`` decoder layers chained, a linear head.
  ``forward`` is teacher-forced and returns logits and a loss (it never samples);
  :meth:`Transformer.greedy_decode` and :meth:`Transformer.beam_decode` generate, through the
  loops every decoder of the library shares (:mod:`attnlib.generation`).

Every residual block is either pre-LN (``norm_first=True``: ``x + f(norm(x))``, with a final
norm after the last layer) or post-LN (``norm_first=False``: ``norm(x + f(x))``, the 2017 paper).
"""
from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn

from attnlib._checks import cross_entropy_loss, divisible, eval_mode, positive_int, probability, token_ids
from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.generation.beam import beam_search
from attnlib.generation.checks import check_decoding, stop_mask
from attnlib.generation.generate import generate
from attnlib.layers.feedforward import FeedForward
from attnlib.layers.norms import LayerNorm
from attnlib.positional.absolute import SinusoidalPositionalEncoding

__all__ = ["DecoderLayer", "EncoderLayer", "FeedForward", "Transformer"]

StopTokens = int | Iterable[int] | torch.Tensor | None


class _Layer(nn.Module):
    """The sublayers of an encoder or decoder layer (the decoder's causal, with cross-attention), built in one place."""

    decoder = False

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
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, causal=self.decoder)
        if self.decoder:
            self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, causal=False)
        self.ff = FeedForward(d_model, d_ff, dropout, gelu_approximate)
        self.norm_1, self.norm_2 = LayerNorm(d_model), LayerNorm(d_model)
        if self.decoder:
            self.norm_3 = LayerNorm(d_model)


class EncoderLayer(_Layer):
    """One encoder layer: bidirectional self-attention, then feed-forward, each in a residual block.

    Args:
        d_model, n_heads, d_ff, dropout: sizes and dropout of the sublayers.
        norm_first: ``True`` = pre-LN ``x + f(LN(x))``; ``False`` = post-LN ``LN(x + f(x))``.
        gelu_approximate: passed to :class:`FeedForward`.

    Shapes:
        ``forward(x (B, T_src, d_model), attention_mask (B, T_src) bool, True = real token)`` → ``(B, T_src, d_model)``.
    """

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # padding keys are hidden from every query (True = real token)
        if self.norm_first:
            x = x + self.self_attn(self.norm_1(x), attention_mask=attention_mask)
            return x + self.ff(self.norm_2(x))
        x = self.norm_1(x + self.self_attn(x, attention_mask=attention_mask))
        return self.norm_2(x + self.ff(x))


class DecoderLayer(_Layer):
    """One decoder layer: causal self-attention, cross-attention to the encoder output, feed-forward.

    Args: as :class:`EncoderLayer`.

    Shapes:
        ``forward(x (B, T_tgt, d_model), memory (B, T_src, d_model), encoder_attention_mask (B, T_src))`` →
        ``(B, T_tgt, d_model)``.
        Target position ``t`` sees target positions ``<= t`` and every real source position.
    """

    decoder = True

    def forward(self, x: torch.Tensor, memory: torch.Tensor,
                encoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        pad = encoder_attention_mask  # the source's padding, hidden from every target query (True = real token)
        if self.norm_first:
            x = x + self.self_attn(self.norm_1(x))
            x = x + self.cross_attn(self.norm_2(x), memory, attention_mask=pad)  # queries x, keys/values memory
            return x + self.ff(self.norm_3(x))
        x = self.norm_1(x + self.self_attn(x))
        x = self.norm_2(x + self.cross_attn(x, memory, attention_mask=pad))
        return self.norm_3(x + self.ff(x))


class _BoundDecoder:
    """The decoder with one encoded source bound: a *decoder* for the loops of :mod:`attnlib.generation`.

    Called on the whole target prefix (it keeps no cache: ``new_cache()`` returns ``None``), it
    runs the decoder against the source memory, whose batch of one is repeated for every beam when
    beam search asks for more rows.
    """

    def __init__(self, model: Transformer, memory: torch.Tensor, encoder_attention_mask: torch.Tensor) -> None:
        self.model, self.memory, self.encoder_attention_mask = model, memory, encoder_attention_mask
        self.config = SimpleNamespace(vocab_size=model.tgt_emb.num_embeddings, block_size=model.block_size)

    def new_cache(self, windows: bool = True) -> None:
        return None

    def __call__(self, tokens: torch.Tensor, cache: None = None, attention_mask: None = None, positions: None = None,
                 last_only: bool = False) -> tuple[torch.Tensor, None]:
        memory, pad = self.memory, self.encoder_attention_mask
        if memory.shape[0] != tokens.shape[0]:  # one source, several beams
            memory = memory.expand(tokens.shape[0], -1, -1)  # (1, T_src, d_model) -> (n_beams, T_src, d_model)
            pad = pad.expand(tokens.shape[0], -1)  # (1, T_src) -> (n_beams, T_src)
        logits = self.model.decode(tokens, memory, pad)  # (n, T, tgt_vocab_size)
        return (logits[:, -1:] if last_only else logits), None


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
        block_size: longest source and longest target (including ``bos_id``) accepted.
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
        block_size: int = 64,
        dropout: float = 0.0,
        norm_first: bool = True,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        gelu_approximate: str = "none",
    ) -> None:
        super().__init__()
        for name, value in [("src_vocab_size", src_vocab_size), ("tgt_vocab_size", tgt_vocab_size),
                            ("d_model", d_model), ("n_heads", n_heads), ("n_layers", n_layers), ("block_size", block_size)]:
            positive_int(name, value)
        divisible("d_model", d_model, "n_heads", n_heads)
        d_ff = 4 * d_model if d_ff is None else d_ff
        positive_int("d_ff", d_ff)
        probability("dropout", dropout)
        for name, value in [("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)]:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < min(src_vocab_size, tgt_vocab_size):
                raise ValueError(f"{name}={value!r} must be an id in both vocabularies "
                                 f"(0 <= id < {min(src_vocab_size, tgt_vocab_size)})")
        self.d_model, self.block_size, self.norm_first = d_model, block_size, norm_first
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.src_emb = nn.Embedding(src_vocab_size, d_model)
        self.tgt_emb = nn.Embedding(tgt_vocab_size, d_model)
        for emb in (self.src_emb, self.tgt_emb):
            nn.init.normal_(emb.weight, std=d_model**-0.5)  # times sqrt(d_model) below: unit scale, like the positions
        self.pos = SinusoidalPositionalEncoding(d_model, block_size)
        self.dropout = nn.Dropout(dropout)
        layer_args = (d_model, n_heads, d_ff, dropout, norm_first, gelu_approximate)
        self.encoder = nn.ModuleList([EncoderLayer(*layer_args) for _ in range(n_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(*layer_args) for _ in range(n_layers)])
        self.enc_norm = LayerNorm(d_model) if norm_first else nn.Identity()
        self.dec_norm = LayerNorm(d_model) if norm_first else nn.Identity()
        self.lm_head = nn.Linear(d_model, tgt_vocab_size)

    def _tokens(self, name: str, idx: object, vocab_size: int) -> torch.Tensor:
        """Check ``idx`` (``(B, T)``, any integer dtype, ``1 <= T <= block_size``, ids in the vocabulary); return it as int64."""
        idx = token_ids(name, idx, vocab_size)
        if idx.shape[1] == 0:
            raise ValueError(f"{name} must hold at least one token per row; got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.block_size:
            raise ValueError(f"{name} has length {idx.shape[1]} > block_size={self.block_size}")
        return idx

    def embed(self, idx: torch.Tensor, emb: nn.Embedding) -> torch.Tensor:
        """Token embedding · sqrt(d_model) + sinusoidal positions: ``(B, T)`` → ``(B, T, d_model)``."""
        return self.dropout(self.pos(emb(idx) * self.d_model**0.5))

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the encoder stack.

        Args:
            src: ``(B, T_src)`` source ids, padded with ``pad_id``.

        Returns:
            ``(memory (B, T_src, d_model), attention_mask (B, T_src) bool)``, the mask True at real tokens.
        """
        src = self._tokens("src", src, self.src_emb.num_embeddings)
        attention_mask = src != self.pad_id  # (B, T_src)
        x = self.embed(src, self.src_emb)
        for layer in self.encoder:
            x = layer(x, attention_mask)  # chained: each layer reads the previous layer's output
        return self.enc_norm(x), attention_mask

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor,
               encoder_attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Run the decoder stack and the head: ``(B, T_tgt)`` ids → logits ``(B, T_tgt, tgt_vocab_size)``;
        ``encoder_attention_mask`` ``(B, T_src)`` hides the source's padding (True = a real token)."""
        tgt_in = self._tokens("tgt_in", tgt_in, self.tgt_emb.num_embeddings)
        y = self.embed(tgt_in, self.tgt_emb)
        for layer in self.decoder:
            y = layer(y, memory, encoder_attention_mask)  # chained, every layer reading the same final encoder output
        return self.lm_head(self.dec_norm(y))

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced pass: the decoder reads the true target prefix ``tgt_in``.

        Args:
            src: ``(B, T_src)`` source ids (padded with ``pad_id``), any integer dtype.
            tgt_in: ``(B, T_tgt)`` decoder input, usually ``[bos, y_1, …, y_{n-1}]``.
            targets: optional ``(B, T_tgt)`` next tokens ``[y_1, …, y_n]`` (usually ending in
                ``eos_id``); ``pad_id`` positions are ignored by the loss.

        Returns:
            ``(logits (B, T_tgt, tgt_vocab_size), loss)``: mean cross-entropy over the
            non-padding targets (``0.0``, not NaN, when every target is padding), or ``None`` without targets.

        Raises:
            TypeError / ValueError: ids of a bad dtype, shape or value (named), before any layer runs.
        """
        tgt_vocab = self.tgt_emb.num_embeddings
        if targets is not None:
            targets = token_ids("targets", targets, tgt_vocab)
            if targets.shape != getattr(tgt_in, "shape", None):
                raise ValueError(f"targets {tuple(targets.shape)} must have the shape of tgt_in "
                                 f"{tuple(getattr(tgt_in, 'shape', ()))}")
        tgt_in = self._tokens("tgt_in", tgt_in, tgt_vocab)
        memory, attention_mask = self.encode(src)
        logits = self.decode(tgt_in, memory, attention_mask)
        loss = None if targets is None else cross_entropy_loss(logits, targets, ignore_index=self.pad_id)
        return logits, loss

    def _decoding_setup(self, src: object, max_new_tokens: object, stop_tokens: StopTokens, **settings) -> tuple:
        """Check every decoding setting (before any layer runs), encode ``src``; return ``(decoder, start, stops)``."""
        stop_tokens = (self.eos_id,) if stop_tokens is None else stop_tokens
        stops = check_decoding(self.tgt_emb.num_embeddings, max_new_tokens, stop_tokens=stop_tokens, **settings)
        if max_new_tokens + 1 > self.block_size:
            raise ValueError(f"max_new_tokens={max_new_tokens} + 1 (bos) exceeds the model's block_size={self.block_size}")
        memory, attention_mask = self.encode(src)
        start = torch.full((memory.shape[0], 1), self.bos_id, dtype=torch.long, device=memory.device)
        return _BoundDecoder(self, memory, attention_mask), start, stops

    @torch.no_grad()
    def greedy_decode(self, src: torch.Tensor, max_new_tokens: int, stop_tokens: StopTokens = None) -> torch.Tensor:
        """Decode by taking the most likely token at each step (the loop of :func:`attnlib.generation.generate`).

        Args:
            src: ``(B, T_src)`` source ids.
            max_new_tokens: most tokens to generate after ``bos_id`` (>= 0; ``1 + max_new_tokens <= self.block_size``).
            stop_tokens: ids that end a row (default ``(eos_id,)``).

        Returns:
            ``(B, 1 + n)`` ids starting with ``bos_id``; ``n <= max_new_tokens`` (decoding stops once
            every row has produced a stop token); positions after a row's stop token hold ``pad_id``.

        Raises:
            TypeError / ValueError: a bad source, ``max_new_tokens`` or stop token, before any layer runs.
        """
        with eval_mode(self):
            decoder, start, stops = self._decoding_setup(src, max_new_tokens, stop_tokens)
            return generate(decoder, start, max_new_tokens, temperature=0.0, use_cache=False, stop_tokens=stops,
                            pad_id=self.pad_id)

    @torch.no_grad()
    def beam_decode(
        self,
        src: torch.Tensor,
        beam_width: int = 4,
        max_new_tokens: int = 32,
        length_penalty: float = 0.0,
        stop_tokens: StopTokens = None,
    ) -> tuple[torch.Tensor, float]:
        """Decode one source with :func:`attnlib.generation.beam_search` (chapter 08).

        Args:
            src: ``(1, T_src)`` source ids (a single source).
            beam_width: beams kept; 1 gives :meth:`greedy_decode`'s output.
            max_new_tokens: most tokens to generate after ``bos_id``.
            length_penalty: see :func:`attnlib.generation.beam_search`.
            stop_tokens: ids that finish a beam (default ``(eos_id,)``).

        Returns:
            ``(tokens (1, 1 + n), score)`` in the format of :meth:`greedy_decode` (cut after the
            first stop token) and the total log-probability of the tokens after ``bos_id``.

        Raises:
            TypeError / ValueError: more than one source, a bad setting, ``max_new_tokens`` too long.
        """
        if isinstance(src, torch.Tensor) and (src.dim() != 2 or src.shape[0] != 1):
            raise ValueError(f"beam_decode takes one source of shape (1, T_src); got {tuple(src.shape)}: loop over a batch")
        with eval_mode(self):
            decoder, start, stops = self._decoding_setup(src, max_new_tokens, stop_tokens, beam_width=beam_width,
                                                         length_penalty=length_penalty)
            tokens, score = beam_search(decoder, start, max_new_tokens, beam_width=beam_width, stop_tokens=stops,
                                        length_penalty=length_penalty, use_cache=False)
        ended = stop_mask(tokens[0, 1:], stops).nonzero()
        if len(ended):
            tokens = tokens[:, : int(ended[0]) + 2]  # keep bos ... the first stop token
        return tokens, score
