"""Exercise checks for chapter 07 (multi-head latent attention).

* 07.1 ``check_absorbed_scores``: attention scores against the latents, with ``W^UK`` folded into the
  queries (DeepSeek-V2 §2.1.2), never decoding the keys.
* 07.2 ``check_fold_output``: the per-head output matrices ``(W^O_h W^UV_h)^T`` that map weighted
  latents straight to the output.
* 07.3 ``check_kv_cache_bytes``: the KV-cache size of a whole model for MHA, GQA, MQA and MLA
  (DeepSeek-V2, Table 1), the variant named by ``config.attention``.

Every grader draws its test tensors from a local ``torch.Generator``; ``grade`` runs it inside
``torch.random.fork_rng``, so checking an answer never moves the notebook's global random state.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlib.book.exercises._core import NotSolved, Wrong, call_for_int, exercise, expect, expect_close
from attnlib.config import GPTConfig

__all__ = ["check_absorbed_scores", "check_fold_output", "check_kv_cache_bytes"]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- 07.1
_SCORE_CASES = [  # (B, n_heads, head_dim, d_c, T_q, T_k)
    (2, 4, 8, 6, 5, 5),
    (1, 2, 4, 12, 3, 7),
    (2, 3, 5, 5, 1, 9),
    (1, 1, 6, 10, 4, 4),
]
_FLOP_CASE = (1, 4, 8, 6, 1, 64)  # one query against many latents: decoding the keys would dominate


def _decoded_scores(q: torch.Tensor, c: torch.Tensor, w_uk: torch.Tensor, n_heads: int, scale: float) -> torch.Tensor:
    """The naive scores: decode k = W^UK c, split into heads, q . k * scale."""
    B, T_k, _ = c.shape
    k = (c @ w_uk.T).view(B, T_k, n_heads, -1).transpose(1, 2)  # (B, T_k, n_heads*hd) -> (B, n_heads, T_k, hd)
    return q @ k.transpose(-2, -1) * scale  # (B, n_heads, T_q, T_k)


def _score_inputs(B, n_heads, head_dim, d_c, T_q, T_k, g):
    q = torch.randn(B, n_heads, T_q, head_dim, generator=g)
    c = torch.randn(B, T_k, d_c, generator=g)
    w_uk = torch.randn(n_heads * head_dim, d_c, generator=g) / math.sqrt(d_c)
    return q, c, w_uk


@exercise("07.1")
def check_absorbed_scores(absorbed_scores) -> None:
    """Check ``absorbed_scores(q, c, w_uk, n_heads)`` against scores of decoded keys, and that no key is decoded."""
    g = torch.Generator().manual_seed(707)
    for B, n_heads, head_dim, d_c, T_q, T_k in _SCORE_CASES:
        q, c, w_uk = _score_inputs(B, n_heads, head_dim, d_c, T_q, T_k, g)
        case = f"(n_heads={n_heads}, head_dim={head_dim}, d_c={d_c}, T_q={T_q}, T_k={T_k})"
        with torch.no_grad():
            got = absorbed_scores(q.clone(), c.clone(), w_uk.clone(), n_heads)
        if got is None:
            raise NotSolved("return the scores of shape (B, n_heads, T_q, T_k), not None")
        expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
        expect(
            tuple(got.shape) == (B, n_heads, T_q, T_k),
            f"{case}: scores have shape {tuple(got.shape)}, expected (B, n_heads, T_q, T_k) = {(B, n_heads, T_q, T_k)}",
        )
        expected = _decoded_scores(q, c, w_uk, n_heads, 1.0 / math.sqrt(head_dim))
        if _close(got, expected):
            continue
        expect(
            not _close(got, _decoded_scores(q, c, w_uk, n_heads, 1.0 / math.sqrt(d_c))),
            f"{case}: you scale by 1/sqrt(d_c); the absorbed score is the same number as q_h . k_h, a dot product "
            f"of head_dim={head_dim} terms, so the scale stays 1/sqrt(head_dim)",
        )
        expect(
            not _close(got, _decoded_scores(q, c, w_uk, n_heads, 1.0)),
            f"{case}: the scores are not scaled; divide by sqrt(head_dim)",
        )
        raise Wrong(
            f"{case}: the scores differ from q_h . (W^UK_h c) / sqrt(head_dim). Head h's block of W^UK is rows "
            "h*head_dim:(h+1)*head_dim of w_uk, i.e. w_uk.view(n_heads, head_dim, d_c)[h]; fold it as "
            "W^UK_h^T q_h (shape (..., d_c)) and take its dot product with every latent"
        )

    B, n_heads, head_dim, d_c, T_q, T_k = _FLOP_CASE
    q, c, w_uk = _score_inputs(B, n_heads, head_dim, d_c, T_q, T_k, g)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        absorbed_scores(q, c, w_uk, n_heads)
    flops = counter.get_total_flops()
    decoding = 2 * B * T_k * d_c * n_heads * head_dim  # c @ W^UK^T for every latent
    absorbed = 2 * B * n_heads * T_q * (head_dim * d_c + T_k * d_c)
    expect(
        flops < decoding,
        f"the scores are right, but for one query against {T_k} latents your function did {flops:,} FLOPs of matrix "
        f"products; decoding the keys alone costs {decoding:,}, the absorbed form {absorbed:,}. Do not compute "
        "c @ w_uk.T (the keys): fold w_uk into q instead",
    )


# ---------------------------------------------------------------- 07.2
_FOLD_CASES = [  # (d_model, n_heads, d_c)
    (12, 3, 5),
    (16, 4, 16),
    (8, 1, 3),
    (24, 4, 10),
]


def _fold(v_up_weight: torch.Tensor, out_proj_weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    d_model = out_proj_weight.shape[0]
    w_uv = v_up_weight.view(n_heads, -1, v_up_weight.shape[1])  # (n_heads*hd, d_c) -> (n_heads, hd, d_c)
    w_o = out_proj_weight.view(d_model, n_heads, -1)  # (d_model, n_heads*hd) -> (d_model, n_heads, hd): columns per head
    return torch.einsum("hdc,mhd->hcm", w_uv, w_o)  # (n_heads, d_c, d_model)


@exercise("07.2")
def check_fold_output(fold_output) -> None:
    """Check ``fold_output(v_up_weight, out_proj_weight, n_heads) -> (n_heads, d_c, d_model)`` = ``(W^O_h W^UV_h)^T``."""
    g = torch.Generator().manual_seed(7072)
    for d_model, n_heads, d_c in _FOLD_CASES:
        head_dim = d_model // n_heads
        w_uv = torch.randn(d_model, d_c, generator=g) / math.sqrt(d_c)
        w_o = torch.randn(d_model, d_model, generator=g) / math.sqrt(d_model)
        w_uv_before, w_o_before = w_uv.clone(), w_o.clone()
        case = f"(d_model={d_model}, n_heads={n_heads}, d_c={d_c})"
        with torch.no_grad():
            got = fold_output(w_uv, w_o, n_heads)
        if got is None:
            raise NotSolved("return the folded matrices of shape (n_heads, d_c, d_model), not None")
        expect(isinstance(got, torch.Tensor), f"return a torch.Tensor; got {type(got).__name__}")
        expect(
            torch.equal(w_uv, w_uv_before) and torch.equal(w_o, w_o_before),
            "your function changed the weights it was given; build a new tensor",
        )
        expected = _fold(w_uv, w_o, n_heads)
        shape = tuple(got.shape)
        expect(
            not (shape == (d_c, d_model) and _close(got, expected.sum(0))),
            f"{case}: you returned one (d_c, d_model) matrix, the heads summed; keep one matrix per head, "
            f"shape (n_heads, d_c, d_model) = {(n_heads, d_c, d_model)}: each head weights its own latent average",
        )
        if shape == (n_heads, d_model, d_c) and (n_heads, d_model, d_c) != (n_heads, d_c, d_model):
            expect(
                not _close(got.transpose(1, 2), expected),
                f"{case}: you returned W^O_h W^UV_h, shape (n_heads, d_model, d_c); transpose each head's matrix "
                f"to (d_c, d_model) so that y_latent (..., d_c) multiplies it from the left",
            )
        expect(
            shape == (n_heads, d_c, d_model),
            f"{case}: the result has shape {shape}, expected (n_heads, d_c, d_model) = {(n_heads, d_c, d_model)}",
        )
        if _close(got, expected):
            continue
        by_rows = torch.einsum("hdc,hdm->hcm", w_uv.view(n_heads, head_dim, d_c), w_o.view(n_heads, head_dim, d_model))
        expect(
            not _close(got, by_rows),
            f"{case}: you cut out_proj_weight into heads by rows. W^O_h is the block of columns "
            "h*head_dim:(h+1)*head_dim of out_proj_weight (nn.Linear stores (out_features, in_features), and the "
            "heads are its inputs): out_proj_weight.view(d_model, n_heads, head_dim)[:, h]",
        )
        expect_close(got, expected, f"{case}: your folded matrices (W[h] = (W^O_h W^UV_h)^T)")


# ---------------------------------------------------------------- 07.3
_SIZES = [  # (sizes, n_kv_heads for "gqa", kv_latent_dim for "mla"): None = not given, the config's default
    (dict(), None, None),  # the book's small model: 4 layers, 4 heads of 16; gqa then has 4 kv heads, d_c = 16
    (dict(n_layers=3), 2, 24),
    (dict(d_model=96, n_heads=6, n_layers=5), 3, 20),
    (dict(d_model=16384, n_heads=128, n_layers=60), 8, 512),  # DeepSeek-V2-sized attention
]
_CACHE_CALLS = [  # (seq_len, rope_dim, dtype_bytes)
    (1, 0, 4),
    (1000, 8, 2),
    (131072, 64, 2),
    (7, 0, 2),
]
_VARIANTS = ("mha", "gqa", "mqa", "mla")


def _configs() -> list[tuple[GPTConfig, int]]:
    """One config per size and variant, with the numbers Table 1 counts per token per layer (rope_dim aside)."""
    out = []
    for sizes, n_kv, d_c in _SIZES:
        base = GPTConfig(**sizes)
        n_h, d_h = base.n_heads, base.head_dim
        out += [
            (base, 2 * n_h * d_h),
            (GPTConfig(**sizes, n_kv_heads=n_kv, attention="gqa"), 2 * (n_h if n_kv is None else n_kv) * d_h),
            (GPTConfig(**sizes, attention="mqa"), 2 * d_h),
            (GPTConfig(**sizes, kv_latent_dim=d_c, attention="mla"), base.d_model // 4 if d_c is None else d_c),
        ]
    return out


_CACHE_CONFIGS = _configs()


@exercise("07.3")
def check_kv_cache_bytes(kv_cache_bytes) -> None:
    """Check ``kv_cache_bytes(config, seq_len, rope_dim, dtype_bytes) -> int`` against Table 1, variant ``config.attention``."""
    for config, table1 in _CACHE_CONFIGS:
        variant = config.attention
        for seq_len, rope_dim, dtype_bytes in _CACHE_CALLS:
            case = (
                f"kv_cache_bytes(attention={variant!r}, n_layers={config.n_layers}, n_heads={config.n_heads}, "
                f"n_kv_heads={config.n_kv_heads}, head_dim={config.head_dim}, kv_latent_dim={config.kv_latent_dim}; "
                f"seq_len={seq_len}, rope_dim={rope_dim}, dtype_bytes={dtype_bytes})"
            )
            got = call_for_int(kv_cache_bytes, (config, seq_len, rope_dim, dtype_bytes), case, config)
            per_token = table1 + (rope_dim if variant == "mla" else 0)
            scale = config.n_layers * seq_len * dtype_bytes
            expected = per_token * scale
            if got == expected:
                continue
            case = f"{case} = {got:,}, expected {expected:,}"
            mistakes = [
                (per_token * seq_len * dtype_bytes, "multiply by config.n_layers: every layer has its own cache"),
                (per_token * config.n_layers * seq_len, "multiply by dtype_bytes: the cache holds numbers of that many bytes"),
                (per_token * config.n_layers * dtype_bytes, "multiply by seq_len: one entry per token"),
            ]
            if variant == "mla":
                mistakes += [
                    (table1 * scale, "the decoupled RoPE key k^R_t (rope_dim numbers per token) is cached next to the latent"),
                    (2 * table1 * scale, "the latent is shared by keys and values: cache d_c + rope_dim numbers, not twice d_c"),
                    (2 * per_token * scale, "the latent is shared by keys and values: cache d_c + rope_dim numbers, not twice that"),
                ]
            else:
                mistakes += [
                    ((per_token + rope_dim) * scale, "rope_dim only concerns MLA's decoupled key; MHA, GQA and MQA rotate their keys in place"),
                    (per_token // 2 * scale, "keys AND values are cached: a factor 2"),
                ]
            if variant == "gqa":
                mistakes.append((2 * config.n_heads * config.head_dim * scale, "GQA caches n_kv_heads key/value heads, not n_heads"))
            for value, hint in mistakes:
                expect(value == expected or got != value, f"{case}: {hint}")
            raise Wrong(f"{case}. Numbers per token per layer (DeepSeek-V2 Table 1): MHA 2*n_heads*head_dim, "
                        "GQA 2*n_kv_heads*head_dim, MQA 2*head_dim, MLA kv_latent_dim + rope_dim")
