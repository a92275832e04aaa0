"""Argument checks shared by the library: bad input fails early, naming the value."""
from __future__ import annotations

import torch


def positive_int(name: str, value: object) -> None:
    """Raise TypeError unless ``value`` is an int, ValueError unless it is positive."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer")


def probability(name: str, value: object) -> None:
    """Raise unless ``value`` is a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float; got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value} must be in [0, 1)")


def divisible(name: str, value: int, by_name: str, by: int) -> None:
    """Raise ValueError unless ``by`` divides ``value``."""
    if value % by:
        raise ValueError(f"{name}={value} is not divisible by {by_name}={by}")


def float_input(x: object, d_model: int, block_size: int | None = None) -> None:
    """Raise unless ``x`` is a float tensor of shape ``(..., T, d_model)`` with ``T <= block_size``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of shape (B, T, d_model); got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating point input; got dtype {x.dtype}")
    if x.dim() < 2 or x.shape[-1] != d_model:
        raise ValueError(f"expected input of shape (B, T, d_model={d_model}); got {tuple(x.shape)}")
    if block_size is not None and x.shape[-2] > block_size:
        raise ValueError(f"sequence length T={x.shape[-2]} exceeds block_size={block_size}")
