"""``python -m attnlib.bench mha``: the implementations of causal multi-head attention, timed side by side.

Chapter 15. Two groups of rows, each with its own reference:

* **layers**, ``x (B, T, d_model) → (B, T, d_model)``, projections included. The
  reference is the fairest one for ``MultiHeadAttention(attn_fn="sdpa")``: the *same*
  ``qkv`` and ``out_proj`` Linear layers around a bare
  ``F.scaled_dot_product_attention(..., is_causal=True)``, so that the ratio shows what
  the module adds (checks, reshapes), not what the projections cost. The readable
  ``attn_fn="eager"`` path is held to the row ``llms_from_scratch``: the design of
  *Build a Large Language Model (From Scratch)*, chapter 3 (separate q/k/v Linear layers,
  a registered causal-mask buffer, ``masked_fill_`` in place, softmax, matmul), written
  here in our own code (:class:`attnlib.bench._layers.ScratchMultiHeadAttention`).
* **cores**, ``q, k, v (B, n_heads, T, head_dim) → (B, n_heads, T, head_dim)`` made
  beforehand. The reference is bare SDPA with ``is_causal=True``.

Every implementation gets the same weights; their outputs are compared with the
reference before anything is timed (``max_abs_diff`` in the rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlib.attention import MultiHeadAttention, attention, causal_mask, tiled_attention
from attnlib.bench._common import format_table, resolve_device, time_calls
from attnlib.bench._common import threads as using_threads
from attnlib.bench._layers import (
    EinsumAttention,
    ProjectedCore,
    ScratchMultiHeadAttention,
    TorchMultiheadAttention,
    einsum_core,
    sdpa_causal,
    split_heads,
    wrapper_with_out_proj,
)

__all__ = ["LAYERS", "CORES", "MHA_DEFAULTS", "format_mha", "mha_rows", "mha_summary"]

#: GPT-2 small's attention layer, with a batch of 8 sequences of 1024 tokens.
MHA_DEFAULTS = dict(batch=8, seq_len=1024, d_model=768, n_heads=12)
#: Row ids of the two tables (``layer/<id>``, ``core/<id>``); ``reference`` is always timed.
LAYERS = ("reference", "mha_sdpa", "mha_eager", "llms_from_scratch", "wrapper", "einsum", "separate_qkv", "bool_mask",
          "nn_mha", "tiled")
CORES = ("reference", "bool_mask", "eager", "einsum", "tiled")


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
    tile_size: int = 128,
    seed: int = 0,
    threads: int | None = None,
    rows: tuple[str, ...] | list[str] | None = None,
) -> list[dict]:
    """Time every implementation of causal multi-head attention; one row per implementation.

    Args:
        batch, seq_len, d_model, n_heads: the shapes (``head_dim = d_model // n_heads``).
        device: where to run (``None``: :func:`attnlib.device`).
        dtype: parameters and activations.
        backward: also time forward + backward (gradients of the input and every weight).
        repeats: timed calls per implementation (the median is reported), in rounds that
            call every implementation once each, so that the machine's load hits all alike.
        warmup: untimed calls first.
        tile_size: tile size of :func:`attnlib.attention.tiled_attention`.
        seed: for the weights and inputs.
        threads: ``torch.set_num_threads`` for the run (``None``: as it is).
        rows: the row ids to time (``"layer/<id>"`` / ``"core/<id>"``, ids in :data:`LAYERS`,
            :data:`CORES`); ``None``: all. The two references are always timed.

    Returns:
        Dicts with ``id, name, kind`` (``"layer"`` or ``"core"``), ``reference`` (the id the
        ratios are against), ``forward_ms`` (under ``torch.no_grad``), ``forward_backward_ms``
        (``None`` without ``backward``), ``forward_ratio``, ``forward_backward_ratio`` and
        ``max_abs_diff`` (largest difference from the reference's output).

    Raises:
        ValueError: an unknown row id.
    """
    known = [f"layer/{k}" for k in LAYERS] + [f"core/{k}" for k in CORES]
    wanted = set(known if rows is None else rows) | {"layer/reference", "core/reference"}
    if unknown := sorted(wanted - set(known)):
        raise ValueError(f"rows={unknown} are not row ids; choose from {known}")
    with using_threads(threads):
        return _mha_rows(batch, seq_len, d_model, n_heads, device, dtype, backward, repeats, warmup, tile_size, seed,
                         [k for k in known if k in wanted])


def _mha_rows(batch, seq_len, d_model, n_heads, device, dtype, backward, repeats, warmup, tile_size, seed, wanted):
    device = resolve_device(device)
    torch.manual_seed(seed)
    source = MultiHeadAttention(d_model, n_heads, causal=True, attn_fn="sdpa").to(device, dtype).eval()
    eager = MultiHeadAttention(d_model, n_heads, causal=True, attn_fn="eager").to(device, dtype).eval()
    eager.load_state_dict(source.state_dict())
    x = torch.randn(batch, seq_len, d_model, device=device, dtype=dtype)
    with torch.no_grad():
        q, k, v = (split_heads(t, n_heads).contiguous() for t in source.qkv(x).chunk(3, dim=-1))

    def sdpa_bool_mask(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q.shape[-2], device=q.device))

    def eager_core(q, k, v):
        return attention(q, k, v, is_causal=True)[0]

    def einsum_causal(q, k, v):
        return einsum_core(q, k, v, causal_mask(q.shape[-2], device=q.device))

    def tiled_core(q, k, v):
        return tiled_attention(q, k, v, is_causal=True, tile_size=tile_size)[0]

    builders = {  # id: (name, builder of the module)
        "layer/reference": ("Linear + bare SDPA(is_causal) + Linear", lambda: ProjectedCore(source, sdpa_causal)),
        "layer/mha_sdpa": ('MultiHeadAttention(attn_fn="sdpa")', lambda: source),
        "layer/mha_eager": ('MultiHeadAttention(attn_fn="eager")', lambda: eager),
        "layer/llms_from_scratch": ("LLMs from Scratch ch. 3 (mask buffer, masked_fill_)",
                                    lambda: ScratchMultiHeadAttention(source, seq_len)),
        "layer/wrapper": (f"MultiHeadAttentionWrapper ({n_heads} heads) + Linear",
                          lambda: wrapper_with_out_proj(source, seq_len)),
        "layer/einsum": ("einsum, heads split in the weights", lambda: EinsumAttention(source)),
        "layer/separate_qkv": ("3 separate q/k/v Linear + SDPA", lambda: ProjectedCore(source, sdpa_causal, separate=True)),
        "layer/bool_mask": ("Linear + SDPA(bool mask) + Linear", lambda: ProjectedCore(source, sdpa_bool_mask)),
        "layer/nn_mha": ("nn.MultiheadAttention (causal)", lambda: TorchMultiheadAttention(source)),
        "layer/tiled": ("Linear + tiled_attention + Linear", lambda: ProjectedCore(source, tiled_core)),
        "core/reference": ("bare SDPA(is_causal=True)", lambda: sdpa_causal),
        "core/bool_mask": ("SDPA(attn_mask=bool causal mask)", lambda: sdpa_bool_mask),
        "core/eager": ("attnlib.attention.attention(is_causal=True)", lambda: eager_core),
        "core/einsum": ("einsum", lambda: einsum_causal),
        "core/tiled": (f"tiled_attention (tiles {tile_size})", lambda: tiled_core),
    }
    out, forward, both = [], {}, {}
    with torch.no_grad():
        expected = {"layer": builders["layer/reference"][1]()(x), "core": sdpa_causal(q, k, v)}
    for key in wanted:
        name, build = builders[key]
        kind, fn = key.split("/")[0], build()
        if isinstance(fn, torch.nn.Module):
            fn.eval()
        with torch.no_grad():
            result = fn(x) if kind == "layer" else fn(q, k, v)
        diff = (result.double() - expected[kind].double()).abs().max().item()
        out.append(dict(id=key, name=name, kind=kind, reference=f"{kind}/reference", max_abs_diff=diff))
        forward[key] = _forward_call(fn, kind, x, (q, k, v))
        if backward:
            both[key] = _forward_backward_call(fn, kind, x, (q, k, v))
    # One interleaved round for forward and forward + backward together: every row sees the same load.
    calls = {("forward", key): fn for key, fn in forward.items()} | {("both", key): fn for key, fn in both.items()}
    seconds = time_calls(calls, repeats=repeats, warmup=warmup)
    for row in out:
        key, ref = row["id"], row["reference"]
        row["forward_ms"] = 1e3 * seconds["forward", key]
        row["forward_ratio"] = seconds["forward", key] / seconds["forward", ref]
        row["forward_backward_ms"] = 1e3 * seconds["both", key] if backward else None
        row["forward_backward_ratio"] = seconds["both", key] / seconds["both", ref] if backward else None
    return out


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


def mha_summary(rows: list[dict], tolerance: float = 1.02, eager_target: float = 1.0) -> dict:
    """The two verdicts of chapter 15 (issue 11): the SDPA path's overhead and the eager path's speed.

    * ``forward_ratio`` / ``forward_backward_ratio``: ``MultiHeadAttention(attn_fn="sdpa")``
      over the same two Linear layers around a bare SDPA call (row ``layer/reference``);
      ``within_tolerance``: both ``<= tolerance``.
    * ``eager_vs_scratch_forward`` (and ``_forward_backward``): ``MultiHeadAttention(attn_fn="eager")``
      over the *LLMs from Scratch* chapter-3 layer; ``eager_within_target``: forward ``<= eager_target``.
      Present when both rows were timed.
    """
    by_id = {row["id"]: row for row in rows}
    summary: dict = {"tolerance": tolerance}
    if "layer/mha_sdpa" in by_id:
        module = by_id["layer/mha_sdpa"]
        summary["forward_ratio"] = module["forward_ratio"]
        ratios = [module["forward_ratio"]]
        if module.get("forward_backward_ratio") is not None:
            summary["forward_backward_ratio"] = module["forward_backward_ratio"]
            ratios.append(module["forward_backward_ratio"])
        summary["within_tolerance"] = all(r <= tolerance for r in ratios)
    if "layer/mha_eager" in by_id and "layer/llms_from_scratch" in by_id:
        eager, scratch = by_id["layer/mha_eager"], by_id["layer/llms_from_scratch"]
        summary["eager_target"] = eager_target
        summary["eager_vs_scratch_forward"] = eager["forward_ms"] / scratch["forward_ms"]
        if eager.get("forward_backward_ms") is not None:
            summary["eager_vs_scratch_forward_backward"] = eager["forward_backward_ms"] / scratch["forward_backward_ms"]
        summary["eager_within_target"] = summary["eager_vs_scratch_forward"] <= eager_target
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
    if "forward_ratio" in summary:
        ratios = f"{summary['forward_ratio']:.3f}× forward"
        if "forward_backward_ratio" in summary:
            ratios += f", {summary['forward_backward_ratio']:.3f}× forward+backward"
        verdict = "yes" if summary["within_tolerance"] else "no"
        parts.append(
            f'\nMultiHeadAttention(attn_fn="sdpa") against Linear + bare SDPA + Linear (same layers): {ratios}. '
            f"Within {summary['tolerance']:.2f}×: {verdict}."
        )
    if "eager_vs_scratch_forward" in summary:
        ratios = f"{summary['eager_vs_scratch_forward']:.3f}× forward"
        if "eager_vs_scratch_forward_backward" in summary:
            ratios += f", {summary['eager_vs_scratch_forward_backward']:.3f}× forward+backward"
        verdict = "yes" if summary["eager_within_target"] else "no"
        parts.append(
            f'MultiHeadAttention(attn_fn="eager") against the LLMs from Scratch chapter-3 layer: {ratios}. '
            f"At most {summary['eager_target']:.2f}× forward: {verdict}."
        )
    return "\n".join(parts)
