"""Linear attention (Katharopoulos et al. 2020): softmax replaced by a feature map, so the
T×T matrix and the growing KV cache are replaced by a fixed-size state. Chapter 18.

With a positive feature map ``φ``, causal attention becomes

    o_i = φ(q_i)ᵀ S_i / (φ(q_i)ᵀ z_i + eps),   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,   z_i = Σ_{j≤i} φ(k_j)

(§3.2–3.4 of the paper; ``eps = 1e-6`` as in their ``fast_transformers`` code). Three
ways to compute the same numbers: ``"parallel"`` (the masked T×T matrix ``φ(Q) φ(K)ᵀ``),
``"recurrent"`` (an RNN whose state is ``(S, z)``, ``d_φ × (d_v + 1)`` numbers per head
whatever T) and ``"chunked"`` (the matrix inside chunks, the state between them).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import divisible, finite_number, positive_int, probability
from attnlib.cache.recurrent import RecurrentState

__all__ = ["FEATURE_MAPS", "LINEAR_MODES", "LinearAttention", "RecurrentLayer", "check_feature_map", "linear_attention",
           "short_convolution"]

#: Feature maps known to be positive, by name: the weights ``φ(q)·φ(k)`` they give are >= 0.
FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu+1": lambda x: F.elu(x) + 1.0,  # Katharopoulos et al. 2020, eq. 7: > 0 everywhere
    "relu": F.relu,
    "softplus": F.softplus,
}
#: Names refused with a reason: each gives negative weights, so the normaliser can be 0 or negative.
REFUSED_MAPS = ("identity", "none", "linear", "tanh")
LINEAR_MODES = ("parallel", "recurrent", "chunked")


def check_feature_map(feature_map: str | Callable, width: int = 8, dtype: torch.dtype = torch.float32,
                      device: torch.device | str | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Resolve ``feature_map`` to a function, refusing one that can produce negative values.

    A name must be a key of :data:`FEATURE_MAPS`. A callable is probed on inputs from -8 to 8 of
    shape ``(1, 1, 8, width)`` in ``dtype`` on ``device`` (as the queries it will see; the identity,
    ``tanh``, ``sin``, ... shows a negative value there), and
    :func:`linear_attention` checks its outputs on the real queries and keys as well.

    Raises:
        ValueError: a refused or unknown name, or a callable with a negative output on the probe.
        TypeError: neither a str nor a callable.
    """
    if isinstance(feature_map, str):
        if feature_map in FEATURE_MAPS:
            return FEATURE_MAPS[feature_map]
        if feature_map.lower() in REFUSED_MAPS:
            raise ValueError(f"feature_map={feature_map!r} can produce negative weights φ(q)·φ(k) (and a zero "
                             f"normaliser); use a positive map: {tuple(FEATURE_MAPS)}")
        raise ValueError(f"feature_map={feature_map!r} is not one of {tuple(FEATURE_MAPS)} (or a callable)")
    if not callable(feature_map):
        raise TypeError(f"feature_map must be a name or a callable; got {type(feature_map).__name__}")
    probe = torch.linspace(-8.0, 8.0, 8 * width, dtype=dtype, device=device).view(1, 1, 8, width)  # both signs
    out = feature_map(probe)
    _positive(feature_map, out, "on the probe inputs in [-8, 8]", dtype)
    if torch.isnan(out).any():  # finite inputs: a NaN comes from the map itself
        raise ValueError(f"feature_map={getattr(feature_map, '__name__', repr(feature_map))} produced NaN "
                         "on the probe inputs in [-8, 8]")
    return feature_map


