"""Exercise checks for chapter 07 (multi-head latent attention).

* 07.1 ``check_absorbed_scores``: attention scores against the latents, with ``W^UK`` folded into the
  queries (DeepSeek-V2 §2.1.2), never decoding the keys.
* 07.2 ``check_fold_output``: the per-head output matrices ``(W^O_h W^UV_h)^T`` that map weighted
  latents straight to the output.
* 07.3 ``check_absorbed_decode_step``: one decoding step of MLA with a decoupled rotary key
  (DeepSeek-V2 §2.1.3): the cache holds the latent ``c`` and the shared rotated key ``k^R``; the
  score is the absorbed content part plus ``q^R . k^R``. Checked at every position against the
  naive computation written out here, and its cost against decoding the keys.

Every grader draws its test tensors from a local ``torch.Generator``; ``grade`` runs it inside
``torch.random.fork_rng``, so checking an answer never moves the notebook's global random state.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from attnlib.book.exercises._core import NotSolved, Wrong, exercise, expect, expect_close

__all__ = ["check_absorbed_scores", "check_fold_output", "check_absorbed_decode_step", "rope"]


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
def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of chapter 07: pairs ``(x[..., 2i], x[..., 2i+1])`` turned by ``t * base**(-2i/w)``.

    Args:
        x: ``(..., T, w)``, ``w`` even.
        positions: ``(T,)`` integer positions of the ``T`` rows.

    Returns:
        ``(..., T, w)``, the rotated rows.
    """
    width = x.shape[-1]
    theta = base ** (-torch.arange(0, width, 2, dtype=x.dtype) / width)  # (w/2,)
    angles = positions.to(x.dtype)[:, None] * theta  # (T, w/2)
    cos, sin = angles.cos(), angles.sin()
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2)


