"""``python -m attnlib.bench mha``: the implementations of causal multi-head attention, timed side by side.

Chapter 15. Two groups of rows, each with its own reference:

* **layers**, ``x (B, T, d_model) → (B, T, d_model)``, projections included. The
  reference is the fairest one for ``MultiHeadAttention(backend="sdpa")``: the *same*
  ``qkv`` and ``out_proj`` Linear layers around a bare
  ``F.scaled_dot_product_attention(..., is_causal=True)``, so that the ratio shows what
  the module adds (checks, reshapes), not what the projections cost.
* **cores**, ``q, k, v (B, n_heads, T, head_dim) → (B, n_heads, T, head_dim)`` made
  beforehand. The reference is bare SDPA with ``is_causal=True``.

Every implementation gets the same weights; their outputs are compared with the
reference before anything is timed (``max_abs_diff`` in the rows).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlib.attention import MultiHeadAttention, MultiHeadAttentionWrapper
from attnlib.attention.tiled import tiled_attention
from attnlib.bench._common import format_table, resolve_device, time_calls
from attnlib.bench._common import threads as using_threads
from attnlib.functional import attention, causal_mask

__all__ = ["MHA_DEFAULTS", "format_mha", "mha_rows", "mha_summary"]

#: GPT-2 small's attention layer, with a batch of 8 sequences of 1024 tokens.
MHA_DEFAULTS = dict(batch=8, seq_len=1024, d_model=768, n_heads=12)


def split_heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    B, T, width = t.shape
    return t.view(B, T, n_heads, width // n_heads).transpose(1, 2)  # (B, T, d_model) -> (B, n_heads, T, head_dim)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, n_heads, T, head_dim = y.shape
    return y.transpose(1, 2).reshape(B, T, n_heads * head_dim)  # (B, n_heads, T, hd) -> (B, T, d_model)


def einsum_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Causal attention with every product written as an einsum (chapter 04's form)."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # (B, nh, T, hd) x2 -> (B, nh, T, T)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v)  # (B, nh, T, T), (B, nh, T, hd) -> (B, nh, T, hd)


class EinsumAttention(nn.Module):
    """Multi-head attention in einsum: the heads are split in the weights, never in the activations."""

    def __init__(self, source: MultiHeadAttention) -> None:
        super().__init__()
        self.n_heads, self.head_dim = source.n_heads, source.head_dim
        self.qkv, self.out_proj = source.qkv, source.out_proj  # the same weights as the source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d_model = x.shape
        w = self.qkv.weight.view(3, self.n_heads, self.head_dim, d_model)  # rows [W_q; W_k; W_v], per head
        q, k, v = (torch.einsum("btm,hdm->bhtd", x, w[i]) for i in range(3))  # (B, T, d_model) -> (B, nh, T, hd)
        if self.qkv.bias is not None:
            b = self.qkv.bias.view(3, self.n_heads, 1, self.head_dim)
            q, k, v = q + b[0], k + b[1], v + b[2]
        y = einsum_core(q, k, v, causal_mask(T, device=x.device))
        w_o = self.out_proj.weight.view(d_model, self.n_heads, self.head_dim)
        out = torch.einsum("bhtd,mhd->btm", y, w_o)  # (B, nh, T, hd) -> (B, T, d_model)
        return out if self.out_proj.bias is None else out + self.out_proj.bias


class ProjectedCore(nn.Module):
    """``out_proj(core(split(qkv(x))))`` with the Linear layers of ``source`` and any attention core."""

    def __init__(self, source: MultiHeadAttention, core, separate: bool = False) -> None:
        super().__init__()
        self.n_heads, self.core = source.n_heads, core
        self.out_proj = source.out_proj
        if separate:  # three Linear layers instead of one fused: the same numbers, three matmuls
            d_model = source.d_model
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))
            for i, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
                proj.to(source.qkv.weight)
                with torch.no_grad():
                    proj.weight.copy_(source.qkv.weight[i * d_model : (i + 1) * d_model])
                    proj.bias.copy_(source.qkv.bias[i * d_model : (i + 1) * d_model])
            self.qkv = None
        else:
            self.qkv = source.qkv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv is not None:
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, 3 * d_model) -> 3 x (B, T, d_model)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (split_heads(t, self.n_heads) for t in (q, k, v))
        return self.out_proj(merge_heads(self.core(q, k, v)))


class TorchMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with the weights of ``source``, causal, ``need_weights=False``."""

    def __init__(self, source: MultiHeadAttention) -> None:
        super().__init__()
        d_model = source.d_model
        self.mha = nn.MultiheadAttention(d_model, source.n_heads, batch_first=True).to(source.qkv.weight)
        with torch.no_grad():
            self.mha.in_proj_weight.copy_(source.qkv.weight)  # the same [W_q; W_k; W_v] layout
            self.mha.in_proj_bias.copy_(source.qkv.bias)
            self.mha.out_proj.weight.copy_(source.out_proj.weight)
            self.mha.out_proj.bias.copy_(source.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        not_allowed = ~causal_mask(T, device=x.device)  # nn.MultiheadAttention: True = may NOT attend
        return self.mha(x, x, x, attn_mask=not_allowed, need_weights=False, is_causal=True)[0]


def wrapper_with_out_proj(source: MultiHeadAttention, block_size: int) -> nn.Module:
    """Chapter 04's list of heads (12 × head_dim 64 for GPT-2) with ``source``'s weights, plus its out_proj."""
    d_model, n_heads, head_dim = source.d_model, source.n_heads, source.head_dim
    wrapper = MultiHeadAttentionWrapper(d_model, head_dim, block_size, n_heads, bias=True).to(source.qkv.weight)
    with torch.no_grad():
        for h, head in enumerate(wrapper.heads):
            for i, proj in enumerate((head.W_query, head.W_key, head.W_value)):
                rows = slice(i * d_model + h * head_dim, i * d_model + (h + 1) * head_dim)
                proj.weight.copy_(source.qkv.weight[rows])
                proj.bias.copy_(source.qkv.bias[rows])
    return nn.Sequential(wrapper, source.out_proj)


def mha_rows(
    batch: int = 8,
    seq_len: int = 1024,
    d_model: int = 768,
    n_heads: int = 12,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    backward: bool = True,
    repeats: int = 5,
    warmup: int = 1,
    block_size: int = 128,
    seed: int = 0,
    threads: int | None = None,
) -> list[dict]:
    """Time every implementation of causal multi-head attention; one row per implementation.

    Args:
        batch, seq_len, d_model, n_heads: the shapes (``head_dim = d_model // n_heads``).
        device: where to run (``None``: :func:`attnlib.device`).
        dtype: parameters and activations.
        backward: also time forward + backward (gradients of the input and every weight).
        repeats: timed calls per implementation (the median is reported).
        warmup: untimed calls first.
        block_size: tile size of :func:`attnlib.attention.tiled.tiled_attention`.
        seed: for the weights and inputs.
        threads: ``torch.set_num_threads`` for the run (``None``: as it is).

    Returns:
        Dicts with ``id, name, kind`` (``"layer"`` or ``"core"``), ``reference`` (the id the
        ratios are against), ``forward_ms`` (under ``torch.no_grad``), ``forward_backward_ms``
        (``None`` without ``backward``), ``forward_ratio``, ``forward_backward_ratio`` and
        ``max_abs_diff`` (largest difference from the reference's output).
    """
    with using_threads(threads):
        return _mha_rows(batch, seq_len, d_model, n_heads, device, dtype, backward, repeats, warmup, block_size, seed)


def _mha_rows(batch, seq_len, d_model, n_heads, device, dtype, backward, repeats, warmup, block_size, seed):
    device = resolve_device(device)
    torch.manual_seed(seed)
    source = MultiHeadAttention(d_model, n_heads, causal=True, backend="sdpa").to(device, dtype).eval()
    eager = MultiHeadAttention(d_model, n_heads, causal=True, backend="eager").to(device, dtype).eval()
    eager.load_state_dict(source.state_dict())
    x = torch.randn(batch, seq_len, d_model, device=device, dtype=dtype)
    with torch.no_grad():
        q, k, v = (split_heads(t, n_heads).contiguous() for t in source.qkv(x).chunk(3, dim=-1))

    def sdpa_causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_bool_mask(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q.shape[-2], device=q.device))

    def eager_core(q, k, v):
        return attention(q, k, v, mask=causal_mask(q.shape[-2], device=q.device))[0]

    def einsum_causal(q, k, v):
        return einsum_core(q, k, v, causal_mask(q.shape[-2], device=q.device))

    def tiled_core(q, k, v):
        return tiled_attention(q, k, v, causal=True, block_size_q=block_size, block_size_k=block_size)

    layers = {  # id: (name, module)
        "reference": ("Linear + bare SDPA(is_causal) + Linear", ProjectedCore(source, sdpa_causal)),
        "mha_sdpa": ('MultiHeadAttention(backend="sdpa")', source),
        "mha_eager": ('MultiHeadAttention(backend="eager")', eager),
        "wrapper": (f"MultiHeadAttentionWrapper ({n_heads} heads) + Linear", wrapper_with_out_proj(source, seq_len)),
        "einsum": ("einsum, heads split in the weights", EinsumAttention(source)),
        "separate_qkv": ("3 separate q/k/v Linear + SDPA", ProjectedCore(source, sdpa_causal, separate=True)),
        "bool_mask": ("Linear + SDPA(bool mask) + Linear", ProjectedCore(source, sdpa_bool_mask)),
        "nn_mha": ("nn.MultiheadAttention (causal)", TorchMultiheadAttention(source)),
        "tiled": ("Linear + tiled_attention + Linear", ProjectedCore(source, tiled_core)),
    }
    cores = {
        "reference": ("bare SDPA(is_causal=True)", sdpa_causal),
        "bool_mask": ("SDPA(attn_mask=bool causal mask)", sdpa_bool_mask),
        "eager": ("attnlib.functional.attention", eager_core),
        "einsum": ("einsum", einsum_causal),
        "tiled": (f"tiled_attention (blocks {block_size})", tiled_core),
    }
    for module in layers.values():
        module[1].eval()

    rows, forward, both = [], {}, {}
    with torch.no_grad():
        expected = {"layer": layers["reference"][1](x), "core": sdpa_causal(q, k, v)}
    for kind, impls in (("layer", layers), ("core", cores)):
        for key, (name, fn) in impls.items():
            with torch.no_grad():
                out = fn(x) if kind == "layer" else fn(q, k, v)
            diff = (out.double() - expected[kind].double()).abs().max().item()
            rows.append(dict(id=f"{kind}/{key}", name=name, kind=kind, reference=f"{kind}/reference", max_abs_diff=diff))
            forward[f"{kind}/{key}"] = _forward_call(fn, kind, x, (q, k, v))
            if backward:
                both[f"{kind}/{key}"] = _forward_backward_call(fn, kind, x, (q, k, v))
    seconds = time_calls(forward, repeats=repeats, warmup=warmup)
    seconds_both = time_calls(both, repeats=repeats, warmup=warmup) if backward else {}
    for row in rows:
        ref = row["reference"]
        row["forward_ms"] = 1e3 * seconds[row["id"]]
        row["forward_ratio"] = seconds[row["id"]] / seconds[ref]
        row["forward_backward_ms"] = 1e3 * seconds_both[row["id"]] if backward else None
        row["forward_backward_ratio"] = seconds_both[row["id"]] / seconds_both[ref] if backward else None
    return rows


