"""RoPE's frequencies, and the ways of stretching them past the training context. Chapter 17.

RoPE (Su et al. 2021) rotates pair ``i`` of a head at position ``m`` by ``m · θ_i`` with
``θ_i = base^(-2i / head_dim)``. A model trained on contexts of ``L`` tokens has seen the
slow pairs turn through only a fraction of a circle; at ``4L`` they reach angles never
seen in training. The scalings below change ``θ`` (and, for YaRN, the attention's
temperature) so that longer contexts stay within what training covered:

* ``linear`` (position interpolation, Chen et al. 2023): every ``θ_i`` divided by ``factor``;
* ``dynamic`` (dynamic NTK, bloc97/emozilla 2023): a larger ``base`` once the sequence grows
  past ``max_position_embeddings``, so fast pairs barely change and slow ones are interpolated;
* ``llama3`` (Llama 3.1, Meta 2024): fast pairs (wavelength < ``L / high_freq_factor``) kept,
  slow pairs (wavelength > ``L / low_freq_factor``) divided by ``factor``, a smooth blend between;
* ``yarn`` (Peng et al. 2023, "YaRN"): the same three bands by the number of rotations a pair
  makes in ``L`` tokens (``beta_fast``, ``beta_slow``), plus an attention factor
  ``0.1 · ln(factor) + 1`` that multiplies cos and sin.

``rope_scaling`` is a dict in Hugging Face ``transformers``' format (``rope_type`` or the
older ``type``, and the fields each type needs); the results equal ``transformers``'
``ROPE_INIT_FUNCTIONS`` for the same settings (tests/test_rope_scaling.py).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from attnlib._checks import positive_int

__all__ = ["ROPE_TYPES", "rope_frequencies"]

#: type -> (required fields, optional fields) of the ``rope_scaling`` dict.
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


def _number(name: str, value: object, *, at_least: float | None = None, above: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"rope_scaling[{name!r}] must be a finite number, got {value!r}")
    if at_least is not None and value < at_least:
        raise ValueError(f"rope_scaling[{name!r}] must be >= {at_least}, got {value!r}")
    if above is not None and value <= above:
        raise ValueError(f"rope_scaling[{name!r}] must be > {above}, got {value!r}")
    return float(value)


def _checked_scaling(rope_scaling: Mapping, base: float) -> tuple[str, dict]:
    """The scaling's type and its fields, or a ValueError naming what is wrong."""
    if not isinstance(rope_scaling, Mapping):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    fields = dict(rope_scaling)
    kind = fields.pop("rope_type", None) or fields.pop("type", None)
    legacy = fields.pop("type", None)
    if legacy is not None and legacy != kind:  # transformers would silently take rope_type
        raise ValueError(f"rope_scaling gives rope_type={kind!r} and type={legacy!r}; give one type")
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; expected one of {sorted(ROPE_TYPES)} "
                         "(as 'rope_type' or 'type')")
    theta = fields.pop("rope_theta", None)
    if theta is not None and _number("rope_theta", theta) != base:
        raise ValueError(f"rope_scaling['rope_theta']={theta!r} disagrees with base={base!r}; pass the base once")
    required, optional = ROPE_TYPES[kind]
    missing = [k for k in required if k not in fields]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs the field(s) {missing}; got {sorted(rope_scaling)}")
    unknown = sorted(set(fields) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"rope_scaling of type {kind!r} has field(s) {unknown} that attnlib does not reproduce; "
                         f"known fields: {sorted(required + optional)}")
    if "factor" in fields:
        _number("factor", fields["factor"], at_least=1.0)
    if "original_max_position_embeddings" in fields:
        positive_int("rope_scaling['original_max_position_embeddings']", fields["original_max_position_embeddings"])
    if kind == "llama3":
        low = _number("low_freq_factor", fields["low_freq_factor"], above=0.0)
        if _number("high_freq_factor", fields["high_freq_factor"]) <= low:
            raise ValueError(f"rope_scaling['high_freq_factor']={fields['high_freq_factor']!r} must be greater than "
                             f"low_freq_factor={fields['low_freq_factor']!r}")
    for name in ("mscale", "mscale_all_dim"):
        if fields.get(name) is not None:
            _number(name, fields[name], at_least=0.0)
    for name in ("attention_factor", "beta_fast", "beta_slow"):  # 0 would zero cos/sin or divide by 0
        if fields.get(name) is not None:
            _number(name, fields[name], above=0.0)
    if (fields.get("beta_fast") or 32) < (fields.get("beta_slow") or 1):
        raise ValueError(f"rope_scaling['beta_fast']={fields.get('beta_fast', 32)!r} must be >= "
                         f"beta_slow={fields.get('beta_slow', 1)!r} (defaults 32 and 1)")
    if "truncate" in fields and not isinstance(fields["truncate"], bool):
        raise ValueError(f"rope_scaling['truncate'] must be a bool, got {fields['truncate']!r}")
    return kind, fields


