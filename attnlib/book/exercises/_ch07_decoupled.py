"""Exercise 07.3 (:mod:`ch07` registers it): chapter 07's rotation, a decoupled-RoPE MLA layer, its naive
computation with the known mistakes it can compute instead, and the check of an absorbed decode step."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from attnlib.book.exercises._core import (
    NotSolved,
    Wrong,
    case_rng,
    exercise,
    expect,
    expect_close,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import run


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
    rotated at the wrong position), ``"no_self"`` (each token attends only to the tokens before it).
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
    future = torch.ones(T, T, dtype=torch.bool).triu(0 if variant == "no_self" else 1)
    w = (scores / math.sqrt(width)).masked_fill(future, float("-inf")).softmax(-1)
    return layer.out_proj((w @ v).transpose(1, 2).reshape(B, T, d))


def _decode_cases(g: torch.Generator) -> list[tuple[int, int, int, int, int, int]]:
    """(B, d_model, n_heads, d_c, rope_dim, T): fixed edges, then fresh sizes (d_c != head_dim)."""
    cases = [
        (2, 32, 4, 24, 4, 6),  # d_c = 3 head_dim: a scale by the wrong width shows
        (1, 48, 6, 16, 4, 5),
        (3, 16, 2, 12, 8, 4),
    ]
    n_heads, head_dim = randint(g, 1, 4), 2 * randint(g, 2, 4)
    cases.append((randint(g, 1, 3), n_heads * head_dim, n_heads, head_dim + randint(g, 2, 12),
                  2 * randint(g, 1, 3), randint(g, 3, 6)))
    return cases


def _decode_cost(B: int, T: int, layer: _DecoupledLayer) -> int:
    """FLOPs of decoding the keys of T cached latents (what the absorbed form never does)."""
    return 2 * B * T * layer.kv_latent_dim * layer.n_heads * layer.head_dim


_HINTS = {
    "scale_head_dim": "you scale by 1/sqrt(head_dim); the score is the dot product of [q^C; q^R] with "
    "[k^C; k^R], head_dim + rope_dim terms: 1/sqrt(head_dim + rope_dim)",
    "scale_d_c": "you scale by 1/sqrt(d_c + rope_dim), the width of the absorbed vectors; the number is still "
    "the naive score: 1/sqrt(head_dim + rope_dim)",
    "no_rope": "the rotary part is missing from the scores: add q^R_h . k^R_s to the absorbed content score "
    "of every head",
    "query_shift_-1": "the new query is rotated at position t - 1; it sits at position t, the number of "
    "tokens already cached",
    "query_shift_1": "the new query is rotated at position t + 1; positions count from 0, so with t tokens "
    "cached it sits at t",
    "query_at_0": "the new query is rotated at position 0; it sits at position t, the number of tokens "
    "already cached",
    "no_self": "the new token does not attend to itself: append its latent and rotary key to the cache "
    "first, then score the query against all t + 1 of them",
}


@exercise("07.3")
def check_absorbed_decode_step(absorbed_decode_step) -> None:
    """Check ``absorbed_decode_step(layer, x_new, cache, rope) -> (out, (c, k_r))`` at every position."""
    g = case_rng()
    for B, d_model, n_heads, d_c, rope_dim, T in _decode_cases(g):
        layer = _DecoupledLayer(d_model, n_heads, d_c, rope_dim, g)
        x = torch.randn(B, T, d_model, generator=g)
        with torch.no_grad():
            full = _naive_decoupled(layer, x)  # (B, T, d_model)
            c_all = layer.kv_down(x)  # (B, T, d_c)
            kr_all = rope(layer.k_rope(x), torch.arange(T))  # (B, T, rope_dim)
            wrong = {v: _naive_decoupled(layer, x, v) for v in _HINTS}
        sizes = f"(B={B}, d_model={d_model}, n_heads={n_heads}, d_c={d_c}, rope_dim={rope_dim})"
        for t in range(T):
            case = f"{sizes}, position t={t} ({t} tokens cached)"
            cache = (c_all[:, :t].clone(), kr_all[:, :t].clone())
            with torch.no_grad():
                result = run(absorbed_decode_step, layer, x[:, t : t + 1], cache, rope,
                             what=f"absorbed_decode_step{case}")
            if result is None:
                raise NotSolved("return (output, (latents, rotary keys)), not None")
            expect(type(result) is tuple and len(result) == 2 and type(result[1]) is tuple and len(result[1]) == 2,
                   f"return a pair (output, (latents, rotary keys)); got {type(result).__name__}")
            out, (c_new, kr_new) = result
            expect_close(c_new, c_all[:, : t + 1], f"{case}: the returned latent cache (B, t+1, d_c)")
            expect_tensor(kr_new, f"{case}: the returned rotary-key cache", shape=(B, t + 1, rope_dim))
            if not torch.allclose(kr_new, kr_all[:, : t + 1], atol=1e-5, rtol=1e-4):
                expect(t == 0 or not torch.allclose(kr_new[:, t:], layer.k_rope(x[:, t : t + 1]), atol=1e-5),
                       f"{case}: the new rotary key is cached unrotated; rotate W^KR x at its own position "
                       f"({t}) once, and cache it rotated")
                raise Wrong(f"{case}: the new rotary key is not R_t W^KR x_t at position t = {t} (the number "
                            "of cached tokens), or the cached ones changed")
            expect_tensor(out, f"{case}: the output", shape=(B, 1, d_model))
            expected = full[:, t : t + 1]
            if torch.allclose(out, expected, atol=1e-5, rtol=1e-4):
                continue
            for variant, hint in _HINTS.items():
                mistake = wrong[variant][:, t : t + 1]
                if not torch.allclose(mistake, expected, atol=1e-5, rtol=1e-4):
                    expect(not torch.allclose(out, mistake, atol=1e-5, rtol=1e-4), f"{case}: {hint}")
            expect_close(out, expected, f"{case}: your output")

    # Cost: one new token over a long cache. Decoding the keys costs 2 B T d_c n_h d_h FLOPs.
    B, d_model, n_heads, d_c, rope_dim, T = 1, 32, 4, 24, 4, 256
    layer = _DecoupledLayer(d_model, n_heads, d_c, rope_dim, g)
    cache = (torch.randn(B, T, d_c, generator=g), torch.randn(B, T, rope_dim, generator=g))
    x_new = torch.randn(B, 1, d_model, generator=g)
    counter = FlopCounterMode(display=False)
    with torch.no_grad():
        run(absorbed_decode_step, layer, x_new, cache, rope, inside=(counter,),
            what=f"absorbed_decode_step over {T} cached tokens")
    flops, decoding = counter.get_total_flops(), _decode_cost(B, T, layer)
    expect(flops < decoding,
           f"the values are right, but one step over {T} cached tokens did {flops:,} FLOPs of matrix "
           f"products; decoding the cached latents into keys alone costs {decoding:,}. Fold W^UK_h "
           "into the new query and score it against the latents; never compute k_up(cache)")