def _forward_call(fn, kind: str, x: torch.Tensor, qkv: tuple[torch.Tensor, ...]):
    def call():
        with torch.no_grad():
            return fn(x) if kind == "layer" else fn(*qkv)

    return call


def _forward_backward_call(fn, kind: str, x: torch.Tensor, qkv: tuple[torch.Tensor, ...]):
    """Forward, then the gradients of the inputs and (for a layer) of every weight."""
    if kind == "layer":
        inputs = [x.detach().requires_grad_()]
        wrt = inputs + [p for p in fn.parameters() if p.requires_grad]
    else:
        inputs = [t.detach().requires_grad_() for t in qkv]
        wrt = inputs
    with torch.no_grad():
        grad_out = torch.randn_like(fn(*inputs))

    def call():
        out = fn(*inputs)
        return torch.autograd.grad(out, wrt, grad_out)

    return call


def mha_summary(rows: list[dict], tolerance: float = 1.05) -> dict:
    """Is ``MultiHeadAttention(backend="sdpa")`` within ``tolerance`` of its fair reference?

    The reference is the same two Linear layers around a bare SDPA call (row ``layer/reference``).
    """
    by_id = {row["id"]: row for row in rows}
    module = by_id["layer/mha_sdpa"]
    summary = {"tolerance": tolerance, "forward_ratio": module["forward_ratio"]}
    ratios = [module["forward_ratio"]]
    if module.get("forward_backward_ratio") is not None:
        summary["forward_backward_ratio"] = module["forward_backward_ratio"]
        ratios.append(module["forward_backward_ratio"])
    summary["within_tolerance"] = all(r <= tolerance for r in ratios)
    return summary


