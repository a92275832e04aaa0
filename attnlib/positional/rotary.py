"""Rotary position embedding (RoPE, Su et al. 2021, §3.4): queries and keys turned by their positions.

Chapter 10 derives it, chapter 16 puts it inside a decoder's attention, chapter 17 stretches it
(:mod:`attnlib.positional.scaling`). Each pair of a head's numbers at position ``m`` is rotated by
an angle proportional to ``m``, so that the dot product of a query and a key depends only on the
offset between their positions.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib._checks import finite_number, float_input, positive_int
from attnlib.positional.absolute import even
from attnlib.positional.scaling import rope_frequencies

__all__ = ["LeadingRotaryEmbedding", "RotaryEmbedding", "interleaved_to_half_split", "turn"]


def _real_positions(positions: object) -> None:
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor of integer or float positions; got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must hold integer or float positions; got dtype {positions.dtype}")


def turn(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Turn each half-split pair ``(x1[i], x2[i]) = (x[i], x[i + d/2])`` of ``x (…, d)`` by its angle.

    ``cos (…, d)`` holds each angle's cosine in both halves and ``signed_sin (…, d)`` its sine,
    negated in the first half (:meth:`RotaryEmbedding.cos_sin`); both broadcast to ``x``.
    Returns ``(x1 cos - x2 sin, x2 cos + x1 sin)``, a tensor like ``x``: ``x · cos`` plus the
    halves swapped, ``(x2, x1)``, times ``(-sin, sin)``. This is ``transformers``' ``x · cos +
    rotate_half(x) · sin`` with the sign of ``rotate_half`` moved into ``sin``, computed once per
    model step, and its concatenation replaced by one ``torch.roll``: the same bits, faster. When
    autograd is not recording (generation, :class:`_Rotation`), the products are summed in place:
    the same bits again, in two fresh buffers instead of four.
    """
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (x1, x2) -> (x2, x1)
    turned = x * cos
    recording = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or signed_sin.requires_grad)
    if recording or turned.shape != x.shape:  # (tables wider than x: the products out of place too)
        return turned + swapped * signed_sin
    return turned.add_(swapped.mul_(signed_sin))


