"""Absolute positions added to the token embeddings. Chapter 10.

- :func:`sinusoidal_encoding` / :class:`SinusoidalPositionalEncoding`: a fixed table of
  sines and cosines (Vaswani et al. 2017, §3.5);
- :class:`LearnedPositionalEmbedding`: one trained vector per position (as in GPT-2).

Rotary positions, applied inside attention instead: :mod:`attnlib.positional.rotary`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib._checks import finite_number, float_input, positive_int

__all__ = ["LearnedPositionalEmbedding", "SinusoidalPositionalEncoding", "even", "sinusoidal_encoding"]


def even(name: str, value: int) -> None:
    positive_int(name, value)
    if value % 2:
        raise ValueError(f"{name}={value} must be even (dimensions are used in pairs)")


def sinusoidal_encoding(T: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """The sinusoidal position table of Vaswani et al. 2017, §3.5.

    ``PE[pos, 2i] = sin(pos / base^(2i / d_model))`` and ``PE[pos, 2i+1] = cos(pos / base^(2i / d_model))``:
    pair ``i`` turns at frequency ``base^(-2i/d_model)``, from one radian per position (i = 0)
    down to about ``1 / base``.

    Args:
        T: number of positions (>= 1).
        d_model: width (even).
        base: the wavelength scale (10000 in the paper).

    Returns:
        ``(T, d_model)`` float32 tensor.

    Raises:
        TypeError / ValueError: ``T`` not a positive int, ``d_model`` not a positive even int, ``base`` not a
            finite number > 1 (as :class:`~attnlib.positional.RotaryEmbedding`'s).
    """
    positive_int("T", T)
    even("d_model", d_model)
    finite_number("base", base, above=1)
    position = torch.arange(T, dtype=torch.float32)[:, None]  # (T, 1)
    freq = torch.exp(-math.log(base) * torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)  # (d_model/2,)
    angle = position * freq  # (T, 1) * (d_model/2,) -> (T, d_model/2)
    pe = torch.empty(T, d_model)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed :func:`sinusoidal_encoding` table to its input. No parameters.

    Args:
        d_model: width (even).
        block_size: longest sequence accepted.

    Shapes:
        ``forward(x (B, T, d_model))`` → ``(B, T, d_model)``, ``x + PE[:T]``.

    Raises:
        ValueError: ``T > block_size`` or a wrong width.
    """

    def __init__(self, d_model: int, block_size: int) -> None:
        super().__init__()
        positive_int("block_size", block_size)
        self.d_model, self.block_size = d_model, block_size
        self.register_buffer("pe", sinusoidal_encoding(block_size, d_model), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + PE[:T]`` for ``x`` of shape ``(B, T, d_model)``."""
        float_input(x, self.d_model, self.block_size)
        return x + self.pe[: x.shape[-2]].to(x.dtype)  # (T, d_model) broadcast over B


class LearnedPositionalEmbedding(nn.Module):
    """Adds a trained vector per position, ``x + P[:T]`` (``P`` an ``nn.Embedding(block_size, d_model)``).

    Args:
        block_size: number of positions (the longest sequence accepted).
        d_model: width.

    Shapes:
        ``forward(x (B, T, d_model))`` → ``(B, T, d_model)``.

    Raises:
        ValueError: ``T > block_size`` or a wrong width.
    """

    def __init__(self, block_size: int, d_model: int) -> None:
        super().__init__()
        positive_int("block_size", block_size)
        positive_int("d_model", d_model)
        self.d_model, self.block_size = d_model, block_size
        self.weight = nn.Embedding(block_size, d_model)
        nn.init.normal_(self.weight.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + P[:T]`` for ``x`` of shape ``(B, T, d_model)``."""
        float_input(x, self.d_model, self.block_size)
        positions = torch.arange(x.shape[-2], device=x.device)
        return x + self.weight(positions)  # (T, d_model) broadcast over B