COLUMNS = [
    ("name", "implementation", "s"),
    ("forward_ms", "forward ms", ".2f"),
    ("forward_ratio", "× ref", ".2f"),
    ("forward_backward_ms", "fwd+bwd ms", ".2f"),
    ("forward_backward_ratio", "× ref", ".2f"),
    ("max_abs_diff", "max |diff|", ".1e"),
]


def format_mha(rows: list[dict], settings: dict | None = None) -> str:
    """The two tables (layers, cores), how they were measured, and the verdict on the SDPA module."""
    parts = []
    if settings:
        s = settings
        parts.append(
            f"B={s['batch']}, T={s['seq_len']}, d_model={s['d_model']}, n_heads={s['n_heads']} "
            f"(head_dim {s['d_model'] // s['n_heads']}), causal, {s['dtype']}; median of {s['repeats']} "
            f"interleaved runs after {s['warmup']} warm-up; forward under torch.no_grad, fwd+bwd = gradients of "
            "the input and every weight."
        )
    parts.append("\nLayers, x (B, T, d_model) -> (B, T, d_model), projections included.")
    parts.append("Reference: the same qkv and out_proj Linear layers around a bare SDPA(is_causal=True) call.")
    parts.append(format_table([r for r in rows if r["kind"] == "layer"], COLUMNS))
    parts.append("\nAttention cores, q, k, v (B, n_heads, T, head_dim) made beforehand. Reference: bare SDPA(is_causal=True).")
    parts.append(format_table([r for r in rows if r["kind"] == "core"], COLUMNS))
    summary = mha_summary(rows)
    ratios = f"{summary['forward_ratio']:.3f}× forward"
    if "forward_backward_ratio" in summary:
        ratios += f", {summary['forward_backward_ratio']:.3f}× forward+backward"
    verdict = "yes" if summary["within_tolerance"] else "no"
    parts.append(
        f'\nMultiHeadAttention(backend="sdpa") against Linear + bare SDPA + Linear (same layers): {ratios}. '
        f"Within {summary['tolerance']:.2f}×: {verdict}."
    )
    return "\n".join(parts)
