"""Differential attention (Ye et al. 2024, "Differential Transformer", §2.1): the difference of two softmaxes.

A differential head takes two query/key pairs of width ``d`` and one value of width ``2d``::

    DiffAttn(X) = (softmax(Q₁ K₁ᵀ / √d) − λ · softmax(Q₂ K₂ᵀ / √d)) V                    (eq. 1)
    λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2) + λ_init                                     (eq. 2)
    λ_init = 0.8 − 0.6 · exp(−0.3 · (l − 1)),  l = 1, …, L                              (eq. 3)

The subtraction cancels the attention both maps give to irrelevant keys ("attention noise"), as a
differential amplifier cancels common-mode noise. Each head's output is normalised on its own
(an RMSNorm over its ``2d`` numbers, no weight) and scaled by ``1 − λ_init`` (§2.1, eq. 4).

Here, as in ``transformers``' ``DiffLlamaAttention``, ``n_heads`` counts the *softmax maps* (query heads of
width ``head_dim = d``): the first half of the query heads are the ``Q₁``, the second half the ``Q₂``;
likewise the key heads; each value of width ``2d`` is the concatenation of value head ``j`` and value head
``j + n_kv_heads / 2``. So the projections, the cache and the parameter count are those of a
:class:`~attnlib.attention.multi_head.MultiHeadAttention` with the same sizes (plus the four ``λ`` vectors),
and the layer has ``n_heads / 2`` differential heads. Chapter 20.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import finite_number, non_negative_int
from attnlib.attention.multi_head import MultiHeadAttention

__all__ = ["DifferentialAttention", "lambda_init_schedule"]


def lambda_init_schedule(layer: int) -> float:
    """``λ_init = 0.8 − 0.6 · exp(−0.3 · layer)`` for the 0-based ``layer`` (the paper's ``l − 1``, eq. 3;
    ``transformers``' ``lambda_init_fn(layer_idx)``): 0.2 at the first layer, towards 0.8 deeper.

    Raises:
        TypeError / ValueError: ``layer`` not an int >= 0.
    """
    non_negative_int("layer", layer)
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


class DifferentialAttention(MultiHeadAttention):
    """Differential attention (registry name ``"differential"``): :class:`MultiHeadAttention` whose ``attend``
    step subtracts a second softmax map, ``(softmax₁ − λ · softmax₂) V``, per pair of query heads.

    Args:
        d_model, n_heads, n_kv_heads, **options: as :class:`MultiHeadAttention` (``block_size``, ``dropout``,
            ``bias``, ``attn_fn``, ``head_dim``, ``rope``, ``sliding_window``, ...). ``n_heads`` counts the
            softmax maps (``transformers``' ``num_attention_heads``), ``n_kv_heads`` the key heads; both even.
            Causal self-attention only (no ``context``). ``dropout`` drops weights of each map apart (the
            paper defines none; ``transformers`` refuses it). A ``score_mod`` sees the differential head's
            index ``h < n_heads / 2`` in both maps.
        layer: the 0-based layer index that sets ``λ_init`` (:func:`lambda_init_schedule`); default 0.
        lambda_init: ``λ_init`` itself, in [0, 1), instead of ``layer`` (the paper's constant-0.8 ablation).
        lambda_std: standard deviation of the normal init of the ``λ`` vectors (0.1, as the paper's code
            and ``transformers``' ``lambda_std_dev``).

    Attributes:
        qkv, out_proj, rope: as :class:`MultiHeadAttention` (``out_proj`` takes ``n_heads / 2`` heads of
            ``2 · head_dim``, the same ``n_heads · head_dim`` numbers).
        lambda_q1, lambda_k1, lambda_q2, lambda_k2: ``(head_dim,)`` parameters; ``λ`` (:attr:`lambda_full`) is
            one number per layer, shared by its heads.
        lambda_init: ``λ_init`` (a float). norm_eps: the per-head RMSNorm's epsilon.
        cache_width: ``2 · n_kv_heads · head_dim``, as multi-head attention.

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, d_model)``; weights (``return_weights``) ``(B, n_heads / 2, T, T_k)``:
        ``softmax₁ − λ · softmax₂``, whose rows sum to ``1 − λ``. A per-head ``mask`` ``(B, n_heads, T, T_k)``
        gives its first half to the ``Q₁`` maps, its second half to the ``Q₂`` maps.

    Raises:
        TypeError / ValueError: as :class:`MultiHeadAttention`; ``n_heads`` or ``n_kv_heads`` odd; ``causal=False``;
            ``layer`` not an int >= 0, or given with ``lambda_init``; ``lambda_init`` outside [0, 1);
            ``lambda_std`` not a finite number >= 0 (each named).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, layer: int | None = None,
                 lambda_init: float | None = None, lambda_std: float = 0.1, **options) -> None:
        super().__init__(d_model, n_heads, n_kv_heads, **options)
        for name, value in (("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads)):
            if value % 2:
                raise ValueError(f"{name}={value} must be even: differential attention pairs its heads "
                                 "(first half with second half)")
        if not self.causal:
            raise ValueError("causal=False: DifferentialAttention is causal self-attention (DiffLlama's)")
        if layer is not None and lambda_init is not None:
            raise ValueError(f"give layer={layer!r} (λ_init from the schedule) or lambda_init={lambda_init!r}, not both")
        if lambda_init is None:
            lambda_init = lambda_init_schedule(0 if layer is None else layer)
        elif not 0 <= finite_number("lambda_init", lambda_init) < 1:
            raise ValueError(f"lambda_init={lambda_init!r} must be in [0, 1): the output is scaled by 1 - lambda_init")
        finite_number("lambda_std", lambda_std, minimum=0)
        self.lambda_init = float(lambda_init)
        self.norm_eps = options.get("norm_eps", 1e-6)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):  # nn.Parameter: the GPT init leaves them
            setattr(self, name, nn.Parameter(torch.randn(self.head_dim) * lambda_std))

    @property
    def lambda_full(self) -> torch.Tensor:
        """``λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2) + λ_init`` (eq. 2), a 0-d tensor in the parameters' dtype
        (the dot products summed in float32, as ``transformers``)."""
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dtype=torch.float32))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dtype=torch.float32))
        return (lambda_1 - lambda_2).to(self.lambda_q1.dtype) + self.lambda_init

    def attend(self, q, k, v, mask, is_causal, need_weights):
        """``(softmax₁ − λ softmax₂) V``, normalised per head: ``(B, n_heads / 2, T_q, 2 · head_dim)``."""
        q1, q2 = q.chunk(2, dim=1)  # (B, n_heads, T, d) -> two (B, n_heads/2, T, d): the Q1 and Q2 maps
        k1, k2 = k.chunk(2, dim=1)  # (B, n_kv, T_k, d) -> two (B, n_kv/2, T_k, d)
        v = torch.cat(v.chunk(2, dim=1), dim=-1)  # (B, n_kv, T_k, d) -> (B, n_kv/2, T_k, 2d): values twice as wide
        m1, m2 = (mask, mask) if mask is None or mask.shape[1] == 1 else mask.chunk(2, dim=1)
        # Two calls of the registered attention function: each map weighs the same values.
        y1, w1 = super().attend(q1, k1, v, m1, is_causal, need_weights)  # softmax(Q1 K1ᵀ/√d) V: (B, n_heads/2, T, 2d)
        y2, w2 = super().attend(q2, k2, v, m2, is_causal, need_weights)  # softmax(Q2 K2ᵀ/√d) V
        lam = self.lambda_full
        y = y1 - lam * y2  # (softmax1 − λ softmax2) V, by linearity
        y = (1 - self.lambda_init) * F.rms_norm(y, (y.shape[-1],), eps=self.norm_eps)  # each head over its 2d numbers
        return y, (w1 - lam * w2 if need_weights else None)
