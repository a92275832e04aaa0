"""A decoder-only GPT assembled from attnlib's pieces (chapter 12).

Token + learned position embeddings, ``n_layers`` pre-LN blocks (attention from
:data:`attnlib.attention.ATTENTION_REGISTRY`, then a GELU MLP), a final
LayerNorm, and an output head tied to the token embedding. GPT-2 (Radford et al.
2019) layout and initialisation.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlib.attention import ATTENTION_REGISTRY
from attnlib.config import GPTConfig
from attnlib.generate import sample_next_token

__all__ = ["GPT", "Block", "MLP"]


class MLP(nn.Module):
    """Position-wise feed-forward network: ``d_model → 4·d_model → GELU → d_model``.

    Shapes: ``(B, T, d_model)`` → ``(B, T, d_model)``. Vaswani et al. 2017, §3.3.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN Transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    Shapes: ``(B, T, d_model)`` → ``(B, T, d_model)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = ATTENTION_REGISTRY[config.attention](config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


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

    def check_idx(self, idx: object, name: str = "idx") -> None:
        """Raise TypeError/ValueError unless ``idx`` is an int64-like (B, T) tensor of valid token ids."""
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of token ids; got {type(idx).__name__}")
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids (torch.long); got dtype {idx.dtype}")
        if idx.dim() != 2:
            raise ValueError(f"{name} must have shape (B, T); got {tuple(idx.shape)}")
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length T={idx.shape[1]} exceeds block_size={self.config.block_size}")
        if idx.numel() and ((idx < 0) | (idx >= self.config.vocab_size)).any():
            bad = idx[(idx < 0) | (idx >= self.config.vocab_size)][0].item()
            raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {self.config.vocab_size})")

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits, and the cross-entropy loss when targets are given.

        Args:
            idx: ``(B, T)`` integer token ids, ``T <= block_size``.
            targets: optional ``(B, T)`` integer ids of the next tokens.

        Returns:
            ``(logits, loss)``: logits ``(B, T, vocab_size)`` float; loss a scalar
            (mean cross-entropy in nats per token) or ``None``.

        Raises:
            TypeError: ``idx`` / ``targets`` not an integer tensor.
            ValueError: wrong shape, ``T > block_size``, or an id outside the vocabulary.
        """
        self.check_idx(idx)
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, d_model) + (T, d_model) -> (B, T, d_model)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, d_model) -> (B, T, vocab_size)

        loss = None
        if targets is not None:
            self.check_idx(targets, "targets")
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}; got {tuple(targets.shape)}")
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``idx`` by ``max_new_tokens`` tokens, one at a time.

        The model sees at most the last ``block_size`` tokens: a longer context is
        cropped from the left before each step (the returned tensor keeps it all).

        Args:
            idx: ``(B, T)`` integer prompt (T >= 1).
            max_new_tokens: how many tokens to add (>= 0).
            temperature: ``0`` = greedy; higher = more random.
            top_k, top_p: optional filters, see :func:`attnlib.generate.sample_next_token`.
            generator: ``torch.Generator`` for reproducible samples.

        Returns:
            ``(B, T + max_new_tokens)`` int64.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
        if isinstance(idx, torch.Tensor) and idx.dim() == 2 and idx.shape[1] == 0:
            raise ValueError("idx must hold at least one prompt token per row; got T=0")
        self.check_idx(idx[:, -self.config.block_size :] if isinstance(idx, torch.Tensor) and idx.dim() == 2 else idx)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.config.block_size :])
                next_id = sample_next_token(logits[:, -1, :], temperature, top_k, top_p, generator)
                idx = torch.cat([idx, next_id], dim=1)  # (B, T) -> (B, T + 1)
        finally:
            self.train(was_training)
        return idx
