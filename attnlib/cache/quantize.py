"""Quantising cached keys and values: symmetric int8, asymmetric low-bit groups, and bit packing. Chapter 19.

The quantised caches of :mod:`attnlib.cache.quantized` store each key and value as a small integer
``q`` and read it back as ``x̂ = q · scale`` (symmetric, :func:`quantize_absmax`) or
``x̂ = q · scale + zero`` (asymmetric, :func:`quantize_minmax`), with one scale (and zero point) per
group of numbers. Rounding to the nearest level bounds the error of every number by half a step:

* absmax, ``bits`` = 8: ``scale = max|x| / 127`` over the group, ``|x - x̂| <= scale / 2``;
* min-max, ``bits`` = b: ``scale = (max - min) / (2^b - 1)``, ``zero = min``, ``|x - x̂| <= scale / 2``
  (KIVI, Liu et al. 2024, §3; the usual asymmetric quantiser of integer inference, Jacob et al. 2018).

:func:`pack_bits` stores ``8 // bits`` codes of ``bits`` < 8 bits in each byte (the first code in the low
bits), so a 4-bit cache really takes half a byte a number; :func:`unpack_bits` reverses it exactly.

Scales and zero points keep the dtype of the tensor quantised (the model's); the arithmetic is float32
(float64 for a float64 tensor).
"""
from __future__ import annotations

import torch

__all__ = ["dequantize_absmax", "dequantize_minmax", "pack_bits", "quantize_absmax", "quantize_minmax", "unpack_bits"]


def _floating(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x


def _bits(bits: object, allowed: tuple[int, ...]) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise ValueError(f"bits must be one of {allowed}; got {bits!r}")
    return bits


def _work(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype the arithmetic is done in: float64 stays, anything else float32."""
    return x if x.dtype == torch.float64 else x.float()


def quantize_absmax(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantisation with one scale per slice along ``dim`` (no zero point).

    Args:
        x: a floating tensor, any shape.
        dim: the axis each scale covers (``-1``: a token's ``head_dim`` numbers in one head).

    Returns:
        ``(codes, scale)``: ``codes`` int8 in ``[-127, 127]``, the shape of ``x``; ``scale`` in ``x``'s dtype,
        the shape of ``x`` with ``dim`` of size 1 (``max |x| / 127``; a slice of zeros has scale 0, codes 0).

    Raises:
        TypeError: ``x`` not a floating tensor.
    """
    w = _work(_floating("x", x))
    scale = (w.abs().amax(dim, keepdim=True) / 127).to(x.dtype)  # stored as the model's dtype
    s = _work(scale)
    codes = torch.where(s > 0, w / torch.where(s > 0, s, 1), 0).round().clamp(-127, 127)
    return codes.to(torch.int8), scale


def dequantize_absmax(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``codes · scale`` in ``dtype`` (default: the scale's): the inverse of :func:`quantize_absmax`."""
    return (_work(scale) * codes).to(dtype or scale.dtype)


def quantize_minmax(x: torch.Tensor, bits: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit quantisation with a scale and a zero point per slice along ``dim`` (KIVI, §3.1).

    Args:
        x: a floating tensor, any shape.
        bits: 1 to 8: levels ``0 … 2^bits - 1``.
        dim: the axis each scale covers (KIVI: the tokens of a group for keys, a token's channels for values).

    Returns:
        ``(codes, scale, zero)``: ``codes`` uint8 in ``[0, 2^bits - 1]``, the shape of ``x``; ``scale``
        ``(max - min) / (2^bits - 1)`` and ``zero = min``, in ``x``'s dtype, with ``dim`` of size 1. A constant
        slice has scale 0 and is read back exactly.

    Raises:
        TypeError: ``x`` not a floating tensor. ValueError: ``bits`` not an int in 1..8.
    """
    _bits(bits, tuple(range(1, 9)))
    w = _work(_floating("x", x))
    levels = 2**bits - 1
    zero = w.amin(dim, keepdim=True).to(x.dtype)
    scale = ((w.amax(dim, keepdim=True) - _work(zero)) / levels).to(x.dtype)
    s = _work(scale)
    codes = torch.where(s > 0, (w - _work(zero)) / torch.where(s > 0, s, 1), 0).round().clamp(0, levels)
    return codes.to(torch.uint8), scale, zero


def dequantize_minmax(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """``codes · scale + zero`` in ``dtype`` (default: the scale's): the inverse of :func:`quantize_minmax`."""
    return (_work(scale) * codes + _work(zero)).to(dtype or scale.dtype)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)  # where each code of a byte starts


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``8 // bits`` codes of ``bits`` bits into each byte along the last axis (the first in the low bits).

    Shapes: ``(..., n)`` uint8 codes below ``2^bits`` → ``(..., n · bits / 8)`` uint8.

    Raises:
        TypeError: ``codes`` not a uint8 tensor. ValueError: ``bits`` not 1, 2, 4 or 8; ``n`` not a multiple of
            ``8 // bits``; a code of ``2^bits`` or more.
    """
    _bits(bits, (1, 2, 4, 8))
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor; got {getattr(codes, 'dtype', type(codes).__name__)}")
    per = 8 // bits
    if codes.dim() == 0 or codes.shape[-1] % per:
        raise ValueError(f"codes' last axis ({tuple(codes.shape)}) must be a multiple of {per} to pack {bits}-bit codes")
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"codes hold {int(codes.max())}, which does not fit in bits={bits}")
    if bits == 8:
        return codes.clone()
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    return torch.bitwise_left_shift(grouped, _shifts(bits, codes.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes :func:`pack_bits` packed: ``(..., m)`` uint8 → ``(..., m · 8 / bits)`` uint8.

    Raises:
        TypeError: ``packed`` not a uint8 tensor. ValueError: ``bits`` not 1, 2, 4 or 8.
    """
    _bits(bits, (1, 2, 4, 8))
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor; got {getattr(packed, 'dtype', type(packed).__name__)}")
    if bits == 8:
        return packed.clone()
    codes = torch.bitwise_right_shift(packed[..., None], _shifts(bits, packed.device)) & (2**bits - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))