def _positive(fn: Callable, out: object, where: str, dtype: torch.dtype) -> None:
    name = getattr(fn, "__name__", repr(fn))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"feature_map={name} must return a tensor; got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"feature_map={name} must return its input's dtype {dtype}; got {out.dtype}")
    if (out < 0).any():
        raise ValueError(f"feature_map={name} produced a negative value ({out.min().item():.3g}) {where}: "
                         "it can give negative attention weights; use a positive map such as 'elu+1'")


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor; got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() < 2 or t.shape[-2] == 0:
            raise ValueError(f"{name} must have shape (..., T, width) with T >= 1; got {tuple(t.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a width d_k >= 1; got shape {tuple(q.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (..., T, d_k); got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v must have shape (..., T, d_v) with q's leading dims {tuple(q.shape[:-1])}; "
                         f"got {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str = "parallel",
    *,
    feature_map: str | Callable = "elu+1",
    chunk_size: int = 64,
    eps: float = 1e-6,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal linear attention, in any of three equal forms (Katharopoulos et al. 2020, §3.2–3.4).

    Args:
        q, k: ``(..., T, d_k)`` float (e.g. ``(B, n_heads, T, head_dim)``); v: ``(..., T, d_v)``.
        mode: ``"parallel"``, ``"recurrent"`` or ``"chunked"``: equal outputs (to rounding).
        feature_map: a name from :data:`FEATURE_MAPS` (default ``"elu+1"``) or a callable
            ``(..., d_k) -> (..., d_φ)`` whose outputs are >= 0 (checked).
        chunk_size: positions per chunk (``"chunked"`` only; checked in every mode), >= 1.
        eps: added to the normaliser ``φ(q_i)·z_i``; a finite number >= 0 (with 0, a query whose features
            meet no key's gets a zero output, as an attention row with nothing to see).
        initial_state: ``(S, z)`` from an earlier call (``return_state=True``): continue that sequence.
        return_state: also return the final state ``(S (..., d_φ, d_v), z (..., d_φ))``.

    Returns:
        ``(..., T, d_v)`` in q's dtype, or ``(output, (S, z))``.

    Raises:
        TypeError: non-float or mixed-dtype tensors, a feature map that is not a name or callable.
        ValueError: mismatched shapes or devices, ``T = 0`` or ``d_k = 0``, an unknown mode,
            ``chunk_size < 1``, ``eps`` negative or not finite, a feature map that is refused or
            gives a negative value or NaN (named), an ``initial_state`` of the wrong shape.
    """
    _check_qkv(q, k, v)
    if mode not in LINEAR_MODES:
        raise ValueError(f"mode={mode!r} is not one of {LINEAR_MODES}")
    positive_int("chunk_size", chunk_size)
    finite_number("eps", eps, minimum=0.0)
    if initial_state is not None and not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2
                                          and all(isinstance(t, torch.Tensor) for t in initial_state)):
        raise TypeError(f"initial_state must be a pair of tensors (S, z); got {type(initial_state).__name__}")
    phi = check_feature_map(feature_map, q.shape[-1], q.dtype, q.device)
    fq, fk = phi(q), phi(k)  # (..., T, d_φ)
    _positive(phi, fq, "on q", q.dtype)
    _positive(phi, fk, "on k", q.dtype)
    if fq.shape[:-1] != q.shape[:-1] or fq.shape != fk.shape:
        raise ValueError(f"feature_map must map (..., T, d_k) to (..., T, d_φ); got {tuple(fq.shape)}, {tuple(fk.shape)}")
    S = fq.new_zeros((*fq.shape[:-2], fq.shape[-1], v.shape[-1]))  # (..., d_φ, d_v)
    z = fq.new_zeros(fq.shape[:-2] + fq.shape[-1:])  # (..., d_φ)
    if initial_state is not None:
        S0, z0 = initial_state
        if S0.shape != S.shape or z0.shape != z.shape:
            raise ValueError(f"initial_state must be (S {tuple(S.shape)}, z {tuple(z.shape)}); "
                             f"got ({tuple(S0.shape)}, {tuple(z0.shape)})")
        S, z = S0.to(S), z0.to(z)
    if mode == "parallel":
        out, S, z = _parallel(fq, fk, v, S, z, eps)
    elif mode == "recurrent":
        out, S, z = _recurrent(fq, fk, v, S, z, eps)
    else:
        outs = []
        for start in range(0, q.shape[-2], chunk_size):  # the parallel form inside, the state between chunks
            part = slice(start, start + chunk_size)
            o, S, z = _parallel(fq[..., part, :], fk[..., part, :], v[..., part, :], S, z, eps)
            outs.append(o)
        out = torch.cat(outs, dim=-2)
    return (out, (S, z)) if return_state else out


def _parallel(fq, fk, v, S, z, eps):
    """The masked matrix form, plus what a state ``(S, z)`` of earlier positions contributes."""
    A = (fq @ fk.transpose(-2, -1)).tril()  # (..., T, d_φ) @ (..., d_φ, T) -> (..., T, T), j <= i kept
    num = A @ v + fq @ S  # (..., T, d_v)
    den = A.sum(-1) + (fq @ z.unsqueeze(-1)).squeeze(-1)  # (..., T)
    S = S + fk.transpose(-2, -1) @ v  # (..., d_φ, T) @ (..., T, d_v) -> (..., d_φ, d_v)
    z = z + fk.sum(-2)  # (..., d_φ)
    return num / _normaliser(den, eps).unsqueeze(-1), S, z


def _normaliser(den: torch.Tensor, eps: float) -> torch.Tensor:
    """``den + eps``, with 1 where it is 0: with ``eps = 0`` a query whose features meet no key's
    (``φ(q)·z = 0``, so its numerator is 0 too) gets a zero output, never 0/0 = NaN."""
    den = den + eps
    return den if eps > 0 else den.masked_fill(den == 0, 1.0)


def _recurrent(fq, fk, v, S, z, eps):
    """One position at a time: an RNN with the state ``(S, z)``."""
    outs = []
    for t in range(fq.shape[-2]):
        S = S + fk[..., t, :, None] * v[..., t, None, :]  # outer product φ(k_t) v_tᵀ: (..., d_φ, d_v)
        z = z + fk[..., t, :]
        num = (fq[..., t, :, None] * S).sum(-2)  # φ(q_t)ᵀ S: (..., d_v)
        den = (fq[..., t, :] * z).sum(-1, keepdim=True)  # (..., 1)
        outs.append(num / _normaliser(den, eps))
    return torch.stack(outs, dim=-2), S, z


def check_recurrent_input(layer: nn.Module, x: object, cache, return_weights: bool, attention_mask: object,
                          positions: object, what: str) -> tuple[int, int]:
    """Check a recurrent layer's ``forward`` arguments (``layer.d_model``, ``layer.block_size``); return ``(B, T)``.

    Raises:
        TypeError: ``x`` not a float tensor of the weights' dtype, ``cache`` not a recurrent state.
        ValueError: weights asked for; a padding mask or positions (a recurrent layer would fold the pads
            into its state); ``x`` not ``(B, T, d_model)`` with ``T >= 1`` or not on the weights' device,
            the sequence past ``block_size``.
    """
    if return_weights:
        raise ValueError(f"return_weights=True: {what} computes no attention weights")
    if attention_mask is not None or positions is not None:
        raise ValueError(f"{what} takes no attention_mask or positions: it would fold the padding into its "
                         "state (left-padded batches need softmax attention)")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating point tensor (B, T, d_model); got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 3 or x.shape[-1] != layer.d_model or x.shape[1] == 0:
        raise ValueError(f"x must have shape (B, T, d_model={layer.d_model}) with T >= 1; got {tuple(x.shape)}")
    weight = layer.out_proj.weight
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"x is {x.dtype} but the module's weights are {weight.dtype}; convert one of them")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the module's weights are on {weight.device}")
    if cache is not None and not (callable(getattr(cache, "read", None)) and callable(getattr(cache, "write", None))):
        raise TypeError(f"cache must be an attnlib.cache.RecurrentState (layer.new_cache(...)); got {type(cache).__name__}")
    B, T, _ = x.shape
    past = 0 if cache is None else cache.length
    if layer.block_size is not None and past + T > layer.block_size:
        raise ValueError(f"sequence length T={past + T} (cached {past} + new {T}) exceeds block_size={layer.block_size}")
    return B, T


class RecurrentLayer(nn.Module):
    """What linear attention and gated DeltaNet share as decoder layers: a fixed state instead of a KV cache."""

    cache_width = 0  # nothing grows with the sequence
    mask_mod = None

    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """0: the state does not grow with the sequence (see :meth:`state_bytes`)."""
        return 0

    def new_cache(self, block_size: int, windows: bool = True) -> RecurrentState:
        """An empty :class:`~attnlib.cache.RecurrentState` (``windows`` changes nothing: there is no window)."""
        return RecurrentState(block_size)


class LinearAttention(RecurrentLayer):
    """Multi-head causal linear attention with the GPT block's attention interface. Chapter 18.

    The projections (``qkv``, ``out_proj``) are :class:`attnlib.attention.MultiHeadAttention`'s, so
    a GPT's ``block.attn`` can be replaced by this layer; only the attention changes. With a
    :class:`attnlib.cache.RecurrentState` it keeps the state ``(S, z)`` there instead of keys and values.

    Args:
        d_model, n_heads: as for :class:`attnlib.attention.MultiHeadAttention` (``n_heads`` divides ``d_model``).
        block_size: longest sequence accepted (``None``: no limit).
        dropout: on the output, in [0, 1). bias: biases on the projections.
        feature_map, mode, chunk_size: see :func:`linear_attention` (``mode`` is used for T > 1;
            a single new token always takes the recurrent step).

    Raises:
        TypeError / ValueError: as :class:`attnlib.attention.MultiHeadAttention`; a bad feature map,
            mode or chunk size (named).
    """


    def __init__(self, d_model: int, n_heads: int, *, block_size: int | None = None, dropout: float = 0.0,
                 bias: bool = True, feature_map: str | Callable = "elu+1", mode: str = "chunked",
                 chunk_size: int = 64) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("n_heads", n_heads)
        divisible("d_model", d_model, "n_heads", n_heads)
        probability("dropout", dropout)
        positive_int("chunk_size", chunk_size)
        if block_size is not None:
            positive_int("block_size", block_size)
        if mode not in LINEAR_MODES:
            raise ValueError(f"mode={mode!r} is not one of {LINEAR_MODES}")
        check_feature_map(feature_map, d_model // n_heads)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.block_size, self.feature_map, self.mode, self.chunk_size = block_size, feature_map, mode, chunk_size
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def state_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the recurrent state of one sequence: ``n_heads · d_φ · (head_dim + 1)`` numbers
        (``d_φ = head_dim`` for the built-in maps)."""
        dtype = dtype or self.out_proj.weight.dtype
        return self.n_heads * self.head_dim * (self.head_dim + 1) * torch.empty((), dtype=dtype).element_size()

    def forward(self, x: torch.Tensor, *, cache: RecurrentState | None = None, attention_mask: None = None,
                positions: None = None, return_weights: bool = False) -> torch.Tensor:
        """``(B, T, d_model)`` → ``(B, T, d_model)``; with a state (``new_cache``), continue the sequence."""
        B, T = check_recurrent_input(self, x, cache, return_weights, attention_mask, positions, "a linear attention layer")
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, T, d) -> (B, h, T, hd)
                   for t in self.qkv(x).split(self.d_model, dim=-1))
        mode = "recurrent" if T == 1 else self.mode
        y, state = linear_attention(q, k, v, mode, feature_map=self.feature_map, chunk_size=self.chunk_size,
                                    initial_state=None if cache is None else cache.read(), return_state=True)
        if cache is not None:
            cache.write(state, T)
        y = y.transpose(1, 2).reshape(B, T, self.d_model)  # (B, h, T, hd) -> (B, T, d_model)
        return self.resid_dropout(self.out_proj(y))