def rope_frequencies(head_dim: int, base: float = 10000.0, rope_scaling: Mapping | None = None,
                     max_position_embeddings: int | None = None, *, seq_len: int | None = None,
                     ) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies ``θ_i`` and the factor on cos/sin, plain or scaled.

    Args:
        head_dim: size of one head (even); there are ``head_dim / 2`` frequencies.
        base: RoPE's wavelength scale (``rope_theta``: 10000 in RoFormer/Llama 2, 500000 in Llama 3).
        rope_scaling: None (plain RoPE) or a dict in ``transformers``' format, e.g.
            ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}``. Types: see :data:`ROPE_TYPES`.
        max_position_embeddings: the context the (scaled) model serves; needed by ``dynamic``
            and by ``yarn`` when it has no ``factor``.
        seq_len: ``dynamic`` only: the current sequence length (the base grows once it passes
            ``max_position_embeddings``; default: ``max_position_embeddings``, i.e. no change).

    Returns:
        ``(inv_freq, attention_factor)``: float32 tensor ``(head_dim / 2,)`` in radians per position,
        and the float that multiplies cos and sin (1.0 except for YaRN).

    Raises:
        TypeError / ValueError: ``head_dim`` not a positive even int; ``base`` not a finite number > 1;
            ``max_position_embeddings`` or ``seq_len`` not a positive int; an unknown type, ``rope_type`` and
            ``type`` that disagree, a missing or unknown field, a field that is not a finite number, a factor < 1,
            ``high_freq_factor <= low_freq_factor``, YaRN's ``attention_factor``/``beta_fast``/``beta_slow`` <= 0 or
            ``beta_fast < beta_slow`` or a ``truncate`` that is not a bool, ``dynamic`` without
            ``max_position_embeddings`` or with ``head_dim=2``.

    ``original_max_position_embeddings`` may exceed ``max_position_embeddings`` (a model served on a
    shorter context than it was trained for): ``llama3`` and ``yarn`` do not depend on the latter,
    as in ``transformers`` (which only warns).
    """
    positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even (dimensions are used in pairs)")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"base must be a finite number > 1, got {base!r}")
    if max_position_embeddings is not None:
        positive_int("max_position_embeddings", max_position_embeddings)
    if seq_len is not None:
        positive_int("seq_len", seq_len)
    kind, f = ("default", {}) if rope_scaling is None else _checked_scaling(rope_scaling, float(base))
    if kind == "dynamic" and head_dim == 2:
        raise ValueError("rope_scaling of type 'dynamic' needs head_dim >= 4 (its base grows with the exponent "
                         "head_dim / (head_dim - 2)); got head_dim=2")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # 2i / head_dim
    inv_freq = 1.0 / (base ** exponents)  # θ_i, (head_dim/2,)
    if kind == "default":
        return inv_freq, 1.0
    factor = float(f["factor"])
    if kind == "linear":  # position interpolation: m -> m / factor
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("rope_scaling of type 'dynamic' needs max_position_embeddings (the trained context)")
        L = max(seq_len if seq_len is not None else max_position_embeddings, max_position_embeddings)
        new_base = base * ((factor * L / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (new_base ** exponents), 1.0
    L = int(f["original_max_position_embeddings"])
    if kind == "llama3":
        low, high = float(f["low_freq_factor"]), float(f["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > L / low, inv_freq / factor, inv_freq)  # slow pairs interpolated
        smooth = (L / wavelen - low) / (high - low)  # 0 at wavelength L/low, 1 at L/high
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= L / high) & (wavelen <= L / low)
        return torch.where(medium, blended, scaled), 1.0
    return _yarn(head_dim, float(base), factor, L, f, exponents)


def _yarn(head_dim: int, base: float, factor: float, L: int, f: dict, exponents: torch.Tensor,
          ) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, §3.2–3.4): NTK-by-parts frequencies and the attention factor."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = f.get("attention_factor")
    if attention_factor is None:
        if f.get("mscale") and f.get("mscale_all_dim"):
            attention_factor = mscale(factor, f["mscale"]) / mscale(factor, f["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = f.get("beta_fast") or 32, f.get("beta_slow") or 1

    def pair_making(n_rotations: float) -> float:  # the pair index that turns n_rotations times in L tokens
        return head_dim * math.log(L / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_making(beta_fast), pair_making(beta_slow)
    if f.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (fast pairs, unchanged), 0: interpolate (slow pairs, / factor)
    pos_freqs = base ** exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)