class _Rotation(torch.autograd.Function):
    """:func:`turn` with its backward written out: a rotation's transpose is its inverse.

    The gradient of ``y = R(θ) x`` is ``R(θ)ᵀ g = R(-θ) g``: the same turn with the sine negated.
    Autograd would instead go back through each step of :func:`turn`; this is one turn, and it
    saves only ``cos`` and ``sin``. Both give the same bits: each element of the gradient is
    ``g1 cos + g2 sin`` or ``g2 cos - g1 sin``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                back_sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, signed_sin, back_sin)  # back_sin = -signed_sin, computed once per model step
        return turn(x, cos, signed_sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, signed_sin, back_sin = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the turn back as a node of its own (differentiable again)
            return _Rotation.apply(grad, cos, back_sin, signed_sin), None, None, None
        return turn(grad, cos, back_sin), None, None, None  # turned back by -θ


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021, §3.4), applied to queries and keys.

    The ``head_dim`` numbers of a head are taken in ``head_dim / 2`` pairs; pair ``i`` at
    position ``m`` is rotated by the angle ``m · θ_i`` with ``θ_i = base^(-2i / head_dim)``.
    A rotation by ``mθ`` of the query and by ``nθ`` of the key leaves their dot product a
    function of ``m - n`` only, so attention scores see relative offsets.

    Pairing: **half-split**, the convention of Hugging Face ``transformers``' Llama, Qwen and
    Mistral code (``rotate_half``): pair ``i`` is ``(x[i], x[i + head_dim/2])``. The RoFormer
    paper and Meta's reference Llama code use the *interleaved* pairing ``(x[2i], x[2i+1])``;
    the two are the same rotation up to a fixed permutation of each head's rows of ``W_Q`` and
    ``W_K`` (:func:`interleaved_to_half_split`, chapter 16), but weights trained
    with one do not work with the other.

    Args:
        head_dim: size of one head (even).
        base: the wavelength scale (10000 as in the paper and LLaMA).
        rope_scaling: None, or a scaling for contexts longer than training in ``transformers``' format
            (``linear``, ``dynamic``, ``llama3``, ``yarn``): see :func:`attnlib.positional.scaling.rope_frequencies`.
            YaRN's attention factor multiplies cos and sin, as in ``transformers``.
        max_position_embeddings: the context the model serves (``dynamic`` needs it: its base grows
            with the largest position rotated once that passes this length).

    Raises:
        TypeError / ValueError: ``head_dim`` not a positive even int; ``base`` not a number, not finite, or ``<= 1``;
            a ``rope_scaling`` that :func:`~attnlib.positional.scaling.rope_frequencies` refuses.

    (The rotation is :meth:`rotate`, not ``apply``: ``apply`` is ``nn.Module.apply(fn)``, which
    ``model.apply(init_fn)`` calls on every submodule.)
    """

    def __init__(self, head_dim: int, base: float = 10000.0, rope_scaling: dict | None = None,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        even("head_dim", head_dim)
        if not isinstance(base, (int, float)) or isinstance(base, bool):
            raise TypeError(f"base must be a float; got {base!r} ({type(base).__name__})")
        if not math.isfinite(base) or base <= 1:
            raise ValueError(f"base={base!r} must be a finite number > 1")
        inv_freq, attention_factor = rope_frequencies(head_dim, base, rope_scaling, max_position_embeddings)
        self.head_dim, self.base, self.attention_factor = head_dim, float(base), attention_factor
        self.rope_scaling = None if rope_scaling is None else dict(rope_scaling)
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (head_dim/2,)
        self._inv_freq_float32 = inv_freq.float()  # not a buffer: what _apply restores

    def _apply(self, fn, recurse=True):
        """As ``nn.Module._apply`` (``.to``, ``.cuda``, ``.half``, ...), except that the frequencies stay in
        float32 when the model moves to a narrower float: a bfloat16 ``θ_i`` is off by up to 2⁻⁸ of itself,
        and the angle ``m·θ_i`` by that times ``m`` (up to 5 radians at position 4096 for head_dim 128).
        ``transformers`` computes its angles in float32 too."""
        super()._apply(fn, recurse)
        if self.inv_freq.is_floating_point() and torch.finfo(self.inv_freq.dtype).bits < 32:
            self.inv_freq = self._inv_freq_float32.to(self.inv_freq.device)
        return self

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotation angles ``(…, T, head_dim / 2)`` for integer or float ``positions`` of shape ``(…, T)``.

        Raises:
            TypeError: ``positions`` not a tensor of a real (integer or floating) dtype.
            ValueError: float ``positions`` holding nan or inf.
        """
        _real_positions(positions)
        on_meta = positions.device.type == "meta"
        if positions.is_floating_point() and not on_meta and not torch.isfinite(positions).all():
            raise ValueError("positions hold nan or inf; expected finite positions")
        inv_freq = self.inv_freq
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        if kind == "dynamic" and positions.numel() and not on_meta:  # the base grows with the longest sequence seen
            seq_len = max(int(positions.max()) + 1, 1)  # (no growth for negative positions)
            inv_freq = rope_frequencies(self.head_dim, self.base, self.rope_scaling, self.max_position_embeddings,
                                        seq_len=seq_len)[0].to(inv_freq.device)
        return positions.to(torch.float32)[..., None] * inv_freq  # (..., T, 1) * (hd/2,) -> (..., T, hd/2)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` by its positions.

        Args:
            x: ``(…, T, head_dim)`` float, e.g. queries ``(B, n_heads, T, head_dim)``.
            positions: ``(T,)`` (or broadcastable to ``x.shape[:-1]``) positions; default
                ``0, 1, …, T-1``. During cached decoding pass the absolute positions of the new tokens.

        Returns:
            a tensor like ``x``.

        Raises:
            TypeError: ``x`` not float; ``positions`` not a tensor, or of a bool or complex dtype.
            ValueError: last dimension not ``head_dim``; positions of the wrong length, 0-d, not broadcastable
                to ``x.shape[:-1]``, holding nan/inf, or on the meta device while ``x`` is not; ``x`` on another
                device than the module's buffers.
        """
        float_input(x, self.head_dim, width="head_dim")
        T = x.shape[-2]
        if x.device != self.inv_freq.device:
            raise ValueError(f"x is on {x.device} but this RotaryEmbedding is on {self.inv_freq.device}; "
                             "move one of them (module.to(device))")
        if positions is None:
            positions = torch.arange(T, device=x.device)
        _real_positions(positions)
        if positions.dim() == 0 or positions.shape[-1] != T:
            raise ValueError(f"positions must be a tensor whose last dimension is T={T}; got shape {tuple(positions.shape)}")
        if len(positions.shape) > x.dim() - 1 or any(p not in (1, n) for p, n in zip(positions.shape[::-1], x.shape[-2::-1])):
            raise ValueError(f"positions of shape {tuple(positions.shape)} do not broadcast to x's "
                             f"{tuple(x.shape[:-1])} (x without head_dim)")
        if positions.device.type == "meta" and x.device.type != "meta":
            raise ValueError(f"positions are on the meta device (no values) but x is on {x.device}")
        cos, signed_sin, back_sin = self.cos_sin(positions.to(x.device), x.dtype)  # (..., T, head_dim) each
        if cos.requires_grad or signed_sin.requires_grad:  # angles that learn (not RoPE's): autograd's backward
            return turn(x, cos, signed_sin)
        if not (torch.is_grad_enabled() and x.requires_grad):  # no gradient to take (generation): the turn alone
            return turn(x, cos, signed_sin)
        return _Rotation.apply(x, cos, signed_sin, back_sin)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos and sin of the angles, each repeated for both halves: ``(…, T, head_dim)`` in ``dtype``;
        and that sine negated (the turn back, for the backward pass).

        The sine is negated in the first half, ``(-sin, sin)``: the sign ``rotate_half`` would put
        on ``x2`` (:func:`turn`). The last result is kept and reused while the positions stay the
        same (every layer of a model, every training step): computing them is a large share of a
        small model's step.
        """
        key = (positions.shape, positions.device, dtype, torch.is_inference_mode_enabled())
        memo = getattr(self, "_cos_sin", None)
        on_meta = positions.device.type == "meta"  # no values to compare: never reused
        if memo is not None and not on_meta and memo[0] == key and torch.equal(memo[1], positions):
            return memo[2]
        angle = self.angles(positions)  # (..., T, hd/2)
        cos = (angle.cos() * self.attention_factor).to(dtype)  # attention_factor: 1 except for YaRN
        sin = (angle.sin() * self.attention_factor).to(dtype)
        cos, signed_sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # pair i at i and i + hd/2
        tables = (cos, signed_sin, -signed_sin)  # and the sine of the turn back, for the backward pass
        self._cos_sin = (key, positions.clone(), tables)
        return tables

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Same as :meth:`rotate`."""
        return self.rotate(x, positions)


class LeadingRotaryEmbedding(nn.Module):
    """RoPE on the leading ``rotary_dim = int(partial_rotary_factor · head_dim)`` numbers of each head only, the
    rest passed through unturned: GPT-NeoX's ``rotary_pct``, Qwen3-Next's and Qwen3.5's ``partial_rotary_factor``
    (chapter 21). Inside the leading part it is :class:`RotaryEmbedding` of width ``rotary_dim``: half-split pairs
    ``(x[i], x[i + rotary_dim/2])``, ``θ_i = base^(-2i / rotary_dim)`` (not Gemma 4's "proportional" RoPE,
    :class:`~attnlib.models.per_layer.PartialRotaryEmbedding`, whose pairs and frequencies span the whole head).

    Args:
        head_dim: size of one head. partial_rotary_factor: in (0, 1]; ``rotary_dim`` must come out even, >= 2.
        base, rope_scaling, max_position_embeddings: as :class:`RotaryEmbedding`, over ``rotary_dim``.

    Attributes:
        head_dim, rotary_dim: the widths. inner: the :class:`RotaryEmbedding` of the leading part.

    Shapes: :meth:`rotate` ``(…, T, head_dim)`` → ``(…, T, head_dim)``.

    Raises:
        TypeError / ValueError: ``head_dim`` not a positive int; ``partial_rotary_factor`` not a number in (0, 1] or
            giving an odd or zero ``rotary_dim`` (named); as :class:`RotaryEmbedding`.
    """

    def __init__(self, head_dim: int, base: float, partial_rotary_factor: float, rope_scaling: dict | None = None,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        positive_int("head_dim", head_dim)
        fraction = finite_number("partial_rotary_factor", partial_rotary_factor)
        rotary_dim = int(head_dim * fraction)
        if not 0 < fraction <= 1 or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={partial_rotary_factor!r} must be in (0, 1] and turn an even "
                             f"number >= 2 of head_dim={head_dim}'s numbers; int(head_dim · factor) = {rotary_dim}")
        self.head_dim, self.rotary_dim, self.partial_rotary_factor = head_dim, rotary_dim, fraction
        self.inner = RotaryEmbedding(rotary_dim, base, rope_scaling, max_position_embeddings)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x (…, T, head_dim)`` with its leading ``rotary_dim`` numbers turned (:meth:`RotaryEmbedding.rotate`)."""
        float_input(x, self.head_dim, width="head_dim")
        turned = self.inner.rotate(x[..., :self.rotary_dim], positions)
        return torch.cat([turned, x[..., self.rotary_dim:]], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Same as :meth:`rotate`."""
        return self.rotate(x, positions)


def interleaved_to_half_split(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a query or key projection from interleaved RoPE pairs to half-split ones.

    Meta's Llama code rotates pairs ``(x[2i], x[2i+1])`` of each head (a complex view);
    ``transformers`` and :class:`RotaryEmbedding` rotate ``(x[i], x[i + head_dim/2])``.
    Putting each head's even rows first and its odd rows after (the permutation of
    ``transformers``' Llama conversion script) makes half-split RoPE on the new weight give the
    same attention scores as interleaved RoPE on the old one.

    Args:
        weight: ``(n_heads · head_dim, d_model)`` (``nn.Linear`` layout), or a bias ``(n_heads · head_dim,)``.
        n_heads: heads in it (the key/value heads for ``W_k``).

    Returns:
        a tensor like ``weight``, rows reordered within each head.

    Raises:
        ValueError: ``n_heads`` does not divide the rows into heads of an even width.
    """
    positive_int("n_heads", n_heads)
    rows = weight.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"weight has {rows} rows: not n_heads={n_heads} heads of an even head_dim")
    head_dim = rows // n_heads
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])  # evens, then odds
    return weight.reshape(n_heads, head_dim, *weight.shape[1:])[:, order].reshape(weight.shape)