def short_convolution(x: torch.Tensor, weight: torch.Tensor,
                      state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution followed by SiLU, continuing from the last inputs (Mamba's short conv).

    Args:
        x: ``(B, T, channels)``. weight: ``(channels, 1, K)`` (an ``nn.Conv1d``'s with ``groups=channels``).
        state: ``(B, channels, K - 1)``, the inputs before ``x`` (zeros: the start of the sequence).

    Returns:
        ``(SiLU(conv(x)) (B, T, channels), the last K - 1 inputs (B, channels, K - 1))``.

    Raises:
        TypeError: ``x`` or ``weight`` not a float tensor. ValueError: ``weight`` not ``(channels, 1, K)``,
            ``x`` not 3-D, a ``state`` that is not ``(B, channels, K - 1)``.
    """
    for name, t, dims in (("x", x, 3), ("weight", weight, 3)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor; got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be 3-D; got shape {tuple(t.shape)}")
    if weight.shape[:2] != (x.shape[-1], 1) or weight.shape[-1] == 0:
        raise ValueError(f"weight must have shape (channels={x.shape[-1]}, 1, K >= 1); got {tuple(weight.shape)}")
    expected = (x.shape[0], x.shape[-1], weight.shape[-1] - 1)
    if state is not None and (not isinstance(state, torch.Tensor) or state.shape != expected):
        raise ValueError(f"state must be a tensor of shape (B, channels, K - 1) = {expected}; "
                         f"got {tuple(getattr(state, 'shape', ())) or type(state).__name__}")
    x = x.transpose(1, 2)  # (B, channels, T)
    if state is None:
        state = x.new_zeros(*x.shape[:2], weight.shape[-1] - 1)
    x = torch.cat([state, x], dim=-1)  # (B, channels, K - 1 + T): the left context, then the new inputs
    # output t is Σ_j weight[c, 0, j] · x[c, t + j]: inputs t - K + 1 .. t of the unpadded sequence
    if x.shape[-1] == weight.shape[-1]:  # one new input (a decoding step): one dot product per channel
        y = (x * weight[:, 0]).sum(-1, keepdim=True)  # (B, channels, K) -> (B, channels, 1)
    else:  # a sequence: the depthwise convolution (transformers' causal_conv1d_fn)
        y = F.conv1d(x, weight, groups=x.shape[1])  # (B, channels, T): no padding needed
    return F.silu(y).transpose(1, 2), x[..., x.shape[-1] - state.shape[-1]:]
