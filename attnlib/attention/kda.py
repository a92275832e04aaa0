"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi Linear (Kimi Team 2025). Chapter 21.

KDA is gated DeltaNet (:mod:`attnlib.attention.deltanet`, chapter 18) with a finer forget gate:
instead of one decay ``α_t ∈ (0, 1]`` per head and token, one per *key channel*,
``α_t ∈ (0, 1]^{d_k}``, so each row of the ``d_k × d_v`` state fades at its own rate
(Kimi Team 2025, "Kimi Linear", arXiv:2510.26692, §3; the state written ``d_k × d_v`` as in
``fla`` and transformers' ``kimi_linear``, the paper writes its transpose):

    S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ,      o_t = S_tᵀ (q_t / √d_k)

(decay first, then the delta rule's read-and-correct write with step ``β_t``). A scalar gate is the
case ``α_t = a_t 1``. :func:`kimi_delta_rule` computes it token by token or chunk by chunk; both run
:func:`~attnlib.attention.deltanet.gated_delta_rule`, whose gate may be per head or per channel.

The layer :class:`KimiDeltaAttention` follows transformers' ``KimiLinearDeltaAttention``:

    q, k, v = SiLU(ShortConv(W_q x, W_k x, W_v x))         (depthwise causal convolution, width 4)
    q, k ← q / ‖q‖, k / ‖k‖ (per head)     β = σ(W_b x)    (one write strength per head)
    g = -exp(A_log) · softplus(W_f↑ W_f↓ x + dt_bias)     (low-rank, one log decay per channel)
    o = out_proj(RMSNorm(KDA(q, k, v, β, g)) ⊙ σ(W_g↑ W_g↓ x))   (low-rank sigmoid output gate)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import divisible, finite_number, positive_int, probability
from attnlib.attention.deltanet import decay_parameters, gated_delta_rule
from attnlib.attention.linear import RecurrentLayer, check_recurrent_input, short_convolution
from attnlib.cache.recurrent import RecurrentState

__all__ = ["KimiDeltaAttention", "kimi_delta_rule", "short_convolution"]


def kimi_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    mode: str = "chunked",
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Kimi delta rule (gated delta rule, one decay per key channel), recurrent or chunked. Chapter 21.

    Args:
        q, k: ``(B, n_heads, T, d_k)`` float; keys of unit length (the layer normalises them).
        v: ``(B, n_heads, T, d_v)``, q's dtype.
        beta: ``(B, n_heads, T)`` in [0, 1]: each token's write strength.
        g: ``(B, n_heads, T, d_k)`` log decays ``<= 0``, one per key channel: ``α_t = exp(g_t)``.
        mode: ``"recurrent"`` (token by token, the equation above) or ``"chunked"`` (the WY/UT form
            inside chunks of ``chunk_size`` positions, the state between them): equal to rounding.
        chunk_size: >= 1. scale: query scale, default ``1 / √d_k``.
        initial_state: ``(B, n_heads, d_k, d_v)`` from an earlier call; default zeros.

    Returns:
        ``(o (B, n_heads, T, d_v), final state (B, n_heads, d_k, d_v))`` in q's dtype.

    Raises:
        TypeError: a non-float tensor (named), q, k, v of different dtypes.
        ValueError: ``g`` not ``(B, n_heads, T, d_k)``, other mismatched shapes, ``beta`` outside
            [0, 1], ``g > 0``, NaN, an unknown mode, ``chunk_size < 1``, a state of the wrong shape.
    """
    if not isinstance(g, torch.Tensor) or not g.is_floating_point():
        raise TypeError(f"g must be a floating point tensor; got {getattr(g, 'dtype', type(g).__name__)}")
    if isinstance(q, torch.Tensor) and g.shape != q.shape:
        raise ValueError(f"g must have shape (B, n_heads, T, d_k) = {tuple(q.shape)} (one log decay per key "
                         f"channel, q's shape); got {tuple(g.shape)}")
    return gated_delta_rule(q, k, v, beta, g, mode, chunk_size=chunk_size, scale=scale,
                            initial_state=initial_state, return_state=True)


class KimiDeltaAttention(RecurrentLayer):
    """A Kimi Delta Attention layer (transformers' ``KimiLinearDeltaAttention``) with the GPT block's interface.

    Takes ``x (B, T, d_model)`` and returns ``(B, T, d_model)``; with a
    :class:`~attnlib.cache.RecurrentState` (``layer.new_cache(block_size)``) it continues a sequence,
    keeping ``(S (B, n_heads, head_dim, head_dim), conv inputs (B, 3·n_heads·head_dim, K - 1))``.
    Parameter names are transformers' (``forget_gate.`` dropped, ``o_norm`` → ``norm_weight``,
    ``o_proj`` → ``out_proj``, ``A_log`` of shape ``(n_heads,)``). Chapter 21; Kimi Linear §3-4.

    Args:
        d_model: model width (``hidden_size``). n_heads: ``linear_num_heads``.
        head_dim: ``linear_head_dim`` (default ``d_model // n_heads``, then ``n_heads`` must divide
            ``d_model``); keys and values share it.
        conv_kernel_size: the short convolution's width ``K`` (``linear_conv_kernel_dim``, 4).
        eps: the output RMSNorm's (``rms_norm_eps``, 1e-5). block_size: longest sequence (``None``: no limit).
        dropout: on the output, in [0, 1). chunk_size: for the chunked form (``T > 1``).

    Raises:
        TypeError / ValueError: a size that is not a positive int, ``eps`` not a positive number,
            ``dropout`` outside [0, 1) (named); in ``forward``, as :func:`check_recurrent_input`.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, conv_kernel_size: int = 4,
                 eps: float = 1e-5, block_size: int | None = None, dropout: float = 0.0,
                 chunk_size: int = 64) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("n_heads", n_heads)
        if head_dim is None:
            divisible("d_model", d_model, "n_heads", n_heads)
            head_dim = d_model // n_heads
        for name, value in (("head_dim", head_dim), ("conv_kernel_size", conv_kernel_size), ("chunk_size", chunk_size)):
            positive_int(name, value)
        if block_size is not None:
            positive_int("block_size", block_size)
        finite_number("eps", eps, above=0.0)
        probability("dropout", dropout)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.block_size, self.chunk_size, self.eps = block_size, chunk_size, eps
        inner = n_heads * head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, inner, bias=False) for _ in range(3))
        self.conv1d = nn.Conv1d(3 * inner, 3 * inner, conv_kernel_size, groups=3 * inner, bias=False)
        self.f_a_proj = nn.Linear(d_model, head_dim, bias=False)  # the forget gate, rank head_dim
        self.f_b_proj = nn.Linear(head_dim, inner, bias=False)
        self.A_log, self.dt_bias = decay_parameters(n_heads, inner)  # one rate per channel
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)  # β, one per head
        self.g_a_proj = nn.Linear(d_model, head_dim, bias=False)  # the output gate, rank head_dim
        self.g_b_proj = nn.Linear(head_dim, inner, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(head_dim))
        self.out_proj = nn.Linear(inner, d_model, bias=False)
        self.resid_dropout = nn.Dropout(dropout)

    def state_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one sequence's state: ``n_heads · head_dim²`` (S) + ``3 · n_heads · head_dim · (K - 1)`` (conv)."""
        dtype = dtype or self.out_proj.weight.dtype
        inner = self.n_heads * self.head_dim
        numbers = inner * self.head_dim + 3 * inner * (self.conv1d.kernel_size[0] - 1)
        return numbers * torch.empty((), dtype=dtype).element_size()

    def forward(self, x: torch.Tensor, *, cache: RecurrentState | None = None, attention_mask: None = None,
                positions: None = None, return_weights: bool = False) -> torch.Tensor:
        """``(B, T, d_model)`` → ``(B, T, d_model)``; with a cache, continue the cached sequence."""
        B, T = check_recurrent_input(self, x, cache, return_weights, attention_mask, positions, "a Kimi Delta Attention layer")

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, T, h·hd) -> (B, h, T, hd)

        S, conv_state = (None, None) if cache is None or cache.read() is None else cache.read()
        qkv, conv_state = short_convolution(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1),
                                            self.conv1d.weight, conv_state)
        q, k, v = (heads(t) for t in qkv.split(self.n_heads * self.head_dim, dim=-1))
        q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # fla's l2norm
        beta = self.b_proj(x).sigmoid().transpose(1, 2)  # (B, h, T)
        decay = F.softplus(self.f_b_proj(self.f_a_proj(x)) + self.dt_bias)  # (B, T, h·hd), >= 0
        g = -self.A_log.exp()[:, None, None] * heads(decay)  # (B, h, T, hd): one log decay per channel
        mode = "recurrent" if T == 1 else "chunked"
        y, S = kimi_delta_rule(q, k, v, beta, g, mode, chunk_size=self.chunk_size, initial_state=S)
        if cache is not None:
            cache.write((S, conv_state), T)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight  # per-head RMSNorm
        y = y * heads(self.g_b_proj(self.g_a_proj(x))).sigmoid()  # the output gate
        return self.resid_dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, -1)))

