"""Two changes to softmax attention from 2025 models: a gate on its output, and top-k sparse keys. Chapter 18.

* :class:`GatedAttention`: Qwen3-Next's gated attention output (Qiu et al. 2025, "Gated
  Attention for Large Language Models"): ``out_proj(attention(x) ⊙ σ(x W_g))``, the gate
  elementwise (one per head and channel, Qwen3-Next's choice) or one per head.
* :func:`topk_attention` and :class:`TopKAttention`: each query attends only to the ``top_k``
  causal keys with the highest *index scores* (its own ``q·k``, or a cheap
  :class:`LightningIndexer`: the idea of DeepSeek Sparse Attention, DeepSeek-AI 2025,
  DeepSeek-V3.2-Exp §2.1). The keys are gathered, so the softmax and the value sum cost
  ``T·k`` instead of ``T²/2``; selecting them still scores every pair (cheaply, with the indexer).
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import finite_number, positive_int
from attnlib.attention.inputs import check_layer_inputs
from attnlib.attention.multi_head import MultiHeadAttention

__all__ = ["GATE_KINDS", "GatedAttention", "LightningIndexer", "TopKAttention", "topk_attention", "topk_mask"]

GATE_KINDS = ("elementwise", "headwise")


class GatedAttention(MultiHeadAttention):
    """Multi-head attention whose output is gated by ``σ(x W_g)`` before ``out_proj`` (Qiu et al. 2025, §2).

    Args:
        d_model, n_heads, n_kv_heads, **kwargs: as :class:`attnlib.attention.MultiHeadAttention`.
        gate: ``"elementwise"`` (``W_g``: ``d_model → n_heads · head_dim``, Qwen3-Next), ``"headwise"``
            (``d_model → n_heads``) or ``None`` (no gate: exactly multi-head attention).
        gate_bias: a bias on ``W_g`` (Qwen3-Next and Qwen3.5 have none: their gate is rows of ``q_proj``).

    Raises:
        ValueError: an unknown ``gate``; otherwise as :class:`MultiHeadAttention`.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *,
                 gate: str | None = "elementwise", gate_bias: bool = True, **kwargs) -> None:
        if gate is not None and gate not in GATE_KINDS:
            raise ValueError(f"gate={gate!r} is not one of {GATE_KINDS} (or None)")
        super().__init__(d_model, n_heads, n_kv_heads, **kwargs)
        self.gate_kind = gate
        width = {"elementwise": n_heads * self.head_dim, "headwise": n_heads, None: 0}[gate]
        self.gate_proj = nn.Linear(d_model, width, bias=gate_bias) if gate else None

    def gate_output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The heads' output ``y (B, n_heads, T, head_dim)`` times ``σ(x W_g)``, per channel or per head."""
        if self.gate_proj is None:
            return y
        B, T, _ = x.shape
        width = self.gate_proj.out_features // self.n_heads  # hd or 1
        g = torch.sigmoid(self.gate_proj(x)).view(B, T, self.n_heads, width).transpose(1, 2)  # (B, h, T, hd or 1)
        return y * g



