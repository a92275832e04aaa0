"""Quantised KV caches: int8 per token and head, and KIVI's 4- and 2-bit groups. Chapter 19.

A cache in fewer bits holds more tokens (or more sequences) in the same memory. Both caches here keep
every position, like :class:`~attnlib.cache.LayerCache`, but store keys and values as small integers
with scales (:mod:`attnlib.cache.quantize`) and dequantise what attention reads, at every
:meth:`~attnlib.cache.LayerCache.update`, to the dtype of the keys and values given:

* :class:`Int8LayerCache`: int8, symmetric (absmax), one scale per (token, head): the int8 KV cache of
  serving engines (vLLM, TensorRT-LLM). Keys and values of a token are roughly centred, and int8's 255
  levels leave a zero point little to win, so there is none (it would cost as much memory as the scale).
* :class:`KIVILayerCache`: KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
  KV Cache", ICML 2024, §3-4): keys quantised *per channel* over groups of ``group_size`` tokens (a
  key's outlier channels then get their own scale), values *per token*, both asymmetric (scale + zero
  point) in ``bits`` = 4 or 2, codes packed into bytes; the most recent tokens stay in full precision
  (the *residual*): at least ``residual_length`` of them, and the tokens of a group that has not filled.

The positions an update adds are returned as given (attention within one forward pass is exact, as in
vLLM and ``transformers``' ``QuantizedCache``); what later tokens read is what was stored. Every layer of
a model gets one with :meth:`attnlib.cache.KVCache.quantized` (:func:`quantized_layers`).
"""
from __future__ import annotations

import torch

from attnlib._checks import non_negative_int, positive_int
from attnlib.cache.layer import LayerCache
from attnlib.cache.quantize import (
    dequantize_absmax,
    dequantize_minmax,
    pack_bits,
    quantize_absmax,
    quantize_minmax,
    unpack_bits,
)
from attnlib.cache.shared import kv_sources, link_shared

__all__ = ["SCHEMES", "Int8LayerCache", "KIVILayerCache", "quantized_layers"]

#: The schemes of :func:`quantized_layers`: ``"int8"`` (:class:`Int8LayerCache`), ``"kivi4"`` and ``"kivi2"``
#: (:class:`KIVILayerCache` with ``bits`` 4 and 2).
SCHEMES = ("int8", "kivi4", "kivi2")


class _QuantizedCache(LayerCache):
    """What both quantised caches check: two tensors, keys and values ``(B, n_kv_heads, T_new, head_dim)``."""

    def check_new(self, new: tuple[torch.Tensor, ...]) -> int:
        if len(new) != 2 or any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in new):
            raise ValueError(f"{type(self).__name__} caches keys and values (B, n_kv_heads, T_new, head_dim); got "
                             f"{len(new)} tensors of shapes {[tuple(getattr(t, 'shape', ())) for t in new]}")
        if not all(t.is_floating_point() for t in new):
            raise ValueError(f"{type(self).__name__} quantises floating-point keys and values; got "
                             f"{[t.dtype for t in new]}")
        if new[0].shape != new[1].shape or new[0].dtype != new[1].dtype:
            raise ValueError(f"keys {tuple(new[0].shape)} {new[0].dtype} and values {tuple(new[1].shape)} "
                             f"{new[1].dtype} must have one shape and dtype")
        return new[0].shape[-2]

    def check_layer(self, layer, masked: bool) -> None:
        """Refuse a multi-head latent attention layer (its cache holds one latent, not keys and values)."""
        if getattr(layer, "kv_latent_dim", None) is not None:
            raise ValueError(f"{type(self).__name__} quantises per-head keys and values; this layer is MLA "
                             f"(kv_latent_dim={layer.kv_latent_dim}) and caches a latent")


