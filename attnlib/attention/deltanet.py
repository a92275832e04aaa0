"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024), the linear-attention layer of Qwen3-Next and Qwen3.5.
Chapters 18 and 21.

Linear attention only adds to its state ``S`` (``d_k × d_v`` per head). The *delta rule*
(Schlag et al. 2021; Yang et al. 2024, "Parallelizing linear transformers with the delta rule")
first reads what ``S`` already stores under the key ``k_t`` and writes only the correction,
with a step size ``β_t ∈ (0, 1)``; the *gate* ``α_t = exp(g_t) ∈ (0, 1]`` lets the state decay
(Mamba-2's forgetting). With keys of unit length:

    S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,      o_t = S_tᵀ (q_t / √d_k)

(the gated delta rule of Gated DeltaNet, with the state written ``d_k × d_v`` as in the ``fla``
library; the paper writes its transpose). :func:`gated_delta_rule` computes it token by token
(``"recurrent"``) or chunk by chunk (``"chunked"``: inside a chunk the updates are folded into
matrix products by the WY/UT representation of Yang et al. 2024, NeurIPS, as in ``fla``'s
``chunk_gated_delta_rule``). :class:`GatedDeltaNet` is the layer; chapter 21 gives it what Qwen3-Next and
Qwen3.5 add (a short causal convolution over q, k, v, grouped value heads, head widths of their own).

The gate may also be one decay per key channel, ``α_t ∈ (0, 1]^{d_k}`` (Kimi Delta Attention,
chapter 21, :mod:`attnlib.attention.kda`): the state decays first, each row at its own rate, then
takes the delta-rule step, ``S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ`` (for a
scalar ``α_t`` the two orders agree, and this is the equation above).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import divisible, finite_number, positive_int, probability
from attnlib.attention.linear import RecurrentLayer, check_recurrent_input, short_convolution
from attnlib.cache.recurrent import RecurrentState

__all__ = ["DELTA_MODES", "GatedDeltaNet", "decay_parameters", "gated_delta_rule"]

DELTA_MODES = ("recurrent", "chunked")


def _check(q, k, v, beta, g) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g)):
        if t is None and name == "g":
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor; got {getattr(t, 'dtype', type(t).__name__)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; use one device")
        if name in ("k", "v") and t.dtype != q.dtype:
            raise TypeError(f"q, k, v must share a dtype; got q {q.dtype} and {name} {t.dtype}")
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, n_heads, T, d_k); got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape (B, n_heads, T, d_v) = {tuple(q.shape[:3])} + (d_v,); got {tuple(v.shape)}")
    if q.shape[2] == 0 or q.shape[3] == 0:
        raise ValueError(f"q holds no positions or has width d_k = 0; got shape {tuple(q.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must have shape (B, n_heads, T) = {tuple(q.shape[:3])}; got {tuple(beta.shape)}")
    if g is not None and g.shape not in (q.shape[:3], q.shape):
        raise ValueError(f"g must have shape (B, n_heads, T) = {tuple(q.shape[:3])} (one decay per head) or "
                         f"(B, n_heads, T, d_k) = {tuple(q.shape)} (one per key channel); got {tuple(g.shape)}")
    for name, t, bad in (("beta", beta, "lie in [0, 1] (a step size)"), ("g", g, "be <= 0 (a log decay)")):
        if t is not None and t.isnan().any():
            raise ValueError(f"{name} holds NaN; it must {bad}")
    if ((beta < 0) | (beta > 1)).any():
        raise ValueError(f"beta must lie in [0, 1] (a step size); got values in [{beta.min().item():.3g}, {beta.max().item():.3g}]")
    if g is not None and (g > 0).any():
        raise ValueError(f"g is a log decay and must be <= 0; got a maximum of {g.max().item():.3g}")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    mode: str = "chunked",
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    return_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, recurrent or chunked (equal outputs).

    Args:
        q, k: ``(B, n_heads, T, d_k)`` float; keys should have unit length (the layer L2-normalises
            them: then ``I - β k kᵀ`` never amplifies the state).
        v: ``(B, n_heads, T, d_v)``.
        beta: ``(B, n_heads, T)`` in [0, 1], the write strength of each token (used in q's dtype, as g).
        g: ``(B, n_heads, T)`` log decays ``<= 0`` (``α_t = exp(g_t)``; ``-inf`` empties the state),
            or ``(B, n_heads, T, d_k)``: one log decay per key channel (``Diag(α_t)``, Kimi Delta
            Attention); ``None`` = no gate (DeltaNet).
        mode: ``"recurrent"`` (one token at a time) or ``"chunked"``.
        chunk_size: positions per chunk (``"chunked"``), >= 1; checked in every mode.
        scale: query scale, a finite number; default ``1 / √d_k``.
        initial_state: ``(B, n_heads, d_k, d_v)`` state from an earlier call.
        return_state: also return the final state.

    Returns:
        ``(B, n_heads, T, d_v)``, or ``(output, state (B, n_heads, d_k, d_v))``.

    Raises:
        TypeError: a non-float tensor, q, k, v of different dtypes, a ``scale`` or
            ``initial_state`` of the wrong type.
        ValueError: tensors on different devices, mismatched shapes, ``T = 0`` or ``d_k = 0``,
            ``beta`` outside [0, 1] or NaN, ``g > 0`` or NaN, an unknown mode, ``chunk_size < 1``,
            a ``scale`` that is not finite, a state of the wrong shape (named).
    """
    _check(q, k, v, beta, g)
    if mode not in DELTA_MODES:
        raise ValueError(f"mode={mode!r} is not one of {DELTA_MODES}")
    positive_int("chunk_size", chunk_size)
    if scale is not None:
        finite_number("scale", scale)
    B, h, T, d_k = q.shape
    S = q.new_zeros(B, h, d_k, v.shape[-1])  # (B, h, d_k, d_v)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a tensor (B, n_heads, d_k, d_v); got {type(initial_state).__name__}")
        if initial_state.shape != S.shape:
            raise ValueError(f"initial_state must have shape {tuple(S.shape)}; got {tuple(initial_state.shape)}")
        S = initial_state.to(S)
    beta = beta.to(q.dtype)  # computed in q's dtype (under autocast the gates may come in float32)
    g = torch.zeros_like(beta) if g is None else g.to(q.dtype)
    g = g if g.dim() == 4 else g.unsqueeze(-1)  # (B, h, T, w): w = 1 (one decay per head) or d_k (per channel)
    q = q * (d_k**-0.5 if scale is None else scale)
    step = _recurrent if mode == "recurrent" else _chunked
    out, S = step(q, k, v, beta, g, S, chunk_size)
    return (out, S) if return_state else out


def _recurrent(q, k, v, beta, g, S, chunk_size):
    """Token by token: decay, read what the state holds under k_t, write β_t times the correction."""
    outs = []
    for t in range(q.shape[2]):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None]  # (B, h, d_k), (B, h, d_v), (B, h, 1)
        S = S * g[:, :, t, :, None].exp()  # forget: Diag(α_t) S (one α_t for every row when w = 1)
        predicted = (k_t.unsqueeze(-1) * S).sum(-2)  # Sᵀ k_t: what the state returns for k_t, (B, h, d_v)
        S = S + k_t.unsqueeze(-1) * (b_t * (v_t - predicted)).unsqueeze(-2)  # + k_t (β_t (v_t - Sᵀk_t))ᵀ
        outs.append((q[:, :, t].unsqueeze(-1) * S).sum(-2))  # o_t = Sᵀ q_t
    return torch.stack(outs, dim=2), S


def _chunked(q, k, v, beta, g, S, C):
    """Chunk by chunk. Inside a chunk (positions r = 1..C, cumulative log decay γ_r), the state is

        S_r = e^{γ_r} S_0 + Σ_{s≤r} e^{γ_r-γ_s} k_s u_sᵀ,   u_r = β_r (v_r - e^{γ_r} S_0ᵀ k_r - Σ_{s<r} e^{γ_r-γ_s} (k_r·k_s) u_s)

    so the rows u solve a unit lower-triangular system A U = β V - β e^{γ} K S_0 with
    A = I + strictly_lower(β (K Kᵀ ⊙ Γ)), Γ_rs = e^{γ_r-γ_s} (the UT transform: U = A⁻¹βV, W = A⁻¹ β e^γ K).
    With one decay per channel, γ_r is a vector, e^{γ_r} S_0 is Diag(e^{γ_r}) S_0 and every product
    a_r·b_s e^{γ_r-γ_s} becomes Σ_c a_rc b_sc e^{γ_rc-γ_sc} (:func:`_decayed_scores`).
    """
    B, h, T, d_k = q.shape
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # no triangular solve in half precision on every device
        q, k, v, beta, g, S = (t.float() for t in (q, k, v, beta, g, S))
    # exp(g) is 0 below log(smallest subnormal): clamping there keeps every product of decays, and
    # keeps the cumulative sums finite (g = -inf would give -inf - -inf = NaN below)
    g = g.clamp(min=math.log(torch.finfo(g.dtype).tiny * torch.finfo(g.dtype).eps) - 1)
    C = min(C, T)  # a chunk longer than the sequence would only add padding
    pad = (C - T % C) % C  # padded positions: β = 0 (no write), g = 0 (no decay), sliced off at the end
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    n = (T + pad) // C
    q, k, v, g = (t.reshape(B, h, n, C, t.shape[-1]) for t in (q, k, v, g))  # (B, h, T, d) -> (B, h, n, C, d)
    beta = beta.reshape(B, h, n, C, 1)
    gamma = g.cumsum(-2)  # (B, h, n, C, w): log of the decay from the chunk's start to r
    A = torch.eye(C, dtype=q.dtype, device=q.device) + (beta * _decayed_scores(k, k, gamma)).tril(-1)
    rhs = torch.cat([beta * v, beta * gamma.exp() * k], dim=-1)  # [β V, β e^γ ⊙ K]: (.., C, d_v + d_k)
    U, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([v.shape[-1], d_k], -1)
    QK = _decayed_scores(q, k, gamma)  # decayed causal scores inside the chunk, diagonal included
    outs = []
    for i in range(n):  # the only sequential part: one state update per chunk
        new = U[:, :, i] - W[:, :, i] @ S  # the corrections u_r given the state entering the chunk
        outs.append((q[:, :, i] * gamma[:, :, i].exp()) @ S + QK[:, :, i] @ new)
        last = gamma[:, :, i, -1:]  # (B, h, 1, w): the whole chunk's log decay
        S = last.exp().transpose(-2, -1) * S + (k[:, :, i] * (last - gamma[:, :, i]).exp()).transpose(-2, -1) @ new
    return torch.cat(outs, dim=2)[:, :, :T].to(dtype), S.to(dtype)


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``Σ_c a_rc b_sc e^{γ_rc - γ_sc}`` for ``s <= r``, 0 above: ``(.., C, d) x2, (.., C, w) -> (.., C, C)``.

    With ``w = 1`` (one decay per head) the decay leaves the sum: ``(a bᵀ) ⊙ e^{γ_r - γ_s}``. With
    ``w = d`` every channel has its own; the exponents are formed as differences (never ``e^{-γ_s}``
    alone, which overflows in a long chunk), at the price of a ``(C, C, d)`` tensor.
    """
    C = gamma.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril()
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]  # (.., C, C, w): γ_r - γ_s, > 0 above the diagonal
    decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
    if gamma.shape[-1] == 1:
        return (a @ b.transpose(-2, -1)) * decay[..., 0]
    return torch.einsum("...rc,...sc,...rsc->...rs", a, b, decay)