def topk_mask(scores: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask keeping, in every row of ``scores`` ``(..., T_q, T_k)``, the ``top_k`` allowed entries
    of highest score (all allowed entries when fewer). ``allowed``: bool, broadcastable; ``None`` = causal
    (bottom-right aligned). Raises TypeError for ``scores`` not a float tensor or ``allowed`` not a bool
    tensor, ValueError for ``top_k < 1`` or shapes that do not fit."""
    positive_int("top_k", top_k)
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() < 2:
        raise TypeError(f"scores must be a float tensor (..., T_q, T_k); got {getattr(scores, 'shape', type(scores))}")
    T_q, T_k = scores.shape[-2:]
    if allowed is None:
        allowed = torch.ones(T_q, T_k, dtype=torch.bool, device=scores.device).tril(T_k - T_q)
    elif not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        raise TypeError(f"allowed must be a bool tensor; got {getattr(allowed, 'dtype', type(allowed).__name__)}")
    elif allowed.dim() > scores.dim() or any(a not in (1, s) for a, s in zip(allowed.shape[::-1], scores.shape[::-1])):
        raise ValueError(f"allowed {tuple(allowed.shape)} does not broadcast to scores {tuple(scores.shape)}")
    s = scores.masked_fill(~allowed, float("-inf"))
    index = s.topk(min(top_k, T_k), dim=-1).indices  # (..., T_q, k)
    return torch.zeros_like(s, dtype=torch.bool).scatter(-1, index, True) & allowed


def topk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, top_k: int, index_scores: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention in which query ``i`` attends only to its ``top_k`` keys of highest index score.

    The chosen keys and values are gathered: the scores, softmax and weighted sum cost ``T_q · top_k``
    instead of ``T_q · T_k``. With ``top_k >= T_k`` it equals dense causal attention.

    Args:
        q: ``(B, h, T_q, d)``; k, v: ``(B, h, T_k, d)``, the last ``T_q`` keys being the queries' own positions.
        top_k: keys per query, >= 1.
        index_scores: ``(B, h|1, T_q, T_k)`` scores that choose the keys; ``None`` = ``q·kᵀ`` (exact top-k).
        scale: default ``1 / √d``.

    Returns:
        ``(B, h, T_q, d_v)``.

    Raises:
        TypeError: q, k, v (or index_scores) not float tensors of one dtype, a ``scale`` not a number.
        ValueError: ``top_k < 1``, mismatched shapes or devices, ``d = 0``, NaN index scores, a
            ``scale`` that is not finite (named).
    """
    positive_int("top_k", top_k)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype != q.dtype:
            raise TypeError(f"q, k, v must be float tensors of one dtype; {name} is "
                            f"{getattr(t, 'dtype', type(t).__name__)}" + ("" if name == "q" else f", q {q.dtype}"))
        if t.device != q.device:
            raise ValueError(f"q, k, v must be on one device; got q on {q.device} and {name} on {t.device}")
    if (q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]
            or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"q (B, h, T_q, d), k (B, h, T_k, d), v (B, h, T_k, d_v) do not match: "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a width d >= 1; got {tuple(q.shape)}")
    B, h, T_q, T_k = *q.shape[:3], k.shape[2]
    if T_q > T_k:
        raise ValueError(f"T_q={T_q} queries but only T_k={T_k} keys; the keys must include the queries' positions")
    scale = q.shape[-1] ** -0.5 if scale is None else finite_number("scale", scale)
    if index_scores is None:
        index_scores = q @ k.transpose(-2, -1)  # (B, h, T_q, T_k)
    elif not isinstance(index_scores, torch.Tensor) or not index_scores.is_floating_point():
        raise TypeError(f"index_scores must be a float tensor; got {getattr(index_scores, 'dtype', type(index_scores))}")
    elif (index_scores.dim() != 4 or index_scores.shape[0] != B or index_scores.shape[1] not in (1, h)
          or index_scores.shape[-2:] != (T_q, T_k)):
        raise ValueError(f"index_scores must have shape (B={B}, h={h} or 1, T_q={T_q}, T_k={T_k}); "
                         f"got {tuple(index_scores.shape)}")
    elif index_scores.isnan().any():
        raise ValueError("index_scores holds NaN: the keys to keep are undefined")
    allowed = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril(T_k - T_q)  # causal, bottom-right
    kk = min(top_k, T_k)
    index = index_scores.masked_fill(~allowed, float("-inf")).topk(kk, dim=-1).indices  # (B, h|1, T_q, kk)
    index = index.expand(B, h, T_q, kk)
    valid = allowed.expand(B, h, T_q, T_k).gather(-1, index)  # rows with < kk keys pick masked ones
    flat = index.reshape(B, h, T_q * kk, 1)
    k_sel = k.gather(2, flat.expand(-1, -1, -1, k.shape[-1])).view(B, h, T_q, kk, k.shape[-1])  # (B, h, T_q, kk, d)
    v_sel = v.gather(2, flat.expand(-1, -1, -1, v.shape[-1])).view(B, h, T_q, kk, v.shape[-1])
    scores = (q.unsqueeze(-2) * k_sel).sum(-1) * scale  # (B, h, T_q, kk)
    weights = scores.masked_fill(~valid, float("-inf")).softmax(-1)
    return (weights.unsqueeze(-1) * v_sel).sum(-2)  # (B, h, T_q, d_v)


class LightningIndexer(nn.Module):
    """A small scorer of keys (DeepSeek-V3.2-Exp §2.1): ``I(t, s) = Σ_j w_{t,j} ReLU(q^I_{t,j} · k^I_s)``.

    ``index_heads`` query heads of width ``index_dim`` and one shared key of width ``index_dim``
    per token, much narrower than the attention's. Not trained by the language-model loss (top-k
    passes no gradient to it): DeepSeek trains it to match the dense attention (a KL loss), which
    this book does not do; the trained comparison uses the attention's own ``q·k``.

    Shapes: ``x (B, T_q, d_model)``, ``context (B, T_k, d_model)`` → scores ``(B, 1, T_q, T_k)``.
    """

    def __init__(self, d_model: int, index_heads: int = 4, index_dim: int = 16) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("index_heads", index_heads), ("index_dim", index_dim)):
            positive_int(name, value)
        self.d_model, self.index_heads, self.index_dim = d_model, index_heads, index_dim
        self.q_proj = nn.Linear(d_model, index_heads * index_dim, bias=False)
        self.k_proj = nn.Linear(d_model, index_dim, bias=False)
        self.w_proj = nn.Linear(d_model, index_heads, bias=False)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Scores ``(B, 1, T_q, T_k)``; TypeError / ValueError for inputs that are not float
        ``(B, T, d_model)`` tensors of the weights' dtype with one batch size."""
        weight = self.q_proj.weight
        for name, t in (("x", x), ("context", context)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype != weight.dtype:
                raise TypeError(f"{name} must be a float tensor of the weights' dtype {weight.dtype}; "
                                f"got {getattr(t, 'dtype', type(t).__name__)}")
            if t.dim() != 3 or t.shape[-1] != self.d_model or t.shape[0] != x.shape[0]:
                raise ValueError(f"x and context must have shape (B, T, d_model={self.d_model}) with one B; "
                                 f"got {tuple(x.shape)} and {tuple(getattr(context, 'shape', ()))}")
        B, T_q, _ = x.shape
        q = self.q_proj(x).view(B, T_q, self.index_heads, self.index_dim)  # (B, T_q, H_I, d_I)
        k = self.k_proj(context)  # (B, T_k, d_I)
        scores = torch.einsum("bthd,bsd->bths", q, k).relu()  # (B, T_q, H_I, T_k)
        return torch.einsum("bths,bth->bts", scores, self.w_proj(x)).unsqueeze(1)  # (B, 1, T_q, T_k)


class TopKAttention(MultiHeadAttention):
    """Causal multi-head attention in which each query attends to its ``top_k`` keys only (the idea of DSA).

    Args:
        d_model, n_heads, n_kv_heads, **kwargs: as :class:`attnlib.attention.MultiHeadAttention`
            (causal self-attention only; no sliding window).
        top_k: keys per query, >= 1; ``top_k >= T`` is dense causal attention.
        indexer: ``False``: each head picks keys by its own ``q·k``; ``True``: a :class:`LightningIndexer`
            picks one set of keys per query for every head (no KV cache then: its keys are not cached).
        index_heads, index_dim: the indexer's size.

    Raises:
        ValueError: ``top_k < 1``; a mask, context or (with the indexer) cache passed to forward.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, top_k: int,
                 indexer: bool = False, index_heads: int = 4, index_dim: int = 16, **kwargs) -> None:
        positive_int("top_k", top_k)
        if not isinstance(indexer, bool):
            raise TypeError(f"indexer must be True or False; got {indexer!r}")
        if kwargs.get("sliding_window") is not None or kwargs.get("causal") is False:
            raise ValueError("TopKAttention is causal self-attention without a sliding_window")
        super().__init__(d_model, n_heads, n_kv_heads, **kwargs)
        self.top_k = top_k
        self.indexer = LightningIndexer(d_model, index_heads, index_dim) if indexer else None

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None, positions: torch.Tensor | None = None,
                return_weights: bool = False) -> torch.Tensor:
        """``(B, T, d_model)`` → ``(B, T, d_model)``, optionally continuing a KV cache (own-``q·k`` mode)."""
        if context is not None or mask is not None or attention_mask is not None or return_weights:
            raise ValueError("TopKAttention takes no context, mask, attention_mask or return_weights")
        if cache is not None and self.indexer is not None:
            raise ValueError("TopKAttention(indexer=True) cannot use a cache: the indexer's keys are not cached")
        check_layer_inputs(self, x, None, None, None, cache, positions)
        q, k, v = self.project(x, None, cache, positions)
        group = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, n_kv, T, hd) -> (B, h, T, hd)
        scores = None if self.indexer is None else self.indexer(x, x)
        y = topk_attention(q, k, v, self.top_k, scores, self.scale)
        return self.resid_dropout(self.merge(y))