class Int8LayerCache(_QuantizedCache):
    """Every position's keys and values as int8, one scale per (token, head), dequantised on read. Chapter 19.

    A number ``x`` of a token's head is stored as ``q = round(x / scale)`` with ``scale = max |x| / 127`` over
    the head's ``head_dim`` numbers, and read back as ``q · scale`` (:func:`~attnlib.cache.quantize.quantize_absmax`):
    ``|x - x̂| <= scale / 2``. Per token and head: ``head_dim`` bytes and one scale in the model's dtype, for
    keys and for values (:meth:`bytes_per_token`); buffers pre-allocated to ``block_size`` positions.

    Args:
        block_size: the most positions it can hold (the model's ``block_size``).

    Raises:
        TypeError / ValueError: ``block_size`` not an int >= 1; on :meth:`update`, anything but keys and values
            ``(B, n_kv_heads, T_new, head_dim)`` of one floating dtype, or what :class:`~attnlib.cache.LayerCache`
            refuses; in :meth:`check_layer`, an MLA layer.
    """

    def store(self, new: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
        end, out = start + new[0].shape[-2], []
        for i, t in enumerate(new):
            codes, scale = quantize_absmax(t)  # (B, H, T_new, head_dim) int8, (B, H, T_new, 1)
            code_buffer, scale_buffer = self.buffer(2 * i, codes), self.buffer(2 * i + 1, scale)
            past = dequantize_absmax(code_buffer[..., :start, :], scale_buffer[..., :start, :])
            code_buffer[..., start:end, :], scale_buffer[..., start:end, :] = codes, scale
            out.append(torch.cat([past, t], dim=-2))  # the past as stored, the new positions as given
        return tuple(out)


class KIVILayerCache(_QuantizedCache):
    """KIVI's cache: keys per channel, values per token, ``bits`` = 4 or 2, a full-precision residual. Chapter 19.

    Liu et al. 2024 (KIVI, ICML 2024, §3.2-4.1). Keys have a few channels of large magnitude, so they are
    quantised per channel: a scale and a zero point per channel over each group of ``group_size``
    consecutive tokens. Values are quantised per token: a scale and a zero point per (token, head) over its
    ``head_dim`` numbers (KIVI's code also splits a token's channels into groups; here a head is one
    group). Both asymmetric, ``|x - x̂| <= (max - min) / (2^bits - 1) / 2`` over each group
    (:func:`~attnlib.cache.quantize.quantize_minmax`); codes packed ``8 // bits`` to a byte.

    A key group can only be quantised once its ``group_size`` tokens exist, and the most recent tokens
    matter most, so positions ``p >= Q`` stay in full precision, where ``Q = group_size · ⌊(length -
    residual_length) / group_size⌋`` (0 while ``length <= residual_length``): at least the last
    ``residual_length`` tokens, at most ``residual_length + group_size - 1`` (KIVI's ``R`` and ``G``).

    :meth:`crop` back into a quantised group moves that group's first positions to the residual as they
    are read now (the cache cannot recover their exact values); when the group fills again they are
    quantised once more.

    Args:
        block_size: the most positions it can hold (the model's ``block_size``).
        bits: 4 or 2. group_size: tokens per key group, an int >= 1 (KIVI: 32).
        residual_length: recent tokens kept in full precision, an int >= 0 (KIVI: 128).

    Raises:
        TypeError / ValueError: a bad argument (named); on :meth:`update`, as :class:`Int8LayerCache`, and a
            ``head_dim`` whose codes do not fill whole bytes (``head_dim · bits`` not a multiple of 8).
    """

    def __init__(self, block_size: int, bits: int = 4, group_size: int = 32, residual_length: int = 128) -> None:
        super().__init__(block_size)
        if isinstance(bits, bool) or bits not in (2, 4):
            raise ValueError(f"bits must be 4 or 2 (KIVI); got {bits!r}")
        positive_int("group_size", group_size)
        non_negative_int("residual_length", residual_length)
        self.bits, self.group_size, self.residual_length = bits, group_size, residual_length
        self.quantized = 0  # Q: positions 0 … Q-1 are quantised, Q … length-1 in the residual

    @property
    def capacity(self) -> int:
        """Quantised slots per sequence: ``block_size`` rounded up to whole groups."""
        return -(-self.block_size // self.group_size) * self.group_size

    def allocate(self, t: torch.Tensor) -> None:
        """On the first update, the eight buffers (see :meth:`nbytes`); later, check ``t`` against them."""
        B, H, _, D = t.shape
        if self.buffers:
            k_res = self.buffers[6]
            if (k_res.shape[0], k_res.shape[1], k_res.shape[-1]) != (B, H, D) or k_res.dtype != t.dtype \
                    or k_res.device != t.device:
                raise ValueError(f"the cache holds keys (B, H, ·, head_dim) = ({k_res.shape[0]}, {k_res.shape[1]}, ·, "
                                 f"{k_res.shape[-1]}) {k_res.dtype} on {k_res.device}; cannot append "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")
            return
        if D * self.bits % 8:
            raise ValueError(f"head_dim={D} times bits={self.bits} must be a multiple of 8 to pack the codes into bytes")
        cap, G, R = self.capacity, self.group_size, self.residual_length

        def new(n, width, dtype=t.dtype):
            return torch.zeros(B, H, n, width, dtype=dtype, device=t.device)

        packed = D * self.bits // 8
        self.buffers = [new(cap, packed, torch.uint8), new(cap, packed, torch.uint8),  # key and value codes
                        new(cap // G, D), new(cap // G, D),  # key scale and zero: per channel, per group
                        new(cap, 1), new(cap, 1),  # value scale and zero: per token
                        new(R + G - 1, D), new(R + G - 1, D)]  # the full-precision residual: keys, values

    def read_quantized(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the quantised positions ``0 … end-1`` (``end`` a multiple of ``group_size``),
        dequantised: ``(B, H, end, head_dim)`` each."""
        k_codes, v_codes, k_scale, k_zero, v_scale, v_zero = self.buffers[:6]
        G, dtype = self.group_size, self.buffers[6].dtype
        k = unpack_bits(k_codes[..., :end, :], self.bits)  # (B, H, end, D)
        B, H, _, D = k.shape
        k = dequantize_minmax(k.view(B, H, end // G, G, D), k_scale[..., :end // G, None, :],
                              k_zero[..., :end // G, None, :], dtype).view(B, H, end, D)
        v = dequantize_minmax(unpack_bits(v_codes[..., :end, :], self.bits), v_scale[..., :end, :],
                              v_zero[..., :end, :], dtype)
        return k, v

    def write_quantized(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Quantise keys and values ``(B, H, n, D)`` of positions ``start …`` (whole groups) into the buffers."""
        B, H, n, D = k.shape
        G, g = self.group_size, start // self.group_size
        codes, scale, zero = quantize_minmax(k.reshape(B, H, n // G, G, D), self.bits, dim=-2)  # per channel
        self.buffers[0][..., start:start + n, :] = pack_bits(codes.view(B, H, n, D), self.bits)
        self.buffers[2][..., g:g + n // G, :], self.buffers[3][..., g:g + n // G, :] = scale[..., 0, :], zero[..., 0, :]
        codes, scale, zero = quantize_minmax(v, self.bits, dim=-1)  # per token
        self.buffers[1][..., start:start + n, :] = pack_bits(codes, self.bits)
        self.buffers[4][..., start:start + n, :], self.buffers[5][..., start:start + n, :] = scale, zero

    def store(self, new: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
        k, v = new
        self.allocate(k)
        Q, G, end = self.quantized, self.group_size, start + k.shape[-2]
        k_res, v_res = self.buffers[6][..., :start - Q, :], self.buffers[7][..., :start - Q, :]
        k_old, v_old = self.read_quantized(Q)
        out = (torch.cat([k_old, k_res, k], dim=-2), torch.cat([v_old, v_res, v], dim=-2))
        k_all, v_all = out[0][..., Q:, :], out[1][..., Q:, :]  # positions Q … end-1, full precision
        Q_new = max(Q, G * ((end - self.residual_length) // G))
        if Q_new > Q:
            self.write_quantized(k_all[..., :Q_new - Q, :], v_all[..., :Q_new - Q, :], Q)
        self.buffers[6][..., :end - Q_new, :] = k_all[..., Q_new - Q:, :]
        self.buffers[7][..., :end - Q_new, :] = v_all[..., Q_new - Q:, :]
        self.quantized = Q_new
        return out

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on; the positions before it read as they did (see the class)."""
        self.check_crop(length)
        if length < self.quantized:
            g0 = self.group_size * (length // self.group_size)
            k, v = self.read_quantized(self.quantized)
            self.buffers[6][..., :length - g0, :] = k[..., g0:length, :]
            self.buffers[7][..., :length - g0, :] = v[..., g0:length, :]
            self.quantized = g0
        self._length = min(self._length, length)

    def reset(self) -> None:
        super().reset()
        self.quantized = 0

    def bytes_per_token(self) -> float:
        """Bytes one quantised position of one sequence takes, the key groups' scales and zero points shared out
        over their ``group_size`` tokens (so it may be fractional); the residual is a fixed cost (:meth:`nbytes`)."""
        if not self.buffers:
            return 0
        per_row = sum(b[:1].numel() * b.element_size() for b in self.buffers[:6])
        return per_row / self.capacity

    def nbytes(self) -> int:
        """Bytes allocated: packed key and value codes (``capacity · head_dim · bits / 8`` each per row and head),
        key scales and zero points (``capacity / group_size · head_dim`` each), value scales and zero points
        (``capacity`` each), and the residual's keys and values (``(residual_length + group_size - 1) · head_dim``
        each), the last five in the model's dtype."""
        return super().nbytes()


def quantized_layers(model, scheme: str = "int8", *, group_size: int = 32, residual_length: int = 128,
                     block_size: int | None = None) -> list:
    """One quantised cache per layer of ``model`` that keeps keys and values (:meth:`attnlib.cache.KVCache.quantized`).

    Every softmax layer gets a cache of every position (a windowed or chunked layer's rule then applies as a
    mask, as with ``model.new_cache(windows=False)``); a layer that shares another's keys and values (Gemma 4)
    reads its source's, dequantised.

    Args:
        model: a decoder (``model.blocks``, ``model.config.block_size``).
        scheme: one of :data:`SCHEMES`. group_size, residual_length: KIVI's ``G`` and ``R`` (``"kivi*"`` only).
        block_size: the most positions (default: the model's).

    Raises:
        ValueError: an unknown ``scheme``; a multi-head latent attention layer (``attention="mla"``: its latent
            is not per-head keys and values); a linear-attention layer (``layer_types[i]="linear_attention"``:
            its recurrent state does not grow by token). TypeError / ValueError: a bad size (named).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}; got {scheme!r}")
    block_size = model.config.block_size if block_size is None else block_size
    positive_int("block_size", block_size)
    bits = {"kivi4": 4, "kivi2": 2}.get(scheme)
    if bits is not None:
        KIVILayerCache(block_size, bits, group_size, residual_length)  # checks the sizes once, before any layer
    sources, caches = kv_sources(model), []
    for i, (block, source) in enumerate(zip(model.blocks, sources)):
        if source is not None:
            caches.append(None)  # linked to its source's cache below
            continue
        if getattr(block.attn, "kv_latent_dim", None) is not None:
            raise ValueError(f"layer {i} is multi-head latent attention (attention='mla', kv_latent_dim="
                             f"{block.attn.kv_latent_dim}): its cache holds a latent, not per-head keys and values "
                             f"to quantise with scheme={scheme!r}")
        if not isinstance(block.attn.new_cache(block_size, windows=False), LayerCache):
            kind = getattr(model.config, "layer_types", None)
            raise ValueError(f"layer {i} ({kind[i] if kind else type(block.attn).__name__!r}) keeps a recurrent "
                             f"state, not keys and values per token: scheme={scheme!r} cannot quantise it")
        caches.append(Int8LayerCache(block_size) if bits is None
                      else KIVILayerCache(block_size, bits, group_size, residual_length))
    return link_shared(caches, sources)