class _DecoupledLayer(nn.Module):
    """The weights of chapter 07's ``DecoupledRopeLatentAttention``, under the same names."""

    def __init__(self, d_model: int, n_heads: int, d_c: int, rope_dim: int, g: torch.Generator) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.kv_latent_dim, self.rope_dim = d_c, rope_dim
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_down = nn.Linear(d_model, d_c, bias=False)
        self.k_up = nn.Linear(d_c, d_model, bias=False)
        self.v_up = nn.Linear(d_c, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model)
        self.q_rope = nn.Linear(d_model, n_heads * rope_dim, bias=False)
        self.k_rope = nn.Linear(d_model, rope_dim, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _split(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    B, T, _ = t.shape
    return t.view(B, T, n_heads, -1).transpose(1, 2)  # (B, T, n_heads*w) -> (B, n_heads, T, w)


def _naive_decoupled(layer: _DecoupledLayer, x: torch.Tensor, variant: str = "right") -> torch.Tensor:
    """Causal decoupled-RoPE MLA on the whole sequence, keys and values decoded: (B, T, d_model).

    ``variant`` computes a known mistake instead: ``"scale_head_dim"``, ``"scale_d_c"``,
    ``"no_rope"``, ``"query_shift_-1"`` / ``"query_shift_1"`` / ``"query_at_0"`` (the new query
    rotated at the wrong position).
    """
    B, T, d = x.shape
    h, hd, rd = layer.n_heads, layer.head_dim, layer.rope_dim
    pos = torch.arange(T)
    c = layer.kv_down(x)  # (B, T, d_c)
    k_r = rope(layer.k_rope(x), pos)  # (B, T, rd): one per token, shared by the heads
    q_pos = {"query_shift_-1": pos - 1, "query_shift_1": pos + 1, "query_at_0": pos * 0}.get(variant, pos)
    q_r = rope(_split(layer.q_rope(x), h), q_pos)  # (B, h, T, rd)
    q_c, k_c, v = _split(layer.q_proj(x), h), _split(layer.k_up(c), h), _split(layer.v_up(c), h)
    scores = q_c @ k_c.transpose(-2, -1)
    if variant != "no_rope":
        scores = scores + q_r @ k_r.unsqueeze(1).transpose(-2, -1)  # (B, h, T, T)
    width = {"scale_head_dim": hd, "scale_d_c": layer.kv_latent_dim + rd}.get(variant, hd + rd)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    w = (scores / math.sqrt(width)).masked_fill(future, float("-inf")).softmax(-1)
    return layer.out_proj((w @ v).transpose(1, 2).reshape(B, T, d))


_DECODE_CASES = [  # (B, d_model, n_heads, d_c, rope_dim, T)
    (2, 32, 4, 24, 4, 6),  # d_c = 3 head_dim: a scale by the wrong width shows
    (1, 48, 6, 16, 4, 5),
    (3, 16, 2, 12, 8, 4),
]


def _decode_cost(B: int, T: int, layer: _DecoupledLayer) -> int:
    """FLOPs of decoding the keys of T cached latents (what the absorbed form never does)."""
    return 2 * B * T * layer.kv_latent_dim * layer.n_heads * layer.head_dim


@exercise("07.3")
def check_absorbed_decode_step(absorbed_decode_step) -> None:
    """Check ``absorbed_decode_step(layer, x_new, cache, rope) -> (out, (c, k_r))`` at every position."""
    g = torch.Generator().manual_seed(7073)
    for B, d_model, n_heads, d_c, rope_dim, T in _DECODE_CASES:
        layer = _DecoupledLayer(d_model, n_heads, d_c, rope_dim, g)
        x = torch.randn(B, T, d_model, generator=g)
        with torch.no_grad():
            full = _naive_decoupled(layer, x)  # (B, T, d_model)
            c_all = layer.kv_down(x)  # (B, T, d_c)
            kr_all = rope(layer.k_rope(x), torch.arange(T))  # (B, T, rope_dim)
            wrong = {v: _naive_decoupled(layer, x, v) for v in (
                "scale_head_dim", "scale_d_c", "no_rope", "query_shift_-1", "query_shift_1", "query_at_0")}
        sizes = f"(B={B}, d_model={d_model}, n_heads={n_heads}, d_c={d_c}, rope_dim={rope_dim})"
        for t in range(T):
            case = f"{sizes}, position {t} ({t} tokens cached)"
            cache = (c_all[:, :t].clone(), kr_all[:, :t].clone())
            with torch.no_grad():
                result = absorbed_decode_step(layer, x[:, t : t + 1], cache, rope)
            if result is None:
                raise NotSolved("return (output, (latents, rotary keys)), not None")
            expect(
                isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], tuple)
                and len(result[1]) == 2,
                f"return a pair (output, (latents, rotary keys)); got {type(result).__name__}",
            )
            out, (c_new, kr_new) = result
            expect_close(c_new, c_all[:, : t + 1], f"{case}: the returned latent cache (B, T+1, d_c)")
            expect(
                isinstance(kr_new, torch.Tensor) and tuple(kr_new.shape) == (B, t + 1, rope_dim),
                f"{case}: the returned rotary-key cache should have shape {(B, t + 1, rope_dim)}",
            )
            if not torch.allclose(kr_new, kr_all[:, : t + 1], atol=1e-5, rtol=1e-4):
                raw = layer.k_rope(x[:, t : t + 1])
                expect(
                    t == 0 or not torch.allclose(kr_new[:, t:], raw, atol=1e-5, rtol=1e-4),
                    f"{case}: the new rotary key is cached unrotated; rotate W^KR x at its "
                    f"own position ({t}) once, and cache it rotated",
                )
                raise Wrong(
                    f"{case}: the new rotary key is not R_t W^KR x_t at position t = {t} (the "
                    "number of cached tokens), or the cached ones changed"
                )
            expect(
                isinstance(out, torch.Tensor) and tuple(out.shape) == (B, 1, d_model),
                f"{case}: the output should be a tensor of shape {(B, 1, d_model)}",
            )
            expected = full[:, t : t + 1]
            if torch.allclose(out, expected, atol=1e-5, rtol=1e-4):
                continue
            hints = {
                "scale_head_dim": "you scale by 1/sqrt(head_dim); the score is the dot product of "
                "[q^C; q^R] with [k^C; k^R], head_dim + rope_dim terms: 1/sqrt(head_dim + rope_dim)",
                "scale_d_c": "you scale by 1/sqrt(d_c + rope_dim), the width of the absorbed "
                "vectors; the number is still the naive score: 1/sqrt(head_dim + rope_dim)",
                "no_rope": "the rotary part is missing from the scores: add q^R_h . k^R_s to "
                "the absorbed content score of every head",
                "query_shift_-1": f"the new query is rotated at position {t - 1}; it sits at "
                f"position {t}, the number of tokens already cached",
                "query_shift_1": f"the new query is rotated at position {t + 1}; positions "
                f"count from 0, so with {t} tokens cached it sits at {t}",
                "query_at_0": f"the new query is rotated at position 0; it sits at position {t}, "
                "the number of tokens already cached",
            }
            for variant, hint in hints.items():
                if not torch.allclose(wrong[variant][:, t : t + 1], expected, atol=1e-5, rtol=1e-4):
                    expect(
                        not torch.allclose(out, wrong[variant][:, t : t + 1], atol=1e-5, rtol=1e-4),
                        f"{case}: {hint}",
                    )
            expect_close(out, expected, f"{case}: your output")

    # Cost: one new token over a long cache. Decoding the keys costs 2 B T d_c n_h d_h FLOPs.
    B, d_model, n_heads, d_c, rope_dim, T = 1, 32, 4, 24, 4, 256
    layer = _DecoupledLayer(d_model, n_heads, d_c, rope_dim, g)
    cache = (torch.randn(B, T, d_c, generator=g), torch.randn(B, T, rope_dim, generator=g))
    x_new = torch.randn(B, 1, d_model, generator=g)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        absorbed_decode_step(layer, x_new, cache, rope)
    flops, decoding = counter.get_total_flops(), _decode_cost(B, T, layer)
    expect(
        flops < decoding,
        f"the values are right, but one step over {T} cached tokens did {flops:,} FLOPs of matrix "
        f"products; decoding the cached latents into keys alone costs {decoding:,}. Fold W^UK_h "
        "into the new query and score it against the latents; never compute k_up(cache)",
    )