def decay_parameters(n_heads: int, n_rates: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Mamba-2's decay parameters as ``fla`` initialises them: ``A_log`` ``(n_heads,)`` with
    ``A ~ U(1, 16)``, and ``dt_bias`` ``(n_rates,)`` with ``softplus(dt_bias) = dt``, ``log dt ~ U(log 1e-3, log 1e-1)``.
    The log decay is then ``g = -exp(A_log) · softplus(a + dt_bias)`` (one rate per head, or per channel)."""
    A = torch.empty(n_heads).uniform_(1, 16)
    dt = torch.exp(torch.empty(n_rates).uniform_(math.log(1e-3), math.log(1e-1)))
    return nn.Parameter(A.log()), nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus of dt


class GatedDeltaNet(RecurrentLayer):
    """A gated DeltaNet layer with the GPT block's attention interface (Qwen3-Next's and Qwen3.5's linear layer).
    Chapters 18 and 21.

    ``x → q, k, v`` (one fused projection; with ``conv_size``, a short causal depthwise convolution and SiLU
    over the three, as Qwen3-Next and Qwen3.5; q and k L2-normalised per head), ``β = σ(W_b x)``,
    ``g = -exp(A_log) · softplus(W_a x + dt_bias)`` (Mamba-2's decay, as Qwen3-Next), then
    :func:`gated_delta_rule`, a per-head RMSNorm gated by ``SiLU(W_z x)`` (Qwen's ``RMSNormGated``), and
    ``out_proj``. With ``n_v_heads > n_heads`` each query/key head serves ``n_v_heads / n_heads`` consecutive
    value heads (grouped value heads, as GQA groups query heads); the state is ``(B, n_v_heads, head_k_dim,
    head_v_dim)``. Chapter 18's layer is the default: no convolution, ``head_k_dim = head_v_dim = d_model //
    n_heads``, as many value heads as query/key heads.

    Args:
        d_model, n_heads: width and query/key heads (``n_heads`` divides ``d_model`` unless both head widths are
            given). block_size: longest sequence (``None``: no limit). dropout: on the output, in [0, 1).
        bias: biases on ``qkv`` and ``out_proj``. chunk_size: for the chunked form (T > 1).
        n_v_heads: value heads (default ``n_heads``), a multiple of ``n_heads``.
        head_k_dim, head_v_dim: query/key and value head widths (default ``d_model // n_heads``).
        conv_size: ``None`` or the kernel of the short causal convolution (transformers' ``linear_conv_kernel_dim``;
            its last ``conv_size - 1`` inputs join the recurrent state).
        norm_eps: the gated RMSNorm's epsilon. l2norm: ``"clamp"`` (``x / max(‖x‖, 10⁻⁶)``, torch's
            ``F.normalize``, chapter 18) or ``"fla"`` (``x / √(‖x‖² + 10⁻⁶)``, fla's and transformers' ``l2norm``).

    Attributes:
        qkv: ``nn.Linear(d_model, 2 · n_heads · head_k_dim + n_v_heads · head_v_dim)``, rows ``[W_q; W_k; W_v]``.
        conv1d: ``nn.Conv1d`` over those channels, depthwise, no bias (weight ``(channels, 1, conv_size)``), or None.
        gate: ``W_z`` to ``n_v_heads · head_v_dim``. beta_decay: ``[W_b; W_a]``, ``2 · n_v_heads`` rows.
        A_log, dt_bias: ``(n_v_heads,)``. norm_weight: ``(head_v_dim,)``. out_proj: back to ``d_model``.

    Shapes: ``(B, T, d_model)`` → ``(B, T, d_model)``.

    Raises:
        TypeError / ValueError: a size that is not a positive int, ``d_model`` not divisible by ``n_heads`` (head
            widths not given), ``n_v_heads`` not a multiple of ``n_heads``, an unknown ``l2norm``, a bad ``norm_eps``.
    """

    def __init__(self, d_model: int, n_heads: int, *, block_size: int | None = None, dropout: float = 0.0,
                 bias: bool = True, chunk_size: int = 64, n_v_heads: int | None = None, head_k_dim: int | None = None,
                 head_v_dim: int | None = None, conv_size: int | None = None, norm_eps: float = 1e-6,
                 l2norm: str = "clamp") -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("chunk_size", chunk_size)):
            positive_int(name, value)
        for name, value in (("block_size", block_size), ("n_v_heads", n_v_heads), ("head_k_dim", head_k_dim),
                            ("head_v_dim", head_v_dim), ("conv_size", conv_size)):
            if value is not None:
                positive_int(name, value)
        if head_k_dim is None or head_v_dim is None:
            divisible("d_model", d_model, "n_heads", n_heads)
        n_v_heads = n_heads if n_v_heads is None else n_v_heads
        divisible("n_v_heads", n_v_heads, "n_heads", n_heads)
        probability("dropout", dropout)
        if finite_number("norm_eps", norm_eps) <= 0:
            raise ValueError(f"norm_eps={norm_eps!r} must be > 0")
        if l2norm not in ("clamp", "fla"):
            raise ValueError(f"l2norm={l2norm!r} is not one of ('clamp', 'fla')")
        self.d_model, self.n_heads, self.n_v_heads = d_model, n_heads, n_v_heads
        self.head_k_dim = d_model // n_heads if head_k_dim is None else head_k_dim
        self.head_v_dim = d_model // n_heads if head_v_dim is None else head_v_dim
        self.head_dim = self.head_k_dim  # chapter 18's name (one width for all)
        self.block_size, self.chunk_size, self.norm_eps, self.l2norm = block_size, chunk_size, norm_eps, l2norm
        self.key_dim, self.value_dim = n_heads * self.head_k_dim, n_v_heads * self.head_v_dim
        self.qkv = nn.Linear(d_model, 2 * self.key_dim + self.value_dim, bias=bias)
        self.gate = nn.Linear(d_model, self.value_dim, bias=False)  # z: the output gate
        self.beta_decay = nn.Linear(d_model, 2 * n_v_heads, bias=False)  # b and a, one each per value head
        self.A_log, self.dt_bias = decay_parameters(n_v_heads, n_v_heads)
        self.norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.out_proj = nn.Linear(self.value_dim, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        channels = 2 * self.key_dim + self.value_dim
        self.conv1d = None if conv_size is None else nn.Conv1d(channels, channels, conv_size, groups=channels, bias=False)

    def state_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the state of one sequence: ``n_v_heads · head_k_dim · head_v_dim`` numbers, and the
        convolution's last ``conv_size - 1`` inputs of every channel."""
        dtype = dtype or self.out_proj.weight.dtype
        conv = 0 if self.conv1d is None else self.conv1d.in_channels * (self.conv1d.kernel_size[0] - 1)
        return (self.n_v_heads * self.head_k_dim * self.head_v_dim + conv) * torch.empty((), dtype=dtype).element_size()

    def _normalize(self, t: torch.Tensor) -> torch.Tensor:
        if self.l2norm == "fla":
            return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)
        return F.normalize(t, dim=-1, eps=1e-6)

    def forward(self, x: torch.Tensor, *, cache: RecurrentState | None = None, attention_mask: None = None,
                positions: None = None, return_weights: bool = False) -> torch.Tensor:
        """``(B, T, d_model)`` → ``(B, T, d_model)``; with a cache, continue the cached sequence (its state holds
        ``S (B, n_v_heads, head_k_dim, head_v_dim)``, and with a convolution its last inputs)."""
        B, T = check_recurrent_input(self, x, cache, return_weights, attention_mask, positions, "a gated DeltaNet layer")

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(B, T, n, t.shape[-1] // n).transpose(1, 2)  # (B, T, n * hd) -> (B, n, T, hd)

        state = None if cache is None else cache.read()
        mixed, conv_state = self.qkv(x), None
        if self.conv1d is not None:
            mixed, conv_state = short_convolution(mixed, self.conv1d.weight, None if state is None else state[1])
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = self._normalize(heads(q, self.n_heads)), self._normalize(heads(k, self.n_heads)), heads(v, self.n_v_heads)
        if self.n_v_heads != self.n_heads:  # each q/k head serves a group of consecutive value heads
            q, k = (t.repeat_interleave(self.n_v_heads // self.n_heads, dim=1) for t in (q, k))
        b, a = self.beta_decay(x).transpose(1, 2).chunk(2, dim=1)  # (B, 2 h_v, T) -> 2 x (B, h_v, T)
        beta = b.sigmoid()
        g = -self.A_log.exp()[:, None] * F.softplus(a + self.dt_bias[:, None])  # (B, h_v, T), <= 0
        y, S = gated_delta_rule(q, k, v, beta, g, "recurrent" if T == 1 else "chunked", chunk_size=self.chunk_size,
                                initial_state=None if state is None else state[0], return_state=True)
        if cache is not None:
            cache.write((S,) if conv_state is None else (S, conv_state), T)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight  # per-head RMSNorm
        y = y * F.silu(heads(self.gate(x), self.n_v_heads))  # gated by z (Qwen's RMSNormGated)
        return self.resid_dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, self.value_dim)))
